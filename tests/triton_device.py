"""Where the test_triton_* files run the kernels, and the modules they need.

Without a GPU the kernels run in Triton's interpreter on CPU tensors:
``conftest.py`` sets ``TRITON_INTERPRET=1`` (unless it is set) before any test
module loads, because ``triton.jit`` reads it when it decorates the kernels.
With ``TRITON_INTERPRET=0`` on a machine with a GPU the same tests run the
compiled kernels on CUDA tensors. Importing this skips the importing test
module when torch or triton is missing, or when a GPU run finds no device.
"""

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

import flashtile.triton as ft  # noqa: E402

#: The device of the test tensors.
DEVICE = "cpu" if ft.INTERPRET else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)

__all__ = ["DEVICE", "ft", "torch", "triton"]
