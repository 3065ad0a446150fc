// src/kernels/simd/attention_fwd_f32_hwy.cpp — fused flash-attention forward, fp32, SIMD.
//
// Compiled once per target (x86: AVX-512 = Highway's AVX3, AVX2+FMA; AArch64: NEON) by Highway's
// foreach_target mechanism and exported per target as attention_fwd_f32_avx512 / _avx2 / _neon;
// the
// registry (dispatch/registry.cpp) maps the resolved path to one of them. Exact attention
// (SPEC 4.2–4.5, 4.8); no T×T matrix.
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
// Score variants (SPEC "Score variants used by real models"): each lane (row) sees one interval
// of keys, AttentionProblem::key_range (causal mask 4.3, window, key length, interval-shaped
// mask). A lane block visits only the key tiles some lane sees — from the least begin to the
// greatest end, so a sliding window costs O(W) keys per row — and masks only the tiles that
// cross an end of some lane's interval (a select: keys outside take no part). Soft-capping, ALiBi
// and a general mask are one element-wise pass over Sᵀ (variants-inl.h), only when present
// (with soft-capping, scale·Q is (s / c)·Q, so the pass starts from z / c: ScoreScale); sinks
// start each lane's online softmax at m = σ_h, l = 1 (so L = log(e^{σ_h} + Σ e^S)).
// Dropout (docs/design.md D.1–D.4, dropout-inl.h): after a tile's P is summed into l, each lane's
// weights are multiplied by its rows' keep mask Z (Philox per lane and group of 4 keys); O is
// divided by l and multiplied by 1 / (1 − p).
//
// exp: SoftmaxExp (exp-inl.h), 0.85 ULP, exactly 0 below −87.34 (so e^{−∞} = 0 and masked
// keys contribute exactly nothing); through ExpNaN, so a NaN score gives a NaN weight
// (nonfinite-inl.h). Non-finite inputs (SPEC 4.3): a NaN or +∞ score makes
// the lane's l NaN, hence O and L NaN; keys a lane does not see take no part (selected away).
// Highway's per-target re-inclusion: these includes must follow foreach_target.h, in order.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/simd/attention_fwd_f32_hwy.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "kernels/simd/dropout-inl.h"
#include "kernels/simd/microkernel-inl.h"
#include "kernels/simd/nonfinite-inl.h"
#include "kernels/simd/variants-inl.h"
// clang-format on

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "kernels/attention_kernels.hpp"
#include "kernels/nonfinite.hpp"
#include "kernels/simd/dpbf16.hpp"
#include "kernels/simd/work_units.hpp"

HWY_BEFORE_NAMESPACE();
namespace tokenmix::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

constexpr std::int64_t kKeyTile = KVTileLayout::kKeyTile;  // keys per tile (Sᵀ: kKeyTile × M)
constexpr std::int64_t kBlocksPerUnit = 4;  // lane blocks sharing each K/V tile (QueryUnits)

// kDp: packs keys [u0, u0 + tile) of KV head j as bf16 bits, K as rows [tile][dh2] (d_h padded
// with a zero to even) and V transposed [dh][ldv] (keys contiguous, so key pairs are adjacent;
// two zero keys past the tile). Returns false if V holds a NaN or ±∞ (exponent all ones).
inline bool PackBf16Tile(const Strided<const bf16_t*>& k, const Strided<const bf16_t*>& v,
                         std::int64_t b, std::int64_t u0, std::int64_t j, std::int64_t tile,
                         std::int64_t dh, std::int64_t dh2, std::int64_t ldv, std::uint16_t* k16,
                         std::uint16_t* vt16) {
  for (std::int64_t u = 0; u < tile; ++u) {
    const bf16_t* row = k.row(b, u0 + u, j);
    std::uint16_t* out = k16 + u * dh2;
    for (std::int64_t x = 0; x < dh; ++x) out[x] = row[x * k.s3].bits;
    if (dh2 > dh) out[dh] = 0;
  }
  std::uint16_t nonfinite = 0;
  for (std::int64_t u = 0; u < tile; ++u) {
    const bf16_t* row = v.row(b, u0 + u, j);
    for (std::int64_t x = 0; x < dh; ++x) {
      const std::uint16_t bits = row[x * v.s3].bits;
      vt16[x * ldv + u] = bits;
      nonfinite |= static_cast<std::uint16_t>((bits & 0x7f80u) == 0x7f80u);
    }
  }
  for (std::int64_t x = 0; x < dh; ++x) vt16[x * ldv + tile] = vt16[x * ldv + tile + 1] = 0;
  return nonfinite == 0;
}

// The kernel for activations of type T (float, bf16_t, f16_t; SPEC "Reduced precision"): Q is
// widened as it is loaded into scale·Qᵀ, K and V as their tiles are packed (DenseRows), so the
// products and the softmax are the fp32 kernel's, in fp32; O is rounded once, on store.
//
// kDp (path avx512_bf16, T = bf16_t, AVX-512 target only): both products run on bf16 operands
// with vdpbf16ps (dpbf16.hpp), fp32 accumulation: Sᵀ = s · (K Qᵀ) with the unscaled bf16 Q and K
// (the scale is applied to the fp32 product, so no extra rounding of Q), and Oᵀ += Vᵀ P̃ᵀ with P̃
// = P rounded to bf16 (FlashAttention's choice; l sums the unrounded fp32 P). The softmax and
// every variant stay the fp32 code above. A V tile holding a NaN or ±∞ runs the widened fp32
// product instead (masking semantics of SPEC 4.3 need the select path there).
template <class T, bool kDp = false>
void AttentionFwdT(const ForwardArgs& fwd) {
  const AttentionProblem& p = fwd.p;
  struct {
    Strided<const T*> q, k, v;
    Strided<T*> out;
    Out lse;
  } const args{as<T>(fwd.q), as<T>(fwd.k), as<T>(fwd.v), as<T>(fwd.out), fwd.lse};
  const hn::ScalableTag<float> d;
  const hn::RebindToSigned<decltype(d)> di;
  using VF = hn::Vec<decltype(d)>;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d)), M = kV * N;
  const std::int64_t dh = p.dh;
  const QueryUnits layout(p, M, kBlocksPerUnit);
  const std::int64_t units = layout.count, lane_blocks = layout.blocks;
  if (units == 0) return;
  const int team = team_size(p.threads, units);

  // Per-worker scratch: per lane block scale·Qᵀ [dh][M], Oᵀ [dh][M] and lane vectors (running max,
  // running sum, visible end); shared Sᵀ/Pᵀ [kKeyTile][M], the packed K and V tile
  // [kKeyTile][dh] and the tile's rescale factors [M].
  ScratchLayout scratch_layout(p.site);
  struct BlockSlots {
    Slot<float> qt, ot, m_run, l_run, slope;
    Slot<std::int32_t> begin_lane, end_lane, pos;
    Slot<std::int64_t> mask_base;
    Slot<std::uint32_t> drop_t, drop_bh;
  } block_slots[kBlocksPerUnit];
  const ScoreVariants& var = p.var;
  const bool elementwise = var.elementwise();
  const float score_scale = ScoreScale(p);  // s, or s / c with soft-capping (variants-inl.h)
  const bool keep_mask = var.mask_kind == MaskKind::boolean;
  const Dropout& drop = var.dropout;
  for (std::int64_t lb = 0; lb < lane_blocks; ++lb) {
    BlockSlots& bs = block_slots[lb];
    bs.qt = scratch_layout.add<float>(scratch_mul(dh, M, p.site, "scale*Q^T"));
    bs.ot = scratch_layout.add<float>(scratch_mul(dh, M, p.site, "O^T"));
    bs.m_run = scratch_layout.add<float>(M);
    bs.l_run = scratch_layout.add<float>(M);
    bs.begin_lane = scratch_layout.add<std::int32_t>(M);
    bs.end_lane = scratch_layout.add<std::int32_t>(M);
    bs.slope = scratch_layout.add<float>(elementwise ? M : 0);             // ALiBi slope per lane
    bs.pos = scratch_layout.add<std::int32_t>(elementwise ? M : 0);        // p(t) per lane
    bs.mask_base = scratch_layout.add<std::int64_t>(elementwise ? M : 0);  // b·m0 + h·m1 + t·m2
    // Dropout: each lane's Philox counter words t and row_word(b, h) (D.3)
    bs.drop_t = scratch_layout.add<std::uint32_t>(drop.active ? M : 0);
    bs.drop_bh = scratch_layout.add<std::uint32_t>(drop.active ? M : 0);
  }
  const auto keep_slot = scratch_layout.add<float>(keep_mask ? kKeyTile * M : 0);
  const auto st_slot = scratch_layout.add<float>(kKeyTile * M);
  const auto k_tile_slot = scratch_layout.add<float>(scratch_mul(kKeyTile, dh, p.site, "K tile"));
  const auto v_tile_slot = scratch_layout.add<float>(scratch_mul(kKeyTile, dh, p.site, "V tile"));
  const auto alphas_slot = scratch_layout.add<float>(M);
  // kDp: Q pairs per lane block [dh2 / 2][M][2], the K tile [kKeyTile][dh2] and Vᵀ
  // [dh][kKeyTile + 2] (pairs along keys; 2 zero keys past the tile) as bf16 bits, P̃ pairs.
  const std::int64_t dh2 = (dh + 1) / 2 * 2, ldv = kKeyTile + 2;
  Slot<std::uint16_t> qp_slot[kBlocksPerUnit];
  for (std::int64_t lb = 0; lb < lane_blocks; ++lb)
    qp_slot[lb] = scratch_layout.add<std::uint16_t>(kDp ? dh2 * M : 0);
  const auto k16_slot = scratch_layout.add<std::uint16_t>(kDp ? kKeyTile * dh2 : 0);
  const auto vt16_slot = scratch_layout.add<std::uint16_t>(kDp ? dh * ldv : 0);
  const auto p16_slot = scratch_layout.add<std::uint16_t>(kDp ? kKeyTile * M : 0);
  if constexpr (kDp) HWY_ASSERT(M == dpbf16::kLanes);
  const ScratchArena scratch(scratch_layout, team, "the per-worker scratch");
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  const auto team_work = [&]() HWY_ATTR {
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t unit = 0; unit < units; ++unit) {
      const int worker = omp_get_thread_num();
      float* st = scratch.at(st_slot, worker);          // Sᵀ, then Pᵀ [kKeyTile][M]
      float* k_tile = scratch.at(k_tile_slot, worker);  // K rows u0.. packed [kKeyTile][dh]
      float* v_tile = scratch.at(v_tile_slot, worker);  // V rows u0.. packed [kKeyTile][dh]
      float* alphas = scratch.at(alphas_slot, worker);  // e^{m − m'} per lane [M] of the tile
      float* keep = keep_mask ? scratch.at(keep_slot, worker) : nullptr;    // boolean mask [u][M]
      std::uint16_t* k16 = kDp ? scratch.at(k16_slot, worker) : nullptr;    // [kKeyTile][dh2]
      std::uint16_t* vt16 = kDp ? scratch.at(vt16_slot, worker) : nullptr;  // [dh][ldv]
      std::uint16_t* p16 = kDp ? scratch.at(p16_slot, worker) : nullptr;    // [kKeyTile / 2][M][2]
      struct BlockState : LaneBlock {
        float *qt, *ot, *m_run, *l_run;  // scale·Qᵀ [dh][M], Oᵀ [dh][M], max and sum per lane [M]
        float* slope;                    // element-wise terms, per lane [M]: ALiBi slope,
        std::int32_t* pos;               // position p(t),
        std::int64_t* mask_base;         // mask offset of (b, h, t)
        std::uint16_t* qp;               // kDp: Q pairs [dh2 / 2][M][2] (bf16 bits, unscaled)
        std::uint32_t *drop_t, *drop_bh;  // dropout: counter words per lane [M]
      };
      BlockState blocks[kBlocksPerUnit] = {};
      std::int64_t unit_key_begin = p.tk, unit_key_end = 0;
      for (std::int64_t lb = 0; lb < lane_blocks; ++lb) {
        BlockState& bs = blocks[lb];
        bs.blk = layout(p, unit, lb);
        bs.qt = scratch.at(block_slots[lb].qt, worker);
        bs.ot = scratch.at(block_slots[lb].ot, worker);
        bs.m_run = scratch.at(block_slots[lb].m_run, worker);
        bs.l_run = scratch.at(block_slots[lb].l_run, worker);
        bs.begin_lane = scratch.at(block_slots[lb].begin_lane, worker);
        bs.end_lane = scratch.at(block_slots[lb].end_lane, worker);
        bs.slope = scratch.at(block_slots[lb].slope, worker);
        bs.pos = scratch.at(block_slots[lb].pos, worker);
        bs.mask_base = scratch.at(block_slots[lb].mask_base, worker);
        bs.qp = kDp ? scratch.at(qp_slot[lb], worker) : nullptr;
        bs.drop_t = drop.active ? scratch.at(block_slots[lb].drop_t, worker) : nullptr;
        bs.drop_bh = drop.active ? scratch.at(block_slots[lb].drop_bh, worker) : nullptr;
        // Padding lanes: zero query (the whole Qᵀ zeroed at once, not lane by lane: a tiny call
        // is mostly padding lanes), all keys visible (finite, then discarded).
        if (bs.blk.heads * layout.mq < M || bs.blk.positions < layout.mq)
          std::fill(bs.qt, bs.qt + dh * M, 0.0f);
        const bool has_rows = SetUpLanes(
            p, layout, bs, static_cast<std::int32_t>(p.tk),
            [&](std::int64_t i, std::int64_t h, std::int64_t t, KeyRange) HWY_ATTR {
              LoadColumn(args.q.row(bs.blk.b, t, h), args.q.s3, dh, score_scale, bs.qt, M, i);
              if constexpr (kDp) {
                const T* q = args.q.row(bs.blk.b, t, h);
                for (std::int64_t x = 0; x < dh2; ++x)
                  bs.qp[((x / 2) * M + i) * 2 + x % 2] = x < dh ? q[x * args.q.s3].bits : 0;
              }
              if (elementwise) {
                bs.slope[i] = var.alibi != nullptr ? var.alibi[h] : 0.0f;
                bs.pos[i] = static_cast<std::int32_t>(p.position(t));
                bs.mask_base[i] = p.mask_offset(bs.blk.b, h, t, 0);
              }
              if (drop.active) {
                bs.drop_t[i] = static_cast<std::uint32_t>(t);
                bs.drop_bh[i] = drop.row_word(bs.blk.b, h);
              }
            },
            [&](std::int64_t i) HWY_ATTR {
              if constexpr (kDp) {
                for (std::int64_t x = 0; x < dh2; ++x) bs.qp[((x / 2) * M + i) * 2 + x % 2] = 0;
              }
              if (elementwise) {
                bs.slope[i] = 0.0f;
                bs.pos[i] = 0;
                bs.mask_base[i] = 0;
              }
              if (drop.active) bs.drop_t[i] = bs.drop_bh[i] = 0;  // (a padding lane's P is unused)
            });
        if (!has_rows) continue;
        for (std::int64_t i = 0; i < M; i += N) {
          hn::Store(hn::Set(d, kNegInf), d, bs.m_run + i);
          hn::Store(hn::Zero(d), d, bs.l_run + i);
        }
        if (var.sinks != nullptr) {  // a sink joins the softmax as its first term: m = σ_h, l = 1
          ForEachRow(layout, bs.blk, [&](std::int64_t i, std::int64_t h, std::int64_t) HWY_ATTR {
            bs.m_run[i] = var.sinks[h];
            bs.l_run[i] = 1.0f;
          });
        }
        std::fill(bs.ot, bs.ot + dh * M, 0.0f);
        if (bs.key_end > bs.key_begin) {
          unit_key_begin = std::min(unit_key_begin, bs.key_begin);
          unit_key_end = std::max(unit_key_end, bs.key_end);
        }
      }
      const std::int64_t b = blocks[0].blk.b, j = blocks[0].blk.j;

      for (std::int64_t u0 = unit_key_begin; u0 < unit_key_end; u0 += kKeyTile) {
        // The tile's K and V rows, packed contiguous once for all lane blocks of the unit.
        const std::int64_t tile = std::min(kKeyTile, unit_key_end - u0);
        const float* k_rows = nullptr;           // [tile][dh]
        const float* v_rows = nullptr;           // [tile][dh]
        [[maybe_unused]] bool v_finite = false;  // kDp: the bf16 P̃·V product may run on this tile
        if constexpr (kDp) {
          v_finite = PackBf16Tile(args.k, args.v, b, u0, j, tile, dh, dh2, ldv, k16, vt16);
          if (!v_finite) v_rows = DenseRows(args.v, b, u0, j, tile, dh, v_tile, VecWiden());
        } else {
          k_rows = DenseRows(args.k, b, u0, j, tile, dh, k_tile, VecWiden());
          v_rows = DenseRows(args.v, b, u0, j, tile, dh, v_tile, VecWiden());
        }
        for (std::int64_t lb = 0; lb < lane_blocks; ++lb) {
          BlockState& bs = blocks[lb];
          // Skip a tile no lane of this block sees (above the causal diagonal, before the window).
          if (u0 >= bs.key_end || u0 + tile <= bs.key_begin) continue;
          // The block's keys in this tile: k0 + [0, nt) (k0 = u0 unless the block starts later).
          const std::int64_t ua = std::max(u0, bs.key_begin) - u0;
          const std::int64_t k0 = u0 + ua, nt = std::min(tile, bs.key_end - u0) - ua;
          // Sᵀ[u][i] = Σ_x K[k0+u][x] · (scale·Q)[i][x]          (4.2)
          if constexpr (kDp) {
            dpbf16::GemmRows(nt, k16 + ua * dh2, dh2, bs.qp, dh2 / 2, st, M, false, nullptr,
                             score_scale);
          } else {
            GemmRows(d, nt, k_rows + ua * dh, dh, 1, bs.qt, M, dh, st, M, false);
          }
          if (elementwise) {  // cap, ALiBi, general mask ("Score variants")
            const auto is_row = [&](std::int64_t i) {
              return i / layout.mq < bs.blk.heads && i % layout.mq < bs.blk.positions;
            };
            ElementwiseQueryLanes(d, var, st, M, nt, k0, bs.slope, bs.pos, bs.mask_base, is_row,
                                  nullptr, keep);
          }

          // Mask keys outside each lane's range (only tiles crossing an end of some range)  (4.3)
          const bool crosses = bs.partial(k0, k0 + nt);
          if (crosses) {
            for (std::int64_t u = 0; u < nt; ++u) {
              const auto key = hn::Set(di, static_cast<std::int32_t>(k0 + u));
              for (std::int64_t i = 0; i < M; i += N) {
                const auto visible =
                    hn::RebindMask(d, hn::AndNot(hn::Lt(key, hn::Load(di, bs.begin_lane + i)),
                                                 hn::Lt(key, hn::Load(di, bs.end_lane + i))));
                hn::Store(hn::IfThenElse(visible, hn::Load(d, st + u * M + i), hn::Set(d, kNegInf)),
                          d, st + u * M + i);
              }
            }
          }
          // Online softmax, lane-wise (4.4): m' = max(m, max_u S), P = e^{S − m'},
          // l' = l·e^{m − m'} + Σ_u P, Oᵀ ← Oᵀ·e^{m − m'}. A lane with m' = −∞ uses 0 as its shift.
          for (std::int64_t i = 0; i < M; i += N) {
            VF tile_max = hn::Load(d, st + i);
            for (std::int64_t u = 1; u < nt; ++u)
              tile_max = hn::Max(tile_max, hn::Load(d, st + u * M + i));
            const VF m_old = hn::Load(d, bs.m_run + i);
            const VF m_new = hn::Max(m_old, tile_max);
            const VF shift = hn::IfThenZeroElse(hn::Eq(m_new, hn::Set(d, kNegInf)), m_new);
            const VF alpha = ExpNaN(d, hn::Sub(m_old, shift));
            VF sum = hn::Zero(d);
            for (std::int64_t u = 0; u < nt; ++u) {
              const VF pu = ExpNaN(d, hn::Sub(hn::Load(d, st + u * M + i), shift));
              hn::Store(pu, d, st + u * M + i);
              sum = hn::Add(sum, pu);
            }
            hn::Store(hn::MulAdd(hn::Load(d, bs.l_run + i), alpha, sum), d, bs.l_run + i);
            hn::Store(m_new, d, bs.m_run + i);
            hn::Store(alpha, d, alphas + i);
          }
          // Dropout (D.1): l summed the undropped P above; the values see P ⊙ Z (the 1 / (1 − p)
          // joins 1 / l at the end).
          if (drop.active) DropQueryLanes(d, drop, bs.drop_t, bs.drop_bh, st, M, k0, nt);
          // Oᵀ[x][i] ← Oᵀ[x][i] · e^{m − m'}[i] + Σ_u V[u0+u][x] · Pᵀ[u][i]   (4.4, 4.5; the
          // rescale rides on the microkernel's load of Oᵀ; Oᵀ is still zero on the first tile).
          // Keys outside [full_begin, full_end) (or excluded by a boolean mask) are not seen by
          // every lane: 0 · V must not add a NaN there.
          const auto lane_sees = [&](std::int64_t u, std::int64_t i) {
            const auto key = hn::Set(di, static_cast<std::int32_t>(k0 + u));
            auto seen = hn::RebindMask(d, hn::AndNot(hn::Lt(key, hn::Load(di, bs.begin_lane + i)),
                                                     hn::Lt(key, hn::Load(di, bs.end_lane + i))));
            if (keep != nullptr)
              seen = hn::And(seen, hn::Ne(hn::Load(d, keep + u * M + i), hn::Zero(d)));
            return seen;
          };
          if constexpr (kDp) {
            if (v_finite) {  // Oᵀ ← Oᵀ · e^{m − m'} + Vᵀ P̃ᵀ, P̃ = bf16(P) (zero past the block)
              dpbf16::PackPairs(st, nt, p16);
              dpbf16::GemmRows(dh, vt16 + ua, ldv, p16, (nt + 1) / 2, bs.ot, M, true,
                               k0 > 0 ? alphas : nullptr, 1.0f);
              continue;
            }
          }
          const PartialKeys part = keep != nullptr
                                       ? PartialKeys{0, nt}
                                       : PartialRange(bs.full_begin - k0, bs.full_end - k0, nt);
          GemmRowsMaskedIfNonFinite(d, dh, v_rows + ua * dh, 1, dh, st, M, nt, bs.ot, M, true,
                                    k0 > 0 ? alphas : nullptr, part.lo, part.hi, lane_sees);
        }
      }

      // O = Oᵀ / l (transposed back), L = m + log l; a lane that saw no key gives 0 and −∞ (σ_h
      // with a sink: m = σ_h, l = 1).
      for (std::int64_t lb = 0; lb < lane_blocks; ++lb) {
        const BlockState& bs = blocks[lb];
        const std::int64_t bb = bs.blk.b;
        ForEachRow(layout, bs.blk, [&](std::int64_t i, std::int64_t h, std::int64_t t) HWY_ATTR {
          const float l = bs.l_run[i];
          // l = 0: no finite score; l = NaN: a NaN was read. Dropout: P̃ = P ⊙ Z / (1 − p) (D.1).
          const float inv = drop.active ? inverse_sum(l) * drop.scale : inverse_sum(l);
          StoreColumn(bs.ot, M, i, dh, inv, args.out.row(bb, t, h), args.out.s3);
          if (args.lse.data != nullptr) {
            args.lse.data[bb * args.lse.s0 + h * args.lse.s1 + t * args.lse.s2] =
                l == 0.0f ? kNegInf : bs.m_run[i] + std::log(l);
          }
        });
      }
    }
  };
  RunTeam(team, team_work);
}

void AttentionFwd(const ForwardArgs& args) {
  AttentionFwdT<float>(args);
}
void AttentionFwdBf16(const ForwardArgs& args) {
  AttentionFwdT<bf16_t>(args);
}
void AttentionFwdF16(const ForwardArgs& args) {
  AttentionFwdT<f16_t>(args);
}
// y[i] = f(d, x[i]) for i < n, f an element-wise vector function (the test hooks below).
template <class F>
void MapVectors(const float* x, float* y, std::int64_t n, F f) {
  const hn::ScalableTag<float> d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  std::int64_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(f(d, hn::LoadU(d, x + i)), d, y + i);
  if (i < n) {  // the tail through a zero-padded vector
    HWY_ALIGN float buf[hn::MaxLanes(d)] = {};
    std::copy(x + i, x + n, buf);
    hn::Store(f(d, hn::Load(d, buf)), d, buf);
    std::copy(buf, buf + (n - i), y + i);
  }
}
// Test hook (tests/unit/test_softcap_tanh.cpp): y[i] = the soft-capping tanh of x[i], i < n.
void SoftcapTanh(const float* x, float* y, std::int64_t n) {
  MapVectors(x, y, n, [](auto d, auto v) { return TanhRational(d, v); });
}
// Test hook (tests/unit/test_softmax_exp.cpp): y[i] = the softmax weights' e^x[i] (ExpNaN, the
// function every SIMD kernel applies), i < n.
void SoftmaxExpNaN(const float* x, float* y, std::int64_t n) {
  MapVectors(x, y, n, [](auto d, auto v) { return ExpNaN(d, v); });
}
// Test hook (tests/unit/test_kv_quant.cpp): the microkernel's widening of n quantized KV-cache
// elements q[i] (int8 or fp8 E4M3 bytes, dtype; fp8 in the given reading) to fp32, as the decode
// kernel's products read them: one vector at a time (LoadB, the VN = 1 products) into by_vector
// and kVD = 4 vectors at a time (LoadBRow<4>: fp8's paired or quad widening) into by_row, the
// quad reading's columns put back in order as the decode kernel does (UnsplitQuads). Both hold
// q · kLoadBUnit.
void WidenQuantized(DType dtype, Fp8Reading reading, const std::uint8_t* q, std::int64_t n,
                    float* by_vector, float* by_row) {
  const hn::ScalableTag<float> d;
  constexpr int kRow = 4;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d)), W = kRow * N;
  std::vector<std::uint8_t> in(static_cast<std::size_t>((n + W - 1) / W * W), 0);
  std::copy(q, q + n, in.begin());
  std::vector<float> out_v(in.size()), out_r(in.size());
  const auto run = [&](const auto* p) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(p)>>;
    constexpr bool kQuad =
        std::is_same_v<T, fp8_e4m3_quad_t> || std::is_same_v<T, fp8_e4m3_quad_f16unit_t>;
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(in.size()); i += W) {
      for (int v = 0; v < kRow; ++v) hn::StoreU(LoadB(d, p + i + v * N), d, &out_v[i + v * N]);
      hn::Vec<decltype(d)> bv[kRow];
      LoadBRow<kRow>(d, p + i, bv);
      for (int v = 0; v < kRow; ++v) hn::StoreU(bv[v], d, &out_r[i + v * N]);
      if constexpr (kQuad && kSplitBuilt) UnsplitQuads(&out_r[i], W, 1, W);
    }
  };
  if (dtype == DType::int8) {
    run(reinterpret_cast<const std::int8_t*>(in.data()));
  } else if (reading == Fp8Reading::direct) {
    run(reinterpret_cast<const fp8_e4m3_quad_t*>(in.data()));  // LoadB: the direct widening
  } else if (reading == Fp8Reading::quad_f16unit) {
    run(reinterpret_cast<const fp8_e4m3_quad_f16unit_t*>(in.data()));
  } else {
    run(reinterpret_cast<const fp8_e4m3_t*>(in.data()));
  }
  std::copy(out_v.begin(), out_v.begin() + n, by_vector);
  std::copy(out_r.begin(), out_r.begin() + n, by_row);
}
#if HWY_TARGET == HWY_AVX3
void AttentionFwdDpBf16(const ForwardArgs& args) {  // path avx512_bf16
  AttentionFwdT<bf16_t, true>(args);
}
#endif

}  // namespace tokenmix::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace tokenmix::kernels {

const ForwardKernel attention_fwd_f32_avx512 = TOKENMIX_SIMD_AVX512(AttentionFwd);
const ForwardKernel attention_fwd_f32_avx2 = TOKENMIX_SIMD_AVX2(AttentionFwd);
const ForwardKernel attention_fwd_f32_neon = TOKENMIX_SIMD_NEON(AttentionFwd);
const ForwardKernel attention_fwd_bf16_avx512 = TOKENMIX_SIMD_AVX512(AttentionFwdBf16);
const ForwardKernel attention_fwd_bf16_avx2 = TOKENMIX_SIMD_AVX2(AttentionFwdBf16);
const ForwardKernel attention_fwd_bf16_neon = TOKENMIX_SIMD_NEON(AttentionFwdBf16);
const ForwardKernel attention_fwd_f16_avx512 = TOKENMIX_SIMD_AVX512(AttentionFwdF16);
const ForwardKernel attention_fwd_f16_avx2 = TOKENMIX_SIMD_AVX2(AttentionFwdF16);
const ForwardKernel attention_fwd_f16_neon = TOKENMIX_SIMD_NEON(AttentionFwdF16);
const TanhKernel softcap_tanh_avx512 = TOKENMIX_SIMD_AVX512(SoftcapTanh);
const TanhKernel softcap_tanh_avx2 = TOKENMIX_SIMD_AVX2(SoftcapTanh);
const TanhKernel softcap_tanh_neon = TOKENMIX_SIMD_NEON(SoftcapTanh);
const ExpKernel softmax_exp_avx512 = TOKENMIX_SIMD_AVX512(SoftmaxExpNaN);
const ExpKernel softmax_exp_avx2 = TOKENMIX_SIMD_AVX2(SoftmaxExpNaN);
const ExpKernel softmax_exp_neon = TOKENMIX_SIMD_NEON(SoftmaxExpNaN);
const WidenKernel widen_quantized_avx512 = TOKENMIX_SIMD_AVX512(WidenQuantized);
const WidenKernel widen_quantized_avx2 = TOKENMIX_SIMD_AVX2(WidenQuantized);
const WidenKernel widen_quantized_neon = TOKENMIX_SIMD_NEON(WidenQuantized);
// AVX512-BF16 products (dpbf16.hpp) inside the AVX-512 kernel: x86-64 builds only.
#if (HWY_TARGETS & HWY_AVX3) && TOKENMIX_HAVE_DPBF16
const ForwardKernel attention_fwd_bf16_avx512bf16 = &N_AVX3::AttentionFwdDpBf16;
#else
const ForwardKernel attention_fwd_bf16_avx512bf16 = nullptr;
#endif

}  // namespace tokenmix::kernels
#endif  // HWY_ONCE
