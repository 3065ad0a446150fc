// tests/unit/test_attention_weights.cpp — attention weights on request (attention_weights:
// P = exp(S + M − L), SPEC 4.2–4.4 and "Score variants used by real models") against the float64
// oracle's A (reference::attention_weights), with L from the forward of the same path.
//
// Shapes straddle the 64-row and 64-key blocks (T ∈ {1, 63, 64, 65, odd}, T_q < T_k and
// T_q > T_k in both alignments, causal and not), GQA ratios {1, 2, 4}, odd head widths, strided
// q/k (PyTorch layout, padded strides) and a padded weights view, every variant alone and
// combined (window, soft-capping, ALiBi, sinks, key lengths, interval and general boolean masks,
// biases with −∞). Inputs are fresh N(0, 1) draws; outputs start as NaN (poison), so an element
// the call does not write fails, and the padding of the weights view must stay NaN.
//
// Bound: rel_err ≤ 2e-5 (the forward's bound on O, tests/unit/test_variants.cpp): P carries the
// fp32 rounding of s·⟨q, k⟩ and of L. Where the oracle's A is exactly 0 (a key the row does not
// see) P must be exactly 0. Selections (heads in any order, with repeats, and row ranges) give
// the full call's elements bitwise; so do 1, 2 and 3 threads and every kernel path.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/kv_element.hpp"
#include "reference/reference.hpp"
#include "test_util.hpp"
#include "tokenmix/tokenmix.hpp"
#include "variant_run.hpp"

namespace tokenmix::testing {
namespace {

constexpr double kBound = 2e-5;

// The weights of one case: forward (for L) on `isa`, then attention_weights into a poisoned
// [B, heads, rows, T_k] tensor in `layout`.
struct WeightsRun {
  VariantRun run;
  StridedTensor weights;
  WeightsSelection select;

  WeightsRun(const VariantCase& c, std::mt19937_64& rng, WeightsSelection s = {},
             Layout layout = Layout::strided)
      : run(c, rng),
        weights(c.B, s.heads.empty() ? c.Hq : static_cast<std::int64_t>(s.heads.size()),
                s.row_end.value_or(c.Tq) - s.row_begin, c.Tk, layout),
        select(std::move(s)) {}

  void compute(Isa isa = Isa::portable, int threads = 0, bool forward = true) {
    if (forward) run.forward(isa, threads);
    weights.poison();
    attention_weights(run.q.view, run.k.view, run.lse_view(), weights.view,
                      run.options(isa, threads), select);
  }
};

// P against the oracle's A: rel_err ≤ kBound, exact zeros where A is 0, the padding untouched.
void ExpectMatchesOracle(const VariantCase& c, std::mt19937_64& rng, Layout layout) {
  SCOPED_TRACE(c.name());
  WeightsRun w(c, rng, {}, layout);
  w.compute();
  const Tensor64 ref =
      reference::attention_weights(w.run.q.to64(), w.run.k.to64(), w.run.ref_options());
  EXPECT_LE(rel_err(w.weights, ref), kBound);
  std::int64_t zeros = 0;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.Hq; ++h)
      for (std::int64_t t = 0; t < c.Tq; ++t)
        for (std::int64_t u = 0; u < c.Tk; ++u) {
          const float got = w.weights.at(b, h, t, u);
          ASSERT_TRUE(std::isfinite(got)) << "b=" << b << " h=" << h << " t=" << t << " u=" << u;
          if (ref.at(b, h, t, u) == 0.0) {
            ASSERT_EQ(got, 0.0f) << "b=" << b << " h=" << h << " t=" << t << " u=" << u;
            ++zeros;
          }
        }
  if (c.causal && c.Tq > 1 && c.Tk > 1) {
    EXPECT_GT(zeros, 0) << "a causal case hides some keys";
  }
  // The view's padding (Layout::strided) is never written.
  std::size_t nan_slots = 0, logical = static_cast<std::size_t>(c.B * c.Hq * c.Tq * c.Tk);
  for (float x : w.weights.storage) nan_slots += std::isnan(x) ? 1 : 0;
  EXPECT_EQ(nan_slots, w.weights.storage.size() - logical);
}

std::vector<VariantCase> oracle_cases() {
  std::vector<VariantCase> cases;
  // Plain causal and not, over tile edges, both alignments, T_q ≶ T_k.
  for (std::int64_t T : {1, 2, 63, 64, 65, 97}) cases.push_back({1, T, T, 2, 1, 16});
  for (CausalAlign align : {CausalAlign::bottom_right, CausalAlign::top_left})
    for (bool causal : {true, false})
      for (auto [Tq, Tk] : {std::pair<std::int64_t, std::int64_t>{20, 130}, {130, 20}, {1, 70}}) {
        cases.push_back({2, Tq, Tk, 4, 2, 12, causal, align});
      }
  // GQA ratios and odd head widths, strided q/k.
  for (auto [Hq, Hkv] : {std::pair<std::int64_t, std::int64_t>{4, 4}, {4, 2}, {8, 2}})
    for (std::int64_t D : {3, 17, 64}) {
      VariantCase c{1, 70, 71, Hq, Hkv, D};
      c.layout = D == 3 ? Layout::bhtd : Layout::strided;
      cases.push_back(c);
    }
  // Each variant alone.
  const VariantCase base{2, 65, 65, 4, 2, 16};
  auto with = [&](auto&& set) {
    VariantCase c = base;
    set(c);
    cases.push_back(c);
  };
  for (std::int64_t W : {1, 7, 64}) with([&](VariantCase& c) { c.window = W; });
  with([](VariantCase& c) { c.softcap = 0.7; });
  with([](VariantCase& c) { c.alibi = true; });
  with([](VariantCase& c) { c.sinks = true; });
  with([](VariantCase& c) { c.key_lengths = true; });
  for (MaskShape m : {MaskShape::causal_shape, MaskShape::left_pad, MaskShape::band,
                      MaskShape::random_bool, MaskShape::random_bias}) {
    with([&](VariantCase& c) { c.mask = m; });
    with([&](VariantCase& c) {
      c.mask = m;
      c.causal = false;
      c.mask_full = {true, false, true, true};
      c.mask_memory = MaskMemory::transposed;
    });
  }
  // Everything at once, T_q ≶ T_k, both alignments.
  for (CausalAlign align : {CausalAlign::bottom_right, CausalAlign::top_left})
    for (auto [Tq, Tk] : {std::pair<std::int64_t, std::int64_t>{33, 130}, {130, 33}}) {
      VariantCase c = with_all_variants({2, Tq, Tk, 4, 1, 9, true, align, Layout::strided});
      cases.push_back(c);
      c.key_lengths = false;
      c.mask = MaskShape::random_bias;
      c.mask_full = {false, true, true, true};
      cases.push_back(c);
    }
  return cases;
}

TEST(AttentionWeights, MatchOracleForEveryShapeAndVariant) {
  std::mt19937_64 rng(5701);
  int i = 0;
  for (const VariantCase& c : oracle_cases())
    ExpectMatchesOracle(c, rng, ++i % 2 == 0 ? Layout::strided : Layout::bthd);
}

// Rows sum to 1, or to 1 − e^{σ_h − L_t} with sinks; a row that sees no key is all zeros.
TEST(AttentionWeights, RowsSumToOneMinusTheSinkShare) {
  std::mt19937_64 rng(5702);
  for (bool sinks : {false, true}) {
    VariantCase c{2, 90, 30, 4, 2, 8};  // bottom-right: rows t < 60 see no key
    c.window = 10;
    c.sinks = sinks;
    SCOPED_TRACE(c.name());
    WeightsRun w(c, rng);
    w.compute();
    int empty = 0;
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < c.Hq; ++h)
        for (std::int64_t t = 0; t < c.Tq; ++t) {
          double sum = 0.0;
          for (std::int64_t u = 0; u < c.Tk; ++u) sum += w.weights.at(b, h, t, u);
          const double L = w.run.lse[static_cast<std::size_t>((b * c.Hq + h) * c.Tq + t)];
          const bool sees = t >= c.Tq - c.Tk;
          if (!sees) {
            ++empty;
            EXPECT_EQ(sum, 0.0);
            continue;
          }
          const double want = sinks ? 1.0 - std::exp(w.run.sinks[h] - L) : 1.0;
          EXPECT_NEAR(sum, want, 1e-5) << "b=" << b << " h=" << h << " t=" << t;
        }
    EXPECT_GT(empty, 0);
  }
}

// A selection gives the full call's elements bitwise: heads in any order (repeats too) and row
// ranges that start and end inside the 64-row blocks.
TEST(AttentionWeights, SelectionsEqualTheFullCall) {
  std::mt19937_64 rng(5703);
  VariantCase c{2, 150, 160, 8, 2, 24, true, CausalAlign::bottom_right, Layout::bhtd};
  c.softcap = 3.0;
  c.alibi = true;
  c.mask = MaskShape::random_bool;
  WeightsRun full(c, rng);
  full.compute();
  for (auto [begin, end] :
       {std::pair<std::int64_t, std::int64_t>{0, 150}, {5, 70}, {149, 150}, {64, 128}, {7, 7}}) {
    WeightsSelection s;
    s.heads = {7, 0, 3, 3};
    s.row_begin = begin;
    s.row_end = end;
    WeightsRun part(c, rng, s, Layout::bthd);
    part.run = full.run;  // the same inputs and L
    part.compute(Isa::portable, 0, false);
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::size_t i = 0; i < s.heads.size(); ++i)
        for (std::int64_t t = begin; t < end; ++t)
          for (std::int64_t u = 0; u < c.Tk; ++u) {
            const std::int64_t h = s.heads[i];
            ASSERT_EQ(std::memcmp(&part.weights.at(b, static_cast<std::int64_t>(i), t - begin, u),
                                  &full.weights.at(b, h, t, u), sizeof(float)),
                      0)
                << "b=" << b << " head " << h << " t=" << t << " u=" << u;
          }
  }
}

// The same bits for 1, 2 and 3 threads and on every kernel path this machine runs (with the same
// L: the weights themselves are one computation on every path).
TEST(AttentionWeights, BitwiseIdenticalAcrossThreadsAndPaths) {
  std::mt19937_64 rng(5704);
  VariantCase c{2, 97, 131, 8, 2, 32};
  c.window = 40;
  c.softcap = 10.0;
  c.sinks = true;
  c.mask = MaskShape::random_bias;
  c.mask_full = {true, false, true, true};
  WeightsRun w(c, rng);
  w.compute(Isa::portable, 1);
  const std::vector<float> first = w.weights.storage;
  for (Isa isa : testkit::concrete_isas()) {
    if (!testkit::isa_unavailable_reason(isa).empty()) continue;
    for (int threads : {1, 2, 3}) {
      SCOPED_TRACE(std::string(to_string(isa)) + " threads " + std::to_string(threads));
      w.compute(isa, threads, false);
      ASSERT_EQ(first.size(), w.weights.storage.size());
      EXPECT_EQ(0,
                std::memcmp(first.data(), w.weights.storage.data(), first.size() * sizeof(float)));
    }
  }
}

// bf16 and f16 q, k (SPEC "Reduced precision"): widened exactly; P against the oracle on the
// rounded values, with L from the forward of the same rounded inputs.
TEST(AttentionWeights, ReducedPrecisionInputs) {
  std::mt19937_64 rng(5705);
  for (DType dt : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(to_string(dt));
    VariantCase c{2, 65, 70, 4, 2, 16};
    c.alibi = true;
    c.window = 30;
    VariantRun r(c, rng);
    const auto round = [&](StridedTensor& x, std::vector<std::uint16_t>& bits) {
      bits.assign(x.storage.size(), 0);
      for (std::size_t i = 0; i < bits.size(); ++i) {
        const float f = x.storage[i];
        bits[i] = dt == DType::bf16 ? kernels::f32_to_bf16(f) : kernels::f32_to_f16(f);
        x.storage[i] =
            dt == DType::bf16 ? kernels::bf16_to_f32(bits[i]) : kernels::f16_to_f32(bits[i]);
      }
    };
    std::vector<std::uint16_t> qb, kb;
    round(r.q, qb);
    round(r.k, kb);
    r.forward(Isa::portable);  // L of the rounded values (the f32 forward on the same numbers)
    ConstTensorView q = r.q.view, k = r.k.view;
    q.data = qb.data();
    q.dtype = dt;
    k.data = kb.data();
    k.dtype = dt;
    StridedTensor w(c.B, c.Hq, c.Tq, c.Tk, Layout::bthd);
    attention_weights(q, k, r.lse_view(), w.view, r.options(Isa::automatic));
    const Tensor64 ref = reference::attention_weights(r.q.to64(), r.k.to64(), r.ref_options());
    EXPECT_LE(rel_err(w, ref), kBound);
  }
}

}  // namespace
}  // namespace tokenmix::testing
