"""Traced mods found again by what they are, in this process or another.

Tracing a pair of mods (``make_fx``, then ``torch.func`` for the
derivative) takes about 1.5 s in a fresh process and 50 ms after. A model
that defines its ``mask_mod`` anew on every step (a closure over the batch's
document ids) would pay that on every step, and every new process would pay
the first. The trace depends only on the mods' code, the numbers they read,
and the layout of the tensors they capture, never on those tensors' values
(the kernels read them at each call; a trace that read one into Python,
``w.item()``, is not stored: :class:`ValueReads`). So the trace is stored
under a digest of exactly that (:func:`flashtile.mod_snapshot.fingerprint`),
in memory and in ``$FLASHTILE_CACHE_DIR/traces``, each table named by its
place among the captured tensors, and bound to the new mods' own tensors
when found. What the digest cannot see (an object it cannot describe, a
bound method, code nested past the walk's depth) leaves the mods untraced
by it: traced on each new closure, as without this cache.

A missing, unreadable or corrupt entry is traced again; nothing here makes a
call fail.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..mod_snapshot import fingerprint
from ..route_cache import cache_dir
from .fx_translate import Table

#: A constant a mod makes itself (``torch.tensor(7)``) is stored with the
#: trace up to this many elements; a mod with a larger one is traced anew.
CONSTANT_LIMIT = 4096
#: Entries kept in memory (each a few kilobytes of source).
MEMORY_ENTRIES = 256

_MEMORY: dict[str, dict] = {}


class ValueReads(TorchDispatchMode):
    """While tracing, notes whether a tensor's value was read into Python
    (``w.item()``, ``float(w)``): ``make_fx`` lets that happen to a captured
    tensor and bakes the number into the graph, so such a trace depends on
    the tensor's values and is not stored (:attr:`seen`)."""

    def __init__(self):
        super().__init__()
        self.seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.seen = True
        return func(*args, **(kwargs or {}))


def describe(value) -> str | None:
    """A captured value as the trace depends on it: a tensor by its layout
    (shape, dtype, whether it takes a gradient, device), a dtype or device
    by name; None for anything else (the mods are then not stored)."""
    if isinstance(value, torch.Tensor):
        grad = value.requires_grad
        return f"tensor {tuple(value.shape)} {value.dtype} grad={grad} {value.device}"
    if isinstance(value, torch.dtype | torch.device):
        return str(value)
    return None


def trace_key(mods, context) -> tuple[str, list] | None:
    """``(key, leaves)`` of a pair of mods traced in ``context`` (the block
    map, dialect and device: a tuple of reprs), or None when what they
    capture cannot be described. ``leaves``: the captured values in order."""
    found = fingerprint(mods, describe)
    if found is None:
        return None
    digest, leaves = found
    text = "\n".join([digest, *map(repr, context), torch.__version__, _sources_digest()])
    return hashlib.sha256(text.encode()).hexdigest()[:32], leaves


def load(key: str, leaves, device) -> dict | None:
    """The stored trace's fields (``TracedMods``'), its tables bound to
    ``leaves``, or None."""
    entry = _MEMORY.get(key)
    if entry is None:
        try:
            entry = json.loads(_path(key).read_text())
        except (OSError, ValueError):
            return None
    try:
        tables = [_table(ref, leaves, device) for ref in entry["tables"]]
        fields = {name: _tuples(v) for name, v in entry["fields"].items()}
    except (AttributeError, KeyError, IndexError, TypeError, ValueError, RuntimeError):
        return None  # (a corrupt entry: traced again, and stored over)
    _remember(key, entry)
    return dict(fields, tables=tables)


def store(key: str, leaves, fields: dict, tables) -> None:
    """Keep a trace (``fields`` without its tables; ``tables`` as
    :class:`Table`) unless a table is neither a leaf nor a small constant."""
    refs = []
    for t in tables:
        ref = _reference(t, leaves)
        if ref is None:
            return
        refs.append(ref)
    entry = {"fields": fields, "tables": refs}
    _remember(key, entry)
    path = _path(key)
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    try:  # (a read-only cache: kept in memory only)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(entry))
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)


def _reference(t: Table, leaves) -> dict | None:
    """How a table is found again: the leaf it is, or the values of a
    constant the mod's code made (None for a captured tensor the walk did not
    reach: its values would be stale in another mod)."""
    for n, leaf in enumerate(leaves):
        if leaf is t.tensor:
            return {"kind": t.kind, "offset": t.offset, "leaf": n}
    if not t.made or t.tensor.numel() > CONSTANT_LIMIT:
        return None
    values = t.tensor.detach().cpu().reshape(-1).tolist()
    dtype = str(t.tensor.dtype).removeprefix("torch.")
    return {"kind": t.kind, "offset": t.offset, "dtype": dtype, "shape": list(t.tensor.shape),
            "values": values}  # fmt: skip


def _table(ref: dict, leaves, device) -> Table:
    if "leaf" in ref:
        tensor = leaves[ref["leaf"]]
        if not isinstance(tensor, torch.Tensor):
            raise TypeError("a table's leaf is not a tensor")
    else:
        dtype = getattr(torch, ref["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"not a dtype: {ref['dtype']}")
        tensor = torch.tensor(ref["values"], dtype=dtype).reshape(ref["shape"]).to(device)
    return Table(tensor, ref["kind"], int(ref["offset"]), made="leaf" not in ref)


def _tuples(value):
    """JSON's lists back as the tuples they were."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _remember(key: str, entry: dict) -> None:
    if key not in _MEMORY and len(_MEMORY) >= MEMORY_ENTRIES:
        _MEMORY.pop(next(iter(_MEMORY)))
    _MEMORY[key] = entry


def _path(key: str) -> Path:
    return cache_dir() / "traces" / f"{key}.json"


@functools.cache
def _sources_digest() -> str:
    """A digest of the sources that turn mods into generated code: a change
    to any of them makes every stored trace another key."""
    here = Path(__file__).resolve().parent
    files = [
        here / "fx_translate.py", here / "flex_trace.py", here / "trace_cache.py",
        here.parent / "mod_snapshot.py", here.parent / "mods.py",
        here.parent / "triton" / "mod_source.py",
    ]  # fmt: skip
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:16]
