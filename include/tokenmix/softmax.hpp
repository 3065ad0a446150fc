// tokenmix/softmax.hpp — stable softmax, log-sum-exp and the softmax Jacobian (SPEC 4.4, 4.6–4.7).
//
// For one row a = softmax(z) ∈ R^n:
//   J = ∂a/∂z = diag(a) − a aᵀ                      (4.6)   ∂a_i/∂z_j = a_i (δ_ij − a_j)  (4.7)
//   J g = a ⊙ (g − ⟨a, g⟩)                          (matrix-free, no n×n buffer)
// Entries equal to −∞ are masked: they get probability 0. A row whose entries are all −∞ has
// log-sum-exp −∞ and softmax all zeros (never NaN). A NaN entry makes its row's softmax and
// log-sum-exp NaN; a +∞ entry makes the softmax NaN (e^{∞−∞}) and the log-sum-exp +∞ (SPEC 4.3).
#pragma once

#include <cstdint>
#include <span>

namespace tokenmix {

/// log Σ_i exp(z_i), computed as m + log Σ exp(z_i − m) with m = max z (stable).
float logsumexp(std::span<const float> z);

/// a = softmax(z) for `rows` rows of length `n` (row-major, contiguous). a may equal z.
void softmax_rows(std::span<const float> z, std::span<float> a, std::int64_t rows, std::int64_t n);

/// The explicit Jacobian J (n×n, row-major) of one softmax row a (4.6).
void softmax_jacobian(std::span<const float> a, std::span<float> jacobian);

/// out = J g = a ⊙ (g − ⟨a, g⟩) without forming J (4.7). out may equal g.
void softmax_jacobian_vector_product(std::span<const float> a, std::span<const float> g,
                                     std::span<float> out);

}  // namespace tokenmix
