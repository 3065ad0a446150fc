"""Context-parallel causal self-attention over ``torch.distributed`` (SPEC "Context parallelism").

A sequence of T positions is split along T over the P ranks of a process group; each rank holds
its queries and its keys/values, and::

    out_local = tokenmix.distributed.ring_attention(q_local, k_local, v_local)

gives this rank's rows of causal self-attention over the *whole* sequence (SPEC 4.2–4.5, 4.8),
equal to single-process attention up to rounding. K/V chunks travel around the ring of ranks
with asynchronous ``isend``/``irecv``, overlapped with tokenmix's kernel on the chunk already
here; each rank merges the partial (O, L) of every chunk it sees with the log-sum-exp formula
(SPEC "Merging partial results", tokenmix's ``merge_partials`` kernel); chunks wholly in a
rank's future are skipped. The backward pass (a ``torch.autograd.Function``) sends K/V and the
dK/dV accumulators around the ring and calls tokenmix's fused backward per chunk with the
global (merged) O and L.

Layouts (how the T positions are split; ``shard`` and ``gather`` implement them):

- ``"zigzag"`` (default): the sequence is cut into 2P equal chunks and rank r holds chunks r and
  2P − 1 − r, in that order (T must be divisible by 2P). Every rank then does the same causal
  work: its own two chunks (causal), and at each of the P − 1 other steps one half-sized
  block without a mask.
- ``"contiguous"``: rank r holds chunk r of P (T divisible by P). Rank r computes r + 1 chunks
  and rank 0 only one, so the causal work is unbalanced (rank P − 1 does ~2× the average).

Tensors use PyTorch's SDPA layout ``[B, H, T_local, d_h]`` (any strides) on the CPU, float32,
bfloat16 or float16 (one dtype), like :func:`tokenmix.torch.scaled_dot_product_attention`; with
bf16/f16 the K/V chunks travel in that dtype, each block's kernel takes and gives that dtype
(L stays float32), the partial (O, L) are merged in float32 and O is cast once at the end;
dQ and the travelling dK/dV accumulators are summed in float32 and the gradients returned in the
input dtype. A sliding ``window`` (SPEC "Score variants") is applied on absolute positions:
chunk pairs wholly outside it are skipped, pairs it cuts get a boolean mask. Grouped-query attention
(``enable_gqa=True``): only the H_kv key/value heads travel. The kernels use
``torch.get_num_threads()`` threads, as in :mod:`tokenmix.torch`.

Errors: every rank checks its own arguments, then the ranks exchange what they found and the
signature of the call (shapes, layout, scale, GQA, whether a gradient will be needed, dtype,
window) with one
``all_gather_object``, *before* any K/V moves; a problem on any rank raises the same error on
every rank (:class:`tokenmix.ArgumentError` or :class:`tokenmix.UnsupportedError`, naming the
rank and what it had) instead of a hang. A group of one rank runs the local kernel. Calls that
never reach this function on some rank (or a backward run on only some ranks) cannot be
detected; they end with the process group's timeout (``init_process_group(timeout=...)``).

Across machines the same code runs unchanged: start one process per rank with ``torchrun``
(or set ``MASTER_ADDR``/``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE``) and
``init_process_group("gloo")``; see docs/design.md, "Context parallelism".
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from . import _tokenmix as _C
from ._errors import ArgumentError, UnsupportedError

__all__ = ["ring_attention", "shard", "gather", "comm_stats", "reset_comm_stats"]

_RING = "tokenmix.distributed.ring_attention"
_SHARD = "tokenmix.distributed.shard"
_GATHER = "tokenmix.distributed.gather"
_LAYOUTS = ("zigzag", "contiguous")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TAG_KV = 17  # message tags: K/V chunks and dK/dV accumulators travel at the same time
_TAG_DKV = 18

# Counters for benchmarks and tests: what this process sent and computed in ring_attention.
_STATS: Dict[str, int] = {"bytes_sent": 0, "messages_sent": 0, "chunks_forward": 0,
                          "chunks_backward": 0}


def comm_stats() -> Dict[str, int]:
    """What this process's :func:`ring_attention` calls (forward and backward) did since the last
    :func:`reset_comm_stats`: ``bytes_sent`` and ``messages_sent`` (point-to-point K/V and dK/dV
    messages; the small argument check is not counted), ``chunks_forward`` and
    ``chunks_backward`` (kernel calls on a (query block, key block) pair; skipped chunks are not
    counted)."""
    return dict(_STATS)


def reset_comm_stats() -> None:
    """Sets every counter of :func:`comm_stats` to zero."""
    for key in _STATS:
        _STATS[key] = 0


def _error(cls: type, fn: str, message: str, code: str) -> Exception:
    e = cls(f"{fn}: {message}")
    e.code = code
    return e


# ----------------------------------------------------------------------------------------------
# Layouts


def _check_layout_name(fn: str, layout: Any) -> None:
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        raise _error(ArgumentError, fn, f"layout must be 'zigzag' or 'contiguous'; got {layout!r}",
                     "invalid_argument")


def _divisor(layout: str, world_size: int) -> int:
    """Number of equal chunks the sequence is cut into."""
    return 2 * world_size if layout == "zigzag" else world_size


def _chunks_of(layout: str, rank: int, world_size: int) -> Tuple[int, ...]:
    """Indices of the chunks (of :func:`_divisor` many) that ``rank`` holds, in local order."""
    if layout == "zigzag":
        return (rank, 2 * world_size - 1 - rank)
    return (rank,)


def _check_int(fn: str, name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _error(ArgumentError, fn, f"{name} must be an int; got {type(value).__name__}",
                     "invalid_argument")
    if value < low:
        raise _error(ArgumentError, fn, f"{name} must be >= {low}; got {value}",
                     "invalid_argument")
    return value


def _check_shard_args(fn: str, x: Any, rank: Any, world_size: Any, layout: Any,
                      dim: Any) -> int:
    """Validates shard/gather arguments; returns dim normalised to [0, x.dim())."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor; got {type(x).__name__}")
    _check_int(fn, "world_size", world_size, 1)
    _check_int(fn, "rank", rank, 0)
    if rank >= world_size:
        raise _error(ArgumentError, fn,
                     f"rank must be in [0, world_size) = [0, {world_size}); got {rank}",
                     "invalid_argument")
    _check_layout_name(fn, layout)
    _check_int(fn, "dim", dim, -(1 << 62))
    if not -x.dim() <= dim < x.dim():
        raise _error(ArgumentError, fn,
                     f"dim must be in [{-x.dim()}, {x.dim()}) for a {x.dim()}-D tensor; "
                     f"got {dim}", "invalid_argument")
    return dim % x.dim()


def shard(x: torch.Tensor, *, rank: int, world_size: int, layout: str = "zigzag",
          dim: int = -2) -> torch.Tensor:
    """This rank's part of the full tensor ``x`` along ``dim`` in ``layout`` (differentiable).

    ``"zigzag"``: x is cut into 2·world_size equal chunks along dim; the result is chunks
    ``rank`` and ``2·world_size − 1 − rank`` concatenated (a new tensor). ``"contiguous"``: chunk
    ``rank`` of world_size (a view of x). ``dim`` defaults to −2, the T axis of
    ``[B, H, T, d_h]``. Needs no process group.

    Raises:
        tokenmix.ArgumentError: rank outside [0, world_size), an unknown layout, dim out of
            range, or a length along dim not divisible by 2·world_size (zigzag) / world_size.
    """
    d = _check_shard_args(_SHARD, x, rank, world_size, layout, dim)
    n = _divisor(layout, world_size)
    T = x.shape[d]
    if T % n != 0:
        raise _error(ArgumentError, _SHARD,
                     f"the length along dim {dim} ({T}) must be divisible by {n} "
                     f"({'2 × ' if layout == 'zigzag' else ''}world_size = {n}) for layout "
                     f"'{layout}'", "shape_mismatch")
    c = T // n
    parts = [x.narrow(d, i * c, c) for i in _chunks_of(layout, rank, world_size)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=d)


def _group_size_rank(fn: str, group: Any) -> Tuple[int, int]:
    if not dist.is_available():
        raise _error(UnsupportedError, fn, "this PyTorch build has no torch.distributed",
                     "unsupported")
    if not dist.is_initialized():
        raise _error(ArgumentError, fn,
                     "torch.distributed is not initialized: call "
                     "torch.distributed.init_process_group (e.g. backend 'gloo') first",
                     "invalid_argument")
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise _error(ArgumentError, fn, "this process is not a member of the given group",
                     "invalid_argument")
    return size, rank


def _exchange(fn: str, group: Any, size: int, problem: Optional[Tuple[str, str, str]],
              signature: Tuple[Any, ...], describe: Sequence[str]) -> None:
    """Collective check before any data moves: every rank contributes its local problem (or None)
    and the call's signature; on any problem or disagreement every rank raises the same error."""
    mine = (problem, signature)
    everyone: List[Any] = [None] * size
    dist.all_gather_object(everyone, mine, group=group)
    for r, (prob, _) in enumerate(everyone):
        if prob is not None:
            kind, message, code = prob
            cls = UnsupportedError if kind == "unsupported" else ArgumentError
            raise _error(cls, fn, f"rank {r} of {size}: {message}", code)
    sigs = [sig for _, sig in everyone]
    for i, name in enumerate(describe):
        values = [sig[i] for sig in sigs]
        if any(v != values[0] for v in values):
            listing = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise _error(ArgumentError, fn,
                         f"the ranks of the group disagree on {name} ({listing}); every rank "
                         "must make the same call", "shape_mismatch")


class _Gather(torch.autograd.Function):
    """All-gather along dim in a layout; backward: sum of every rank's gradient, this rank's
    part (as torch.distributed.nn.functional.all_gather)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rank: int, size: int, layout: str, dim: int,
                group: Any) -> torch.Tensor:
        ctx.args = (rank, size, layout, dim, group)
        xc = x.detach().contiguous()
        parts = [torch.empty_like(xc) for _ in range(size)]
        dist.all_gather(parts, xc, group=group)
        n = _divisor(layout, size)
        c = x.shape[dim] // len(_chunks_of(layout, 0, size))
        chunks: List[Optional[torch.Tensor]] = [None] * n
        for r, part in enumerate(parts):
            for j, idx in enumerate(_chunks_of(layout, r, size)):
                chunks[idx] = part.narrow(dim, j * c, c)
        return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Any, ...]:
        rank, size, layout, dim, group = ctx.args
        total = grad.contiguous().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        mine = shard(total, rank=rank, world_size=size, layout=layout, dim=dim)
        return mine, None, None, None, None, None


def gather(x_local: torch.Tensor, *, rank: int, world_size: int, layout: str = "zigzag",
           dim: int = -2, group: Any = None) -> torch.Tensor:
    """The full tensor, in sequence order, on every rank of ``group`` (the inverse of
    :func:`shard`; a collective: every rank of the group must call it).

    Differentiable: the gradient w.r.t. ``x_local`` is this rank's part of the *sum* over ranks
    of the gradients w.r.t. the gathered tensor (as ``torch.distributed.nn.functional
    .all_gather``), so the backward pass is a collective too. ``rank`` and ``world_size`` must
    be this process's rank in ``group`` and the group's size. With world_size 1 and no process
    group initialized, returns ``x_local`` unchanged.

    Raises:
        tokenmix.ArgumentError: as :func:`shard`; rank/world_size not those of the group; ranks
            with different shapes (raised on every rank).
    """
    d = _check_shard_args(_GATHER, x_local, rank, world_size, layout, dim)
    if world_size == 1 and not (dist.is_available() and dist.is_initialized()):
        return x_local
    size, me = _group_size_rank(_GATHER, group)
    problem = None
    if (size, me) != (world_size, rank):
        problem = ("argument", f"rank={rank}, world_size={world_size} were passed, but this "
                   f"process is rank {me} of a group of {size}", "invalid_argument")
    elif x_local.shape[d] % len(_chunks_of(layout, rank, world_size)) != 0:
        problem = ("argument", f"the local length along dim {dim} ({x_local.shape[d]}) must be "
                   "even for layout 'zigzag' (two chunks per rank)", "shape_mismatch")
    sig = (tuple(x_local.shape), str(x_local.dtype), layout, d)
    _exchange(_GATHER, group, size, problem, sig, ("x_local's shape", "x_local's dtype",
                                                   "layout", "dim"))
    if size == 1:
        return x_local
    return _Gather.apply(x_local, rank, size, layout, d, group)


# ----------------------------------------------------------------------------------------------
# Ring attention


def _bthd(x: torch.Tensor) -> torch.Tensor:
    """The logical [B, T, H, E] view tokenmix takes of a [B, H, T, E] tensor (no copy)."""
    return x.permute(0, 2, 1, 3)


class _Ring:
    """The communication of one ring_attention call: neighbours (global ranks) and counters."""

    def __init__(self, group: Any, size: int, me: int) -> None:
        self.group, self.size, self.me = group, size, me
        self.next = dist.get_global_rank(group, (me + 1) % size) if group is not None \
            else (me + 1) % size
        self.prev = dist.get_global_rank(group, (me - 1) % size) if group is not None \
            else (me - 1) % size

    def send(self, t: torch.Tensor, tag: int) -> Any:
        _STATS["bytes_sent"] += t.numel() * t.element_size()
        _STATS["messages_sent"] += 1
        return dist.isend(t, dst=self.next, group=self.group, tag=tag)

    def recv(self, t: torch.Tensor, tag: int) -> Any:
        return dist.irecv(t, src=self.prev, group=self.group, tag=tag)


def _blocks(layout: str, me: int, src: int, T_l: int) -> Optional[Tuple[slice, slice]]:
    """(query rows, key rows) of the local arrays that attend without a mask when this rank
    (``me``) holds the K/V of rank ``src`` ≠ me; None if the whole chunk is in me's future.

    contiguous: chunk src is wholly in the past of chunk me if src < me, else wholly in the future.
    zigzag: me holds chunks (me, 2P−1−me), src holds (src, 2P−1−src). src < me: both of me's
    chunks see all of chunk src and none of 2P−1−src (it lies after 2P−1−me). src > me: chunk me
    sees neither; chunk 2P−1−me sees both (src ≤ P−1 < 2P−1−me and 2P−1−src < 2P−1−me).
    """
    full = slice(0, T_l)
    if layout == "contiguous":
        return (full, full) if src < me else None
    half = T_l // 2
    return (full, slice(0, half)) if src < me else (slice(half, T_l), full)


# A kernel call on one (query rows, key rows) block of the local arrays: rows, keys, causal (the
# block is a diagonal one: the same positions on both sides, top-left causal mask), window (the
# kernel's window option, on diagonal blocks only), mask (bool [1, 1, rows, keys], or None).
_Job = Tuple[slice, slice, bool, Optional[int], Optional[torch.Tensor]]


def _pieces(layout: str, rank: int, size: int, T_l: int) -> List[Tuple[int, int, int]]:
    """(local start, length, global position of the first row) of each chunk ``rank`` holds."""
    n = len(_chunks_of(layout, rank, size))
    c = T_l // n
    return [(j * c, c, idx * c) for j, idx in enumerate(_chunks_of(layout, rank, size))]


def _jobs(layout: str, me: int, src: int, size: int, T_l: int,
          window: Optional[int]) -> List[_Job]:
    """The blocks this rank computes when it holds the K/V of rank ``src`` (src = me: its own).

    Without a window: the whole local causal block (src = me) or :func:`_blocks`. With a sliding
    window W (SPEC "Score variants": key u visible to row t iff t − W < u ≤ t, absolute
    positions): every (query chunk, key chunk) pair on its own; a diagonal pair uses the kernel's
    causal mask and window option; a key chunk wholly after the query chunk, or wholly more than
    W − 1 positions before it, is skipped; otherwise the rows with no visible key and the keys
    that no row sees are trimmed off (so every row computed has a finite L), and a boolean mask
    is passed only when the window cuts the trimmed block (its rows are intervals: full speed).
    At src = me the diagonal blocks come first and cover every row once.
    """
    if window is None:
        if src == me:
            full = slice(0, T_l)
            return [(full, full, True, None, None)]
        blk = _blocks(layout, me, src, T_l)
        return [] if blk is None else [(blk[0], blk[1], False, None, None)]
    jobs: List[_Job] = []
    if src == me:
        jobs = [(slice(a, a + n), slice(a, a + n), True, window, None)
                for a, n, _ in _pieces(layout, me, size, T_l)]
    for a, n, gq in _pieces(layout, me, size, T_l):
        for b, m, gk in _pieces(layout, src, size, T_l):
            if src == me and a == b:
                continue  # the diagonal block, above
            if gk >= gq + n:
                continue  # keys after every query: the causal mask hides them all
            # Pieces are disjoint, so gk + m ≤ gq: every key is ≤ every query position.
            t1 = min(gq + n, gk + m - 1 + window)  # rows t < gk + m − 1 + W see a key
            u0 = max(gk, gq - window + 1)  # keys u > gq − W are seen by some row
            if t1 <= gq or u0 >= gk + m:
                continue  # the whole key chunk is older than the window of every row
            rows = slice(a, a + t1 - gq)
            keys = slice(b + u0 - gk, b + m)
            mask = None
            if u0 <= t1 - 1 - window:  # the last row does not see the first key: cut
                t = torch.arange(gq, t1).unsqueeze(1)
                u = torch.arange(u0, gk + m).unsqueeze(0)
                mask = (u > t - window)[None, None]  # u ≤ t holds everywhere here
            jobs.append((rows, keys, False, None, mask))
    return jobs


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring,
                layout: str, scale: Optional[float], window: Optional[int]) -> torch.Tensor:
        q, k, v = q.detach(), k.detach(), v.detach()
        B, H_q, T_l, E = q.shape
        dtype = q.dtype  # float32, bfloat16 or float16: the kernels' inputs and partial outputs
        threads = torch.get_num_threads()
        # (O, L) are merged in float32 (SPEC "Merging partial results"); O is cast at the end.
        out = torch.empty((B, H_q, T_l, E), dtype=torch.float32)
        lse = torch.empty((B, H_q, T_l), dtype=torch.float32)
        kv = torch.stack((k, v))  # [2, B, H_kv, T_l, E]: one message per step, H_kv heads only
        spare = torch.empty_like(kv)
        part_o = torch.empty((B, H_q, T_l, E), dtype=dtype)
        part_f = part_o if dtype == torch.float32 else torch.empty_like(out)
        part_l = torch.empty_like(lse)
        for step in range(ring.size):
            src = (ring.me - step) % ring.size
            reqs = []
            if step + 1 < ring.size:  # the next chunk travels while this one is computed
                reqs = [ring.send(kv, _TAG_KV), ring.recv(spare, _TAG_KV)]
            for rows, keys, causal, win, mask in _jobs(layout, ring.me, src, ring.size, T_l,
                                                       window):
                # Own chunk(s), step 0: the causal mask (and window) on the local rows is exact
                # in both layouts (the zig-zag pair (r, 2P−1−r) is in increasing order; T_q = T_k
                # so the alignment is immaterial), SPEC 4.3; these blocks cover every row once
                # and write (out, lse) directly. Other blocks are merged into them.
                direct = causal
                po = (out if direct and dtype == torch.float32 else part_o)[:, :, rows]
                pl = (lse if direct else part_l)[:, :, rows]
                _C.attention_forward(_bthd(q[:, :, rows]), _bthd(kv[0][:, :, keys]),
                                     _bthd(kv[1][:, :, keys]), _bthd(po), pl, scale, causal,
                                     "top_left", threads, "auto", window=win, mask=mask)
                oo, ol = out[:, :, rows], lse[:, :, rows]
                if direct:
                    if dtype != torch.float32:
                        oo.copy_(po)
                else:
                    pf = part_f[:, :, rows]
                    if pf is not po:
                        pf.copy_(po)
                    # SPEC "Merging partial results", in place into (out, lse).
                    _C.merge_partials(_bthd(oo), ol, _bthd(pf), pl, _bthd(oo), ol)
                _STATS["chunks_forward"] += 1
            for req in reqs:
                req.wait()
            kv, spare = spare, kv
        out_t = out if dtype == torch.float32 else out.to(dtype)
        ctx.save_for_backward(q, k, v, out_t, lse)
        ctx.ring, ctx.layout, ctx.scale, ctx.window = ring, layout, scale, window
        return out_t

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> Tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring, layout, scale, window = ctx.ring, ctx.layout, ctx.scale, ctx.window
        dtype = q.dtype
        if grad_out.dtype != dtype or grad_out.device.type != "cpu":
            grad_out = grad_out.to(device="cpu", dtype=dtype)
        B, H_q, T_l, E = q.shape
        threads = torch.get_num_threads()
        # Per-block gradients come in the input dtype; dQ and the travelling dK/dV accumulators
        # are summed in float32 and cast at the end.
        dq = torch.zeros((B, H_q, T_l, E), dtype=torch.float32)
        dq_part = torch.empty((B, H_q, T_l, E), dtype=dtype)
        kv = torch.stack((k, v))
        spare = torch.empty_like(kv)
        acc_in: Optional[torch.Tensor] = None  # dK/dV accumulator of the chunk held, received
        acc_req: Any = None
        sending: Any = None  # the accumulator sent last step, still in flight (and its buffer)
        for step in range(ring.size):
            src = (ring.me - step) % ring.size
            reqs = []
            if step + 1 < ring.size:
                reqs = [ring.send(kv, _TAG_KV), ring.recv(spare, _TAG_KV)]
            # This rank's contribution to dK/dV of chunk src, and to its own dQ. The global O and
            # L (saved by the forward) make each block's backward exact on its own: A = e^{S−L},
            # D = ⟨dO, O⟩ (SPEC "Backward pass").
            jobs = _jobs(layout, ring.me, src, ring.size, T_l, window)
            contrib: Optional[torch.Tensor] = None
            if jobs or step == 0:
                # Keys outside every block get no gradient from this rank.
                contrib = torch.zeros(kv.shape, dtype=torch.float32)
            part = torch.empty_like(kv)
            for rows, keys, causal, win, mask in jobs:
                _C.attention_backward(
                    _bthd(q[:, :, rows]), _bthd(kv[0][:, :, keys]), _bthd(kv[1][:, :, keys]),
                    _bthd(out[:, :, rows]), lse[:, :, rows], _bthd(grad_out[:, :, rows]),
                    _bthd(dq_part[:, :, rows]), _bthd(part[0][:, :, keys]),
                    _bthd(part[1][:, :, keys]), scale, causal, "top_left", threads, "auto",
                    window=win, mask=mask)
                dq[:, :, rows] += dq_part[:, :, rows]
                contrib[:, :, :, keys] += part[:, :, :, keys]  # type: ignore[index]
                _STATS["chunks_backward"] += 1
            # The accumulator of chunk src arrived from the previous rank while we computed.
            if acc_req is not None:
                acc_req.wait()
                if contrib is not None:
                    acc_in += contrib
                contrib = acc_in
            assert contrib is not None  # step 0 always has an accumulator
            if sending is not None:  # posted a step ago; its receiver has been waiting for it
                sending[0].wait()
            sending = (ring.send(contrib, _TAG_DKV), contrib)
            acc_in = torch.empty_like(contrib)
            acc_req = ring.recv(acc_in, _TAG_DKV)
            for req in reqs:
                req.wait()
            kv, spare = spare, kv
        # After P hops this rank's own chunk's accumulator comes home.
        acc_req.wait()
        sending[0].wait()
        dk, dv = acc_in[0].to(dtype), acc_in[1].to(dtype)
        return dq.to(dtype), dk, dv, None, None, None, None


def _local_problem(q: Any, k: Any, v: Any, layout: Any, scale: Any, window: Any,
                   enable_gqa: Any) -> Optional[Tuple[str, str, str]]:
    """This rank's argument problem as (kind, message, code), or None."""
    tensors = (("q", q), ("k", k), ("v", v))
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            return ("argument", f"{name} must be a torch.Tensor; got {type(t).__name__}",
                    "invalid_argument")
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        return ("argument", f"layout must be 'zigzag' or 'contiguous'; got {layout!r}",
                "invalid_argument")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int):
            return ("argument", f"window must be an int or None; got {type(window).__name__}",
                    "invalid_argument")
        if window < 1:
            return ("argument", f"window must be >= 1 (the last W positions up to the query's "
                    f"own, SPEC \"Score variants\"); got {window}", "invalid_argument")
    for name, t in tensors:
        if t.device.type != "cpu":
            return ("unsupported", f"{name} is on device '{t.device}'; tokenmix runs on the CPU "
                    "only", "unsupported")
        if t.dtype not in _DTYPES:
            return ("unsupported", f"{name} has dtype {t.dtype}; only torch.float32, "
                    "torch.bfloat16 and torch.float16 are supported", "unsupported")
        if t.dtype != q.dtype:
            return ("argument", f"q, k and v must have the same dtype; q has {q.dtype} and "
                    f"{name} {t.dtype}", "invalid_argument")
        if t.layout != torch.strided:
            return ("unsupported", f"{name} has layout {t.layout}; only strided tensors are "
                    "supported", "unsupported")
        if t.dim() != 4:
            return ("argument", f"{name} must be 4-D [B, H, T_local, d_h]; got shape "
                    f"{tuple(t.shape)}", "shape_mismatch")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or \
                not math.isfinite(float(scale)):
            return ("argument", f"scale must be a finite number or None; got {scale!r}",
                    "invalid_argument")
    if not isinstance(enable_gqa, bool):
        return ("argument", f"enable_gqa must be a bool; got {type(enable_gqa).__name__}",
                "invalid_argument")
    B, H_q, T_l, E = q.shape
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] != B or t.shape[2] != T_l or t.shape[3] != E:
            return ("argument", f"{name} has shape {tuple(t.shape)}; expected [B={B}, H_kv, "
                    f"T_local={T_l}, d_h={E}] like q {tuple(q.shape)} (self-attention: q, k and "
                    "v hold the same positions)", "shape_mismatch")
    H_kv = k.shape[1]
    if v.shape[1] != H_kv:
        return ("argument", f"k and v must have the same number of heads; got {H_kv} and "
                f"{v.shape[1]}", "shape_mismatch")
    if H_q != H_kv:
        if not enable_gqa:
            return ("argument", f"q has {H_q} heads and k/v {H_kv}; pass enable_gqa=True for "
                    "grouped-query attention", "shape_mismatch")
        if H_kv == 0 or H_q % H_kv != 0:
            return ("argument", f"the number of query heads ({H_q}) must be a multiple of the "
                    f"number of key/value heads ({H_kv})", "shape_mismatch")
    if T_l < 1 or B < 1 or H_q < 1 or E < 1:
        return ("argument", f"q must have non-empty dimensions; got shape {tuple(q.shape)}",
                "shape_mismatch")
    if layout == "zigzag" and T_l % 2 != 0:
        return ("argument", f"layout 'zigzag' needs an even local length (two chunks per rank, "
                f"T divisible by 2 × world_size); got T_local = {T_l}", "shape_mismatch")
    return None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any = None, *,
                   layout: str = "zigzag", scale: Optional[float] = None,
                   window: Optional[int] = None, enable_gqa: bool = False) -> torch.Tensor:
    """Causal self-attention over a sequence sharded along T across the ranks of ``group``.

    Args:
        q: [B, H_q, T_local, d_h] float32, bfloat16 or float16 CPU tensor: this rank's
            queries, in ``layout`` (as :func:`shard` cuts them; T = world_size · T_local).
        k, v: [B, H_kv, T_local, d_h]: this rank's keys and values (same positions as q).
        group: a ``torch.distributed`` process group (default: the world). A group of one rank
            runs :func:`tokenmix.torch.scaled_dot_product_attention` locally.
        layout: ``"zigzag"`` (chunks r and 2P − 1 − r of 2P; T_local even) or
            ``"contiguous"`` (chunk r of P); the same on every rank.
        scale: s of SPEC (4.2); ``None`` = 1/sqrt(d_h).
        window: sliding window W ≥ 1 (SPEC "Score variants": key u is visible to row t iff
            t − W < u ≤ t, absolute positions in the whole sequence); ``None`` = off. Chunk
            pairs wholly outside the window are skipped; a pair the window cuts gets a boolean
            mask.
        enable_gqa: allow H_q ≠ H_kv (H_q a multiple of H_kv; SPEC 4.8).

    Returns:
        [B, H_q, T_local, d_h] in q's dtype: this rank's rows of causal attention over all T
        positions; differentiable w.r.t. q, k and v (the backward pass is a collective: run it
        on every rank).

    Raises:
        tokenmix.ArgumentError / tokenmix.UnsupportedError: on every rank, when any rank's
            arguments are invalid or the ranks disagree (shapes, dtype, layout, scale, GQA,
            whether gradients are needed, dtype, window); torch.distributed not initialized.
    """
    size, me = _group_size_rank(_RING, group)
    problem = _local_problem(q, k, v, layout, scale, window, enable_gqa)
    if size == 1:
        if problem is not None:
            kind, message, code = problem
            cls = UnsupportedError if kind == "unsupported" else ArgumentError
            raise _error(cls, _RING, message, code)
        from .torch import scaled_dot_product_attention

        return scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                            enable_gqa=enable_gqa, window=window)
    if problem is None:
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        sig: Tuple[Any, ...] = (tuple(q.shape), tuple(k.shape), layout,
                                None if scale is None else float(scale), needs_grad,
                                str(q.dtype), window)
    else:
        sig = (None,) * 7  # the problem itself is reported
    _exchange(_RING, group, size, problem, sig,
              ("q's shape [B, H_q, T_local, d_h]", "k/v's shape [B, H_kv, T_local, d_h]",
               "layout", "scale", "whether gradients are needed (requires_grad)", "the dtype",
               "window"))
    ring = _Ring(group, size, me)
    return _RingAttention.apply(q, k, v, ring, layout,
                                None if scale is None else float(scale), window)
