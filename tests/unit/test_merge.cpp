// tests/unit/test_merge.cpp — merging partial attentions over disjoint key sets (SPEC "Merging
// partial results"): L = log(e^{L¹} + e^{L²}), O = e^{L¹−L} O¹ + e^{L²−L} O².
//
// Bounds (u = 2^-24): a partial attention from attention_forward carries the kernel's error — the
// d_h-term dot products (γ_{d_h}), exp, and the T_k-term weighted sum (γ_{T_k}) — at most about
// (d_h + T_k + 10)·u ≈ 50u = 3e-6 for the sizes here; the merge adds exp/log and two products
// (≈ 8u). kAttentionBound = 1e-5 ≈ 170u keeps a factor ~3 over that. Merging exactly-given parts
// (the oracle's, rounded to fp32) is checked at 32u.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "test_util.hpp"

namespace tokenmix::testing {
namespace {

constexpr double kU = 0x1p-24;
constexpr double kAttentionBound = 1e-5;
constexpr float kInf = std::numeric_limits<float>::infinity();

/// Keys [t0, t0 + len) of a [B, T, H, D] view: same strides, shifted pointer (no copy).
ConstTensorView slice_t(const TensorView& v, std::int64_t t0, std::int64_t len) {
  ConstTensorView s = v;
  s.data = static_cast<const float*>(v.data) + t0 * v.strides[1];
  s.shape[1] = len;
  return s;
}

/// A row log-sum-exp buffer [B, H, T] (contiguous).
struct Lse {
  std::int64_t B, H, T;
  std::vector<float> data;
  Lse(std::int64_t b, std::int64_t h, std::int64_t t)
      : B(b), H(h), T(t), data(static_cast<std::size_t>(b * h * t), kPoison) {}
  TensorView view() { return TensorView::bht(data.data(), B, H, T); }
  float& at(std::int64_t b, std::int64_t h, std::int64_t t) { return data[(b * H + h) * T + t]; }
};

/// max |L − L_ref| over rows, each scaled by max(1, |L_ref|); −∞ must match exactly.
double lse_err(Lse& l, const Tensor64& ref) {
  double worst = 0.0;
  for (std::int64_t b = 0; b < l.B; ++b)
    for (std::int64_t h = 0; h < l.H; ++h)
      for (std::int64_t t = 0; t < l.T; ++t) {
        const double x = l.at(b, h, t), r = ref.at(b, h, t, 0);
        if (std::isinf(r) && r < 0) {
          if (!(std::isinf(x) && x < 0)) return std::numeric_limits<double>::infinity();
          continue;
        }
        if (std::isnan(x)) return std::numeric_limits<double>::infinity();
        worst = std::max(worst, std::fabs(x - r) / std::max(1.0, std::fabs(r)));
      }
  return worst;
}

reference::Options ref_options(bool causal, CausalAlign align) {
  reference::Options o;
  o.causal = causal;
  o.align = align == CausalAlign::bottom_right ? reference::Align::bottom_right
                                               : reference::Align::top_left;
  return o;
}

struct Problem {
  std::int64_t B = 2, Tq = 6, Tk = 20, Hq = 4, Hkv = 2, D = 16;
};

TEST(Merge, TwoKeySplitsEqualWholeAttention) {
  std::mt19937_64 rng(31);
  const Problem p;
  for (Layout layout : {Layout::bthd, Layout::bhtd, Layout::strided}) {
    for (std::int64_t split : {1, 7, 19}) {
      SCOPED_TRACE(::testing::Message() << layout_name(layout) << " split=" << split);
      StridedTensor q(p.B, p.Tq, p.Hq, p.D, layout), k(p.B, p.Tk, p.Hkv, p.D, layout),
          v(p.B, p.Tk, p.Hkv, p.D, layout);
      q.fill_random(rng), k.fill_random(rng), v.fill_random(rng);
      // Non-causal attention of all queries over keys [0, split) and [split, T_k).
      AttentionOptions opt;
      opt.causal = false;
      StridedTensor o1(p.B, p.Tq, p.Hq, p.D, layout), o2(p.B, p.Tq, p.Hq, p.D, layout);
      Lse l1(p.B, p.Hq, p.Tq), l2(p.B, p.Hq, p.Tq);
      attention_forward(q.view, slice_t(k.view, 0, split), slice_t(v.view, 0, split), o1.view,
                        l1.view(), opt);
      attention_forward(q.view, slice_t(k.view, split, p.Tk - split),
                        slice_t(v.view, split, p.Tk - split), o2.view, l2.view(), opt);
      StridedTensor out(p.B, p.Tq, p.Hq, p.D, layout);
      Lse l(p.B, p.Hq, p.Tq);
      merge_partials(o1.view, l1.view(), o2.view, l2.view(), out.view, l.view());
      const auto whole = reference::attention_forward(
          q.to64(), k.to64(), v.to64(), ref_options(false, CausalAlign::bottom_right));
      EXPECT_LE(rel_err(out, whole.out), kAttentionBound);
      EXPECT_LE(lse_err(l, whole.lse), kAttentionBound);
    }
  }
}

TEST(Merge, CausalSplitWithEmptyRowsEqualsWhole) {
  // Causal self-attention (T_q = T_k = T) with keys split at P. Keys [0, P) are at their own
  // positions, so query t sees u ≤ t: top-left alignment. Keys [P, T) have global index P + u',
  // visible if P + u' ≤ t, i.e. u' ≤ t + (T_k' − T_q) with T_k' = T − P: bottom-right (SPEC 4.3);
  // queries t < P see none of them and get O = 0, L = −∞ in that part — an empty part per row.
  std::mt19937_64 rng(32);
  const std::int64_t B = 2, T = 10, H = 3, D = 8;
  for (std::int64_t P : {1, 4, 9}) {
    SCOPED_TRACE(::testing::Message() << "P=" << P);
    StridedTensor q(B, T, H, D, Layout::bthd), k(B, T, H, D, Layout::bthd),
        v(B, T, H, D, Layout::bthd);
    q.fill_random(rng), k.fill_random(rng), v.fill_random(rng);
    StridedTensor o1(B, T, H, D, Layout::bthd), o2(B, T, H, D, Layout::bthd);
    Lse l1(B, H, T), l2(B, H, T);
    AttentionOptions top_left, bottom_right;
    top_left.align = CausalAlign::top_left;
    attention_forward(q.view, slice_t(k.view, 0, P), slice_t(v.view, 0, P), o1.view, l1.view(),
                      top_left);
    attention_forward(q.view, slice_t(k.view, P, T - P), slice_t(v.view, P, T - P), o2.view,
                      l2.view(), bottom_right);
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t t = 0; t < P; ++t) {
          EXPECT_TRUE(std::isinf(l2.at(b, h, t)) && l2.at(b, h, t) < 0) << "row " << t;
          for (std::int64_t d = 0; d < D; ++d) EXPECT_EQ(o2.at(b, t, h, d), 0.0f);
        }
    StridedTensor out(B, T, H, D, Layout::bthd);
    Lse l(B, H, T);
    merge_partials(o1.view, l1.view(), o2.view, l2.view(), out.view, l.view());
    const auto whole = reference::attention_forward(q.to64(), k.to64(), v.to64(),
                                                    ref_options(true, CausalAlign::bottom_right));
    EXPECT_LE(rel_err(out, whole.out), kAttentionBound);
    EXPECT_LE(lse_err(l, whole.lse), kAttentionBound);
  }
}

/// fp32 copies of an oracle result, as StridedTensor / Lse.
void to_f32(const Tensor64& o, StridedTensor& out) {
  for (std::int64_t b = 0; b < o.shape[0]; ++b)
    for (std::int64_t t = 0; t < o.shape[1]; ++t)
      for (std::int64_t h = 0; h < o.shape[2]; ++h)
        for (std::int64_t d = 0; d < o.shape[3]; ++d)
          out.at(b, t, h, d) = static_cast<float>(o.at(b, t, h, d));
}
void to_f32(const Tensor64& lse, Lse& out) {
  for (std::int64_t b = 0; b < out.B; ++b)
    for (std::int64_t h = 0; h < out.H; ++h)
      for (std::int64_t t = 0; t < out.T; ++t)
        out.at(b, h, t) = static_cast<float>(lse.at(b, h, t, 0));
}
Tensor64 lse64(Lse& l) {
  Tensor64 r({l.B, l.H, l.T, 1});
  for (std::int64_t b = 0; b < l.B; ++b)
    for (std::int64_t h = 0; h < l.H; ++h)
      for (std::int64_t t = 0; t < l.T; ++t) r.at(b, h, t, 0) = l.at(b, h, t);
  return r;
}

TEST(Merge, MatchesReferenceMergeOfExactParts) {
  // Parts from the oracle (rounded to fp32), merged by us and by reference::merge on the same
  // fp32 values: only the merge's own rounding remains (exp, log, two products, one sum ≈ 8u);
  // bound 32u. Row 0 of part 2 and row 1 of part 1 are empty (L = −∞).
  std::mt19937_64 rng(33);
  const std::int64_t B = 1, T = 5, H = 2, D = 8;
  StridedTensor q(B, T, H, D, Layout::bthd), k(B, 12, H, D, Layout::bthd),
      v(B, 12, H, D, Layout::bthd);
  q.fill_random(rng), k.fill_random(rng), v.fill_random(rng);
  const auto k64 = k.to64(), v64 = v.to64();
  Tensor64 k1({B, 5, H, D}), v1({B, 5, H, D}), k2({B, 7, H, D}), v2({B, 7, H, D});
  for (std::int64_t u = 0; u < 12; ++u)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t d = 0; d < D; ++d) {
        auto& kd = u < 5 ? k1.at(0, u, h, d) : k2.at(0, u - 5, h, d);
        auto& vd = u < 5 ? v1.at(0, u, h, d) : v2.at(0, u - 5, h, d);
        kd = k64.at(0, u, h, d), vd = v64.at(0, u, h, d);
      }
  const auto p1 =
      reference::attention_forward(q.to64(), k1, v1, ref_options(false, CausalAlign::top_left));
  const auto p2 =
      reference::attention_forward(q.to64(), k2, v2, ref_options(false, CausalAlign::top_left));
  StridedTensor o1(B, T, H, D, Layout::bhtd), o2(B, T, H, D, Layout::strided),
      out(B, T, H, D, Layout::bthd);
  Lse l1(B, H, T), l2(B, H, T), l(B, H, T);
  to_f32(p1.out, o1), to_f32(p2.out, o2), to_f32(p1.lse, l1), to_f32(p2.lse, l2);
  for (std::int64_t h = 0; h < H; ++h) {
    l2.at(0, h, 0) = -kInf;
    l1.at(0, h, 1) = -kInf;
    for (std::int64_t d = 0; d < D; ++d) o2.at(0, 0, h, d) = 0.0f, o1.at(0, 1, h, d) = 0.0f;
  }
  merge_partials(o1.view, l1.view(), o2.view, l2.view(), out.view, l.view());
  const auto ref = reference::merge(o1.to64(), lse64(l1), o2.to64(), lse64(l2));
  EXPECT_LE(rel_err(out, ref.out), 32 * kU);
  EXPECT_LE(lse_err(l, ref.lse), 32 * kU);
  // With the empty rows put back to their true values the merge is the whole attention again.
  const auto whole =
      reference::attention_forward(q.to64(), k64, v64, ref_options(false, CausalAlign::top_left));
  for (std::int64_t t = 2; t < T; ++t)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t d = 0; d < D; ++d)
        EXPECT_NEAR(out.at(0, t, h, d), whole.out.at(0, t, h, d), 64 * kU)
            << t << " " << h << " " << d;
}

TEST(Merge, EmptyPartContributesNothing) {
  // SPEC: an empty part has L = −∞ and contributes nothing — whatever (finite) O it carries.
  std::mt19937_64 rng(34);
  const std::int64_t B = 2, T = 4, H = 2, D = 8;
  StridedTensor full(B, T, H, D, Layout::bthd), junk(B, T, H, D, Layout::bhtd);
  full.fill_random(rng), junk.fill_random(rng, 100.0);
  Lse lf(B, H, T), le(B, H, T);
  for (auto& x : lf.data) x = std::normal_distribution<float>(0.0f, 5.0f)(rng);
  std::fill(le.data.begin(), le.data.end(), -kInf);
  for (int order = 0; order < 2; ++order) {
    SCOPED_TRACE(order == 0 ? "empty second" : "empty first");
    StridedTensor out(B, T, H, D, Layout::strided);
    Lse l(B, H, T);
    if (order == 0)
      merge_partials(full.view, lf.view(), junk.view, le.view(), out.view, l.view());
    else
      merge_partials(junk.view, le.view(), full.view, lf.view(), out.view, l.view());
    // L = log(e^{L¹} + 0) = L¹ and O = e^0 O¹ + 0: exact up to a rounding or two (≤ 4u).
    EXPECT_LE(rel_err(out, full.to64()), 4 * kU);
    EXPECT_LE(lse_err(l, lse64(lf)), 4 * kU);
  }
  // Both parts empty: the row sees no key — O = 0 and L = −∞ (SPEC 4.3), never NaN.
  StridedTensor out(B, T, H, D, Layout::bthd);
  Lse l(B, H, T), le2(B, H, T);
  std::fill(le2.data.begin(), le2.data.end(), -kInf);
  merge_partials(junk.view, le.view(), full.view, le2.view(), out.view, l.view());
  out.for_each([](float& x) { EXPECT_EQ(x, 0.0f); });
  for (float x : l.data) EXPECT_TRUE(std::isinf(x) && x < 0) << x;
}

TEST(Merge, InPlaceAccumulationAndAssociativity) {
  // Three disjoint key blocks merged as ((1 ⊕ 2) ⊕ 3) in place into part 1's buffers (out = o1,
  // lse_out = lse1, as merge_partials documents), and as 1 ⊕ (2 ⊕ 3) out of place.
  std::mt19937_64 rng(35);
  const Problem p;
  for (Layout layout : {Layout::bthd, Layout::bhtd}) {
    SCOPED_TRACE(layout_name(layout));
    StridedTensor q(p.B, p.Tq, p.Hq, p.D, layout), k(p.B, p.Tk, p.Hkv, p.D, layout),
        v(p.B, p.Tk, p.Hkv, p.D, layout);
    q.fill_random(rng), k.fill_random(rng), v.fill_random(rng);
    AttentionOptions opt;
    opt.causal = false;
    const std::int64_t cut[4] = {0, 5, 13, p.Tk};
    std::vector<StridedTensor> o;
    std::vector<Lse> l;
    for (int i = 0; i < 3; ++i) {
      o.emplace_back(p.B, p.Tq, p.Hq, p.D, layout);
      l.emplace_back(p.B, p.Hq, p.Tq);
    }
    for (int i = 0; i < 3; ++i) {
      attention_forward(q.view, slice_t(k.view, cut[i], cut[i + 1] - cut[i]),
                        slice_t(v.view, cut[i], cut[i + 1] - cut[i]), o[i].view, l[i].view(), opt);
    }
    // Out of place first, to compare the in-place result with it bit for bit.
    StridedTensor o12(p.B, p.Tq, p.Hq, p.D, layout), o123(p.B, p.Tq, p.Hq, p.D, layout);
    Lse l12(p.B, p.Hq, p.Tq), l123(p.B, p.Hq, p.Tq);
    merge_partials(o[0].view, l[0].view(), o[1].view, l[1].view(), o12.view, l12.view());
    merge_partials(o12.view, l12.view(), o[2].view, l[2].view(), o123.view, l123.view());

    StridedTensor o23(p.B, p.Tq, p.Hq, p.D, layout), right(p.B, p.Tq, p.Hq, p.D, layout);
    Lse l23(p.B, p.Hq, p.Tq), lright(p.B, p.Hq, p.Tq);
    merge_partials(o[1].view, l[1].view(), o[2].view, l[2].view(), o23.view, l23.view());
    merge_partials(o[0].view, l[0].view(), o23.view, l23.view(), right.view, lright.view());

    merge_partials(o[0].view, l[0].view(), o[1].view, l[1].view(), o[0].view, l[0].view());
    merge_partials(o[0].view, l[0].view(), o[2].view, l[2].view(), o[0].view, l[0].view());
    EXPECT_EQ(
        std::memcmp(o[0].storage.data(), o123.storage.data(), o123.storage.size() * sizeof(float)),
        0)
        << "in-place merge differs from out-of-place";
    EXPECT_EQ(std::memcmp(l[0].data.data(), l123.data.data(), l123.data.size() * sizeof(float)), 0);

    const auto whole = reference::attention_forward(q.to64(), k.to64(), v.to64(),
                                                    ref_options(false, CausalAlign::bottom_right));
    EXPECT_LE(rel_err(o123, whole.out), kAttentionBound);
    EXPECT_LE(lse_err(l123, whole.lse), kAttentionBound);
    EXPECT_LE(rel_err(right, whole.out), kAttentionBound);
    EXPECT_LE(lse_err(lright, whole.lse), kAttentionBound);
  }
}

}  // namespace
}  // namespace tokenmix::testing
