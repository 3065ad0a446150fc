// src/kernels/simd/microkernel-inl.h — the one register-blocked microkernel behind every SIMD
// attention product (forward and backward), per Highway target.
//
//   C[R rows][M lanes] (+)= Σ_{k<K} A_r[k] · B[k][M lanes],   M = kV · Lanes
//
// A is read by scalar broadcast straight from a row-major operand (a K, V, Q or dO row of the
// caller's tensor, or a P/dS buffer): element (r, k) at a[r·a_row + k·a_k]. B is a packed
// buffer of M-element rows, fp32 or (KV-cache decode) bf16/f16 widened to fp32 on load; M =
// VN·Lanes with VN = kV unless the caller asks for another width. C lives in memory and is
// loaded/stored once per call; the accumulators stay in registers across the whole k loop.
//
// Highway "-inl" header: included once per target from a foreach_target translation unit.
#if defined(TOKENMIX_KERNELS_SIMD_MICROKERNEL_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TOKENMIX_KERNELS_SIMD_MICROKERNEL_INL_H_
#undef TOKENMIX_KERNELS_SIMD_MICROKERNEL_INL_H_
#else
#define TOKENMIX_KERNELS_SIMD_MICROKERNEL_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "hwy/cache_control.h"
#include "hwy/highway.h"
#include "kernels/kv_element.hpp"
#include "kernels/simd/work_units.hpp"

HWY_BEFORE_NAMESPACE();
namespace tokenmix::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// A byte range prefetched front to back, a cache line at a time, while a microkernel computes
// (decode: the next K/V tile pair, in address order whatever order the products read the current
// one; see decode_blocking-inl.h, kLinearPrefetch). next advances past what was prefetched.
// sharers: how many row blocks over the same B columns advance it (each by row_bytes / sharers
// per k), so that the range is prefetched across all of their k loops, not the first one's only.
struct PrefetchCursor {
  const std::uint8_t* next = nullptr;
  const std::uint8_t* end = nullptr;
  std::int64_t sharers = 1;
};

// Prefetch of one cache line of decode's forward stream (MicroKernel's pf rows and cursor). x86:
// into L2 (PREFETCHT1), not L1; the lines reach L1 on the loads, a tile later. On AMD Zen 4 the
// T_new = 1 step (bf16 cache, T_k = 32768, one thread) took 12.3 ms prefetching into L1 and
// 7.8 ms into L2 on AVX-512 (no software prefetch: 8.3 ms); the AVX2 path there (forced), whose
// cursor prefetched into L1: f32 21.7 → 12.3–13.6 ms, bf16 10.0 → 8.8, int8 8.2 → 6.8 (on AMD
// Zen 3 a PREFETCHT2 cursor had measured within noise of L1). docs/performance.md, D-prefetch-1
// and D-prefetch-3. NEON: L1 (not measured).
HWY_INLINE void PrefetchStream(const std::uint8_t* p) {
#if (HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX2) && \
    !defined(HWY_DISABLE_CACHE_CONTROL)
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
#else
  hwy::Prefetch(p);
#endif
}

// Register blocking per target: kR rows × kV vectors of accumulators.
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
constexpr int kR = 6, kV = 4;  // 24 of 32 zmm registers: M = 64 lanes
#elif HWY_TARGET == HWY_AVX2
constexpr int kR = 3, kV = 3;  // 9 of 16 ymm registers: M = 24 lanes
#elif HWY_TARGET == HWY_NEON
constexpr int kR = 6, kV = 4;  // 24 of 32 128-bit q registers (+ 4 B, 1 A): M = 16 lanes
// LoadB's f16 → f32 widening must be the exact hardware conversion (FCVTL; base AArch64), not
// Highway's bit-twiddling fallback, which would turn f16 Inf/NaN into finite values.
#if !(__ARM_FP & 2)
#error "NEON target without half-precision conversion (__ARM_FP & 2): f16 cache widening"
#endif
#else
constexpr int kR = 2, kV = 2;  // fallback targets (not dispatched to by tokenmix)
#endif

// One vector of B widened to fp32: a plain load for fp32, exact promotion for bf16 / f16.
template <class D>
HWY_INLINE hn::Vec<D> LoadB(D d, const float* HWY_RESTRICT p) {
  return hn::LoadU(d, p);
}
template <class D>
HWY_INLINE hn::Vec<D> LoadB(D d, const hwy::bfloat16_t* HWY_RESTRICT p) {
  return hn::PromoteTo(d, hn::LoadU(hn::Rebind<hwy::bfloat16_t, D>(), p));
}
template <class D>
HWY_INLINE hn::Vec<D> LoadB(D d, const hwy::float16_t* HWY_RESTRICT p) {
  return hn::PromoteTo(d, hn::LoadU(hn::Rebind<hwy::float16_t, D>(), p));
}

// Quantized KV-cache elements (SPEC "Quantized KV cache"), the stored q before its row's scale,
// exactly: int8 → i32 → f32 (the value q); fp8 E4M3 (s eeee mmm) placed in f16 bits
// (s 0eeee mmm 0000000: the byte sign-extended to 16 bits, shifted left by 7, bit 14 cleared),
// which is the E4M3 value × 2^−8 for normal and subnormal codes alike, widened exactly (F16C /
// FCVTL). The fp8 LoadB thus returns q · 2^−8: the decode kernel folds 2^8 into the row scales
// (fp8_unit_scale).
template <class D>
HWY_INLINE hn::Vec<D> LoadB(D d, const std::int8_t* HWY_RESTRICT p) {
  const hn::RebindToSigned<D> di;
  return hn::ConvertTo(d, hn::PromoteTo(di, hn::LoadU(hn::Rebind<std::int8_t, D>(), p)));
}
template <class D>
HWY_INLINE hn::Vec<D> LoadB(D d, const fp8_e4m3_t* HWY_RESTRICT p) {
  const hn::Rebind<std::int16_t, D> d16;
  const auto b = hn::PromoteTo(  // sign copies in bits 7–15
      d16, hn::LoadU(hn::Rebind<std::int8_t, D>(), reinterpret_cast<const std::int8_t*>(p)));
  const auto h = hn::And(hn::ShiftLeft<7>(b), hn::Set(d16, static_cast<std::int16_t>(0xbf80)));
  return hn::PromoteTo(d, hn::BitCast(hn::Rebind<hwy::float16_t, D>(), h));
}
// fp8 E4M3 read a second way (the "direct" widening, decode_reader_fp8-inl.h): the same bytes as
// fp8_e4m3_t, the code's bits placed straight into fp32 bits s 0000eeee mmm000…0 (sign to bit
// 31, eeee mmm to bits 26–20), which is the E4M3 value × 2^−120 for normal and subnormal codes
// alike — the subnormal codes (e = 0) become subnormal fp32 (0.mmm · 2^−126): exact only while
// the MXCSR's DAZ and FTZ are clear, which the decode kernel checks before choosing this type.
struct fp8_e4m3_direct_t {
  std::uint8_t bits;
};
template <class D>
HWY_INLINE hn::Vec<D> LoadB(D d, const fp8_e4m3_direct_t* HWY_RESTRICT p) {
  const hn::RebindToSigned<D> di;
  const auto b = hn::PromoteTo(  // sign copies in bits 7–31
      di, hn::LoadU(hn::Rebind<std::int8_t, D>(), reinterpret_cast<const std::int8_t*>(p)));
  const auto bits =
      hn::And(hn::ShiftLeft<20>(b), hn::Set(di, static_cast<std::int32_t>(0x87f00000)));
  return hn::BitCast(d, bits);
}

// fp8 E4M3 read directly as fp32 bits four columns to a 32-bit word (the "quad" reading, decode's
// regular blocks: decode_reader_fp8-inl.h): the same bytes as fp8_e4m3_t. LoadB is the direct
// widening (one vector, columns in order, q · 2^−120); LoadBRow reads each group of four vectors
// (4·Lanes columns from x) as 2·Lanes 16-bit words, byte 2i + 1 in bits 8–15 of word i: an
// arithmetic shift right by 4 puts that byte's sign in bit 15 and its eeee mmm in bits 4–10,
// which in a 32-bit word's upper half is the direct fp32 bits s 0000eeee mmm000…0 once masked
// (columns x + 4i + 3), and after a shift left by 16 those of its lower half (x + 4i + 1); the
// even bytes take one more shift (left by 8, first). 9 integer instructions per 4·Lanes
// elements against 12 for the pairs of vectors these blocks read before (VPERMD, VPMOVSXBW, a
// shift, a mask and two unpacks per pair: 8 of the 12 shuffles); the four vectors hold columns
// x + 4i, x + 4i + 1, x + 4i + 2, x + 4i + 3 (i < Lanes), and UnsplitQuads puts the products'
// columns back in order. A 4-row k loop of 4 zmm vectors on AMD Zen 4: 0.33 → 0.29 ns per FMA
// (int8: 0.30).
struct fp8_e4m3_quad_t {
  std::uint8_t bits;
};
template <class D>
HWY_INLINE hn::Vec<D> LoadB(D d, const fp8_e4m3_quad_t* HWY_RESTRICT p) {
  return LoadB(d, reinterpret_cast<const fp8_e4m3_direct_t*>(p));
}
// The quad reading times 2^112 (exact: DAZ clear), i.e. q · 2^−8, the f16 reading's values in
// the quad reading's column order; LoadB is the f16 widening. The decode kernel reads a V tile
// whose scales rule out the direct unit (see there) through this type, so that Õ's columns are
// in one order for every tile of a unit.
struct fp8_e4m3_quad_f16unit_t {
  std::uint8_t bits;
};
template <class D>
HWY_INLINE hn::Vec<D> LoadB(D d, const fp8_e4m3_quad_f16unit_t* HWY_RESTRICT p) {
  return LoadB(d, reinterpret_cast<const fp8_e4m3_t*>(p));
}

// bf16 read a second way (the "split" reading, decode's products): the same bytes as
// hwy::bfloat16_t. LoadB is the plain widening (one vector, columns in order); LoadBRow reads a
// pair of vectors (2·Lanes columns from x) as Lanes 32-bit words and gives the even columns
// (the low halves shifted left by 16) and then the odd ones (the high halves, low bits
// cleared): 2 instructions per 2·Lanes elements, no shuffle, against 4 for the widening in
// order (zero-extend, shift; twice). The products then hold each pair's columns as
// [x, x+2, …, x+2·Lanes−2 | x+1, x+3, …]; UnsplitPairs puts them back in order (each output
// element's k loop is unchanged: the same bits). A k loop of 4 rows × 4 vectors (8 × 2,
// 12 × 2) on AMD Zen 4: 0.29 → 0.275 (0.30 → 0.29, 0.30 → 0.285) ns per zmm FMA; AVX2 4 × 2
// and 6 × 2 there 5–10 % faster (docs/performance.md, D-bf16-4).
struct bf16_split_t {
  std::uint16_t bits;
};
template <class D>
HWY_INLINE hn::Vec<D> LoadB(D d, const bf16_split_t* HWY_RESTRICT p) {
  return LoadB(d, reinterpret_cast<const hwy::bfloat16_t*>(p));
}
// The int8 cache's tiles in VNNI-4 quads (kv_tile_layout.hpp: K [d_h/4][64][4], V
// [16][d_h][4]): B's rows k = 4i .. 4i + 3 share one row of 32-bit words, column x's word holding
// the four elements of rows 4i .. 4i + 3 (B row k of column x at byte 4x + k % 4 of quad row
// k / 4). MicroKernel reads row k of such a B (kQuadLayout) by loading 4·Lanes bytes of its quad
// row per vector and moving byte k % 4 of each word to the word's top byte, zeros below (one byte
// shuffle: TableLookupBytesOr0 with kQuadPick), which as an int32 is q · 2^24, exact:
//   int8_quad_t        then converted: q · 2^24 (kLoadBUnit 2^24; the decode kernel folds 2^−24
//                      into the scores and weights where no product can leave the normal range),
//                      the same two instructions per Lanes elements as the plain widening;
//   int8_quad_exact_t  shifted right by 24 first (arithmetic), then converted: q (unit 1).
struct int8_quad_t {
  std::uint8_t bits;
};
struct int8_quad_exact_t {
  std::uint8_t bits;
};
// The plain int8 widening times 2^24 (exact): K's d_h % 4 tail features, stored as plain rows
// after the quads, at int8_quad_t's unit.
struct int8_x24_t {
  std::int8_t bits;
};
template <class TB>
inline constexpr bool kQuadLayout =
    std::is_same_v<TB, int8_quad_t> || std::is_same_v<TB, int8_quad_exact_t>;
// Bytes of B from one column to the next in a B row (the quad layouts: a word per column).
template <class TB>
inline constexpr std::int64_t kColumnBytes = kQuadLayout<TB> ? 4 : sizeof(TB);
// B at column x of its rows (the caller's column offset into a row of B).
template <class TB>
HWY_INLINE const TB* BColumn(const TB* b, std::int64_t x) {
  return b == nullptr ? nullptr
                      : reinterpret_cast<const TB*>(reinterpret_cast<const std::uint8_t*>(b) +
                                                    x * kColumnBytes<TB>);
}
// Byte shuffle controls: kQuadPick[j] moves byte j of each 32-bit word to its top byte and
// zeroes the other three (indices within each 16-byte block; 0x80: zero).
alignas(64) inline constexpr std::uint8_t kQuadPick[4][64] = {
#define TOKENMIX_QUAD_PICK(j)                                                                      \
  {                                                                                                \
    0x80, 0x80, 0x80, j, 0x80, 0x80, 0x80, 4 + j, 0x80, 0x80, 0x80, 8 + j, 0x80, 0x80, 0x80,       \
        12 + j, 0x80, 0x80, 0x80, j, 0x80, 0x80, 0x80, 4 + j, 0x80, 0x80, 0x80, 8 + j, 0x80, 0x80, \
        0x80, 12 + j, 0x80, 0x80, 0x80, j, 0x80, 0x80, 0x80, 4 + j, 0x80, 0x80, 0x80, 8 + j, 0x80, \
        0x80, 0x80, 12 + j, 0x80, 0x80, 0x80, j, 0x80, 0x80, 0x80, 4 + j, 0x80, 0x80, 0x80, 8 + j, \
        0x80, 0x80, 0x80, 12 + j                                                                   \
  }
    TOKENMIX_QUAD_PICK(0), TOKENMIX_QUAD_PICK(1), TOKENMIX_QUAD_PICK(2), TOKENMIX_QUAD_PICK(3)
#undef TOKENMIX_QUAD_PICK
};
// Row k of a quad-layout B: VN vectors from p, a quad row (j = k % 4), as fp32 (q · kLoadBUnit).
template <int VN, class D, class TB>
HWY_INLINE void LoadQuadRow(D d, const TB* HWY_RESTRICT p, std::int64_t j, hn::Vec<D>* bv) {
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const hn::Repartition<std::uint8_t, D> d8;
  const hn::RebindToSigned<D> di;
  const auto pick = hn::Load(d8, kQuadPick[j]);
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(p);
  for (int v = 0; v < VN; ++v) {
    const auto top =
        hn::BitCast(di, hn::TableLookupBytesOr0(hn::LoadU(d8, bytes + 4 * N * v), pick));
    if constexpr (std::is_same_v<TB, int8_quad_exact_t>) {
      bv[v] = hn::ConvertTo(d, hn::ShiftRight<24>(top));
    } else {
      bv[v] = hn::ConvertTo(d, top);
    }
  }
}
template <class D>
HWY_INLINE hn::Vec<D> LoadB(D d, const int8_x24_t* HWY_RESTRICT p) {
  return hn::Mul(LoadB(d, reinterpret_cast<const std::int8_t*>(p)), hn::Set(d, 0x1.0p24f));
}

// The split readings (bf16_split_t, fp8_e4m3_quad_t) are built for x86 only (NEON's bf16
// widening is one instruction per vector already; fp8 is read directly on x86 only).
constexpr bool kSplitBuilt =
    HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX2;

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
using SplitVec = __m512;
#elif HWY_TARGET == HWY_AVX2
using SplitVec = __m256;
#endif
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX2
// Two vectors x, y (Lanes floats each) interleaved: x0 y0 x1 y1 … into lo (the first Lanes) and
// hi. Intrinsics: Highway 1.0.3 has no two-table lane permutation.
HWY_INLINE void Interleave(SplitVec x, SplitVec y, SplitVec& lo, SplitVec& hi) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  lo = _mm512_permutex2var_ps(x, first, y);
  hi = _mm512_permutex2var_ps(x, second, y);
#else
  const __m256 a = _mm256_unpacklo_ps(x, y);  // x0 y0 x1 y1 | x4 y4 x5 y5
  const __m256 b = _mm256_unpackhi_ps(x, y);  // x2 y2 x3 y3 | x6 y6 x7 y7
  lo = _mm256_permute2f128_ps(a, b, 0x20);
  hi = _mm256_permute2f128_ps(a, b, 0x31);
#endif
}
HWY_INLINE SplitVec LoadSplit(const float* p) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  return _mm512_loadu_ps(p);
#else
  return _mm256_loadu_ps(p);
#endif
}
HWY_INLINE void StoreSplit(SplitVec v, float* p) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  _mm512_storeu_ps(p, v);
#else
  _mm256_storeu_ps(p, v);
#endif
}
#endif

// Rows of C whose columns [0, ext) were computed through bf16_split_t pairs (ext a multiple of
// 2·Lanes) back to column order, in place: each group of 2·Lanes floats holds the even columns
// of the group, then the odd ones.
HWY_INLINE void UnsplitPairs(float* HWY_RESTRICT c, std::int64_t ldc, std::int64_t rows,
                             std::int64_t ext) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX2
  constexpr std::int64_t N = sizeof(SplitVec) / sizeof(float);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t x = 0; x < ext; x += 2 * N) {
      float* g = c + r * ldc + x;
      SplitVec lo, hi;
      Interleave(LoadSplit(g), LoadSplit(g + N), lo, hi);
      StoreSplit(lo, g);
      StoreSplit(hi, g + N);
    }
  }
#else
  (void)c, (void)ldc, (void)rows, (void)ext;  // never called: kSplitBuilt is false
#endif
}

// Rows of C whose columns [0, ext) were computed through fp8_e4m3_quad_t groups (ext a multiple
// of 4·Lanes) back to column order, in place: each group of 4·Lanes floats holds its columns
// 4i, then 4i + 1, 4i + 2 and 4i + 3 (i < Lanes). Columns 4i and 4i + 2 interleaved, 4i + 1 and
// 4i + 3 likewise, then those two: 8 two-vector permutations per group.
HWY_INLINE void UnsplitQuads(float* HWY_RESTRICT c, std::int64_t ldc, std::int64_t rows,
                             std::int64_t ext) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX2
  constexpr std::int64_t N = sizeof(SplitVec) / sizeof(float);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t x = 0; x < ext; x += 4 * N) {
      float* g = c + r * ldc + x;
      SplitVec even_lo, even_hi, odd_lo, odd_hi, o0, o1, o2, o3;
      Interleave(LoadSplit(g), LoadSplit(g + 2 * N), even_lo, even_hi);    // 4i, 4i + 2
      Interleave(LoadSplit(g + N), LoadSplit(g + 3 * N), odd_lo, odd_hi);  // 4i + 1, 4i + 3
      Interleave(even_lo, odd_lo, o0, o1);
      Interleave(even_hi, odd_hi, o2, o3);
      StoreSplit(o0, g);
      StoreSplit(o1, g + N);
      StoreSplit(o2, g + 2 * N);
      StoreSplit(o3, g + 3 * N);
    }
  }
#else
  (void)c, (void)ldc, (void)rows, (void)ext;  // never called: kSplitBuilt is false
#endif
}

// Rows of B at least this many vectors wide widen fp8 E4M3 through f16 bits in pairs of vectors
// (LoadBRow; the direct bits are read per vector, or as quads in the regular blocks). AVX-512:
// 4, because its decode tall blocks (2 vectors, 8–12 rows: each row's broadcast feeds 2 FMAs) ran
// faster widening per vector, 3–4 instructions per 16 elements with fewer shuffles. On AMD Zen 4,
// hot decode at T_new = 2 and 4 was 4–5 % faster through both the direct and the f16 widening
// (an 8 × 2 k loop with its broadcasts: 0.34 → 0.32 ns per FMA, direct). Other targets: 2 (AVX2's
// tall blocks measured 2–3 % slower per vector there, f16 widening). docs/performance.md,
// D-fp8-4.
constexpr int kFp8PairVectors = HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL ? 4 : 2;

// VN consecutive vectors of B (one k row of the microkernel) widened to fp32. fp8 E4M3 pairs
// its vectors (VN a multiple of kFp8PairVectors): one sign-extending load, shift and mask at full
// 16-bit width for 2·Lanes bytes, then each half widened f16 → f32 — the same values as LoadB
// (same bits), fewer instructions per element (4 instead of 5 on x86). The split readings
// (fp8_e4m3_quad_t, fp8_e4m3_quad_f16unit_t: VN a multiple of 4; bf16_split_t: of 2) give their
// columns in another order, see there. Otherwise, and for other element types: LoadB per vector.
template <int VN, class D, class TB>
HWY_INLINE void LoadBRow(D d, const TB* HWY_RESTRICT p, hn::Vec<D>* bv) {
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
#if HWY_TARGET != HWY_SCALAR  // (one lane: no halves)
  if constexpr (std::is_same_v<TB, fp8_e4m3_t> && VN % kFp8PairVectors == 0) {
    const hn::Repartition<std::int16_t, D> d16;  // 2·Lanes 16-bit lanes (D: a full vector)
    const hn::Half<decltype(d16)> d16h;          // Lanes 16-bit lanes
    const hn::Rebind<hwy::float16_t, D> dh;
    for (int v = 0; v < VN; v += 2) {
      const auto b = hn::PromoteTo(  // sign copies in bits 7–15
          d16, hn::LoadU(hn::Rebind<std::int8_t, decltype(d16)>(),
                         reinterpret_cast<const std::int8_t*>(p + v * N)));
      const auto h = hn::And(hn::ShiftLeft<7>(b), hn::Set(d16, static_cast<std::int16_t>(0xbf80)));
      bv[v] = hn::PromoteTo(d, hn::BitCast(dh, hn::LowerHalf(d16h, h)));
      bv[v + 1] = hn::PromoteTo(d, hn::BitCast(dh, hn::UpperHalf(d16h, h)));
    }
    return;
  }
#endif
#if HWY_TARGET == HWY_AVX2
  // The direct fp8 bits in AVX2's 3-vector blocks (decode_blocking-inl.h,
  // kThreeVectorSmallBlocks): their 12 accumulators, 3 B vectors and the broadcast take all 16
  // ymm registers, so the mask is ANDed from memory (a compiler keeps a loop-invariant constant
  // in a register and spills accumulators: 0.34 → 0.49 ms hot on AMD Zen 5). The same bits as
  // LoadB.
  if constexpr (std::is_same_v<TB, fp8_e4m3_direct_t> && VN == 3) {
    alignas(32) static constexpr std::int32_t kMask[8] = {
        static_cast<std::int32_t>(0x87f00000u), static_cast<std::int32_t>(0x87f00000u),
        static_cast<std::int32_t>(0x87f00000u), static_cast<std::int32_t>(0x87f00000u),
        static_cast<std::int32_t>(0x87f00000u), static_cast<std::int32_t>(0x87f00000u),
        static_cast<std::int32_t>(0x87f00000u), static_cast<std::int32_t>(0x87f00000u)};
    const hn::RebindToSigned<D> di;
    for (int v = 0; v < VN; ++v) {
      __m256i b = _mm256_slli_epi32(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + v * N))), 20);
      asm("vpand %1, %0, %0" : "+x"(b) : "m"(*reinterpret_cast<const __m256i*>(kMask)));
      bv[v] = hn::BitCast(d, hn::Vec<decltype(di)>{b});
    }
    return;
  }
#endif
  constexpr bool kQuad =
      std::is_same_v<TB, fp8_e4m3_quad_t> || std::is_same_v<TB, fp8_e4m3_quad_f16unit_t>;
  if constexpr (kQuad && kSplitBuilt && VN % 4 == 0) {
    const hn::Repartition<std::int16_t, D> d16;  // 2·Lanes words: 4·Lanes bytes
    const hn::Repartition<std::uint8_t, D> d8;   // bytes: no typed access to 1-byte aligned data
    const hn::RebindToSigned<D> di;
    const auto mask = hn::Set(di, static_cast<std::int32_t>(0x87f00000));
    for (int v = 0; v < VN; v += 4) {
      const auto w =
          hn::BitCast(d16, hn::LoadU(d8, reinterpret_cast<const std::uint8_t*>(p + v * N)));
      const auto odd = hn::BitCast(di, hn::ShiftRight<4>(w));  // bytes 4i + 1, 4i + 3
      const auto even = hn::BitCast(di, hn::ShiftRight<4>(hn::ShiftLeft<8>(w)));  // 4i, 4i + 2
      bv[v] = hn::BitCast(d, hn::And(hn::ShiftLeft<16>(even), mask));
      bv[v + 1] = hn::BitCast(d, hn::And(hn::ShiftLeft<16>(odd), mask));
      bv[v + 2] = hn::BitCast(d, hn::And(even, mask));
      bv[v + 3] = hn::BitCast(d, hn::And(odd, mask));
      if constexpr (std::is_same_v<TB, fp8_e4m3_quad_f16unit_t>) {
        const auto to_f16_unit = hn::Set(d, 0x1.0p112f);  // q · 2^−120 → q · 2^−8, exact
        for (int i = 0; i < 4; ++i) bv[v + i] = hn::Mul(bv[v + i], to_f16_unit);
      }
    }
    return;
  }
  if constexpr (std::is_same_v<TB, bf16_split_t> && kSplitBuilt && VN % 2 == 0) {
    const hn::RebindToUnsigned<D> du;
    const hn::Repartition<std::uint8_t, D> d8;  // bytes: no typed access to 2-byte aligned data
    const auto high = hn::Set(du, 0xffff0000u);
    for (int v = 0; v < VN; v += 2) {
      const auto w =
          hn::BitCast(du, hn::LoadU(d8, reinterpret_cast<const std::uint8_t*>(p + v * N)));
      bv[v] = hn::BitCast(d, hn::ShiftLeft<16>(w));  // columns x, x+2, …: the low halves
      bv[v + 1] = hn::BitCast(d, hn::And(w, high));  // columns x+1, x+3, …: the high halves
    }
    return;
  }
  for (int v = 0; v < VN; ++v) bv[v] = LoadB(d, p + v * N);
}

/// What LoadB (LoadQuadRow) returns is the stored q times this: 2^−8 for fp8 E4M3 (f16 bits),
/// 2^−120 for the direct fp8 widening, 2^24 for int8 quads (int8_quad_t, int8_x24_t), 1
/// otherwise.
template <class TB>
inline constexpr float kLoadBUnit =
    std::is_same_v<TB, fp8_e4m3_t> || std::is_same_v<TB, fp8_e4m3_quad_f16unit_t>  ? 0x1.0p-8f
    : std::is_same_v<TB, fp8_e4m3_direct_t> || std::is_same_v<TB, fp8_e4m3_quad_t> ? 0x1.0p-120f
    : std::is_same_v<TB, int8_quad_t> || std::is_same_v<TB, int8_x24_t>            ? 0x1.0p24f
                                                                                   : 1.0f;

// Widens n contiguous bf16/f16 activation elements (kernels::bf16_t / f16_t) to fp32 with the
// target's exact vector promotion (bf16: a shift; f16: F16C on x86, FCVTL on NEON), for the
// kernels' packing of K, V, Q and dO rows (PackRows / DenseRows / RowsOf, work_units.hpp).
struct VecWiden {
  template <class T>
  void operator()(const T* src, std::int64_t n, float* dst) const {  // a call, not inlined
    using HT = std::conditional_t<std::is_same_v<T, bf16_t>, hwy::bfloat16_t, hwy::float16_t>;
    const hn::ScalableTag<float> d;
    const hn::Rebind<HT, decltype(d)> dn;
    const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
    const HT* in = reinterpret_cast<const HT*>(src);
    std::int64_t x = 0;
    for (; x + N <= n; x += N) hn::StoreU(hn::PromoteTo(d, hn::LoadU(dn, in + x)), d, dst + x);
    for (; x < n; ++x) dst[x] = widen(src[x]);
  }
};

// kARow: A's row stride when the caller knows it at compile time (0: a_row, known at run time). A
// constant stride lets the R broadcasts of a k step share one base register (displacements);
// with a run-time one each row needs its own, and 8 rows with the decode prefetch pointers
// exceed the x86 general registers (the compiler parks pointers in vector registers).
template <int R, int VN = kV, std::int64_t kARow = 0, class TB = float, class D>
HWY_INLINE void MicroKernel(D d, const float* HWY_RESTRICT a, std::int64_t a_row, std::int64_t a_k,
                            const TB* HWY_RESTRICT b, std::int64_t ldb, std::int64_t K,
                            float* HWY_RESTRICT c, std::int64_t ldc, bool accumulate,
                            const float* HWY_RESTRICT c_scale, const TB* pf = nullptr,
                            PrefetchCursor* cursor = nullptr) {
  using V = hn::Vec<D>;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  if constexpr (kARow != 0) a_row = kARow;
  V acc[R][VN];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < VN; ++v)
      acc[r][v] = accumulate ? hn::LoadU(d, c + r * ldc + v * N) : hn::Zero(d);
  if (c_scale != nullptr) {  // C ← C · diag(c_scale) before accumulating (lane-wise rescale)
    for (int v = 0; v < VN; ++v) {
      const V sv = hn::LoadU(d, c_scale + v * N);
      for (int r = 0; r < R; ++r) acc[r][v] = hn::Mul(acc[r][v], sv);
    }
  }
  // Bytes of B read per k, in whole cache lines (the prefetch below covers them all).
  constexpr std::int64_t kLine = 64;
  const std::int64_t row_bytes = VN * N * static_cast<std::int64_t>(sizeof(TB));
  // With a cursor: about row_bytes / sharers of its range per k (the pace at which this block
  // reads B, shared among the blocks that advance the cursor in turn). A step shorter than a
  // line: the line holding the cursor, each k (so each line is asked for kLine / step times), not
  // one line every kLine / step k: that test of k's residue cost 12 % of a hot bf16 step on AVX2
  // (T_new = 1, AMD Zen 4; docs/performance.md, D-prefetch-4).
  const std::int64_t step =
      cursor != nullptr ? std::max<std::int64_t>(1, row_bytes / cursor->sharers) : row_bytes;
  const std::int64_t cur_lines = step >= kLine ? step / kLine : 1;         // lines per k
  const std::int64_t cur_step = step >= kLine ? cur_lines * kLine : step;  // bytes per k
  const std::uint8_t* cur = cursor != nullptr ? cursor->next : nullptr;
  const std::uint8_t* const cur_end = cursor != nullptr ? cursor->end : nullptr;
  const auto fma_row = [&](std::int64_t k, const V* bv) HWY_ATTR {
    const float* HWY_RESTRICT ak = a + k * a_k;  // A[·][k]
    for (int r = 0; r < R; ++r) {
      const V ar = hn::Set(d, ak[r * a_row]);
      for (int v = 0; v < VN; ++v) acc[r][v] = hn::MulAdd(ar, bv[v], acc[r][v]);
    }
  };
  const auto k_step = [&](std::int64_t k) HWY_ATTR {
    if constexpr (!kQuadLayout<TB>) {  // (the quad layouts: quad_step below)
      V bv[VN];
      LoadBRow<VN>(d, b + k * ldb, bv);
      fma_row(k, bv);
    }
  };
  const auto cursor_prefetch = [&]() HWY_ATTR {
    if (cur < cur_end) {
      for (std::int64_t i = 0; i < cur_lines; ++i) PrefetchStream(cur + i * kLine);
      cur += cur_step;
    }
  };
  const auto k_prefetch = [&](std::int64_t k) HWY_ATTR {
    if (pf != nullptr) {  // the same B row of a later tile of decode's stream (PrefetchStream)
      const auto* line = reinterpret_cast<const std::uint8_t*>(pf + k * ldb);
      for (std::int64_t o = 0; o < row_bytes; o += kLine) PrefetchStream(line + o);
    }
    cursor_prefetch();
  };
  if constexpr (kQuadLayout<TB>) {
    // B rows k = 4i .. 4i + 3 from quad row i (a pointer stepped by ldb per four k: no product
    // of k and ldb per k), byte j = k % 4 of each word (a compile-time shuffle control); the
    // prefetch of quad row i of pf a quarter per k.
    const TB* bq = b;
    const auto* pq = reinterpret_cast<const std::uint8_t*>(pf);
    const auto quad_step = [&](std::int64_t k, std::int64_t j) HWY_ATTR {
      if (pq != nullptr) {
        for (std::int64_t o = 0; o < row_bytes; o += kLine) PrefetchStream(pq + j * row_bytes + o);
      }
      cursor_prefetch();
      const TB* p = bq;
#if HWY_TARGET == HWY_AVX2
      // AVX2: the quad row loaded again for each k (the pointer made opaque), not kept in
      // registers for its four k: AVX2's 16 registers hold the 4 × 3 blocks' accumulators, and
      // the hoisted loads spilled them (1.17–1.2× the plain layout's time, hot and from DRAM,
      // with the path forced on an Intel Xeon; docs/performance.md, D-int8-4).
      asm volatile("" : "+r"(p));
#endif
      V bv[VN];
      LoadQuadRow<VN>(d, p, j, bv);
      fma_row(k, bv);
    };
    std::int64_t k = 0;
    for (; k + 4 <= K; k += 4) {
      for (std::int64_t j = 0; j < 4; ++j) quad_step(k + j, j);  // (unrolled: j a constant)
      bq += ldb;
      if (pq != nullptr) pq += ldb;
    }
    for (std::int64_t j = 0; k < K; ++k, ++j) quad_step(k, j);
    if (cursor != nullptr) cursor->next = cur;
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < VN; ++v) hn::StoreU(acc[r][v], d, c + r * ldc + v * N);
    return;
  }
  // Blocks of more than 6 rows (AVX-512's tall decode blocks, 7–12 rows × 2 vectors) with a
  // decode prefetch take k two at a time: the pointer and cursor bookkeeping and the prefetch's
  // branch once per two k, where they had been ≈ 14 scalar instructions next to 16–24 FMAs (the
  // same FMAs in the same order: the same bits). Intel Xeon (family 6 model 207), one thread,
  // T_k = 2048, median over alternated runs: f32 T_new = 4 0.85–0.88× the time, bf16 T_new = 2
  // 0.89–0.97×, f32 T_new = 8 0.96×; blocks of ≤ 6 rows measured level to 1.11× and are left
  // as they were (docs/performance.md, D-decode-7).
  std::int64_t k = 0;
  if constexpr (R >= 7) {
    if (pf != nullptr || cursor != nullptr) {
      for (; k + 2 <= K; k += 2) {
        k_prefetch(k);
        k_prefetch(k + 1);
        k_step(k);
        k_step(k + 1);
      }
    }
  }
  for (; k < K; ++k) {
    k_prefetch(k);
    k_step(k);
  }
  if (cursor != nullptr) cursor->next = cur;
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < VN; ++v) hn::StoreU(acc[r][v], d, c + r * ldc + v * N);
}

// C[rows][M] (+)= A B over any number of rows: blocks of R (default kR), then one remainder
// block. VN and TB as for MicroKernel. With accumulate and c_scale ([M] lane factors), C is
// first scaled lane-wise: C ← C · diag(c_scale) + A B (the online softmax's rescale of Õ,
// fused into the load of C). With pf, the first block's k loop also prefetches the B rows at
// pf (same ldb, same width): the decode kernel passes a later tile of its stream, so the
// memory reads overlap this tile's FMAs (the later blocks re-read B from cache: no prefetch).
// With cursor, the first block's k loop instead prefetches the cursor's range in address order,
// row_bytes / cursor->sharers of it per k, and advances it (the caller may pass the same cursor to
// the other row blocks of these columns too: ColumnBlocks).
// kARow as for MicroKernel (then a_row must equal it).
template <int R = kR, int VN = kV, bool kTop = true, std::int64_t kARow = 0, class TB = float,
          class D>
HWY_INLINE void GemmRows(D d, std::int64_t rows, const float* a, std::int64_t a_row,
                         std::int64_t a_k, const TB* b, std::int64_t ldb, std::int64_t K, float* c,
                         std::int64_t ldc, bool accumulate, const float* c_scale = nullptr,
                         const TB* pf = nullptr, PrefetchCursor* cursor = nullptr) {
  if constexpr (kTop) {
    for (; rows >= R; rows -= R, a += R * a_row, c += R * ldc, pf = nullptr, cursor = nullptr) {
      MicroKernel<R, VN, kARow>(d, a, a_row, a_k, b, ldb, K, c, ldc, accumulate, c_scale, pf,
                                cursor);
    }
  }
  if constexpr (R > 1) {
    if (rows == R - 1) {
      MicroKernel<R - 1, VN, kARow>(d, a, a_row, a_k, b, ldb, K, c, ldc, accumulate, c_scale, pf,
                                    cursor);
    } else {
      GemmRows<R - 1, VN, false, kARow>(d, rows, a, a_row, a_k, b, ldb, K, c, ldc, accumulate,
                                        c_scale, pf, cursor);
    }
  }
}

}  // namespace tokenmix::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard toggle
