// tests/unit/test_decode_multi.cpp — attention_decode with several new tokens per sequence
// (T_new = 1 … 70: speculative decoding, chunked prefill) and batches of very different sequence
// lengths, on every ISA path this machine supports, every cache dtype, contiguous and paged
// caches, against the float64 oracle over the values the cache holds (kv_oracle.hpp; quantized
// caches: the dequantized x̂ = q · δ), bound rel_err ≤ 2e-5 on O and on L (4.4–4.5).
//
// The kernels stack g heads × qblock query positions as the rows of a unit (rows ≤ 128, so
// qblock = min(T_new, 128 / g)), walk 64-key tiles and split keys into 1024-key chunks merged in
// a fixed order (SPEC "Merging partial results"). The queries are the last T_new positions of
// each sequence (bottom-right causal mask, SPEC 4.3): query t of a sequence of L positions sees
// keys 0 … L − T_new + t, so within the new block each row sees one key more than the row
// before, and rows with L − T_new + t < 0 (L < T_new) see no key (O = 0, L = −∞). The sampled
// T_new (1 … 16, 31–33, 63–65, 70) with g ∈ {1, 4, 8} straddle the query-block edges (qblock
// 128, 32, 16), the lengths (< T_new, 63/64/65, 1023/1024/1025) the key-tile and chunk edges,
// and every batch mixes lengths so chunks past a short sequence's keys are empty units. Queries
// are strided views; outputs are poisoned (NaN) and their padding must stay so; lse is checked;
// 1 and 2 threads (1, 2 and 3 where runs of units differ) must give bitwise identical results.
// Sized to stay cheap under the sanitizers.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "decode/decode_internal.hpp"
#include "kernels/attention_kernels.hpp"
#include "kernels/kv_element.hpp"
#include "kv_oracle.hpp"
#include "test_util.hpp"

namespace tokenmix::testing {
namespace {

constexpr DType kCacheTypes[] = {DType::f32, DType::bf16, DType::f16, DType::int8, DType::fp8_e4m3};

struct MultiCase {
  std::vector<std::int64_t> lengths;
  std::int64_t tnew, hq, hkv, dh;
  DType dtype;
  std::int64_t block;  // 0: contiguous; else paged, positions per block
};

std::string describe(const MultiCase& c) {
  std::string s = "lengths=";
  for (std::int64_t L : c.lengths) s += std::to_string(L) + ",";
  return s + " T_new=" + std::to_string(c.tnew) + " H_q=" + std::to_string(c.hq) +
         " H_kv=" + std::to_string(c.hkv) + " d_h=" + std::to_string(c.dh) +
         " dtype=" + to_string(c.dtype) + " block=" + std::to_string(c.block);
}

// Appends rows of uniform values in [−√3, √3) (variance 1; two per draw of the generator, as
// normal deviates would dominate the test's time) in pieces of 1, 37, 200, … positions (offsets
// across tiles and blocks), sequences interleaved so a paged cache's blocks interleave.
void fill(KVCache& cache, std::int64_t layer, const std::vector<std::int64_t>& lengths,
          std::mt19937_64& rng) {
  const std::int64_t H = cache.config().heads_kv, D = cache.config().head_dim;
  const std::int64_t pieces[] = {1, 37, 200, 5, 900, 64};
  const auto uniform = [&rng](std::vector<float>& x) {
    constexpr float kScale = 2.0f * 1.7320508f / 4294967296.0f;  // 2√3 / 2^32
    for (std::size_t i = 0; i < x.size(); i += 2) {
      const std::uint64_t bits = rng();
      x[i] = static_cast<float>(bits & 0xffffffffu) * kScale - 1.7320508f;
      if (i + 1 < x.size()) x[i + 1] = static_cast<float>(bits >> 32) * kScale - 1.7320508f;
    }
  };
  std::vector<std::int64_t> done(lengths.size(), 0);
  for (int round = 0;; ++round) {
    bool any = false;
    for (std::size_t b = 0; b < lengths.size(); ++b) {
      const std::int64_t n = std::min(pieces[round % 6], lengths[b] - done[b]);
      if (n <= 0) continue;
      any = true;
      std::vector<float> k(static_cast<std::size_t>(n * H * D)), v(k.size());
      uniform(k);
      uniform(v);
      cache.append(layer, static_cast<std::int64_t>(b), ConstTensorView::bthd(k.data(), 1, n, H, D),
                   ConstTensorView::bthd(v.data(), 1, n, H, D));
      done[b] += n;
    }
    if (!any) break;
  }
}

// Runs the case on `isa` with each of `threads` (1 and 2 by default): each against the oracle,
// all bitwise equal, padding of the (strided, poisoned) output untouched.
// A case's inputs for `seed`: the cache filled to its lengths, then Q (in that order from one
// generator, so every use of the same case and seed sees the same values).
struct CaseInputs {
  CaseInputs(const MultiCase& c, std::uint64_t seed)
      : rng(seed),
        B(static_cast<std::int64_t>(c.lengths.size())),
        cache({1, B, c.hkv, c.dh, *std::max_element(c.lengths.begin(), c.lengths.end()), c.dtype,
               c.block, 0}),
        q(B, c.tnew, c.hq, c.dh, Layout::strided) {
    fill(cache, 0, c.lengths, rng);
    q.fill_random(rng);
  }
  std::mt19937_64 rng;
  std::int64_t B;
  KVCache cache;
  StridedTensor q;
};

void run_case(const MultiCase& c, Isa isa, std::uint64_t seed,
              const std::vector<int>& threads = {1, 2}) {
  SCOPED_TRACE(describe(c));
  const CaseInputs in(c, seed);
  const std::int64_t B = in.B;
  const KVCache& cache = in.cache;
  const StridedTensor& q = in.q;
  std::vector<reference::ForwardResult> refs;
  for (std::int64_t b = 0; b < B; ++b) refs.push_back(cache_oracle(q, b, cache, 0));
  std::vector<StridedTensor> outs;  // reserved: each view points into its own storage
  std::vector<std::vector<float>> lses;
  outs.reserve(threads.size());
  for (const int n : threads) {
    outs.emplace_back(B, c.tnew, c.hq, c.dh, Layout::strided);
    lses.emplace_back(static_cast<std::size_t>(B * c.hq * c.tnew), kPoison);
    DecodeOptions o;
    o.isa = isa;
    o.threads = n;
    attention_decode(q.view, cache, 0, outs.back().view,
                     TensorView::bht(lses.back().data(), B, c.hq, c.tnew), o);
    SCOPED_TRACE("threads=" + std::to_string(n));
    expect_decode_matches(outs.back(), lses.back(), refs);
    // Every output is finite here (a row that sees no key gets O = 0); the padding stays NaN.
    std::int64_t written = 0;
    for (float x : outs.back().storage) written += std::isnan(x) ? 0 : 1;
    EXPECT_EQ(written, B * c.tnew * c.hq * c.dh);
  }
  for (std::size_t i = 1; i < outs.size(); ++i) {
    SCOPED_TRACE("threads=" + std::to_string(threads[i]) + " against " +
                 std::to_string(threads[0]));
    EXPECT_EQ(0, std::memcmp(outs[0].storage.data(), outs[i].storage.data(),
                             outs[0].storage.size() * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(lses[0].data(), lses[i].data(), lses[0].size() * sizeof(float)));
  }
}

// T_new sampled over 1 … 16 and the query-block edges; per sample a group size (1, 4, 8; MQA:
// one KV head), a head width (16, 40, 72: not a multiple of 16, 7: scalar tail), a cache dtype
// and kind (all 10 combinations over the samples), and three lengths: one below T_new (leading
// rows see nothing), one at the 64-key tile edge, and one at the 1024-key chunk edge (every third
// sample; else a few tiles long, to keep the float64 oracle cheap).
std::vector<MultiCase> tnew_cases() {
  const std::int64_t tnews[] = {1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12,
                                13, 14, 15, 16, 31, 32, 33, 63, 64, 65, 70};
  std::vector<MultiCase> cases;
  for (std::int64_t i = 0; i < static_cast<std::int64_t>(std::size(tnews)); ++i) {
    const std::int64_t tnew = tnews[i];
    // g = 4 puts 31/32/33 and 63/64/65 across one and two 32-position blocks; g = 8 makes
    // 16-position blocks (33: 16 + 16 + 1, 64: four full, 70: 4 + a partial one).
    const std::int64_t g = tnew <= 16 ? std::array<std::int64_t, 3>{1, 4, 8}[i % 3]
                           : (tnew == 33 || tnew == 64 || tnew == 70) ? 8
                                                                      : 4;
    // One KV head: MHA (g = 1) or MQA (g > 1); all of the long T_new (the oracle's cost).
    const std::int64_t hkv = i % 4 == 3 || tnew > 16 ? 1 : 2;
    const std::int64_t dh = std::array<std::int64_t, 4>{16, 40, 72, 7}[i % 4];
    const std::int64_t shortest = std::max<std::int64_t>(1, tnew / 2);  // < T_new from T_new 2
    const std::int64_t tile_edge = 63 + i % 3;
    const std::int64_t longest = i % 3 == 0 ? 1023 + (i / 3) % 3 : 129 + i;
    cases.push_back({{tile_edge, longest, shortest},
                     tnew,
                     g * hkv,
                     hkv,
                     dh,
                     kCacheTypes[i % 5],
                     i % 2 == 0 ? 0 : 64});
  }
  return cases;
}

class DecodeMulti : public PerIsaTest {};

TEST_P(DecodeMulti, TnewAcrossQueryBlocksTilesAndChunks) {
  std::uint64_t seed = 100;
  for (const MultiCase& c : tnew_cases()) run_case(c, GetParam(), ++seed);
}

// B = 3 sequences of very different lengths (5, 700, 2100: one, one and three chunks), every
// cache dtype, contiguous and paged; small heads.
TEST_P(DecodeMulti, MixedLengthsEveryDtypeAndCache) {
  std::uint64_t seed = 200;
  for (DType dt : kCacheTypes)
    for (std::int64_t block : {0, 128})
      run_case({{5, 700, 2100}, 2, 4, 1, 40, dt, block}, GetParam(), ++seed);
}

// Units whose row blocks hold at most 4 rows (T_new · g = 3, 4, 7, 8: AVX2 computes an int8
// cache's products there in 3-vector column blocks, 24 + 24 + 16 keys of a tile) over head widths
// that split into 3- and 2-vector blocks in every way (8, 16, 24, 40, 48, 56, 72, 128, 136) or
// leave a scalar tail (7, 30), and tiles cut at every 8 keys (a sequence's last tile of 1, 9, …,
// 57 keys: the vectors computed, nv, take every value). Every ISA; int8, fp8 E4M3 (read directly:
// AVX2 takes these blocks for both) and f32.
TEST_P(DecodeMulti, RowBlocksOfAtMostFourRowsEveryColumnSplit) {
  struct Shape {
    std::int64_t tnew, g;
  };
  const Shape shapes[] = {{1, 4}, {2, 4}, {1, 3}, {1, 8}, {1, 7}, {3, 1}, {2, 2}, {8, 1}};
  const std::int64_t widths[] = {8, 16, 24, 40, 48, 56, 72, 128, 136, 7, 30};
  std::uint64_t seed = 400;
  for (std::size_t i = 0; i < std::size(widths); ++i) {
    const Shape s = shapes[i % std::size(shapes)];
    const std::int64_t cut = 1 + 8 * static_cast<std::int64_t>(i % 8);  // the last tile's keys
    const DType dt = i % 4 == 3 ? DType::fp8_e4m3 : i % 4 == 1 ? DType::f32 : DType::int8;
    // fp8: its direct reading (the 3-vector blocks' type there) whatever this CPU's default.
    const ScopedEnv widen("TOKENMIX_FP8_WIDEN", "direct");
    run_case({{128 + cut, 64 + (cut + 8) % 64 + 1, s.tnew},
              s.tnew,
              2 * s.g,
              2,
              widths[i],
              dt,
              i % 2 == 0 ? 0 : 64},
             GetParam(), ++seed);
  }
}

// The output of one call over run_case's inputs for `seed`, on the default thread count.
std::vector<float> decode_output(const MultiCase& c, Isa isa, std::uint64_t seed) {
  const CaseInputs in(c, seed);
  StridedTensor out(in.B, c.tnew, c.hq, c.dh, Layout::strided);
  DecodeOptions o;
  o.isa = isa;
  attention_decode(in.q.view, in.cache, 0, out.view, {}, o);
  return out.storage;
}

void expect_same_bits(const std::vector<float>& x, const std::vector<float>& y) {
  ASSERT_EQ(x.size(), y.size());
  EXPECT_EQ(0, std::memcmp(x.data(), y.data(), x.size() * sizeof(float)));
}

// The x86 kernels' prefetch order (TOKENMIX_LINEAR_PREFETCH, DecodeArgs::linear_prefetch: every
// cache dtype's next tile pair in address order, or the path's per-dtype choice) changes what is
// prefetched, never what is computed: for every cache dtype (fp8 through both of its readings),
// contiguous and paged, T_new = 1 (AVX-512's regular units; AVX2's int8 and direct fp8 4 × 3
// blocks, 24 + 24 + 16 keys, which then advance the cursor too) and 5 (tall units: the cursor
// shared by their row blocks), with sequences of several chunks (runs of units carry the
// cursor's stream on into the next chunk) and one that ends mid-tile, each order against the
// oracle on 1 and 2 threads and the two bitwise equal. Every ISA (portable and NEON ignore the
// setting: the same check).
TEST_P(DecodeMulti, PrefetchOrderChangesNoBit) {
  std::uint64_t seed = 500;
  const std::vector<std::pair<DType, const char*>> readings = {
      {DType::f32, ""},  {DType::bf16, ""},           {DType::f16, ""},
      {DType::int8, ""}, {DType::fp8_e4m3, "direct"}, {DType::fp8_e4m3, "f16"}};
  for (const auto& [dt, widen] : readings) {
    const ScopedEnv fp8_widen("TOKENMIX_FP8_WIDEN", widen);
    for (const std::int64_t tnew : {1, 5}) {
      const MultiCase c{{2100, 77}, tnew, 8, 2, 64, dt, dt == DType::bf16 ? 128 : 0};
      ++seed;
      std::vector<std::vector<float>> outs;
      for (const char* order : {"all", "per-dtype"}) {
        const ScopedEnv env("TOKENMIX_LINEAR_PREFETCH", order);
        SCOPED_TRACE(std::string("TOKENMIX_LINEAR_PREFETCH=") + order);
        run_case(c, GetParam(), seed);  // oracle, threads, poisoned padding
        outs.push_back(decode_output(c, GetParam(), seed));
      }
      SCOPED_TRACE(std::string(to_string(dt)) + " T_new=" + std::to_string(tnew) + " fp8 " + widen);
      expect_same_bits(outs[0], outs[1]);
    }
  }
}

// AVX-512's tall row blocks of 7–12 rows take the k loop two steps at a time while they prefetch
// (MicroKernel), the last step alone where the count is odd: odd head widths (d_h steps of
// Q Kᵀ) and sequences ending mid-tile (53 and 13 keys: odd P V steps), blocks of 8, 12, 10 + 10
// and 10 + 9 + 9 rows (T_new 2, 3, 5, 7 at g = 4), every cache dtype, against the oracle on 1 and
// 2 threads, and bitwise equal under both prefetch orders (the cursor and the tile pointers).
// Every ISA (the others' blocks take one step at a time: the same check).
TEST_P(DecodeMulti, TallBlocksOddStepCounts) {
  std::uint64_t seed = 900;
  for (const DType dt : {DType::f32, DType::bf16, DType::f16, DType::int8, DType::fp8_e4m3}) {
    for (const std::int64_t tnew : {2, 3, 5, 7}) {
      const MultiCase c{{2101, 77}, tnew, 8, 2, tnew % 2 == 0 ? 33 : 65, dt, 0};
      ++seed;
      std::vector<std::vector<float>> outs;
      for (const char* order : {"all", "per-dtype"}) {
        const ScopedEnv env("TOKENMIX_LINEAR_PREFETCH", order);
        SCOPED_TRACE(std::string("TOKENMIX_LINEAR_PREFETCH=") + order);
        run_case(c, GetParam(), seed);
        outs.push_back(decode_output(c, GetParam(), seed));
      }
      expect_same_bits(outs[0], outs[1]);
    }
  }
}

// One realistic shape: 32 query heads over 8 KV heads (g = 4), d_h = 128, T_new = 2, lengths
// 5, 700 and 2100, a paged bf16 cache.
TEST_P(DecodeMulti, MixedLengthsRealisticShape) {
  run_case({{5, 2100, 700}, 2, 32, 8, 128, DType::bf16, 128}, GetParam(), 300);
}

// A sequence's result does not depend on the other sequences of the batch (their lengths set the
// number of chunks, whose units past its keys are empty): bitwise what it gets decoded alone.
TEST_P(DecodeMulti, ShortSequenceAloneEqualsInMixedBatch) {
  std::mt19937_64 rng(400);
  const std::int64_t B = 3, tnew = 5, hq = 8, hkv = 2, dh = 40;
  for (DType dt : {DType::f32, DType::int8}) {
    SCOPED_TRACE(to_string(dt));
    KVCache cache({1, B, hkv, dh, 2100, dt, 64, 0});
    fill(cache, 0, {2100, 7, 700}, rng);
    StridedTensor q(B, tnew, hq, dh, Layout::bthd);
    q.fill_random(rng);
    StridedTensor all(B, tnew, hq, dh, Layout::bthd);
    DecodeOptions o;
    o.isa = GetParam();
    attention_decode(q.view, cache, 0, all.view, {}, o);
    for (std::int64_t b = 0; b < B; ++b) {
      TensorView qb = q.view;
      StridedTensor one(1, tnew, hq, dh, Layout::bthd);
      qb.data = &q.at(b, 0, 0, 0);
      qb.shape[0] = 1;
      o.first_seq = b;
      attention_decode(qb, cache, 0, one.view, {}, o);
      EXPECT_EQ(0, std::memcmp(&all.at(b, 0, 0, 0), one.storage.data(),
                               one.storage.size() * sizeof(float)))
          << "sequence " << b;
    }
  }
}

// The SIMD kernels hand each worker runs of consecutive units (DecodeArgs::run_units): at most
// 16, at least 4 runs per worker, 1 when there are too few units (a zero worker count reads as 1).
TEST(DecodeRuns, RunLengthFollowsUnitsAndWorkers) {
  using kernels::DecodeArgs;
  EXPECT_EQ(DecodeArgs::run_units(256, 2), 16);   // B = 1, T_k = 32768, H_kv = 8
  EXPECT_EQ(DecodeArgs::run_units(4096, 2), 16);  // capped
  EXPECT_EQ(DecodeArgs::run_units(32, 2), 4);     // T_k = 4096: 8 runs for 2 workers
  EXPECT_EQ(DecodeArgs::run_units(40, 1), 10);
  EXPECT_EQ(DecodeArgs::run_units(40, 3), 3);
  EXPECT_EQ(DecodeArgs::run_units(7, 2), 1);
  EXPECT_EQ(DecodeArgs::run_units(1, 1), 1);
  EXPECT_EQ(DecodeArgs::run_units(64, 0), 16);
}

// Runs that end inside a stream and streams that end inside a run: two sequences of 4100 and
// 2500 keys (5 and 3 chunks), 2 KV heads, T_new = 20 with g = 8 (two query blocks of 16 and 4
// positions): 32 units, runs of 8, 4 and 2 units on 1, 2 and 3 threads, so a run's next unit is
// sometimes the same stream's next chunk (the prefetch runs on into it) and sometimes another
// query block, head or sequence. Each against the oracle, all bitwise equal, on an int8 and a
// bf16 cache, contiguous and paged.
TEST_P(DecodeMulti, RunsAcrossChunksHeadsAndSequences) {
  std::uint64_t seed = 450;
  for (DType dt : {DType::int8, DType::bf16})
    for (std::int64_t block : {0, 192})
      run_case({{4100, 2500}, 20, 16, 2, 40, dt, block}, GetParam(), ++seed, {1, 2, 3});
}

// Units exist only for the chunks each sequence has: one sequence of 8200 keys (9 chunks) and 15
// of 5 keys need 24 units, not 16 × 9 = 144, and their partial results fit a scratch limit of
// 48 KiB (≈ 25 KiB with 24 units: 10.6 KiB of worker scratch, 0.6 KiB of partials per unit;
// ≈ 94 KiB with 144). Each sequence's result is bitwise what it gets decoded alone.
TEST_P(DecodeMulti, UnitsFollowEachSequencesKeys) {
  std::mt19937_64 rng(500);
  const std::int64_t B = 16, hq = 8, dh = 16;
  std::vector<std::int64_t> lengths(B, 5);
  lengths[3] = 8200;
  KVCache cache({1, B, 1, dh, 8200, DType::f32, 0, 0});
  fill(cache, 0, lengths, rng);
  StridedTensor q(B, 1, hq, dh, Layout::strided);
  q.fill_random(rng);
  StridedTensor all(B, 1, hq, dh, Layout::bthd);
  DecodeOptions o;
  o.isa = GetParam();
  o.threads = 1;
  detail::set_decode_scratch_limit_for_testing(48 * 1024);
  EXPECT_NO_THROW(attention_decode(q.view, cache, 0, all.view, {}, o));
  detail::set_decode_scratch_limit_for_testing(-1);
  for (std::int64_t b : {0, 3, 15}) {
    TensorView qb = q.view;
    qb.data = &q.at(b, 0, 0, 0);
    qb.shape[0] = 1;
    StridedTensor one(1, 1, hq, dh, Layout::bthd);
    o.first_seq = b;
    attention_decode(qb, cache, 0, one.view, {}, o);
    EXPECT_EQ(
        0, std::memcmp(&all.at(b, 0, 0, 0), one.storage.data(), one.storage.size() * sizeof(float)))
        << "sequence " << b;
  }
}

// A bf16 cache is widened by the products in their own way (on x86 each pair of B vectors as
// even / odd columns, bf16_split_t, whose columns are put back in order after each product), but
// every output element's k loop is the one an fp32 cache gets: on values that bf16 holds exactly,
// a bf16 and an f32 cache give bitwise the same O and L (4.2–4.5). T_new from 1 to 33 covers the
// blockings (4 to 132 rows: one block, the tall one, several query blocks), d_h 128, 96, 72 and 40
// the column pairs and single vectors, 7 the scalar tail; two chunks and a partial last tile.
// With one V element +∞ at key L − 2 (seen only by the last two query rows, so its tile is read
// row by row from T_new = 3 on), those rows' column 3 is +∞ or NaN in both, bitwise alike.
TEST_P(DecodeMulti, Bf16CacheBitwiseEqualsF32CacheOfTheSameValues) {
  std::mt19937_64 rng(600);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  struct Shape {
    std::int64_t tnew, hq, hkv, dh;
  };
  for (const Shape s : {Shape{1, 8, 2, 128}, Shape{2, 8, 2, 96}, Shape{3, 8, 1, 40},
                        Shape{5, 4, 1, 7}, Shape{17, 8, 1, 128}, Shape{33, 4, 1, 72}}) {
    for (const bool inf_v : {false, true}) {
      const std::int64_t L = 1100 + s.tnew, H = s.hkv, D = s.dh;
      SCOPED_TRACE("T_new=" + std::to_string(s.tnew) + " H_q=" + std::to_string(s.hq) +
                   " H_kv=" + std::to_string(H) + " d_h=" + std::to_string(D) +
                   (inf_v ? " with +inf in V" : ""));
      std::vector<float> k(static_cast<std::size_t>(L * H * D)), v(k.size());
      for (std::vector<float>* x : {&k, &v})
        for (float& e : *x) e = kernels::bf16_to_f32(kernels::f32_to_bf16(normal(rng)));
      if (inf_v)
        v[static_cast<std::size_t>((L - 2) * H * D + 3)] = std::numeric_limits<float>::infinity();
      KVCache c32({1, 1, H, D, L, DType::f32, 0, 0}), c16({1, 1, H, D, L, DType::bf16, 0, 0});
      for (KVCache* c : {&c32, &c16})
        c->append(0, 0, ConstTensorView::bthd(k.data(), 1, L, H, D),
                  ConstTensorView::bthd(v.data(), 1, L, H, D));
      StridedTensor q(1, s.tnew, s.hq, D, Layout::strided);
      q.fill_random(rng);
      std::array<StridedTensor, 2> outs{StridedTensor(1, s.tnew, s.hq, D, Layout::strided),
                                        StridedTensor(1, s.tnew, s.hq, D, Layout::strided)};
      std::array<std::vector<float>, 2> lses;
      DecodeOptions o;
      o.isa = GetParam();
      // The FMA products (the AMX tile products of a bf16 cache agree at fp32 rounding level, not
      // bitwise: test_kv_quant.cpp, DecodeAmx).
      const ScopedEnv fma("TOKENMIX_DECODE_AMX", "off");
      for (int i = 0; i < 2; ++i) {
        lses[i].assign(static_cast<std::size_t>(s.hq * s.tnew), kPoison);
        attention_decode(q.view, i == 0 ? c32 : c16, 0, outs[i].view,
                         TensorView::bht(lses[i].data(), 1, s.hq, s.tnew), o);
      }
      // The same bits, or NaN in both (outputs, their poisoned padding, L).
      const auto same = [](float x, float y) {
        return std::memcmp(&x, &y, sizeof(float)) == 0 || (std::isnan(x) && std::isnan(y));
      };
      std::int64_t differ = 0;
      for (std::size_t e = 0; e < outs[0].storage.size(); ++e)
        differ += same(outs[0].storage[e], outs[1].storage[e]) ? 0 : 1;
      EXPECT_EQ(differ, 0);
      for (std::size_t e = 0; e < lses[0].size(); ++e)
        EXPECT_TRUE(same(lses[0][e], lses[1][e])) << "lse " << e;
      // Every output was written (poisoned with NaN before); the +∞ reaches only column 3 of
      // the last two query positions of KV head 0's group.
      std::int64_t nonfinite = 0;
      for (std::int64_t t = 0; t < s.tnew; ++t)
        for (std::int64_t h = 0; h < s.hq; ++h)
          for (std::int64_t x = 0; x < D; ++x)
            nonfinite += std::isfinite(outs[1].at(0, t, h, x)) ? 0 : 1;
      if (inf_v) {
        EXPECT_GT(nonfinite, 0);
        EXPECT_LE(nonfinite, 2 * s.hq / H);
      } else {
        EXPECT_EQ(nonfinite, 0);
      }
    }
  }
}

// Random calls, each against the float64 oracle over the values its cache holds (kv_oracle.hpp):
// 100 draws per path from one fixed seed of the sequences' lengths (T_new ≤ L ≤ 300), T_new 1 … 9
// (now and then 17 or 33), H_kv 1 … 3, g 1 … 5, d_h (1 … 130: scalar tails, odd widths, two
// 64-feature halves), the cache's dtype, contiguous or paged (64 or 128 positions per block), a
// rolling cache (its window 1 … 200, decode's window up to it) or a window on a full cache, soft-
// capping, ALiBi and sinks (each by a coin), 1 or 2 threads. The tests above pair these up a few
// at a time; here any combination can meet.
TEST_P(DecodeMulti, RandomCallsMatchTheCacheOracle) {
  Picker pick(20261206);  // the cases and, from the same stream, their data (pick.gen)
  std::mt19937_64& rng = pick.gen;
  const std::int64_t widths[] = {1, 3, 8, 16, 17, 32, 48, 64, 65, 100, 128, 130};
  for (int draw = 0; draw < 100; ++draw) {
    const std::int64_t B = pick(1, 3), hkv = pick(1, 3), g = pick(1, 5), hq = g * hkv;
    const std::int64_t dh = widths[pick(0, std::size(widths) - 1)];
    const std::int64_t tnew =
        pick(0, 5) == 0 ? std::array<std::int64_t, 2>{17, 33}[pick(0, 1)] : pick(1, 9);
    const DType dtype = kCacheTypes[pick(0, 4)];
    const std::int64_t block = std::array<std::int64_t, 3>{0, 64, 128}[pick(0, 2)];
    std::vector<std::int64_t> lengths;
    for (std::int64_t b = 0; b < B; ++b) lengths.push_back(pick(tnew, 300));
    const std::int64_t longest = *std::max_element(lengths.begin(), lengths.end());
    const bool rolling = pick(0, 3) == 0;
    const std::int64_t cache_window = rolling ? pick(1, 200) : 0;
    std::optional<std::int64_t> window;
    if (rolling) {
      window = pick(1, cache_window);
    } else if (pick(0, 3) == 0) {
      window = pick(1, 300);
    }
    const bool softcap = pick(0, 3) == 0, alibi = pick(0, 3) == 0, sinks = pick(0, 3) == 0;
    const int threads = static_cast<int>(pick(1, 2));
    std::string what = "draw " + std::to_string(draw) + ": lengths";
    for (std::int64_t L : lengths) what += " " + std::to_string(L);
    what += ", T_new " + std::to_string(tnew) + ", H_q " + std::to_string(hq) + ", H_kv " +
            std::to_string(hkv) + ", d_h " + std::to_string(dh) + ", " + to_string(dtype) +
            ", block " + std::to_string(block) + ", cache window " + std::to_string(cache_window) +
            ", window " + (window ? std::to_string(*window) : "none") +
            (softcap ? ", softcap" : "") + (alibi ? ", alibi" : "") + (sinks ? ", sinks" : "") +
            ", threads " + std::to_string(threads);
    SCOPED_TRACE(what);

    KVCache cache({1, B, hkv, dh, longest, dtype, block, 0, cache_window});
    fill(cache, 0, lengths, rng);
    StridedTensor q(B, tnew, hq, dh, Layout::strided);
    q.fill_random(rng);
    DecodeOptions o;
    reference::Options ro;
    o.isa = GetParam();
    o.threads = threads;
    o.window = window;
    ro.window = window;
    if (softcap) o.softcap = ro.softcap = 4.0;
    std::vector<float> slopes, sink_logits;
    for (std::int64_t h = 0; h < hq; ++h) {
      slopes.push_back(static_cast<float>(std::exp2(-8.0 * static_cast<double>(h + 1) / hq)));
      sink_logits.push_back(-1.0f + 3.0f * static_cast<float>(h) / static_cast<float>(hq));
    }
    if (alibi) {
      o.alibi_slopes = ConstTensorView{slopes.data(), DType::f32, 1, {hq, 1, 1, 1}, {1}};
      ro.alibi_slopes.assign(slopes.begin(), slopes.end());
    }
    if (sinks) {
      o.sinks = ConstTensorView{sink_logits.data(), DType::f32, 1, {hq, 1, 1, 1}, {1}};
      ro.sinks.assign(sink_logits.begin(), sink_logits.end());
    }
    StridedTensor out(B, tnew, hq, dh, Layout::strided);
    std::vector<float> lse(static_cast<std::size_t>(B * hq * tnew), kPoison);
    attention_decode(q.view, cache, 0, out.view, TensorView::bht(lse.data(), B, hq, tnew), o);
    std::vector<reference::ForwardResult> refs;
    for (std::int64_t b = 0; b < B; ++b) refs.push_back(cache_oracle(q, b, cache, 0, ro));
    // ALiBi's biases reach −m_h · L ≈ −300 here, rounded in fp32 before the softmax.
    expect_decode_matches(out, lse, refs, alibi ? 4e-5 : kDecodeBound);
    std::int64_t written = 0;  // every element written (a row seeing no key: O = 0)
    for (float x : out.storage) written += std::isnan(x) ? 0 : 1;
    EXPECT_EQ(written, B * tnew * hq * dh);
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, DecodeMulti, AllIsas(), IsaName);

}  // namespace
}  // namespace tokenmix::testing
