// src/kernels/simd/amx_int8.cpp — decode's per-tile products over an int8 cache on AMX-INT8
// (amx_int8.hpp: the planes, their exactness and the column order). Compiled with -mamx-tile
// -mamx-int8 -mavx512f/bw/vl/dq; called only where CpuFeatures::amx_int8 holds.
//
// Tiles (one configuration, palette 1, every tile 16 rows × 64 bytes):
//   tmm0–tmm3  C: 16 rows × 16 int32 columns (four column blocks of a product)
//   tmm4       A of S: rows 4p + i = plane p of query row 4·rb + i, 64 features of one chunk
//   tmm5       A of Õ: rows 4p + i = plane p of P row 4·rb + i (rows 12–15 zero), 64 keys
//   tmm6, tmm7 B: 16 byte-quad rows × 16 columns × 4 bytes
// B operands, built per cache tile in this thread's buffers from 4 rows at a time:
//   K [dh][64] → kb[c][b][i][16 × 4]: quad i of chunk c (features 64c + 4i ..+3) for the keys
//       16L + 4b + j (L, j < 4) of column 4L + j of block b;
//   V [64][dh] → vb[c][b][i][16 × 4]: keys 4i ..+3 for the features 64c + 16L + 4b + j of
//       column 4L + j of block b (feature block f = 4c + b).
// Two byte and two word interleaves of 4 rows give exactly this order (they work within 128-bit
// lanes), 8 shuffles per 256 bytes.
#include "kernels/simd/amx_int8.hpp"

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

namespace tokenmix::kernels::amx {
namespace {

constexpr int kArchReqXcompPerm = 0x1023;  // arch_prctl: request an XSAVE feature
constexpr int kXfeatureXtiledata = 18;     // the AMX tile data state component
constexpr std::int64_t kKeys = 64;         // keys per cache tile (KVTileLayout::kKeyTile)
constexpr std::int64_t kRowsMax = 128;     // rows of a decode unit (decode.cpp kMaxRows)
constexpr std::int64_t kTileBytes = 1024;  // 16 rows × 64 bytes

struct alignas(64) TileConfig {
  std::uint8_t palette = 1, start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

// This thread's operands (64-byte aligned views into one allocation).
struct Workspace {
  std::vector<std::uint8_t> storage;
  std::int8_t* qa = nullptr;    // [row blocks][chunks][16][64]: the query planes (A of S)
  std::uint8_t* pa = nullptr;   // [16][64]: one row block's P planes (A of Õ)
  std::int8_t* kb = nullptr;    // [dh · 64]: the K tile as B tiles
  std::int8_t* vb = nullptr;    // [64 · dh]: the V tile as B tiles
  std::int32_t* cb = nullptr;   // [4][16][16]: C tiles stored
  float q_unit[kRowsMax] = {};  // 2^−s_r of each query row
  std::int64_t n = 0, dh = 0;
  const std::uint8_t *pf_next = nullptr, *pf_end = nullptr;  // the pair ahead, not yet asked for
  unsigned wakes = 0;                                        // keep_awake's turn of C tiles

  Workspace() {
    const std::size_t bytes =
        kRowsMax / 4 * 4 * kTileBytes + kTileBytes + 2 * 256 * kKeys + 4 * kTileBytes + 64;
    storage.resize(bytes);
    auto* p = storage.data();
    p += (64 - reinterpret_cast<std::uintptr_t>(p) % 64) % 64;
    qa = reinterpret_cast<std::int8_t*>(p), p += kRowsMax / 4 * 4 * kTileBytes;
    pa = p, p += kTileBytes;
    kb = reinterpret_cast<std::int8_t*>(p), p += 256 * kKeys;
    vb = reinterpret_cast<std::int8_t*>(p), p += 256 * kKeys;
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
inline float pow2(int k) {
  const std::uint32_t bits = static_cast<std::uint32_t>(k + 127) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
// e with x ∈ [2^(e−1), 2^e) for a normal positive x, from its bits.
inline int exponent_of(float x) {
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return static_cast<int>(bits >> 23) - 126;
}

// Four rows of 64 bytes (r_j at base + j·stride) → four B rows z_b (see the file comment):
// z_b[16L + 4j' + j] = r_j[16L + 4b + j'].
inline void interleave4(const std::int8_t* base, std::int64_t stride, std::int8_t* out,
                        std::int64_t out_step) {
  const __m512i r0 = _mm512_loadu_si512(base), r1 = _mm512_loadu_si512(base + stride),
                r2 = _mm512_loadu_si512(base + 2 * stride),
                r3 = _mm512_loadu_si512(base + 3 * stride);
  const __m512i t0 = _mm512_unpacklo_epi8(r0, r1), t1 = _mm512_unpackhi_epi8(r0, r1),
                t2 = _mm512_unpacklo_epi8(r2, r3), t3 = _mm512_unpackhi_epi8(r2, r3);
  _mm512_store_si512(out, _mm512_unpacklo_epi16(t0, t2));
  _mm512_store_si512(out + out_step, _mm512_unpackhi_epi16(t0, t2));
  _mm512_store_si512(out + 2 * out_step, _mm512_unpacklo_epi16(t1, t3));
  _mm512_store_si512(out + 3 * out_step, _mm512_unpackhi_epi16(t1, t3));
}

// The tile pair ahead is prefetched into L2 by a cursor that every phase of a tile's work
// advances (scores: per K quad row and per query row; keep_awake: per softmax row; values: per P
// row, per V quad row and per query row of the combine), so the requests are spread over the whole
// tile, as the FMA kernel's are. Asked for in a burst during the rewrites instead, the step took
// 3.4 ms against 2.8–2.9 spread (int8, T_k = 32768, T_new = 1, two threads; docs/performance.md,
// 2026-12-05, third session). Lines per call of each phase (≈ 230 of a pair's 264 at d_h = 128
// and 4 rows; values() asks for the rest at its end):
constexpr std::int64_t kPfPerKQuad = 1, kPfPerRow = 4, kPfPerSoftmaxRow = 16, kPfPerVQuad = 2;

// The next `lines` lines of the pair ahead into L2 (as many as are left).
inline void pf_take(Workspace& w, std::int64_t lines) {
  for (; lines > 0 && w.pf_next < w.pf_end; --lines, w.pf_next += 64)
    _mm_prefetch(reinterpret_cast<const char*>(w.pf_next), _MM_HINT_T1);
}

// A product into one of the dead C tiles (of the A and B tiles last loaded), the four in turn (no
// chain of dependent products), to keep the tile unit busy: after ≈ 120 ns of vector work without
// a product, the next product waited ≈ 300–400 ns on an Intel Xeon (family 6 model 207); one every
// ≈ 60 ns of vector work keeps it awake (TILEZERO and TILELOADD do not). Called every 8 rewrite
// steps, per softmax row and per P row: int8, T_k = 32768, T_new = 1, two threads, 4.0 → 3.4 ms
// (docs/performance.md, 2026-12-05, third session).
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

// C tiles 0–3 → cb[b][16][16].
inline void store_c(std::int32_t* cb) {
  _tile_stored(0, cb, 64);
  _tile_stored(1, cb + 256, 64);
  _tile_stored(2, cb + 512, 64);
  _tile_stored(3, cb + 768, 64);
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

bool query_planes(const float* qs, std::int64_t n, std::int64_t dh) {
  if (n < 1 || n > kRowsMax || !head_dim_supported(dh)) return false;  // the workspace's sizes
  Workspace& w = workspace();
  w.n = n, w.dh = dh;
  const std::int64_t chunks = dh / 64, blocks = (n + 3) / 4;
  std::memset(w.qa, 0, static_cast<std::size_t>(blocks * chunks * kTileBytes));
  alignas(64) float row[256];
  for (std::int64_t r = 0; r < n; ++r) {
    float m = 0.0f;
    for (std::int64_t x = 0; x < dh; ++x) {
      row[x] = qs[x * n + r];
      m = std::max(m, std::fabs(row[x]));  // a NaN element passes over: caught below
    }
    bool finite = std::isfinite(m);
    for (std::int64_t x = 0; x < dh; ++x) finite = finite && std::isfinite(row[x]);
    if (!finite || (m != 0.0f && (m < 0x1p-60f || m >= 0x1p60f))) return false;
    int e = 0;
    std::frexp(m, &e);                    // m ∈ [2^(e−1), 2^e)
    const int s = m == 0.0f ? 0 : 6 - e;  // m · 2^s ∈ [32, 64): a₀ ∈ [−64, 64]
    w.q_unit[r] = std::ldexp(1.0f, -s);
    const __m512 up = _mm512_set1_ps(std::ldexp(1.0f, s)), step = _mm512_set1_ps(128.0f);
    std::int8_t* a_row = w.qa + (r / 4) * chunks * kTileBytes + (r % 4) * 64;
    for (std::int64_t x = 0; x < dh; x += 16) {
      __m512 t = _mm512_mul_ps(_mm512_load_ps(row + x), up);  // exact (a power of two)
      std::int8_t* a = a_row + (x / 64) * kTileBytes + x % 64;
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

void scores(const std::int8_t* k_tile, float* s, const std::uint8_t* pf, std::int64_t pf_bytes) {
  Workspace& w = workspace();
  const std::int64_t dh = w.dh, n = w.n, chunks = dh / 64, quads = dh / 4;
  // The K tile as B tiles; the pair ahead prefetched by a cursor over the whole tile's work.
  w.pf_next = pf, w.pf_end = pf != nullptr ? pf + pf_bytes : nullptr;
  for (std::int64_t i = 0; i < quads; ++i) {
    if (i % 8 == 0) wake(w);
    pf_take(w, kPfPerKQuad);
    interleave4(k_tile + 4 * i * kKeys, kKeys, w.kb + ((i / 16) * 4 * 16 + i % 16) * 64, 16 * 64);
  }
  const __m512 step = _mm512_set1_ps(0x1p-7f);
  for (std::int64_t rb = 0; rb * 4 < n; ++rb) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (std::int64_t c = 0; c < chunks; ++c) {
      const std::int8_t* b = w.kb + c * 4 * kTileBytes;
      _tile_loadd(4, w.qa + (rb * chunks + c) * kTileBytes, 64);
      _tile_loadd(6, b, 64);
      _tile_loadd(7, b + kTileBytes, 64);
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
      _tile_loadd(6, b + 2 * kTileBytes, 64);
      _tile_loadd(7, b + 3 * kTileBytes, 64);
      _tile_dpbssd(2, 4, 6);
      _tile_dpbssd(3, 4, 7);
    }
    store_c(w.cb);
    for (std::int64_t i = 0; i < 4 && rb * 4 + i < n; ++i) {
      pf_take(w, kPfPerRow);
      const std::int64_t r = rb * 4 + i;
      const __m512 unit = _mm512_set1_ps(w.q_unit[r]);
      __m512 v[4];
      for (int b = 0; b < 4; ++b) {  // ((C₃ 2^−7 + C₂) 2^−7 + C₁) 2^−7 + C₀, then · 2^−s_r
        const std::int32_t* c = w.cb + b * 256 + i * 16;
        __m512 t = _mm512_fmadd_ps(cvt(c + 12 * 16), step, cvt(c + 8 * 16));
        t = _mm512_fmadd_ps(t, step, cvt(c + 4 * 16));
        v[b] = _mm512_mul_ps(_mm512_fmadd_ps(t, step, cvt(c)), unit);
      }
      transpose_blocks(v[0], v[1], v[2], v[3]);  // keys 16L .. 16L + 15 in v[L]
      for (int L = 0; L < 4; ++L) _mm512_storeu_ps(s + r * kKeys + 16 * L, v[L]);
    }
  }
}

void values(const float* p, std::int64_t nt, const std::int8_t* v_tile, float* acc) {
  Workspace& w = workspace();
  const std::int64_t dh = w.dh, n = w.n, chunks = dh / 64;
  // The V tile as B tiles.
  for (std::int64_t i = 0; i < 16; ++i)
    for (std::int64_t c = 0; c < chunks; ++c) {
      if ((i * chunks + c) % 8 == 0) wake(w);
      pf_take(w, kPfPerVQuad);
      interleave4(v_tile + 4 * i * dh + 64 * c, dh, w.vb + (c * 4 * 16 + i) * 64, 16 * 64);
    }
  __mmask16 in_tile[4];  // the lanes of keys < nt in each 16-key quarter of P's row
  for (int L = 0; L < 4; ++L) {
    const std::int64_t keys = std::clamp<std::int64_t>(nt - 16 * L, 0, 16);
    in_tile[L] = static_cast<__mmask16>((1u << keys) - 1);
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
      const float* pr = p + (rb * 4 + i) * kKeys;
      __m512 pv[4];
      __m512 mx = _mm512_setzero_ps();
      for (int L = 0; L < 4; ++L) {
        pv[L] = _mm512_maskz_loadu_ps(in_tile[L], pr + 16 * L);
        mx = _mm512_max_ps(mx, pv[L]);  // NaN lanes: caught by the check below
      }
      const float m = _mm512_reduce_max_ps(mx);
      bool finite = std::isfinite(m);
      for (int L = 0; L < 4; ++L)
        finite =
            finite && _mm512_cmp_ps_mask(pv[L], pv[L], _CMP_UNORD_Q) == 0 &&
            _mm512_cmp_ps_mask(_mm512_abs_ps(pv[L]), _mm512_set1_ps(INFINITY), _CMP_EQ_OQ) == 0;
      if (!finite) {
        scalar_row[i] = true;
        continue;
      }
      if (m == 0.0f) continue;  // nothing to add (planes 0)
      int e = 0;
      if (m >= 0x1p-126f) {
        e = exponent_of(m);  // m ∈ [2^(e−1), 2^e): m · 2^t ∈ [128, 256)
      } else {
        std::frexp(m, &e);
      }
      const int t = 8 - e;
      // 2^t in two exact steps (t ≤ 157 for the least subnormal m); 2^−t likewise.
      const int t1 = std::clamp(t, -126, 100);
      const __m512 up1 = _mm512_set1_ps(pow2(t1)), up2 = _mm512_set1_ps(pow2(t - t1));
      const int d1 = std::clamp(-t, -126, 100);
      unit[i] = pow2(d1), unit2[i] = pow2(-t - d1);
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
      const std::int8_t* b = w.vb + c * 4 * kTileBytes;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      _tile_loadd(6, b, 64);
      _tile_loadd(7, b + kTileBytes, 64);
      _tile_dpbusd(0, 5, 6);
      _tile_dpbusd(1, 5, 7);
      _tile_loadd(6, b + 2 * kTileBytes, 64);
      _tile_loadd(7, b + 3 * kTileBytes, 64);
      _tile_dpbusd(2, 5, 6);
      _tile_dpbusd(3, 5, 7);
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
      // A NaN or ±∞ weight: Σ_u P[u]·V[u][x] as a plain loop (keys < nt), into the permuted
      // columns: feature 64c + 16L + 4b + j sits at 64c + 16b + 4L + j.
      const float* pr = p + (rb * 4 + i) * kKeys;
      float* o = acc + (rb * 4 + i) * dh;
      for (std::int64_t u = 0; u < nt; ++u)
        for (std::int64_t x = 0; x < dh; ++x) {
          const std::int64_t f = x % 64, at = x - f + 16 * (f / 4 % 4) + 4 * (f / 16) + f % 4;
          o[at] += pr[u] * static_cast<float>(v_tile[u * dh + x]);
        }
    }
  }
  pf_take(w, std::int64_t{1} << 20);  // what the cursor has left of the pair ahead
}

void unpermute(float* acc) {
  const Workspace& w = workspace();
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
