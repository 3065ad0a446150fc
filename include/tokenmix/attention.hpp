// tokenmix/attention.hpp — exact causal scaled-dot-product attention, forward and backward.
//
// Shapes (logical; any strides, see tensor.hpp):
//   q    [B, T_q, H_q,  d_h]        k, v [B, T_k, H_kv, d_h]
//   out  [B, T_q, H_q,  d_h]        lse  [B, H_q, T_q]        (row log-sum-exp, SPEC 4.4)
// Query head h reads key/value head j(h) = floor(h / g), g = H_q / H_kv (SPEC 4.8).
//
// Forward, per head h (SPEC 4.2–4.5):
//   S = s · Q_h K_jᵀ          (4.2)   s = 1/sqrt(d_h) unless overridden
//   A = softmax(S + M)        (4.3, 4.4)  M = causal mask, bottom-right aligned by default
//   O_h = A V_j               (4.5)   L_t = log Σ_u exp(S_tu + M_tu)
// A row that sees no key (only possible when T_q > T_k, bottom-right) gives O = 0, L = −∞.
//
// Backward (SPEC "Backward pass"): with D_t = ⟨dO_t, O_t⟩ (the softmax Jacobian 4.6–4.7 applied
// row by row), dS = A ⊙ (dO Vᵀ − D 1ᵀ), dQ = s·dS K, dK = s·Σ_group dSᵀ Q, dV = Σ_group Aᵀ dO.
#pragma once

#include <optional>
#include <string>

#include "tokenmix/runtime.hpp"
#include "tokenmix/tensor.hpp"

namespace tokenmix {

/// Where the causal diagonal sits when T_q != T_k (SPEC 4.3).
enum class CausalAlign {
  bottom_right,  ///< query t is at absolute position t + (T_k − T_q); sees u ≤ t + T_k − T_q
  top_left,      ///< query t sees u ≤ t (PyTorch's is_causal convention)
};

/// "bottom_right" / "top_left" (the one spelling shared by the CLI's --align and Python's align=);
/// "unknown" for a value outside the enum.
const char* to_string(CausalAlign align) noexcept;
/// Parses "bottom_right" or "top_left" (throws ArgumentError(invalid_argument) naming `what` and
/// listing the allowed values otherwise).
CausalAlign parse_causal_align(const std::string& text, const char* what = "align");

struct AttentionOptions {
  std::optional<double> scale;  ///< s in (4.2); default 1/sqrt(d_h). Must be finite.
  bool causal = true;           ///< apply the mask M of (4.3)
  CausalAlign align = CausalAlign::bottom_right;
  int threads = 0;           ///< 0 = all (default_threads()); results do not depend on it
  Isa isa = Isa::automatic;  ///< force a (lower) kernel path; see runtime.hpp
};

/// Forward pass. `lse` may be an empty view (data == nullptr) when not wanted.
/// Throws ArgumentError on inconsistent shapes, null pointers, overlapping outputs/inputs, an
/// output with a zero stride on an axis of size > 1 (it would overlap itself), overflowing sizes,
/// non-finite scale, an options.align outside the enum; UnsupportedError for a dtype other than
/// f32.
void attention_forward(ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out,
                       TensorView lse = {}, const AttentionOptions& options = {});

/// Backward pass from the forward's q, k, v, out, lse and the incoming gradient dout.
/// Writes dq [B,T_q,H_q,d_h], dk and dv [B,T_k,H_kv,d_h] (overwritten, not accumulated).
void attention_backward(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                        ConstTensorView out, ConstTensorView lse, ConstTensorView dout,
                        TensorView dq, TensorView dk, TensorView dv,
                        const AttentionOptions& options = {});

/// Number of keys visible to query t, 0 ≤ t < T_q (SPEC "Useful-work counts": pairs(t)).
/// Throws ArgumentError(invalid_argument) for t outside [0, T_q), a negative size or an align
/// value outside the enum.
std::int64_t visible_keys(std::int64_t t, std::int64_t T_q, std::int64_t T_k, bool causal,
                          CausalAlign align);
/// P = Σ_t pairs(t) in closed form (O(1) for any size). Throws as visible_keys for bad
/// arguments, and ArgumentError(overflow) naming T_q and T_k when P exceeds 2^63 − 1 (e.g. causal
/// T_q = T_k = 6·2^30).
std::int64_t visible_pairs(std::int64_t T_q, std::int64_t T_k, bool causal, CausalAlign align);
/// Forward FLOPs 4·d_h·H_q·P·B (SPEC "Useful-work counts"), in double (P exact before the
/// conversion, so no overflow). Throws ArgumentError for negative sizes or a bad align.
double forward_flops(std::int64_t B, std::int64_t T_q, std::int64_t T_k, std::int64_t H_q,
                     std::int64_t d_h, bool causal, CausalAlign align);
/// Backward FLOPs = 2.5 × forward_flops (SPEC "Useful-work counts": five products instead of
/// two, the convention of the FlashAttention papers). Throws as forward_flops.
double backward_flops(std::int64_t B, std::int64_t T_q, std::int64_t T_k, std::int64_t H_q,
                      std::int64_t d_h, bool causal, CausalAlign align);

/// Merge two partial attentions over disjoint key sets (SPEC "Merging partial results"):
///   L = log(e^{L¹} + e^{L²}),  O = e^{L¹−L} O¹ + e^{L²−L} O².
/// o1, o2, out: [B, T, H, d_h]; lse1, lse2, lse_out: [B, H, T]. A part with L = −∞ is empty
/// (its O is not read); a NaN L is not empty: it makes the row NaN (SPEC 4.3).
/// out/lse_out may alias o1/lse1 (in-place accumulation) but not o2/lse2.
void merge_partials(ConstTensorView o1, ConstTensorView lse1, ConstTensorView o2,
                    ConstTensorView lse2, TensorView out, TensorView lse_out);

}  // namespace tokenmix
