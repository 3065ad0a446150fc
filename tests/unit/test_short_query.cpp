// tests/unit/test_short_query.cpp — attention_forward's split-KV path for short query blocks
// (src/api/short_query.cpp: T_q ≤ 16, the decode kernels on K/V packed from plain strided
// tensors, 256-key chunks merged in order, SPEC "Merging partial results") against the float64
// oracle on every kernel path: T_q around the 16-row limit (17 takes the forward kernel) × T_k
// across the 64-key tiles and 256-key chunks, GQA, both alignments, no mask, the score variants,
// strided and PyTorch-layout views, outputs poisoned before each call; and results bitwise
// identical for any thread count.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "api/short_query.hpp"
#include "kernels/kv_element.hpp"
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

// ---- V read in place (DecodeArgs::v_rows) vs V packed into tiles ----
// short_query.cpp reads V's rows in place when V's feature stride is 1 and packs them into V
// tiles otherwise; both must give bitwise the same O and L (the same products in the same
// order), and both must match the float64 oracle.

// A [B, T, H, D] tensor of dtype f32 or bf16 with explicit strides over its own storage. Bytes
// no element covers (padding) hold NaN: a kernel reading with a wrong stride sees them.
struct RawTensor {
  DType dt;
  std::array<std::int64_t, 4> shape, strides;
  std::vector<std::uint8_t> bytes;

  RawTensor(DType d, std::array<std::int64_t, 4> sh, std::array<std::int64_t, 4> st)
      : dt(d), shape(sh), strides(st) {
    std::int64_t last = 0;
    for (int i = 0; i < 4; ++i) last += (shape[i] - 1) * strides[i];
    bytes.assign(static_cast<std::size_t>((last + 1) * esize()), 0xff);  // all-ones bits: NaN
  }
  std::int64_t esize() const { return static_cast<std::int64_t>(size_of(dt)); }
  std::int64_t offset(std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t x) const {
    return (b * strides[0] + t * strides[1] + h * strides[2] + x * strides[3]) * esize();
  }
  // Stores x rounded to dt (nearest even for bf16) and returns the stored value.
  float set(std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t x, float value) {
    std::uint8_t* p = bytes.data() + offset(b, t, h, x);
    if (dt == DType::f32) {
      std::memcpy(p, &value, 4);
      return value;
    }
    const std::uint16_t bits = kernels::f32_to_bf16(value);
    std::memcpy(p, &bits, 2);
    return kernels::bf16_to_f32(bits);
  }
  float get(std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t x) const {
    const std::uint8_t* p = bytes.data() + offset(b, t, h, x);
    if (dt == DType::f32) {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    std::uint16_t bits;
    std::memcpy(&bits, p, 2);
    return kernels::bf16_to_f32(bits);
  }
  TensorView view() {
    return {bytes.data(),
            dt,
            4,
            {shape[0], shape[1], shape[2], shape[3]},
            {strides[0], strides[1], strides[2], strides[3]}};
  }
};

struct VInPlaceCase {
  std::int64_t B = 1, Tq = 1, Tk = 1, Hq = 1, Hkv = 1, D = 8;
  bool causal = true;
  CausalAlign align = CausalAlign::bottom_right;
  std::optional<std::int64_t> window{};
  int v_layout =
      0;  // in-place V: 0 [B,T,H,D] contiguous, 1 [B,H,T,D] with padded rows (s1 = D + 3)
  std::vector<std::int64_t> nan_keys;  // keys u whose V row holds +∞ (feature 0), NaN (D − 1)

  std::string name() const {
    std::string s = "B" + std::to_string(B) + "_Tq" + std::to_string(Tq) + "_Tk" +
                    std::to_string(Tk) + "_Hq" + std::to_string(Hq) + "_Hkv" + std::to_string(Hkv) +
                    "_d" + std::to_string(D) + (causal ? "" : "_nomask") + "_" + to_string(align) +
                    "_vlayout" + std::to_string(v_layout);
    if (window) s += "_W" + std::to_string(*window);
    for (std::int64_t u : nan_keys) s += "_nan" + std::to_string(u);
    return s;
  }
};

// Runs the case in dtype dt on path isa: V in place and V packed (feature stride 2, the same
// values), O and L compared bitwise, then O and L against the float64 oracle.
void check_v_in_place(const VInPlaceCase& c, DType dt, Isa isa, std::mt19937_64& rng) {
  const std::int64_t B = c.B, Tq = c.Tq, Tk = c.Tk, Hq = c.Hq, Hkv = c.Hkv, D = c.D;
  RawTensor q(dt, {B, Tq, Hq, D}, {Tq * Hq * D, Hq * D, D, 1});
  RawTensor k(dt, {B, Tk, Hkv, D}, {Tk * Hkv * D, Hkv * D, D, 1});
  const std::int64_t row = D + 3;  // v_layout 1: padded rows
  RawTensor v_in = c.v_layout == 0
                       ? RawTensor(dt, {B, Tk, Hkv, D}, {Tk * Hkv * D, Hkv * D, D, 1})
                       : RawTensor(dt, {B, Tk, Hkv, D}, {Hkv * Tk * row, row, Tk * row, 1});
  RawTensor v_packed(dt, {B, Tk, Hkv, D}, {Tk * Hkv * D * 2, Hkv * D * 2, D * 2, 2});
  Tensor64 q64({B, Tq, Hq, D}), k64({B, Tk, Hkv, D}), v64({B, Tk, Hkv, D});
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < Tq; ++t)
      for (std::int64_t h = 0; h < Hq; ++h)
        for (std::int64_t x = 0; x < D; ++x) q64.at(b, t, h, x) = q.set(b, t, h, x, dist(rng));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t u = 0; u < Tk; ++u)
      for (std::int64_t h = 0; h < Hkv; ++h)
        for (std::int64_t x = 0; x < D; ++x) {
          k64.at(b, u, h, x) = k.set(b, u, h, x, dist(rng));
          float value = dist(rng);
          if (std::find(c.nan_keys.begin(), c.nan_keys.end(), u) != c.nan_keys.end()) {
            if (x == 0) value = std::numeric_limits<float>::infinity();
            if (x == D - 1) value = std::numeric_limits<float>::quiet_NaN();
          }
          v64.at(b, u, h, x) = v_in.set(b, u, h, x, value);
          v_packed.set(b, u, h, x, value);
        }

  AttentionOptions o;
  o.causal = c.causal;
  o.align = c.align;
  o.window = c.window;
  o.isa = isa;
  o.threads = 0;
  // Both calls run the split-KV path (not the forward kernel): what this test is about.
  kernels::AttentionProblem p;
  p.batch = B;
  p.tq = Tq;
  p.tk = Tk;
  p.hq = Hq;
  p.hkv = Hkv;
  p.dh = D;
  p.causal = c.causal;
  p.align = c.align;
  p.var.window = c.window.value_or(0);
  ASSERT_TRUE(detail::short_query_applies(p, isa, dt));

  const std::array<std::int64_t, 4> out_shape{B, Tq, Hq, D}, out_strides{Tq * Hq * D, Hq * D, D, 1};
  RawTensor out_in(dt, out_shape, out_strides), out_packed(dt, out_shape, out_strides);
  std::vector<float> lse_in(static_cast<std::size_t>(B * Hq * Tq), kPoison), lse_packed = lse_in;
  attention_forward(q.view(), k.view(), v_in.view(), out_in.view(),
                    TensorView::bht(lse_in.data(), B, Hq, Tq), o);
  attention_forward(q.view(), k.view(), v_packed.view(), out_packed.view(),
                    TensorView::bht(lse_packed.data(), B, Hq, Tq), o);
  ASSERT_EQ(out_in.bytes.size(), out_packed.bytes.size());
  EXPECT_EQ(0, std::memcmp(out_in.bytes.data(), out_packed.bytes.data(), out_in.bytes.size()))
      << "O: V in place differs from V packed";
  EXPECT_EQ(0, std::memcmp(lse_in.data(), lse_packed.data(), lse_in.size() * sizeof(float)))
      << "L: V in place differs from V packed";

  reference::Options ro;
  ro.causal = c.causal;
  ro.align = testkit::to_reference(c.align);
  ro.window = c.window;
  const reference::ForwardResult ref = reference::attention_forward(q64, k64, v64, ro);
  // bf16: O is rounded once to bf16 (half an ulp, 2^-9 of max|O|) after fp32 arithmetic.
  const double tol = dt == DType::f32 ? 2e-5 : std::ldexp(1.0, -8);
  double max_ref = 0.0;
  for (double r : ref.out.data)
    if (std::isfinite(r)) max_ref = std::max(max_ref, std::abs(r));
  max_ref = std::max(max_ref, 1e-30);
  double err = 0.0, lerr = 0.0;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < Hq; ++h)
      for (std::int64_t t = 0; t < Tq; ++t) {
        const double want_l = ref.lse.at(b, h, t, 0);
        const float got_l = lse_in[static_cast<std::size_t>((b * Hq + h) * Tq + t)];
        if (std::isinf(want_l)) {
          EXPECT_EQ(got_l, static_cast<float>(want_l)) << "b=" << b << " h=" << h << " t=" << t;
        } else {
          lerr = std::max(lerr, std::abs(got_l - want_l) / std::max(1.0, std::abs(want_l)));
        }
        for (std::int64_t x = 0; x < D; ++x) {
          const double want = ref.out.at(b, t, h, x);
          const float got = out_in.get(b, t, h, x);
          if (!std::isfinite(want)) {  // a non-finite V row this row sees: not finite either
            EXPECT_FALSE(std::isfinite(got)) << "b=" << b << " h=" << h << " t=" << t << " x=" << x;
          } else {
            ASSERT_TRUE(std::isfinite(got)) << "b=" << b << " h=" << h << " t=" << t << " x=" << x;
            err = std::max(err, std::abs(got - want) / max_ref);
          }
        }
      }
  EXPECT_LE(err, tol);
  EXPECT_LE(lerr, 2e-5);
}

TEST_P(ShortQuery, VInPlaceBitwiseMatchesPackedVAndOracle) {
  std::mt19937_64 rng(1805);
  const struct {
    std::int64_t Hq, Hkv;
  } groups[] = {{2, 2}, {4, 1}, {8, 2}, {1, 1}};  // g = 1, 4, 4, 1
  const std::int64_t dims[] = {64, 40, 7};
  const std::optional<std::int64_t> windows[] = {std::nullopt, 50, std::nullopt, 1, 200};
  int n = 0;
  for (std::int64_t Tk : {1, 63, 64, 65, 255, 256, 257, 1000})
    for (std::int64_t Tq = 1; Tq <= 4; ++Tq) {
      VInPlaceCase c;
      c.B = 1 + n % 2;
      c.Tq = Tq;
      c.Tk = Tk;
      // Indices that cycle independently of T_q (n % 4 = T_q − 1).
      c.Hq = groups[(n + n / 4) % 4].Hq;
      c.Hkv = groups[(n + n / 4) % 4].Hkv;
      c.D = dims[n % 3];
      c.window = windows[n % 5];
      c.v_layout = (n / 2 + n / 8) % 2;  // H_kv = 1 in layout 0: V's row stride is d_h
      if (n % 7 == 3 && Tq <= Tk) c.align = CausalAlign::top_left;
      if (n % 11 == 5 && Tq == 1) c.causal = false;
      // Non-finite V rows: key T_k − 1 (seen by the last row only, bottom-right), the key only
      // the first row's window holds, and a key no row sees (before every window).
      if (n % 3 != 1 && c.align == CausalAlign::bottom_right) {
        c.nan_keys.push_back(Tk - 1);
        if (c.window && Tk - Tq - *c.window + 1 >= 0) c.nan_keys.push_back(Tk - Tq - *c.window + 1);
        if (c.window && Tk - Tq - *c.window >= 0) c.nan_keys.push_back(Tk - Tq - *c.window);
      }
      ++n;
      for (DType dt : {DType::f32, DType::bf16}) {
        if (GetParam() == Isa::avx512_bf16 && dt == DType::bf16) continue;  // forward kernel
        SCOPED_TRACE(std::string(to_string(dt)) + " " + c.name());
        check_v_in_place(c, dt, GetParam(), rng);
        if (HasFatalFailure()) return;
      }
    }
}

// DecodeArgs::read_v_in_place serves activation dtypes with contiguous features and no ring;
// anything else is an internal misuse, refused with an error naming the entry point. The
// quantized decode kernels refuse in-place V rows too (their V rows need the tile's scales).
TEST(ShortQueryPath, VInPlaceRefusesQuantizedRingAndStridedFeatures) {
  const float v[4] = {};
  const kernels::In contiguous{v, 4, 4, 4, 1}, strided{v, 4, 4, 4, 2};
  const kernels::CallSite site{"attention_forward", "decode"};
  const auto refused = [&](const kernels::DecodeArgs& a, const kernels::In& in) {
    kernels::DecodeArgs copy = a;
    try {
      copy.read_v_in_place(in, site);
    } catch (const UnsupportedError& e) {
      EXPECT_NE(std::string(e.what()).find("attention_forward"), std::string::npos) << e.what();
      EXPECT_FALSE(copy.v_in_place());
      return true;
    }
    return false;
  };
  kernels::DecodeArgs a;  // a valid problem: the kernels below compute its units first
  a.batch = 1, a.tnew = 1, a.hq = 1, a.hkv = 1, a.dh = 4;
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    a.dtype = dt;
    EXPECT_FALSE(refused(a, contiguous)) << to_string(dt);
    EXPECT_TRUE(refused(a, strided)) << to_string(dt);
  }
  a.ring = 64;
  EXPECT_TRUE(refused(a, contiguous));
  a.ring = 0;
  for (DType dt : {DType::int8, DType::fp8_e4m3}) {
    a.dtype = dt;
    EXPECT_TRUE(refused(a, contiguous)) << to_string(dt);
  }
  // A quantized kernel handed in-place V rows anyway (outside a parallel region: it throws
  // before its units).
  a.dtype = DType::int8;
  a.v_rows.data = v;
  EXPECT_THROW(kernels::attention_decode_int8_portable(a), UnsupportedError);
  EXPECT_THROW(kernels::attention_decode_fp8_e4m3_portable(a), UnsupportedError);
  if (testkit::isa_unavailable_reason(Isa::avx2).empty()) {
    EXPECT_THROW(kernels::attention_decode_int8_avx2(a), UnsupportedError);
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, ShortQuery, AllIsas(), IsaName);

}  // namespace
}  // namespace tokenmix::testing
