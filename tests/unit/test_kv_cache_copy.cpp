// tests/unit/test_kv_cache_copy.cpp — KVCache::copy_sequences (tokenmix/kv_cache.hpp): beam
// search's reordering (source = the cache itself, sources with repeats) and a change of batch
// (a new cache copying from an old one). A copy must equal a cache that was appended the same
// rows directly: the same storage bytes (contiguous caches), lengths, first positions and decode
// results (every flavour: contiguous, paged, rolling, quantized). Every bad argument is a typed
// error naming it, with the cache unchanged byte for byte.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "test_util.hpp"
#include "tokenmix/error.hpp"
#include "tokenmix/kv_cache.hpp"

namespace tokenmix::testing {
namespace {

constexpr std::int64_t kH = 2, kD = 16, kLayers = 2;

std::vector<float> rows(std::int64_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist;
  std::vector<float> x(static_cast<std::size_t>(n * kH * kD));
  for (float& e : x) e = dist(rng);
  return x;
}

// Sequence s of a "source" holds lengths[s] rows of rows(…, seed 100 + s) in every layer (layer
// l's rows shifted by l, so layers differ), appended in chunks of 37.
const std::int64_t kLengths[3] = {150, 40, 0};

void fill(KVCache& c, std::int64_t seq, std::int64_t src) {
  const auto kv = rows(kLengths[src] + kLayers, 100 + static_cast<std::uint64_t>(src));
  for (std::int64_t l = 0; l < kLayers; ++l)
    for (std::int64_t t = 0; t < kLengths[src]; t += 37) {
      const std::int64_t n = std::min<std::int64_t>(37, kLengths[src] - t);
      const auto view = ConstTensorView::bthd(kv.data() + (t + l) * kH * kD, 1, n, kH, kD);
      c.append(l, seq, view, view);
    }
}

KVCacheConfig config(std::int64_t batch, DType dtype, std::int64_t block, std::int64_t window) {
  KVCacheConfig c;
  c.layers = kLayers;
  c.batch = batch;
  c.heads_kv = kH;
  c.head_dim = kD;
  c.capacity = 256;
  c.dtype = dtype;
  c.block_tokens = block;
  c.window = window;
  return c;
}

std::vector<float> decode_all(const KVCache& c, std::int64_t layer) {
  const std::int64_t B = c.config().batch;
  const auto q = rows(B * 2, 7);  // [B, 1, H_q = 4, d_h]
  std::vector<float> out(static_cast<std::size_t>(B * 4 * kD));
  DecodeOptions o;
  if (c.window() != 0) o.window = c.window();
  attention_decode(ConstTensorView::bthd(q.data(), B, 1, 4, kD), c, layer,
                   TensorView::bthd(out.data(), B, 1, 4, kD), {}, o);
  return out;
}

void expect_same(const KVCache& got, const KVCache& want, bool bytes) {
  for (std::int64_t l = 0; l < kLayers; ++l)
    for (std::int64_t b = 0; b < want.config().batch; ++b) {
      EXPECT_EQ(got.length(b, l), want.length(b, l)) << "seq " << b << " layer " << l;
      EXPECT_EQ(got.first_position(b, l), want.first_position(b, l));
      EXPECT_TRUE(got.active(b));
    }
  if (bytes) {
    ASSERT_EQ(got.raw_storage().size(), want.raw_storage().size());
    EXPECT_EQ(0, std::memcmp(got.raw_storage().data(), want.raw_storage().data(),
                             got.raw_storage().size()));
  }
  for (std::int64_t l = 0; l < kLayers; ++l) {
    const auto a = decode_all(got, l), b = decode_all(want, l);
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << "layer " << l;
  }
}

struct Flavour {
  DType dtype;
  std::int64_t block, window;
};

const Flavour kFlavours[] = {{DType::f32, 0, 0},       {DType::bf16, 64, 0}, {DType::int8, 0, 0},
                             {DType::fp8_e4m3, 64, 0}, {DType::f32, 0, 50},  {DType::f16, 64, 50}};

TEST(KVCacheCopy, NewBatchEqualsAppendingTheSourceRows) {
  for (const Flavour& f : kFlavours) {
    SCOPED_TRACE("dtype " + std::string(to_string(f.dtype)) + " block " + std::to_string(f.block) +
                 " window " + std::to_string(f.window));
    KVCache source(config(3, f.dtype, f.block, f.window));
    for (std::int64_t s = 0; s < 3; ++s) fill(source, s, s);
    const std::vector<std::int64_t> sources = {1, 0, 0, 2, 1};  // repeats, a different batch
    KVCache got(config(5, f.dtype, f.block, f.window)), want(config(5, f.dtype, f.block, f.window));
    fill(got, 4, 0);  // overwritten: held rows of the destination are dropped
    got.copy_sequences(source, sources);
    for (std::int64_t b = 0; b < 5; ++b) fill(want, b, sources[static_cast<std::size_t>(b)]);
    expect_same(got, want, f.block == 0);
    if (f.block != 0) {
      EXPECT_EQ(got.free_blocks(), want.free_blocks());
      got.reset();  // every block back, zeroed
      for (std::byte x : got.raw_storage()) ASSERT_EQ(x, std::byte{0});
    }
  }
}

TEST(KVCacheCopy, ReorderInPlaceIsBeamSearchReordering) {
  for (const Flavour& f : kFlavours) {
    SCOPED_TRACE("dtype " + std::string(to_string(f.dtype)) + " block " + std::to_string(f.block) +
                 " window " + std::to_string(f.window));
    KVCache c(config(3, f.dtype, f.block, f.window)), want(config(3, f.dtype, f.block, f.window));
    for (std::int64_t s = 0; s < 3; ++s) fill(c, s, s);
    const std::vector<std::int64_t> beams = {2, 0, 0};  // sequence 1 dropped, 0 twice
    c.copy_sequences(c, beams);
    for (std::int64_t b = 0; b < 3; ++b) fill(want, b, beams[static_cast<std::size_t>(b)]);
    expect_same(c, want, f.block == 0);
    const std::vector<std::int64_t> identity = {0, 1, 2};
    c.copy_sequences(c, identity);
    expect_same(c, want, f.block == 0);
  }
}

TEST(KVCacheCopy, GrowingPagedCacheKeepsEveryRow) {
  KVCache small(config(2, DType::bf16, 64, 0));
  KVCacheConfig big_config = config(2, DType::bf16, 64, 0);
  big_config.capacity = 1024;
  big_config.pool_blocks = 40;
  KVCache big(big_config), want(big_config);
  fill(small, 0, 0);
  fill(small, 1, 1);
  big.copy_sequences(small, std::vector<std::int64_t>{0, 1});
  fill(want, 0, 0);
  fill(want, 1, 1);
  expect_same(big, want, false);
  EXPECT_EQ(big.free_blocks(), 40 - 3 - 1);
}

template <class Err, class F>
void expect_rejected(const KVCache& c, F&& f, ErrorCode code, const std::string& needle) {
  const std::vector<std::byte> before(c.raw_storage().begin(), c.raw_storage().end());
  std::vector<std::int64_t> lengths;
  for (std::int64_t b = 0; b < c.config().batch; ++b) lengths.push_back(c.length(b, 1));
  const std::int64_t free_before = c.free_blocks();
  try {
    f();
    ADD_FAILURE() << "no error thrown; expected one mentioning '" << needle << "'";
  } catch (const Err& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("KVCache::copy_sequences"), std::string::npos);
  }
  EXPECT_EQ(0, std::memcmp(before.data(), c.raw_storage().data(), before.size())) << needle;
  for (std::int64_t b = 0; b < c.config().batch; ++b) EXPECT_EQ(c.length(b, 1), lengths[b]);
  EXPECT_EQ(c.free_blocks(), free_before);
}

TEST(KVCacheCopyErrors, BadArgumentsAreTypedAndLeaveTheCacheUnchanged) {
  using AE = ArgumentError;
  constexpr ErrorCode bad = ErrorCode::invalid_argument;
  KVCache source(config(3, DType::f32, 64, 0));
  for (std::int64_t s = 0; s < 3; ++s) fill(source, s, s);
  KVCache c(config(2, DType::f32, 64, 0));
  fill(c, 0, 1);
  using V = std::vector<std::int64_t>;
  expect_rejected<AE>(
      c, [&] { c.copy_sequences(source, V{0}); }, bad, "sources must name");
  expect_rejected<AE>(
      c,
      [&] {
        c.copy_sequences(source, V{0, 3});
      },
      bad, "sources[1]");
  expect_rejected<AE>(
      c,
      [&] {
        c.copy_sequences(source, V{-1, 0});
      },
      bad, "sources[0]");
  expect_rejected<AE>(
      c,
      [&] {
        c.copy_sequences(c, V{0, 2});
      },
      bad, "sources[1]");
  const auto mismatch = [&](KVCacheConfig other, const char* needle) {
    KVCache o(other);
    expect_rejected<AE>(
        c,
        [&] {
          c.copy_sequences(o, V{0, 0});
        },
        bad, needle);
  };
  KVCacheConfig o = config(2, DType::f32, 64, 0);
  o.layers = 3;
  mismatch(o, "source.layers");
  o = config(2, DType::f32, 64, 0);
  o.heads_kv = 1;
  mismatch(o, "source.heads_kv");
  o = config(2, DType::f32, 64, 0);
  o.head_dim = 8;
  mismatch(o, "source.head_dim");
  mismatch(config(2, DType::bf16, 64, 0), "source.dtype");
  mismatch(config(2, DType::f32, 128, 0), "source.block_tokens()");
  mismatch(config(2, DType::f32, 64, 50), "source.window");
  o = config(2, DType::int8, 64, 0);
  o.int8_quads = true;
  KVCache quads(o);
  KVCache rows_cache(config(2, DType::int8, 64, 0));
  expect_rejected<AE>(
      rows_cache,
      [&] {
        rows_cache.copy_sequences(quads, V{0, 0});
      },
      bad, "source.int8_quads()");
  // Released source sequence.
  KVCache released(config(3, DType::f32, 64, 0));
  released.release(1);
  expect_rejected<AE>(
      c,
      [&] {
        c.copy_sequences(released, V{0, 1});
      },
      bad, "released");
  // Capacity: sequence 0 of source holds 150 positions.
  KVCacheConfig tight = config(2, DType::f32, 64, 0);
  tight.capacity = 100;
  KVCache t(tight);
  expect_rejected<AE>(
      t,
      [&] {
        t.copy_sequences(source, V{1, 0});
      },
      bad, "capacity");
  // Pool: 3 + 3 blocks wanted, 4 in the pool.
  KVCacheConfig pool = config(2, DType::f32, 64, 0);
  pool.pool_blocks = 4;
  KVCache p(pool);
  expect_rejected<AE>(
      p,
      [&] {
        p.copy_sequences(source, V{0, 0});
      },
      bad, "pool");
  p.copy_sequences(source, V{0, 1});  // 3 + 1 blocks fit
  EXPECT_EQ(p.free_blocks(), 0);
  EXPECT_EQ(p.length(0, 1), 150);
}

}  // namespace
}  // namespace tokenmix::testing
