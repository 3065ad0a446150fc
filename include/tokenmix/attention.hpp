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

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

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

/// Options of the attention entry points. The score variants (SPEC "Score variants used by real
/// models") combine freely with each other, with the causal mask and with both alignments:
///   S_{t,u} = cap(z_{t,u}) + b_h(t,u) + bias_{b,h,t,u},   z = s·⟨q_t, k_u⟩   (4.2)
/// and key u is visible to row t of (b, h) iff the causal mask (4.3), the window, the key length
/// of sequence b and the boolean mask all allow it. p(t) = t + (T_k − T_q) bottom-right, t
/// top-left, is query t's position (for the window and ALiBi; also when causal is false).
/// A row that sees no key gives O = 0 and L = −∞ (with sinks: O = 0, L = σ_h).
/// A kernel path that does not implement the variants (see `tokenmix info`) refuses a call that
/// uses any of them with UnsupportedError naming the kernel and the variants; force another
/// path with `isa` (Isa::portable implements all of them).
struct AttentionOptions {
  std::optional<double> scale;  ///< s in (4.2); default 1/sqrt(d_h). Must be finite.
  bool causal = true;           ///< apply the mask M of (4.3)
  CausalAlign align = CausalAlign::bottom_right;
  int threads = 0;           ///< 0 = all (default_threads()); results do not depend on it
  Isa isa = Isa::automatic;  ///< force a (lower) kernel path; see runtime.hpp

  /// Sliding window W ≥ 1: key u is visible to row t only if p(t) − W < u (the last W positions
  /// up to p(t); FlashAttention's window_size = (W − 1, 0)). Work per row is O(W).
  std::optional<std::int64_t> window;
  /// Logit soft-capping c > 0: cap(z) = c·tanh(z / c), after the scale. Finite in float32.
  std::optional<double> softcap;
  /// ALiBi slopes, rank 1 [H_q] f32 (any stride): b_h(t,u) = −m_h·(p(t) − u). Empty = off.
  ConstTensorView alibi_slopes;
  /// Attention sinks, rank 1 [H_q] f32: a logit σ_h per query head that joins each row's softmax
  /// denominator with no value vector; L includes it. Empty = off. Gradient: attention_backward's
  /// dsinks.
  ConstTensorView sinks;
  /// Explicit mask, rank 4, logical [B, H_q, T_q, T_k]: each dimension the full size or 1, any
  /// strides (stride 0 broadcasts without a copy). DType::boolean (nonzero = may attend) or f32
  /// (an additive bias; −∞ excludes a key by weight 0). Combined with the causal mask when both
  /// are given. Boolean masks whose every row is one interval of keys (causal, padding, window)
  /// are detected and run at the unmasked speed.
  ConstTensorView mask;
  /// Key padding, rank 1 [B], i32 or i64: keys u ≥ key_lengths[b] of sequence b are invisible
  /// (the alignment stays that of the full T_q, T_k). Empty = every key.
  ConstTensorView key_lengths;
};

/// Forward pass. `lse` may be an empty view (data == nullptr) when not wanted.
/// Throws ArgumentError on inconsistent shapes, null pointers, overlapping outputs/inputs, an
/// output with a zero stride on an axis of size > 1 (it would overlap itself), overflowing sizes,
/// non-finite scale, an options.align outside the enum, q, k, v, out of different dtypes;
/// UnsupportedError for a dtype other than f32, bf16, f16 (lse: other than f32).
///
/// Reduced precision (SPEC "Reduced precision"): q, k, v, out (and in the backward dout, dq, dk,
/// dv) are all f32, all bf16 or all f16; lse, sinks, ALiBi slopes and f32 masks stay f32. With
/// bf16/f16 the products accumulate in fp32, the softmax (max, exp, sums, L) is fp32, and O, dQ,
/// dK, dV are rounded to the dtype once, at the end (nearest even). Every path serves them.
void attention_forward(ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out,
                       TensorView lse = {}, const AttentionOptions& options = {});

/// Backward pass from the forward's q, k, v, out, lse and the incoming gradient dout.
/// Writes dq [B,T_q,H_q,d_h], dk and dv [B,T_k,H_kv,d_h] (overwritten, not accumulated), and,
/// when options.sinks is set and dsinks is not empty, dsinks [H_q] f32:
/// dσ_h = −Σ_{b,t} e^{σ_h − L_t} D_t (SPEC "Score variants": sinks). Options as for the forward
/// (the same ones, or the gradients are of a different function). An f32 mask gets no gradient.
void attention_backward(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                        ConstTensorView out, ConstTensorView lse, ConstTensorView dout,
                        TensorView dq, TensorView dk, TensorView dv,
                        const AttentionOptions& options = {}, TensorView dsinks = {});

/// The rows of P that attention_weights writes: query heads in output order and a range of
/// query rows (default: every head, every row).
struct WeightsSelection {
  /// Query heads h, 0 ≤ h < H_q, in the order of the output's head axis (repeats allowed).
  /// Empty = all, 0 … H_q − 1.
  std::vector<std::int64_t> heads;
  std::int64_t row_begin = 0;           ///< first query row t (0 ≤ row_begin ≤ row_end)
  std::optional<std::int64_t> row_end;  ///< one past the last row (≤ T_q); default T_q
};

/// Attention weights on request (SPEC 4.2–4.4 and "Score variants"): for the selected heads h
/// and rows t of each batch row b,
///   weights[b, i, t − row_begin, u] = P_{t,u} = exp(S_{t,u} + M_{t,u} − L_t),  h = heads[i],
/// with S the score of the forward (z = s·⟨q_t, k_u⟩, cap(z), ALiBi, an f32 mask's bias) and L
/// the forward's row log-sum-exp `lse` [B, H_q, T_q] (f32): the rows of A = softmax(S + M) that
/// the forward used, without any T×T buffer. Keys the row does not see (causal mask, window, key
/// length, a boolean mask, a −∞ bias) get exactly 0; so does every key of a row that sees none.
/// With sinks each row sums to 1 − e^{σ_h − L_t} (the sink's share is not a key's).
///   q [B, T_q, H_q, d_h], k [B, T_k, H_kv, d_h]: f32, bf16 or f16, one dtype (widened exactly).
///   weights: rank 4 [B, heads, rows, T_k] f32, any strides (no overlap with itself or inputs).
/// The options must be the forward's (scale, causal, align and the variants); threads and isa
/// as for the forward (the results are the same bits for every thread count and path). Memory:
/// per-thread scratch of O(64·(d_h + 64)) floats; time: one product s·Q K_jᵀ per written row
/// (about half the forward's useful FLOPs for all rows). Throws ArgumentError naming the
/// argument for bad shapes, a head index outside [0, H_q), a row range outside [0, T_q], null
/// pointers, overlapping outputs, overflowing sizes; UnsupportedError for other dtypes.
void attention_weights(ConstTensorView q, ConstTensorView k, ConstTensorView lse,
                       TensorView weights, const AttentionOptions& options = {},
                       const WeightsSelection& select = {});

/// Variable-length batches (SPEC "Score variants": varlen; FlashAttention's varlen API).
///   q [total_q, H_q, d_h], k and v [total_k, H_kv, d_h] (rank 3, any strides)
///   cu_seqlens_q, cu_seqlens_k: rank 1 [n + 1], i32 or i64, cu[0] = 0, non-decreasing, ending
///   at total_q / total_k; sequence i owns query rows [cu_q[i], cu_q[i+1]) and keys
///   [cu_k[i], cu_k[i+1]); no token attends across sequences; alignment, window and ALiBi
///   positions are per sequence.
///   out [total_q, H_q, d_h]; lse [H_q, total_q] (rank 2) or empty.
/// options.mask and options.key_lengths must be empty (UnsupportedError otherwise). Bad offsets
/// throw ArgumentError naming the index. Runs one B = 1 kernel call per sequence on views of the
/// packed tensors (no copy): the threads share the work of each sequence in turn (its heads and
/// row blocks), so many tiny sequences use the threads less well than a padded batch. A sequence
/// with no keys gives O = 0 and L = −∞ (σ_h with sinks).
void attention_forward_varlen(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                              ConstTensorView cu_seqlens_q, ConstTensorView cu_seqlens_k,
                              TensorView out, TensorView lse = {},
                              const AttentionOptions& options = {});
void attention_backward_varlen(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                               ConstTensorView out, ConstTensorView lse, ConstTensorView dout,
                               ConstTensorView cu_seqlens_q, ConstTensorView cu_seqlens_k,
                               TensorView dq, TensorView dk, TensorView dv,
                               const AttentionOptions& options = {}, TensorView dsinks = {});

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

/// The same counts with a sliding window W ≥ 1 (SPEC "Score variants": window): only keys
/// p(t) − W < u count, so a benchmark of a windowed call counts the pairs it computes
/// (P ≈ W·T_q for T ≫ W). Closed form, exact in 128-bit arithmetic. Throws as above, and
/// ArgumentError(invalid_argument) naming `window` for W < 1.
/// (Separate names, not overloads, so the functions above stay addressable without a cast.)
std::int64_t visible_keys_windowed(std::int64_t t, std::int64_t T_q, std::int64_t T_k, bool causal,
                                   CausalAlign align, std::int64_t window);
std::int64_t visible_pairs_windowed(std::int64_t T_q, std::int64_t T_k, bool causal,
                                    CausalAlign align, std::int64_t window);
double forward_flops_windowed(std::int64_t B, std::int64_t T_q, std::int64_t T_k, std::int64_t H_q,
                              std::int64_t d_h, bool causal, CausalAlign align,
                              std::int64_t window);
double backward_flops_windowed(std::int64_t B, std::int64_t T_q, std::int64_t T_k, std::int64_t H_q,
                               std::int64_t d_h, bool causal, CausalAlign align,
                               std::int64_t window);

/// Merge two partial attentions over disjoint key sets (SPEC "Merging partial results"):
///   L = log(e^{L¹} + e^{L²}),  O = e^{L¹−L} O¹ + e^{L²−L} O².
/// o1, o2, out: [B, T, H, d_h]; lse1, lse2, lse_out: [B, H, T]. A part with L = −∞ is empty
/// (its O is not read); a NaN L is not empty: it makes the row NaN (SPEC 4.3).
/// out/lse_out may alias o1/lse1 (in-place accumulation) but not o2/lse2.
void merge_partials(ConstTensorView o1, ConstTensorView lse1, ConstTensorView o2,
                    ConstTensorView lse2, TensorView out, TensorView lse_out);

}  // namespace tokenmix
