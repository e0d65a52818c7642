"""``import flash_attn`` resolved to flashtile, without installing anything named flash_attn.

:func:`install` puts modules into ``sys.modules`` under flash-attn's names:

- ``flash_attn``: the seven attention functions and ``__version__``;
- ``flash_attn.flash_attn_interface``: the same functions;
- ``flash_attn.layers`` and ``flash_attn.layers.rotary``: ``apply_rotary_emb``.

Python's import system looks in ``sys.modules`` before it searches the
disk, so afterwards ``import flash_attn``, ``from flash_attn import
flash_attn_func`` and ``from flash_attn.flash_attn_interface import ...``
get flashtile, whether or not a real flash-attn is installed. Other
submodules of flash-attn (``bert_padding``, ``modules``, ``ops``, ...) are
not provided: importing one raises a ModuleNotFoundError saying so. If a
real flash_attn was already imported, :func:`install` refuses (the code
that imported it holds the real functions; replacing the module under it
would mix the two).
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import flashtile

from . import interface, kvcache, rotary

#: The flash-attn release whose Python API these functions follow.
FLASH_ATTN_API = "2.8.3"
#: ``flash_attn.__version__`` under the shim: flash-attn's API version with a
#: PEP 440 local label naming flashtile, so version checks (``>= 2.1``) pass
#: and the label tells what runs.
VERSION = f"{FLASH_ATTN_API}+flashtile.{flashtile.__version__}"

_FUNCTIONS = {
    name: getattr(interface, name)
    for name in (
        "flash_attn_func",
        "flash_attn_kvpacked_func",
        "flash_attn_qkvpacked_func",
        "flash_attn_varlen_func",
        "flash_attn_varlen_kvpacked_func",
        "flash_attn_varlen_qkvpacked_func",
    )
}
_FUNCTIONS["flash_attn_with_kvcache"] = kvcache.flash_attn_with_kvcache
_ROTARY = {
    "apply_rotary_emb": rotary.apply_rotary_emb,
    "apply_rotary_emb_func": rotary.apply_rotary_emb_func,
}


def _module(name: str, doc: str, attributes: dict, package: bool = False) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    module.__dict__.update(attributes)
    module.__spec__ = importlib.machinery.ModuleSpec(
        name, None, origin="flashtile.flash_attn (shim)", is_package=package
    )
    if package:
        module.__path__ = []  # a package: its submodules are the sys.modules entries
    module.__flashtile__ = True
    return module


def _modules() -> dict[str, types.ModuleType]:
    note = "flashtile's stand-in for flash-attn 2 (flashtile.flash_attn.install())."
    interface_module = _module("flash_attn.flash_attn_interface", note, dict(_FUNCTIONS))
    rotary_module = _module("flash_attn.layers.rotary", note, dict(_ROTARY))
    layers = _module("flash_attn.layers", note, {"rotary": rotary_module}, package=True)
    top = _module(
        "flash_attn",
        note,
        dict(_FUNCTIONS, __version__=VERSION, flash_attn_interface=interface_module,
             layers=layers),
        package=True,
    )  # fmt: skip
    return {
        "flash_attn": top,
        "flash_attn.flash_attn_interface": interface_module,
        "flash_attn.layers": layers,
        "flash_attn.layers.rotary": rotary_module,
    }


class _NotProvided:
    """A meta path finder that turns an import of a flash-attn submodule the shim
    does not provide into a ModuleNotFoundError that says so."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if fullname.startswith("flash_attn.") and installed():
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: flashtile's flash_attn shim provides flash_attn, "
                f"flash_attn.flash_attn_interface and flash_attn.layers.rotary only (the "
                f"attention functions and apply_rotary_emb); {fullname} is part of the real "
                f"flash-attn package",
                name=fullname,
            )
        return None


_FINDER = _NotProvided()


def installed() -> bool:
    """Whether ``flash_attn`` in ``sys.modules`` is this shim."""
    return getattr(sys.modules.get("flash_attn"), "__flashtile__", False) is True


def install() -> types.ModuleType:
    """Make ``import flash_attn`` (and its interface and rotary modules) resolve to
    flashtile; returns the ``flash_attn`` module. Idempotent.

    Call it before anything imports flash_attn, e.g. at the top of the
    program: ``import flashtile.flash_attn; flashtile.flash_attn.install()``.

    Raises:
        ImportError: a real ``flash_attn`` (or one of its submodules) is
            already imported.
    """
    if installed():
        return sys.modules["flash_attn"]
    real = [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]
    if real:
        where = getattr(sys.modules[real[0]], "__file__", None) or "unknown location"
        raise ImportError(
            f"a real flash_attn is already imported ({real[0]} from {where}): "
            f"flashtile.flash_attn.install() must run before anything imports flash_attn; "
            f"call it first (at the top of the program), or keep the real package"
        )
    sys.modules.update(_modules())
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    return sys.modules["flash_attn"]


def uninstall() -> None:
    """Remove what :func:`install` added (the shim's ``sys.modules`` entries and its
    finder); a later ``import flash_attn`` searches the disk again."""
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        if getattr(sys.modules[name], "__flashtile__", False) is True:
            del sys.modules[name]
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
