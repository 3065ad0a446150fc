// tests/unit/test_forward_simd.cpp — the fused flash forward (src/kernels/simd) on every ISA
// path this machine supports, forced in turn, against the float64 oracle (SPEC 4.2–4.5, 4.8).
//
// The kernel tiles keys by 64 and stacks the g query heads of a KV group in SIMD lanes
// (M = 64 rows on AVX-512, 24 on AVX2; M / g query positions per unit), so the shapes below
// straddle those edges: T ∈ {tile−1, tile, tile+1, 2·tile+1} for both tilings, head widths
// {1, 3, 64, 80, 96, 128, 256} (remainder rows of the 6-/3-row microkernel), group sizes
// {1, 2, 4, 7, 8, 32} (7 and 32 do not divide the lane count evenly; 32 > 24 splits a group
// across units on AVX2), T_q < T_k and T_q > T_k in both alignments, and strided views (which
// take the kernel's packing path when d_h is not the unit-stride axis).
//
// Bound: rel_err ≤ 2e-5 (same justification as test_attention.cpp: length-d_h dot products and
// T_k-term weighted sums in fp32, u = 6e-8; exp is 1 ULP). A masking or tiling bug gives ≥ 1e-3.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "reference/reference.hpp"
#include "test_util.hpp"
#include "tokenmix/tokenmix.hpp"

namespace tokenmix::testing {
namespace {

constexpr double kBound = 2e-5;

struct SimdCase {
  std::int64_t B, Tq, Tk, Hq, Hkv, D;
  bool causal = true;
  CausalAlign align = CausalAlign::bottom_right;
  Layout layout = Layout::bthd;
};

std::vector<SimdCase> simd_cases() {
  std::vector<SimdCase> cases;
  // Key-tile edges (64) and AVX2 lane edges (24) with T_q = T_k, MHA and GQA.
  for (std::int64_t T : {1, 23, 24, 25, 49, 63, 64, 65, 129})
    cases.push_back({1, T, T, 4, 2, 64});
  // Head widths, including the ones with microkernel remainders.
  for (std::int64_t D : {1, 3, 64, 80, 96, 128, 256}) cases.push_back({1, 70, 70, 2, 1, D});
  // Group sizes g = H_q / H_kv.
  for (std::int64_t g : {1, 2, 4, 7, 8, 32}) cases.push_back({1, 33, 77, g * 2, 2, 16});
  // T_q ≠ T_k, both alignments, causal and not; batch > 1.
  cases.push_back({2, 20, 150, 8, 2, 32});
  cases.push_back({2, 150, 20, 8, 2, 32});  // bottom-right: the first 130 rows see no key
  cases.push_back({1, 20, 150, 8, 2, 32, true, CausalAlign::top_left});
  cases.push_back({1, 150, 20, 8, 2, 32, true, CausalAlign::top_left});
  cases.push_back({2, 65, 129, 4, 1, 40, false});
  // Strided views: PyTorch layout and padded (non-unit d_h stride is not possible with the
  // padded layout, so pack via bhtd-with-transposed-d below).
  cases.push_back({1, 65, 65, 8, 2, 64, true, CausalAlign::bottom_right, Layout::bhtd});
  cases.push_back({2, 31, 97, 14, 2, 80, true, CausalAlign::bottom_right, Layout::strided});
  return cases;
}

std::string case_name(const SimdCase& c) {
  return "B" + std::to_string(c.B) + "_Tq" + std::to_string(c.Tq) + "_Tk" + std::to_string(c.Tk) + "_Hq" +
         std::to_string(c.Hq) + "_Hkv" + std::to_string(c.Hkv) + "_d" + std::to_string(c.D) +
         (c.causal ? "" : "_noncausal") + (c.align == CausalAlign::top_left ? "_topleft" : "") + "_" +
         layout_name(c.layout);
}

reference::Options ref_options(const SimdCase& c) {
  reference::Options o;
  o.causal = c.causal;
  o.align = c.align == CausalAlign::bottom_right ? reference::Align::bottom_right : reference::Align::top_left;
  return o;
}

// Every ISA path the build knows, as gtest parameters; those this CPU lacks are skipped visibly.
class ForwardSimd : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    const auto avail = available_isas();
    if (std::find(avail.begin(), avail.end(), GetParam()) == avail.end()) {
      GTEST_SKIP() << "ISA " << to_string(GetParam()) << " is not available on this CPU/build";
    }
  }
};

TEST_P(ForwardSimd, MatchesFloat64ReferenceAcrossTileEdges) {
  std::mt19937_64 rng(1234);
  for (const SimdCase& c : simd_cases()) {
    SCOPED_TRACE(case_name(c));
    StridedTensor q(c.B, c.Tq, c.Hq, c.D, c.layout), k(c.B, c.Tk, c.Hkv, c.D, c.layout),
        v(c.B, c.Tk, c.Hkv, c.D, c.layout), out(c.B, c.Tq, c.Hq, c.D, c.layout);
    q.fill_random(rng);
    k.fill_random(rng);
    v.fill_random(rng);
    std::vector<float> lse(static_cast<std::size_t>(c.B * c.Hq * c.Tq), kPoison);  // poisoned
    AttentionOptions opt;
    opt.causal = c.causal;
    opt.align = c.align;
    opt.isa = GetParam();
    attention_forward(q.view, k.view, v.view, out.view, TensorView::bht(lse.data(), c.B, c.Hq, c.Tq), opt);
    const auto ref = reference::attention_forward(q.to64(), k.to64(), v.to64(), ref_options(c));
    EXPECT_LE(rel_err(out, ref.out), kBound);
    // LSE: −∞ exactly where the reference has −∞ (rows with no visible key), close elsewhere.
    double max_diff = 0.0;
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < c.Hq; ++h)
        for (std::int64_t t = 0; t < c.Tq; ++t) {
          const double r = ref.lse.at(b, h, t, 0);
          const float x = lse[static_cast<std::size_t>((b * c.Hq + h) * c.Tq + t)];
          if (std::isinf(r)) {
            ASSERT_TRUE(std::isinf(x) && x < 0) << "row b=" << b << " h=" << h << " t=" << t;
          } else {
            ASSERT_TRUE(std::isfinite(x));
            max_diff = std::max(max_diff, std::fabs(x - r) / std::max(1.0, std::fabs(r)));
          }
        }
    EXPECT_LE(max_diff, kBound);
  }
}

// d_h not the unit-stride axis: the kernel must pack K/V tiles (and gather Q) correctly.
TEST_P(ForwardSimd, NonUnitHeadDimStride) {
  const std::int64_t B = 1, T = 70, H = 4, Hkv = 2, D = 24;
  std::mt19937_64 rng(7);
  // Memory [B, D, T, H]: logical [B, T, H, D] with strides {D*T*H, H, 1, T*H}.
  auto make = [&](std::int64_t heads, std::vector<float>& buf) {
    buf.assign(static_cast<std::size_t>(B * D * T * heads), 0.0f);
    std::normal_distribution<float> dist;
    for (float& x : buf) x = dist(rng);
    return TensorView{buf.data(), DType::f32, 4, {B, T, heads, D}, {D * T * heads, heads, 1, T * heads}};
  };
  std::vector<float> qb, kb, vb, ob;
  const TensorView q = make(H, qb), k = make(Hkv, kb), v = make(Hkv, vb), o = make(H, ob);
  std::fill(ob.begin(), ob.end(), kPoison);
  AttentionOptions opt;
  opt.isa = GetParam();
  attention_forward(q, k, v, o, {}, opt);
  auto to64 = [&](const TensorView& x) {
    reference::Tensor64 r(x.shape);
    const auto* p = static_cast<const float*>(x.data);
    for (std::int64_t t = 0; t < x.shape[1]; ++t)
      for (std::int64_t h = 0; h < x.shape[2]; ++h)
        for (std::int64_t d = 0; d < D; ++d) r.at(0, t, h, d) = p[t * x.strides[1] + h * x.strides[2] + d * x.strides[3]];
    return r;
  };
  const auto ref = reference::attention_forward(to64(q), to64(k), to64(v));
  const auto got = to64(o);
  EXPECT_LE(rel_err_flat(got.data, ref.out.data), kBound);
}

// Results must not depend on the thread count: bitwise equal for 1, 2 and 3 threads.
TEST_P(ForwardSimd, BitwiseIdenticalAcrossThreadCounts) {
  const std::int64_t B = 2, T = 131, Hq = 8, Hkv = 2, D = 64;
  std::mt19937_64 rng(99);
  StridedTensor q(B, T, Hq, D, Layout::bthd), k(B, T, Hkv, D, Layout::bthd), v(B, T, Hkv, D, Layout::bthd);
  q.fill_random(rng);
  k.fill_random(rng);
  v.fill_random(rng);
  std::vector<std::vector<float>> outs, lses;
  for (int threads : {1, 2, 3}) {
    StridedTensor out(B, T, Hq, D, Layout::bthd);
    std::vector<float> lse(static_cast<std::size_t>(B * Hq * T), kPoison);
    AttentionOptions opt;
    opt.isa = GetParam();
    opt.threads = threads;
    attention_forward(q.view, k.view, v.view, out.view, TensorView::bht(lse.data(), B, Hq, T), opt);
    outs.push_back(out.storage);
    lses.push_back(lse);
  }
  for (std::size_t i = 1; i < outs.size(); ++i) {
    EXPECT_EQ(0, std::memcmp(outs[0].data(), outs[i].data(), outs[0].size() * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(lses[0].data(), lses[i].data(), lses[0].size() * sizeof(float)));
  }
}

// Scores of magnitude ~1e4 (q, k scaled by 100): no overflow to Inf/NaN; still exact.
TEST_P(ForwardSimd, LargeMagnitudeScoresStayFinite) {
  const std::int64_t B = 1, T = 97, Hq = 4, Hkv = 1, D = 64;
  std::mt19937_64 rng(5);
  StridedTensor q(B, T, Hq, D, Layout::bthd), k(B, T, Hkv, D, Layout::bthd), v(B, T, Hkv, D, Layout::bthd),
      out(B, T, Hq, D, Layout::bthd);
  q.fill_random(rng, 100.0);
  k.fill_random(rng, 100.0);
  v.fill_random(rng);
  std::vector<float> lse(static_cast<std::size_t>(B * Hq * T), kPoison);
  AttentionOptions opt;
  opt.isa = GetParam();
  attention_forward(q.view, k.view, v.view, out.view, TensorView::bht(lse.data(), B, Hq, T), opt);
  for (float x : out.storage) ASSERT_TRUE(std::isfinite(x));
  for (float x : lse) ASSERT_TRUE(std::isfinite(x));
  const auto ref = reference::attention_forward(q.to64(), k.to64(), v.to64());
  // Scores ~1e4 carry an absolute rounding error ~1e4·d_h·u ≈ 0.04, which moves the (nearly
  // one-hot) weights; outputs are still within 1e-2 of the float64 result relative to max|v|.
  EXPECT_LE(rel_err(out, ref.out), 1e-2);
}

INSTANTIATE_TEST_SUITE_P(AllIsas, ForwardSimd, ::testing::Values(Isa::portable, Isa::avx2, Isa::avx512),
                         [](const ::testing::TestParamInfo<Isa>& info) { return std::string(to_string(info.param)); });

}  // namespace
}  // namespace tokenmix::testing
