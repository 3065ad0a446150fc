// src/kernels/simd/work_units.hpp — how the SIMD attention kernels split work and reach their
// operands; plain scalar code shared by every Highway target.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/attention_kernels.hpp"

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
      : lanes(M), g(p.group()), gh(std::min(g, M)), mq(std::max<std::int64_t>(1, M / gh)),
        head_chunks((g + gh - 1) / gh), qblocks((p.tq + mq - 1) / mq),
        blocks(std::max<std::int64_t>(1, std::min(blocks_per_unit, qblocks))),
        qgroups((qblocks + blocks - 1) / blocks), count(p.batch * p.hkv * head_chunks * qgroups) {}

  struct Block {
    std::int64_t b, j, h0, heads, t0, positions;  // positions ≤ 0: past T_q, nothing to do
  };
  // Lane block `sub` (< blocks) of unit `unit`. Units are numbered so that late query blocks,
  // which see the most keys, come first (causal load balance under dynamic scheduling).
  Block operator()(const AttentionProblem& p, std::int64_t unit, std::int64_t sub) const {
    const std::int64_t qb = (qgroups - 1 - unit % qgroups) * blocks + sub;
    std::int64_t rest = unit / qgroups;
    const std::int64_t hc = rest % head_chunks;
    rest /= head_chunks;
    Block u;
    u.j = rest % p.hkv;
    u.b = rest / p.hkv;
    u.h0 = u.j * g + hc * gh;
    u.heads = std::min(gh, (u.j + 1) * g - u.h0);
    u.t0 = qb * mq;
    u.positions = std::min(mq, p.tq - u.t0);
    return u;
  }
};

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

// The per-target instantiation of kernel FN for `isa`, or nullptr if this build lacks it; for
// the HWY_ONCE section of a foreach_target translation unit.
#define TOKENMIX_SIMD_KERNEL_FOR(isa, FN) TOKENMIX_SIMD_AVX3_(isa, FN) TOKENMIX_SIMD_AVX2_(isa, FN) nullptr
#if HWY_TARGETS & HWY_AVX3
#define TOKENMIX_SIMD_AVX3_(isa, FN) (isa) == ::tokenmix::Isa::avx512 ? &N_AVX3::FN:
#else
#define TOKENMIX_SIMD_AVX3_(isa, FN)
#endif
#if HWY_TARGETS & HWY_AVX2
#define TOKENMIX_SIMD_AVX2_(isa, FN) (isa) == ::tokenmix::Isa::avx2 ? &N_AVX2::FN:
#else
#define TOKENMIX_SIMD_AVX2_(isa, FN)
#endif
