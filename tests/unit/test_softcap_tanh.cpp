// tests/unit/test_softcap_tanh.cpp — the tanh of soft-capping (SPEC "Score variants used by
// real models": cap(z) = c·tanh(z / c)) on every kernel path this machine runs: the SIMD
// kernels' rational tanh (src/kernels/simd/tanh-inl.h, through the per-target test hook
// kernels::softcap_tanh_<isa>) and the portable kernel's std::tanh in float.
//
// Accuracy against tanh in float64 (std::tanh on the exactly widened input), in ULP of the
// float64 value's float binade: every 127th fp32 in [0, 10] (an odd stride, so every mantissa
// residue class is visited), every fp32 in [8, 9.2] (where the rational's largest errors lie),
// 20000 subnormal ones and 65536 from 1e-30 on; the negated inputs must give the bitwise negated
// results (tanh is odd). The bound, 6 ULP, is the largest error of an exhaustive run over all
// fp32 in [0, 10] (5.28 ULP on AVX-512 and AVX2) rounded up; a wrong coefficient gives hundreds
// of ULP, the quotient without its Newton step about a thousand. Special values exactly: NaN →
// NaN, ±∞ → ±1 (so a capped score is exactly ±c), ±0 → ±0, |x| ≥ 9.1 → ±1 (tanh rounds to 1
// from 9.011 on; the rational gives 1 from its clamp bound 9.1 on, at most 1 ULP less before).
#include <gtest/gtest.h>

#include <algorithm>
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

constexpr double kMaxUlp = 6.0;

// The tanh of soft-capping on path `isa` (null if the build lacks it).
kernels::TanhKernel tanh_of(Isa isa) {
  switch (isa) {
    case Isa::portable:  // the portable kernel's std::tanh(z / c) in float
      return [](const float* x, float* y, std::int64_t n) {
        for (std::int64_t i = 0; i < n; ++i) y[i] = std::tanh(x[i]);
      };
    case Isa::avx2:
      return kernels::softcap_tanh_avx2;
    case Isa::avx512:
    case Isa::avx512_bf16:  // the AVX-512 kernels' element-wise pass
      return kernels::softcap_tanh_avx512;
    case Isa::neon:
      return kernels::softcap_tanh_neon;
    default:
      return nullptr;
  }
}

class SoftcapTanh : public PerIsaTest {};

TEST_P(SoftcapTanh, WithinBoundOfFloat64) {
  const kernels::TanhKernel fn = tanh_of(GetParam());
  ASSERT_NE(fn, nullptr) << "no soft-capping tanh for a runnable path";
  std::vector<float> x;
  const std::uint32_t ten = std::bit_cast<std::uint32_t>(10.0f);
  for (std::uint32_t u = 0; u <= ten; u += 127) x.push_back(std::bit_cast<float>(u));
  for (float v = 8.0f; v <= 9.2f; v = std::nextafter(v, 10.0f)) x.push_back(v);
  for (std::uint32_t u = 1; u < 20000; ++u) x.push_back(std::bit_cast<float>(u));  // subnormal
  const std::uint32_t tiny = std::bit_cast<std::uint32_t>(1e-30f);  // tanh(x) = x in fp32
  for (std::uint32_t u = tiny; u < tiny + 65536; ++u) x.push_back(std::bit_cast<float>(u));
  x.push_back(std::numeric_limits<float>::min());
  x.push_back(std::numeric_limits<float>::denorm_min());
  const std::int64_t n = static_cast<std::int64_t>(x.size());
  std::vector<float> neg(x.size()), y(x.size(), kPoison), y_neg(x.size(), kPoison);
  for (std::size_t i = 0; i < x.size(); ++i) neg[i] = -x[i];
  fn(x.data(), y.data(), n);
  fn(neg.data(), y_neg.data(), n);
  const WorstUlp worst = worst_ulp(x, y, [](double v) { return std::tanh(v); });
  std::int64_t not_odd = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    not_odd += std::bit_cast<std::uint32_t>(y_neg[i]) !=
               (std::bit_cast<std::uint32_t>(y[i]) ^ 0x80000000u);
  }
  EXPECT_LE(worst.ulp, kMaxUlp) << "at x = " << worst.x;
  EXPECT_EQ(not_odd, 0) << "tanh(−x) ≠ −tanh(x) bitwise";
  std::printf("[ %s ] soft-capping tanh: max error %.2f ULP over %lld inputs (x = %.9g)\n",
              to_string(GetParam()), worst.ulp, static_cast<long long>(n), worst.x);
}

TEST_P(SoftcapTanh, SpecialValues) {
  const kernels::TanhKernel fn = tanh_of(GetParam());
  ASSERT_NE(fn, nullptr) << "no soft-capping tanh for a runnable path";
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  const float nan_payload = std::bit_cast<float>(0xffc12345u);  // negative NaN with a payload
  const float big = std::numeric_limits<float>::max();
  const std::vector<float> x = {qnan, -qnan,  nan_payload, kInf,    -kInf,  0.0f,   -0.0f,
                                big,  -big,   1e30f,       -1e30f,  -9.1f,  12.0f,  9.1f,
                                9.5f, -20.0f, 1e-40f,      -1e-40f, 1e-20f, -1e-20f};
  std::vector<float> y(x.size(), kPoison);
  fn(x.data(), y.data(), static_cast<std::int64_t>(x.size()));
  EXPECT_TRUE(std::isnan(y[0]));
  EXPECT_TRUE(std::isnan(y[1]));
  EXPECT_TRUE(std::isnan(y[2]));
  EXPECT_EQ(y[3], 1.0f);
  EXPECT_EQ(y[4], -1.0f);
  EXPECT_EQ(y[5], 0.0f);
  EXPECT_FALSE(std::signbit(y[5]));
  EXPECT_EQ(y[6], 0.0f);
  EXPECT_TRUE(std::signbit(y[6]));
  for (std::size_t i = 7; i < 16; ++i) {  // |x| ≥ 9.1 (the SIMD clamp bound): ±1
    EXPECT_EQ(y[i], std::copysign(1.0f, x[i])) << "x = " << x[i];
  }
  for (std::size_t i = 16; i < 20; ++i) {  // tiny: tanh(x) = x to within an ULP
    EXPECT_LE(ulp_error(y[i], std::tanh(static_cast<double>(x[i]))), 1.0) << "x = " << x[i];
    EXPECT_EQ(std::signbit(y[i]), std::signbit(x[i]));
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, SoftcapTanh, AllIsas(), IsaName);

}  // namespace
}  // namespace tokenmix::testing
