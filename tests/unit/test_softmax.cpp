// tests/unit/test_softmax.cpp — stable softmax / log-sum-exp (SPEC 4.4) and the softmax Jacobian
// (SPEC 4.6–4.7): its properties, its agreement with finite differences of the float64 oracle, the
// matrix-free product, and the attention backward pass as "J applied row by row".
//
// Error bounds are stated in units of the fp32 unit roundoff u = 2^-24 ≈ 6e-8. For a sum of n
// non-negative terms the worst-case relative rounding error is γ_n ≈ n·u; exp/log add a few ulp.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "test_util.hpp"

namespace tokenmix::testing {
namespace {

constexpr double kU = 0x1p-24;  // fp32 unit roundoff
constexpr float kInf = std::numeric_limits<float>::infinity();

std::vector<double> to_double(const std::vector<float>& x) {
  return {x.begin(), x.end()};
}

std::vector<float> softmax_of(const std::vector<float>& z) {
  std::vector<float> a(z.size(), kPoison);
  softmax_rows(z, a, 1, static_cast<std::int64_t>(z.size()));
  return a;
}

// Worst-case bound for softmax of a row of n entries, relative to max|a| (see rel_err in
// test_util.hpp): exp (≈2u per entry), the sum γ_n, the division u, with a factor 2 margin.
double softmax_bound(std::size_t n) {
  return 2.0 * (static_cast<double>(n) + 8.0) * kU;
}

TEST(Softmax, StableForHugeInputs) {
  // exp(1e4) overflows float and double; a correct implementation subtracts the max first (4.4).
  const std::vector<std::vector<float>> rows = {
      {1e4f, 1e4f - 0.5f, 1e4f - 3.0f, -1e4f, 0.0f},
      {-1e4f, -1e4f - 1.0f, -1e4f - 2.0f},
      {3e38f, 3e38f, -3e38f},  // z − max overflows to −∞ for the last entry: still exactly 0
  };
  for (const auto& z : rows) {
    SCOPED_TRACE(::testing::Message() << "row starting " << z[0]);
    const auto a = softmax_of(z);
    const auto ref = reference::softmax(to_double(z));
    double sum = 0.0;
    for (float x : a) {
      ASSERT_TRUE(std::isfinite(x));
      sum += x;
    }
    EXPECT_LE(rel_err_flat(a, ref), softmax_bound(z.size()));
    EXPECT_NEAR(sum, 1.0, (z.size() + 4) * kU);
    // L is as large as the inputs; its fp32 rounding is |L|·u, plus log of the sum (γ_n).
    const double lse = logsumexp(z), lse_ref = reference::logsumexp(to_double(z));
    ASSERT_TRUE(std::isfinite(lse));
    EXPECT_NEAR(lse, lse_ref, 2.0 * kU * std::fabs(lse_ref) + (z.size() + 4) * kU);
  }
  // The third row is exact: exp(0)/2 = 0.5 twice, exp(−∞) = 0.
  const auto a = softmax_of({3e38f, 3e38f, -3e38f});
  EXPECT_EQ(a[0], 0.5f);
  EXPECT_EQ(a[1], 0.5f);
  EXPECT_EQ(a[2], 0.0f);
}

TEST(Softmax, MaskedEntriesGetZeroProbability) {
  const std::vector<float> z = {0.3f, -kInf, 1.7f, -kInf, -2.0f, 0.0f, -kInf};
  const auto a = softmax_of(z);
  const auto ref = reference::softmax(to_double(z));
  for (std::size_t i = 0; i < z.size(); ++i) {
    if (std::isinf(z[i])) {
      EXPECT_EQ(a[i], 0.0f) << i;  // exactly zero, not tiny
    }
  }
  EXPECT_LE(rel_err_flat(a, ref), softmax_bound(z.size()));
  // Masked entries do not count: L equals the log-sum-exp of the visible entries only.
  const std::vector<double> visible = {0.3f, 1.7f, -2.0f, 0.0f};
  EXPECT_NEAR(logsumexp(z), reference::logsumexp(visible), 16 * kU);
  EXPECT_NEAR(reference::logsumexp(to_double(z)), reference::logsumexp(visible), 1e-15);
}

TEST(Softmax, FullyMaskedRowGivesZerosAndMinusInfinity) {
  // SPEC 4.3: a row that sees no key gives probabilities 0 and L = −∞ — never NaN.
  const std::vector<float> z(5, -kInf);
  const auto a = softmax_of(z);
  for (float x : a) EXPECT_EQ(x, 0.0f);
  const float l = logsumexp(z);
  EXPECT_TRUE(std::isinf(l) && l < 0) << l;
  // Mixed with ordinary rows in one call, and in place (a may equal z).
  std::vector<float> zz = {1.0f, 2.0f, 3.0f, -kInf, -kInf, -kInf, -kInf, 0.0f, -kInf};
  softmax_rows(zz, zz, 3, 3);
  for (int i = 3; i < 6; ++i) EXPECT_EQ(zz[i], 0.0f);
  EXPECT_EQ(zz[7], 1.0f);  // a single visible entry has probability exactly 1
  EXPECT_EQ(zz[6], 0.0f);
  EXPECT_EQ(zz[8], 0.0f);
  for (float x : zz) EXPECT_FALSE(std::isnan(x));
}

TEST(Softmax, RowsAndLogSumExpMatchReference) {
  std::mt19937_64 rng(11);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  for (std::int64_t n : {1, 2, 17, 1000}) {
    SCOPED_TRACE(::testing::Message() << "n = " << n);
    const std::int64_t rows = 4;
    std::vector<float> z(static_cast<std::size_t>(rows * n));
    for (auto& x : z) x = dist(rng) + 20.0f;  // offset: L is not near 0
    std::vector<float> a(z.size(), kPoison);
    softmax_rows(z, a, rows, n);
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::vector<float> zr(z.begin() + r * n, z.begin() + (r + 1) * n);
      const std::vector<float> ar(a.begin() + r * n, a.begin() + (r + 1) * n);
      EXPECT_LE(rel_err_flat(ar, reference::softmax(to_double(zr))), softmax_bound(zr.size()));
      const double lr = reference::logsumexp(to_double(zr));
      // |L| ≈ 20 rounds with |L|·u; the log of the sum has absolute error ≤ γ_n + a few u.
      EXPECT_NEAR(logsumexp(zr), lr, 2.0 * kU * std::fabs(lr) + (n + 8) * kU);
    }
    // In place (a may equal z) gives bitwise the same rows.
    std::vector<float> in_place = z;
    softmax_rows(in_place, in_place, rows, n);
    EXPECT_EQ(std::memcmp(in_place.data(), a.data(), a.size() * sizeof(float)), 0);
  }
}

// A spread-out probability row (no entry near 1, so J is not tiny relative to a).
std::vector<float> random_probabilities(std::mt19937_64& rng, std::size_t n) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> z(n);
  for (auto& x : z) x = dist(rng);
  return softmax_of(z);
}

std::vector<float> jacobian_of(const std::vector<float>& a) {
  std::vector<float> j(a.size() * a.size(), kPoison);
  softmax_jacobian(a, j);
  return j;
}

TEST(SoftmaxJacobian, MatchesDefinitionAndIsSymmetric) {
  std::mt19937_64 rng(12);
  const std::size_t n = 9;
  const auto a = random_probabilities(rng, n);
  const auto j = jacobian_of(a);
  const auto jr = reference::softmax_jacobian(to_double(a));  // same a, in double
  const double amax = *std::max_element(a.begin(), a.end());
  for (std::size_t r = 0; r < n; ++r) {
    for (std::size_t c = 0; c < n; ++c) {
      // (4.7) J_rc = a_r(δ_rc − a_c): one product and at most one subtraction, ≤ 3u·a_r.
      EXPECT_NEAR(j[r * n + c], jr[r * n + c], 3.0 * kU * amax) << r << "," << c;
      // (4.6) J = diag(a) − a aᵀ is symmetric (a_r a_c = a_c a_r in any rounding).
      EXPECT_NEAR(j[r * n + c], j[c * n + r], 2.0 * kU * amax) << r << "," << c;
    }
  }
}

TEST(SoftmaxJacobian, AnnihilatesOnesAndIsPositiveSemidefinite) {
  std::mt19937_64 rng(13);
  std::normal_distribution<double> dist(0.0, 1.0);
  for (std::size_t n : {2u, 9u, 64u}) {
    SCOPED_TRACE(::testing::Message() << "n = " << n);
    const auto a = random_probabilities(rng, n);
    const auto j = jacobian_of(a);
    double asum = 0.0, amax = 0.0;
    for (float x : a) asum += x, amax = std::max<double>(amax, x);
    // J·1 = 0 (shift invariance): with exact arithmetic on the stored a, row r sums to
    // a_r(1 − Σa); each of the n stored entries adds ≤ 3u·amax of rounding (see above).
    for (std::size_t r = 0; r < n; ++r) {
      double s = 0.0;
      for (std::size_t c = 0; c < n; ++c) s += j[r * n + c];
      EXPECT_NEAR(s, 0.0, std::fabs(1.0 - asum) * a[r] + 3.0 * n * kU * amax) << r;
    }
    // vᵀJv = Var_a(v) ≥ 0. Computed in double from the fp32 J, the rounding of J contributes at
    // most 3u·amax·(Σ|v|)², so vᵀJv ≥ −that and it equals the variance within that.
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<double> v(n);
      for (auto& x : v) x = dist(rng);
      if (trial == 0) std::fill(v.begin(), v.end(), 1.0);  // the null direction: vᵀJv = 0
      double quad = 0.0, mean = 0.0, var = 0.0, l1 = 0.0;
      for (std::size_t r = 0; r < n; ++r) {
        l1 += std::fabs(v[r]);
        mean += a[r] * v[r];
        for (std::size_t c = 0; c < n; ++c) quad += v[r] * j[r * n + c] * v[c];
      }
      for (std::size_t r = 0; r < n; ++r) var += a[r] * (v[r] - mean) * (v[r] - mean);
      const double tol = 3.0 * kU * amax * l1 * l1 + std::fabs(1.0 - asum) * l1 * l1;
      EXPECT_GE(quad, -tol) << trial;
      EXPECT_NEAR(quad, var, tol) << trial;
    }
  }
}

TEST(SoftmaxJacobian, EqualsFiniteDifferenceJacobian) {
  // Central differences in float64 on the oracle's softmax: truncation O(h²) ≈ 1e-10 and
  // cancellation ≈ 1e-16/h ≈ 1e-11 for h = 1e-5, far below the fp32 bounds.
  std::mt19937_64 rng(14);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  const std::size_t n = 9;
  std::vector<float> z(n);
  for (auto& x : z) x = dist(rng);
  const auto z64 = to_double(z);
  const double h = 1e-5;
  std::vector<double> fd(n * n);
  for (std::size_t c = 0; c < n; ++c) {
    auto zp = z64, zm = z64;
    zp[c] += h;
    zm[c] -= h;
    const auto ap = reference::softmax(zp), am = reference::softmax(zm);
    for (std::size_t r = 0; r < n; ++r) fd[r * n + c] = (ap[r] - am[r]) / (2 * h);
  }
  // The oracle's J (4.6) agrees with its own finite differences.
  const auto jr = reference::softmax_jacobian(reference::softmax(z64));
  for (std::size_t i = 0; i < n * n; ++i) EXPECT_NEAR(jr[i], fd[i], 1e-9) << i;
  // Our fp32 J from our fp32 a: each a_r carries relative error ≤ softmax_bound(n)/2 (≈(n+8)u),
  // J_rc = a_r(δ − a_c) doubles it, plus 3u for forming J: |ΔJ| ≤ (2(n+8)+3)u·amax; ×2 margin.
  const auto a = softmax_of(z);
  const auto j = jacobian_of(a);
  const double amax = *std::max_element(a.begin(), a.end());
  for (std::size_t i = 0; i < n * n; ++i) {
    EXPECT_NEAR(j[i], fd[i], 2.0 * (2.0 * (n + 8) + 3.0) * kU * amax) << i;
    EXPECT_NEAR(j[i], jr[i], 2.0 * (2.0 * (n + 8) + 3.0) * kU * amax) << i;
  }
}

TEST(SoftmaxJacobian, MatrixFreeProductEqualsExplicitProduct) {
  // (4.7) J g = a ⊙ (g − ⟨a, g⟩). Against Σ_c J_rc g_c (double, from our fp32 J): the dot ⟨a,g⟩
  // has error ≤ (n+1)u·max|g| (Σa ≈ 1), the explicit sum ≤ 3n u·amax·max|g| from J's rounding;
  // together ≤ 4(n+2)u·amax·max|g|. A common offset c in g exercises cancellation: J(g + c1) = Jg.
  std::mt19937_64 rng(15);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (std::size_t n : {1u, 7u, 33u, 200u}) {
    for (float offset : {0.0f, 100.0f}) {
      SCOPED_TRACE(::testing::Message() << "n = " << n << ", offset = " << offset);
      const auto a = random_probabilities(rng, n);
      const auto j = jacobian_of(a);
      std::vector<float> g(n);
      for (auto& x : g) x = dist(rng) + offset;
      std::vector<float> out(n, kPoison);
      softmax_jacobian_vector_product(a, g, out);
      double amax = 0.0, gmax = 0.0;
      for (std::size_t i = 0; i < n; ++i) {
        amax = std::max<double>(amax, a[i]);
        gmax = std::max<double>(gmax, std::fabs(g[i]));
      }
      const double tol = 4.0 * (n + 2) * kU * amax * gmax;
      for (std::size_t r = 0; r < n; ++r) {
        double explicit_jg = 0.0;
        for (std::size_t c = 0; c < n; ++c) explicit_jg += static_cast<double>(j[r * n + c]) * g[c];
        EXPECT_NEAR(out[r], explicit_jg, tol) << r;
      }
      // out may equal g: same result bit for bit.
      std::vector<float> in_place = g;
      softmax_jacobian_vector_product(a, in_place, in_place);
      EXPECT_EQ(std::memcmp(in_place.data(), out.data(), n * sizeof(float)), 0);
    }
  }
}

TEST(SoftmaxJacobian, AttentionBackwardIsJacobianAppliedRowByRow) {
  // With d_h = T, K = I and V = I (rows k_u = v_u = e_u), attention reduces to a bare softmax:
  // S_t = s·q_t (4.2), O_t = a_t = softmax(S_t + M_t) (4.4–4.5), dA = dO Vᵀ = dO, and the
  // backward pass gives dq_t = s · dS_t K = s · J(a_t) dO_t — the Jacobian of (4.6) applied row by
  // row, with masked entries (u > t) carrying exactly zero gradient.
  const std::int64_t T = 8;
  const double s = 0.5;
  std::mt19937_64 rng(16);
  StridedTensor q(1, T, 1, T, Layout::bthd), k(1, T, 1, T, Layout::bthd),
      v(1, T, 1, T, Layout::bthd);
  StridedTensor out(1, T, 1, T, Layout::bthd), dout(1, T, 1, T, Layout::bthd);
  StridedTensor dq(1, T, 1, T, Layout::bthd), dk(1, T, 1, T, Layout::bthd),
      dv(1, T, 1, T, Layout::bthd);
  q.fill_random(rng, 2.0);
  dout.fill_random(rng);
  for (std::int64_t u = 0; u < T; ++u)
    for (std::int64_t d = 0; d < T; ++d)
      k.at(0, u, 0, d) = v.at(0, u, 0, d) = (u == d) ? 1.0f : 0.0f;
  std::vector<float> lse(T, kPoison);
  AttentionOptions opt;
  opt.scale = s;
  attention_forward(q.view, k.view, v.view, out.view, TensorView::bht(lse.data(), 1, 1, T), opt);
  attention_backward(q.view, k.view, v.view, out.view, TensorView::bht(lse.data(), 1, 1, T),
                     dout.view, dq.view, dk.view, dv.view, opt);
  for (std::int64_t t = 0; t < T; ++t) {
    SCOPED_TRACE(::testing::Message() << "row t = " << t);
    std::vector<float> z(T);
    for (std::int64_t u = 0; u < T; ++u)
      z[u] = u <= t ? static_cast<float>(s * q.at(0, t, 0, u)) : -kInf;  // (4.3) mask
    std::vector<float> a(T, kPoison);
    softmax_rows(z, a, 1, T);
    const auto j = jacobian_of(a);
    std::vector<float> g(T);
    double gmax = 0.0;
    for (std::int64_t u = 0; u < T; ++u) {
      g[u] = dout.at(0, t, 0, u);
      gmax = std::max(gmax, std::fabs(static_cast<double>(g[u])));
    }
    std::vector<float> jg(T, kPoison);
    softmax_jacobian_vector_product(a, g, jg);
    // O = A exactly as softmax_rows gives it, up to the kernel's own rounding (≈(T+8)u).
    for (std::int64_t u = 0; u < T; ++u)
      EXPECT_NEAR(out.at(0, t, 0, u), a[u], 2 * softmax_bound(T));
    // Explicit J·g (double) vs the kernel: the kernel's softmax rounding (≈(T+8)u relative on a),
    // propagated through J (×2) and the product (≤ (T+2)u), all times max|g|; ×2 margin.
    const double tol = 2.0 * (2.0 * (T + 8) + (T + 2)) * kU * gmax * s;
    for (std::int64_t u = 0; u < T; ++u) {
      double explicit_jg = 0.0;
      for (std::int64_t c = 0; c < T; ++c) explicit_jg += static_cast<double>(j[u * T + c]) * g[c];
      EXPECT_NEAR(dq.at(0, t, 0, u), s * explicit_jg, tol) << u;
      EXPECT_NEAR(dq.at(0, t, 0, u), s * jg[u], tol) << u;
      if (u > t) {
        EXPECT_EQ(dq.at(0, t, 0, u), 0.0f) << "masked entry " << u;
      }
    }
  }
}

}  // namespace
}  // namespace tokenmix::testing
