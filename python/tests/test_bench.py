"""Smoke test of ``python -m tokenmix.bench`` on a tiny shape: it runs both passes, prints the
same-run GEMM ceiling (``tokenmix bench``'s, through the extension) and a speedup per case, and
the two sides agree on the forward."""

import math
import re
import statistics

import pytest
import torch

import tokenmix
import tokenmix._tokenmix as _C
from tokenmix import bench

CASE = r"T=\s*(\d+) (fwd\+bwd|fwd)\s.*speedup ([0-9.]+)x.*max\|diff\| ([0-9.e+-]+)"
# tokenmix's GFLOP/s and its fraction of the case's ceiling, the ceiling's median and spread
CASE_CEILING = (r"T=\s*(\d+) (fwd\+bwd|fwd)\s.*tokenmix ([0-9.]+) GFLOP/s \(([0-9.]+) of GEMM\).*"
                r"GEMM ceiling ([0-9.]+) \(([0-9.]+)-([0-9.]+)\)")


def check_case_ceilings(out):
    """Every case line: min <= median <= max of the ceiling's passes, all > 0, and the printed
    fraction follows from the printed figures (rounding: GFLOP/s to 0.05, the fraction 0.005)."""
    rows = re.findall(CASE_CEILING, out)
    assert rows, out
    for _, _, gflops, frac, med, lo, hi in rows:
        gflops, frac, med, lo, hi = map(float, (gflops, frac, med, lo, hi))
        assert 0 < lo <= med <= hi, (lo, med, hi)
        assert (gflops - 0.05) / (med + 0.05) - 0.005 <= frac <= \
            (gflops + 0.05) / (med - 0.05) + 0.005, (gflops, frac, med)
    return rows


def test_bench_prints_each_case_with_ceiling_and_agreement(capsys):
    assert bench.main(["--seq", "64", "65", "--repeats", "1", "--heads-q", "4", "--heads-kv", "2",
                       "--head-dim", "16", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    # tokenmix bench's ceiling: its kind, OpenBLAS's kernel as the C++ code reports it
    assert (f"f32 GEMM ceiling (tokenmix bench's, openblas_sgemm_2048: OpenBLAS "
            f"{_C.bench_sgemm_core()} kernel, 1 thread(s), a pass of 2 calls after each round)"
            in out), out
    assert "numpy.matmul" not in out
    check_case_ceilings(out)
    cases = re.findall(CASE, out)
    assert sorted((int(t), m) for t, m, _, _ in cases) == [(64, "fwd"), (64, "fwd+bwd"), (65, "fwd"), (65, "fwd+bwd")]
    for _, _, speedup, diff in cases:
        assert float(speedup) > 0.0
        assert float(diff) < 1e-5  # |O_torch - O_tokenmix| on unit-normal inputs


@pytest.mark.slow  # ~10 s: torch.mm in bf16 / f16 as the peer figure (no fast path on AVX2)
def test_bench_reduced_precision_side_by_side(capsys):
    """--dtype bf16 / f16: both sides in that dtype, a GEMM ceiling in that dtype, and the two
    sides' outputs agree to a few units of the dtype's rounding (unit-normal inputs, |O| < 4)."""
    for dtype, name, bound in (("bf16", "bfloat16", 5e-2), ("f16", "float16", 8e-3)):
        assert bench.main(["--seq", "64", "--repeats", "1", "--heads-q", "4", "--heads-kv", "2",
                           "--head-dim", "16", "--threads", "1", "--dtype", dtype]) == 0
        out = capsys.readouterr().out
        assert f"causal, {name}, layout" in out
        # The CLI's choice and kind for the dtype (bf16: oneDNN's bf16 GEMM only where the CPU
        # has bf16 GEMM instructions and the build oneDNN), and torch.mm in the dtype as a peer.
        bf16_gemm, kind = _C.bench_gemm_ceiling_choice(dtype)
        assert kind.startswith("onednn_bf16_gemm_2048" if bf16_gemm else "openblas_sgemm_2048")
        if bf16_gemm:
            assert re.search(rf"{dtype} GEMM ceiling \(tokenmix bench's, onednn_bf16_gemm_2048 "
                             r"\(.*\), 1 thread\(s\), best of 10, measured once\): [0-9.]+ "
                             r"GFLOP/s", out), out
        else:
            assert f"{dtype} GEMM ceiling (tokenmix bench's, {kind}: OpenBLAS" in out, out
        peer = re.search(rf"PyTorch's {dtype} GEMM \(torch\.mm (2048|1024|512)\^3, 1 thread\(s\), "
                         r"best of 10[^)]*\): ([0-9.]+) GFLOP/s, a peer figure, not the ceiling", out)
        assert peer and float(peer.group(2)) > 0.0, out
        check_case_ceilings(out)
        cases = re.findall(r"T=\s*(\d+) (fwd\+bwd|fwd)\s.*speedup ([0-9.]+)x.*"
                           r"max\|diff\| ([0-9.e+-]+)", out)
        assert sorted((int(t), m) for t, m, _, _ in cases) == [(64, "fwd"), (64, "fwd+bwd")]
        for _, _, speedup, diff in cases:
            assert float(speedup) > 0.0
            assert float(diff) < bound, (dtype, diff)


def test_torch_gemm_size_fits_the_budget():
    """The reduced-precision peer GEMM's size: 2048 when the budget allows it, otherwise the
    largest power of two >= the probe size whose predicted time fits (never below the probe)."""
    assert bench.torch_gemm_size(torch.bfloat16, budget_s=1e9) == 2048
    assert bench.torch_gemm_size(torch.bfloat16, budget_s=0.0) == 512
    assert bench.torch_gemm_size(torch.float16, probe=256, budget_s=0.0) == 256
    size = bench.torch_gemm_size(torch.bfloat16)
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


@pytest.mark.slow  # ~12 s: two-process worlds (test_distributed.py checks the ring everyday)
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
    assert ("ceiling: streaming read of a 8 MiB float32 buffer (tokenmix bench decode's, "
            "stream_read_8MiB: 1 thread(s), the widest vectors)") in out, out
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
    # Per KV head at T_k = 70 (two 64-position tiles), d_h = 16: each tile pair 2·64·16 bytes,
    # 16 fp32 channel scales (64 bytes) and 64 fp32 row scales; the open K tile in float32
    # (64·16·4 bytes); bf16: 2·128·16·2 bytes.
    quant = (2 * (2 * 64 * 16 + 64 + 256) + 64 * 16 * 4) / (2 * 128 * 16 * 2)
    assert by["int8"][6] == by["fp8_e4m3"][6] == round(quant, 3)
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
        assert r["ceiling_kind"] == "stream_read_8MiB" and r["ceiling_gbps"] > 0
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


def test_sgemm_ceiling_warning_follows_the_cli_rule():
    """The warning that the sgemm ceiling is low is the C++ bench's (its rule has its own test,
    cli_bench_ceiling_warning_rule): on this CPU, given OpenBLAS's kernel and whether tokenmix
    runs AVX-512."""
    warning = _C.bench_sgemm_ceiling_warning()
    core = _C.bench_sgemm_core()
    avx512 = tokenmix.cpu_features()["avx512f"]
    wide = core.lower() in {"skylakex", "cooperlake", "sapphirerapids"}
    assert (warning != "") == (avx512 and not wide), (warning, core, avx512)
    if warning:
        assert f"OpenBLAS's {core} kernel" in warning


# --- the ceilings through the extension (tools/bench/ceilings.hpp) ----------------------------


def test_gemm_ceiling_is_the_cli_choice_and_its_passes():
    """GemmCeiling takes the C++ choice and kind for each dtype; its passes are the C++ sgemm's
    (positive, finite rates) and their spread is the C++ summary, which agrees with Python's
    median, min and max of the same passes."""
    for dtype in ("f32", "f16", "bf16"):
        gemm = bench.GemmCeiling(dtype, 1)
        assert (gemm.bf16_gemm, gemm.kind.split(" ")[0]) == (
            _C.bench_gemm_ceiling_choice(dtype)[0],
            _C.bench_gemm_ceiling_choice(dtype)[1].split(" ")[0])
    f32 = bench.GemmCeiling("f32", 1)
    assert f32.kind == "openblas_sgemm_2048" and not f32.bf16_gemm
    passes = [f32.pass_gflops() for _ in range(3)]
    assert all(math.isfinite(p) and p > 0 for p in passes), passes
    med, lo, hi = bench.ceiling_spread(passes)
    assert (med, lo, hi) == (statistics.median(passes), min(passes), max(passes))
    assert bench.ceiling_spread([4.0, 1.0, 3.0, 2.0]) == (2.5, 1.0, 4.0)
    with pytest.raises(tokenmix.ArgumentError, match="a ceiling's spread needs a pass"):
        bench.ceiling_spread([])
    bad_dtype = pytest.raises(ValueError, match="dtype must be")
    with bad_dtype:
        bench.GemmCeiling("f64", 1)


def test_python_ceiling_equals_the_cxx_one_called_the_same_way():
    """The Python bench's sgemm pass is the C++ pass: on one object, alternating the wrapper's
    pass and the extension's pass_gflops(threads, 2), the two series come from the same code, so
    their medians agree within the machine's noise (a second implementation — numpy.matmul, a
    different OpenBLAS — would not be held to this)."""
    gemm = bench.GemmCeiling("f32", 2)

    class Recorder:  # stands in for the C++ object: what the wrapper asks and returns
        calls: list = []

        def pass_gflops(self, threads, calls):
            self.calls.append((threads, calls))
            return 123.25

    real, gemm._sgemm = gemm._sgemm, Recorder()
    assert gemm.pass_gflops() == 123.25 and Recorder.calls == [(2, 2)]  # the CLI's pass: 2 calls
    gemm._sgemm, gemm.threads = real, 1
    ours, cxx = [], []
    for _ in range(3):
        ours.append(gemm.pass_gflops())
        cxx.append(gemm._sgemm.pass_gflops(1, 2))
    assert gemm._sgemm is not None and isinstance(gemm._sgemm, _C.BenchSgemmCeiling)
    ratio = statistics.median(ours) / statistics.median(cxx)
    assert 0.5 < ratio < 2.0, (ours, cxx)


def test_ceiling_objects_and_their_errors():
    """The extension's ceiling objects: sizes, kinds, rates, and every argument error (typed,
    naming the function)."""
    read = _C.BenchStreamRead(40000)  # rounded down to whole 16 KiB blocks
    assert read.bytes == 32768 and read.kind == "stream_read_32KiB"
    gbps = read.pass_gbps(1)
    assert math.isfinite(gbps) and gbps > 0
    assert read.pass_gbps(0) > 0  # 0 = all threads, as every binding takes it
    assert _C.BenchStreamRead(8 << 20).kind == "stream_read_8MiB"
    with pytest.raises(tokenmix.ArgumentError, match="at least 16384 bytes; got 100"):
        _C.BenchStreamRead(100)
    with pytest.raises(tokenmix.ArgumentError, match="BenchStreamRead: bytes must be >= 16384"):
        _C.BenchStreamRead(-1)
    with pytest.raises(tokenmix.ArgumentError, match="BenchStreamRead.pass_gbps: threads"):
        read.pass_gbps(-1)
    sgemm = _C.BenchSgemmCeiling()
    with pytest.raises(tokenmix.ArgumentError, match="the sgemm ceiling's calls must be >= 1"):
        sgemm.pass_gflops(1, 0)
    with pytest.raises(tokenmix.ArgumentError, match="BenchSgemmCeiling.pass_gflops: threads"):
        sgemm.pass_gflops(-2, 1)
    with pytest.raises(tokenmix.ArgumentError, match="the sgemm ceiling's repeats must be >= 1"):
        sgemm.best_gflops(1, 0)
    with pytest.raises(tokenmix.ArgumentError, match="the bf16 GEMM ceiling's repeats"):
        _C.bench_bf16_gemm_ceiling(1, 0)
    assert _C.bench_after_sgemm_pause_s() == 0.2


def test_bf16_gemm_ceiling_runs_or_says_why_not():
    """oneDNN's bf16 GEMM ceiling: a rate and its kind where it can run; else UnsupportedError
    saying why (no oneDNN in the build, or no bf16 matmul for this CPU: only on a CPU without
    bf16 GEMM instructions). The bench's choice uses it exactly where both hold."""
    try:
        gflops, kind = _C.bench_bf16_gemm_ceiling(1, 1)
    except tokenmix.UnsupportedError as e:
        assert ("needs oneDNN" in str(e)) != _C.bench_have_onednn(), str(e)
        if _C.bench_have_onednn():
            assert "oneDNN has no bf16 matmul" in str(e) and not _C.bench_cpu_has_bf16_gemm()
    else:
        assert math.isfinite(gflops) and gflops > 0 and kind.startswith("onednn_bf16_gemm_2048 (")
    bf16_gemm, kind = _C.bench_gemm_ceiling_choice("bf16")
    assert bf16_gemm == (_C.bench_cpu_has_bf16_gemm() and _C.bench_have_onednn())
    if not _C.bench_cpu_has_bf16_gemm():
        assert kind.startswith("openblas_sgemm_2048 (no bf16 GEMM instructions on this CPU")
    elif not _C.bench_have_onednn():
        assert kind.startswith("openblas_sgemm_2048 (this build has no oneDNN")
