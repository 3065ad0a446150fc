"""Side-by-side benchmark: PyTorch's CPU SDPA vs tokenmix's drop-in, in one process.

    python -m tokenmix.bench                       # T = 512, 2048, 8192; forward and fwd+bwd
    python -m tokenmix.bench --seq 2048 --repeats 7 --threads 2 --markdown
    python -m tokenmix.bench --dtype bf16          # both sides in bfloat16 (or f16: float16)
    python -m tokenmix.bench --model      # a Llama-shaped model in transformers (_bench_model)
    python -m tokenmix.bench --overhead   # the cost of one tiny call (generation's shapes)
    python -m tokenmix.bench --decode     # one-token decode per KV-cache dtype (f32 ... fp8)

Shapes (SPEC "Names and shapes"): B=1, H_q=32, H_kv=8, d_h=128 by default (grouped-query,
g = 4), causal, float32 (``--dtype bf16`` / ``f16``: both sides in bfloat16 / float16, the
inputs rounded once from the same float32 draws), PyTorch's layout [B, H, T, d_h]. Both sides get
the same tensors and
the same thread count (``torch.set_num_threads``; tokenmix's drop-in uses
``torch.get_num_threads()``). PyTorch runs ``F.scaled_dot_product_attention(..., is_causal=True,
enable_gqa=True)``; ``--torch-expanded`` also times PyTorch on K/V repeated to H_q heads
(plain multi-head, expanded outside the timing) and compares against the faster of the two.

``--ring N`` benchmarks context parallelism instead (tokenmix.distributed.ring_attention; see
:func:`ring_main`): T = 16384 by default, N gloo processes on this machine with one thread each
against one process with one thread.

Each case: one warm-up call per side, then ``--repeats`` rounds; a round times PyTorch and then
tokenmix back to back (alternating order each round), so slow phases of a shared machine hit
both sides alike. Reported: the median time of each side, the ratio of the medians
(``speedup`` = torch / tokenmix, > 1 means tokenmix is faster), the median of the per-round
ratios, and tokenmix's useful FLOP/s (forward 4·d_h·H_q·P·B with P = T(T+1)/2, backward 2.5×
that; SPEC "Useful-work counts"). The load average before and after is printed, since other
processes on the machine change the figures. Each side's FLOP/s is also given as a fraction of
the GEMM ceiling of ``tokenmix bench`` — the same C++ code (tools/bench/ceilings.hpp, through the
extension: :class:`GemmCeiling`), the same choice and kind (``ceiling_kind``) for the dtype, and
the same interleaving (docs/performance.md, D-bench-10): the OpenBLAS sgemm 2048³ on the same
threads, one pass of 2 calls after each round (then a pause while OpenBLAS's workers stop
spinning, D-bench-5), the median of a case's passes with their spread; for ``--dtype bf16`` on a
CPU with bf16 GEMM instructions and a build with oneDNN, oneDNN's bf16 matmul 2048³ measured once
(best of 10). f16 (fp32 products on widened operands) and bf16 elsewhere use the sgemm, and the
kind says why. With ``--dtype bf16`` / ``f16`` PyTorch's own GEMM in the dtype (``torch.mm``, the
same threads, best of 10) is printed next to it as a peer figure, not the ceiling: where one such
GEMM would take over ``TORCH_GEMM_BUDGET_S`` (no bf16/f16 GEMM instructions: PyTorch's scalar
loop) the size halves until it fits, down to 512, and the line says so.
The forward agreement ``max|diff|`` is between the two sides' outputs in the dtype, so at
bfloat16 it is of the order of the dtype's rounding (2^-8 relative), not 1e-6.

``--decode`` benchmarks one-token decode instead (:func:`decode_main`): for each T_k of
``--cache-tokens`` one tokenmix.KVCache per dtype of ``--cache-dtype`` (default all five: f32,
bf16, f16, int8, fp8_e4m3) holding the same N(0, 1) K/V, timed side by side in alternating
rounds, next to the streaming-read ceiling of the same rounds (``tokenmix bench decode``'s, the C++
``StreamRead`` through the extension, over a ``--stream-mib`` buffer).

Score variants (SPEC "Score variants used by real models"): ``--window W``, ``--softcap C``,
``--alibi`` (the standard slopes 2^(−8(h+1)/H_q)) and ``--sinks V`` (one sink logit for every
head) are passed to tokenmix's keyword-only extras. PyTorch's side is what a model does without
tokenmix: SDPA with the window and ALiBi written into an explicit ``attn_mask`` (built once,
outside the timing), or — for soft-capping and sinks, which SDPA cannot express — the eager
computation (scores, ``tanh`` cap, mask, a sink column, softmax, P·V; as Hugging Face's eager
attention does for Gemma 2 and gpt-oss). Useful FLOPs count only the pairs the window leaves
visible.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F

import tokenmix
from tokenmix import _tokenmix as _C
from tokenmix.torch import scaled_dot_product_attention as tm_sdpa


def case_flops(B: int, T: int, H_q: int, d_h: int, mode: str,
               window: Optional[int] = None) -> float:
    """Useful FLOPs of one causal self-attention call (T_q = T_k = T) in ``mode`` "fwd" or
    "fwd+bwd", as the library counts them (SPEC "Useful-work counts": tokenmix.forward_flops,
    and tokenmix.backward_flops = 2.5 × that, five matrix products instead of two). With a
    sliding window W only the visible pairs count (tokenmix.forward_flops(..., window=W))."""
    flops = tokenmix.forward_flops(B, T, T, H_q, d_h, True, "top_left", window=window)
    if mode != "fwd":
        flops += tokenmix.backward_flops(B, T, T, H_q, d_h, True, "top_left", window=window)
    return flops


def alibi_slopes(H: int) -> torch.Tensor:
    """The standard ALiBi slopes m_h = 2^(−8(h+1)/H) (SPEC "Score variants": ALiBi)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], dtype=torch.float32)


def variant_kwargs(args: argparse.Namespace, H_q: int) -> Dict[str, object]:
    """tokenmix's keyword-only extras for the variants on the command line."""
    kw: Dict[str, object] = {}
    if args.window is not None:
        kw["window"] = args.window
    if args.softcap is not None:
        kw["softcap"] = args.softcap
    if args.alibi:
        kw["alibi_slopes"] = alibi_slopes(H_q)
    if args.sinks is not None:
        kw["sinks"] = torch.full((H_q,), args.sinks, dtype=torch.float32)
    return kw


def torch_variant(T: int, H_q: int, H_kv: int, kw: Dict[str, object]) -> Callable:
    """PyTorch's own way to compute the variants in ``kw`` (see the module docstring)."""
    pos = torch.arange(T)
    visible = pos[None, :] <= pos[:, None]  # causal [T, T]
    if "window" in kw:
        visible &= pos[None, :] > pos[:, None] - int(kw["window"])
    bias = torch.zeros(T, T).masked_fill(~visible, float("-inf"))[None]  # [1, T, T]
    if "alibi_slopes" in kw:
        dist = (pos[:, None] - pos[None, :]).float()
        bias = bias - kw["alibi_slopes"][:, None, None] * dist  # [H_q, T, T]
    g = H_q // H_kv
    if "softcap" not in kw and "sinks" not in kw:
        mask = visible if "alibi_slopes" not in kw else bias

        def sdpa(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=g > 1)
        return sdpa
    cap = kw.get("softcap")
    sinks = kw.get("sinks")

    def eager(q, k, v):
        if g > 1:
            k = k.repeat_interleave(g, dim=1)
            v = v.repeat_interleave(g, dim=1)
        s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
        if cap is not None:
            s = cap * torch.tanh(s / cap)
        s = s + bias.to(s.dtype)  # (--dtype bf16/f16: the eager model computes in the dtype)
        if sinks is not None:
            col = sinks[None, :, None, None].expand(s.shape[0], -1, s.shape[2], 1).to(s.dtype)
            p = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1]
        else:
            p = torch.softmax(s, dim=-1)
        return p @ v
    return eager


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return tokenmix.cpu_features().get("model") or platform.processor() or "unknown"


def _loadavg() -> str:
    try:
        return "%.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        return "n/a"


def _time(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class GemmCeiling:
    """The GEMM ceiling of forward and backward for activations of ``dtype`` ("f32", "bf16",
    "f16") on ``threads`` threads: ``tokenmix bench``'s, through the extension (the C++ code of
    tools/bench/ceilings.hpp; nothing here measures a ceiling of its own). ``kind`` is the CLI's
    ``ceiling_kind``. The sgemm is measured in passes (:meth:`pass_gflops`) interleaved with the
    timed rounds and summarised by :func:`ceiling_spread`; oneDNN's bf16 GEMM once, here."""

    def __init__(self, dtype: str, threads: int):
        self.threads = threads
        self.bf16_gemm, self.kind = _C.bench_gemm_ceiling_choice(dtype)
        self._sgemm: Optional[Any] = None
        self._once = 0.0
        if self.bf16_gemm:
            self._once, self.kind = _C.bench_bf16_gemm_ceiling(threads, 10)
        else:
            self._sgemm = _C.BenchSgemmCeiling()
            self._sgemm.best_gflops(threads, 1)  # its warm-up, as the CLI's before a case

    def pass_gflops(self) -> float:
        """One pass: the best of 2 sgemm calls (the CLI's pass after each timed call, D-bench-10),
        then a pause while OpenBLAS's workers stop spinning (``bench_after_sgemm_pause_s``,
        D-bench-5), since here the next timed call is PyTorch's or ours, and either must not share
        the cores with them; the bf16 GEMM's one measurement."""
        if self._sgemm is None:
            return self._once
        gflops = self._sgemm.pass_gflops(self.threads, 2)
        time.sleep(_C.bench_after_sgemm_pause_s())
        return gflops


def ceiling_spread(passes: List[float]) -> "tuple[float, float, float]":
    """(median, min, max) of a ceiling's passes: the C++ bench's summary (ArgumentError when
    empty)."""
    return _C.bench_ceiling_spread(passes)


DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


TORCH_GEMM_BUDGET_S = 0.25  # seconds one torch.mm of the reduced-precision peer figure may take


def torch_gemm_size(dtype: torch.dtype, n: int = 2048, probe: int = 512,
                    budget_s: float = TORCH_GEMM_BUDGET_S) -> int:
    """The size of the reduced-precision peer GEMM: ``n``, unless a ``probe``³ ``torch.mm`` in
    ``dtype`` predicts more than ``budget_s`` seconds for one n³ GEMM; then the largest power of
    two ≥ ``probe`` within it. A CPU without bf16/f16 GEMM hardware (AVX2-only: PyTorch's scalar
    path, ≈ 1.3 GFLOP/s on AMD Zen 3) would take ~15 s per 2048³ GEMM, minutes for 10 of them."""
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(probe, probe, generator=gen).to(dtype)
    torch.mm(a, a)  # warm-up
    per_flop = min(_time(lambda: torch.mm(a, a)) for _ in range(2)) / (2.0 * probe ** 3)
    size = n
    while size > probe and per_flop * 2.0 * size ** 3 > budget_s:
        size //= 2
    return size


def torch_gemm_gflops(dtype: torch.dtype, repeats: int = 10, n: int = 2048) -> float:
    """GEMM rate of ``torch.mm`` in ``dtype`` (bfloat16 / float16) on torch's threads, n³: best
    GFLOP/s of ``repeats``. Kept here, not in C++: it is PyTorch's own GEMM in the dtype, a peer
    of its SDPA in the same process (what a model's other matrix products get), printed next to
    the ceiling, not used as one."""
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    torch.mm(a, b)  # warm-up
    best = min(_time(lambda: torch.mm(a, b)) for _ in range(repeats))
    return 2.0 * n ** 3 / best / 1e9


def run_case(T: int, args: argparse.Namespace, mode: str,
             ceiling: Optional[GemmCeiling] = None) -> Dict[str, float]:
    """Times one (T, mode) case; mode is "fwd" or "fwd+bwd". With ``ceiling``, one of its passes
    follows each round, and the result has the passes' median and spread (``ceiling_gflops``,
    ``ceiling_min``, ``ceiling_max``; NaN without)."""
    B, Hq, Hkv, D = args.batch, args.heads_q, args.heads_kv, args.head_dim
    dtype = DTYPES[args.dtype]
    gen = torch.Generator().manual_seed(1234 + T)
    q = torch.randn(B, Hq, T, D, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, T, D, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, T, D, generator=gen).to(dtype)
    g = torch.randn(B, Hq, T, D, generator=gen).to(dtype)
    gqa = Hq != Hkv

    extras = variant_kwargs(args, Hq)

    def torch_gqa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    def torch_expanded(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def ours(q, k, v):
        return tm_sdpa(q, k, v, is_causal=True, enable_gqa=gqa, **extras)

    if extras:
        torch_gqa = torch_variant(T, Hq, Hkv, extras)  # noqa: F811 — the variant's PyTorch way

    sides = {"torch": (torch_gqa, k, v), "tokenmix": (ours, k, v)}
    if args.torch_expanded and gqa and not extras:
        ke = k.repeat_interleave(Hq // Hkv, dim=1).contiguous()
        ve = v.repeat_interleave(Hq // Hkv, dim=1).contiguous()
        sides["torch_expanded"] = (torch_expanded, ke, ve)

    def make(fn, kk, vv) -> Callable[[], None]:
        if mode == "fwd":
            def call() -> None:
                with torch.no_grad():
                    fn(q, kk, vv)
        else:
            qq = q.clone().requires_grad_()
            kg = kk.clone().requires_grad_()
            vg = vv.clone().requires_grad_()

            def call() -> None:
                qq.grad = kg.grad = vg.grad = None
                fn(qq, kg, vg).backward(g)
        return call

    calls = {name: make(*spec) for name, spec in sides.items()}
    # Agreement check (forward) so a fast wrong answer cannot pass unnoticed.
    with torch.no_grad():
        err = (torch_gqa(q, k, v).float() - ours(q, k, v).float()).abs().max().item()
    for call in calls.values():  # warm-up
        call()
    times: Dict[str, List[float]] = {name: [] for name in calls}
    names = list(calls)
    passes: List[float] = []
    for r in range(args.repeats):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            times[name].append(_time(calls[name]))
        if ceiling is not None:
            passes.append(ceiling.pass_gflops())
    nan = float("nan")
    ceil_med, ceil_min, ceil_max = ceiling_spread(passes) if passes else (nan, nan, nan)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    best_torch = min(v for n, v in med.items() if n.startswith("torch"))
    torch_rounds = [
        min(times[n][i] for n in names if n.startswith("torch")) for i in range(args.repeats)
    ]
    ratios = [t / o for t, o in zip(torch_rounds, times["tokenmix"])]
    flops = case_flops(B, T, Hq, D, mode, args.window)
    return {
        "torch": med["torch"],
        "torch_expanded": med.get("torch_expanded", float("nan")),
        "tokenmix": med["tokenmix"],
        "best_torch": best_torch,
        "speedup": best_torch / med["tokenmix"],
        "speedup_rounds": statistics.median(ratios),
        "gflops": flops / med["tokenmix"] / 1e9,
        "torch_gflops": flops / best_torch / 1e9,
        "max_abs_err": err,
        "ceiling_gflops": ceil_med,
        "ceiling_min": ceil_min,
        "ceiling_max": ceil_max,
    }


# ---------------------------------------------------------------------------------------------
# --ring N: context parallelism (tokenmix.distributed.ring_attention, SPEC "Context parallelism")


def _rss_kib() -> int:
    """Resident set size of this process now, in KiB (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)
    except (OSError, ValueError, IndexError):
        return 0


def _ring_child(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One process of a --ring run: rank ``spec["rank"]`` of ``spec["world"]`` (world 1: the
    single-process baseline, plain tokenmix.torch on the full sequence, no process group).
    Allocates only this rank's shard, times each mode, counts bytes sent, records peak RSS."""
    import torch.distributed as dist

    import tokenmix.distributed as tmd

    torch.set_num_threads(spec["threads"])
    world, rank = spec["world"], spec["rank"]
    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"tcp://{spec['addr']}:{spec['port']}", rank=rank,
            world_size=world, timeout=datetime.timedelta(seconds=spec["timeout"]))
        dist.barrier()
    # After the process group is up: its own buffers and threads do not grow with T.
    rss_start = _rss_kib()
    B, Hq, Hkv, D, T = spec["batch"], spec["heads_q"], spec["heads_kv"], spec["head_dim"], \
        spec["seq"]
    T_l = T // world
    gen = torch.Generator().manual_seed(1234 + rank)
    q = torch.randn(B, Hq, T_l, D, generator=gen)
    k = torch.randn(B, Hkv, T_l, D, generator=gen)
    v = torch.randn(B, Hkv, T_l, D, generator=gen)
    g = torch.randn(B, Hq, T_l, D, generator=gen)
    gqa = Hq != Hkv

    def attn(qq, kk, vv):
        if world == 1:
            return tm_sdpa(qq, kk, vv, is_causal=True, enable_gqa=gqa)
        return tmd.ring_attention(qq, kk, vv, layout=spec["layout"], enable_gqa=gqa)

    def slowest(seconds: float) -> float:
        """The round's time is the slowest rank's."""
        if world == 1:
            return seconds
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    result: Dict[str, Any] = {"rank": rank, "modes": {}}
    for mode in spec["modes"]:
        if mode == "fwd":
            def call() -> None:
                with torch.no_grad():
                    attn(q, k, v)
        else:
            qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

            def call() -> None:
                qg.grad = kg.grad = vg.grad = None
                attn(qg, kg, vg).backward(g)
        for _ in range(spec["warmup"]):
            call()
        tmd.reset_comm_stats()
        times = []
        for _ in range(spec["repeats"]):
            if world > 1:
                dist.barrier()
            times.append(slowest(_time(call)))
        stats = tmd.comm_stats()
        result["modes"][mode] = {
            "median_s": statistics.median(times), "times_s": times,
            "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "bytes_sent": stats["bytes_sent"] // spec["repeats"],
            "messages_sent": stats["messages_sent"] // spec["repeats"],
        }
    result["rss_start_kib"] = rss_start
    result["peak_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if world > 1:
        dist.destroy_process_group()
    return result


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_world(spec: Dict[str, Any], world: int) -> List[Dict[str, Any]]:
    """Starts ``world`` processes of ``python -m tokenmix.bench --ring-child`` (one per rank),
    waits for them (killing all on timeout or failure) and returns their results by rank."""
    with tempfile.TemporaryDirectory(prefix="tokenmix-ring-") as tmp:
        port = _free_port()
        procs = []
        for rank in range(world):
            child = dict(spec, world=world, rank=rank, port=port, addr="127.0.0.1",
                         out=os.path.join(tmp, f"rank{rank}.json"))
            env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tokenmix.bench", "--ring-child", json.dumps(child)],
                env=env, cwd=tmp))
        deadline = time.monotonic() + spec["timeout"]
        try:
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"--ring: the world of {world} did not finish within "
                               f"{spec['timeout']} s (--ring-timeout)") from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        codes = [p.returncode for p in procs]
        if any(codes):
            raise RuntimeError(f"--ring: a process of the world of {world} failed (exit codes "
                               f"{codes})")
        results = []
        for rank in range(world):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                results.append(json.load(f))
        return results


def ring_main(args: argparse.Namespace) -> int:
    """``--ring N``: forward and forward+backward of causal self-attention at each T, over N
    gloo processes on this machine (``--threads`` threads each, default 1; layout
    ``--ring-layout``) against one process with the same threads on the full sequence.

    Reported per (T, pass): both median times (a round's time is its slowest rank's), the
    speedup and the parallel efficiency E = t_1 / (N · t_N), the bytes each rank sent per call
    (K/V chunks; in the backward also the dK/dV accumulators), and the peak resident memory per
    process (``getrusage`` ru_maxrss at the end of each pass; "above start" subtracts the RSS
    after ``import torch`` and the process group's set-up, which is what falls ∝ 1/N). Then,
    from these figures, the expected efficiency on a network of 10 and 100 Gbit/s (docs/design.md, "Context parallelism"): each of the N steps takes
    max(t_N / N, bytes per step · 8 / bandwidth) when the transfer overlaps the compute, so
    E(bw) = t_1 / (N · Σ max(...)).
    """
    N = args.ring
    seqs = args.seq or [16384]
    threads = args.threads if args.threads > 0 else 1
    modes = ["fwd", "fwd+bwd"] if args.mode == "both" else [args.mode]
    div = 2 * N if args.ring_layout == "zigzag" else N
    for T in seqs:
        if T % div != 0:
            print(f"python -m tokenmix.bench: error: --ring {N} with layout {args.ring_layout} "
                  f"needs T divisible by {div}; got T={T}", file=sys.stderr)
            return 2
    print(f"CPU: {_cpu_model()} ({os.cpu_count()} logical CPUs)")
    print(f"torch {torch.__version__}, tokenmix {tokenmix.__version__} (kernel path "
          f"{tokenmix.resolve_isa()}), Python {platform.python_version()}")
    print(f"ring attention: {N} gloo processes on 127.0.0.1, layout {args.ring_layout}, "
          f"{threads} thread(s) each, vs 1 process with {threads} thread(s); B={args.batch} "
          f"H_q={args.heads_q} H_kv={args.heads_kv} d_h={args.head_dim}, causal, float32; "
          f"median of {args.repeats} rounds after {args.ring_warmup} warm-up call(s)")
    print(f"load average before: {_loadavg()}")
    sys.stdout.flush()
    rows = []
    for T in seqs:
        spec = {"seq": T, "batch": args.batch, "heads_q": args.heads_q,
                "heads_kv": args.heads_kv, "head_dim": args.head_dim, "threads": threads,
                "modes": modes, "repeats": args.repeats, "warmup": args.ring_warmup,
                "layout": args.ring_layout, "timeout": args.ring_timeout}
        single = _run_world(spec, 1)[0]
        ranks = _run_world(spec, N)
        mib = 1024.0
        for mode in modes:
            # Peak RSS up to the end of this mode (fwd runs first, so fwd+bwd's includes it).
            peak1 = single["modes"][mode]["peak_rss_kib"] / mib
            peak1_above = (single["modes"][mode]["peak_rss_kib"] - single["rss_start_kib"]) / mib
            peakN = max(r["modes"][mode]["peak_rss_kib"] for r in ranks) / mib
            peakN_above = max(r["modes"][mode]["peak_rss_kib"] - r["rss_start_kib"]
                              for r in ranks) / mib
            t1 = single["modes"][mode]["median_s"]
            tN = ranks[0]["modes"][mode]["median_s"]  # every rank holds the same (max) figure
            sent = max(r["modes"][mode]["bytes_sent"] for r in ranks)
            eff = t1 / (N * tN)
            net = {}
            for gbit in (10, 100):
                step = max(tN / N, sent / N * 8 / (gbit * 1e9))
                net[gbit] = t1 / (N * N * step)
            rows.append((T, mode, t1, tN, eff, sent, peak1, peak1_above, peakN, peakN_above,
                         net))
            print(f"T={T:6d} {mode:8s} 1 process {t1 * 1e3:10.3f} ms  {N} processes "
                  f"{tN * 1e3:10.3f} ms  speedup {t1 / tN:.2f}x  efficiency {eff:.2f}  "
                  f"sent/rank {sent} B ({sent / 2**20:.1f} MiB)  peak RSS/process {peak1:.0f} -> "
                  f"{peakN:.0f} MiB (above start {peak1_above:.0f} -> {peakN_above:.0f} MiB)  "
                  f"expected efficiency at 10 Gbit/s {net[10]:.2f}, 100 Gbit/s {net[100]:.2f}")
            sys.stdout.flush()
    if args.markdown:
        print()
        print(f"| T | pass | 1 process (ms) | {N} processes (ms) | speedup | efficiency | "
              "sent per rank (MiB) | peak RSS above start, 1 → N (MiB) | "
              "expected efficiency 10 / 100 Gbit/s |")
        print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for T, mode, t1, tN, eff, sent, _, p1a, _, pNa, net in rows:
            print(f"| {T} | {mode} | {t1 * 1e3:.1f} | {tN * 1e3:.1f} | {t1 / tN:.2f}x | "
                  f"{eff:.2f} | {sent / 2**20:.1f} | {p1a:.0f} → {pNa:.0f} | "
                  f"{net[10]:.2f} / {net[100]:.2f} |")
    print(f"load average after: {_loadavg()}")
    return 0



# ---------------------------------------------------------------------------------------------
# --decode: one-token decode against a KV cache of each dtype (SPEC 4.8, "Quantized KV cache")

CACHE_DTYPES = ["f32", "bf16", "f16", "int8", "fp8_e4m3"]


def run_decode_case(T_k: int, args: argparse.Namespace, dtypes: List[str], read: Any,
                    threads: int) -> Dict[str, Dict[str, float]]:
    """One T_k: a cache per dtype of ``dtypes`` filled with the same N(0, 1) K/V (appended in
    chunks of 4096 positions), one warm-up step each, then ``--repeats`` rounds, each a
    streaming-read pass of ``read`` (the extension's ``BenchStreamRead``: ``tokenmix bench
    decode``'s ceiling, the C++ code) and one decode step per dtype (order alternating round by
    round). Kept in Python rather than running the CLI's decode case: that case's error slice
    needs the float64 oracle, which the wheel does not carry, and this one times what a Python
    generation loop pays (the binding's call) for every cache dtype side by side.
    Returns per dtype the median step time, the decode bytes (cache.decode_bytes), the cache's
    storage bytes, the median ceiling and the step's output."""
    B, Hq, Hkv, D = args.batch, args.heads_q, args.heads_kv, args.head_dim
    caches = {dt: tokenmix.KVCache(1, B, Hkv, D, T_k, dtype=dt) for dt in dtypes}
    rng = np.random.default_rng(4321 + T_k)
    for t0 in range(0, T_k, 4096):
        n = min(4096, T_k - t0)
        k = rng.standard_normal((B, n, Hkv, D), dtype=np.float32)
        v = rng.standard_normal((B, n, Hkv, D), dtype=np.float32)
        for cache in caches.values():
            cache.append(0, k, v)
    q = rng.standard_normal((B, 1, Hq, D), dtype=np.float32)
    outs = {dt: np.full((B, 1, Hq, D), np.nan, np.float32) for dt in dtypes}

    def step(dt: str) -> None:
        tokenmix.attention_decode(q, caches[dt], 0, out=outs[dt], threads=threads)

    for dt in dtypes:  # warm-up (and the outputs compared below)
        step(dt)
    times: Dict[str, List[float]] = {dt: [] for dt in dtypes}
    ceiling: List[float] = []
    for r in range(args.repeats):
        ceiling.append(read.pass_gbps(threads))
        for dt in (dtypes if r % 2 == 0 else dtypes[::-1]):
            times[dt].append(_time(lambda: step(dt)))
    res = {}
    for dt in dtypes:
        res[dt] = {"seconds": statistics.median(times[dt]),
                   "seconds_min": min(times[dt]), "seconds_max": max(times[dt]),
                   "bytes": float(caches[dt].decode_bytes(0, 0, B)),
                   "storage_bytes": float(caches[dt].storage_bytes),
                   "ceiling_gbps": ceiling_spread(ceiling)[0], "out": outs[dt]}
    return res


def decode_main(args: argparse.Namespace) -> int:
    """``--decode``: per T_k and cache dtype the median time of one decode step (B sequences,
    one new token each, causal against T_k cached positions), the K/V bytes it reads per second
    (decode bytes, SPEC "Useful-work counts": for int8 / fp8 what is read, elements, scales
    and the open K tile) and
    that as a fraction of the streaming-read ceiling of the same rounds, tokens per second
    (B / time), tokens/s and cache bytes (storage) relative to the bf16 cache, and the largest
    |O − O_f32| against the fp32 cache's output on the same K/V (the error of storing K/V in
    the dtype). The f32 and bf16 caches are run whether listed or not (the references); only
    the listed dtypes are printed. ``--json`` rows also give the fastest and slowest round
    (``ms_min``, ``ms_max``): how far a shared machine moved the figure in this run."""
    bad = [dt for dt in args.cache_dtype if dt not in CACHE_DTYPES]
    if bad or not args.cache_dtype:
        print(f"python -m tokenmix.bench: error: --cache-dtype must be among "
              f"{', '.join(CACHE_DTYPES)}; got {' '.join(args.cache_dtype)}", file=sys.stderr)
        return 2
    if any(t < 1 for t in args.cache_tokens) or args.stream_mib < 1:
        print("python -m tokenmix.bench: error: --cache-tokens and --stream-mib must be >= 1; "
              f"got {args.cache_tokens} and {args.stream_mib}", file=sys.stderr)
        return 2
    threads = args.threads if args.threads > 0 else tokenmix.default_threads()
    shown = list(dict.fromkeys(args.cache_dtype))
    run = [dt for dt in CACHE_DTYPES if dt in shown or dt in ("f32", "bf16")]
    read = _C.BenchStreamRead(args.stream_mib * 2**20)  # tokenmix bench decode's read ceiling
    ceiling_kind = read.kind
    if not args.json:
        print(f"CPU: {_cpu_model()} ({os.cpu_count()} logical CPUs)")
        print(f"tokenmix {tokenmix.__version__} (kernel path {tokenmix.resolve_isa()}), NumPy "
              f"{np.__version__}, Python {platform.python_version()}")
        print(f"decode: B={args.batch} T_new=1 H_q={args.heads_q} H_kv={args.heads_kv} "
              f"d_h={args.head_dim}, q float32, {threads} thread(s); median of {args.repeats} "
              f"rounds (each: a ceiling pass, then one step per cache dtype)")
        print(f"ceiling: streaming read of a {args.stream_mib} MiB float32 buffer (tokenmix bench "
              f"decode's, {ceiling_kind}: {threads} thread(s), the widest vectors), median of the "
              "rounds")
        print(f"load average before: {_loadavg()}")
        sys.stdout.flush()
    rows = []
    for T_k in args.cache_tokens:
        res = run_decode_case(T_k, args, run, read, threads)
        ref, base = res["f32"], res["bf16"]
        tps_bf16 = args.batch / base["seconds"]
        for dt in shown:
            r = res[dt]
            gbps = r["bytes"] / r["seconds"] / 1e9
            tps = args.batch / r["seconds"]
            row = {"op": "decode", "cache_dtype": dt, "batch": args.batch, "tnew": 1,
                   "tk": T_k, "hq": args.heads_q, "hkv": args.heads_kv, "dh": args.head_dim,
                   "threads": threads, "isa": tokenmix.resolve_isa(),
                   "ms": r["seconds"] * 1e3, "ms_min": r["seconds_min"] * 1e3,
                   "ms_max": r["seconds_max"] * 1e3, "gbps": gbps,
                   "ceiling_gbps": r["ceiling_gbps"],
                   "ceiling_kind": ceiling_kind, "ratio": gbps / r["ceiling_gbps"],
                   "tokens_per_s": tps, "tokens_per_s_vs_bf16": tps / tps_bf16,
                   "cache_bytes": int(r["storage_bytes"]),
                   "cache_bytes_vs_bf16": r["storage_bytes"] / base["storage_bytes"],
                   "err_vs_unquantized": float(np.abs(r["out"].astype(np.float64)
                                                      - ref["out"]).max())}
            rows.append(row)
            if args.json:
                print(json.dumps(row))
            elif not args.markdown:
                print(f"T_k={T_k:6d} {dt:8s} {row['ms']:10.4f} ms {gbps:7.2f} GB/s "
                      f"(ceiling {row['ceiling_gbps']:.2f}, ratio {row['ratio']:.2f})  "
                      f"{tps:9.1f} tokens/s ({row['tokens_per_s_vs_bf16']:.2f}x bf16)  cache "
                      f"{row['cache_bytes_vs_bf16']:.3f}x bf16  err_vs_unquantized "
                      f"{row['err_vs_unquantized']:.2e}")
            sys.stdout.flush()
    if args.markdown and not args.json:
        print()
        print("| T_k | cache | ms | GB/s | ceiling GB/s | ratio | tokens/s | tokens/s vs bf16 | "
              "cache bytes vs bf16 | err vs unquantized |")
        print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in rows:
            print(f"| {r['tk']} | {r['cache_dtype']} | {r['ms']:.4f} | {r['gbps']:.2f} | "
                  f"{r['ceiling_gbps']:.2f} | {r['ratio']:.2f} | {r['tokens_per_s']:.1f} | "
                  f"{r['tokens_per_s_vs_bf16']:.2f}x | {r['cache_bytes_vs_bf16']:.3f} | "
                  f"{r['err_vs_unquantized']:.2e} |")
    if not args.json:
        print(f"load average after: {_loadavg()}")
    return 0


def main(argv: List[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--model" in argv or "--overhead" in argv:  # whole-model and per-call timings
        from . import _bench_model
        return _bench_model.main(argv)
    p = argparse.ArgumentParser(
        prog="python -m tokenmix.bench", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--seq", type=int, nargs="+", default=None,
        help="sequence lengths T (default 512 2048 8192; with --ring 16384)",
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads-q", type=int, default=32)
    p.add_argument("--heads-kv", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument(
        "--threads", type=int, default=0,
        help="threads for both sides (0 = torch's default; with --ring: per process, default 1)",
    )
    p.add_argument("--repeats", type=int, default=None,
                   help="timed rounds per case (median reported; default 5, with --ring 3)")
    p.add_argument("--mode", choices=["fwd", "fwd+bwd", "both"], default="both")
    p.add_argument("--dtype", choices=list(DTYPES), default="f32",
                   help="dtype of q, k, v (and out, gradients) on both sides")
    p.add_argument("--torch-expanded", action="store_true",
                   help="also time PyTorch on K/V expanded to H_q heads; compare with the faster")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--ring", type=int, default=None, metavar="N",
                   help="context parallelism: ring attention over N local gloo processes vs 1")
    p.add_argument("--ring-layout", choices=["zigzag", "contiguous"], default="zigzag")
    p.add_argument("--ring-warmup", type=int, default=1, help="untimed calls per mode (--ring)")
    p.add_argument("--ring-timeout", type=int, default=3600,
                   help="seconds a --ring world may take before its processes are killed")
    p.add_argument("--ring-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--decode", action="store_true",
                   help="one-token decode against a KV cache of each --cache-dtype")
    p.add_argument("--cache-tokens", type=int, nargs="+", default=[4096, 32768],
                   help="cached positions T_k (--decode; default 4096 32768)")
    p.add_argument("--cache-dtype", nargs="+", default=list(CACHE_DTYPES),
                   help="KV-cache dtypes (--decode; default: f32 bf16 f16 int8 fp8_e4m3)")
    p.add_argument("--stream-mib", type=int, default=1024,
                   help="size of the streaming-read ceiling's buffer in MiB (--decode)")
    p.add_argument("--json", action="store_true",
                   help="--decode: one JSON object per row instead of the text")
    p.add_argument("--window", type=int, default=None,
                   help="sliding window W >= 1 (the last W positions up to the query's own)")
    p.add_argument("--softcap", type=float, default=None, help="logit soft-capping c > 0")
    p.add_argument("--alibi", action="store_true",
                   help="ALiBi with the standard slopes 2^(-8(h+1)/H_q)")
    p.add_argument("--sinks", type=float, default=None,
                   help="one attention-sink logit for every query head")
    args = p.parse_args(argv)
    if args.ring_child is not None:
        spec = json.loads(args.ring_child)
        result = _ring_child(spec)
        with open(spec["out"], "w") as f:
            json.dump(result, f)
        return 0
    if args.repeats is None:
        args.repeats = 3 if args.ring is not None else 5
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.window is not None and args.window < 1:
        p.error("--window must be >= 1")
    if args.softcap is not None and not (0.0 < args.softcap < float("inf")):
        p.error("--softcap must be a finite number > 0")
    if args.sinks is not None and args.sinks != args.sinks:
        p.error("--sinks must be a number")
    if args.decode:
        if args.ring is not None or (args.window is not None or args.softcap is not None
                                     or args.alibi or args.sinks is not None):
            p.error("--decode times plain causal decode; it takes no --ring, --window, "
                    "--softcap, --alibi or --sinks")
        return decode_main(args)
    if args.ring is not None:
        if args.ring < 1:
            p.error("--ring must be >= 1")
        if args.ring_warmup < 0 or args.ring_timeout < 1:
            p.error("--ring-warmup must be >= 0 and --ring-timeout >= 1")
        if (args.window is not None or args.softcap is not None or args.alibi
                or args.sinks is not None):
            p.error("--ring times plain causal attention; it takes no --window, --softcap, "
                    "--alibi or --sinks")
        return ring_main(args)
    if args.seq is None:
        args.seq = [512, 2048, 8192]
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    modes = ["fwd", "fwd+bwd"] if args.mode == "both" else [args.mode]

    print(f"CPU: {_cpu_model()} ({os.cpu_count()} logical CPUs)")
    print(f"torch {torch.__version__}, tokenmix {tokenmix.__version__} (kernel path "
          f"{tokenmix.resolve_isa()}), Python {platform.python_version()}, torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    print(f"threads: {threads} (both sides); B={args.batch} H_q={args.heads_q} "
          f"H_kv={args.heads_kv} d_h={args.head_dim}, causal, "
          f"{str(DTYPES[args.dtype]).replace('torch.', '')}, layout [B,H,T,d_h]; "
          f"median of {args.repeats} rounds")
    variants = [f"window={args.window}" if args.window is not None else "",
                f"softcap={args.softcap:g}" if args.softcap is not None else "",
                "alibi" if args.alibi else "",
                f"sinks={args.sinks:g}" if args.sinks is not None else ""]
    if any(variants):
        print("score variants: " + " ".join(v for v in variants if v) +
              " (PyTorch side: " + ("eager attention" if args.softcap is not None or
                                    args.sinks is not None else "SDPA with an explicit attn_mask")
              + ")")
    print(f"load average before: {_loadavg()}")
    sys.stdout.flush()
    # The ceiling: tokenmix bench's for the dtype (GemmCeiling: the C++ code, kind and passes).
    gemm = GemmCeiling(args.dtype, threads)
    if gemm.bf16_gemm:
        print(f"{args.dtype} GEMM ceiling (tokenmix bench's, {gemm.kind}, {threads} thread(s), "
              f"best of 10, measured once): {gemm.pass_gflops():.1f} GFLOP/s")
    else:
        print(f"{args.dtype} GEMM ceiling (tokenmix bench's, {gemm.kind}: OpenBLAS "
              f"{_C.bench_sgemm_core()} kernel, {threads} thread(s), a pass of 2 calls after each "
              "round): per case the median of its passes (min-max)")
        warning = _C.bench_sgemm_ceiling_warning()
        if warning:
            print(f"warning: {warning}")
    if args.dtype != "f32":
        # PyTorch's own GEMM in the dtype: a peer figure (torch_gemm_gflops), not the ceiling.
        size = torch_gemm_size(DTYPES[args.dtype])
        peer = torch_gemm_gflops(DTYPES[args.dtype], n=size)
        print(f"PyTorch's {args.dtype} GEMM (torch.mm {size}^3, {threads} thread(s), best of 10"
              + ("" if size == 2048 else
                 f"; 2048^3 would take over {TORCH_GEMM_BUDGET_S} s per GEMM on this CPU")
              + f"): {peer:.1f} GFLOP/s, a peer figure, not the ceiling")
    sys.stdout.flush()

    rows = []
    for T in args.seq:
        for mode in modes:
            r = run_case(T, args, mode, gemm)
            rows.append((T, mode, r))
            ceiling = r["ceiling_gflops"]
            if not args.markdown:
                exp = "" if r["torch_expanded"] != r["torch_expanded"] else \
                    f"  torch(expanded KV) {r['torch_expanded'] * 1e3:9.1f} ms"
                print(f"T={T:6d} {mode:8s} torch {r['torch'] * 1e3:9.1f} ms{exp}  tokenmix "
                      f"{r['tokenmix'] * 1e3:9.1f} ms  speedup {r['speedup']:.2f}x "
                      f"(per-round median {r['speedup_rounds']:.2f}x)  tokenmix "
                      f"{r['gflops']:.1f} GFLOP/s ({r['gflops'] / ceiling:.2f} of GEMM), torch "
                      f"{r['torch_gflops']:.1f} ({r['torch_gflops'] / ceiling:.2f})  "
                      f"GEMM ceiling {ceiling:.1f} ({r['ceiling_min']:.1f}-"
                      f"{r['ceiling_max']:.1f})  max|diff| {r['max_abs_err']:.1e}")
                sys.stdout.flush()
    if args.markdown:
        print()
        print("| T | pass | PyTorch SDPA, best (ms) | tokenmix (ms) | speedup | per-round median | "
              "tokenmix GFLOP/s (of GEMM) | PyTorch GFLOP/s (of GEMM) | GEMM ceiling (spread) |")
        print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for T, mode, r in rows:
            ceiling = r["ceiling_gflops"]
            print(f"| {T} | {mode} | {r['best_torch'] * 1e3:.1f} | {r['tokenmix'] * 1e3:.1f} | "
                  f"{r['speedup']:.2f}x | {r['speedup_rounds']:.2f}x | {r['gflops']:.1f} "
                  f"({r['gflops'] / ceiling:.2f}) | {r['torch_gflops']:.1f} "
                  f"({r['torch_gflops'] / ceiling:.2f}) | {ceiling:.1f} ({r['ceiling_min']:.1f}-"
                  f"{r['ceiling_max']:.1f}) |")
    print(f"load average after: {_loadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
