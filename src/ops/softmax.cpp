// src/ops/softmax.cpp — softmax, log-sum-exp and the softmax Jacobian (SPEC 4.4, 4.6–4.7).
#include "tokenmix/softmax.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "kernels/nonfinite.hpp"
#include "util/validate.hpp"

namespace tokenmix {
namespace {

using detail::fail;

void check_size(const char* fn, const char* name, std::size_t got, std::int64_t expected,
                const char* expected_what) {
  if (static_cast<std::int64_t>(got) != expected) {
    fail(ErrorCode::shape_mismatch, fn,
         std::string(name) + ".size() must equal " + expected_what + " = " +
             std::to_string(expected) + "; got " + std::to_string(got));
  }
}

void check_data(const char* fn, const char* name, const void* p, std::size_t n) {
  if (n > 0 && p == nullptr)
    fail(ErrorCode::null_pointer, fn, std::string(name) + ".data() must not be null");
}

// Two spans may be the same memory (in-place) or disjoint, never partially overlapping.
void check_alias(const char* fn, const char* out_name, std::span<const float> out,
                 const char* in_name, std::span<const float> in) {
  if (out.empty() || in.empty() || out.data() == in.data()) return;
  const float* o0 = out.data();
  const float* i0 = in.data();
  if (o0 < i0 + in.size() && i0 < o0 + out.size()) {
    fail(ErrorCode::aliasing, fn,
         std::string(out_name) + " partially overlaps " + in_name +
             "; pass the same buffer (in place) or disjoint buffers");
  }
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// max of a row that is NaN if any entry is (std::max_element skips a NaN: softmax([−∞, NaN])
// came out as [0, 0]). SPEC 4.3: a NaN read propagates.
float row_max(const float* z, std::int64_t n) {
  float m = kNegInf;
  for (std::int64_t i = 0; i < n; ++i) m = kernels::max_nan(m, z[i]);
  return m;
}

}  // namespace

float logsumexp(std::span<const float> z) {
  check_data("logsumexp", "z", z.data(), z.size());
  if (z.empty()) return kNegInf;
  const float m = row_max(z.data(), static_cast<std::int64_t>(z.size()));
  if (std::isinf(m) || std::isnan(m)) return m;  // all −∞ → −∞ ; any NaN → NaN ; else +∞ → +∞
  double sum = 0.0;
  for (float x : z) sum += std::exp(static_cast<double>(x) - m);
  return static_cast<float>(m + std::log(sum));
}

void softmax_rows(std::span<const float> z, std::span<float> a, std::int64_t rows, std::int64_t n) {
  constexpr const char* fn = "softmax_rows";
  if (rows < 0)
    fail(ErrorCode::invalid_argument, fn, "rows must be >= 0; got " + std::to_string(rows));
  if (n < 0) fail(ErrorCode::invalid_argument, fn, "n must be >= 0; got " + std::to_string(n));
  const std::int64_t total = detail::checked_mul(rows, n, fn, "rows * n");
  check_size(fn, "z", z.size(), total, "rows * n");
  check_size(fn, "a", a.size(), total, "rows * n");
  check_data(fn, "z", z.data(), z.size());
  check_data(fn, "a", a.data(), a.size());
  check_alias(fn, "a", a, "z", z);
  if (total == 0) return;  // rows of zero entries (or no rows): nothing to write, whatever rows is
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* zr = z.data() + r * n;
    float* ar = a.data() + r * n;
    const float m = row_max(zr, n);  // NaN if the row holds one: the row becomes NaN
    if (m == kNegInf) {              // every entry masked: a row of zeros, not 0/0 = NaN
      std::fill(ar, ar + n, 0.0f);
      continue;
    }
    double sum = 0.0;  // a_i = exp(z_i − m) / Σ_j exp(z_j − m)  (4.4, stable form)
    for (std::int64_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(zr[i]) - m);
    for (std::int64_t i = 0; i < n; ++i) {
      ar[i] = static_cast<float>(std::exp(static_cast<double>(zr[i]) - m) / sum);
    }
  }
}

void softmax_jacobian(std::span<const float> a, std::span<float> jacobian) {
  constexpr const char* fn = "softmax_jacobian";
  const auto n = static_cast<std::int64_t>(a.size());
  check_size(fn, "jacobian", jacobian.size(), detail::checked_mul(n, n, fn, "a.size()^2"),
             "a.size()^2");
  check_data(fn, "a", a.data(), a.size());
  check_data(fn, "jacobian", jacobian.data(), jacobian.size());
  check_alias(fn, "jacobian", jacobian, "a", a);
  if (!a.empty() && jacobian.data() == a.data()) {
    fail(ErrorCode::aliasing, fn, "jacobian must not share memory with a");
  }
  for (std::int64_t i = 0; i < n; ++i) {  // J_ij = a_i (δ_ij − a_j)  (4.7)
    for (std::int64_t j = 0; j < n; ++j) {
      jacobian[i * n + j] = (i == j ? a[i] : 0.0f) - a[i] * a[j];
    }
  }
}

void softmax_jacobian_vector_product(std::span<const float> a, std::span<const float> g,
                                     std::span<float> out) {
  constexpr const char* fn = "softmax_jacobian_vector_product";
  check_size(fn, "g", g.size(), static_cast<std::int64_t>(a.size()), "a.size()");
  check_size(fn, "out", out.size(), static_cast<std::int64_t>(a.size()), "a.size()");
  check_data(fn, "a", a.data(), a.size());
  check_data(fn, "g", g.data(), g.size());
  check_data(fn, "out", out.data(), out.size());
  check_alias(fn, "out", out, "a", a);
  check_alias(fn, "out", out, "g", g);
  double ag = 0.0;  // ⟨a, g⟩
  for (std::size_t i = 0; i < a.size(); ++i) ag += static_cast<double>(a[i]) * g[i];
  for (std::size_t i = 0; i < a.size(); ++i) {  // J g = a ⊙ (g − ⟨a, g⟩), no n×n matrix
    out[i] = static_cast<float>(a[i] * (g[i] - ag));
  }
}

}  // namespace tokenmix
