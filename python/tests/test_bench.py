"""Smoke test of ``python -m tokenmix.bench`` on a tiny shape: it runs both passes, prints the
same-run GEMM ceiling and a speedup per case, and the two sides agree on the forward."""

import re

import torch

from tokenmix import bench


def test_bench_prints_each_case_with_ceiling_and_agreement(capsys):
    assert bench.main(["--seq", "64", "65", "--repeats", "1", "--heads-q", "4", "--heads-kv", "2",
                       "--head-dim", "16", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    ceiling = re.search(r"fp32 GEMM ceiling \(OpenBLAS sgemm via numpy\.matmul 2048\^3, 1 thread\(s\), "
                        r"best of 10\): ([0-9.]+) GFLOP/s", out)
    assert ceiling and float(ceiling.group(1)) > 0.0
    assert re.search(r"numpy's OpenBLAS sgemm kernel: \w+", out)
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
        # The faster of torch.mm in the dtype (2048^3, or smaller where that GEMM would take
        # over 0.25 s: no bf16/f16 GEMM instructions) and the fp32 sgemm over widened operands,
        # named, with the other's rate.
        mm = rf"torch\.mm {dtype} (?:2048|1024|512)\^3, 1 thread\(s\), best of 10[^)]*"
        own = re.search(rf"{dtype} GEMM ceiling \({mm}\): ([0-9.]+) GFLOP/s "
                        r"\(fp32 sgemm: ([0-9.]+)\)", out)
        widened = re.search(rf"{dtype} GEMM ceiling \(OpenBLAS sgemm via numpy\.matmul 2048\^3 "
                            r"over the widened operands, 1 thread\(s\), best of 10\): "
                            rf"([0-9.]+) GFLOP/s, the fastest GEMM here \({mm}: ([0-9.]+) "
                            r"GFLOP/s\)", out)
        assert (own is None) != (widened is None), out
        ceiling, other = map(float, (own or widened).groups())
        assert ceiling > 0.0 and ceiling >= other
        cases = re.findall(r"T=\s*(\d+) (fwd\+bwd|fwd)\s.*speedup ([0-9.]+)x.*"
                           r"max\|diff\| ([0-9.e+-]+)", out)
        assert sorted((int(t), m) for t, m, _, _ in cases) == [(64, "fwd"), (64, "fwd+bwd")]
        for _, _, speedup, diff in cases:
            assert float(speedup) > 0.0
            assert float(diff) < bound, (dtype, diff)


def test_gemm_ceiling_torch_size_fits_the_budget():
    """The reduced-precision ceiling's GEMM size: 2048 when the budget allows it, otherwise the
    largest power of two >= the probe size whose predicted time fits (never below the probe)."""
    assert bench.gemm_ceiling_torch_size(torch.bfloat16, budget_s=1e9) == 2048
    assert bench.gemm_ceiling_torch_size(torch.bfloat16, budget_s=0.0) == 512
    assert bench.gemm_ceiling_torch_size(torch.float16, probe=256, budget_s=0.0) == 256
    size = bench.gemm_ceiling_torch_size(torch.bfloat16)
    assert size in (512, 1024, 2048)


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
        # E = t_1 / (N t_N), from the unrounded times: the printed ms are ±half (three
        # decimals: at T = 64 one process can take under 0.05 ms), E ±0.005
        half = 0.0005
        t1f, t2f, e = float(t1), float(t2), float(eff)
        low = max(t1f - half, 0.0) / (2 * (t2f + half)) - 0.005
        high = (t1f + half) / (2 * max(t2f - half, 1e-9)) + 0.005
        assert low <= e <= high, (t1, t2, eff)
        # P = 2: one K/V hop forward; the backward adds its hop and two dK/dV hops (float32).
        assert int(sent) == (kv_bytes if mode == "fwd" else 4 * kv_bytes), (mode, sent)
    assert out.count("| 64 | fwd") == 2  # "fwd" and "fwd+bwd" rows of the table


def test_bench_decode_all_cache_dtypes_side_by_side(capsys):
    """--decode (issue 15 item 4): one row per cache dtype (all five by default) for each T_k,
    with the same-run streaming-read ceiling; the printed ratios follow from the printed
    figures, bf16's relative speed and size are exactly 1, the fp32 cache is the unquantized
    reference (error exactly 0) and the others' errors are of their storage's rounding."""
    import json

    assert bench.main(["--decode", "--cache-tokens", "70", "--repeats", "1", "--threads", "1",
                       "--heads-q", "4", "--heads-kv", "2", "--head-dim", "16",
                       "--stream-mib", "8"]) == 0
    out = capsys.readouterr().out
    assert "ceiling: streaming read of a 8 MiB float32 buffer" in out
    rows = re.findall(r"T_k=\s*(\d+) (\S+)\s+([0-9.]+) ms\s+([0-9.]+) GB/s \(ceiling ([0-9.]+), "
                      r"ratio ([0-9.]+)\)\s+([0-9.]+) tokens/s \(([0-9.]+)x bf16\)\s+cache "
                      r"([0-9.]+)x bf16\s+err_vs_unquantized ([0-9.e+-]+)", out)
    assert [(int(t), dt) for t, dt, *_ in rows] == [
        (70, dt) for dt in ("f32", "bf16", "f16", "int8", "fp8_e4m3")], out
    by = {dt: [float(x) for x in rest] for _, dt, *rest in rows}

    def consistent(printed, decimals, lo, hi):  # printed (rounded) value of something in [lo, hi]
        half = 0.5 * 10.0 ** -decimals
        return lo - half <= printed <= hi + half

    tps_bf16 = by["bf16"][4]
    for dt, (ms, gbps, ceil, ratio, tps, rel, size, err) in by.items():
        assert ms > 0 and gbps > 0 and ceil > 0 and tps > 0
        # printed with 4 (ms), 2 (GB/s, ceiling, ratios) and 1 (tokens/s) decimals
        assert consistent(ratio, 2, (gbps - 0.005) / (ceil + 0.005),
                          (gbps + 0.005) / (ceil - 0.005)), (dt, ratio, gbps, ceil)
        assert consistent(tps, 1, 1e3 / (ms + 5e-5), 1e3 / (ms - 5e-5)), (dt, tps, ms)  # B = 1
        assert consistent(rel, 2, (tps - 0.05) / (tps_bf16 + 0.05),
                          (tps + 0.05) / (tps_bf16 - 0.05)), (dt, rel, tps, tps_bf16)
    assert by["bf16"][5] == 1.0 and by["bf16"][6] == 1.0
    assert by["f32"][6] == 2.0 and by["f16"][6] == 1.0
    assert by["int8"][6] == by["fp8_e4m3"][6] == 0.625  # (d_h + 4) / (2 d_h) at d_h = 16
    assert by["f32"][7] == 0.0
    for dt, bound in (("bf16", 2e-2), ("f16", 4e-3), ("int8", 5e-2), ("fp8_e4m3", 2e-1)):
        assert 0 < by[dt][7] < bound, (dt, by[dt][7])

    # --json: one object per row, the same fields; bf16 exactly 1; a subset of dtypes
    assert bench.main(["--decode", "--cache-tokens", "65", "--repeats", "1", "--threads", "1",
                       "--heads-q", "2", "--heads-kv", "1", "--head-dim", "8", "--stream-mib",
                       "8", "--json", "--cache-dtype", "fp8_e4m3", "bf16"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["cache_dtype"] for r in lines] == ["fp8_e4m3", "bf16"]
    for r in lines:
        assert r["tk"] == 65 and r["op"] == "decode" and r["ratio"] == r["gbps"] / r["ceiling_gbps"]
        assert r["tokens_per_s"] == 1.0 / (r["ms"] / 1e3)
        assert 0 < r["ms_min"] <= r["ms"] <= r["ms_max"]  # the median between the extremes
    assert lines[1]["tokens_per_s_vs_bf16"] == 1.0 and lines[1]["cache_bytes_vs_bf16"] == 1.0
    assert lines[0]["err_vs_unquantized"] > 0

    # bad arguments: exit code 2 with the reason
    assert bench.main(["--decode", "--cache-dtype", "int4", "--cache-tokens", "8"]) == 2
    assert "--cache-dtype must be among f32, bf16, f16, int8, fp8_e4m3" in capsys.readouterr().err
    assert bench.main(["--decode", "--cache-tokens", "0"]) == 2
    try:
        bench.main(["--decode", "--window", "4"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("--decode --window accepted")


def test_blas_ceiling_warning_rule():
    """The GEMM ceiling is said to be low exactly when OpenBLAS lacks AVX-512 and tokenmix runs it
    (given kernels and paths: the expectation does not depend on this machine's CPU)."""
    warning = bench.blas_ceiling_warning("Haswell", "avx512")
    assert "OpenBLAS's Haswell kernel" in warning and "OPENBLAS_CORETYPE=SKYLAKEX" in warning
    assert bench.blas_ceiling_warning("Zen", "avx512_bf16")
    for kernel in ("SkylakeX", "Cooperlake", "SapphireRapids", "SKYLAKEX"):
        assert bench.blas_ceiling_warning(kernel, "avx512") == ""
    for isa in ("avx2", "portable", "neon"):
        assert bench.blas_ceiling_warning("Haswell", isa) == ""
