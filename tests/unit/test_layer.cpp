// tests/unit/test_layer.cpp — the causal self-attention layer (SPEC 4.1–4.5, layer.hpp): forward
// and backward against the float64 oracle and against float64 central finite differences of the
// oracle's forward; KV-cache sizing (SPEC 4.8).
//
// Bounds (u = 2^-24): the layer chains projections (inner length ≤ max(d, H·d_h) = 16), RoPE,
// attention (d_h-term scores, T-term sums) and W_O; each stage adds ≤ ~16u relative in the
// max-norm, so the forward is within ~5 stages ≈ 80u ≈ 5e-6 → bound 2e-5. The backward chains
// about twice as many stages (dY = dO W_Oᵀ, dS, dQ, dK, dV, the weight gradients with inner
// length B·T = 10, and the three-term dU) ≈ 10·16u ≈ 1e-5, and the softmax Jacobian's
// cancellation A ⊙ (dA − D) can lose a factor of a few relative to the max-norm → bound 3e-5.
// (Measured: ≈ 2e-7 for forward and backward.)
// Finite differences: h = 1e-5 central in float64 gives truncation O(h²·f''') ≈ 1e-10 and
// cancellation ≈ 1e-16·|f|/h ≈ 1e-11 — negligible against both.
#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <random>
#include <vector>

#include "test_util.hpp"

namespace tokenmix::testing {
namespace {

constexpr double kForwardBound = 2e-5;
constexpr double kBackwardBound = 3e-5;
constexpr double kFdStep = 1e-5;

struct LayerCase {
  const char* name;
  std::optional<RopePairing> rope;
};

reference::LayerWeights ref_weights(const CausalSelfAttention& layer) {
  const auto& c = layer.config();
  reference::LayerWeights w;
  w.d_model = c.d_model, w.heads_q = c.heads_q, w.heads_kv = c.heads_kv, w.head_dim = c.head_dim;
  w.use_rope = c.rope.has_value();
  if (c.rope) {
    w.pairing = c.rope->pairing == RopePairing::rotate_half ? reference::RopePairing::rotate_half
                                                            : reference::RopePairing::interleaved;
    w.rope_base = c.rope->base;
  }
  w.scale = c.attention.scale;
  w.w_q.assign(layer.w_q().begin(), layer.w_q().end());
  w.w_k.assign(layer.w_k().begin(), layer.w_k().end());
  w.w_v.assign(layer.w_v().begin(), layer.w_v().end());
  w.w_o.assign(layer.w_o().begin(), layer.w_o().end());
  return w;
}

LayerConfig small_config(std::optional<RopePairing> rope) {
  LayerConfig c;
  c.d_model = 16, c.heads_q = 4, c.heads_kv = 2, c.head_dim = 4;
  if (rope) c.rope = RopeOptions{*rope, 10000.0, 0};
  return c;
}

const LayerCase kCases[] = {{"no rope", std::nullopt},
                            {"rope rotate_half", RopePairing::rotate_half},
                            {"rope interleaved", RopePairing::interleaved}};

TEST(Layer, ForwardMatchesReference) {
  const std::int64_t B = 2, T = 5;
  for (const auto& lc : kCases) {
    SCOPED_TRACE(lc.name);
    CausalSelfAttention layer(small_config(lc.rope));
    layer.init_random(7);
    const std::int64_t d = layer.config().d_model;
    std::mt19937_64 rng(51);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<float> u(static_cast<std::size_t>(B * T * d));
    for (auto& x : u) x = dist(rng);
    std::vector<float> out(u.size(), kPoison);
    layer.forward(u, B, T, out);
    const auto ref = reference::layer_forward(ref_weights(layer), {u.begin(), u.end()}, B, T);
    EXPECT_LE(rel_err_flat(out, ref), kForwardBound);
    // init_random gives non-trivial weights (the check above would pass vacuously with zeros).
    double wmax = 0.0;
    for (float x : layer.w_o()) wmax = std::max(wmax, std::fabs(double{x}));
    EXPECT_GT(wmax, 0.0);
    // The same seed gives the same weights (deterministic per seed).
    CausalSelfAttention again(small_config(lc.rope));
    again.init_random(7);
    EXPECT_TRUE(std::equal(again.w_q().begin(), again.w_q().end(), layer.w_q().begin()));
  }
}

TEST(Layer, LongerSequenceForwardMatchesReference) {
  // A wider layer (d = 64, H_q = 8, H_kv = 2, d_h = 8) over T = 33 with Llama-3 RoPE base.
  LayerConfig c;
  c.d_model = 64, c.heads_q = 8, c.heads_kv = 2, c.head_dim = 8;
  c.rope = RopeOptions{RopePairing::rotate_half, 500000.0, 0};
  CausalSelfAttention layer(c);
  layer.init_random(3);
  const std::int64_t B = 1, T = 33;
  std::mt19937_64 rng(52);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> u(static_cast<std::size_t>(B * T * c.d_model));
  for (auto& x : u) x = dist(rng);
  std::vector<float> out(u.size(), kPoison);
  layer.forward(u, B, T, out);
  const auto ref = reference::layer_forward(ref_weights(layer), {u.begin(), u.end()}, B, T);
  // Inner lengths up to 64 here: γ_64 ≈ 64u per projection; 2e-5 still holds with margin ~3.
  EXPECT_LE(rel_err_flat(out, ref), kForwardBound);
}

TEST(Layer, BackwardMatchesReferenceAndFiniteDifferences) {
  const std::int64_t B = 2, T = 5;
  for (const auto& lc : kCases) {
    SCOPED_TRACE(lc.name);
    CausalSelfAttention layer(small_config(lc.rope));
    layer.init_random(11);
    const std::int64_t d = layer.config().d_model;
    std::mt19937_64 rng(53);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<float> u(static_cast<std::size_t>(B * T * d)), dout(u.size());
    for (auto& x : u) x = dist(rng);
    for (auto& x : dout) x = dist(rng);
    std::vector<float> out(u.size(), kPoison);
    layer.forward(u, B, T, out);
    LayerGradients grads;
    layer.backward(dout, grads);

    auto w = ref_weights(layer);
    const std::vector<double> u64(u.begin(), u.end()), dout64(dout.begin(), dout.end());
    const auto ref = reference::layer_backward(w, u64, B, T, dout64);
    ASSERT_EQ(grads.d_u.size(), ref.d_u.size());
    ASSERT_EQ(grads.d_w_q.size(), ref.d_w_q.size());
    ASSERT_EQ(grads.d_w_k.size(), ref.d_w_k.size());
    ASSERT_EQ(grads.d_w_v.size(), ref.d_w_v.size());
    ASSERT_EQ(grads.d_w_o.size(), ref.d_w_o.size());
    EXPECT_LE(rel_err_flat(grads.d_u, ref.d_u), kBackwardBound);
    EXPECT_LE(rel_err_flat(grads.d_w_q, ref.d_w_q), kBackwardBound);
    EXPECT_LE(rel_err_flat(grads.d_w_k, ref.d_w_k), kBackwardBound);
    EXPECT_LE(rel_err_flat(grads.d_w_v, ref.d_w_v), kBackwardBound);
    EXPECT_LE(rel_err_flat(grads.d_w_o, ref.d_w_o), kBackwardBound);

    // Central finite differences of loss(θ) = ⟨dO, layer_forward(θ)⟩ in float64, for every
    // entry of U and of each weight matrix.
    auto loss = [&](const reference::LayerWeights& ww, const std::vector<double>& uu) {
      const auto o = reference::layer_forward(ww, uu, B, T);
      double s = 0.0;
      for (std::size_t i = 0; i < o.size(); ++i) s += dout64[i] * o[i];
      return s;
    };
    auto fd_of = [&](std::vector<double>& param) {
      return testkit::central_differences(
          param, [&] { return loss(w, u64); }, kFdStep);
    };
    std::vector<double> u_var = u64;
    const std::vector<double> fd_u = testkit::central_differences(
        u_var, [&] { return loss(w, u_var); }, kFdStep);
    const auto fd_wq = fd_of(w.w_q), fd_wk = fd_of(w.w_k), fd_wv = fd_of(w.w_v),
               fd_wo = fd_of(w.w_o);
    // The oracle's analytic backward agrees with its finite differences to ~1e-9 ...
    EXPECT_LE(rel_err_flat(ref.d_u, fd_u), 1e-8);
    EXPECT_LE(rel_err_flat(ref.d_w_q, fd_wq), 1e-8);
    EXPECT_LE(rel_err_flat(ref.d_w_k, fd_wk), 1e-8);
    EXPECT_LE(rel_err_flat(ref.d_w_v, fd_wv), 1e-8);
    EXPECT_LE(rel_err_flat(ref.d_w_o, fd_wo), 1e-8);
    // ... and ours within the fp32 backward bound.
    EXPECT_LE(rel_err_flat(grads.d_u, fd_u), kBackwardBound);
    EXPECT_LE(rel_err_flat(grads.d_w_q, fd_wq), kBackwardBound);
    EXPECT_LE(rel_err_flat(grads.d_w_k, fd_wk), kBackwardBound);
    EXPECT_LE(rel_err_flat(grads.d_w_v, fd_wv), kBackwardBound);
    EXPECT_LE(rel_err_flat(grads.d_w_o, fd_wo), kBackwardBound);

    // A second backward from the same forward overwrites (does not accumulate into) grads.
    LayerGradients again = grads;
    layer.backward(dout, again);
    EXPECT_EQ(again.d_u, grads.d_u);
    EXPECT_EQ(again.d_w_q, grads.d_w_q);
    EXPECT_EQ(again.d_w_o, grads.d_w_o);
  }
}

TEST(Layer, KvCacheBytes) {
  // SPEC 4.8: bytes = 2 · n · B · T · H_kv · d_h · sizeof(element).
  // Llama-3-8B: n = 32 layers, H_kv = 8, d_h = 128, fp16 → 2·32·8·128·2 = 131072 bytes per token.
  EXPECT_EQ(kv_cache_bytes(32, 1, 1, 8, 128, 2), 131072u);
  EXPECT_EQ(kv_cache_bytes(32, 1, 8192, 8, 128, 2), 131072ull * 8192);      // 1 GiB at 8k tokens
  EXPECT_EQ(kv_cache_bytes(32, 4, 8192, 8, 128, 2), 4ull * 131072 * 8192);  // linear in B
  // The same model as MHA (H_kv = H_q = 32) needs g = 32/8 = 4 times as much.
  EXPECT_EQ(kv_cache_bytes(32, 1, 1, 32, 128, 2), 4u * 131072u);
  EXPECT_EQ(kv_cache_bytes(32, 1, 1, 1, 128, 4), 2u * 32u * 128u * 4u);  // MQA, fp32
  EXPECT_EQ(kv_cache_bytes(32, 0, 100, 8, 128, 2), 0u);                  // empty batch
  // Products that do not fit in 64 bits throw ArgumentError(overflow) instead of wrapping.
  const std::int64_t big = std::int64_t{1} << 40;
  try {
    (void)kv_cache_bytes(32, big, big, 8, 128, 2);
    ADD_FAILURE() << "no exception for an overflowing product";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.code(), ErrorCode::overflow) << e.what();
  }
  try {
    (void)kv_cache_bytes(std::numeric_limits<std::int64_t>::max(), 1, 1, 1, 1, 2);
    ADD_FAILURE() << "no exception for 2·n overflowing";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.code(), ErrorCode::overflow) << e.what();
  }
}

}  // namespace
}  // namespace tokenmix::testing
