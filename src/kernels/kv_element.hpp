// src/kernels/kv_element.hpp — element conversions of the KV cache (tokenmix/kv_cache.hpp):
// fp32 → bf16 / f16 with round-to-nearest-even on write, exact widening back to fp32 on read.
// NaN stays NaN (quiet), ±∞ stays ±∞, values beyond the format's range round to ±∞. The same
// conversions widen bf16/f16 attention activations on pack and round O, dQ, dK, dV on store.
#pragma once

#include <bit>
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
      return;
  }
}

/// Element `i` of a `dtype` array, widened to fp32 (exact).
inline float load_element(DType dtype, const void* base, std::int64_t i) {
  switch (dtype) {
    case DType::f32:
      return static_cast<const float*>(base)[i];
    case DType::bf16:
      return bf16_to_f32(static_cast<const std::uint16_t*>(base)[i]);
    case DType::f16:
      return f16_to_f32(static_cast<const std::uint16_t*>(base)[i]);
    case DType::boolean:  // not a cache element type (KVCacheConfig validation)
    case DType::i32:
    case DType::i64:
      break;
  }
  return 0.0f;
}

}  // namespace tokenmix::kernels
