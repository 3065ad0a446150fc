// src/kernels/simd/decode_products-inl.h — the decode products (Highway): ColumnBlocks (one
// register-blocked product over a tile's columns), the unit a reader sees (DecodeUnit) and the
// three product shapes every reader calls with the element type it reads the cache through:
//   S[r][u]  = Σ_x (scale·q_r)[x] · Kᵀ[x][u]   A = scale·Q rows, B = K tile [d_h][64]  (4.2)
//   Õ[r][x] += Σ_u P[r][u] · V[u][x]        A = P rows (broadcast),   B = V rows [64][d_h]  (4.5)
// and one row's Õ over its own visible keys (a V tile with non-finite rows).
//
// Highway "-inl" header: included once per target from a foreach_target translation unit.
#if defined(TOKENMIX_KERNELS_SIMD_DECODE_PRODUCTS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TOKENMIX_KERNELS_SIMD_DECODE_PRODUCTS_INL_H_
#undef TOKENMIX_KERNELS_SIMD_DECODE_PRODUCTS_INL_H_
#else
#define TOKENMIX_KERNELS_SIMD_DECODE_PRODUCTS_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "hwy/highway.h"
#include "kernels/attention_kernels.hpp"
#include "kernels/kv_element.hpp"
#include "kernels/simd/decode_blocking-inl.h"
#include "kernels/simd/microkernel-inl.h"

HWY_BEFORE_NAMESPACE();
namespace tokenmix::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// True if an element of p[lo, hi) is NaN or ±∞ (exponent bits all ones), from the bits alone
// (a branch-free loop the compiler vectorises).
template <class TB>
bool NonFiniteIn(const TB* p, std::int64_t lo, std::int64_t hi) {
  using Bits = std::conditional_t<sizeof(TB) == 4, std::uint32_t, std::uint16_t>;
  constexpr Bits kExp = static_cast<Bits>(sizeof(TB) == 4                      ? 0x7f80'0000u
                                          : std::is_same_v<TB, hwy::float16_t> ? 0x7c00u
                                                                               : 0x7f80u);
  static_assert(sizeof(TB) == sizeof(Bits));
  const auto* bits = reinterpret_cast<const Bits*>(p);
  Bits bad = 0;
  for (std::int64_t i = lo; i < hi; ++i) bad |= static_cast<Bits>((bits[i] & kExp) == kExp);
  return bad != 0;
}

// One product over a tile's columns (S: keys, Õ: features): C[rows][x] (+)= A B[·][x], A's rows
// a_row apart, for x in whole blocks of VN vectors (the R × VN register blocking; pf: the same
// columns of a later tile prefetched) and then single vectors, up to vec (a multiple of Lanes).
// Returns the first column not computed.
// A's element (r, k) is at a[r·kARow + k·a_k]: the compile-time row stride of MicroKernel.
// The rows go in ceil(rows / R) blocks of sizes that differ by at most one (8 rows at R = 6:
// 4 + 4, not 6 + 2, whose 2-row block keeps 4 FMA chains where the latency needs 8 on AVX2):
// AVX2 on AMD Zen 4, T_new = 2 hot, 4–9 % faster (docs/performance.md, D-decode-6). Each
// element's k loop is the same whatever the blocks (the same bits).
// (The column and k-chunk shapes: kThreeVectorSmallBlocks, kKChunk, decode_blocking-inl.h.)
template <int R, int VN, std::int64_t kARow, class D, class TB>
HWY_INLINE std::int64_t ColumnBlocks(D d, std::int64_t rows, const float* a, std::int64_t a_k,
                                     const TB* b, std::int64_t ldb, std::int64_t K, float* c,
                                     std::int64_t ldc, bool accumulate, std::int64_t vec,
                                     const TB* pf, PrefetchCursor* cursor) {
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d)), W = VN * N;
  std::int64_t x = 0;
  const std::int64_t blocks = (rows + R - 1) / R;
  if constexpr (kThreeVectorSmallBlocks<TB> && VN == 2) {
    if (LargestRowBlock(rows, R) <= 4) {  // every row block: at most 4 rows
      const std::int64_t W3 = 3 * N;
      std::int64_t blocks3 = vec / W3;  // 3-vector blocks, leaving a multiple of W columns
      while (blocks3 > 0 && (vec - blocks3 * W3) % W != 0) --blocks3;
      for (std::int64_t j = 0; j < blocks3; ++j, x += W3) {
        const TB* pfx = BColumn(pf, x);
        for (std::int64_t i = 0, r0 = 0; i < blocks; ++i) {
          const std::int64_t n = rows / blocks + (i < rows % blocks ? 1 : 0);  // this block's rows
          GemmRows<4, 3, true, kARow>(d, n, a + r0 * kARow, kARow, a_k, BColumn(b, x), ldb, K,
                                      c + r0 * ldc + x, ldc, accumulate, nullptr, pfx,
                                      i == 0 ? cursor : nullptr);
          r0 += n, pfx = nullptr;
        }
      }
    }
  }
  // The cursor: advanced by the first row block, or (kCursorAcrossRowBlocks) by the first
  // `sharers` of them, as many as a B row has cache lines at most: each then asks for whole lines,
  // none twice (at 64 rows, 6 blocks sharing 2 lines per k made a compute-bound step 2–3 % slower).
  std::int64_t sharers = 1;
  if (kCursorAcrossRowBlocks && cursor != nullptr) {
    const std::int64_t lines = W * static_cast<std::int64_t>(sizeof(TB)) / 64;
    sharers = std::clamp<std::int64_t>(lines, 1, blocks);
    cursor->sharers = sharers;
  }
  // The k loop in chunks of kc rows of B (kKChunk), or whole; one pass even for K = 0 (an int8
  // cache in quads with d_h < 4 has no quad features: C is then zeroed, or left as it is).
  const std::int64_t kc =
      kKChunk<TB> > 0 && blocks > 1 ? kKChunk<TB> : std::max<std::int64_t>(K, 1);
  for (; x + W <= vec; x += W) {
    for (std::int64_t k0 = 0; k0 == 0 || k0 < K; k0 += kc) {
      const TB* pfx = pf != nullptr ? BColumn(pf, x) + k0 * ldb : nullptr;
      for (std::int64_t i = 0, r0 = 0; i < blocks; ++i) {
        const std::int64_t n = rows / blocks + (i < rows % blocks ? 1 : 0);  // this block's rows
        GemmRows<R, VN, true, kARow>(d, n, a + r0 * kARow + k0 * a_k, kARow, a_k,
                                     BColumn(b, x) + k0 * ldb, ldb, std::min(kc, K - k0),
                                     c + r0 * ldc + x, ldc, accumulate || k0 > 0, nullptr, pfx,
                                     i < sharers ? cursor : nullptr);
        r0 += n, pfx = nullptr;
      }
    }
  }
  for (; x + N <= vec; x += N) {
    GemmRows<R, 1, true, kARow>(d, rows, a, kARow, a_k, BColumn(b, x), ldb, K, c + x, ldc,
                                accumulate);
  }
  return x;
}

// The Reader policy (one per cache dtype family; all members inlined into the loop):
//   Elem, kQuantized       the cache element; quantized: K's channel scales after each K tile
//                          (folded into the rows, see below), V's row scales after each V tile
//                          multiply P (times 1 / ValueUnit())
//   RowElem                (activation dtypes) what a row's own-keys P·V product reads
//   tiles                  its product backend (decode_amx-inl.h)
//   Reader(a)              per call and worker
//   BeginUnit(u, in_place) per unit, scale·Q written: backend claim, reading modes (may rescale Q)
//   RegularOnly()          keep the regular blocking whatever the rows
//   SetBlocking(u)         u.tall and u.w_blk known
//   LinearPrefetch()       this unit prefetches linearly whatever the dtype's default
//   Scores(u, t)           S of tile t in key order (4.2)
//   KeyPost(), ValueUnit(u, t, vs)  the scores' factor; the V tile's reading and LoadB's unit
//   PrepareValues(u, t, v) before the tile's P·V; Values(u, vk, vn, k0, nk, vld, cur) (4.5)
//   ValueIndex(a, u, x, vld)  element of V[u][x] in the tile (the scalar tail)
//   EndUnit(u)             Õ's columns back in order
//
//   KeyFold()              quantized: the power of two f the skeleton folds into scale·Q ⊙ δ_τ
//   KeyMax()               quantized: KeyTile reads qmax (else it is 0)
//   KeyTile(qmax)          quantized, per closed K tile, qmax = max |scale·Q ⊙ δ_τ| (f = 1):
//                          picks the tile's K reading; returns the power of two the fold then
//                          multiplies the rows by (1: none)
//
// Quantized caches (SPEC "Quantized KV cache"): a closed K tile's channel scales δ_{τ,e} fold
// into the query rows once per tile (FoldKeyScales: S_u = Σ_e ((s·q_r)[e] δ_{τ,e}) c_{u,e}, times
// KeyPost()), so the inner loop stays one-byte → fp32 FMAs (docs/performance.md, D-kv-2); the open
// tile (keys from DecodeArgs::open_start) is read unquantized from its fp32 staging copy by the
// float product. V's row scales multiply P before P V (Õ += Σ_u (P_u δ_u) c_u, l from the unscaled
// P): attention over the dequantized values at fp32 rounding level; the elements are widened in
// registers (LoadB) and never stored as fp32. LoadB returns c · kLoadBUnit (2^−8 for fp8): the
// scales are multiplied by 1 / kLoadBUnit (exact, a power of two), and the scalar tail reads
// c · kLoadBUnit too.

// Quantized caches, K (SPEC "Quantized KV cache"): q·k̂_u = Σ_e (q_e δ_{τ,e}) c_{u,e}, the
// channel scales δ_τ of a closed K tile folded into the unit's query rows once per tile and
// query row: qd[x][r] = (qs[x][r] · (δ[x] · f)) · up over [d_h][nrows] (DecodeUnit::qs's layout),
// f and up powers of two (f: the reader's KeyFold(), the unit its K reading's LoadB returns; up:
// KeyTile()'s prescale; 1 is not multiplied). Vectorised three ways: nrows a multiple of Lanes
// (δ[x] broadcast per channel), Lanes a multiple of nrows (one vector spans Lanes / nrows
// channels: δ's lanes repeated by a table lookup; δ is read a vector at a time, up to Lanes − 1
// floats past the d_h scales: the V tile follows them in the cache), else scalar. One pass, no
// integer division: a 64-bit idiv per vector (δ at i / nrows) made a hot one-thread int8 step 8 %
// slower than per-row K on AMD Zen 3, and a second pass for fp8's prescale cost 4 % more
// (docs/performance.md, D-kv-2).
template <bool kF, bool kUp, class D>
HWY_INLINE void FoldKeyScalesT(D d, const float* HWY_RESTRICT qs, const float* HWY_RESTRICT delta,
                               float f, float up, std::int64_t dh, std::int64_t nrows,
                               float* HWY_RESTRICT qd) {
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const auto vf = hn::Set(d, f), vup = hn::Set(d, up);
  std::int64_t x = 0;  // channels [0, x) folded by the vector loops
  if (nrows % N == 0) {
    for (; x < dh; ++x) {
      const auto s = hn::Set(d, kF ? delta[x] * f : delta[x]);
      for (std::int64_t r = 0; r < nrows; r += N) {
        auto v = hn::Mul(hn::LoadU(d, qs + x * nrows + r), s);
        if constexpr (kUp) v = hn::Mul(v, vup);
        hn::StoreU(v, d, qd + x * nrows + r);
      }
    }
  } else if (N % nrows == 0) {
    const std::int64_t per = N / nrows;  // channels per vector
    const hn::RebindToSigned<D> di;
    HWY_ALIGN std::int32_t lanes[hn::MaxLanes(di)];
    for (std::int64_t c = 0; c < per; ++c)  // lane c·nrows + r takes channel c
      for (std::int64_t r = 0; r < nrows; ++r) lanes[c * nrows + r] = static_cast<std::int32_t>(c);
    const auto idx = hn::IndicesFromVec(d, hn::Load(di, lanes));
    for (; x + per <= dh; x += per) {
      auto s = hn::TableLookupLanes(hn::LoadU(d, delta + x), idx);
      if constexpr (kF) s = hn::Mul(s, vf);
      auto v = hn::Mul(hn::LoadU(d, qs + x * nrows), s);
      if constexpr (kUp) v = hn::Mul(v, vup);
      hn::StoreU(v, d, qd + x * nrows);
    }
  }
  for (; x < dh; ++x) {
    const float s = kF ? delta[x] * f : delta[x];
    for (std::int64_t r = 0; r < nrows; ++r) {
      const float v = qs[x * nrows + r] * s;
      qd[x * nrows + r] = kUp ? v * up : v;
    }
  }
}
template <class D>
HWY_INLINE void FoldKeyScales(D d, const float* HWY_RESTRICT qs, const float* HWY_RESTRICT delta,
                              float f, float up, std::int64_t dh, std::int64_t nrows,
                              float* HWY_RESTRICT qd) {
  if (f == 1.0f && up == 1.0f)
    return FoldKeyScalesT<false, false>(d, qs, delta, f, up, dh, nrows, qd);
  if (f == 1.0f) return FoldKeyScalesT<false, true>(d, qs, delta, f, up, dh, nrows, qd);
  if (up == 1.0f) return FoldKeyScalesT<true, false>(d, qs, delta, f, up, dh, nrows, qd);
  FoldKeyScalesT<true, true>(d, qs, delta, f, up, dh, nrows, qd);
}

// Per unit, for readers whose K reading depends on the folded rows' largest |element| (KeyMax()):
// qcol[x] = max_r |qs[x][r]| over [d_h][nrows] (a NaN may pass over: a NaN query's row is NaN
// whatever the reading).
template <class D>
HWY_INLINE void QueryColumnMax(D d, const float* HWY_RESTRICT qs, std::int64_t dh,
                               std::int64_t nrows, float* HWY_RESTRICT qcol) {
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  for (std::int64_t x = 0; x < dh; ++x) {
    const float* row = qs + x * nrows;
    std::int64_t r = 0;
    float m = 0.0f;
    if (nrows >= N) {
      auto vm = hn::Abs(hn::LoadU(d, row));
      for (r = N; r + N <= nrows; r += N) vm = hn::Max(vm, hn::Abs(hn::LoadU(d, row + r)));
      m = hn::GetLane(hn::MaxOfLanes(d, vm));
    }
    for (; r < nrows; ++r) m = std::max(m, std::fabs(row[r]));
    qcol[x] = m;
  }
}

// Per closed K tile: max_x |δ[x]| · qcol[x] = max |qs ⊙ δ| (each product rounded as the fold
// rounds it, and rounding is monotonic): the folded rows' largest |element| at f = 1, from d_h
// products instead of d_h · nrows.
template <class D>
HWY_INLINE float FoldedKeyMax(D d, const float* HWY_RESTRICT qcol, const float* HWY_RESTRICT delta,
                              std::int64_t dh) {
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  auto vm = hn::Zero(d);
  std::int64_t x = 0;
  for (; x + N <= dh; x += N)
    vm = hn::Max(vm, hn::Mul(hn::LoadU(d, qcol + x), hn::Abs(hn::LoadU(d, delta + x))));
  float m = hn::GetLane(hn::MaxOfLanes(d, vm));
  for (; x < dh; ++x) m = std::max(m, qcol[x] * std::fabs(delta[x]));
  return m;
}

// One unit (sequence b, KV head j, query block from t0, one chunk of keys) as its reader sees it:
// nrows = (query positions) · g rows, r = t_local · g + h_local.
struct DecodeUnit {
  const DecodeArgs* a;
  int worker;
  std::int64_t b, j, t0, g, nrows, dh;
  std::int64_t dh_vec;  // d_h in whole vectors (then a scalar tail)
  float* qs;            // scale·Q, transposed: [d_h][nrows]
  float* st;            // S, then P [nrows][64]
  float* acc;           // Õ [nrows][d_h]
  bool tall;            // the tall blocking kRT × kVT (else kRD × kVD)
  std::int64_t w_blk;   // columns of a register block (the split readings' column order is per
                        // block: ColumnBlocks computes [0, floor(columns / w_blk) · w_blk))
};

// One K / V tile pair of a unit as its reader sees it: keys [u0, u0 + nt), nv of them in whole
// vectors (S's lanes [nt, nv) are masked later).
template <class TB>
struct DecodeTile {
  std::int64_t u0, nt, nv;
  const TB* kt;       // Kᵀ tile [d_h][64] (a quantized tile: its scales after it)
  const TB* vt;       // V rows [nt][d_h], vld elements apart
  const TB* kt_next;  // the same-position prefetch's K and V tiles (or null)
  const TB* vt_next;
  const std::uint8_t* pair_next;  // the tile pair ahead (or null): a backend's own prefetch
  std::int64_t pair_bytes;
  PrefetchCursor* cur;  // the linear prefetch (or null)
};

// The two products are out of line, one function per element type read (as the compiler left
// them when they were lambdas of one function): inlined, every reading's ColumnBlocks in one body
// made fp8 tall units 2.3× slower on AMD Zen 3 (AVX2, T_new = 16) and the TU's compile 2× longer.
// S = (scale·Q) Kᵀ over nv key lanes (4.2), K read as TK: A = (scale·Q)ᵀ, row r of a block at
// qs + r, k (a feature) nrows floats on. int8 quads (kQuadLayout): quad rows of 4·64 bytes over
// the quads' features (the tail rows after, by the reader). kn: the same columns of a later tile
// (prefetched, or null); cur: the linear prefetch (or null).
template <class TK>
HWY_NOINLINE void ScoreProduct(const DecodeUnit& u, const TK* kk, const TK* kn, std::int64_t nv,
                               PrefetchCursor* cur) {
  const hn::ScalableTag<float> d;
  constexpr std::int64_t kKeyTile = kDecodeKeyTile;
  constexpr bool kQuads = kQuadLayout<TK>;
  const std::int64_t ldb = kQuads ? 4 * kKeyTile : kKeyTile;
  const std::int64_t K = kQuads ? u.a->layout.quad_features() : u.dh;
  if (u.tall) {
    ColumnBlocks<kRT, kVT, 1>(d, u.nrows, u.qs, u.nrows, kk, ldb, K, u.st, kKeyTile, false, nv, kn,
                              cur);
  } else {
    ColumnBlocks<kRD, kVD, 1>(d, u.nrows, u.qs, u.nrows, kk, ldb, K, u.st, kKeyTile, false, nv, kn,
                              cur);
  }
}

// Õ += P V over keys [k0, k0 + nk) of the tile (4.5), V's rows vld elements apart, read as TV:
// A = P, row r at st + r·64, k (a key) the next float. int8 quads (kQuadLayout): key quads 4·vld
// bytes apart (k0 a multiple of 4). vn: the same rows of a later tile (or null). Returns the
// first column of Õ not computed (the scalar tail's).
template <class TV>
HWY_NOINLINE std::int64_t ValueProduct(const DecodeUnit& u, const TV* vv, const TV* vn,
                                       std::int64_t k0, std::int64_t nk, std::int64_t vld,
                                       PrefetchCursor* cur) {
  const hn::ScalableTag<float> d;
  constexpr std::int64_t kKeyTile = kDecodeKeyTile;
  constexpr bool kQuads = kQuadLayout<TV>;
  const std::int64_t ldb = kQuads ? 4 * vld : vld;
  return u.tall ? ColumnBlocks<kRT, kVT, kKeyTile>(d, u.nrows, u.st + k0, 1, vv, ldb, nk, u.acc,
                                                   u.dh, true, u.dh_vec, vn, cur)
                : ColumnBlocks<kRD, kVD, kKeyTile>(d, u.nrows, u.st + k0, 1, vv, ldb, nk, u.acc,
                                                   u.dh, true, u.dh_vec, vn, cur);
}

// One row's Õ += P V over its own nk_r visible keys (p_r, v_r at its first one), in the unit's
// column blocking (w_blk), so Õ's columns are in the same (split) order as the other tiles'.
template <class TV>
HWY_INLINE std::int64_t ValueRowProduct(const DecodeUnit& u, const float* p_r, const TV* v_r,
                                        std::int64_t vld, std::int64_t nk_r, float* o_r) {
  const hn::ScalableTag<float> d;
  constexpr std::int64_t kKeyTile = kDecodeKeyTile;
  constexpr const TV* kNoPrefetch = nullptr;
  return u.tall ? ColumnBlocks<1, kVT, kKeyTile>(d, 1, p_r, 1, v_r, vld, nk_r, o_r, u.dh, true,
                                                 u.dh_vec, kNoPrefetch, nullptr)
                : ColumnBlocks<1, kVD, kKeyTile>(d, 1, p_r, 1, v_r, vld, nk_r, o_r, u.dh, true,
                                                 u.dh_vec, kNoPrefetch, nullptr);
}

// Õ += P V over keys [k0, k0 + nk) of the tile of keys from u0 (V rows vk from key u0 + k0, vld
// elements apart) whose V rows are not all finite: each row over its own visible keys only, so a
// masked key takes no part (0 · NaN = NaN)  (4.3, 4.5), in the unit's column blocking (w_blk):
// Õ's columns are in the same (split) order as the other tiles'. Returns the first column of Õ
// not computed (the scalar tail's).
template <class TV>
HWY_INLINE std::int64_t VisibleValueRowsProduct(const DecodeUnit& u, const TV* vk, std::int64_t vld,
                                                std::int64_t u0, std::int64_t k0, std::int64_t nk) {
  const DecodeArgs& a = *u.a;
  std::int64_t x0 = 0;
  for (std::int64_t r = 0; r < u.nrows; ++r) {
    const std::int64_t t = u.t0 + r / u.g;
    const std::int64_t lo = std::clamp<std::int64_t>(a.visible_begin(u.b, t) - u0 - k0, 0, nk);
    const std::int64_t nk_r = std::clamp<std::int64_t>(a.visible_end(u.b, t) - u0 - k0, 0, nk) - lo;
    if (nk_r <= 0) {
      x0 = u.dh_vec;  // nothing visible in this sub-tile (the tail loop checks per key)
      continue;
    }
    x0 = ValueRowProduct(u, u.st + r * kDecodeKeyTile + k0 + lo, vk + lo * vld, vld, nk_r,
                         u.acc + r * u.dh);
  }
  return x0;
}

}  // namespace tokenmix::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard (per target)
