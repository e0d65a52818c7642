"""flashtile.triton.decode_attention (split-KV, contiguous and paged caches) against
flashtile.reference.decode_attention, in float64.

Runs in Triton's interpreter on CPU tensors unless ``TRITON_INTERPRET=0`` is
set on a machine with a GPU (see tests/test_triton_attention.py).
"""

import numpy as np
import pytest

# First: sets the device, skips this module without torch or triton.
from triton_device import DEVICE, ft, torch

# isort: split
import flashtile
from dense import rel_err
from flashtile.reference import decode_attention as reference_decode


def f64(t):
    return t.detach().cpu().double().numpy()


def paged_cache(seqlens, page, heads, d, dv, gen, dtype=torch.float32):
    """A shuffled page pool and its block table; unused table entries are -1."""
    pages_per_seq = [-(-n // page) for n in seqlens]
    pool = sum(pages_per_seq) + 2  # two pages nobody uses
    order = torch.randperm(pool, generator=gen)
    table = torch.full((len(seqlens), max(pages_per_seq) + 1), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_seq):
        table[b, :n] = order[used : used + n]
        used += n
    k = torch.randn(pool, heads, page, d, generator=gen).to(dtype)
    v = torch.randn(pool, heads, page, dv, generator=gen).to(dtype)
    return k, v, table


def check(q, k, v, seqlens, table=None, splits=(None,), **kw):
    ref, ref_lse = reference_decode(
        f64(q), f64(k), f64(v), cache_seqlens=np.asarray(seqlens),
        block_table=None if table is None else table.numpy(), return_lse=True,
        **{key: (f64(x) if isinstance(x, torch.Tensor) else x) for key, x in kw.items()},
    )  # fmt: skip
    outs = []
    for num_splits in splits:
        out, lse = ft.decode_attention(
            q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cache_seqlens=seqlens, block_table=table,
            num_splits=num_splits, return_lse=True, **kw,
        )  # fmt: skip
        assert out.dtype == q.dtype and lse.dtype == torch.float32
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        assert rel_err(f64(out), ref) < 1e-6, f"num_splits={num_splits}"
        assert np.array_equal(np.isneginf(f64(lse)), np.isneginf(ref_lse))
        finite = np.isfinite(ref_lse)
        np.testing.assert_allclose(f64(lse)[finite], ref_lse[finite], rtol=2e-6, atol=2e-5)
        outs.append(out)
    return outs


def test_contiguous_cache_any_split_count():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 1, 24, generator=gen)
    k, v = torch.randn(3, 2, 40, 24, generator=gen), torch.randn(3, 2, 40, 40, generator=gen)
    # an empty sequence, a short one, one across many key tiles
    outs = check(q, k, v, [0, 5, 33], splits=(1, 3, None))
    assert torch.all(outs[0][0] == 0)


def test_paged_cache_speculative_queries_with_variants():
    gen = torch.Generator().manual_seed(1)
    seqlens = [13, 0, 40, 2]
    k, v, table = paged_cache(seqlens, 7, 2, 16, 16, gen)
    q = torch.randn(4, 4, 3, 16, generator=gen)
    slopes = torch.rand(4, generator=gen) + 0.1
    check(q, k, v, seqlens, table, splits=(2,), alibi_slopes=slopes, window=(10, None))
    check(q, k, v, seqlens, table, splits=(1,), causal=False, softcap=3.0, scale=0.2)


def test_many_query_rows_per_kv_head_span_row_blocks():
    # 8 query heads on 1 kv head with 9 queries each: 72 rows, two row tiles.
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 8, 9, 8, generator=gen)
    k, v = torch.randn(1, 1, 20, 8, generator=gen), torch.randn(1, 1, 20, 8, generator=gen)
    check(q, k, v, [17], splits=(2,))


def dense_lowp(q, k, v, seqlen, **kw):
    """One sequence's decoding computed densely in the inputs' dtype (the baseline)."""
    tq, group = q.shape[-2], q.shape[-3] // k.shape[-3]
    k, v = (t[:, :seqlen].repeat_interleave(group, dim=0) for t in (k, v))
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if kw.get("softcap"):
        s = kw["softcap"] * torch.tanh(s / kw["softcap"])
    pos = torch.arange(tq) + seqlen - tq
    s = s.masked_fill(torch.arange(seqlen)[None, :] > pos[:, None], float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0) @ v


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_within_twice_the_error_of_torch_in_that_precision(dtype):
    gen = torch.Generator().manual_seed(3)
    seqlens = [30, 9]
    q = torch.randn(2, 4, 2, 32, generator=gen).to(dtype)
    k, v, table = paged_cache(seqlens, 16, 2, 32, 32, gen, dtype)
    out = ft.decode_attention(
        q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cache_seqlens=seqlens, block_table=table,
        num_splits=2, softcap=4.0,
    )  # fmt: skip
    ref = reference_decode(
        f64(q), f64(k), f64(v), cache_seqlens=np.asarray(seqlens), block_table=table.numpy(),
        softcap=4.0,
    )  # fmt: skip
    for b, n in enumerate(seqlens):
        pages = table[b, : -(-n // 16)].long()
        kb, vb = (c[pages].transpose(0, 1).reshape(2, -1, 32) for c in (k, v))
        base = dense_lowp(q[b], kb, vb, n, softcap=4.0)
        assert rel_err(f64(out[b]), ref[b]) <= 2 * rel_err(f64(base), ref[b])


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"cache_seqlens": [41, 1]}, r"\[0, 40\]"),
        ({"num_splits": 0}, "num_splits"),
        ({"block_table": [[0], [5]], "cache_seqlens": [3, 3]}, r"block_table\[1, 0\] = 5"),
        ({"alibi_slopes": [0.5]}, "one slope per query head"),
    ],
)
def test_bad_decode_input_is_refused_with_the_fix(kw, match):
    q = torch.zeros(2, 4, 1, 8, device=DEVICE)
    k = torch.zeros(2, 2, 40, 8, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        ft.decode_attention(q, k, k, **kw)


def test_cache_dtype_must_match_the_queries():
    q = torch.zeros(1, 2, 1, 8, device=DEVICE)
    k = torch.zeros(1, 2, 4, 8, dtype=torch.float16, device=DEVICE)
    with pytest.raises(TypeError, match="cast q"):
        ft.decode_attention(q, k, k)


@pytest.mark.parametrize(
    ("shapes", "table", "lengths"),
    [
        (((2, 4, 1, 8), (3, 2, 40, 8)), None, None),  # a contiguous cache of 3 rows for B = 2
        (((2, 3, 1, 8), (2, 2, 40, 8)), None, None),  # Hkv does not divide Hq
        (((2, 4, 1, 8), (2, 2, 40, 4)), None, None),  # head dims differ
        (((2, 4, 1, 8), (4, 2, 20, 8)), [[0, 1]], None),  # one table row for B = 2
        (((2, 4, 1, 8), (4, 2, 20, 8)), [[0, 1], [2, 7]], [40, 30]),  # page 7 of 4
        (((2, 4, 1, 8), (4, 2, 20, 8)), [[0, 1], [2, -1]], None),  # full rows without lengths
    ],
)
def test_both_backends_refuse_a_bad_cache_with_one_message(shapes, table, lengths):
    """The cache rule is written once (flashtile.kvlayout): the CPU's decode_attention and
    the Triton kernels' refuse the same cache with the same words."""
    (qs, ks), errors = shapes, []
    for xp in (np, torch):
        q, k = (xp.zeros(s, dtype=xp.float32) for s in (qs, ks))
        if xp is torch:
            q, k = q.to(DEVICE), k.to(DEVICE)
        call = flashtile.decode_attention if xp is np else ft.decode_attention
        table_in = None if table is None else (np if xp is np else torch).asarray(table)
        with pytest.raises(ValueError) as info:
            call(q, k, k, block_table=table_in, cache_seqlens=lengths)
        errors.append(str(info.value))
    assert errors[0] == errors[1]


def test_an_empty_batch_decodes_to_empty_results():
    """B = 0 or Hq = 0: empty results, as the forward gives (the CPU's decoding refuses)."""
    for qs, ks in (((0, 4, 1, 8), (0, 2, 12, 8)), ((1, 0, 1, 8), (1, 2, 12, 8))):
        q, k = torch.zeros(qs, device=DEVICE), torch.zeros(ks, device=DEVICE)
        out, lse = ft.decode_attention(q, k, k, return_lse=True)
        assert out.shape == qs and lse.shape == qs[:3]
