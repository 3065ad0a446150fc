// src/kernels/simd/tanh-inl.h — the fp32 tanh of soft-capping (SPEC "Score variants used by
// real models": cap(z) = c·tanh(z / c)), shared by the forward, backward (variants-inl.h) and
// decode kernels, so every SIMD path caps with the same function.
//
// Odd rational approximation, 16 vector operations with the AVX-512 reciprocal estimate:
//   tanh(x) ≈ x̂ · P(x̂²) / Q(x̂²),   x̂ = clamp(x, −9.1, 9.1),  P, Q of degree 4 in x̂²,
// P(0) = Q(0) = 1. The coefficients are a relative-error minimax fit of tanh(x)/x on
// t = x² ∈ [0, 9.1²] (Lawson-weighted linearised least squares in float64), rounded to fp32 one
// at a time, highest degree first, refitting the others after each (fit error 2.7e-8 relative
// with the rounded coefficients; tools/fit/fit_softcap_tanh.py reproduces them). fp32 tanh is 1 for
// |x| > 9.011, and the clamped value rounds to exactly 1, so ±∞ → ±1. The positive coefficients
// make both Horner sums free of cancellation. Measured over every fp32 in [0, 10] (odd: exact
// symmetry, so [−10, 10]): at most 5.28 ULP from tanh in float64 (AVX-512, AVX2), the largest
// errors near |x| ≈ 8.5 where the result may exceed 1 by 2 ULP; tests/unit/test_softcap_tanh.cpp
// asserts the bound on every path.
//
// The quotient: the hardware reciprocal estimate r of Q (AVX-512 14 bits; AVX2 12, NEON 8 bits,
// refined by 1 or 2 Newton steps r ← r·(2 − Q·r)), then one Newton step on the quotient itself,
// y = y0 − r·(Q·y0 − N) with y0 = N·r: no vector division (one per 16 scores issues every ~10
// cycles). The operand order keeps −0 (−0 − r·(+0) = −0).
// Special values: NaN → NaN (the clamp is Min(9.1, Max(−9.1, x)), whose x86 forms return the
// second operand, x, when it is NaN; Highway's NEON Min / Max are FMINNM / FMAXNM, which return
// the number, so there the NaN is selected back at the end: one compare and one select),
// ±∞ → ±1, ±0 → ±0, tiny x → x.
//
// Highway "-inl" header: included once per target from a foreach_target translation unit.
#if defined(TOKENMIX_KERNELS_SIMD_TANH_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TOKENMIX_KERNELS_SIMD_TANH_INL_H_
#undef TOKENMIX_KERNELS_SIMD_TANH_INL_H_
#else
#define TOKENMIX_KERNELS_SIMD_TANH_INL_H_
#endif

#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace tokenmix::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Newton steps on the reciprocal estimate before the quotient step: the AVX-512 family's
// estimate (rcp14) is good to 2^-14, so the quotient step alone reaches 2^-28; AVX2's (12 bits)
// needs one, NEON's (8 bits) two.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
constexpr int kTanhRcpSteps = 0;
#elif HWY_ARCH_ARM
constexpr int kTanhRcpSteps = 2;
#else
constexpr int kTanhRcpSteps = 1;
#endif

template <class D, class V = hn::Vec<D>>
HWY_INLINE V TanhRational(D d, V x) {
  const V bound = hn::Set(d, 0x1.233334p+3f);               // 9.1f
  const V xc = hn::Min(bound, hn::Max(hn::Neg(bound), x));  // x (NaN) is the second operand
  const V t = hn::Mul(xc, xc);
  V p = hn::MulAdd(hn::Set(d, 0x1.c7065ap-27f), t, hn::Set(d, 0x1.588194p-16f));
  p = hn::MulAdd(p, t, hn::Set(d, 0x1.c99c6ap-9f));
  p = hn::MulAdd(p, t, hn::Set(d, 0x1.11f8a4p-3f));
  p = hn::MulAdd(p, t, hn::Set(d, 1.0f));
  V q = hn::MulAdd(hn::Set(d, 0x1.9f22c4p-21f), t, hn::Set(d, 0x1.57c4a4p-12f));
  q = hn::MulAdd(q, t, hn::Set(d, 0x1.a7b49ap-6f));
  q = hn::MulAdd(q, t, hn::Set(d, 0x1.de519ep-2f));
  q = hn::MulAdd(q, t, hn::Set(d, 1.0f));
  const V num = hn::Mul(xc, p);
  V r = hn::ApproximateReciprocal(q);
  for (int i = 0; i < kTanhRcpSteps; ++i) r = hn::Mul(r, hn::NegMulAdd(q, r, hn::Set(d, 2.0f)));
  const V y0 = hn::Mul(num, r);
  const V y = hn::NegMulAdd(r, hn::MulSub(q, y0, num), y0);
#if HWY_ARCH_X86
  return y;  // a NaN x passed the clamp (the second operand of vminps / vmaxps)
#else
  return hn::IfThenElse(hn::IsNaN(x), x, y);  // NEON's Min / Max (FMINNM / FMAXNM) drop a NaN
#endif
}

}  // namespace tokenmix::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard toggle
