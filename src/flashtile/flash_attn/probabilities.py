"""``S_dmask``: the attention probabilities that ``return_attn_probs=True`` returns.

flash-attn returns them for testing only, dense ``(batch, nheads, seqlen_q,
seqlen_k)``, with the entries that dropout dropped negated. flashtile never
forms ``P`` in its kernels; it is recovered by running the same kernels with
the identity matrix as the values: ``P @ I = P``, through exactly the
forward's masks, softcap, ALiBi and sinks. With dropout the kernels return
``(P * keep / (1 - p)) @ I``, whose zeros mark the dropped entries; the
dropout decisions depend only on ``(seed, offset, b, h, i, j)``
(:mod:`flashtile.dropout`), not on the values, so they are those of the
call being inspected. Columns run in chunks of at most ``width`` (the
Triton kernels take value head dims up to 256). This costs ``O(Tq * Tk)``
memory and a forward per chunk: for tests, as in flash-attn.
"""

from __future__ import annotations

import torch


def identity_columns(run, columns: int, width: int, dropout_p: float, device) -> torch.Tensor:
    """Probabilities ``(..., columns)`` from ``run(c0, c1, dropout)``, which attends
    with the identity's columns ``[c0, c1)`` as values (``dropout`` says whether
    to apply the call's dropout) and returns ``(..., c1 - c0)``; ``columns >= 1``.

    Every dropout run starts from the generator state the call was made with
    (``torch.random.fork_rng``), so it draws the call's seed; run this before
    the call itself.
    """
    devices = [device] if device.type == "cuda" else []
    kept, dropped = [], []
    with torch.no_grad():
        for c0 in range(0, columns, width):
            c1 = min(columns, c0 + width)
            kept.append(run(c0, c1, False))
            if dropout_p > 0:
                with torch.random.fork_rng(devices=devices):
                    dropped.append(run(c0, c1, True))
        p = torch.cat(kept, -1)
        if dropout_p == 0:
            return p
        survived = torch.cat(dropped, -1) != 0
        return torch.where(survived | (p == 0), p, -p)


def identity_values(keys: int, lead: tuple[int, ...], c0: int, c1: int, like) -> torch.Tensor:
    """Columns ``[c0, c1)`` of the ``keys x keys`` identity, as values ``lead + (keys, c1 - c0)``
    (contiguous, dtype and device of ``like``)."""
    eye = torch.eye(keys, dtype=like.dtype, device=like.device)[:, c0:c1]
    return eye.expand(*lead, keys, c1 - c0).contiguous()
