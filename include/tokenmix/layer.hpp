// tokenmix/layer.hpp — the causal self-attention layer of SPEC 4.1–4.5, forward and backward.
//
//   U [B, T, d]
//   Q = U W_Q [B,T,H_q·d_h],  K = U W_K, V = U W_V [B,T,H_kv·d_h]           (4.1)
//   Q, K ← RoPE(Q, K) (optional)                                             (4.1, RoPE)
//   A_h = softmax(S_h + M),  Y_h = A_h V_j                                   (4.2–4.5)
//   S_h = cap(s Q_h K_jᵀ) + ALiBi, M: causal ∩ sliding window, sinks in the denominator
//         (SPEC "Score variants used by real models"; each off unless configured)
//   O = [Y_1 | … | Y_{H_q}] W_O   [B, T, d]                                 (4.5)
// Weights are row-major: W_Q [d, H_q·d_h], W_K and W_V [d, H_kv·d_h], W_O [H_q·d_h, d].
// Projections go through OpenBLAS sgemm; those of at most 8 rows (a decode step: step(), or a
// prefill of batch · seq ≤ 8 rows) through the layer's own product, which reads W_Q, W_K, W_V in
// one pass (then W_O), in fixed-size reduction chunks summed in a fixed order, on
// config.attention.threads (its bits do not depend on the thread count). Attention goes through
// attention_forward/backward/decode.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "tokenmix/attention.hpp"
#include "tokenmix/kv_cache.hpp"  // KVCache, kv_cache_bytes
#include "tokenmix/rope.hpp"

namespace tokenmix {

struct LayerConfig {
  std::int64_t d_model = 0;         ///< d
  std::int64_t heads_q = 0;         ///< H_q
  std::int64_t heads_kv = 0;        ///< H_kv (divides H_q)
  std::int64_t head_dim = 0;        ///< d_h
  std::optional<RopeOptions> rope;  ///< rotary embedding of Q and K (position_offset ignored)
  /// scale, threads, isa and the score variants window, softcap, alibi_slopes [H_q] and sinks
  /// [H_q] (they apply in forward/backward and in prefill/step); causal and align must keep their
  /// defaults (causal, bottom_right); mask and key_lengths must be empty (a layer has no
  /// per-call mask). The constructor copies the values of alibi_slopes and sinks: the views given
  /// here need only live until it returns, and config().attention's views point to the layer's
  /// own contiguous copies.
  AttentionOptions attention;
};

/// Gradients of one backward call; every buffer is overwritten.
struct LayerGradients {
  std::vector<float> d_u;    ///< [B, T, d]
  std::vector<float> d_w_q;  ///< [d, H_q·d_h]
  std::vector<float> d_w_k;  ///< [d, H_kv·d_h]
  std::vector<float> d_w_v;  ///< [d, H_kv·d_h]
  std::vector<float> d_w_o;  ///< [H_q·d_h, d]
  /// [H_q] dσ_h of the attention sinks (SPEC "Score variants": sinks); empty without sinks.
  std::vector<float> d_sinks;
};

class CausalSelfAttention {
 public:
  /// Validates the configuration (positive sizes, H_q % H_kv == 0, even d_h and a finite
  /// positive base with RoPE; attention options: scale finite in float32, threads >= 0, causal
  /// bottom_right, isa a known value that runs here unless automatic, window >= 1, softcap
  /// finite and > 0 in float32, alibi_slopes and sinks rank 1 [H_q] f32 (values are data), no
  /// mask or key_lengths) and allocates zero weights. Throws ArgumentError (UnsupportedError for
  /// a forced isa this CPU or build lacks, or a non-f32 alibi_slopes / sinks).
  explicit CausalSelfAttention(const LayerConfig& config);
  /// Copies and moves keep config().attention's ALiBi / sinks views on the object's own copies.
  CausalSelfAttention(const CausalSelfAttention& other);
  CausalSelfAttention(CausalSelfAttention&& other) noexcept;
  CausalSelfAttention& operator=(const CausalSelfAttention& other);
  CausalSelfAttention& operator=(CausalSelfAttention&& other) noexcept;
  ~CausalSelfAttention() = default;

  const LayerConfig& config() const noexcept { return config_; }

  std::span<float> w_q() noexcept { return w_q_; }
  std::span<float> w_k() noexcept { return w_k_; }
  std::span<float> w_v() noexcept { return w_v_; }
  std::span<float> w_o() noexcept { return w_o_; }
  std::span<const float> w_q() const noexcept { return w_q_; }
  std::span<const float> w_k() const noexcept { return w_k_; }
  std::span<const float> w_v() const noexcept { return w_v_; }
  std::span<const float> w_o() const noexcept { return w_o_; }

  /// Fills the weights with seeded random values, N(0, 1/fan_in)-like (deterministic per seed).
  void init_random(std::uint64_t seed);

  /// O = layer(U). u and out are [batch, seq, d] row-major. Saves what backward needs.
  void forward(std::span<const float> u, std::int64_t batch, std::int64_t seq,
               std::span<float> out);

  /// From dO [batch, seq, d] of the most recent forward, computes dU and the four weight
  /// gradients. Throws ArgumentError if no forward was run or d_out has the wrong size.
  void backward(std::span<const float> d_out, LayerGradients& grads);

  /// Inference (nothing is saved for backward). For sequences first_seq … first_seq + batch − 1
  /// of `cache`: computes Q, K, V of `seq` new tokens each, rotates them (RoPE position of new
  /// token t of sequence b = cache.length(b, layer) + t), appends K and V to layer `layer` of the
  /// cache and writes O for the new tokens, attending to everything cached with the bottom-right
  /// causal mask (SPEC 4.3) and the configured score variants. u and out are [batch, seq, d]. A
  /// prefill into empty sequences runs attention_forward on the fresh fp32 K/V (not on a quantized
  /// int8 / fp8_e4m3 cache: there every prefill appends, then attention_decode reads x̂ from the
  /// cache, and a NaN or ±∞ in K or V is an ArgumentError); otherwise
  /// attention_decode reads the cache (on a rolling cache in pieces of at most
  /// retained_positions() − window + 1 tokens, append then decode, so every query's keys are
  /// still held). Prefill of P tokens followed by S step() calls gives forward() over P + S
  /// tokens (up to rounding, and to the cache's element type). A rolling cache (KVCacheConfig::
  /// window = W) needs a layer window ≤ W. Throws, with the cache unchanged byte for byte, if
  /// the cache does not match the layer (heads_kv, head_dim, rolling window), the layer index
  /// or sequences are out of range, a sequence was released, the new tokens do not fit, the
  /// kernel path cannot be resolved (TOKENMIX_ISA invalid or naming a path this CPU lacks), or
  /// the decode scratch cannot be allocated (ResourceError): all of these are checked, and the
  /// scratch reserved, before the cache changes.
  void prefill(std::span<const float> u, std::int64_t batch, std::int64_t seq, KVCache& cache,
               std::int64_t layer, std::span<float> out, std::int64_t first_seq = 0);
  /// One new token per sequence (prefill with seq = 1): u and out are [batch, d].
  void step(std::span<const float> u, std::int64_t batch, KVCache& cache, std::int64_t layer,
            std::span<float> out, std::int64_t first_seq = 0);

  /// Attention-core tensors saved by the last forward (post-RoPE Q and K, V, the per-head
  /// output Y before W_O, and its row log-sum-exp). Exposed for checks and benchmarks.
  struct Saved {
    std::int64_t batch = 0, seq = 0;
    std::vector<float> u;    ///< [B, T, d]
    std::vector<float> q;    ///< [B, T, H_q, d_h]  (after RoPE)
    std::vector<float> k;    ///< [B, T, H_kv, d_h] (after RoPE)
    std::vector<float> v;    ///< [B, T, H_kv, d_h]
    std::vector<float> y;    ///< [B, T, H_q, d_h]  attention output before W_O
    std::vector<float> lse;  ///< [B, H_q, T]
  };
  const Saved& saved() const noexcept { return saved_; }

 private:
  void bind_variant_views() noexcept;  // config_.attention's alibi/sinks views → own copies

  LayerConfig config_;
  std::vector<float> alibi_, sinks_;  // [H_q] copies of the ALiBi slopes and sinks (or empty)
  std::vector<float> w_q_, w_k_, w_v_, w_o_;
  Saved saved_;
};

}  // namespace tokenmix
