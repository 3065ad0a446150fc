#!/usr/bin/env python3
"""SPEC "Quantized KV cache" in float64 NumPy, with no tokenmix code: the error of one decode
step against the unquantized cache, for bf16, int8 and fp8 E4M3 caches on the real-keys profile
(docs/performance.md, D-kv-4).

Why it exists: issue 56 asks for an fp8 E4M3 cache error of at most 4x the bf16 cache's on that
profile. SPEC fixes every stored value: K per channel over each closed 64-position tile with
delta = max|K| / 448, V per row likewise, the code the nearest E4M3 value. The kernels then attend
over exactly those values (their error against a float64 oracle over the stored values is at
fp32 rounding level, tests/unit/test_kv_quant.cpp). So the error against the unquantized cache
is a property of the format, which this script computes without the library. E4M3 keeps 3
mantissa bits (a relative step of 2^-4 at any scale) where bf16 keeps 7 (2^-8).

The profile (testkit::apply_real_keys): K = m_t * s_c * (N(0, 1) + offset_c), six channels per
head with s_c = 10, 14, ..., 30 at (5 + i * (d_h // 6) + h) mod d_h, offset_c ~ N(0, 1), m_t = 6
at positions 0, 1 and every 2048th; V and q ~ N(0, 1). Shape: issue 56's, B = 2, T = 3000,
H_kv = 2, g = 4, d_h = 128; the last 3000 mod 64 keys are the open tile (unquantized).
err = max |O - O_exact| / max |O_exact| per (sequence, KV head), O_exact over the unrounded K, V.

Usage: scripts/kv-quant-error-sim.py [SEEDS]   (default 12; needs numpy and ml_dtypes, both in
the virtual environment python/run-tests.sh makes)
"""
import sys

import ml_dtypes
import numpy as np

KEY_TILE = 64
OUTLIERS = (10, 14, 18, 22, 26, 30)
MASSIVE, MASSIVE_EVERY = 6.0, 2048


def to_bf16(x):
    return x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def to_e4m3(x):
    return x.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def quantize(x, kind, axis=-1):
    """x_hat (float64) of x quantized with one delta per slice along `axis` (the last: V's rows):
    delta = max|x| / 127 (kind "int8", c = round(x / delta), ties to even) or / 448 (any other
    kind: "fp8" here, "fp8_e4m3" in python/tests/test_kv_quant.py's oracle; c the nearest E4M3
    value), delta and x / delta formed in float32 as the cache forms them; delta = 0 stores
    zeros."""
    x = x.astype(np.float32)
    qmax = np.float32(127.0 if kind == "int8" else 448.0)
    delta = (np.abs(x).max(axis=axis, keepdims=True) / qmax).astype(np.float32)
    y = np.clip((x / np.where(delta > 0, delta, np.float32(1))).astype(np.float32), -qmax, qmax)
    c = np.rint(y).astype(np.float64) if kind == "int8" else to_e4m3(y)
    return np.where(delta > 0, c * delta.astype(np.float64), 0.0)


def quantized_cache(k, v, kind):
    """k, v [T, d_h]: K per channel over each closed tile, the open tile as is; V per row."""
    k_hat = k.astype(np.float32).astype(np.float64)
    for t0 in range(0, len(k) // KEY_TILE * KEY_TILE, KEY_TILE):
        k_hat[t0 : t0 + KEY_TILE] = quantize(k[t0 : t0 + KEY_TILE], kind, axis=0)
    return k_hat, quantize(v, kind)


def attend(q, k, v):
    """q [g, d_h], k, v [T, d_h]: softmax(q k^T / sqrt(d_h)) v (SPEC 4.2-4.5), the last query."""
    s = q @ k.T / np.sqrt(k.shape[1])
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ v


def real_keys(rng, t, h, d):
    k = rng.standard_normal((t, h, d))
    offset = rng.standard_normal((h, d))
    scale = np.ones((h, d))
    for head in range(h):
        for i, s in enumerate(OUTLIERS):
            scale[head, (5 + i * (d // len(OUTLIERS)) + head) % d] = s
    m = np.ones(t)
    m[::MASSIVE_EVERY] = MASSIVE
    m[1] = MASSIVE
    return m[:, None, None] * scale * (k + offset)


def main():
    seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    batch, t, h_kv, g, d = 2, 3000, 2, 4, 128
    kinds = ("bf16", "int8", "fp8")
    per_head = {kind: [] for kind in kinds}
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        worst = {kind: 0.0 for kind in kinds}
        for _ in range(batch):
            k = real_keys(rng, t, h_kv, d).astype(np.float32).astype(np.float64)
            v = rng.standard_normal((t, h_kv, d)).astype(np.float32).astype(np.float64)
            q = rng.standard_normal((h_kv * g, d))
            for j in range(h_kv):
                qj, kj, vj = q[j * g : (j + 1) * g], k[:, j], v[:, j]
                exact = attend(qj, kj, vj)
                caches = {"bf16": (to_bf16(kj), to_bf16(vj))}
                caches.update({kind: quantized_cache(kj, vj, kind) for kind in ("int8", "fp8")})
                for kind, (k_hat, v_hat) in caches.items():
                    err = np.abs(attend(qj, k_hat, v_hat) - exact).max() / np.abs(exact).max()
                    per_head[kind].append(err)
                    worst[kind] = max(worst[kind], err)
        print(
            f"seed {seed:2d}: bf16 {worst['bf16']:.2e}  int8 {worst['int8']:.2e} "
            f"({worst['int8'] / worst['bf16']:.1f}x)  fp8 {worst['fp8']:.2e} "
            f"({worst['fp8'] / worst['bf16']:.1f}x)"
        )
    bf16 = np.array(per_head["bf16"])
    for kind in ("int8", "fp8"):
        ratio = np.array(per_head[kind]) / bf16
        print(
            f"{kind} / bf16 over {len(ratio)} (sequence, KV head) pairs: median "
            f"{np.median(ratio):.1f}x, geometric mean {np.exp(np.log(ratio).mean()):.1f}x, "
            f"range {ratio.min():.1f}x - {ratio.max():.1f}x"
        )


if __name__ == "__main__":
    main()
