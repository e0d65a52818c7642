"""``KVCache``: keys and values of a batch of sequences, grown in place.

A small, explicit cache for serving loops and tests: contiguous or paged,
float32, float64, float16 or bfloat16 storage, per-sequence lengths, and :meth:`KVCache.attend`
to run :func:`flashtile.decode_attention` on itself. The arrays are public
(``k``, ``v``, ``block_table``, ``lengths``) so they can be passed to
``decode_attention`` directly or inspected.

Paged storage is a shared pool of pages handed out on demand as sequences
grow (lowest free page first) and returned by :meth:`KVCache.reset`; a
sequence's ``block_table`` row lists its pages in order, -1 beyond them.
"""

from __future__ import annotations

import math
import numbers
import os

import ml_dtypes
import numpy as np

from ._validate import BFLOAT16, as_numpy, is_float
from .decode import decode_attention

#: Storage dtypes; the 16-bit ones are read as such by the decode kernel
#: (half the bytes per step) and computed in float32 (a bf16 cache with bf16
#: queries: bf16 products with float32 sums, docs/decoding.md).
STORAGE_DTYPES = (np.dtype(np.float16), BFLOAT16, np.dtype(np.float32), np.dtype(np.float64))


def _positive(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _check_fits(batch, shape, dims, table_entries, pool, dtype: np.dtype) -> None:
    """Refuse a cache larger than this machine's memory, before allocating any of it.

    Counts K and V, the lengths, the block table and the free-page list
    (about 40 bytes a page as a Python list). Past the memory NumPy fails
    with a message that names no argument, or allocates lazily and the
    first appends swap.
    """
    need = math.prod(shape) * sum(dims) * dtype.itemsize + 8 * (batch + table_entries) + 40 * pool
    if need > _physical_memory():
        raise ValueError(
            f"a KVCache of batch={batch}, {shape[1]} kv_heads, dims {dims} and shape "
            f"{shape} ({dtype}) needs {need / 2**30:.3g} GiB, more than this machine's "
            f"memory: lower batch, kv_heads, capacity or head_dim, or use a paged cache "
            f"(page_size, num_pages) or 16-bit storage (float16, ml_dtypes.bfloat16)"
        )


def _physical_memory() -> int:
    """Bytes of RAM (the largest NumPy size where the OS cannot tell)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not POSIX: NumPy decides
        return np.iinfo(np.intp).max


class KVCache:
    """Keys and values of ``batch`` sequences, up to ``capacity`` tokens each.

    Args:
        batch, kv_heads, head_dim: the cache's ``B``, ``Hkv`` and ``d``.
        capacity: the most tokens one sequence may hold.
        value_dim: ``dv`` (default ``head_dim``).
        dtype: storage, ``np.float32`` (default), ``np.float16`` or
            ``ml_dtypes.bfloat16`` (half the memory and the bytes read per
            step; computed in float32, or in bf16 products for bf16
            queries) or ``np.float64``.
        page_size: None for a contiguous ``(B, Hkv, capacity, d)`` cache, or
            the tokens per page of a paged ``(num_pages, Hkv, page_size, d)``
            pool with a ``block_table (B, ceil(capacity / page_size))``.
        num_pages: pages in the pool (default: enough for every sequence
            at full capacity; fewer saves memory when sequences vary).

    Sizes whose arrays would not fit this machine's memory raise a
    ``ValueError`` naming them, before anything is allocated.
    """

    def __init__(
        self,
        batch,
        kv_heads,
        head_dim,
        capacity,
        *,
        value_dim=None,
        dtype=np.float32,
        page_size=None,
        num_pages=None,
    ):
        batch = _positive(batch, "batch")
        kv_heads = _positive(kv_heads, "kv_heads")
        head_dim = _positive(head_dim, "head_dim")
        capacity = _positive(capacity, "capacity")
        value_dim = head_dim if value_dim is None else _positive(value_dim, "value_dim")
        self.dtype = np.dtype(dtype)
        if self.dtype not in STORAGE_DTYPES:
            raise TypeError(
                f"dtype must be float16, ml_dtypes.bfloat16, float32 or float64, got {self.dtype}"
            )
        self.capacity = capacity
        if page_size is None:
            if num_pages is not None:
                raise ValueError("num_pages needs page_size (it sizes a paged pool)")
            self.page_size = None
            shape, per_seq, pool = (batch, kv_heads, capacity), 0, 0
        else:
            self.page_size = _positive(page_size, "page_size")
            per_seq = -(-capacity // self.page_size)
            pool = batch * per_seq if num_pages is None else _positive(num_pages, "num_pages")
            shape = (pool, kv_heads, self.page_size)
        _check_fits(batch, shape, (head_dim, value_dim), batch * per_seq, pool, self.dtype)
        self.lengths = np.zeros(batch, dtype=np.int64)
        self.block_table = None
        if self.paged:
            self.block_table = np.full((batch, per_seq), -1, dtype=np.int64)
            self._free = list(range(pool - 1, -1, -1))  # a stack: lowest page on top
        self.k = np.zeros((*shape, head_dim), dtype=self.dtype)
        self.v = np.zeros((*shape, value_dim), dtype=self.dtype)

    @property
    def paged(self) -> bool:
        return self.page_size is not None

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def _rows(self, batch_index) -> np.ndarray:
        if batch_index is None:
            return np.arange(self.batch)
        rows = np.atleast_1d(np.asarray(batch_index))
        if rows.dtype.kind not in "iu" or rows.ndim != 1:
            raise TypeError(f"batch_index must be an int or 1-D ints, got {batch_index!r}")
        if rows.size and (rows.min() < 0 or rows.max() >= self.batch):
            raise ValueError(f"batch_index {rows.tolist()} outside [0, {self.batch})")
        if len(np.unique(rows)) != len(rows):
            raise ValueError(f"batch_index {rows.tolist()} repeats a sequence")
        return rows.astype(np.int64)

    def append(self, k, v, *, batch_index=None):
        """Append ``k (n, Hkv, T, d)``, ``v (n, Hkv, T, dv)`` to ``n`` sequences.

        ``batch_index`` picks the ``n`` sequences (default: all ``B``, in
        order). Values are cast to the storage dtype; finite values beyond
        its range (float16's or bfloat16's, or float32's for float64 input) are refused
        rather than stored as inf (NaN and inf are stored as given: attention
        then returns NaN for the queries that see them). If any sequence would
        pass its capacity, or the page pool would run dry, nothing is written
        and a ``ValueError`` says by how much.
        """
        rows = self._rows(batch_index)
        k, v = as_numpy(k), as_numpy(v)
        _, hkv, _, d = self.k.shape
        dv = self.v.shape[3]
        if k.ndim != 4 or k.shape[0] != len(rows) or k.shape[1] != hkv or k.shape[3] != d:
            raise ValueError(f"k has shape {k.shape}; expected ({len(rows)}, {hkv}, T, {d})")
        if v.shape != k.shape[:3] + (dv,):
            raise ValueError(f"v has shape {v.shape}; expected {k.shape[:3] + (dv,)}")
        if not (is_float(k.dtype) and is_float(v.dtype)):
            raise TypeError(f"k and v must be floating point, got {k.dtype} and {v.dtype}")
        for name, a in (("k", k), ("v", v)):
            if ml_dtypes.finfo(a.dtype).max <= ml_dtypes.finfo(self.dtype).max:
                continue  # the cast cannot overflow (bf16 into float16 can: 3.4e38 > 65504)
            with np.errstate(over="ignore"):
                over = np.isfinite(a) & np.isinf(a.astype(self.dtype))
            if over.any():
                wider = "float32" if self.dtype.itemsize == 2 else "float64"
                top = float(ml_dtypes.finfo(self.dtype).max)
                raise ValueError(
                    f"{name} holds {np.abs(a[over]).max():.6g}, beyond {self.dtype}'s range "
                    f"(+-{top:.6g}): it would be stored as inf and "
                    f"poison attention; nothing was written. Use {wider} storage "
                    f"(dtype=np.{wider})"
                )
        t = k.shape[2]
        new = self.lengths[rows] + t
        if new.max(initial=0) > self.capacity:
            b = rows[np.argmax(new)]
            raise ValueError(
                f"appending {t} tokens to sequence {b} (holding {self.lengths[b]}) would pass "
                f"the capacity of {self.capacity}: nothing was written; reset() it or make "
                f"a larger cache"
            )
        if self.paged:
            need = int((-(-new // self.page_size) - -(-self.lengths[rows] // self.page_size)).sum())
            if need > len(self._free):
                raise ValueError(
                    f"appending {t} tokens needs {need} new pages but {len(self._free)} "
                    f"are free: nothing was written; reset() finished sequences or make a "
                    f"larger pool (num_pages)"
                )
        for n, b in enumerate(rows.tolist()):
            self._write(b, k[n], v[n])

    def _write(self, b: int, k, v):
        """Write ``(Hkv, T, d)`` rows after sequence ``b``'s last token."""
        start, t = int(self.lengths[b]), k.shape[1]
        if not self.paged:
            self.k[b, :, start : start + t] = k
            self.v[b, :, start : start + t] = v
        else:
            j = start
            while j < start + t:
                p, off = divmod(j, self.page_size)
                if self.block_table[b, p] < 0:
                    self.block_table[b, p] = self._free.pop()
                run = min(self.page_size - off, start + t - j)
                page = self.block_table[b, p]
                self.k[page, :, off : off + run] = k[:, j - start : j - start + run]
                self.v[page, :, off : off + run] = v[:, j - start : j - start + run]
                j += run
        self.lengths[b] = start + t

    def reset(self, batch_index=None):
        """Empty the chosen sequences (default: all); their pages return to the pool."""
        rows = self._rows(batch_index)
        if self.paged:
            for b in rows.tolist():
                pages = self.block_table[b]
                self._free.extend(sorted(pages[pages >= 0].tolist(), reverse=True))
                pages[:] = -1
            self._free.sort(reverse=True)
        self.lengths[rows] = 0

    def attend(self, q, **kwargs):
        """:func:`flashtile.decode_attention` of ``q (B, Hq, Tq, d)`` against the cache.

        The last ``Tq`` tokens of each sequence are the queries' own
        positions (append their keys first). ``kwargs`` as in
        ``decode_attention`` (``causal``, ``window``, ``num_splits``, ...).
        """
        return decode_attention(
            q,
            self.k,
            self.v,
            cache_seqlens=self.lengths,
            block_table=self.block_table,
            **kwargs,
        )

    def __repr__(self) -> str:
        kind = f"paged({self.page_size})" if self.paged else "contiguous"
        return (
            f"KVCache({kind}, B={self.batch}, Hkv={self.k.shape[1]}, d={self.k.shape[3]}, "
            f"capacity={self.capacity}, dtype={self.dtype}, lengths={self.lengths.tolist()})"
        )
