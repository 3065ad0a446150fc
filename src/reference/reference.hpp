// src/reference/reference.hpp — the float64 oracle.
//
// A literal, deliberately slow implementation of every tokenmix operation in double precision.
// It follows SPEC.md step by step: it materialises S (4.2), M (4.3) and A (4.4) per head,
// forms the explicit softmax Jacobian J = diag(a) − a aᵀ (4.6) for the backward pass, and does
// projections as plain triple loops. It is the oracle for the tests, for `tokenmix check` and
// for the benchmarks' error column; it is never used on the fast path.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

namespace tokenmix::reference {

/// Contiguous double tensor with up to 4 dims (row-major). Attention tensors are [B, T, H, d_h];
/// log-sum-exp tensors [B, H, T] (shape[3] = 1).
struct Tensor64 {
  std::array<std::int64_t, 4> shape{1, 1, 1, 1};
  std::vector<double> data;

  Tensor64() = default;
  explicit Tensor64(std::array<std::int64_t, 4> s);
  std::int64_t size() const { return shape[0] * shape[1] * shape[2] * shape[3]; }
  double& at(std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t d);
  double at(std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t d) const;
};

enum class Align { bottom_right, top_left };

/// SPEC 4.2–4.4 and "Score variants used by real models". The score of row t, key u is
///   S_{t,u} = cap(z_{t,u}) + b_h(t,u) + bias_{b,h,t,u}   (+ M_{t,u}: −∞ where not visible)
/// with z = s·⟨q_t, k_u⟩; key u is visible to row t of (b, h) iff the causal mask (4.3), the
/// window, the key length of sequence b and the boolean mask all allow it.
struct Options {
  std::optional<double> scale;  ///< default 1/sqrt(d_h)
  bool causal = true;
  Align align = Align::bottom_right;
  std::optional<std::int64_t> window;  ///< W ≥ 1: u visible only if p(t) − W < u
  std::optional<double> softcap;       ///< c > 0: cap(z) = c·tanh(z / c)
  std::vector<double> alibi_slopes;    ///< [H_q] m_h: b_h(t,u) = −m_h·(p(t) − u); empty = off
  std::vector<double> sinks;           ///< [H_q] σ_h (joins each row's denominator); empty = off
  std::vector<std::int64_t> key_lengths;  ///< [B]: keys u ≥ key_lengths[b] are invisible
  /// Explicit masks, dense [B][H_q][T_q][T_k] row-major (the tests expand any broadcast):
  std::vector<std::uint8_t> mask_bool;  ///< nonzero = may attend; empty = none
  std::vector<double> mask_bias;        ///< added to the score; empty = none
  /// Attention dropout (docs/design.md D.1): the keep mask Z, dense [B][H_q][T_q][T_k] (1 =
  /// kept; tokenmix::attention_dropout_mask writes it), and p: the values are averaged with
  /// P̃ = A ⊙ Z / (1 − p); L stays that of A. Empty = off.
  std::vector<std::uint8_t> dropout_keep;
  double dropout_p = 0.0;
};

/// p(t): the absolute position of query row t — t + (T_k − T_q) bottom-right, t top-left (4.3).
std::int64_t position(std::int64_t t, std::int64_t T_q, std::int64_t T_k, const Options& o);

/// M_{t,u} of (4.3) and the sliding window: true if key u is visible to query t (the parts of
/// the visibility that do not depend on the batch row or head).
bool visible(std::int64_t t, std::int64_t u, std::int64_t T_q, std::int64_t T_k, const Options& o);

struct ForwardResult {
  Tensor64 out;  ///< [B, T_q, H_q, d_h]
  Tensor64 lse;  ///< [B, H_q, T_q, 1]; −∞ for rows that see no key
};
/// (4.2)–(4.5) with GQA (4.8): materialises S, M, A for every (b, h).
ForwardResult attention_forward(const Tensor64& q, const Tensor64& k, const Tensor64& v,
                                const Options& o = {});

/// The attention weights A of (4.4) with every variant, [B, H_q, T_q, T_k] (row-major; shape[3]
/// = T_k): A[b, h, t, u] = e^{S_{t,u} + M_{t,u} − L_t}, 0 where masked; with a sink its share is
/// not in A (a row sums to 1 − e^{σ_h − L_t}). The oracle of attention_weights.
Tensor64 attention_weights(const Tensor64& q, const Tensor64& k, const Options& o = {});

struct BackwardResult {
  Tensor64 dq;                 ///< [B, T_q, H_q, d_h]
  Tensor64 dk;                 ///< [B, T_k, H_kv, d_h]
  Tensor64 dv;                 ///< [B, T_k, H_kv, d_h]
  std::vector<double> dsinks;  ///< [H_q] dσ_h when o.sinks is set, else empty
};
/// SPEC "Backward pass", literally: dA = dO Vᵀ; each row's dS = J_row · dA_row with the
/// explicit Jacobian (4.6); dQ = s dS K; dK = s Σ dSᵀ Q; dV = Σ Aᵀ dO.
BackwardResult attention_backward(const Tensor64& q, const Tensor64& k, const Tensor64& v,
                                  const Tensor64& dout, const Options& o = {});

/// Variable-length batches (SPEC "Score variants": varlen): q [1, total_q, H_q, d_h], k and v
/// [1, total_k, H_kv, d_h]; sequence i owns query rows [cu_q[i], cu_q[i+1]) and keys
/// [cu_k[i], cu_k[i+1]); alignment, window and ALiBi positions are per sequence. Each sequence
/// is an independent B = 1 problem (o.key_lengths and the masks must be empty).
ForwardResult attention_forward_varlen(const Tensor64& q, const Tensor64& k, const Tensor64& v,
                                       const std::vector<std::int64_t>& cu_q,
                                       const std::vector<std::int64_t>& cu_k,
                                       const Options& o = {});
BackwardResult attention_backward_varlen(const Tensor64& q, const Tensor64& k, const Tensor64& v,
                                         const Tensor64& dout,
                                         const std::vector<std::int64_t>& cu_q,
                                         const std::vector<std::int64_t>& cu_k,
                                         const Options& o = {});

/// Stable softmax / log-sum-exp of one row (−∞ entries are masked; all −∞ → zeros, −∞).
std::vector<double> softmax(const std::vector<double>& z);
double logsumexp(const std::vector<double>& z);
/// Explicit J = diag(a) − a aᵀ, n×n row-major (4.6).
std::vector<double> softmax_jacobian(const std::vector<double>& a);

/// SPEC "Reduced precision → Quantized KV cache": the formats of a quantized KV-cache element.
enum class KVQuant { int8, fp8_e4m3 };
/// The fp8 E4M3 value of a byte, from the format's definition (sign, 4 exponent bits with bias
/// 7, 3 mantissa bits; e ≥ 1: 2^(e−7)·(1 + m/8), e = 0: 2^(−6)·m/8; 0x7f and 0xff are NaN).
double e4m3_value(std::uint8_t bits);
/// x̂ = q · δ in float64 of one stored element (int8: the signed byte; fp8_e4m3: e4m3_value)
/// with its row's scale δ.
double dequantize(KVQuant format, std::uint8_t stored, float delta);
/// Largest magnitude of the format: 127 (int8), 448 (fp8_e4m3); δ = max|x| / it (SPEC).
double quant_max(KVQuant format);

enum class RopePairing { rotate_half, interleaved };
/// Rotates x [B, T, H, d_h] (copy) by position offset + t; inverse=true rotates by −angle.
Tensor64 rope(const Tensor64& x, RopePairing pairing, double base, std::int64_t offset,
              bool inverse = false);

/// SPEC "Merging partial results". o: [B,T,H,d_h], lse: [B,H,T,1].
ForwardResult merge(const Tensor64& o1, const Tensor64& lse1, const Tensor64& o2,
                    const Tensor64& lse2);

/// The whole layer (4.1–4.5) in double. Weights row-major as in tokenmix/layer.hpp.
struct LayerWeights {
  std::int64_t d_model = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
  bool use_rope = false;
  RopePairing pairing = RopePairing::rotate_half;
  double rope_base = 10000.0;
  std::optional<double> scale;
  std::vector<double> w_q, w_k, w_v, w_o;
};
struct LayerGrads {
  std::vector<double> d_u, d_w_q, d_w_k, d_w_v, d_w_o;
};
/// u [B, T, d] → out [B, T, d] (causal, bottom-right, T_q = T_k = T).
std::vector<double> layer_forward(const LayerWeights& w, const std::vector<double>& u,
                                  std::int64_t batch, std::int64_t seq);
LayerGrads layer_backward(const LayerWeights& w, const std::vector<double>& u, std::int64_t batch,
                          std::int64_t seq, const std::vector<double>& d_out);

}  // namespace tokenmix::reference
