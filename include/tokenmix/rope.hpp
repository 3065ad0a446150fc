// tokenmix/rope.hpp — rotary position embedding (SPEC 4.1, "RoPE").
//
// A vector x of width d_h at absolute position p has coordinate pairs rotated by p·θ_i,
// θ_i = base^(−2i/d_h), i = 0 … d_h/2 − 1:
//   rotate-half  pairs (x_i, x_{i+d_h/2})   (Llama / GPT-NeoX)
//   interleaved  pairs (x_{2i}, x_{2i+1})   (GPT-J / RoFormer)
//   (x, y) ↦ (x cos φ − y sin φ, x sin φ + y cos φ),  φ = p·θ_i
// Rotations are orthogonal: the backward pass applies the inverse rotation (angle −p·θ_i).
// Position of token t (axis 1 of a [B, T, H, d_h] view) is p = position_offset + t.
#pragma once

#include <cstdint>

#include "tokenmix/tensor.hpp"

namespace tokenmix {

enum class RopePairing { rotate_half, interleaved };

struct RopeOptions {
  RopePairing pairing = RopePairing::rotate_half;
  double base = 10000.0;             ///< 10000 classic, 500000 Llama-3; must be finite and > 0
  std::int64_t position_offset = 0;  ///< absolute position of t = 0 (e.g. KV-cache length); ≥ 0
};

/// Rotates x [B, T, H, d_h] in place (d_h must be even).
void rope_forward(TensorView x, const RopeOptions& options = {});
/// Applies the inverse rotation to a gradient dx [B, T, H, d_h] in place.
void rope_backward(TensorView dx, const RopeOptions& options = {});

}  // namespace tokenmix
