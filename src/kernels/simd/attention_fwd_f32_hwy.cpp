// src/kernels/simd/attention_fwd_f32_hwy.cpp — fused flash-attention forward, fp32, SIMD.
//
// Compiled once per x86 target (AVX-512 = Highway's AVX3, AVX2+FMA) by Highway's
// foreach_target mechanism; the public API picks the target explicitly (runtime.hpp), so a
// caller can force a lower path. Exact attention (SPEC 4.2–4.5, 4.8); no T×T matrix.
//
// Work unit: (batch b, KV head j, a chunk of the g query heads of group j, a block of query
// positions). The unit's query rows — every (head, position) pair — are stacked in the SIMD
// lanes: row i ↦ (head h0 + i / Mq, position t0 + i % Mq), M = V·N lanes in all. All g heads of
// a group thus read each K/V tile once (GQA: K/V traffic does not grow with g).
//
// With queries in lanes, both products are one register-blocked microkernel
//   C[R rows][M lanes] (+)= Σ_k A_r[k] · B[k][M lanes]      (A broadcast, B vector loads)
//   Sᵀ = K_tile Qᵀ :  rows = keys u,       k = d,   A = K rows (input, unpacked), B = s·Qᵀ  (4.2)
//   Oᵀ += V_tileᵀ Pᵀ:  rows = features d,   k = u,   A = V columns (input),        B = Pᵀ    (4.5)
// and the online softmax (running max m, running sum l, rescale of Oᵀ by e^{m_old − m_new})
// works lane-wise: the row maximum over keys is a vertical max over rows of Sᵀ (4.4).
// Key tiles above the causal diagonal are never visited; only tiles crossing it are masked (4.3).
//
// exp: Highway's contrib Exp, max error 1 ULP on float32, returns exactly 0 below its range
// (so e^{−∞} = 0 and masked keys contribute exactly nothing).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/simd/attention_fwd_f32_hwy.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// clang-format: the two includes below must follow foreach_target.h
#include "hwy/highway.h"
#include "hwy/contrib/math/math-inl.h"
#include "kernels/simd/microkernel-inl.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <omp.h>

#include "hwy/aligned_allocator.h"
#include "kernels/attention_kernels.hpp"
#include "kernels/simd/work_units.hpp"

HWY_BEFORE_NAMESPACE();
namespace tokenmix::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

constexpr std::int64_t kKeyTile = 64;  // keys per tile (Sᵀ tile: kKeyTile × M floats)

void AttentionFwd(const ForwardArgs& args) {
  const AttentionProblem& p = args.p;
  const hn::ScalableTag<float> d;
  const hn::RebindToSigned<decltype(d)> di;
  using VF = hn::Vec<decltype(d)>;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d)), M = kV * N;
  const std::int64_t dh = p.dh;
  const QueryUnits layout(p, M);
  const std::int64_t units = layout.count, mq = layout.mq;
  if (units == 0) return;
  const int team = static_cast<int>(std::clamp<std::int64_t>(p.threads, 1, units));

  // Per-worker scratch (aligned): Qᵀ [dh][M], Oᵀ [dh][M], Sᵀ/Pᵀ [kKeyTile][M], a packed K and V
  // tile [kKeyTile][dh] (used only when d_h is not the unit-stride axis), lane vectors.
  const std::int64_t lane_vecs = 4 * M;
  std::int64_t per_worker = 2 * dh * M + kKeyTile * M + 2 * kKeyTile * dh + lane_vecs;
  per_worker = (per_worker + 63) / 64 * 64;
  auto scratch = hwy::AllocateAligned<float>(static_cast<std::size_t>(team * per_worker));
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#pragma omp parallel for schedule(dynamic, 1) num_threads(team)
  for (std::int64_t unit = 0; unit < units; ++unit) {
    const auto [b, j, h0, heads, t0, positions] = layout(p, unit);

    float* qt = scratch.get() + omp_get_thread_num() * per_worker;  // Qᵀ [dh][M], pre-scaled by s
    float* ot = qt + dh * M;                                      // Oᵀ [dh][M]
    float* st = ot + dh * M;                                      // Sᵀ, then Pᵀ [kKeyTile][M]
    float* k_tile = st + kKeyTile * M;                            // [kKeyTile][dh] if packed
    float* v_tile = k_tile + kKeyTile * dh;                       // [kKeyTile][dh] if packed
    float* m_run = v_tile + kKeyTile * dh;                        // running max per lane [M]
    float* l_run = m_run + M;                                     // running sum per lane [M]
    auto* end_lane = reinterpret_cast<std::int32_t*>(l_run + M);  // visible_end per lane [M]

    // Lane i ↦ (head h0 + i / mq, position t0 + i % mq); lanes past the unit's rows are padding
    // (zero query, all keys visible: finite, then discarded).
    std::int64_t key_end = 0, full_end = p.tk;  // keys any lane sees / every lane sees
    for (std::int64_t i = 0; i < M; ++i) {
      const std::int64_t hl = i / mq, tl = i % mq;
      const bool valid = hl < heads && tl < positions;
      if (valid) {
        const std::int64_t e = std::max<std::int64_t>(0, p.visible_end(t0 + tl));
        key_end = std::max(key_end, e);
        full_end = std::min(full_end, e);
        end_lane[i] = static_cast<std::int32_t>(e);
        const float* q = args.q.row(b, t0 + tl, h0 + hl);
        for (std::int64_t x = 0; x < dh; ++x) qt[x * M + i] = p.scale * q[x * args.q.s3];
      } else {
        end_lane[i] = static_cast<std::int32_t>(p.tk);
        for (std::int64_t x = 0; x < dh; ++x) qt[x * M + i] = 0.0f;
      }
    }
    for (std::int64_t i = 0; i < M; i += N) {
      hn::Store(hn::Set(d, kNegInf), d, m_run + i);
      hn::Store(hn::Zero(d), d, l_run + i);
    }
    std::fill(ot, ot + dh * M, 0.0f);

    for (std::int64_t u0 = 0; u0 < key_end; u0 += kKeyTile) {
      const std::int64_t nt = std::min(kKeyTile, key_end - u0);
      std::int64_t ldk = 0, ldv = 0;
      const float* k_rows = RowsOf(args.k, b, u0, j, nt, dh, k_tile, ldk);
      // Sᵀ[u][i] = Σ_x K[u0+u][x] · (s·Q)[i][x]          (4.2)
      GemmRows(d, nt, k_rows, ldk, 1, qt, M, dh, st, M, false);

      // Mask keys beyond each lane's visible end (only tiles crossing the diagonal)   (4.3)
      if (u0 + nt > full_end) {
        for (std::int64_t u = 0; u < nt; ++u) {
          const auto key = hn::Set(di, static_cast<std::int32_t>(u0 + u));
          for (std::int64_t i = 0; i < M; i += N) {
            const auto visible = hn::RebindMask(d, hn::Lt(key, hn::Load(di, end_lane + i)));
            hn::Store(hn::IfThenElse(visible, hn::Load(d, st + u * M + i), hn::Set(d, kNegInf)), d,
                      st + u * M + i);
          }
        }
      }
      // Online softmax, lane-wise (4.4): m' = max(m, max_u S), P = e^{S − m'},
      // l' = l·e^{m − m'} + Σ_u P, Oᵀ ← Oᵀ·e^{m − m'}. A lane with m' = −∞ uses 0 as its shift.
      for (std::int64_t i = 0; i < M; i += N) {
        VF tile_max = hn::Load(d, st + i);
        for (std::int64_t u = 1; u < nt; ++u) tile_max = hn::Max(tile_max, hn::Load(d, st + u * M + i));
        const VF m_old = hn::Load(d, m_run + i);
        const VF m_new = hn::Max(m_old, tile_max);
        const VF shift = hn::IfThenZeroElse(hn::Eq(m_new, hn::Set(d, kNegInf)), m_new);
        const VF alpha = hn::Exp(d, hn::Sub(m_old, shift));
        VF sum = hn::Zero(d);
        for (std::int64_t u = 0; u < nt; ++u) {
          const VF pu = hn::Exp(d, hn::Sub(hn::Load(d, st + u * M + i), shift));
          hn::Store(pu, d, st + u * M + i);
          sum = hn::Add(sum, pu);
        }
        hn::Store(hn::MulAdd(hn::Load(d, l_run + i), alpha, sum), d, l_run + i);
        hn::Store(m_new, d, m_run + i);
        if (u0 > 0) {
          for (std::int64_t x = 0; x < dh; ++x) hn::Store(hn::Mul(hn::Load(d, ot + x * M + i), alpha), d, ot + x * M + i);
        }
      }
      // Oᵀ[x][i] += Σ_u V[u0+u][x] · Pᵀ[u][i]          (4.5)
      const float* v_rows = RowsOf(args.v, b, u0, j, nt, dh, v_tile, ldv);
      GemmRows(d, dh, v_rows, 1, ldv, st, M, nt, ot, M, true);
    }

    // O = Oᵀ / l (transposed back), L = m + log l; a lane that saw no key gives 0 and −∞.
    for (std::int64_t i = 0; i < heads * mq; ++i) {
      const std::int64_t hl = i / mq, tl = i % mq;
      if (tl >= positions) continue;
      const std::int64_t h = h0 + hl, t = t0 + tl;
      const float l = l_run[i];
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      float* out = args.out.row(b, t, h);
      for (std::int64_t x = 0; x < dh; ++x) out[x * args.out.s3] = ot[x * M + i] * inv;
      if (args.lse.data != nullptr) {
        args.lse.data[b * args.lse.s0 + h * args.lse.s1 + t * args.lse.s2] =
            l > 0.0f ? m_run[i] + std::log(l) : kNegInf;
      }
    }
  }
}

}  // namespace tokenmix::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace tokenmix::kernels {

ForwardKernel simd_forward_kernel(Isa isa) { return TOKENMIX_SIMD_KERNEL_FOR(isa, AttentionFwd); }

}  // namespace tokenmix::kernels
#endif  // HWY_ONCE
