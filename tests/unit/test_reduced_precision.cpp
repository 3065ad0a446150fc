// tests/unit/test_reduced_precision.cpp — bf16 and f16 attention (SPEC "Reduced precision") on
// every kernel path this machine runs: forward, backward, varlen and decode, through the public
// API, against the float64 oracle run on the same (already rounded) inputs, and bitwise against
// the fp32 path run on the widened inputs (the reduced-precision kernels widen exactly on pack
// and keep the fp32 kernels' arithmetic: only the final rounding of O, dQ, dK, dV differs).
//
// Error bounds (max-norm error relative to the reference's max-norm, test_util.hpp):
//   * O: the fp32 kernel's error (forward bound 2e-5, test_flash_kernels.cpp) plus one rounding
//     to the dtype, at most half an ulp of |O_i| ≤ max|O|: the unit roundoff 2^-8 for bf16 (8
//     significand bits: ulp(1) = 2^-7; not 2^-9), 2^-11 for f16 (11 bits; |O| ≤ max|v| ~ 4
//     stays far from f16's subnormals). Measured: up to 0.0037 = 0.95 · 2^-8 for bf16.
//   * dQ, dK, dV: the fp32 backward bound (1e-4, with the gradient floor of 1) plus the final
//     rounding (2^-8 / 2^-11), against the oracle moved to the D = ⟨dO, O⟩ that the kernels form
//     from the rounded O (as FlashAttention and PyTorch do; move_to_rounded_o computes the move
//     exactly, with the score variants and per varlen sequence). dσ (f32, never rounded): the fp32
//     bound. Before the move, four rounding units were allowed for D; that allowance does not
//     hold at d_h = 1, and without the move the present bound fails on every path.
//   * L (lse, f32): the fp32 bound 2e-5 relative to max(1, |L|): it is never rounded.
//   * Path avx512_bf16, bf16 forward: P is rounded to bf16 before P·V (vdpbf16ps), so each term
//     of Σ_u P_tu v_u / l gains a relative error ≤ 2^-8: |ΔO_t| ≤ 2^-8 Σ_u P_tu |v_u| / l ≤
//     2^-8 max|v|, i.e. a further 2^-8 · max|v| / max|O| on the relative bound (dp_extra). Its
//     products use Q unscaled, so it is not the fp32 path's bits: no bitwise comparison there.
//   * Path avx512_bf16, bf16 backward: S and dP on vdpbf16ps from the bf16 operands (exact
//     products, fp32 sums in another order, the scale applied after the sum; D-bf16-8): the
//     fp32 backward bound holds, but not the widened fp32 path's bits (same_bits_as_fp32).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/kv_element.hpp"
#include "reference/reference.hpp"
#include "test_util.hpp"

namespace tokenmix::testing {
namespace {

constexpr double kFp32Fwd = 2e-5, kFp32Bwd = 1e-4;

double unit(DType dt) {  // unit roundoff (half an ulp of 1): one rounding of an output element
  return dt == DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
}
double fwd_bound(DType dt) {
  return unit(dt) + kFp32Fwd;
}

// True where the bf16 forward rounds P before P·V (the avx512_bf16 path's vdpbf16ps products).
bool rounds_p(Isa isa, DType dt) {
  return isa == Isa::avx512_bf16 && dt == DType::bf16;
}

// True where the path's dt kernels keep the fp32 kernels' arithmetic on widened operands, so
// their outputs are the fp32 path's results rounded (false: avx512_bf16's bf16 kernels).
bool same_bits_as_fp32(Isa isa, DType dt) {
  return !(isa == Isa::avx512_bf16 && dt == DType::bf16);
}

float widen(DType dt, std::uint16_t bits) {
  return dt == DType::bf16 ? kernels::bf16_to_f32(bits) : kernels::f16_to_f32(bits);
}
std::uint16_t narrow(DType dt, float x) {
  return dt == DType::bf16 ? kernels::f32_to_bf16(x) : kernels::f32_to_f16(x);
}

// A 16-bit tensor of logical shape [B, T, H, D] in one of testkit's layouts (the padding of
// `strided` holds NaN bits: a kernel that reads it makes NaN and fails), plus its rank-3 form.
struct Tensor16 {
  DType dtype;
  std::vector<std::uint16_t> storage;
  TensorView view;

  Tensor16(DType dt, std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t D, Layout layout)
      : dtype(dt) {
    std::array<std::int64_t, 4> st{};
    std::int64_t total = 0;
    if (layout == Layout::bthd) {
      st = {T * H * D, H * D, D, 1};
      total = B * T * H * D;
    } else if (layout == Layout::bhtd) {
      st = {H * T * D, D, T * D, 1};
      total = B * H * T * D;
    } else {
      const std::int64_t sh = D + 3, stt = (H + 1) * sh, sb = (T + 2) * stt;
      st = {sb, stt, sh, 1};
      total = B * sb;
    }
    storage.assign(static_cast<std::size_t>(std::max<std::int64_t>(total, 1)), nan_bits());
    view = TensorView{storage.data(), dt, 4, {B, T, H, D}, st};
  }
  std::uint16_t nan_bits() const { return dtype == DType::bf16 ? 0x7fc0 : 0x7e00; }
  std::uint16_t& bits(std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t d) {
    const auto& s = view.strides;
    return storage[static_cast<std::size_t>(b * s[0] + t * s[1] + h * s[2] + d * s[3])];
  }
  float at(std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t d) {
    return widen(dtype, bits(b, t, h, d));
  }
  void set(std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t d, float x) {
    bits(b, t, h, d) = narrow(dtype, x);
  }
  template <class F>
  void for_each(F&& f) {
    const auto& s = view.shape;
    for (std::int64_t b = 0; b < s[0]; ++b)
      for (std::int64_t t = 0; t < s[1]; ++t)
        for (std::int64_t h = 0; h < s[2]; ++h)
          for (std::int64_t d = 0; d < s[3]; ++d) f(b, t, h, d);
  }
  void fill_random(std::mt19937_64& rng) {
    std::normal_distribution<float> dist;
    for_each([&](auto b, auto t, auto h, auto d) { set(b, t, h, d, dist(rng)); });
  }
  void poison() {
    for_each([&](auto b, auto t, auto h, auto d) { bits(b, t, h, d) = nan_bits(); });
  }
  // The exact (widened) values, for the oracle.
  reference::Tensor64 to64() {
    reference::Tensor64 r(view.shape);
    for_each([&](auto b, auto t, auto h, auto d) { r.at(b, t, h, d) = at(b, t, h, d); });
    return r;
  }
  // The widened values as an f32 tensor in the same layout (for the fp32 path).
  StridedTensor to32(Layout layout) {
    StridedTensor x(view.shape[0], view.shape[1], view.shape[2], view.shape[3], layout);
    for_each([&](auto b, auto t, auto h, auto d) { x.at(b, t, h, d) = at(b, t, h, d); });
    return x;
  }
  // [B·T, H, D] as rank 3 (B = 1 only): the varlen form.
  TensorView rank3() const {
    return TensorView{view.data,
                      dtype,
                      3,
                      {view.shape[1], view.shape[2], view.shape[3], 1},
                      {view.strides[1], view.strides[2], view.strides[3], 0}};
  }
};

// The extra forward bound of a path that rounds P (see the top): 2^-8 · max|v| / max|O|.
double dp_extra(Isa isa, DType dt, const reference::Tensor64& v, const reference::Tensor64& o) {
  if (!rounds_p(isa, dt)) return 0.0;
  double vmax = 0.0, omax = 0.0;
  for (double x : v.data) vmax = std::max(vmax, std::fabs(x));
  for (double x : o.data) omax = std::max(omax, std::fabs(x));
  return std::ldexp(1.0, -8) * vmax / std::max(omax, 1e-30);
}

double err16(Tensor16& x, const reference::Tensor64& r, double floor = 1e-30) {
  ErrorAccumulator acc;
  x.for_each([&](auto b, auto t, auto h, auto d) { acc.add(x.at(b, t, h, d), r.at(b, t, h, d)); });
  return acc.value(floor);
}

// True if every element of x is the fp32 result y rounded to x's dtype, bit for bit.
bool rounds_of(Tensor16& x, StridedTensor& y) {
  bool same = true;
  x.for_each([&](auto b, auto t, auto h, auto d) {
    const std::uint16_t want = narrow(x.dtype, y.at(b, t, h, d));
    const std::uint16_t got = x.bits(b, t, h, d);
    const bool both_nan = std::isnan(widen(x.dtype, got)) && std::isnan(widen(x.dtype, want));
    if (got != want && !both_nan) same = false;
  });
  return same;
}

double lse_err(const std::vector<float>& got, const reference::Tensor64& ref) {
  double e = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double r = ref.data[i], g = got[i];
    if (std::isinf(r)) {
      if (!(std::isinf(g) && (g < 0) == (r < 0))) return INFINITY;
      continue;
    }
    e = std::max(e, std::isnan(g) ? INFINITY : std::fabs(g - r) / std::max(1.0, std::fabs(r)));
  }
  return e;
}

struct Shape {
  std::int64_t B, Tq, Tk, Hq, Hkv, D;
  Layout layout = Layout::bthd;
  bool causal = true;
};

std::string name_of(const Shape& s, DType dt) {
  std::ostringstream o;
  o << to_string(dt) << " B" << s.B << " Tq" << s.Tq << " Tk" << s.Tk << " Hq" << s.Hq << " Hkv"
    << s.Hkv << " d" << s.D << " " << layout_name(s.layout) << (s.causal ? "" : " noncausal");
  return o.str();
}

// Shapes around the key tile (64) and the lane blocks (64 rows AVX-512, 24 AVX2, 16 NEON), odd
// d_h, GQA ratios 1, 2, 3, 7, T_q ≠ T_k both ways, the three layouts; B·H_kv ≥ 8 for the
// one-pass backward.
std::vector<Shape> shapes() {
  return {{1, 1, 1, 1, 1, 1},
          {1, 65, 65, 2, 1, 64, Layout::bthd},
          {2, 64, 64, 4, 4, 33, Layout::bhtd},
          {1, 25, 130, 3, 1, 17, Layout::strided},
          {1, 130, 70, 7, 1, 16, Layout::bthd},
          {1, 47, 47, 6, 2, 40, Layout::strided, false},
          {2, 40, 40, 8, 4, 24, Layout::bhtd}};
}

struct Inputs {
  Tensor16 q, k, v;
  Inputs(DType dt, const Shape& s, std::mt19937_64& rng)
      : q(dt, s.B, s.Tq, s.Hq, s.D, s.layout),
        k(dt, s.B, s.Tk, s.Hkv, s.D, s.layout),
        v(dt, s.B, s.Tk, s.Hkv, s.D, s.layout) {
    q.fill_random(rng);
    k.fill_random(rng);
    v.fill_random(rng);
  }
};

// Forward of shape s in dt on `isa` against the float64 oracle; where the path computes in fp32
// (rounds_p false), also the fp32 path on the widened inputs, rounded: the same bits.
void check_forward(DType dt, const Shape& s, Isa isa, std::mt19937_64& rng) {
  SCOPED_TRACE(name_of(s, dt));
  Inputs in(dt, s, rng);
  Tensor16 out(dt, s.B, s.Tq, s.Hq, s.D, s.layout);
  out.poison();
  std::vector<float> lse(static_cast<std::size_t>(s.B * s.Hq * s.Tq), kPoison);
  AttentionOptions o;
  o.isa = isa;
  o.causal = s.causal;
  attention_forward(in.q.view, in.k.view, in.v.view, out.view,
                    TensorView::bht(lse.data(), s.B, s.Hq, s.Tq), o);
  reference::Options ro;
  ro.causal = s.causal;
  const auto v64 = in.v.to64();
  const auto ref = reference::attention_forward(in.q.to64(), in.k.to64(), v64, ro);
  EXPECT_LE(err16(out, ref.out), fwd_bound(dt) + dp_extra(isa, dt, v64, ref.out));
  EXPECT_LE(lse_err(lse, ref.lse), kFp32Fwd);
  if (rounds_p(isa, dt)) return;

  // The fp32 path on the widened inputs, rounded, gives the same bits (same arithmetic).
  StridedTensor q32 = in.q.to32(s.layout), k32 = in.k.to32(s.layout), v32 = in.v.to32(s.layout);
  StridedTensor out32(s.B, s.Tq, s.Hq, s.D, s.layout);
  attention_forward(q32.view, k32.view, v32.view, out32.view, {}, o);
  EXPECT_TRUE(rounds_of(out, out32));
}

// The oracle's gradients moved to what the kernels compute from the rounded O. FlashAttention's
// backward (and ours) forms D_t = ⟨dO_t, O_t⟩ from the O it is given, here rounded to 16 bits;
// the oracle uses the exact O. dS = P ⊙ (dP − D) (4.7) is linear in D, so D_t + ΔD_t moves
// dS_tu by −P_tu ΔD_t, exactly (no higher-order term). Through the scores S = cap(z) + b (z =
// s ⟨q_t, k_u⟩, b ALiBi's bias) that is dz_tu moved by −P_tu ΔD_t cap'(z_tu), so
//   ΔdQ_t = −s ΔD_t Σ_u P_tu cap'_tu K_u,   ΔdK_u = −s Σ_{h of the group} Σ_t P_tu ΔD_t cap'_tu
//   Q_t, Δdσ_h = −Σ_t e^{σ_h − L_t} ΔD_t (a sink's dS is P_sink · (0 − D)),   ΔdV = 0,
// with ΔD_t = ⟨dO_t, O_rounded,t − O_t⟩, P_tu = e^{S_tu − L_t} over the keys visible under the
// causal mask and the window, cap' = 1 − tanh²(z / c) (1 without soft-capping). What is left is
// the fp32 kernel's error and the final rounding of each gradient: no allowance for D, whatever
// d_h (at d_h = 1 ΔD is not averaged).
// Rows [q0, q0 + nq) of batch row b against keys [k0, k0 + nk): one sequence (a varlen batch's
// is a segment of the packed rows, its mask and positions local to it).
struct Segment {
  std::int64_t b, q0, nq, k0, nk;
};

void move_to_rounded_o(reference::BackwardResult& ref, const reference::Tensor64& q,
                       const reference::Tensor64& k, const reference::Tensor64& dout,
                       const reference::ForwardResult& exact, Tensor16& out_rounded,
                       const reference::Options& ro, const Segment& seg) {
  const std::int64_t Hq = q.shape[2], D = q.shape[3], group = Hq / k.shape[2], b = seg.b;
  const double s = ro.scale.value_or(1.0 / std::sqrt(static_cast<double>(D)));  // as the oracle
  for (std::int64_t h = 0; h < Hq; ++h)
    for (std::int64_t i = 0; i < seg.nq; ++i) {
      const std::int64_t t = seg.q0 + i;
      const double L = exact.lse.at(b, h, t, 0);
      if (std::isinf(L)) continue;  // a row that sees no key: no gradient, nothing moves
      double dD = 0.0;
      for (std::int64_t x = 0; x < D; ++x)
        dD += dout.at(b, t, h, x) * (out_rounded.at(b, t, h, x) - exact.out.at(b, t, h, x));
      if (!ro.sinks.empty()) ref.dsinks[h] -= std::exp(ro.sinks[h] - L) * dD;
      const std::int64_t p = reference::position(i, seg.nq, seg.nk, ro);
      for (std::int64_t j = 0; j < seg.nk; ++j) {
        if (!reference::visible(i, j, seg.nq, seg.nk, ro)) continue;
        const std::int64_t u = seg.k0 + j;
        double z = 0.0;
        for (std::int64_t x = 0; x < D; ++x) z += q.at(b, t, h, x) * k.at(b, u, h / group, x);
        z *= s;
        double score = z, slope = 1.0;
        if (ro.softcap) {
          const double th = std::tanh(z / *ro.softcap);
          score = *ro.softcap * th;
          slope = 1.0 - th * th;
        }
        if (!ro.alibi_slopes.empty()) score -= ro.alibi_slopes[h] * static_cast<double>(p - j);
        const double w = s * std::exp(score - L) * dD * slope;  // s · P_tu · ΔD_t · cap'
        for (std::int64_t x = 0; x < D; ++x) {
          ref.dq.at(b, t, h, x) -= w * k.at(b, u, h / group, x);
          ref.dk.at(b, u, h / group, x) -= w * q.at(b, t, h, x);
        }
      }
    }
}

// Every batch row as one sequence of T_q queries and T_k keys.
void move_to_rounded_o(reference::BackwardResult& ref, const reference::Tensor64& q,
                       const reference::Tensor64& k, const reference::Tensor64& dout,
                       const reference::ForwardResult& exact, Tensor16& out_rounded,
                       const reference::Options& ro) {
  for (std::int64_t b = 0; b < q.shape[0]; ++b)
    move_to_rounded_o(ref, q, k, dout, exact, out_rounded, ro,
                      Segment{b, 0, q.shape[1], 0, k.shape[1]});
}

// The fp32 backward's error plus one final rounding of a gradient element: the bound of dQ, dK
// and dV against the oracle moved to the rounded O.
double bwd_bound(DType dt) {
  return kFp32Bwd + unit(dt);
}

// Backward likewise: dQ, dK, dV against the oracle (dQ and dK moved to the rounded O, above:
// bound kFp32Bwd + one rounding unit), and the fp32 backward on the widened q, k, v, O, dO (and
// the same L) rounds to the same bits.
void check_backward(DType dt, const Shape& s, Isa isa, std::mt19937_64& rng) {
  SCOPED_TRACE(name_of(s, dt));
  Inputs in(dt, s, rng);
  Tensor16 out(dt, s.B, s.Tq, s.Hq, s.D, s.layout), dout(dt, s.B, s.Tq, s.Hq, s.D, s.layout);
  dout.fill_random(rng);
  std::vector<float> lse(static_cast<std::size_t>(s.B * s.Hq * s.Tq), kPoison);
  AttentionOptions o;
  o.isa = isa;
  o.causal = s.causal;
  const TensorView lse_view = TensorView::bht(lse.data(), s.B, s.Hq, s.Tq);
  attention_forward(in.q.view, in.k.view, in.v.view, out.view, lse_view, o);
  Tensor16 dq(dt, s.B, s.Tq, s.Hq, s.D, s.layout), dk(dt, s.B, s.Tk, s.Hkv, s.D, s.layout),
      dv(dt, s.B, s.Tk, s.Hkv, s.D, s.layout);
  dq.poison();
  dk.poison();
  dv.poison();
  attention_backward(in.q.view, in.k.view, in.v.view, out.view, lse_view, dout.view, dq.view,
                     dk.view, dv.view, o);
  reference::Options ro;
  ro.causal = s.causal;
  const auto q64 = in.q.to64(), k64 = in.k.to64(), v64 = in.v.to64(), do64 = dout.to64();
  auto ref = reference::attention_backward(q64, k64, v64, do64, ro);
  move_to_rounded_o(ref, q64, k64, do64, reference::attention_forward(q64, k64, v64, ro), out, ro);
  // Gradient floor 1: gradients may vanish (e.g. a key no query sees).
  EXPECT_LE(err16(dq, ref.dq, 1.0), bwd_bound(dt));
  EXPECT_LE(err16(dk, ref.dk, 1.0), bwd_bound(dt));
  EXPECT_LE(err16(dv, ref.dv, 1.0), bwd_bound(dt));
  if (!same_bits_as_fp32(isa, dt)) return;

  // The fp32 backward on the widened q, k, v, O, dO (and the same L) rounds to the same bits.
  StridedTensor q32 = in.q.to32(s.layout), k32 = in.k.to32(s.layout), v32 = in.v.to32(s.layout),
                o32 = out.to32(s.layout), do32 = dout.to32(s.layout);
  StridedTensor dq32(s.B, s.Tq, s.Hq, s.D, s.layout), dk32(s.B, s.Tk, s.Hkv, s.D, s.layout),
      dv32(s.B, s.Tk, s.Hkv, s.D, s.layout);
  attention_backward(q32.view, k32.view, v32.view, o32.view, lse_view, do32.view, dq32.view,
                     dk32.view, dv32.view, o);
  EXPECT_TRUE(rounds_of(dq, dq32));
  EXPECT_TRUE(rounds_of(dk, dk32));
  EXPECT_TRUE(rounds_of(dv, dv32));
}

class ReducedPrecision : public PerIsaTest {};

TEST_P(ReducedPrecision, ForwardMatchesOracleAndRoundsTheFp32Path) {
  std::mt19937_64 rng(13);
  for (DType dt : {DType::bf16, DType::f16}) {
    for (const Shape& s : shapes()) check_forward(dt, s, GetParam(), rng);
  }
}

TEST_P(ReducedPrecision, BackwardMatchesOracleAndRoundsTheFp32Path) {
  std::mt19937_64 rng(17);
  for (DType dt : {DType::bf16, DType::f16}) {
    for (const Shape& s : shapes()) check_backward(dt, s, GetParam(), rng);
  }
}

// Random shapes, bf16 and f16, forward and backward as above: 30 draws per path from one fixed
// seed of B, T_q and T_k (1 … 150: the lane blocks' and key tile's edges), GQA ratio 1 … 7, d_h
// (1 … 72, odd widths), layout, causal or not. d_h = 1 is drawn since the backward's reference
// follows the rounded O (move_to_rounded_o): under the former allowance of 4 rounding units for
// D it failed (bf16, B 2, T 84 × 85: 0.0186 against 0.0157, on every path).
TEST_P(ReducedPrecision, RandomShapesMatchOracleAndRoundTheFp32Path) {
  Picker pick(20261206);
  std::mt19937_64 rng(20261208);
  const std::int64_t widths[] = {1, 2, 5, 8, 16, 17, 24, 33, 64, 72};
  for (int draw = 0; draw < 30; ++draw) {
    Shape s{pick(1, 2), pick(1, 150), 0, 0, pick(1, 3), widths[pick(0, std::size(widths) - 1)]};
    s.Tk = pick(0, 2) == 0 ? s.Tq : pick(1, 150);
    s.Hq = s.Hkv * pick(1, 7);
    s.layout = std::array<Layout, 3>{Layout::bthd, Layout::bhtd, Layout::strided}[pick(0, 2)];
    s.causal = pick(0, 3) != 0;
    const DType dt = pick(0, 1) == 0 ? DType::bf16 : DType::f16;
    SCOPED_TRACE("draw " + std::to_string(draw));
    check_forward(dt, s, GetParam(), rng);
    check_backward(dt, s, GetParam(), rng);
  }
}

// Window, soft-capping and sinks (with ALiBi) in bf16/f16, forward and backward, vs the oracle.
TEST_P(ReducedPrecision, ScoreVariants) {
  std::mt19937_64 rng(19);
  const Shape s{2, 70, 90, 4, 2, 24, Layout::strided};
  for (DType dt : {DType::bf16, DType::f16}) {
    for (int variant = 0; variant < 4; ++variant) {
      SCOPED_TRACE(name_of(s, dt) + " variant " + std::to_string(variant));
      Inputs in(dt, s, rng);
      std::vector<float> sinks{0.5f, -1.0f, 2.0f, 0.0f}, slopes{0.5f, 0.25f, 0.125f, 0.0625f};
      AttentionOptions o;
      o.isa = GetParam();
      reference::Options ro;
      if (variant == 0) {
        o.window = 7;
        ro.window = 7;
      } else if (variant == 1) {
        o.softcap = 2.0;
        ro.softcap = 2.0;
      } else if (variant == 3) {  // dropout (docs/design.md D.1), the oracle given the same Z
        o.dropout = {0.3, 77, 0};
        ro.dropout_p = 0.3;
        ro.dropout_keep.resize(static_cast<std::size_t>(s.B * s.Hq * s.Tq * s.Tk));
        attention_dropout_mask({ro.dropout_keep.data(),
                                DType::boolean,
                                4,
                                {s.B, s.Hq, s.Tq, s.Tk},
                                {s.Hq * s.Tq * s.Tk, s.Tq * s.Tk, s.Tk, 1}},
                               o);
      } else {
        o.sinks = ConstTensorView{sinks.data(), DType::f32, 1, {4, 1, 1, 1}, {1, 0, 0, 0}};
        o.alibi_slopes = ConstTensorView{slopes.data(), DType::f32, 1, {4, 1, 1, 1}, {1, 0, 0, 0}};
        ro.sinks.assign(sinks.begin(), sinks.end());
        ro.alibi_slopes.assign(slopes.begin(), slopes.end());
      }
      Tensor16 out(dt, s.B, s.Tq, s.Hq, s.D, s.layout), dout(dt, s.B, s.Tq, s.Hq, s.D, s.layout);
      out.poison();
      dout.fill_random(rng);
      std::vector<float> lse(static_cast<std::size_t>(s.B * s.Hq * s.Tq), kPoison);
      const TensorView lse_view = TensorView::bht(lse.data(), s.B, s.Hq, s.Tq);
      attention_forward(in.q.view, in.k.view, in.v.view, out.view, lse_view, o);
      const auto v64 = in.v.to64();
      const auto ref = reference::attention_forward(in.q.to64(), in.k.to64(), v64, ro);
      EXPECT_LE(err16(out, ref.out), fwd_bound(dt) + dp_extra(GetParam(), dt, v64, ref.out));
      EXPECT_LE(lse_err(lse, ref.lse), kFp32Fwd);

      Tensor16 dq(dt, s.B, s.Tq, s.Hq, s.D, s.layout), dk(dt, s.B, s.Tk, s.Hkv, s.D, s.layout),
          dv(dt, s.B, s.Tk, s.Hkv, s.D, s.layout);
      dq.poison();
      dk.poison();
      dv.poison();
      std::vector<float> dsinks(4, kPoison);
      const TensorView dsinks_view{dsinks.data(), DType::f32, 1, {4, 1, 1, 1}, {1, 0, 0, 0}};
      attention_backward(in.q.view, in.k.view, in.v.view, out.view, lse_view, dout.view, dq.view,
                         dk.view, dv.view, o, variant == 2 ? dsinks_view : TensorView{});
      const auto q64 = in.q.to64(), k64 = in.k.to64(), do64 = dout.to64();
      auto gref = reference::attention_backward(q64, k64, v64, do64, ro);
      move_to_rounded_o(gref, q64, k64, do64, ref, out, ro);
      EXPECT_LE(err16(dq, gref.dq, 1.0), bwd_bound(dt));
      EXPECT_LE(err16(dk, gref.dk, 1.0), bwd_bound(dt));
      EXPECT_LE(err16(dv, gref.dv, 1.0), bwd_bound(dt));
      if (variant == 2) {  // dσ_h is fp32, never rounded: the fp32 bound
        EXPECT_LE(testkit::rel_err(dsinks, gref.dsinks, 1.0), kFp32Bwd);
      }
    }
  }
}

TEST_P(ReducedPrecision, VarlenForwardAndBackward) {
  std::mt19937_64 rng(23);
  const std::vector<std::int64_t> cu_q{0, 5, 5, 75, 100}, cu_k{0, 9, 12, 82, 100};
  const std::int64_t total_q = cu_q.back(), total_k = cu_k.back(), hq = 4, hkv = 2, d = 20;
  const ConstTensorView cq{cu_q.data(), DType::i64, 1, {5, 1, 1, 1}, {1, 0, 0, 0}};
  const ConstTensorView ck{cu_k.data(), DType::i64, 1, {5, 1, 1, 1}, {1, 0, 0, 0}};
  for (DType dt : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(to_string(dt));
    Tensor16 q(dt, 1, total_q, hq, d, Layout::strided), k(dt, 1, total_k, hkv, d, Layout::strided),
        v(dt, 1, total_k, hkv, d, Layout::strided), out(dt, 1, total_q, hq, d, Layout::bthd),
        dout(dt, 1, total_q, hq, d, Layout::bthd);
    q.fill_random(rng);
    k.fill_random(rng);
    v.fill_random(rng);
    dout.fill_random(rng);
    out.poison();
    std::vector<float> lse(static_cast<std::size_t>(hq * total_q), kPoison);
    const TensorView lse_view{lse.data(), DType::f32, 2, {hq, total_q, 1, 1}, {total_q, 1, 0, 0}};
    AttentionOptions o;
    o.isa = GetParam();
    attention_forward_varlen(q.rank3(), k.rank3(), v.rank3(), cq, ck, out.rank3(), lse_view, o);
    const auto v64 = v.to64();
    const auto ref = reference::attention_forward_varlen(q.to64(), k.to64(), v64, cu_q, cu_k, {});
    EXPECT_LE(err16(out, ref.out), fwd_bound(dt) + dp_extra(GetParam(), dt, v64, ref.out));

    Tensor16 dq(dt, 1, total_q, hq, d, Layout::bhtd), dk(dt, 1, total_k, hkv, d, Layout::bhtd),
        dv(dt, 1, total_k, hkv, d, Layout::bhtd);
    dq.poison();
    dk.poison();
    dv.poison();
    attention_backward_varlen(q.rank3(), k.rank3(), v.rank3(), out.rank3(), lse_view, dout.rank3(),
                              cq, ck, dq.rank3(), dk.rank3(), dv.rank3(), o);
    const auto q64 = q.to64(), k64 = k.to64(), do64 = dout.to64();
    auto gref = reference::attention_backward_varlen(q64, k64, v64, do64, cu_q, cu_k, {});
    for (std::size_t i = 0; i + 1 < cu_q.size(); ++i) {
      move_to_rounded_o(gref, q64, k64, do64, ref, out, {},
                        Segment{0, cu_q[i], cu_q[i + 1] - cu_q[i], cu_k[i], cu_k[i + 1] - cu_k[i]});
    }
    EXPECT_LE(err16(dq, gref.dq, 1.0), bwd_bound(dt));
    EXPECT_LE(err16(dk, gref.dk, 1.0), bwd_bound(dt));
    EXPECT_LE(err16(dv, gref.dv, 1.0), bwd_bound(dt));
  }
}

// bf16/f16 queries on every cache dtype: O is the f32-query decode's O (tested against the
// oracle in test_decode.cpp) on the widened queries, rounded once — bit for bit.
TEST_P(ReducedPrecision, DecodeQueriesOnEveryCacheDtype) {
  std::mt19937_64 rng(29);
  const std::int64_t B = 2, tnew = 3, hq = 6, hkv = 2, d = 40, len = 150;
  std::vector<float> kv(static_cast<std::size_t>(B * len * hkv * d));
  std::normal_distribution<float> dist;
  for (DType cache_dt : {DType::f32, DType::bf16, DType::f16}) {
    KVCache cache({1, B, hkv, d, 256, cache_dt, 0, 0});
    for (float& x : kv) x = dist(rng);
    const ConstTensorView kview{
        kv.data(), DType::f32, 4, {B, len, hkv, d}, {len * hkv * d, hkv * d, d, 1}};
    cache.append(0, 0, kview, kview);
    for (DType dt : {DType::bf16, DType::f16}) {
      SCOPED_TRACE(std::string("q ") + to_string(dt) + ", cache " + to_string(cache_dt));
      Tensor16 q(dt, B, tnew, hq, d, Layout::strided), out(dt, B, tnew, hq, d, Layout::bhtd);
      q.fill_random(rng);
      out.poison();
      DecodeOptions o;
      o.isa = GetParam();
      std::vector<float> lse(static_cast<std::size_t>(B * hq * tnew), kPoison),
          lse32(lse.size(), kPoison);
      attention_decode(q.view, cache, 0, out.view, TensorView::bht(lse.data(), B, hq, tnew), o);
      StridedTensor q32 = q.to32(Layout::bthd), out32(B, tnew, hq, d, Layout::bthd);
      attention_decode(q32.view, cache, 0, out32.view, TensorView::bht(lse32.data(), B, hq, tnew),
                       o);
      EXPECT_TRUE(rounds_of(out, out32));
      EXPECT_EQ(0, std::memcmp(lse.data(), lse32.data(), lse.size() * sizeof(float)));
    }
  }
}

// SPEC 4.3: a NaN in a key (or value) a row reads makes its output NaN; one in a key it does
// not see (causal future) stays out. bf16/f16 NaN widen to NaN and round back to NaN. (A NaN
// value sends the avx512_bf16 path's tile to its widened fp32 product: tested here.)
TEST_P(ReducedPrecision, NaNPropagation) {
  std::mt19937_64 rng(31);
  const Shape s{1, 70, 70, 2, 1, 16};
  for (DType dt : {DType::bf16, DType::f16})
    for (bool in_value : {false, true}) {
      SCOPED_TRACE(std::string(to_string(dt)) + (in_value ? " NaN in v" : " NaN in k"));
      Inputs in(dt, s, rng);
      const std::int64_t bad = 50;  // key 50: seen by rows t ≥ 50 only
      Tensor16& x = in_value ? in.v : in.k;
      x.bits(0, bad, 0, 3) = x.nan_bits();
      Tensor16 out(dt, s.B, s.Tq, s.Hq, s.D, s.layout);
      out.poison();
      AttentionOptions o;
      o.isa = GetParam();
      std::vector<float> lse(static_cast<std::size_t>(s.B * s.Hq * s.Tq), kPoison);
      const TensorView lse_view = TensorView::bht(lse.data(), s.B, s.Hq, s.Tq);
      attention_forward(in.q.view, in.k.view, in.v.view, out.view, lse_view, o);
      for (std::int64_t t = 0; t < s.Tq; ++t)
        for (std::int64_t h = 0; h < s.Hq; ++h) {
          const bool nan = std::isnan(out.at(0, t, h, in_value ? 3 : 0));
          EXPECT_EQ(nan, t >= bad) << "t=" << t << " h=" << h;
        }
      // Backward (the avx512_bf16 path recomputes S and dP on vdpbf16ps, unmasked, then
      // selects): rows before the bad key never see it, so their dQ stays finite; the rows
      // that see it get NaN (through S or dP, and through D from their NaN output).
      Tensor16 dout(dt, s.B, s.Tq, s.Hq, s.D, s.layout), dq(dt, s.B, s.Tq, s.Hq, s.D, s.layout),
          dk(dt, s.B, s.Tk, s.Hkv, s.D, s.layout), dv(dt, s.B, s.Tk, s.Hkv, s.D, s.layout);
      dout.fill_random(rng);
      dq.poison();
      dk.poison();
      dv.poison();
      attention_backward(in.q.view, in.k.view, in.v.view, out.view, lse_view, dout.view, dq.view,
                         dk.view, dv.view, o);
      for (std::int64_t t = 0; t < s.Tq; ++t)
        for (std::int64_t h = 0; h < s.Hq; ++h)
          for (std::int64_t x = 0; x < s.D; ++x)
            EXPECT_EQ(std::isnan(dq.at(0, t, h, x)), t >= bad)
                << "dq t=" << t << " h=" << h << " x=" << x;
    }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, ReducedPrecision, AllIsas(), IsaName);

// ---- dtype contract errors (ArgumentError / UnsupportedError naming views and dtypes) ----

template <class F>
void expect_error(F&& f, ErrorCode code, const std::vector<std::string>& words) {
  try {
    f();
    ADD_FAILURE() << "no error thrown";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const auto& w : words)
      EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what();
  }
}

TEST(ReducedPrecisionErrors, MixedDtypesAreArgumentErrors) {
  std::mt19937_64 rng(37);
  const Shape s{1, 8, 8, 2, 1, 8};
  Inputs in(DType::bf16, s, rng);
  StridedTensor k32(1, 8, 1, 8, Layout::bthd), out32(1, 8, 2, 8, Layout::bthd);
  Tensor16 out(DType::bf16, 1, 8, 2, 8, Layout::bthd), outh(DType::f16, 1, 8, 2, 8, Layout::bthd);
  std::vector<float> lse(16);
  const TensorView lse_view = TensorView::bht(lse.data(), 1, 2, 8);
  expect_error([&] { attention_forward(in.q.view, k32.view, in.v.view, out.view); },
               ErrorCode::invalid_argument,
               {"attention_forward", "k has dtype f32", "q has dtype bf16"});
  expect_error([&] { attention_forward(in.q.view, in.k.view, in.v.view, outh.view); },
               ErrorCode::invalid_argument, {"attention_forward", "out has dtype f16"});
  expect_error([&] { attention_forward(in.q.view, in.k.view, in.v.view, out32.view); },
               ErrorCode::invalid_argument, {"out has dtype f32", "q has dtype bf16"});
  Tensor16 dq(DType::bf16, 1, 8, 2, 8, Layout::bthd), dk(DType::bf16, 1, 8, 1, 8, Layout::bthd);
  StridedTensor dv32(1, 8, 1, 8, Layout::bthd);
  expect_error(
      [&] {
        attention_backward(in.q.view, in.k.view, in.v.view, out.view, lse_view, out.view, dq.view,
                           dk.view, dv32.view);
      },
      ErrorCode::invalid_argument, {"attention_backward", "dv has dtype f32", "q has dtype bf16"});
  // lse stays f32: a bf16 lse is unsupported.
  TensorView lse16 = lse_view;
  lse16.dtype = DType::bf16;
  expect_error([&] { attention_forward(in.q.view, in.k.view, in.v.view, out.view, lse16); },
               ErrorCode::unsupported, {"attention_forward", "lse has dtype bf16"});
  // Other dtypes are unsupported for attention tensors.
  TensorView qb = in.q.view;
  qb.dtype = DType::i32;
  expect_error([&] { attention_forward(qb, in.k.view, in.v.view, out.view); },
               ErrorCode::unsupported,
               {"attention_forward", "q has dtype i32", "f32, bf16 or f16"});
  // Varlen.
  const std::vector<std::int64_t> cu{0, 8};
  const ConstTensorView c{cu.data(), DType::i64, 1, {2, 1, 1, 1}, {1, 0, 0, 0}};
  expect_error(
      [&] {
        attention_forward_varlen(in.q.rank3(), in.k.rank3(), in.v.rank3(), c, c, outh.rank3());
      },
      ErrorCode::invalid_argument, {"attention_forward_varlen", "out has dtype f16"});
  // Decode: out must have q's dtype.
  KVCache cache({1, 1, 1, 8, 16, DType::f32, 0, 0});
  StridedTensor kv(1, 4, 1, 8, Layout::bthd);
  kv.fill_random(rng);
  cache.append(0, 0, kv.view, kv.view);
  expect_error([&] { attention_decode(in.q.view, cache, 0, out32.view); },
               ErrorCode::invalid_argument, {"attention_decode", "out has dtype f32"});
}

}  // namespace
}  // namespace tokenmix::testing
