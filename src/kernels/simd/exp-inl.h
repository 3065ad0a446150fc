// src/kernels/simd/exp-inl.h — the fp32 e^x of the softmax weights (SPEC 4.4: P = e^{S − m},
// the rescale e^{m − m'}; SPEC "Backward pass": e^{S − L}), shared by the forward, backward and
// decode kernels through ExpNaN (nonfinite-inl.h), so every SIMD path weighs keys with the same
// function.
//
// The kernels' arguments are x = a score minus the row maximum (or minus L): x ≤ 0 up to
// rounding, −∞ for a masked key, NaN for a NaN score. Domain of SoftmaxExp: x ≤ 88 (e^x finite),
// −∞ and NaN (the result for NaN is unspecified: ExpNaN restores the NaN).
//
//   n = round(x / ln 2),  r = x − n·ln 2 ∈ [−ln 2 / 2, ln 2 / 2],  e^x = 2^n · e^r
//
// n from one FMA with a rounding constant (x·log₂e + 1.5·2^23 + 127 rounds to an integer in the
// low mantissa bits; subtracting the constant gives n exactly); r by Cody–Waite with the two-part
// ln 2 (C1 = fp32(ln 2), C2 = fp32(ln 2 − C1)), two FMAs; e^r by a degree-6 polynomial with
// P(0) = 1, P'(0) = 1 in Horner form, 6 FMAs: a relative-error minimax fit of e^r on
// [−ln 2 / 2, ln 2 / 2] (Lawson-weighted least squares in float64, coefficients rounded to fp32
// one at a time, highest degree first, refitting the others after each; fit error 3.8e-9
// relative, tools/fit/fit_softmax_exp.py reproduces them). Then 2^n:
//   * AVX-512: VSCALEFPS (p · 2^n), masked to 0 where x < −87.33 (one compare into a mask);
//   * other targets: 2^n's bits are the rounded sum's mantissa bits shifted left by 23 (the
//     exponent n + 127 ∈ [1, 254] for −87.33 ≤ x ≤ 88), one multiply, then 0 where x < −87.33.
// So e^x is exactly 0 below −87.33 (e^x < 2^−126, below the normal range) — in particular for
// x = −∞, so a masked key weighs exactly nothing — and never subnormal (no microcode assists in
// the products that read P). e^0 = 1 exactly (the row maximum's weight).
// About 13 vector operations per 16 scores on AVX-512 against about 30 for Highway's Exp
// (hwy/contrib/math, 1 ULP), which it replaced: the per-row softmax's share of a hot T_new = 1
// decode step fell from ≈ 12 % to ≈ 8 % on AMD Zen 4, the step by 0–9 % (docs/performance.md,
// D-softmax-1). Accuracy: 0.85 ULP from e^x in float64 at most over the normal range
// (tests/unit/test_softmax_exp.cpp asserts the bound on every path).
//
// Highway "-inl" header: included once per target from a foreach_target translation unit.
#if defined(TOKENMIX_KERNELS_SIMD_EXP_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TOKENMIX_KERNELS_SIMD_EXP_INL_H_
#undef TOKENMIX_KERNELS_SIMD_EXP_INL_H_
#else
#define TOKENMIX_KERNELS_SIMD_EXP_INL_H_
#endif

#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace tokenmix::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

template <class D, class V = hn::Vec<D>>
HWY_INLINE V SoftmaxExp(D d, V x) {
  const hn::RebindToSigned<D> di;
  // x·log₂e + (1.5·2^23 + 127): the sum is in [2^23, 2^24), so it is rounded to an integer
  // (ties to even), whose low mantissa bits are 0x400000 + 127 + n.
  const V round = hn::Set(d, 0x1.8000fep+23f);  // 1.5·2^23 + 127
  const V t = hn::MulAdd(x, hn::Set(d, 0x1.715476p+0f), round);
  const V n = hn::Sub(t, round);                          // exact
  V r = hn::NegMulAdd(n, hn::Set(d, 0x1.62e430p-1f), x);  // x − n·C1
  r = hn::NegMulAdd(n, hn::Set(d, -0x1.05c610p-29f), r);  // − n·C2 (C2 < 0)
  V p = hn::MulAdd(hn::Set(d, 0x1.6a2448p-10f), r, hn::Set(d, 0x1.1239d4p-7f));
  p = hn::MulAdd(p, r, hn::Set(d, 0x1.5558f2p-5f));
  p = hn::MulAdd(p, r, hn::Set(d, 0x1.555492p-3f));
  p = hn::MulAdd(p, r, hn::Set(d, 0x1.fffffcp-2f));
  p = hn::MulAdd(p, r, hn::Set(d, 1.0f));
  p = hn::MulAdd(p, r, hn::Set(d, 1.0f));
  // ln 2^−126 = −87.3365447…, rounded to fp32 towards 0: from there on n ≥ −126 and e^x ≥ 2^−126.
  const V lowest = hn::Set(d, -0x1.5d589ep+6f);
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  (void)di;
  const __mmask16 normal = _mm512_cmp_ps_mask(x.raw, lowest.raw, _CMP_GE_OQ);  // false for NaN
  return V{_mm512_maskz_scalef_ps(normal, p.raw, n.raw)};
#else
  const V two_n = hn::BitCast(d, hn::ShiftLeft<23>(hn::BitCast(di, t)));  // 2^n (bits)
  return hn::IfThenZeroElse(hn::Lt(x, lowest), hn::Mul(p, two_n));
#endif
}

}  // namespace tokenmix::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard toggle
