// tools/testkit/testkit.hpp — the one testing toolkit of tokenmix, used by the unit tests
// (tests/unit/test_util.hpp builds its gtest helpers on it), `tokenmix check` and the
// benchmarks (`tokenmix bench`, benchmarks/):
//   - the error metric of every bound (ErrorAccumulator, rel_err),
//   - the attention case table (AttentionShape, AttentionCase: shape, tolerance, useful FLOPs),
//   - copies of float tensors (slices) into the float64 oracle's Tensor64, seeded inputs,
//   - why a kernel path cannot run on this machine (isa_unavailable_reason).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "reference/reference.hpp"
#include "tokenmix/tokenmix.hpp"

namespace tokenmix::testkit {

// --- the error metric ----------------------------------------------------------------------------

/// The error metric of every test, check and benchmark: for a result x and its reference r,
///   rel_err(x, r) = max_i |x_i − r_i| / max(max_i |r_i|, floor)
/// (the max-norm error relative to the max-norm of the reference; floor = 1e-30 unless a caller
/// judges a quantity that may vanish, e.g. a gradient, against its natural size). It is
/// insensitive to individual tiny reference entries, where an element-wise relative error means
/// nothing. Conventions: equal values (equal infinities included, e.g. the −∞ log-sum-exp of a
/// row with no visible key) are exact; a NaN on either side, or an infinity against a different
/// value, is an infinite error; only finite reference entries count towards max|r|; an error of
/// exactly 0 is 0 whatever the reference (0/0 counts as 0).
struct ErrorAccumulator {
  double max_diff = 0.0;
  double max_ref = 0.0;
  void add(double x, double r) {
    const double diff = x == r                           ? 0.0
                        : std::isnan(x) || std::isnan(r) ? std::numeric_limits<double>::infinity()
                                                         : std::fabs(x - r);
    if (diff > max_diff) max_diff = diff;
    if (std::isfinite(r) && std::fabs(r) > max_ref) max_ref = std::fabs(r);
  }
  double value(double floor = kDefaultFloor) const {
    return max_diff == 0.0 ? 0.0 : max_diff / std::max(max_ref, floor);
  }
  static constexpr double kDefaultFloor = 1e-30;
};

/// rel_err over two indexable sequences of the same length (a length mismatch is an infinite
/// error): std::vector, std::span, Tensor64::data, ...
template <class X, class R>
double rel_err(const X& x, const R& r, double floor = ErrorAccumulator::kDefaultFloor) {
  if (std::size(x) != std::size(r)) return std::numeric_limits<double>::infinity();
  ErrorAccumulator acc;
  for (std::size_t i = 0; i < std::size(r); ++i) {
    acc.add(static_cast<double>(x[i]), static_cast<double>(r[i]));
  }
  return acc.value(floor);
}

// --- the case table ------------------------------------------------------------------------------

/// The shape of one attention problem: q [B, T_q, H_q, d_h], k and v [B, T_k, H_kv, d_h].
struct AttentionShape {
  std::int64_t B = 1, T_q = 1, T_k = 1, H_q = 1, H_kv = 1, d_h = 1;
  bool causal = true;
  CausalAlign align = CausalAlign::bottom_right;

  /// Useful work (SPEC "Useful-work counts"): 4·d_h·H_q·P·B forward, 2.5× that backward.
  double forward_flops() const {
    return tokenmix::forward_flops(B, T_q, T_k, H_q, d_h, causal, align);
  }
  double backward_flops() const {
    return tokenmix::backward_flops(B, T_q, T_k, H_q, d_h, causal, align);
  }
  /// "bottom-right" / "top-left", as the CLI and the bench's JSON spell it.
  const char* align_name() const {
    return align == CausalAlign::bottom_right ? "bottom-right" : "top-left";
  }
};

/// Bounds on rel_err of float32 results against the float64 oracle.
struct Tolerance {
  double forward = 2e-5;   ///< O and L
  double backward = 2e-4;  ///< dQ, dK, dV
};

/// One row of a case table: a named shape with its options and tolerance.
struct AttentionCase {
  std::string name;
  AttentionShape shape;
  std::optional<double> scale;  ///< s in (4.2); empty: 1/√d_h
  bool sdpa_layout = false;     ///< memory [B, H, T, d_h] instead of [B, T, H, d_h]
  Tolerance tolerance{};

  /// The library options of this case (causal, align, scale) on kernel path `isa`.
  AttentionOptions options(Isa isa = Isa::automatic, int threads = 0) const;
  /// The oracle's options for the same problem.
  reference::Options reference_options() const;
};

reference::Align to_reference(CausalAlign align);

// --- tensors for the oracle ----------------------------------------------------------------------

/// Rows [t0, t0 + nt) of heads [h0, h0 + nh) of a contiguous [B, T, H, D] float tensor, every
/// batch, as a Tensor64 [B, nt, nh, D] (nt < 0: to the end). B = 1 takes batch 0 of a larger one.
reference::Tensor64 slice64(std::span<const float> x, std::int64_t B, std::int64_t T,
                            std::int64_t H, std::int64_t D, std::int64_t t0 = 0,
                            std::int64_t nt = -1, std::int64_t h0 = 0, std::int64_t nh = -1);

/// Central differences (loss(x + h·e_i) − loss(x − h·e_i)) / 2h at every entry i of x, which is
/// perturbed in place and restored: the float64 derivative the gradient checks compare with.
/// With h = 1e-5 in double the error is ≲ 1e-9 relative (truncation h², rounding u/h).
std::vector<double> central_differences(std::vector<double>& x, const std::function<double()>& loss,
                                        double h = 1e-5);
reference::Tensor64 central_differences(reference::Tensor64& x, const std::function<double()>& loss,
                                        double h = 1e-5);

/// Σ dout ⊙ out of the oracle's forward: the loss whose gradient attention_backward computes
/// (∂loss/∂out = dout).
double attention_loss(const reference::Tensor64& q, const reference::Tensor64& k,
                      const reference::Tensor64& v, const reference::Tensor64& dout,
                      const reference::Options& options);

/// Seeded N(0, sigma) values.
std::vector<float> random_normal(std::size_t n, std::uint64_t seed, double sigma = 1.0);

// --- kernel paths --------------------------------------------------------------------------------

/// The concrete kernel paths, lowest first: portable, avx2, avx512.
const std::vector<Isa>& concrete_isas();

/// Empty if `isa` runs here; otherwise why not, naming the CPU: "this CPU/OS does not support
/// avx512 (CPU: …)" or "this build has no avx512 kernels, although the CPU (…) supports them".
std::string isa_unavailable_reason(Isa isa);

}  // namespace tokenmix::testkit
