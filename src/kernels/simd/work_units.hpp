// src/kernels/simd/work_units.hpp — the skeleton of the SIMD attention kernels: how they split
// work (lane blocks, work units), set up and write back the SIMD lanes, and reach their
// operands; plain scalar code shared by every Highway target.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/attention_kernels.hpp"
#include "kernels/kernel_skeleton.hpp"

namespace tokenmix::kernels {

// The query-lane work of the forward kernel and of the backward's dQ pass. A lane block is
// (batch b, KV head j, a chunk of the g query heads of group j, a block of query positions); its
// rows — every (head, position) pair — fill the M SIMD lanes: lane i ↦ (head h0 + i / mq,
// position t0 + i % mq). All heads of a group share each K/V tile (SPEC 4.8). A work unit is
// `blocks` consecutive lane blocks of the same (b, j, head chunk), so every K/V tile it loads
// serves blocks · M query rows: fewer passes over K/V (and over their pages: with K/V rows
// H_kv·d_h floats apart, each row can sit on its own page, and TLB misses dominate long
// sequences otherwise).
struct QueryUnits {
  std::int64_t lanes, g, gh, mq, head_chunks, qblocks, blocks, qgroups, count;

  QueryUnits(const AttentionProblem& p, std::int64_t M, std::int64_t blocks_per_unit)
      : lanes(M),
        g(p.group()),
        gh(std::min(g, M)),
        mq(std::max<std::int64_t>(1, M / gh)),
        head_chunks((g + gh - 1) / gh),
        qblocks((p.tq + mq - 1) / mq),
        blocks(std::max<std::int64_t>(1, std::min(blocks_per_unit, qblocks))),
        qgroups((qblocks + blocks - 1) / blocks),
        count(p.batch * p.hkv * head_chunks * qgroups) {}

  struct Block {
    std::int64_t b, j, h0, heads, t0, positions;  // positions ≤ 0: past T_q, nothing to do
  };
  // Lane block `sub` (< blocks) of unit `unit`. Units are numbered so that late query blocks,
  // which see the most keys, come first (causal load balance under dynamic scheduling).
  Block operator()(const AttentionProblem& p, std::int64_t unit, std::int64_t sub) const {
    const auto [qgroup, hc, j, b] = Unravel(unit, qgroups, head_chunks, p.hkv);
    const std::int64_t qb = (qgroups - 1 - qgroup) * blocks + sub;
    Block u;
    u.j = j;
    u.b = b;
    u.h0 = u.j * g + hc * gh;
    u.heads = std::min(gh, (u.j + 1) * g - u.h0);
    u.t0 = qb * mq;
    u.positions = std::min(mq, p.tq - u.t0);
    return u;
  }
};

// The lanes of one lane block and the keys they see (forward, backward dQ pass).
struct LaneBlock {
  QueryUnits::Block blk;
  std::int32_t* end_lane = nullptr;  // visible_end per lane [M]
  std::int64_t key_end = 0;          // keys some lane sees
  std::int64_t full_end = 0;         // keys every lane sees
};

// Sets up the M lanes of `lb` (lane i ↦ head h0 + i / mq, position t0 + i % mq). A lane holding
// a row gets end_lane[i] = e = max(0, visible_end(t)) and row(i, h, t, e); a padding lane (past
// the block's heads or positions) gets end_lane[i] = pad_end and pad(i). Returns false (and does
// nothing else) for a block past T_q.
template <class Row, class Pad>
bool SetUpLanes(const AttentionProblem& p, const QueryUnits& units, LaneBlock& lb,
                std::int32_t pad_end, Row&& row, Pad&& pad) {
  lb.key_end = 0;
  lb.full_end = p.tk;
  const auto& [b, j, h0, heads, t0, positions] = lb.blk;
  if (positions <= 0) return false;
  for (std::int64_t i = 0; i < units.lanes; ++i) {
    const std::int64_t hl = i / units.mq, tl = i % units.mq;
    if (hl < heads && tl < positions) {
      const std::int64_t e = std::max<std::int64_t>(0, p.visible_end(t0 + tl));
      lb.key_end = std::max(lb.key_end, e);
      lb.full_end = std::min(lb.full_end, e);
      lb.end_lane[i] = static_cast<std::int32_t>(e);
      row(i, h0 + hl, t0 + tl, e);
    } else {
      lb.end_lane[i] = pad_end;
      pad(i);
    }
  }
  return true;
}

// Calls f(i, h, t) for every lane i of a lane block that holds a row (head h, position t).
template <class F>
void ForEachRow(const QueryUnits& units, const QueryUnits::Block& blk, F&& f) {
  for (std::int64_t i = 0; i < blk.heads * units.mq; ++i) {
    const std::int64_t hl = i / units.mq, tl = i % units.mq;
    if (tl >= blk.positions) continue;
    f(i, blk.h0 + hl, blk.t0 + tl);
  }
}

// Column `lane` of a transposed [cols][M] buffer into a strided row: dst[x·stride] =
// factor · src[x·M + lane]. The write-out of every transposed accumulator (Oᵀ, dQᵀ, dKᵀ, dVᵀ).
inline void StoreColumn(const float* src, std::int64_t M, std::int64_t lane, std::int64_t cols,
                        float factor, float* dst, std::int64_t stride) {
  for (std::int64_t x = 0; x < cols; ++x) dst[x * stride] = factor * src[x * M + lane];
}

// A strided row into column `lane` of a transposed [cols][M] buffer, times `factor`.
inline void LoadColumn(const float* src, std::int64_t stride, std::int64_t cols, float factor,
                       float* dst, std::int64_t M, std::int64_t lane) {
  for (std::int64_t x = 0; x < cols; ++x) dst[x * M + lane] = factor * src[x * stride];
}

// Copies `rows` rows of a strided matrix (row stride `ld`, column stride `cs`) into a contiguous
// [rows][cols] buffer.
inline void PackRows(const float* src, std::int64_t ld, std::int64_t cs, std::int64_t rows,
                     std::int64_t cols, float* dst) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* row = src + r * ld;
    float* out = dst + r * cols;
    if (cs == 1) {
      std::copy(row, row + cols, out);
    } else {
      for (std::int64_t x = 0; x < cols; ++x) out[x] = row[x * cs];
    }
  }
}

// Copies rows [0, rows) of a strided matrix transposed into dst[col][row] (dst rows M floats
// long), scaled by `scale`. Packs the B operands Qᵀ, Kᵀ, Vᵀ of the microkernel.
inline void PackTransposed(const float* src, std::int64_t ld, std::int64_t cs, std::int64_t rows,
                           std::int64_t cols, float scale, float* dst, std::int64_t M) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* row = src + r * ld;
    for (std::int64_t x = 0; x < cols; ++x) dst[x * M + r] = scale * row[x * cs];
  }
}

// Rows [row0, row0 + rows) of head `head` of a [B, T, H, d_h] tensor as a dense [rows][d_h]
// matrix: in place when they already are (e.g. the [B, H, T, d_h] layout), else packed into
// `scratch`. Dense rows keep a tile on few pages and cache sets (in [B, T, H, d_h], rows of one
// head are H·d_h floats apart: one page each for H·d_h·4 ≥ 4 KiB).
inline const float* DenseRows(const In& x, std::int64_t b, std::int64_t row0, std::int64_t head,
                              std::int64_t rows, std::int64_t dh, float* scratch) {
  if (x.s3 == 1 && (x.s1 == dh || rows <= 1)) return x.row(b, row0, head);
  PackRows(x.row(b, row0, head), x.s1, x.s3, rows, dh, scratch);
  return scratch;
}

// Rows [row0, row0 + rows) of head `head` of a [B, T, H, d_h] tensor as a row-major matrix the
// microkernel can broadcast from: in place when d_h is the unit-stride axis, else packed into
// `scratch` ([rows][d_h]). Sets `ld` to the row stride of the returned matrix.
inline const float* RowsOf(const In& x, std::int64_t b, std::int64_t row0, std::int64_t head,
                           std::int64_t rows, std::int64_t dh, float* scratch, std::int64_t& ld) {
  if (x.s3 == 1) {
    ld = x.s1;
    return x.row(b, row0, head);
  }
  PackRows(x.row(b, row0, head), x.s1, x.s3, rows, dh, scratch);
  ld = dh;
  return scratch;
}

}  // namespace tokenmix::kernels

// The per-target instantiation of kernel FN, or nullptr if this build lacks the target; for the
// HWY_ONCE section of a foreach_target translation unit, which exports one constant per target
// (attention_<op>_<dtype>_avx512 / _avx2 / _neon, declared in attention_kernels.hpp).
#if HWY_TARGETS & HWY_AVX3
#define TOKENMIX_SIMD_AVX512(FN) &N_AVX3::FN
#else
#define TOKENMIX_SIMD_AVX512(FN) nullptr
#endif
#if HWY_TARGETS & HWY_AVX2
#define TOKENMIX_SIMD_AVX2(FN) &N_AVX2::FN
#else
#define TOKENMIX_SIMD_AVX2(FN) nullptr
#endif
#if HWY_TARGETS & HWY_NEON
#define TOKENMIX_SIMD_NEON(FN) &N_NEON::FN
#else
#define TOKENMIX_SIMD_NEON(FN) nullptr
#endif
