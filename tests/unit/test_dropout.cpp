// tests/unit/test_dropout.cpp — attention dropout (docs/design.md "Attention dropout", D.1–D.4):
// the Philox4x32-10 generator against published known answers, the keep mask Z's statistics
// (kept fraction within binomial bounds; no correlation across rows, heads, batch rows, keys,
// seeds and offsets), and the forward, backward and attention weights of every kernel path
// against the float64 oracle applying the same Z, with finite differences for the gradients.
//
// The oracle gets Z from attention_dropout_mask (the scalar generator, kernels/dropout.hpp); the
// kernels draw it lane by lane (simd/dropout-inl.h). A single weight dropped differently moves O
// by about P_tu / (1 − p) · |v_u| ≥ 1e-3 at these lengths, far above the bounds (forward 2e-5,
// backward 1e-4, as tests/unit/test_variants.cpp), so matching the oracle means the same mask on
// every path. Outputs are poisoned before each call (variant_run.hpp).
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/dropout.hpp"
#include "reference/reference.hpp"
#include "test_util.hpp"
#include "tokenmix/tokenmix.hpp"
#include "variant_run.hpp"

namespace tokenmix::testing {
namespace {

constexpr double kForwardBound = 2e-5;
constexpr double kBackwardBound = 1e-4;

// ---- The generator ----

// Random123's known-answer vectors for philox4x32_10 (kat_vectors): counter, key, result.
TEST(DropoutPhilox, MatchesPublishedKnownAnswers) {
  using kernels::philox4x32_10;
  using W4 = std::array<std::uint32_t, 4>;
  EXPECT_EQ(philox4x32_10({0, 0, 0, 0}, {0, 0}),
            (W4{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  EXPECT_EQ(philox4x32_10({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
                          {0xffffffffu, 0xffffffffu}),
            (W4{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
  EXPECT_EQ(philox4x32_10({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
                          {0xa4093822u, 0x299f31d0u}),
            (W4{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}));
}

// ---- The keep mask ----

struct Mask {
  std::int64_t B, H, Tq, Tk;
  std::vector<std::uint8_t> z;
  Mask(std::int64_t b, std::int64_t h, std::int64_t tq, std::int64_t tk, double p,
       std::uint64_t seed, std::uint64_t offset = 0, int threads = 0)
      : B(b), H(h), Tq(tq), Tk(tk), z(static_cast<std::size_t>(b * h * tq * tk), 0xAB) {
    AttentionOptions o;
    o.dropout = {p, seed, offset};
    o.threads = threads;
    attention_dropout_mask(
        {z.data(), DType::boolean, 4, {B, H, Tq, Tk}, {H * Tq * Tk, Tq * Tk, Tk, 1}}, o);
  }
  int at(std::int64_t b, std::int64_t h, std::int64_t t, std::int64_t u) const {
    return z[static_cast<std::size_t>(((b * H + h) * Tq + t) * Tk + u)];
  }
};

// |x − n·q| ≤ 5 standard deviations of a binomial(n, q) count.
void ExpectBinomial(std::int64_t x, std::int64_t n, double q, const std::string& what) {
  const double sd = std::sqrt(static_cast<double>(n) * q * (1.0 - q));
  EXPECT_LE(std::fabs(static_cast<double>(x) - static_cast<double>(n) * q), 5.0 * sd + 1.0)
      << what << ": " << x << " of " << n << ", expected " << static_cast<double>(n) * q;
}

TEST(DropoutMask, KeptFractionWithinBinomialBounds) {
  for (double p : {1e-3, 0.1, 0.5, 0.9}) {
    const Mask m(2, 3, 100, 333, p, 42);
    std::int64_t kept = 0;
    for (std::uint8_t x : m.z) {
      ASSERT_LE(x, 1);  // every element written, 0 or 1
      kept += x;
    }
    ExpectBinomial(kept, static_cast<std::int64_t>(m.z.size()), 1.0 - p,
                   "kept, p = " + std::to_string(p));
  }
}

// Two masks' elements agree with probability (1 − p)² + p² when independent: checked for
// neighbouring rows, heads, batch rows and keys (the same Philox call and the next), and for the
// next seed and offset.
TEST(DropoutMask, NoCorrelationAcrossRowsHeadsKeysSeedsAndOffsets) {
  const double p = 0.3, agree = (1 - p) * (1 - p) + p * p;
  const Mask m(2, 4, 64, 256, p, 7), seed2(2, 4, 64, 256, p, 8), offset2(2, 4, 64, 256, p, 7, 1);
  struct Pair {
    const char* name;
    std::function<int(std::int64_t, std::int64_t, std::int64_t, std::int64_t)> other;
    bool (*valid)(std::int64_t, std::int64_t, std::int64_t, std::int64_t);
  };
  const auto all = [](std::int64_t, std::int64_t, std::int64_t, std::int64_t) { return true; };
  const std::vector<Pair> pairs = {
      {"next row", [&](auto b, auto h, auto t, auto u) { return m.at(b, h, t + 1, u); },
       [](auto, auto, auto t, auto) { return t + 1 < 64; }},
      {"next head", [&](auto b, auto h, auto t, auto u) { return m.at(b, h + 1, t, u); },
       [](auto, auto h, auto, auto) { return h + 1 < 4; }},
      {"next batch row", [&](auto b, auto h, auto t, auto u) { return m.at(b + 1, h, t, u); },
       [](auto b, auto, auto, auto) { return b + 1 < 2; }},
      {"next key (same Philox call)",
       [&](auto b, auto h, auto t, auto u) { return m.at(b, h, t, u + 1); },
       [](auto, auto, auto, auto u) { return u % 4 != 3; }},
      {"key 4 on (next call)", [&](auto b, auto h, auto t, auto u) { return m.at(b, h, t, u + 4); },
       [](auto, auto, auto, auto u) { return u + 4 < 256; }},
      {"next seed", [&](auto b, auto h, auto t, auto u) { return seed2.at(b, h, t, u); }, all},
      {"next offset", [&](auto b, auto h, auto t, auto u) { return offset2.at(b, h, t, u); }, all},
  };
  for (const Pair& pr : pairs) {
    std::int64_t n = 0, same = 0;
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t h = 0; h < 4; ++h)
        for (std::int64_t t = 0; t < 64; ++t)
          for (std::int64_t u = 0; u < 256; ++u) {
            if (!pr.valid(b, h, t, u)) continue;
            ++n;
            same += m.at(b, h, t, u) == pr.other(b, h, t, u) ? 1 : 0;
          }
    ExpectBinomial(same, n, agree, pr.name);
  }
}

TEST(DropoutMask, SameForEveryThreadCountAndLayout) {
  const Mask one(2, 3, 37, 129, 0.25, 99, 5, 1);
  for (int threads : {2, 3}) {
    const Mask m(2, 3, 37, 129, 0.25, 99, 5, threads);
    EXPECT_EQ(one.z, m.z) << threads << " threads";
  }
  // A transposed view ([B, H, T_q, T_k] with T_k outermost in memory) holds the same elements.
  std::vector<std::uint8_t> tr(one.z.size(), 0xAB);
  AttentionOptions o;
  o.dropout = {0.25, 99, 5};
  attention_dropout_mask({tr.data(), DType::boolean, 4, {2, 3, 37, 129}, {1, 2, 6, 6 * 37}}, o);
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t h = 0; h < 3; ++h)
      for (std::int64_t t = 0; t < 37; ++t)
        for (std::int64_t u = 0; u < 129; ++u)
          ASSERT_EQ(tr[static_cast<std::size_t>(b + 2 * h + 6 * t + 6 * 37 * u)],
                    one.at(b, h, t, u));
  // p = 0 keeps everything.
  const Mask none(1, 2, 5, 9, 0.0, 99);
  for (std::uint8_t x : none.z) EXPECT_EQ(x, 1);
}

// Every path drops the same weights, bit for bit: with V = I (v_u = e_u, T_k = d_h) the forward's
// O_t is row t of P̃, so O_t[u] = 0 exactly where Z_{b,h,t,u} = 0 or key u is masked; with dO = I
// (T_q = d_h) the backward's dV_u[t] = Σ_h P̃_tu is 0 exactly where every head of the group
// dropped (or cannot see) key u for row t. The patterns must equal the mask's, on each path.
TEST(DropoutMask, EveryPathDropsTheSameWeights) {
  const std::int64_t B = 2, T = 64, Hq = 4, Hkv = 2, D = 64, g = Hq / Hkv;
  std::mt19937_64 rng(5808);
  VariantRun r({B, T, T, Hq, Hkv, D}, rng);
  r.c.dropout = 0.3;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < T; ++t) {
      for (std::int64_t j = 0; j < Hkv; ++j)
        for (std::int64_t x = 0; x < D; ++x) r.v.at(b, t, j, x) = t == x ? 1.0f : 0.0f;
      for (std::int64_t h = 0; h < Hq; ++h)
        for (std::int64_t x = 0; x < D; ++x) r.dout.at(b, t, h, x) = t == x ? 1.0f : 0.0f;
    }
  const Mask z(B, Hq, T, T, 0.3, r.c.dropout_seed, 3);  // the options' offset (variant_run.hpp)
  for (Isa isa : testkit::concrete_isas()) {
    if (!testkit::isa_unavailable_reason(isa).empty()) continue;
    SCOPED_TRACE(to_string(isa));
    r.backward(isa);
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = 0; t < T; ++t)
        for (std::int64_t u = 0; u < T; ++u) {
          bool any_head = false;
          for (std::int64_t h = 0; h < Hq; ++h) {
            const bool kept = u <= t && z.at(b, h, t, u) == 1;
            ASSERT_EQ(r.out.at(b, t, h, u) != 0.0f, kept)
                << "O b=" << b << " h=" << h << " t=" << t << " u=" << u;
            if (h % g == g - 1) {  // the last head of KV group j = h / g
              any_head = any_head || kept;
              ASSERT_EQ(r.dv.at(b, u, h / g, t) != 0.0f, any_head)
                  << "dV b=" << b << " j=" << h / g << " u=" << u << " t=" << t;
              any_head = false;
            } else {
              any_head = any_head || kept;
            }
          }
        }
  }
}

// ---- Kernels against the oracle ----

std::vector<VariantCase> dropout_cases() {
  std::vector<VariantCase> cases;
  const auto add = [&](VariantCase c, double p) {
    c.dropout = p;
    cases.push_back(c);
  };
  // Tile edges (64 keys; lane blocks of 8 or 16 rows), T_q ≶ T_k, both alignments.
  for (std::int64_t T : {1, 2, 15, 63, 64, 65, 97}) add({1, T, T, 2, 1, 16}, 0.2);
  for (CausalAlign align : {CausalAlign::bottom_right, CausalAlign::top_left})
    for (bool causal : {true, false})
      for (auto [Tq, Tk] : {std::pair<std::int64_t, std::int64_t>{20, 130}, {130, 20}})
        add({2, Tq, Tk, 4, 2, 12, causal, align}, 0.5);
  // GQA ratios, odd head widths, strided layouts; a high and a low p.
  for (auto [Hq, Hkv] : {std::pair<std::int64_t, std::int64_t>{4, 4}, {4, 2}, {8, 2}})
    for (std::int64_t D : {3, 17, 64}) {
      VariantCase c{2, 70, 71, Hq, Hkv, D};
      c.layout = D == 3 ? Layout::bhtd : Layout::strided;
      add(c, D == 17 ? 0.9 : 0.1);
    }
  // With the score variants: everything at once, and a general boolean mask.
  add(with_all_variants({2, 33, 130, 4, 1, 9, true, CausalAlign::bottom_right, Layout::strided}),
      0.3);
  VariantCase m{2, 65, 65, 4, 2, 16};
  m.mask = MaskShape::random_bool;
  add(m, 0.3);
  return cases;
}

class Dropout : public PerIsaTest {};

TEST_P(Dropout, ForwardMatchesOracleWithTheSameMask) {
  std::mt19937_64 rng(5801);
  for (const VariantCase& c : dropout_cases()) {
    SCOPED_TRACE(c.name());
    VariantRun r(c, rng);
    r.forward(GetParam());
    const auto ro = r.ref_options();
    const auto ref = reference::attention_forward(r.q.to64(), r.k.to64(), r.v.to64(), ro);
    EXPECT_LE(rel_err(r.out, ref.out), kForwardBound) << "O";
    EXPECT_LE(lse_error(r, ref.lse), kForwardBound) << "L (the undropped scores')";
    if (c.Tk >= 64) {  // the mask matters: without it the oracle is far from the kernel's O
      auto plain = ro;
      plain.dropout_keep.clear();
      const auto undropped =
          reference::attention_forward(r.q.to64(), r.k.to64(), r.v.to64(), plain);
      EXPECT_GT(rel_err(r.out, undropped.out), 1e-3);
    }
  }
}

TEST_P(Dropout, BackwardMatchesOracleWithTheSameMask) {
  std::mt19937_64 rng(5802);
  for (const VariantCase& c : dropout_cases()) {
    SCOPED_TRACE(c.name());
    VariantRun r(c, rng);
    r.backward(GetParam());
    const auto ref = reference::attention_backward(r.q.to64(), r.k.to64(), r.v.to64(),
                                                   r.dout.to64(), r.ref_options());
    const double g = max_abs(r.dout) * max_abs(r.v) / std::sqrt(static_cast<double>(c.D));
    EXPECT_LE(rel_err(r.dq, ref.dq, g), kBackwardBound) << "dq";
    EXPECT_LE(rel_err(r.dk, ref.dk, g), kBackwardBound) << "dk";
    EXPECT_LE(rel_err(r.dv, ref.dv, g), kBackwardBound) << "dv";
    if (c.sinks) {
      EXPECT_LE(rel_err_flat(r.dsinks, ref.dsinks), kBackwardBound) << "dsinks";
    }
  }
}

// The attention weights with dropout are the weights the values were averaged with.
TEST_P(Dropout, WeightsAreTheDroppedWeights) {
  std::mt19937_64 rng(5803);
  VariantCase c{2, 65, 70, 4, 2, 16};
  c.dropout = 0.4;
  c.sinks = true;
  VariantRun r(c, rng);
  r.forward(GetParam());
  StridedTensor w(c.B, c.Hq, c.Tq, c.Tk, Layout::bthd);
  w.poison();
  attention_weights(r.q.view, r.k.view, r.lse_view(), w.view, r.options(GetParam()));
  const auto ref = reference::attention_weights(r.q.to64(), r.k.to64(), r.ref_options());
  EXPECT_LE(rel_err(w, ref), kForwardBound);
}

TEST_P(Dropout, BitwiseIdenticalAcrossThreadCounts) {
  VariantCase c = with_all_variants({2, 97, 131, 8, 2, 32});
  c.dropout = 0.25;
  std::mt19937_64 rng(5804);
  VariantRun r(c, rng);
  ExpectBitwiseAcrossThreadCounts(r, GetParam());
}

// Central differences of the float64 forward with the mask held fixed (loss = Σ dO ⊙ O) against
// this path's fp32 backward: the chain rule through P̃ = A ⊙ Z / (1 − p) (D.4) checked against the
// definition, not against the oracle's backward.
TEST_P(Dropout, GradientsMatchFiniteDifferencesWithAFixedMask) {
  std::mt19937_64 rng(5805);
  VariantCase a{1, 7, 9, 4, 2, 5};
  a.dropout = 0.3;
  a.sinks = true;
  a.softcap = 1.0;
  VariantCase b{2, 9, 6, 2, 1, 4, false, CausalAlign::top_left};
  b.dropout = 0.5;
  for (const VariantCase& c : {a, b}) {
    SCOPED_TRACE(c.name());
    VariantRun r(c, rng);
    r.backward(GetParam());
    ExpectGradientsMatchFiniteDifferences(r, kBackwardBound);
  }
}

// Varlen: sequence i draws its mask as batch row i, so equal-length sequences give the padded
// batch's results.
TEST_P(Dropout, VarlenSequencesAreBatchRows) {
  std::mt19937_64 rng(5806);
  VariantCase c{3, 40, 40, 4, 2, 16};
  c.dropout = 0.35;
  c.layout = Layout::bthd;  // contiguous: [B·T, H, d_h] is the same memory
  VariantRun r(c, rng);
  r.backward(GetParam());
  const std::int64_t n = c.B * c.Tq;
  std::vector<std::int32_t> cu{0, 40, 80, 120};
  const ConstTensorView cu_view{cu.data(), DType::i32, 1, {4}, {1}};
  const auto packed = [&](StridedTensor& x, std::int64_t h) {
    return TensorView{x.view.data, DType::f32, 3, {n, h, c.D}, {h * c.D, c.D, 1}};
  };
  StridedTensor out(c.B, c.Tq, c.Hq, c.D, Layout::bthd), dq(c.B, c.Tq, c.Hq, c.D, Layout::bthd),
      dk(c.B, c.Tk, c.Hkv, c.D, Layout::bthd), dv(c.B, c.Tk, c.Hkv, c.D, Layout::bthd);
  for (StridedTensor* x : {&out, &dq, &dk, &dv}) x->poison();
  std::vector<float> lse(static_cast<std::size_t>(c.Hq * n), kPoison);
  const TensorView lse_view{lse.data(), DType::f32, 2, {c.Hq, n}, {n, 1}};
  AttentionOptions o = r.options(GetParam());
  attention_forward_varlen(packed(r.q, c.Hq), packed(r.k, c.Hkv), packed(r.v, c.Hkv), cu_view,
                           cu_view, packed(out, c.Hq), lse_view, o);
  attention_backward_varlen(packed(r.q, c.Hq), packed(r.k, c.Hkv), packed(r.v, c.Hkv),
                            packed(out, c.Hq), lse_view, packed(r.dout, c.Hq), cu_view, cu_view,
                            packed(dq, c.Hq), packed(dk, c.Hkv), packed(dv, c.Hkv), o);
  const auto close = [](const StridedTensor& x, const StridedTensor& y) {
    double worst = 0.0, scale = 1e-30;
    for (std::size_t i = 0; i < x.storage.size(); ++i) {
      worst = std::max(worst, static_cast<double>(std::fabs(x.storage[i] - y.storage[i])));
      scale = std::max(scale, static_cast<double>(std::fabs(y.storage[i])));
    }
    return worst / scale;
  };
  EXPECT_LE(close(out, r.out), 1e-6) << "O";
  EXPECT_LE(close(dq, r.dq), 1e-5) << "dq";
  EXPECT_LE(close(dk, r.dk), 1e-5) << "dk";
  EXPECT_LE(close(dv, r.dv), 1e-5) << "dv";
}

INSTANTIATE_TEST_SUITE_P(AllIsas, Dropout, AllIsas(), IsaName);

// ---- Errors ----

template <class F>
void ExpectError(F&& call, ErrorCode code, const std::vector<std::string>& words) {
  try {
    call();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const std::string& w : words)
      EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what() << " lacks " << w;
  }
}

TEST(DropoutErrors, BadProbabilityOffsetAndSizesAreNamed) {
  std::mt19937_64 rng(5807);
  VariantRun r({1, 8, 8, 2, 1, 8}, rng);
  for (double p : {-0.1, 1.0, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
    AttentionOptions o;
    o.dropout.p = p;
    ExpectError([&] { attention_forward(r.q.view, r.k.view, r.v.view, r.out.view, {}, o); },
                ErrorCode::invalid_argument, {"attention_forward", "options.dropout.p", "[0, 1)"});
    ExpectError(
        [&] {
          attention_backward(r.q.view, r.k.view, r.v.view, r.out.view, r.lse_view(), r.dout.view,
                             r.dq.view, r.dk.view, r.dv.view, o);
        },
        ErrorCode::invalid_argument, {"attention_backward", "options.dropout.p"});
  }
  AttentionOptions o;
  o.dropout = {0.1, 1, std::uint64_t{1} << 32};
  ExpectError([&] { attention_forward(r.q.view, r.k.view, r.v.view, r.out.view, {}, o); },
              ErrorCode::invalid_argument, {"options.dropout.offset", "2^32", "4294967296"});

  // The mask's own checks: rank, dtype, and counter words that would wrap (B·H_q > 2^32; no
  // memory is touched: T_k = 0).
  std::uint8_t byte = 0;
  float f = 0.0f;
  AttentionOptions d;
  d.dropout.p = 0.5;
  ExpectError(
      [&] {
        attention_dropout_mask({&byte, DType::boolean, 3, {1, 1, 1}, {1, 1, 1}}, d);
      },
      ErrorCode::shape_mismatch, {"attention_dropout_mask", "keep", "rank 4"});
  ExpectError(
      [&] {
        attention_dropout_mask({&f, DType::f32, 4, {1, 1, 1, 1}, {1, 1, 1, 1}}, d);
      },
      ErrorCode::unsupported, {"attention_dropout_mask", "keep", "bool"});
  ExpectError(
      [&] {
        attention_dropout_mask(
            {&byte, DType::boolean, 4, {std::int64_t{1} << 31, 4, 1, 0}, {4, 1, 1, 1}}, d);
      },
      ErrorCode::overflow, {"attention_dropout_mask", "B * H_q", "2^32"});
  d.dropout.p = 2.0;
  ExpectError(
      [&] {
        attention_dropout_mask({&byte, DType::boolean, 4, {1, 1, 1, 1}, {1, 1, 1, 1}}, d);
      },
      ErrorCode::invalid_argument, {"options.dropout.p"});
}

TEST(DropoutErrors, TheInferenceLayerRefusesDropout) {
  LayerConfig config;
  config.d_model = 8;
  config.heads_q = 2;
  config.heads_kv = 1;
  config.head_dim = 4;
  config.attention.dropout.p = 0.1;
  ExpectError([&] { CausalSelfAttention layer(config); }, ErrorCode::unsupported,
              {"CausalSelfAttention", "config.attention.dropout.p", "inference"});
}

}  // namespace
}  // namespace tokenmix::testing
