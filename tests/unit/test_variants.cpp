// tests/unit/test_variants.cpp — the score variants (SPEC "Score variants used by real models":
// sliding window, soft-capping, ALiBi, sinks, explicit boolean and bias masks, key lengths,
// variable-length batches) on every kernel path, against the float64 oracle (src/reference)
// and finite differences.
//
// Each path is forced in turn (PerIsaTest). A path whose registry entry lacks score_variants
// must refuse every variant with an UnsupportedError naming the kernel and the variant (no
// silent fallback): the same tests then check that, and check the numerics as soon as the path
// gains the flag — nothing is skipped.
//
// Shapes straddle the 64-key and 64-row tiles (T ∈ {1, 63, 64, 65, odd}), with GQA ratios
// {1, 2, 4}, odd head widths, T_q < T_k and T_q > T_k in both alignments, causal and not,
// strided q/k/v (PyTorch layout, padded strides) and masks with broadcast (size-1) dimensions,
// stride-0 dimensions and non-unit strides. Masks: interval-shaped boolean masks (causal-shaped,
// left and right padding, a band), which the API turns into key ranges, general (random)
// boolean masks, and float biases with −∞ entries (whole rows too).
//
// Bounds and metric as tests/unit/test_flash_kernels.cpp: forward rel_err ≤ 2e-5 (O) and
// |ΔL| / max(1, |L|) ≤ 2e-5; backward max|x − r| / max(max|r|, G) ≤ 1e-4 with
// G = max|dO|·max|V|·s. ALiBi adds scores up to ~m·T in magnitude; its rounding (≈ 6e-8 of
// that) stays far below the bounds at these lengths. dσ is judged against G·(number of rows).
// A masking, range or state bug gives errors ≥ 1e-3.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "api/variants.hpp"
#include "dispatch/registry.hpp"
#include "reference/reference.hpp"
#include "test_util.hpp"
#include "tokenmix/tokenmix.hpp"
#include "variant_run.hpp"

namespace tokenmix::testing {
namespace {

constexpr double kForwardBound = 2e-5;
constexpr double kBackwardBound = 1e-4;
constexpr double kInf = std::numeric_limits<double>::infinity();

bool supports_variants(Isa isa) {
  return kernels::kernel_set(isa).score_variants;
}

// A path without score_variants must refuse: UnsupportedError naming the kernel and a variant.
template <class F>
void ExpectRefused(F&& call, const char* op, Isa isa) {
  try {
    call();
    ADD_FAILURE() << "the " << to_string(isa) << " path ran a score variant without the flag";
  } catch (const UnsupportedError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(std::string("attention_") + op + "_f32_" + to_string(isa)),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("score variants"), std::string::npos) << msg;
  }
}

void ExpectForwardMatches(const VariantCase& c, Isa isa, std::mt19937_64& rng) {
  SCOPED_TRACE(c.name());
  VariantRun r(c, rng);
  if (!supports_variants(isa)) {
    ExpectRefused([&] { r.forward(isa); }, "fwd", isa);
    return;
  }
  r.forward(isa);
  const auto ref =
      reference::attention_forward(r.q.to64(), r.k.to64(), r.v.to64(), r.ref_options());
  EXPECT_LE(rel_err(r.out, ref.out), kForwardBound) << "O";
  EXPECT_LE(lse_error(r, ref.lse), kForwardBound) << "L";
}

void ExpectBackwardMatches(const VariantCase& c, Isa isa, std::mt19937_64& rng) {
  SCOPED_TRACE(c.name());
  VariantRun r(c, rng);
  if (!supports_variants(isa)) {
    ExpectRefused([&] { r.backward(isa); }, "fwd", isa);
    // The backward refuses too, with its own kernel's name (lse from a portable forward).
    AttentionOptions o = r.options(Isa::portable);
    attention_forward(r.q.view, r.k.view, r.v.view, r.out.view, r.lse_view(), o);
    o.isa = isa;
    ExpectRefused(
        [&] {
          attention_backward(r.q.view, r.k.view, r.v.view, r.out.view, r.lse_view(), r.dout.view,
                             r.dq.view, r.dk.view, r.dv.view, o);
        },
        "bwd", isa);
    return;
  }
  r.backward(isa);
  const auto ref = reference::attention_backward(r.q.to64(), r.k.to64(), r.v.to64(), r.dout.to64(),
                                                 r.ref_options());
  const double g = max_abs(r.dout) * max_abs(r.v) / std::sqrt(static_cast<double>(c.D));
  EXPECT_LE(rel_err(r.dq, ref.dq, g), kBackwardBound) << "dq";
  EXPECT_LE(rel_err(r.dk, ref.dk, g), kBackwardBound) << "dk";
  EXPECT_LE(rel_err(r.dv, ref.dv, g), kBackwardBound) << "dv";
  if (c.sinks) {
    EXPECT_LE(rel_err_flat(r.dsinks, ref.dsinks), kBackwardBound) << "dsinks";
    for (float x : r.dsinks) EXPECT_TRUE(std::isfinite(x));
  }
}

// ---------------------------------------------------------------------------------------------
// The case tables

std::vector<VariantCase> single_variant_cases() {
  std::vector<VariantCase> cases;
  const VariantCase base{2, 65, 65, 4, 2, 16};
  auto with = [&](auto&& set) {
    VariantCase c = base;
    set(c);
    cases.push_back(c);
  };
  for (std::int64_t W : {1, 7, 64, 200}) with([&](VariantCase& c) { c.window = W; });
  with([](VariantCase& c) { c.softcap = 0.7; });  // scores ~N(0, 1): the cap bends them
  with([](VariantCase& c) { c.softcap = 30.0; });
  with([](VariantCase& c) { c.alibi = true; });
  with([](VariantCase& c) { c.sinks = true; });
  with([](VariantCase& c) { c.key_lengths = true; });
  for (MaskShape m : {MaskShape::causal_shape, MaskShape::left_pad, MaskShape::right_pad,
                      MaskShape::band, MaskShape::random_bool, MaskShape::random_bias}) {
    with([&](VariantCase& c) { c.mask = m; });
    with([&](VariantCase& c) {
      c.mask = m;
      c.causal = false;
    });
  }
  return cases;
}

std::vector<VariantCase> combined_cases() {
  std::vector<VariantCase> cases;
  // Everything at once, over tile-edge lengths, both alignments, T_q ≶ T_k, causal and not.
  for (std::int64_t T : {1, 63, 64, 65, 97}) {
    VariantCase c{1, T, T, 4, 2, 16};
    c.window = 9;
    c.softcap = 5.0;
    c.alibi = true;
    c.sinks = true;
    cases.push_back(c);
  }
  for (CausalAlign align : {CausalAlign::bottom_right, CausalAlign::top_left})
    for (bool causal : {true, false})
      for (auto [Tq, Tk] : {std::pair<std::int64_t, std::int64_t>{20, 130}, {130, 20}, {64, 1}}) {
        const VariantCase c = with_all_variants({2, Tq, Tk, 4, 1, 12, causal, align});
        cases.push_back(c);
        VariantCase m = c;  // with a general mask instead of key lengths, no sinks
        m.key_lengths = false;
        m.sinks = false;
        m.mask = MaskShape::random_bool;
        m.mask_full = {true, false, true, true};
        cases.push_back(m);
      }
  // GQA ratios and odd head widths, strided views.
  for (auto [Hq, Hkv] : {std::pair<std::int64_t, std::int64_t>{4, 4}, {4, 2}, {8, 2}})
    for (std::int64_t D : {3, 17}) {
      VariantCase c{1, 70, 70, Hq, Hkv, D};
      c.window = 33;
      c.alibi = true;
      c.sinks = true;
      c.softcap = 1.5;
      c.layout = D == 3 ? Layout::bhtd : Layout::strided;
      cases.push_back(c);
    }
  // Masks: broadcast patterns and memory layouts, bias with −∞, combined with other variants.
  for (auto full : {std::array<bool, 4>{true, true, true, true},
                    {false, false, true, true},
                    {true, false, false, true},
                    {false, true, true, false}})
    for (MaskMemory mem : {MaskMemory::dense, MaskMemory::padded, MaskMemory::transposed})
      for (MaskShape m : {MaskShape::random_bool, MaskShape::random_bias, MaskShape::left_pad}) {
        VariantCase c{2, 33, 66, 4, 2, 8, true, CausalAlign::bottom_right, Layout::strided};
        c.mask = m;
        c.mask_full = full;
        c.mask_memory = mem;
        c.sinks = m == MaskShape::random_bias;
        c.softcap = m == MaskShape::random_bool ? std::optional<double>(3.0) : std::nullopt;
        cases.push_back(c);
      }
  {  // interval masks combined with a window, key lengths and causal top-left
    VariantCase c{3, 65, 65, 2, 1, 8, true, CausalAlign::top_left};
    c.mask = MaskShape::right_pad;
    c.mask_full = {true, false, false, true};
    c.window = 20;
    c.key_lengths = true;
    cases.push_back(c);
    c.mask = MaskShape::band;
    c.mask_full = {false, true, true, true};
    c.sinks = true;
    cases.push_back(c);
  }
  return cases;
}

class Variants : public PerIsaTest {};

TEST_P(Variants, EachVariantAloneMatchesOracleForward) {
  std::mt19937_64 rng(1201);
  for (const auto& c : single_variant_cases()) ExpectForwardMatches(c, GetParam(), rng);
}

TEST_P(Variants, EachVariantAloneMatchesOracleBackward) {
  std::mt19937_64 rng(1202);
  for (const auto& c : single_variant_cases()) ExpectBackwardMatches(c, GetParam(), rng);
}

TEST_P(Variants, CombinedVariantsMatchOracleForward) {
  std::mt19937_64 rng(1203);
  for (const auto& c : combined_cases()) ExpectForwardMatches(c, GetParam(), rng);
}

TEST_P(Variants, CombinedVariantsMatchOracleBackward) {
  std::mt19937_64 rng(1204);
  for (const auto& c : combined_cases()) ExpectBackwardMatches(c, GetParam(), rng);
}

// Rows that see no key: O = 0 exactly and L = −∞, or L = σ_h exactly with sinks; their dQ is
// exactly 0. Sources: T_q > T_k bottom-right, a key length of 0, an all-false boolean row, an
// all −∞ bias row (that row still "sees" keys, of weight 0), a window past every key (top-left,
// T_q > T_k is not needed: W = 1 with key lengths that end before p(t)).
TEST_P(Variants, RowsThatSeeNoKey) {
  std::mt19937_64 rng(1205);
  for (bool sinks : {false, true}) {
    std::vector<VariantCase> cases;
    VariantCase a{2, 90, 30, 4, 2, 8};  // rows t < 60 see nothing (bottom-right)
    a.sinks = sinks;
    a.window = 10;
    cases.push_back(a);
    VariantCase b{2, 40, 40, 2, 1, 8};
    b.key_lengths = true;  // lengths {13 + 0, 26 + 1}: rows t ≥ length + W see nothing
    b.window = 1;
    b.sinks = sinks;
    cases.push_back(b);
    VariantCase m{1, 33, 33, 2, 2, 8};
    m.mask = MaskShape::random_bias;  // row T_q/2 is all −∞
    m.sinks = sinks;
    cases.push_back(m);
    for (const VariantCase& c : cases) {
      SCOPED_TRACE(c.name());
      VariantRun r(c, rng);
      if (!supports_variants(GetParam())) {
        ExpectRefused([&] { r.backward(GetParam()); }, "fwd", GetParam());
        continue;
      }
      r.backward(GetParam());
      const auto ref =
          reference::attention_forward(r.q.to64(), r.k.to64(), r.v.to64(), r.ref_options());
      int empty_rows = 0;
      for (std::int64_t bb = 0; bb < c.B; ++bb)
        for (std::int64_t h = 0; h < c.Hq; ++h)
          for (std::int64_t t = 0; t < c.Tq; ++t) {
            const double want = ref.lse.at(bb, h, t, 0);
            const bool empty = sinks ? want == static_cast<double>(r.sinks[h]) : std::isinf(want);
            if (!empty) continue;
            ++empty_rows;
            const float got = r.lse[static_cast<std::size_t>((bb * c.Hq + h) * c.Tq + t)];
            ASSERT_EQ(got, static_cast<float>(want)) << "b=" << bb << " h=" << h << " t=" << t;
            for (std::int64_t e = 0; e < c.D; ++e) {
              ASSERT_EQ(r.out.at(bb, t, h, e), 0.0f) << "b=" << bb << " h=" << h << " t=" << t;
              ASSERT_EQ(r.dq.at(bb, t, h, e), 0.0f) << "b=" << bb << " h=" << h << " t=" << t;
            }
          }
      EXPECT_GT(empty_rows, 0) << "the case must have rows that see no key";
    }
  }
}

// A key that a row does not see takes no part (SPEC 4.3): NaN in K and V at keys excluded by
// the window, the key lengths or a boolean mask does not reach O, L or any gradient of the rows
// (and dK, dV of visible keys stay finite).
TEST_P(Variants, InvisibleNaNKeysDoNotLeak) {
  std::mt19937_64 rng(1206);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int which = 0; which < 3; ++which) {
    VariantCase c{2, 40, 40, 2, 1, 8, false};  // non-causal: only the variant hides the key
    if (which == 0) c.window = 5;
    if (which == 1) c.key_lengths = true;
    if (which == 2) {
      c.mask = MaskShape::right_pad;  // u < len[b]: interval rows ...
      c.softcap = 4.0;                // ... plus an element-wise term
    }
    SCOPED_TRACE(c.name());
    VariantRun r(c, rng);
    if (!supports_variants(GetParam())) {
      ExpectRefused([&] { r.forward(GetParam()); }, "fwd", GetParam());
      continue;
    }
    // Window (non-causal: keys p(t) − W < u): key 0 is invisible to rows t ≥ W. Key lengths
    // {13, 27} and right padding (lengths 40 − {1, 6}) hide the last key from every row.
    const std::int64_t u_bad = which == 0 ? 0 : c.Tk - 1, t_first = which == 0 ? *c.window : 0;
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t e = 0; e < c.D; ++e) {
        r.k.at(b, u_bad, 0, e) = nan;
        r.v.at(b, u_bad, 0, e) = nan;
      }
    r.backward(GetParam());
    const auto ref =
        reference::attention_forward(r.q.to64(), r.k.to64(), r.v.to64(), r.ref_options());
    ErrorAccumulator acc;
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t t = t_first; t < c.Tq; ++t)
        for (std::int64_t h = 0; h < c.Hq; ++h) {
          ASSERT_TRUE(std::isfinite(r.lse[static_cast<std::size_t>((b * c.Hq + h) * c.Tq + t)]));
          for (std::int64_t e = 0; e < c.D; ++e) {
            ASSERT_TRUE(std::isfinite(r.out.at(b, t, h, e))) << "b=" << b << " t=" << t;
            ASSERT_TRUE(std::isfinite(r.dq.at(b, t, h, e))) << "b=" << b << " t=" << t;
            acc.add(r.out.at(b, t, h, e), ref.out.at(b, t, h, e));
          }
        }
    EXPECT_LE(acc.value(), kForwardBound);
  }
}

// Results do not depend on the thread count: O, L, dQ, dK, dV and dσ bitwise equal for 1, 2, 3.
TEST_P(Variants, BitwiseIdenticalAcrossThreadCounts) {
  VariantCase c{2, 97, 131, 8, 2, 32};
  c.window = 40;
  c.softcap = 10.0;
  c.alibi = true;
  c.sinks = true;
  c.mask = MaskShape::random_bool;
  c.mask_full = {true, false, true, true};
  std::mt19937_64 rng(1207);
  VariantRun r(c, rng);
  if (!supports_variants(GetParam())) {
    ExpectRefused([&] { r.forward(GetParam()); }, "fwd", GetParam());
    return;
  }
  ExpectBitwiseAcrossThreadCounts(r, GetParam());
}

// Central differences of the float64 forward (loss = Σ dO ⊙ O) against this path's fp32
// backward: dQ, dK, dV and dσ with soft-capping, ALiBi, a window, sinks and a bias mask, so the
// chain rule of each term is checked against the definition, not the oracle's backward.
TEST_P(Variants, GradientsMatchFiniteDifferences) {
  std::mt19937_64 rng(1208);
  std::vector<VariantCase> cases;
  {
    VariantCase c{1, 7, 9, 4, 2, 5};
    c.softcap = 1.0;
    c.alibi = true;
    c.sinks = true;
    c.window = 4;
    cases.push_back(c);
    VariantCase d{2, 9, 6, 2, 1, 4, false, CausalAlign::top_left};
    d.sinks = true;
    d.mask = MaskShape::random_bias;
    d.mask_full = {true, false, true, true};
    cases.push_back(d);
    VariantCase e{2, 6, 8, 2, 2, 3};
    e.sinks = true;
    e.key_lengths = true;
    e.mask = MaskShape::random_bool;
    cases.push_back(e);
  }
  for (const VariantCase& c : cases) {
    SCOPED_TRACE(c.name());
    VariantRun r(c, rng);
    if (!supports_variants(GetParam())) {
      ExpectRefused([&] { r.backward(GetParam()); }, "fwd", GetParam());
      continue;
    }
    r.backward(GetParam());
    ExpectGradientsMatchFiniteDifferences(r, kBackwardBound);
  }
}

// An interval-shaped boolean mask is the same function as the options it encodes: a
// causal-shaped mask with causal = false equals causal = true, a right-padding mask equals key
// lengths, a band equals a window — bitwise, since each becomes the same key ranges.
TEST_P(Variants, IntervalMasksEqualTheOptionsTheyEncode) {
  const Isa isa = GetParam();
  const std::int64_t B = 2, T = 70, Hq = 4, Hkv = 2, D = 16, W = 9;
  std::mt19937_64 rng(1209);
  StridedTensor q(B, T, Hq, D, Layout::bthd), k(B, T, Hkv, D, Layout::bthd),
      v(B, T, Hkv, D, Layout::bthd);
  q.fill_random(rng);
  k.fill_random(rng);
  v.fill_random(rng);
  // [1, 1, T, T] lower triangle, band of width W; [B, 1, 1, T] right padding of lengths {50, 70}.
  std::vector<std::uint8_t> tri(T * T), band(T * T), pad(B * T);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t u = 0; u < T; ++u) {
      tri[t * T + u] = u <= t;
      band[t * T + u] = u <= t && u > t - W;
    }
  const std::int32_t lengths[2] = {50, 70};
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t u = 0; u < T; ++u) pad[b * T + u] = u < lengths[b];
  const ConstTensorView tri_v{tri.data(), DType::boolean, 4, {1, 1, T, T}, {0, 0, T, 1}};
  const ConstTensorView band_v{band.data(), DType::boolean, 4, {1, 1, T, T}, {0, 0, T, 1}};
  const ConstTensorView pad_v{pad.data(), DType::boolean, 4, {B, 1, 1, T}, {T, 0, 0, 1}};
  const ConstTensorView len_v{lengths, DType::i32, 1, {B}, {1}};

  auto run = [&](const AttentionOptions& o) {
    StridedTensor out(B, T, Hq, D, Layout::bthd);
    std::vector<float> lse(static_cast<std::size_t>(B * Hq * T), kPoison);
    attention_forward(q.view, k.view, v.view, out.view, TensorView::bht(lse.data(), B, Hq, T), o);
    std::vector<float> all = out.storage;
    all.insert(all.end(), lse.begin(), lse.end());
    return all;
  };
  AttentionOptions causal, masked;
  causal.isa = masked.isa = isa;
  masked.causal = false;
  masked.mask = tri_v;
  if (!supports_variants(isa)) {
    ExpectRefused([&] { run(masked); }, "fwd", isa);
    return;
  }
  auto equal = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
  };
  EXPECT_TRUE(equal(run(causal), run(masked))) << "causal-shaped mask";
  AttentionOptions windowed = causal, banded = masked;
  windowed.window = W;
  banded.mask = band_v;
  EXPECT_TRUE(equal(run(windowed), run(banded))) << "band mask";
  AttentionOptions lens = causal, padded = causal;
  lens.key_lengths = len_v;
  padded.mask = pad_v;
  EXPECT_TRUE(equal(run(lens), run(padded))) << "right-padding mask";
}

// ---------------------------------------------------------------------------------------------
// Variable-length batches

struct VarlenRun {
  std::int64_t Hq, Hkv, D;
  std::vector<std::int64_t> cu_q, cu_k;
  StridedTensor q, k, v, out, dout, dq, dk, dv;
  std::vector<float> lse, sinks, slopes, dsinks;
  std::vector<std::int32_t> cu_q32, cu_k32;

  VarlenRun(const std::vector<std::int64_t>& lq, const std::vector<std::int64_t>& lk,
            std::int64_t hq, std::int64_t hkv, std::int64_t d, Layout layout, std::mt19937_64& rng)
      : Hq(hq),
        Hkv(hkv),
        D(d),
        cu_q(prefix(lq)),
        cu_k(prefix(lk)),
        q(1, cu_q.back(), hq, d, layout),
        k(1, cu_k.back(), hkv, d, layout),
        v(1, cu_k.back(), hkv, d, layout),
        out(1, cu_q.back(), hq, d, layout),
        dout(1, cu_q.back(), hq, d, layout),
        dq(1, cu_q.back(), hq, d, layout),
        dk(1, cu_k.back(), hkv, d, layout),
        dv(1, cu_k.back(), hkv, d, layout),
        lse(static_cast<std::size_t>(hq * cu_q.back()), kPoison) {
    q.fill_random(rng);
    k.fill_random(rng);
    v.fill_random(rng);
    dout.fill_random(rng);
    std::normal_distribution<float> dist;
    for (std::int64_t h = 0; h < hq; ++h) {
      sinks.push_back(dist(rng));
      slopes.push_back(std::exp2(-static_cast<float>(h + 1)));
    }
    dsinks.assign(static_cast<std::size_t>(hq), kPoison);
    for (auto x : cu_q) cu_q32.push_back(static_cast<std::int32_t>(x));
    for (auto x : cu_k) cu_k32.push_back(static_cast<std::int32_t>(x));
  }
  static std::vector<std::int64_t> prefix(const std::vector<std::int64_t>& lens) {
    std::vector<std::int64_t> cu{0};
    for (auto l : lens) cu.push_back(cu.back() + l);
    return cu;
  }
  // The rank-3 [total, H, d_h] view of a [1, total, H, d_h] test tensor.
  static TensorView packed(const StridedTensor& x) {
    const TensorView& w = x.view;
    return {w.data,
            DType::f32,
            3,
            {w.shape[1], w.shape[2], w.shape[3]},
            {w.strides[1], w.strides[2], w.strides[3]}};
  }
  TensorView lse_view() {
    const std::int64_t total = cu_q.back();
    return {lse.data(), DType::f32, 2, {Hq, total}, {total, 1}};
  }
  ConstTensorView cu_view(bool i64, bool keys) const {
    const auto& c64 = keys ? cu_k : cu_q;
    const auto& c32 = keys ? cu_k32 : cu_q32;
    const std::int64_t n = static_cast<std::int64_t>(c64.size());
    if (i64) return {c64.data(), DType::i64, 1, {n}, {1}};
    return {c32.data(), DType::i32, 1, {n}, {1}};
  }
};

// The options of one varlen case: the causal mask and its alignment, sinks with ALiBi, a window,
// soft-capping.
struct VarlenVariants {
  bool causal = true;
  bool top_left = false;
  bool sinks_and_alibi = false;
  std::optional<std::int64_t> window;
  std::optional<double> softcap;
};

// One varlen forward and backward on `isa` against the float64 oracle: sequences of query lengths
// lq and key lengths lk (packed, cu_seqlens as i64 or i32), H_q / H_kv heads of width d. A path
// without score variants must refuse a case that asks for one.
void ExpectVarlenMatches(const std::vector<std::int64_t>& lq, const std::vector<std::int64_t>& lk,
                         std::int64_t hq, std::int64_t hkv, std::int64_t d, Layout layout,
                         const VarlenVariants& vv, bool i64, Isa isa, std::mt19937_64& rng) {
  VarlenRun r(lq, lk, hq, hkv, d, layout, rng);
  AttentionOptions o;
  o.isa = isa;
  reference::Options ro;
  o.causal = ro.causal = vv.causal;
  if (vv.top_left) {
    o.align = CausalAlign::top_left;
    ro.align = reference::Align::top_left;
  }
  if (vv.sinks_and_alibi) {
    o.sinks = {r.sinks.data(), DType::f32, 1, {r.Hq}, {1}};
    o.alibi_slopes = {r.slopes.data(), DType::f32, 1, {r.Hq}, {1}};
    for (float x : r.sinks) ro.sinks.push_back(x);
    for (float x : r.slopes) ro.alibi_slopes.push_back(x);
  }
  if (vv.window) o.window = ro.window = *vv.window;
  if (vv.softcap) o.softcap = ro.softcap = *vv.softcap;
  const auto fwd = [&] {
    attention_forward_varlen(VarlenRun::packed(r.q), VarlenRun::packed(r.k), VarlenRun::packed(r.v),
                             r.cu_view(i64, false), r.cu_view(i64, true), VarlenRun::packed(r.out),
                             r.lse_view(), o);
  };
  const bool variant = vv.sinks_and_alibi || vv.window || vv.softcap;
  if (variant && !supports_variants(isa)) {
    ExpectRefused(fwd, "fwd", isa);
    return;
  }
  fwd();
  const auto ref =
      reference::attention_forward_varlen(r.q.to64(), r.k.to64(), r.v.to64(), r.cu_q, r.cu_k, ro);
  EXPECT_LE(rel_err(r.out, ref.out), kForwardBound) << "O";
  ErrorAccumulator lse_acc;
  for (std::int64_t h = 0; h < r.Hq; ++h)
    for (std::int64_t t = 0; t < r.cu_q.back(); ++t)
      lse_acc.add(r.lse[static_cast<std::size_t>(h * r.cu_q.back() + t)], ref.lse.at(0, h, t, 0));
  EXPECT_LE(lse_acc.value(1.0), kForwardBound) << "L";

  r.dq.poison();
  r.dk.poison();
  r.dv.poison();
  std::fill(r.dsinks.begin(), r.dsinks.end(), kPoison);
  TensorView ds{};
  if (vv.sinks_and_alibi) ds = {r.dsinks.data(), DType::f32, 1, {r.Hq}, {1}};
  attention_backward_varlen(VarlenRun::packed(r.q), VarlenRun::packed(r.k), VarlenRun::packed(r.v),
                            VarlenRun::packed(r.out), r.lse_view(), VarlenRun::packed(r.dout),
                            r.cu_view(i64, false), r.cu_view(i64, true), VarlenRun::packed(r.dq),
                            VarlenRun::packed(r.dk), VarlenRun::packed(r.dv), o, ds);
  const auto bref = reference::attention_backward_varlen(r.q.to64(), r.k.to64(), r.v.to64(),
                                                         r.dout.to64(), r.cu_q, r.cu_k, ro);
  const double g = max_abs(r.dout) * max_abs(r.v) / std::sqrt(static_cast<double>(d));
  EXPECT_LE(rel_err(r.dq, bref.dq, g), kBackwardBound) << "dq";
  EXPECT_LE(rel_err(r.dk, bref.dk, g), kBackwardBound) << "dk";
  EXPECT_LE(rel_err(r.dv, bref.dv, g), kBackwardBound) << "dv";
  if (vv.sinks_and_alibi) {
    EXPECT_LE(rel_err_flat(r.dsinks, bref.dsinks), kBackwardBound) << "dsinks";
  }
}

TEST_P(Variants, VarlenMatchesOracle) {
  std::mt19937_64 rng(1210);
  // Sequences of lengths straddling the tiles, with empty ones (no queries; no keys).
  const std::vector<std::int64_t> lq{5, 0, 64, 3, 65, 1, 7}, lk{7, 4, 64, 0, 130, 1, 7};
  int config = 0;
  for (Layout layout : {Layout::bthd, Layout::strided}) {
    for (int variants = 0; variants < 3; ++variants, ++config) {
      SCOPED_TRACE("layout " + std::string(layout_name(layout)) + ", variants " +
                   std::to_string(variants));
      VarlenVariants vv;
      if (variants >= 1) {  // sinks and ALiBi, top-left
        vv.top_left = true;
        vv.sinks_and_alibi = true;
      }
      if (variants == 2) {  // plus a window and soft-capping, non-causal
        vv.window = 6;
        vv.softcap = 2.5;
        vv.causal = false;
      }
      ExpectVarlenMatches(lq, lk, 4, 2, 12, layout, vv, config % 2 == 1, GetParam(), rng);
    }
  }
}

// Random varlen batches, forward and backward against the float64 oracle: 25 draws per path from
// one fixed seed of the number of sequences (1 … 6), each one's query and key lengths (0 … 130,
// empty sequences and tile edges; T_q ≶ T_k within a sequence), GQA ratio, d_h (1 … 64, odd
// widths), the layout, i32 or i64 offsets, and by coins causal or not, the alignment, sinks with
// ALiBi, a window and soft-capping.
TEST_P(Variants, RandomVarlenBatchesMatchOracle) {
  Picker pick(20261213);
  std::mt19937_64 rng(20261214);
  const std::int64_t widths[] = {1, 3, 8, 16, 17, 33, 64};
  const auto length = [&pick] {
    return pick(0, 3) == 0 ? std::array<std::int64_t, 5>{0, 1, 63, 64, 65}[pick(0, 4)]
                           : pick(1, 130);
  };
  for (int draw = 0; draw < 25; ++draw) {
    std::vector<std::int64_t> lq, lk;
    for (std::int64_t n = pick(1, 6); n > 0; --n) {
      lq.push_back(length());
      lk.push_back(pick(0, 2) == 0 ? lq.back() : length());
    }
    const std::int64_t hkv = pick(1, 3), hq = hkv * pick(1, 4);
    const std::int64_t d = widths[pick(0, std::size(widths) - 1)];
    const Layout layout =
        std::array<Layout, 3>{Layout::bthd, Layout::bhtd, Layout::strided}[pick(0, 2)];
    const bool i64 = pick(0, 1) == 0;
    VarlenVariants vv;
    vv.causal = pick(0, 3) != 0;
    vv.top_left = pick(0, 2) == 0;
    vv.sinks_and_alibi = pick(0, 2) == 0;
    if (pick(0, 2) == 0) vv.window = pick(1, 150);
    if (pick(0, 2) == 0) vv.softcap = std::array<double, 3>{0.7, 5.0, 30.0}[pick(0, 2)];
    SCOPED_TRACE("draw " + std::to_string(draw));
    ExpectVarlenMatches(lq, lk, hq, hkv, d, layout, vv, i64, GetParam(), rng);
  }
}

// Random cases, forward and backward against the float64 oracle: 40 draws per path from one
// fixed seed of B, T_q and T_k (1 … 130 each: tile edges, T_q ≶ T_k), GQA ratio, d_h (1 … 64, odd
// widths), causal or not, either alignment, the memory layout, and by coins a window, soft-
// capping, ALiBi, sinks, key lengths and one of the masks (its broadcast dimensions and memory
// layout drawn too). The tables above pair these up a few at a time; here any combination can
// meet.
TEST_P(Variants, RandomCasesMatchOracleForwardAndBackward) {
  Picker pick(20261206);
  std::mt19937_64 rng(20261207);
  const std::int64_t widths[] = {1, 3, 8, 16, 17, 33, 64};
  const MaskShape masks[] = {MaskShape::causal_shape, MaskShape::left_pad,
                             MaskShape::right_pad,    MaskShape::band,
                             MaskShape::random_bool,  MaskShape::random_bias};
  for (int draw = 0; draw < 40; ++draw) {
    VariantCase c;
    c.B = pick(1, 3);
    c.Tq = pick(0, 3) == 0 ? std::array<std::int64_t, 4>{1, 63, 64, 65}[pick(0, 3)] : pick(1, 130);
    c.Tk = pick(0, 3) == 0 ? c.Tq : pick(1, 130);
    c.Hkv = pick(1, 3);
    c.Hq = c.Hkv * pick(1, 4);
    c.D = widths[pick(0, std::size(widths) - 1)];
    c.causal = pick(0, 3) != 0;
    c.align = pick(0, 1) == 0 ? CausalAlign::bottom_right : CausalAlign::top_left;
    c.layout = std::array<Layout, 3>{Layout::bthd, Layout::bhtd, Layout::strided}[pick(0, 2)];
    if (pick(0, 2) == 0) c.window = pick(1, 150);
    if (pick(0, 2) == 0) c.softcap = std::array<double, 3>{0.7, 5.0, 30.0}[pick(0, 2)];
    c.alibi = pick(0, 2) == 0;
    c.sinks = pick(0, 2) == 0;
    c.key_lengths = pick(0, 3) == 0;
    if (pick(0, 2) == 0) {
      c.mask = masks[pick(0, std::size(masks) - 1)];
      for (bool& full : c.mask_full) full = pick(0, 1) == 0;
      c.mask_memory = std::array<MaskMemory, 3>{MaskMemory::dense, MaskMemory::padded,
                                                MaskMemory::transposed}[pick(0, 2)];
    }
    SCOPED_TRACE("draw " + std::to_string(draw));
    ExpectForwardMatches(c, GetParam(), rng);
    ExpectBackwardMatches(c, GetParam(), rng);
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, Variants, AllIsas(), IsaName);

}  // namespace
}  // namespace tokenmix::testing

namespace tokenmix::testing {
namespace {

// The window-aware useful-work counts (SPEC "Useful-work counts" with "Score variants":
// window): visible_keys_windowed counts the oracle's visible keys, visible_pairs_windowed is their
// sum in closed form, the FLOP counts follow, and a window of at least T_k + T_q changes nothing.
TEST(VariantCounts, WindowedCountsMatchBruteForce) {
  for (bool causal : {true, false})
    for (CausalAlign align : {CausalAlign::bottom_right, CausalAlign::top_left})
      for (auto [Tq, Tk] : {std::pair<std::int64_t, std::int64_t>{1, 1},
                            {7, 7},
                            {5, 12},
                            {12, 5},
                            {64, 65},
                            {0, 4},
                            {4, 0}})
        for (std::int64_t W : {1, 2, 3, 6, 13, 200}) {
          reference::Options o;
          o.causal = causal;
          o.align = testkit::to_reference(align);
          o.window = W;
          std::int64_t total = 0;
          for (std::int64_t t = 0; t < Tq; ++t) {
            std::int64_t n = 0;
            for (std::int64_t u = 0; u < Tk; ++u) n += reference::visible(t, u, Tq, Tk, o);
            EXPECT_EQ(visible_keys_windowed(t, Tq, Tk, causal, align, W), n)
                << "t=" << t << " Tq=" << Tq << " Tk=" << Tk << " W=" << W;
            total += n;
          }
          EXPECT_EQ(visible_pairs_windowed(Tq, Tk, causal, align, W), total)
              << "Tq=" << Tq << " Tk=" << Tk << " W=" << W << " causal=" << causal;
          EXPECT_EQ(forward_flops_windowed(2, Tq, Tk, 3, 8, causal, align, W),
                    4.0 * 8 * 3 * total * 2);
          EXPECT_EQ(backward_flops_windowed(2, Tq, Tk, 3, 8, causal, align, W),
                    2.5 * 4.0 * 8 * 3 * total * 2);
          if (W >= Tq + Tk) {
            EXPECT_EQ(visible_pairs_windowed(Tq, Tk, causal, align, W),
                      visible_pairs(Tq, Tk, causal, align));
          }
        }
  // Huge sizes: closed form, no overflow; W·T for T ≫ W (causal, square).
  const std::int64_t T = std::int64_t{1} << 40, W = 4096;
  EXPECT_EQ(visible_pairs_windowed(T, T, true, CausalAlign::bottom_right, W),
            W * T - W * (W - 1) / 2);
  EXPECT_EQ(visible_pairs_windowed(3, 3, true, CausalAlign::bottom_right, INT64_MAX),
            visible_pairs(3, 3, true, CausalAlign::bottom_right));
}

}  // namespace
}  // namespace tokenmix::testing

namespace tokenmix::testing {
namespace {

// The API's mask normalisation (src/api/variants.cpp): a boolean mask whose rows are single
// intervals of true keys becomes row intervals only (key ranges, no element-wise mask), over
// the mask's own (non-broadcast) dimensions; any hole makes it a general mask, with the rows'
// hulls still narrowing the key ranges; an all-false row is the empty interval; a broadcast key
// dimension of a true row covers all T_k keys; an f32 mask is a bias.
TEST(VariantNormalisation, BooleanMaskIntervalDetection) {
  const std::int64_t B = 2, H = 3, T = 5;
  kernels::AttentionProblem p;
  p.batch = B;
  p.hq = H;
  p.tq = T;
  p.tk = T;
  p.threads = 2;
  p.causal = false;  // key ranges from the mask alone
  detail::VariantData data;
  // Lower triangle [1, 1, T, T]: intervals [0, t + 1) per row t.
  std::vector<std::uint8_t> tri(T * T);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t u = 0; u < T; ++u) tri[t * T + u] = u <= t ? 1 : 0;
  AttentionOptions o;
  o.mask = {tri.data(), DType::boolean, 4, {1, 1, T, T}, {0, 0, T, 1}};
  detail::prepare_variants("test", o, p, data);
  EXPECT_EQ(p.var.mask_kind, kernels::MaskKind::none);
  ASSERT_NE(p.var.row_begin, nullptr);
  EXPECT_EQ(p.var.r0, 0);
  EXPECT_EQ(p.var.r1, 0);
  EXPECT_EQ(p.var.r2, 1);
  for (std::int64_t t = 0; t < T; ++t) {
    EXPECT_EQ(p.key_range(1, 2, t).begin, 0);
    EXPECT_EQ(p.key_range(1, 2, t).end, t + 1);
  }
  EXPECT_EQ(data.names, "mask");

  // Left padding [B, 1, 1, T] with pads {2, 0}; batch row 1 of a second mask all false.
  std::vector<std::uint8_t> pad{0, 0, 1, 1, 1, 1, 1, 1, 1, 1};
  o.mask = {pad.data(), DType::boolean, 4, {B, 1, 1, T}, {T, 7, 99, 1}};
  detail::prepare_variants("test", o, p, data);
  EXPECT_EQ(p.var.mask_kind, kernels::MaskKind::none);
  EXPECT_EQ(p.var.r0, 1);
  EXPECT_EQ(p.var.r1, 0);
  EXPECT_EQ(p.var.r2, 0);
  EXPECT_EQ(p.key_range(0, 1, 3).begin, 2);
  EXPECT_EQ(p.key_range(1, 1, 3).begin, 0);
  std::fill(pad.begin() + T, pad.end(), 0);
  detail::prepare_variants("test", o, p, data);
  EXPECT_EQ(p.var.mask_kind, kernels::MaskKind::none);
  EXPECT_EQ(p.key_range(1, 0, 4).end, p.key_range(1, 0, 4).begin);  // empty

  // A hole: general mask, with the hull as the key range.
  pad[1] = 1;  // row 0: 0 1 1 1 1 → interval; make a hole:
  pad[2] = 0;  // row 0: 0 1 0 1 1
  detail::prepare_variants("test", o, p, data);
  EXPECT_EQ(p.var.mask_kind, kernels::MaskKind::boolean);
  EXPECT_EQ(p.var.m0, T);
  EXPECT_EQ(p.var.m1, 0);  // size-1 dims broadcast whatever their stride
  EXPECT_EQ(p.var.m2, 0);
  EXPECT_EQ(p.key_range(0, 0, 0).begin, 1);
  EXPECT_EQ(p.key_range(0, 0, 0).end, T);

  // Key dimension broadcast [1, H, 1, 1]: head 1 false, others true → [0, T_k) or empty.
  std::vector<std::uint8_t> heads{1, 0, 1};
  o.mask = {heads.data(), DType::boolean, 4, {1, H, 1, 1}, {0, 1, 0, 0}};
  detail::prepare_variants("test", o, p, data);
  EXPECT_EQ(p.var.mask_kind, kernels::MaskKind::none);
  EXPECT_EQ(p.key_range(0, 0, 2).end, T);
  EXPECT_EQ(p.key_range(0, 1, 2).end - p.key_range(0, 1, 2).begin, 0);

  // f32: a bias, no intervals.
  std::vector<float> bias(T, 0.5f);
  o.mask = {bias.data(), DType::f32, 4, {1, 1, 1, T}, {0, 0, 0, 1}};
  o.window = 2;
  detail::prepare_variants("test", o, p, data);
  EXPECT_EQ(p.var.mask_kind, kernels::MaskKind::bias);
  EXPECT_EQ(p.var.row_begin, nullptr);
  EXPECT_EQ(p.var.m3, 1);
  EXPECT_EQ(data.names, "window, mask");
}

}  // namespace
}  // namespace tokenmix::testing
