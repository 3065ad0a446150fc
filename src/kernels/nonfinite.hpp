// src/kernels/nonfinite.hpp — scalar helpers that keep NaN and ±∞ flowing as IEEE arithmetic
// says (SPEC 4.3 "Non-finite inputs"); the SIMD counterparts are in simd/nonfinite-inl.h.
//
// The rules every path follows (docs/design.md, "Numerics"):
//   * a key a row does not see takes no part in that row's arithmetic (selected away, never
//     multiplied by 0: 0 · NaN = NaN);
//   * a NaN the row does read makes its O and L NaN; a +∞ score does too (e^{∞ − ∞} = NaN, as in
//     PyTorch's softmax); a −∞ score next to finite ones is a weight of exactly 0;
//   * a row whose visible scores are all −∞ (or that sees no key) has l = 0: O = 0 · (Σ 0 · v),
//     which is 0 unless a visible v is NaN or ±∞, and L = −∞.
#pragma once

#include <limits>

namespace tokenmix::kernels {

/// max(a, b) that is NaN when either is (std::max(a, b) returns a when b is NaN, and
/// std::max(NaN, b) returns NaN only by the order of its arguments).
template <class T>
inline T max_nan(T a, T b) {
  if (a != a || b != b) return a + b;  // NaN + x = NaN
  return a < b ? b : a;
}

/// The shift of the stable softmax for a running maximum m: m itself, or 0 while no finite score
/// has been seen (m = −∞), so that e^{s − shift} = e^{−∞} = 0 instead of e^{−∞ + ∞} = NaN. Also
/// used for a saved L = −∞ in the backward (a row whose visible scores are all −∞: P = 0).
template <class T>
inline T softmax_shift(T m) {
  return m == -std::numeric_limits<T>::infinity() ? T(0) : m;
}

/// 1 / l for the final normalisation O = Õ / l: 0 for l = 0 (no finite score: O = 0 · Õ), and
/// NaN for l = NaN (a row that read a NaN) — unlike `l > 0 ? 1 / l : 0`, which hides it.
template <class T>
inline T inverse_sum(T l) {
  return l == T(0) ? T(0) : T(1) / l;
}

}  // namespace tokenmix::kernels
