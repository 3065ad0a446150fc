"""Smoke test of ``python -m tokenmix.bench`` on a tiny shape: it runs both passes, prints the
same-run GEMM ceiling and a speedup per case, and the two sides agree on the forward."""

import re

from tokenmix import bench


def test_bench_prints_each_case_with_ceiling_and_agreement(capsys):
    assert bench.main(["--seq", "64", "65", "--repeats", "1", "--heads-q", "4", "--heads-kv", "2",
                       "--head-dim", "16", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    ceiling = re.search(r"fp32 GEMM ceiling \(OpenBLAS sgemm via numpy\.matmul 2048\^3, 1 thread\(s\), "
                        r"best of 10\): ([0-9.]+) GFLOP/s", out)
    assert ceiling and float(ceiling.group(1)) > 0.0
    cases = re.findall(r"T=\s*(\d+) (fwd\+bwd|fwd)\s.*speedup ([0-9.]+)x.*max\|diff\| ([0-9.e+-]+)", out)
    assert sorted((int(t), m) for t, m, _, _ in cases) == [(64, "fwd"), (64, "fwd+bwd"), (65, "fwd"), (65, "fwd+bwd")]
    for _, _, speedup, diff in cases:
        assert float(speedup) > 0.0
        assert float(diff) < 1e-5  # |O_torch - O_tokenmix| on unit-normal inputs


def test_bench_reduced_precision_side_by_side(capsys):
    """--dtype bf16 / f16: both sides in that dtype, a GEMM ceiling in that dtype, and the two
    sides' outputs agree to a few units of the dtype's rounding (unit-normal inputs, |O| < 4)."""
    for dtype, name, bound in (("bf16", "bfloat16", 5e-2), ("f16", "float16", 8e-3)):
        assert bench.main(["--seq", "64", "--repeats", "1", "--heads-q", "4", "--heads-kv", "2",
                           "--head-dim", "16", "--threads", "1", "--dtype", dtype]) == 0
        out = capsys.readouterr().out
        assert f"causal, {name}, layout" in out
        ceiling = re.search(rf"{dtype} GEMM ceiling \(torch\.mm {dtype} 2048\^3, 1 thread\(s\), "
                            r"best of 10\): ([0-9.]+) GFLOP/s", out)
        assert ceiling and float(ceiling.group(1)) > 0.0
        cases = re.findall(r"T=\s*(\d+) (fwd\+bwd|fwd)\s.*speedup ([0-9.]+)x.*"
                           r"max\|diff\| ([0-9.e+-]+)", out)
        assert sorted((int(t), m) for t, m, _, _ in cases) == [(64, "fwd"), (64, "fwd+bwd")]
        for _, _, speedup, diff in cases:
            assert float(speedup) > 0.0
            assert float(diff) < bound, (dtype, diff)


def test_bench_variants_passthrough(capsys):
    """--window/--softcap/--alibi/--sinks reach tokenmix's extras; PyTorch computes the same
    variant its own way (mask or eager), and the two agree."""
    for extra, side in ((["--window", "16", "--alibi"], "SDPA with an explicit attn_mask"),
                        (["--softcap", "5", "--sinks", "0.5", "--window", "8"], "eager attention")):
        assert bench.main(["--seq", "40", "--repeats", "1", "--heads-q", "4", "--heads-kv", "2",
                           "--head-dim", "16", "--threads", "1", "--mode", "fwd"] + extra) == 0
        out = capsys.readouterr().out
        assert "score variants: " in out and side in out
        diff = re.search(r"max\|diff\| ([0-9.e+-]+)", out)
        assert diff and float(diff.group(1)) < 1e-5, out
    # useful work counts only the window's pairs: rows t < W see t + 1 keys, the others W
    assert bench.case_flops(1, 40, 4, 16, "fwd", window=8) == 4.0 * 16 * 4 * (36 + 32 * 8)
    assert bench.case_flops(1, 40, 4, 16, "fwd", window=100) == bench.case_flops(1, 40, 4, 16,
                                                                                  "fwd")
    for bad in (["--window", "0"], ["--softcap", "-1"]):
        try:
            bench.main(["--seq", "8"] + bad)
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(bad)


def test_bench_ring_reports_efficiency_bytes_and_memory(capsys):
    """--ring 2 (SPEC "Context parallelism"): two gloo processes against one, on a tiny shape.
    Each pass reports both times, the efficiency t_1 / (N t_N), the K/V bytes each rank sent and
    the peak RSS per process; the markdown table has one row per pass."""
    T, Hkv, D = 64, 1, 16
    assert bench.main(["--ring", "2", "--seq", str(T), "--heads-q", "2", "--heads-kv", str(Hkv),
                       "--head-dim", str(D), "--repeats", "1", "--markdown"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"T=\s*(\d+) (fwd\+bwd|fwd)\s+1 process\s+([0-9.]+) ms\s+2 processes\s+"
                      r"([0-9.]+) ms.*efficiency ([0-9.]+)\s+sent/rank (\d+) B.*"
                      r"above start (-?\d+) -> (-?\d+) MiB", out)
    assert [(int(t), m) for t, m, *_ in rows] == [(T, "fwd"), (T, "fwd+bwd")], out
    kv_bytes = 2 * Hkv * (T // 2) * D * 4  # one [2, B, H_kv, T_local, E] float32 chunk
    for _, mode, t1, t2, eff, sent, _, _ in rows:
        assert float(t1) > 0 and float(t2) > 0
        # E = t_1 / (N t_N), from the unrounded times: the printed ms are ±0.05, E ±0.005
        t1f, t2f, e = float(t1), float(t2), float(eff)
        low = max(t1f - 0.05, 0.0) / (2 * (t2f + 0.05)) - 0.005
        high = (t1f + 0.05) / (2 * max(t2f - 0.05, 1e-9)) + 0.005
        assert low <= e <= high, (t1, t2, eff)
        # P = 2: one K/V hop forward; the backward adds its hop and two dK/dV hops (float32).
        assert int(sent) == (kv_bytes if mode == "fwd" else 4 * kv_bytes), (mode, sent)
    assert out.count("| 64 | fwd") == 2  # "fwd" and "fwd+bwd" rows of the table
