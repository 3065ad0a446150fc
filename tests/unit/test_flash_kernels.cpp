// tests/unit/test_flash_kernels.cpp — the fused flash forward and backward (src/kernels/simd) on
// every ISA path this machine supports, forced in turn, against the float64 oracle
// (SPEC 4.2–4.5, 4.8, "Backward pass") and finite differences.
//
// The kernel tiles keys by 64 and stacks the g query heads of a KV group in SIMD lanes
// (M = 64 rows on AVX-512, 24 on AVX2; M / g query positions per unit), so the shapes below
// straddle those edges: T ∈ {tile−1, tile, tile+1, 2·tile+1} for both tilings, head widths
// {1, 3, 64, 80, 96, 128, 256} (remainder rows of the 6-/3-row microkernel), group sizes
// {1, 2, 4, 7, 8, 32} (7 and 32 do not divide the lane count evenly; 32 > 24 splits a group
// across units on AVX2), T_q < T_k and T_q > T_k in both alignments, and strided views (which
// take the kernel's packing path when d_h is not the unit-stride axis).
//
// Bounds: forward rel_err ≤ 2e-5 (same justification as test_attention.cpp: length-d_h dot
// products and T_k-term weighted sums in fp32, u = 6e-8; exp is 1 ULP). Backward ≤ 1e-4: one
// more product per term, sums over T_q and the g heads of a group, and the cancellation in
// dA − D. Gradients are compared with max|x − r| / max(max|r|, G) where G = max|dO|·max|V|·s
// is the natural size of a gradient entry: a gradient that is exactly 0 in exact arithmetic
// (e.g. dQ for T = 1, where softmax is constant) is then judged by its absolute rounding error.
// A masking or tiling bug gives errors ≥ 1e-3.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <tuple>
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
  for (std::int64_t T : {1, 23, 24, 25, 49, 63, 64, 65, 129}) cases.push_back({1, T, T, 4, 2, 64});
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
  return "B" + std::to_string(c.B) + "_Tq" + std::to_string(c.Tq) + "_Tk" + std::to_string(c.Tk) +
         "_Hq" + std::to_string(c.Hq) + "_Hkv" + std::to_string(c.Hkv) + "_d" +
         std::to_string(c.D) + (c.causal ? "" : "_noncausal") +
         (c.align == CausalAlign::top_left ? "_topleft" : "") + "_" + layout_name(c.layout);
}

reference::Options ref_options(const SimdCase& c) {
  reference::Options o;
  o.causal = c.causal;
  o.align = c.align == CausalAlign::bottom_right ? reference::Align::bottom_right
                                                 : reference::Align::top_left;
  return o;
}

// Every ISA path the build knows, as gtest parameters; those this CPU lacks are skipped visibly.
class FlashKernels : public PerIsaTest {};

TEST_P(FlashKernels, MatchesFloat64ReferenceAcrossTileEdges) {
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
    attention_forward(q.view, k.view, v.view, out.view,
                      TensorView::bht(lse.data(), c.B, c.Hq, c.Tq), opt);
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
TEST_P(FlashKernels, NonUnitHeadDimStride) {
  const std::int64_t B = 1, T = 70, H = 4, Hkv = 2, D = 24;
  std::mt19937_64 rng(7);
  // Memory [B, D, T, H]: logical [B, T, H, D] with strides {D*T*H, H, 1, T*H}.
  auto make = [&](std::int64_t heads, std::vector<float>& buf) {
    buf.assign(static_cast<std::size_t>(B * D * T * heads), 0.0f);
    std::normal_distribution<float> dist;
    for (float& x : buf) x = dist(rng);
    return TensorView{
        buf.data(), DType::f32, 4, {B, T, heads, D}, {D * T * heads, heads, 1, T * heads}};
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
        for (std::int64_t d = 0; d < D; ++d)
          r.at(0, t, h, d) = p[t * x.strides[1] + h * x.strides[2] + d * x.strides[3]];
    return r;
  };
  const auto ref = reference::attention_forward(to64(q), to64(k), to64(v));
  const auto got = to64(o);
  EXPECT_LE(rel_err_flat(got.data, ref.out.data), kBound);
}

// Results must not depend on the thread count: bitwise equal for 1, 2 and 3 threads.
TEST_P(FlashKernels, BitwiseIdenticalAcrossThreadCounts) {
  const std::int64_t B = 2, T = 131, Hq = 8, Hkv = 2, D = 64;
  std::mt19937_64 rng(99);
  StridedTensor q(B, T, Hq, D, Layout::bthd), k(B, T, Hkv, D, Layout::bthd),
      v(B, T, Hkv, D, Layout::bthd);
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
TEST_P(FlashKernels, LargeMagnitudeScoresStayFinite) {
  const std::int64_t B = 1, T = 97, Hq = 4, Hkv = 1, D = 64;
  std::mt19937_64 rng(5);
  StridedTensor q(B, T, Hq, D, Layout::bthd), k(B, T, Hkv, D, Layout::bthd),
      v(B, T, Hkv, D, Layout::bthd), out(B, T, Hq, D, Layout::bthd);
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

// ---------------------------------------------------------------------------------------------
// Backward

constexpr double kBackwardBound = 1e-4;

// Runs forward then backward of one case on `isa`; outputs poisoned before each call.
struct BackwardRun {
  StridedTensor q, k, v, out, dout, dq, dk, dv;
  std::vector<float> lse;
  BackwardRun(const SimdCase& c, std::mt19937_64& rng)
      : q(c.B, c.Tq, c.Hq, c.D, c.layout),
        k(c.B, c.Tk, c.Hkv, c.D, c.layout),
        v(c.B, c.Tk, c.Hkv, c.D, c.layout),
        out(c.B, c.Tq, c.Hq, c.D, c.layout),
        dout(c.B, c.Tq, c.Hq, c.D, c.layout),
        dq(c.B, c.Tq, c.Hq, c.D, c.layout),
        dk(c.B, c.Tk, c.Hkv, c.D, c.layout),
        dv(c.B, c.Tk, c.Hkv, c.D, c.layout),
        lse(static_cast<std::size_t>(c.B * c.Hq * c.Tq), kPoison) {
    q.fill_random(rng);
    k.fill_random(rng);
    v.fill_random(rng);
    dout.fill_random(rng);
  }
  void run(const SimdCase& c, Isa isa, int threads = 0) {
    AttentionOptions opt;
    opt.causal = c.causal;
    opt.align = c.align;
    opt.isa = isa;
    opt.threads = threads;
    const TensorView L = TensorView::bht(lse.data(), c.B, c.Hq, c.Tq);
    attention_forward(q.view, k.view, v.view, out.view, L, opt);
    dq.poison();
    dk.poison();
    dv.poison();
    attention_backward(q.view, k.view, v.view, out.view, L, dout.view, dq.view, dk.view, dv.view,
                       opt);
  }
};

// dQ, dK, dV of case `c` on `isa` against the float64 oracle's backward.
void ExpectBackwardMatchesReference(const SimdCase& c, Isa isa, std::mt19937_64& rng) {
  SCOPED_TRACE(case_name(c));
  BackwardRun r(c, rng);
  r.run(c, isa);
  const auto ref = reference::attention_backward(r.q.to64(), r.k.to64(), r.v.to64(), r.dout.to64(),
                                                 ref_options(c));
  const double floor = max_abs(r.dout) * max_abs(r.v) / std::sqrt(static_cast<double>(c.D));
  EXPECT_LE(rel_err(r.dq, ref.dq, floor), kBackwardBound) << "dq";
  EXPECT_LE(rel_err(r.dk, ref.dk, floor), kBackwardBound) << "dk";
  EXPECT_LE(rel_err(r.dv, ref.dv, floor), kBackwardBound) << "dv";
}

TEST_P(FlashKernels, BackwardMatchesFloat64ReferenceAcrossTileEdges) {
  std::mt19937_64 rng(4321);
  for (const SimdCase& c : simd_cases()) ExpectBackwardMatchesReference(c, GetParam(), rng);
}

// The backward runs in one pass (5 products); units (b, KV head) with one query range when
// B·H_kv ≥ 8 (the table above mostly splits into ranges, D-bwd-6). These shapes take one range,
// straddling its lane blocks (M = 64 / 24 query rows) and key blocks, with T_q ≠ T_k both ways,
// both alignments, non-causal, odd d_h, g = 7 and strided views.
std::vector<SimdCase> one_pass_cases() {
  return {
      {2, 70, 70, 8, 4, 32},
      {1, 129, 129, 16, 8, 64},
      {1, 65, 65, 8, 8, 3},
      {2, 25, 150, 8, 4, 16},  // T_q < T_k
      {2, 150, 25, 8, 4, 16},  // T_q > T_k: empty rows
      {2, 40, 100, 8, 4, 16, true, CausalAlign::top_left},
      {2, 100, 40, 8, 4, 16, true, CausalAlign::top_left},
      {1, 63, 97, 56, 8, 24, false},  // g = 7, non-causal
      {2, 49, 49, 8, 4, 40, true, CausalAlign::bottom_right, Layout::bhtd},
      {2, 33, 71, 8, 4, 20, true, CausalAlign::bottom_right, Layout::strided},
  };
}

TEST_P(FlashKernels, BackwardOnePassMatchesFloat64Reference) {
  std::mt19937_64 rng(2024);
  for (const SimdCase& c : one_pass_cases()) {
    ASSERT_GE(c.B * c.Hkv, 8) << "case must take the one-pass path";
    ExpectBackwardMatchesReference(c, GetParam(), rng);
  }
}

// Central finite differences of the float64 forward, loss = Σ dO ⊙ O, against our fp32
// backward on this ISA: checks the backward against the forward's definition, not against the
// reference backward. h = 1e-5 in float64: truncation O(h²) ≈ 1e-10, rounding ≈ 1e-16/h = 1e-11.
TEST_P(FlashKernels, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(77);
  for (const SimdCase& c :
       {SimdCase{1, 7, 9, 4, 2, 5}, SimdCase{2, 9, 5, 6, 2, 4, true, CausalAlign::top_left},
        SimdCase{1, 5, 8, 3, 1, 6, false}}) {
    SCOPED_TRACE(case_name(c));
    BackwardRun r(c, rng);
    r.run(c, GetParam());
    auto q64 = r.q.to64(), k64 = r.k.to64(), v64 = r.v.to64();
    const auto do64 = r.dout.to64();
    const auto ro = ref_options(c);
    auto loss = [&] {
      const auto f = reference::attention_forward(q64, k64, v64, ro);
      double l = 0.0;
      for (std::size_t i = 0; i < f.out.data.size(); ++i) l += f.out.data[i] * do64.data[i];
      return l;
    };
    const double h = 1e-5;
    double max_diff = 0.0, max_ref = 0.0;
    auto check = [&](reference::Tensor64& x, StridedTensor& grad) {
      const auto& s = x.shape;
      for (std::int64_t b = 0; b < s[0]; ++b)
        for (std::int64_t t = 0; t < s[1]; ++t)
          for (std::int64_t hh = 0; hh < s[2]; ++hh)
            for (std::int64_t e = 0; e < s[3]; ++e) {
              double& xv = x.at(b, t, hh, e);
              const double saved = xv;
              xv = saved + h;
              const double lp = loss();
              xv = saved - h;
              const double lm = loss();
              xv = saved;
              const double fd = (lp - lm) / (2 * h);
              max_diff = std::max(max_diff, std::fabs(fd - grad.at(b, t, hh, e)));
              max_ref = std::max(max_ref, std::fabs(fd));
            }
    };
    check(q64, r.dq);
    check(k64, r.dk);
    check(v64, r.dv);
    EXPECT_LE(max_diff / max_ref, kBackwardBound);
  }
}

// dQ, dK and dV of case `c` on `isa` are bitwise identical for 1, 2, 3 and 4 threads.
void ExpectBackwardIndependentOfThreads(const SimdCase& c, Isa isa, std::uint64_t seed) {
  SCOPED_TRACE(case_name(c));
  std::mt19937_64 rng(seed);
  BackwardRun r(c, rng);
  std::vector<std::vector<float>> grads;
  for (int threads : {1, 2, 3, 4}) {
    r.run(c, isa, threads);
    std::vector<float> all = r.dq.storage;
    all.insert(all.end(), r.dk.storage.begin(), r.dk.storage.end());
    all.insert(all.end(), r.dv.storage.begin(), r.dv.storage.end());
    grads.push_back(all);
  }
  EXPECT_EQ(0, std::memcmp(grads[0].data(), grads[1].data(), grads[0].size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(grads[0].data(), grads[2].data(), grads[0].size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(grads[0].data(), grads[3].data(), grads[0].size() * sizeof(float)));
}

TEST_P(FlashKernels, BackwardBitwiseIdenticalAcrossThreadCounts) {
  ExpectBackwardIndependentOfThreads({2, 131, 131, 8, 2, 64}, GetParam(),
                                     3);  // B·H_kv = 4: one pass, 2 query ranges
}

TEST_P(FlashKernels, BackwardOnePassBitwiseIdenticalAcrossThreadCounts) {
  ExpectBackwardIndependentOfThreads({2, 97, 97, 8, 4, 32}, GetParam(),
                                     31);  // B·H_kv = 8: one pass
}

// B·H_kv < 8: the one-pass backward splits each (b, KV head) into query ranges of whole lane
// blocks (M = 24 rows on AVX2, 64 on AVX-512), ⌈8 / (B·H_kv)⌉ of them where T_q has that many
// blocks (QuerySplit, D-bwd-6); key blocks seen by several ranges get their partial dK/dV summed
// in range order, blocks seen by none get zeros. These shapes have 1 … 8 ranges: MQA (g = 4, 8)
// and g = 7, T straddling the lane blocks, odd d_h, T_q < T_k and T_q > T_k in both alignments
// (leading ranges with no key; keys no range sees), non-causal (every range shares every key
// block), strided views.
std::vector<SimdCase> query_range_cases() {
  std::vector<SimdCase> cases;
  for (std::int64_t T : {23, 24, 25, 47, 48, 49, 63, 64, 65, 127, 128, 129, 200})
    cases.push_back({1, T, T, 4, 1, 32});                                // MQA: up to 8 ranges
  cases.push_back({1, 97, 97, 8, 1, 16});                                // g = 8
  cases.push_back({1, 150, 150, 14, 2, 80});                             // g = 7, 4 ranges
  cases.push_back({1, 73, 73, 2, 2, 3});                                 // MHA, odd d_h
  cases.push_back({3, 121, 121, 6, 2, 16});                              // B·H_kv = 6: 2 ranges
  cases.push_back({1, 50, 200, 8, 2, 16});                               // T_q < T_k
  cases.push_back({1, 200, 50, 8, 2, 16});                               // T_q > T_k: empty rows
  cases.push_back({1, 60, 190, 4, 2, 24, true, CausalAlign::top_left});  // keys ≥ 60 unseen
  cases.push_back({1, 190, 60, 4, 2, 24, true, CausalAlign::top_left});
  cases.push_back({1, 130, 100, 8, 2, 40, false});  // non-causal
  cases.push_back({1, 129, 129, 8, 2, 64, true, CausalAlign::bottom_right, Layout::bhtd});
  cases.push_back({1, 77, 131, 6, 3, 20, true, CausalAlign::bottom_right, Layout::strided});
  return cases;
}

TEST_P(FlashKernels, BackwardQueryRangesMatchFloat64Reference) {
  std::mt19937_64 rng(2025);
  for (const SimdCase& c : query_range_cases()) {
    ASSERT_LT(c.B * c.Hkv, 8) << "case must split its (b, KV head) units";
    ExpectBackwardMatchesReference(c, GetParam(), rng);
  }
}

// The query ranges and the order of the partial sums depend on the shape alone.
TEST_P(FlashKernels, BackwardQueryRangesBitwiseIdenticalAcrossThreadCounts) {
  std::uint64_t seed = 40;
  for (const SimdCase& c :
       {SimdCase{1, 200, 200, 4, 1, 32}, SimdCase{1, 129, 129, 14, 2, 24},
        SimdCase{3, 97, 97, 6, 2, 16}, SimdCase{1, 130, 100, 8, 2, 40, false},
        SimdCase{1, 60, 190, 4, 2, 24, true, CausalAlign::top_left},
        SimdCase{1, 77, 131, 6, 3, 20, true, CausalAlign::bottom_right, Layout::strided}}) {
    ExpectBackwardIndependentOfThreads(c, GetParam(), seed++);
  }
}

// Tiny problems (T_q and T_k within one vector: ≤ 16 on AVX-512, ≤ 8 on AVX2) run the backward
// with lane blocks of one vector instead of kV (attention_bwd-inl.h): both passes and the
// one-pass path (B·H_kv ≥ 8), T_q ≠ T_k both ways, one query row, odd d_h, GQA, both alignments,
// non-causal, strided views; and bitwise independent of the thread count.
std::vector<SimdCase> tiny_cases() {
  return {
      {1, 8, 8, 4, 4, 64},
      {1, 4, 4, 4, 4, 64},
      {2, 3, 7, 8, 4, 33},  // one pass
      {2, 7, 3, 4, 4, 17},
      {1, 8, 8, 7, 1, 5, false},
      {1, 1, 8, 2, 2, 64},
      {4, 8, 8, 4, 2, 40, true, CausalAlign::top_left},  // one pass
      {2, 5, 8, 8, 4, 16, true, CausalAlign::bottom_right, Layout::strided},
      {1, 4, 4, 2, 1, 128, true, CausalAlign::top_left, Layout::bhtd},
      {1, 16, 16, 2, 2, 64, true, CausalAlign::top_left},
  };
}

TEST_P(FlashKernels, BackwardTinyShapesMatchFloat64Reference) {
  std::mt19937_64 rng(1818);
  for (const SimdCase& c : tiny_cases()) ExpectBackwardMatchesReference(c, GetParam(), rng);
  ExpectBackwardIndependentOfThreads({1, 8, 8, 4, 4, 64}, GetParam(), 5);
  ExpectBackwardIndependentOfThreads({4, 8, 8, 4, 2, 40}, GetParam(), 6);
}

// The fp32 backward packs Qᵀ, dOᵀ (and D), Kᵀ, Vᵀ and writes dQ, dK, dV back through 4 × 4
// register transposes (attention_bwd-inl.h, issue 18), with scalar tails for d_h mod 4,
// rows mod 4 and lane groups that are part padding. Shapes straddling those edges and the
// one-vector lane blocks (T = 15, 16, 17 on AVX-512; 7, 8, 9 on AVX2): T = 1, 2, odd and
// even d_h below and above 4, GQA, one and several query ranges, T_q ≠ T_k, and strided
// views (non-unit d_h stride: the scalar loops), with poisoned gradient buffers (BackwardRun).
std::vector<SimdCase> packing_edge_cases() {
  return {
      {1, 15, 15, 4, 4, 7},
      {1, 16, 16, 4, 2, 5},
      {1, 17, 17, 3, 1, 6},
      {2, 1, 1, 2, 2, 3},
      {1, 2, 5, 4, 2, 9},
      {1, 9, 9, 4, 4, 4},
      {1, 7, 8, 2, 1, 1},
      {4, 15, 15, 4, 2, 12},  // one pass
      {3, 17, 17, 6, 3, 3},
      {2, 16, 9, 8, 4, 13, true, CausalAlign::top_left},
      {1, 13, 13, 6, 2, 64, true, CausalAlign::bottom_right, Layout::strided},
      {1, 5, 5, 2, 2, 4, true, CausalAlign::bottom_right, Layout::bhtd},
      {1, 16, 16, 4, 4, 8, false},
  };
}

TEST_P(FlashKernels, BackwardPackingEdgesMatchFloat64Reference) {
  std::mt19937_64 rng(1819);
  for (const SimdCase& c : packing_edge_cases()) ExpectBackwardMatchesReference(c, GetParam(), rng);
  ExpectBackwardIndependentOfThreads({1, 17, 17, 4, 2, 7}, GetParam(), 7);
  ExpectBackwardIndependentOfThreads({4, 15, 15, 4, 2, 12}, GetParam(), 8);
}

// The one-vector lane blocks of a tiny problem give bitwise the gradients of the full-width
// ones: causal top-left with T_q = 8, T_k = 8 (one vector on AVX2 and AVX-512) against T_q = 8,
// T_k = 24 (wider than a vector; keys 8.. are seen by no row), whose dQ, dK and dV of keys < 8
// come from the same pairs, in the same order.
TEST_P(FlashKernels, BackwardTinyShapesBitwiseMatchFullWidthLanes) {
  for (const auto& [B, Hq, Hkv] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{1, 4, 2},
                                   {4, 4, 2}}) {  // 4 query ranges, one
    const SimdCase narrow{B, 8, 8, Hq, Hkv, 24, true, CausalAlign::top_left};
    const SimdCase wide{B, 8, 24, Hq, Hkv, 24, true, CausalAlign::top_left};
    SCOPED_TRACE(case_name(wide));
    std::mt19937_64 rng(99);
    BackwardRun a(narrow, rng), w(wide, rng);
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t e = 0; e < 24; ++e) {
        for (std::int64_t t = 0; t < 8; ++t) {
          for (std::int64_t h = 0; h < Hq; ++h) {
            w.q.at(b, t, h, e) = a.q.at(b, t, h, e);
            w.dout.at(b, t, h, e) = a.dout.at(b, t, h, e);
          }
          for (std::int64_t h = 0; h < Hkv; ++h) {
            w.k.at(b, t, h, e) = a.k.at(b, t, h, e);
            w.v.at(b, t, h, e) = a.v.at(b, t, h, e);
          }
        }
      }
    a.run(narrow, GetParam(), 1);
    w.run(wide, GetParam(), 1);
    std::int64_t differ = 0;
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = 0; t < 8; ++t)
        for (std::int64_t e = 0; e < 24; ++e) {
          for (std::int64_t h = 0; h < Hq; ++h)
            differ += a.dq.at(b, t, h, e) != w.dq.at(b, t, h, e);
          for (std::int64_t h = 0; h < Hkv; ++h) {
            differ += a.dk.at(b, t, h, e) != w.dk.at(b, t, h, e);
            differ += a.dv.at(b, t, h, e) != w.dv.at(b, t, h, e);
          }
        }
    EXPECT_EQ(differ, 0);
  }
}

// Masked pairs contribute exactly nothing: keys no query sees get dK = dV = 0 exactly, rows that
// see no key get dQ = 0 exactly, and changing dO at rows that cannot see key u leaves dK[u],
// dV[u] bitwise unchanged.
TEST_P(FlashKernels, MaskedPositionsGetExactlyZeroGradient) {
  // Top-left with T_q < T_k: keys u ≥ T_q are seen by nobody.
  {
    const SimdCase c{1, 40, 100, 4, 2, 16, true, CausalAlign::top_left};
    std::mt19937_64 rng(8);
    BackwardRun r(c, rng);
    r.run(c, GetParam());
    for (std::int64_t u = c.Tq; u < c.Tk; ++u)
      for (std::int64_t h = 0; h < c.Hkv; ++h)
        for (std::int64_t e = 0; e < c.D; ++e) {
          ASSERT_EQ(r.dk.at(0, u, h, e), 0.0f) << "u=" << u;
          ASSERT_EQ(r.dv.at(0, u, h, e), 0.0f) << "u=" << u;
        }
  }
  // Bottom-right with T_q > T_k: the first T_q − T_k rows see no key → dQ = 0, no NaN.
  {
    const SimdCase c{1, 100, 30, 4, 1, 16};
    std::mt19937_64 rng(9);
    BackwardRun r(c, rng);
    r.run(c, GetParam());
    for (std::int64_t t = 0; t < c.Tq; ++t)
      for (std::int64_t h = 0; h < c.Hq; ++h)
        for (std::int64_t e = 0; e < c.D; ++e) {
          ASSERT_TRUE(std::isfinite(r.dq.at(0, t, h, e)));
          if (t < c.Tq - c.Tk) {
            ASSERT_EQ(r.dq.at(0, t, h, e), 0.0f) << "t=" << t;
          }
        }
  }
  // Causal T_q = T_k: dO at rows t < u cannot reach dK[u], dV[u].
  {
    const SimdCase c{1, 90, 90, 4, 2, 16};
    std::mt19937_64 rng(10);
    BackwardRun r(c, rng);
    r.run(c, GetParam());
    const std::vector<float> dk0 = r.dk.storage, dv0 = r.dv.storage;
    const std::int64_t u_first = 50;  // keys ≥ 50 are seen only by rows ≥ 50
    for (std::int64_t t = 0; t < u_first; ++t)
      for (std::int64_t h = 0; h < c.Hq; ++h)
        for (std::int64_t e = 0; e < c.D; ++e) r.dout.at(0, t, h, e) += 1.0f;
    r.run(c, GetParam());
    for (std::int64_t u = u_first; u < c.Tk; ++u)
      for (std::int64_t h = 0; h < c.Hkv; ++h)
        for (std::int64_t e = 0; e < c.D; ++e) {
          const std::size_t i =
              static_cast<std::size_t>(&r.dk.at(0, u, h, e) - r.dk.storage.data());
          ASSERT_EQ(r.dk.storage[i], dk0[i]) << "u=" << u;
          ASSERT_EQ(r.dv.storage[i], dv0[i]) << "u=" << u;
        }
  }
}

// A few steps of gradient descent on one attention layer fitting a random target: with a fixed
// small learning rate the loss must decrease at every step (the gradient is a descent direction).
TEST_P(FlashKernels, TrainingLoopLossDecreasesMonotonically) {
  LayerConfig cfg;
  cfg.d_model = 32;
  cfg.heads_q = 4;
  cfg.heads_kv = 2;
  cfg.head_dim = 8;
  cfg.rope = RopeOptions{};
  cfg.attention.isa = GetParam();
  CausalSelfAttention layer(cfg);
  layer.init_random(42);
  const std::int64_t B = 2, T = 33, n = B * T * cfg.d_model;
  std::mt19937_64 rng(11);
  std::normal_distribution<float> dist;
  std::vector<float> u(static_cast<std::size_t>(n)), target(u.size()), out(u.size()),
      d_out(u.size());
  for (float& x : u) x = dist(rng);
  for (float& x : target) x = dist(rng);
  LayerGradients grads;
  const float lr = 1e-3f;  // small enough for monotone descent on this problem (sum loss)
  double previous = INFINITY, first = 0.0;
  for (int step = 0; step < 8; ++step) {
    layer.forward(u, B, T, out);
    double loss = 0.0;  // L = ½ Σ (O − Y)²,  dL/dO = O − Y
    for (std::size_t i = 0; i < out.size(); ++i) {
      d_out[i] = out[i] - target[i];
      loss += 0.5 * static_cast<double>(d_out[i]) * d_out[i];
    }
    EXPECT_LT(loss, previous) << "step " << step;
    if (step == 0) first = loss;
    previous = loss;
    layer.backward(d_out, grads);
    auto descend = [&](std::span<float> w, const std::vector<float>& gw) {
      for (std::size_t i = 0; i < w.size(); ++i) w[i] -= lr * gw[i];
    };
    descend(layer.w_q(), grads.d_w_q);
    descend(layer.w_k(), grads.d_w_k);
    descend(layer.w_v(), grads.d_w_v);
    descend(layer.w_o(), grads.d_w_o);
  }
  EXPECT_LT(previous, 0.95 * first) << "the loop must make real progress, not just avoid increases";
}

INSTANTIATE_TEST_SUITE_P(AllIsas, FlashKernels, AllIsas(), IsaName);

}  // namespace
}  // namespace tokenmix::testing
