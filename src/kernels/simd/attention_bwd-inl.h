// src/kernels/simd/attention_bwd-inl.h — fused flash-attention backward, SIMD (Highway): the
// AttentionBwdT<T> template, T the activation element type (fp32; bf16 / f16 widened to fp32 on
// pack, gradients rounded once on store). Each attention_bwd_<f32|bf16|f16>_hwy.cpp includes it
// once per target and exports its one dtype as attention_bwd_<dtype>_<avx512|avx2|neon>
// (dispatch/registry.cpp): one translation unit per dtype, so the three compile in parallel (one
// file held all three: the longest compile of the build, the cold build's critical path).
//
// SPEC "Backward pass", recomputing every score tile from Q, K and the saved row log-sum-exp L
// (no T×T buffer), so that each output row has exactly one owner or a sum in a fixed order (no
// atomics, results bitwise independent of the thread count), in one pass:
//
// BackwardOnePass (D-bwd-1, D-bwd-6), 5 products per score tile: one unit per (b, KV head j,
// query range) walks the key blocks its rows see, keys in SIMD lanes as in pass 2 below, and
// also accumulates dQᵀ += K_blockᵀ dSᵀ for its rows; it owns dQ and D of its rows. The query
// ranges (QuerySplit): ⌈8 / (B·H_kv)⌉ per (b, j), so at least 8 units in all, and more (up to
// 4) where a range's dQᵀ accumulators would pass 2 MiB; one range owns dK/dV of every key,
// several add partial dK/dV of the key blocks they share, summed in the order of the ranges
// (ReduceKeyBlocks). Every shape takes this form (AttentionBwdLanes).
//
// Two passes, 7 products per score tile: removed (slower at every measured shape, D-bwd-6); the
// passes' description stays as the derivation the one-pass unit fuses:
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
// The pass uses the forward's microkernel (microkernel-inl.h); Q, dO, K and V rows are read in
// place, only the per-unit operands are packed transposed. Extra memory: D, 4·B·H_q·T_q
// bytes, plus per worker O(d_h · tile).
//
// Non-finite inputs (SPEC 4.3, nonfinite-inl.h): P = ExpNaN(S − L), so a NaN in q, k, L reaches
// the row; the causal mask selects dS (not only P), so a NaN in a masked key's S or dP, or in
// the row's D, stays out; and the products over tiles that cross the diagonal leave out masked
// (key, row) pairs whenever a masked operand is not finite. A saved L = −∞ with visible keys
// (every visible score −∞) is used as 0: P = 0, as in the forward.
//
// Score variants (SPEC "Score variants used by real models"), as in the forward: the pass
// recomputes the same S — the same key ranges (AttentionProblem::key_range; tiles and query
// chunks no row/key of the unit sees are skipped, tiles crossing a range end are masked by a
// select) and the same element-wise pass (variants-inl.h: cap, ALiBi, general mask); then
// P = e^{S − L} with the forward's L (which holds the sink's e^{σ_h}), dS = P ⊙ (dP − D), and
// with soft-capping dz = dS ⊙ (1 − tanh²(z / c)) before dQ = s·dz K and dK = s·dzᵀ Q (the
// score products then use s / c in place of s, ScoreScale, as the forward's: the pass starts
// from z / c).
// dσ_h is not computed here: the API forms it from L, O and dO.
//
// Dropout (docs/design.md D.1–D.4, dropout-inl.h): per row and key block the keep factors
// Z / (1 − p) are regenerated (Philox, keys in lanes), dA = dP̃ ⊙ Z / (1 − p) enters dS, and P̃
// (not A) enters dV; D_t = ⟨dO_t, O_t⟩ still holds (Σ_u A dA = Σ_u P̃ dP̃).
//
// Highway "-inl" header: included once per target from a foreach_target translation unit.
#if defined(TOKENMIX_KERNELS_SIMD_ATTENTION_BWD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TOKENMIX_KERNELS_SIMD_ATTENTION_BWD_INL_H_
#undef TOKENMIX_KERNELS_SIMD_ATTENTION_BWD_INL_H_
#else
#define TOKENMIX_KERNELS_SIMD_ATTENTION_BWD_INL_H_
#endif

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "hwy/highway.h"
#include "kernels/attention_kernels.hpp"
#include "kernels/nonfinite.hpp"
#include "kernels/simd/dpbf16.hpp"
#include "kernels/simd/dropout-inl.h"
#include "kernels/simd/microkernel-inl.h"
#include "kernels/simd/nonfinite-inl.h"
#include "kernels/simd/variants-inl.h"
#include "kernels/simd/work_units.hpp"

HWY_BEFORE_NAMESPACE();
namespace tokenmix::kernels::HWY_NAMESPACE {

// Units of the one-pass backward per call, at least: (b, KV head) pairs, each split into
// ⌈kOnePassUnits / (B·H_kv)⌉ query ranges (QuerySplit, D-bwd-6).
constexpr std::int64_t kOnePassUnits = 8;
// And at most kCacheRanges query ranges per (b, KV head) so that a range's dQᵀ accumulators
// (g · d_h · rows floats) stay within kRangeDqBytes (D-bwd-6).
constexpr std::int64_t kRangeDqBytes = std::int64_t{2} << 20;
constexpr std::int64_t kCacheRanges = 4;

// ---- Packing into and out of the transposed [d_h][M] buffers, 4 × 4 blocks at a time (fp32
// views with unit d_h stride). A tiny call (a small training step: T ≤ one vector) spent most of
// its time moving rows into and out of these buffers one element at a time; these helpers load
// four rows of four floats, transpose them in registers (128-bit vectors: the same code on every
// target) and store four vectors. Every element gets exactly the arithmetic of the scalar loops
// they replace (the product scale · x; D the FMA chain over x), so the results are bitwise those
// of the scalar loops. (Gathers were slower here: the transposed loads are four floats apart.)
#if HWY_TARGET != HWY_SCALAR  // (one lane: the scalar loops)
using D4 = hn::FixedTag<float, 4>;
using V4 = hn::Vec<D4>;

// r_k[l] ← r_l[k] for k, l < 4.
HWY_INLINE void Transpose4x4(V4& r0, V4& r1, V4& r2, V4& r3) {
  const D4 d4;
  const hn::Repartition<std::uint64_t, D4> du;
  const auto t0 = hn::BitCast(du, hn::InterleaveLower(d4, r0, r1));  // r0[0] r1[0] r0[1] r1[1]
  const auto t1 = hn::BitCast(du, hn::InterleaveLower(d4, r2, r3));  // r2[0] r3[0] r2[1] r3[1]
  const auto t2 = hn::BitCast(du, hn::InterleaveUpper(d4, r0, r1));  // r0[2] r1[2] r0[3] r1[3]
  const auto t3 = hn::BitCast(du, hn::InterleaveUpper(d4, r2, r3));  // r2[2] r3[2] r2[3] r3[3]
  r0 = hn::BitCast(d4, hn::InterleaveLower(du, t0, t1));
  r1 = hn::BitCast(d4, hn::InterleaveUpper(du, t0, t1));
  r2 = hn::BitCast(d4, hn::InterleaveLower(du, t2, t3));
  r3 = hn::BitCast(d4, hn::InterleaveUpper(du, t2, t3));
}
#endif

// Columns lane0 .. lane0 + 3 of a transposed [cols][M] buffer into the rows dst[0..3]:
// dst[l][x·stride] = factor · src[x·M + lane0 + l] (StoreColumn, work_units.hpp, four at once).
template <class T>
HWY_INLINE void StoreColumns4(const float* src, std::int64_t M, std::int64_t lane0,
                              std::int64_t cols, float factor, T* const dst[4],
                              std::int64_t stride) {
  std::int64_t x = 0;
#if HWY_TARGET != HWY_SCALAR
  if constexpr (std::is_same_v<T, float>) {
    if (stride == 1) {
      const D4 d4;
      const V4 f = hn::Set(d4, factor);
      for (; x + 4 <= cols; x += 4) {
        const float* s0 = src + x * M + lane0;
        V4 r0 = hn::LoadU(d4, s0), r1 = hn::LoadU(d4, s0 + M), r2 = hn::LoadU(d4, s0 + 2 * M),
           r3 = hn::LoadU(d4, s0 + 3 * M);
        Transpose4x4(r0, r1, r2, r3);
        hn::StoreU(hn::Mul(f, r0), d4, dst[0] + x);
        hn::StoreU(hn::Mul(f, r1), d4, dst[1] + x);
        hn::StoreU(hn::Mul(f, r2), d4, dst[2] + x);
        hn::StoreU(hn::Mul(f, r3), d4, dst[3] + x);
      }
    }
  }
#endif
  for (std::int64_t l = 0; l < 4; ++l)
    for (std::int64_t y = x; y < cols; ++y)
      dst[l][y * stride] = narrow<T>(factor * src[y * M + lane0 + l]);
}

// StoreColumn of the columns `lane0 + l` into rows row(l) for l < n: four at a time.
template <class T, class RowFn>
HWY_INLINE void StoreColumns(const float* src, std::int64_t M, std::int64_t lane0, std::int64_t n,
                             std::int64_t cols, float factor, std::int64_t stride,
                             const RowFn& row) {
  std::int64_t l = 0;
  for (; l + 4 <= n; l += 4) {
    T* const dst[4] = {row(l), row(l + 1), row(l + 2), row(l + 3)};
    StoreColumns4(src, M, lane0 + l, cols, factor, dst, stride);
  }
  for (; l < n; ++l) StoreColumn(src, M, lane0 + l, cols, factor, row(l), stride);
}

// Rows [0, rows) (rows ≤ M) of a strided matrix transposed into dst[col][row] (dst rows M
// floats long), times `scale` (PackTransposed, work_units.hpp): fp32 rows with unit column
// stride four rows and four columns at a time. Lanes past `rows` are left as they are.
template <class T>
HWY_INLINE void PackTransposedFast(const T* src, std::int64_t ld, std::int64_t cs,
                                   std::int64_t rows, std::int64_t cols, float scale, float* dst,
                                   std::int64_t M) {
  std::int64_t r0 = 0;
#if HWY_TARGET != HWY_SCALAR
  if constexpr (std::is_same_v<T, float>) {
    if (cs == 1) {
      const D4 d4;
      const V4 f = hn::Set(d4, scale);
      for (; r0 + 4 <= rows; r0 += 4) {
        const float* s0 = src + r0 * ld;
        std::int64_t x = 0;
        for (; x + 4 <= cols; x += 4) {
          V4 c0 = hn::LoadU(d4, s0 + x), c1 = hn::LoadU(d4, s0 + ld + x),
             c2 = hn::LoadU(d4, s0 + 2 * ld + x), c3 = hn::LoadU(d4, s0 + 3 * ld + x);
          Transpose4x4(c0, c1, c2, c3);
          hn::StoreU(hn::Mul(f, c0), d4, dst + x * M + r0);
          hn::StoreU(hn::Mul(f, c1), d4, dst + (x + 1) * M + r0);
          hn::StoreU(hn::Mul(f, c2), d4, dst + (x + 2) * M + r0);
          hn::StoreU(hn::Mul(f, c3), d4, dst + (x + 3) * M + r0);
        }
        for (std::int64_t r = r0; r < r0 + 4; ++r)
          for (std::int64_t y = x; y < cols; ++y) dst[y * M + r] = scale * src[r * ld + y];
      }
    }
  }
#endif
  if (r0 < rows) PackTransposed(src + r0 * ld, ld, cs, rows - r0, cols, scale, dst + r0, M);
}

// The activation views of a backward call, re-typed to their element type T (float, bf16_t,
// f16_t): every read widens to fp32 (the lane set-up loops, DenseRows, PackRows,
// PackTransposed, RowsOf), every write (StoreColumn) rounds once (SPEC "Reduced precision").
template <class T>
struct TypedBackward {
  Strided<const T*> q, k, v, out;
  In lse;
  Strided<const T*> dout;
  Strided<T*> dq, dk, dv;
  explicit TypedBackward(const BackwardArgs& a)
      : q(as<T>(a.q)),
        k(as<T>(a.k)),
        v(as<T>(a.v)),
        out(as<T>(a.out)),
        lse(a.lse),
        dout(as<T>(a.dout)),
        dq(as<T>(a.dq)),
        dk(as<T>(a.dk)),
        dv(as<T>(a.dv)) {}
};

// Runs unit_work(unit) for every unit < units on a team of `team` threads, units shared out
// dynamically (RunTeam and an orphaned `omp for`). A team of one outside any parallel region
// runs the units in a plain loop: no region and no loop scheduling calls (a tiny call's
// units take about a microsecond each; the libgomp calls were a visible part of it).
// Both run each unit through the one compiled body of RunUnit: inlined into two loops, the
// compiler could round them differently (contracting a product into an FMA in one and not
// the other), and results must not depend on the thread count.
template <class F>
HWY_NOINLINE void RunUnit(const F& unit_work, std::int64_t unit) {
  unit_work(unit);
}
template <class F>
void RunUnits(int team, std::int64_t units, const F& unit_work) {
  if (team <= 1 && omp_get_level() == 0) {
    for (std::int64_t unit = 0; unit < units; ++unit) RunUnit(unit_work, unit);
    return;
  }
  const auto team_work = [&]() HWY_ATTR {
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t unit = 0; unit < units; ++unit) RunUnit(unit_work, unit);
  };
  RunTeam(team, team_work);
}

// The query ranges of the one-pass backward (D-bwd-6). Its unit is (b, KV head j, query range
// s): the rows [row_begin[s], row_end(s)) of the g heads of group j, walking the key blocks
// [kb_lo[s], kb_hi[s]) that any of them can see (causal mask and window; a row outside sees no
// key of the others). The unit owns dQ and D of its rows. A key block seen by one range alone
// gets its dK/dV from that unit directly; a block seen by several gets their partial dKᵀ/dVᵀ
// ([2][d_h][M] each, in a slot of a shared buffer) summed in the order of s by a reduction unit
// per (b, j, key block), which also writes zeros for blocks no range sees. The ranges and the
// order depend on the shape only, so the bits never depend on the thread count; one range (B·H_kv
// large enough) is the plain one-pass form, bitwise as before, with no partials.
struct QuerySplit {
  static constexpr std::int64_t kMax = 16;
  std::int64_t count = 1;
  std::int64_t row_begin[kMax + 1] = {};  // multiples of M; row_begin[count] ≥ T_q
  std::int64_t kb_lo[kMax] = {}, kb_hi[kMax] = {};
  // Key blocks [sole_lo[s], sole_hi[s]) are seen by range s alone; the others of its walk have a
  // partial slot, first[s] + (kb − kb_lo[s]) below sole_lo[s], first[s] + (sole_lo[s] − kb_lo[s])
  // + (kb − sole_hi[s]) from sole_hi[s] on; `slots` per (b, j).
  std::int64_t sole_lo[kMax] = {}, sole_hi[kMax] = {}, first[kMax] = {};
  std::int64_t slots = 0;
  std::int64_t rows_max = 0;  // the longest range, rounded up to M (the dQᵀ accumulators)

  std::int64_t row_end(const AttentionProblem& p, std::int64_t s) const {
    return std::min(row_begin[s + 1], p.tq);
  }
  bool sees(std::int64_t s, std::int64_t kb) const { return kb >= kb_lo[s] && kb < kb_hi[s]; }
  std::int64_t slot(std::int64_t s, std::int64_t kb) const {
    return kb < sole_lo[s] ? first[s] + kb - kb_lo[s]
                           : first[s] + sole_lo[s] - kb_lo[s] + kb - sole_hi[s];
  }

  // `ranges` ranges of whole lane blocks of M rows, cut where the rows' cumulative key count
  // (causal mask and window; + 1 per row for its fixed work) crosses s / ranges of the total, so
  // the units of a causal call do similar work; at most one range per lane block.
  QuerySplit(const AttentionProblem& p, std::int64_t M, std::int64_t ranges) {
    const std::int64_t blocks = (p.tq + M - 1) / M, kblocks = (p.tk + M - 1) / M;
    count = std::clamp<std::int64_t>(ranges, 1, std::min(kMax, std::max<std::int64_t>(1, blocks)));
    const auto keys_of = [&](std::int64_t t) {  // keys row t sees under the mask and window
      const std::int64_t end = p.visible_end(t);
      const std::int64_t begin =
          p.var.window > 0 ? std::max<std::int64_t>(0, p.position(t) - p.var.window + 1) : 0;
      return std::max<std::int64_t>(0, end - begin) + 1;
    };
    double total = 0.0;
    for (std::int64_t t = 0; t < p.tq; ++t) total += static_cast<double>(keys_of(t));
    row_begin[0] = 0;
    std::int64_t s = 1;
    double sum = 0.0;
    for (std::int64_t blk = 0; blk < blocks && s < count; ++blk) {
      for (std::int64_t t = blk * M; t < std::min(p.tq, (blk + 1) * M); ++t)
        sum += static_cast<double>(keys_of(t));
      // Cut after this block once its share is reached, leaving a block for each later range.
      if (sum * static_cast<double>(count) >= total * static_cast<double>(s) ||
          blocks - (blk + 1) <= count - s) {
        row_begin[s++] = (blk + 1) * M;
      }
    }
    count = s;
    row_begin[count] = blocks * M;
    for (std::int64_t r = 0; r < count; ++r) {
      const std::int64_t t0 = row_begin[r], t1 = row_end(p, r) - 1;
      rows_max = std::max(rows_max, row_begin[r + 1] - row_begin[r]);
      const std::int64_t end = p.visible_end(t1);  // the last row sees the most keys
      kb_hi[r] = std::clamp<std::int64_t>((end + M - 1) / M, 0, kblocks);
      kb_lo[r] = p.var.window > 0 ? std::clamp<std::int64_t>(
                                        (p.position(t0) - p.var.window + 1) / M, 0, kb_hi[r])
                                  : 0;
    }
    for (std::int64_t r = 0; r < count; ++r) {  // monotone in r: neighbours bound the sharing
      const std::int64_t lo = r > 0 ? std::max(kb_lo[r], kb_hi[r - 1]) : kb_lo[r];
      const std::int64_t hi = r + 1 < count ? std::min(kb_hi[r], kb_lo[r + 1]) : kb_hi[r];
      sole_lo[r] = lo < hi ? lo : kb_hi[r];
      sole_hi[r] = lo < hi ? hi : kb_hi[r];
      first[r] = slots;
      slots += (kb_hi[r] - kb_lo[r]) - (sole_hi[r] - sole_lo[r]);
    }
  }
};

// The one-pass form's last step with several query ranges (QuerySplit): one unit per (b, KV
// head j, key block) that more than one range sees sums their partial dKᵀ, dVᵀ in the order of
// the ranges (a fixed order: bitwise the same for any thread count) and stores dK = scale · Σ,
// dV = Σ; a key block no range sees gets dK = dV = 0. Blocks seen by one range were stored by
// its unit.
template <class T>
void ReduceKeyBlocks(const TypedBackward<T>& args, const AttentionProblem& p,
                     const QuerySplit& split, std::int64_t M, float* partials) {
  const std::int64_t kblocks = (p.tk + M - 1) / M, dh = p.dh;
  const auto seen_by = [&](std::int64_t kb) {
    std::int64_t n = 0;
    for (std::int64_t s = 0; s < split.count; ++s) n += split.sees(s, kb) ? 1 : 0;
    return n;
  };
  bool any = false;  // a block to reduce or zero
  for (std::int64_t kb = 0; kb < kblocks && !any; ++kb) any = seen_by(kb) != 1;
  if (!any) return;
  const std::int64_t units = p.batch * p.hkv * kblocks;
  const auto unit_work = [&](std::int64_t unit) HWY_ATTR {
    const auto index = Unravel(unit, kblocks, p.hkv);  // copies: the lambdas below capture them
    const std::int64_t kb = index[0], j = index[1], b = index[2];
    const std::int64_t n = seen_by(kb), u0 = kb * M, keys = std::min(M, p.tk - u0);
    if (n == 1) return;
    if (n == 0) {  // no row sees these keys: dK = dV = 0
      for (std::int64_t u = 0; u < keys; ++u) {
        T* dk = args.dk.row(b, u0 + u, j);
        T* dv = args.dv.row(b, u0 + u, j);
        for (std::int64_t x = 0; x < dh; ++x) {
          dk[x * args.dk.s3] = narrow<T>(0.0f);
          dv[x * args.dv.s3] = narrow<T>(0.0f);
        }
      }
      return;
    }
    float* base = partials + (b * p.hkv + j) * split.slots * 2 * dh * M;
    float* acc = nullptr;  // the first range's slot, summed into in place
    for (std::int64_t s = 0; s < split.count; ++s) {
      if (!split.sees(s, kb)) continue;
      const float* part = base + split.slot(s, kb) * 2 * dh * M;
      if (acc == nullptr) {
        acc = base + split.slot(s, kb) * 2 * dh * M;
        continue;
      }
      for (std::int64_t i = 0; i < 2 * dh * M; ++i) acc[i] += part[i];
    }
    StoreColumns<T>(acc, M, 0, keys, dh, p.scale, args.dk.s3,
                    [&](std::int64_t u) { return args.dk.row(b, u0 + u, j); });
    StoreColumns<T>(acc + dh * M, M, 0, keys, dh, 1.0f, args.dv.s3,
                    [&](std::int64_t u) { return args.dv.row(b, u0 + u, j); });
  };
  RunUnits(team_size(p.threads, units), units, unit_work);
}

// kDp (D-bf16-8): keys [u0, u0 + keys) of KV head j of a bf16 view as vdpbf16ps B pairs
// (dpbf16.hpp): out[(x / 2 · M + u) · 2 + x % 2] = X[u0 + u][x] (bits), zero for u ≥ keys and for
// the pad column x = dh of an odd d_h.
inline void PackKeyPairs(const Strided<const bf16_t*>& x, std::int64_t b, std::int64_t u0,
                         std::int64_t j, std::int64_t keys, std::int64_t dh, std::int64_t dh2,
                         std::int64_t M, std::uint16_t* out) {
  std::fill(out, out + dh2 * M, std::uint16_t{0});
  for (std::int64_t u = 0; u < keys; ++u) {
    const bf16_t* row = x.row(b, u0 + u, j);
    for (std::int64_t e = 0; e < dh; ++e)
      out[((e >> 1) * M + u) * 2 + (e & 1)] = row[e * x.s3].bits;
  }
}

// kDp: rows [t0, t0 + rows) of head h of a bf16 view as vdpbf16ps A rows (pairs of adjacent
// columns): in place when d_h is even and unit-strided (a_row = the view's row stride), else
// copied into buf [rows][dh2] with a zero pad column.
inline const std::uint16_t* Bf16Rows(const Strided<const bf16_t*>& x, std::int64_t b,
                                     std::int64_t t0, std::int64_t h, std::int64_t rows,
                                     std::int64_t dh, std::int64_t dh2, std::uint16_t* buf,
                                     std::int64_t& a_row) {
  if (x.s3 == 1 && dh == dh2) {
    a_row = x.s1;
    return reinterpret_cast<const std::uint16_t*>(x.row(b, t0, h));
  }
  for (std::int64_t r = 0; r < rows; ++r) {
    const bf16_t* row = x.row(b, t0 + r, h);
    for (std::int64_t e = 0; e < dh; ++e) buf[r * dh2 + e] = row[e * x.s3].bits;
    if (dh2 > dh) buf[r * dh2 + dh] = 0;
  }
  a_row = dh2;
  return buf;
}

// The one-pass backward: dK and dV with the block's keys in lanes, and dQ and D. One unit per
// (b, KV head j, query range s) walks the key blocks its rows see in order; it owns dQ of its
// rows of the g heads of group j, accumulating dQᵀ += Kᵀ dSᵀ per block into a per-unit buffer
// of g × rows/M lane blocks [d_h][M] (O(T·d_h) per head; blocked so each chunk's dQᵀ is
// contiguous): 5 products per score tile, and exactly one owner per output row or a sum in a
// fixed order (ReduceKeyBlocks), so results are bitwise independent of the thread count.
template <class T, int VN, bool kDp = false>
void BackwardOnePass(const BackwardArgs& bwd, float* delta, const QuerySplit& split) {
  const AttentionProblem& p = bwd.p;
  const TypedBackward<T> args(bwd);
  const hn::ScalableTag<float> d;
  using VF = hn::Vec<decltype(d)>;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d)), M = VN * N;
  const std::int64_t dh = p.dh, g = p.group();
  const std::int64_t ranges = split.count;
  const std::int64_t units = p.batch * p.hkv * ranges;
  if (units == 0) return;
  const int team = team_size(p.threads, units);
  // Query rows per chunk: M (a chunk is one lane block of dQᵀ).
  const std::int64_t chunk = M;
  const std::int64_t rows_pad = split.rows_max;  // rows of the longest query range
  // Per-worker scratch: scale·Kᵀ, Vᵀ, dKᵀ, dVᵀ [dh][M] (one slot: zeroed together per key block),
  // S → P and dP → dS [chunk][M], packed Q and dO rows [chunk][dh] when d_h is strided, the K
  // block [M][dh], dSᵀ [M][M] and the unit's dQᵀ [g][rows_pad / M][dh][M].
  ScratchLayout scratch_layout(p.site);
  ScratchLayout& sl = scratch_layout;
  const auto kv_acc_slot = sl.add<float>(scratch_mul(4 * M, dh, p.site, "K^T, V^T, dK^T, dV^T"));
  const auto scores_slot = sl.add<float>(chunk * M);
  const auto dp_slot = sl.add<float>(chunk * M);
  const auto q_pack_slot = sl.add<float>(scratch_mul(chunk, dh, p.site, "Q rows"));
  const auto do_pack_slot = sl.add<float>(scratch_mul(chunk, dh, p.site, "dO rows"));
  const auto k_nat_slot = sl.add<float>(scratch_mul(M, dh, p.site, "K block"));
  const auto dst_slot = scratch_layout.add<float>(M * M);
  const std::int64_t dq_floats =
      scratch_mul(scratch_mul(g, dh, p.site, "dQ^T"), rows_pad, p.site, "dQ^T");
  const auto dqt_slot = scratch_layout.add<float>(dq_floats);
  // kDp (D-bf16-8): the key block's K and V as vdpbf16ps B pairs [dh2 / 2][M][2] (bf16 bits,
  // d_h padded with a zero to even dh2), and Q / dO rows as bf16 A rows [chunk][dh2] when they
  // cannot be read in place.
  const std::int64_t dh2 = (dh + 1) / 2 * 2;
  if constexpr (kDp) HWY_ASSERT(M == dpbf16::kLanes);
  const auto kv_pairs_slot = sl.add<std::uint16_t>(kDp ? 2 * dh2 * M : 0);
  const auto rows16_slot = sl.add<std::uint16_t>(kDp ? 2 * chunk * dh2 : 0);
  const ScoreVariants& var = p.var;
  const bool elementwise = var.elementwise(), capped = var.softcap > 0.0f;
  const float score_scale = ScoreScale(p);  // s, or s / c with soft-capping (variants-inl.h)
  const bool keep_mask = var.mask_kind == MaskKind::boolean;
  const auto dcap_slot = sl.add<float>(capped ? chunk * M : 0);     // ∂S/∂z [chunk][M]
  const auto keep_slot = sl.add<float>(keep_mask ? chunk * M : 0);  // boolean mask
  const auto range_slot = sl.add<std::int32_t>(2 * chunk);          // chunk rows' key ranges
  const Dropout& drop = var.dropout;
  const auto drop_slot = sl.add<float>(drop.active ? M : 0);  // Z / (1 − p) of a row's keys [M]
  const ScratchArena scratch(scratch_layout, team,
                             "the per-worker scratch of the one-pass backward");
  const std::int64_t shift = p.align == CausalAlign::bottom_right ? p.tk - p.tq : 0;
  // Several query ranges: the partial dKᵀ, dVᵀ [2][dh][M] of every key block seen by more than
  // one range, split.slots per (b, j) (QuerySplit).
  const std::int64_t partial_floats =
      scratch_mul(scratch_mul(p.batch * p.hkv, split.slots, p.site, "partial dK, dV"),
                  scratch_mul(2 * M, dh, p.site, "partial dK, dV"), p.site, "partial dK, dV");
  ScratchLayout partial_layout(p.site);
  const auto partial_slot = partial_layout.add<float>(partial_floats);
  const ScratchArena partial_memory(partial_layout, 1, "the partial dK, dV of the query ranges");
  float* partials = partial_memory.at(partial_slot, 0);

  const auto unit_work = [&](std::int64_t unit) HWY_ATTR {
    {
      // unit = (query range s, j, b), the last range (whose rows see the most keys) first.
      // (Copies, not structured bindings: the lambdas below capture them, which C++20 allows
      // only from clang 16 on.)
      const auto unit_index = Unravel(unit, ranges, p.hkv);
      const std::int64_t j = std::get<1>(unit_index), b = std::get<2>(unit_index);
      const std::int64_t s = ranges - 1 - std::get<0>(unit_index);  // the query range
      const std::int64_t kb_first = split.kb_lo[s], kb_end = split.kb_hi[s];
      const std::int64_t row0 = split.row_begin[s], row1 = split.row_end(p, s);  // its rows

      const int worker = omp_get_thread_num();
      float* kt = scratch.at(kv_acc_slot, worker);        // scale·Kᵀ [dh][M]
      float* vt = kt + dh * M;                            // Vᵀ [dh][M]
      float* dkt = vt + dh * M;                           // dKᵀ [dh][M]
      float* dvt = dkt + dh * M;                          // dVᵀ [dh][M]
      float* scores = scratch.at(scores_slot, worker);    // S → P [chunk][M]
      float* dp = scratch.at(dp_slot, worker);            // dP → dS [chunk][M]
      float* q_pack = scratch.at(q_pack_slot, worker);    // [chunk][dh] if needed
      float* do_pack = scratch.at(do_pack_slot, worker);  // [chunk][dh] if needed
      float* k_nat = scratch.at(k_nat_slot, worker);      // K block [M][dh]
      float* dst = scratch.at(dst_slot, worker);          // dSᵀ [M keys][M rows]
      float* dqt = scratch.at(dqt_slot, worker);          // dQᵀ [g][rows_pad/M][dh][M]
      float* dcap = capped ? scratch.at(dcap_slot, worker) : nullptr;     // [chunk][M]
      float* keep = keep_mask ? scratch.at(keep_slot, worker) : nullptr;  // [chunk][M]
      std::int32_t* rb = scratch.at(range_slot, worker);  // key_range(b, h, c0 + r).begin [chunk]
      std::int32_t* re = rb + chunk;                      // ... .end; empty past T_q
      float* drop_factor = drop.active ? scratch.at(drop_slot, worker) : nullptr;  // [M]
      [[maybe_unused]] std::uint16_t* k_pairs = kDp ? scratch.at(kv_pairs_slot, worker) : nullptr;
      [[maybe_unused]] std::uint16_t* v_pairs = kDp ? k_pairs + dh2 * M : nullptr;
      [[maybe_unused]] std::uint16_t* q16 = kDp ? scratch.at(rows16_slot, worker) : nullptr;
      [[maybe_unused]] std::uint16_t* do16 = kDp ? q16 + chunk * dh2 : nullptr;

      {  // D_t = ⟨dO_t, O_t⟩ for the group's rows; dQᵀ = 0
        for (std::int64_t h = j * g; h < (j + 1) * g; ++h)
          for (std::int64_t t = row0; t < row1; ++t) {
            const T* dout = args.dout.row(b, t, h);
            const T* o = args.out.row(b, t, h);
            float dsum = 0.0f;
            for (std::int64_t x = 0; x < dh; ++x)
              dsum += widen(dout[x * args.dout.s3]) * widen(o[x * args.out.s3]);
            const KeyRange r = p.key_range(b, h, t);
            delta[(b * p.hq + h) * p.tq + t] = r.end > r.begin ? dsum : 0.0f;
          }
        std::fill(dqt, dqt + dq_floats, 0.0f);
      }

      for (std::int64_t kb = kb_first; kb < kb_end; ++kb) {
        const std::int64_t u0 = kb * M, keys = std::min(M, p.tk - u0);
        // Zero the padding lanes (keys ≥ T_k) and the accumulators; kDp leaves scale·Kᵀ and Vᵀ
        // unused (its S and dP read the pairs), so only dKᵀ, dVᵀ.
        std::fill(kDp ? dkt : kt, kt + 4 * dh * M, 0.0f);
        if constexpr (kDp) {  // S and dP take K and V unscaled, as bf16 pairs
          PackKeyPairs(args.k, b, u0, j, keys, dh, dh2, M, k_pairs);
          PackKeyPairs(args.v, b, u0, j, keys, dh, dh2, M, v_pairs);
        } else {
          PackTransposedFast(args.k.row(b, u0, j), args.k.s1, args.k.s3, keys, dh, score_scale, kt,
                             M);
          PackTransposedFast(args.v.row(b, u0, j), args.v.s1, args.v.s3, keys, dh, 1.0f, vt, M);
        }
        PackRows(args.k.row(b, u0, j), args.k.s1, args.k.s3, keys, dh, k_nat, VecWiden());
        std::fill(k_nat + keys * dh, k_nat + M * dh, 0.0f);

        // Queries that see any key of the block: t ≥ u0 − shift (causal), all otherwise. Chunks
        // start on a multiple of M (they are lane blocks of dQᵀ); rows before t_first are fully
        // masked there and contribute exactly 0.
        // With a window W, rows t ≥ u0 + keys − 1 + W − shift see none of them (p(t) − W < u).
        const std::int64_t t_first = p.causal ? std::max<std::int64_t>(0, u0 - shift) : 0;
        const std::int64_t c_begin = std::max(row0, t_first / M * M);
        const std::int64_t t_stop =
            var.window > 0 ? std::clamp<std::int64_t>(u0 + keys - 1 + var.window - shift, 0, row1)
                           : row1;
        for (std::int64_t h = j * g; h < (j + 1) * g; ++h) {  // the g query heads of group j (4.8)
          for (std::int64_t c0 = c_begin; c0 < t_stop; c0 += chunk) {
            const std::int64_t rows = std::min(chunk, row1 - c0);
            // The rows' key ranges; skip a chunk none of whose rows sees a key of the block.
            // Rows [r_lo, r_hi) are the ones that do not see every key of the block; keys
            // outside [u0 + full_lo, u0 + full_hi) are not seen by every row.
            bool any = false;
            std::int64_t r_lo = rows, r_hi = 0, full_lo = 0, full_hi = keys;
            for (std::int64_t r = 0; r < rows; ++r) {
              const KeyRange kr = p.key_range(b, h, c0 + r);
              rb[r] = static_cast<std::int32_t>(kr.begin);
              re[r] = static_cast<std::int32_t>(kr.end);
              any |= kr.end > kr.begin && kr.begin < u0 + keys && kr.end > u0;
              if (kr.begin > u0 || kr.end < u0 + keys) {
                r_lo = std::min(r_lo, r);
                r_hi = r + 1;
              }
              full_lo = std::max(full_lo, kr.begin - u0);
              full_hi = std::min(full_hi, kr.end - u0);
            }
            if (!any) continue;
            for (std::int64_t r = rows; r < chunk; ++r) rb[r] = re[r] = 0;
            // Q and dO rows are read in place (packing them per chunk was slower, docs/
            // performance.md, D-bwd-3); only a non-unit d_h stride forces a copy.
            std::int64_t ldq = 0, lddo = 0;
            const float* q_rows = RowsOf(args.q, b, c0, h, rows, dh, q_pack, ldq, VecWiden());
            const float* do_rows = RowsOf(args.dout, b, c0, h, rows, dh, do_pack, lddo, VecWiden());
            if constexpr (kDp) {
              // The same two products on vdpbf16ps: the operands are bf16 already, so each
              // product is exact and only the fp32 accumulation order differs (D-bf16-8).
              std::int64_t aq = 0, ado = 0;
              const std::uint16_t* q_a = Bf16Rows(args.q, b, c0, h, rows, dh, dh2, q16, aq);
              const std::uint16_t* do_a = Bf16Rows(args.dout, b, c0, h, rows, dh, dh2, do16, ado);
              dpbf16::GemmRows(rows, q_a, aq, k_pairs, dh2 / 2, scores, M, false, nullptr,
                               score_scale);  // S = scale · Q Kᵀ (4.2)
              dpbf16::GemmRows(rows, do_a, ado, v_pairs, dh2 / 2, dp, M, false, nullptr,
                               1.0f);  // dP = dO Vᵀ
            } else {
              GemmRows<kR, VN>(d, rows, q_rows, ldq, 1, kt, M, dh, scores, M,
                               false);  // S = Q (scale·K)ᵀ (4.2)
              GemmRows<kR, VN>(d, rows, do_rows, lddo, 1, vt, M, dh, dp, M, false);  // dP = dO Vᵀ
            }
            for (std::int64_t r = 0; r < rows; ++r) {
              const std::int64_t t = c0 + r;
              // Lanes [lo, visible) see their key (key range of the row, SPEC 4.3 and variants).
              const std::int64_t lo = rb[r] - u0, visible = re[r] - u0;
              const float lse = args.lse.data[b * args.lse.s0 + h * args.lse.s1 + t * args.lse.s2];
              const VF l = hn::Set(d, visible > 0 ? softmax_shift(lse) : 0.0f);
              const VF dl = hn::Set(d, delta[(b * p.hq + h) * p.tq + t]);
              if (elementwise) {  // the forward's S: cap, ALiBi, general mask
                ElementwiseKeyLanes(d, p, scores + r * M, M, keys, u0, b, h, t,
                                    dcap != nullptr ? dcap + r * M : nullptr,
                                    keep != nullptr ? keep + r * M : nullptr);
              }
              // Dropout (D.4): the values saw P̃ = A ⊙ Z / (1 − p), so dA = dP̃ ⊙ Z / (1 − p) and
              // dV takes P̃ (below, after dS).
              if (drop_factor != nullptr) DropFactorsKeyLanes(d, drop, b, h, t, u0, M, drop_factor);
              for (std::int64_t i = 0; i < M; i += N) {
                VF pu = ExpNaNFlushTiny(
                    d, hn::Sub(hn::Load(d, scores + r * M + i), l));  // A = e^{S − L}
                VF da = hn::Load(d, dp + r * M + i);                  // dA = dO Vᵀ (dP̃)
                if (drop_factor != nullptr) da = hn::Mul(da, hn::Load(d, drop_factor + i));
                VF ds = hn::Mul(pu, hn::Sub(da, dl));  // dS = A ⊙ (dA − D)
                if (visible < i + N || lo > i) {       // key range (4.3), a select on P and dS
                  const std::int64_t n_vis = std::clamp<std::int64_t>(visible - i, 0, N);
                  const std::int64_t n_lo = std::clamp<std::int64_t>(lo - i, 0, N);
                  const auto seen = hn::AndNot(hn::FirstN(d, static_cast<std::size_t>(n_lo)),
                                               hn::FirstN(d, static_cast<std::size_t>(n_vis)));
                  pu = hn::IfThenElseZero(seen, pu);
                  ds = hn::IfThenElseZero(seen, ds);
                }
                if (keep != nullptr) {  // general boolean mask, a select as well
                  const auto kept = hn::Ne(hn::Load(d, keep + r * M + i), hn::Zero(d));
                  pu = hn::IfThenElseZero(kept, pu);
                  ds = hn::IfThenElseZero(kept, ds);
                }
                if (dcap != nullptr) ds = hn::Mul(ds, hn::Load(d, dcap + r * M + i));        // dz
                if (drop_factor != nullptr) pu = hn::Mul(pu, hn::Load(d, drop_factor + i));  // P̃
                hn::Store(pu, d, scores + r * M + i);
                hn::Store(ds, d, dp + r * M + i);
              }
            }
            // dVᵀ += dOᵀ P, dKᵀ += Qᵀ dS. Rows [r_lo, r_hi) do not see every key of the block: a
            // NaN in their dO or Q must not reach the keys they do not see (0 · NaN = NaN).
            if (keep != nullptr) r_lo = 0, r_hi = rows;
            const auto row_sees = [&](std::int64_t r, std::int64_t i) {
              const std::int64_t n = std::clamp<std::int64_t>(re[r] - u0 - i, 0, N);
              const std::int64_t n_lo = std::clamp<std::int64_t>(rb[r] - u0 - i, 0, N);
              auto seen = hn::AndNot(hn::FirstN(d, static_cast<std::size_t>(n_lo)),
                                     hn::FirstN(d, static_cast<std::size_t>(n)));
              if (keep != nullptr) {
                seen = hn::And(seen, hn::Ne(hn::Load(d, keep + r * M + i), hn::Zero(d)));
              }
              return seen;
            };
            GemmRowsMaskedIfNonFinite<VN>(d, dh, do_rows, 1, lddo, scores, M, rows, dvt, M, true,
                                          nullptr, r_lo, r_hi, row_sees);
            GemmRowsMaskedIfNonFinite<VN>(d, dh, q_rows, 1, ldq, dp, M, rows, dkt, M, true, nullptr,
                                          r_lo, r_hi, row_sees);
            {
              // dQᵀ[x][c0 + r] += Σ_u K[u][x] dS[r][u]: dS transposed to [key][row] (rows past
              // T_q zeroed), then the microkernel with B = dSᵀ, C = the chunk's columns of dQᵀ.
              for (std::int64_t u = 0; u < M; ++u) {
                for (std::int64_t r = 0; r < rows; ++r) dst[u * M + r] = dp[r * M + u];
                for (std::int64_t r = rows; r < M; ++r) dst[u * M + r] = 0.0f;
              }
              // Keys outside [u0 + full_lo, u0 + full_hi) are not seen by some rows of the chunk:
              // row c0 + i + lane sees key u0 + u iff rb ≤ u0 + u < re (and the boolean mask).
              const hn::RebindToSigned<decltype(d)> di;
              const auto key_seen_by = [&](std::int64_t u, std::int64_t i) {
                const auto key = hn::Set(di, static_cast<std::int32_t>(u0 + u));
                auto seen = hn::RebindMask(d, hn::AndNot(hn::Lt(key, hn::LoadU(di, rb + i)),
                                                         hn::Lt(key, hn::LoadU(di, re + i))));
                if (keep != nullptr) {  // keep is [row][key]: gather the lanes' column
                  HWY_ALIGN float col[hn::MaxLanes(d)] = {};
                  for (std::int64_t x = 0; x < N; ++x)
                    col[x] = i + x < rows ? keep[(i + x) * M + u] : 0.0f;
                  seen = hn::And(seen, hn::Ne(hn::Load(d, col), hn::Zero(d)));
                }
                return seen;
              };
              const PartialKeys part =
                  keep != nullptr ? PartialKeys{0, keys} : PartialRange(full_lo, full_hi, keys);
              GemmRowsMaskedIfNonFinite<VN>(d, dh, k_nat, 1, dh, dst, M, keys,
                                            dqt + ((h - j * g) * rows_pad + c0 - row0) * dh, M,
                                            true, nullptr, part.lo, part.hi, key_seen_by);
            }
          }
        }
        if (kb < split.sole_lo[s] || kb >= split.sole_hi[s]) {
          // Another range sees the block too: this range's partial sums, reduced below.
          float* part = partials + ((b * p.hkv + j) * split.slots + split.slot(s, kb)) * 2 * dh * M;
          std::copy(dkt, dkt + 2 * dh * M, part);
        } else {  // dK = scale · (dKᵀ)ᵀ, dV = (dVᵀ)ᵀ
          StoreColumns<T>(dkt, M, 0, keys, dh, p.scale, args.dk.s3,
                          [&](std::int64_t u) { return args.dk.row(b, u0 + u, j); });
          StoreColumns<T>(dvt, M, 0, keys, dh, 1.0f, args.dv.s3,
                          [&](std::int64_t u) { return args.dv.row(b, u0 + u, j); });
        }
      }

      {  // dQ = scale · (dQᵀ)ᵀ
        for (std::int64_t h = j * g; h < (j + 1) * g; ++h) {
          const float* src = dqt + (h - j * g) * rows_pad * dh;
          for (std::int64_t t0 = row0; t0 < row1; t0 += M) {  // lane t % M of lane block t / M
            StoreColumns<T>(src + (t0 - row0) * dh, M, 0, std::min(M, row1 - t0), dh, p.scale,
                            args.dq.s3, [&](std::int64_t l) { return args.dq.row(b, t0 + l, h); });
          }
        }
      }
    }
  };
  RunUnits(team, units, unit_work);
  ReduceKeyBlocks<T>(args, p, split, M, partials);
}

template <class T, int VN, bool kDp = false>
void AttentionBwdLanes(const BackwardArgs& args) {
  const AttentionProblem& p = args.p;
  ScratchLayout delta_layout(p.site);  // D [B, H_q, T_q], shared by both passes
  const auto delta_slot = delta_layout.add<float>(
      scratch_mul(scratch_mul(p.batch, p.hq, p.site, "D"), p.tq, p.site, "D"));
  const ScratchArena delta_memory(delta_layout, 1, "D = rowsum(dO * O)");
  float* delta = delta_memory.at(delta_slot, 0);
  // One pass (5 products per score tile) for every shape: at least kOnePassUnits units of
  // (b, KV head, query range), and query ranges whose dQᵀ accumulators fit kRangeDqBytes, up to
  // kCacheRanges (D-bwd-6). The ranges depend on the shape only, never on the thread count, so
  // results stay bitwise independent of it. (The two-pass form measured slower at every shape,
  // D-bwd-6, and was removed.)
  const std::int64_t M = VN * static_cast<std::int64_t>(hn::Lanes(hn::ScalableTag<float>()));
  const std::int64_t pairs = std::max<std::int64_t>(1, p.batch * p.hkv);
  const std::int64_t by_units = (kOnePassUnits + pairs - 1) / pairs;
  const std::int64_t dq_bytes = p.group() * p.dh * ((p.tq + M - 1) / M * M) * 4;
  const std::int64_t by_bytes =
      std::min(kCacheRanges, (dq_bytes + kRangeDqBytes - 1) / kRangeDqBytes);
  BackwardOnePass<T, VN, kDp>(args, delta, QuerySplit(p, M, std::max(by_units, by_bytes)));
}

// kDp (path avx512_bf16, T = bf16_t, AVX-512 target only; D-bf16-8): S = QKᵀ and dP = dO Vᵀ on
// vdpbf16ps from the bf16 operands (exact products, fp32 accumulation); dV, dK, dQ stay fp32
// products on the widened operands, so nothing is rounded that the widening kernel keeps in fp32.
// A tiny problem takes the one-vector blocks of the widening kernel (M = one vector, not the 64
// lanes of the pairs).
template <class T, bool kDp = false>
void AttentionBwdT(const BackwardArgs& args) {
  const AttentionProblem& p = args.p;
  // A tiny problem (every query row and every key within one vector of lanes, a small training
  // step's attention) runs with lane blocks of one vector instead of kV: most of a wide block's
  // work (products, packing, zeroing) is then padding lanes. Each lane's arithmetic is the same
  // FMA sequence at either width, so the results are the same; the choice depends on the shape
  // only (never on the thread count).
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(hn::ScalableTag<float>()));
  if (p.tq <= N && p.tk <= N) {
    AttentionBwdLanes<T, 1>(args);
  } else {
    AttentionBwdLanes<T, kV, kDp>(args);
  }
}

}  // namespace tokenmix::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard (per target)

// The three exports of one dtype's translation unit (its HWY_ONCE part): the kernel per target,
// attention_bwd_<dtype>_<avx512|avx2|neon>, null where the target is not compiled.
#ifndef TOKENMIX_BWD_KERNELS
#define TOKENMIX_BWD_KERNELS(dtype, T)                                                          \
  const BackwardKernel attention_bwd_##dtype##_avx512 = TOKENMIX_SIMD_AVX512(AttentionBwdT<T>); \
  const BackwardKernel attention_bwd_##dtype##_avx2 = TOKENMIX_SIMD_AVX2(AttentionBwdT<T>);     \
  const BackwardKernel attention_bwd_##dtype##_neon = TOKENMIX_SIMD_NEON(AttentionBwdT<T>)
#endif
