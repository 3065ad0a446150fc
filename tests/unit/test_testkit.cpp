// tests/unit/test_testkit.cpp — the testing toolkit itself (tools/testkit, test_util.hpp) and the
// public useful-work counts it takes its FLOPs from (SPEC "Useful-work counts"): a metric or a
// count that is wrong would make every bound and every benchmark figure meaningless.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "test_util.hpp"
#include "testkit.hpp"
#include "tokenmix/tokenmix.hpp"

namespace tokenmix::testing {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

TEST(UsefulWork, ForwardCountsVisiblePairs) {
  // T_q = T_k = 8 causal: P = 8·9/2 = 36 pairs; 4·d_h·H_q·P·B = 4·16·2·36.
  EXPECT_EQ(forward_flops(1, 8, 8, 2, 16, true, CausalAlign::bottom_right), 4.0 * 16 * 2 * 36);
  // Non-causal: every pair; B scales linearly.
  EXPECT_EQ(forward_flops(3, 5, 7, 4, 8, false, CausalAlign::bottom_right), 4.0 * 8 * 4 * 35 * 3);
}

TEST(UsefulWork, BackwardIsTwoAndAHalfTimesForward) {
  EXPECT_EQ(backward_flops(1, 8, 8, 2, 16, true, CausalAlign::bottom_right), 2.5 * 4608.0);
  for (CausalAlign align : {CausalAlign::bottom_right, CausalAlign::top_left})
    for (bool causal : {true, false})
      for (std::int64_t tk : {1, 5, 19, 300}) {
        const double f = forward_flops(2, 17, tk, 8, 64, causal, align);
        EXPECT_EQ(backward_flops(2, 17, tk, 8, 64, causal, align), 2.5 * f);
      }
  // Top-left, T_q = T_k = 4: P = 4·5/2 = 10.
  EXPECT_EQ(backward_flops(1, 4, 4, 1, 8, true, CausalAlign::top_left),
            2.5 * 4 * 8 * 1 * (4 * 5 / 2));
}

TEST(UsefulWork, CountErrorsNameTheFunctionCalled) {
  for (bool backward : {false, true}) {
    const char* fn = backward ? "backward_flops" : "forward_flops";
    try {
      (backward ? backward_flops : forward_flops)(1, 8, 8, -2, 16, true, CausalAlign::top_left);
      ADD_FAILURE() << fn << " accepted H_q = -2";
    } catch (const ArgumentError& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_EQ(std::string(e.what()).rfind(std::string(fn) + ": ", 0), 0u) << e.what();
      EXPECT_NE(std::string(e.what()).find("H_q"), std::string::npos) << e.what();
    }
  }
}

TEST(UsefulWork, CaseTableShapeUsesThePublicCounts) {
  testkit::AttentionShape s{2, 33, 77, 8, 2, 16, true, CausalAlign::top_left};
  EXPECT_EQ(s.forward_flops(), forward_flops(2, 33, 77, 8, 16, true, CausalAlign::top_left));
  EXPECT_EQ(s.backward_flops(), backward_flops(2, 33, 77, 8, 16, true, CausalAlign::top_left));
  EXPECT_STREQ(s.align_name(), "top_left");
  testkit::AttentionCase c{"c", s, 0.3};
  const AttentionOptions o = c.options(Isa::portable, 3);
  EXPECT_EQ(o.scale, 0.3);
  EXPECT_TRUE(o.causal);
  EXPECT_EQ(o.align, CausalAlign::top_left);
  EXPECT_EQ(o.isa, Isa::portable);
  EXPECT_EQ(o.threads, 3);
  EXPECT_EQ(c.reference_options().align, reference::Align::top_left);
  EXPECT_EQ(c.reference_options().scale, 0.3);
  // No scale in the case: both sides use the default 1/√d_h (not a scale of 0).
  const testkit::AttentionCase plain{"plain", s};
  EXPECT_FALSE(plain.options().scale.has_value());
  EXPECT_FALSE(plain.reference_options().scale.has_value());
  EXPECT_EQ(plain.options().isa, Isa::automatic);
}

TEST(ErrorMetric, MaxNormErrorOverMaxNormOfTheReference) {
  const std::vector<double> r = {1.0, -4.0, 0.5};
  EXPECT_EQ(testkit::rel_err(std::vector<float>{1.0f, -4.0f, 0.5f}, r), 0.0);
  // max|x − r| = 0.5 (first entry), max|r| = 4.
  EXPECT_DOUBLE_EQ(testkit::rel_err(std::vector<float>{1.5f, -4.25f, 0.5f}, r), 0.5 / 4.0);
  // 0/0 is 0; an error against an all-zero reference is judged by the floor.
  EXPECT_EQ(testkit::rel_err(std::vector<double>{0.0}, std::vector<double>{0.0}), 0.0);
  EXPECT_DOUBLE_EQ(testkit::rel_err(std::vector<double>{1e-3}, std::vector<double>{0.0}, 1.0),
                   1e-3);
}

TEST(ErrorMetric, NonFiniteValues) {
  // A NaN on either side, or an infinity against a different value, is an infinite error.
  EXPECT_EQ(testkit::rel_err(std::vector<double>{kNaN, 1.0}, std::vector<double>{1.0, 1.0}), kInf);
  EXPECT_EQ(testkit::rel_err(std::vector<double>{1.0}, std::vector<double>{kNaN}), kInf);
  EXPECT_EQ(testkit::rel_err(std::vector<double>{-kInf}, std::vector<double>{-1.0}), kInf);
  EXPECT_EQ(testkit::rel_err(std::vector<double>{kInf}, std::vector<double>{-kInf}), kInf);
  // Equal infinities (the −∞ log-sum-exp of an empty row) are exact and do not count in max|r|.
  EXPECT_DOUBLE_EQ(
      testkit::rel_err(std::vector<double>{-kInf, 2.5}, std::vector<double>{-kInf, 2.0}), 0.25);
  // A length mismatch cannot pass.
  EXPECT_EQ(testkit::rel_err(std::vector<double>{1.0}, std::vector<double>{1.0, 2.0}), kInf);
}

TEST(ErrorMetric, StridedTensorSeesOnlyLogicalElementsAndPoisonFails) {
  std::mt19937_64 rng(5);
  StridedTensor x(2, 3, 2, 5, Layout::strided);  // padding stays NaN
  x.fill_random(rng);
  Tensor64 r = x.to64();
  EXPECT_EQ(rel_err(x, r), 0.0);
  r.at(1, 2, 1, 4) += 0.125;
  double max_ref = 0.0;
  for (double v : r.data) max_ref = std::max(max_ref, std::fabs(v));
  EXPECT_DOUBLE_EQ(rel_err(x, r), 0.125 / max_ref);
  EXPECT_DOUBLE_EQ(rel_err(x, r, 1e6), 0.125 / 1e6);  // the floor
  x.at(0, 1, 0, 2) = kPoison;                         // an element a kernel failed to write
  EXPECT_EQ(rel_err(x, r), kInf);
}

TEST(IsaPaths, UnavailableReasonNamesTheCause) {
  for (Isa isa : testkit::concrete_isas()) {
    const std::string why = testkit::isa_unavailable_reason(isa);
    const auto avail = available_isas();
    const bool runs = std::find(avail.begin(), avail.end(), isa) != avail.end();
    EXPECT_EQ(why.empty(), runs) << to_string(isa) << ": " << why;
    if (!runs) {
      EXPECT_NE(why.find(to_string(isa)), std::string::npos) << why;
      EXPECT_NE(why.find(cpu_features().model), std::string::npos) << why;
    }
  }
  EXPECT_EQ(testkit::isa_unavailable_reason(Isa::portable), "");
}

TEST(OracleSlices, Slice64TakesRowsAndHeadsOfEveryBatch) {
  const std::int64_t B = 2, T = 5, H = 3, D = 4;
  std::vector<float> x(static_cast<std::size_t>(B * T * H * D));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i);
  const Tensor64 s = testkit::slice64(x, B, T, H, D, 1, 3, 2, 1);
  ASSERT_EQ(s.shape, (std::array<std::int64_t, 4>{B, 3, 1, D}));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < 3; ++t)
      for (std::int64_t d = 0; d < D; ++d)
        EXPECT_EQ(s.at(b, t, 0, d), static_cast<double>(((b * T + 1 + t) * H + 2) * D + d));
  EXPECT_EQ(testkit::slice64(x, B, T, H, D).data, std::vector<double>(x.begin(), x.end()));
}

// The real-keys profile: k[t, h, e] = m_t · s_{h,e} · (x + o_{h,e}), its outlier channels at
// (5 + i·⌊d_h / 6⌋ + h) mod d_h, massive tokens 0, 1 and 2048; a k too small is refused.
TEST(RealKeys, OutlierChannelsOffsetsAndMassiveTokens) {
  const std::int64_t T = 2050, H = 2, D = 12;
  std::vector<float> k(static_cast<std::size_t>(T * H * D), 0.0f);  // x = 0: k = m_t s o
  testkit::apply_real_keys(k, T, H, D, 5);
  const std::vector<float> o = testkit::random_normal(static_cast<std::size_t>(H * D), 5);
  for (std::int64_t t : {0, 1, 2, 1000, 2048, 2049})
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t e = 0; e < D; ++e) {
        double s = 1.0;
        for (std::int64_t i = 0; i < 6; ++i)
          if (e == (5 + 2 * i + h) % D) s = testkit::kRealKeyOutliers[i];
        const double m = t == 0 || t == 1 || t == 2048 ? testkit::kRealKeyMassive : 1.0;
        EXPECT_FLOAT_EQ(k[static_cast<std::size_t>((t * H + h) * D + e)],
                        static_cast<float>(m * s * o[static_cast<std::size_t>(h * D + e)]))
            << "t=" << t << " h=" << h << " e=" << e;
      }
  EXPECT_THROW(testkit::apply_real_keys(k, T + 1, H, D, 5), ArgumentError);
}

}  // namespace
}  // namespace tokenmix::testing
