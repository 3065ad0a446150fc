// tests/unit/test_util.hpp — the unit tests' side of the testing toolkit (tools/testkit): random
// strided tensors, poison, conversion to the float64 oracle's Tensor64, the error metric over
// them, and the per-kernel-path fixture.
//
// Error metric (used everywhere; defined once, in testkit::ErrorAccumulator): for a result x and
// its float64 reference r,
//   rel_err(x, r) = max_i |x_i − r_i| / max(max_i |r_i|, 1e-30)
// i.e. the max-norm error relative to the max-norm of the reference. It is insensitive to
// individual tiny reference entries (where element-wise relative error is meaningless).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "reference/reference.hpp"
#include "testkit.hpp"
#include "tokenmix/tokenmix.hpp"

namespace tokenmix::testing {

using reference::Tensor64;
using testkit::ErrorAccumulator;

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
  Tensor64 to64() {
    Tensor64 r(view.shape);
    const auto& s = view.shape;
    for (std::int64_t b = 0; b < s[0]; ++b)
      for (std::int64_t t = 0; t < s[1]; ++t)
        for (std::int64_t h = 0; h < s[2]; ++h)
          for (std::int64_t d = 0; d < s[3]; ++d) r.at(b, t, h, d) = at(b, t, h, d);
    return r;
  }
};

/// rel_err as defined at the top of this file, over the logical elements of `x`; the
/// denominator is at least `floor` (a gradient that is ≈ 0 everywhere is judged absolutely).
inline double rel_err(StridedTensor& x, const Tensor64& r, double floor = 1e-30) {
  ErrorAccumulator acc;
  const auto& s = x.view.shape;
  for (std::int64_t b = 0; b < s[0]; ++b)
    for (std::int64_t t = 0; t < s[1]; ++t)
      for (std::int64_t h = 0; h < s[2]; ++h)
        for (std::int64_t d = 0; d < s[3]; ++d) acc.add(x.at(b, t, h, d), r.at(b, t, h, d));
  return acc.value(floor);
}

/// rel_err for flat arrays of the same length (vectors, spans, Tensor64::data).
template <class A, class B>
double rel_err_flat(const A& x, const B& r) {
  return testkit::rel_err(x, r);
}

/// Fixture of the tests run once per concrete kernel path, each forced in turn:
///   class Suite : public PerIsaTest {};  TEST_P(Suite, ...) { ... GetParam() ... }
///   INSTANTIATE_TEST_SUITE_P(AllIsas, Suite, AllIsas(), IsaName);
/// A path this machine cannot run is skipped, visibly, with the reason (CPU or build).
class PerIsaTest : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    const std::string why = testkit::isa_unavailable_reason(GetParam());
    if (!why.empty()) GTEST_SKIP() << why;
  }
};
/// Every concrete path (portable, avx2, avx512), as gtest parameters named after the path.
inline auto AllIsas() {
  return ::testing::ValuesIn(testkit::concrete_isas());
}
inline std::string IsaName(const ::testing::TestParamInfo<Isa>& info) {
  return to_string(info.param);
}

}  // namespace tokenmix::testing
