// tests/unit/test_rope.cpp — rotary position embedding (SPEC 4.1 "RoPE"): forward and backward vs
// the float64 oracle for both pairings, bases, position offsets and layouts; the relative-position
// property ⟨R_m q, R_n k⟩ = f(m − n); norm preservation; backward = inverse; and a float64 central
// finite-difference check of the gradient.
//
// Bound (used throughout, u = 2^-24): each output coordinate is x cos φ − y sin φ with cos/sin
// rounded to fp32 (u each, if φ is reduced accurately) and two products plus one sum (3u), so its
// error is ≤ 5u·(|x| + |y|) ≤ 10u·max|x|. rel_err (max-norm, test_util.hpp) ≤ 2e-6 ≈ 33u leaves a
// factor ~3 margin; an implementation that forms φ = p·θ_i in fp32 fails it once p ≳ 100.
#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "test_util.hpp"

namespace tokenmix::testing {
namespace {

constexpr double kU = 0x1p-24;
constexpr double kRopeBound = 2e-6;
constexpr float kSentinel = 12345.0f;  // padding marker: a strided write into padding changes it

reference::RopePairing ref_pairing(RopePairing p) {
  return p == RopePairing::rotate_half ? reference::RopePairing::rotate_half
                                       : reference::RopePairing::interleaved;
}
const char* pairing_name(RopePairing p) {
  return p == RopePairing::rotate_half ? "rotate_half" : "interleaved";
}

// A random tensor whose padding (strided layout) holds kSentinel instead of NaN.
StridedTensor make_tensor(std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t D, Layout l,
                          std::mt19937_64& rng) {
  StridedTensor x(B, T, H, D, l);
  std::fill(x.storage.begin(), x.storage.end(), kSentinel);
  x.fill_random(rng);
  return x;
}

std::size_t count_sentinels(const StridedTensor& x) {
  return static_cast<std::size_t>(std::count(x.storage.begin(), x.storage.end(), kSentinel));
}

TEST(Rope, ForwardAndBackwardMatchReference) {
  std::mt19937_64 rng(21);
  const std::int64_t B = 2, T = 5, H = 3, D = 16;
  for (RopePairing pairing : {RopePairing::rotate_half, RopePairing::interleaved}) {
    for (double base : {10000.0, 500000.0}) {
      for (std::int64_t offset : {0, 3, 1021}) {
        for (Layout layout : {Layout::bthd, Layout::bhtd, Layout::strided}) {
          SCOPED_TRACE(::testing::Message() << pairing_name(pairing) << " base=" << base
                                            << " offset=" << offset << " " << layout_name(layout));
          const RopeOptions opt{pairing, base, offset};
          auto x = make_tensor(B, T, H, D, layout, rng);
          const std::size_t padding = count_sentinels(x);
          const Tensor64 x64 = x.to64();
          rope_forward(x.view, opt);
          EXPECT_LE(rel_err(x, reference::rope(x64, ref_pairing(pairing), base, offset)),
                    kRopeBound);
          EXPECT_EQ(count_sentinels(x), padding) << "rope_forward wrote outside the view";

          auto g = make_tensor(B, T, H, D, layout, rng);
          const Tensor64 g64 = g.to64();
          rope_backward(g.view, opt);
          EXPECT_LE(rel_err(g, reference::rope(g64, ref_pairing(pairing), base, offset, true)),
                    kRopeBound);
          EXPECT_EQ(count_sentinels(g), padding) << "rope_backward wrote outside the view";
        }
      }
    }
  }
}

TEST(Rope, LongContextPositionsStayAccurate) {
  // Llama-3.1 contexts reach 131072 tokens: φ = p·θ_0 ≈ 1.3e5 rad. The same per-coordinate bound
  // holds only if φ is formed and reduced in double (an fp32 φ has error ≈ p·u ≈ 8e-3 rad).
  std::mt19937_64 rng(22);
  for (RopePairing pairing : {RopePairing::rotate_half, RopePairing::interleaved}) {
    SCOPED_TRACE(pairing_name(pairing));
    const RopeOptions opt{pairing, 500000.0, 131072 - 4};
    auto x = make_tensor(1, 8, 2, 128, Layout::bthd, rng);
    const Tensor64 x64 = x.to64();
    rope_forward(x.view, opt);
    EXPECT_LE(rel_err(x, reference::rope(x64, ref_pairing(pairing), opt.base, opt.position_offset)),
              kRopeBound);
  }
}

double dot(StridedTensor& x, std::int64_t t, std::int64_t h, StridedTensor& y, std::int64_t t2,
           std::int64_t h2) {
  double s = 0.0;
  for (std::int64_t d = 0; d < x.view.shape[3]; ++d)
    s += double{x.at(0, t, h, d)} * y.at(0, t2, h2, d);
  return s;
}

TEST(Rope, ScoresDependOnlyOnRelativePosition) {
  // ⟨R_m q, R_n k⟩ = ⟨q, R_{n−m} k⟩ depends only on m − n (SPEC 4.1). Head 0 holds the same q at
  // every position, head 1 the same k; the score matrix G[t][t'] = ⟨R_t q, R_t' k⟩ must be
  // Toeplitz, and shifting both positions by an offset must not change it. Each rotated vector has
  // norm-wise error ≤ ~10u, so two scores differ by ≤ 2·2·10u·|q||k| ≈ 2.4e-6·|q||k|.
  std::mt19937_64 rng(23);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  const std::int64_t T = 12, D = 32;
  for (RopePairing pairing : {RopePairing::rotate_half, RopePairing::interleaved}) {
    std::vector<float> qv(D), kv(D);
    double qn = 0.0, kn = 0.0;
    for (std::int64_t d = 0; d < D; ++d) {
      qv[d] = dist(rng), kv[d] = dist(rng);
      qn += double{qv[d]} * qv[d], kn += double{kv[d]} * kv[d];
    }
    const double tol = 40.0 * kU * std::sqrt(qn * kn);
    std::vector<std::vector<double>> g0;
    for (std::int64_t offset : {0, 1000}) {
      SCOPED_TRACE(::testing::Message() << pairing_name(pairing) << " offset=" << offset);
      StridedTensor x(1, T, 2, D, Layout::bthd);
      for (std::int64_t t = 0; t < T; ++t)
        for (std::int64_t d = 0; d < D; ++d) x.at(0, t, 0, d) = qv[d], x.at(0, t, 1, d) = kv[d];
      rope_forward(x.view, RopeOptions{pairing, 10000.0, offset});
      std::vector<std::vector<double>> g(T, std::vector<double>(T));
      for (std::int64_t t = 0; t < T; ++t)
        for (std::int64_t t2 = 0; t2 < T; ++t2) g[t][t2] = dot(x, t, 0, x, t2, 1);
      for (std::int64_t t = 0; t + 1 < T; ++t)
        for (std::int64_t t2 = 0; t2 + 1 < T; ++t2) EXPECT_NEAR(g[t + 1][t2 + 1], g[t][t2], tol);
      if (g0.empty()) {
        g0 = g;
        // At m = n the rotations cancel: ⟨R_t q, R_t k⟩ = ⟨q, k⟩.
        double qk = 0.0;
        for (std::int64_t d = 0; d < D; ++d) qk += double{qv[d]} * kv[d];
        EXPECT_NEAR(g[0][0], qk, tol);
        // And the scores really vary with m − n (the rotation is not the identity).
        EXPECT_GT(std::fabs(g[0][5] - g[0][0]), 100 * tol);
      } else {
        for (std::int64_t t = 0; t < T; ++t)
          for (std::int64_t t2 = 0; t2 < T; ++t2) EXPECT_NEAR(g[t][t2], g0[t][t2], tol);
      }
    }
  }
}

TEST(Rope, PreservesNormsAndBackwardInvertsForward) {
  std::mt19937_64 rng(24);
  const std::int64_t B = 2, T = 7, H = 2, D = 64;
  for (RopePairing pairing : {RopePairing::rotate_half, RopePairing::interleaved}) {
    for (Layout layout : {Layout::bthd, Layout::bhtd, Layout::strided}) {
      SCOPED_TRACE(::testing::Message() << pairing_name(pairing) << " " << layout_name(layout));
      const RopeOptions opt{pairing, 500000.0, 17};
      auto x = make_tensor(B, T, H, D, layout, rng);
      const Tensor64 x64 = x.to64();
      rope_forward(x.view, opt);
      // Rotations are orthogonal: ‖R x‖ = ‖x‖ per (b, t, h) vector, to ≤ 10u relative (see top).
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t t = 0; t < T; ++t)
          for (std::int64_t h = 0; h < H; ++h) {
            double n0 = 0.0, n1 = 0.0;
            for (std::int64_t d = 0; d < D; ++d) {
              n0 += x64.at(b, t, h, d) * x64.at(b, t, h, d);
              n1 += double{x.at(b, t, h, d)} * x.at(b, t, h, d);
            }
            EXPECT_NEAR(std::sqrt(n1), std::sqrt(n0), 10 * kU * std::sqrt(n0));
          }
      // backward applies the inverse rotation: backward(forward(x)) = x, two roundings of ≤ 10u.
      rope_backward(x.view, opt);
      EXPECT_LE(rel_err(x, x64), 2 * kRopeBound);
    }
  }
}

TEST(Rope, BackwardIsGradientOfRotation) {
  // f(x) = ⟨g, R x⟩ has ∇f = Rᵀ g, which rope_backward must compute. Central differences in
  // float64 on the oracle: f is linear, so the only FD error is cancellation, ≈ 1e-16·|f|/h.
  std::mt19937_64 rng(25);
  const std::int64_t B = 1, T = 3, H = 2, D = 8, offset = 7;
  const double h = 1e-3;
  for (RopePairing pairing : {RopePairing::rotate_half, RopePairing::interleaved}) {
    SCOPED_TRACE(pairing_name(pairing));
    auto x = make_tensor(B, T, H, D, Layout::bthd, rng);
    auto g = make_tensor(B, T, H, D, Layout::bthd, rng);
    const Tensor64 x64 = x.to64(), g64 = g.to64();
    auto f = [&](const Tensor64& xx) {
      const Tensor64 y = reference::rope(xx, ref_pairing(pairing), 10000.0, offset);
      double s = 0.0;
      for (std::size_t i = 0; i < y.data.size(); ++i) s += g64.data[i] * y.data[i];
      return s;
    };
    Tensor64 grad_fd(x64.shape);
    for (std::size_t i = 0; i < x64.data.size(); ++i) {
      Tensor64 xp = x64, xm = x64;
      xp.data[i] += h;
      xm.data[i] -= h;
      grad_fd.data[i] = (f(xp) - f(xm)) / (2 * h);
    }
    // The oracle's inverse rotation is the gradient ...
    const Tensor64 inv = reference::rope(g64, ref_pairing(pairing), 10000.0, offset, true);
    for (std::size_t i = 0; i < inv.data.size(); ++i)
      EXPECT_NEAR(inv.data[i], grad_fd.data[i], 1e-9);
    // ... and so is ours, within the fp32 rotation bound.
    rope_backward(g.view, RopeOptions{pairing, 10000.0, offset});
    EXPECT_LE(rel_err(g, grad_fd), kRopeBound);
  }
}

}  // namespace
}  // namespace tokenmix::testing
