"""tokenmix.plot: the files are written and depict what they should — the grid's axes, the token
strings on the axes, the image data of a known pattern (a diagonal: every query attends to
itself only), the roofline's points and ratio bars — through the Figure's matplotlib objects and
the PNG read back; and the command line `python -m tokenmix.plot`."""

from __future__ import annotations

import json
import subprocess
import sys

import matplotlib.image
import numpy as np
import pytest
import torch

import tokenmix
import tokenmix.plot as tplot


def _diagonal(B=1, H=3, T=6):
    """Weights [B, H, T, T] of a head that attends to itself only (P = I), and of a causal
    uniform head: row t spreads 1/(t + 1) over keys 0..t."""
    w = np.zeros((B, H, T, T), np.float32)
    w[:, 0] = np.eye(T)
    for t in range(T):
        w[:, 1:, t, : t + 1] = 1.0 / (t + 1)
    return w


def test_attention_maps_grid_tokens_and_image_data(tmp_path):
    tokens = ["The", "cat", "sat", "on", "the", "mat"]
    path = tmp_path / "maps.png"
    fig = tplot.attention_maps(_diagonal(), path, tokens=tokens, title="one layer")
    assert path.exists() and path.stat().st_size > 0
    png = matplotlib.image.imread(path)
    assert png.ndim == 3 and png.shape[0] > 50 and png.shape[1] > 50
    axes = fig.axes
    assert len(axes) == 3 + 1  # three heads, one colour bar
    for h, ax in enumerate(axes[:3]):
        assert ax.get_title() == f"head {h}"
        assert [t.get_text() for t in ax.get_xticklabels()] == tokens
        assert [t.get_text() for t in ax.get_yticklabels()] == tokens
        (image,) = ax.get_images()
        data = np.asarray(image.get_array())
        assert data.shape == (6, 6)
    diag = np.asarray(axes[0].get_images()[0].get_array())
    assert np.array_equal(diag, np.eye(6))  # the known diagonal pattern, pixel for pixel
    causal = np.asarray(axes[1].get_images()[0].get_array())
    assert np.allclose(np.triu(causal, 1), 0) and np.allclose(causal.sum(1), 1)


def test_attention_maps_of_a_models_attentions_tuple(tmp_path):
    """The `attentions` tuple of a transformers model (layers × [B, H, T, T] torch tensors):
    chosen layers and heads, the queries labelled with the last T_q tokens."""
    layers = tuple(torch.from_numpy(_diagonal(B=2, H=4, T=5)) * (i + 1) / 3 for i in range(3))
    fig = tplot.attention_maps(layers, tmp_path / "m.png", layers=[2, 0], heads=[3, 1],
                               tokens=list("abcde"), batch=1)
    grid = fig.axes[:-1]
    assert [ax.get_title() for ax in grid] == ["layer 2, head 3", "layer 2, head 1",
                                               "layer 0, head 3", "layer 0, head 1"]
    assert np.allclose(grid[2].get_images()[0].get_array(), layers[0][1, 3].numpy())
    # Rectangular maps (T_q < T_k): the query axis carries the last T_q tokens.
    w = np.random.default_rng(0).random((1, 2, 3, 7)).astype(np.float32)
    fig = tplot.attention_maps(w, None, tokens=list("abcdefg"))
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["e", "f", "g"]
    with pytest.raises(ValueError, match="tokens"):
        tplot.attention_maps(w, None, tokens=list("abc"))
    with pytest.raises(ValueError, match="head 5"):
        tplot.attention_maps(w, None, heads=[5])


def test_attention_maps_of_tokenmix_weights(tmp_path):
    """From attention_weights: a query that equals its own key and is far from the others
    attends to itself — the diagonal shows in the picture."""
    T, D = 8, 16
    k = np.zeros((1, T, 1, D), np.float32)
    for t in range(T):
        k[0, t, 0, t] = 8.0  # orthogonal keys
    q = k.copy()
    _, lse = tokenmix.attention_forward(q, k, k, return_lse=True, causal=False, scale=1.0)
    w = tokenmix.attention_weights(q, k, lse, causal=False, scale=1.0)
    fig = tplot.attention_maps(w, tmp_path / "diag.png")
    img = np.asarray(fig.axes[0].get_images()[0].get_array())
    assert np.array_equal(img.argmax(axis=1), np.arange(T))
    assert np.all(np.diag(img) > 0.999)


def _bench_lines():
    common = dict(batch=1, hq=8, hkv=2, dh=64, threads=2, isa="avx512", causal=True,
                  align="bottom_right", ceiling_kind="openblas_sgemm_2048", sgemm_core="x",
                  max_rel_err=1e-7, extra_bytes=0, window=None, softcap=None, alibi=False,
                  sinks=None, cpu="test")
    fwd = dict(common, op="forward", tq=512, tk=512, dtype="f32", seconds=0.01, gflops=100.0,
               ceiling_gflops=200.0, ratio=0.5, ceiling_min=190.0, ceiling_max=210.0)
    bwd = dict(fwd, op="backward", gflops=150.0, ratio=0.75)
    dec = dict(common, op="decode", tq=1, tk=4096, dtype="f32", cache_dtype="bf16",
               seconds=1e-4, gflops=2.0, ceiling_gflops=200.0, ratio=0.8, gbps=20.0,
               ceiling_gbps=25.0, kv_bytes=2_000_000, flops=2e5)
    return [fwd, bwd, dec]


def test_roofline_points_bars_and_file(tmp_path):
    cases = _bench_lines()
    src = tmp_path / "bench.jsonl"
    src.write_text("tokenmix bench: a header line\n" + "\n".join(json.dumps(c) for c in cases)
                   + "\n")
    path = tmp_path / "roof.png"
    fig = tplot.roofline(src, path, title="test")
    assert path.exists() and matplotlib.image.imread(path).ndim == 3
    roof_ax, bar_ax = fig.axes
    assert roof_ax.get_xscale() == "log" and roof_ax.get_yscale() == "log"
    points = [l for l in roof_ax.get_lines() if l.get_marker() == "o"]
    assert [p.get_ydata()[0] for p in points] == [100.0, 150.0, 2.0]
    # Decode's intensity: useful FLOPs / K-V bytes read = 2e9 · 1e-4 / 2e6.
    assert points[2].get_xdata()[0] == pytest.approx(2.0 * 1e9 * 1e-4 / 2_000_000)
    roofs = [l for l in roof_ax.get_lines() if l.get_linestyle() == "--"]
    assert len(roofs) == 3 and max(roofs[0].get_ydata()) == 200.0
    assert max(roofs[2].get_ydata()) <= 200.0 and min(roofs[2].get_ydata()) < 200.0  # bandwidth
    bars = bar_ax.patches
    assert [b.get_width() for b in bars] == [0.5, 0.75, 0.8]
    labels = [t.get_text() for t in bar_ax.get_yticklabels()]
    assert labels[0].startswith("forward f32 T=512") and "bf16 cache" in labels[2]
    with pytest.raises(ValueError, match="no bench case"):
        tplot.roofline("not json at all\n")


def test_command_line(tmp_path):
    w = tmp_path / "w.npy"
    np.save(w, _diagonal(H=2, T=4))
    out = tmp_path / "cli.png"
    run = subprocess.run([sys.executable, "-m", "tokenmix.plot", "maps", str(w), str(out),
                          "--tokens", "a", "b", "c", "d", "--heads", "0"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert out.exists() and matplotlib.image.imread(out).ndim == 3
    bench = tmp_path / "b.jsonl"
    bench.write_text("\n".join(json.dumps(c) for c in _bench_lines()))
    roof = tmp_path / "roof.png"
    run = subprocess.run([sys.executable, "-m", "tokenmix.plot", "roofline", str(bench),
                          str(roof)], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert roof.exists()
    run = subprocess.run([sys.executable, "-m", "tokenmix.plot", "maps", str(w), str(out),
                          "--tokens", "a"], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 2 and "tokens" in run.stderr
