// src/kernels/simd/amx_decode.cpp — decode's per-tile products over an int8, fp8 or bf16 cache on
// AMX tiles (amx_decode.hpp: the planes, their exactness and the column order). The file is
// compiled for the x86-64 baseline; every function after the includes carries the AMX and
// AVX-512 target (HWY_PUSH_ATTRIBUTES: docs/design.md, "ISA confinement"), and is called only
// from the AVX-512 decode kernel where CpuFeatures::amx_int8 (int8 cache) or amx_bf16 (fp8,
// bf16 cache) holds. Nothing here is initialized dynamically: the fp8 tables are constexpr.
//
// Tiles (one configuration, palette 1, every tile 16 rows × 64 bytes):
//   tmm0–tmm3  C: 16 rows × 16 int32 / fp32 columns (four column blocks of a product)
//   int8: tmm4     A of S: rows 4p + i = plane p of query row 4·rb + i, 64 features of a chunk
//         tmm5     A of Õ: rows 4p + i = plane p of P row 4·rb + i (rows 12–15 zero), 64 keys
//         tmm6, 7  B: 16 byte-quad rows × 16 columns × 4 bytes
//   fp8, bf16: tmm4–6   A, plane p in tmm(4 + p): 16 query rows 16·rb + i × 32 features of a chunk
//                  (S), or 16 P rows × 32 keys of a half (Õ), as bf16 pairs; the three planes'
//                  products add up in the same C tile (fewer products and tile loads than
//                  int8's rows of planes: the bf16 products go at half the int8 ones' rate)
//         tmm7     B: 16 bf16-pair rows × 16 columns × 2 × 2 bytes
// B operands:
//   int8  the cache's tiles as they are (kv_tile_layout.hpp: VNNI-4 quads, no rewrite): K
//         [dh/4][64][4] → B tile b of chunk c = quad rows 16c .. 16c + 15 of keys 16b .. 16b + 15
//         (rows 256 bytes apart); V [16][dh][4] → B tile b of chunk c = features 64c + 16b ..
//         + 15 of the 16 key quads (rows 4·dh bytes apart). Columns in order.
// fp8 and bf16 B operands are built per cache tile in this thread's buffers:
//   fp8   K [dh][64] → kb[c][b][i][16 × 4]: quad i of chunk c (features 64c + 4i ..+3) for the
//         keys 16L + 4b + j (L, j < 4) of column 4L + j of block b, and V [64][dh] →
//         vb[c][b][i][16 × 4]: keys 4i ..+3 for the features 64c + 16L + 4b + j of column 4L + j
//         of block b (feature block f = 4c + b), each byte row widened to two (the bf16 value's
//         low and high bytes) and one pair of rows in each B row:
//         K → kb[c][b][i][16 × 2 × 2]: features 32c + 2i, 32c + 2i + 1 (chunks of 32 features);
//         V → vb[h][c][b][i][16 × 2 × 2]: keys 32h + 2i, 32h + 2i + 1 (halves of 32 keys).
// Two byte and two word interleaves of 4 rows give exactly this order (they work within 128-bit
// lanes), 8 shuffles per 256 bytes.
//   bf16  the same tiles of row pairs, from two stored rows by one word interleave per 64 bytes
//         (4 shuffles per 256 bytes): B tile 2z + h of a 64-column chunk holds in column 4l + j
//         the pair of column 32z + 8l + 4h + j (z, h < 2; l, j < 4), a permutation within each
//         32-column group (pairs_in_order puts it back).
#include "kernels/simd/amx_decode.hpp"

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "hwy/base.h"  // HWY_PUSH_ATTRIBUTES

// Every function defined from here to HWY_POP_ATTRIBUTES is compiled for AMX + AVX-512; the
// headers above (the STL's templates included) keep the baseline.
HWY_PUSH_ATTRIBUTES(
    "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,amx-tile,amx-int8,amx-bf16")

namespace tokenmix::kernels::amx {
namespace {

constexpr int kArchReqXcompPerm = 0x1023;  // arch_prctl: request an XSAVE feature
constexpr int kXfeatureXtiledata = 18;     // the AMX tile data state component
constexpr std::int64_t kKeys = 64;         // keys per cache tile (KVTileLayout::kKeyTile)
constexpr std::int64_t kRowsMax = 128;     // rows of a decode unit (decode.cpp kMaxRows)
constexpr std::int64_t kDhMax = 256;       // head_dim_supported
constexpr std::int64_t kTileBytes = 1024;  // 16 rows × 64 bytes

struct alignas(64) TileConfig {
  std::uint8_t palette = 1, start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

// Features per chunk of an A row of S (a tile row: 64 bytes of the element's operand type).
constexpr std::int64_t chunk_features(Element e) {
  return e == Element::int8 ? 64 : 32;
}

// The A operands' rows are scaled so that their largest |element| lies in [2^(top − 1), 2^top):
// int8 [32, 64) (a₀ ∈ [−64, 64]), fp8 [1, 2), bf16 [2^40, 2^41) (see amx_decode.hpp).
constexpr int a_top(Element e) {
  return e == Element::int8 ? 6 : e == Element::fp8_e4m3 ? 1 : 41;
}

// This thread's operands (64-byte aligned views into one allocation), sized for the widest
// element (fp8: bf16 operands, twice the bytes of int8's).
struct Workspace {
  static constexpr std::size_t kQaBytes = kRowsMax / 4 * (kDhMax / 32) * kTileBytes;
  static constexpr std::size_t kPaBytes = 2 * 3 * kTileBytes;
  static constexpr std::size_t kBBytes = 2 * kDhMax * kKeys;  // a K or a V tile as B tiles
  std::vector<std::uint8_t> storage;
  std::uint8_t* qa = nullptr;   // the query planes (A of S): int8 [row blocks][chunks][16][64],
                                // fp8 [row blocks of 16][chunks][planes][16][64]
  std::uint8_t* pa = nullptr;   // one row block's P planes (A of Õ): int8 [16][64], fp8
                                // [halves][planes][16][64]
  std::uint8_t* kb = nullptr;   // the K tile as B tiles
  std::uint8_t* vb = nullptr;   // the V tile as B tiles
  std::int32_t* cb = nullptr;   // [4][16][16]: C tiles stored (int32 or fp32 bits)
  float q_unit[kRowsMax] = {};  // 2^−s_r of each query row
  Element element = Element::int8;
  std::int64_t n = 0, dh = 0;
  const std::uint8_t *pf_next = nullptr, *pf_end = nullptr;  // the pair ahead, not yet asked for
  unsigned wakes = 0;                                        // keep_awake's turn of C tiles

  Workspace() {
    storage.resize(kQaBytes + kPaBytes + 2 * kBBytes + 4 * kTileBytes + 64);
    auto* p = storage.data();
    p += (64 - reinterpret_cast<std::uintptr_t>(p) % 64) % 64;
    qa = p, p += kQaBytes;
    pa = p, p += kPaBytes;
    kb = p, p += kBBytes;
    vb = p, p += kBBytes;
    cb = reinterpret_cast<std::int32_t*>(p);
  }
};

// This thread's workspace: owned by a thread_local (freed when the thread ends), reached through
// one pointer of initial-exec TLS (no __tls_get_addr call per use: 7 % of a hot step's samples
// with a plain thread_local object).
__attribute__((tls_model("initial-exec"))) thread_local Workspace* tl_workspace = nullptr;
Workspace& workspace() {
  if (tl_workspace == nullptr) {
    thread_local std::unique_ptr<Workspace> owner = std::make_unique<Workspace>();
    tl_workspace = owner.get();
  }
  return *tl_workspace;
}

// 2^k for k ∈ [−126, 127] (a normal fp32 number), from its bits.
constexpr float pow2(int k) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(k + 127) << 23);
}
// e with x ∈ [2^(e−1), 2^e) for a normal positive x, from its bits.
inline int exponent_of(float x) {
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return static_cast<int>(bits >> 23) - 126;
}

// fp8 E4M3 (sign, 4 exponent bits with bias 7, 3 mantissa bits) code c without its sign → its
// value times 2^−8 (the decode kernel's unit): 2^(e−15)·(1 + m/8) for e ≥ 1, m·2^−17 for e = 0
// (as kv_element.hpp's e4m3_to_f32, here so that no inline function of another header is
// compiled for AMX in this file). Every such value has at most 4 significant bits and is ≥ 2^−17:
// a normal bf16 number, whose bits are the top half of the fp32 ones.
constexpr float e4m3_unit_value(unsigned c) {
  const unsigned e = (c >> 3) & 0xfu, m = c & 7u;
  return e == 0 ? static_cast<float>(m) * 0x1p-17f
                : pow2(static_cast<int>(e) - 15) * (1.0f + m / 8.0f);
}

// The low and high bytes of those bf16 bits, for the 128 codes without a sign bit.
// Computed by the compiler (constexpr): a dynamic initializer here would run at load time on
// every CPU, compiled for AVX-512.
struct Fp8Tables {
  alignas(64) std::uint8_t lo[128] = {}, hi[128] = {};
  constexpr Fp8Tables() {
    for (unsigned c = 0; c < 128; ++c) {
      const auto bits = std::bit_cast<std::uint32_t>(e4m3_unit_value(c));
      lo[c] = static_cast<std::uint8_t>(bits >> 16), hi[c] = static_cast<std::uint8_t>(bits >> 24);
    }
  }
};
constexpr Fp8Tables kFp8Tables;

// 64 fp8 codes → the low and high bytes of their bf16 values (two byte permutes over the 128-entry
// tables, held in registers for a tile's rewrite; VPERMI2B reads bits 0–6 of each code, the sign
// is or-ed into the high byte).
// (The constructors here are written out: an implicit one would not carry the target.)
struct Fp8Widen {
  __m512i lo0, lo1, hi0, hi1, sign;
  Fp8Widen()
      : lo0(_mm512_load_si512(kFp8Tables.lo)),
        lo1(_mm512_load_si512(kFp8Tables.lo + 64)),
        hi0(_mm512_load_si512(kFp8Tables.hi)),
        hi1(_mm512_load_si512(kFp8Tables.hi + 64)),
        sign(_mm512_set1_epi8(static_cast<char>(0x80))) {}
  void operator()(__m512i codes, __m512i& lo, __m512i& hi) const {
    lo = _mm512_permutex2var_epi8(lo0, codes, lo1);
    hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, codes, hi1), codes, sign,
                                   0xf8);  // a | (b & c)
  }
};

// Four byte rows r_j → four B rows z_b (see the file comment): z_b[16L + 4j' + j] = r_j[16L + 4b
// + j'], at out + b · out_step.
inline void interleave4(__m512i r0, __m512i r1, __m512i r2, __m512i r3, std::uint8_t* out,
                        std::int64_t out_step) {
  const __m512i t0 = _mm512_unpacklo_epi8(r0, r1), t1 = _mm512_unpackhi_epi8(r0, r1),
                t2 = _mm512_unpacklo_epi8(r2, r3), t3 = _mm512_unpackhi_epi8(r2, r3);
  _mm512_store_si512(out, _mm512_unpacklo_epi16(t0, t2));
  _mm512_store_si512(out + out_step, _mm512_unpackhi_epi16(t0, t2));
  _mm512_store_si512(out + 2 * out_step, _mm512_unpacklo_epi16(t1, t3));
  _mm512_store_si512(out + 3 * out_step, _mm512_unpackhi_epi16(t1, t3));
}

// fp8: rows base and base + stride (either as zeros where `live` says so) → B rows of bf16 pairs.
inline void rewrite_fp8(const Fp8Widen& widen, const std::uint8_t* base, std::int64_t stride,
                        bool live0, bool live1, std::uint8_t* out) {
  __m512i lo0, hi0, lo1, hi1;
  widen(live0 ? _mm512_loadu_si512(base) : _mm512_setzero_si512(), lo0, hi0);
  widen(live1 ? _mm512_loadu_si512(base + stride) : _mm512_setzero_si512(), lo1, hi1);
  interleave4(lo0, hi0, lo1, hi1, out, 16 * 64);
}

// bf16: row 0's and row 1's 32 values (a, b) → the B rows of their columns 8l + j (at out) and
// 8l + 4 + j (at out + out_step), l, j < 4: one word interleave each.
inline void rewrite_bf16(__m512i a, __m512i b, std::uint8_t* out, std::int64_t out_step) {
  _mm512_store_si512(out, _mm512_unpacklo_epi16(a, b));
  _mm512_store_si512(out + out_step, _mm512_unpackhi_epi16(a, b));
}

// What the bf16 rewrites saw, for the fallbacks (amx_decode.hpp): the largest |v| bits (sign
// cleared) and the smallest of those bits minus 1 (0 wraps to 0xffff: zeros pass), per lane.
struct Bf16Scan {
  __m512i top, low;
  const __m512i magnitude, one;
  Bf16Scan()
      : top(_mm512_setzero_si512()),
        low(_mm512_set1_epi16(-1)),
        magnitude(_mm512_set1_epi16(0x7fff)),
        one(_mm512_set1_epi16(1)) {}
  // K: only the top is checked (a subnormal key is read as 0 within the stated error).
  void top_of(__m512i v) { top = _mm512_max_epu16(top, _mm512_and_si512(v, magnitude)); }
  void both_of(__m512i v) {
    const __m512i x = _mm512_and_si512(v, magnitude);
    top = _mm512_max_epu16(top, x);
    low = _mm512_min_epu16(low, _mm512_sub_epi16(x, one));
  }
  // |v| ≥ 2^64 (bits ≥ 0x5f80: exponent field ≥ 191), ±∞ or NaN seen.
  bool huge() const { return _mm512_cmpge_epu16_mask(top, _mm512_set1_epi16(0x5f80)) != 0; }
  // That, or a subnormal (bits 1 .. 0x7f).
  bool outside() const {
    return huge() || _mm512_cmplt_epu16_mask(low, _mm512_set1_epi16(0x7f)) != 0;
  }
};

// bf16 products' columns (B tiles 2z and 2z + 1 of a chunk: C tiles t0, t1 hold columns 8l + j
// and 8l + 4 + j of block l) → the 32-column group's columns 0–15 (lo) and 16–31 (hi) in order.
inline void pairs_in_order(__m512 t0, __m512 t1, __m512& lo, __m512& hi) {
  const __m512i take_lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i take_hi =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  lo = _mm512_permutex2var_ps(t0, take_lo, t1);
  hi = _mm512_permutex2var_ps(t0, take_hi, t1);
}

// A bf16 value from its bits.
inline float bf16_value(std::uint16_t bits) {
  const std::uint32_t wide = static_cast<std::uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

// The tile pair ahead is prefetched into L2 by a cursor that every phase of a tile's work
// advances (scores: per K rewrite step and per query row; keep_awake: per softmax row; values: per
// P row, per V rewrite step and per query row of the combine), so the requests are spread over
// the whole tile, as the FMA kernel's are. Asked for in a burst during the rewrites instead, the
// int8 step took 3.4 ms against 2.8–2.9 spread (T_k = 32768, T_new = 1, two threads;
// docs/performance.md, D-amx-4). Lines per call of each phase (int8: ≈ 230 of a
// pair's 264 at d_h = 128 and 4 rows; values() asks for the rest at its end):
constexpr std::int64_t kPfPerKStep = 1, kPfPerRow = 4, kPfPerSoftmaxRow = 16, kPfPerVStep = 2;

// int8: units of more rows than this (more than one 4-row block, each loading every B tile of the
// pair) copy the cache's quads to contiguous B tiles first (64-byte copies, no shuffles), as the
// tile loads with the cache's row strides (256 and 4·d_h bytes) measured slower when repeated:
// Intel Xeon (family 6 model 207), T_k = 2048, one thread, median of alternated runs, T_new = 4
// and 16 at 0.95× the time of direct loads, T_new = 1 level (docs/performance.md,
// D-amx-8). A unit of one block loads the cache's tiles as they are.
constexpr std::int64_t kInt8CopyRows = 4;

// The next `lines` lines of the pair ahead into L2 (as many as are left).
inline void pf_take(Workspace& w, std::int64_t lines) {
  for (; lines > 0 && w.pf_next < w.pf_end; --lines, w.pf_next += 64)
    _mm_prefetch(reinterpret_cast<const char*>(w.pf_next), _MM_HINT_T1);
}

// A product into one of the dead C tiles (of the A and B tiles last loaded: an integer product
// of whatever bytes they hold, for either element), the four in turn (no chain of dependent
// products), to keep the tile unit busy: after ≈ 120 ns of vector work without a product, the
// next product waited ≈ 300–400 ns on an Intel Xeon (family 6 model 207); one every ≈ 60 ns of
// vector work keeps it awake (TILEZERO and TILELOADD do not). Called every 8 rewrite steps, per
// softmax row and per P row: int8, T_k = 32768, T_new = 1, two threads, 4.0 → 3.4 ms
// (docs/performance.md, D-amx-4).
inline void wake(Workspace& w) {
  switch (w.wakes++ & 3) {
    case 0:
      _tile_dpbssd(0, 4, 6);
      break;
    case 1:
      _tile_dpbssd(1, 4, 6);
      break;
    case 2:
      _tile_dpbssd(2, 4, 6);
      break;
    default:
      _tile_dpbssd(3, 4, 6);
      break;
  }
}

// The 4 × 4 transpose of 128-bit blocks: w_L block b = v_b block L.
inline void transpose_blocks(__m512& v0, __m512& v1, __m512& v2, __m512& v3) {
  const __m512 t0 = _mm512_shuffle_f32x4(v0, v1, 0x44), t1 = _mm512_shuffle_f32x4(v0, v1, 0xee),
               t2 = _mm512_shuffle_f32x4(v2, v3, 0x44), t3 = _mm512_shuffle_f32x4(v2, v3, 0xee);
  v0 = _mm512_shuffle_f32x4(t0, t2, 0x88), v1 = _mm512_shuffle_f32x4(t0, t2, 0xdd);
  v2 = _mm512_shuffle_f32x4(t1, t3, 0x88), v3 = _mm512_shuffle_f32x4(t1, t3, 0xdd);
}

inline __m512 cvt(const std::int32_t* c) {
  return _mm512_cvtepi32_ps(_mm512_load_si512(c));
}
inline __m512 fp32(const std::int32_t* c) {
  return _mm512_castsi512_ps(_mm512_load_si512(c));
}

// C tiles 0–3 → cb[b][16][16].
inline void store_c(std::int32_t* cb) {
  _tile_stored(0, cb, 64);
  _tile_stored(1, cb + 256, 64);
  _tile_stored(2, cb + 512, 64);
  _tile_stored(3, cb + 768, 64);
}

inline void zero_c() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// int8: C_b += A · B_b (A in tile a_tile, loaded; B_b the four B tiles of the cache's quads, B
// tile b at b0 + b · b_step, its rows ld bytes apart, into tmm6 and tmm7 in turn, so that a load
// need not wait for the last product), with dp the signed (_tile_dpbssd: query planes) or
// unsigned (_tile_dpbusd: P planes) product. A macro: the tile intrinsics take their tile numbers
// as literal tokens.
#define TOKENMIX_AMX_INT8_PRODUCTS_STRIDED(dp, a_tile, b0, b_step, ld) \
  do {                                                                 \
    _tile_loadd(6, (b0), (ld));                                        \
    _tile_loadd(7, (b0) + (b_step), (ld));                             \
    dp(0, a_tile, 6);                                                  \
    dp(1, a_tile, 7);                                                  \
    _tile_loadd(6, (b0) + 2 * (b_step), (ld));                         \
    _tile_loadd(7, (b0) + 3 * (b_step), (ld));                         \
    dp(2, a_tile, 6);                                                  \
    dp(3, a_tile, 7);                                                  \
  } while (false)

// fp8: C_b += Σ_p A_p · B_b for the three bf16 planes A_p from a (1 KiB apart, into tmm4–6) and
// the four B tiles from b, each B tile's products the planes low to high.
inline void bf16_plane_products(const std::uint8_t* a, const std::uint8_t* b) {
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a + kTileBytes, 64);
  _tile_loadd(6, a + 2 * kTileBytes, 64);
  _tile_loadd(7, b, 64);
  _tile_dpbf16ps(0, 6, 7);
  _tile_dpbf16ps(0, 5, 7);
  _tile_dpbf16ps(0, 4, 7);
  _tile_loadd(7, b + kTileBytes, 64);
  _tile_dpbf16ps(1, 6, 7);
  _tile_dpbf16ps(1, 5, 7);
  _tile_dpbf16ps(1, 4, 7);
  _tile_loadd(7, b + 2 * kTileBytes, 64);
  _tile_dpbf16ps(2, 6, 7);
  _tile_dpbf16ps(2, 5, 7);
  _tile_dpbf16ps(2, 4, 7);
  _tile_loadd(7, b + 3 * kTileBytes, 64);
  _tile_dpbf16ps(3, 6, 7);
  _tile_dpbf16ps(3, 5, 7);
  _tile_dpbf16ps(3, 4, 7);
}

// The three bf16 planes of t (16 fp32), each the rounded rest of the one before, as 32 bytes at
// a, a + plane_step, a + 2 · plane_step.
inline void bf16_planes(__m512 t, std::uint8_t* a, std::int64_t plane_step) {
  for (int p = 0; p < 3; ++p) {
    const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(t));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + p * plane_step), h);
    t = _mm512_sub_ps(t, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
}

// One P row's 64 weights (keys ≥ nt read as 0) into pv and its largest into m; false where a
// weight is NaN or ±∞.
inline bool load_p_row(const float* pr, const __mmask16 in_tile[4], __m512 pv[4], float& m) {
  __m512 mx = _mm512_setzero_ps();
  for (int L = 0; L < 4; ++L) {
    pv[L] = _mm512_maskz_loadu_ps(in_tile[L], pr + 16 * L);
    mx = _mm512_max_ps(mx, pv[L]);  // NaN lanes: caught by the check below
  }
  m = _mm512_reduce_max_ps(mx);
  bool finite = std::isfinite(m);
  for (int L = 0; L < 4; ++L)
    finite = finite && _mm512_cmp_ps_mask(pv[L], pv[L], _CMP_UNORD_Q) == 0 &&
             _mm512_cmp_ps_mask(_mm512_abs_ps(pv[L]), _mm512_set1_ps(INFINITY), _CMP_EQ_OQ) == 0;
  return finite;
}

// For a weight row's largest m > 0 (finite, maybe subnormal): m · 2^t ∈ [2^(top − 1), 2^top)
// for t = top − e(m); 2^t as two exact factors (up1, up2; t ≤ 158) and 2^−t likewise (unit,
// unit2).
inline void row_scale(float m, int top, __m512& up1, __m512& up2, float& unit, float& unit2) {
  int e = 0;
  if (m >= 0x1p-126f) {
    e = exponent_of(m);  // m ∈ [2^(e−1), 2^e)
  } else {
    std::frexp(m, &e);
  }
  const int t = top - e;
  const int t1 = std::clamp(t, -126, 100);
  up1 = _mm512_set1_ps(pow2(t1)), up2 = _mm512_set1_ps(pow2(t - t1));
  const int d1 = std::clamp(-t, -126, 100);
  unit = pow2(d1), unit2 = pow2(-t - d1);
}

// The column of feature x within its 64-column group in the permuted order (see the file
// comment): feature 64c + 16L + 4b + j sits at 64c + 16b + 4L + j.
inline std::int64_t permuted_column(std::int64_t x) {
  const std::int64_t f = x % 64;
  return x - f + 16 * (f / 4 % 4) + 4 * (f / 16) + f % 4;
}
// The same for bf16's order: feature 32z + 8l + 4h + j sits at 32z + 16h + 4l + j.
inline std::int64_t permuted_column_bf16(std::int64_t x) {
  const std::int64_t f = x % 32;
  return x - f + 16 * (f / 4 % 2) + 4 * (f / 8) + f % 4;
}

// The int8 and fp8 halves of scores() and values() (the public functions dispatch on the
// workspace's element).
void scores_int8(Workspace& w, const std::int8_t* k_tile, float* s) {
  const std::int64_t dh = w.dh, n = w.n, chunks = dh / 64;
  // The K tile's quads are the B tiles (kv_tile_layout.hpp: [d_h/4][64 keys][4]): B tile b of
  // chunk c holds quad rows 16c .. 16c + 15 of keys 16b .. 16b + 15, 256 bytes from row to row.
  // The pair ahead is prefetched by a cursor over the whole tile's work.
  // A unit of more than one row block first copies them to contiguous B tiles in w.kb (see
  // kInt8CopyRows).
  const auto* kq = reinterpret_cast<const std::uint8_t*>(k_tile);
  const bool copy = n > kInt8CopyRows;
  if (copy) {
    for (std::int64_t i = 0; i < dh / 4; ++i) {  // quad row i → B tiles of chunk i / 16, row i % 16
      if (i % 8 == 0) wake(w);
      pf_take(w, kPfPerKStep);
      const std::uint8_t* r = kq + i * 4 * kKeys;
      std::uint8_t* out = w.kb + ((i / 16) * 4 * 16 + i % 16) * 64;
      for (int b = 0; b < 4; ++b) {
        _mm512_store_si512(out + b * kTileBytes, _mm512_loadu_si512(r + 64 * b));
      }
    }
  }
  const __m512 step = _mm512_set1_ps(0x1p-7f);
  for (std::int64_t rb = 0; rb * 4 < n; ++rb) {
    zero_c();
    for (std::int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(4, w.qa + (rb * chunks + c) * kTileBytes, 64);
      if (copy) {
        TOKENMIX_AMX_INT8_PRODUCTS_STRIDED(_tile_dpbssd, 4, w.kb + c * 4 * kTileBytes, kTileBytes,
                                           64);
      } else {
        pf_take(w, 16 * kPfPerKStep);
        TOKENMIX_AMX_INT8_PRODUCTS_STRIDED(_tile_dpbssd, 4, kq + c * 16 * 4 * kKeys, 64, 4 * kKeys);
      }
    }
    store_c(w.cb);
    for (std::int64_t i = 0; i < 4 && rb * 4 + i < n; ++i) {
      pf_take(w, kPfPerRow);
      const std::int64_t r = rb * 4 + i;
      const __m512 unit = _mm512_set1_ps(w.q_unit[r]);
      for (int b = 0; b < 4; ++b) {  // ((C₃ 2^−7 + C₂) 2^−7 + C₁) 2^−7 + C₀, then · 2^−s_r
        const std::int32_t* c = w.cb + b * 256 + i * 16;
        __m512 t = _mm512_fmadd_ps(cvt(c + 12 * 16), step, cvt(c + 8 * 16));
        t = _mm512_fmadd_ps(t, step, cvt(c + 4 * 16));
        _mm512_storeu_ps(s + r * kKeys + 16 * b,  // keys 16b .. 16b + 15, in order
                         _mm512_mul_ps(_mm512_fmadd_ps(t, step, cvt(c)), unit));
      }
    }
  }
}

// fp8 and bf16: the S products of the query planes with the B tiles in w.kb, each row's C
// tiles (scaled back by 2^−s_r) written to S in key order by put_row(v[4], s_row).
template <class PutRow>
void bf16_scores_products(Workspace& w, float* s, PutRow put_row) {
  const std::int64_t n = w.n, chunks = w.dh / 32;
  for (std::int64_t rb = 0; rb * 16 < n; ++rb) {
    zero_c();
    for (std::int64_t c = 0; c < chunks; ++c) {
      bf16_plane_products(w.qa + (rb * chunks + c) * 3 * kTileBytes, w.kb + c * 4 * kTileBytes);
    }
    store_c(w.cb);
    for (std::int64_t i = 0; i < 16 && rb * 16 + i < n; ++i) {
      pf_take(w, kPfPerRow);
      const std::int64_t r = rb * 16 + i;
      const __m512 unit = _mm512_set1_ps(w.q_unit[r]);
      __m512 v[4];
      for (int b = 0; b < 4; ++b) v[b] = _mm512_mul_ps(fp32(w.cb + b * 256 + i * 16), unit);
      put_row(v, s + r * kKeys);
    }
  }
}

void scores_fp8(Workspace& w, const std::uint8_t* k_tile, float* s) {
  const Fp8Widen widen;
  for (std::int64_t i = 0; i < w.dh / 2; ++i) {
    if (i % 8 == 0) wake(w);
    pf_take(w, kPfPerKStep);
    rewrite_fp8(widen, k_tile + 2 * i * kKeys, kKeys, true, true,
                w.kb + ((i / 16) * 4 * 16 + i % 16) * 64);
  }
  bf16_scores_products(w, s, [](__m512 v[4], float* s_row) {
    transpose_blocks(v[0], v[1], v[2], v[3]);  // keys 16L .. 16L + 15 in v[L]
    for (int L = 0; L < 4; ++L) _mm512_storeu_ps(s_row + 16 * L, v[L]);
  });
}

// bf16: keys ≥ nt read as 0 (not loaded); false before any product where a key < nt is too large
// for the tiles (Bf16Scan::huge).
bool scores_bf16(Workspace& w, const std::uint16_t* k_tile, std::int64_t nt, float* s) {
  const auto keys_from = [nt](std::int64_t k0) {  // the lanes of keys k0 .. k0 + 31 below nt
    const std::int64_t keys = std::clamp<std::int64_t>(nt - k0, 0, 32);
    return static_cast<__mmask32>(keys == 32 ? ~0u : (1u << keys) - 1);
  };
  const __mmask32 half0 = keys_from(0), half1 = keys_from(32);
  Bf16Scan scan;
  for (std::int64_t i = 0; i < w.dh / 2; ++i) {  // features 2i, 2i + 1
    if (i % 8 == 0) wake(w);
    pf_take(w, kPfPerKStep);
    const std::uint16_t* r = k_tile + 2 * i * kKeys;
    const __m512i a0 = _mm512_maskz_loadu_epi16(half0, r),
                  b0 = _mm512_maskz_loadu_epi16(half1, r + 32),
                  a1 = _mm512_maskz_loadu_epi16(half0, r + kKeys),
                  b1 = _mm512_maskz_loadu_epi16(half1, r + kKeys + 32);
    scan.top_of(a0), scan.top_of(b0), scan.top_of(a1), scan.top_of(b1);
    std::uint8_t* out = w.kb + ((i / 16) * 4 * 16 + i % 16) * 64;
    rewrite_bf16(a0, a1, out, 16 * 64);                // keys 0–31: B tiles 0, 1
    rewrite_bf16(b0, b1, out + 2 * 16 * 64, 16 * 64);  // keys 32–63: B tiles 2, 3
  }
  if (scan.huge()) return false;
  bf16_scores_products(w, s, [](__m512 v[4], float* s_row) {
    __m512 lo, hi;
    pairs_in_order(v[0], v[1], lo, hi);
    _mm512_storeu_ps(s_row, lo), _mm512_storeu_ps(s_row + 16, hi);
    pairs_in_order(v[2], v[3], lo, hi);
    _mm512_storeu_ps(s_row + 32, lo), _mm512_storeu_ps(s_row + 48, hi);
  });
  return true;
}

// A row whose weights hold a NaN or ±∞: Σ_u P[u]·V[u][x] as a plain loop (keys < nt), into the
// permuted columns.
// (Keys [lo, hi); Column: the element's permuted column of a feature.)
template <class T, class Widen, class Column>
void values_scalar_row(const float* pr, std::int64_t lo, std::int64_t hi, const T* v_tile,
                       std::int64_t dh, float* o, Widen widen, Column column) {
  for (std::int64_t u = lo; u < hi; ++u)
    for (std::int64_t x = 0; x < dh; ++x) o[column(x)] += pr[u] * widen(v_tile[u * dh + x]);
}

void values_int8(Workspace& w, const float* p, std::int64_t nt, const std::uint8_t* v_tile,
                 float* acc, const __mmask16 in_tile[4]) {
  const std::int64_t dh = w.dh, n = w.n, chunks = dh / 64;
  // The V tile's quads are the B tiles (kv_tile_layout.hpp: [16 key quads][d_h][4]): B tile b of
  // chunk c holds features 64c + 16b .. + 15 of the 16 key quads, 4·d_h bytes from row to row;
  // copied to contiguous B tiles in w.vb first by a unit of more than one row block.
  const bool copy = n > kInt8CopyRows;
  if (copy) {
    for (std::int64_t i = 0; i < 16; ++i)
      for (std::int64_t c = 0; c < chunks; ++c) {
        if ((i * chunks + c) % 8 == 0) wake(w);
        pf_take(w, kPfPerVStep);
        const std::uint8_t* r = v_tile + i * 4 * dh + 4 * 64 * c;
        std::uint8_t* out = w.vb + (c * 4 * 16 + i) * 64;
        for (int b = 0; b < 4; ++b) {
          _mm512_store_si512(out + b * kTileBytes, _mm512_loadu_si512(r + 64 * b));
        }
      }
  }
  const __m512 step = _mm512_set1_ps(0x1p-8f), byte = _mm512_set1_ps(256.0f);
  float unit[4] = {}, unit2[4] = {};
  for (std::int64_t rb = 0; rb * 4 < n; ++rb) {
    const std::int64_t rows = std::min<std::int64_t>(4, n - rb * 4);
    std::memset(w.pa, 0, kTileBytes);
    bool scalar_row[4] = {};
    for (std::int64_t i = 0; i < rows; ++i) {
      wake(w);
      pf_take(w, kPfPerRow);
      __m512 pv[4], up1, up2;
      float m = 0.0f;
      if (!load_p_row(p + (rb * 4 + i) * kKeys, in_tile, pv, m)) {
        scalar_row[i] = true;
        continue;
      }
      if (m == 0.0f) continue;                       // nothing to add (planes 0)
      row_scale(m, 8, up1, up2, unit[i], unit2[i]);  // m · 2^t ∈ [128, 256)
      std::uint8_t* a = w.pa + i * 64;
      for (int L = 0; L < 4; ++L) {
        __m512 x = _mm512_mul_ps(_mm512_mul_ps(pv[L], up1), up2);  // exact, in [0, 256)
        for (int q = 0; q < 3; ++q) {  // b_q = ⌊x⌋, x ← (x − b_q)·2^8: exact steps
          const __m512i bq = _mm512_cvttps_epi32(x);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(a + q * 4 * 64 + 16 * L),
                           _mm512_cvtepi32_epi8(bq));
          x = _mm512_mul_ps(_mm512_sub_ps(x, _mm512_cvtepi32_ps(bq)), byte);
        }
      }
    }
    _tile_loadd(5, w.pa, 64);
    for (std::int64_t c = 0; c < chunks; ++c) {
      zero_c();
      if (copy) {
        TOKENMIX_AMX_INT8_PRODUCTS_STRIDED(_tile_dpbusd, 5, w.vb + c * 4 * kTileBytes, kTileBytes,
                                           64);
      } else {
        pf_take(w, 16 * kPfPerVStep);
        TOKENMIX_AMX_INT8_PRODUCTS_STRIDED(_tile_dpbusd, 5, v_tile + 4 * 64 * c, 4 * 16, 4 * dh);
      }
      store_c(w.cb);
      for (std::int64_t i = 0; i < rows; ++i) {
        pf_take(w, kPfPerRow);
        if (scalar_row[i] || unit[i] == 0.0f) continue;
        float* o = acc + (rb * 4 + i) * dh + 64 * c;
        const __m512 u1 = _mm512_set1_ps(unit[i]), u2 = _mm512_set1_ps(unit2[i]);
        for (int b4 = 0; b4 < 4; ++b4) {  // (D₂ 2^−8 + D₁) 2^−8 + D₀, then · 2^−t_r
          const std::int32_t* d = w.cb + b4 * 256 + i * 16;
          __m512 t = _mm512_fmadd_ps(cvt(d + 8 * 16), step, cvt(d + 4 * 16));
          t = _mm512_mul_ps(_mm512_mul_ps(_mm512_fmadd_ps(t, step, cvt(d)), u1), u2);
          _mm512_storeu_ps(o + 16 * b4, _mm512_add_ps(_mm512_loadu_ps(o + 16 * b4), t));
        }
      }
    }
    for (std::int64_t i = 0; i < rows; ++i) {
      unit[i] = unit2[i] = 0.0f;
      if (!scalar_row[i]) continue;
      const float* pr = p + (rb * 4 + i) * kKeys;  // Õ's columns in order; the quads' elements
      float* o = acc + (rb * 4 + i) * dh;
      for (std::int64_t u = 0; u < nt; ++u)
        for (std::int64_t x = 0; x < dh; ++x)
          o[x] += pr[u] * static_cast<float>(
                              static_cast<std::int8_t>(v_tile[u / 4 * 4 * dh + 4 * x + u % 4]));
    }
  }
}

// fp8 and bf16: Õ += P V on the tiles for the B tiles in w.vb: each P row's three bf16 planes
// (the row scaled to [2^(top − 1), 2^top)), the products per 64-column chunk, each row's C tiles
// scaled back and added to Õ; a row whose P holds a NaN or ±∞ is added by
// scalar_row_add(p_row, acc_row) instead.
template <class ScalarRow>
void bf16_values_products(Workspace& w, const float* p, float* acc, const __mmask16 in_tile[4],
                          int top, ScalarRow scalar_row_add) {
  const std::int64_t dh = w.dh, n = w.n, chunks = dh / 64;
  float unit[16] = {}, unit2[16] = {};
  for (std::int64_t rb = 0; rb * 16 < n; ++rb) {
    const std::int64_t rows = std::min<std::int64_t>(16, n - rb * 16);
    bool scalar_row[16] = {};
    // Row i of the six A tiles (two halves × three planes) as zeros: rows past the unit's, and
    // rows with nothing to add on the tiles (every other row's planes overwrite all of it).
    const auto zero_row = [&](std::int64_t i) {
      for (std::int64_t t = 0; t < 6; ++t)
        _mm512_store_si512(w.pa + t * kTileBytes + i * 64, _mm512_setzero_si512());
    };
    for (std::int64_t i = rows; i < 16; ++i) zero_row(i);
    for (std::int64_t i = 0; i < rows; ++i) {
      wake(w);
      pf_take(w, kPfPerRow);
      __m512 pv[4], up1, up2;
      float m = 0.0f;
      unit[i] = unit2[i] = 0.0f;
      if (!load_p_row(p + (rb * 16 + i) * kKeys, in_tile, pv, m)) {
        scalar_row[i] = true;
        zero_row(i);
        continue;
      }
      if (m == 0.0f) {  // nothing to add (planes 0)
        zero_row(i);
        continue;
      }
      row_scale(m, top, up1, up2, unit[i], unit2[i]);  // m · 2^t ∈ [2^(top − 1), 2^top)
      for (int L = 0; L < 4; ++L)  // keys 16L ..: half L / 2, bytes 32 · (L % 2) of the row
        bf16_planes(_mm512_mul_ps(_mm512_mul_ps(pv[L], up1), up2),
                    w.pa + (L / 2) * 3 * kTileBytes + i * 64 + 32 * (L % 2), kTileBytes);
    }
    for (std::int64_t c = 0; c < chunks; ++c) {
      zero_c();
      for (std::int64_t h = 0; h < 2; ++h) {  // keys 32h .. 32h + 31
        bf16_plane_products(w.pa + h * 3 * kTileBytes, w.vb + (h * chunks + c) * 4 * kTileBytes);
      }
      store_c(w.cb);
      for (std::int64_t i = 0; i < rows; ++i) {
        pf_take(w, kPfPerRow);
        if (scalar_row[i] || unit[i] == 0.0f) continue;
        float* o = acc + (rb * 16 + i) * dh + 64 * c;
        const __m512 u1 = _mm512_set1_ps(unit[i]), u2 = _mm512_set1_ps(unit2[i]);
        for (int b4 = 0; b4 < 4; ++b4) {  // D · 2^−t_r
          const __m512 t = _mm512_mul_ps(_mm512_mul_ps(fp32(w.cb + b4 * 256 + i * 16), u1), u2);
          _mm512_storeu_ps(o + 16 * b4, _mm512_add_ps(_mm512_loadu_ps(o + 16 * b4), t));
        }
      }
    }
    for (std::int64_t i = 0; i < rows; ++i) {
      if (scalar_row[i]) scalar_row_add(p + (rb * 16 + i) * kKeys, acc + (rb * 16 + i) * dh);
    }
  }
}

void values_fp8(Workspace& w, const float* p, std::int64_t nt, const std::uint8_t* v_tile,
                float* acc, const __mmask16 in_tile[4]) {
  const std::int64_t dh = w.dh, chunks = dh / 64;
  const Fp8Widen widen;
  // The V tile as B tiles (key pairs; rows from nt on as zeros: their bytes are not read).
  for (std::int64_t i = 0; i < 32; ++i)
    for (std::int64_t c = 0; c < chunks; ++c) {
      if ((i * chunks + c) % 8 == 0) wake(w);
      pf_take(w, kPfPerVStep);
      rewrite_fp8(widen, v_tile + 2 * i * dh + 64 * c, dh, 2 * i < nt, 2 * i + 1 < nt,
                  w.vb + (((i / 16) * chunks + c) * 4 * 16 + i % 16) * 64);
    }
  bf16_values_products(w, p, acc, in_tile, a_top(Element::fp8_e4m3),
                       [&](const float* pr, float* o) {
                         values_scalar_row(
                             pr, 0, nt, v_tile, dh, o,
                             [](std::uint8_t q) {
                               const float v = e4m3_unit_value(q & 0x7fu);
                               return (q & 0x80u) != 0 ? -v : v;
                             },
                             permuted_column);
                       });
}

// bf16: rows from nt on as zeros (not loaded); false before any product where a row < nt holds a
// value the tiles would not take exactly (Bf16Scan::outside).
bool values_bf16(Workspace& w, const float* p, std::int64_t nt, const std::uint16_t* v_tile,
                 float* acc, const __mmask16 in_tile[4]) {
  const std::int64_t dh = w.dh, chunks = dh / 64;
  Bf16Scan scan;
  const auto row_part = [&](std::int64_t u, std::int64_t x) {  // 32 values of row u from x
    if (u >= nt) return _mm512_setzero_si512();
    const __m512i v = _mm512_loadu_si512(v_tile + u * dh + x);
    scan.both_of(v);
    return v;
  };
  for (std::int64_t i = 0; i < 32; ++i)  // keys 2i, 2i + 1: B row i % 16 of half i / 16
    for (std::int64_t c = 0; c < chunks; ++c) {
      if ((i * chunks + c) % 8 == 0) wake(w);
      pf_take(w, kPfPerVStep);
      std::uint8_t* out = w.vb + (((i / 16) * chunks + c) * 4 * 16 + i % 16) * 64;
      for (std::int64_t z = 0; z < 2; ++z)  // features 64c + 32z ..: B tiles 2z, 2z + 1
        rewrite_bf16(row_part(2 * i, 64 * c + 32 * z), row_part(2 * i + 1, 64 * c + 32 * z),
                     out + 2 * z * 16 * 64, 16 * 64);
    }
  if (scan.outside()) return false;
  bf16_values_products(w, p, acc, in_tile, a_top(Element::bf16),
                       [&](const float* pr, float* o) { values_visible(pr, 0, nt, v_tile, o); });
  return true;
}

}  // namespace

bool thread_ready() {
  thread_local const bool granted =
      syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

void configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  // LDTILECFG with the whole 64-byte operand as its input: GCC 12's _tile_loadconfig names only
  // its first 8 bytes, and the stores of the rest were dropped as dead (SIGILL at the first tile
  // instruction).
  asm volatile("ldtilecfg %0" : : "m"(cfg));
}

void release() {
  _tile_release();
}

void keep_awake() {
  Workspace& w = workspace();
  wake(w);
  pf_take(w, kPfPerSoftmaxRow);
}

bool query_planes(Element element, const float* qs, std::int64_t n, std::int64_t dh) {
  if (n < 1 || n > kRowsMax || !head_dim_supported(dh)) return false;  // the workspace's sizes
  Workspace& w = workspace();
  w.element = element, w.n = n, w.dh = dh;
  const bool bf16_rows = element != Element::int8;  // fp8 and bf16: three bf16 planes per row
  const std::int64_t cf = chunk_features(element), chunks = dh / cf;
  const std::int64_t tiles = bf16_rows ? (n + 15) / 16 * chunks * 3 : (n + 3) / 4 * chunks;
  std::memset(w.qa, 0, static_cast<std::size_t>(tiles * kTileBytes));
  alignas(64) float row[kDhMax];
  // Row r's features x .. x + 15 are 16 floats n apart in qs: one gather each.
  const __m512i column =
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(static_cast<int>(n)));
  for (std::int64_t r = 0; r < n; ++r) {
    __m512 largest = _mm512_setzero_ps();
    __mmask16 not_finite = 0;
    for (std::int64_t x = 0; x < dh; x += 16) {
      const __m512 v = _mm512_i32gather_ps(
          _mm512_add_epi32(column, _mm512_set1_epi32(static_cast<int>(x * n))), qs + r, 4);
      _mm512_store_ps(row + x, v);
      const __m512 magnitude = _mm512_abs_ps(v);
      not_finite |= _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(INFINITY), _CMP_NLT_UQ);
      largest = _mm512_max_ps(largest, magnitude);
    }
    if (not_finite != 0) return false;  // NaN or ±∞
    const float m = _mm512_reduce_max_ps(largest);
    if (m != 0.0f && (m < 0x1p-60f || m >= 0x1p60f)) return false;
    int e = 0;
    std::frexp(m, &e);                                 // m ∈ [2^(e−1), 2^e)
    const int s = m == 0.0f ? 0 : a_top(element) - e;  // m · 2^s ∈ [2^(top − 1), 2^top)
    w.q_unit[r] = std::ldexp(1.0f, -s);
    const __m512 up = _mm512_set1_ps(std::ldexp(1.0f, s)), step = _mm512_set1_ps(128.0f);
    std::uint8_t* a_row = bf16_rows ? w.qa + (r / 16) * chunks * 3 * kTileBytes + (r % 16) * 64
                                    : w.qa + (r / 4) * chunks * kTileBytes + (r % 4) * 64;
    for (std::int64_t x = 0; x < dh; x += 16) {
      __m512 t = _mm512_mul_ps(_mm512_load_ps(row + x), up);  // exact (a power of two)
      if (bf16_rows) {  // features 32c + (x % 32): bytes 2 · (x % 32) of the rows of chunk c's
                        // planes
        bf16_planes(t, a_row + (x / 32) * 3 * kTileBytes + 2 * (x % 32), kTileBytes);
        continue;
      }
      std::uint8_t* a = a_row + (x / 64) * kTileBytes + x % 64;
      for (int p = 0; p < 4; ++p) {  // a_p = round(t), t ← (t − a_p)·2^7: exact steps
        const __m512 ap = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(a + p * 4 * 64),
                         _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(ap)));
        t = _mm512_mul_ps(_mm512_sub_ps(t, ap), step);
      }
    }
  }
  return true;
}

bool scores(const void* k_tile, std::int64_t nt, float* s, const std::uint8_t* pf,
            std::int64_t pf_bytes) {
  Workspace& w = workspace();
  w.pf_next = pf, w.pf_end = pf != nullptr ? pf + pf_bytes : nullptr;
  switch (w.element) {
    case Element::int8:
      scores_int8(w, static_cast<const std::int8_t*>(k_tile), s);
      return true;
    case Element::fp8_e4m3:
      scores_fp8(w, static_cast<const std::uint8_t*>(k_tile), s);
      return true;
    default:
      return scores_bf16(w, static_cast<const std::uint16_t*>(k_tile), nt, s);
  }
}

bool values(const float* p, std::int64_t nt, const void* v_tile, float* acc) {
  Workspace& w = workspace();
  __mmask16 in_tile[4];  // the lanes of keys < nt in each 16-key quarter of P's row
  for (int L = 0; L < 4; ++L) {
    const std::int64_t keys = std::clamp<std::int64_t>(nt - 16 * L, 0, 16);
    in_tile[L] = static_cast<__mmask16>((1u << keys) - 1);
  }
  const auto* v = static_cast<const std::uint8_t*>(v_tile);
  bool done = true;
  switch (w.element) {
    case Element::int8:
      values_int8(w, p, nt, v, acc, in_tile);
      break;
    case Element::fp8_e4m3:
      values_fp8(w, p, nt, v, acc, in_tile);
      break;
    default:
      done = values_bf16(w, p, nt, static_cast<const std::uint16_t*>(v_tile), acc, in_tile);
  }
  pf_take(w, std::int64_t{1} << 20);  // what the cursor has left of the pair ahead
  return done;
}

void values_visible(const float* p_row, std::int64_t lo, std::int64_t hi, const void* v_tile,
                    float* acc_row) {
  const Workspace& w = workspace();
  values_scalar_row(p_row, lo, hi, static_cast<const std::uint16_t*>(v_tile), w.dh, acc_row,
                    bf16_value, permuted_column_bf16);
}

void unpermute(float* acc) {
  const Workspace& w = workspace();
  if (w.element == Element::bf16) {
    for (std::int64_t r = 0; r < w.n; ++r)
      for (std::int64_t c = 0; c < w.dh; c += 32) {
        float* o = acc + r * w.dh + c;
        __m512 lo, hi;
        pairs_in_order(_mm512_loadu_ps(o), _mm512_loadu_ps(o + 16), lo, hi);
        _mm512_storeu_ps(o, lo), _mm512_storeu_ps(o + 16, hi);
      }
    return;
  }
  if (w.element == Element::int8) return;  // the quads' products: columns in order
  for (std::int64_t r = 0; r < w.n; ++r)
    for (std::int64_t c = 0; c < w.dh; c += 64) {
      float* o = acc + r * w.dh + c;
      __m512 v0 = _mm512_loadu_ps(o), v1 = _mm512_loadu_ps(o + 16), v2 = _mm512_loadu_ps(o + 32),
             v3 = _mm512_loadu_ps(o + 48);
      transpose_blocks(v0, v1, v2, v3);
      _mm512_storeu_ps(o, v0), _mm512_storeu_ps(o + 16, v1);
      _mm512_storeu_ps(o + 32, v2), _mm512_storeu_ps(o + 48, v3);
    }
}

}  // namespace tokenmix::kernels::amx

#undef TOKENMIX_AMX_INT8_PRODUCTS_STRIDED

HWY_POP_ATTRIBUTES
