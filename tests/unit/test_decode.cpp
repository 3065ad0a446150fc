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
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/kv_element.hpp"
#include "kv_oracle.hpp"
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
  for (DType dtype : {DType::f32, DType::bf16, DType::f16, DType::int8, DType::fp8_e4m3}) {
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

// ---- score variants (SPEC "Score variants used by real models") ----

// One combination of decode options, with the values both the kernel (f32 views) and the oracle
// (the same values in double) use.
struct Variants {
  std::string name;
  std::int64_t window = 0;  // 0 = off
  double softcap = 0.0;     // 0 = off
  bool alibi = false, sinks = false;
};

std::vector<Variants> variant_sets() {
  return {{"window=1", 1},
          {"window=63", 63},
          {"window=64", 64},
          {"window=65", 65},
          {"window=1000", 1000},
          {"softcap=2", 0, 2.0},
          {"alibi", 0, 0.0, true},
          {"sinks", 0, 0.0, false, true},
          {"window=100+softcap=5+alibi+sinks", 100, 5.0, true, true},
          {"window=700+sinks", 700, 0.0, false, true}};
}

// The usual ALiBi slopes m_h = 2^(−8(h+1)/H) (SPEC) and sinks spread over [−1, 3].
std::vector<float> alibi_slopes(std::int64_t hq) {
  std::vector<float> m(static_cast<std::size_t>(hq));
  for (std::int64_t h = 0; h < hq; ++h)
    m[static_cast<std::size_t>(h)] = static_cast<float>(std::exp2(-8.0 * (h + 1) / hq));
  return m;
}
std::vector<float> sink_logits(std::int64_t hq) {
  std::vector<float> s(static_cast<std::size_t>(hq));
  for (std::int64_t h = 0; h < hq; ++h)
    s[static_cast<std::size_t>(h)] = -1.0f + 4.0f * static_cast<float>(h) / hq;
  return s;
}

// Decode options and oracle options for a variant set; the f32 vectors must outlive both.
struct VariantOptions {
  std::vector<float> slopes, sinks;
  DecodeOptions decode;
  reference::Options oracle;
  VariantOptions(const Variants& v, std::int64_t hq, Isa isa) {
    decode.isa = isa;
    if (v.window > 0) decode.window = oracle.window = v.window;
    if (v.softcap > 0) decode.softcap = oracle.softcap = v.softcap;
    if (v.alibi) {
      slopes = alibi_slopes(hq);
      // A strided view (every other element of a doubled buffer): any stride is accepted.
      std::vector<float> spread(slopes.size() * 2, kPoison);
      for (std::size_t h = 0; h < slopes.size(); ++h) spread[2 * h] = slopes[h];
      slopes = spread;
      decode.alibi_slopes = ConstTensorView{slopes.data(), DType::f32, 1, {hq, 1, 1, 1}, {2}};
      for (std::int64_t h = 0; h < hq; ++h)
        oracle.alibi_slopes.push_back(slopes[static_cast<std::size_t>(2 * h)]);
    }
    if (v.sinks) {
      sinks = sink_logits(hq);
      decode.sinks = ConstTensorView{sinks.data(), DType::f32, 1, {hq, 1, 1, 1}, {1}};
      oracle.sinks.assign(sinks.begin(), sinks.end());
    }
  }
};

// The oracle for sequence b with options: q [1, T_new, H_q, d_h] against its first L keys (as
// stored: rounded to the cache's type), bottom-right (decode's alignment), SPEC "Score variants".
reference::ForwardResult oracle(StridedTensor& q, std::int64_t b, Filled& f, DType dtype,
                                const reference::Options& o, std::int64_t L) {
  const std::int64_t tnew = q.view.shape[1], hq = q.view.shape[2];
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
  return reference::attention_forward(q64, k64, v64, o);
}

// ALiBi biases reach −m_h·L ≈ −10³ here, rounded in fp32 (≈ 6e-5 absolute) before the softmax;
// the keys they change are those of negligible weight, so the bound stays at fp32 level.
constexpr double kVariantBound = 4e-5;

// Each variant alone and combined, against the float64 oracle with the same options: lengths
// across tile (64) and chunk (1024) edges, windows smaller and larger than a tile, windows that
// start mid-chunk, T_new 1 … 4, rows that see no key (T_new > L: O = 0, L = −∞ or σ_h), GQA
// g ∈ {1, 2, 4, 32}, head widths 64, 40, 32, 16, 7, contiguous and paged caches, every dtype.
TEST_P(Decode, VariantsMatchFloat64Reference) {
  std::mt19937_64 rng(4242);
  const std::vector<DecodeCase> cases = {{{2100, 700}, 1, 8, 2, 64},
                                         {{1025, 130}, 3, 8, 2, 40},
                                         {{300, 65}, 4, 4, 1, 7},
                                         {{2, 1}, 4, 4, 2, 16},
                                         {{64, 129}, 2, 32, 1, 32}};
  for (const DecodeCase& c : cases) {
    Filled f = make_kv(c.lengths, c.hkv, c.dh, rng);
    const std::int64_t B = static_cast<std::int64_t>(c.lengths.size());
    StridedTensor q(B, c.tnew, c.hq, c.dh, Layout::strided);
    q.fill_random(rng);
    for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
      KVCache contiguous({1, B, c.hkv, c.dh, 2200, dtype, 0, 0});
      KVCache paged({1, B, c.hkv, c.dh, 2200, dtype, 128, 0});
      fill_cache(contiguous, 0, f);
      fill_cache(paged, 0, f);
      for (const Variants& v : variant_sets()) {
        const VariantOptions vo(v, c.hq, GetParam());
        std::vector<reference::ForwardResult> refs;
        for (std::int64_t b = 0; b < B; ++b)
          refs.push_back(oracle(q, b, f, dtype, vo.oracle, c.lengths[static_cast<std::size_t>(b)]));
        for (KVCache* cache : {&contiguous, &paged}) {
          SCOPED_TRACE(v.name + " L0=" + std::to_string(c.lengths[0]) +
                       " T_new=" + std::to_string(c.tnew) + " H_q=" + std::to_string(c.hq) +
                       " d_h=" + std::to_string(c.dh) + " dtype=" + to_string(dtype) +
                       (cache->paged() ? " paged" : " contiguous"));
          StridedTensor out(B, c.tnew, c.hq, c.dh, Layout::bthd);
          std::vector<float> lse(static_cast<std::size_t>(B * c.hq * c.tnew), kPoison);
          attention_decode(q.view, *cache, 0, out.view,
                           TensorView::bht(lse.data(), B, c.hq, c.tnew), vo.decode);
          for (std::int64_t b = 0; b < B; ++b) {
            const auto [err, lse_err] =
                decode_errors(out, lse, b, refs[static_cast<std::size_t>(b)]);
            EXPECT_LE(err, kVariantBound) << "sequence " << b;
            EXPECT_LE(lse_err, kVariantBound) << "sequence " << b;
          }
        }
      }
    }
  }
}

// Sets K and V of every position before the window of each sequence's first new query (T_new
// queries, window W) to NaN in f, and returns the oracle's input: f with zeros there instead
// (those positions are invisible, any value will do).
Filled nan_before_window(Filled& f, std::int64_t W, std::int64_t tnew) {
  Filled zeroed = f;
  for (std::size_t b = 0; b < f.lengths.size(); ++b) {
    const std::int64_t first = f.lengths[b] - tnew + 1 - W;
    for (std::int64_t t = 0; t < first; ++t)
      for (std::int64_t h = 0; h < f.hkv; ++h)
        for (std::int64_t x = 0; x < f.dh; ++x) {
          const auto bi = static_cast<std::int64_t>(b);
          f.K(bi, t, h, x) = f.V(bi, t, h, x) = std::nanf("");
          zeroed.K(bi, t, h, x) = zeroed.V(bi, t, h, x) = 0.0f;
        }
  }
  return zeroed;
}

// Decode with window W over `cache` on `isa`, every sequence against the oracle over `zeroed`.
void expect_window_decode_matches(StridedTensor& q, const KVCache& cache, Filled& zeroed,
                                  DType dtype, std::int64_t W, Isa isa) {
  const std::int64_t B = q.view.shape[0], tnew = q.view.shape[1], hq = q.view.shape[2];
  const VariantOptions vo({"window", W, 0.0, false, true}, hq, isa);
  StridedTensor out(B, tnew, hq, zeroed.dh, Layout::bthd);
  std::vector<float> lse(static_cast<std::size_t>(B * hq * tnew), kPoison);
  attention_decode(q.view, cache, 0, out.view, TensorView::bht(lse.data(), B, hq, tnew), vo.decode);
  for (std::int64_t b = 0; b < B; ++b) {
    const auto ref =
        oracle(q, b, zeroed, dtype, vo.oracle, zeroed.lengths[static_cast<std::size_t>(b)]);
    const auto [err, lse_err] = decode_errors(out, lse, b, ref);
    EXPECT_LE(err, kVariantBound) << to_string(dtype) << " sequence " << b;
    EXPECT_LE(lse_err, kVariantBound) << to_string(dtype) << " sequence " << b;
  }
}

// Keys before the window are not part of the result: NaN keys and values there (also in the
// masked lanes of the tile holding the window's start) leave every row finite and equal to the
// oracle's, on every path; a cache without the window propagates the NaN (so the test can fail).
TEST_P(Decode, WindowIgnoresEverythingBeforeIt) {
  std::mt19937_64 rng(31);
  const std::int64_t W = 100, tnew = 2;
  Filled f = make_kv({1500, 333}, 2, 48, rng);
  Filled zeroed = nan_before_window(f, W, tnew);
  StridedTensor q(2, tnew, 8, 48, Layout::bthd);
  q.fill_random(rng);
  for (DType dtype : {DType::f32, DType::bf16}) {
    KVCache cache({1, 2, 2, 48, 1500, dtype, 64, 0});
    fill_cache(cache, 0, f);
    expect_window_decode_matches(q, cache, zeroed, dtype, W, GetParam());
    StridedTensor out(2, tnew, 8, 48, Layout::bthd);
    DecodeOptions plain;
    plain.isa = GetParam();
    attention_decode(q.view, cache, 0, out.view, {}, plain);
    EXPECT_TRUE(std::isnan(out.at(0, 0, 0, 0))) << "without the window the NaN keys are seen";
  }
}

// The same on a rolling cache (KVCacheConfig::window): its ring of R = round_up(W + 64, 64) slots
// still holds positions the window no longer sees, in the tiles it reads (the ring's oldest
// slots, next to visible ones); NaN keys and values there leave every row finite and equal to the
// oracle's, on every path, contiguous and paged. Positions older than the ring are overwritten.
TEST_P(Decode, RollingCacheIgnoresHeldPositionsBeforeTheWindow) {
  std::mt19937_64 rng(37);
  const std::int64_t W = 100, tnew = 2;
  Filled f = make_kv({700, 251}, 2, 48, rng);
  Filled zeroed = nan_before_window(f, W, tnew);
  StridedTensor q(2, tnew, 8, 48, Layout::bthd);
  q.fill_random(rng);
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (std::int64_t block : {0, 64}) {
      SCOPED_TRACE("block " + std::to_string(block));
      KVCache cache({1, 2, 2, 48, 700, dtype, block, 0, W});
      fill_cache(cache, 0, f);
      ASSERT_GT(cache.first_position(0, 0), 0);  // the ring has wrapped: old slots reused
      expect_window_decode_matches(q, cache, zeroed, dtype, W, GetParam());
    }
  }
}

// Split-KV merging stays thread-count independent with every variant (sinks join the merge).
TEST_P(Decode, VariantsBitwiseIdenticalAcrossThreadCounts) {
  std::mt19937_64 rng(17);
  Filled f = make_kv({4500, 1500}, 1, 64, rng);
  StridedTensor q(2, 3, 8, 64, Layout::bthd);
  q.fill_random(rng);
  KVCache cache({1, 2, 1, 64, 4500, DType::f16, 0, 0});
  fill_cache(cache, 0, f);
  for (const Variants& v :
       {Variants{"all", 2500, 4.0, true, true}, Variants{"alibi+cap", 0, 3.0, true}}) {
    VariantOptions vo(v, 8, GetParam());
    std::vector<std::vector<float>> outs, lses;
    for (int threads : {1, 2, 3, 5}) {
      StridedTensor out(2, 3, 8, 64, Layout::bthd);
      std::vector<float> lse(2 * 8 * 3, kPoison);
      vo.decode.threads = threads;
      attention_decode(q.view, cache, 0, out.view, TensorView::bht(lse.data(), 2, 8, 3), vo.decode);
      outs.push_back(out.storage);
      lses.push_back(lse);
    }
    for (std::size_t i = 1; i < outs.size(); ++i) {
      EXPECT_EQ(0, std::memcmp(outs[0].data(), outs[i].data(), outs[0].size() * sizeof(float)))
          << v.name;
      EXPECT_EQ(0, std::memcmp(lses[0].data(), lses[i].data(), lses[0].size() * sizeof(float)))
          << v.name;
    }
  }
}

// Slopes and sinks are data, as for attention_forward: a NaN sink or slope makes its head's rows
// NaN and leaves the other heads as they are; a −∞ sink is no sink (weight e^{−∞} = 0), bitwise.
TEST_P(Decode, NonFiniteSlopesAndSinksPropagate) {
  std::mt19937_64 rng(19);
  Filled f = make_kv({1100, 40}, 1, 32, rng);
  StridedTensor q(2, 2, 4, 32, Layout::bthd);
  q.fill_random(rng);
  KVCache cache({1, 2, 1, 32, 1100, DType::f32, 0, 0});
  fill_cache(cache, 0, f);
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> sinks{0.5f, std::nanf(""), -inf, 1.0f},
      slopes{0.1f, 0.2f, std::nanf(""), 0.3f};
  auto run = [&](bool with_sinks, bool with_slopes, StridedTensor& out) {
    DecodeOptions o;
    o.isa = GetParam();
    o.window = 700;
    if (with_sinks) o.sinks = ConstTensorView{sinks.data(), DType::f32, 1, {4, 1, 1, 1}, {1}};
    if (with_slopes)
      o.alibi_slopes = ConstTensorView{slopes.data(), DType::f32, 1, {4, 1, 1, 1}, {1}};
    attention_decode(q.view, cache, 0, out.view, {}, o);
  };
  StridedTensor plain(2, 2, 4, 32, Layout::bthd), sunk(2, 2, 4, 32, Layout::bthd),
      sloped(2, 2, 4, 32, Layout::bthd);
  run(false, false, plain);
  run(true, false, sunk);
  run(false, true, sloped);
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t t = 0; t < 2; ++t)
      for (std::int64_t x = 0; x < 32; ++x) {
        EXPECT_TRUE(std::isnan(sunk.at(b, t, 1, x)));
        EXPECT_EQ(sunk.at(b, t, 2, x), plain.at(b, t, 2, x));  // σ = −∞: no sink
        EXPECT_TRUE(std::isfinite(sunk.at(b, t, 0, x)) && std::isfinite(sunk.at(b, t, 3, x)));
        EXPECT_TRUE(std::isnan(sloped.at(b, t, 2, x)));
        for (std::int64_t h : {0, 1, 3}) EXPECT_TRUE(std::isfinite(sloped.at(b, t, h, x)));
      }
}

// ---- rolling caches (KVCacheConfig::window) ----

// A rolling cache of window 100 (ring R = 192 contiguous / 64-blocks, 256 with 128-blocks) fed
// far beyond R: decode with a window ≤ 100 equals the oracle over the full K/V, and equals,
// bitwise, the same decode on a cache that kept everything (the kernel reads the same tiles).
TEST_P(Decode, RollingCacheMatchesOracleAndFullCache) {
  std::mt19937_64 rng(55);
  const std::int64_t Wc = 100;
  Filled f = make_kv({700, 150, 1300}, 2, 32, rng);
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    KVCache full({1, 3, 2, 32, 1300, dtype, 0, 0});
    fill_cache(full, 0, f);
    for (std::int64_t block : {0, 64, 128}) {
      KVCache rolling({1, 3, 2, 32, std::int64_t{1} << 40, dtype, block, 0, Wc});
      fill_cache(rolling, 0, f);
      const std::int64_t R = block == 128 ? 256 : 192;
      ASSERT_EQ(rolling.retained_positions(), R);
      EXPECT_EQ(rolling.length(0), 700);
      EXPECT_EQ(rolling.first_position(0), 700 - R);
      EXPECT_EQ(rolling.first_position(1), 0);  // 150 < R: nothing dropped yet
      EXPECT_EQ(rolling.storage_bytes(), kv_cache_bytes(1, 3, R, 2, 32, size_of(dtype)));
      for (std::int64_t w : {Wc, std::int64_t{37}, std::int64_t{1}})
        for (std::int64_t tnew : {1, 3}) {
          SCOPED_TRACE(std::string(to_string(dtype)) + " block=" + std::to_string(block) +
                       " window=" + std::to_string(w) + " T_new=" + std::to_string(tnew));
          StridedTensor q(3, tnew, 4, 32, Layout::bthd);
          q.fill_random(rng);
          const VariantOptions vo({"", w, 0.0, true, true}, 4, GetParam());
          StridedTensor o1(3, tnew, 4, 32, Layout::bthd), o2(3, tnew, 4, 32, Layout::bthd);
          std::vector<float> l1(3 * 4 * tnew, kPoison), l2 = l1;
          attention_decode(q.view, rolling, 0, o1.view, TensorView::bht(l1.data(), 3, 4, tnew),
                           vo.decode);
          attention_decode(q.view, full, 0, o2.view, TensorView::bht(l2.data(), 3, 4, tnew),
                           vo.decode);
          EXPECT_EQ(0, std::memcmp(o1.storage.data(), o2.storage.data(),
                                   o1.storage.size() * sizeof(float)));
          EXPECT_EQ(0, std::memcmp(l1.data(), l2.data(), l1.size() * sizeof(float)));
          for (std::int64_t b = 0; b < 3; ++b) {
            const auto ref =
                oracle(q, b, f, dtype, vo.oracle, f.lengths[static_cast<std::size_t>(b)]);
            const auto [err, lse_err] = decode_errors(o1, l1, b, ref);
            EXPECT_LE(err, kVariantBound) << "sequence " << b;
            EXPECT_LE(lse_err, kVariantBound) << "sequence " << b;
          }
        }
    }
  }
}

// Speculative decoding on a rolling cache: truncating back within the retained positions and
// appending the same tokens again gives the storage of a cache that never held the draft, and
// decoding it matches the oracle.
TEST_P(Decode, RollingTruncateThenAppendEqualsNeverAppended) {
  std::mt19937_64 rng(56);
  Filled f = make_kv({900}, 1, 16, rng), draft = make_kv({900}, 1, 16, rng);
  for (std::int64_t block : {0, 64}) {
    KVCache a({1, 1, 1, 16, 100000, DType::bf16, block, 0, 60});  // R = 128
    KVCache b({1, 1, 1, 16, 100000, DType::bf16, block, 0, 60});
    Filled head = f;
    head.lengths = {850};
    fill_cache(a, 0, head);
    fill_cache(b, 0, head);
    const std::array<std::int64_t, 4> strides{900 * 16, 16, 16, 1};
    auto rows = [&](Filled& src, std::int64_t from, std::int64_t n) {
      return std::pair{
          ConstTensorView{&src.K(0, from, 0, 0), DType::f32, 4, {1, n, 1, 16}, strides},
          ConstTensorView{&src.V(0, from, 0, 0), DType::f32, 4, {1, n, 1, 16}, strides}};
    };
    auto [dk, dv] = rows(draft, 850, 30);
    a.append(0, 0, dk, dv);  // a draft of 30 tokens
    EXPECT_EQ(a.first_position(0), 880 - 128);
    a.truncate(0, 850);  // reject it: back to 850 ≥ first position 752
    auto [k, v] = rows(f, 850, 50);
    a.append(0, 0, k, v);
    b.append(0, 0, k, v);
    ASSERT_EQ(a.length(0), 900);
    EXPECT_EQ(a.first_position(0), b.first_position(0));
    EXPECT_EQ(0,
              std::memcmp(a.raw_storage().data(), b.raw_storage().data(), a.raw_storage().size()));
    StridedTensor q(1, 1, 2, 16, Layout::bthd);
    q.fill_random(rng);
    const VariantOptions vo({"", 60}, 2, GetParam());
    StridedTensor out(1, 1, 2, 16, Layout::bthd);
    std::vector<float> lse(2, kPoison);
    attention_decode(q.view, a, 0, out.view, TensorView::bht(lse.data(), 1, 2, 1), vo.decode);
    const auto [err, lse_err] =
        decode_errors(out, lse, 0, oracle(q, 0, f, DType::bf16, vo.oracle, 900));
    EXPECT_LE(err, kVariantBound);
    EXPECT_LE(lse_err, kVariantBound);
  }
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
  // With a window, the keys the T_new queries can see: min(L, W + T_new − 1).
  EXPECT_EQ(decode_bytes(cache, 1, 0, 2, 30), 2u * (30 + 20) * 4 * 32 * 2);
  EXPECT_EQ(decode_bytes(cache, 1, 0, 2, 30, 5), 2u * (34 + 20) * 4 * 32 * 2);
  EXPECT_THROW(decode_bytes(cache, 1, 0, 2, -1), ArgumentError);
  EXPECT_THROW(decode_bytes(cache, 1, 0, 2, 30, 0), ArgumentError);
}

// A rolling cache holds O(W) positions: decode bytes count what is held (and seen).
TEST(DecodeBytes, RollingCacheCountsHeldPositions) {
  KVCache cache({1, 1, 2, 16, 1 << 20, DType::f32, 0, 0, 50});  // R = 128
  std::vector<float> k(static_cast<std::size_t>(1000 * 2 * 16), 0.25f);
  cache.append(0, 0, ConstTensorView::bthd(k.data(), 1, 1000, 2, 16),
               ConstTensorView::bthd(k.data(), 1, 1000, 2, 16));
  EXPECT_EQ(cache.length(0), 1000);
  EXPECT_EQ(cache.first_position(0), 1000 - 128);
  EXPECT_EQ(decode_bytes(cache, 0, 0, 1), 2u * 128 * 2 * 16 * 4);
  EXPECT_EQ(decode_bytes(cache, 0, 0, 1, 50), 2u * 50 * 2 * 16 * 4);
}

}  // namespace
}  // namespace tokenmix::testing
