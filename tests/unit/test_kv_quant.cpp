// tests/unit/test_kv_quant.cpp — the quantized KV cache (int8, fp8 E4M3; SPEC "Reduced precision
// → Quantized KV cache"): element formats, quantization on append exactly as SPEC says, the
// layout (scales next to their tile), memory, every cache operation, every error path (typed
// error, cache unchanged byte for byte), and attention_decode on every ISA path against the
// float64 oracle over the dequantized values x̂ = q · δ read back from the cache.
//
// Decode bound: the oracle runs on exactly the values the cache holds (reference::dequantize of
// the stored q and δ), so the kernels are held to the fp32-accumulation bound of test_decode.cpp,
// rel_err ≤ 2e-5 (dot products of length d_h and L-term weighted sums in fp32, u = 6e-8, exp
// 1 ULP, one merge per 1024-key chunk; forming q·δ or folding δ into the score or the probability
// adds one rounding per term). A scale applied to the wrong key, or a tile or merge bug, gives
// errors ≥ 1e-3.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <xmmintrin.h>  // _mm_getcsr / _mm_setcsr (ScopedFlushSubnormals)
#endif

#include "decode/decode_internal.hpp"
#include "kernels/attention_kernels.hpp"
#include "kernels/kv_element.hpp"
#include "kv_oracle.hpp"
#include "test_util.hpp"

namespace tokenmix::testing {
namespace {

constexpr DType kQuantTypes[] = {DType::int8, DType::fp8_e4m3};
// The decode kernels' readings of a quantized cache: int8, and fp8 E4M3 through f16 bits or
// directly as fp32 bits (TOKENMIX_FP8_WIDEN=direct: the AVX-512 and AVX2 kernels; portable and NEON
// ignore it), each forced, so that no CPU's automatic choice leaves one untested.
// A quantized cache and how it is read: fp8's widening (TOKENMIX_FP8_WIDEN), int8's tile layout
// (KVCacheConfig::int8_quads: rows and quads on every path, whatever this CPU's default).
struct QuantReading {
  DType dt;
  const char* fp8_widen;
  std::optional<bool> int8_quads = std::nullopt;
};
const QuantReading kQuantReadings[] = {{DType::int8, "f16", false},
                                       {DType::int8, "f16", true},
                                       {DType::fp8_e4m3, "f16"},
                                       {DType::fp8_e4m3, "direct"}};
// `c` with the reading's int8 layout.
KVCacheConfig read_as(KVCacheConfig c, const QuantReading& reading) {
  c.int8_quads = reading.int8_quads;
  return c;
}
// `c` as AMX-INT8 takes an int8 cache (quads), whatever this CPU's default; other dtypes as given.
KVCacheConfig amx_tiles(KVCacheConfig c) {
  if (c.dtype == DType::int8) c.int8_quads = true;
  return c;
}
QuantReading amx_reading(DType dt) {
  return {dt, "f16", dt == DType::int8 ? std::optional<bool>(true) : std::nullopt};
}
std::string layout_name(const QuantReading& reading) {
  return !reading.int8_quads ? "" : *reading.int8_quads ? " quads" : " rows";
}

// ---- element formats ----

TEST(KVQuantElements, E4M3DecodeMatchesTheFormatDefinition) {
  for (int b = 0; b < 256; ++b) {
    const auto bits = static_cast<std::uint8_t>(b);
    if ((b & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(reference::e4m3_value(bits)));
      continue;
    }
    ASSERT_EQ(static_cast<double>(kernels::e4m3_to_f32(bits)), reference::e4m3_value(bits)) << b;
    ASSERT_EQ(kernels::f32_to_e4m3(kernels::e4m3_to_f32(bits)), bits) << b;  // exact round trip
  }
  EXPECT_EQ(reference::e4m3_value(0x7e), 448.0);
  EXPECT_EQ(reference::e4m3_value(0x01), std::ldexp(1.0, -9));  // smallest subnormal
  EXPECT_EQ(reference::e4m3_value(0x08), std::ldexp(1.0, -6));  // smallest normal
}

// Ties to even; the saturation at 448 (x / δ may exceed 448 by an fp32 rounding).
TEST(KVQuantElements, E4M3RoundsToNearestEven) {
  EXPECT_EQ(kernels::f32_to_e4m3(448.0f), 0x7e);
  EXPECT_EQ(kernels::f32_to_e4m3(448.01f), 0x7e);
  EXPECT_EQ(kernels::f32_to_e4m3(-1000.0f), 0xfe);
  EXPECT_EQ(kernels::f32_to_e4m3(0x1.0p-10f), 0x00);          // tie between 0 and 2^-9 → 0
  EXPECT_EQ(kernels::f32_to_e4m3(3 * 0x1.0p-10f), 0x02);      // tie between 1 and 2 (·2^-9) → 2
  EXPECT_EQ(kernels::f32_to_e4m3(1.0f + 1.0f / 16), 0x38);    // tie 1 | 1.125 → 1 (even)
  EXPECT_EQ(kernels::f32_to_e4m3(1.0f + 3.0f / 16), 0x3a);    // tie 1.125 | 1.25 → 1.25
  EXPECT_EQ(kernels::f32_to_e4m3(15.5f * 0x1.0p-10f), 0x08);  // 7.75·2^-9 → carries to 2^-6
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> expo(-12.0, 8.81), sign(-1.0, 1.0);
  for (int i = 0; i < 20000; ++i) {
    const float y = static_cast<float>(std::copysign(std::exp2(expo(rng)), sign(rng)));
    const std::uint8_t c = kernels::f32_to_e4m3(y);
    const double got = std::fabs(y - reference::e4m3_value(c));
    for (int o = 0; o < 256; ++o) {
      if ((o & 0x7f) == 0x7f) continue;
      const double other = std::fabs(y - reference::e4m3_value(static_cast<std::uint8_t>(o)));
      ASSERT_LE(got, other) << "y=" << y << " code " << int(c) << " vs " << o;
      if (other == got && o != c && reference::e4m3_value(static_cast<std::uint8_t>(o)) != 0.0) {
        ASSERT_EQ(c & 1, 0) << "tie not to even: y=" << y;
      }
    }
  }
}

// The quantizer never emits the E4M3 NaN codes 0x7f / 0xff, which the SIMD widening (f16 bits,
// microkernel-inl.h) would read as finite: every fp32 from 256 up to the saturation bound 448
// and just beyond, and whole rows at extreme magnitudes (δ subnormal, x / δ overflowing to ∞ and
// clamped, the largest finite fp32), through quantize_row as the cache calls it.
TEST(KVQuantElements, QuantizerNeverEmitsNaNCodes) {
  for (float y = 256.0f; y <= 480.0f; y = std::nextafter(y, INFINITY)) {
    ASSERT_NE(kernels::f32_to_e4m3(y) & 0x7f, 0x7f) << y;
    ASSERT_NE(kernels::f32_to_e4m3(-y) & 0x7f, 0x7f) << -y;
  }
  std::mt19937_64 rng(17);
  std::normal_distribution<float> dist;
  const float mags[] = {1.0f, 1e-38f, 1e-44f, 3e38f, std::numeric_limits<float>::max(), 447.9f};
  std::vector<float> x(64);
  std::vector<std::byte> q(x.size());
  for (DType dt : {DType::int8, DType::fp8_e4m3})
    for (float mag : mags)
      for (int r = 0; r < 200; ++r) {
        for (float& e : x) e = std::clamp(dist(rng), -4.0f, 4.0f) * (mag / 4.0f);
        x[static_cast<std::size_t>(r % 64)] = (r % 2 ? -1.0f : 1.0f) * mag;  // the row's max
        kernels::quantize_row(dt, x.data(), 1, 64, q.data(), 1);
        for (std::byte b : q) {
          const auto u = static_cast<std::uint8_t>(b);
          if (dt == DType::fp8_e4m3) {
            ASSERT_NE(u & 0x7f, 0x7f) << "magnitude " << mag;
          }
          if (dt == DType::int8) {
            ASSERT_NE(u, 0x80) << "magnitude " << mag;  // q ∈ [−127, 127]
          }
        }
      }
}

// The widening of stored elements to fp32 on every kernel path, for all 256 byte values at every
// lane position of the widest vector row (byte i of the input is (i + i / 256) mod 256, so each
// block of 256 shifts the codes by one lane): the SIMD microkernel's LoadB (one vector) and
// LoadBRow<4> (fp8: paired widening through f16 bits, or the quad reading with its columns put
// back in order by UnsplitQuads) through the test hook kernels::widen_quantized_<isa> must give
// q · kLoadBUnit bitwise — int8: q; fp8 E4M3: the format's value (SPEC "Quantized KV cache")
// times 2^−8 through f16 bits, times 2^−120 read directly as fp32 bits (subnormal fp32 for the
// subnormal codes; the decode kernel's fp8_direct reading), or times 2^−8 again from the quad
// reading rescaled (the decode kernel's V tiles whose scales rule out 2^−120) — with normal and
// subnormal codes alike, and the portable kernel's element read (load_element) q itself. NaN
// codes (never stored, QuantizerNeverEmitsNaNCodes) are left out of the fp8 comparison.
class KVQuantWiden : public PerIsaTest {};

TEST_P(KVQuantWiden, AllByteValuesBitwiseAsTheScalarDecoding) {
  const Isa isa = GetParam();
  kernels::WidenKernel fn = nullptr;
  if (isa == Isa::avx2) fn = kernels::widen_quantized_avx2;
  if (isa == Isa::avx512 || isa == Isa::avx512_bf16) fn = kernels::widen_quantized_avx512;
  if (isa == Isa::neon) fn = kernels::widen_quantized_neon;
  ASSERT_TRUE(fn != nullptr || isa == Isa::portable) << "no widening hook for " << to_string(isa);
  const std::int64_t n = 256 * 64 + 5;  // + a partial vector
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) bytes[static_cast<std::size_t>(i)] = (i + i / 256) % 256;
  using kernels::Fp8Reading;
  struct Reading {
    DType dt;
    Fp8Reading fp8_reading;
  };
  for (const Reading reading :
       {Reading{DType::int8, Fp8Reading::f16}, Reading{DType::fp8_e4m3, Fp8Reading::f16},
        Reading{DType::fp8_e4m3, Fp8Reading::direct},
        Reading{DType::fp8_e4m3, Fp8Reading::quad_f16unit}}) {
    const DType dt = reading.dt;
    const bool fp8 = dt == DType::fp8_e4m3;
    const bool direct = fp8 && reading.fp8_reading == Fp8Reading::direct;
    const float unit = !fp8 ? 1.0f : direct ? 0x1.0p-120f : 0x1.0p-8f;
    std::vector<float> by_vector(bytes.size(), std::nanf("")), by_row(bytes.size(), std::nanf(""));
    if (fn != nullptr) {
      fn(dt, reading.fp8_reading, bytes.data(), n, by_vector.data(), by_row.data());
    } else {  // the portable kernel: the stored element q read one at a time (load_element)
      for (std::int64_t i = 0; i < n; ++i) {
        const float v = kernels::load_element(dt, bytes.data(), i) * unit;
        by_vector[static_cast<std::size_t>(i)] = by_row[static_cast<std::size_t>(i)] = v;
      }
    }
    const std::string what =
        std::string(to_string(dt)) +
        (!fp8                                              ? ""
         : reading.fp8_reading == Fp8Reading::direct       ? " (direct, quad rows)"
         : reading.fp8_reading == Fp8Reading::quad_f16unit ? " (quad rows at the f16 unit)"
                                                           : " (f16)");
    int subnormal_fp32 = 0;  // direct: the subnormal codes' fp32 values are subnormal
    for (std::int64_t i = 0; i < n; ++i) {
      const std::uint8_t b = bytes[static_cast<std::size_t>(i)];
      if (fp8 && (b & 0x7f) == 0x7f) continue;  // NaN code: never stored
      const double value = fp8 ? reference::e4m3_value(b) : static_cast<double>(std::int8_t(b));
      const double want_d = value * static_cast<double>(unit);
      const auto want = static_cast<float>(want_d);
      ASSERT_EQ(static_cast<double>(want), want_d) << what << " byte " << int(b);  // exact
      subnormal_fp32 += want != 0.0f && std::fpclassify(want) == FP_SUBNORMAL;
      const float got_v = by_vector[static_cast<std::size_t>(i)];
      const float got_r = by_row[static_cast<std::size_t>(i)];
      ASSERT_EQ(std::bit_cast<std::uint32_t>(got_v), std::bit_cast<std::uint32_t>(want))
          << what << " byte " << int(b) << " at " << i << ": " << got_v << " vs " << want;
      ASSERT_EQ(std::bit_cast<std::uint32_t>(got_r), std::bit_cast<std::uint32_t>(want))
          << what << " (row) byte " << int(b) << " at " << i << ": " << got_r;
    }
    // 14 subnormal codes (±1..7 · 2^−9) in each of the 64 shifted blocks
    EXPECT_EQ(subnormal_fp32, direct ? 14 * 64 : 0) << what;
  }
}
INSTANTIATE_TEST_SUITE_P(AllIsas, KVQuantWiden, AllIsas(), IsaName);

// ---- reading the cache back (stored_row, cached_row: kv_oracle.hpp) ----

// Checks one stored row against SPEC for the fp32 input row x: δ = max|x| / 127 (or 448) in
// fp32, each element the nearest representable q to x / δ (int8: |x/δ − q| ≤ 1/2; fp8: no E4M3
// value nearer), δ = 0 → zeros.
void expect_quantized_per_spec(DType dt, const float* x, std::int64_t n, const StoredRow& r) {
  float amax = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float lim = dt == DType::int8 ? 127.0f : 448.0f;
  ASSERT_EQ(r.delta, amax / lim);
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint8_t q = r.q[static_cast<std::size_t>(i)];
    if (r.delta == 0.0f) {
      ASSERT_EQ(reference::dequantize(format_of(dt), q, r.delta), 0.0);
      continue;
    }
    const double y = static_cast<double>(x[i]) / static_cast<double>(r.delta);
    const double slack = 1e-6 * std::fabs(y) + 1e-12;  // x / δ is formed in fp32
    if (dt == DType::int8) {
      const int qi = static_cast<std::int8_t>(q);
      ASSERT_GE(qi, -127);
      ASSERT_LE(std::fabs(y - qi), 0.5 + slack) << "x=" << x[i] << " delta=" << r.delta;
    } else {
      const double got = std::fabs(y - reference::e4m3_value(q));
      for (int o = 0; o < 256; ++o) {
        if ((o & 0x7f) == 0x7f) continue;
        ASSERT_LE(got, std::fabs(y - reference::e4m3_value(static_cast<std::uint8_t>(o))) + slack)
            << "x=" << x[i] << " code " << int(q) << " vs " << o;
      }
    }
  }
}

// Rows with N(0,1) values, outlier channels ×30, an all-zero row, a single nonzero and tiny values.
std::vector<float> test_rows(std::int64_t rows, std::int64_t dh, std::mt19937_64& rng) {
  std::normal_distribution<float> dist;
  std::vector<float> x(static_cast<std::size_t>(rows * dh));
  for (float& e : x) e = dist(rng);
  for (std::int64_t r = 0; r < rows; ++r) {
    float* row = x.data() + r * dh;
    switch (r % 6) {
      case 1:
        row[r % dh] *= 30.0f;  // outlier channel
        break;
      case 2:
        std::fill(row, row + dh, 0.0f);
        break;
      case 3:
        std::fill(row, row + dh, 0.0f);
        row[dh / 2] = -3.5f;
        break;
      case 4:
        for (std::int64_t i = 0; i < dh; ++i) row[i] *= 1e-30f;
        break;
      default:
        break;
    }
  }
  return x;
}

// K per channel over each closed 64-position tile, V per row, the open tile unquantized (SPEC
// "Quantized KV cache"), whatever the chunking of the appends; an all-zero channel stores δ = 0
// and zeros.
TEST(KVQuant, AppendQuantizesEachRowPerSpec) {
  std::mt19937_64 rng(1);
  const std::int64_t H = 3, D = 20, T = 150;
  auto k = test_rows(T * H, D, rng);
  const auto v = test_rows(T * H, D, rng);
  for (std::int64_t r = 0; r < T * H; ++r) k[static_cast<std::size_t>(r * D + 3)] = 0.0f;
  for (DType dt : kQuantTypes)
    for (std::int64_t block : {0, 64})
      for (std::int64_t window : {0, 70}) {
        SCOPED_TRACE(std::string(to_string(dt)) + " block=" + std::to_string(block) +
                     " window=" + std::to_string(window));
        KVCache c({2, 2, H, D, 1000, dt, block, 0, window});
        // In pieces of 1, 37, 112 positions: offsets inside tiles, blocks and (rolling) the ring.
        std::int64_t done = 0;
        for (std::int64_t n : {1, 37, 112}) {
          const auto kv = ConstTensorView::bthd(k.data() + done * H * D, 1, n, H, D);
          const auto vv = ConstTensorView::bthd(v.data() + done * H * D, 1, n, H, D);
          c.append(1, 1, kv, vv);
          done += n;
        }
        ASSERT_EQ(c.length(1, 1), T);
        constexpr std::int64_t kT = KVCache::kKeyTile;
        for (std::int64_t p = c.first_position(1, 1); p < T; ++p)
          for (std::int64_t h = 0; h < H; ++h) {
            expect_quantized_per_spec(dt, v.data() + (p * H + h) * D, D,
                                      stored_row(c, 1, 1, p, h, true));
            const StoredRow kr = stored_row(c, 1, 1, p, h, false);
            ASSERT_EQ(kr.open, p >= T / kT * kT);
            for (std::int64_t e = 0; kr.open && e < D; ++e)  // staged as given, bit for bit
              ASSERT_EQ(kr.staged[static_cast<std::size_t>(e)],
                        k[static_cast<std::size_t>((p * H + h) * D + e)]);
            if (kr.open || p % kT != 0) continue;
            for (std::int64_t e = 0; e < D; ++e) {  // tile from p, channel e: its 64 keys
              std::vector<float> x;
              StoredRow col;
              for (std::int64_t u = p; u < p + kT; ++u) {
                x.push_back(k[static_cast<std::size_t>((u * H + h) * D + e)]);
                col.q.push_back(stored_row(c, 1, 1, u, h, false).q[static_cast<std::size_t>(e)]);
              }
              col.delta = kr.deltas[static_cast<std::size_t>(e)];
              if (e == 3) {
                ASSERT_EQ(col.delta, 0.0f);
              }
              expect_quantized_per_spec(dt, x.data(), kT, col);
            }
          }
      }
}

TEST(KVQuant, MemoryCountsElementsPlusScales) {
  // Per 64-position tile pair of a KV head: K 64·d_h bytes + d_h fp32 channel scales (padded to
  // 64 bytes), V 64·d_h bytes + 64 fp32 row scales; plus one open fp32 K tile per (layer,
  // sequence, KV head).
  const auto pair = [](std::uint64_t dh) { return 128 * dh + (4 * dh + 63) / 64 * 64 + 256; };
  for (DType dt : kQuantTypes) {
    KVCache c({4, 3, 8, 64, 256, dt, 0, 0});
    EXPECT_EQ(c.storage_bytes(), 4u * 3 * 8 * (256 / 64) * pair(64) + 4u * 3 * 8 * 64 * 64 * 4);
    EXPECT_GE(c.memory_bytes(), c.storage_bytes());
    EXPECT_LE(c.memory_bytes() - c.storage_bytes(), 1024u);
    KVCache paged({2, 4, 2, 20, 1000, dt, 128, 10});
    EXPECT_EQ(paged.storage_bytes(), 2u * 10 * 2 * 2 * pair(20) + 2u * 4 * 2 * 64 * 20 * 4);
    // The shape (H_kv = 8, d_h = 128) at T_k = 32768: ≤ 0.53 of a bf16 cache's bytes
    // (target 0.56), the open tiles included.
    KVCache q({1, 1, 8, 128, 32768, dt, 0, 0}), bf({1, 1, 8, 128, 32768, DType::bf16, 0, 0});
    EXPECT_LE(static_cast<double>(q.memory_bytes()) / static_cast<double>(bf.memory_bytes()), 0.53);
    // Decode bytes: what is read (SPEC "Quantized KV cache"): closed K tiles' elements and channel
    // scales, the open tile's fp32 keys, V elements plus row scales.
    std::vector<float> kv(100 * 8 * 128, 0.5f);
    q.append(0, 0, ConstTensorView::bthd(kv.data(), 1, 100, 8, 128),
             ConstTensorView::bthd(kv.data(), 1, 100, 8, 128));
    EXPECT_EQ(decode_bytes(q, 0, 0, 1), 8u * (64 * 128 + 512 + 36 * 128 * 4 + 100 * (128 + 4)));
    EXPECT_EQ(decode_bytes(q, 0, 0, 1, 10, 1), 8u * (10 * 128 * 4 + 10 * (128 + 4)));
    EXPECT_EQ(decode_bytes(q, 0, 0, 1, 40, 1),
              8u * (4 * 128 + 512 + 36 * 128 * 4 + 40 * (128 + 4)));
  }
  KVCache q({1, 1, 2, 16, 64, DType::int8, 0, 0});
  EXPECT_STREQ(to_string(DType::int8), "int8");
  EXPECT_STREQ(to_string(DType::fp8_e4m3), "fp8_e4m3");
  EXPECT_EQ(size_of(DType::int8), 1u);
  EXPECT_EQ(size_of(DType::fp8_e4m3), 1u);
}

// Truncate / release / reset zero the dropped rows' elements and scales: the storage equals that
// of a cache that never held them; paged blocks return to the pool.
TEST(KVQuant, TruncateReleaseResetLikeNeverAppended) {
  std::mt19937_64 rng(4);
  const auto real = test_rows(200 * 2, 16, rng), draft = test_rows(200 * 2, 16, rng);
  const auto put = [](KVCache& c, std::int64_t l, std::int64_t s, const std::vector<float>& x,
                      std::int64_t t0, std::int64_t n) {
    const auto view = ConstTensorView::bthd(x.data() + t0 * 2 * 16, 1, n, 2, 16);
    c.append(l, s, view, view);
  };
  for (DType dt : kQuantTypes)
    for (std::int64_t block : {0, 64})
      for (std::int64_t window : {0, 100}) {
        SCOPED_TRACE(std::string(to_string(dt)) + " block=" + std::to_string(block) +
                     " window=" + std::to_string(window));
        KVCache a({2, 2, 2, 16, 200, dt, block, 0, window});
        KVCache b({2, 2, 2, 16, 200, dt, block, 0, window});
        for (KVCache* c : {&a, &b})
          for (std::int64_t l = 0; l < 2; ++l) {
            put(*c, l, 0, real, 0, 60);
            put(*c, l, 1, real, 0, 10);
          }
        // Draft tokens inside the open tile (the tile does not close: see
        // TruncateIntoAClosedTileReopensIt for one that does).
        for (std::int64_t l = 0; l < 2; ++l) put(a, l, 0, draft, 60, 3);
        a.truncate(0, 60);
        for (KVCache* c : {&a, &b})
          for (std::int64_t l = 0; l < 2; ++l) put(*c, l, 0, real, 60, 5);
        EXPECT_EQ(a.length(0, 1), 65);
        EXPECT_EQ(a.free_blocks(), b.free_blocks());
        if (block == 0) {
          EXPECT_EQ(0, std::memcmp(a.raw_storage().data(), b.raw_storage().data(),
                                   a.raw_storage().size()));
        }
        for (std::int64_t p = 0; p < 65; ++p)
          for (bool value : {false, true}) {
            const StoredRow ra = stored_row(a, 1, 0, p, 1, value),
                            rb = stored_row(b, 1, 0, p, 1, value);
            ASSERT_EQ(ra.q, rb.q);
            ASSERT_EQ(ra.delta, rb.delta);
            ASSERT_EQ(ra.deltas, rb.deltas);
            ASSERT_EQ(ra.staged, rb.staged);
          }
        a.release(1);
        EXPECT_FALSE(a.active(1));
        a.reset();
        EXPECT_TRUE(a.active(1));
        EXPECT_EQ(a.length(0, 1), 0);
        for (std::byte x : a.raw_storage()) ASSERT_EQ(x, std::byte{0});
      }
}

// ---- errors: typed, the argument named, the cache unchanged byte for byte ----

struct Snapshot {
  std::vector<std::byte> bytes;
  std::vector<std::int64_t> lengths;
  std::int64_t free_blocks;
  explicit Snapshot(const KVCache& c)
      : bytes(c.raw_storage().begin(), c.raw_storage().end()), free_blocks(c.free_blocks()) {
    for (std::int64_t l = 0; l < c.config().layers; ++l)
      for (std::int64_t b = 0; b < c.config().batch; ++b) {
        lengths.push_back(c.length(b, l));
        lengths.push_back(c.first_position(b, l));
      }
  }
  bool operator==(const Snapshot&) const = default;
};

template <class Err, class F>
void expect_rejected(const KVCache& c, F&& f, ErrorCode code, const std::string& needle) {
  const Snapshot before(c);
  try {
    f();
    ADD_FAILURE() << "no error thrown; expected one mentioning '" << needle << "'";
  } catch (const Err& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
  EXPECT_TRUE(Snapshot(c) == before) << "cache changed by a failing call (" << needle << ")";
}

TEST(KVQuantErrors, NonFiniteRowsAreRefusedAndNothingIsAppended) {
  std::mt19937_64 rng(5);
  const std::int64_t H = 2, D = 16, T = 70;
  for (DType dt : kQuantTypes)
    for (std::int64_t block : {0, 64}) {
      KVCache c({1, 3, H, D, 200, dt, block, 0});
      const auto base = test_rows(3 * T * H, D, rng);
      c.append(0, 0, ConstTensorView::bthd(base.data(), 1, 10, H, D),
               ConstTensorView::bthd(base.data(), 1, 10, H, D));
      const float bad_values[] = {std::numeric_limits<float>::quiet_NaN(), INFINITY, -INFINITY};
      for (float bad : bad_values)
        for (bool in_v : {false, true})
          for (std::int64_t at : {std::int64_t{0}, 3 * T * H * D - 1, T * H * D + 5}) {
            std::vector<float> k = base, v = base;
            (in_v ? v : k)[static_cast<std::size_t>(at)] = bad;
            expect_rejected<ArgumentError>(
                c,
                [&] {
                  c.append(0, 0, ConstTensorView::bthd(k.data(), 3, T, H, D),
                           ConstTensorView::bthd(v.data(), 3, T, H, D));
                },
                ErrorCode::invalid_argument, in_v ? "KVCache::append: v[" : "KVCache::append: k[");
          }
      // Wrong dtype or width of the rows.
      std::vector<float> ok = base;
      ConstTensorView bf = ConstTensorView::bthd(ok.data(), 1, 4, H, D);
      bf.dtype = DType::bf16;
      expect_rejected<UnsupportedError>(
          c, [&] { c.append(0, 0, bf, bf); }, ErrorCode::unsupported, "k has dtype bf16");
      const auto narrow = ConstTensorView::bthd(ok.data(), 1, 4, H, D - 1);
      expect_rejected<ArgumentError>(
          c, [&] { c.append(0, 0, narrow, narrow); }, ErrorCode::shape_mismatch, "d_h");
      // Truncating below zero (or beyond the length).
      expect_rejected<ArgumentError>(
          c, [&] { c.truncate(0, -1); }, ErrorCode::invalid_argument,
          "new_length must be in [0, 10]");
      expect_rejected<ArgumentError>(
          c, [&] { c.truncate(0, 11); }, ErrorCode::invalid_argument, "new_length");
    }
}

TEST(KVQuantErrors, BadConfigDtypeNamesTheCacheTypes) {
  for (DType dt : {DType::i32, DType::boolean, static_cast<DType>(42)}) {
    try {
      KVCache c({1, 1, 1, 16, 64, dt, 0, 0});
      ADD_FAILURE() << "accepted dtype " << static_cast<int>(dt);
    } catch (const ArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("f32, bf16, f16, int8 or fp8_e4m3"), std::string::npos)
          << e.what();
    }
  }
}

// The layer refuses K/V rows a quantized cache cannot store before anything is appended (also
// when a rolling cache appends in several pieces).
TEST(KVQuantErrors, LayerPrefillWithNonFiniteKVLeavesCacheUnchanged) {
  LayerConfig cfg;
  cfg.d_model = 32;
  cfg.heads_q = 4;
  cfg.heads_kv = 2;
  cfg.head_dim = 8;
  cfg.attention.window = 20;
  CausalSelfAttention layer(cfg);
  layer.init_random(3);
  std::mt19937_64 rng(6);
  std::normal_distribution<float> dist;
  for (DType dt : kQuantTypes)
    for (std::int64_t window : {0, 20}) {
      KVCache c({1, 1, 2, 8, 400, dt, 0, 0, window});
      std::vector<float> u(150 * 32), out(u.size());
      for (float& x : u) x = dist(rng);
      layer.prefill(std::span(u).first(10 * 32), 1, 10, c, 0, std::span(out).first(10 * 32));
      // The 141st token: in the second piece of 109 on the rolling cache (R = 128, W = 20).
      u[140 * 32 + 3] = std::numeric_limits<float>::quiet_NaN();
      expect_rejected<ArgumentError>(
          c, [&] { layer.prefill(u, 1, 150, c, 0, out); }, ErrorCode::invalid_argument,
          "CausalSelfAttention::prefill: k[");
    }
}

// ---- decode against the float64 oracle over the dequantized cache (cache_oracle) ----

struct QuantCase {
  std::vector<std::int64_t> lengths;
  std::int64_t tnew, hq, hkv, dh;
};

std::vector<QuantCase> quant_cases() {
  std::vector<QuantCase> cases;
  for (std::int64_t L : {1, 63, 64, 65, 1023, 1025, 2100})
    cases.push_back({{L, L / 2 + 1}, 1, 8, 2, 64});
  cases.push_back({{1025, 130}, 3, 8, 2, 64});
  for (std::int64_t g : {1, 4, 8}) cases.push_back({{700, 65}, 2, 2 * g, 2, 32});
  cases.push_back({{300, 129}, 3, 4, 1, 40});
  cases.push_back({{200, 64}, 4, 6, 3, 7});
  // d_h < 4: an int8 cache in quads has no quad features, only its d_h % 4 tail rows.
  for (std::int64_t dh : {1, 3}) cases.push_back({{130, 65}, 2, 8, 2, dh});
  cases.push_back({{2, 1}, 4, 4, 2, 16});  // T_new > L: leading rows see no key
  return cases;
}

// Fills sequences b of `layer` with lengths[b] rows of N(0,1) (outlier channels ×30 in every
// sixth row), appended in pieces (offsets across tiles and blocks), sequences interleaved.
void fill(KVCache& c, std::int64_t layer, const std::vector<std::int64_t>& lengths,
          std::mt19937_64& rng) {
  const std::int64_t H = c.config().heads_kv, D = c.config().head_dim;
  const std::int64_t pieces[] = {1, 37, 200, 5, 900, 64};
  std::vector<std::int64_t> done(lengths.size(), 0);
  for (int round = 0;; ++round) {
    bool any = false;
    for (std::size_t b = 0; b < lengths.size(); ++b) {
      const std::int64_t n = std::min(pieces[round % 6], lengths[b] - done[b]);
      if (n <= 0) continue;
      any = true;
      const auto k = test_rows(n * H, D, rng), v = test_rows(n * H, D, rng);
      c.append(layer, static_cast<std::int64_t>(b), ConstTensorView::bthd(k.data(), 1, n, H, D),
               ConstTensorView::bthd(v.data(), 1, n, H, D));
      done[b] += n;
    }
    if (!any) break;
  }
}

// Window W, soft-capping 5, and an ALiBi slope and a sink per query head: the decode options and
// the oracle's (the options point into slopes and sinks: not copied).
struct VariantOptions {
  std::vector<float> slopes, sinks;
  DecodeOptions o;
  reference::Options ro;
  VariantOptions(std::int64_t hq, std::int64_t W) {
    for (std::int64_t h = 0; h < hq; ++h) {
      slopes.push_back(0.01f * static_cast<float>(h + 1));
      sinks.push_back(0.3f * static_cast<float>(h) - 1.0f);
    }
    o.window = ro.window = W;
    o.softcap = ro.softcap = 5.0;
    o.alibi_slopes = ConstTensorView{slopes.data(), DType::f32, 1, {hq, 1, 1, 1}, {1, 0, 0, 0}};
    o.sinks = ConstTensorView{sinks.data(), DType::f32, 1, {hq, 1, 1, 1}, {1, 0, 0, 0}};
    ro.alibi_slopes.assign(slopes.begin(), slopes.end());
    ro.sinks.assign(sinks.begin(), sinks.end());
  }
  VariantOptions(const VariantOptions&) = delete;
  VariantOptions& operator=(const VariantOptions&) = delete;
};

// A `dt` cache (rolling over var's window, or full) of two sequences (1500 and 700 tokens) in
// `layer`, queries of T_new `tnew` with var's heads: decode(q, cache, out, lse) against the oracle.
template <class Decode>
void expect_variants_match_oracle(const QuantReading& reading, bool rolling, std::int64_t layer,
                                  std::int64_t hkv, std::int64_t dh, std::int64_t tnew,
                                  const VariantOptions& var, std::mt19937_64& rng, Decode decode) {
  const std::int64_t hq = static_cast<std::int64_t>(var.slopes.size()), W = *var.ro.window;
  KVCache cache(read_as(
      {layer + 1, 2, hkv, dh, 3000, reading.dt, rolling ? 64 : 0, 0, rolling ? W : 0}, reading));
  fill(cache, layer, {1500, 700}, rng);
  StridedTensor q(2, tnew, hq, dh, Layout::bhtd);
  q.fill_random(rng);
  std::vector<reference::ForwardResult> refs;
  for (std::int64_t b = 0; b < 2; ++b) refs.push_back(cache_oracle(q, b, cache, layer, var.ro));
  StridedTensor out(2, tnew, hq, dh, Layout::strided);
  std::vector<float> lse(static_cast<std::size_t>(2 * hq * tnew), kPoison);
  decode(q, cache, out, lse);
  expect_decode_matches(out, lse, refs);
}

class KVQuantDecode : public PerIsaTest {};

TEST_P(KVQuantDecode, MatchesFloat64OracleOverDequantizedCache) {
  std::mt19937_64 rng(2024);
  for (const QuantCase& qc : quant_cases())
    for (const QuantReading& reading : kQuantReadings)
      for (std::int64_t block : {0, 128}) {
        const DType dt = reading.dt;
        const ScopedEnv widen("TOKENMIX_FP8_WIDEN", reading.fp8_widen);
        SCOPED_TRACE(std::string("reading=") + reading.fp8_widen + layout_name(reading) + " L0=" +
                     std::to_string(qc.lengths[0]) + " L1=" + std::to_string(qc.lengths[1]) +
                     " T_new=" + std::to_string(qc.tnew) + " H_q=" + std::to_string(qc.hq) +
                     " H_kv=" + std::to_string(qc.hkv) + " d_h=" + std::to_string(qc.dh) +
                     " dtype=" + to_string(dt) + " block=" + std::to_string(block));
        const std::int64_t B = static_cast<std::int64_t>(qc.lengths.size());
        KVCache cache(read_as({2, B, qc.hkv, qc.dh, 2200, dt, block, 0}, reading));
        fill(cache, 1, qc.lengths, rng);
        StridedTensor q(B, qc.tnew, qc.hq, qc.dh, Layout::strided);
        q.fill_random(rng);
        std::vector<reference::ForwardResult> refs;
        for (std::int64_t b = 0; b < B; ++b) refs.push_back(cache_oracle(q, b, cache, 1));
        StridedTensor out(B, qc.tnew, qc.hq, qc.dh, Layout::bthd);  // poisoned (NaN)
        std::vector<float> lse(static_cast<std::size_t>(B * qc.hq * qc.tnew), kPoison);
        DecodeOptions o;
        o.isa = GetParam();
        attention_decode(q.view, cache, 1, out.view, TensorView::bht(lse.data(), B, qc.hq, qc.tnew),
                         o);
        expect_decode_matches(out, lse, refs);
      }
}

// Window, soft-capping, ALiBi and sinks on a quantized cache (the kernels apply them to the
// dequantized scores exactly as for the other dtypes), and a rolling cache.
TEST_P(KVQuantDecode, VariantsAndRollingCacheMatchOracle) {
  std::mt19937_64 rng(77);
  const std::int64_t hq = 8, hkv = 2, dh = 40, tnew = 3, W = 300;
  VariantOptions var(hq, W);
  var.o.isa = GetParam();
  for (const QuantReading& reading : kQuantReadings)
    for (std::int64_t rolling : {0, 1}) {
      const DType dt = reading.dt;
      const ScopedEnv widen("TOKENMIX_FP8_WIDEN", reading.fp8_widen);
      SCOPED_TRACE(std::string(to_string(dt)) + " " + reading.fp8_widen + layout_name(reading) +
                   (rolling ? " rolling" : " full"));
      expect_variants_match_oracle(reading, rolling != 0, 0, hkv, dh, tnew, var, rng,
                                   [&](const StridedTensor& q, const KVCache& cache,
                                       StridedTensor& out, std::vector<float>& lse) {
                                     attention_decode(q.view, cache, 0, out.view,
                                                      TensorView::bht(lse.data(), 2, hq, tnew),
                                                      var.o);
                                   });
    }
}

// An int8 cache in rows and one in quads (KVCacheConfig::int8_quads) hold the same q and scales,
// and every path reads each element's products in the same order from either: the same bits,
// over tile edges, d_h tails (37: a tail after the quads; 3 and 1: no quad features, the tail
// alone) and T_new of the regular and tall blocks.
// The default follows the CPU: quads where it has AMX-INT8 (after TOKENMIX_CPU_CAP).
TEST_P(KVQuantDecode, Int8RowsAndQuadsSameBits) {
  std::mt19937_64 rng(4242);
  for (const std::int64_t dh : {64, 37, 3, 1})
    for (const std::int64_t tnew : {1, 2, 5}) {
      SCOPED_TRACE("d_h=" + std::to_string(dh) + " T_new=" + std::to_string(tnew));
      const std::int64_t hq = 8, hkv = 2;
      KVCache rows({1, 2, hkv, dh, 400, DType::int8, 0, 0, 0, false});
      KVCache quads({1, 2, hkv, dh, 400, DType::int8, 0, 0, 0, true});
      EXPECT_FALSE(rows.int8_quads());
      EXPECT_TRUE(quads.int8_quads());
      for (std::int64_t seq = 0; seq < 2; ++seq) {
        const std::int64_t n = seq == 0 ? 333 : 64;
        StridedTensor k(1, n, hkv, dh, Layout::bthd), v(1, n, hkv, dh, Layout::bthd);
        k.fill_random(rng);
        v.fill_random(rng);
        rows.append(0, seq, k.view, v.view);
        quads.append(0, seq, k.view, v.view);
      }
      StridedTensor q(2, tnew, hq, dh, Layout::bthd);
      q.fill_random(rng);
      const std::vector<reference::ForwardResult> refs = {cache_oracle(q, 0, rows, 0),
                                                          cache_oracle(q, 1, rows, 0)};
      std::vector<std::vector<float>> outs, lses;
      for (const KVCache* cache : {&rows, &quads}) {
        StridedTensor out(2, tnew, hq, dh, Layout::bthd);  // poisoned (NaN)
        std::vector<float> lse(static_cast<std::size_t>(2 * hq * tnew), kPoison);
        DecodeOptions o;
        o.isa = GetParam();
        const ScopedEnv amx("TOKENMIX_DECODE_AMX", "off");  // FMA products on both layouts
        attention_decode(q.view, *cache, 0, out.view, TensorView::bht(lse.data(), 2, hq, tnew), o);
        expect_decode_matches(out, lse, refs);
        outs.push_back(out.storage);
        lses.push_back(lse);
      }
      EXPECT_EQ(0, std::memcmp(outs[0].data(), outs[1].data(), outs[0].size() * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(lses[0].data(), lses[1].data(), lses[0].size() * sizeof(float)));
    }
  // Unset: rows, whatever the CPU (the layout follows the config: one layout on every machine).
  KVCache automatic({1, 1, 1, 64, 64, DType::int8, 0, 0});
  EXPECT_FALSE(automatic.int8_quads());
  KVCache fp8({1, 1, 1, 64, 64, DType::fp8_e4m3, 0, 0});
  EXPECT_FALSE(fp8.int8_quads());
}

// The chunk split and merge order do not depend on the thread count: bitwise identical results.
TEST_P(KVQuantDecode, BitwiseIdenticalAcrossThreadCounts) {
  std::mt19937_64 rng(7);
  for (const QuantReading& reading : kQuantReadings) {
    const DType dt = reading.dt;
    const ScopedEnv widen("TOKENMIX_FP8_WIDEN", reading.fp8_widen);
    KVCache cache(read_as({1, 2, 1, 64, 4500, dt, 0, 0}, reading));
    fill(cache, 0, {4500, 1500}, rng);
    StridedTensor q(2, 2, 8, 64, Layout::bthd);
    q.fill_random(rng);
    std::vector<std::vector<float>> outs, lses;
    for (int threads : {1, 2, 3, 5}) {
      StridedTensor out(2, 2, 8, 64, Layout::bthd);
      std::vector<float> lse(2 * 8 * 2, kPoison);
      DecodeOptions o;
      o.isa = GetParam();
      o.threads = threads;
      attention_decode(q.view, cache, 0, out.view, TensorView::bht(lse.data(), 2, 8, 2), o);
      outs.push_back(out.storage);
      lses.push_back(lse);
    }
    for (std::size_t i = 1; i < outs.size(); ++i) {
      EXPECT_EQ(0, std::memcmp(outs[0].data(), outs[i].data(), outs[0].size() * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(lses[0].data(), lses[i].data(), lses[0].size() * sizeof(float)));
    }
  }
}

// ---- K per channel over closed 64-position tiles: the edge cases (SPEC "Quantized KV cache";
// docs/design.md, "Quantized caches") ----

// Appends keys [from, to) of sequence `seq` of `layer` in pieces of the sizes `pieces` cycles
// through (tiles close inside a piece, at its end, or not at all). K: the real-keys profile
// (testkit::apply_real_keys: outlier channels, per-channel offsets, massive tokens) with channel 2
// all zeros (if d_h > 2); V: N(0, 1). k and v hold the sequence's rows [T][H_kv][d_h].
void append_real(KVCache& c, std::int64_t layer, std::int64_t seq, const std::vector<float>& k,
                 const std::vector<float>& v, std::int64_t from, std::int64_t to) {
  const std::int64_t H = c.config().heads_kv, D = c.config().head_dim;
  const std::int64_t pieces[] = {1, 37, 64, 5, 90, 63};
  for (std::int64_t t = from, i = 0; t < to; ++i) {
    const std::int64_t n = std::min(pieces[i % 6], to - t);
    c.append(layer, seq, ConstTensorView::bthd(k.data() + t * H * D, 1, n, H, D),
             ConstTensorView::bthd(v.data() + t * H * D, 1, n, H, D));
    t += n;
  }
}
std::pair<std::vector<float>, std::vector<float>> real_rows(std::int64_t T, std::int64_t H,
                                                            std::int64_t D, std::uint64_t seed) {
  std::vector<float> k = testkit::random_normal(static_cast<std::size_t>(T * H * D), seed);
  testkit::apply_real_keys(k, T, H, D, seed + 1);
  for (std::int64_t r = 0; D > 2 && r < T * H; ++r) k[static_cast<std::size_t>(r * D + 2)] = 0.0f;
  return {k, testkit::random_normal(k.size(), seed + 2)};
}

// Decode of q over `layer` on this path with 1, 2 and 3 threads: each matches the oracle over the
// values the cache holds, and all give the same bits.
void expect_decode_per_spec(Isa isa, const StridedTensor& q, const KVCache& cache,
                            std::int64_t layer, const DecodeOptions& base = {},
                            const reference::Options& ro = {}) {
  const std::int64_t B = q.view.shape[0], T = q.view.shape[1], H = q.view.shape[2],
                     D = q.view.shape[3];
  std::vector<reference::ForwardResult> refs;
  for (std::int64_t b = 0; b < B; ++b) refs.push_back(cache_oracle(q, b, cache, layer, ro));
  std::vector<float> first_out, first_lse;
  for (int threads : {1, 2, 3}) {
    SCOPED_TRACE("threads=" + std::to_string(threads));
    StridedTensor out(B, T, H, D, Layout::bthd);  // poisoned (NaN)
    std::vector<float> lse(static_cast<std::size_t>(B * H * T), kPoison);
    DecodeOptions o = base;
    o.isa = isa;
    o.threads = threads;
    attention_decode(q.view, cache, layer, out.view, TensorView::bht(lse.data(), B, H, T), o);
    expect_decode_matches(out, lse, refs);
    if (threads == 1) {
      first_out = out.storage;
      first_lse = lse;
      continue;
    }
    EXPECT_EQ(0, std::memcmp(first_out.data(), out.storage.data(), out.storage.size() * 4));
    EXPECT_EQ(0, std::memcmp(first_lse.data(), lse.data(), lse.size() * 4));
  }
}

// Lengths around the tile (1, 63: the open tile alone; 64: one closed tile, none open; 65, 129:
// closed tiles and an open one of one key), GQA ratios 1, 3 and 4, odd and even head widths, an
// all-zero channel (δ = 0: zeros), the real-keys profile, every reading, contiguous and paged,
// 1–3 threads (the same bits).
TEST_P(KVQuantDecode, PerChannelTilesAcrossTileEdges) {
  struct Shape {
    std::int64_t hq, hkv, dh;
  };
  std::uint64_t seed = 100;
  for (const QuantReading& reading : kQuantReadings)
    for (const Shape sh : {Shape{2, 2, 7}, Shape{6, 2, 37}, Shape{8, 2, 64}, Shape{4, 1, 128}})
      for (const std::int64_t L : {1, 63, 64, 65, 129})
        for (const std::int64_t block : {0, 64}) {
          const ScopedEnv widen("TOKENMIX_FP8_WIDEN", reading.fp8_widen);
          SCOPED_TRACE(std::string(to_string(reading.dt)) + " " + reading.fp8_widen +
                       layout_name(reading) + " L=" + std::to_string(L) +
                       " H_q=" + std::to_string(sh.hq) + " H_kv=" + std::to_string(sh.hkv) +
                       " d_h=" + std::to_string(sh.dh) + " block=" + std::to_string(block));
          KVCache cache(read_as({1, 2, sh.hkv, sh.dh, 200, reading.dt, block, 0}, reading));
          const std::int64_t lengths[] = {L, L == 1 ? 64 : L - 1};
          for (std::int64_t b = 0; b < 2; ++b) {
            const auto [k, v] = real_rows(lengths[b], sh.hkv, sh.dh, ++seed);
            append_real(cache, 0, b, k, v, 0, lengths[b]);
          }
          for (const std::int64_t tnew : {1, 3}) {
            std::mt19937_64 rng(++seed);
            StridedTensor q(2, tnew, sh.hq, sh.dh, Layout::strided);
            q.fill_random(rng);
            expect_decode_per_spec(GetParam(), q, cache, 0);
          }
        }
}

// A rolling cache (W = 100: R = 192 slots) whose ring reuses the slots of a closed tile: the new
// positions' K waits in the open tile (staging) while the old tile's keys that are still held
// keep their K tile and scales, and a decode that sees both (T_new = R − W + 1 = 93: the first
// query's window starts at first_position) reads each from its own place; then the open tile
// closes over the old tile's slots. Also an append of more than R positions at once (the tile of
// the first position kept is written whole), and the same on a paged ring.
TEST_P(KVQuantDecode, RollingRingOverClosedTiles) {
  std::uint64_t seed = 300;
  for (const QuantReading& reading : kQuantReadings)
    for (const std::int64_t block : {0, 64}) {
      const ScopedEnv widen("TOKENMIX_FP8_WIDEN", reading.fp8_widen);
      SCOPED_TRACE(std::string(to_string(reading.dt)) + " " + reading.fp8_widen +
                   layout_name(reading) + " block=" + std::to_string(block));
      const std::int64_t hq = 8, hkv = 2, dh = 40, W = 100;
      KVCache cache(read_as({1, 2, hkv, dh, 100000, reading.dt, block, 0, W}, reading));
      ASSERT_EQ(cache.retained_positions(), 192);
      const auto [k0, v0] = real_rows(600, hkv, dh, ++seed);
      const auto [k1, v1] = real_rows(600, hkv, dh, ++seed);
      DecodeOptions o;
      reference::Options ro;
      o.window = ro.window = W;
      const auto check = [&](std::int64_t tnew) {
        std::mt19937_64 rng(++seed);
        StridedTensor q(2, tnew, hq, dh, Layout::bthd);
        q.fill_random(rng);
        expect_decode_per_spec(GetParam(), q, cache, 0, o, ro);
      };
      // 250 and 200 positions: open tiles [192, 250) and [192, 200) in the slots of the closed
      // tile [0, 64), whose positions from 58 and 8 are still held.
      append_real(cache, 0, 0, k0, v0, 0, 250);
      append_real(cache, 0, 1, k1, v1, 0, 200);
      EXPECT_EQ(cache.first_position(0, 0), 58);
      EXPECT_EQ(cache.first_position(1, 0), 8);
      check(93);
      check(1);
      // 256: the open tile closes over [0, 64)'s slots; 260: that and a new open tile.
      append_real(cache, 0, 0, k0, v0, 250, 256);
      append_real(cache, 0, 1, k1, v1, 200, 260);
      check(93);
      check(2);
      // 600 positions at once into a reset sequence (only its last R are held).
      cache.reset(1);
      cache.append(0, 1, ConstTensorView::bthd(k1.data(), 1, 600, hkv, dh),
                   ConstTensorView::bthd(v1.data(), 1, 600, hkv, dh));
      EXPECT_EQ(cache.first_position(1, 0), 408);
      check(93);
    }
}

// truncate into a closed tile reopens it: the keys it keeps are held as their dequantized values
// c · δ_{τ,e} (fp32: within 2^-24) in the open tile, and when the tile closes again it is quantized
// from them and the new keys with new channel scales (each kept key within half a new step of its
// value). A truncate to a tile edge keeps the closed tiles as they are, and one inside the open
// tile keeps its staged keys as they were appended. Decode matches the oracle after each.
TEST_P(KVQuantDecode, TruncateIntoAClosedTileReopensIt) {
  std::uint64_t seed = 500;
  for (const QuantReading& reading : kQuantReadings)
    for (const std::int64_t block : {0, 64}) {
      const ScopedEnv widen("TOKENMIX_FP8_WIDEN", reading.fp8_widen);
      SCOPED_TRACE(std::string(to_string(reading.dt)) + " " + reading.fp8_widen +
                   layout_name(reading) + " block=" + std::to_string(block));
      const std::int64_t hq = 6, hkv = 2, dh = 24;
      KVCache cache(read_as({1, 2, hkv, dh, 400, reading.dt, block, 0}, reading));
      const auto [k0, v0] = real_rows(300, hkv, dh, ++seed);
      const auto [k1, v1] = real_rows(300, hkv, dh, ++seed);
      append_real(cache, 0, 0, k0, v0, 0, 150);
      append_real(cache, 0, 1, k1, v1, 0, 130);
      const auto keys = [&](std::int64_t from, std::int64_t to) {
        std::vector<std::vector<double>> x;
        for (std::int64_t p = from; p < to; ++p)
          for (std::int64_t h = 0; h < hkv; ++h) x.push_back(cached_row(cache, 0, 0, p, h, false));
        return x;
      };
      const auto check = [&](std::int64_t tnew) {
        std::mt19937_64 rng(++seed);
        StridedTensor q(2, tnew, hq, dh, Layout::bthd);
        q.fill_random(rng);
        expect_decode_per_spec(GetParam(), q, cache, 0);
      };
      // Inside the open tile [128, 150): its kept keys as appended, bit for bit.
      const auto before = keys(0, 140);
      cache.truncate(0, 140);
      EXPECT_EQ(keys(0, 140), before);
      check(3);
      // To a tile edge: the closed tiles as they were.
      cache.truncate(0, 128);
      EXPECT_EQ(keys(0, 128),
                std::vector<std::vector<double>>(before.begin(), before.begin() + 128 * hkv));
      // Into the closed tile [64, 128): it reopens with its 36 kept keys' values.
      cache.truncate(0, 100);
      const auto reopened = keys(64, 100);
      for (std::size_t i = 0; i < reopened.size(); ++i) {
        const std::int64_t p = 64 + static_cast<std::int64_t>(i) / hkv;
        const std::int64_t h = static_cast<std::int64_t>(i) % hkv;
        ASSERT_TRUE(stored_row(cache, 0, 0, p, h, false).open) << "position " << p;
        for (std::int64_t e = 0; e < dh; ++e) {
          const double was = before[64 * hkv + i][static_cast<std::size_t>(e)];
          ASSERT_LE(std::fabs(reopened[i][static_cast<std::size_t>(e)] - was),
                    0x1.0p-24 * std::fabs(was))
              << "position " << p << " channel " << e;
        }
      }
      EXPECT_EQ(keys(0, 64),
                std::vector<std::vector<double>>(before.begin(), before.begin() + 64 * hkv));
      check(1);
      check(3);
      // The tile closes again (new keys [100, 128)) and a new one opens: the kept keys within half
      // a step of the re-quantized tile (int8; E4M3's spacing for fp8).
      append_real(cache, 0, 0, k1, v1, 100, 140);
      const auto closed = keys(64, 100);
      for (std::size_t i = 0; i < closed.size(); ++i) {
        const std::int64_t p = 64 + static_cast<std::int64_t>(i) / hkv;
        const std::int64_t h = static_cast<std::int64_t>(i) % hkv;
        const StoredRow r = stored_row(cache, 0, 0, p, h, false);
        ASSERT_FALSE(r.open);
        for (std::int64_t e = 0; e < dh; ++e) {
          const double x = reopened[i][static_cast<std::size_t>(e)];
          const double delta = r.deltas[static_cast<std::size_t>(e)];
          const double tol = reading.dt == DType::int8
                                 ? 0.5 * delta * (1 + 4e-5)
                                 : 0x1.0p-4 * std::fabs(x) + 0x1.0p-10 * delta;
          ASSERT_LE(std::fabs(closed[i][static_cast<std::size_t>(e)] - x), tol)
              << "position " << p << " channel " << e;
        }
      }
      check(1);
      check(3);
      // To 0 and again: like a fresh sequence.
      cache.truncate(0, 0);
      append_real(cache, 0, 0, k0, v0, 0, 70);
      check(2);
    }
}

// fp8 E4M3 read directly as fp32 bits (subnormal fp32 for the subnormal codes, scale·Q
// prescaled by 2^sh, the unit 2^−120 folded into the scales; simd/decode_reader_fp8-inl.h)
// gives the same bits as the f16 reading wherever no product is subnormal, and both match the
// oracle: on caches whose elements span 2^−14 of their row's largest (about one code in eight
// subnormal), over shapes across tile edges, d_h tails and the tall blocking (T_new > 1; on AVX2
// units whose row blocks hold more than 4 rows convert each tile to bf16 words first: 20, 52, 64
// and 128 rows, d_h 40, 7, 72 and 24). And its
// guards: a tile whose V scales reach 2^7 (rows ×2·10^5 in keys [64, 128)) and queries whose
// largest |scale·q| is outside [2^−60, 2^61) (×1e−20, ×3e20) are read through f16 bits — the
// same bits again — and so is every unit of a call whose workers flush subnormals (MXCSR DAZ and
// FTZ, as under -ffast-math or torch.set_flush_denormal(True)), where the direct reading would
// take the subnormal codes for 0.
// MXCSR's DAZ and FTZ set (subnormal operands read as 0, subnormal results flushed) on the
// calling thread and on each thread of an OpenMP team of `threads` (the pool the next parallel
// region of that size reuses) for one scope, cleared again after (x86; elsewhere no MXCSR:
// kSupported is false and nothing is set).
class ScopedFlushSubnormals {
 public:
#if defined(__x86_64__)
  static constexpr bool kSupported = true;
#else
  static constexpr bool kSupported = false;
#endif
  ScopedFlushSubnormals(bool on, int threads) : on_(on && kSupported), threads_(threads) {
    if (on_) set(true);
  }
  ~ScopedFlushSubnormals() {
    if (on_) set(false);
  }
  ScopedFlushSubnormals(const ScopedFlushSubnormals&) = delete;
  ScopedFlushSubnormals& operator=(const ScopedFlushSubnormals&) = delete;

 private:
  void set([[maybe_unused]] bool flush) const {
#if defined(__x86_64__)
    constexpr unsigned kDazFtz = 0x8040u;
    const auto apply = [flush] {
      _mm_setcsr(flush ? _mm_getcsr() | kDazFtz : _mm_getcsr() & ~kDazFtz);
    };
    apply();
#pragma omp parallel num_threads(threads_)
    apply();
#endif
  }
  bool on_;
  int threads_;
};

void fill_wide_range(KVCache& c, std::int64_t seq, std::int64_t n, std::mt19937_64& rng) {
  const std::int64_t H = c.config().heads_kv, D = c.config().head_dim;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> octave(0, 14);
  std::vector<float> k(static_cast<std::size_t>(n * H * D)), v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = std::ldexp(normal(rng), -octave(rng));
    v[i] = std::ldexp(normal(rng), -octave(rng));
    const std::int64_t u = static_cast<std::int64_t>(i) / (H * D);
    if (u >= 64 && u < 128) v[i] *= 2e5f;  // V scales ≥ 2^7 in that tile
  }
  c.append(0, seq, ConstTensorView::bthd(k.data(), 1, n, H, D),
           ConstTensorView::bthd(v.data(), 1, n, H, D));
}

// The int8 cache's quads read at q · 2^24 only where no product leaves the normal range
// (decode_reader_int8-inl.h): queries scaled by 1e30 (S · 2^24 would overflow), V rows of
// ~1e-33 (δ · 2^−24 subnormal): a whole sequence's, and tiles next to ordinary ones; odd d_h (K's
// tail rows after its quads) and T_new 1–3. Every unit and tile must match the float64 oracle.
TEST_P(KVQuantDecode, Int8QuadsExactOutsideTheFastReadingsRange) {
  std::mt19937_64 rng(1033);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const std::int64_t dh : {64, 37})
    for (const std::int64_t tnew : {1, 3})
      for (const float q_scale : {1.0f, 1e30f}) {
        SCOPED_TRACE("d_h=" + std::to_string(dh) + " T_new=" + std::to_string(tnew) + " q scale " +
                     std::to_string(q_scale));
        const std::int64_t hq = 8, hkv = 2, n = 300;
        KVCache cache(amx_tiles({1, 2, hkv, dh, 400, DType::int8, 0, 0}));  // quads
        for (std::int64_t seq = 0; seq < 2; ++seq) {
          std::vector<float> k(static_cast<std::size_t>(n * hkv * dh)), v(k.size());
          for (std::size_t i = 0; i < k.size(); ++i) {
            k[i] = normal(rng), v[i] = normal(rng);
            const std::int64_t u = static_cast<std::int64_t>(i) / (hkv * dh);
            // Sequence 0: every V row tiny; sequence 1: those of tiles 0 and 2.
            if (seq == 0 || u < 64 || (u >= 128 && u < 150)) v[i] *= 1e-33f;
          }
          cache.append(0, seq, ConstTensorView::bthd(k.data(), 1, n, hkv, dh),
                       ConstTensorView::bthd(v.data(), 1, n, hkv, dh));
        }
        StridedTensor q(2, tnew, hq, dh, Layout::strided);
        q.fill_random(rng);
        for (float& x : q.storage) x *= q_scale;
        const std::vector<reference::ForwardResult> refs = {cache_oracle(q, 0, cache, 0),
                                                            cache_oracle(q, 1, cache, 0)};
        StridedTensor out(2, tnew, hq, dh, Layout::bthd);  // poisoned (NaN)
        std::vector<float> lse(static_cast<std::size_t>(2 * hq * tnew), kPoison);
        DecodeOptions o;
        o.isa = GetParam();
        attention_decode(q.view, cache, 0, out.view, TensorView::bht(lse.data(), 2, hq, tnew), o);
        expect_decode_matches(out, lse, refs);
        // Sequence 0's outputs are ~1e-33: relative to their own largest (decode_errors floors
        // the scale at 1e-30).
        double diff = 0.0, mx = 0.0;
        for (std::int64_t t = 0; t < tnew; ++t)
          for (std::int64_t h = 0; h < hq; ++h)
            for (std::int64_t x = 0; x < dh; ++x) {
              const double got = out.at(0, t, h, x), r = refs[0].out.at(0, t, h, x);
              diff = std::max(diff, std::isnan(got) ? INFINITY : std::fabs(got - r));
              mx = std::max(mx, std::fabs(r));
            }
        EXPECT_GT(mx, 0.0);
        EXPECT_LE(diff, kDecodeBound * mx);
      }
}

TEST_P(KVQuantDecode, Fp8DirectReadingSameBitsAsF16) {
  std::mt19937_64 rng(815);
  struct Shape {
    std::int64_t len, tnew, hq, hkv, dh;
  };
  const Shape shapes[] = {{2100, 1, 8, 2, 128}, {700, 5, 8, 2, 40}, {300, 13, 4, 1, 7},
                          {130, 2, 6, 3, 64},   {64, 1, 4, 4, 16},  {400, 16, 8, 2, 72},
                          {260, 33, 4, 1, 24}};
  std::int64_t subnormal_codes = 0;
  for (const Shape& sh : shapes) {
    KVCache cache({1, 1, sh.hkv, sh.dh, sh.len, DType::fp8_e4m3, 0, 0});
    fill_wide_range(cache, 0, sh.len, rng);
    for (std::int64_t u = 0; u < sh.len; ++u)  // the codes the cache holds (kv_oracle.hpp)
      for (std::int64_t h = 0; h < sh.hkv; ++h)
        for (const bool value : {false, true})
          for (const std::uint8_t b : stored_row(cache, 0, 0, u, h, value).q)
            subnormal_codes += (b & 0x78) == 0 && (b & 0x07) != 0;
    for (const float q_scale : {1.0f, 1e-20f, 3e20f}) {
      SCOPED_TRACE("T_k=" + std::to_string(sh.len) + " T_new=" + std::to_string(sh.tnew) +
                   " H_q=" + std::to_string(sh.hq) + " H_kv=" + std::to_string(sh.hkv) +
                   " d_h=" + std::to_string(sh.dh) + " q scale " + std::to_string(q_scale));
      StridedTensor q(1, sh.tnew, sh.hq, sh.dh, Layout::strided);
      q.fill_random(rng);
      for (float& x : q.storage) x *= q_scale;
      const std::vector<reference::ForwardResult> refs{cache_oracle(q, 0, cache, 0)};
      // One call into out (poisoned: NaN) and lse; the tensors are not copied (views).
      struct Result {
        StridedTensor out;
        std::vector<float> lse;
      };
      const auto run = [&](Result& r, const char* widen, bool flush_subnormals) {
        const ScopedEnv env("TOKENMIX_FP8_WIDEN", widen);
        DecodeOptions o;
        o.isa = GetParam();
        o.threads = 2;
        const ScopedFlushSubnormals flush(flush_subnormals, o.threads);
        attention_decode(q.view, cache, 0, r.out.view,
                         TensorView::bht(r.lse.data(), 1, sh.hq, sh.tnew), o);
      };
      const auto fresh = [&] {
        return Result{StridedTensor(1, sh.tnew, sh.hq, sh.dh, Layout::bthd),
                      std::vector<float>(static_cast<std::size_t>(sh.hq * sh.tnew), kPoison)};
      };
      Result f16 = fresh(), direct = fresh(), flushed = fresh();
      run(f16, "f16", false);
      run(direct, "direct", false);
      expect_decode_matches(f16.out, f16.lse, refs);
      expect_decode_matches(direct.out, direct.lse, refs);
      const auto same_bits = [](const Result& x, const Result& y) {
        return std::memcmp(x.out.storage.data(), y.out.storage.data(),
                           x.out.storage.size() * sizeof(float)) == 0 &&
               std::memcmp(x.lse.data(), y.lse.data(), x.lse.size() * sizeof(float)) == 0;
      };
      EXPECT_TRUE(same_bits(f16, direct));
      if (ScopedFlushSubnormals::kSupported) {
        run(flushed, "direct", true);
        expect_decode_matches(flushed.out, flushed.lse, refs);
        EXPECT_TRUE(same_bits(f16, flushed));
      }
    }
  }
  EXPECT_GT(subnormal_codes, 10000);  // the data this test is for
}

INSTANTIATE_TEST_SUITE_P(AllIsas, KVQuantDecode, AllIsas(), IsaName);

// ---- AMX tile products for the int8, fp8 and bf16 caches (kernels/simd/amx_decode.hpp) ----
// Units of ≥ 16 rows (query positions × the heads of a KV group; int8: from 4; bf16: from 32 rows,
// decode_amx-inl.h AmxProducts::Pays) on the avx512 paths, where the CPU has AMX-INT8 (int8)
// or AMX-BF16 (fp8, bf16) and Linux grants the tile data. With TOKENMIX_DECODE_AMX=on they match
// the float64 oracle over the cached values at the FMA products' bound, and differ from the FMA
// products' bits (the planes' sums are rounded in another order): the tile path ran. Where AMX
// cannot run (another CPU, TOKENMIX_CPU_CAP), forcing it on is refused with UnsupportedError.
class DecodeAmx : public ::testing::TestWithParam<DType> {};

// T_new for a test written for units of 4·tnew rows (g = 4) or more: twice that for bf16, whose
// units take the tiles from 32 rows.
std::int64_t amx_tnew(DType dt, std::int64_t tnew) {
  return dt == DType::bf16 ? 2 * tnew : tnew;
}

// Whether this process can run the tile products for a `dt` cache (decode_amx with the switch
// unset).
bool amx_usable(DType dt) {
  const ScopedEnv unset("TOKENMIX_DECODE_AMX", nullptr);
  return decode_amx(dt);
}

// Where the tile products cannot run: TOKENMIX_DECODE_AMX=on refuses a decode call over a `dt`
// cache that would use them.
void expect_amx_refused(DType dt) {
  std::mt19937_64 rng(4);
  KVCache cache(amx_tiles({1, 1, 1, 64, 100, dt, 0, 0}));
  const auto k = test_rows(80, 64, rng), v = test_rows(80, 64, rng);
  cache.append(0, 0, ConstTensorView::bthd(k.data(), 1, 80, 1, 64),
               ConstTensorView::bthd(v.data(), 1, 80, 1, 64));
  StridedTensor q(1, 4, 4, 64, Layout::bthd), out(1, 4, 4, 64, Layout::bthd);
  q.fill_random(rng);
  std::vector<float> lse(16, kPoison);
  const ScopedEnv on("TOKENMIX_DECODE_AMX", "on");
  try {
    attention_decode(q.view, cache, 0, out.view, TensorView::bht(lse.data(), 1, 4, 4));
    ADD_FAILURE() << "TOKENMIX_DECODE_AMX=on ran where the tile products cannot";
  } catch (const UnsupportedError& e) {
    EXPECT_NE(std::string(e.what()).find("TOKENMIX_DECODE_AMX=on"), std::string::npos) << e.what();
  }
}

struct AmxCase {
  std::vector<std::int64_t> lengths;
  std::int64_t tnew, hq, hkv, dh;
};

// Decode of q against `layer` of `cache` with the switch at `amx` ("on" / "off").
void decode_amx_switch(const StridedTensor& q, const KVCache& cache, std::int64_t layer,
                       const char* amx, StridedTensor& out, std::vector<float>& lse,
                       const DecodeOptions& o = {}) {
  const ScopedEnv sw("TOKENMIX_DECODE_AMX", amx);
  attention_decode(q.view, cache, layer, out.view,
                   TensorView::bht(lse.data(), q.view.shape[0], q.view.shape[2], q.view.shape[1]),
                   o);
}

// q against `layer` of `cache` with the tile products on and off: both match the oracle, and
// (other_bits) the bits differ: the tile products ran.
void expect_amx_matches_oracle(const StridedTensor& q, const KVCache& cache, std::int64_t layer,
                               bool other_bits = true) {
  const std::int64_t B = q.view.shape[0], T = q.view.shape[1], H = q.view.shape[2],
                     D = q.view.shape[3];
  StridedTensor on(B, T, H, D, Layout::bthd), off(B, T, H, D, Layout::bthd);
  std::vector<float> lse_on(static_cast<std::size_t>(B * H * T), kPoison);
  std::vector<float> lse_off = lse_on;
  decode_amx_switch(q, cache, layer, "on", on, lse_on);
  decode_amx_switch(q, cache, layer, "off", off, lse_off);
  std::vector<reference::ForwardResult> refs;
  for (std::int64_t b = 0; b < B; ++b) refs.push_back(cache_oracle(q, b, cache, layer));
  expect_decode_matches(on, lse_on, refs);
  expect_decode_matches(off, lse_off, refs);
  if (!other_bits) return;
  EXPECT_NE(0,
            std::memcmp(on.storage.data(), off.storage.data(), on.storage.size() * sizeof(float)))
      << "the same bits as the FMA products: the tile products did not run";
}

TEST_P(DecodeAmx, ForcedOnMatchesOracleOrIsRefused) {
  const DType dt = GetParam();
  if (!amx_usable(dt)) return expect_amx_refused(dt);
  std::mt19937_64 rng(31);
  // Rows per unit: 16 (T_new 4, g 4), 20, 68 and 128 + 32 (T_new 40, g 4: two query blocks);
  // d_h 64, 128, 256; lengths across tiles and chunks (a short last tile: V rows past it not
  // read), T_new > L (rows that see no key), paged.
  const std::vector<AmxCase> cases = {
      {{1, 63}, 4, 8, 2, 128},     {{64, 65}, 5, 8, 2, 64},  {{1025, 130}, 17, 8, 2, 128},
      {{2100, 700}, 4, 4, 1, 256}, {{300, 3}, 40, 4, 1, 64}, {{129, 1100}, 2, 16, 2, 128},
  };
  for (const AmxCase& c : cases)
    for (std::int64_t block : {0, 128}) {
      SCOPED_TRACE("L0=" + std::to_string(c.lengths[0]) + " L1=" + std::to_string(c.lengths[1]) +
                   " T_new=" + std::to_string(c.tnew) + " H_q=" + std::to_string(c.hq) +
                   " H_kv=" + std::to_string(c.hkv) + " d_h=" + std::to_string(c.dh) +
                   " block=" + std::to_string(block));
      const std::int64_t B = static_cast<std::int64_t>(c.lengths.size());
      KVCache cache(amx_tiles({2, B, c.hkv, c.dh, 2200, dt, block, 0}));
      fill(cache, 1, c.lengths, rng);
      StridedTensor q(B, amx_tnew(dt, c.tnew), c.hq, c.dh, Layout::strided);
      q.fill_random(rng);
      expect_amx_matches_oracle(q, cache, 1);
    }
}

// Where the automatic rule puts a unit (decode_amx-inl.h AmxProducts::Pays) with the switch
// on: units of 3 rows (T_new 3 at g = 1), 4, 8 and 12 rows (T_new 1, 2, 3 at g = 4). int8 units
// from 4 rows run on the tiles (bits other than the FMA products', the oracle's values); 3 rows,
// and every such unit of an fp8 or bf16 cache (from 16 and 32 rows), the FMA products, bit for bit.
TEST_P(DecodeAmx, UnitsTakeTheTilesFromTheirDtypesRowCount) {
  const DType dt = GetParam();
  if (!amx_usable(dt)) return expect_amx_refused(dt);
  std::mt19937_64 rng(64);
  const std::int64_t dh = 128;
  struct Shape {
    std::int64_t hq, hkv, tnew;
  };
  for (const Shape sh : {Shape{2, 2, 3}, Shape{8, 2, 1}, Shape{8, 2, 2}, Shape{8, 2, 3}}) {
    const std::int64_t rows = sh.tnew * (sh.hq / sh.hkv);
    const bool tiles = dt == DType::int8 && rows >= 4;
    SCOPED_TRACE("T_new=" + std::to_string(sh.tnew) + " rows=" + std::to_string(rows));
    KVCache cache(amx_tiles({1, 2, sh.hkv, dh, 1200, dt, 0, 0}));
    fill(cache, 0, {1100, 650}, rng);
    StridedTensor q(2, sh.tnew, sh.hq, dh, Layout::strided);
    q.fill_random(rng);
    expect_amx_matches_oracle(q, cache, 0, tiles);
    if (tiles) continue;
    StridedTensor on(2, sh.tnew, sh.hq, dh, Layout::bthd), off(2, sh.tnew, sh.hq, dh, Layout::bthd);
    std::vector<float> lse_on(static_cast<std::size_t>(2 * sh.hq * sh.tnew), kPoison);
    std::vector<float> lse_off = lse_on;
    decode_amx_switch(q, cache, 0, "on", on, lse_on);
    decode_amx_switch(q, cache, 0, "off", off, lse_off);
    EXPECT_EQ(0,
              std::memcmp(on.storage.data(), off.storage.data(), on.storage.size() * sizeof(float)))
        << "a unit below its dtype's row count ran on the tiles";
  }
}

// Values over a wide range (fp8: most codes of some rows subnormal, V scales ≥ 2^7 in a tile) and
// queries scaled by 1e-15 and 1e15 (one key takes all the weight there: the FMA products' bits
// may be the same): the planes' row scaling.
TEST_P(DecodeAmx, WideRangeMatchesOracle) {
  const DType dt = GetParam();
  if (!amx_usable(dt)) return expect_amx_refused(dt);
  std::mt19937_64 rng(57);
  KVCache cache(amx_tiles({1, 1, 2, 128, 700, dt, 0, 0}));
  fill_wide_range(cache, 0, 650, rng);
  for (const float q_scale : {1.0f, 1e-15f, 1e15f}) {
    SCOPED_TRACE("q scale " + std::to_string(q_scale));
    StridedTensor q(1, 8, 8, 128, Layout::strided);
    q.fill_random(rng);
    for (float& x : q.storage) x *= q_scale;
    expect_amx_matches_oracle(q, cache, 0, q_scale < 1e10f);
  }
}

// Window, soft-capping, ALiBi and sinks (applied to the scores between the two tile products),
// and a rolling cache, on the tile products.
TEST_P(DecodeAmx, VariantsAndRollingCacheMatchOracle) {
  const DType dt = GetParam();
  if (!amx_usable(dt)) return expect_amx_refused(dt);
  std::mt19937_64 rng(78);
  const std::int64_t hq = 8, hkv = 2, dh = 128, tnew = amx_tnew(dt, 6), W = 300;
  const VariantOptions var(hq, W);
  for (std::int64_t rolling : {0, 1}) {
    SCOPED_TRACE(rolling ? "rolling" : "full");
    expect_variants_match_oracle(
        amx_reading(dt), rolling != 0, 1, hkv, dh, tnew, var, rng,
        [&](const StridedTensor& q, const KVCache& cache, StridedTensor& out,
            std::vector<float>& lse) { decode_amx_switch(q, cache, 1, "on", out, lse, var.o); });
  }
}

// A unit whose query rows hold a NaN takes the FMA products (no planes of a NaN): the NaN row's
// output is NaN, the unit's other rows are the FMA products' bits, and the other units (other KV
// heads) still match the oracle.
TEST_P(DecodeAmx, NonFiniteQueryUnitTakesTheFmaProducts) {
  const DType dt = GetParam();
  if (!amx_usable(dt)) return expect_amx_refused(dt);
  std::mt19937_64 rng(90);
  const std::int64_t hq = 8, hkv = 2, dh = 64, tnew = amx_tnew(dt, 4);
  KVCache cache(amx_tiles({2, 1, hkv, dh, 1000, dt, 0, 0}));
  fill(cache, 1, {900}, rng);
  StridedTensor q(1, tnew, hq, dh, Layout::bthd);
  q.fill_random(rng);
  q.storage[(2 * hq + 1) * dh + 5] = std::numeric_limits<float>::quiet_NaN();  // t 2, head 1
  StridedTensor on(1, tnew, hq, dh, Layout::bthd), off(1, tnew, hq, dh, Layout::bthd);
  std::vector<float> lse_on(static_cast<std::size_t>(hq * tnew), kPoison), lse_off = lse_on;
  decode_amx_switch(q, cache, 1, "on", on, lse_on);
  decode_amx_switch(q, cache, 1, "off", off, lse_off);
  for (std::int64_t t = 0; t < tnew; ++t)
    for (std::int64_t h = 0; h < hq; ++h)
      for (std::int64_t x = 0; x < dh; ++x) {
        const std::size_t i = static_cast<std::size_t>((t * hq + h) * dh + x);
        if (t == 2 && h == 1) {
          EXPECT_TRUE(std::isnan(on.storage[i])) << "t 2 head 1 x " << x;
        } else if (h < hq / hkv) {  // KV head 0's unit: the FMA products' bits
          EXPECT_EQ(std::bit_cast<std::uint32_t>(on.storage[i]),
                    std::bit_cast<std::uint32_t>(off.storage[i]))
              << "t " << t << " head " << h << " x " << x;
        }
      }
  // KV head 1's unit ran on the tiles: close to the FMA products, not the same bits.
  double diff = 0.0, scale = 0.0;
  bool same = true;
  for (std::int64_t t = 0; t < tnew; ++t)
    for (std::int64_t h = hq / hkv; h < hq; ++h)
      for (std::int64_t x = 0; x < dh; ++x) {
        const std::size_t i = static_cast<std::size_t>((t * hq + h) * dh + x);
        diff = std::max(diff, static_cast<double>(std::fabs(on.storage[i] - off.storage[i])));
        scale = std::max(scale, static_cast<double>(std::fabs(off.storage[i])));
        same = same && on.storage[i] == off.storage[i];
      }
  EXPECT_LE(diff, kDecodeBound * scale);
  EXPECT_FALSE(same) << "KV head 1's unit did not run on the tiles";
}

// `on` for a call on another path is refused; `off` runs any path.
TEST_P(DecodeAmx, OtherPathsRefuseOn) {
  std::mt19937_64 rng(3);
  KVCache cache(amx_tiles({2, 1, 1, 64, 200, GetParam(), 0, 0}));
  fill(cache, 1, {150}, rng);
  StridedTensor q(1, 4, 4, 64, Layout::bthd);
  q.fill_random(rng);
  StridedTensor out(1, 4, 4, 64, Layout::bthd);
  std::vector<float> lse(16, kPoison);
  DecodeOptions o;
  o.isa = Isa::portable;
  try {
    decode_amx_switch(q, cache, 1, "on", out, lse, o);
    ADD_FAILURE() << "TOKENMIX_DECODE_AMX=on accepted on the portable path";
  } catch (const UnsupportedError& e) {
    EXPECT_NE(std::string(e.what()).find("portable path"), std::string::npos) << e.what();
  }
  decode_amx_switch(q, cache, 1, "off", out, lse, o);
  const std::vector<reference::ForwardResult> refs = {cache_oracle(q, 0, cache, 1)};
  expect_decode_matches(out, lse, refs);
}

INSTANTIATE_TEST_SUITE_P(Caches, DecodeAmx,
                         ::testing::Values(DType::int8, DType::fp8_e4m3, DType::bf16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(to_string(info.param));
                         });

// bf16 tiles the AMX products cannot take exactly go to the exact fallbacks (amx_decode.hpp): a K
// tile with |k| ≥ 2^64, ±∞ or NaN to the FMA products, a V tile with NaN, ±∞, |v| ≥ 2^64 or a
// subnormal to a scalar loop over each row's visible keys. Units of 32 rows (T_new 8, g 4), 700
// keys (a short last tile). Each case against the float64 oracle over the cached values: NaN
// where the oracle has NaN, ±∞ where it has ±∞, the FMA bound elsewhere (relative to the largest
// finite output).
TEST(DecodeAmxBf16, TilesTheProductsCannotTakeGoToExactFallbacks) {
  if (!amx_usable(DType::bf16)) return expect_amx_refused(DType::bf16);
  const std::int64_t L = 700, extra = 6, hq = 8, hkv = 2, dh = 128, tnew = 8;
  const float kNaN = std::numeric_limits<float>::quiet_NaN(),
              kInf = std::numeric_limits<float>::infinity();
  std::mt19937_64 rng(123);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> k0(static_cast<std::size_t>((L + extra) * hkv * dh)), v0(k0.size());
  for (float& x : k0) x = normal(rng);
  for (float& x : v0) x = normal(rng);
  StridedTensor q(1, tnew, hq, dh, Layout::strided);
  q.fill_random(rng);
  const auto at = [](std::int64_t u, std::int64_t h, std::int64_t x) {
    return static_cast<std::size_t>((u * hkv + h) * dh + x);
  };
  struct Case {
    const char* name;
    std::function<void(std::vector<float>& k, std::vector<float>& v)> change;
    bool nonfinite_out;  // the oracle has NaN or ±∞ outputs
  };
  const std::vector<Case> cases = {
      {"V subnormal (all of it: O is subnormal too)",
       [](std::vector<float>&, std::vector<float>& v) {
         for (float& x : v) x = std::ldexp(x, -130);
       },
       false},
      {"V NaN at key 695 (rows t >= 3 see it), +inf at key 100, 2^70 at key 300",
       [&](std::vector<float>&, std::vector<float>& v) {
         v[at(695, 1, 3)] = kNaN;
         v[at(100, 0, 5)] = kInf;
         v[at(300, 1, 9)] = 0x1p70f;
       },
       true},
      {"K of key 300 at 1e30 (head 0), NaN at key 400 (head 1), -inf at key 20 (head 0)",
       [&](std::vector<float>& k, std::vector<float>&) {
         for (std::int64_t x = 0; x < dh; ++x) k[at(300, 0, x)] = 1e30f;
         k[at(400, 1, 7)] = kNaN;
         k[at(20, 0, 11)] = -kInf;
       },
       true},
      {"NaN K and V past the length (appended, then truncated): not read",
       [&](std::vector<float>& k, std::vector<float>& v) {
         for (std::int64_t u = L; u < L + extra; ++u)
           for (std::int64_t h = 0; h < hkv; ++h) k[at(u, h, 1)] = v[at(u, h, 2)] = kNaN;
       },
       false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<float> k = k0, v = v0;
    c.change(k, v);
    KVCache cache({1, 1, hkv, dh, L + extra, DType::bf16, 0, 0});
    cache.append(0, 0, ConstTensorView::bthd(k.data(), 1, L + extra, hkv, dh),
                 ConstTensorView::bthd(v.data(), 1, L + extra, hkv, dh));
    cache.truncate(0, L);
    const reference::ForwardResult ref = cache_oracle(q, 0, cache, 0);
    StridedTensor out(1, tnew, hq, dh, Layout::bthd);
    std::vector<float> lse(static_cast<std::size_t>(hq * tnew), kPoison);
    decode_amx_switch(q, cache, 0, "on", out, lse);
    double mx = 0.0, diff = 0.0;
    std::int64_t nonfinite = 0;
    for (std::int64_t t = 0; t < tnew; ++t)
      for (std::int64_t h = 0; h < hq; ++h)
        for (std::int64_t x = 0; x < dh; ++x)
          if (std::isfinite(ref.out.at(0, t, h, x)))
            mx = std::max(mx, std::fabs(ref.out.at(0, t, h, x)));
    for (std::int64_t t = 0; t < tnew; ++t)
      for (std::int64_t h = 0; h < hq; ++h) {
        for (std::int64_t x = 0; x < dh; ++x) {
          const double r = ref.out.at(0, t, h, x), got = out.at(0, t, h, x);
          if (std::isnan(r)) {
            EXPECT_TRUE(std::isnan(got)) << "t " << t << " head " << h << " x " << x << ": " << got;
            ++nonfinite;
          } else if (std::isinf(r)) {
            EXPECT_EQ(got, r) << "t " << t << " head " << h << " x " << x;
            ++nonfinite;
          } else {
            diff = std::max(diff, std::isfinite(got) ? std::fabs(got - r) : INFINITY);
          }
        }
        const double rl = ref.lse.at(0, h, t, 0);
        const float gl = lse[static_cast<std::size_t>(h * tnew + t)];
        if (std::isnan(rl)) {
          EXPECT_TRUE(std::isnan(gl)) << "lse t " << t << " head " << h;
        } else {
          EXPECT_LE(std::fabs(gl - rl) / std::max(1.0, std::fabs(rl)), kDecodeBound)
              << "lse t " << t << " head " << h;
        }
      }
    EXPECT_LE(diff, kDecodeBound * mx) << "largest finite |O| " << mx;
    EXPECT_GT(mx, 0.0);
    EXPECT_EQ(nonfinite > 0, c.nonfinite_out);
  }
}

// The switch's values, and decode_amx's cache dtype.
TEST(DecodeAmxSwitch, ValuesAndCacheDtypeAreChecked) {
  {
    const ScopedEnv bad("TOKENMIX_DECODE_AMX", "sometimes");
    try {
      (void)decode_amx();
      ADD_FAILURE() << "TOKENMIX_DECODE_AMX=sometimes accepted";
    } catch (const ArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("TOKENMIX_DECODE_AMX"), std::string::npos) << e.what();
    }
  }
  for (const DType dt : {DType::f32, DType::f16}) {
    try {
      (void)decode_amx(dt);
      ADD_FAILURE() << "decode_amx(" << to_string(dt) << ") accepted";
    } catch (const ArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("cache_dtype must be int8, fp8_e4m3 or bf16"),
                std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find(to_string(dt)), std::string::npos) << e.what();
    }
  }
  // int8 and fp8 caches (K per channel per closed tile) never take the tile products
  // (docs/performance.md, D-kv-3); bf16's features include AMX-INT8's.
  const ScopedEnv unset("TOKENMIX_DECODE_AMX", nullptr);
  EXPECT_FALSE(decode_amx(DType::int8));
  EXPECT_FALSE(decode_amx(DType::fp8_e4m3));
  EXPECT_TRUE(!cpu_features().amx_bf16 || cpu_features().amx_int8);
}

// An int8 cache in rows has no tile products: TOKENMIX_DECODE_AMX=on is refused on every path,
// naming the layout, and the cache is read by the FMA products otherwise.
TEST(DecodeAmxSwitch, Int8RowsRefuseOn) {
  std::mt19937_64 rng(5);
  KVCache cache({1, 1, 1, 64, 200, DType::int8, 0, 0, 0, false});
  fill(cache, 0, {150}, rng);
  StridedTensor q(1, 4, 4, 64, Layout::bthd);
  q.fill_random(rng);
  StridedTensor out(1, 4, 4, 64, Layout::bthd);
  std::vector<float> lse(16, kPoison);
  for (const Isa isa : {Isa::automatic, Isa::avx512}) {
    if (isa == Isa::avx512 && !testkit::isa_unavailable_reason(isa).empty()) continue;
    DecodeOptions o;
    o.isa = isa;
    try {
      decode_amx_switch(q, cache, 0, "on", out, lse, o);
      ADD_FAILURE() << "TOKENMIX_DECODE_AMX=on accepted on an int8 cache in rows";
    } catch (const UnsupportedError& e) {
      EXPECT_NE(std::string(e.what()).find("plain rows"), std::string::npos) << e.what();
    }
  }
  decode_amx_switch(q, cache, 0, "", out, lse, {});
  expect_decode_matches(out, lse, {cache_oracle(q, 0, cache, 0)});
}

// KVCacheConfig::int8_quads belongs to int8 caches: set for another dtype, an ArgumentError that
// names it and the dtype.
TEST(KVQuantCache, Int8QuadsOnAnotherDtypeIsRefused) {
  for (const DType dt : {DType::f32, DType::bf16, DType::f16, DType::fp8_e4m3})
    for (const bool quads : {false, true}) {
      try {
        KVCache cache({1, 1, 1, 64, 64, dt, 0, 0, 0, quads});
        ADD_FAILURE() << "int8_quads accepted for " << to_string(dt);
      } catch (const ArgumentError& e) {
        EXPECT_NE(std::string(e.what()).find("config.int8_quads applies to an int8 cache only"),
                  std::string::npos)
            << e.what();
        EXPECT_NE(std::string(e.what()).find(to_string(dt)), std::string::npos) << e.what();
      }
    }
}

}  // namespace
}  // namespace tokenmix::testing
