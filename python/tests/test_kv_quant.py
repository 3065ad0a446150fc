"""Quantized KV caches, "int8" and "fp8_e4m3" (SPEC "Reduced precision → Quantized KV cache"),
through the Python API.

The oracle is independent of the library: the cache's values are formed in NumPy exactly as SPEC
says — each V row of one (token, KV head), and each channel of K over each closed tile of 64
positions (the open tile, the sequence's last L % 64 keys, is held as given), quantized with
δ = max|x| / 127 (int8, q = round(x / δ) to nearest even) or max|x| / 448 (fp8 E4M3, x / δ rounded
to the nearest E4M3 value by ml_dtypes.float8_e4m3fn), δ and x / δ in float32 as the cache forms
them (scripts/kv-quant-error-sim.py's quantize, loaded as SIM) — then x̂ = q · δ in float64, and
attention over x̂ is computed in float64. tokenmix must match it at float32 rounding level (rel.
err ≤ 2e-5, the bound of the C++ decode tests).
"""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

import tokenmix as tm

QUANT = ["int8", "fp8_e4m3"]


def _error_simulation():
    """scripts/kv-quant-error-sim.py (the float64 simulation behind docs/performance.md's error
    figures for issue 56) as a module: its quantize is this file's oracle of SPEC's formula."""
    path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "kv-quant-error-sim.py"
    spec = importlib.util.spec_from_file_location("kv_quant_error_sim", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SIM = _error_simulation()
# x̂ (float64) of float32 x quantized as SPEC says, one δ per slice along `axis` (default the
# last: V's rows): SIM.quantize(x, dtype, axis).
dequantized = SIM.quantize


def dequantized_keys(k: np.ndarray, dtype: str, lengths) -> np.ndarray:
    """K [B, T, H_kv, d_h] as the cache holds sequence b's first lengths[b] positions: each channel
    of each closed 64-position tile quantized with its own δ, the open tile as given."""
    out = k.astype(np.float64)
    for b, L in enumerate(lengths):
        closed = L // 64 * 64
        for t0 in range(0, closed, 64):
            out[b, t0 : t0 + 64] = dequantized(k[b, t0 : t0 + 64], dtype, axis=0)
    return out


def decode_oracle(q, k, v, lengths):
    """float64 attention of q [B, T_new, H_q, D] against k, v [B, T, H_kv, D] (first lengths[b]
    positions), bottom-right causal (SPEC 4.3), GQA (4.8)."""
    B, T_new, H_q, D = q.shape
    g = H_q // k.shape[2]
    out = np.zeros((B, T_new, H_q, D))
    for b in range(B):
        L = lengths[b]
        for t in range(T_new):
            p = L - T_new + t
            for h in range(H_q):
                s = k[b, : p + 1, h // g] @ q[b, t, h].astype(np.float64) / np.sqrt(D)
                a = np.exp(s - s.max())
                out[b, t, h] = (a / a.sum()) @ v[b, : p + 1, h // g]
    return out


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("block_tokens", [0, 64])
@pytest.mark.parametrize("isa", ["portable", "auto"])
def test_decode_matches_float64_oracle_over_dequantized_cache(dtype, block_tokens, isa):
    rng = np.random.default_rng(15)
    B, H_q, H_kv, D, T_new = 2, 8, 2, 40, 2
    lengths = [130, 65]
    k = rng.standard_normal((B, 130, H_kv, D)).astype(np.float32)
    v = rng.standard_normal((B, 130, H_kv, D)).astype(np.float32)
    k[:, :, :, 5] *= 30  # an outlier channel of K (its own δ per tile), an offset on another
    k[:, :, :, 9] += 4
    k[:, :, :, 2] = 0  # a channel of zeros: δ = 0
    v[:, :, :, 3] *= 30  # an outlier channel (δ of every V row set by it)
    cache = tm.KVCache(1, B, H_kv, D, 200, dtype=dtype, block_tokens=block_tokens)
    assert cache.dtype == dtype
    for b, L in enumerate(lengths):
        cache.append(0, np.ascontiguousarray(k[b : b + 1, :L]), np.ascontiguousarray(v[b : b + 1, :L]),
                     first_seq=b)
    q = rng.standard_normal((B, T_new, H_q, D)).astype(np.float32)
    out = tm.attention_decode(q, cache, 0, isa=isa)
    ref = decode_oracle(q, dequantized_keys(k, dtype, lengths), dequantized(v, dtype), lengths)
    assert np.abs(out - ref).max() / np.abs(ref).max() <= 2e-5
    # The error against the unquantized cache is the quantization's (reported, not hidden; K's
    # outlier channel has its own scales, so it does not coarsen the other channels).
    exact = decode_oracle(q, k.astype(np.float64), v.astype(np.float64), lengths)
    err = np.abs(out - exact).max() / np.abs(exact).max()
    assert 0 < err < (2.0**-5 if dtype == "int8" else 2.0**-2)


@pytest.mark.parametrize("dtype", QUANT)
def test_error_simulation_forms_the_cache_values_the_library_reads(dtype):
    """The simulation's cache (K per channel per closed tile, the open tile as is, V per row) on
    its real-keys profile is the cache tokenmix holds: one decode step of 4 query heads over it
    matches the simulation's float64 attention at float32 rounding. Its error against the
    unquantized cache is non-zero, and for fp8 (3 mantissa bits against bf16's 7) above bf16's."""
    rng = np.random.default_rng(21)
    T, g, D = 200, 4, 128  # three closed tiles and an open tile of 8
    k = SIM.real_keys(rng, T, 1, D).astype(np.float32)
    v = rng.standard_normal((T, 1, D)).astype(np.float32)
    q = rng.standard_normal((1, 1, g, D)).astype(np.float32)
    cache = tm.KVCache(1, 1, 1, D, T, dtype=dtype)
    cache.append(0, k[None], v[None])
    out = tm.attention_decode(q, cache, 0)[0, 0]
    k_hat, v_hat = SIM.quantized_cache(k[:, 0], v[:, 0], dtype)
    ref = SIM.attend(q[0, 0].astype(np.float64), k_hat, v_hat)
    assert np.abs(out - ref).max() / np.abs(ref).max() <= 2e-5
    exact = SIM.attend(q[0, 0].astype(np.float64), k[:, 0].astype(np.float64), v[:, 0])
    err = np.abs(ref - exact).max() / np.abs(exact).max()
    bf16 = SIM.attend(q[0, 0].astype(np.float64), SIM.to_bf16(k[:, 0]), SIM.to_bf16(v[:, 0]))
    bf16_err = np.abs(bf16 - exact).max() / np.abs(exact).max()
    assert 0 < bf16_err and 0 < err
    if dtype == "fp8_e4m3":
        assert err > 2 * bf16_err


@pytest.mark.parametrize("isa", ["portable", "auto"])
def test_int8_rows_and_quads_give_the_same_bits(isa):
    """KVCache(int8_quads=...): the int8 tiles in plain rows (the default, on every CPU) or in
    VNNI-4 quads; the same stored values, read to the same bits on every path."""
    rng = np.random.default_rng(16)
    B, H_q, H_kv, D, T_new, L = 1, 8, 2, 37, 3, 150
    k = rng.standard_normal((B, L, H_kv, D)).astype(np.float32)
    v = rng.standard_normal((B, L, H_kv, D)).astype(np.float32)
    q = rng.standard_normal((B, T_new, H_q, D)).astype(np.float32)
    outs = []
    for quads in (False, True):
        cache = tm.KVCache(1, B, H_kv, D, 200, dtype="int8", int8_quads=quads)
        assert cache.int8_quads is quads
        cache.append(0, k, v)
        outs.append(tm.attention_decode(q, cache, 0, isa=isa))
    assert np.array_equal(outs[0], outs[1])
    ref = decode_oracle(q, dequantized_keys(k, "int8", [L]), dequantized(v, "int8"), [L])
    assert np.abs(outs[0] - ref).max() / np.abs(ref).max() <= 2e-5
    assert tm.KVCache(1, 1, 1, 16, 64, dtype="int8").int8_quads is False  # rows on every CPU
    with pytest.raises(tm.ArgumentError, match="config.int8_quads applies to an int8 cache only"):
        tm.KVCache(1, 1, 1, 16, 64, dtype="fp8_e4m3", int8_quads=False)


@pytest.mark.parametrize("dtype", QUANT)
def test_memory_counts_elements_plus_scales(dtype):
    # Per 64 positions of a KV head: K and V 64·d_h bytes each, d_h fp32 channel scales (a
    # multiple of 64 bytes) and 64 fp32 row scales; per (layer, sequence, KV head) the open K
    # tile in float32, 64·d_h·4 bytes.
    layers, B, H, D, T = 2, 3, 8, 128, 256  # d_h = 128: the shape
    cache = tm.KVCache(layers, B, H, D, T, dtype=dtype)
    pair = 2 * 64 * D + 4 * D + 4 * 64
    assert cache.storage_bytes == layers * B * H * (T // 64 * pair + 4 * 64 * D)
    long = tm.KVCache(1, 1, H, D, 32768, dtype=dtype)
    bf16 = tm.KVCache(1, 1, H, D, 32768, dtype="bf16")
    assert long.memory_bytes / bf16.memory_bytes <= 0.53  # issue 56: <= 0.56 at T_k = 32768


@pytest.mark.parametrize("dtype", QUANT)
def test_non_finite_rows_are_refused_and_nothing_is_appended(dtype):
    rng = np.random.default_rng(2)
    cache = tm.KVCache(1, 2, 2, 16, 64, dtype=dtype)
    k = rng.standard_normal((2, 5, 2, 16)).astype(np.float32)
    cache.append(0, k, k)
    q = rng.standard_normal((2, 1, 4, 16)).astype(np.float32)
    before = tm.attention_decode(q, cache, 0)
    for bad in (np.nan, np.inf, -np.inf):
        kb = k.copy()
        kb[1, 4, 1, 7] = bad
        with pytest.raises(tm.ArgumentError, match=r"v\[1, 4, 1, 7\] is .*finite rows only"):
            cache.append(0, k, kb)
        assert cache.length(0) == 5 and cache.length(1) == 5
        assert np.array_equal(tm.attention_decode(q, cache, 0), before)


def test_quantized_cache_argument_errors():
    with pytest.raises(ValueError, match=r"dtype must be 'f32', 'bf16', 'f16', 'int8' or "
                                         r"'fp8_e4m3'; got 'int4'"):
        tm.KVCache(1, 1, 2, 16, 64, dtype="int4")
    cache = tm.KVCache(1, 1, 2, 16, 64, dtype="int8")
    with pytest.raises(tm.ArgumentError, match=r"new_length must be in \[0, 0\]"):
        cache.truncate(0, -1)
    with pytest.raises(tm.ArgumentError, match=r"d_h"):
        cache.append(0, np.zeros((1, 2, 2, 8), np.float32), np.zeros((1, 2, 2, 8), np.float32))


@pytest.mark.parametrize("dtype", QUANT)
def test_layer_prefill_and_steps_on_a_quantized_cache(dtype):
    d, H_q, H_kv, D, P, S = 32, 4, 2, 8, 6, 3
    layer = tm.CausalSelfAttention(d, H_q, H_kv, D, rope="rotate_half", seed=3)
    u = np.random.default_rng(4).standard_normal((2, P + S, d)).astype(np.float32)
    full = layer.forward(u)
    cache = tm.KVCache(layers=1, batch=2, heads_kv=H_kv, head_dim=D, capacity=64, dtype=dtype)
    outs = [layer.prefill(np.ascontiguousarray(u[:, :P]), cache, 0)]
    for s in range(S):
        outs.append(layer.step(np.ascontiguousarray(u[:, P + s]), cache, 0)[:, None])
    got = np.concatenate(outs, 1)
    assert cache.length(0) == P + S
    err = np.abs(got - full).max() / np.abs(full).max()
    # Even the prefill reads the quantized cache (no float32 shortcut): not exact, but close.
    assert 0 < err <= (2.0**-5 if dtype == "int8" else 2.0**-2)
