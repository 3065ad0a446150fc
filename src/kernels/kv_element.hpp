// src/kernels/kv_element.hpp — element conversions of the KV cache (tokenmix/kv_cache.hpp):
// fp32 → bf16 / f16 with round-to-nearest-even on write, exact widening back to fp32 on read.
// NaN stays NaN (quiet), ±∞ stays ±∞, values beyond the format's range round to ±∞. The same
// conversions widen bf16/f16 attention activations on pack and round O, dQ, dK, dV on store.
// The quantized cache types (int8, fp8 E4M3) are written a whole (token, KV head) row at a time
// with its fp32 scale (quantize_row, SPEC "Reduced precision → Quantized KV cache").
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "tokenmix/tensor.hpp"

namespace tokenmix::kernels {

inline std::uint16_t f32_to_bf16(float f) {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u)
    return static_cast<std::uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  // Round to nearest, ties to even, on the 16 dropped bits (carries into the exponent and to ∞).
  return static_cast<std::uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

inline float bf16_to_f32(std::uint16_t h) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16);
}

inline std::uint16_t f32_to_f16(float f) {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u)
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));  // NaN
  if (ax >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // ≥ 65520 (or ∞) → ∞
  if (ax >= 0x38800000u) {  // normal f16: rebias the exponent (127 → 15), round 13 bits RNE
    const std::uint32_t r = ax - (112u << 23);
    return static_cast<std::uint16_t>(sign | ((r + 0x0fffu + ((r >> 13) & 1u)) >> 13));
  }
  // Subnormal f16: value = k · 2^-24 with k = m · 2^(e − 126 − 24 + 24) = m >> (126 − e).
  const std::uint32_t e = ax >> 23;
  if (e < 102) return static_cast<std::uint16_t>(sign);  // below half the smallest subnormal
  const std::uint32_t m = (ax & 0x7fffffu) | 0x800000u, s = 126 - e;  // 14 ≤ s ≤ 24
  std::uint32_t k = m >> s;
  const std::uint32_t rem = m & ((1u << s) - 1u), half = 1u << (s - 1);
  if (rem > half || (rem == half && (k & 1u))) ++k;  // may carry into the smallest normal: fine
  return static_cast<std::uint16_t>(sign | k);
}

inline float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (m << 13));  // ∞ / NaN
  if (e == 0) {  // zero or subnormal: m · 2^-24, exact in float
    const float v = static_cast<float>(m) * 0x1.0p-24f;
    return sign ? -v : v;
  }
  return std::bit_cast<float>(sign | ((e + 112u) << 23) | (m << 13));
}

/// The quantized KV-cache element types: one-byte codes c with fp32 scales δ, x̂ = c · δ (SPEC
/// "Quantized KV cache": V one scale per row, K one per channel over each closed 64-key tile).
inline constexpr bool is_quantized(DType dtype) {
  return dtype == DType::int8 || dtype == DType::fp8_e4m3;
}
/// Largest stored magnitude: δ = max|x| / quant_max (SPEC): 127 (int8), 448 (fp8 E4M3).
inline constexpr float quant_max(DType dtype) {
  return dtype == DType::int8 ? 127.0f : 448.0f;
}

/// fp8 E4M3 ("E4M3FN": sign, 4 exponent bits with bias 7, 3 mantissa bits, no infinities, the
/// largest finite value 448; 0x7f / 0xff are NaN and are never stored) → fp32, exact:
/// 2^(e−7)·(1 + m/8) for e ≥ 1, m·2^−9 for e = 0.
inline float e4m3_to_f32(std::uint8_t b) {
  const std::uint32_t e = (b >> 3) & 0xfu, m = b & 7u;
  const float v = e == 0 ? static_cast<float>(m) * 0x1.0p-9f
                         : std::bit_cast<float>(((e + 120u) << 23) | (m << 20));
  return (b & 0x80u) != 0 ? -v : v;
}

/// fp32 → the nearest fp8 E4M3 value (ties to even); |y| ≥ 448 saturates to ±448 (the caller
/// passes |y| ≤ 448: x / δ with δ = max|x| / 448). y must not be NaN.
inline std::uint8_t f32_to_e4m3(float y) {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(y);
  const std::uint32_t sign = (x >> 24) & 0x80u, ax = x & 0x7fffffffu;
  if (ax >= 0x43e00000u) return static_cast<std::uint8_t>(sign | 0x7eu);  // ≥ 448
  if (ax >= 0x3c800000u) {  // ≥ 2^−6, normal: rebias the exponent (127 → 7), round 20 bits RNE
    const std::uint32_t r = ax - (120u << 23);
    return static_cast<std::uint8_t>(sign | ((r + 0x7ffffu + ((r >> 20) & 1u)) >> 20));
  }
  // Subnormal: k · 2^−9 with k = |y| · 2^9 rounded to nearest even (exact product; k = 8 is the
  // smallest normal, 0x08, so the carry is the right encoding).
  const std::uint32_t k =
      static_cast<std::uint32_t>(std::nearbyint(std::bit_cast<float>(ax) * 512.0f));
  return static_cast<std::uint8_t>(sign | k);
}

/// Quantizes one (token, KV head) row of n finite fp32 values x[i · x_stride] (SPEC "Reduced
/// precision → Quantized KV cache"): δ = max|x| / quant_max(dtype) (fp32 division); element i is
/// round(x_i / δ) ∈ [−127, 127] (int8, ties to even) or x_i / δ rounded to the nearest E4M3
/// value (fp8), stored as one byte at out[i · out_stride]; δ = 0 stores zeros. Returns δ.
inline float quantize_row(DType dtype, const float* x, std::int64_t x_stride, std::int64_t n,
                          std::byte* out, std::int64_t out_stride) {
  float amax = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i * x_stride]));
  const float lim = quant_max(dtype), delta = amax / lim;
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint8_t q = 0;
    if (delta != 0.0f) {
      const float y = std::clamp(x[i * x_stride] / delta, -lim, lim);
      q = dtype == DType::int8
              ? static_cast<std::uint8_t>(static_cast<std::int8_t>(std::nearbyint(y)))
              : f32_to_e4m3(y);
    }
    out[i * out_stride] = static_cast<std::byte>(q);
  }
  return delta;
}

/// The fp8 E4M3 cache element (its bits), a distinct type for the kernels templated on the cache
/// element type.
struct fp8_e4m3_t {
  std::uint8_t bits;
};

/// The 16-bit activation element types of the attention kernels (SPEC "Reduced precision"):
/// distinct types over the stored bits, so a kernel templated on its element type tells them
/// apart. Layout-compatible with std::uint16_t (and with Highway's bfloat16_t / float16_t).
struct bf16_t {
  std::uint16_t bits;
};
struct f16_t {
  std::uint16_t bits;
};

/// An activation element widened to fp32 (exact).
inline float widen(float x) {
  return x;
}
inline float widen(bf16_t x) {
  return bf16_to_f32(x.bits);
}
inline float widen(f16_t x) {
  return f16_to_f32(x.bits);
}

/// fp32 rounded to an activation element type, to nearest even (identity for float).
template <class T>
inline T narrow(float x) {
  if constexpr (std::is_same_v<T, bf16_t>) {
    return bf16_t{f32_to_bf16(x)};
  } else if constexpr (std::is_same_v<T, f16_t>) {
    return f16_t{f32_to_f16(x)};
  } else {
    return x;
  }
}

/// The DType of an activation element type.
template <class T>
inline constexpr DType dtype_of = std::is_same_v<T, bf16_t>  ? DType::bf16
                                  : std::is_same_v<T, f16_t> ? DType::f16
                                                             : DType::f32;

/// Stores x as element `i` of a `dtype` array.
inline void store_element(DType dtype, void* base, std::int64_t i, float x) {
  switch (dtype) {
    case DType::f32:
      static_cast<float*>(base)[i] = x;
      return;
    case DType::bf16:
      static_cast<std::uint16_t*>(base)[i] = f32_to_bf16(x);
      return;
    case DType::f16:
      static_cast<std::uint16_t*>(base)[i] = f32_to_f16(x);
      return;
    case DType::boolean:  // not a cache element type (KVCacheConfig validation)
    case DType::i32:
    case DType::i64:
    case DType::int8:  // quantized: written a row at a time with its scale (quantize_row)
    case DType::fp8_e4m3:
      return;
  }
}

/// Element `i` of a `dtype` array, widened to fp32 (exact); for int8 / fp8_e4m3 the stored
/// element q before its row's scale (x̂ = q · δ).
inline float load_element(DType dtype, const void* base, std::int64_t i) {
  switch (dtype) {
    case DType::f32:
      return static_cast<const float*>(base)[i];
    case DType::bf16:
      return bf16_to_f32(static_cast<const std::uint16_t*>(base)[i]);
    case DType::f16:
      return f16_to_f32(static_cast<const std::uint16_t*>(base)[i]);
    case DType::int8:
      return static_cast<float>(static_cast<const std::int8_t*>(base)[i]);
    case DType::fp8_e4m3:
      return e4m3_to_f32(static_cast<const std::uint8_t*>(base)[i]);
    case DType::boolean:  // not a cache element type (KVCacheConfig validation)
    case DType::i32:
    case DType::i64:
      break;
  }
  return 0.0f;
}

}  // namespace tokenmix::kernels
