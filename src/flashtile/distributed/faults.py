"""A failure on one rank surfaces on every rank, promptly, with its reason.

A rank that raises while its peers wait for its messages would leave them
blocked until the process group's timeout (30 minutes by default). Each
distributed call runs in two stages:

1. **Checks, agreed** (:func:`agree`): every check that can refuse the call
   runs on every rank, and one ``all_reduce`` of a flag combines the
   verdicts before the first message. If any rank refuses, every rank
   raises: the refusing ranks their own error, the others a ``ValueError``
   naming the first refusing rank and its message. No message is in flight,
   so the group stays usable.
2. **Work, guarded** (:func:`guarded`): an exception after the first message
   (a kernel's error, out of memory, an interrupt) is written to the group's
   store, and the failing rank then closes its connections to every peer of
   the group (a receive that times out at once: gloo closes the pair). A
   peer waiting for one of its messages gets gloo's "connection closed" at
   once, and :func:`wait` turns it into :class:`PeerFailure` naming the
   failed rank and its error; that peer's own guard closes its connections
   in turn, so the failure reaches every rank within a few hops' time. A
   rank whose process dies closes its connections too (measured: its peers
   raise within 0.02 s on one machine). Either way the group cannot be used
   again: later calls on it raise :class:`PeerFailure`. Restart the
   processes (torchrun's restarts do), or go on with a new group
   (``torch.distributed.new_group``).

While calls succeed this costs one ``all_reduce`` and one look at the store
per call (0.9 ms on gloo, 2 local processes; docs/reliability.md); the waits
are the plain ones. It applies to CPU tensors (gloo). CUDA calls
(NCCL) rely on NCCL's own error handling (``TORCH_NCCL_ASYNC_ERROR_HANDLING``).
"""

from __future__ import annotations

import contextlib
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

#: The store key a failed rank writes (the group's store is its own: a
#: ``PrefixStore`` per group).
FAULT_KEY = "flashtile/fault"
#: The tag of the receives that close a failed rank's connections (never sent).
_CLOSING_TAG = 0x7A11


class PeerFailure(RuntimeError):
    """Another rank of the group failed during a call (its reason in the message)."""


#: group name -> (a weak reference to the group object last seen under it,
#: its generation): a group destroyed and made again gets the same name (and
#: store prefix), so its fault key carries a generation, the same on every
#: rank (every rank meets the same sequence of groups). Weak: a destroyed
#: group must be freed (its connections go with it).
_GENERATIONS: dict = {}


def _key(group) -> str:
    name = group.group_name
    seen, generation = _GENERATIONS.get(name, (lambda: None, -1))
    if seen() is not group:
        generation += 1
        _GENERATIONS[name] = (weakref.ref(group), generation)
    return f"{FAULT_KEY}/{generation}"


def _group(group):
    return group if group is not None else c10d._get_default_group()


def _store(group):
    return c10d._get_process_group_store(_group(group))


def _reason(group) -> str | None:
    """What a failed rank of ``group`` posted, or None."""
    with contextlib.suppress(Exception):  # (the store may be gone with the job)
        store, key = _store(group), _key(_group(group))
        if store.check([key]):
            return store.get(key).decode(errors="replace")
    return None


def _failure(reason: str) -> PeerFailure:
    return PeerFailure(
        f"flashtile.distributed: {reason}; this rank stops too. The process group cannot be "
        f"used again: restart the processes, or go on with a new group"
    )


def raise_if_failed(group) -> None:
    """Raise :class:`PeerFailure` if a rank of ``group`` posted a failure."""
    reason = _reason(group)
    if reason is not None:
        raise _failure(reason)


def _close(ring) -> None:
    """Close this rank's connections to every peer of ``ring``'s group: a
    receive that times out makes gloo close the pair, which fails the
    peer's pending messages with it at once."""
    group = ring.group if ring.group is not None else c10d._get_default_group()
    me = dist.get_rank()
    for peer in dist.get_process_group_ranks(group):
        if peer == me:
            continue
        with contextlib.suppress(Exception):  # (an already closed pair raises at once)
            work = dist.irecv(torch.empty(1), peer, group=ring.group, tag=_CLOSING_TAG)
            work.wait(timedelta(milliseconds=1))


@contextlib.contextmanager
def guarded(ring, what: str):
    """Run the communicating part of a call: an exception raised inside is
    posted for the other ranks of ``ring`` (:class:`~.comm.Ring`; CPU
    tensors) and this rank's connections closed, then it is re-raised."""
    if ring is None or ring.size == 1 or not ring.polls:
        yield
        return
    try:
        yield
    except BaseException as exc:
        if not isinstance(exc, PeerFailure) and _reason(ring.group) is None:
            reason = f"{_who(ring)} failed in {what} ({type(exc).__name__}: {str(exc)[:400]})"
            with contextlib.suppress(Exception):
                _store(ring.group).set(_key(_group(ring.group)), reason)
        _close(ring)
        raise


def _who(ring) -> str:
    """This rank as its peers read it: its rank in the group (and the global one)."""
    mine = f"rank {ring.rank} of the group"
    if ring.group is not None and dist.get_rank() != ring.rank:
        mine += f" (global rank {dist.get_rank()})"
    return mine


@contextlib.contextmanager
def messages(ring):
    """Post or wait for messages of ``ring``'s group: gloo's error for a peer
    that failed or went away (its connection closed) becomes
    :class:`PeerFailure`, with the peer's reason where it posted one."""
    try:
        yield
    except RuntimeError as exc:
        if ring is None or not ring.polls or isinstance(exc, PeerFailure):
            raise
        reason = _reason(ring.group)
        if reason is None and "Timed out" in str(exc):
            reason = f"a peer rank did not answer within the group's timeout ({str(exc)[:300]})"
        raise _failure(reason or f"a peer rank went away ({str(exc)[:300]})") from exc


def wait(works, ring) -> None:
    """Wait for ``works`` (pending messages of ``ring``'s group), within
    :func:`messages`."""
    with messages(ring):
        for w in works or ():
            if w is not None:
                w.wait()


def any_rank(ring, flag: bool) -> bool:
    """Whether ``flag`` holds on any rank of ``ring`` (one ``all_reduce``;
    ``flag`` itself without peers). Every rank of the group must call it."""
    if ring is None or ring.size == 1:
        return flag
    vote = torch.tensor([int(flag)], dtype=torch.int64).to(ring.flag_device)
    with messages(ring):
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=ring.group)
    return bool(vote.item())


#: Integers of a call's signature that :func:`agree` compares across ranks.
SIGNATURE = 20


def agree(ring, check, when="before any message"):
    """``check() -> (result, signature)`` on every rank of ``ring``: the
    result, or on every rank an error if ``check`` raised on any (see the
    module docstring), or if the ranks' ``signature`` (up to
    :data:`SIGNATURE` integers: shapes, dtypes, flags that every rank must
    share) differ. ``when``: the vote's place in the call, as the refusal
    names it (no message of the call may be in flight)."""
    if ring is None or ring.size == 1:
        return check()[0]
    try:
        if ring.polls:
            raise_if_failed(ring.group)  # a group left broken by an earlier failure
        return _vote(ring, check, when)
    except PeerFailure:
        _close(ring)  # (a peer already in the vote waits on this rank: let it go too)
        raise


def _vote(ring, check, when):
    """:func:`agree`'s vote, on a group of several ranks."""
    error, signature = None, ()
    try:
        result, signature = check()
    except BaseException as exc:  # refused (or interrupted) here: the others must hear of it
        error = exc
    sig = (list(signature) + [0] * SIGNATURE)[:SIGNATURE]
    # one all_reduce (MAX) gives the flag, the largest and (negated) the smallest signature
    votes = torch.tensor([int(error is not None), *sig, *(-x for x in sig)], dtype=torch.int64)
    votes = votes.to(ring.flag_device)
    with messages(ring):
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=ring.group)
    votes = votes.tolist()
    same = votes[1 : 1 + SIGNATURE] == [-x for x in votes[1 + SIGNATURE :]]
    if not votes[0] and same:
        return result
    verdicts = [None] * ring.size
    mine = (None if error is None else f"{type(error).__name__}: {error}", sig)
    with messages(ring):
        dist.all_gather_object(verdicts, mine, group=ring.group)
    if error is not None:
        raise error
    refused = [r for r, (m, _) in enumerate(verdicts) if m]
    if refused:
        raise ValueError(
            f"rank {refused[0]} of the group refused the call ({verdicts[refused[0]][0]}); "
            f"every rank refuses it, {when} (ranks are the group's)"
        )
    odd = next(r for r, (_, theirs) in enumerate(verdicts) if theirs != verdicts[0][1])
    raise ValueError(
        f"the ranks disagree on the call's shapes, dtype or keywords (q's, k's and v's "
        f"shapes, the dtype, then the call's flags: rank 0 {verdicts[0][1]}, rank {odd} "
        f"{verdicts[odd][1]}): every rank must pass the same"
    )


def dtype_code(dtype) -> int:
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    return dtypes.index(dtype) if dtype in dtypes else -1


def signature(q, k, v, causal, layout: int, window) -> tuple[int, ...]:
    """What every rank of a sequence-parallel call must share: ``q``'s,
    ``k``'s and ``v``'s shapes, the dtype, whether the call will be
    differentiated (every rank must run the backward, which communicates),
    ``causal``, the layout's index and the window (-1: an unbounded side;
    -2, -2: none)."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    sides = (-2, -2) if window is None else tuple(-1 if w is None else int(w) for w in window)
    flags = (dtype_code(q.dtype), int(grad), int(bool(causal)), layout, *sides)
    return (*q.shape, *k.shape, *v.shape, *flags)[:SIGNATURE]
