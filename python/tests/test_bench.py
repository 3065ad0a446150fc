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
