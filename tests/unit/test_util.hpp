// tests/unit/test_util.hpp — the unit tests' side of the testing toolkit (tools/testkit, which
// holds the random strided tensors, poison, conversion to the float64 oracle's Tensor64 and the
// error metric over them): those names in tokenmix::testing, and the per-kernel-path fixture.
//
// Error metric (used everywhere; defined once, in testkit::ErrorAccumulator): for a result x and
// its float64 reference r,
//   rel_err(x, r) = max_i |x_i − r_i| / max(max_i |r_i|, 1e-30)
// i.e. the max-norm error relative to the max-norm of the reference. It is insensitive to
// individual tiny reference entries (where element-wise relative error is meaningless).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
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

using testkit::kPoison;
using testkit::Layout;
using testkit::layout_name;
using testkit::rel_err;
using testkit::StridedTensor;

/// The random-case suites' integer draws: pick(lo, hi) is uniform in [lo, hi] (up to the modulo's
/// bias) from a fixed seed, so a suite draws the same cases on every machine. `gen` is the
/// generator itself, for a suite that draws its data from the same stream.
struct Picker {
  std::mt19937_64 gen;
  explicit Picker(std::uint64_t seed) : gen(seed) {}
  std::int64_t operator()(std::int64_t lo, std::int64_t hi) {
    return lo + static_cast<std::int64_t>(gen() % static_cast<std::uint64_t>(hi - lo + 1));
  }
};

/// max_i |x_i| over the logical elements of a strided tensor (the gradient scale of the backward
/// bounds).
inline double max_abs(StridedTensor& x) {
  double m = 0.0;
  x.for_each([&](float& e) { m = std::max(m, static_cast<double>(std::fabs(e))); });
  return m;
}

/// rel_err for flat arrays of the same length (vectors, spans, Tensor64::data).
template <class A, class B>
double rel_err_flat(const A& x, const B& r) {
  return testkit::rel_err(x, r);
}

/// |y − r| in ULP of r's float binade (subnormal ULP below the normal range): the accuracy
/// measure of the SIMD kernels' element-wise functions (test_softcap_tanh, test_softmax_exp).
inline double ulp_error(float y, double r) {
  int e = 0;
  std::frexp(std::fabs(r), &e);  // |r| = m·2^e, m ∈ [0.5, 1)
  return std::fabs(static_cast<double>(y) - r) / std::ldexp(1.0, std::max(e - 24, -149));
}

/// The largest ulp_error(y[i], f64(x[i])) over i and the x[i] where it is (NaN counts as worst):
/// an element-wise fp32 function's outputs y against its float64 counterpart f64.
struct WorstUlp {
  double ulp = 0.0;
  float x = 0.0f;
};
template <class F64>
WorstUlp worst_ulp(const std::vector<float>& x, const std::vector<float>& y, F64 f64) {
  WorstUlp worst;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double e = ulp_error(y[i], f64(static_cast<double>(x[i])));
    if (!(e <= worst.ulp)) worst = {e, x[i]};
  }
  return worst;
}

// Sets (or, with nullptr, unsets) an environment variable for one scope, restoring it after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) {
      had_ = true;
      old_ = old;
    }
    if (value != nullptr) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (had_) {
      ::setenv(name_, old_.c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

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
/// Every concrete path (portable, avx2, avx512, neon), as gtest parameters named after the path.
inline auto AllIsas() {
  return ::testing::ValuesIn(testkit::concrete_isas());
}
inline std::string IsaName(const ::testing::TestParamInfo<Isa>& info) {
  return to_string(info.param);
}

}  // namespace tokenmix::testing
