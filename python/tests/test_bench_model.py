"""Smoke runs of ``python -m tokenmix.bench --model`` and ``--overhead`` (tokenmix/_bench_model.py)
at tiny sizes: every case runs and prints its line, both sides agree (hidden states, greedy
tokens), and bad options are refused. The figures themselves are measured on a quiet machine
(docs/performance.md, "PyTorch side by side"), not here."""

import re

import pytest

from tokenmix import bench

TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--intermediate",
        "96", "--vocab", "128", "--seq", "40", "--gen-context", "70", "--gen-tokens", "2",
        "--repeats", "1", "--profile-tokens", "1", "--cache-dtypes", "f32", "bf16", "int8"]


def test_model_bench_runs_at_tiny_sizes(capsys):
    assert bench.main(["--model"] + TINY + ["--model-dtype", "f32"]) == 0
    out = capsys.readouterr().out
    for case in ("T=40 forward ", "T=40 forward+backward"):
        line = next(l for l in out.splitlines() if l.startswith(case))
        assert re.search(r"sdpa +[0-9.]+ ms +tokenmix +[0-9.]+ ms +ratio sdpa/tokenmix [0-9.]+x",
                         line), line
        # the next line: each side's attention time in the model (its time less the null side's)
        attn = out.splitlines()[out.splitlines().index(line) + 1]
        m = re.match(r"  attention in the model +sdpa +(-?[0-9.]+) ms +tokenmix +(-?[0-9.]+) ms +"
                     r"ratio sdpa/tokenmix (\S+)x +share sdpa (-?[0-9]+)% tokenmix (-?[0-9]+)% +"
                     r"\(model without attention ([0-9.]+) ms\)$", attn)
        assert m, attn
        assert float(m.group(6)) > 0
    err = float(re.search(r"max relative difference of the hidden states: (\S+)", out).group(1))
    assert err < 1e-5
    assert "[f32 model] prompt 70 tokens" in out
    rows = {}
    for side in ("dynamic + sdpa", "dynamic + tokenmix", "tokenmix Cache f32",
                 "tokenmix Cache bf16", "tokenmix Cache int8"):
        lines = [l for l in out.splitlines() if l.startswith("  " + side + " ")]
        assert len(lines) == 1, (side, out)
        m = re.match(r"  .{22} +([0-9.]+) +([0-9.]+)x +([0-9.]+)x +([0-9.]+) +([0-9.]+) +"
                     r"([0-9]+)% +(True|False)$", lines[-1])
        assert m, lines[-1]
        rows[side] = m.groups()
    assert rows["dynamic + sdpa"][1] == "1.00"
    assert rows["tokenmix Cache f32"][6] == "True"  # the fp32 cache: sdpa's tokens
    # int8 per (layer, sequence, KV head), both rounded up to 128 positions at d_h = 16: two tile
    # pairs of 64 positions (2·64·16 bytes, 16 channel scales padded to 64 bytes, 64 row scales)
    # and the open K tile in float32 (64·16·4), against f32's 2·128·16·4: 0.54
    assert float(rows["tokenmix Cache int8"][4]) < 0.56 * float(rows["tokenmix Cache f32"][4])


def test_model_bench_bf16_model(capsys):
    assert bench.main(["--model"] + TINY[:-4] + ["--seq", "--gen-context", "24",
                                                 "--model-dtype", "bf16",
                                                 "--cache-dtypes", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "bf16, random weights" in out and "[bf16 model] prompt 24 tokens" in out
    assert any(l.startswith("  tokenmix Cache bf16 ") for l in out.splitlines())


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


def test_null_side_takes_the_attention_out_and_puts_it_back():
    """The "null" side of the forward cases: the model with its attention function replaced by
    one returning the query, only while the call runs (also when it raises)."""
    import argparse

    import torch
    from transformers import AttentionInterface

    from tokenmix import _bench_model as bm

    ns = argparse.Namespace(vocab=128, hidden=64, intermediate=96, layers=2, heads=4, kv_heads=2,
                            seq=[12], gen_context=[], gen_tokens=1)
    _, models = bm._models(ns, "f32")
    model = models["sdpa"]
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model.model(ids).last_hidden_state
        seen = {}

        def call():
            seen["mapped"] = AttentionInterface._global_mapping["sdpa"]
            seen["hidden"] = model.model(ids).last_hidden_state

        bm._without_attention(model, call)()
        assert seen["mapped"] is bm._null_attention
        assert (seen["hidden"] - ref).abs().max() > 1e-3  # the attention was taken out

        def fails():
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError):
            bm._without_attention(model, fails)()
        assert AttentionInterface._global_mapping["sdpa"] is not bm._null_attention
        assert torch.equal(model.model(ids).last_hidden_state, ref)  # and put back
