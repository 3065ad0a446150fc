// src/kernels/simd/attention_bwd_f32_hwy.cpp — fused flash-attention backward, fp32, SIMD.
//
// SPEC "Backward pass", recomputing every score tile from Q, K and the saved row log-sum-exp L
// (no T×T buffer), in two passes so each output row has exactly one owner (no atomics, results
// bitwise independent of the thread count):
//
//   pass 1 — one unit per (b, KV head j, query block), query rows of the g heads in SIMD lanes
//            (as in the forward):
//     D_t   = ⟨dO_t, O_t⟩                                  (J·g of 4.6–4.7, row by row)
//     Sᵀ    = K_tile (scale·Q)ᵀ,  Pᵀ = e^{Sᵀ − L}          (4.2–4.4 recomputed)
//     dPᵀ   = V_tile dOᵀ,     dSᵀ = Pᵀ ⊙ (dPᵀ − D)
//     dQᵀ  += K_tileᵀ dSᵀ ;   dQ = scale · dQ            (dQ = scale · dS K)
//   pass 2 — one unit per (b, KV head j, key block), the block's keys in SIMD lanes:
//     S     = Q_rows (scale·K_block)ᵀ,  P = e^{S − L},  dP = dO_rows V_blockᵀ,  dS = P ⊙ (dP − D)
//     dVᵀ  += dO_rowsᵀ P ;  dKᵀ += Q_rowsᵀ dS, summed over the g query heads of the group and
//             every query row that sees the block                (dV = Σ Aᵀ dO, dK = scale Σ dSᵀ Q)
// Both passes use the forward's microkernel (microkernel-inl.h); Q, dO, K and V rows are read
// in place, only the per-unit operands are packed transposed. Extra memory: D, 4·B·H_q·T_q
// bytes, plus per worker O(d_h · tile).
//
// Non-finite inputs (SPEC 4.3, nonfinite-inl.h): P = ExpNaN(S − L), so a NaN in q, k, L reaches
// the row; the causal mask selects dS (not only P), so a NaN in a masked key's S or dP, or in
// the row's D, stays out; and the products over tiles that cross the diagonal leave out masked
// (key, row) pairs whenever a masked operand is not finite. A saved L = −∞ with visible keys
// (every visible score −∞) is used as 0: P = 0, as in the forward.
// Highway's per-target re-inclusion: these includes must follow foreach_target.h, in order.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/simd/attention_bwd_f32_hwy.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/contrib/math/math-inl.h"
#include "kernels/simd/microkernel-inl.h"
#include "kernels/simd/nonfinite-inl.h"
// clang-format on

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/attention_kernels.hpp"
#include "kernels/nonfinite.hpp"
#include "kernels/simd/work_units.hpp"

HWY_BEFORE_NAMESPACE();
namespace tokenmix::kernels::HWY_NAMESPACE {

constexpr std::int64_t kKeyTile = KVTileLayout::kKeyTile;  // pass 1: keys per tile
constexpr std::int64_t kQueryChunk = 64;                   // two-pass pass 2: query rows per chunk
constexpr std::int64_t kBlocksPerUnit = 4;  // pass 1: lane blocks sharing each K/V tile
// B·H_kv at which the one-pass backward is used (its units are (b, KV head) pairs).
constexpr std::int64_t kOnePassMinUnits = 8;

// Pass 1: D and dQ. Mirrors the forward kernel's unit layout (kBlocksPerUnit lane blocks share
// each packed K/V tile).
void BackwardQueries(const BackwardArgs& args, float* delta) {
  const AttentionProblem& p = args.p;
  const hn::ScalableTag<float> d;
  const hn::RebindToSigned<decltype(d)> di;
  using VF = hn::Vec<decltype(d)>;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d)), M = kV * N;
  const std::int64_t dh = p.dh;
  const QueryUnits layout(p, M, kBlocksPerUnit);
  const std::int64_t units = layout.count, lane_blocks = layout.blocks;
  if (units == 0) return;
  const int team = team_size(p.threads, units);
  // Per lane block: scale·Qᵀ, dOᵀ, dQᵀ [dh][M] and lane vectors L, D, visible end [M]; shared:
  // Sᵀ and dPᵀ [kKeyTile][M], packed K and V tiles [kKeyTile][dh].
  ScratchLayout scratch_layout(p.site);
  struct BlockSlots {
    Slot<float> qt, dot, dqt, lse_lane, delta_lane;
    Slot<std::int32_t> end_lane;
  } block_slots[kBlocksPerUnit];
  for (std::int64_t lb = 0; lb < lane_blocks; ++lb) {
    BlockSlots& bs = block_slots[lb];
    bs.qt = scratch_layout.add<float>(scratch_mul(dh, M, p.site, "scale*Q^T"));
    bs.dot = scratch_layout.add<float>(scratch_mul(dh, M, p.site, "dO^T"));
    bs.dqt = scratch_layout.add<float>(scratch_mul(dh, M, p.site, "dQ^T"));
    bs.lse_lane = scratch_layout.add<float>(M);
    bs.delta_lane = scratch_layout.add<float>(M);
    bs.end_lane = scratch_layout.add<std::int32_t>(M);
  }
  const auto st_slot = scratch_layout.add<float>(kKeyTile * M);
  const auto dpt_slot = scratch_layout.add<float>(kKeyTile * M);
  const auto k_tile_slot = scratch_layout.add<float>(scratch_mul(kKeyTile, dh, p.site, "K tile"));
  const auto v_tile_slot = scratch_layout.add<float>(scratch_mul(kKeyTile, dh, p.site, "V tile"));
  const ScratchArena scratch(scratch_layout, team, "the per-worker scratch of pass 1 (dQ)");
#pragma omp parallel for schedule(dynamic, 1) num_threads(team)
  for (std::int64_t unit = 0; unit < units; ++unit) {
    const int worker = omp_get_thread_num();
    float* st = scratch.at(st_slot, worker);          // Sᵀ → Pᵀ → dSᵀ [kKeyTile][M]
    float* dpt = scratch.at(dpt_slot, worker);        // dPᵀ [kKeyTile][M]
    float* k_tile = scratch.at(k_tile_slot, worker);  // K rows u0.. packed [kKeyTile][dh]
    float* v_tile = scratch.at(v_tile_slot, worker);  // V rows u0.. packed [kKeyTile][dh]
    struct BlockState : LaneBlock {
      float *qt, *dot, *dqt, *lse_lane, *delta_lane;  // scale·Qᵀ, dOᵀ, dQᵀ [dh][M]; L, D [M]
    };
    BlockState blocks[kBlocksPerUnit];
    std::int64_t unit_key_end = 0;
    for (std::int64_t lb = 0; lb < lane_blocks; ++lb) {
      BlockState& bs = blocks[lb];
      bs.blk = layout(p, unit, lb);
      bs.qt = scratch.at(block_slots[lb].qt, worker);
      bs.dot = scratch.at(block_slots[lb].dot, worker);
      bs.dqt = scratch.at(block_slots[lb].dqt, worker);
      bs.lse_lane = scratch.at(block_slots[lb].lse_lane, worker);
      bs.delta_lane = scratch.at(block_slots[lb].delta_lane, worker);
      bs.end_lane = scratch.at(block_slots[lb].end_lane, worker);
      // Lanes as in SetUpLanes (work_units.hpp), written out here: this setup also computes D,
      // and padding lanes see nothing (end 0: P = 0). (Routing D's loop through SetUpLanes'
      // callback changed how the compiler rounds it: kept inline, bitwise as before.)
      bs.key_end = 0;
      bs.full_end = p.tk;
      const auto& [b, j, h0, heads, t0, positions] = bs.blk;
      if (positions <= 0) continue;
      for (std::int64_t i = 0; i < M; ++i) {
        const std::int64_t hl = i / layout.mq, tl = i % layout.mq;
        std::int64_t e = 0;
        if (hl < heads && tl < positions) {
          const std::int64_t h = h0 + hl, t = t0 + tl;
          e = std::max<std::int64_t>(0, p.visible_end(t));
          bs.key_end = std::max(bs.key_end, e);
          bs.full_end = std::min(bs.full_end, e);
          const float* q = args.q.row(b, t, h);
          const float* dout = args.dout.row(b, t, h);
          const float* o = args.out.row(b, t, h);
          float dsum = 0.0f;  // D_t = ⟨dO_t, O_t⟩
          for (std::int64_t x = 0; x < dh; ++x) {
            bs.qt[x * M + i] = p.scale * q[x * args.q.s3];
            bs.dot[x * M + i] = dout[x * args.dout.s3];
            dsum += dout[x * args.dout.s3] * o[x * args.out.s3];
          }
          delta[(b * p.hq + h) * p.tq + t] = e > 0 ? dsum : 0.0f;
          bs.delta_lane[i] = dsum;
          const float lse = args.lse.data[b * args.lse.s0 + h * args.lse.s1 + t * args.lse.s2];
          bs.lse_lane[i] = e > 0 ? softmax_shift(lse) : 0.0f;
        } else {
          for (std::int64_t x = 0; x < dh; ++x) bs.qt[x * M + i] = bs.dot[x * M + i] = 0.0f;
          bs.delta_lane[i] = bs.lse_lane[i] = 0.0f;
        }
        bs.end_lane[i] = static_cast<std::int32_t>(e);
      }
      std::fill(bs.dqt, bs.dqt + dh * M, 0.0f);
      unit_key_end = std::max(unit_key_end, bs.key_end);
    }
    const std::int64_t b = blocks[0].blk.b, j = blocks[0].blk.j;

    for (std::int64_t u0 = 0; u0 < unit_key_end; u0 += kKeyTile) {
      const std::int64_t tile = std::min(kKeyTile, unit_key_end - u0);
      const float* k_rows = DenseRows(args.k, b, u0, j, tile, dh, k_tile);  // [tile][dh]
      const float* v_rows = DenseRows(args.v, b, u0, j, tile, dh, v_tile);  // [tile][dh]
      for (std::int64_t lb = 0; lb < lane_blocks; ++lb) {
        BlockState& bs = blocks[lb];
        if (u0 >= bs.key_end) continue;
        const std::int64_t nt = std::min(tile, bs.key_end - u0);
        GemmRows(d, nt, k_rows, dh, 1, bs.qt, M, dh, st, M, false);  // Sᵀ = K (scale·Q)ᵀ   (4.2)
        GemmRows(d, nt, v_rows, dh, 1, bs.dot, M, dh, dpt, M, false);  // dPᵀ = V dOᵀ = dAᵀ
        const bool crosses = u0 + nt > bs.full_end;
        for (std::int64_t i = 0; i < M; i += N) {
          const VF lse = hn::Load(d, bs.lse_lane + i), dl = hn::Load(d, bs.delta_lane + i);
          const auto ends = hn::Load(di, bs.end_lane + i);
          for (std::int64_t u = 0; u < nt; ++u) {
            // A = e^{S − L} (4.4), dS = A ⊙ (dA − D)
            const VF pu = ExpNaN(d, hn::Sub(hn::Load(d, st + u * M + i), lse));
            VF ds = hn::Mul(pu, hn::Sub(hn::Load(d, dpt + u * M + i), dl));
            if (crosses) {  // causal mask (4.3), a select: no NaN of a masked key gets in
              const auto visible =
                  hn::RebindMask(d, hn::Lt(hn::Set(di, static_cast<std::int32_t>(u0 + u)), ends));
              ds = hn::IfThenElseZero(visible, ds);
            }
            hn::Store(ds, d, st + u * M + i);
          }
        }
        // dQᵀ += Kᵀ dSᵀ (keys from full_end on are masked for some lanes: 0 · K must add nothing)
        const auto lane_sees = [&](std::int64_t u, std::int64_t i) {
          const auto key = hn::Set(di, static_cast<std::int32_t>(u0 + u));
          return hn::RebindMask(d, hn::Lt(key, hn::Load(di, bs.end_lane + i)));
        };
        GemmRowsMaskedIfNonFinite(d, dh, k_rows, 1, dh, st, M, nt, bs.dqt, M, true, nullptr,
                                  bs.full_end - u0, nt, lane_sees);
      }
    }

    for (std::int64_t lb = 0; lb < lane_blocks; ++lb) {  // dQ = scale · (dQᵀ)ᵀ
      const BlockState& bs = blocks[lb];
      ForEachRow(layout, bs.blk, [&](std::int64_t i, std::int64_t h, std::int64_t t) HWY_ATTR {
        StoreColumn(bs.dqt, M, i, dh, p.scale, args.dq.row(bs.blk.b, t, h), args.dq.s3);
      });
    }
  }
}

// Pass 2: dK and dV, keys in lanes — and, in one-pass mode, dQ and D as well.
//
// Two-pass mode (kOnePass = false): one unit per (b, KV head j, key block of M keys); pass 1 has
// already written dQ and D. One-pass mode: one unit per (b, j) walking its key blocks in order,
// which also owns dQ of the g heads of group j, so it accumulates dQᵀ += Kᵀ dSᵀ per block into
// a per-unit buffer of g × T_q/M lane blocks [d_h][M] (O(T·d_h) per head; blocked so each
// chunk's dQᵀ is contiguous) — 5 products per score tile instead of 7,
// and still exactly one owner per output row (deterministic for any thread count).
template <bool kOnePass>
void BackwardKeys(const BackwardArgs& args, float* delta) {
  const AttentionProblem& p = args.p;
  const hn::ScalableTag<float> d;
  using VF = hn::Vec<decltype(d)>;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d)), M = kV * N;
  const std::int64_t dh = p.dh, g = p.group();
  const std::int64_t kblocks = (p.tk + M - 1) / M;
  const std::int64_t units = kOnePass ? p.batch * p.hkv : p.batch * p.hkv * kblocks;
  if (units == 0) return;
  const int team = team_size(p.threads, units);
  // Query rows per chunk: kQueryChunk, or M in one-pass mode (a chunk is then one lane block of
  // dQᵀ).
  const std::int64_t chunk = kOnePass ? M : kQueryChunk;
  const std::int64_t tq_pad = (p.tq + M - 1) / M * M;
  // Per-worker scratch: scale·Kᵀ, Vᵀ, dKᵀ, dVᵀ [dh][M] (one slot: zeroed together per key block),
  // S → P and dP → dS [chunk][M], packed Q and dO rows [chunk][dh] when d_h is strided; one-pass
  // also the K block [M][dh], dSᵀ [M][M] and the unit's dQᵀ [g][tq_pad / M][dh][M].
  ScratchLayout scratch_layout(p.site);
  ScratchLayout& sl = scratch_layout;
  const auto kv_acc_slot = sl.add<float>(scratch_mul(4 * M, dh, p.site, "K^T, V^T, dK^T, dV^T"));
  const auto scores_slot = sl.add<float>(kQueryChunk * M);
  const auto dp_slot = sl.add<float>(kQueryChunk * M);
  const auto q_pack_slot = sl.add<float>(scratch_mul(kQueryChunk, dh, p.site, "Q rows"));
  const auto do_pack_slot = sl.add<float>(scratch_mul(kQueryChunk, dh, p.site, "dO rows"));
  const auto k_nat_slot = sl.add<float>(kOnePass ? scratch_mul(M, dh, p.site, "K block") : 0);
  const auto dst_slot = scratch_layout.add<float>(kOnePass ? M * M : 0);
  const std::int64_t dq_floats =
      kOnePass ? scratch_mul(scratch_mul(g, dh, p.site, "dQ^T"), tq_pad, p.site, "dQ^T") : 0;
  const auto dqt_slot = scratch_layout.add<float>(dq_floats);
  const ScratchArena scratch(scratch_layout, team,
                             kOnePass ? "the per-worker scratch of the one-pass backward"
                                      : "the per-worker scratch of pass 2 (dK, dV)");
  const std::int64_t shift = p.align == CausalAlign::bottom_right ? p.tk - p.tq : 0;

#pragma omp parallel for schedule(dynamic, 1) num_threads(team)
  for (std::int64_t unit = 0; unit < units; ++unit) {
    // Two-pass: unit = (key block, j, b), early key blocks (most work) first; one-pass: (j, b).
    const auto [kb_unit, j, b] = Unravel(unit, kOnePass ? 1 : kblocks, p.hkv);
    const std::int64_t kb_first = kOnePass ? 0 : kb_unit;
    const std::int64_t kb_end = kOnePass ? kblocks : kb_first + 1;

    const int worker = omp_get_thread_num();
    float* kt = scratch.at(kv_acc_slot, worker);        // scale·Kᵀ [dh][M]
    float* vt = kt + dh * M;                            // Vᵀ [dh][M]
    float* dkt = vt + dh * M;                           // dKᵀ [dh][M]
    float* dvt = dkt + dh * M;                          // dVᵀ [dh][M]
    float* scores = scratch.at(scores_slot, worker);    // S → P [chunk][M]
    float* dp = scratch.at(dp_slot, worker);            // dP → dS [chunk][M]
    float* q_pack = scratch.at(q_pack_slot, worker);    // [chunk][dh] if needed
    float* do_pack = scratch.at(do_pack_slot, worker);  // [chunk][dh] if needed
    float* k_nat = scratch.at(k_nat_slot, worker);      // one-pass: K block [M][dh]
    float* dst = scratch.at(dst_slot, worker);          // one-pass: dSᵀ [M keys][M rows]
    float* dqt = scratch.at(dqt_slot, worker);          // one-pass: dQᵀ [g][tq_pad / M][dh][M]

    if constexpr (kOnePass) {  // D_t = ⟨dO_t, O_t⟩ for the group's rows; dQᵀ = 0
      for (std::int64_t h = j * g; h < (j + 1) * g; ++h)
        for (std::int64_t t = 0; t < p.tq; ++t) {
          const float* dout = args.dout.row(b, t, h);
          const float* o = args.out.row(b, t, h);
          float dsum = 0.0f;
          for (std::int64_t x = 0; x < dh; ++x) dsum += dout[x * args.dout.s3] * o[x * args.out.s3];
          delta[(b * p.hq + h) * p.tq + t] = p.visible_end(t) > 0 ? dsum : 0.0f;
        }
      std::fill(dqt, dqt + dq_floats, 0.0f);
    }

    for (std::int64_t kb = kb_first; kb < kb_end; ++kb) {
      const std::int64_t u0 = kb * M, keys = std::min(M, p.tk - u0);
      std::fill(kt, kt + 4 * dh * M, 0.0f);  // zero padding lanes (keys ≥ T_k) and accumulators
      PackTransposed(args.k.row(b, u0, j), args.k.s1, args.k.s3, keys, dh, p.scale, kt, M);
      PackTransposed(args.v.row(b, u0, j), args.v.s1, args.v.s3, keys, dh, 1.0f, vt, M);
      if constexpr (kOnePass) {
        PackRows(args.k.row(b, u0, j), args.k.s1, args.k.s3, keys, dh, k_nat);
        std::fill(k_nat + keys * dh, k_nat + M * dh, 0.0f);
      }

      // Queries that see any key of the block: t ≥ u0 − shift (causal), all otherwise. One-pass
      // chunks start on a multiple of M (they are lane blocks of dQᵀ); rows before t_first are
      // fully masked there and contribute exactly 0.
      const std::int64_t t_first = p.causal ? std::max<std::int64_t>(0, u0 - shift) : 0;
      const std::int64_t c_begin = kOnePass ? t_first / M * M : t_first;
      for (std::int64_t h = j * g; h < (j + 1) * g; ++h) {  // the g query heads of group j (4.8)
        for (std::int64_t c0 = c_begin; c0 < p.tq; c0 += chunk) {
          const std::int64_t rows = std::min(chunk, p.tq - c0);
          // Q and dO rows are read in place (packing them per chunk was slower, docs/
          // performance.md "Backward"); only a non-unit d_h stride forces a copy.
          std::int64_t ldq = 0, lddo = 0;
          const float* q_rows = RowsOf(args.q, b, c0, h, rows, dh, q_pack, ldq);
          const float* do_rows = RowsOf(args.dout, b, c0, h, rows, dh, do_pack, lddo);
          GemmRows(d, rows, q_rows, ldq, 1, kt, M, dh, scores, M, false);  // S = Q (scale·K)ᵀ (4.2)
          GemmRows(d, rows, do_rows, lddo, 1, vt, M, dh, dp, M, false);  // dP = dO Vᵀ
          for (std::int64_t r = 0; r < rows; ++r) {
            const std::int64_t t = c0 + r;
            const std::int64_t visible = p.visible_end(t) - u0;  // lanes < visible are unmasked
            const float lse = args.lse.data[b * args.lse.s0 + h * args.lse.s1 + t * args.lse.s2];
            const VF l = hn::Set(d, visible > 0 ? softmax_shift(lse) : 0.0f);
            const VF dl = hn::Set(d, delta[(b * p.hq + h) * p.tq + t]);
            for (std::int64_t i = 0; i < M; i += N) {
              VF pu = ExpNaN(d, hn::Sub(hn::Load(d, scores + r * M + i), l));  // A = e^{S − L}
              VF ds = hn::Mul(pu, hn::Sub(hn::Load(d, dp + r * M + i), dl));  // dS = A ⊙ (dA − D)
              if (visible < i + N) {  // causal mask (4.3), a select on P and dS
                const std::int64_t n_vis = std::clamp<std::int64_t>(visible - i, 0, N);
                const auto seen = hn::FirstN(d, static_cast<std::size_t>(n_vis));
                pu = hn::IfThenElseZero(seen, pu);
                ds = hn::IfThenElseZero(seen, ds);
              }
              hn::Store(pu, d, scores + r * M + i);
              hn::Store(ds, d, dp + r * M + i);
            }
          }
          // dVᵀ += dOᵀ P, dKᵀ += Qᵀ dS. Rows [0, r_full) do not see every key of the block: a
          // NaN in their dO or Q must not reach the keys they do not see (0 · NaN = NaN).
          std::int64_t r_full = 0;
          while (r_full < rows && p.visible_end(c0 + r_full) - u0 < keys) ++r_full;
          const auto row_sees = [&](std::int64_t r, std::int64_t i) {
            const std::int64_t n = std::clamp<std::int64_t>(p.visible_end(c0 + r) - u0 - i, 0, N);
            return hn::FirstN(d, static_cast<std::size_t>(n));
          };
          GemmRowsMaskedIfNonFinite(d, dh, do_rows, 1, lddo, scores, M, rows, dvt, M, true, nullptr,
                                    0, r_full, row_sees);
          GemmRowsMaskedIfNonFinite(d, dh, q_rows, 1, ldq, dp, M, rows, dkt, M, true, nullptr, 0,
                                    r_full, row_sees);
          if constexpr (kOnePass) {
            // dQᵀ[x][c0 + r] += Σ_u K[u][x] dS[r][u]: dS transposed to [key][row] (rows past
            // T_q zeroed), then the microkernel with B = dSᵀ, C = the chunk's columns of dQᵀ.
            for (std::int64_t u = 0; u < M; ++u) {
              for (std::int64_t r = 0; r < rows; ++r) dst[u * M + r] = dp[r * M + u];
              for (std::int64_t r = rows; r < M; ++r) dst[u * M + r] = 0.0f;
            }
            // Keys from visible_end(c0) on are not seen by the chunk's first rows.
            // Row c0 + i + lane sees key u0 + u  ⟺  lane ≥ u0 + u − shift − c0 − i (causal).
            const auto key_seen_by = [&](std::int64_t u, std::int64_t i) {
              const std::int64_t n = std::clamp<std::int64_t>(u0 + u - shift - c0 - i, 0, N);
              return hn::Not(hn::FirstN(d, static_cast<std::size_t>(n)));
            };
            GemmRowsMaskedIfNonFinite(d, dh, k_nat, 1, dh, dst, M, keys,
                                      dqt + ((h - j * g) * tq_pad + c0) * dh, M, true, nullptr,
                                      p.visible_end(c0) - u0, keys, key_seen_by);
          }
        }
      }
      for (std::int64_t u = 0; u < keys; ++u) {  // dK = scale · (dKᵀ)ᵀ, dV = (dVᵀ)ᵀ
        StoreColumn(dkt, M, u, dh, p.scale, args.dk.row(b, u0 + u, j), args.dk.s3);
        StoreColumn(dvt, M, u, dh, 1.0f, args.dv.row(b, u0 + u, j), args.dv.s3);
      }
    }

    if constexpr (kOnePass) {  // dQ = scale · (dQᵀ)ᵀ
      for (std::int64_t h = j * g; h < (j + 1) * g; ++h) {
        const float* src = dqt + (h - j * g) * tq_pad * dh;
        for (std::int64_t t = 0; t < p.tq; ++t) {  // lane t % M of lane block t / M: [dh][M]
          StoreColumn(src + (t / M) * M * dh, M, t % M, dh, p.scale, args.dq.row(b, t, h),
                      args.dq.s3);
        }
      }
    }
  }
}

void AttentionBwd(const BackwardArgs& args) {
  const AttentionProblem& p = args.p;
  ScratchLayout delta_layout(p.site);  // D [B, H_q, T_q], shared by both passes
  const auto delta_slot = delta_layout.add<float>(
      scratch_mul(scratch_mul(p.batch, p.hq, p.site, "D"), p.tq, p.site, "D"));
  const ScratchArena delta_memory(delta_layout, 1, "D = rowsum(dO * O)");
  float* delta = delta_memory.at(delta_slot, 0);
  // One pass (5 products) when there are enough (b, KV head) units to share among threads;
  // the choice depends on the shape only, never on the thread count, so results stay bitwise
  // independent of it.
  if (p.batch * p.hkv >= kOnePassMinUnits) {
    BackwardKeys<true>(args, delta);
  } else {
    BackwardQueries(args, delta);
    BackwardKeys<false>(args, delta);
  }
}

}  // namespace tokenmix::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace tokenmix::kernels {

const BackwardKernel attention_bwd_f32_avx512 = TOKENMIX_SIMD_AVX512(AttentionBwd);
const BackwardKernel attention_bwd_f32_avx2 = TOKENMIX_SIMD_AVX2(AttentionBwd);
const BackwardKernel attention_bwd_f32_neon = TOKENMIX_SIMD_NEON(AttentionBwd);

}  // namespace tokenmix::kernels
#endif  // HWY_ONCE
