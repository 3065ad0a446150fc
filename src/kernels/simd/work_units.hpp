// src/kernels/simd/work_units.hpp — the skeleton of the SIMD attention kernels: how they split
// work (lane blocks, work units), set up and write back the SIMD lanes, and reach their
// operands; plain scalar code shared by every Highway target.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

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

// The lanes of one lane block and the keys they see (forward, backward dQ pass). Lane i sees the
// keys [begin_lane[i], end_lane[i]) (AttentionProblem::key_range: causal mask, window, key
// length, an interval-shaped mask); a tile of keys inside [full_begin, full_end) is seen by every
// lane and needs no masking.
struct LaneBlock {
  QueryUnits::Block blk;
  std::int32_t* begin_lane = nullptr;  // key_range(b, h, t).begin per lane [M]
  std::int32_t* end_lane = nullptr;    // key_range(b, h, t).end per lane [M]
  std::int64_t key_begin = 0;          // keys some lane sees: [key_begin, key_end)
  std::int64_t key_end = 0;
  std::int64_t full_begin = 0;  // keys every lane sees: [full_begin, full_end)
  std::int64_t full_end = 0;
  /// True if some lane does not see some key of [k0, k1) (the tile must be masked).
  bool partial(std::int64_t k0, std::int64_t k1) const { return k0 < full_begin || k1 > full_end; }
};

// Sets up the M lanes of `lb` (lane i ↦ head h0 + i / mq, position t0 + i % mq). A lane holding
// a row gets its key range r = key_range(b, h, t) in begin_lane/end_lane and row(i, h, t, r); a
// padding lane (past the block's heads or positions) gets [0, pad_end) and pad(i). key_begin is
// the least begin and key_end the greatest end of the rows that see a key; full_begin/full_end
// bound the keys every row sees. Returns false (and does nothing else) for a block past T_q.
template <class Row, class Pad>
bool SetUpLanes(const AttentionProblem& p, const QueryUnits& units, LaneBlock& lb,
                std::int32_t pad_end, Row&& row, Pad&& pad) {
  lb.key_begin = p.tk;
  lb.key_end = 0;
  lb.full_begin = 0;
  lb.full_end = p.tk;
  const auto& [b, j, h0, heads, t0, positions] = lb.blk;
  if (positions <= 0) {
    lb.key_begin = 0;
    return false;
  }
  for (std::int64_t i = 0; i < units.lanes; ++i) {
    const std::int64_t hl = i / units.mq, tl = i % units.mq;
    if (hl < heads && tl < positions) {
      const KeyRange r = p.key_range(b, h0 + hl, t0 + tl);
      if (r.end > r.begin) {
        lb.key_begin = std::min(lb.key_begin, r.begin);
        lb.key_end = std::max(lb.key_end, r.end);
      }
      lb.full_begin = std::max(lb.full_begin, r.begin);
      lb.full_end = std::min(lb.full_end, r.end);
      lb.begin_lane[i] = static_cast<std::int32_t>(r.begin);
      lb.end_lane[i] = static_cast<std::int32_t>(r.end);
      row(i, h0 + hl, t0 + tl, r);
    } else {
      lb.begin_lane[i] = 0;
      lb.end_lane[i] = pad_end;
      pad(i);
    }
  }
  if (lb.key_end == 0) lb.key_begin = 0;  // no row sees a key: nothing to visit
  return true;
}

// The keys [k_lo, k_hi) of a tile of n keys that cover those outside [full_lo, full_hi) (the
// keys not every lane sees): the range GemmRowsMaskedIfNonFinite checks for non-finite operands.
struct PartialKeys {
  std::int64_t lo, hi;
};
inline PartialKeys PartialRange(std::int64_t full_lo, std::int64_t full_hi, std::int64_t n) {
  if (full_hi <= full_lo || (full_lo > 0 && full_hi < n)) return {0, n};
  if (full_lo > 0) return {0, std::min(full_lo, n)};
  return {std::max<std::int64_t>(full_hi, 0), n};
}

// Runs f() on each thread of a team of `team` (RunTeam, kernel_skeleton.hpp): the kernels'
// `#pragma omp parallel for` is this region plus an orphaned `#pragma omp for` inside f, so the
// region itself is opened outside the Highway target code.
template <class F>
void RunTeamBody(void* f) {
  (*static_cast<const F*>(f))();
}
template <class F>
void RunTeam(int team, const F& f) {
  RunTeam(team, &RunTeamBody<F>, const_cast<void*>(static_cast<const void*>(&f)));
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
// factor · src[x·M + lane], rounded once to T (SPEC "Reduced precision"; a plain store for
// float). The write-out of every transposed accumulator (Oᵀ, dQᵀ, dKᵀ, dVᵀ).
template <class T>
inline void StoreColumn(const float* src, std::int64_t M, std::int64_t lane, std::int64_t cols,
                        float factor, T* dst, std::int64_t stride) {
  for (std::int64_t x = 0; x < cols; ++x) dst[x * stride] = narrow<T>(factor * src[x * M + lane]);
}

// A strided row (widened to fp32) into column `lane` of a transposed [cols][M] buffer, times
// `factor`.
template <class T>
inline void LoadColumn(const T* src, std::int64_t stride, std::int64_t cols, float factor,
                       float* dst, std::int64_t M, std::int64_t lane) {
  for (std::int64_t x = 0; x < cols; ++x) dst[x * M + lane] = factor * widen(src[x * stride]);
}

// Widens n contiguous bf16/f16 elements to fp32, one at a time (exact). The SIMD kernels pass
// their per-target vector version (VecWiden, microkernel-inl.h) instead.
struct ScalarWiden {
  template <class T>
  void operator()(const T* src, std::int64_t n, float* dst) const {
    for (std::int64_t x = 0; x < n; ++x) dst[x] = widen(src[x]);
  }
};

// Copies `rows` rows of a strided matrix (row stride `ld`, column stride `cs`) into a contiguous
// fp32 [rows][cols] buffer (bf16/f16 widened exactly; unit-stride rows by `widen_row`).
template <class T, class W = ScalarWiden>
inline void PackRows(const T* src, std::int64_t ld, std::int64_t cs, std::int64_t rows,
                     std::int64_t cols, float* dst, const W& widen_row = {}) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* row = src + r * ld;
    float* out = dst + r * cols;
    if (cs == 1) {
      if constexpr (std::is_same_v<T, float>) {
        std::copy(row, row + cols, out);
      } else {
        widen_row(row, cols, out);
      }
      continue;
    }
    for (std::int64_t x = 0; x < cols; ++x) out[x] = widen(row[x * cs]);
  }
}

// Copies rows [0, rows) of a strided matrix transposed into dst[col][row] (dst rows M floats
// long), widened and scaled by `scale`. Packs the B operands Qᵀ, Kᵀ, Vᵀ of the microkernel.
template <class T>
inline void PackTransposed(const T* src, std::int64_t ld, std::int64_t cs, std::int64_t rows,
                           std::int64_t cols, float scale, float* dst, std::int64_t M) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* row = src + r * ld;
    for (std::int64_t x = 0; x < cols; ++x) dst[x * M + r] = scale * widen(row[x * cs]);
  }
}

// Rows [row0, row0 + rows) of head `head` of a [B, T, H, d_h] tensor as a dense fp32 [rows][d_h]
// matrix: in place when they already are (f32 only, e.g. the [B, H, T, d_h] layout), else
// packed (bf16/f16: widened) into `scratch`. Dense rows keep a tile on few pages and cache sets
// (in [B, T, H, d_h], rows of one head are H·d_h floats apart: one page each for H·d_h·4 ≥ 4 KiB).
template <class T, class W = ScalarWiden>
inline const float* DenseRows(const Strided<const T*>& x, std::int64_t b, std::int64_t row0,
                              std::int64_t head, std::int64_t rows, std::int64_t dh, float* scratch,
                              const W& widen_row = {}) {
  if constexpr (std::is_same_v<T, float>) {
    if (x.s3 == 1 && (x.s1 == dh || rows <= 1)) return x.row(b, row0, head);
  }
  PackRows(x.row(b, row0, head), x.s1, x.s3, rows, dh, scratch, widen_row);
  return scratch;
}

// Rows [row0, row0 + rows) of head `head` of a [B, T, H, d_h] tensor as a row-major fp32 matrix
// the microkernel can broadcast from: in place when d_h is the unit-stride axis (f32 only), else
// packed (widened) into `scratch` ([rows][d_h]). Sets `ld` to the row stride of the result.
template <class T, class W = ScalarWiden>
inline const float* RowsOf(const Strided<const T*>& x, std::int64_t b, std::int64_t row0,
                           std::int64_t head, std::int64_t rows, std::int64_t dh, float* scratch,
                           std::int64_t& ld, const W& widen_row = {}) {
  if constexpr (std::is_same_v<T, float>) {
    if (x.s3 == 1) {
      ld = x.s1;
      return x.row(b, row0, head);
    }
  }
  PackRows(x.row(b, row0, head), x.s1, x.s3, rows, dh, scratch, widen_row);
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
