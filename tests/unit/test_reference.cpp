// tests/unit/test_reference.cpp — sanity of the float64 oracle itself (src/reference).
//
// Before the oracle can judge the fast library it must itself be right. These tests check it on
// cases small enough to compute by hand (T = 1, uniform scores, a 2×2 example, masked rows,
// log-sum-exp values), on the algebraic properties SPEC 4.6–4.7 requires of the Jacobian, and
// its backward pass against central finite differences of its own forward pass.
//
// Everything is float64. Hand-computed values are compared with a tolerance of 1e-14 relative
// (a handful of double roundings, u = 1.1e-16). Finite differences: central differences with
// step h have truncation error O(h² f''') and rounding error O(u |f| / h); with h = 1e-5 and
// O(1) values both are ≲ 1e-10, so 1e-8 (rel_err) is a safe bound that still catches any
// wrong term in a gradient (those give O(1) errors).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <vector>

#include "reference/reference.hpp"
#include "test_util.hpp"

namespace tokenmix::testing {
namespace {

namespace ref = tokenmix::reference;
using ref::Tensor64;

constexpr double kInf = std::numeric_limits<double>::infinity();

Tensor64 random64(std::array<std::int64_t, 4> shape, std::mt19937_64& rng, double sigma = 1.0) {
  Tensor64 t(shape);
  std::normal_distribution<double> dist(0.0, sigma);
  for (double& x : t.data) x = dist(rng);
  return t;
}

bool all_finite(const Tensor64& t) {
  for (double x : t.data)
    if (!std::isfinite(x)) return false;
  return true;
}

// ---------------------------------------------------------------------------------------------
// Forward on hand-computable cases

// T = 1: the single query sees the single key, a = [1], so out = v and lse = s·⟨q, k⟩.
TEST(Reference, SingleTokenOutputIsValue) {
  std::mt19937_64 rng(1);
  const Tensor64 q = random64({2, 1, 3, 4}, rng), k = random64({2, 1, 3, 4}, rng),
                 v = random64({2, 1, 3, 4}, rng);
  const auto r = ref::attention_forward(q, k, v);
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t h = 0; h < 3; ++h) {
      double dot = 0.0;
      for (std::int64_t e = 0; e < 4; ++e) {
        EXPECT_EQ(r.out.at(b, 0, h, e), v.at(b, 0, h, e));
        dot += q.at(b, 0, h, e) * k.at(b, 0, h, e);
      }
      EXPECT_NEAR(r.lse.at(b, h, 0, 0), dot / 2.0, 1e-14);  // s = 1/sqrt(4)
    }
}

// q = 0 makes every score 0: row t of a causal attention is uniform over keys 0..t, so
// out_t = mean(v_0..v_t) and lse_t = log(t + 1). Non-causal: mean of all v, lse = log T_k.
TEST(Reference, UniformScoresAverageValues) {
  std::mt19937_64 rng(2);
  const std::int64_t T = 5, D = 3;
  const Tensor64 q({1, T, 1, D});  // zeros
  const Tensor64 k = random64({1, T, 1, D}, rng), v = random64({1, T, 1, D}, rng);
  const auto causal = ref::attention_forward(q, k, v);
  ref::Options nc;
  nc.causal = false;
  const auto full = ref::attention_forward(q, k, v, nc);
  for (std::int64_t t = 0; t < T; ++t) {
    EXPECT_NEAR(causal.lse.at(0, 0, t, 0), std::log(static_cast<double>(t + 1)), 1e-14);
    EXPECT_NEAR(full.lse.at(0, 0, t, 0), std::log(static_cast<double>(T)), 1e-14);
    for (std::int64_t e = 0; e < D; ++e) {
      double prefix = 0.0, all = 0.0;
      for (std::int64_t u = 0; u < T; ++u) {
        if (u <= t) prefix += v.at(0, u, 0, e);
        all += v.at(0, u, 0, e);
      }
      EXPECT_NEAR(causal.out.at(0, t, 0, e), prefix / static_cast<double>(t + 1), 1e-14);
      EXPECT_NEAR(full.out.at(0, t, 0, e), all / static_cast<double>(T), 1e-14);
    }
  }
}

// A 2×2 causal example by hand (d_h = 1, scale 1):
//   q = [1, 1], k = [0, ln 3], v = [4, 8].
//   Row 0 sees key 0 only: a = [1, 0], out = 4, lse = q0·k0 = 0.
//   Row 1: z = [0, ln 3] → a = [1/4, 3/4], out = 1 + 6 = 7, lse = log(1 + 3) = log 4.
// Backward with dout = [1, 1]: dA row 1 = dout·v = [4, 8]; dS = a ⊙ (dA − ⟨a, dA⟩)
//   = [1/4 (4 − 7), 3/4 (8 − 7)] = [−3/4, 3/4]; row 0 has a one-hot a, so dS row 0 = 0.
//   dq1 = dS·k = 3/4 ln 3, dq0 = 0; dk0 = dS00 q0 + dS10 q1 = −3/4, dk1 = 3/4;
//   dv0 = a00 + a10 = 5/4, dv1 = 3/4.
TEST(Reference, HandComputedTwoByTwo) {
  Tensor64 q({1, 2, 1, 1}), k({1, 2, 1, 1}), v({1, 2, 1, 1}), dout({1, 2, 1, 1});
  q.data = {1.0, 1.0};
  k.data = {0.0, std::log(3.0)};
  v.data = {4.0, 8.0};
  dout.data = {1.0, 1.0};
  ref::Options o;
  o.scale = 1.0;
  const auto f = ref::attention_forward(q, k, v, o);
  EXPECT_NEAR(f.out.data[0], 4.0, 1e-14);
  EXPECT_NEAR(f.out.data[1], 7.0, 1e-14);
  EXPECT_NEAR(f.lse.data[0], 0.0, 1e-14);
  EXPECT_NEAR(f.lse.data[1], std::log(4.0), 1e-14);
  const auto g = ref::attention_backward(q, k, v, dout, o);
  EXPECT_NEAR(g.dq.data[0], 0.0, 1e-14);
  EXPECT_NEAR(g.dq.data[1], 0.75 * std::log(3.0), 1e-14);
  EXPECT_NEAR(g.dk.data[0], -0.75, 1e-14);
  EXPECT_NEAR(g.dk.data[1], 0.75, 1e-14);
  EXPECT_NEAR(g.dv.data[0], 1.25, 1e-14);
  EXPECT_NEAR(g.dv.data[1], 0.75, 1e-14);
}

// The mask (4.3) for T_q ≠ T_k in both alignments, written out.
TEST(Reference, MaskAlignment) {
  ref::Options br, tl, nc;
  tl.align = ref::Align::top_left;
  nc.causal = false;
  // T_q = 2, T_k = 4, bottom-right: query 0 is at position 2 (sees 0..2), query 1 at 3.
  EXPECT_TRUE(ref::visible(0, 2, 2, 4, br));
  EXPECT_FALSE(ref::visible(0, 3, 2, 4, br));
  EXPECT_TRUE(ref::visible(1, 3, 2, 4, br));
  // Top-left: query 0 sees key 0 only.
  EXPECT_TRUE(ref::visible(0, 0, 2, 4, tl));
  EXPECT_FALSE(ref::visible(0, 1, 2, 4, tl));
  // T_q = 4, T_k = 2, bottom-right: queries 0, 1 are at positions −2, −1: they see nothing.
  EXPECT_FALSE(ref::visible(0, 0, 4, 2, br));
  EXPECT_FALSE(ref::visible(1, 0, 4, 2, br));
  EXPECT_TRUE(ref::visible(2, 0, 4, 2, br));
  EXPECT_FALSE(ref::visible(2, 1, 4, 2, br));
  EXPECT_TRUE(ref::visible(0, 3, 2, 4, nc));
}

// Rows that see no key (T_q > T_k, bottom-right): out = 0, lse = −∞, gradients 0, never NaN.
// The rows that do see keys behave like the last T_k rows of a square attention.
TEST(Reference, RowsWithoutKeysAreZero) {
  std::mt19937_64 rng(3);
  const std::int64_t Tq = 5, Tk = 2, D = 4;
  const Tensor64 q = random64({1, Tq, 2, D}, rng), k = random64({1, Tk, 1, D}, rng),
                 v = random64({1, Tk, 1, D}, rng), dout = random64({1, Tq, 2, D}, rng);
  const auto f = ref::attention_forward(q, k, v);
  const auto g = ref::attention_backward(q, k, v, dout);
  EXPECT_TRUE(all_finite(f.out));
  EXPECT_TRUE(all_finite(g.dq) && all_finite(g.dk) && all_finite(g.dv));
  for (std::int64_t h = 0; h < 2; ++h) {
    for (std::int64_t t = 0; t < Tq - Tk; ++t) {
      EXPECT_EQ(f.lse.at(0, h, t, 0), -kInf);
      for (std::int64_t e = 0; e < D; ++e) {
        EXPECT_EQ(f.out.at(0, t, h, e), 0.0);
        EXPECT_EQ(g.dq.at(0, t, h, e), 0.0);
      }
    }
    // Row Tq − Tk sits at position 0: it sees key 0 only → out = v_0, lse = s⟨q, k_0⟩.
    const std::int64_t t0 = Tq - Tk;
    double dot = 0.0;
    for (std::int64_t e = 0; e < D; ++e) {
      EXPECT_NEAR(f.out.at(0, t0, h, e), v.at(0, 0, 0, e), 1e-15);
      dot += q.at(0, t0, h, e) * k.at(0, 0, 0, e);
    }
    EXPECT_NEAR(f.lse.at(0, h, t0, 0), dot / 2.0, 1e-14);
  }
}

// GQA (4.8): H_q = 4 heads sharing H_kv = 2 KV heads equals MHA with each KV head repeated for
// its g = 2 query heads (forward); dK, dV of GQA are the sums over the group of the MHA ones.
TEST(Reference, GroupedQueryEqualsRepeatedHeads) {
  std::mt19937_64 rng(4);
  const std::int64_t B = 2, T = 4, Hq = 4, Hkv = 2, D = 3;
  const Tensor64 q = random64({B, T, Hq, D}, rng), k = random64({B, T, Hkv, D}, rng),
                 v = random64({B, T, Hkv, D}, rng), dout = random64({B, T, Hq, D}, rng);
  Tensor64 k_rep({B, T, Hq, D}), v_rep({B, T, Hq, D});
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t h = 0; h < Hq; ++h)
        for (std::int64_t e = 0; e < D; ++e) {
          k_rep.at(b, t, h, e) = k.at(b, t, h / 2, e);
          v_rep.at(b, t, h, e) = v.at(b, t, h / 2, e);
        }
  const auto gqa = ref::attention_forward(q, k, v), mha = ref::attention_forward(q, k_rep, v_rep);
  EXPECT_LT(rel_err_flat(gqa.out.data, mha.out.data), 1e-15);
  EXPECT_LT(rel_err_flat(gqa.lse.data, mha.lse.data), 1e-15);
  const auto g1 = ref::attention_backward(q, k, v, dout),
             g2 = ref::attention_backward(q, k_rep, v_rep, dout);
  EXPECT_LT(rel_err_flat(g1.dq.data, g2.dq.data), 1e-15);
  Tensor64 dk_sum({B, T, Hkv, D}), dv_sum({B, T, Hkv, D});
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t h = 0; h < Hq; ++h)
        for (std::int64_t e = 0; e < D; ++e) {
          dk_sum.at(b, t, h / 2, e) += g2.dk.at(b, t, h, e);
          dv_sum.at(b, t, h / 2, e) += g2.dv.at(b, t, h, e);
        }
  EXPECT_LT(rel_err_flat(g1.dk.data, dk_sum.data), 1e-14);
  EXPECT_LT(rel_err_flat(g1.dv.data, dv_sum.data), 1e-14);
}

// Custom scale: scores are s·⟨q, k⟩, so scale s on q equals scale 1 on s·q.
TEST(Reference, CustomScaleMultipliesScores) {
  std::mt19937_64 rng(5);
  const Tensor64 q = random64({1, 6, 2, 4}, rng), k = random64({1, 6, 2, 4}, rng),
                 v = random64({1, 6, 2, 4}, rng);
  ref::Options a, b;
  a.scale = 0.3;
  b.scale = 1.0;
  Tensor64 q3 = q;
  for (double& x : q3.data) x *= 0.3;
  const auto ra = ref::attention_forward(q, k, v, a), rb = ref::attention_forward(q3, k, v, b);
  EXPECT_LT(rel_err_flat(ra.out.data, rb.out.data), 1e-14);
  EXPECT_LT(rel_err_flat(ra.lse.data, rb.lse.data), 1e-14);
}

// ---------------------------------------------------------------------------------------------
// softmax, log-sum-exp, Jacobian (4.4, 4.6, 4.7)

TEST(Reference, SoftmaxAndLogSumExp) {
  // softmax([0, ln 3]) = [1/4, 3/4]; lse = ln 4. Shift invariance: +1000 changes nothing in a
  // (up to the rounding of 1000 + ln 3 itself: ulp(1000) = 1.1e-13, hence the 1e-12 bound).
  const auto a = ref::softmax({1000.0, 1000.0 + std::log(3.0)});
  EXPECT_NEAR(a[0], 0.25, 1e-12);
  EXPECT_NEAR(a[1], 0.75, 1e-12);
  EXPECT_GT(a[0], 0.0);
  EXPECT_NEAR(ref::logsumexp({0.0, std::log(3.0)}), std::log(4.0), 1e-15);
  EXPECT_NEAR(ref::logsumexp({1000.0, 1000.0 + std::log(3.0)}), 1000.0 + std::log(4.0), 1e-12);
  // Masked entries get probability 0; an all-masked row gives zeros and lse = −∞, no NaN.
  const auto m = ref::softmax({0.0, -kInf, 0.0});
  EXPECT_EQ(m[1], 0.0);
  EXPECT_NEAR(m[0], 0.5, 1e-15);
  const auto none = ref::softmax({-kInf, -kInf});
  EXPECT_EQ(none[0], 0.0);
  EXPECT_EQ(none[1], 0.0);
  EXPECT_EQ(ref::logsumexp({-kInf, -kInf}), -kInf);
}

// J = diag(a) − a aᵀ: symmetric, J·1 = 0, vᵀJv = Var_a(v) ≥ 0, J g = a ⊙ (g − ⟨a, g⟩), and it
// matches central differences of softmax.
TEST(Reference, JacobianProperties) {
  const std::vector<double> z = {0.3, -1.2, 2.0, 0.0, 0.7};
  const std::size_t n = z.size();
  const auto a = ref::softmax(z);
  const auto J = ref::softmax_jacobian(a);
  ASSERT_EQ(J.size(), n * n);
  const std::vector<double> g = {1.0, -2.0, 0.5, 3.0, -0.25};
  double ag = 0.0, ag2 = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    ag += a[i] * g[i];
    ag2 += a[i] * g[i] * g[i];
  }
  double vJv = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    double row = 0.0, Jg = 0.0;
    for (std::size_t j = 0; j < n; ++j) {
      EXPECT_EQ(J[i * n + j], J[j * n + i]);  // symmetric
      row += J[i * n + j];
      Jg += J[i * n + j] * g[j];
    }
    EXPECT_NEAR(row, 0.0, 1e-16);                // J·1 = 0
    EXPECT_NEAR(Jg, a[i] * (g[i] - ag), 1e-15);  // matrix-free product (4.7)
    vJv += g[i] * Jg;
    // ∂a_i/∂z_j by central differences
    for (std::size_t j = 0; j < n; ++j) {
      auto zp = z, zm = z;
      zp[j] += 1e-6;
      zm[j] -= 1e-6;
      const double fd = (ref::softmax(zp)[i] - ref::softmax(zm)[i]) / 2e-6;
      EXPECT_NEAR(J[i * n + j], fd, 1e-9);
    }
  }
  EXPECT_NEAR(vJv, ag2 - ag * ag, 1e-14);  // vᵀJv = Var_a(v)
  EXPECT_GT(vJv, 0.0);
}

// ---------------------------------------------------------------------------------------------
// Backward vs central finite differences of the forward (float64)

/// Central-difference gradient of loss(x) = f(x) at every entry of x (testing toolkit).
using testkit::central_differences;

struct FdCase {
  const char* what;
  std::int64_t B, Tq, Tk, Hq, Hkv, D;
  bool causal;
  ref::Align align;
  std::optional<double> scale;
};

TEST(Reference, BackwardMatchesFiniteDifferences) {
  const FdCase cases[] = {
      {"square causal MHA", 1, 4, 4, 2, 2, 3, true, ref::Align::bottom_right, {}},
      {"GQA g=2, batch 2", 2, 3, 3, 4, 2, 2, true, ref::Align::bottom_right, {}},
      {"MQA, T_q<T_k bottom-right", 1, 2, 5, 3, 1, 4, true, ref::Align::bottom_right, {}},
      {"T_q>T_k bottom-right (empty rows)", 1, 5, 3, 2, 1, 2, true, ref::Align::bottom_right, {}},
      {"T_q>T_k top-left", 1, 4, 2, 2, 2, 3, true, ref::Align::top_left, {}},
      {"T_q<T_k top-left, custom scale", 1, 3, 5, 2, 1, 2, true, ref::Align::top_left, 0.7},
      {"non-causal", 1, 3, 4, 2, 2, 3, false, ref::Align::bottom_right, {}},
  };
  std::mt19937_64 rng(6);
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    Tensor64 q = random64({c.B, c.Tq, c.Hq, c.D}, rng), k = random64({c.B, c.Tk, c.Hkv, c.D}, rng),
             v = random64({c.B, c.Tk, c.Hkv, c.D}, rng);
    const Tensor64 dout = random64({c.B, c.Tq, c.Hq, c.D}, rng);
    ref::Options o;
    o.causal = c.causal;
    o.align = c.align;
    o.scale = c.scale;
    // loss = Σ dout ⊙ out, so ∂loss/∂out = dout.
    auto loss = [&] { return testkit::attention_loss(q, k, v, dout, o); };
    const auto g = ref::attention_backward(q, k, v, dout, o);
    EXPECT_LT(rel_err_flat(g.dq.data, central_differences(q.data, loss)), 1e-8);
    EXPECT_LT(rel_err_flat(g.dk.data, central_differences(k.data, loss)), 1e-8);
    EXPECT_LT(rel_err_flat(g.dv.data, central_differences(v.data, loss)), 1e-8);
  }
}

// ---------------------------------------------------------------------------------------------
// RoPE and merge

// d_h = 2, base irrelevant (θ_0 = 1): position p rotates (x, y) by p radians. Both pairings
// coincide at d_h = 2. Inverse undoes forward; ⟨R_m q, R_n k⟩ depends only on m − n.
TEST(Reference, RopeRotation) {
  Tensor64 x({1, 3, 1, 2});
  for (std::int64_t t = 0; t < 3; ++t) {
    x.at(0, t, 0, 0) = 1.0;
    x.at(0, t, 0, 1) = 0.0;
  }
  const auto y = ref::rope(x, ref::RopePairing::rotate_half, 10000.0, 0);
  for (std::int64_t t = 0; t < 3; ++t) {
    EXPECT_NEAR(y.at(0, t, 0, 0), std::cos(static_cast<double>(t)), 1e-15);
    EXPECT_NEAR(y.at(0, t, 0, 1), std::sin(static_cast<double>(t)), 1e-15);
  }
  std::mt19937_64 rng(7);
  for (auto pairing : {ref::RopePairing::rotate_half, ref::RopePairing::interleaved}) {
    const Tensor64 a = random64({2, 5, 3, 8}, rng);
    const auto back = ref::rope(ref::rope(a, pairing, 500000.0, 7), pairing, 500000.0, 7, true);
    EXPECT_LT(rel_err_flat(back.data, a.data), 1e-14);
    // Same q at every position, same k at every position: ⟨R_m q, R_n k⟩ for (m, n) = (3, 1)
    // and (4, 2) must agree (offset 0, T = 5).
    Tensor64 q({1, 5, 1, 8}), k({1, 5, 1, 8});
    for (std::int64_t t = 0; t < 5; ++t)
      for (std::int64_t e = 0; e < 8; ++e) {
        q.at(0, t, 0, e) = a.at(0, 0, 0, e);
        k.at(0, t, 0, e) = a.at(0, 0, 1, e);
      }
    const auto rq = ref::rope(q, pairing, 100.0, 0), rk = ref::rope(k, pairing, 100.0, 0);
    double d31 = 0.0, d42 = 0.0;
    for (std::int64_t e = 0; e < 8; ++e) {
      d31 += rq.at(0, 3, 0, e) * rk.at(0, 1, 0, e);
      d42 += rq.at(0, 4, 0, e) * rk.at(0, 2, 0, e);
    }
    EXPECT_NEAR(d31, d42, 1e-13);
  }
  // Interleaved vs rotate-half on d_h = 4 differ in which coordinates pair up.
  Tensor64 e0({1, 2, 1, 4});
  e0.at(0, 1, 0, 0) = 1.0;  // x_0 = 1 at position 1, θ_0 = 1
  const auto rh = ref::rope(e0, ref::RopePairing::rotate_half, 10000.0, 0);
  const auto il = ref::rope(e0, ref::RopePairing::interleaved, 10000.0, 0);
  EXPECT_NEAR(rh.at(0, 1, 0, 2), std::sin(1.0), 1e-15);  // partner of x_0 is x_2
  EXPECT_NEAR(il.at(0, 1, 0, 1), std::sin(1.0), 1e-15);  // partner of x_0 is x_1
}

// Splitting the keys into two disjoint sets (non-causal, keys 0..2 and 3..6) and merging the
// partial results reproduces attention over all keys; an empty part (lse −∞) changes nothing.
TEST(Reference, MergeOfPartsEqualsWhole) {
  std::mt19937_64 rng(8);
  const std::int64_t B = 2, Tq = 3, Tk = 7, H = 2, D = 4, split = 3;
  const Tensor64 q = random64({B, Tq, H, D}, rng), k = random64({B, Tk, H, D}, rng),
                 v = random64({B, Tk, H, D}, rng);
  Tensor64 k1({B, split, H, D}), v1({B, split, H, D}), k2({B, Tk - split, H, D}),
      v2({B, Tk - split, H, D});
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t u = 0; u < Tk; ++u)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t e = 0; e < D; ++e) {
          if (u < split) {
            k1.at(b, u, h, e) = k.at(b, u, h, e);
            v1.at(b, u, h, e) = v.at(b, u, h, e);
          } else {
            k2.at(b, u - split, h, e) = k.at(b, u, h, e);
            v2.at(b, u - split, h, e) = v.at(b, u, h, e);
          }
        }
  ref::Options nc;
  nc.causal = false;
  nc.scale = 0.5;  // the default 1/sqrt(d_h) = 0.5 as well, stated explicitly for all parts
  const auto whole = ref::attention_forward(q, k, v, nc);
  const auto p1 = ref::attention_forward(q, k1, v1, nc), p2 = ref::attention_forward(q, k2, v2, nc);
  const auto m = ref::merge(p1.out, p1.lse, p2.out, p2.lse);
  EXPECT_LT(rel_err_flat(m.out.data, whole.out.data), 1e-14);
  EXPECT_LT(rel_err_flat(m.lse.data, whole.lse.data), 1e-14);
  Tensor64 empty_lse(p1.lse.shape), empty_out(p1.out.shape);
  for (double& x : empty_lse.data) x = -kInf;
  const auto same = ref::merge(p1.out, p1.lse, empty_out, empty_lse);
  EXPECT_EQ(same.out.data, p1.out.data);
  EXPECT_EQ(same.lse.data, p1.lse.data);
  const auto both_empty = ref::merge(empty_out, empty_lse, empty_out, empty_lse);
  for (double x : both_empty.lse.data) EXPECT_EQ(x, -kInf);
  for (double x : both_empty.out.data) EXPECT_EQ(x, 0.0);
}

// ---------------------------------------------------------------------------------------------
// The layer (4.1–4.5)

ref::LayerWeights random_layer(std::mt19937_64& rng, bool rope, ref::RopePairing pairing) {
  ref::LayerWeights w;
  w.d_model = 6;
  w.heads_q = 4;
  w.heads_kv = 2;
  w.head_dim = 4;
  w.use_rope = rope;
  w.pairing = pairing;
  w.rope_base = 100.0;  // a small base so that the rotation angles are large at T = 4
  std::normal_distribution<double> dist(0.0, 0.5);
  auto fill = [&](std::vector<double>& x, std::size_t n) {
    x.resize(n);
    for (double& e : x) e = dist(rng);
  };
  fill(w.w_q, 6 * 16);
  fill(w.w_k, 6 * 8);
  fill(w.w_v, 6 * 8);
  fill(w.w_o, 16 * 6);
  return w;
}

// W_Q = 0 makes all scores 0: Y_t = mean of V_0..V_t per head, so out_t = mean(U_0..U_t) W_V
// (head-wise, repeated for the group) W_O — computed here independently of attention code.
TEST(Reference, LayerWithZeroQueriesAveragesValues) {
  std::mt19937_64 rng(9);
  auto w = random_layer(rng, false, ref::RopePairing::rotate_half);
  std::fill(w.w_q.begin(), w.w_q.end(), 0.0);
  const std::int64_t B = 1, T = 3, d = 6;
  std::vector<double> u(B * T * d);
  std::normal_distribution<double> dist(0.0, 1.0);
  for (double& x : u) x = dist(rng);
  const auto out = ref::layer_forward(w, u, B, T);
  ASSERT_EQ(out.size(), u.size());
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<double> ubar(d, 0.0);  // mean of U rows 0..t
    for (std::int64_t s = 0; s <= t; ++s)
      for (std::int64_t i = 0; i < d; ++i) ubar[i] += u[s * d + i] / static_cast<double>(t + 1);
    std::vector<double> y(16, 0.0);  // Y_t: head h takes V columns of KV head h / 2
    for (std::int64_t h = 0; h < 4; ++h)
      for (std::int64_t e = 0; e < 4; ++e)
        for (std::int64_t i = 0; i < d; ++i)
          y[h * 4 + e] += ubar[i] * w.w_v[i * 8 + (h / 2) * 4 + e];
    for (std::int64_t c = 0; c < d; ++c) {
      double o = 0.0;
      for (std::int64_t r = 0; r < 16; ++r) o += y[r] * w.w_o[r * d + c];
      EXPECT_NEAR(out[t * d + c], o, 1e-13);
    }
  }
}

TEST(Reference, LayerBackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(10);
  const std::int64_t B = 2, T = 4, d = 6;
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE(variant == 0 ? "no rope" : variant == 1 ? "rope rotate-half" : "rope interleaved");
    auto w =
        random_layer(rng, variant > 0,
                     variant == 2 ? ref::RopePairing::interleaved : ref::RopePairing::rotate_half);
    if (variant == 2) w.scale = 0.4;
    std::vector<double> u(B * T * d), dout(B * T * d);
    std::normal_distribution<double> dist(0.0, 1.0);
    for (double& x : u) x = dist(rng);
    for (double& x : dout) x = dist(rng);
    auto loss = [&] {
      const auto out = ref::layer_forward(w, u, B, T);
      double l = 0.0;
      for (std::size_t i = 0; i < out.size(); ++i) l += dout[i] * out[i];
      return l;
    };
    const auto g = ref::layer_backward(w, u, B, T, dout);
    EXPECT_LT(rel_err_flat(g.d_u, central_differences(u, loss)), 1e-8);
    EXPECT_LT(rel_err_flat(g.d_w_q, central_differences(w.w_q, loss)), 1e-8);
    EXPECT_LT(rel_err_flat(g.d_w_k, central_differences(w.w_k, loss)), 1e-8);
    EXPECT_LT(rel_err_flat(g.d_w_v, central_differences(w.w_v, loss)), 1e-8);
    EXPECT_LT(rel_err_flat(g.d_w_o, central_differences(w.w_o, loss)), 1e-8);
  }
}

// ---------------------------------------------------------------------------------------------
// Score variants (SPEC "Score variants used by real models"), by hand: one query (T_q = 1) of
// width 1 with q = 1 and scale 1 against three keys, so z_u = k_u, and the query sits at
// position p = T_k − 1 = 2 (bottom-right). Each variant's expected O and L are written out
// literally from SPEC's formulas.

struct TinyCase {
  Tensor64 q{{1, 1, 1, 1}}, k{{1, 3, 1, 1}}, v{{1, 3, 1, 1}};
  double kz[3] = {0.3, -0.8, 1.1}, vz[3] = {2.0, -1.0, 0.5};
  TinyCase() {
    q.at(0, 0, 0, 0) = 1.0;
    for (int u = 0; u < 3; ++u) {
      k.at(0, u, 0, 0) = kz[u];
      v.at(0, u, 0, 0) = vz[u];
    }
  }
  // O and L of a softmax over scores S_u for the keys in `keys`, plus an optional sink logit.
  static std::pair<double, double> expect(const std::vector<std::pair<int, double>>& keys,
                                          const double* values, std::optional<double> sink) {
    double num = 0.0, den = sink ? std::exp(*sink) : 0.0;
    for (auto [u, s] : keys) {
      num += std::exp(s) * values[u];
      den += std::exp(s);
    }
    return {keys.empty() ? 0.0 : num / den, std::log(den)};
  }
  void check(const ref::Options& o, std::pair<double, double> want) const {
    ref::Options with_scale = o;
    with_scale.scale = 1.0;
    const auto r = ref::attention_forward(q, k, v, with_scale);
    EXPECT_NEAR(r.out.at(0, 0, 0, 0), want.first, 1e-14 * std::max(1.0, std::fabs(want.first)));
    if (std::isinf(want.second)) {
      EXPECT_EQ(r.lse.at(0, 0, 0, 0), want.second);
    } else {
      EXPECT_NEAR(r.lse.at(0, 0, 0, 0), want.second, 1e-14 * std::max(1.0, std::fabs(want.second)));
    }
  }
};

TEST(ReferenceVariants, HandComputedEachVariant) {
  const TinyCase c;
  const double* kz = c.kz;
  {  // plain: every key (p = 2 sees u ≤ 2)
    c.check({}, TinyCase::expect({{0, kz[0]}, {1, kz[1]}, {2, kz[2]}}, c.vz, {}));
  }
  {  // soft-capping c = 0.5: S = c·tanh(z / c)
    ref::Options o;
    o.softcap = 0.5;
    auto cap = [](double z) { return 0.5 * std::tanh(z / 0.5); };
    c.check(o, TinyCase::expect({{0, cap(kz[0])}, {1, cap(kz[1])}, {2, cap(kz[2])}}, c.vz, {}));
  }
  {  // ALiBi m = 0.25: S = z − m·(p − u)
    ref::Options o;
    o.alibi_slopes = {0.25};
    c.check(o, TinyCase::expect({{0, kz[0] - 0.5}, {1, kz[1] - 0.25}, {2, kz[2]}}, c.vz, {}));
  }
  {  // window W = 2: keys p − 2 < u, i.e. u ∈ {1, 2}
    ref::Options o;
    o.window = 2;
    c.check(o, TinyCase::expect({{1, kz[1]}, {2, kz[2]}}, c.vz, {}));
  }
  {  // sinks σ = 0.7: e^σ joins the denominator (and L), no value
    ref::Options o;
    o.sinks = {0.7};
    c.check(o, TinyCase::expect({{0, kz[0]}, {1, kz[1]}, {2, kz[2]}}, c.vz, 0.7));
  }
  {  // key length 2: u ∈ {0, 1}
    ref::Options o;
    o.key_lengths = {2};
    c.check(o, TinyCase::expect({{0, kz[0]}, {1, kz[1]}}, c.vz, {}));
  }
  {  // boolean mask [1, 0, 1]
    ref::Options o;
    o.mask_bool = {1, 0, 1};
    c.check(o, TinyCase::expect({{0, kz[0]}, {2, kz[2]}}, c.vz, {}));
  }
  {  // bias [0.5, −∞, −1]
    ref::Options o;
    o.mask_bias = {0.5, -kInf, -1.0};
    c.check(o, TinyCase::expect({{0, kz[0] + 0.5}, {2, kz[2] - 1.0}}, c.vz, {}));
  }
  {  // everything: window 2, cap 2, ALiBi 0.5, sink −0.3, bias on key 1
    ref::Options o;
    o.window = 2;
    o.softcap = 2.0;
    o.alibi_slopes = {0.5};
    o.sinks = {-0.3};
    o.mask_bias = {9.0, 0.25, 0.0};  // key 0 is outside the window: its bias is irrelevant
    auto cap = [](double z) { return 2.0 * std::tanh(z / 2.0); };
    c.check(o, TinyCase::expect({{1, cap(kz[1]) - 0.5 + 0.25}, {2, cap(kz[2])}}, c.vz, -0.3));
  }
  {  // nothing visible: O = 0, L = −∞; with a sink O = 0, L = σ
    ref::Options o;
    o.mask_bool = {0, 0, 0};
    c.check(o, {0.0, -kInf});
    o.sinks = {1.25};
    c.check(o, {0.0, 1.25});
  }
}

// Varlen is a loop of independent B = 1 problems: each sequence equals its own call, with its
// own alignment (T_q, T_k of the sequence), window and ALiBi positions.
TEST(ReferenceVariants, VarlenEqualsSeparateCalls) {
  std::mt19937_64 rng(12);
  const std::vector<std::int64_t> cu_q{0, 2, 2, 6}, cu_k{0, 3, 5, 7};
  const Tensor64 q = random64({1, 6, 2, 3}, rng), k = random64({1, 7, 1, 3}, rng),
                 v = random64({1, 7, 1, 3}, rng), dout = random64({1, 6, 2, 3}, rng);
  ref::Options o;
  o.window = 2;
  o.alibi_slopes = {0.5, 0.125};
  o.sinks = {0.1, -0.4};
  const auto all = ref::attention_forward_varlen(q, k, v, cu_q, cu_k, o);
  const auto grads = ref::attention_backward_varlen(q, k, v, dout, cu_q, cu_k, o);
  std::vector<double> dsinks(2, 0.0);
  for (std::size_t i = 0; i + 1 < cu_q.size(); ++i) {
    const std::int64_t q0 = cu_q[i], nq = cu_q[i + 1] - q0, k0 = cu_k[i], nk = cu_k[i + 1] - k0;
    Tensor64 qi({1, nq, 2, 3}), ki({1, nk, 1, 3}), vi({1, nk, 1, 3}), di({1, nq, 2, 3});
    for (std::int64_t t = 0; t < nq; ++t)
      for (std::int64_t h = 0; h < 2; ++h)
        for (std::int64_t e = 0; e < 3; ++e) {
          qi.at(0, t, h, e) = q.at(0, q0 + t, h, e);
          di.at(0, t, h, e) = dout.at(0, q0 + t, h, e);
        }
    for (std::int64_t u = 0; u < nk; ++u)
      for (std::int64_t e = 0; e < 3; ++e) {
        ki.at(0, u, 0, e) = k.at(0, k0 + u, 0, e);
        vi.at(0, u, 0, e) = v.at(0, k0 + u, 0, e);
      }
    const auto part = ref::attention_forward(qi, ki, vi, o);
    const auto pg = ref::attention_backward(qi, ki, vi, di, o);
    for (std::int64_t t = 0; t < nq; ++t)
      for (std::int64_t h = 0; h < 2; ++h) {
        EXPECT_EQ(all.lse.at(0, h, q0 + t, 0), part.lse.at(0, h, t, 0));
        for (std::int64_t e = 0; e < 3; ++e) {
          EXPECT_EQ(all.out.at(0, q0 + t, h, e), part.out.at(0, t, h, e));
          EXPECT_EQ(grads.dq.at(0, q0 + t, h, e), pg.dq.at(0, t, h, e));
        }
      }
    for (std::int64_t u = 0; u < nk; ++u)
      for (std::int64_t e = 0; e < 3; ++e) {
        EXPECT_EQ(grads.dk.at(0, k0 + u, 0, e), pg.dk.at(0, u, 0, e));
        EXPECT_EQ(grads.dv.at(0, k0 + u, 0, e), pg.dv.at(0, u, 0, e));
      }
    for (std::size_t h = 0; h < 2; ++h) dsinks[h] += pg.dsinks[h];
  }
  EXPECT_LT(rel_err_flat(grads.dsinks, dsinks), 1e-15);
}

// The oracle's backward with every variant against central differences of its own forward:
// dQ, dK, dV (soft-capping's 1 − tanh², ALiBi and bias constant in z, the window and masks
// selecting) and dσ = −Σ e^{σ − L} D.
TEST(ReferenceVariants, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(13);
  for (int variant = 0; variant < 4; ++variant) {
    SCOPED_TRACE("variant set " + std::to_string(variant));
    const std::int64_t B = 2, Tq = 4, Tk = 5, Hq = 2, Hkv = 1, D = 3;
    Tensor64 q = random64({B, Tq, Hq, D}, rng), k = random64({B, Tk, Hkv, D}, rng),
             v = random64({B, Tk, Hkv, D}, rng);
    const Tensor64 dout = random64({B, Tq, Hq, D}, rng);
    ref::Options o;
    o.sinks = {0.3, -1.1};
    if (variant == 0) o.softcap = 0.8;
    if (variant == 1) {
      o.alibi_slopes = {0.5, 0.25};
      o.window = 3;
    }
    if (variant == 2) {
      o.causal = false;
      o.key_lengths = {3, 5};
      std::bernoulli_distribution coin(0.6);
      for (std::int64_t i = 0; i < B * Hq * Tq * Tk; ++i) o.mask_bool.push_back(coin(rng));
    }
    if (variant == 3) {
      o.align = ref::Align::top_left;
      o.softcap = 3.0;
      std::normal_distribution<double> dist;
      for (std::int64_t i = 0; i < B * Hq * Tq * Tk; ++i)
        o.mask_bias.push_back(i % 7 == 3 ? -kInf : dist(rng));
    }
    auto loss = [&] { return testkit::attention_loss(q, k, v, dout, o); };
    const auto g = ref::attention_backward(q, k, v, dout, o);
    EXPECT_LT(rel_err_flat(g.dq.data, central_differences(q.data, loss)), 1e-8);
    EXPECT_LT(rel_err_flat(g.dk.data, central_differences(k.data, loss)), 1e-8);
    EXPECT_LT(rel_err_flat(g.dv.data, central_differences(v.data, loss)), 1e-8);
    EXPECT_LT(rel_err_flat(g.dsinks, central_differences(o.sinks, loss)), 1e-8);
  }
}

}  // namespace
}  // namespace tokenmix::testing
