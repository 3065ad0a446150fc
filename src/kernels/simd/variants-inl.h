// src/kernels/simd/variants-inl.h — the element-wise score terms of the SIMD kernels (SPEC
// "Score variants used by real models"): S = cap(z) + b_h(t, u) + bias, or −∞ where a general
// boolean mask excludes the key. Applied in one pass over a score tile that the microkernel has
// just written, only when AttentionProblem::var.elementwise(); the key ranges (causal mask,
// window, key lengths, interval-shaped masks) are handled by the kernels' tile loops instead.
//
// Two orientations, one formula (forward and backward recompute bitwise the same S):
//   * query lanes (forward, backward dQ pass): tile Sᵀ[key u][lane i], per-lane slope, position
//     and mask offset, one key per tile row;
//   * key lanes (backward dK/dV pass): tile S[row r][lane i], one query row per tile row; the
//     decode's rows too (ElementwiseDecodeRow: cap and ALiBi, its masks are key ranges).
// cap(z) = c·tanh(z / c) with TanhRational (tanh-inl.h: rational, a few ULP, ±∞ → ±c, NaN →
// NaN) on the tile of z / c (the kernels scale q·k by s / c, ScoreScale);
// ALiBi −m_h·(p(t) − u) as one FMA on the exact integer distance. With `dcap` the pass also
// stores ∂S/∂z = 1 − tanh²(z / c) for the backward's chain rule; with `keep` (boolean masks) it
// stores 1 where the mask lets the key in and 0 where it does not, so later selects (dS, and the
// products that must not take 0 · NaN from an excluded key) can leave the pair out.
//
// Highway "-inl" header: included once per target from a foreach_target translation unit, after
// microkernel-inl.h.
#if defined(TOKENMIX_KERNELS_SIMD_VARIANTS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TOKENMIX_KERNELS_SIMD_VARIANTS_INL_H_
#undef TOKENMIX_KERNELS_SIMD_VARIANTS_INL_H_
#else
#define TOKENMIX_KERNELS_SIMD_VARIANTS_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <limits>

#include "hwy/highway.h"
#include "kernels/attention_kernels.hpp"
#include "kernels/simd/tanh-inl.h"

HWY_BEFORE_NAMESPACE();
namespace tokenmix::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// The factor the kernels apply to q·k before the element-wise pass: s, or s / c with
// soft-capping, so the tile holds z / c and the pass skips a multiply per score (the backward's
// gradients keep s: dQ = s·dz K, dK = s·dzᵀ Q with dz the gradient with respect to z = s·q·k).
inline float ScoreScale(const AttentionProblem& p) {
  return p.var.softcap > 0.0f
             ? static_cast<float>(static_cast<double>(p.scale) / static_cast<double>(p.var.softcap))
             : p.scale;
}

// cap(z) and ALiBi on one vector: → c·tanh(z/c) − slope·dist (each term only when on); with
// capping the vector holds z / c on entry (ScoreScale), else z. *dcap ← 1 − tanh²(z/c) when
// dcap is non-null and capping is on.
template <class D, class V = hn::Vec<D>>
HWY_INLINE V CapAlibi(D d, V z, bool cap, V c, bool alibi, V slope, V dist, V* dcap) {
  if (cap) {
    const V th = TanhRational(d, z);
    if (dcap != nullptr) *dcap = hn::NegMulAdd(th, th, hn::Set(d, 1.0f));
    z = hn::Mul(c, th);
  }
  if (alibi) z = hn::NegMulAdd(slope, dist, z);  // b_h(t, u) = −m_h · (p(t) − u)
  return z;
}

// Query lanes. st: Sᵀ rows [0, nt) of keys key0.. [nt][M] (z on entry, S on exit). Per lane i:
// slope[i], pos[i] = p(t) (int32), mask_base[i] = b·m0 + h·m1 + t·m2; is_row(i) says whether
// the lane holds a row (padding lanes keep their scores; their keep = 1). dcap, keep: [nt][M]
// or null.
template <class D, class IsRow>
HWY_NOINLINE void ElementwiseQueryLanes(D d, const ScoreVariants& var, float* HWY_RESTRICT st,
                                        std::int64_t M, std::int64_t nt, std::int64_t key0,
                                        const float* slope, const std::int32_t* pos,
                                        const std::int64_t* mask_base, const IsRow& is_row,
                                        float* HWY_RESTRICT dcap, float* HWY_RESTRICT keep) {
  using V = hn::Vec<D>;
  const hn::RebindToSigned<D> di;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const bool cap = var.softcap > 0.0f, alibi = var.alibi != nullptr;
  if (cap || alibi) {
    const V c = hn::Set(d, var.softcap);
    for (std::int64_t u = 0; u < nt; ++u) {
      const auto key = hn::Set(di, static_cast<std::int32_t>(key0 + u));
      for (std::int64_t i = 0; i < M; i += N) {
        V slope_v = hn::Zero(d), dist = hn::Zero(d), dc = hn::Zero(d);
        if (alibi) {
          slope_v = hn::Load(d, slope + i);
          dist = hn::ConvertTo(d, hn::Sub(hn::Load(di, pos + i), key));
        }
        const V s = CapAlibi(d, hn::Load(d, st + u * M + i), cap, c, alibi, slope_v, dist,
                             dcap != nullptr ? &dc : nullptr);
        hn::Store(s, d, st + u * M + i);
        if (cap && dcap != nullptr) hn::Store(dc, d, dcap + u * M + i);
      }
    }
  }
  if (var.mask_kind == MaskKind::none) return;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  if (keep != nullptr) std::fill(keep, keep + nt * M, 1.0f);
  for (std::int64_t i = 0; i < M; ++i) {
    if (!is_row(i)) continue;
    const std::int64_t base = mask_base[i] + key0 * var.m3;
    if (var.mask_kind == MaskKind::boolean) {
      const auto* m = static_cast<const std::uint8_t*>(var.mask) + base;
      for (std::int64_t u = 0; u < nt; ++u) {
        if (m[u * var.m3] == 0) {
          st[u * M + i] = kNegInf;
          if (keep != nullptr) keep[u * M + i] = 0.0f;
        }
      }
    } else {
      const auto* m = static_cast<const float*>(var.mask) + base;
      for (std::int64_t u = 0; u < nt; ++u) st[u * M + i] += m[u * var.m3];
    }
  }
}

// Key lanes, one query row (b, h, t) of p: s is the row's scores for keys key0 + i, i < M
// (z on entry, S on exit); lanes i ≥ keys are padding (past T_k: no mask read, keep = 1).
// dcap, keep: [M] or null.
template <class D>
HWY_INLINE void ElementwiseKeyLanes(D d, const AttentionProblem& p, float* HWY_RESTRICT s,
                                    std::int64_t M, std::int64_t keys, std::int64_t key0,
                                    std::int64_t b, std::int64_t h, std::int64_t t,
                                    float* HWY_RESTRICT dcap, float* HWY_RESTRICT keep) {
  using V = hn::Vec<D>;
  const ScoreVariants& var = p.var;
  const hn::RebindToSigned<D> di;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const bool cap = var.softcap > 0.0f, alibi = var.alibi != nullptr;
  if (cap || alibi) {
    const V c = hn::Set(d, var.softcap);
    const V slope = hn::Set(d, alibi ? var.alibi[h] : 0.0f);
    const std::int32_t rel = static_cast<std::int32_t>(p.position(t) - key0);  // p(t) − key0
    for (std::int64_t i = 0; i < M; i += N) {
      V dist = hn::Zero(d), dc = hn::Zero(d);
      if (alibi) {
        dist = hn::ConvertTo(
            d, hn::Sub(hn::Set(di, rel - static_cast<std::int32_t>(i)), hn::Iota(di, 0)));
      }
      const V x = CapAlibi(d, hn::Load(d, s + i), cap, c, alibi, slope, dist,
                           dcap != nullptr ? &dc : nullptr);
      hn::Store(x, d, s + i);
      if (cap && dcap != nullptr) hn::Store(dc, d, dcap + i);
    }
  }
  if (var.mask_kind == MaskKind::none) return;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  if (keep != nullptr) std::fill(keep, keep + M, 1.0f);
  const std::int64_t base = p.mask_offset(b, h, t, key0);
  if (var.mask_kind == MaskKind::boolean) {
    const auto* m = static_cast<const std::uint8_t*>(var.mask) + base;
    for (std::int64_t i = 0; i < keys; ++i) {
      if (m[i * var.m3] == 0) {
        s[i] = kNegInf;
        if (keep != nullptr) keep[i] = 0.0f;
      }
    }
  } else {
    const auto* m = static_cast<const float*>(var.mask) + base;
    for (std::int64_t i = 0; i < keys; ++i) s[i] += m[i * var.m3];
  }
}

// Decode (key lanes, one row of a decode unit, decode_skeleton-inl.h): the row's scores s[0, nv)
// for keys u0 + i, S = s·q·k on entry (not z / c: a quantized cache's key scales multiply S after
// the product, so the scale cannot carry 1 / c), S on exit: cap(S) = c·tanh(S · (1 / c)), then
// ALiBi with rel = u0 − p (p the row's position): the distance p − u = −(rel + i + lane), as the
// negation of the exact integer lanes (the same FMA as S + m_h (u − p)).
template <class D>
HWY_INLINE void ElementwiseDecodeRow(D d, float* HWY_RESTRICT s, std::int64_t nv, bool cap,
                                     hn::Vec<D> c, hn::Vec<D> inv_c, bool alibi, float slope,
                                     std::int64_t rel) {
  using V = hn::Vec<D>;
  if (!cap && !alibi) return;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const V slope_v = hn::Set(d, slope);
  for (std::int64_t i = 0; i < nv; i += N) {
    V z = hn::Load(d, s + i);
    if (cap) z = hn::Mul(z, inv_c);
    const V dist = alibi ? hn::Neg(hn::Iota(d, static_cast<float>(rel + i))) : hn::Zero(d);
    hn::Store(CapAlibi<D, V>(d, z, cap, c, alibi, slope_v, dist, nullptr), d, s + i);
  }
}

// Decode's mask (4.3 and the sliding window) on one row's scores s[0, nv) for keys u0 + i: −∞
// for lanes outside [lo, hi) (lo = begin − u0, hi = end − u0, clamped to the 64-key tile).
template <class D>
HWY_INLINE void MaskDecodeRow(D d, float* HWY_RESTRICT s, std::int64_t nv, std::int64_t lo,
                              std::int64_t hi) {
  const hn::RebindToSigned<D> di;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  constexpr std::int64_t kTile = kDecodeKeyTile;
  // lane ≥ lo ⟺ lo − 1 < lane (no integer Ge here)
  const auto lo_minus_1 =
      hn::Set(di, static_cast<std::int32_t>(std::clamp<std::int64_t>(lo, 0, kTile) - 1));
  const auto hi_v = hn::Set(di, static_cast<std::int32_t>(std::clamp<std::int64_t>(hi, 0, kTile)));
  const auto neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
  for (std::int64_t i = 0; i < nv; i += N) {
    const auto lane = hn::Iota(di, static_cast<std::int32_t>(i));
    const auto visible = hn::RebindMask(d, hn::And(hn::Lt(lo_minus_1, lane), hn::Lt(lane, hi_v)));
    hn::Store(hn::IfThenElse(visible, hn::Load(d, s + i), neg_inf), d, s + i);
  }
}

}  // namespace tokenmix::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard toggle
