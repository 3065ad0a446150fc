"""One rank of the tokenmix.distributed tests (python/tests/test_distributed.py starts N of them).

    python _distributed_worker.py RANK WORLD_SIZE PORT RESULT_JSON

Joins a gloo process group on 127.0.0.1:PORT (timeout 120 s, so a rank left waiting fails instead
of hanging), runs every scenario below in order with one thread, and writes a JSON object
{scenario: result} to RESULT_JSON. A scenario's result holds numbers (relative errors, byte
counts) or, for the error scenarios, the exception each rank raised; the assertions are made by
the test process. A scenario that raises unexpectedly is recorded as {"crash": traceback} and
the remaining scenarios still run (they may then time out, which is recorded the same way).
"""

from __future__ import annotations

import datetime
import json
import sys
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

import tokenmix
import tokenmix.distributed as tmd
from tokenmix.torch import scaled_dot_product_attention as tm_sdpa


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours − ref| / max |ref|."""
    scale = ref.double().abs().max().item()
    return (ours.double() - ref.double()).abs().max().item() / (scale if scale > 0 else 1.0)


def reference64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float],
                window: Optional[int] = None):
    """float64 causal attention with PyTorch ops (SPEC 4.2–4.5, 4.8; a sliding window per SPEC
    "Score variants": key u visible to row t iff t − W < u ≤ t), for the yardstick. Works on
    float64 leaves with requires_grad too (the gradients' yardstick)."""
    g = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(g, dim=1)
    v = v.double().repeat_interleave(g, dim=1)
    s = scale if scale is not None else 1.0 / q.shape[-1] ** 0.5
    S = q.double() @ k.transpose(-1, -2) * s
    T = q.shape[2]
    t = torch.arange(T).unsqueeze(1)
    u = torch.arange(T).unsqueeze(0)
    mask = u <= t
    if window is not None:
        mask &= u > t - window
    return torch.softmax(S.masked_fill(~mask, float("-inf")), dim=-1) @ v


def visible_chunk_pairs(rank: int, world: int, T: int, layout: str,
                        window: Optional[int]) -> int:
    """How many (query chunk of this rank, key chunk of any rank) pairs hold at least one
    visible (t, u), by brute force over positions: the kernel calls a windowed ring makes."""
    n = 2 * world if layout == "zigzag" else world
    c = T // n
    mine = (rank, n - 1 - rank) if layout == "zigzag" else (rank,)
    count = 0
    for a in mine:
        for b in range(n):
            if any(t - window < u <= t for t in range(a * c, (a + 1) * c)
                   for u in range(b * c, (b + 1) * c)):
                count += 1
    return count


def equivalence(rank: int, world: int, *, B: int, H_q: int, H_kv: int, T: int, E: int,
                layout: str, scale: Optional[float] = None, strided: bool = False,
                seed: int = 0, group: Any = None, window: Optional[int] = None,
                dtype: torch.dtype = torch.float32) -> Dict[str, Any]:
    """Ring attention on this rank's shards vs single-process tokenmix on the full tensors:
    output and the gradients of q, k, v, gathered back in order. ``rank`` and ``world`` are
    this process's rank in ``group`` and its size (default: the world). With a bf16/f16
    ``dtype`` the inputs are rounded to it and both the ring and the single process are also
    compared with float64 attention (output and gradients) on the rounded inputs."""
    gen = torch.Generator().manual_seed(seed)
    if strided:  # [B, T, H, E] projections seen as [B, H, T, E]: non-contiguous inputs
        q = torch.randn(B, T, H_q, E, generator=gen).transpose(1, 2)
        k = torch.randn(B, T, H_kv, E, generator=gen).transpose(1, 2)
        v = torch.randn(B, T, H_kv, E, generator=gen).transpose(1, 2)
    else:
        q = torch.randn(B, H_q, T, E, generator=gen)
        k = torch.randn(B, H_kv, T, E, generator=gen)
        v = torch.randn(B, H_kv, T, E, generator=gen)
    g = torch.randn(B, H_q, T, E, generator=gen)
    q, k, v, g = (x.to(dtype) for x in (q, k, v, g))
    gqa = H_q != H_kv
    kw = dict(rank=rank, world_size=world, layout=layout, dim=2)
    ql, kl, vl = (tmd.shard(x, **kw).detach().requires_grad_() for x in (q, k, v))
    tmd.reset_comm_stats()
    out_l = tmd.ring_attention(ql, kl, vl, group, layout=layout, scale=scale, enable_gqa=gqa,
                               window=window)
    fwd_stats = tmd.comm_stats()
    out_l.backward(tmd.shard(g, **kw))
    stats = tmd.comm_stats()

    out = tmd.gather(out_l.detach(), group=group, **kw)
    dq, dk, dv = (tmd.gather(x.grad, group=group, **kw) for x in (ql, kl, vl))

    qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = tm_sdpa(qr, kr, vr, is_causal=True, scale=scale, enable_gqa=gqa, window=window)
    ref.backward(g)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref64 = reference64(q64, k64, v64, scale, window)
    ref64.backward(g.double())
    size = torch.tensor([], dtype=dtype).element_size()
    message = 2 * B * H_kv * (T // world) * E * size  # one K/V chunk: H_kv heads only
    acc = 2 * B * H_kv * (T // world) * E * 4  # one dK/dV accumulator: summed in float32
    extra = {}
    if dtype != torch.float32:  # ring and single process vs float64
        for name, ours, single, exact in (("out", out, ref, ref64), ("dq", dq, qr.grad, q64.grad),
                                          ("dk", dk, kr.grad, k64.grad),
                                          ("dv", dv, vr.grad, v64.grad)):
            extra[name + "_ring_vs_float64"] = rel_err(ours, exact)
            extra[name + "_single_vs_float64"] = rel_err(single, exact)
        extra["dtypes"] = [str(x.dtype) for x in (out_l, ql.grad, kl.grad, vl.grad)]
    chunks = None if window is None else visible_chunk_pairs(rank, world, T, layout, window)
    return {**extra, "visible_chunk_pairs": chunks,
        "out": rel_err(out, ref), "dq": rel_err(dq, qr.grad), "dk": rel_err(dk, kr.grad),
        "dv": rel_err(dv, vr.grad), "out_vs_float64": rel_err(out, ref64),
        "fwd_bytes": fwd_stats["bytes_sent"], "fwd_bytes_expected": (world - 1) * message,
        "bwd_bytes": stats["bytes_sent"] - fwd_stats["bytes_sent"],
        "bwd_bytes_expected": (world - 1) * message + world * acc,
        "fwd_chunks": fwd_stats["chunks_forward"], "bwd_chunks": stats["chunks_backward"],
        "same_output_shape": list(out_l.shape) == [B, H_q, T // world, E],
    }


def expect_error(fn: Callable[[], Any]) -> Dict[str, Any]:
    """Runs fn, which must raise; returns the exception's type, message and code."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test process checks the type
        return {"raised": type(e).__name__, "message": str(e), "code": getattr(e, "code", None),
                "is_argument_error": isinstance(e, tokenmix.ArgumentError),
                "is_unsupported_error": isinstance(e, tokenmix.UnsupportedError)}
    return {"raised": None}


def tensors(B: int, H_q: int, H_kv: int, T_l: int, E: int, dtype=torch.float32):
    return (torch.randn(B, H_q, T_l, E, dtype=dtype), torch.randn(B, H_kv, T_l, E, dtype=dtype),
            torch.randn(B, H_kv, T_l, E, dtype=dtype))


def scenarios(rank: int, world: int) -> List[Any]:
    P = world
    cases: List[Any] = [
        # T = 2P·c with c not a power of two, odd chunk lengths (c = 15, 9, ...).
        ("zigzag_mha", lambda: equivalence(rank, P, B=2, H_q=2, H_kv=2, T=2 * P * 15, E=16,
                                           layout="zigzag")),
        ("contiguous_mha", lambda: equivalence(rank, P, B=1, H_q=3, H_kv=3, T=P * 29, E=24,
                                               layout="contiguous", strided=True)),
        ("zigzag_gqa", lambda: equivalence(rank, P, B=1, H_q=4, H_kv=2, T=2 * P * 11, E=32,
                                           layout="zigzag", scale=0.3, strided=True)),
        ("contiguous_mqa", lambda: equivalence(rank, P, B=1, H_q=4, H_kv=1, T=P * 21, E=8,
                                               layout="contiguous")),
        # Chunks longer than a kernel tile, odd head width.
        ("zigzag_long", lambda: equivalence(rank, P, B=1, H_q=2, H_kv=1, T=2 * P * 45, E=20,
                                            layout="zigzag", seed=1)),
        # Sliding windows (SPEC "Score variants"): smaller than a chunk (chunk pairs cut by the
        # window, most skipped) and spanning several chunks (whole, cut and skipped pairs).
        ("zigzag_window_small", lambda: equivalence(rank, P, B=1, H_q=4, H_kv=2, T=2 * P * 13,
                                                    E=16, layout="zigzag", window=5, seed=4)),
        ("contiguous_window_small", lambda: equivalence(rank, P, B=2, H_q=2, H_kv=2, T=P * 17,
                                                        E=8, layout="contiguous", window=7,
                                                        seed=5, strided=True)),
        ("zigzag_window_wide", lambda: equivalence(rank, P, B=1, H_q=2, H_kv=2, T=2 * P * 9,
                                                   E=16, layout="zigzag", window=23, seed=6)),
        ("contiguous_window_wide", lambda: equivalence(rank, P, B=1, H_q=4, H_kv=1, T=P * 11,
                                                       E=24, layout="contiguous", window=26,
                                                       seed=7)),
        # bfloat16 / float16 (SPEC "Reduced precision"): compared with float64 below.
        ("zigzag_bf16", lambda: equivalence(rank, P, B=1, H_q=4, H_kv=2, T=2 * P * 24, E=32,
                                            layout="zigzag", dtype=torch.bfloat16, seed=8)),
        ("contiguous_f16_window", lambda: equivalence(rank, P, B=1, H_q=2, H_kv=2, T=P * 30,
                                                      E=16, layout="contiguous", window=37,
                                                      dtype=torch.float16, seed=9)),
    ]

    def mismatched_shapes():
        T_l = 6 if rank == 0 else 8
        return tmd.ring_attention(*tensors(1, 2, 2, T_l, 8))

    def odd_local_length():
        return tmd.ring_attention(*tensors(1, 2, 2, 5, 8), layout="zigzag")

    def mismatched_layout():
        return tmd.ring_attention(*tensors(1, 2, 2, 6, 8),
                                  layout="contiguous" if rank == 0 else "zigzag")

    def window_zero():
        return tmd.ring_attention(*tensors(1, 2, 2, 6, 8), window=0)

    def mismatched_window():
        return tmd.ring_attention(*tensors(1, 2, 2, 6, 8), window=4 if rank == 0 else None)

    def mixed_dtypes():
        q, k, v = tensors(1, 2, 2, 6, 8)
        return tmd.ring_attention(q.bfloat16(), k, v)

    def float64_on_last_rank():
        return tmd.ring_attention(
            *tensors(1, 2, 2, 6, 8, dtype=torch.float64 if rank == P - 1 else torch.float32))

    def gqa_without_flag():
        return tmd.ring_attention(*tensors(1, 4, 2, 6, 8))

    def mismatched_requires_grad():
        q, k, v = tensors(1, 2, 2, 6, 8)
        return tmd.ring_attention(q.requires_grad_(rank == 0), k, v)

    def mismatched_scale():
        return tmd.ring_attention(*tensors(1, 2, 2, 6, 8), scale=0.5 if rank == 0 else None)

    def gather_wrong_rank():
        return tmd.gather(torch.zeros(1, 4), rank=(rank + 1) % P, world_size=P, dim=1)

    def gather_mismatched_shapes():
        return tmd.gather(torch.zeros(1, 4 if rank == 0 else 6), rank=rank, world_size=P,
                          dim=1)

    cases += [
        ("err_mismatched_shapes", lambda: expect_error(mismatched_shapes)),
        ("err_odd_local_length", lambda: expect_error(odd_local_length)),
        ("err_mismatched_layout", lambda: expect_error(mismatched_layout)),
        ("err_window_zero", lambda: expect_error(window_zero)),
        ("err_mismatched_window", lambda: expect_error(mismatched_window)),
        ("err_mixed_dtypes", lambda: expect_error(mixed_dtypes)),
        ("err_float64_on_last_rank", lambda: expect_error(float64_on_last_rank)),
        ("err_gqa_without_flag", lambda: expect_error(gqa_without_flag)),
        ("err_mismatched_requires_grad", lambda: expect_error(mismatched_requires_grad)),
        ("err_mismatched_scale", lambda: expect_error(mismatched_scale)),
        ("err_gather_wrong_rank", lambda: expect_error(gather_wrong_rank)),
        ("err_gather_mismatched_shapes", lambda: expect_error(gather_mismatched_shapes)),
        ("group_of_one", lambda: group_of_one(rank, P)),
        ("subgroup", lambda: subgroup(rank, P)),
        ("gather_backward", lambda: gather_backward(rank, P)),
        # After every error above the group must still be in step.
        ("after_errors", lambda: equivalence(rank, P, B=1, H_q=2, H_kv=2, T=2 * P * 7, E=16,
                                             layout="zigzag", seed=2)),
    ]
    return cases


def group_of_one(rank: int, world: int) -> Dict[str, Any]:
    """A group of one rank runs the local kernel: identical to tokenmix.torch's drop-in."""
    groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    mine = groups[rank]
    q, k, v = (x.requires_grad_() for x in tensors(1, 4, 2, 10, 8))
    out = tmd.ring_attention(q, k, v, mine, enable_gqa=True, layout="zigzag")
    out.backward(torch.ones_like(out))
    qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = tm_sdpa(qr, kr, vr, is_causal=True, enable_gqa=True)
    ref.backward(torch.ones_like(ref))
    qw, kw, vw = (x.detach().clone() for x in (q, k, v))
    out_w = tmd.ring_attention(qw, kw, vw, mine, enable_gqa=True, window=3)
    ref_w = tm_sdpa(qw, kw, vw, is_causal=True, enable_gqa=True, window=3)
    odd = expect_error(lambda: tmd.ring_attention(*tensors(1, 2, 2, 5, 8), mine))
    return {
        "out_equal": bool(torch.equal(out, ref)),
        "grads_equal": all(bool(torch.equal(a.grad, b.grad)) for a, b in
                           ((q, qr), (k, kr), (v, vr))),
        "window_equal": bool(torch.equal(out_w, ref_w)), "odd": odd,
    }


def subgroup(rank: int, world: int) -> Dict[str, Any]:
    """A ring over a subgroup: with 4 ranks, groups {0, 2} and {1, 3} (group ranks differ from
    global ranks, and the neighbours are not adjacent); with 2, the world passed explicitly."""
    if world == 4:
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        group, g_rank, g_size, color = groups[rank % 2], rank // 2, 2, rank % 2
    else:
        group, g_rank, g_size, color = dist.group.WORLD, rank, world, 0
    # The same full tensors within a group, different ones in the two groups.
    return equivalence(g_rank, g_size, B=1, H_q=4, H_kv=2, T=2 * g_size * 13, E=16,
                       layout="zigzag", seed=3 + color, group=group)


def gather_backward(rank: int, world: int) -> Dict[str, Any]:
    """gather's gradient is this rank's part of the sum over ranks of the gathered gradient."""
    T = 4 * world
    full = torch.arange(3 * T, dtype=torch.float32).reshape(3, T)
    results = {}
    for layout in ("zigzag", "contiguous"):
        kw = dict(rank=rank, world_size=world, layout=layout, dim=1)
        x = tmd.shard(full, **kw).clone().requires_grad_()
        y = tmd.gather(x, **kw)
        w = torch.linspace(-1, 1, 3 * T).reshape(3, T) * (rank + 1)
        (y * w).sum().backward()
        total = torch.linspace(-1, 1, 3 * T).reshape(3, T) * sum(r + 1 for r in range(world))
        results[layout] = {"forward_equal": bool(torch.equal(y.detach(), full)),
                           "grad_err": rel_err(x.grad, tmd.shard(total, **kw))}
    return results


def main() -> int:
    rank, world, port, result_path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), \
        sys.argv[4]
    torch.set_num_threads(1)
    torch.manual_seed(100 + rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    results: Dict[str, Any] = {}
    try:
        for name, fn in scenarios(rank, world):
            try:
                results[name] = fn()
            except Exception:  # noqa: BLE001 - reported to the test process
                results[name] = {"crash": traceback.format_exc()}
            with open(result_path, "w") as f:  # partial results survive a later hang
                json.dump(results, f)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
