// src/kernels/simd/decode_units-inl.h — decode attention over a KVCache, SIMD (Highway): the
// DecodeUnits<TB> template, TB the cache element type. Each attention_decode_<dtype>_hwy.cpp
// includes it once per target (x86: AVX-512 = AVX3, AVX2+FMA; AArch64: NEON) and exports its
// one element type as attention_decode_<dtype>_<avx512|avx2|neon> (the registry picks one): one
// translation unit per cache dtype, so they compile in parallel. Unit contract: DecodeArgs in
// attention_kernels.hpp; chunks are merged by src/decode/decode.cpp.
//
// A unit is (sequence b, KV head j, query block, chunk of ≤ 1024 keys). Its rows are all g query
// heads of group j × the block's query positions (r = t_local · g + h_local), so each K/V tile is
// read from memory once for the whole group (GQA: bytes do not grow with g). Workers take runs of
// consecutive units (DecodeArgs::run_units), i.e. consecutive chunks of one stream, so each
// worker's reads go on front to back and the prefetch runs on into its next chunk. Per 64-key tile,
// both products are the shared register-blocked microkernel (microkernel-inl.h), with the cache
// element type (fp32 / bf16 / f16) as its B operand, widened to fp32 in registers:
//   S[r][u]  = Σ_x (scale·q_r)[x] · Kᵀ[x][u]   A = scale·Q rows, B = K tile [d_h][64]  (4.2)
//   Õ[r][x] += Σ_u P[r][u] · V[u][x]        A = P rows (broadcast),   B = V rows [64][d_h]  (4.5)
// Keys are lanes in the first product and features in the second — the cache stores K tiles
// transposed and V row-major for exactly this, so nothing is repacked per step (a short query
// block's V rows are even read in place from the caller's tensor, DecodeArgs::v_rows: the same
// products with the tensor's row stride for d_h). Between them,
// the score variants (SPEC "Score variants used by real models") on the S tile — soft-capping
// S = c·tanh(S / c) (tanh-inl.h) and ALiBi S += m_h (u − p) — then the online softmax
// per row (4.4): mask keys outside [visible_begin(r), visible_end(r)) to −∞ (4.3 and the sliding
// window), m' = max(m, max S), P = e^{S − m'}, l ← l e^{m − m'} + Σ P, Õ ← Õ e^{m − m'} (only
// when m grows). With a window, tiles before the first row's window start are not read.
// exp: SoftmaxExp (exp-inl.h, through ExpNaN), 0.85 ULP, exactly 0 for −∞.
//
// Highway "-inl" header: included once per target from a foreach_target translation unit.
#if defined(TOKENMIX_KERNELS_SIMD_DECODE_UNITS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TOKENMIX_KERNELS_SIMD_DECODE_UNITS_INL_H_
#undef TOKENMIX_KERNELS_SIMD_DECODE_UNITS_INL_H_
#else
#define TOKENMIX_KERNELS_SIMD_DECODE_UNITS_INL_H_
#endif

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "hwy/highway.h"
#include "kernels/attention_kernels.hpp"
#include "kernels/kv_element.hpp"
#include "kernels/nonfinite.hpp"
#include "kernels/simd/microkernel-inl.h"
#include "kernels/simd/nonfinite-inl.h"
#include "kernels/simd/tanh-inl.h"
#include "kernels/simd/work_units.hpp"
#if TOKENMIX_HAVE_AMX
#include "kernels/simd/amx_decode.hpp"
#endif

HWY_BEFORE_NAMESPACE();
namespace tokenmix::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Register blocking of the decode products: kRD rows × kVD vectors (kVD·Lanes must divide 64).
// A unit of more than kRD rows (several query positions: speculative verification, chunked
// prefill) uses the tall blocking kRT rows × kVT vectors instead: each B vector loaded (and, for
// a bf16/f16/int8/fp8 cache, widened) serves kRT rows, so the widening's share of the FMA ports
// halves, and the k loop of every output element is the same (bitwise the same results).
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
constexpr int kRD = 6, kVD = 4;   // 24 accumulators + 4 B vectors of 32 zmm; 64 lanes
constexpr int kRT = 12, kVT = 2;  // 24 accumulators + 2 B vectors; 32 lanes
#elif HWY_TARGET == HWY_AVX2
constexpr int kRD = 2, kVD = 4;  // 8 accumulators + 4 B vectors of 16 ymm; 32 lanes
constexpr int kRT = 6, kVT = 2;  // 12 accumulators + 2 B vectors; 16 lanes
#elif HWY_TARGET == HWY_NEON
constexpr int kRD = 6, kVD = 4;  // 24 accumulators + 4 B vectors of 32 q registers; 16 lanes
constexpr int kRT = kRD, kVT = kVD;
#else
constexpr int kRD = 2, kVD = 1;  // fallback targets (not dispatched to by tokenmix)
constexpr int kRT = kRD, kVT = kVD;
#endif

constexpr std::int64_t kSub = 16;  // keys per V sub-tile in the P·V product
static_assert(kSub % 4 == 0, "an int8 V sub-tile starts at a key quad");
// The P·V product of a regular (not tall) unit over the whole 64-key V tile per call, not kSub
// keys: Õ's accumulators are then loaded and stored once per tile instead of four times. AVX-512,
// for caches of 1- and 2-byte elements, whose tile pair is in L2 by then (PrefetchStream): on AMD
// Zen 4, T_new = 1, one thread, T_k = 32768, 7.7 → 6.4 ms (bf16) and 6.7 → 6.3 ms (int8), hot
// 6–7 % for bf16, int8 and fp8; f32 (32 KiB V tiles) was 2–3 % slower, and AVX2 measured within
// noise there (docs/performance.md, D-decode-5).
constexpr bool kWholeTilePVNarrow = HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL;
// Bytes of a unit's stream between the tile computed on and the one prefetched (whole tile
// pairs of K and V, at least one). AVX-512: 32 KiB (measured on AMD Zen 4: 16, 32, 64 and
// 128 KiB within noise for bf16, 32 best for int8); other targets: the next tile pair, as
// measured on Zen 3 (AVX2) before.
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
constexpr std::int64_t kAheadBytes = 32 * 1024;
#else
constexpr std::int64_t kAheadBytes = 0;
#endif

// How a later tile pair of a unit's stream (kAheadBytes on) is prefetched while the current one is
// computed on. Same position (false): with each B row the microkernel reads, the same row of that
// tile (into L2 on x86: PrefetchStream), so the prefetches follow the products' order. Linear
// (true): the next K tile and V tile as one byte range, front to back, at the pace the first row
// block reads B (PrefetchCursor). Where a column block is narrower than a tile row (AVX2: 16 or 32
// of 64 keys, and of d_h) the products visit a tile in row-strided column passes, and prefetches in
// that order keep the DRAM stream short of what a core can read: in a model of the T_new = 1 step
// (bf16, g = 4: each 32 B widened and fed to 8 FMAs) one AMD Zen 3 core streamed 10.7–11.4 GB/s
// prefetching in the products' order and 17.6–17.9 in address order (19.3 reading linearly). The
// kernel: T_new = 1 from 14.8 to 10.8 ms (bf16) and 33.6 to 21.3 ms (f32), 1 thread, T_k = 32768
// (docs/performance.md, D-prefetch-2). AVX-512's 64-lane blocks read K rows whole: same position
// there for 1- and 2-byte caches (its L2 target and distance measured on AMD Zen 4,
// docs/performance.md, D-prefetch-1), linear for f32, with the cursor shared by all row blocks of a
// tall unit (kCursorAcrossRowBlocks): AMD Zen 5, two threads, T_k = 32768, B = 1, T_new = 4
// 8.5–8.7 → 6.9–8.0 ms, T_new = 16 23.6–24.1 → 21.1–21.2, B = 32 mixed lengths around 4096,
// T_new = 4 35.8–37.2 → 30.2–31.0; T_new = 1 and 64 unchanged (docs/performance.md,
// D-prefetch-5).
// Per call (DecodeArgs::linear_prefetch, AVX-512 and AVX2): every cache dtype linear. On an Intel
// Xeon (family 6 model 207), two threads, T_k = 32768: AVX-512 bf16 T_new = 2 6.05 → 4.89 ms,
// T_new = 4 8.8 → 7.84, f16 T_new = 2 5.97 → 4.91, fp8 T_new = 1 3.15 → 2.94, int8 T_new = 1
// 2.78 → 2.71 (its scales are in the cursor's byte range); AVX2 int8 T_new = 1 4.25 → 3.40, fp8
// 4.91 → 3.97; on AMD Zen 5 the cursor was slower for int8 and fp8 (docs/performance.md,
// D-prefetch-7 and D-prefetch-6): detail::linear_prefetch_preferred.
#if HWY_TARGET == HWY_AVX2
template <class TB>
constexpr bool kLinearPrefetch = true;
#elif HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
template <class TB>
constexpr bool kLinearPrefetch = std::is_same_v<TB, float>;
#else
template <class TB>
constexpr bool kLinearPrefetch = false;
#endif
// A tall unit's row blocks each read the same B columns; the first one alone advancing the cursor
// (at its own pace) prefetches a tile pair in bursts, in the first block's k loops, and none in
// the others'. AVX-512: every row block advances it, each by 1 / blocks of its B row per k, so the
// prefetches are spread over the whole tile's products (ColumnBlocks). AVX2 (its blocks read one
// line of B per k, the cursor's least step) keeps the first block's pace.
constexpr bool kCursorAcrossRowBlocks = HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL;
// Targets on which DecodeArgs::linear_prefetch makes every cache dtype linear (see above); on
// AVX2 the quantized caches too (its others are linear anyway), their 4 × 3 blocks advancing the
// cursor in their first row block as the 2-vector blocks do.
constexpr bool kLinearByCall =
    HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX2;
// The S tile is computed in column blocks of kVD vectors: they must tile the cache's key tile.
static_assert(kDecodeKeyTile % (kVD * static_cast<std::int64_t>(HWY_LANES(float))) == 0);
static_assert(kDecodeKeyTile % (kVT * static_cast<std::int64_t>(HWY_LANES(float))) == 0);

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
// AVX2, an int8 cache or fp8 read directly: tall units whose row blocks hold at most 4 rows
// (T_new · g = 3, 4, 7 or 8; e.g. T_new = 1 or 2 at g = 4) take 3 vectors of columns (4 × 3: 12
// accumulators, all 16 ymm registers with the widened B vectors and the broadcast) where 4 × 2
// kept only the 8 FMA chains its latency needs, so any stall cost throughput. The columns go in
// blocks of 3 vectors while the rest stays a multiple of 2 (64 keys: 24 + 24 + 16; d_h = 128:
// 4 · 24 + 2 · 16), each element's k loop unchanged (the same bits). AMD Zen 5, the AVX2 path
// forced, T_new = 1 / 2, hot (T_k = 2048, one thread): int8 0.325 → 0.295 / 0.63 → 0.59 ms, fp8
// 0.34 → 0.32 / 0.66 → 0.63 (its mask read from memory: LoadBRow); int8 at T_k = 32768 from
// memory, two threads, 2.74–2.87 → 2.49–2.54 / 5.25–5.59 → 4.88–4.95 ms. Not for f32 (the
// linear prefetch's pace is per 2-vector block), the bf16 split reading (its column order is per
// block width) or fp8 through f16 bits. docs/performance.md, D-avx2-1.
#if HWY_TARGET == HWY_AVX2
template <class TB>
constexpr bool kThreeVectorSmallBlocks =
    std::is_same_v<TB, std::int8_t> || std::is_same_v<TB, fp8_e4m3_direct_t> || kQuadLayout<TB>;
#else
template <class TB>
constexpr bool kThreeVectorSmallBlocks = false;
#endif

// AVX2, an f32 cache: a product of several row blocks runs each column block's k loop in chunks
// of kKChunk<TB> rows of B, every row block over one chunk before the next (C stored and loaded
// again in between: each element's k order unchanged, the same bits), so that the B rows the row
// blocks read in turn are 32 lines, not a whole tile's 64 (Õ) or 128 (S). A stand-alone 6 × 2 k
// loop over a 64-row f32 strip 512 bytes apart (Õ's shape at d_h = 128), six row blocks on AMD
// Zen 4: 0.18 ns per FMA, 0.155 in chunks of 32 rows, 0.145 with the rows padded to 528 bytes
// (L1 set conflicts); over 128 rows 256 bytes apart (S's shape): 0.178, 0.155 in chunks, 0.175
// padded (not set conflicts; not explained). In the kernel (one process alternating the two, the
// same output bits), AVX2 forced: hot (T_k = 1024, one thread) T_new = 2 / 4 / 8 / 16 / 64 0.95 /
// 0.97 / 0.95 / 0.97 / 0.975× the time; T_k = 32768, two threads, T_new = 2 / 4 / 8 / 16 / 64
// 0.94–0.98 / 0.98 / 0.97 / 0.99 / 0.98×. Not for AVX-512 (f32 hot T_new = 4 / 8 / 16 1.03–1.04×)
// nor for the narrower caches on AVX2 (bf16, int8, fp8 hot 1.01–1.05×; why the chunks were left
// out when they were first tried for every cache). docs/performance.md,
// D-avx2-3.
#if HWY_TARGET == HWY_AVX2
template <class TB>
constexpr std::int64_t kKChunk = std::is_same_v<TB, float> ? 32 : 0;
#else
template <class TB>
constexpr std::int64_t kKChunk = 0;
#endif

// The rows of the largest row block ColumnBlocks makes of `rows` at register blocking R
// (ceil(rows / R) blocks whose sizes differ by at most one).
constexpr std::int64_t LargestRowBlock(std::int64_t rows, std::int64_t R) {
  const std::int64_t blocks = (rows + R - 1) / R;
  return blocks == 0 ? 0 : (rows + blocks - 1) / blocks;
}

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

// n fp8 E4M3 codes (n a multiple of 64) as bf16 words, for the products of a tall unit that reads
// fp8 directly (see kFp8TilesAsBf16): direct, the code's bits placed as bf16 bits s 0000eeee
// mmm0000 (the upper half of the direct fp32 bits, fp8_e4m3_direct_t: the E4M3 value × 2^−120,
// subnormal for subnormal codes); otherwise the f16 reading's value q · 2^−8 (at most 4 significant
// bits and normal: exact in bf16).
template <class D>
HWY_INLINE void Fp8TileToBf16(D d, const fp8_e4m3_t* HWY_RESTRICT src, std::int64_t n, bool direct,
                              hwy::bfloat16_t* HWY_RESTRICT dst) {
  const hn::Repartition<std::int16_t, D> d16;  // 2·Lanes words
  const hn::Rebind<std::int8_t, decltype(d16)> d8;
  const hn::Rebind<hwy::bfloat16_t, D> dbf;
  const std::int64_t N16 = static_cast<std::int64_t>(hn::Lanes(d16));
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const auto* bytes = reinterpret_cast<const std::int8_t*>(src);
  auto* out = reinterpret_cast<std::int16_t*>(dst);
  const auto mask = hn::Set(d16, static_cast<std::int16_t>(0x87f0));
  if (direct) {
    for (std::int64_t x = 0; x < n; x += N16) {
      const auto b = hn::PromoteTo(d16, hn::LoadU(d8, bytes + x));  // sign in bits 7–15
      hn::StoreU(hn::And(hn::ShiftLeft<4>(b), mask), d16, out + x);
    }
  } else {
    for (std::int64_t x = 0; x < n; x += N) {
      hn::StoreU(hn::DemoteTo(dbf, LoadB(d, src + x)), dbf, dst + x);  // (exact, see above)
    }
  }
}

template <class TB>
void DecodeUnits(const DecodeArgs& a) {
  // Quantized caches (SPEC "Quantized KV cache"): K's row scales δ_u multiply the score lanes
  // after Q Kᵀ over the stored q (S_u = δ_u · Σ_x (s·q_r)[x] q_u[x]), and V's multiply P before
  // P V (Õ += Σ_u (P_u δ_u) q_u, l from the unscaled P): attention over x̂ = q · δ at fp32
  // rounding level; the elements are widened in registers (LoadB) and never stored as fp32.
  // LoadB returns q · kLoadBUnit (2^−8 for fp8): the scales are multiplied by 1 / kLoadBUnit
  // (exact, a power of two), and the scalar tail reads q · kLoadBUnit too.
  constexpr bool kQuant = std::is_same_v<TB, std::int8_t> || std::is_same_v<TB, fp8_e4m3_t>;
  constexpr bool kFp8 = std::is_same_v<TB, fp8_e4m3_t>;
  constexpr float kUnit = kLoadBUnit<TB>;
  // int8: the tiles hold VNNI-4 quads (kv_tile_layout.hpp, a.layout.int8_quads), read through
  // int8_quad_t (q · 2^24: one byte shuffle and the conversion per Lanes elements, as the plain
  // layout's widening) where no product can leave the normal range, and int8_quad_exact_t (q, one
  // shift more) elsewhere:
  //   K: the unit's max |scale·q| finite and below 2^64 (so |S · 2^24| < 2^(64 + 7 + 24) · d_h):
  //      the scores' factor k_post = 2^−24 (S · 2^24 · 2^−24 = S, the same bits);
  //   V: every row scale δ_u of the tile 0 or at least 2^−64: P_u · (δ_u · 2^−24), exact powers
  //      of two again.
  // K's d_h % 4 tail features (plain rows after the quads) go through int8_x24_t (q · 2^24) or
  // int8_t. Each element's products are those of the plain layout, in the same order.
  constexpr bool kInt8 = std::is_same_v<TB, std::int8_t>;
  // An int8 cache in plain rows (KVCacheConfig::int8_quads false: CPUs without AMX-INT8) is read
  // as above without the quads: the plain widening (LoadB of int8_t, unit 1), no AMX units.
  const bool quads = kInt8 && a.layout.int8_quads;
  // fp8 E4M3 on AVX-512 and AVX2 has a second widening, straight into fp32 bits (fp8_e4m3_direct_t,
  // microkernel-inl.h: no conversion instruction, LoadB returns q · 2^−120, subnormal fp32 for
  // subnormal codes), used when the call asks for it (DecodeArgs::fp8_direct) and this worker's
  // MXCSR has DAZ and FTZ clear (a subnormal operand read as 0 would be a wrong answer). Its
  // unit 2^−120 is folded where 2^−8 is otherwise, with two guards that keep every product
  // normal and every factor finite:
  //   K: the unit's scale·Q rows are multiplied by 2^sh (exact) so that their largest |element|
  //      lies in [2^64, 2^65): the score products q'·(k·2^−120) stay far above 2^−126; the score
  //      is then (S'·2^(120−sh))·δ_u. Only where max |scale·q| is finite, non-zero and in
  //      [2^−60, 2^61); otherwise the unit reads K through the f16 bits (sh = 0).
  //   V: P_u·(δ_u·2^120) needs δ_u < 2^8: a tile whose V scales are not all below 2^7 is read
  //      through the f16 bits.
  // Both readings multiply the same products by exact powers of two, so they give the same
  // bits while no product is subnormal (tests/unit/test_kv_quant.cpp compares them bitwise).
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX2
  // (AVX2: LoadB per vector, 3 integer instructions, no conversion; on AMD Zen 4 with the path
  // forced, steps 10–17 % faster than through f16 bits; docs/performance.md, D-fp8-3.)
  constexpr bool kDirectBuilt = kFp8;
  const bool direct_ok = kDirectBuilt && a.fp8_direct && (_mm_getcsr() & 0x8040u) == 0;
#else
  constexpr bool kDirectBuilt = false;
  const bool direct_ok = false;
#endif
  using TD = std::conditional_t<kDirectBuilt, fp8_e4m3_direct_t, TB>;  // the direct element
  constexpr float kDirectUnit = kLoadBUnit<TD>;
  // The regular blocks (kVD vectors, a multiple of 4) read the direct bits four columns to a
  // word (fp8_e4m3_quad_t, microkernel-inl.h): their products' columns come out in groups of
  // 4·Lanes as columns 4i, 4i + 1, 4i + 2, 4i + 3 and are put back in order once complete (S
  // after the tile's Q Kᵀ, Õ at the end of the unit: UnsplitQuads), as the bf16 split reading.
  // A V tile the direct unit cannot take (v_direct false) is then read through
  // fp8_e4m3_quad_f16unit_t, the f16 reading's values in the same column order.
  constexpr bool kQuadBuilt = kDirectBuilt && kSplitBuilt && kVD % 4 == 0;
  // AVX-512: a unit that reads fp8 directly keeps the regular 6 × 4 blocking with the quad
  // reading however many rows it has (ColumnBlocks splits them into blocks of at most 6), not the
  // tall 12 × 2 blocking with the plain direct reading: each B vector serves fewer rows, but
  // the quads' widening is cheaper. AMD Zen 4, B = 1, g = 4, one process alternating the two
  // call by call (the same bits): hot (T_k = 2048, one thread) T_new = 2 / 3 / 4 / 8 / 16
  // 0.90 / 0.92 / 0.89 / 0.91 / 0.91× the time; T_k = 32768, two threads, T_new = 2 / 4 / 8
  // 0.91 / 0.89 / 0.90×. AVX2 (2 × 4 regular blocks) was 1.03–1.05× slower: tall there.
  // docs/performance.md, D-fp8-8.
  constexpr bool kDirectRegularOnly =
      kQuadBuilt && (HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL);
  // AVX2: a tall unit that reads fp8 directly, in row blocks of more than 4 rows (the 6 × 2
  // blocking; not the 4 × 3 blocks of kThreeVectorSmallBlocks, e.g. T_new = 2 at g = 4), converts
  // each K and V tile once into bf16 words (Fp8TileToBf16: 5 instructions per 16 codes; the direct
  // bits' upper half, or q · 2^−8 where the unit reads a tile through f16 bits), and every row
  // block reads those through the bf16 split reading (1.5 instructions per vector) instead of
  // widening the codes itself (4 per vector): the same values, each element's k loop unchanged
  // (the same bits). The tile pair ahead is prefetched through the cursor (linear), spread over the
  // products (a burst of prefetches with the conversion made T_new = 5 from memory 1.04× slower).
  // AMD Zen 4, the AVX2 path forced, one process alternating the two call by call (the same
  // output bits), two threads, T_k = 32768 from memory: T_new = 3 / 4 / 5 / 8 / 16 / 64 0.98 /
  // 0.96 / 0.94 / 0.92 / 0.905 / 0.89× the time (T_k = 4096, hot: T_new = 3 / 4 0.97 / 0.95×);
  // the 4 × 3 blocks so converted (T_new = 2) 1.02–1.03×. AVX-512 (whose direct units keep the
  // regular blocks and the quad reading: kDirectRegularOnly) took 1.05–1.22× the time in tall units
  // so converted. docs/performance.md, D-fp8-9.
  constexpr bool kFp8TilesAsBf16 = kDirectBuilt && kSplitBuilt && HWY_TARGET == HWY_AVX2;
  using TQ = std::conditional_t<kQuadBuilt, fp8_e4m3_quad_t, TB>;
  using TQ16 = std::conditional_t<kQuadBuilt, fp8_e4m3_quad_f16unit_t, TB>;
  // A bf16 cache is read by the products through bf16_split_t (microkernel-inl.h) where the
  // target has it: each pair of B vectors as even / odd columns, two instructions per 2·Lanes
  // elements; the products' columns are put back in order once they are complete (S after the
  // tile's Q Kᵀ, Õ at the end of the unit: UnsplitPairs), so every element is the same bits.
  constexpr bool kSplit = kSplitBuilt && std::is_same_v<TB, hwy::bfloat16_t>;
  using TP = std::conditional_t<kSplit, bf16_split_t, TB>;  // what the products read
  // AMX tile products for an int8 cache (AMX-INT8), an fp8 or a bf16 cache (AMX-BF16)
  // (DecodeArgs::amx, amx_decode.hpp) in units whose rows make them pay (amx_unit_pays below),
  // where d_h is a multiple of 64 up to 256, the unit's query rows can be written as planes and V
  // is read from the cache's tiles: every tile's S (in key order; a bf16 K tile the tiles cannot
  // take: the FMA products) and Õ (in amx_decode's column order until the unit's end; a bf16 V
  // tile they cannot take: amx::values_visible). fp8 units read K and V through the tile path's
  // own widening (k_direct and v_direct off: the scores' and weights' unit is kUnit).
  // On an Intel Xeon (family 6 model 207), T_k = 32768, B = 1, g = 4, two threads, from DRAM,
  // best of 7 calls (docs/performance.md, D-amx-4), int8: T_new = 4
  // (16 rows) 7.80 → 6.10 ms, T_new = 16 27.97 → 18.88 ms; T_new = 1 and 2 level
  // (2.78 / 2.75–2.87, 3.91–3.99 / 3.87–4.09), T_new = 3 slower (5.27 → 5.73: its 12 rows are one
  // FMA tall block). fp8 (D-amx-5, in a slow phase of the host), median of 9 calls alternated:
  // T_new = 4 / 16 / 64 19.3 → 16.0, 51.2 → 31.2, 257 → 203 ms; 4 rows and 8 rows slower on the
  // tiles (hot, one thread: 1.77× and 1.25× the time), 12 level.
#if TOKENMIX_HAVE_AMX && (HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL)
  constexpr bool kAmxBuilt = kQuant || std::is_same_v<TB, hwy::bfloat16_t>;
#else
  constexpr bool kAmxBuilt = false;
#endif
#if TOKENMIX_HAVE_AMX
  constexpr amx::Element kAmxElement = kFp8                              ? amx::Element::fp8_e4m3
                                       : std::is_same_v<TB, std::int8_t> ? amx::Element::int8
                                                                         : amx::Element::bf16;
  // int8: units of ≥ 4 rows; fp8: ≥ 16. int8 at 8 and 12 rows (T_new = 2 and 3 at g = 4), Intel
  // Xeon (family 6 model 207), T_k = 32768, two threads, from DRAM, AMX off / on alternated per
  // call, median of 9: 0.91–0.94× and 0.85–0.90× the FMA time (hot, T_k = 2048, one thread:
  // 0.89×, 0.89×), with the per-tile rewrites of the plain layout; 4 rows (T_new = 1) took
  // 1.04× then, and with the cache in quads (no rewrites) 0.81× hot and 0.88× from DRAM
  // (`tokenmix bench decode`: read ratio 0.67–0.72 → 0.75–0.80 at T_k = 32768)
  // (docs/performance.md, D-amx-8). bf16 (whose FMA products read the cache
  // with two instructions per 2·Lanes elements, bf16_split_t) only where rows − 9·⌈rows / 16⌉ > 10:
  // a tile unit costs about 0.64 of a 16-row FMA block per tile (the rewrites) plus 0.56 per 16-row
  // block of its A tiles, fitted to T_k = 32768, two threads, alternated calls
  // (docs/performance.md, D-amx-6): 16 rows (T_new = 4) 1.00–1.24× the FMA
  // time, 20 and 24 rows 1.11–1.30×, 32 rows 0.74–0.97×, 36 rows 1.13×, 40 rows 0.93×, 48 rows
  // 0.89×, 64 rows 0.48–0.89×.
  const auto amx_unit_pays = [](std::int64_t rows) {
    if constexpr (std::is_same_v<TB, hwy::bfloat16_t>) return rows - 9 * ((rows + 15) / 16) > 10;
    if constexpr (std::is_same_v<TB, std::int8_t>) return rows >= 4;
    return rows >= 16;
  };
#endif
  const hn::ScalableTag<float> d;
  const hn::RebindToSigned<decltype(d)> di;
  using VF = hn::Vec<decltype(d)>;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  constexpr std::int64_t kKeyTile = kDecodeKeyTile;  // keys per cache tile
  const std::int64_t units = a.units(), rows = a.rows_max(), dh = a.dh, g = a.group();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const TB* k_layer = static_cast<const TB*>(a.k_layer);
  const TB* v_layer = static_cast<const TB*>(a.v_layer);
  // V rows read in place (DecodeArgs::v_rows: a short query block's caller tensor) or from the
  // V tiles: keys u0.. of (b, j) start at vt, one key's row vld elements after the previous one.
  // A quantized cache's V rows need their tile's scales: never in place (read_v_in_place).
  const bool v_in_place = a.v_in_place();
  const TB* v_rows = static_cast<const TB*>(a.v_rows.data);
  const std::int64_t vld = a.v_stride();
  if constexpr (kQuant) {
    if (v_in_place) {
      throw UnsupportedError(
          "attention decode: a quantized cache's V rows cannot be read in place");
    }
  }
  // True if an element of V rows [lo, hi) from vt is not finite (a generic lambda: instantiated
  // for activation dtypes only, NonFiniteIn needs 2- or 4-byte elements): one range when the
  // rows are contiguous, row by row otherwise.
  const auto v_nonfinite = [&](const auto* vt, std::int64_t lo, std::int64_t hi) {
    if (vld == dh) return NonFiniteIn(vt, lo * dh, hi * dh);
    bool bad = false;
    for (std::int64_t u = lo; u < hi; ++u) bad |= NonFiniteIn(vt + u * vld, 0, dh);
    return bad;
  };
  // Prefetch distance: the first tile pair at least kAheadBytes on (an int8 / fp8 pair of 64
  // keys is about half a bf16 one, and one tile ahead was too short for it on AMD Zen 4: T_new = 1
  // at T_k = 32768, 2 threads, 5.5 → 4.1 ms with two).
  const std::int64_t pair_bytes = 2 * a.layout.tile_span() * static_cast<std::int64_t>(sizeof(TB));
  const std::int64_t ahead_tiles =
      std::max<std::int64_t>(1, (kAheadBytes + pair_bytes - 1) / pair_bytes);
  const std::int64_t dh_vec = dh / N * N;  // d_h in whole vectors (then a scalar tail)

  // Runs of consecutive units per worker (DecodeArgs::run_units): on AMD Zen 5, T_k = 32768,
  // T_new = 1, two threads, int8 1.94–2.00 → 1.43 ms, bf16 T_new = 4 5.6–7.6 → 5.1–5.2 ms
  // (docs/performance.md, D-decode-8).
  const std::int64_t run = DecodeArgs::run_units(units, omp_get_num_threads());
#if TOKENMIX_HAVE_AMX
  bool amx_worker = false, amx_configured = false;
  if constexpr (kAmxBuilt) {
    if (a.amx && amx::head_dim_supported(dh)) {
      amx_worker = amx::thread_ready();
      if (!amx_worker && a.amx_refused != nullptr) a.amx_refused->store(true);
    }
  }
#endif
#pragma omp for schedule(dynamic, run)
  for (std::int64_t unit = 0; unit < units; ++unit) {
    const auto [c, qb, j, b] = a.unit_at(unit);
    // The next unit is this worker's (same run) and the next chunk of the same stream (units of
    // a (b, j, qb) are numbered by chunk: DecodeArgs::unit_index): the prefetch runs on into it
    // (stream_end) instead of stopping at this chunk's end.
    const bool next_chunk_mine = (unit + 1) % run != 0 && c + 1 < a.chunks_of(b);
    const int worker = omp_get_thread_num();
    float* qs = a.scratch.at(a.slots.q_scaled, worker);  // scale·Q, transposed: [d_h][nrows]
    float* st = a.scratch.at(a.slots.scores, worker);    // S, then P [rows][64]
    float* acc = a.part_acc + unit * rows * dh;          // Õ [rows][d_h]
    float* m_run = a.part_m + unit * rows;
    float* l_run = a.part_l + unit * rows;

    const std::int64_t t0 = qb * a.qblock, nrows = std::min(a.qblock, a.tnew - t0) * g;
    // Keys some row sees: [kbegin, kend); keys every row sees: [kfull_begin, kfull).
    const DecodeArgs::KeyRange keys = a.key_range(b, t0, nrows / g);
    const std::int64_t kend = keys.end, kfull = keys.full_end, kbegin = keys.begin,
                       kfull_begin = keys.full_begin;
    const std::int64_t k0 = a.chunk_base(b) + c * a.chunk, k1 = std::min(k0 + a.chunk, kend);
    const std::int64_t stream_end = next_chunk_mine ? std::min(k1 + a.chunk, kend) : k1;
    // From the tile holding the first visible key (a window's start) on.
    const std::int64_t kb = std::max(k0, kbegin / kKeyTile * kKeyTile);
    std::fill(m_run, m_run + nrows, kNegInf);  // m = −∞, l = 0: the part is empty until a key
    std::fill(l_run, l_run + nrows, 0.0f);
    // Nothing visible in this chunk (past the last key of this query block — early blocks of a
    // long T_new —, a sequence with no key yet, or before a window): out before any per-row
    // work. The merge reads no part of it.
    if (kb >= k1) continue;
    for (std::int64_t r = 0; r < nrows; ++r) {
      const float* q = a.q.row(b, t0 + r / g, j * g + r % g);
      for (std::int64_t x = 0; x < dh; ++x) qs[x * nrows + r] = a.scale * q[x * a.q.s3];
    }
    bool amx_unit = false;  // this unit's products on AMX tiles (kAmxBuilt)
#if TOKENMIX_HAVE_AMX
    if constexpr (kAmxBuilt) {
      if (amx_worker && amx_unit_pays(nrows) && !v_in_place &&
          amx::query_planes(kAmxElement, qs, nrows, dh)) {
        amx::configure();
        amx_unit = amx_configured = true;
      }
    }
#endif
    // The direct fp8 reading in this unit (the tile products read the codes their own way).
    const bool direct_unit = direct_ok && !amx_unit;
    // int8: K read through int8_quad_t in this unit (see kInt8; the tile products' S is at unit 1).
    bool k_fast = false;
    if constexpr (kInt8) {
      if (!amx_unit && quads) {
        // max |scale·q| (a NaN may pass over or come out: NaN takes the exact reading, and a NaN
        // query's row is NaN either way)
        VF vm = hn::Zero(d);
        std::int64_t i = 0;
        for (; i + N <= nrows * dh; i += N) vm = hn::Max(vm, hn::Abs(hn::LoadU(d, qs + i)));
        float m = hn::GetLane(hn::MaxOfLanes(d, vm));
        for (; i < nrows * dh; ++i) m = std::max(m, std::fabs(qs[i]));
        k_fast = m < 0x1.0p64f;
      }
    }
    // K read directly (see kDirectBuilt): scale·Q ← 2^sh · scale·Q, the scores' factor 2^(120−sh).
    bool k_direct = false;
    float k_post = k_fast ? 0x1.0p-24f : 1.0f / kUnit;
    float q_max = 0.0f;  // max |scale·q| of the unit's rows (NaN elements pass over)
    if (direct_unit) {
      for (std::int64_t i = 0; i < nrows * dh; ++i) q_max = std::max(q_max, std::fabs(qs[i]));
    }
    if (direct_unit && std::isfinite(q_max) && q_max > 0.0f) {
      int e = 0;
      std::frexp(q_max, &e);  // q_max ∈ [2^(e−1), 2^e)
      if (e - 1 >= -60 && e - 1 <= 60) {
        const int sh = 64 - (e - 1);
        const float up = std::ldexp(1.0f, sh);
        for (std::int64_t i = 0; i < nrows * dh; ++i) qs[i] *= up;
        k_direct = true;
        k_post = std::ldexp(1.0f, 120 - sh);
      }
    }
    std::fill(acc, acc + nrows * dh, 0.0f);
    const bool capped = a.var.softcap > 0.0f;
    // Several row blocks: the tall blocking (see kRT), except for fp8 read directly on AVX-512
    // (kDirectRegularOnly), which keeps the regular blocking and its quad reading at every row
    // count.
    const bool tall = nrows > kRD && !(kDirectRegularOnly && direct_unit);
    // Columns of a product in register blocks (ColumnBlocks: [0, floor(columns / w_blk) · w_blk)),
    // which the split readings compute in their own column order (bf16 pairs, fp8 quads).
    const std::int64_t w_blk = (tall ? kVT : kVD) * N;
    // The quad reading (kQuadBuilt) in this unit: fp8 read directly, the regular blocking.
    const bool quad = kQuadBuilt && direct_unit && !tall;
    // fp8 read directly in a tall unit of row blocks of more than 4 rows (see kFp8TilesAsBf16;
    // ColumnBlocks sizes the blocks so): each K and V tile converted once into bf16 words in the
    // worker's scratch (the portable kernel's K and V tile slots), read as a bf16 cache.
    const bool tiles_bf16 =
        kFp8TilesAsBf16 && direct_unit && tall && LargestRowBlock(nrows, kRT) > 4;
    auto* const k_bf16 = reinterpret_cast<hwy::bfloat16_t*>(a.scratch.at(a.slots.k_f32, worker));
    auto* const v_bf16 = reinterpret_cast<hwy::bfloat16_t*>(a.scratch.at(a.slots.v_f32, worker));
    const VF cap = hn::Set(d, a.var.softcap), inv_cap = hn::Set(d, 1.0f / a.var.softcap);

    for (std::int64_t u0 = kb; u0 < k1; u0 += kKeyTile) {
      const std::int64_t nt = std::min(kKeyTile, k1 - u0);
      const std::int64_t tile = a.tile_offset(b, j, u0);
      const TB* kt = k_layer + tile;  // Kᵀ tile [d_h][64]
      const TB* vt = v_in_place ? v_rows + a.v_row(b, j, u0) : v_layer + tile;  // V [nt][d_h]
      // The tile ahead_tiles on in this chunk, or in the next one where this worker takes it next
      // (stream_end; none in the stream's last tiles): the microkernels prefetch it row by row
      // while they compute on this one, so a worker's forward stream is read ahead by at least
      // kAheadBytes.
      const std::int64_t u_ahead = u0 + ahead_tiles * kKeyTile;
      const bool has_next = u_ahead < stream_end;
      const std::int64_t next = has_next ? a.tile_offset(b, j, u_ahead) : 0;
      // kLinearPrefetch (V tiles in the cache, not rows in place): the whole next pair through the
      // cursor (the pf pointers are then null), a quantized pair's scales included. Not for int8 /
      // fp8 by default: their widening makes a step compute-bound, and the cursor's bookkeeping
      // measured 3–7 % slower there (Zen 3); per call on AVX-512 and AVX2 (kLinearByCall) every
      // dtype; and an fp8 unit that converts its tiles to bf16 (tiles_bf16).
      const bool linear =
          !v_in_place && !amx_unit &&
          (tiles_bf16 || (kLinearPrefetch<TB> && !kQuant) || (kLinearByCall && a.linear_prefetch));
      PrefetchCursor cursor;
      if (linear && has_next) {
        cursor.next = reinterpret_cast<const std::uint8_t*>(k_layer + next);
        cursor.end = cursor.next + pair_bytes;
      }
      PrefetchCursor* const cur = linear && has_next ? &cursor : nullptr;
      const TB* kt_next = has_next && !linear && !amx_unit ? k_layer + next : nullptr;
      const TB* vt_next = !has_next || linear || amx_unit ? nullptr
                          : v_in_place                    ? v_rows + a.v_row(b, j, u_ahead)
                                                          : v_layer + next;
      if (kQuant && has_next && !linear && !amx_unit) {  // that tile's K and V scales (64 each)
        for (std::int64_t o = 0; o < kKeyTile * 4; o += 64) {
          PrefetchStream(reinterpret_cast<const std::uint8_t*>(kt_next + a.layout.tile_elems()) +
                         o);
          PrefetchStream(reinterpret_cast<const std::uint8_t*>(vt_next + a.layout.tile_elems()) +
                         o);
        }
      }

      // S = (scale·Q) Kᵀ over the whole 64-key tile (lanes past the data are masked below)  (4.2)
      // Only the nv lanes that hold keys of this tile (whole vectors; all 64 but in a sequence's
      // last tile) are computed and passed over below: a short last tile (or a call with fewer
      // than 64 keys) costs its keys, not the tile. Lanes [nt, nv) are masked (partial is true).
      const std::int64_t nv = (nt + N - 1) / N * N;
      // kk: the K tile as TB or (k_direct) as TD, kn: the prefetched one (or null).
      const auto s_product = [&](const auto* kk, const auto* kn) {
        // A = (scale·Q)ᵀ: row r of a block at qs + r, k (a feature) nrows floats on. int8 quads
        // (kQuadLayout): quad rows of 4·64 bytes over the quads' features (the tail rows after).
        constexpr bool kQuads =
            kQuadLayout<std::remove_cv_t<std::remove_reference_t<decltype(*kk)>>>;
        const std::int64_t ldb = kQuads ? 4 * kKeyTile : kKeyTile;
        const std::int64_t K = kQuads ? a.layout.quad_features() : dh;
        if (tall) {
          ColumnBlocks<kRT, kVT, 1>(d, nrows, qs, nrows, kk, ldb, K, st, kKeyTile, false, nv, kn,
                                    cur);
        } else {
          ColumnBlocks<kRD, kVD, 1>(d, nrows, qs, nrows, kk, ldb, K, st, kKeyTile, false, nv, kn,
                                    cur);
        }
      };
      // S from the tiles (in key order), or (false) from the FMA products below: not an AMX unit,
      // or a bf16 K tile the tiles cannot take (amx::scores).
      bool s_tiles = false;
      if (amx_unit) {
#if TOKENMIX_HAVE_AMX
        // The tile pair ahead (K and V tiles with their scales), front to back, over this tile's
        // work (amx_decode.cpp: pf_take).
        const std::uint8_t* const pf_pair =
            has_next ? reinterpret_cast<const std::uint8_t*>(k_layer + next) : nullptr;
        if constexpr (kAmxBuilt) s_tiles = amx::scores(kt, nt, st, pf_pair, pair_bytes);
#endif
      }
      if (s_tiles) {
        // (S written, in key order)
      } else if (quads) {
        // The quads' features, then the d_h % 4 tail rows (accumulated: the same k order). An
        // int8 cache in plain rows takes the plain widening (the last branch, TP = int8_t).
        const std::int64_t dq = a.layout.quad_features();
        const auto tail = [&](const auto* kk) {
          using TT = std::remove_cv_t<std::remove_pointer_t<decltype(kk)>>;
          constexpr const TT* kNoPrefetch = nullptr;
          ColumnBlocks<kRD, kVD, 1>(d, nrows, qs + dq * nrows, nrows, kk, kKeyTile, dh - dq, st,
                                    kKeyTile, true, nv, kNoPrefetch, nullptr);
        };
        if constexpr (kInt8) {  // (quads is false for every other cache element)
          if (k_fast) {
            s_product(reinterpret_cast<const int8_quad_t*>(kt),
                      reinterpret_cast<const int8_quad_t*>(kt_next));
            if (dq < dh) tail(reinterpret_cast<const int8_x24_t*>(kt + dq * kKeyTile));
          } else {
            s_product(reinterpret_cast<const int8_quad_exact_t*>(kt),
                      reinterpret_cast<const int8_quad_exact_t*>(kt_next));
            if (dq < dh) tail(kt + dq * kKeyTile);
          }
        }
      } else if (tiles_bf16) {
        // The whole K tile [d_h][64] (a last tile's keys past nt are masked below), at K's unit:
        // the direct bits (k_direct) or q · 2^−8.
        if constexpr (kFp8TilesAsBf16) {
          Fp8TileToBf16(d, kt, a.layout.tile_elems(), k_direct, k_bf16);
          constexpr const bf16_split_t* kNoPrefetch = nullptr;
          s_product(reinterpret_cast<const bf16_split_t*>(k_bf16), kNoPrefetch);
          UnsplitPairs(st, kKeyTile, nrows, nv / w_blk * w_blk);
        }
      } else if (kQuadBuilt && k_direct && quad) {
        s_product(reinterpret_cast<const TQ*>(kt), reinterpret_cast<const TQ*>(kt_next));
        UnsplitQuads(st, kKeyTile, nrows, nv / w_blk * w_blk);
      } else if (kDirectBuilt && k_direct) {
        s_product(reinterpret_cast<const TD*>(kt), reinterpret_cast<const TD*>(kt_next));
      } else {
        s_product(reinterpret_cast<const TP*>(kt), reinterpret_cast<const TP*>(kt_next));
        if constexpr (kSplit) UnsplitPairs(st, kKeyTile, nrows, nv / w_blk * w_blk);
      }
      // Tile crosses some row's end or window start: the mask pass below runs.
      const bool partial = u0 + kKeyTile > kfull || u0 < kfull_begin;
      // S_u ← δ_u · S_u (the K tile's row scales follow it): fused into the row max pass below
      // when no variant or mask pass comes first (the same products), else a pass of its own.
      const float* ks = reinterpret_cast<const float*>(kt + a.layout.tile_elems());
      const bool fuse_ks = kQuant && !capped && a.var.alibi == nullptr && !partial;
      // S_u · δ_u for int8; (S_u · k_post) · δ_u for fp8 (k_post a power of two: the same bits
      // as S_u · (δ_u · k_post) wherever that product is finite, and no overflow of it).
      const VF kpost = hn::Set(d, k_post);
      const auto scale_scores = [&](VF s_u, VF delta) {
        // (int8: k_post 2^−24 with int8_quad_t, S_u · 2^24 · 2^−24 exact; else 1)
        if constexpr (kFp8 || kInt8) return hn::Mul(hn::Mul(s_u, kpost), delta);
        return hn::Mul(s_u, delta);
      };
      // V's row scales: P_u ← P_u · δ_u in the exp pass (after l takes the unscaled P).
      const float* vs =
          kQuant ? reinterpret_cast<const float*>(vt + a.layout.tile_elems()) : nullptr;
      // V read directly (see kDirectBuilt) if every scale of the tile is below 2^7.
      bool v_direct = false;
      if (kDirectBuilt && direct_unit) {
        VF vmax_scale = hn::LoadU(d, vs);
        for (std::int64_t i = N; i < nv; i += N)
          vmax_scale = hn::Max(vmax_scale, hn::LoadU(d, vs + i));
        v_direct = hn::GetLane(hn::MaxOfLanes(d, vmax_scale)) < 0x1.0p7f;
      }
      // int8: V read through int8_quad_t if every scale of the tile is 0 or at least 2^−64.
      bool v_fast = false;
      if (kInt8 && quads && !amx_unit) {  // (the tile products read q: unit 1; rows: unit 1)
        const VF lo = hn::Set(d, 0x1.0p-64f);
        auto bad = hn::Lt(lo, lo);  // none
        for (std::int64_t i = 0; i < nv; i += N) {
          const VF delta = hn::LoadU(d, vs + i);
          bad = hn::Or(bad, hn::And(hn::Lt(delta, lo), hn::Ne(delta, hn::Zero(d))));
        }
        v_fast = hn::AllFalse(d, bad);
      }
      const float v_elem_unit = v_direct ? kDirectUnit  // what V's LoadB returns per q
                                : v_fast ? 0x1.0p24f
                                         : kUnit;
      const VF v_unit = hn::Set(d, 1.0f / v_elem_unit);
      if (kQuant && !fuse_ks) {
        for (std::int64_t i = 0; i < nv; i += N) {
          const VF delta = hn::LoadU(d, ks + i);
          for (std::int64_t r = 0; r < nrows; ++r) {
            hn::Store(scale_scores(hn::Load(d, st + r * kKeyTile + i), delta), d,
                      st + r * kKeyTile + i);
          }
        }
      }

      // Score variants, mask (4.3, window) and online softmax (4.4), in groups of kSoftmaxGroup
      // rows: first each row's variants, mask and max m', then each row's exponentials, sum and
      // rescale. Every row goes through the same operations in the same order as row by row (the
      // same bits), but the group's reductions, and then its exps, are adjacent in the program,
      // so the core overlaps their latency chains instead of finishing one row's max → exp →
      // sum before the next row's starts. AMD Zen 4, one process alternating the two call by call
      // (the same output bits), hot (T_k = 2048, one thread), T_new = 1 / 2: AVX-512 0.96–0.99×
      // the time for every cache dtype, AVX2 forced 0.96–0.995×; T_new = 4 and 16 0.95–1.0×
      // (groups of 4 and 16 no better); T_k = 32768 from memory, two threads: within the noise
      // (docs/performance.md, D-softmax-2).
      constexpr std::int64_t kSoftmaxGroup = 8;
      float m_group[kSoftmaxGroup];
      for (std::int64_t r0 = 0; r0 < nrows; r0 += kSoftmaxGroup) {
        const std::int64_t r1 = std::min(nrows, r0 + kSoftmaxGroup);
        for (std::int64_t r = r0; r < r1; ++r) {
#if TOKENMIX_HAVE_AMX
          if constexpr (kAmxBuilt) {
            if (amx_unit) amx::keep_awake();
          }
#endif
          float* score = st + r * kKeyTile;
          const std::int64_t t = t0 + r / g;
          const std::int64_t end = a.visible_end(b, t), begin = a.visible_begin(b, t);
          if (capped) {  // cap(z) = c·tanh(z / c)
            for (std::int64_t i = 0; i < nv; i += N) {
              const VF z = hn::Load(d, score + i);
              hn::Store(hn::Mul(cap, TanhRational(d, hn::Mul(z, inv_cap))), d, score + i);
            }
          }
          if (a.var.alibi != nullptr) {  // S += m_h (u − p), u − p = u0 + i − (end − 1)
            const VF slope = hn::Set(d, a.var.alibi[j * g + r % g]);
            const std::int64_t rel = u0 - (end - 1);
            for (std::int64_t i = 0; i < nv; i += N) {
              const VF dist = hn::Iota(d, static_cast<float>(rel + i));
              hn::Store(hn::MulAdd(slope, dist, hn::Load(d, score + i)), d, score + i);
            }
          }
          // Tile crosses some row's end or window start: −∞ for lanes outside [begin, end).
          if (partial) {
            const auto lo_minus_1 = hn::Set(  // lane ≥ lo ⟺ lo − 1 < lane (no integer Ge here)
                di,
                static_cast<std::int32_t>(std::clamp<std::int64_t>(begin - u0, 0, kKeyTile) - 1));
            const auto hi = hn::Set(
                di, static_cast<std::int32_t>(std::clamp<std::int64_t>(end - u0, 0, kKeyTile)));
            for (std::int64_t i = 0; i < nv; i += N) {
              const auto lane = hn::Iota(di, static_cast<std::int32_t>(i));
              const auto visible =
                  hn::RebindMask(d, hn::And(hn::Lt(lo_minus_1, lane), hn::Lt(lane, hi)));
              hn::Store(hn::IfThenElse(visible, hn::Load(d, score + i), hn::Set(d, kNegInf)), d,
                        score + i);
            }
          }
          // The row's max (same order of Max either way); fuse_ks: S_u ← δ_u · S_u on the way.
          const auto scaled = [&](std::int64_t i) {
            if (!fuse_ks) return hn::Load(d, score + i);
            const VF z = scale_scores(hn::Load(d, score + i), hn::LoadU(d, ks + i));
            hn::Store(z, d, score + i);
            return z;
          };
          VF vmax = scaled(0);
          for (std::int64_t i = N; i < nv; i += N) vmax = hn::Max(vmax, scaled(i));
          m_group[r - r0] = max_nan(m_run[r], hn::GetLane(hn::MaxOfLanes(d, vmax)));
        }
        for (std::int64_t r = r0; r < r1; ++r) {
          float* score = st + r * kKeyTile;
          const float m_old = m_run[r], m_new = m_group[r - r0];
          // A row with nothing visible yet keeps P = 0 (shift 0: e^{−∞} = 0).
          const VF shift = hn::Set(d, m_new == kNegInf ? 0.0f : m_new);
          VF vsum = hn::Zero(d);
          for (std::int64_t i = 0; i < nv; i += N) {
            const VF p = ExpNaN(d, hn::Sub(hn::Load(d, score + i), shift));  // NaN score: l = NaN
            if constexpr (kQuant) {  // P_u δ_u for P V (V's row scales follow the tile); l: P_u
              hn::Store(hn::Mul(p, hn::Mul(hn::LoadU(d, vs + i), v_unit)), d, score + i);
            } else {
              hn::Store(p, d, score + i);
            }
            vsum = hn::Add(vsum, p);
          }
          if (m_new > m_old && m_old != kNegInf) {  // rescale Õ and l by e^{m − m'}
            const float alpha = std::exp(m_old - m_new);
            float* o = acc + r * dh;
            const VF va = hn::Set(d, alpha);
            std::int64_t x = 0;
            for (; x < dh_vec; x += N) hn::StoreU(hn::Mul(hn::LoadU(d, o + x), va), d, o + x);
            for (; x < dh; ++x) o[x] *= alpha;
            l_run[r] *= alpha;
          }
          l_run[r] += hn::GetLane(hn::SumOfLanes(d, vsum));
          m_run[r] = m_new;
        }
      }

      // Õ += P V over the tile's nt keys, d_h in register blocks, then single vectors, then
      // a scalar tail (d_h % Lanes)  (4.5)
      std::int64_t x0 = 0;
      // The V tile is consumed in sub-tiles of kSub keys, all d_h chunks of a sub-tile before the
      // next, so memory is read front to back (row-strided passes over the whole tile halve the
      // DRAM bandwidth a core gets).
      // Keys before kfull_begin and from kfull on are not seen by every row; if their V rows are
      // not finite, each row's product covers its own visible keys only (a masked key takes no
      // part: 0 · NaN = NaN).
      // A quantized V is finite (non-finite rows are refused on append): no scan.
      const std::int64_t first_partial = std::clamp<std::int64_t>(kfull - u0, 0, nt);
      const std::int64_t last_partial = std::clamp<std::int64_t>(kfull_begin - u0, 0, nt);
      bool v_bad = false;
      if constexpr (!kQuant) {  // (an AMX unit checks its tiles itself: amx::values)
        v_bad =
            !amx_unit && (v_nonfinite(vt, 0, last_partial) || v_nonfinite(vt, first_partial, nt));
      }
      // The tall blocking is bound by FMAs, not by the stream (several query rows per key): it
      // takes the whole tile per call, so Õ is loaded and stored once per tile, not per kSub; so
      // does every unit of a narrow cache on AVX-512 (kWholeTilePVNarrow). The same k order for
      // every element of Õ either way (the same bits).
      const std::int64_t sub = tall || (kWholeTilePVNarrow && sizeof(TB) < 4) ? kKeyTile : kSub;
      if (amx_unit) {
#if TOKENMIX_HAVE_AMX
        if constexpr (kAmxBuilt) {
          // A bf16 V tile the tiles cannot take: each row's visible keys by a scalar loop, in
          // the tiles' column order (a key a row does not see takes no part: 0 · NaN = NaN).
          if (!amx::values(st, nt, vt, acc)) {
            for (std::int64_t r = 0; r < nrows; ++r) {
              const std::int64_t t = t0 + r / g;
              amx::values_visible(
                  st + r * kKeyTile, std::clamp<std::int64_t>(a.visible_begin(b, t) - u0, 0, nt),
                  std::clamp<std::int64_t>(a.visible_end(b, t) - u0, 0, nt), vt, acc + r * dh);
            }
          }
        }
#endif
        continue;  // the next tile (d_h % 64 == 0: no scalar tail)
      }
      // tiles_bf16: the V tile's nt rows [nt][d_h] (in whole 64-byte lines), at V's unit: the
      // direct bits (v_direct) or q · 2^−8 (v_elem_unit). (A tall unit: one sub-tile, k0 = 0.)
      if constexpr (kFp8TilesAsBf16) {
        if (tiles_bf16) {
          Fp8TileToBf16(d, vt, std::min(a.layout.tile_elems(), (nt * vld + 63) / 64 * 64), v_direct,
                        v_bf16);
        }
      }
      for (std::int64_t k0 = 0; k0 < nt; k0 += sub) {
        const std::int64_t nk = std::min(sub, nt - k0);
        const TB* vk = vt + k0 * vld;
        if (v_bad) {
          for (std::int64_t r = 0; r < nrows; ++r) {
            const std::int64_t seen = a.visible_end(b, t0 + r / g) - u0 - k0;
            const std::int64_t from = a.visible_begin(b, t0 + r / g) - u0 - k0;
            const std::int64_t lo = std::clamp<std::int64_t>(from, 0, nk);
            const std::int64_t nk_r = std::clamp<std::int64_t>(seen, 0, nk) - lo;
            const float* p_r = st + r * kKeyTile + k0 + lo;
            const TP* v_r = reinterpret_cast<const TP*>(vk + lo * vld);
            float* o_r = acc + r * dh;
            if (nk_r <= 0) {
              x0 = dh_vec;  // nothing visible in this sub-tile (the tail loop checks per key)
              continue;
            }
            // The unit's column blocking (w_blk), as the other tiles' products: Õ's columns
            // are in the same (split) order in every tile.
            constexpr const TP* kNoPrefetch = nullptr;
            x0 = tall ? ColumnBlocks<1, kVT, kKeyTile>(d, 1, p_r, 1, v_r, vld, nk_r, o_r, dh, true,
                                                       dh_vec, kNoPrefetch, nullptr)
                      : ColumnBlocks<1, kVD, kKeyTile>(d, 1, p_r, 1, v_r, vld, nk_r, o_r, dh, true,
                                                       dh_vec, kNoPrefetch, nullptr);
          }
          continue;
        }
        // vv: the V sub-tile as TB or (v_direct) as TD, vn: the prefetched one (or null).
        const auto pv_product = [&](const auto* vv, const auto* vn) {
          // A = P: row r at st + r·64 (kKeyTile), k (a key) the next float. int8 quads
          // (kQuadLayout): key quads 4·d_h bytes apart (k0 a multiple of 4: the same offset).
          constexpr bool kQuads =
              kQuadLayout<std::remove_cv_t<std::remove_reference_t<decltype(*vv)>>>;
          const std::int64_t ldb = kQuads ? 4 * vld : vld;
          x0 = tall ? ColumnBlocks<kRT, kVT, kKeyTile>(d, nrows, st + k0, 1, vv, ldb, nk, acc, dh,
                                                       true, dh_vec, vn, cur)
                    : ColumnBlocks<kRD, kVD, kKeyTile>(d, nrows, st + k0, 1, vv, ldb, nk, acc, dh,
                                                       true, dh_vec, vn, cur);
        };
        const TB* vk_next = vt_next != nullptr ? vt_next + k0 * vld : nullptr;
        if (quads) {  // the key quads (int8 in plain rows: the last branch)
          if constexpr (kInt8) {
            if (v_fast) {
              pv_product(reinterpret_cast<const int8_quad_t*>(vk),
                         reinterpret_cast<const int8_quad_t*>(vk_next));
            } else {
              pv_product(reinterpret_cast<const int8_quad_exact_t*>(vk),
                         reinterpret_cast<const int8_quad_exact_t*>(vk_next));
            }
          }
        } else if (tiles_bf16) {
          constexpr const bf16_split_t* kNoPrefetch = nullptr;
          pv_product(reinterpret_cast<const bf16_split_t*>(v_bf16 + k0 * vld), kNoPrefetch);
        } else if (kQuadBuilt && quad && v_direct) {
          pv_product(reinterpret_cast<const TQ*>(vk), reinterpret_cast<const TQ*>(vk_next));
        } else if (kQuadBuilt && quad) {
          pv_product(reinterpret_cast<const TQ16*>(vk), reinterpret_cast<const TQ16*>(vk_next));
        } else if (kDirectBuilt && v_direct) {
          pv_product(reinterpret_cast<const TD*>(vk), reinterpret_cast<const TD*>(vk_next));
        } else {
          pv_product(reinterpret_cast<const TP*>(vk), reinterpret_cast<const TP*>(vk_next));
        }
      }
      if (x0 < dh) {
        for (std::int64_t r = 0; r < nrows; ++r)  // visible keys only (0 · NaN = NaN)
          for (std::int64_t u = std::max<std::int64_t>(0, a.visible_begin(b, t0 + r / g) - u0);
               u < std::min(nt, a.visible_end(b, t0 + r / g) - u0); ++u) {
            const float p = st[r * kKeyTile + u];
            for (std::int64_t x = x0; x < dh; ++x) {
              const std::int64_t at = kInt8 ? a.layout.value_in_tile(u, x) : u * vld + x;
              acc[r * dh + x] += p * (load_element(a.dtype, vt, at) * v_elem_unit);
            }
          }
      }
    }
    // Õ's blocked columns back in order (the split readings; the scalar tail is in order).
    if ((kSplit || tiles_bf16) && !amx_unit) UnsplitPairs(acc, dh, nrows, dh_vec / w_blk * w_blk);
    if (quad) UnsplitQuads(acc, dh, nrows, dh_vec / w_blk * w_blk);
#if TOKENMIX_HAVE_AMX
    if constexpr (kAmxBuilt) {
      if (amx_unit) amx::unpermute(acc);
    }
#endif
  }
#if TOKENMIX_HAVE_AMX
  if constexpr (kAmxBuilt) {
    if (amx_configured) amx::release();
  }
#endif
}

}  // namespace tokenmix::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard (per target)

// The three exports of one cache dtype's translation unit (its HWY_ONCE part): the kernel per
// target, attention_decode_<dtype>_<avx512|avx2|neon>, null where the target is not compiled.
#ifndef TOKENMIX_DECODE_KERNELS
#define TOKENMIX_DECODE_KERNELS(dtype, TB)                                                      \
  const DecodeKernel attention_decode_##dtype##_avx512 = TOKENMIX_SIMD_AVX512(DecodeUnits<TB>); \
  const DecodeKernel attention_decode_##dtype##_avx2 = TOKENMIX_SIMD_AVX2(DecodeUnits<TB>);     \
  const DecodeKernel attention_decode_##dtype##_neon = TOKENMIX_SIMD_NEON(DecodeUnits<TB>)
#endif
