// tests/unit/test_attention.cpp — the fp32 library (tokenmix::attention_forward/backward)
// against the float64 oracle (src/reference), SPEC 4.2–4.8 and "Backward pass".
//
// Coverage is a table of cases (kCases below), not a cartesian product: every value of every
// axis appears at least once — T ∈ {1, 2, 3, 17, 64, 129, 1000}, d_h ∈ {8, 64, 80, 128, 256},
// (H_q, H_kv) ∈ {(1,1), (4,4), (8,2), (8,1), (14,2)}, B ∈ {1, 3}, T_q < T_k and T_q > T_k in
// both alignments, non-causal, custom scale, and each of the eight tensors (q, k, v, out, dout,
// dq, dk, dv) in each of the three layouts (bthd, bhtd, strided) — with the large sizes
// (T = 1000, d_h = 256) in only a few cases so the file stays fast under AddressSanitizer.
//
// Error metric: rel_err of test_util.hpp (max-norm error / max-norm of the reference).
// Bounds (fp32 unit roundoff u = 2^-24 ≈ 6e-8):
//   kForwardBound = 2e-5 for out and lse. A score is a length-d_h dot product (error ≲ √d_h u
//     typically, d_h u = 1.5e-5 worst case at d_h = 256, relative to Σ|q_i k_i|, which for
//     scaled O(1) inputs is O(1)); exp and the normalisation add a few u; the output is a sum of
//     T_k terms a_u v_u with a_u ≥ 0, whose rounding error is ≲ √T_k u ≈ 2e-6 typically
//     (T_k u = 6e-5 only in the never-seen worst case). Observed errors are ~1e-7–1e-6, so
//     2e-5 has margin yet catches any real mistake (a wrong mask entry, a missed key, a wrong
//     head mapping or scale all give errors ≥ 1e-3).
//   kBackwardBound = 1e-4 for dq, dk, dv. The backward pass has one more product per term
//     (dS = A ⊙ (dO Vᵀ − D)), a cancellation in dA − D, sums over T_q (dk, dv, and over the
//     g heads of a group) as well as T_k (dq), and it starts from the fp32-rounded out and lse
//     of the forward pass. Each adds an error of the forward's size, so 5× the forward bound.
//     (dq and dk use rel_err with a floor for gradients that cancel to ~0: see grad_scales.)
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "reference/reference.hpp"
#include "test_util.hpp"
#include "tokenmix/tokenmix.hpp"

namespace tokenmix::testing {
namespace {

namespace ref = tokenmix::reference;

constexpr double kForwardBound = 2e-5;
constexpr double kBackwardBound = 1e-4;
constexpr double kU = 5.960464477539063e-08;  // 2^-24, fp32 unit roundoff
constexpr double kNegInf = -std::numeric_limits<double>::infinity();
/// Written into the padding of strided outputs: a kernel writing outside its view changes it.
constexpr float kSentinel = 1234.5f;

// ---------------------------------------------------------------------------------------------
// The case table

/// Layouts of the eight tensors of one case, in the order q, k, v, out, dout, dq, dk, dv.
using Layouts = std::array<Layout, 8>;
constexpr Layout kT = Layout::bthd, kH = Layout::bhtd, kS = Layout::strided;
constexpr Layouts all(Layout l) {
  return {l, l, l, l, l, l, l, l};
}
// Three mixes; together with all(·) every tensor sees every layout.
constexpr Layouts kMixA = {kT, kH, kS, kS, kH, kH, kS, kT};
constexpr Layouts kMixB = {kS, kT, kH, kH, kS, kT, kH, kS};
constexpr Layouts kMixC = {kH, kS, kT, kT, kT, kS, kT, kH};

struct Case {
  const char* name;  ///< gtest name suffix
  std::int64_t B, Tq, Tk, Hq, Hkv, D;
  Layouts layouts = all(kT);
  bool causal = true;
  CausalAlign align = CausalAlign::bottom_right;
  std::optional<double> scale = std::nullopt;
  bool backward = true;  ///< also check attention_backward
};

// clang-format off
const Case kCases[] = {
    // Single token: A = [1], out = v. The smallest possible problem.
    {"T1_MHA1_d8", 1, 1, 1, 1, 1, 8},
    // Two tokens, batch 3, SDPA layout everywhere.
    {"T2_B3_MHA4_d64_bhtd", 3, 2, 2, 4, 4, 64, all(kH)},
    // Three tokens, GQA g = 4, odd-ish head width 80, every tensor padded.
    {"T3_GQA8x2_d80_strided", 1, 3, 3, 8, 2, 80, all(kS)},
    // T = 17 (not a multiple of any tile), MQA, mixed layouts, batch 3.
    {"T17_B3_MQA8x1_d128_mixA", 3, 17, 17, 8, 1, 128, kMixA},
    // T = 64, 14 query heads on 2 KV heads (g = 7, as in some production models).
    {"T64_GQA14x2_d64_mixB", 1, 64, 64, 14, 2, 64, kMixB},
    // T = 129 (one past a power of two), GQA, batch 3.
    {"T129_B3_GQA8x2_d8_mixC", 3, 129, 129, 8, 2, 8, kMixC},
    // Widest head.
    {"T64_MHA4_d256_bthd", 1, 64, 64, 4, 4, 256},
    // Long sequence, forward and backward (the reference's cost grows as T^3 here: one case).
    {"T1000_MHA1_d64_mixA", 1, 1000, 1000, 1, 1, 64, kMixA},
    // Decode step: one new query at the end of 129 cached keys (bottom-right → sees all).
    {"decode_Tq1_Tk129_B3_MQA8x1_d128_mixB", 3, 1, 129, 8, 1, 128, kMixB},
    // Decode over a long cache with the widest head.
    {"decode_Tq1_Tk1000_MQA8x1_d256_mixC", 1, 1, 1000, 8, 1, 256, kMixC},
    // Chunked prefill: 17 new queries after 47 cached keys (T_q < T_k, bottom-right).
    {"Tq17_Tk64_GQA8x2_d80_bottomright_mixA", 1, 17, 64, 8, 2, 80, kMixA},
    // T_q < T_k, top-left: query t sees keys 0..t only (the 14 keys past T_q are never seen).
    {"Tq3_Tk17_B3_MHA4_d64_topleft_strided", 3, 3, 17, 4, 4, 64, all(kS), true, CausalAlign::top_left},
    // Few queries over 1000 keys, top-left: rows see 1, 2, 3 keys.
    {"Tq3_Tk1000_MHA1_d8_topleft_bhtd", 1, 3, 1000, 1, 1, 8, all(kH), true, CausalAlign::top_left},
    // T_q > T_k, bottom-right: rows 0..46 see no key (out = 0, lse = −∞, zero dq).
    {"Tq64_Tk17_MQA8x1_d8_bottomright_mixB", 1, 64, 17, 8, 1, 8, kMixB},
    // T_q > T_k, bottom-right, extreme: 998 empty rows, the last two see 1 and 2 keys.
    {"Tq1000_Tk2_MHA4_d8_bottomright_mixC", 1, 1000, 2, 4, 4, 8, kMixC},
    // T_q > T_k, top-left: row t sees min(t + 1, 3) keys; no empty row.
    {"Tq64_Tk3_B3_GQA14x2_d8_topleft_mixA", 3, 64, 3, 14, 2, 8, kMixA, true, CausalAlign::top_left},
    // T_q > T_k by one, bottom-right: exactly one empty row.
    {"Tq3_Tk2_B3_GQA8x2_d64_bottomright_bhtd", 3, 3, 2, 8, 2, 64, all(kH)},
    // Non-causal cross-attention shape (T_q ≠ T_k), batch 3.
    {"noncausal_Tq17_Tk129_B3_MHA4_d128_mixB", 3, 17, 129, 4, 4, 128, kMixB, false},
    // Non-causal square with a small custom scale (softer softmax).
    {"noncausal_T64_GQA8x2_d64_scale005_mixC", 1, 64, 64, 8, 2, 64, kMixC, false,
     CausalAlign::bottom_right, 0.05},
    // Causal with scale 1 (no 1/sqrt(d_h): scores ~ sqrt(80) ≈ 9, a much peakier softmax).
    {"T129_GQA14x2_d80_scale1_strided", 1, 129, 129, 14, 2, 80, all(kS), true,
     CausalAlign::bottom_right, 1.0},
    // Non-causal, T_q > T_k, top-left (alignment must not matter without the mask).
    {"noncausal_Tq17_Tk3_MQA8x1_d80_topleft_bthd", 1, 17, 3, 8, 1, 80, all(kT), false,
     CausalAlign::top_left},
};
// clang-format on

ref::Options ref_options(const Case& c) {
  ref::Options o;
  o.causal = c.causal;
  o.align = c.align == CausalAlign::bottom_right ? ref::Align::bottom_right : ref::Align::top_left;
  o.scale = c.scale;
  return o;
}

AttentionOptions lib_options(const Case& c) {
  AttentionOptions o;
  o.causal = c.causal;
  o.align = c.align;
  o.scale = c.scale;
  return o;
}

// ---------------------------------------------------------------------------------------------
// Running one case

/// A strided output: padding holds kSentinel, logical elements hold kPoison.
StridedTensor make_output(std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t D,
                          Layout l) {
  StridedTensor t(B, T, H, D, l);
  std::fill(t.storage.begin(), t.storage.end(), kSentinel);
  t.poison();
  return t;
}

/// Number of storage entries outside the logical view whose value is no longer kSentinel.
std::int64_t padding_changed(StridedTensor& t) {
  std::vector<char> logical(t.storage.size(), 0);
  t.for_each([&](float& x) { logical[static_cast<std::size_t>(&x - t.storage.data())] = 1; });
  std::int64_t changed = 0;
  for (std::size_t i = 0; i < t.storage.size(); ++i)
    if (!logical[i] && !(t.storage[i] == kSentinel)) ++changed;
  return changed;
}

/// Random inputs for one case and the oracle's results on exactly those (fp32) values.
struct Problem {
  Case c;
  StridedTensor q, k, v, dout;
  Tensor64 q64, k64, v64, dout64;
  ref::ForwardResult fwd;
  ref::BackwardResult bwd;

  Problem(const Case& cs, std::uint64_t seed, double qk_sigma = 1.0)
      : c(cs),
        q(c.B, c.Tq, c.Hq, c.D, c.layouts[0]),
        k(c.B, c.Tk, c.Hkv, c.D, c.layouts[1]),
        v(c.B, c.Tk, c.Hkv, c.D, c.layouts[2]),
        dout(c.B, c.Tq, c.Hq, c.D, c.layouts[4]) {
    std::mt19937_64 rng(seed);
    q.fill_random(rng, qk_sigma);
    k.fill_random(rng, qk_sigma);
    v.fill_random(rng);
    dout.fill_random(rng);
    q64 = q.to64();
    k64 = k.to64();
    v64 = v.to64();
    dout64 = dout.to64();
    fwd = ref::attention_forward(q64, k64, v64, ref_options(c));
    if (c.backward) bwd = ref::attention_backward(q64, k64, v64, dout64, ref_options(c));
  }
};

/// What the library produced for a Problem.
struct LibResult {
  StridedTensor out, dq, dk, dv;
  std::vector<float> lse;  ///< [B, H_q, T_q] contiguous
  explicit LibResult(const Case& c)
      : out(make_output(c.B, c.Tq, c.Hq, c.D, c.layouts[3])),
        dq(make_output(c.B, c.Tq, c.Hq, c.D, c.layouts[5])),
        dk(make_output(c.B, c.Tk, c.Hkv, c.D, c.layouts[6])),
        dv(make_output(c.B, c.Tk, c.Hkv, c.D, c.layouts[7])),
        lse(static_cast<std::size_t>(c.B * c.Hq * c.Tq), kPoison) {}
  TensorView lse_view(const Case& c) { return TensorView::bht(lse.data(), c.B, c.Hq, c.Tq); }
};

/// Runs the library's forward (and backward if the case asks) with outputs poisoned.
LibResult run_library(Problem& p, AttentionOptions o) {
  const Case& c = p.c;
  LibResult r(c);
  attention_forward(p.q.view, p.k.view, p.v.view, r.out.view, r.lse_view(c), o);
  if (c.backward) {
    attention_backward(p.q.view, p.k.view, p.v.view, r.out.view, r.lse_view(c), p.dout.view,
                       r.dq.view, r.dk.view, r.dv.view, o);
  }
  return r;
}

/// rel_err of the lse over the rows whose reference lse is finite; returns +∞ if a row whose
/// reference is −∞ (no visible key) is not exactly −∞ in the library, or if any entry is NaN.
double lse_err(const std::vector<float>& lse, const Tensor64& ref_lse) {
  std::vector<double> got, want;
  for (std::size_t i = 0; i < ref_lse.data.size(); ++i) {
    if (std::isnan(lse[i])) return std::numeric_limits<double>::infinity();
    if (ref_lse.data[i] == kNegInf) {
      if (!(lse[i] == -std::numeric_limits<float>::infinity()))
        return std::numeric_limits<double>::infinity();
      continue;
    }
    got.push_back(lse[i]);
    want.push_back(ref_lse.data[i]);
  }
  return want.empty() ? 0.0 : rel_err_flat(got, want);
}

double scale_of(const Case& c) {
  return c.scale.value_or(1.0 / std::sqrt(static_cast<double>(c.D)));
}

/// max over (b, h, t, u) of |s · ⟨x[b, t, h], y[b, u, j(h)]⟩| with j(h) = h / g, in float64;
/// only over visible pairs when `visible_only`.
double max_abs_pair_dot(const Problem& p, const Tensor64& x, const Tensor64& y, double s,
                        bool visible_only) {
  const Case& c = p.c;
  const std::int64_t g = c.Hq / c.Hkv;
  double m = 0.0;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.Hq; ++h)
      for (std::int64_t t = 0; t < c.Tq; ++t)
        for (std::int64_t u = 0; u < c.Tk; ++u) {
          if (visible_only && !ref::visible(t, u, c.Tq, c.Tk, ref_options(c))) continue;
          double dot = 0.0;
          for (std::int64_t e = 0; e < c.D; ++e) dot += x.at(b, t, h, e) * y.at(b, u, h / g, e);
          m = std::max(m, std::fabs(s * dot));
        }
  return m;
}

/// max |S_tu| over visible pairs (b, h, t, u), from the fp32 inputs (4.2).
double max_abs_score(const Problem& p) {
  return max_abs_pair_dot(p, p.q64, p.k64, scale_of(p.c), true);
}

/// max_{b,h,t,u} |dO_t · V_u| over the head pairs (b, h, j(h)).
double max_abs_dA(const Problem& p) {
  return max_abs_pair_dot(p, p.dout64, p.v64, 1.0, false);
}

double max_abs(const Tensor64& x) {
  double m = 0.0;
  for (double y : x.data) m = std::max(m, std::fabs(y));
  return m;
}

/// max|x − r| / max(max|r|, floor); NaN in x counts as infinite error.
double floored_err(StridedTensor& x, const Tensor64& r, double floor) {
  return rel_err(x, r) * std::max(max_abs(r), 1e-30) / std::max(max_abs(r), floor);
}

bool all_finite(StridedTensor& x) {
  bool ok = true;
  x.for_each([&](float& v) { ok = ok && std::isfinite(v); });
  return ok;
}

/// Error of dq and dk. dq_t = s Σ_u A_tu (dA_tu − D_t) K_u is a sum of terms of size up to
/// N_q = s·max|K|·max|dA| whose exact value can cancel to 0: identically when every row sees
/// one key (A = [1], so dA = D), nearly when the softmax saturates. The fp32 rounding of dA − D
/// is relative to |dA| + |D|, not to the difference, so there the library returns rounding noise
/// of size ~u·N_q where the reference has 0, and plain rel_err would divide by 0. dq's error is
/// therefore max|x − r| / max(max|r|, N_q / 100). In every ordinary case of this file
/// max|dq_ref| ≥ N_q / 50 (printed as max|ref|/N), so the floor does not engage and this is
/// exactly rel_err; it only engages for vanishing gradients. Likewise dk with N_k =
/// s·max|Q|·max|dA|.
struct GradScales {
  double n_q, n_k;  ///< the floors N_q / 100 and N_k / 100
};
GradScales grad_scales(const Problem& p) {
  const double s = std::fabs(scale_of(p.c)), dA = max_abs_dA(p);
  return {s * max_abs(p.k64) * dA / 100, s * max_abs(p.q64) * dA / 100};
}

/// All checks of one case: errors within bounds, rows without keys exactly zero, no writes
/// into padding. `fwd_bound`/`bwd_bound` default to the file-wide bounds.
void check_case(Problem& p, LibResult& r, double fwd_bound = kForwardBound,
                double bwd_bound = kBackwardBound) {
  const Case& c = p.c;
  EXPECT_LT(rel_err(r.out, p.fwd.out), fwd_bound) << "out";
  EXPECT_LT(lse_err(r.lse, p.fwd.lse), fwd_bound) << "lse";
  EXPECT_EQ(padding_changed(r.out), 0) << "forward wrote into the padding of out";

  // Rows that see no key (SPEC 4.3): out exactly 0, lse exactly −∞ (checked in lse_err), dq 0.
  const ref::Options ro = ref_options(c);
  std::int64_t empty_rows = 0;
  for (std::int64_t t = 0; t < c.Tq; ++t) {
    if (c.Tk > 0 && ref::visible(t, 0, c.Tq, c.Tk, ro)) continue;  // key 0 is seen first
    ++empty_rows;
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < c.Hq; ++h)
        for (std::int64_t e = 0; e < c.D; ++e) {
          ASSERT_EQ(r.out.at(b, t, h, e), 0.0f) << "row without keys t=" << t;
          if (c.backward) {
            ASSERT_EQ(r.dq.at(b, t, h, e), 0.0f) << "row without keys t=" << t;
          }
        }
  }
  const bool expect_empty = c.causal && c.align == CausalAlign::bottom_right && c.Tq > c.Tk;
  EXPECT_EQ(empty_rows, expect_empty ? c.Tq - c.Tk : 0);

  if (!c.backward) {
    std::printf("[ info     ] %s: rel_err out %.2g lse %.2g\n", c.name, rel_err(r.out, p.fwd.out),
                lse_err(r.lse, p.fwd.lse));
    return;
  }
  const GradScales n = grad_scales(p);
  const double e_dq = floored_err(r.dq, p.bwd.dq, n.n_q), e_dk = floored_err(r.dk, p.bwd.dk, n.n_k);
  std::printf(
      "[ info     ] %s: rel_err out %.2g lse %.2g dv %.2g dq %.2g dk %.2g (max|ref|/N: %.2g "
      "%.2g)\n",
      c.name, rel_err(r.out, p.fwd.out), lse_err(r.lse, p.fwd.lse), rel_err(r.dv, p.bwd.dv), e_dq,
      e_dk, max_abs(p.bwd.dq) / (100 * n.n_q), max_abs(p.bwd.dk) / (100 * n.n_k));
  EXPECT_LT(e_dq, bwd_bound) << "dq (relative to max(max|dq_ref|, N_q / 100))";
  EXPECT_LT(e_dk, bwd_bound) << "dk (relative to max(max|dk_ref|, N_k / 100))";
  EXPECT_LT(rel_err(r.dv, p.bwd.dv), bwd_bound) << "dv";
  EXPECT_EQ(padding_changed(r.dq) + padding_changed(r.dk) + padding_changed(r.dv), 0)
      << "backward wrote into the padding of dq/dk/dv";
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return info.param.name;
}

// ---------------------------------------------------------------------------------------------
// 1. The table: library vs reference, forward (out, lse) and backward (dq, dk, dv).

class AttentionVsReference : public ::testing::TestWithParam<Case> {};

TEST_P(AttentionVsReference, ForwardAndBackward) {
  Problem p(GetParam(), 0x5eed + static_cast<std::uint64_t>(GetParam().Tq * 7 + GetParam().D));
  LibResult r = run_library(p, lib_options(p.c));
  check_case(p, r);
}

INSTANTIATE_TEST_SUITE_P(Table, AttentionVsReference, ::testing::ValuesIn(kCases), case_name);

// Every axis value the brief lists appears in the table (guards against the table shrinking).
TEST(AttentionTable, CoversEveryAxisValue) {
  auto has = [](auto pred) { return std::any_of(std::begin(kCases), std::end(kCases), pred); };
  for (std::int64_t T : {1, 2, 3, 17, 64, 129, 1000})
    EXPECT_TRUE(has([&](const Case& c) { return c.Tq == T || c.Tk == T; })) << "T=" << T;
  for (std::int64_t D : {8, 64, 80, 128, 256})
    EXPECT_TRUE(has([&](const Case& c) { return c.D == D; })) << "d_h=" << D;
  for (auto heads : {std::pair<int, int>{1, 1}, {4, 4}, {8, 2}, {8, 1}, {14, 2}}) {
    const int hq = heads.first, hkv = heads.second;  // clang 14: lambdas cannot capture bindings
    EXPECT_TRUE(has([&](const Case& c) { return c.Hq == hq && c.Hkv == hkv; })) << hq << "," << hkv;
  }
  for (std::int64_t B : {1, 3}) EXPECT_TRUE(has([&](const Case& c) { return c.B == B; }));
  for (auto align : {CausalAlign::bottom_right, CausalAlign::top_left}) {
    EXPECT_TRUE(has([&](const Case& c) { return c.causal && c.align == align && c.Tq < c.Tk; }));
    EXPECT_TRUE(has([&](const Case& c) { return c.causal && c.align == align && c.Tq > c.Tk; }));
  }
  EXPECT_TRUE(has([](const Case& c) { return !c.causal; }));
  EXPECT_TRUE(has([](const Case& c) { return c.scale.has_value(); }));
  for (std::size_t role = 0; role < 8; ++role)
    for (Layout l : {kT, kH, kS})
      EXPECT_TRUE(has([&](const Case& c) { return c.layouts[role] == l && c.backward; }))
          << "tensor " << role << " layout " << layout_name(l);
}

// ---------------------------------------------------------------------------------------------
// 2. Forward without an lse output (lse is optional in the API).

TEST(Attention, ForwardWithoutLse) {
  Problem p({"no_lse", 3, 17, 17, 8, 2, 64, kMixA, true, CausalAlign::bottom_right, {}, false}, 11);
  StridedTensor out = make_output(3, 17, 8, 64, kS);
  attention_forward(p.q.view, p.k.view, p.v.view, out.view, TensorView{}, AttentionOptions{});
  EXPECT_LT(rel_err(out, p.fwd.out), kForwardBound);
}

// ---------------------------------------------------------------------------------------------
// 3. Results do not depend on the number of threads (AttentionOptions::threads): bitwise.

TEST(Attention, ThreadsGiveBitwiseIdenticalResults) {
  const Case cases[] = {
      // Many (b, h) pairs and rows: work is split across threads in several ways.
      {"threads_T129", 3, 129, 129, 8, 2, 64, all(kT)},
      // One query over 1000 keys: the only parallelism left is over heads or keys.
      {"threads_decode", 1, 1, 1000, 8, 1, 64, all(kT)},
      // GQA with empty rows: dk/dv sum over the group and over rows.
      {"threads_Tq_gt_Tk", 1, 64, 17, 14, 2, 80, all(kT)},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Problem p(c, 21);
    std::vector<LibResult> results;
    for (int threads : {1, 2, 3}) {
      AttentionOptions o = lib_options(c);
      o.threads = threads;
      results.push_back(run_library(p, o));
    }
    check_case(p, results[0]);  // the single-thread result is also correct
    for (std::size_t i = 1; i < results.size(); ++i) {
      SCOPED_TRACE("threads = " + std::to_string(i + 1) + " vs 1");
      auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
        return a.size() == b.size() &&
               std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
      };
      EXPECT_TRUE(same(results[i].out.storage, results[0].out.storage)) << "out";
      EXPECT_TRUE(same(results[i].lse, results[0].lse)) << "lse";
      EXPECT_TRUE(same(results[i].dq.storage, results[0].dq.storage)) << "dq";
      EXPECT_TRUE(same(results[i].dk.storage, results[0].dk.storage)) << "dk";
      EXPECT_TRUE(same(results[i].dv.storage, results[0].dv.storage)) << "dv";
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 4. Large-magnitude inputs: q and k scaled by 100, so scores reach ~1e4. A softmax that does
// not subtract the row maximum overflows (exp(1e4) = inf → NaN); a stable one stays finite.
//
// Bounds. exp(z) has relative condition number |z|: merely rounding a score z to fp32 (or
// multiplying it by s or log2 e, or storing L in fp32 for the backward pass) perturbs the
// exponent by ~u|z|, and a perturbation δ of one row's scores moves that output row by
// Σ_i (Jδ)_i v_i with (Jδ)_i = a_i (δ_i − ⟨a, δ⟩) (4.7), i.e. by at most 2 max|δ| · max|v|. So
// an error proportional to G = u · max|S| is inherent to fp32, whatever the kernel does:
//   out: 2e-5 + 4G (two roundings of z, factor 2 from J)    lse: the usual 2e-5 (relative)
//   dv, dq, dk: 1e-4 + 8G (A enters once more through dS = A ⊙ (dA − D), with L rounded too)
// With max|S| ≈ 5e4, G ≈ 3e-3: for a row with near-tied top scores this error really occurs.
// The failure this test exists for (overflow) gives inf/NaN and fails any bound.
//
// A saturated softmax (a ∈ {0, 1} to within e^{-1000}) has a Jacobian that vanishes, so the
// exact dq and dk are ~0 there: this is where the floor of grad_scales engages.

TEST(Attention, LargeMagnitudeScoresStayFiniteAndAccurate) {
  const Case cases[] = {
      // Causal: early rows have few keys, so near-ties occur and gradients are non-trivial.
      {"large_T64_GQA4x2_d16", 1, 64, 64, 4, 2, 16, kMixA},
      // Non-causal, T_q < T_k: every row is saturated (one key dominates by ≫ 100).
      {"large_Tq17_Tk64_B3_MHA4_d64_noncausal", 3, 17, 64, 4, 4, 64, kMixB, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Problem p(c, 31, /*qk_sigma=*/100.0);
    const double smax = max_abs_score(p);
    ASSERT_GT(smax, 5e3);  // the test is about large scores: make sure they are
    const double G = kU * smax;
    LibResult r = run_library(p, lib_options(c));
    for (float x : r.lse) ASSERT_TRUE(std::isfinite(x));
    ASSERT_TRUE(all_finite(r.out) && all_finite(r.dq) && all_finite(r.dk) && all_finite(r.dv));
    EXPECT_LT(rel_err(r.out, p.fwd.out), kForwardBound + 4 * G) << "out";
    EXPECT_LT(lse_err(r.lse, p.fwd.lse), kForwardBound) << "lse";
    EXPECT_LT(rel_err(r.dv, p.bwd.dv), kBackwardBound + 8 * G) << "dv";
    const GradScales n = grad_scales(p);
    EXPECT_LT(floored_err(r.dq, p.bwd.dq, n.n_q), kBackwardBound + 8 * G) << "dq";
    EXPECT_LT(floored_err(r.dk, p.bwd.dk, n.n_k), kBackwardBound + 8 * G) << "dk";
    std::printf(
        "[ info     ] %s: max|S| = %.3g, G = %.2g; errors out %.2g, dq %.2g, dk %.2g, dv %.2g\n",
        c.name, smax, G, rel_err(r.out, p.fwd.out), floored_err(r.dq, p.bwd.dq, n.n_q),
        floored_err(r.dk, p.bwd.dk, n.n_k), rel_err(r.dv, p.bwd.dv));
  }
}

// ---------------------------------------------------------------------------------------------
// 5. Finite-difference gradient check: central differences of the *reference forward* (float64)
// of loss = Σ dout ⊙ out, against the library's fp32 backward. Independent of the reference
// backward. FD error with h = 1e-5 in double is ≲ 1e-9 relative (truncation h², rounding
// u/h), negligible next to the fp32 error of the library, so the backward bound applies.

TEST(Attention, BackwardMatchesFiniteDifferencesOfReferenceForward) {
  const Case cases[] = {
      {"fd_square_MHA", 1, 4, 4, 2, 2, 8, all(kT)},
      {"fd_GQA_Tq_lt_Tk_bottomright", 2, 3, 6, 4, 2, 8, kMixA},
      {"fd_MQA_Tq_gt_Tk_bottomright", 1, 5, 3, 3, 1, 8, kMixB},
      {"fd_GQA_Tq_gt_Tk_topleft", 1, 5, 3, 4, 2, 8, kMixC, true, CausalAlign::top_left},
      {"fd_noncausal_scale", 1, 3, 4, 2, 1, 8, all(kS), false, CausalAlign::bottom_right, 0.6},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Problem p(c, 41);
    LibResult r = run_library(p, lib_options(c));
    const ref::Options ro = ref_options(c);
    auto loss = [&] { return testkit::attention_loss(p.q64, p.k64, p.v64, p.dout64, ro); };
    auto fd = [&](Tensor64& x) { return testkit::central_differences(x, loss, 1e-5); };
    EXPECT_LT(rel_err(r.dq, fd(p.q64)), kBackwardBound) << "dq";
    EXPECT_LT(rel_err(r.dk, fd(p.k64)), kBackwardBound) << "dk";
    EXPECT_LT(rel_err(r.dv, fd(p.v64)), kBackwardBound) << "dv";
  }
}

// ---------------------------------------------------------------------------------------------
// 6. Each kernel path forced in turn (AttentionOptions::isa). Parameterised over every concrete
// Isa so each shows up by name; a path this CPU cannot run is reported as skipped with the
// reason (and forcing it must throw UnsupportedError, not crash).

// Not PerIsaTest: before skipping, an unavailable path must be refused with UnsupportedError.
class AttentionPerIsa : public ::testing::TestWithParam<Isa> {};

TEST_P(AttentionPerIsa, MatchesReference) {
  const Isa isa = GetParam();
  if (const std::string why = testkit::isa_unavailable_reason(isa); !why.empty()) {
    Problem p({"unavailable", 1, 2, 2, 1, 1, 8}, 51);
    AttentionOptions o;
    o.isa = isa;
    EXPECT_THROW(run_library(p, o), UnsupportedError);
    GTEST_SKIP() << why;
  }
  const Case cases[] = {
      {"isa_T17_B3_GQA8x2_d80", 3, 17, 17, 8, 2, 80, kMixA},
      {"isa_Tq64_Tk17_MQA8x1_d64_empty_rows", 1, 64, 17, 8, 1, 64, kMixB},
      {"isa_Tq3_Tk129_MHA4_d128_topleft", 1, 3, 129, 4, 4, 128, kMixC, true, CausalAlign::top_left},
      {"isa_noncausal_T64_MHA1_d256_scale", 1, 64, 64, 1, 1, 256, all(kS), false,
       CausalAlign::bottom_right, 0.1},
      {"isa_T1_B3_GQA14x2_d8", 3, 1, 1, 14, 2, 8, all(kH)},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Problem p(c, 61);
    AttentionOptions o = lib_options(c);
    o.isa = isa;
    LibResult r = run_library(p, o);
    check_case(p, r);
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, AttentionPerIsa, AllIsas(), IsaName);

// A batch of 2^31 − 1 sequences with no positions (fuzz_api finding): every tensor has zero
// elements, so the backward has nothing to write and must return at once (it used to share out
// 2^31 empty (b, KV head) units), with the sinks' gradient zero (SPEC "Score variants": no row).
// The forward of the same shapes returns at once too. (d_h = 0 is an ArgumentError.)
TEST(Attention, EmptyTensorsWithHugeBatchReturnAtOnce) {
  const std::int64_t B = (std::int64_t{1} << 31) - 1;
  float buf[4] = {1.0f, 2.0f, 3.0f, 4.0f};
  {
    const std::int64_t T = 0, D = 4;
    auto view = [&](std::int64_t H) -> TensorView {
      return {buf, DType::f32, 4, {B, T, H, D}, {4, 4, 4, 1}};
    };
    const TensorView lse{buf, DType::f32, 3, {B, 2, T, 0}, {4, 4, 1, 0}};
    float dsinks[2] = {kPoison, kPoison};
    const float sinks[2] = {0.5f, -1.0f};
    AttentionOptions o;
    o.causal = true;
    o.sinks = {sinks, DType::f32, 1, {2, 0, 0, 0}, {1, 0, 0, 0}};
    const auto t0 = std::chrono::steady_clock::now();
    attention_forward(view(2), view(1), view(1), view(2), lse, o);
    attention_backward(view(2), view(1), view(1), view(2), lse, view(2), view(2), view(1), view(1),
                       o, {dsinks, DType::f32, 1, {2, 0, 0, 0}, {1, 0, 0, 0}});
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_LT(s, 5.0);  // (it took minutes: 2^31 units)
    EXPECT_EQ(dsinks[0], 0.0f);
    EXPECT_EQ(dsinks[1], 0.0f);
    EXPECT_EQ(buf[0], 1.0f);  // nothing written into the zero-element views
  }
}

}  // namespace
}  // namespace tokenmix::testing
