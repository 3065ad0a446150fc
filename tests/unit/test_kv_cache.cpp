// tests/unit/test_kv_cache.cpp — KVCache (tokenmix/kv_cache.hpp) and the layer's inference mode
// (CausalSelfAttention::prefill / step): element conversions, memory (SPEC 4.8), paging,
// truncate / release / reset, prefill + steps against one full forward, and every bad input
// rejected with a typed error and the cache unchanged byte for byte.
//
// Bounds for prefill(P) + S × step vs forward(P + S) (rel_err of test_util.hpp over all outputs):
//   fp32 cache: 1e-5 — the same fp32 arithmetic in another order (decode splits keys in chunks
//     and merges; the projections see different row counts), errors ~d·u with u = 6e-8.
//   bf16 / f16 cache: K and V are rounded to nearest on write, relative error ≤ u_e = 2^-9
//     (bf16) or 2^-12 (f16) per element. The output of a step is a convex combination of V rows
//     (error ≤ u_e·max|v|) with weights from scores s·⟨q, k⟩ = O(1), each perturbed by ≲ u_e
//     (relative change of the weights ≲ u_e); W_O (normalised, fan-in H_q·d_h) keeps the error
//     relative. Both effects add: bound 2·u_e, i.e. bf16 ≤ 2^-8 ≈ 3.9e-3, f16 ≤ 2^-11 ≈ 4.9e-4
//     (measured: ≤ 1.2e-3 and ≤ 2.0e-4). The fresh prefill rows use fp32 K/V and are as exact as
//     the fp32 case; the bound is set by the rows that read the rounded cache.
//   int8 / fp8 E4M3 cache (SPEC "Quantized KV cache"; every prefill reads the cache): an element
//     is off by ≤ δ/2 = max|x|/254 (int8), i.e. ≲ 2^-7 of a typical |x| for N(0,1) rows of 16
//     (max|x| ≈ 2–2.5 σ), or by ≤ 2^-4 relative (E4M3's half ulp, 3 mantissa bits). With the same
//     two effects as above: int8 ≤ 2^-6 ≈ 1.6e-2, fp8 ≤ 2^-4 ≈ 6.3e-2 (measured: ≤ 7.6e-3 and
//     ≤ 3.3e-2 on every path).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "decode/decode_internal.hpp"
#include "kernels/kv_element.hpp"
#include "kv_oracle.hpp"
#include "test_util.hpp"

namespace tokenmix::testing {
namespace {

using kernels::bf16_to_f32;
using kernels::f16_to_f32;
using kernels::f32_to_bf16;
using kernels::f32_to_f16;

// ---- element conversions ----

TEST(KVCacheElements, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x3f808000u)), 0x3f80);  // tie → even (down)
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x3f818000u)), 0x3f82);  // tie → even (up)
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x3f808001u)), 0x3f81);  // above the tie
  EXPECT_EQ(f32_to_bf16(-2.5f), 0xc020);
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x7f7fffffu)), 0x7f80);  // FLT_MAX rounds to ∞
  EXPECT_EQ(f32_to_bf16(INFINITY), 0x7f80);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
  EXPECT_EQ(bf16_to_f32(0x3f82), std::bit_cast<float>(0x3f820000u));
}

TEST(KVCacheElements, F16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(1.0f + 0x1.0p-11f), 0x3c00);      // tie → even (down)
  EXPECT_EQ(f32_to_f16(1.0f + 3 * 0x1.0p-11f), 0x3c02);  // tie → even (up)
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);               // largest finite
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7bff);               // below the tie to ∞
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);               // tie → ∞
  EXPECT_EQ(f32_to_f16(-0x1.0p-24f), 0x8001);            // smallest subnormal
  EXPECT_EQ(f32_to_f16(0x1.0p-25f), 0x0000);             // tie → even (zero)
  EXPECT_EQ(f32_to_f16(0x1.8p-24f), 0x0002);             // 1.5 ulp → 2 (even)
  EXPECT_EQ(f32_to_f16(0x1.ffcp-15f), 0x0400);           // carries into the normals
  EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(NAN))));
  // Every f16 value round-trips exactly through fp32.
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    if (((h >> 10) & 0x1f) == 0x1f && (h & 0x3ff)) continue;  // NaNs
    ASSERT_EQ(f32_to_f16(f16_to_f32(static_cast<std::uint16_t>(h))), h) << h;
  }
}

// ---- memory, paging, truncate ----

TEST(KVCache, MemoryIsSpecFigurePlusSmallConstant) {
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    KVCache c({4, 3, 8, 64, 256, dt, 0, 0});
    EXPECT_EQ(c.storage_bytes(), kv_cache_bytes(4, 3, 256, 8, 64, size_of(dt)));
    EXPECT_GE(c.memory_bytes(), c.storage_bytes());
    EXPECT_LE(c.memory_bytes() - c.storage_bytes(), 1024u);  // tables, lengths: not ∝ T or d_h
  }
  KVCache paged({2, 4, 2, 64, 1000, DType::bf16, 128, 10});
  EXPECT_EQ(paged.storage_bytes(), kv_cache_bytes(2, 10, 128, 2, 64, 2));
  EXPECT_EQ(paged.free_blocks(), 10);
}

std::vector<float> random_vec(std::size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> dist;
  std::vector<float> x(n);
  for (float& e : x) e = dist(rng);
  return x;
}

void append_rows(KVCache& c, std::int64_t layer, std::int64_t seq, const std::vector<float>& kv,
                 std::int64_t t0, std::int64_t n) {
  const auto H = c.config().heads_kv, D = c.config().head_dim;
  const auto view = ConstTensorView::bthd(kv.data() + t0 * H * D, 1, n, H, D);
  c.append(layer, seq, view, view);
}

TEST(KVCache, PagedGrowsWithoutReallocationAndReturnsBlocks) {
  std::mt19937_64 rng(3);
  KVCache c({1, 3, 2, 32, 1000, DType::bf16, 64, 12});
  const std::byte* base = c.raw_storage().data();
  const auto kv = random_vec(1000 * 2 * 32, rng);
  append_rows(c, 0, 0, kv, 0, 65);   // 2 blocks
  append_rows(c, 0, 1, kv, 0, 64);   // 1 block
  append_rows(c, 0, 0, kv, 65, 63);  // fills block 2 of sequence 0 exactly
  EXPECT_EQ(c.free_blocks(), 9);
  append_rows(c, 0, 2, kv, 0, 300);  // 5 blocks
  EXPECT_EQ(c.free_blocks(), 4);
  EXPECT_EQ(c.raw_storage().data(), base);  // never reallocated
  c.release(0);
  EXPECT_EQ(c.free_blocks(), 6);
  EXPECT_FALSE(c.active(0));
  c.truncate(2, 100);  // 5 → 2 blocks
  EXPECT_EQ(c.free_blocks(), 9);
  EXPECT_EQ(c.length(2), 100);
  c.reset(0);
  EXPECT_TRUE(c.active(0));
  append_rows(c, 0, 0, kv, 0, 500);  // reuses freed blocks
  EXPECT_EQ(c.free_blocks(), 1);
  c.reset();
  EXPECT_EQ(c.free_blocks(), 12);
  for (std::byte x : c.raw_storage()) ASSERT_EQ(x, std::byte{0});  // reset zeroes what it drops
}

// Speculative decoding: append draft tokens, reject them (truncate), append the real ones —
// identical to never having appended the drafts (storage bytes for a contiguous cache, decode
// results for both kinds).
TEST(KVCache, TruncateThenAppendEqualsNeverAppended) {
  std::mt19937_64 rng(4);
  const auto real = random_vec(200 * 2 * 16, rng), draft = random_vec(200 * 2 * 16, rng);
  for (std::int64_t block : {0, 64}) {
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
      KVCache a({2, 2, 2, 16, 200, dt, block, 0}), b({2, 2, 2, 16, 200, dt, block, 0});
      for (KVCache* c : {&a, &b})
        for (std::int64_t l = 0; l < 2; ++l) {
          append_rows(*c, l, 0, real, 0, 60);
          append_rows(*c, l, 1, real, 0, 10);
        }
      for (std::int64_t l = 0; l < 2; ++l)
        append_rows(a, l, 0, draft, 60, 7);  // crosses a tile edge
      a.truncate(0, 60);
      for (KVCache* c : {&a, &b})
        for (std::int64_t l = 0; l < 2; ++l) append_rows(*c, l, 0, real, 60, 5);
      EXPECT_EQ(a.length(0, 1), 65);
      if (block == 0) {
        ASSERT_EQ(a.raw_storage().size(), b.raw_storage().size());
        EXPECT_EQ(
            0, std::memcmp(a.raw_storage().data(), b.raw_storage().data(), a.raw_storage().size()));
      }
      std::vector<float> q = random_vec(2 * 1 * 4 * 16, rng), oa(q.size()), ob(q.size());
      attention_decode(ConstTensorView::bthd(q.data(), 2, 1, 4, 16), a, 1,
                       TensorView::bthd(oa.data(), 2, 1, 4, 16));
      attention_decode(ConstTensorView::bthd(q.data(), 2, 1, 4, 16), b, 1,
                       TensorView::bthd(ob.data(), 2, 1, 4, 16));
      EXPECT_EQ(0, std::memcmp(oa.data(), ob.data(), oa.size() * sizeof(float)));
    }
  }
}

// ---- the layer in inference mode ----

struct LayerCase {
  std::int64_t hq, hkv;
};

// prefill(P_b) per sequence (different lengths), one speculative-style chunk of 3 tokens for
// both sequences, then S single steps; compared with one forward over all P_b + 3 + S tokens.
double prefill_steps_vs_forward(DType dtype, std::int64_t block, LayerCase lc, Isa isa) {
  const std::int64_t d = 64, dh = 16, S = 5, chunk = 3;
  const std::int64_t P[2] = {37, 70};
  LayerConfig cfg;
  cfg.d_model = d;
  cfg.heads_q = lc.hq;
  cfg.heads_kv = lc.hkv;
  cfg.head_dim = dh;
  cfg.rope = RopeOptions{RopePairing::rotate_half, 10000.0, 0};
  cfg.attention.isa = isa;
  CausalSelfAttention layer(cfg);
  layer.init_random(42 + static_cast<std::uint64_t>(lc.hq * 10 + lc.hkv));
  std::mt19937_64 rng(9);
  std::vector<float> u[2], got[2];
  for (int b = 0; b < 2; ++b) {
    u[b] = random_vec(static_cast<std::size_t>((P[b] + chunk + S) * d), rng);
    got[b].assign(u[b].size(), kPoison);
  }
  KVCache cache({2, 2, lc.hkv, dh, 128, dtype, block, 0});
  for (int b = 0; b < 2; ++b) {  // prefill each sequence on its own (different lengths)
    layer.prefill(std::span(u[b]).first(static_cast<std::size_t>(P[b] * d)), 1, P[b], cache, 1,
                  std::span(got[b]).first(static_cast<std::size_t>(P[b] * d)), b);
  }
  // Chunk of 3 tokens for both sequences at once (T_new = 3 against different lengths).
  std::vector<float> ub(static_cast<std::size_t>(2 * chunk * d)), ob(ub.size());
  for (int b = 0; b < 2; ++b)
    std::copy_n(u[b].begin() + P[b] * d, chunk * d, ub.begin() + b * chunk * d);
  layer.prefill(ub, 2, chunk, cache, 1, ob);
  for (int b = 0; b < 2; ++b)
    std::copy_n(ob.begin() + b * chunk * d, chunk * d, got[b].begin() + P[b] * d);
  for (std::int64_t s = 0; s < S; ++s) {
    std::vector<float> us(static_cast<std::size_t>(2 * d)), os(us.size());
    for (int b = 0; b < 2; ++b)
      std::copy_n(u[b].begin() + (P[b] + chunk + s) * d, d, us.begin() + b * d);
    layer.step(us, 2, cache, 1, os);
    for (int b = 0; b < 2; ++b)
      std::copy_n(os.begin() + b * d, d, got[b].begin() + (P[b] + chunk + s) * d);
  }
  EXPECT_EQ(cache.length(0, 1), P[0] + chunk + S);
  EXPECT_EQ(cache.length(1, 1), P[1] + chunk + S);
  EXPECT_EQ(cache.length(0, 0), 0);
  double err = 0.0;
  for (int b = 0; b < 2; ++b) {
    std::vector<float> full(u[b].size());
    layer.forward(u[b], 1, P[b] + chunk + S, full);
    err = std::max(err, rel_err_flat(got[b], full));
  }
  return err;
}

class KVCacheLayer : public PerIsaTest {};

TEST_P(KVCacheLayer, PrefillThenStepsEqualsFullForward) {
  for (DType dtype : {DType::f32, DType::bf16, DType::f16, DType::int8, DType::fp8_e4m3}) {
    const double bound = dtype == DType::f32    ? 1e-5
                         : dtype == DType::bf16 ? 0x1.0p-8
                         : dtype == DType::f16  ? 0x1.0p-11
                         : dtype == DType::int8 ? 0x1.0p-6
                                                : 0x1.0p-4;
    for (std::int64_t block : {0, 64})
      for (LayerCase lc : {LayerCase{4, 4}, LayerCase{8, 2}, LayerCase{8, 1}, LayerCase{32, 1}}) {
        SCOPED_TRACE(std::string(to_string(dtype)) + " block=" + std::to_string(block) +
                     " H_q=" + std::to_string(lc.hq) + " H_kv=" + std::to_string(lc.hkv));
        const double err = prefill_steps_vs_forward(dtype, block, lc, GetParam());
        EXPECT_LE(err, bound);
        if (std::getenv("TOKENMIX_TEST_VERBOSE"))
          std::printf("  %s block=%lld H_q=%lld H_kv=%lld rel_err=%.3g\n", to_string(dtype),
                      (long long)block, (long long)lc.hq, (long long)lc.hkv, err);
      }
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, KVCacheLayer, AllIsas(), IsaName);

// ---- bad input: typed error, message names the argument, cache unchanged ----

struct Snapshot {
  std::vector<std::byte> bytes;
  std::vector<std::int64_t> lengths;
  std::vector<bool> active;
  std::int64_t free_blocks;
  explicit Snapshot(const KVCache& c)
      : bytes(c.raw_storage().begin(), c.raw_storage().end()), free_blocks(c.free_blocks()) {
    for (std::int64_t l = 0; l < c.config().layers; ++l)
      for (std::int64_t b = 0; b < c.config().batch; ++b) {
        lengths.push_back(c.length(b, l));
        lengths.push_back(c.first_position(b, l));  // rolling caches
      }
    for (std::int64_t b = 0; b < c.config().batch; ++b) active.push_back(c.active(b));
  }
  bool operator==(const Snapshot&) const = default;
};

template <class Err, class F>
void expect_rejected(KVCache& c, F&& f, ErrorCode code, const std::string& needle) {
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

TEST(KVCacheErrors, BadInputLeavesCacheUnchanged) {
  std::mt19937_64 rng(5);
  KVCache c({2, 2, 2, 16, 100, DType::bf16, 64, 3});  // pool of 3 blocks of 64
  const auto kv = random_vec(200 * 2 * 16, rng);
  append_rows(c, 0, 0, kv, 0, 90);  // 2 blocks
  append_rows(c, 1, 0, kv, 0, 90);
  append_rows(c, 0, 1, kv, 0, 10);  // 1 block: pool exhausted
  const auto K = [&](std::int64_t T, std::int64_t H = 2, std::int64_t D = 16) {
    return ConstTensorView::bthd(kv.data(), 1, T, H, D);
  };
  using AE = ArgumentError;
  expect_rejected<AE>(
      c, [&] { c.append(0, 0, K(11), K(11)); }, ErrorCode::invalid_argument, "capacity");
  expect_rejected<AE>(
      c, [&] { c.append(0, 1, K(60), K(60)); }, ErrorCode::invalid_argument, "pool");
  expect_rejected<AE>(
      c, [&] { c.append(2, 0, K(1), K(1)); }, ErrorCode::invalid_argument, "layer");
  expect_rejected<AE>(
      c, [&] { c.append(-1, 0, K(1), K(1)); }, ErrorCode::invalid_argument, "layer");
  expect_rejected<AE>(
      c, [&] { c.append(0, 2, K(1), K(1)); }, ErrorCode::invalid_argument, "first_seq");
  expect_rejected<AE>(
      c, [&] { c.append(0, 0, K(1, 4), K(1, 4)); }, ErrorCode::shape_mismatch, "H_kv");
  expect_rejected<AE>(
      c, [&] { c.append(0, 0, K(1, 2, 8), K(1, 2, 8)); }, ErrorCode::shape_mismatch, "d_h");
  expect_rejected<AE>(
      c, [&] { c.append(0, 0, K(1), K(2)); }, ErrorCode::shape_mismatch, "v.shape[1]");
  ConstTensorView half = K(1);
  half.dtype = DType::bf16;
  expect_rejected<UnsupportedError>(
      c, [&] { c.append(0, 0, half, K(1)); }, ErrorCode::unsupported, "dtype");
  expect_rejected<AE>(
      c, [&] { c.truncate(0, 91); }, ErrorCode::invalid_argument, "new_length");
  expect_rejected<AE>(
      c, [&] { c.truncate(0, -1); }, ErrorCode::invalid_argument, "new_length");
  expect_rejected<AE>(
      c, [&] { c.truncate(5, 0); }, ErrorCode::invalid_argument, "seq");

  // Decode: bad layer, widths, head ratio, sequence range.
  std::vector<float> q(2 * 1 * 4 * 16), o(q.size());
  auto Q = [&](std::int64_t B, std::int64_t H, std::int64_t D) {
    return ConstTensorView::bthd(q.data(), B, 1, H, D);
  };
  auto O = [&](std::int64_t B, std::int64_t H, std::int64_t D) {
    return TensorView::bthd(o.data(), B, 1, H, D);
  };
  expect_rejected<AE>(
      c, [&] { attention_decode(Q(2, 4, 16), c, 2, O(2, 4, 16)); }, ErrorCode::invalid_argument,
      "layer");
  expect_rejected<AE>(
      c, [&] { attention_decode(Q(2, 4, 8), c, 0, O(2, 4, 8)); }, ErrorCode::shape_mismatch, "d_h");
  expect_rejected<AE>(
      c, [&] { attention_decode(Q(2, 3, 16), c, 0, O(2, 3, 16)); }, ErrorCode::shape_mismatch,
      "H_q");
  expect_rejected<AE>(
      c, [&] { attention_decode(Q(2, 4, 16), c, 0, O(1, 4, 16)); }, ErrorCode::shape_mismatch,
      "out");
  DecodeOptions shifted;
  shifted.first_seq = 1;
  expect_rejected<AE>(
      c, [&] { attention_decode(Q(2, 4, 16), c, 0, O(2, 4, 16), {}, shifted); },
      ErrorCode::invalid_argument, "first_seq");

  // A released sequence can be neither read nor appended to until reset.
  c.release(1);
  EXPECT_EQ(c.free_blocks(), 1);
  expect_rejected<AE>(
      c, [&] { attention_decode(Q(2, 4, 16), c, 0, O(2, 4, 16)); }, ErrorCode::invalid_argument,
      "released");
  expect_rejected<AE>(
      c, [&] { c.append(0, 1, K(1), K(1)); }, ErrorCode::invalid_argument, "released");
  expect_rejected<AE>(
      c, [&] { c.truncate(1, 0); }, ErrorCode::invalid_argument, "released");

  // The layer: mismatched cache, bad layer index, released sequence, capacity.
  LayerConfig cfg;
  cfg.d_model = 32;
  cfg.heads_q = 4;
  cfg.heads_kv = 2;
  cfg.head_dim = 16;
  CausalSelfAttention layer(cfg);
  layer.init_random(1);
  std::vector<float> u(32 * 20), out(u.size());
  expect_rejected<AE>(
      c, [&] { layer.step(std::span(u).first(32), 1, c, 2, std::span(out).first(32)); },
      ErrorCode::invalid_argument, "layer");
  expect_rejected<AE>(
      c, [&] { layer.step(std::span(u).first(32), 1, c, 0, std::span(out).first(32), 1); },
      ErrorCode::invalid_argument, "released");
  expect_rejected<AE>(
      c,
      [&] {
        layer.prefill(std::span(u).first(32 * 11), 1, 11, c, 0, std::span(out).first(32 * 11));
      },
      ErrorCode::invalid_argument, "capacity");
  cfg.heads_kv = 4;
  CausalSelfAttention wide(cfg);
  expect_rejected<AE>(
      c, [&] { wide.step(std::span(u).first(32), 1, c, 0, std::span(out).first(32)); },
      ErrorCode::shape_mismatch, "heads_kv");

  // Positions that overflow 64-bit arithmetic (a zero-stride view of 2^63 − 1 positions).
  KVCache tiny({1, 1, 1, 1, 10, DType::f32, 0, 0});
  float one = 1.0f;
  tiny.append(0, 0, ConstTensorView{&one, DType::f32, 4, {1, 1, 1, 1}, {0, 0, 0, 0}},
              ConstTensorView{&one, DType::f32, 4, {1, 1, 1, 1}, {0, 0, 0, 0}});
  const ConstTensorView huge{&one, DType::f32, 4, {1, INT64_MAX, 1, 1}, {0, 0, 0, 0}};
  expect_rejected<AE>(
      tiny, [&] { tiny.append(0, 0, huge, huge); }, ErrorCode::overflow, "overflow");
}

TEST(KVCacheErrors, BadConfigIsRejected) {
  auto bad = [](KVCacheConfig cfg, ErrorCode code, const char* needle) {
    try {
      KVCache c(cfg);
      ADD_FAILURE() << "accepted a bad config (" << needle << ")";
    } catch (const ArgumentError& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  bad({0, 1, 1, 16, 10, DType::f32, 0, 0}, ErrorCode::invalid_argument, "config.layers");
  bad({1, 1, 1, 16, 0, DType::f32, 0, 0}, ErrorCode::invalid_argument, "config.capacity");
  bad({1, 1, 1, 16, 10, static_cast<DType>(9), 0, 0}, ErrorCode::invalid_argument, "config.dtype");
  bad({1, 1, 1, 16, 10, DType::f32, 100, 0}, ErrorCode::invalid_argument, "config.block_tokens");
  bad({1, 1, 1, 16, 10, DType::f32, 0, 4}, ErrorCode::invalid_argument, "config.pool_blocks");
  bad({1 << 20, 1 << 20, 1 << 20, 1 << 20, 1 << 20, DType::f32, 0, 0}, ErrorCode::overflow,
      "overflow");
  bad({1, 1, 1, 16, 10, DType::f32, 0, 0, -1}, ErrorCode::invalid_argument, "config.window");
  bad({1, 1, 1, 16, 10, DType::f32, 0, 0, std::numeric_limits<std::int64_t>::max() - 8},
      ErrorCode::overflow, "config.window");
  // A small pool shared by 2^61 sequences: the block table's 2^61 int32 entries overflow its
  // byte count (fuzz_api once reached an allocation of the K/V storage before this check).
  bad({1, std::int64_t{1} << 61, 1, 16, 64, DType::f32, 64, 1}, ErrorCode::overflow,
      "block table bytes");
  bad({std::int64_t{1} << 40, std::int64_t{1} << 21, 1, 1, 64, DType::int8, 64, 1},
      ErrorCode::overflow, "lengths bytes");
}

TEST(KVCacheErrors, CacheLargerThanPhysicalMemoryIsAResourceError) {
  // 2 · 2^16 layers · 2^20 positions · 2^10 features · 4 bytes = 2^49 bytes: representable,
  // never allocatable. Refused before any allocation (ErrorCode::out_of_memory).
  const KVCacheConfig cfg{std::int64_t{1} << 16, 1, 1, 1 << 10, 1 << 20, DType::f32, 0, 0};
  try {
    KVCache c(cfg);
    ADD_FAILURE() << "allocated a 2^49-byte cache";
  } catch (const ResourceError& e) {
    EXPECT_EQ(e.code(), ErrorCode::out_of_memory) << e.what();
    const std::string what = e.what();
    EXPECT_NE(what.find("KVCache"), std::string::npos) << what;
    EXPECT_NE(what.find("562949953421312"), std::string::npos) << what;  // 2^49 bytes
    EXPECT_NE(what.find("physical memory"), std::string::npos) << what;
  }
}

// ---- rolling caches (KVCacheConfig::window): memory O(W), positions keep counting ----

TEST(KVCacheRolling, MemoryIsOWindowNotOCapacity) {
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    for (std::int64_t capacity : {std::int64_t{2000}, std::int64_t{1} << 40}) {
      KVCache c({2, 3, 2, 64, capacity, dt, 0, 0, 1000});  // R = round_up(1000 + 64, 64) = 1088
      EXPECT_EQ(c.retained_positions(), 1088);
      EXPECT_EQ(c.window(), 1000);
      EXPECT_EQ(c.storage_bytes(), kv_cache_bytes(2, 3, 1088, 2, 64, size_of(dt)));
      EXPECT_LE(c.memory_bytes() - c.storage_bytes(), 1024u);
      KVCache p({2, 3, 2, 64, capacity, dt, 128, 0, 1000});  // R = 1152: 9 blocks a sequence
      EXPECT_EQ(p.retained_positions(), 1152);
      EXPECT_EQ(p.pool_blocks(), 27);
      EXPECT_EQ(p.storage_bytes(), kv_cache_bytes(2, 27, 128, 2, 64, size_of(dt)));
    }
  }
  KVCache small({1, 1, 1, 16, 10, DType::f32, 0, 0, 1});  // W = 1: one tile + one of slack
  EXPECT_EQ(small.retained_positions(), 128);
}

// Appending far beyond R: lengths keep counting, first_position = length − R, the storage holds
// the last R positions whatever the append sizes (one append of 300 = many small ones), blocks
// are taken once per ring slot, truncate within the retained positions, release / reset
// return everything and zero it.
TEST(KVCacheRolling, AppendTruncateReleaseSemantics) {
  std::mt19937_64 rng(21);
  const auto kv = random_vec(400 * 2 * 16, rng);
  for (std::int64_t block : {0, 64}) {
    SCOPED_TRACE("block=" + std::to_string(block));
    const KVCacheConfig cfg{2, 2, 2, 16, 100000, DType::bf16, block, block ? 5 : 0, 10};
    KVCache one(cfg), many(cfg);  // R = 128 (2 blocks of 64)
    append_rows(one, 0, 0, kv, 0, 300);
    for (std::int64_t t0 = 0, n = 1; t0 < 300; t0 += n, n = n * 3 % 97 + 1)
      append_rows(many, 0, 0, kv, t0, std::min<std::int64_t>(n, 300 - t0));
    append_rows(one, 1, 0, kv, 0, 70);  // layer 1 is shorter (no wrap)
    append_rows(many, 1, 0, kv, 0, 70);
    EXPECT_EQ(one.length(0, 0), 300);
    EXPECT_EQ(one.first_position(0, 0), 300 - 128);
    EXPECT_EQ(one.first_position(0, 1), 0);
    EXPECT_TRUE(Snapshot(one) == Snapshot(many));
    if (block != 0) {
      EXPECT_EQ(one.free_blocks(), 3);
    }  // a ring of 2 blocks, taken once
    // truncate: back within the retained positions only (0 empties the sequence)
    one.truncate(0, 200);
    EXPECT_EQ(one.length(0, 0), 200);
    EXPECT_EQ(one.length(0, 1), 70);
    EXPECT_EQ(one.first_position(0, 0), 172);
    if (block != 0) {
      EXPECT_EQ(one.free_blocks(), 3);
    }  // wrapped: the ring keeps its blocks
    append_rows(one, 0, 0, kv, 200, 100);
    EXPECT_TRUE(Snapshot(one) == Snapshot(many)) << "truncate + append again = never truncated";
    one.truncate(0, 0);
    EXPECT_EQ(one.length(0, 0), 0);
    EXPECT_EQ(one.first_position(0, 0), 0);
    if (block != 0) {
      EXPECT_EQ(one.free_blocks(), 5);
    }
    append_rows(one, 0, 1, kv, 0, 70);  // no wrap: truncate returns blocks as a plain cache does
    if (block != 0) {
      EXPECT_EQ(one.free_blocks(), 3);
    }
    one.truncate(1, 10);
    if (block != 0) {
      EXPECT_EQ(one.free_blocks(), 4);
    }
    many.release(0);
    many.reset(0);
    EXPECT_EQ(many.length(0, 0), 0);
    EXPECT_EQ(many.first_position(0, 0), 0);
    many.reset();
    for (std::byte x : many.raw_storage()) ASSERT_EQ(x, std::byte{0});
  }
}

TEST(KVCacheErrors, RollingCacheRejectsWhatItCannotServe) {
  std::mt19937_64 rng(22);
  KVCache c({1, 2, 2, 16, 100000, DType::f32, 64, 0, 50});  // R = 128
  const auto kv = random_vec(500 * 2 * 16, rng);
  append_rows(c, 0, 0, kv, 0, 500);
  append_rows(c, 0, 1, kv, 0, 20);
  std::vector<float> q = random_vec(2 * 80 * 4 * 16, rng), o(q.size(), kPoison);
  auto decode = [&](std::int64_t tnew, std::optional<std::int64_t> window) {
    return [&, tnew, window] {
      DecodeOptions opt;
      opt.window = window;
      attention_decode(ConstTensorView::bthd(q.data(), 2, tnew, 4, 16), c, 0,
                       TensorView::bthd(o.data(), 2, tnew, 4, 16), {}, opt);
    };
  };
  using AE = ArgumentError;
  expect_rejected<AE>(c, decode(1, std::nullopt), ErrorCode::invalid_argument, "options.window");
  expect_rejected<AE>(c, decode(1, 51), ErrorCode::invalid_argument, "options.window");
  // 500 − T_new + 1 − 50 ≥ first position 372 ⟺ T_new ≤ 79 = R − W + 1
  expect_rejected<AE>(c, decode(80, 50), ErrorCode::invalid_argument, "T_new");
  EXPECT_NO_THROW(decode(79, 50)());
  EXPECT_NO_THROW(decode(1, 7)());
  expect_rejected<AE>(
      c, [&] { c.truncate(0, 371); }, ErrorCode::invalid_argument, "first position");
  // A layer whose window does not fit the rolling cache.
  LayerConfig cfg;
  cfg.d_model = 32;
  cfg.heads_q = 4;
  cfg.heads_kv = 2;
  cfg.head_dim = 16;
  std::vector<float> u = random_vec(32, rng), out(32, kPoison);
  for (std::optional<std::int64_t> w :
       {std::optional<std::int64_t>{}, std::optional<std::int64_t>{51}}) {
    cfg.attention.window = w;
    CausalSelfAttention layer(cfg);
    expect_rejected<AE>(
        c, [&] { layer.step(u, 1, c, 0, out, 0); }, ErrorCode::invalid_argument,
        "config.attention.window");
    expect_rejected<AE>(
        c, [&] { layer.step(u, 1, c, 0, out, 1); }, ErrorCode::invalid_argument,
        "config.attention.window");
  }
}

// Large caches are re-backed by huge pages after allocation (madvise + collapse on Linux, an
// advisory step that must not change a byte): a fresh 8 MiB cache reads as all zeros, and what
// is appended reads back exactly.
TEST(KVCache, HugePageBackingKeepsContents) {
  KVCache cache({1, 1, 8, 128, 2048, DType::f32, 0, 0});
  const auto raw = cache.raw_storage();
  ASSERT_EQ(raw.size(), 2u * 2048 * 8 * 128 * 4);
  EXPECT_TRUE(std::all_of(raw.begin(), raw.end(), [](std::byte b) { return b == std::byte{0}; }));
  std::vector<float> k(3 * 8 * 128), v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<float>(i) * 0.25f;
    v[i] = -static_cast<float>(i);
  }
  cache.append(0, 0, ConstTensorView::bthd(k.data(), 1, 3, 8, 128),
               ConstTensorView::bthd(v.data(), 1, 3, 8, 128));
  EXPECT_EQ(cache.length(0), 3);
  // Every appended value is somewhere in the storage, bit for bit (the layout is the kernel's).
  std::vector<float> stored(raw.size() / 4);
  std::memcpy(stored.data(), cache.raw_storage().data(), raw.size());
  for (float x : {k[1], k[1000], k.back(), v[5], v.back()}) {
    EXPECT_NE(std::find(stored.begin(), stored.end(), x), stored.end()) << x;
  }
}

// ---- issue 11 #3: a failed prefill / step / append / decode leaves the cache byte-identical ----

/// Sets TOKENMIX_ISA for one scope and restores the previous value (or its absence).
struct IsaEnv {
  explicit IsaEnv(const char* value) {
    const char* old = std::getenv("TOKENMIX_ISA");
    had_ = old != nullptr;
    if (had_) old_ = old;
    ::setenv("TOKENMIX_ISA", value, 1);
  }
  ~IsaEnv() {
    if (had_)
      ::setenv("TOKENMIX_ISA", old_.c_str(), 1);
    else
      ::unsetenv("TOKENMIX_ISA");
  }
  IsaEnv(const IsaEnv&) = delete;
  IsaEnv& operator=(const IsaEnv&) = delete;

 private:
  bool had_ = false;
  std::string old_;
};

// Every way prefill and step can fail, on a fresh sequence (attention_forward path) and on one
// that already holds tokens (attention_decode path), on a paged cache: the typed error, the cache
// unchanged byte for byte (storage, lengths, active flags, free blocks) and out not written.
// Afterwards the cache still behaves exactly like one that never saw the failures.
TEST(KVCacheErrors, FailedPrefillAndStepLeaveCacheUnchanged) {
  constexpr std::int64_t d = 32, dh = 16;
  LayerConfig cfg;
  cfg.d_model = d;
  cfg.heads_q = 4;
  cfg.heads_kv = 2;
  cfg.head_dim = dh;
  cfg.rope = RopeOptions{RopePairing::rotate_half, 10000.0, 0};
  CausalSelfAttention layer(cfg);
  layer.init_random(3);
  const KVCacheConfig cc{2, 3, 2, dh, 100, DType::bf16, 64, 3};  // 3 blocks of 64 in the pool
  KVCache c(cc), twin(cc);  // twin: the same successful calls, no failing ones
  std::mt19937_64 rng(8);
  const auto u = random_vec(110 * d, rng);
  std::vector<float> out(110 * d, kPoison), twin_out(out.size());
  auto U = [&](std::int64_t rows) {
    return std::span<const float>(u).first(static_cast<std::size_t>(rows * d));
  };
  auto O = [&](std::int64_t rows) {
    return std::span<float>(out).first(static_cast<std::size_t>(rows * d));
  };
  for (KVCache* x : {&c, &twin}) {
    layer.prefill(U(70), 1, 70, *x, 0, std::span<float>(twin_out).first(70 * d), 0);  // 2 blocks
    layer.prefill(U(5), 1, 5, *x, 1, std::span<float>(twin_out).first(5 * d), 0);
  }
  c.release(2);
  twin.release(2);
  // The failing calls; sequence 0 holds tokens (decode path), sequence 1 is empty (fresh path).
  auto untouched = [&] {
    return std::all_of(out.begin(), out.end(),
                       [](float x) { return std::isnan(x) || x == kPoison; });
  };
  auto expect_fails = [&](const char* what, ErrorCode code, const std::string& needle,
                          const std::function<void()>& f) {
    SCOPED_TRACE(what);
    const Snapshot before(c);
    try {
      f();
      ADD_FAILURE() << "no error thrown (" << what << ")";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_TRUE(Snapshot(c) == before) << "cache changed by a failing call (" << what << ")";
    EXPECT_TRUE(untouched()) << "out written by a failing call (" << what << ")";
  };
  CausalSelfAttention wide([&] {
    LayerConfig w = cfg;
    w.heads_q = w.heads_kv = 4;
    return w;
  }());
  CausalSelfAttention narrow([&] {
    LayerConfig w = cfg;
    w.head_dim = 8;
    return w;
  }());
  const auto avail = available_isas();
  for (std::int64_t seq0 : {0, 1}) {
    const std::string at = seq0 == 0 ? " (sequence with tokens)" : " (fresh sequence)";
    auto prefill = [&](std::int64_t T) {
      return [&, T] { layer.prefill(U(T), 1, T, c, 0, O(T), seq0); };
    };
    auto step = [&] { layer.step(U(1), 1, c, 0, O(1), seq0); };
    for (const char* bad : {"garbage", "avx3", "AVX2"}) {  // an invalid TOKENMIX_ISA
      IsaEnv env(bad);
      expect_fails(("TOKENMIX_ISA prefill" + at).c_str(), ErrorCode::invalid_argument,
                   "TOKENMIX_ISA", prefill(3));
      expect_fails(("TOKENMIX_ISA step" + at).c_str(), ErrorCode::invalid_argument, "TOKENMIX_ISA",
                   step);
    }
    for (Isa isa : {Isa::avx2, Isa::avx512, Isa::neon}) {  // a valid TOKENMIX_ISA this CPU lacks
      if (std::find(avail.begin(), avail.end(), isa) != avail.end()) continue;
      IsaEnv env(to_string(isa));
      expect_fails(("unsupported isa prefill" + at).c_str(), ErrorCode::unsupported, to_string(isa),
                   prefill(3));
      expect_fails(("unsupported isa step" + at).c_str(), ErrorCode::unsupported, to_string(isa),
                   step);
    }
    expect_fails(("u size" + at).c_str(), ErrorCode::shape_mismatch, "u.size()",
                 [&] { layer.prefill(U(5), 1, 3, c, 0, O(3), seq0); });
    expect_fails(("out size" + at).c_str(), ErrorCode::shape_mismatch, "out.size()",
                 [&] { layer.step(U(1), 1, c, 0, O(2), seq0); });
    expect_fails(("out overlaps u" + at).c_str(), ErrorCode::aliasing, "overlaps", [&] {
      std::vector<float> io(static_cast<std::size_t>(d), 0.5f);
      layer.step(io, 1, c, 0, io, seq0);
    });
    expect_fails(("batch 0" + at).c_str(), ErrorCode::invalid_argument, "batch",
                 [&] { layer.prefill(U(0), 0, 3, c, 0, O(0), seq0); });
    expect_fails(("seq 0" + at).c_str(), ErrorCode::invalid_argument, "seq",
                 [&] { layer.prefill(U(0), 1, 0, c, 0, O(0), seq0); });
    expect_fails(("batch * seq overflows" + at).c_str(), ErrorCode::overflow, "overflow", [&] {
      layer.prefill(U(1), std::int64_t{1} << 40, std::int64_t{1} << 40, c, 0, O(1), seq0);
    });
    expect_fails(("layer" + at).c_str(), ErrorCode::invalid_argument, "layer",
                 [&] { layer.step(U(1), 1, c, 2, O(1), seq0); });
    expect_fails(("negative layer" + at).c_str(), ErrorCode::invalid_argument, "layer",
                 [&] { layer.step(U(1), 1, c, -1, O(1), seq0); });
    expect_fails(("first_seq" + at).c_str(), ErrorCode::invalid_argument, "first_seq",
                 [&] { layer.step(U(4 - seq0), 4 - seq0, c, 0, O(4 - seq0), seq0); });
    expect_fails(("released" + at).c_str(), ErrorCode::invalid_argument, "released",
                 [&] { layer.step(U(3 - seq0), 3 - seq0, c, 0, O(3 - seq0), seq0); });
    expect_fails(("heads_kv" + at).c_str(), ErrorCode::shape_mismatch, "heads_kv",
                 [&] { wide.step(U(1), 1, c, 0, O(1), seq0); });
    expect_fails(("head_dim" + at).c_str(), ErrorCode::shape_mismatch, "head_dim",
                 [&] { narrow.step(U(1), 1, c, 0, O(1), seq0); });
    expect_fails(("capacity" + at).c_str(), ErrorCode::invalid_argument, "capacity",
                 prefill(seq0 == 0 ? 31 : 101));
  }
  // The pool: sequence 1 takes the last free block, then a prefill needing another one fails on
  // the decode path (sequence 1 grows past 64) and on the fresh path (sequence 2, reset).
  layer.prefill(U(60), 1, 60, c, 0, O(60), 1);
  layer.prefill(U(60), 1, 60, twin, 0, std::span<float>(twin_out).first(60 * d), 1);
  c.reset(2);
  twin.reset(2);
  std::fill(out.begin(), out.end(), kPoison);
  ASSERT_EQ(c.free_blocks(), 0);
  expect_fails("pool exhausted (decode path)", ErrorCode::invalid_argument, "pool",
               [&] { layer.prefill(U(10), 1, 10, c, 0, O(10), 1); });
  expect_fails("pool exhausted (fresh path)", ErrorCode::invalid_argument, "pool",
               [&] { layer.prefill(U(10), 1, 10, c, 0, O(10), 2); });
  {
    IsaEnv env("garbage");  // fails before the pool is consulted
    expect_fails("TOKENMIX_ISA with a full pool", ErrorCode::invalid_argument, "TOKENMIX_ISA",
                 [&] { layer.prefill(U(10), 1, 10, c, 0, O(10), 1); });
  }
  // After all that, both caches take the same step and end byte-identical, with equal outputs.
  std::vector<float> o1(2 * d), o2(2 * d);
  layer.step(U(2), 2, c, 0, o1, 0);
  layer.step(U(2), 2, twin, 0, o2, 0);
  EXPECT_TRUE(Snapshot(c) == Snapshot(twin)) << "failed calls left a trace in the cache";
  EXPECT_EQ(0, std::memcmp(o1.data(), o2.data(), o1.size() * sizeof(float)));
}

// Every way append can fail that the test above does not reach through the layer.
TEST(KVCacheErrors, FailedAppendLeavesCacheUnchanged) {
  std::mt19937_64 rng(6);
  KVCache c({1, 2, 2, 8, 70, DType::f16, 64, 2});
  const auto kv = random_vec(70 * 2 * 8, rng);
  append_rows(c, 0, 0, kv, 0, 65);  // both blocks: pool exhausted
  const auto K = [&](std::int64_t T) { return ConstTensorView::bthd(kv.data(), 1, T, 2, 8); };
  using AE = ArgumentError;
  ConstTensorView null_k = K(1);
  null_k.data = nullptr;
  expect_rejected<AE>(
      c, [&] { c.append(0, 0, null_k, K(1)); }, ErrorCode::null_pointer, "k.data");
  ConstTensorView neg = K(1);
  neg.strides[3] = -1;
  expect_rejected<AE>(
      c, [&] { c.append(0, 0, K(1), neg); }, ErrorCode::invalid_argument, "v.strides[3]");
  ConstTensorView neg_size = K(1);
  neg_size.shape[1] = -1;
  expect_rejected<AE>(
      c, [&] { c.append(0, 0, neg_size, K(1)); }, ErrorCode::invalid_argument, "k.shape[1]");
  ConstTensorView wide_extent = K(1);
  wide_extent.strides[2] = std::int64_t{1} << 62;
  expect_rejected<AE>(
      c, [&] { c.append(0, 0, K(1), wide_extent); }, ErrorCode::overflow, "v byte extent");
  ConstTensorView rank3 = K(1);
  rank3.rank = 3;
  expect_rejected<AE>(
      c, [&] { c.append(0, 0, rank3, K(1)); }, ErrorCode::shape_mismatch, "rank");
  expect_rejected<AE>(
      c, [&] { c.append(0, 1, K(1), K(1)); }, ErrorCode::invalid_argument, "pool");
  expect_rejected<AE>(
      c, [&] { c.append(0, 0, K(6), K(6)); }, ErrorCode::invalid_argument, "capacity");
  expect_rejected<AE>(
      c, [&] { c.append(0, -1, K(1), K(1)); }, ErrorCode::invalid_argument, "first_seq");
  ConstTensorView two = ConstTensorView::bthd(kv.data(), 2, 1, 2, 8);
  expect_rejected<AE>(
      c, [&] { c.append(0, 1, two, two); }, ErrorCode::invalid_argument, "first_seq");
}

// attention_decode never changes the cache; every failure also leaves out and lse unwritten.
TEST(KVCacheErrors, FailedDecodeWritesNothing) {
  std::mt19937_64 rng(7);
  KVCache c({1, 2, 2, 16, 100, DType::f32, 0, 0});
  const auto kv = random_vec(100 * 2 * 16, rng);
  append_rows(c, 0, 0, kv, 0, 40);
  append_rows(c, 0, 1, kv, 0, 20);
  std::vector<float> q = random_vec(2 * 3 * 4 * 16, rng), o(q.size() + 64, kPoison),
                     l(2 * 4 * 3 + 64, kPoison);
  const auto Q = ConstTensorView::bthd(q.data(), 2, 3, 4, 16);
  const auto Ov = TensorView::bthd(o.data(), 2, 3, 4, 16);
  const auto Lv = TensorView::bht(l.data(), 2, 4, 3);
  auto fails = [&](const char* what, ErrorCode code, const std::string& needle, TensorView out,
                   TensorView lse, const DecodeOptions& opt) {
    SCOPED_TRACE(what);
    expect_rejected<Error>(
        c, [&] { attention_decode(Q, c, 0, out, lse, opt); }, code, needle);
    EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](float x) {
      return std::isnan(x) || x == kPoison;
    })) << what;
    EXPECT_TRUE(std::all_of(l.begin(), l.end(), [](float x) {
      return std::isnan(x) || x == kPoison;
    })) << what;
  };
  {
    IsaEnv env("garbage");
    fails("TOKENMIX_ISA", ErrorCode::invalid_argument, "TOKENMIX_ISA", Ov, Lv, {});
  }
  DecodeOptions o_nan;
  o_nan.scale = std::nan("");
  fails("scale", ErrorCode::invalid_argument, "scale", Ov, Lv, o_nan);
  DecodeOptions o_thr;
  o_thr.threads = -1;
  fails("threads", ErrorCode::invalid_argument, "threads", Ov, Lv, o_thr);
  DecodeOptions o_isa;
  o_isa.isa = static_cast<Isa>(9);
  fails("isa value", ErrorCode::unsupported, "isa", Ov, Lv, o_isa);
  TensorView zero = Ov;
  zero.strides[1] = 0;
  fails("zero-stride out", ErrorCode::aliasing, "out.strides[1]", zero, Lv, {});
  TensorView lse_bad = Lv;
  lse_bad.shape[2] = 4;
  fails("lse shape", ErrorCode::shape_mismatch, "lse", Ov, lse_bad, {});
  TensorView over = Lv;
  over.data = o.data() + 5;
  fails("lse overlaps out", ErrorCode::aliasing, "overlap", Ov, over, {});
  TensorView out_q = Ov;
  out_q.data = q.data();
  fails("out overlaps q", ErrorCode::aliasing, "overlaps input q", out_q, Lv, {});
  TensorView nul = Ov;
  nul.data = nullptr;
  fails("null out", ErrorCode::null_pointer, "out", nul, Lv, {});
  // The score variants (DecodeOptions, as AttentionOptions).
  DecodeOptions o_w;
  o_w.window = 0;
  fails("window", ErrorCode::invalid_argument, "options.window", Ov, Lv, o_w);
  for (double cap : {0.0, -2.0, std::nan(""), HUGE_VAL, 1e-50, 1e300}) {
    DecodeOptions o_c;
    o_c.softcap = cap;
    fails("softcap", ErrorCode::invalid_argument, "options.softcap", Ov, Lv, o_c);
  }
  std::vector<float> heads(8, 0.5f);
  std::vector<std::int32_t> ints(4, 1);
  for (const char* which : {"options.alibi_slopes", "options.sinks"}) {
    auto with = [&](ConstTensorView v) {
      DecodeOptions x;
      (std::string(which) == "options.sinks" ? x.sinks : x.alibi_slopes) = v;
      return x;
    };
    fails(which, ErrorCode::shape_mismatch, std::string(which) + ".shape[0] (H_q)", Ov, Lv,
          with(ConstTensorView{heads.data(), DType::f32, 1, {3, 1, 1, 1}, {1}}));
    fails(which, ErrorCode::shape_mismatch, which, Ov, Lv,
          with(ConstTensorView{heads.data(), DType::f32, 2, {4, 2, 1, 1}, {2, 1}}));
    fails(which, ErrorCode::unsupported, which, Ov, Lv,
          with(ConstTensorView{ints.data(), DType::i32, 1, {4, 1, 1, 1}, {1}}));
  }
}

/// Sets the decode scratch limit (test seam, decode/decode_internal.hpp) for one scope.
struct ScratchLimit {
  explicit ScratchLimit(std::int64_t bytes) { detail::set_decode_scratch_limit_for_testing(bytes); }
  ~ScratchLimit() { detail::set_decode_scratch_limit_for_testing(-1); }
  ScratchLimit(const ScratchLimit&) = delete;
  ScratchLimit& operator=(const ScratchLimit&) = delete;
};

// Issue 11 leftover: prefill / step on a sequence that holds tokens appends K/V and then decodes;
// a ResourceError from the decode scratch must not leave the append behind. The scratch is
// reserved before the append, so the failure comes first: the cache is byte-identical, out is
// unwritten, and afterwards the cache behaves like one that never saw the failures. Also on a
// rolling cache, where a long prefill runs as several append + decode pieces.
TEST(KVCacheErrors, DecodeScratchFailureLeavesCacheUnchanged) {
  constexpr std::int64_t d = 32, dh = 16;
  std::mt19937_64 rng(23);
  const auto u = random_vec(300 * d, rng);
  for (std::int64_t window : {0, 40}) {
    SCOPED_TRACE("cache window " + std::to_string(window));
    LayerConfig cfg;
    cfg.d_model = d;
    cfg.heads_q = 4;
    cfg.heads_kv = 2;
    cfg.head_dim = dh;
    cfg.rope = RopeOptions{RopePairing::rotate_half, 10000.0, 0};
    if (window) cfg.attention.window = window;
    CausalSelfAttention layer(cfg);
    layer.init_random(5);
    const KVCacheConfig cc{1, 2, 2, dh, 1000, DType::f16, 64, 0, window};
    KVCache c(cc), twin(cc);
    const auto kv = random_vec(100 * 2 * dh, rng);
    for (KVCache* x : {&c, &twin}) {  // sequence 0 holds tokens: prefill / step decode
      append_rows(*x, 0, 0, kv, 0, 100);
      append_rows(*x, 0, 1, kv, 0, 30);
    }
    std::vector<float> out(300 * d, kPoison);
    auto untouched = [&] {
      return std::all_of(out.begin(), out.end(),
                         [](float x) { return std::isnan(x) || x == kPoison; });
    };
    auto U = [&](std::int64_t rows) {
      return std::span<const float>(u).first(static_cast<std::size_t>(rows * d));
    };
    auto O = [&](std::int64_t rows) {
      return std::span<float>(out).first(static_cast<std::size_t>(rows * d));
    };
    {
      ScratchLimit limit(64);  // far below any decode's scratch
      const std::function<void()> calls[] = {
          [&] { layer.step(U(1), 1, c, 0, O(1), 0); }, [&] { layer.step(U(2), 2, c, 0, O(2), 0); },
          [&] { layer.prefill(U(200), 1, 200, c, 0, O(200), 0); },  // pieces on the rolling cache
          [&] {
            std::vector<float> q = random_vec(2 * 4 * dh, rng);
            DecodeOptions o;
            if (window) o.window = window;
            attention_decode(ConstTensorView::bthd(q.data(), 2, 1, 4, dh), c, 0,
                             TensorView::bthd(out.data(), 2, 1, 4, dh), {}, o);
          }};
      for (const auto& call : calls) {
        const Snapshot before(c);
        try {
          call();
          ADD_FAILURE() << "no ResourceError under a 64-byte scratch limit";
        } catch (const ResourceError& e) {
          EXPECT_EQ(e.code(), ErrorCode::out_of_memory) << e.what();
          EXPECT_NE(std::string(e.what()).find("bytes"), std::string::npos) << e.what();
        }
        EXPECT_TRUE(Snapshot(c) == before) << "a failed call left its append in the cache";
        EXPECT_TRUE(untouched()) << "out written by a failed call";
      }
    }
    std::vector<float> o1(2 * d), o2(2 * d);
    layer.step(U(2), 2, c, 0, o1, 0);
    layer.step(U(2), 2, twin, 0, o2, 0);
    EXPECT_TRUE(Snapshot(c) == Snapshot(twin)) << "failed calls left a trace in the cache";
    EXPECT_EQ(0, std::memcmp(o1.data(), o2.data(), o1.size() * sizeof(float)));
    std::vector<float> p1(200 * d), p2(200 * d);
    layer.prefill(U(200), 1, 200, c, 0, p1, 0);  // and the long prefill now goes through
    layer.prefill(U(200), 1, 200, twin, 0, p2, 0);
    EXPECT_TRUE(Snapshot(c) == Snapshot(twin));
    EXPECT_EQ(0, std::memcmp(p1.data(), p2.data(), p1.size() * sizeof(float)));
  }
}

// Random churn: 12 caches from one fixed seed (1–2 layers, 1–3 sequences, H_kv 1–2, d_h 1–17,
// every dtype, contiguous or paged with a pool of 2–8 blocks, rolling or not), each taking 40
// random operations: appends of 1–70 positions to some sequences of one layer, truncate, release,
// reset of one sequence or of all, and calls that must fail (past the capacity, into a released
// sequence, beyond the pool's free blocks, below a rolling cache's oldest position, a NaN row
// into a quantized cache). A model keeps each layer's length, oldest held position and the values
// the cache held for every position right after its append. After every operation: a failed
// call left the cache byte for byte as it was, lengths and oldest positions match the model,
// every held row still holds its values (no operation on one sequence or layer touches another's
// rows, however the pool hands blocks round), and on a paged cache without a window the pool's
// free blocks are what the lengths leave (an append is refused exactly when they are too few).
// After the appends, each stored row is the appended one as the dtype stores it (f32 exactly, bf16
// / f16 rounded to nearest even; int8 within half a step δ = max|x| / 127, and x / δ's fp32
// rounding, 127u; fp8 within 2^-4 relative, or half its smallest step, 2^-10 δ, δ = max|x| / 448).
// A quantized cache's K (SPEC "Quantized KV cache") is held as appended while its 64-position
// tile is open, and within those bounds of its channel's step δ_{τ,e} (which covers every key of
// the channel in the tile) once the tile closes, in the append that brings the tile's 64th key;
// a truncate into a closed tile reopens it with its kept keys' values c · δ (fp32: within 2^-24),
// which the tile is quantized from again when it closes.
// At the end, a decode of every non-empty sequence of layer 0 against the float64 oracle over the
// held values (or, where a rolling cache no longer holds the keys of even one query, its refusal).
// 2000 draws passed once (D-tests-1).
TEST(KVCacheChurn, RandomOperationsKeepEveryHeldRow) {
  Picker pick(20261217);
  std::mt19937_64 rng(20261218);
  std::normal_distribution<float> dist;
  const DType dtypes[] = {DType::f32, DType::bf16, DType::f16, DType::int8, DType::fp8_e4m3};
  for (int draw = 0; draw < 12; ++draw) {
    KVCacheConfig cfg;
    cfg.layers = pick(1, 2);
    cfg.batch = pick(1, 3);
    cfg.heads_kv = pick(1, 2);
    cfg.head_dim = std::array<std::int64_t, 4>{1, 3, 8, 17}[pick(0, 3)];
    cfg.capacity = pick(60, 300);
    cfg.dtype = dtypes[pick(0, 4)];
    if (pick(0, 1) == 0) {
      cfg.block_tokens = 64;
      cfg.pool_blocks = pick(2, 8);
    }
    if (pick(0, 2) == 0) cfg.window = pick(1, 40);
    const std::int64_t L = cfg.layers, B = cfg.batch, H = cfg.heads_kv, D = cfg.head_dim;
    SCOPED_TRACE("draw " + std::to_string(draw) + ": " + std::to_string(L) + " layers, B " +
                 std::to_string(B) + ", H_kv " + std::to_string(H) + ", d_h " + std::to_string(D) +
                 ", T_max " + std::to_string(cfg.capacity) + ", " + to_string(cfg.dtype) +
                 ", block " + std::to_string(cfg.block_tokens) + " pool " +
                 std::to_string(cfg.pool_blocks) + ", window " + std::to_string(cfg.window));
    KVCache cache(cfg);
    const std::int64_t R = cache.retained_positions();
    const bool quantized = kernels::is_quantized(cfg.dtype);

    // The model: per (layer, sequence) length, oldest held position, held values [pos][H][2][D].
    struct Seq {
      std::int64_t length = 0, first = 0;
      std::vector<std::vector<double>> rows;  // rows[pos]: H·2·D values (K then V per head)
      std::vector<std::vector<float>> keys;   // quantized: keys[pos], H·D values its tile takes
    };
    std::vector<Seq> model(static_cast<std::size_t>(L * B));
    std::vector<bool> active(static_cast<std::size_t>(B), true);
    const auto seq = [&](std::int64_t l, std::int64_t b) -> Seq& { return model[l * B + b]; };
    const auto held = [&](std::int64_t l, std::int64_t b, std::int64_t pos) {
      std::vector<double> r;
      for (std::int64_t h = 0; h < H; ++h)
        for (bool value : {false, true})
          for (double x : cached_row(cache, l, b, pos, h, value)) r.push_back(x);
      return r;
    };
    // A paged cache without a window: sequence b holds ⌈max_l length / block⌉ blocks (its layers
    // share them), so the free blocks are known, and so is when an append must find too few.
    const bool counted = cache.paged() && cfg.window == 0;
    const auto blocks_of = [&](std::int64_t b, std::int64_t extra, std::int64_t layer) {
      std::int64_t longest = 0;
      for (std::int64_t l = 0; l < L; ++l)
        longest = std::max(longest, seq(l, b).length + (l == layer ? extra : 0));
      return (longest + cfg.block_tokens - 1) / cfg.block_tokens;
    };
    const auto blocks_held = [&] {
      std::int64_t n = 0;
      for (std::int64_t b = 0; b < B; ++b) n += active[b] ? blocks_of(b, 0, 0) : 0;
      return n;
    };
    const auto check_all = [&](const std::string& after) {
      for (std::int64_t l = 0; l < L; ++l)
        for (std::int64_t b = 0; b < B; ++b) {
          if (!active[b]) continue;
          const Seq& m = seq(l, b);
          ASSERT_EQ(cache.length(b, l), m.length) << after << ", layer " << l << " seq " << b;
          ASSERT_EQ(cache.first_position(b, l), m.first)
              << after << ", layer " << l << " seq " << b;
          for (std::int64_t p = m.first; p < m.length; ++p)
            ASSERT_EQ(held(l, b, p), m.rows[p])
                << after << ", layer " << l << " seq " << b << " position " << p;
        }
      EXPECT_GE(cache.free_blocks(), 0);
      EXPECT_LE(cache.free_blocks(), cache.pool_blocks());
      if (counted) {
        EXPECT_EQ(cache.free_blocks(), cache.pool_blocks() - blocks_held()) << after;
      }
    };
    // Calls that must fail: a typed error, the cache byte for byte as it was.
    const auto expect_refused = [&](const std::string& what, auto&& call) {
      const Snapshot before(cache);
      try {
        call();
        ADD_FAILURE() << what << ": no error";
      } catch (const Error& e) {
        EXPECT_TRUE(Snapshot(cache) == before)
            << what << ": the cache changed (" << e.what() << ")";
      }
    };
    // The stored values of a fresh append against the appended ones, as the dtype stores them.
    const auto expect_stored = [&](const std::vector<double>& got, const float* x) {
      for (std::int64_t r = 0; r < 2 * H; ++r) {  // a K or V row of one head
        if (quantized && r % 2 == 0) continue;    // (quantized K: expect_key_held)
        const float* row = x + r * D;
        const double* g = got.data() + r * D;
        double amax = 0.0;
        for (std::int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(double(row[i])));
        for (std::int64_t i = 0; i < D; ++i) {
          const double want = cfg.dtype == DType::f32    ? row[i]
                              : cfg.dtype == DType::bf16 ? bf16_to_f32(f32_to_bf16(row[i]))
                              : cfg.dtype == DType::f16  ? f16_to_f32(f32_to_f16(row[i]))
                                                         : row[i];
          const double delta = amax / (cfg.dtype == DType::int8 ? 127.0 : 448.0);
          const double tol = !quantized ? 0.0
                             : cfg.dtype == DType::int8
                                 ? 0.5 * delta * (1 + 4e-5)
                                 : 0x1.0p-4 * std::fabs(want) + 0x1.0p-10 * delta;
          ASSERT_LE(std::fabs(g[i] - want), tol) << "element " << i << " of row " << r;
        }
      }
    };

    // Quantized K of (l, b, pos) against the values its tile takes (Seq::keys): as they are in
    // the open tile; per channel e of a closed tile, the appended value within half a step of the
    // tile's δ_{τ,e} (int8) or E4M3's spacing (fp8), and δ_{τ,e} no smaller than the channel's
    // largest |value| over the held keys / 127 or / 448 (no key clipped).
    const auto expect_key_held = [&](std::int64_t l, std::int64_t b, std::int64_t pos) {
      const Seq& m = seq(l, b);
      for (std::int64_t h = 0; h < H; ++h) {
        const StoredRow r = stored_row(cache, l, b, pos, h, false);
        const std::vector<double> got = cached_row(cache, l, b, pos, h, false);
        const float* want = m.keys[static_cast<std::size_t>(pos)].data() + h * D;
        ASSERT_EQ(r.open, m.length % 64 != 0 && pos >= m.length / 64 * 64) << "position " << pos;
        for (std::int64_t e = 0; e < D; ++e) {
          const double x = want[e], g = got[static_cast<std::size_t>(e)];
          if (r.open) {
            ASSERT_EQ(g, x) << "open tile, position " << pos << " head " << h << " channel " << e;
            continue;
          }
          const double delta = r.deltas[static_cast<std::size_t>(e)];
          const double lim = cfg.dtype == DType::int8 ? 127.0 : 448.0;
          ASSERT_LE(std::fabs(x), lim * delta * (1 + 1e-6))
              << "position " << pos << " channel " << e;
          const double tol = cfg.dtype == DType::int8 ? 0.5 * delta * (1 + 4e-5)
                                                      : 0x1.0p-4 * std::fabs(x) + 0x1.0p-10 * delta;
          ASSERT_LE(std::fabs(g - x), tol)
              << "position " << pos << " head " << h << " channel " << e;
        }
      }
    };

    for (int op = 0; op < 40; ++op) {
      const std::int64_t kind = pick(0, 19);
      const std::int64_t b = pick(0, B - 1);
      std::string what = "op " + std::to_string(op);
      if (kind <= 11) {  // append T_new positions to sequences b … b + nb − 1 of layer l
        const std::int64_t l = pick(0, L - 1), nb = pick(1, B - b);
        const std::int64_t tnew = pick(0, 1) == 0 ? pick(1, 8) : pick(1, 70);
        what += ": append " + std::to_string(tnew) + " to layer " + std::to_string(l) + " seqs " +
                std::to_string(b) + "+" + std::to_string(nb);
        std::vector<float> k(static_cast<std::size_t>(nb * tnew * H * D)), v(k.size());
        for (float& x : k) x = dist(rng);
        for (float& x : v) x = dist(rng);
        const auto view = [&](std::vector<float>& x) {
          return ConstTensorView::bthd(x.data(), nb, tnew, H, D);
        };
        bool fits = true;
        for (std::int64_t i = b; i < b + nb; ++i)
          fits = fits && active[i] && seq(l, i).length + tnew <= cfg.capacity;
        if (!fits) {
          expect_refused(what, [&] { cache.append(l, b, view(k), view(v)); });
          continue;
        }
        if (quantized && pick(0, 9) == 0) {  // a NaN row: nothing of the batch appended
          std::vector<float> bad = k;
          bad[bad.size() - 1] = std::numeric_limits<float>::quiet_NaN();
          expect_refused(what + " (NaN)", [&] { cache.append(l, b, view(bad), view(v)); });
        }
        const std::int64_t free_before = cache.free_blocks();
        std::int64_t more = 0;  // blocks the append takes (counted caches)
        for (std::int64_t i = b; counted && i < b + nb; ++i)
          more += blocks_of(i, tnew, l) - blocks_of(i, 0, 0);
        try {
          cache.append(l, b, view(k), view(v));
          if (counted) {
            EXPECT_LE(more, free_before) << what << ": appended into blocks the pool did not have";
          }
        } catch (const ArgumentError& e) {  // the pool ran out: refused whole, nothing changed
          ASSERT_TRUE(cache.paged()) << what << ": " << e.what();
          if (counted) {
            EXPECT_GT(more, free_before) << what << ": refused with enough free blocks";
          }
          EXPECT_NE(std::string(e.what()).find("block"), std::string::npos) << e.what();
          EXPECT_EQ(cache.free_blocks(), free_before);
          check_all(what + " (refused)");
          continue;
        }
        for (std::int64_t i = 0; i < nb; ++i) {
          Seq& m = seq(l, b + i);
          const std::int64_t old = m.length;
          m.rows.resize(static_cast<std::size_t>(m.length + tnew));
          m.keys.resize(m.rows.size());
          m.length += tnew;
          m.first = std::max(m.first, m.length - R);
          for (std::int64_t t = 0; t < tnew; ++t)  // the K rows of every head, [H][D]
            for (std::int64_t h = 0; h < H; ++h)
              for (std::int64_t e = 0; e < D; ++e)
                m.keys[static_cast<std::size_t>(old + t)].push_back(
                    k[static_cast<std::size_t>(((i * tnew + t) * H + h) * D + e)]);
          // The rows this append set: the new ones still held, and (quantized) the open tile's
          // earlier keys, whose tile may have closed.
          const std::int64_t from = std::max(m.first, quantized ? old / 64 * 64 : old);
          for (std::int64_t pos = from; pos < m.length; ++pos) {
            m.rows[pos] = held(l, b + i, pos);
            if (quantized) expect_key_held(l, b + i, pos);
            if (pos < old) continue;
            const std::int64_t t = pos - old;
            std::vector<float> x;  // the appended K and V rows of every head, as held() orders them
            for (std::int64_t h = 0; h < H; ++h)
              for (const std::vector<float>* src : {&k, &v})
                for (std::int64_t e = 0; e < D; ++e)
                  x.push_back((*src)[static_cast<std::size_t>(((i * tnew + t) * H + h) * D + e)]);
            expect_stored(m.rows[pos], x.data());
          }
        }
      } else if (kind <= 15) {  // truncate
        if (!active[b]) {
          expect_refused(what + ": truncate a released sequence", [&] { cache.truncate(b, 0); });
          continue;
        }
        std::int64_t longest = 0;
        for (std::int64_t l = 0; l < L; ++l) longest = std::max(longest, seq(l, b).length);
        const std::int64_t n = pick(0, longest + 2);
        what += ": truncate seq " + std::to_string(b) + " to " + std::to_string(n);
        bool ok = n <= longest;
        for (std::int64_t l = 0; l < L; ++l)
          ok = ok && (n == 0 || n >= seq(l, b).length || n >= seq(l, b).first);
        if (!ok) {
          expect_refused(what, [&] { cache.truncate(b, n); });
          continue;
        }
        cache.truncate(b, n);
        for (std::int64_t l = 0; l < L; ++l) {
          Seq& m = seq(l, b);
          if (n >= m.length) continue;
          // Quantized: a closed tile that n falls inside reopens; its kept keys are held as
          // c · δ_{τ,e} rounded to fp32, and the tile takes those values when it closes again.
          const std::int64_t t0 = n / 64 * 64;
          const bool reopens = quantized && n % 64 != 0 && m.length >= t0 + 64;
          m.length = n;
          if (n == 0) m.first = 0;
          m.rows.resize(static_cast<std::size_t>(n));
          m.keys.resize(m.rows.size());
          for (std::int64_t pos = std::max(m.first, t0); reopens && pos < n; ++pos) {
            const std::vector<double> got = held(l, b, pos);
            std::vector<double>& was = m.rows[static_cast<std::size_t>(pos)];
            for (std::int64_t h = 0; h < H; ++h)
              for (std::int64_t e = 0; e < 2 * D; ++e) {
                const std::size_t at = static_cast<std::size_t>(h * 2 * D + e);
                ASSERT_LE(std::fabs(got[at] - was[at]), 0x1.0p-24 * std::fabs(was[at]))
                    << what << ": position " << pos << " head " << h << " element " << e;
                if (e < D) {
                  m.keys[static_cast<std::size_t>(pos)][static_cast<std::size_t>(h * D + e)] =
                      static_cast<float>(got[at]);
                }
              }
            was = got;
          }
        }
      } else if (kind == 16) {  // release
        what += ": release seq " + std::to_string(b);
        cache.release(b);
        active[b] = false;
        for (std::int64_t l = 0; l < L; ++l) seq(l, b) = Seq{};
      } else if (kind <= 18) {  // reset one
        what += ": reset seq " + std::to_string(b);
        cache.reset(b);
        active[b] = true;
        for (std::int64_t l = 0; l < L; ++l) seq(l, b) = Seq{};
      } else if (pick(0, 1) == 0) {  // reset all
        what += ": reset";
        cache.reset();
        std::fill(active.begin(), active.end(), true);
        for (Seq& m : model) m = Seq{};
        if (cache.paged()) {
          EXPECT_EQ(cache.free_blocks(), cache.pool_blocks());
        }  // (a contiguous cache's sequences keep their blocks)
      } else {
        continue;
      }
      check_all(what);
      if (::testing::Test::HasFatalFailure()) return;
    }

    // Decode every non-empty active sequence of layer 0 against the oracle over the held values.
    for (std::int64_t b = 0; b < B; ++b) {
      if (!active[b] || seq(0, b).length == 0) continue;
      // T_new ≤ 3 queries whose keys are all still held (a rolling cache: the window's keys of
      // the first query from first_position on); none such: the call must be refused.
      const Seq& m = seq(0, b);
      std::int64_t tnew = std::min<std::int64_t>(m.length, 3);
      if (cfg.window && m.first > 0) tnew = std::min(tnew, m.length - m.first - cfg.window + 1);
      const std::int64_t hq = 2 * H;
      DecodeOptions o;
      o.first_seq = b;
      reference::Options ro;
      if (cfg.window) o.window = ro.window = cfg.window;
      if (tnew < 1) {
        StridedTensor q1(1, 1, hq, D, Layout::bthd), out1(1, 1, hq, D, Layout::bthd);
        q1.fill_random(rng);
        EXPECT_THROW(attention_decode(q1.view, cache, 0, out1.view, {}, o), ArgumentError);
        continue;
      }
      // q [B, …] (cache_oracle reads its row b); the call gets row b alone, as sequence b.
      StridedTensor q(B, tnew, hq, D, Layout::bthd), out(1, tnew, hq, D, Layout::bthd);
      q.fill_random(rng);
      TensorView row_b = q.view;
      row_b.data = static_cast<float*>(q.view.data) + b * q.view.strides[0];
      row_b.shape[0] = 1;
      std::vector<float> lse(static_cast<std::size_t>(hq * tnew), kPoison);
      attention_decode(row_b, cache, 0, out.view, TensorView::bht(lse.data(), 1, hq, tnew), o);
      expect_decode_matches(out, lse, {cache_oracle(q, b, cache, 0, ro)});
    }
  }
}

}  // namespace
}  // namespace tokenmix::testing
