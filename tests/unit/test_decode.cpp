// tests/unit/test_decode.cpp — attention_decode over a KVCache (tokenmix/kv_cache.hpp) on every
// ISA path this machine supports, forced in turn, against the float64 oracle (SPEC 4.2–4.5, 4.8).
//
// The cache stores K in 64-key tiles, the kernel splits keys into 1024-key chunks (merged in a
// fixed order) and stacks the g heads × T_new positions of a group as rows, so the lengths below
// straddle those edges (1, 63, 64, 65, 1023, 1024, 1025, 2100), T_new = 1 … 4, group sizes
// g ∈ {1, 4, 8, 32}, head widths 64 (whole vectors), 40 (AVX-512 remainder vector) and 7 (scalar
// tail), two sequences of different lengths, contiguous and paged (128-position blocks) caches,
// and fp32 / bf16 / f16 elements.
//
// Oracle input: the K/V values *as stored* (fp32 rounded to the cache's type and widened back),
// so every element type is held to the fp32-accumulation bound rel_err ≤ 2e-5 (as
// test_flash_kernels.cpp: length-d_h dot products and L-term weighted sums in fp32, u = 6e-8,
// exp 1 ULP, plus one merge per chunk). A masking, tiling or merge bug gives errors ≥ 1e-3.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/kv_element.hpp"
#include "test_util.hpp"

namespace tokenmix::testing {
namespace {

constexpr double kBound = 2e-5;

float round_to(DType dtype, float x) {
  std::uint32_t slot = 0;
  kernels::store_element(dtype, &slot, 0, x);
  return kernels::load_element(dtype, &slot, 0);
}

// K/V of B sequences, [B][L_max][H_kv][d_h] fp32, and a cache holding their first L_b positions.
struct Filled {
  std::vector<std::int64_t> lengths;
  std::int64_t hkv, dh, lmax;
  std::vector<float> k, v;
  float& K(std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t x) {
    return k[((b * lmax + t) * hkv + h) * dh + x];
  }
  float& V(std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t x) {
    return v[((b * lmax + t) * hkv + h) * dh + x];
  }
};

Filled make_kv(std::vector<std::int64_t> lengths, std::int64_t hkv, std::int64_t dh,
               std::mt19937_64& rng) {
  Filled f{lengths, hkv, dh, *std::max_element(lengths.begin(), lengths.end()), {}, {}};
  const std::size_t n = static_cast<std::size_t>(lengths.size() * f.lmax * hkv * dh);
  std::normal_distribution<float> dist;
  f.k.resize(n);
  f.v.resize(n);
  for (float& x : f.k) x = dist(rng);
  for (float& x : f.v) x = dist(rng);
  return f;
}

// Appends sequence by sequence, in pieces of 1, 37, 200, … positions (exercises the append
// offsets within key tiles and blocks), interleaving sequences so paged blocks interleave.
void fill_cache(KVCache& cache, std::int64_t layer, Filled& f) {
  const std::int64_t B = static_cast<std::int64_t>(f.lengths.size());
  std::vector<std::int64_t> done(static_cast<std::size_t>(B), 0);
  const std::int64_t pieces[] = {1, 37, 200, 5, 900, 64};
  for (int round = 0;; ++round) {
    bool any = false;
    for (std::int64_t b = 0; b < B; ++b) {
      const std::int64_t n = std::min(pieces[round % 6], f.lengths[b] - done[b]);
      if (n <= 0) continue;
      any = true;
      const std::array<std::int64_t, 4> strides{f.lmax * f.hkv * f.dh, f.hkv * f.dh, f.dh, 1};
      const ConstTensorView kv{&f.K(b, done[b], 0, 0), DType::f32, 4, {1, n, f.hkv, f.dh}, strides};
      const ConstTensorView vv{&f.V(b, done[b], 0, 0), DType::f32, 4, {1, n, f.hkv, f.dh}, strides};
      cache.append(layer, b, kv, vv);
      done[b] += n;
    }
    if (!any) break;
  }
}

// The oracle for sequence b: q [1, T_new, H_q, d_h] against its L_b stored (rounded) keys.
reference::ForwardResult oracle(StridedTensor& q, std::int64_t b, Filled& f, DType dtype) {
  const std::int64_t L = f.lengths[static_cast<std::size_t>(b)], tnew = q.view.shape[1],
                     hq = q.view.shape[2];
  Tensor64 q64({1, tnew, hq, f.dh}), k64({1, L, f.hkv, f.dh}), v64({1, L, f.hkv, f.dh});
  for (std::int64_t t = 0; t < tnew; ++t)
    for (std::int64_t h = 0; h < hq; ++h)
      for (std::int64_t x = 0; x < f.dh; ++x) q64.at(0, t, h, x) = q.at(b, t, h, x);
  for (std::int64_t t = 0; t < L; ++t)
    for (std::int64_t h = 0; h < f.hkv; ++h)
      for (std::int64_t x = 0; x < f.dh; ++x) {
        k64.at(0, t, h, x) = round_to(dtype, f.K(b, t, h, x));
        v64.at(0, t, h, x) = round_to(dtype, f.V(b, t, h, x));
      }
  return reference::attention_forward(q64, k64, v64);  // causal, bottom-right (SPEC 4.3)
}

struct DecodeCase {
  std::vector<std::int64_t> lengths;
  std::int64_t tnew, hq, hkv, dh;
};

std::vector<DecodeCase> decode_cases() {
  std::vector<DecodeCase> cases;
  for (std::int64_t L : {1, 63, 64, 65, 1023, 1024, 1025, 2100})
    cases.push_back({{L, L / 2 + 1}, 1, 8, 2, 64});
  for (std::int64_t tnew : {2, 3, 4}) cases.push_back({{1025, 130}, tnew, 8, 2, 64});
  for (std::int64_t g : {1, 4, 8, 32}) cases.push_back({{700, 65}, 2, 2 * g, 2, 32});
  cases.push_back({{300, 129}, 3, 4, 1, 40});
  cases.push_back({{200, 64}, 4, 6, 3, 7});
  cases.push_back({{2, 1}, 4, 4, 2, 16});  // T_new > L: leading rows see no key (O = 0, L = −∞)
  return cases;
}

class Decode : public PerIsaTest {};

TEST_P(Decode, MatchesFloat64ReferenceAllDtypesAndCaches) {
  std::mt19937_64 rng(2024);
  for (const DecodeCase& c : decode_cases()) {
    Filled f = make_kv(c.lengths, c.hkv, c.dh, rng);
    const std::int64_t B = static_cast<std::int64_t>(c.lengths.size());
    StridedTensor q(B, c.tnew, c.hq, c.dh, Layout::strided);
    q.fill_random(rng);
    for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
      std::vector<reference::ForwardResult> refs;  // per sequence; the same for both cache kinds
      for (std::int64_t b = 0; b < B; ++b) refs.push_back(oracle(q, b, f, dtype));
      for (std::int64_t block : {0, 128}) {
        SCOPED_TRACE("L0=" + std::to_string(c.lengths[0]) + " L1=" + std::to_string(c.lengths[1]) +
                     " T_new=" + std::to_string(c.tnew) + " H_q=" + std::to_string(c.hq) +
                     " H_kv=" + std::to_string(c.hkv) + " d_h=" + std::to_string(c.dh) +
                     " dtype=" + to_string(dtype) + " block=" + std::to_string(block));
        KVCache cache({2, B, c.hkv, c.dh, 2200, dtype, block, 0});
        fill_cache(cache, 1, f);
        StridedTensor out(B, c.tnew, c.hq, c.dh, Layout::bthd);
        std::vector<float> lse(static_cast<std::size_t>(B * c.hq * c.tnew), kPoison);
        DecodeOptions o;
        o.isa = GetParam();
        attention_decode(q.view, cache, 1, out.view, TensorView::bht(lse.data(), B, c.hq, c.tnew),
                         o);
        for (std::int64_t b = 0; b < B; ++b) {
          const auto& ref = refs[static_cast<std::size_t>(b)];
          double diff = 0.0, mx = 0.0, lse_diff = 0.0;
          for (std::int64_t t = 0; t < c.tnew; ++t)
            for (std::int64_t h = 0; h < c.hq; ++h) {
              for (std::int64_t x = 0; x < c.dh; ++x) {
                const double got = out.at(b, t, h, x), r = ref.out.at(0, t, h, x);
                diff = std::max(diff, std::isnan(got) ? INFINITY : std::fabs(got - r));
                mx = std::max(mx, std::fabs(r));
              }
              const double rl = ref.lse.at(0, h, t, 0);
              const float gl = lse[static_cast<std::size_t>((b * c.hq + h) * c.tnew + t)];
              if (std::isinf(rl)) {
                ASSERT_TRUE(std::isinf(gl) && gl < 0) << "b=" << b << " t=" << t << " h=" << h;
              } else {
                lse_diff = std::max(lse_diff, std::fabs(gl - rl) / std::max(1.0, std::fabs(rl)));
              }
            }
          EXPECT_LE(diff / std::max(mx, 1e-30), kBound) << "sequence " << b;
          EXPECT_LE(lse_diff, kBound) << "sequence " << b;
        }
      }
    }
  }
}

// Flash-decoding splits keys into fixed chunks; the merge order is fixed, so any thread count
// gives bitwise identical results (here 5 chunks per head, B·H_kv = 2 units of work per chunk).
TEST_P(Decode, BitwiseIdenticalAcrossThreadCounts) {
  std::mt19937_64 rng(7);
  Filled f = make_kv({4500, 1500}, 1, 64, rng);
  StridedTensor q(2, 2, 8, 64, Layout::bthd);
  q.fill_random(rng);
  KVCache cache({1, 2, 1, 64, 4500, DType::bf16, 0, 0});
  fill_cache(cache, 0, f);
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

// A paged cache (64-position blocks, interleaved between sequences, so physically scattered)
// gives bitwise the same result as a contiguous one: same layout within a tile, same kernels.
TEST_P(Decode, PagedBitwiseEqualsContiguous) {
  std::mt19937_64 rng(11);
  Filled f = make_kv({1300, 777, 64}, 2, 48, rng);
  StridedTensor q(3, 3, 8, 48, Layout::bthd);
  q.fill_random(rng);
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    KVCache contiguous({1, 3, 2, 48, 1400, dtype, 0, 0}), paged({1, 3, 2, 48, 1400, dtype, 64, 40});
    fill_cache(contiguous, 0, f);
    fill_cache(paged, 0, f);
    EXPECT_EQ(paged.free_blocks(), 40 - (21 + 13 + 1));
    StridedTensor o1(3, 3, 8, 48, Layout::bthd), o2(3, 3, 8, 48, Layout::bthd);
    DecodeOptions o;
    o.isa = GetParam();
    attention_decode(q.view, contiguous, 0, o1.view, {}, o);
    attention_decode(q.view, paged, 0, o2.view, {}, o);
    EXPECT_EQ(0,
              std::memcmp(o1.storage.data(), o2.storage.data(), o1.storage.size() * sizeof(float)));
  }
}

// options.first_seq: decoding sequences 1..2 of a 3-sequence cache equals decoding all three.
TEST_P(Decode, SequenceSubsetMatchesFullBatch) {
  std::mt19937_64 rng(12);
  Filled f = make_kv({90, 300, 41}, 1, 32, rng);
  StridedTensor q(3, 1, 4, 32, Layout::bthd);
  q.fill_random(rng);
  KVCache cache({1, 3, 1, 32, 300, DType::f32, 0, 0});
  fill_cache(cache, 0, f);
  StridedTensor all(3, 1, 4, 32, Layout::bthd), part(2, 1, 4, 32, Layout::bthd);
  DecodeOptions o;
  o.isa = GetParam();
  attention_decode(q.view, cache, 0, all.view, {}, o);
  TensorView q12 = q.view;
  q12.shape[0] = 2;
  q12.data = &q.at(1, 0, 0, 0);
  o.first_seq = 1;
  attention_decode(q12, cache, 0, part.view, {}, o);
  EXPECT_EQ(0, std::memcmp(&all.at(1, 0, 0, 0), part.storage.data(),
                           part.storage.size() * sizeof(float)));
}

INSTANTIATE_TEST_SUITE_P(AllIsas, Decode, AllIsas(), IsaName);

// GQA: bytes read per step are those of the H_kv heads once (SPEC "decode bytes"), not g times.
TEST(DecodeBytes, CountsEachKvHeadOnce) {
  KVCache cache({2, 2, 4, 32, 100, DType::bf16, 0, 0});
  std::vector<float> k(static_cast<std::size_t>(2 * 70 * 4 * 32), 0.5f);
  cache.append(1, 0, ConstTensorView::bthd(k.data(), 2, 70, 4, 32),
               ConstTensorView::bthd(k.data(), 2, 70, 4, 32));
  cache.truncate(1, 20);
  EXPECT_EQ(decode_bytes(cache, 1, 0, 2), 2u * (70 + 20) * 4 * 32 * 2);
  EXPECT_EQ(decode_bytes(cache, 1, 1, 1), 2u * 20 * 4 * 32 * 2);
  EXPECT_EQ(decode_bytes(cache, 0, 0, 2), 0u);
}

}  // namespace
}  // namespace tokenmix::testing
