// tests/unit/test_short_query.cpp — attention_forward's split-KV path for short query blocks
// (src/api/short_query.cpp: T_q ≤ 16, the decode kernels on K/V packed from plain strided
// tensors, 256-key chunks merged in order, SPEC "Merging partial results") against the float64
// oracle on every kernel path: T_q around the 16-row limit (17 takes the forward kernel) × T_k
// across the 64-key tiles and 256-key chunks, GQA, both alignments, no mask, the score variants,
// strided and PyTorch-layout views, outputs poisoned before each call; and results bitwise
// identical for any thread count.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "api/short_query.hpp"
#include "test_util.hpp"

namespace tokenmix::testing {
namespace {

struct ShortCase {
  std::int64_t B = 1, Tq = 1, Tk = 1, Hq = 1, Hkv = 1, D = 8;
  bool causal = true;
  CausalAlign align = CausalAlign::bottom_right;
  Layout layout = Layout::bthd;
  std::optional<std::int64_t> window{};
  std::optional<double> softcap{};
  bool alibi = false, sinks = false;

  std::string name() const {
    std::string s = "B" + std::to_string(B) + "_Tq" + std::to_string(Tq) + "_Tk" +
                    std::to_string(Tk) + "_Hq" + std::to_string(Hq) + "_Hkv" + std::to_string(Hkv) +
                    "_d" + std::to_string(D) + (causal ? "" : "_nomask") + "_" + to_string(align) +
                    "_" + layout_name(layout);
    if (window) s += "_W" + std::to_string(*window);
    if (softcap) s += "_cap";
    if (alibi) s += "_alibi";
    if (sinks) s += "_sinks";
    return s;
  }
};

struct ShortRun {
  ShortCase c;
  StridedTensor q, k, v, out;
  std::vector<float> lse, slopes, sinks;

  ShortRun(const ShortCase& sc, std::mt19937_64& rng)
      : c(sc),
        q(sc.B, sc.Tq, sc.Hq, sc.D, sc.layout),
        k(sc.B, sc.Tk, sc.Hkv, sc.D, sc.layout),
        v(sc.B, sc.Tk, sc.Hkv, sc.D, sc.layout),
        out(sc.B, sc.Tq, sc.Hq, sc.D, sc.layout),
        lse(static_cast<std::size_t>(sc.B * sc.Hq * sc.Tq), kPoison) {
    q.fill_random(rng);
    k.fill_random(rng);
    v.fill_random(rng);
    std::uniform_real_distribution<float> slope(0.01f, 0.3f), sink(-1.0f, 2.0f);
    for (std::int64_t h = 0; h < c.Hq; ++h) {
      if (c.alibi) slopes.push_back(slope(rng));
      if (c.sinks) sinks.push_back(sink(rng));
    }
  }

  AttentionOptions options(Isa isa, int threads) const {
    AttentionOptions o;
    o.causal = c.causal;
    o.align = c.align;
    o.isa = isa;
    o.threads = threads;
    o.window = c.window;
    o.softcap = c.softcap;
    if (c.alibi) o.alibi_slopes = {slopes.data(), DType::f32, 1, {c.Hq}, {1}};
    if (c.sinks) o.sinks = {sinks.data(), DType::f32, 1, {c.Hq}, {1}};
    return o;
  }

  void forward(Isa isa, int threads) {
    out.poison();
    std::fill(lse.begin(), lse.end(), kPoison);
    attention_forward(q.view, k.view, v.view, out.view,
                      TensorView::bht(lse.data(), c.B, c.Hq, c.Tq), options(isa, threads));
  }

  reference::ForwardResult oracle() const {
    reference::Options o;
    o.causal = c.causal;
    o.align = testkit::to_reference(c.align);
    o.window = c.window;
    o.softcap = c.softcap;
    for (float s : slopes) o.alibi_slopes.push_back(s);
    for (float s : sinks) o.sinks.push_back(s);
    return reference::attention_forward(q.to64(), k.to64(), v.to64(), o);
  }

  // O and L against the oracle; rows that see no key must be exactly O = 0, L = −∞ (or σ_h).
  void expect_matches_oracle(Isa isa, int threads) {
    forward(isa, threads);
    const auto ref = oracle();
    EXPECT_LE(rel_err(out, ref.out), 2e-5);
    ErrorAccumulator lerr;
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < c.Hq; ++h)
        for (std::int64_t t = 0; t < c.Tq; ++t) {
          const double want = ref.lse.at(b, h, t, 0);
          const float got = lse[static_cast<std::size_t>((b * c.Hq + h) * c.Tq + t)];
          if (std::isinf(want)) {
            ASSERT_EQ(got, static_cast<float>(want)) << "b=" << b << " h=" << h << " t=" << t;
            for (std::int64_t x = 0; x < c.D; ++x) ASSERT_EQ(out.at(b, t, h, x), 0.0f);
            continue;
          }
          lerr.add(got, want);
        }
    EXPECT_LE(lerr.value(), 2e-5);
  }
};

class ShortQuery : public PerIsaTest {};

// The path is chosen by shape and options alone (never by the thread count).
TEST(ShortQueryPath, AppliesToShortBlocksWithoutMasks) {
  kernels::AttentionProblem p;
  p.batch = 1;
  p.hq = 8;
  p.hkv = 2;
  p.dh = 64;
  p.tk = 1024;
  for (std::int64_t tq : {1, 7, 16}) {
    p.tq = tq;
    EXPECT_TRUE(detail::short_query_applies(p, Isa::avx2, DType::f32)) << tq;
  }
  p.tq = 17;
  EXPECT_FALSE(detail::short_query_applies(p, Isa::avx2, DType::f32));
  p.tq = 4;
  p.causal = false;  // T_q > 1 without the causal mask: every row sees every key
  EXPECT_FALSE(detail::short_query_applies(p, Isa::avx2, DType::f32));
  p.tq = 1;
  EXPECT_TRUE(detail::short_query_applies(p, Isa::avx2, DType::f32));
  p.align = CausalAlign::top_left;
  p.var.window = 8;  // the window of a top-left query without the mask sits at position 0
  EXPECT_FALSE(detail::short_query_applies(p, Isa::avx2, DType::f32));
  p.var.window = 0;
  p.causal = true;
  p.tq = 4;
  p.tk = 3;  // top-left with T_q > T_k
  EXPECT_FALSE(detail::short_query_applies(p, Isa::avx2, DType::f32));
  p.tk = 1024;
  p.var.mask_kind = kernels::MaskKind::bias;
  EXPECT_FALSE(detail::short_query_applies(p, Isa::avx2, DType::f32));
  p.var.mask_kind = kernels::MaskKind::none;
  EXPECT_TRUE(detail::short_query_applies(p, Isa::avx2, DType::f32));
  EXPECT_FALSE(detail::short_query_applies(p, Isa::avx512_bf16, DType::bf16));  // opt-in dpbf16
  p.threads = 64;
  EXPECT_TRUE(detail::short_query_applies(p, Isa::avx2, DType::f32));
  p.align = CausalAlign::bottom_right;
  p.tk = 65536;  // 32 MiB of f32 K/V tiles per KV head: 2 heads fit in the 64 MiB pack, 8 not
  EXPECT_TRUE(detail::short_query_applies(p, Isa::avx2, DType::f32));
  p.hkv = 8;
  EXPECT_FALSE(detail::short_query_applies(p, Isa::avx2, DType::f32));
  p.var.window = 4096;  // only the tiles from the first window start are packed
  EXPECT_TRUE(detail::short_query_applies(p, Isa::avx2, DType::f32));
}

TEST_P(ShortQuery, MatchesFloat64OracleAcrossTileAndChunkEdges) {
  std::mt19937_64 rng(1801);
  const struct {
    std::int64_t Hq, Hkv, D;
    Layout layout;
  } heads[] = {{1, 1, 8, Layout::bthd}, {4, 1, 13, Layout::bhtd}, {6, 2, 64, Layout::strided}};
  int n = 0;
  for (std::int64_t Tq : {1, 2, 3, 7, 16, 17})
    for (std::int64_t Tk : {1, 5, 63, 64, 65, 256, 257, 600})
      for (CausalAlign align : {CausalAlign::bottom_right, CausalAlign::top_left})
        for (bool causal : {true, false}) {
          if (!causal && (Tq > 2 || align == CausalAlign::top_left)) continue;
          const auto& hd = heads[n++ % 3];
          ShortCase c{1 + n % 2, Tq, Tk, hd.Hq, hd.Hkv, hd.D, causal, align, hd.layout};
          SCOPED_TRACE(c.name());
          ShortRun r(c, rng);
          r.expect_matches_oracle(GetParam(), 0);
          if (HasFatalFailure()) return;
        }
}

TEST_P(ShortQuery, ScoreVariantsMatchFloat64Oracle) {
  std::mt19937_64 rng(1802);
  int n = 0;
  for (std::int64_t Tq : {1, 5, 16})
    for (std::int64_t Tk : {70, 700})
      for (CausalAlign align : {CausalAlign::bottom_right, CausalAlign::top_left}) {
        ShortCase c{2, Tq, Tk, 4, 2, 24, true, align, n % 2 ? Layout::bhtd : Layout::strided};
        switch (n++ % 4) {
          case 0:
            c.window = 40;
            c.sinks = true;
            break;
          case 1:
            c.softcap = 2.0;
            c.alibi = true;
            break;
          case 2:
            c.window = 300;
            c.alibi = true;
            c.softcap = 5.0;
            break;
          default:
            c.sinks = true;
            c.window = 1;
        }
        SCOPED_TRACE(c.name());
        ShortRun r(c, rng);
        r.expect_matches_oracle(GetParam(), 0);
        if (HasFatalFailure()) return;
      }
  // One query without the mask, bottom-right: the window and ALiBi use p = T_k − 1.
  ShortCase c{1, 1, 500, 8, 2, 16, false, CausalAlign::bottom_right, Layout::bhtd};
  c.window = 100;
  c.alibi = true;
  c.sinks = true;
  SCOPED_TRACE(c.name());
  ShortRun r(c, rng);
  r.expect_matches_oracle(GetParam(), 0);
}

// Rows that see no key (bottom-right with T_q > T_k): O = 0, L = −∞ exactly.
TEST_P(ShortQuery, RowsThatSeeNoKey) {
  std::mt19937_64 rng(1803);
  ShortCase c{1, 12, 5, 4, 2, 8, true, CausalAlign::bottom_right, Layout::bthd};
  ShortRun r(c, rng);
  r.expect_matches_oracle(GetParam(), 0);
  EXPECT_TRUE(std::isinf(r.lse[0]) && r.lse[0] < 0);
}

TEST_P(ShortQuery, BitwiseIdenticalAcrossThreadCounts) {
  std::mt19937_64 rng(1804);
  ShortCase c{1, 3, 1500, 8, 2, 32, true, CausalAlign::bottom_right, Layout::bhtd};
  c.sinks = true;
  ShortRun r(c, rng);
  r.forward(GetParam(), 1);
  const std::vector<float> out1 = r.out.storage, lse1 = r.lse;
  for (int threads : {2, 3, 7, 0}) {
    r.forward(GetParam(), threads);
    EXPECT_EQ(0, std::memcmp(out1.data(), r.out.storage.data(), out1.size() * sizeof(float)))
        << threads;
    EXPECT_EQ(0, std::memcmp(lse1.data(), r.lse.data(), lse1.size() * sizeof(float))) << threads;
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, ShortQuery, AllIsas(), IsaName);

}  // namespace
}  // namespace tokenmix::testing
