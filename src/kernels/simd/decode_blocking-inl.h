// src/kernels/simd/decode_blocking-inl.h — the per-target tuning of the decode products (Highway):
// register blocking (kRD × kVD regular, kRT × kVT tall), V sub-tiles, the prefetch distance and
// order (same position or the linear cursor), and the column / k-chunk shapes ColumnBlocks uses.
// Compile-time constants only; each is keyed on the target and, where measured so, on the element
// type a product reads (never on a reader: a new cache dtype takes the defaults).
//
// Highway "-inl" header: included once per target from a foreach_target translation unit.
#if defined(TOKENMIX_KERNELS_SIMD_DECODE_BLOCKING_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TOKENMIX_KERNELS_SIMD_DECODE_BLOCKING_INL_H_
#undef TOKENMIX_KERNELS_SIMD_DECODE_BLOCKING_INL_H_
#else
#define TOKENMIX_KERNELS_SIMD_DECODE_BLOCKING_INL_H_
#endif

#include <cstdint>
#include <type_traits>

#include "hwy/highway.h"
#include "kernels/attention_kernels.hpp"
#include "kernels/kv_element.hpp"
#include "kernels/simd/microkernel-inl.h"

HWY_BEFORE_NAMESPACE();
namespace tokenmix::kernels::HWY_NAMESPACE {

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

}  // namespace tokenmix::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard (per target)
