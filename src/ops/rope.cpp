// src/ops/rope.cpp — rotary position embedding, forward and inverse (SPEC 4.1, "RoPE").
#include "tokenmix/rope.hpp"

#include <cmath>
#include <string>
#include <vector>

#include "util/validate.hpp"

namespace tokenmix {
namespace {

using detail::fail;

// Rotates every pair of x [B, T, H, d_h] by ±(offset + t)·θ_i, θ_i = base^(−2i/d_h).
void rotate(const char* fn, const char* name, TensorView x, const RopeOptions& o, double sign) {
  detail::check_view(x, 4, fn, name);
  const std::int64_t B = x.dim(0), T = x.dim(1), H = x.dim(2), D = x.dim(3);
  if (D % 2 != 0) {
    fail(ErrorCode::invalid_argument, fn,
         std::string(name) +
             ".shape[3] (d_h) must be even for RoPE (coordinates are rotated in pairs); got " +
             std::to_string(D));
  }
  if (!std::isfinite(o.base) || o.base <= 0.0) {
    fail(ErrorCode::invalid_argument, fn,
         "options.base must be finite and > 0; got " + std::to_string(o.base));
  }
  if (o.position_offset < 0) {
    fail(ErrorCode::invalid_argument, fn,
         "options.position_offset must be >= 0; got " + std::to_string(o.position_offset));
  }
  std::int64_t last = 0;
  if (T > 0 && __builtin_add_overflow(o.position_offset, T - 1, &last)) {
    fail(ErrorCode::overflow, fn, "options.position_offset + T overflows 64-bit arithmetic");
  }
  // Nothing to rotate: no per-d_h table for a view with no elements (its d_h may be huge).
  if (B == 0 || T == 0 || H == 0 || D == 0) return;
  const std::int64_t half = D / 2;
  auto* data = static_cast<float*>(x.data);
  const auto& s = x.strides;
  std::vector<double> theta(static_cast<std::size_t>(half));
  for (std::int64_t i = 0; i < half; ++i) {
    theta[i] = std::pow(o.base, -2.0 * static_cast<double>(i) / static_cast<double>(D));
  }
  // Pair i is (x_i, x_{i+d_h/2}) for rotate-half, (x_{2i}, x_{2i+1}) for interleaved.
  const bool interleaved = o.pairing == RopePairing::interleaved;
  std::vector<double> cos_t(half), sin_t(half);
  for (std::int64_t t = 0; t < T; ++t) {
    const double pos = static_cast<double>(o.position_offset + t);
    for (std::int64_t i = 0; i < half; ++i) {
      const double angle = sign * pos * theta[i];  // φ = ±p·θ_i
      cos_t[i] = std::cos(angle);
      sin_t[i] = std::sin(angle);
    }
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t h = 0; h < H; ++h) {
        float* row = data + b * s[0] + t * s[1] + h * s[2];
        for (std::int64_t i = 0; i < half; ++i) {
          float& xr = row[(interleaved ? 2 * i : i) * s[3]];
          float& yr = row[(interleaved ? 2 * i + 1 : i + half) * s[3]];
          const double xv = xr, yv = yr;  // (x, y) ↦ (x cos φ − y sin φ, x sin φ + y cos φ)
          xr = static_cast<float>(xv * cos_t[i] - yv * sin_t[i]);
          yr = static_cast<float>(xv * sin_t[i] + yv * cos_t[i]);
        }
      }
    }
  }
}

}  // namespace

void rope_forward(TensorView x, const RopeOptions& options) {
  rotate("rope_forward", "x", x, options, 1.0);
}

void rope_backward(TensorView dx, const RopeOptions& options) {
  // The rotation R is orthogonal, so ∂L/∂x = Rᵀ ∂L/∂(Rx) = R(−φ) dx.
  rotate("rope_backward", "dx", dx, options, -1.0);
}

}  // namespace tokenmix
