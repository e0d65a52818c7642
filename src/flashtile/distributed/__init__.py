"""flashtile.distributed: attention over a sequence split across processes and machines.

Context parallelism on ``torch.distributed`` (gloo with CPU tensors, running
flashtile's CPU kernels; NCCL with CUDA tensors, running its Triton kernels),
launched with torchrun. Every rank holds a shard of the sequence (:func:`shard_sequence`,
layouts ``"zigzag"`` and ``"contiguous"``) and gets its shard of the exact
result of one-process :func:`flashtile.attention` on the whole sequence:

* :func:`ring_attention`: K/V shards travel round a ring of ranks; partial
  results merge with :func:`flashtile.merge_states`. Any head count.
* :func:`ulysses_attention`: all-to-all from token shards to head shards,
  local attention over the whole sequence, all-to-all back. Heads must divide
  by the world size; supports ALiBi.
* :func:`context_parallel_decode`: decoding against a KV cache split across
  ranks, merged with one all-gather per step.
* :func:`gather_sequence`, :func:`sequence_positions`: the whole sequence
  back on every rank; each local token's true position (for rotary or
  learned position embeddings).
* :func:`set_num_threads`: kernel threads per process (default: the node's
  cores over its processes; see :mod:`flashtile.distributed.threads`).

Importing this module needs PyTorch; see docs/distributed.md for launching.
"""

try:
    import torch.distributed as _dist  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError(
        "flashtile.distributed needs PyTorch: pip install 'flashtile[torch]' (the CPU wheel)"
    ) from exc

from .decode import context_parallel_decode
from .layout import LAYOUTS, gather_sequence, sequence_positions, shard_sequence
from .ring import ring_attention
from .threads import set_num_threads
from .ulysses import ulysses_attention

__all__ = [
    "LAYOUTS",
    "context_parallel_decode",
    "gather_sequence",
    "ring_attention",
    "sequence_positions",
    "set_num_threads",
    "shard_sequence",
    "ulysses_attention",
]
