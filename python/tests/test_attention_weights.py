"""tokenmix.attention_weights: P = exp(S + M − L) of chosen heads and rows (SPEC 4.2–4.4, "Score
variants used by real models") with L from tokenmix.attention_forward, against the softmax of the
scores written in float64 NumPy (every variant, GQA, T_q ≶ T_k, both layouts, strided views);
selections against the full call bitwise; NumPy and torch, bfloat16 and float16 inputs; the
errors naming the argument."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tokenmix

ATOL = 2e-5  # P ≤ 1: the fp32 rounding of s·⟨q, k⟩ and of L


def _reference(q, k, *, scale=None, causal=True, align="bottom_right", window=None,
               softcap=None, alibi_slopes=None, sinks=None, mask=None, key_lengths=None):
    """A = softmax(S + M) [B, H_q, T_q, T_k] in float64 (with sinks: the keys' columns of the
    softmax over [S + M, σ_h])."""
    q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
    B, T_q, H_q, D = q64.shape
    T_k, H_kv = k64.shape[1], k64.shape[2]
    k64 = np.repeat(k64, H_q // H_kv, axis=2)  # j(h) = ⌊h / g⌋ (4.8)
    s = 1.0 / np.sqrt(D) if scale is None else scale
    z = s * np.einsum("bthd,buhd->bhtu", q64, k64)  # (4.2)
    if softcap is not None:
        z = softcap * np.tanh(z / softcap)
    t = np.arange(T_q)[:, None]
    u = np.arange(T_k)[None, :]
    p = t + (T_k - T_q) if align == "bottom_right" else t
    if alibi_slopes is not None:
        z = z - np.asarray(alibi_slopes, np.float64)[None, :, None, None] * (p - u)
    visible = np.ones((B, H_q, T_q, T_k), bool)
    if causal:
        visible &= u <= p  # (4.3)
    if window is not None:
        visible &= u > p - window
    if key_lengths is not None:
        visible &= u[None, None] < np.asarray(key_lengths)[:, None, None, None]
    if mask is not None:
        m = np.broadcast_to(np.asarray(mask), (B, H_q, T_q, T_k))
        if m.dtype == bool:
            visible &= m
        else:
            z = z + m
    z = np.where(visible, z, -np.inf)
    cols = [z]
    if sinks is not None:
        cols.append(np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None],
                                    (B, H_q, T_q, 1)))
    full = np.concatenate(cols, axis=-1)
    mx = np.max(full, axis=-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    e = np.exp(full - mx)
    den = e.sum(axis=-1, keepdims=True)
    a = np.where(den > 0, e / np.where(den > 0, den, 1.0), 0.0)
    return a[..., :T_k]


def _inputs(B, T_q, T_k, H_q, H_kv, D, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T_q, H_q, D)).astype(np.float32)
    k = rng.standard_normal((B, T_k, H_kv, D)).astype(np.float32)
    return q, k, rng


CASES = [
    dict(shape=(1, 1, 1, 2, 1, 8)),
    dict(shape=(2, 65, 65, 4, 2, 16)),
    dict(shape=(2, 20, 130, 4, 1, 12), align="top_left"),
    dict(shape=(2, 130, 20, 4, 2, 12)),  # rows t < 110 see no key (bottom-right)
    dict(shape=(1, 63, 63, 8, 2, 17), causal=False),
    dict(shape=(2, 65, 70, 4, 2, 16), window=7),
    dict(shape=(2, 65, 65, 4, 2, 16), softcap=0.7),
    dict(shape=(2, 65, 65, 4, 2, 16), alibi=True),
    dict(shape=(2, 65, 65, 4, 2, 16), sinks=True),
    dict(shape=(3, 40, 45, 2, 1, 8), key_lengths=[10, 45, 0]),
    dict(shape=(2, 33, 66, 4, 2, 8), mask="bool"),
    dict(shape=(2, 33, 66, 4, 2, 8), mask="bias", causal=False),
    dict(shape=(2, 97, 131, 8, 2, 9), window=17, softcap=2.0, alibi=True, sinks=True,
         mask="bias", align="top_left"),
]


def _case_kwargs(case, H_q, B, T_q, T_k, rng):
    kw = {name: case[name] for name in ("causal", "align", "window", "softcap", "key_lengths")
          if name in case}
    if case.get("alibi"):
        kw["alibi_slopes"] = (2.0 ** (-8.0 * (np.arange(H_q) + 1) / H_q)).astype(np.float32)
    if case.get("sinks"):
        kw["sinks"] = rng.normal(0.5, 1.0, H_q).astype(np.float32)
    if case.get("mask") == "bool":
        kw["mask"] = rng.random((B, 1, T_q, T_k)) < 0.7  # broadcast over heads
    if case.get("mask") == "bias":
        bias = rng.standard_normal((B, H_q, 1, T_k)).astype(np.float32)  # broadcast over rows
        bias[rng.random(bias.shape) < 0.2] = -np.inf
        kw["mask"] = bias
    return kw


@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()
                                                            if k != "shape") or "plain")
def test_weights_match_the_float64_softmax(case, layout):
    B, T_q, T_k, H_q, H_kv, D = case["shape"]
    q, k, rng = _inputs(B, T_q, T_k, H_q, H_kv, D, seed=T_q * 131 + T_k)
    kw = _case_kwargs(case, H_q, B, T_q, T_k, rng)
    if layout == "bhtd":  # strided views: [B, H, T, D] memory seen as [B, T, H, D] logically
        qx, kx = np.ascontiguousarray(q.transpose(0, 2, 1, 3)), np.ascontiguousarray(
            k.transpose(0, 2, 1, 3))
    else:
        qx, kx = q, k
    _, lse = tokenmix.attention_forward(qx, kx, kx, layout=layout, return_lse=True, **kw)
    got = tokenmix.attention_weights(qx, kx, lse, layout=layout, **kw)
    ref = _reference(q, k, **kw)
    assert got.dtype == np.float32 and got.shape == (B, H_q, T_q, T_k)
    assert np.all(np.isfinite(got))
    assert np.abs(got - ref).max() <= ATOL
    assert np.array_equal(got[ref == 0], np.zeros_like(got[ref == 0]))  # masked: exactly 0


def test_selections_and_threads_give_the_same_bits():
    q, k, rng = _inputs(2, 150, 160, 8, 2, 24, seed=7)
    kw = dict(softcap=3.0, window=60, mask=rng.random((2, 8, 150, 160)) < 0.8)
    _, lse = tokenmix.attention_forward(q, k, k, return_lse=True, **kw)
    full = tokenmix.attention_weights(q, k, lse, **kw)
    for threads in (1, 2, 3):
        assert np.array_equal(tokenmix.attention_weights(q, k, lse, threads=threads, **kw), full)
    for isa in tokenmix.available_isas():
        assert np.array_equal(tokenmix.attention_weights(q, k, lse, isa=isa, **kw), full), isa
    heads = [7, 0, 3, 3]
    for rows, (b, e) in [(slice(5, 70), (5, 70)), (range(64, 128), (64, 128)),
                         ((149, 150), (149, 150)), (slice(-10, None), (140, 150))]:
        part = tokenmix.attention_weights(q, k, lse, heads=heads, rows=rows, **kw)
        assert part.shape == (2, 4, e - b, 160)
        assert np.array_equal(part, full[:, heads, b:e])
    # A caller-supplied, strided output is written in place (its padding untouched).
    buf = np.full((2, 2, 10, 170), np.nan, np.float32)
    out = buf[:, :, :, 5:165]
    assert tokenmix.attention_weights(q, k, lse, out, heads=[1, 6], rows=(20, 30), **kw) is out
    assert np.array_equal(out, full[:, [1, 6], 20:30])
    assert np.isnan(buf[..., :5]).all() and np.isnan(buf[..., 165:]).all()


def test_torch_tensors_and_reduced_precision():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 33, 16)  # [B, H, T, E]: PyTorch's layout
    k = torch.randn(2, 2, 40, 16)
    _, lse = tokenmix.attention_forward(q, k, k, layout="bhtd", return_lse=True, window=9)
    w = tokenmix.attention_weights(q, k, lse, layout="bhtd", window=9)
    assert isinstance(w, torch.Tensor) and w.dtype == torch.float32
    ref = _reference(q.transpose(1, 2).numpy(), k.transpose(1, 2).numpy(), window=9)
    assert np.abs(w.numpy() - ref).max() <= ATOL
    for dt in (torch.bfloat16, torch.float16):
        qh, kh = q.to(dt), k.to(dt)
        _, lse = tokenmix.attention_forward(qh, kh, kh, layout="bhtd", return_lse=True)
        w = tokenmix.attention_weights(qh, kh, lse, layout="bhtd")
        assert w.dtype == torch.float32  # P and L stay float32 (SPEC "Reduced precision")
        ref = _reference(qh.float().transpose(1, 2).numpy(), kh.float().transpose(1, 2).numpy())
        # L of the reduced-precision forward carries its fp32 rounding, as in float32
        assert np.abs(w.numpy() - ref).max() <= ATOL, dt


def test_errors_name_the_argument():
    q, k, _ = _inputs(2, 5, 6, 4, 2, 3, seed=1)
    _, lse = tokenmix.attention_forward(q, k, k, return_lse=True)
    with pytest.raises(tokenmix.ArgumentError, match=r"select\.heads\[1\].*H_q = 4.*got 4"):
        tokenmix.attention_weights(q, k, lse, heads=[0, 4])
    with pytest.raises(tokenmix.ArgumentError, match="row_end.*T_q = 5"):
        tokenmix.attention_weights(q, k, lse, rows=(2, 9))
    with pytest.raises(tokenmix.ArgumentError, match=r"lse\.shape\[2\] \(T_q\)") as e:
        tokenmix.attention_weights(q, k, lse[:, :, :4])
    assert e.value.code == "shape_mismatch"
    with pytest.raises(tokenmix.ArgumentError, match=r"weights\.shape\[3\] \(T_k\)"):
        tokenmix.attention_weights(q, k, lse, np.empty((2, 4, 5, 7), np.float32))
    with pytest.raises(TypeError, match="weights"):
        tokenmix.attention_weights(q, k, lse, np.empty((2, 4, 5, 6), np.float64))
    with pytest.raises(tokenmix.ArgumentError, match="options.window"):
        tokenmix.attention_weights(q, k, lse, window=0)
    with pytest.raises(TypeError, match="heads must be integers"):
        tokenmix.attention_weights(q, k, lse, heads=[0.5])
    with pytest.raises(ValueError, match="step"):
        tokenmix.attention_weights(q, k, lse, rows=slice(0, 5, 2))
    with pytest.raises(TypeError, match="k"):
        tokenmix.attention_weights(q, k.astype(np.float16), lse)
