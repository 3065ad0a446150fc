"""Smoke runs of ``python -m tokenmix.bench --model`` and ``--overhead`` (tokenmix/_bench_model.py)
at tiny sizes: every case runs and prints its line, both sides agree (hidden states, greedy
tokens), and bad options are refused. The figures themselves are measured on a quiet machine
(docs/performance.md, "PyTorch side by side"), not here."""

import re

import pytest

from tokenmix import bench

TINY = ["--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--intermediate",
        "96", "--vocab", "128", "--seq", "40", "--gen-context", "24", "--gen-tokens", "2",
        "--repeats", "1"]


def test_model_bench_runs_at_tiny_sizes(capsys):
    assert bench.main(["--model"] + TINY) == 0
    out = capsys.readouterr().out
    for case in ("T=40 forward ", "T=40 forward+backward", "prefill 24 tokens",
                 "decode at 24 (per token)"):
        line = next(l for l in out.splitlines() if l.startswith(case))
        assert re.search(r"sdpa +[0-9.]+ ms +tokenmix +[0-9.]+ ms +ratio sdpa/tokenmix [0-9.]+x",
                         line), line
    err = float(re.search(r"max relative difference of the hidden states: (\S+)", out).group(1))
    assert err < 1e-5
    assert "greedy tokens identical: True" in out


@pytest.mark.slow  # ~8 s of timed calls; test_model_bench_runs_at_tiny_sizes runs everyday
def test_overhead_bench_runs(capsys):
    assert bench.main(["--overhead", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    lines = [l for l in out.splitlines() if " us  tokenmix " in l]
    assert len(lines) == 4, out


@pytest.mark.parametrize("bad", [["--model", "--overhead"], ["--model", "--heads", "3"],
                                 ["--model", "--layers", "0"], ["--model", "--seq", "0"]])
def test_model_bench_refuses_bad_options(bad, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(bad)
    assert e.value.code == 2
