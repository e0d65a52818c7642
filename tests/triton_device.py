"""Where the test_triton_* files run the kernels, and the modules they need.

Without a GPU the kernels run in Triton's interpreter on CPU tensors:
``conftest.py`` sets ``TRITON_INTERPRET=1`` (unless it is set) before any test
module loads, because ``triton.jit`` reads it when it decorates the kernels.
With ``TRITON_INTERPRET=0`` on a machine with a GPU the same tests run the
compiled kernels on CUDA tensors. Importing this skips the importing test
module when torch or triton is missing, or when a GPU run finds no device.

Under the interpreter a launch's keyword arguments are checked against the
kernel's parameters: the interpreter drops the ones a kernel lacks, where a
compiled launch raises ``KeyError`` (a decode launch once passed the
forward's ``DROPOUT`` switch, and only the GPU noticed).
"""

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

import flashtile.triton as ft  # noqa: E402

#: The device of the test tensors.
DEVICE = "cpu" if ft.INTERPRET else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)

if ft.INTERPRET:
    import inspect

    from triton.runtime.interpreter import GridExecutor

    #: Launch options, not kernel parameters (``triton.Config``'s and the
    #: CUDA backend's).
    _OPTIONS = {"num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion"}
    _interpreted_call = GridExecutor.__call__

    def _strict_call(self, *args, **kwargs):
        unknown = set(kwargs) - set(inspect.signature(self.fn).parameters) - _OPTIONS
        assert not unknown, f"{self.fn.__name__} has no parameters {sorted(unknown)}"
        return _interpreted_call(self, *args, **kwargs)

    GridExecutor.__call__ = _strict_call

__all__ = ["DEVICE", "ft", "torch", "triton"]
