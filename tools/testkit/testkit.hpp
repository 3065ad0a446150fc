// tools/testkit/testkit.hpp — the one testing toolkit of tokenmix, used by the unit tests
// (tests/unit/test_util.hpp builds its gtest helpers on it), `tokenmix check` and the
// benchmarks (`tokenmix bench`, benchmarks/):
//   - the error metric of every bound (ErrorAccumulator, rel_err),
//   - the attention case table (AttentionShape, AttentionCase: shape, tolerance, useful FLOPs),
//   - strided test tensors (StridedTensor: three layouts, poisoned padding and outputs),
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
#include <random>
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

// --- test tensors --------------------------------------------------------------------------------

/// Value written to outputs before a call: any element the call fails to write stays NaN and
/// fails every comparison.
inline constexpr float kPoison = std::numeric_limits<float>::quiet_NaN();

/// Memory layout of a test tensor with logical shape [B, T, H, D].
enum class Layout {
  bthd,     ///< contiguous [B, T, H, D]
  bhtd,     ///< memory [B, H, T, D] (PyTorch SDPA layout)
  strided,  ///< [B, T, H, D] with padding: every stride larger than dense (non-contiguous)
};
inline const char* layout_name(Layout l) {
  return l == Layout::bthd ? "bthd" : l == Layout::bhtd ? "bhtd" : "strided";
}

/// An owned float buffer plus a strided view of logical shape [B, T, H, D] into it.
struct StridedTensor {
  std::vector<float> storage;
  TensorView view;

  StridedTensor(std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t D, Layout layout) {
    std::array<std::int64_t, 4> strides{};
    std::int64_t total = 0;
    if (layout == Layout::bthd) {
      strides = {T * H * D, H * D, D, 1};
      total = B * T * H * D;
    } else if (layout == Layout::bhtd) {
      strides = {H * T * D, D, T * D, 1};
      total = B * H * T * D;
    } else {  // pad D by 3, H by 1, T by 2 (unit inner stride kept, as real views have)
      const std::int64_t sd = 1, sh = D + 3, st = (H + 1) * sh, sb = (T + 2) * st;
      strides = {sb, st, sh, sd};
      total = B * sb;
    }
    storage.assign(static_cast<std::size_t>(std::max<std::int64_t>(total, 1)), kPoison);
    view = TensorView{storage.data(), DType::f32, 4, {B, T, H, D}, strides};
  }

  float& at(std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t d) {
    auto* p = static_cast<float*>(view.data);
    return p[b * view.strides[0] + t * view.strides[1] + h * view.strides[2] + d * view.strides[3]];
  }
  float at(std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t d) const {
    return const_cast<StridedTensor*>(this)->at(b, t, h, d);
  }
  /// Fills every logical element with N(0, sigma) from `rng` (padding stays NaN: a kernel that
  /// reads padding produces NaN and fails).
  void fill_random(std::mt19937_64& rng, double sigma = 1.0) {
    std::normal_distribution<float> dist(0.0f, static_cast<float>(sigma));
    for_each([&](float& x) { x = dist(rng); });
  }
  void poison() {
    for_each([](float& x) { x = kPoison; });
  }
  template <class F>
  void for_each(F&& f) {
    const auto& s = view.shape;
    for (std::int64_t b = 0; b < s[0]; ++b)
      for (std::int64_t t = 0; t < s[1]; ++t)
        for (std::int64_t h = 0; h < s[2]; ++h)
          for (std::int64_t d = 0; d < s[3]; ++d) f(at(b, t, h, d));
  }
  reference::Tensor64 to64() const {
    reference::Tensor64 r(view.shape);
    const auto& s = view.shape;
    for (std::int64_t b = 0; b < s[0]; ++b)
      for (std::int64_t t = 0; t < s[1]; ++t)
        for (std::int64_t h = 0; h < s[2]; ++h)
          for (std::int64_t d = 0; d < s[3]; ++d) r.at(b, t, h, d) = at(b, t, h, d);
    return r;
  }
};

/// rel_err over the logical elements of `x` against a reference of the same logical shape; the
/// denominator is at least `floor` (a gradient that is ≈ 0 everywhere is judged absolutely).
inline double rel_err(const StridedTensor& x, const reference::Tensor64& r,
                      double floor = ErrorAccumulator::kDefaultFloor) {
  ErrorAccumulator acc;
  const auto& s = x.view.shape;
  for (std::int64_t b = 0; b < s[0]; ++b)
    for (std::int64_t t = 0; t < s[1]; ++t)
      for (std::int64_t h = 0; h < s[2]; ++h)
        for (std::int64_t d = 0; d < s[3]; ++d) acc.add(x.at(b, t, h, d), r.at(b, t, h, d));
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
  /// "bottom_right" / "top_left": tokenmix::to_string(CausalAlign), the one spelling of the
  /// CLI, the bench's JSON and Python.
  const char* align_name() const { return to_string(align); }
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
  std::optional<double> scale = std::nullopt;  ///< s in (4.2); empty: 1/√d_h
  bool sdpa_layout = false;                    ///< memory [B, H, T, d_h] instead of [B, T, H, d_h]
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

/// The "real keys" profile (`tokenmix bench decode --kv-profile real`; docs/performance.md,
/// D-kv-4): keys as a quantizer sees real LLMs' K — a few channels 10–30× the others, an offset
/// per channel, a few massive tokens (the first ones, attention sinks). Its named defaults:
inline constexpr double kRealKeyOutliers[] = {10, 14, 18, 22, 26, 30};  // ×s_i, one channel each
inline constexpr double kRealKeyOffsetSigma = 1.0;          // o_{h,e} ~ N(0, σ_o), per channel
inline constexpr double kRealKeyMassive = 6.0;              // m_t of a massive token
inline constexpr std::int64_t kRealKeyMassiveEvery = 2048;  // massive: t ≡ 0 (mod this), t = 1
/// K rows [T, H, d_h] (contiguous, at least T·H·d_h values, N(0, 1)) are turned in place into
/// k[t, h, e] = m_t · s_{h,e} · (x + o_{h,e}): s_{h,e} = kRealKeyOutliers[i] for channel
/// e = (5 + i·⌊d_h / 6⌋ + h) mod d_h (i = 0..5; another channel per head), else 1; the offsets
/// seeded by `seed`; m_t = kRealKeyMassive for the massive tokens, else 1. Throws ArgumentError
/// naming k, T, H or D if they do not fit.
void apply_real_keys(std::vector<float>& k, std::int64_t T, std::int64_t H, std::int64_t D,
                     std::uint64_t seed);

// --- kernel paths --------------------------------------------------------------------------------

/// The concrete kernel paths: portable, avx2, avx512 (x86, lowest first), neon (AArch64).
const std::vector<Isa>& concrete_isas();

/// Empty if `isa` runs here; otherwise why not, naming the CPU: "this CPU/OS does not support
/// avx512 (CPU: …)" or "this build has no avx512 kernels, although the CPU (…) supports them".
std::string isa_unavailable_reason(Isa isa);

}  // namespace tokenmix::testkit
