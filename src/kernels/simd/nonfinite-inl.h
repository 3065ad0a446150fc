// src/kernels/simd/nonfinite-inl.h — NaN/±∞ propagation for the SIMD kernels (SPEC 4.3
// "Non-finite inputs"; the rules are in kernels/nonfinite.hpp and docs/design.md "Numerics").
//
// Two things in the flash kernels would otherwise hide a NaN:
//   * The kernels' exp (SoftmaxExp, exp-inl.h) returns 0 for a NaN argument on AVX-512 (its
//     range compare is false for NaN), so a NaN score would become a weight of 0. ExpNaN fixes
//     that with one vmaxps per element.
//   * The products P·V (forward) and dS·K, Pᵀ·dO, dSᵀ·Q (backward) run over every key of a tile
//     that crosses the causal diagonal, with P = 0 for the lanes that do not see a key — and
//     0 · NaN = NaN, so a NaN or ±∞ stored in a masked key's row leaked into rows that must not
//     see it. GemmRowsMaskedIfNonFinite keeps the plain microkernel (and its speed) whenever the
//     operand rows of the partially visible keys are finite — then 0 · x = ±0 adds nothing — and
//     otherwise runs a product in which a masked (k, lane) pair is selected away, never added.
//
// Highway "-inl" header: included once per target from a foreach_target translation unit,
// after microkernel-inl.h.
#if defined(TOKENMIX_KERNELS_SIMD_NONFINITE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TOKENMIX_KERNELS_SIMD_NONFINITE_INL_H_
#undef TOKENMIX_KERNELS_SIMD_NONFINITE_INL_H_
#else
#define TOKENMIX_KERNELS_SIMD_NONFINITE_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "hwy/highway.h"
#include "kernels/simd/exp-inl.h"

HWY_BEFORE_NAMESPACE();
namespace tokenmix::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// e^x (SoftmaxExp, exp-inl.h) that is NaN for NaN x. For every other argument the kernels pass
// (x ≤ ~88: a score minus the row maximum or minus L) e^x > x, so Max(SoftmaxExp(x), x) =
// SoftmaxExp(x) bit for bit, and e^{−∞} = 0. For NaN x the result is x: x86's vmaxps returns its
// second operand when either is NaN (one op per element). Elsewhere Highway's Max may drop a NaN
// (NEON's FMAXNM does), so other targets select it explicitly (two ops). test_nonfinite checks it
// on every path.
template <class D, class V>
HWY_INLINE V ExpNaN(D d, V x) {
#if HWY_ARCH_X86
  return hn::Max(SoftmaxExp(d, x), x);  // vmaxps returns its second operand if either is NaN
#else
  // Highway's Max on NEON is FMAXNM (the non-NaN operand wins): select the NaN explicitly.
  return hn::IfThenElse(hn::IsNaN(x), x, SoftmaxExp(d, x));
#endif
}

// The backward's weights A = e^{S − L} (SPEC "Backward pass"), as ExpNaN but exactly 0 below
// 2^−64 (x < −64·ln 2). Far keys under ALiBi (scores down to −m·T) otherwise give a band of
// subnormal weights per row, and subnormal operands of the dS, dQ, dK products cost a microcode
// assist per vector op on x86: the backward with ALiBi at T = 2048 took 4.2 s instead of 1.1 s
// (Xeon; docs/performance.md, D-bwd-5). A weight < 2^−64 of a row whose weights sum to 1 changes no
// fp32 result (T · 2^−64 ≪ 2^−24 for any T < 2^31); NaN x still gives NaN (Lt is false).
template <class D, class V>
HWY_INLINE V ExpNaNFlushTiny(D d, V x) {
  const V kTiny = hn::Set(d, -44.3614195558365f);  // −64 · ln 2: e^x < 2^−64 below
  return hn::IfThenZeroElse(hn::Lt(x, kTiny), ExpNaN(d, x));
}

// True if a[r·a_row + k·a_k] is NaN or ±∞ for some r < rows, k0 ≤ k < k1.
template <class D>
HWY_INLINE bool AnyNonFinite(D d, const float* a, std::int64_t a_row, std::int64_t a_k,
                             std::int64_t rows, std::int64_t k0, std::int64_t k1) {
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  auto probe = hn::Zero(d);  // Σ x · 0: ±0 while every x is finite, NaN (sticky) otherwise
  const auto zero = hn::Zero(d);
  bool bad = false;
  for (std::int64_t k = k0; k < k1; ++k) {
    const float* row = a + k * a_k;
    std::int64_t r = 0;
    if (a_row == 1) {
      for (; r + N <= rows; r += N) probe = hn::MulAdd(hn::LoadU(d, row + r), zero, probe);
    }
    for (; r < rows; ++r) bad |= !std::isfinite(row[r * a_row]);
  }
  return bad || !hn::AllFalse(d, hn::IsNaN(probe));
}

// C[rows][M] (+)= Σ_k [visible(k, i)] A_r[k] · B[k][i] with M = m lanes, the same operands and
// per-element FMA sequence as GemmRows (so lanes that see every key get bitwise the same
// result), but a pair (k, lane) that visible(k, lane0) — a mask over lanes lane0.. — leaves out
// takes no part. Register-light and slower: only used when a masked operand is not finite.
template <class D, class VisibleFn>
HWY_NOINLINE void GemmRowsMasked(D d, std::int64_t rows, const float* a, std::int64_t a_row,
                                 std::int64_t a_k, const float* b, std::int64_t ldb, std::int64_t K,
                                 float* c, std::int64_t ldc, std::int64_t m, bool accumulate,
                                 const float* c_scale, const VisibleFn& visible) {
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  for (std::int64_t i = 0; i < m; i += N) {
    for (std::int64_t r = 0; r < rows; ++r) {
      auto acc = accumulate ? hn::LoadU(d, c + r * ldc + i) : hn::Zero(d);
      if (c_scale != nullptr) acc = hn::Mul(acc, hn::LoadU(d, c_scale + i));
      for (std::int64_t k = 0; k < K; ++k) {
        const auto prod =
            hn::MulAdd(hn::Set(d, a[r * a_row + k * a_k]), hn::LoadU(d, b + k * ldb + i), acc);
        acc = hn::IfThenElse(visible(k, i), prod, acc);
      }
      hn::StoreU(acc, d, c + r * ldc + i);
    }
  }
}

// GemmRows (kR × VN blocking, M = VN·Lanes lanes; VN = kV unless the caller asks for another
// width) when the A operand is finite for every k in [k_lo, k_hi) — the k whose lanes are not
// all visible — else GemmRowsMasked. With an empty range (every lane sees every k: the common
// case) there is no check at all.
template <int VN = kV, class D, class VisibleFn>
HWY_INLINE void GemmRowsMaskedIfNonFinite(D d, std::int64_t rows, const float* a,
                                          std::int64_t a_row, std::int64_t a_k, const float* b,
                                          std::int64_t ldb, std::int64_t K, float* c,
                                          std::int64_t ldc, bool accumulate, const float* c_scale,
                                          std::int64_t k_lo, std::int64_t k_hi,
                                          const VisibleFn& visible) {
  k_lo = std::clamp<std::int64_t>(k_lo, 0, K);
  k_hi = std::clamp<std::int64_t>(k_hi, k_lo, K);
  if (k_lo < k_hi && AnyNonFinite(d, a, a_row, a_k, rows, k_lo, k_hi)) {
    const std::int64_t M = VN * static_cast<std::int64_t>(hn::Lanes(d));
    GemmRowsMasked(d, rows, a, a_row, a_k, b, ldb, K, c, ldc, M, accumulate, c_scale, visible);
  } else {
    GemmRows<kR, VN>(d, rows, a, a_row, a_k, b, ldb, K, c, ldc, accumulate, c_scale);
  }
}

}  // namespace tokenmix::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard toggle
