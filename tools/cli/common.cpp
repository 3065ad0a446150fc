// tools/cli/common.cpp — helpers shared by the subcommands (see common.hpp).
#include "common.hpp"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <limits>
#include <random>

namespace tokenmix::cli {

void progress(const std::string& message) {
  std::cerr << "tokenmix: " << message << std::endl;
}

void ErrorAccumulator::add(double x, double r) {
  const double diff =
      std::isnan(x) || std::isnan(r) ? std::numeric_limits<double>::infinity() : std::fabs(x - r);
  if (!(diff <= max_diff)) max_diff = diff;  // also propagates +inf
  if (std::isfinite(r)) max_ref = std::max(max_ref, std::fabs(r));
}

double ErrorAccumulator::value() const {
  if (max_diff == 0.0) return 0.0;
  return max_diff / std::max(max_ref, 1e-30);
}

double rel_err(std::span<const float> x, std::span<const double> r) {
  ErrorAccumulator acc;
  if (x.size() != r.size()) return std::numeric_limits<double>::infinity();
  for (std::size_t i = 0; i < x.size(); ++i) {
    // Equal infinities (e.g. the −∞ log-sum-exp of a row with no visible key) are exact.
    if (std::isinf(r[i]) && static_cast<double>(x[i]) == r[i]) continue;
    acc.add(x[i], r[i]);
  }
  return acc.value();
}

reference::Tensor64 to_tensor64(std::span<const float> data, std::array<std::int64_t, 4> shape) {
  reference::Tensor64 t(shape);
  for (std::size_t i = 0; i < t.data.size() && i < data.size(); ++i) t.data[i] = data[i];
  return t;
}

std::vector<float> random_normal(std::size_t n, std::uint64_t seed, double sigma) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist(0.0, sigma);
  std::vector<float> out(n);
  for (auto& x : out) x = static_cast<float>(dist(rng));
  return out;
}

std::string fmt(double value, const char* format) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, value);
  return buf;
}

void apply_blas_threads(int threads) {
  if (threads > 0) openblas_set_num_threads(threads);
}

}  // namespace tokenmix::cli
