// tests/unit/test_softmax_exp.cpp — the e^x of the softmax weights (SPEC 4.4: P = e^{S − m} and
// the rescale e^{m − m'}; SPEC "Backward pass": e^{S − L}) on every SIMD path this machine runs:
// ExpNaN over SoftmaxExp (src/kernels/simd/exp-inl.h), through the per-target test hook
// kernels::softmax_exp_<isa>. The portable kernels use std::exp (checked by the float64-oracle
// tests of every kernel); here a portable parameter checks that same std::exp against the bound.
//
// Accuracy against exp in float64 (std::exp on the exactly widened input), in ULP of the float64
// value's float binade, over the normal range of the result, x ∈ [−87.33654, 88]: every 509th
// fp32 (an odd stride, so every mantissa residue class is visited), every 7th in [−2^−10, −2^−13]
// near the row maximum (x = S − m ≈ 0) and a sample from there to −0, every fp32 in [−1, −0.99]
// and near ± ln 2 / 2, where the reduced argument changes sides. The bound, 2 ULP, is the largest
// error measured over those inputs (0.85 ULP on AVX-512 and AVX2, AMD Zen 4) rounded up. Special
// values exactly: e^0 = e^−0 = 1 (the row maximum's weight), e^−∞ = +0 (a masked key weighs
// nothing), NaN → NaN, 0 below −87.33654 (e^x < 2^−126) and never a subnormal result.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <vector>

#include "kernels/attention_kernels.hpp"
#include "test_util.hpp"

namespace tokenmix::testing {
namespace {

constexpr double kMaxUlp = 2.0;
constexpr float kLowest = -0x1.5d589ep+6f;  // −87.33654: fp32 ln 2^−126 rounded towards 0

// The softmax exp on path `isa` (null if the build lacks it).
kernels::ExpKernel exp_of(Isa isa) {
  switch (isa) {
    case Isa::portable:  // the portable kernels' std::exp in float
      return [](const float* x, float* y, std::int64_t n) {
        for (std::int64_t i = 0; i < n; ++i) y[i] = std::exp(x[i]);
      };
    case Isa::avx2:
      return kernels::softmax_exp_avx2;
    case Isa::avx512:
    case Isa::avx512_bf16:  // the AVX-512 kernels' exp
      return kernels::softmax_exp_avx512;
    case Isa::neon:
      return kernels::softmax_exp_neon;
    default:
      return nullptr;
  }
}

// fp32 in the order of the reals as an unsigned key (−0 just below +0) and back.
std::uint32_t order_key(float v) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(v);
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}
float from_order_key(std::uint32_t k) {
  return std::bit_cast<float>((k & 0x80000000u) != 0 ? (k & 0x7fffffffu) : ~k);
}

// Every fp32 from lo to hi (both finite, lo ≤ hi) whose position in that ordered range is a
// multiple of `stride`.
void push_range(std::vector<float>& x, float lo, float hi, std::uint32_t stride) {
  const std::uint64_t end = order_key(hi);
  for (std::uint64_t k = order_key(lo); k <= end; k += stride) {
    x.push_back(from_order_key(static_cast<std::uint32_t>(k)));
  }
}

class SoftmaxExp : public PerIsaTest {};

TEST_P(SoftmaxExp, WithinBoundOfFloat64OverTheNormalRange) {
  const kernels::ExpKernel fn = exp_of(GetParam());
  ASSERT_NE(fn, nullptr) << "no softmax exp for a runnable path";
  std::vector<float> x;
  push_range(x, kLowest, 88.0f, 509);
  push_range(x, -0x1.0p-10f, -0x1.0p-13f, 7);
  push_range(x, -0x1.0p-13f, 0.0f, 100'003);  // down to −0 (the tiny ones give 1 or 1 − 2^−24)
  push_range(x, -1.0f, -0.99f, 1);
  push_range(x, -0.3466f, -0.3465f, 1);  // ± ln 2 / 2 = ±0.34657
  push_range(x, 0.3465f, 0.3466f, 1);
  const std::int64_t n = static_cast<std::int64_t>(x.size());
  ASSERT_GT(n, 4'000'000);  // the strided sweep alone: about 2.24·10^9 / 509 values
  std::vector<float> y(x.size(), kPoison);
  fn(x.data(), y.data(), n);
  const WorstUlp worst = worst_ulp(x, y, [](double v) { return std::exp(v); });
  std::int64_t subnormal = 0;
  for (const float v : y) subnormal += std::fpclassify(v) == FP_SUBNORMAL;
  EXPECT_LE(worst.ulp, kMaxUlp) << "at x = " << worst.x;
  EXPECT_EQ(subnormal, 0) << "e^x ≥ 2^−126 here: no subnormal result";
  std::printf("[ %s ] softmax exp: max error %.2f ULP over %lld inputs (x = %.9g)\n",
              to_string(GetParam()), worst.ulp, static_cast<long long>(n), worst.x);
}

TEST_P(SoftmaxExp, SpecialValues) {
  const kernels::ExpKernel fn = exp_of(GetParam());
  ASSERT_NE(fn, nullptr) << "no softmax exp for a runnable path";
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  const float nan_payload = std::bit_cast<float>(0xffc12345u);  // negative NaN with a payload
  const std::vector<float> x = {qnan, -qnan, nan_payload, 0.0f, -0.0f, -kInf, kLowest};
  std::vector<float> y(x.size(), kPoison);
  fn(x.data(), y.data(), static_cast<std::int64_t>(x.size()));
  EXPECT_TRUE(std::isnan(y[0]));
  EXPECT_TRUE(std::isnan(y[1]));
  EXPECT_TRUE(std::isnan(y[2]));
  EXPECT_EQ(y[3], 1.0f);
  EXPECT_EQ(y[4], 1.0f);
  EXPECT_EQ(std::bit_cast<std::uint32_t>(y[5]), 0u) << "e^−∞ must be +0";
  EXPECT_GE(y[6], std::numeric_limits<float>::min()) << "e^x at the lowest normal argument";
}

// Below the normal range the SIMD exp is exactly +0 (the portable kernels' std::exp is subnormal
// there first; a row's weights sum to at least 1, so no fp32 result can tell them apart).
class SoftmaxExpSimd : public PerIsaTest {};

TEST_P(SoftmaxExpSimd, ZeroBelowTheNormalRange) {
  const kernels::ExpKernel fn = exp_of(GetParam());
  ASSERT_NE(fn, nullptr) << "no softmax exp for a runnable path";
  constexpr float kInf = std::numeric_limits<float>::infinity();
  std::vector<float> x;
  push_range(x, -300.0f, std::nextafter(kLowest, -kInf), 97);
  x.push_back(std::nextafter(kLowest, -kInf));
  x.push_back(-std::numeric_limits<float>::max());
  x.push_back(-1e30f);
  ASSERT_GT(x.size(), 10'000u);
  std::vector<float> y(x.size(), kPoison);
  fn(x.data(), y.data(), static_cast<std::int64_t>(x.size()));
  for (std::size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(std::bit_cast<std::uint32_t>(y[i]), 0u) << "x = " << x[i] << ": " << y[i];
  }
}

// The SIMD paths (every concrete path but portable).
std::vector<Isa> SimdIsas() {
  std::vector<Isa> isas;
  for (const Isa isa : testkit::concrete_isas()) {
    if (isa != Isa::portable) isas.push_back(isa);
  }
  return isas;
}

INSTANTIATE_TEST_SUITE_P(AllIsas, SoftmaxExp, AllIsas(), IsaName);
INSTANTIATE_TEST_SUITE_P(SimdIsas, SoftmaxExpSimd, ::testing::ValuesIn(SimdIsas()), IsaName);

}  // namespace
}  // namespace tokenmix::testing
