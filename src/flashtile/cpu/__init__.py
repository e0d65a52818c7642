"""Compiled CPU kernels (Numba). Import-time cheap: kernels compile on first
use and are cached on disk next to their modules (``cache=True``)."""
