// tests/unit/test_variant_kernels.cpp — the score variants (SPEC "Score variants used by real
// models") in the forward and backward kernels, called directly through the registry (kernel
// level: the API's validation and conversion are tested in test_variants.cpp), on every path
// this machine runs — the fused SIMD kernels above all, and portable — against the float64
// oracle.
//
// Each variant alone and all combined — sliding window W ∈ {1, 5, 64, 100}, soft-capping, ALiBi,
// sinks, key lengths, interval-shaped masks (AttentionProblem's row intervals), general boolean
// and bias masks, dense and broadcast (stride 0) — over shapes that straddle the key tile (64)
// and the lane blocks (M = 64 rows on AVX-512, 24 on AVX2), GQA g ∈ {1, 4, 7}, odd d_h, both
// alignments, T_q ≠ T_k both ways, causal or not, strided views, the backward with one and with
// several query ranges; and a NaN in a key a row does not see (outside its window, masked out) that
// must not reach it. Bounds as in test_flash_kernels.cpp (forward 2e-5, backward 1e-4 with the
// gradient floor): a wrong range, a missing term or a wrong chain rule gives errors ≥ 1e-3.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "dispatch/registry.hpp"
#include "kernels/attention_kernels.hpp"
#include "reference/reference.hpp"
#include "test_util.hpp"

namespace tokenmix::testing {
namespace {

using kernels::MaskKind;

constexpr double kFwdBound = 2e-5;
constexpr double kBwdBound = 1e-4;

struct Shape {
  std::int64_t B, Tq, Tk, Hq, Hkv, D;
  bool causal = true;
  CausalAlign align = CausalAlign::bottom_right;
  Layout layout = Layout::bthd;
};

struct Variant {
  std::string name;
  std::int64_t window = 0;
  float softcap = 0.0f;
  bool alibi = false, sinks = false, key_lengths = false, intervals = false;
  MaskKind mask = MaskKind::none;
  bool broadcast = false;  // mask [T_q, T_k] with stride 0 over batch and heads
};

std::string shape_name(const Shape& s) {
  std::ostringstream o;
  o << "B" << s.B << "_Tq" << s.Tq << "_Tk" << s.Tk << "_Hq" << s.Hq << "_Hkv" << s.Hkv << "_d"
    << s.D << (s.causal ? "" : "_noncausal") << (s.align == CausalAlign::top_left ? "_topleft" : "")
    << "_" << layout_name(s.layout);
  return o.str();
}

kernels::In in_of(const StridedTensor& x) {
  const auto& st = x.view.strides;
  return {static_cast<const float*>(x.view.data), st[0], st[1], st[2], st[3]};
}
kernels::Out out_of(StridedTensor& x) {
  const auto& st = x.view.strides;
  return {static_cast<float*>(x.view.data), st[0], st[1], st[2], st[3]};
}

// One problem with its variant data, in both forms: the kernels' ScoreVariants and the oracle's
// Options (dense masks).
struct Problem {
  Shape s;
  Variant v;
  std::vector<float> alibi, sinks, bias;
  std::vector<std::uint8_t> keep;
  std::vector<std::int64_t> lengths, row_begin, row_end;
  kernels::AttentionProblem p;
  reference::Options o;

  Problem(const Shape& shape, const Variant& var, std::mt19937_64& rng) : s(shape), v(var) {
    const std::int64_t B = s.B, Hq = s.Hq, Tq = s.Tq, Tk = s.Tk;
    p.batch = B;
    p.tq = Tq;
    p.tk = Tk;
    p.hq = Hq;
    p.hkv = s.Hkv;
    p.dh = s.D;
    p.scale = 1.0f / std::sqrt(static_cast<float>(s.D));
    p.causal = s.causal;
    p.align = s.align;
    p.threads = 3;
    o.scale = p.scale;
    o.causal = s.causal;
    o.align = s.align == CausalAlign::bottom_right ? reference::Align::bottom_right
                                                   : reference::Align::top_left;
    std::uniform_real_distribution<float> unit(0.0f, 1.0f);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    if (v.window > 0) {
      p.var.window = v.window;
      o.window = v.window;
    }
    if (v.softcap > 0.0f) {
      p.var.softcap = v.softcap;
      o.softcap = v.softcap;
    }
    if (v.alibi) {
      for (std::int64_t h = 0; h < Hq; ++h) alibi.push_back(0.02f + 0.3f * unit(rng));
      p.var.alibi = alibi.data();
      o.alibi_slopes.assign(alibi.begin(), alibi.end());
    }
    if (v.sinks) {
      for (std::int64_t h = 0; h < Hq; ++h) sinks.push_back(1.5f * normal(rng));
      p.var.sinks = sinks.data();
      o.sinks.assign(sinks.begin(), sinks.end());
    }
    if (v.key_lengths) {
      std::uniform_int_distribution<std::int64_t> len(0, Tk);
      for (std::int64_t b = 0; b < B; ++b) lengths.push_back(b == 0 ? Tk - Tk / 3 : len(rng));
      p.var.key_lengths = lengths.data();
      o.key_lengths = lengths;
    }
    const std::int64_t full = B * Hq * Tq * Tk;
    std::vector<std::uint8_t> dense_keep;  // the oracle's boolean mask (intervals ∧ mask)
    if (v.intervals) {  // one interval per (head, row), broadcast over the batch (r0 = 0)
      std::uniform_int_distribution<std::int64_t> pos(0, Tk);
      for (std::int64_t i = 0; i < Hq * Tq; ++i) {
        std::int64_t a = pos(rng), e = pos(rng);
        if (a > e) std::swap(a, e);
        row_begin.push_back(a);
        row_end.push_back(e);
      }
      p.var.row_begin = row_begin.data();
      p.var.row_end = row_end.data();
      p.var.r0 = 0;
      p.var.r1 = Tq;
      p.var.r2 = 1;
      dense_keep.assign(static_cast<std::size_t>(full), 1);
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t h = 0; h < Hq; ++h)
          for (std::int64_t t = 0; t < Tq; ++t)
            for (std::int64_t u = 0; u < Tk; ++u) {
              const auto i = static_cast<std::size_t>(h * Tq + t);
              dense_keep[static_cast<std::size_t>(((b * Hq + h) * Tq + t) * Tk + u)] =
                  u >= row_begin[i] && u < row_end[i];
            }
    }
    if (v.mask != MaskKind::none) {
      // Stored [B][H_q][T_q][T_k], or [T_q][T_k] broadcast; the keys along u with stride m3.
      const std::int64_t n = v.broadcast ? Tq * Tk : full;
      p.var.m3 = 1;
      p.var.m2 = Tk;
      p.var.m1 = v.broadcast ? 0 : Tq * Tk;
      p.var.m0 = v.broadcast ? 0 : Hq * Tq * Tk;
      p.var.mask_kind = v.mask;
      if (v.mask == MaskKind::boolean) {
        for (std::int64_t i = 0; i < n; ++i) keep.push_back(unit(rng) < 0.7f);
        p.var.mask = keep.data();
        if (dense_keep.empty()) dense_keep.assign(static_cast<std::size_t>(full), 1);
      } else {
        for (std::int64_t i = 0; i < n; ++i) bias.push_back(normal(rng));
        p.var.mask = bias.data();
        o.mask_bias.resize(static_cast<std::size_t>(full));
      }
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t h = 0; h < Hq; ++h)
          for (std::int64_t t = 0; t < Tq; ++t)
            for (std::int64_t u = 0; u < Tk; ++u) {
              const auto at = static_cast<std::size_t>(p.mask_offset(b, h, t, u));
              const auto i = static_cast<std::size_t>(((b * Hq + h) * Tq + t) * Tk + u);
              if (v.mask == MaskKind::boolean) {
                dense_keep[i] = dense_keep[i] && keep[at] != 0;
              } else {
                o.mask_bias[i] = bias[at];
              }
            }
    }
    o.mask_bool = dense_keep;
  }

  /// True if row (b, h, t) sees key u (key range and boolean mask).
  bool sees(std::int64_t b, std::int64_t h, std::int64_t t, std::int64_t u) const {
    const kernels::KeyRange r = p.key_range(b, h, t);
    if (u < r.begin || u >= r.end) return false;
    return p.var.mask_kind != MaskKind::boolean ||
           keep[static_cast<std::size_t>(p.mask_offset(b, h, t, u))] != 0;
  }
};

class VariantKernels : public PerIsaTest {};

struct KernelRun {
  StridedTensor q, k, v, out, dout, dq, dk, dv;
  std::vector<float> lse;
  explicit KernelRun(const Shape& s)
      : q(s.B, s.Tq, s.Hq, s.D, s.layout),
        k(s.B, s.Tk, s.Hkv, s.D, s.layout),
        v(s.B, s.Tk, s.Hkv, s.D, s.layout),
        out(s.B, s.Tq, s.Hq, s.D, s.layout),
        dout(s.B, s.Tq, s.Hq, s.D, s.layout),
        dq(s.B, s.Tq, s.Hq, s.D, s.layout),
        dk(s.B, s.Tk, s.Hkv, s.D, s.layout),
        dv(s.B, s.Tk, s.Hkv, s.D, s.layout),
        lse(static_cast<std::size_t>(s.B * s.Hq * s.Tq), kPoison) {}
  void fill(std::mt19937_64& rng) {
    q.fill_random(rng);
    k.fill_random(rng);
    v.fill_random(rng);
    dout.fill_random(rng);
  }
  kernels::Out lse_out(const Shape& s) { return {lse.data(), s.Hq * s.Tq, s.Tq, 1, 0}; }
  void forward(const Problem& pr, Isa isa) {
    out.poison();
    std::fill(lse.begin(), lse.end(), kPoison);
    kernels::ForwardArgs a;
    a.p = pr.p;
    a.q = in_of(q);
    a.k = in_of(k);
    a.v = in_of(v);
    a.out = out_of(out);
    a.lse = lse_out(pr.s);
    kernels::kernel_set(isa).forward[0].fn(a);
  }
  void backward(const Problem& pr, Isa isa) {
    dq.poison();
    dk.poison();
    dv.poison();
    kernels::BackwardArgs a;
    a.p = pr.p;
    a.q = in_of(q);
    a.k = in_of(k);
    a.v = in_of(v);
    a.out = in_of(out);
    const kernels::Out l = lse_out(pr.s);
    a.lse = {l.data, l.s0, l.s1, l.s2, 0};
    a.dout = in_of(dout);
    a.dq = out_of(dq);
    a.dk = out_of(dk);
    a.dv = out_of(dv);
    kernels::kernel_set(isa).backward[0].fn(a);
  }
  float lse_at(const Shape& s, std::int64_t b, std::int64_t h, std::int64_t t) const {
    return lse[static_cast<std::size_t>((b * s.Hq + h) * s.Tq + t)];
  }
};

// Forward (O and L) and backward (dQ, dK, dV) of one problem on `isa` against the oracle.
void ExpectMatchesOracle(const Shape& s, const Variant& var, Isa isa, std::mt19937_64& rng) {
  SCOPED_TRACE(var.name + " " + shape_name(s));
  const Problem pr(s, var, rng);
  KernelRun r(s);
  r.fill(rng);
  r.forward(pr, isa);
  const auto ref = reference::attention_forward(r.q.to64(), r.k.to64(), r.v.to64(), pr.o);
  EXPECT_LE(rel_err(r.out, ref.out), kFwdBound) << "out";
  double lse_err = 0.0;
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t h = 0; h < s.Hq; ++h)
      for (std::int64_t t = 0; t < s.Tq; ++t) {
        const double x = r.lse_at(s, b, h, t), want = ref.lse.at(b, h, t, 0);
        if (std::isinf(want)) {
          ASSERT_TRUE(std::isinf(x) && x < 0) << "L of row b=" << b << " h=" << h << " t=" << t;
        } else {
          ASSERT_TRUE(std::isfinite(x)) << "L of row b=" << b << " h=" << h << " t=" << t;
          lse_err = std::max(lse_err, std::fabs(x - want) / std::max(1.0, std::fabs(want)));
        }
      }
  EXPECT_LE(lse_err, kFwdBound) << "lse";

  r.backward(pr, isa);
  const auto g =
      reference::attention_backward(r.q.to64(), r.k.to64(), r.v.to64(), r.dout.to64(), pr.o);
  const double floor = max_abs(r.dout) * max_abs(r.v) / std::sqrt(static_cast<double>(s.D));
  EXPECT_LE(rel_err(r.dq, g.dq, floor), kBwdBound) << "dq";
  EXPECT_LE(rel_err(r.dk, g.dk, floor), kBwdBound) << "dk";
  EXPECT_LE(rel_err(r.dv, g.dv, floor), kBwdBound) << "dv";
}

std::vector<Variant> single_variants() {
  std::vector<Variant> out;
  for (std::int64_t w : {1, 5, 64, 100}) out.push_back({"window" + std::to_string(w), w});
  Variant v;
  v = {"softcap"};
  v.softcap = 2.0f;  // strong: |z| reaches a few times c
  out.push_back(v);
  v = {"alibi"};
  v.alibi = true;
  out.push_back(v);
  v = {"sinks"};
  v.sinks = true;
  out.push_back(v);
  v = {"key_lengths"};
  v.key_lengths = true;
  out.push_back(v);
  v = {"intervals"};
  v.intervals = true;
  out.push_back(v);
  v = {"mask_bool"};
  v.mask = MaskKind::boolean;
  out.push_back(v);
  v = {"mask_bool_broadcast"};
  v.mask = MaskKind::boolean;
  v.broadcast = true;
  out.push_back(v);
  v = {"mask_bias"};
  v.mask = MaskKind::bias;
  out.push_back(v);
  v = {"mask_bias_broadcast"};
  v.mask = MaskKind::bias;
  v.broadcast = true;
  out.push_back(v);
  return out;
}

std::vector<Variant> combined_variants() {
  Variant a{"window+softcap+alibi+sinks+key_lengths", 37};
  a.softcap = 5.0f;
  a.alibi = a.sinks = a.key_lengths = true;
  Variant b{"window+sinks+mask_bool+intervals", 20};
  b.sinks = b.intervals = true;
  b.mask = MaskKind::boolean;
  Variant c{"softcap+alibi+mask_bias_broadcast+key_lengths"};
  c.softcap = 3.0f;
  c.alibi = c.key_lengths = true;
  c.mask = MaskKind::bias;
  c.broadcast = true;
  Variant d{"window+softcap+mask_bool_broadcast+sinks", 5};
  d.softcap = 4.0f;
  d.sinks = true;
  d.mask = MaskKind::boolean;
  d.broadcast = true;
  return {a, b, c, d};
}

// Every variant alone over T ∈ {1, 23, 24, 25, 63, 64, 65, 129} (g = 4: AVX2's 24 lanes hold 6
// positions, AVX-512's 64 hold 16), T_q = T_k.
TEST_P(VariantKernels, EachVariantAcrossTileEdges) {
  std::mt19937_64 rng(912);
  for (const Variant& v : single_variants())
    for (std::int64_t T : {1, 23, 24, 25, 63, 64, 65, 129})
      ExpectMatchesOracle({1, T, T, 4, 1, 16}, v, GetParam(), rng);
}

// Each variant and the combinations over GQA g ∈ {1, 4, 7}, odd d_h, T_q ≠ T_k both ways, both
// alignments, non-causal, strided views, and the one-pass backward (B·H_kv ≥ 8).
TEST_P(VariantKernels, VariantsAcrossShapesAndAlignments) {
  std::mt19937_64 rng(913);
  const std::vector<Shape> shapes = {
      {2, 70, 70, 3, 3, 17},                                // g = 1, odd d_h
      {1, 33, 97, 7, 1, 5},                                 // g = 7, T_q < T_k
      {2, 100, 40, 8, 2, 16},                               // T_q > T_k: empty rows
      {1, 40, 100, 8, 2, 16, true, CausalAlign::top_left},  // top-left, T_q < T_k
      {2, 100, 40, 8, 2, 16, true, CausalAlign::top_left},  // top-left, T_q > T_k
      {1, 65, 129, 4, 1, 24, false},                        // non-causal
      {2, 70, 90, 8, 4, 20},                                // one-pass backward
      {2, 65, 65, 28, 4, 9, false},                         // one-pass, g = 7
      {1, 65, 65, 8, 2, 32, true, CausalAlign::bottom_right, Layout::bhtd},
      {2, 31, 97, 8, 2, 40, true, CausalAlign::bottom_right, Layout::strided},
  };
  std::vector<Variant> variants = single_variants();
  for (const Variant& v : combined_variants()) variants.push_back(v);
  for (const Shape& s : shapes)
    for (const Variant& v : variants) ExpectMatchesOracle(s, v, GetParam(), rng);
}

// A sliding window at T = 300, W = 40, one and several query ranges, combined with everything else.
TEST_P(VariantKernels, LongSlidingWindow) {
  std::mt19937_64 rng(914);
  for (const Variant& v : combined_variants()) {
    Variant w = v;
    w.window = 40;
    ExpectMatchesOracle({1, 300, 300, 4, 2, 16}, w, GetParam(), rng);
    ExpectMatchesOracle({2, 200, 300, 8, 4, 16}, w, GetParam(), rng);
  }
}

// A row with a sink and no visible key gives O = 0 and L = σ_h exactly (SPEC "sinks"), and
// its gradients are zero.
TEST_P(VariantKernels, SinkRowWithoutKeysGivesZeroAndSigma) {
  std::mt19937_64 rng(915);
  const Shape s{2, 50, 20, 4, 2, 16};  // bottom-right: rows t < 30 see no key
  Variant v{"sinks+key_lengths"};
  v.sinks = v.key_lengths = true;
  const Problem pr(s, v, rng);
  KernelRun r(s);
  r.fill(rng);
  r.forward(pr, GetParam());
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t h = 0; h < s.Hq; ++h)
      for (std::int64_t t = 0; t < s.Tq; ++t) {
        const kernels::KeyRange kr = pr.p.key_range(b, h, t);
        if (kr.end > kr.begin) continue;
        EXPECT_EQ(r.lse_at(s, b, h, t), pr.sinks[static_cast<std::size_t>(h)]);
        for (std::int64_t x = 0; x < s.D; ++x) EXPECT_EQ(r.out.at(b, t, h, x), 0.0f);
      }
}

// NaN in K and V of one key: rows that do not see it (outside their window or key range,
// excluded by the boolean mask) match the oracle run on clean inputs; rows that see it are NaN.
TEST_P(VariantKernels, NaNInUnseenKeyDoesNotLeak) {
  std::mt19937_64 rng(916);
  Variant w{"window", 9};
  Variant m{"mask_bool"};
  m.mask = MaskKind::boolean;
  Variant wm{"window+mask_bool_broadcast+softcap+alibi+sinks", 30};
  wm.mask = MaskKind::boolean;
  wm.broadcast = true;
  wm.softcap = 3.0f;
  wm.alibi = wm.sinks = true;
  for (const Variant& v : {w, m, wm})
    for (const Shape& s : {Shape{1, 130, 130, 4, 1, 16}, Shape{2, 70, 90, 8, 4, 16}}) {
      SCOPED_TRACE(v.name + " " + shape_name(s));
      const Problem pr(s, v, rng);
      KernelRun r(s);
      r.fill(rng);
      const auto ref = reference::attention_forward(r.q.to64(), r.k.to64(), r.v.to64(), pr.o);
      const auto gref =
          reference::attention_backward(r.q.to64(), r.k.to64(), r.v.to64(), r.dout.to64(), pr.o);
      const std::int64_t bad = 20;  // key position poisoned in every (b, KV head)
      const float nan = std::numeric_limits<float>::quiet_NaN();
      for (std::int64_t b = 0; b < s.B; ++b)
        for (std::int64_t j = 0; j < s.Hkv; ++j)
          for (std::int64_t x = 0; x < s.D; ++x) r.k.at(b, bad, j, x) = r.v.at(b, bad, j, x) = nan;
      r.forward(pr, GetParam());
      r.backward(pr, GetParam());
      std::int64_t clean_rows = 0;
      for (std::int64_t b = 0; b < s.B; ++b)
        for (std::int64_t h = 0; h < s.Hq; ++h)
          for (std::int64_t t = 0; t < s.Tq; ++t) {
            if (pr.sees(b, h, t, bad)) {
              EXPECT_TRUE(std::isnan(r.out.at(b, t, h, 0)))
                  << "b=" << b << " h=" << h << " t=" << t;
              continue;
            }
            ++clean_rows;
            // max that keeps a NaN (std::max would drop it)
            const auto worst = [](double& m, double x) {
              if (std::isnan(x) || x > m) m = x;
            };
            double err = 0.0, size = 1e-30, gerr = 0.0, gsize = 1e-30;
            for (std::int64_t x = 0; x < s.D; ++x) {
              worst(err, std::fabs(r.out.at(b, t, h, x) - ref.out.at(b, t, h, x)));
              worst(size, std::fabs(ref.out.at(b, t, h, x)));
              worst(gerr, std::fabs(r.dq.at(b, t, h, x) - gref.dq.at(b, t, h, x)));
              worst(gsize, std::fabs(gref.dq.at(b, t, h, x)));
            }
            ASSERT_LE(err / std::max(size, 1e-3), 1e-4)
                << "O of b=" << b << " h=" << h << " t=" << t;
            ASSERT_LE(gerr / std::max(gsize, 1e-2), 1e-3)
                << "dQ of b=" << b << " h=" << h << " t=" << t;
          }
      EXPECT_GT(clean_rows, 0);
    }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, VariantKernels, AllIsas(), IsaName);

}  // namespace
}  // namespace tokenmix::testing
