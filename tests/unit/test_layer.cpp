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
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kv_oracle.hpp"
#include "test_util.hpp"
#include "tokenmix/kv_cache.hpp"

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

// ---- score variants in the layer (SPEC "Score variants used by real models") ----

template <class Err>
void expect_config_error(const LayerConfig& c, ErrorCode code, const std::string& needle) {
  try {
    CausalSelfAttention layer(c);
    ADD_FAILURE() << "accepted a bad config (" << needle << ")";
  } catch (const Err& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  } catch (const Error& e) {
    ADD_FAILURE() << "wrong error type for " << needle << ": " << e.what();
  }
}

// Every option is validated in the constructor, with the argument named; masks and key lengths
// (per-call inputs) are not layer options.
TEST(LayerVariants, ConstructorValidatesEveryOption) {
  using AE = ArgumentError;
  const LayerConfig base = small_config(std::nullopt);  // H_q = 4
  std::vector<float> four{0.5f, 0.25f, 0.125f, 0.0625f}, three{1, 2, 3}, bad{0, 1, NAN, 2};
  std::vector<std::int32_t> ints{1, 2, 3, 4};
  const auto vec = [](const void* p, std::int64_t n, DType dt = DType::f32, int rank = 1) {
    return ConstTensorView{p, dt, rank, {n, 1, 1, 1}, {1, 1, 1, 1}};
  };
  LayerConfig c = base;
  c.attention.window = 0;
  expect_config_error<AE>(c, ErrorCode::invalid_argument, "config.attention.window");
  for (double cap : {0.0, -1.0, double(NAN), double(INFINITY), 1e-50, 1e300}) {
    c = base;
    c.attention.softcap = cap;
    expect_config_error<AE>(c, ErrorCode::invalid_argument, "config.attention.softcap");
  }
  for (const char* which : {"alibi_slopes", "sinks"}) {
    const std::string name = std::string("config.attention.") + which;
    auto with = [&](ConstTensorView v) {
      LayerConfig x = base;
      (std::string(which) == "sinks" ? x.attention.sinks : x.attention.alibi_slopes) = v;
      return x;
    };
    expect_config_error<AE>(with(vec(three.data(), 3)), ErrorCode::shape_mismatch, name);
    expect_config_error<AE>(with(vec(four.data(), 4, DType::f32, 2)), ErrorCode::shape_mismatch,
                            name);
    EXPECT_NO_THROW(CausalSelfAttention{with(vec(bad.data(), 4))});  // values are data (NaN)
    expect_config_error<UnsupportedError>(with(vec(ints.data(), 4, DType::i32)),
                                          ErrorCode::unsupported, name);
    EXPECT_NO_THROW(CausalSelfAttention{with(vec(four.data(), 4))});
  }
  std::vector<std::uint8_t> mask(16, 1);
  c = base;
  c.attention.mask = ConstTensorView{mask.data(), DType::boolean, 4, {1, 1, 4, 4}, {0, 0, 4, 1}};
  expect_config_error<AE>(c, ErrorCode::invalid_argument, "config.attention.mask");
  c = base;
  std::vector<std::int64_t> lens{3};
  c.attention.key_lengths = vec(lens.data(), 1, DType::i64);
  expect_config_error<AE>(c, ErrorCode::invalid_argument, "key_lengths");
}

// The layer copies the ALiBi slopes and sinks (documented in layer.hpp): the caller's buffers
// need not outlive the constructor, and copies / moves keep views on their own values.
TEST(LayerVariants, OwnsCopiesOfAlibiAndSinks) {
  LayerConfig c = small_config(std::nullopt);
  std::optional<CausalSelfAttention> layer;
  {
    std::vector<float> slopes{0, 9, 1, 9, 2, 9, 3, 9}, sinks{-1, 0, 1, 2};  // slopes: stride 2
    c.attention.alibi_slopes = ConstTensorView{slopes.data(), DType::f32, 1, {4, 1, 1, 1}, {2}};
    c.attention.sinks = ConstTensorView{sinks.data(), DType::f32, 1, {4, 1, 1, 1}, {1}};
    layer.emplace(c);
    std::fill(slopes.begin(), slopes.end(), -7.0f);
    std::fill(sinks.begin(), sinks.end(), -7.0f);
  }
  auto values = [](const ConstTensorView& v) {
    std::vector<float> x;
    for (std::int64_t i = 0; i < v.dim(0); ++i)
      x.push_back(static_cast<const float*>(v.data)[i * v.stride(0)]);
    return x;
  };
  const std::vector<float> want_slopes{0, 1, 2, 3}, want_sinks{-1, 0, 1, 2};
  EXPECT_EQ(values(layer->config().attention.alibi_slopes), want_slopes);
  EXPECT_EQ(values(layer->config().attention.sinks), want_sinks);
  CausalSelfAttention copy(*layer);
  EXPECT_NE(copy.config().attention.sinks.data, layer->config().attention.sinks.data);
  CausalSelfAttention moved(std::move(*layer));
  layer.reset();
  EXPECT_EQ(values(copy.config().attention.alibi_slopes), want_slopes);
  EXPECT_EQ(values(moved.config().attention.sinks), want_sinks);
  CausalSelfAttention assigned(small_config(std::nullopt));
  assigned = copy;
  EXPECT_EQ(values(assigned.config().attention.alibi_slopes), want_slopes);
  EXPECT_NE(assigned.config().attention.alibi_slopes.data,
            copy.config().attention.alibi_slopes.data);
  CausalSelfAttention plain(small_config(std::nullopt));
  EXPECT_TRUE(plain.config().attention.sinks.empty());
}

// The layer in double: Q, K, V = U W (4.1), RoPE, attention with the variants (reference), W_O.
struct LayerOracle {
  Tensor64 q, k, v;         // [1, T, H, d_h], after RoPE
  std::vector<double> out;  // [T, d]
  reference::Options opts;
};

// out = Y W_O (4.5) in double: Y the attention output [1, T, H_q, d_h], out [T, d].
std::vector<double> output_projection(const CausalSelfAttention& layer, const Tensor64& y) {
  const std::int64_t T = y.shape[1], dh = y.shape[3], qw = y.shape[2] * dh;
  const std::int64_t d = layer.config().d_model;
  std::vector<double> out(static_cast<std::size_t>(T * d), 0.0);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t n = 0; n < qw; ++n) {
      const double yv = y.at(0, t, n / dh, n % dh);
      for (std::int64_t i = 0; i < d; ++i)
        out[static_cast<std::size_t>(t * d + i)] +=
            yv * layer.w_o()[static_cast<std::size_t>(n * d + i)];
    }
  return out;
}

LayerOracle layer_oracle(const CausalSelfAttention& layer, std::span<const float> u, std::int64_t T,
                         const reference::Options& o) {
  const auto& c = layer.config();
  const std::int64_t d = c.d_model, dh = c.head_dim;
  LayerOracle r{Tensor64({1, T, c.heads_q, dh}),
                Tensor64({1, T, c.heads_kv, dh}),
                Tensor64({1, T, c.heads_kv, dh}),
                {},
                o};
  auto project = [&](std::span<const float> w, Tensor64& x, std::int64_t H) {
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t n = 0; n < H * dh; ++n) {
        double acc = 0.0;
        for (std::int64_t i = 0; i < d; ++i)
          acc += static_cast<double>(u[static_cast<std::size_t>(t * d + i)]) *
                 w[static_cast<std::size_t>(i * H * dh + n)];
        x.at(0, t, n / dh, n % dh) = acc;
      }
  };
  project(layer.w_q(), r.q, c.heads_q);
  project(layer.w_k(), r.k, c.heads_kv);
  project(layer.w_v(), r.v, c.heads_kv);
  if (c.rope) {
    const auto pairing = c.rope->pairing == RopePairing::rotate_half
                             ? reference::RopePairing::rotate_half
                             : reference::RopePairing::interleaved;
    r.q = reference::rope(r.q, pairing, c.rope->base, 0);
    r.k = reference::rope(r.k, pairing, c.rope->base, 0);
  }
  r.out = output_projection(layer, reference::attention_forward(r.q, r.k, r.v, o).out);
  return r;
}

// The K/V rows a KVCache held for one sequence, read back (kv_oracle.hpp: cached_row; bf16 / f16
// widened, int8 / fp8 dequantized) after each call, before a rolling cache drops them, and which
// queries attended the fresh fp32 K/V instead: those of a call into an empty sequence on an
// unquantized cache (layer.hpp: prefill). Each call's queries are checked against the keys as
// they were held at that call: a quantized cache's K changes when its 64-position tile closes
// (SPEC "Quantized KV cache": held unquantized while open), so a later call attends other values
// for the same earlier positions.
struct HeldSequence {
  struct Call {
    std::int64_t from, to;  // the call's query positions
    Tensor64 k, v;          // [1, to, H_kv, d_h]: positions [0, to) as held after it
  };
  std::int64_t hkv, dh;
  std::vector<Call> calls;
  std::vector<bool> fresh;  // [T]
  HeldSequence(std::int64_t T, std::int64_t hkv_, std::int64_t dh_)
      : hkv(hkv_), dh(dh_), fresh(static_cast<std::size_t>(T), false) {}
  // A call's queries [from, to) of sequence b: the keys [0, to) as the cache holds them now (from
  // its first position; older ones, outside every window, zeros).
  void read_back(const KVCache& cache, std::int64_t b, std::int64_t from, std::int64_t to) {
    Call c{from, to, Tensor64({1, to, hkv, dh}), Tensor64({1, to, hkv, dh})};
    for (std::int64_t p = cache.first_position(b, 0); p < to; ++p)
      for (std::int64_t j = 0; j < hkv; ++j) {
        const auto kr = cached_row(cache, 0, b, p, j, false);
        const auto vr = cached_row(cache, 0, b, p, j, true);
        for (std::int64_t x = 0; x < dh; ++x) {
          c.k.at(0, p, j, x) = kr[static_cast<std::size_t>(x)];
          c.v.at(0, p, j, x) = vr[static_cast<std::size_t>(x)];
        }
      }
    calls.push_back(std::move(c));
  }
  // The layer's output [T, d] in double with each query over the K/V it attended: the oracle's
  // (fresh) or those its call held, through the oracle's options and W_O.
  std::vector<double> expected(const CausalSelfAttention& layer, const LayerOracle& ref) const {
    const Tensor64 y_fresh = reference::attention_forward(ref.q, ref.k, ref.v, ref.opts).out;
    Tensor64 y = y_fresh;
    const std::int64_t hq = y.shape[2];
    for (const Call& c : calls) {  // bottom-right: query i at position from + i
      Tensor64 q({1, c.to - c.from, hq, dh});
      for (std::int64_t t = c.from; t < c.to; ++t)
        for (std::int64_t n = 0; n < hq * dh; ++n)
          q.at(0, t - c.from, n / dh, n % dh) = ref.q.at(0, t, n / dh, n % dh);
      const Tensor64 yc = reference::attention_forward(q, c.k, c.v, ref.opts).out;
      for (std::int64_t t = c.from; t < c.to; ++t)
        for (std::int64_t n = 0; n < hq * dh; ++n)
          if (!fresh[static_cast<std::size_t>(t)])
            y.at(0, t, n / dh, n % dh) = yc.at(0, t - c.from, n / dh, n % dh);
    }
    return output_projection(layer, y);
  }
};

// The variant layer config of the tests below, and its oracle options.
struct VariantLayer {
  std::vector<float> slopes, sinks;
  LayerConfig config;
  reference::Options oracle;
  explicit VariantLayer(Isa isa, std::int64_t window = 40) {
    config.d_model = 64, config.heads_q = 8, config.heads_kv = 2, config.head_dim = 16;
    config.rope = RopeOptions{RopePairing::rotate_half, 10000.0, 0};
    config.attention.isa = isa;
    config.attention.window = oracle.window = window;
    config.attention.softcap = oracle.softcap = 4.0;
    for (int h = 0; h < 8; ++h) {
      slopes.push_back(static_cast<float>(std::exp2(-(h + 1))));
      sinks.push_back(-1.0f + 0.5f * static_cast<float>(h));
    }
    config.attention.alibi_slopes =
        ConstTensorView{slopes.data(), DType::f32, 1, {8, 1, 1, 1}, {1}};
    config.attention.sinks = ConstTensorView{sinks.data(), DType::f32, 1, {8, 1, 1, 1}, {1}};
    oracle.alibi_slopes.assign(slopes.begin(), slopes.end());
    oracle.sinks.assign(sinks.begin(), sinks.end());
  }
};

class LayerVariantsIsa : public PerIsaTest {};

// prefill / step with window, soft-capping, ALiBi and sinks against the float64 layer with the
// same options, on plain and rolling (KVCacheConfig::window = 40, ring R = 128) caches,
// contiguous and paged, every cache dtype: two sequences seeded with P_b = 1 and 5 positions
// (the oracle's K/V), then a chunk of 150 tokens for both (bottom-right against different
// lengths; on the rolling cache in pieces of R − W + 1 = 89), then 5 steps.
// Plain caches: the oracle attends over the K/V rows the cache holds (HeldSequence, read back
// after each call), so every dtype is held to the fp32 forward bound (2e-5). Rolling caches drop
// rows within the chunk's call (its first pieces' keys are overwritten by its last), so they
// cannot be read back: the oracle's own K/V, with the bounds of test_kv_cache.cpp for the
// cache's rounding (bf16 / f16: 2·u_e; int8 / fp8: the quantization's error).
TEST_P(LayerVariantsIsa, PrefillAndStepsMatchFloat64) {
  VariantLayer vl(GetParam());
  CausalSelfAttention layer(vl.config);
  layer.init_random(77);
  const std::int64_t d = 64, chunk = 150, steps = 5, P[2] = {1, 5};
  std::mt19937_64 rng(78);
  std::normal_distribution<float> dist;
  std::vector<float> u[2];
  LayerOracle ref[2];
  for (int b = 0; b < 2; ++b) {
    u[b].resize(static_cast<std::size_t>((P[b] + chunk + steps) * d));
    for (float& x : u[b]) x = dist(rng);
    ref[b] = layer_oracle(layer, u[b], P[b] + chunk + steps, vl.oracle);
  }
  for (DType dtype : {DType::f32, DType::bf16, DType::f16, DType::int8, DType::fp8_e4m3}) {
    // Rolling caches: the rounding of the cache's values against the oracle's.
    const double rolling_bound = dtype == DType::f32    ? 1e-4
                                 : dtype == DType::bf16 ? 0x1.0p-8
                                 : dtype == DType::f16  ? 0x1.0p-11
                                 : dtype == DType::int8 ? 0x1.0p-6
                                                        : 0x1.0p-4;
    for (std::int64_t block : {0, 64})
      for (std::int64_t rolling : {0, 40}) {
        SCOPED_TRACE(std::string(to_string(dtype)) + " block=" + std::to_string(block) +
                     " cache window=" + std::to_string(rolling));
        KVCache cache({1, 2, 2, 16, 1000, dtype, block, 0, rolling});
        std::vector<HeldSequence> held;
        for (int b = 0; b < 2; ++b) {  // seed: the oracle's post-RoPE K and V
          held.emplace_back(P[b] + chunk + steps, 2, 16);
          std::vector<float> k(static_cast<std::size_t>(P[b] * 2 * 16)), v(k.size());
          for (std::size_t i = 0; i < k.size(); ++i) {
            k[i] = static_cast<float>(ref[b].k.data[i]);
            v[i] = static_cast<float>(ref[b].v.data[i]);
          }
          cache.append(0, b, ConstTensorView::bthd(k.data(), 1, P[b], 2, 16),
                       ConstTensorView::bthd(v.data(), 1, P[b], 2, 16));
          if (!rolling) held[b].read_back(cache, b, 0, P[b]);
        }
        std::vector<float> got[2];
        for (int b = 0; b < 2; ++b) got[b].assign(u[b].size(), kPoison);
        std::vector<float> ub(static_cast<std::size_t>(2 * chunk * d)), ob(ub.size(), kPoison);
        for (int b = 0; b < 2; ++b)
          std::copy_n(u[b].begin() + P[b] * d, chunk * d, ub.begin() + b * chunk * d);
        layer.prefill(ub, 2, chunk, cache, 0, ob);
        for (int b = 0; b < 2; ++b) {
          std::copy_n(ob.begin() + b * chunk * d, chunk * d, got[b].begin() + P[b] * d);
          if (!rolling) held[b].read_back(cache, b, P[b], P[b] + chunk);
        }
        for (std::int64_t s = 0; s < steps; ++s) {
          std::vector<float> us(static_cast<std::size_t>(2 * d)), os(us.size(), kPoison);
          for (int b = 0; b < 2; ++b)
            std::copy_n(u[b].begin() + (P[b] + chunk + s) * d, d, us.begin() + b * d);
          layer.step(us, 2, cache, 0, os);
          for (int b = 0; b < 2; ++b) {
            std::copy_n(os.begin() + b * d, d, got[b].begin() + (P[b] + chunk + s) * d);
            const std::int64_t p = P[b] + chunk + s;
            if (!rolling) held[b].read_back(cache, b, p, p + 1);
          }
        }
        for (int b = 0; b < 2; ++b) {
          EXPECT_EQ(cache.length(b), P[b] + chunk + steps);
          if (rolling) {
            EXPECT_EQ(cache.first_position(b), P[b] + chunk + steps - 128);
          }
          const std::vector<double> want = rolling ? ref[b].out : held[b].expected(layer, ref[b]);
          const std::size_t from = static_cast<std::size_t>(P[b] * d);
          const std::vector<float> g(got[b].begin() + from, got[b].end());
          const std::vector<double> r(want.begin() + from, want.end());
          EXPECT_LE(rel_err_flat(g, r), rolling ? rolling_bound : kForwardBound)
              << "sequence " << b;
        }
      }
  }
}

// Layer prefill / step with the variants equals the layer's forward with the same variants:
// fresh prefills of P_b = 37 and 70 tokens (attention_forward on the fresh K/V), a chunk of 100
// tokens for both (attention_decode; on the rolling cache in pieces of 89), then 5 steps, against
// one forward over all tokens — plain and rolling caches, contiguous and paged, every dtype.
// Bounds as in test_kv_cache.cpp (fp32 1e-5: the same fp32 arithmetic in another order).
TEST_P(LayerVariantsIsa, PrefillAndStepsEqualForwardWithTheSameVariants) {
  VariantLayer vl(GetParam());
  CausalSelfAttention layer(vl.config);
  layer.init_random(79);
  const std::int64_t d = 64, chunk = 100, steps = 5, P[2] = {37, 70};
  std::mt19937_64 rng(80);
  std::normal_distribution<float> dist;
  std::vector<float> u[2], full[2];
  for (int b = 0; b < 2; ++b) {
    const std::int64_t T = P[b] + chunk + steps;
    u[b].resize(static_cast<std::size_t>(T * d));
    for (float& x : u[b]) x = dist(rng);
    full[b].assign(u[b].size(), kPoison);
    layer.forward(u[b], 1, T, full[b]);
  }
  for (DType dtype : {DType::f32, DType::bf16, DType::f16, DType::int8, DType::fp8_e4m3}) {
    const double bound = dtype == DType::f32    ? 1e-5
                         : dtype == DType::bf16 ? 0x1.0p-8
                         : dtype == DType::f16  ? 0x1.0p-11
                         : dtype == DType::int8 ? 0x1.0p-6
                                                : 0x1.0p-4;
    for (std::int64_t block : {0, 64})
      for (std::int64_t rolling : {0, 40}) {
        SCOPED_TRACE(std::string(to_string(dtype)) + " block=" + std::to_string(block) +
                     " cache window=" + std::to_string(rolling));
        KVCache cache({1, 2, 2, 16, 1000, dtype, block, 0, rolling});
        std::vector<float> got[2];
        for (int b = 0; b < 2; ++b) {
          got[b].assign(u[b].size(), kPoison);
          const auto rows = static_cast<std::size_t>(P[b] * d);
          layer.prefill(std::span(u[b]).first(rows), 1, P[b], cache, 0,
                        std::span(got[b]).first(rows), b);
        }
        std::vector<float> ub(static_cast<std::size_t>(2 * chunk * d)), ob(ub.size(), kPoison);
        for (int b = 0; b < 2; ++b)
          std::copy_n(u[b].begin() + P[b] * d, chunk * d, ub.begin() + b * chunk * d);
        layer.prefill(ub, 2, chunk, cache, 0, ob);
        for (int b = 0; b < 2; ++b)
          std::copy_n(ob.begin() + b * chunk * d, chunk * d, got[b].begin() + P[b] * d);
        for (std::int64_t s = 0; s < steps; ++s) {
          std::vector<float> us(static_cast<std::size_t>(2 * d)), os(us.size(), kPoison);
          for (int b = 0; b < 2; ++b)
            std::copy_n(u[b].begin() + (P[b] + chunk + s) * d, d, us.begin() + b * d);
          layer.step(us, 2, cache, 0, os);
          for (int b = 0; b < 2; ++b)
            std::copy_n(os.begin() + b * d, d, got[b].begin() + (P[b] + chunk + s) * d);
        }
        for (int b = 0; b < 2; ++b) EXPECT_LE(rel_err_flat(got[b], full[b]), bound) << b;
      }
  }
}

// forward with the variants against the float64 layer, and backward's d_sinks against the
// oracle's dσ (SPEC "Score variants": sinks) through dY = dO W_Oᵀ.
TEST_P(LayerVariantsIsa, ForwardAndSinkGradientMatchFloat64) {
  VariantLayer vl(GetParam(), 23);
  CausalSelfAttention layer(vl.config);
  layer.init_random(81);
  const std::int64_t d = 64, T = 90, qw = 8 * 16;
  std::mt19937_64 rng(82);
  std::normal_distribution<float> dist;
  std::vector<float> u(static_cast<std::size_t>(T * d)), dout(u.size()), out(u.size(), kPoison);
  for (float& x : u) x = dist(rng);
  for (float& x : dout) x = dist(rng);
  layer.forward(u, 1, T, out);
  const LayerOracle ref = layer_oracle(layer, u, T, vl.oracle);
  EXPECT_LE(rel_err_flat(out, ref.out), 1e-5);
  LayerGradients g;
  layer.backward(dout, g);
  Tensor64 dy({1, T, 8, 16});
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t n = 0; n < qw; ++n) {
      double acc = 0.0;
      for (std::int64_t i = 0; i < d; ++i)
        acc += static_cast<double>(dout[static_cast<std::size_t>(t * d + i)]) *
               layer.w_o()[static_cast<std::size_t>(n * d + i)];
      dy.at(0, t, n / 16, n % 16) = acc;
    }
  const auto rb = reference::attention_backward(ref.q, ref.k, ref.v, dy, vl.oracle);
  ASSERT_EQ(g.d_sinks.size(), 8u);
  EXPECT_LE(rel_err_flat(g.d_sinks, rb.dsinks), 1e-4);
  CausalSelfAttention plain(small_config(std::nullopt));
  std::vector<float> u16(16 * 3, 0.5f), o16(u16.size());
  plain.forward(u16, 1, 3, o16);
  LayerGradients pg;
  plain.backward(o16, pg);
  EXPECT_TRUE(pg.d_sinks.empty());
}

// Random layers through prefill and step against the float64 layer over the values the cache
// holds: 12 draws per path from one fixed seed of d (8 … 72), H_kv, the GQA ratio, d_h (odd
// without RoPE), RoPE (none, either pairing, base 10^4 or 5·10^5), the variants (window,
// soft-capping, ALiBi, sinks, by coins), the thread count and the cache (its dtype, contiguous or
// paged, rolling when there is a window). B = 1 … 3 sequences, either fresh or seeded with 1 …
// 40 of the oracle's K/V rows each (different lengths), then a call of 1 … 100 tokens for all, by
// a coin a prefill of 2 … 40 for some of them, and steps for all and for some.
//
// The oracle's attention reads the K/V rows the cache holds (kv_oracle.hpp: read back after each
// call, before a rolling cache drops them; bf16 / f16 widened, int8 / fp8 dequantized), except
// for the queries of a call into empty sequences on an unquantized cache, which attend over the
// fresh fp32 K/V (layer.hpp: prefill). So every cache dtype is held to the fp32 forward bound
// (2e-5; measured ≤ 1e-6 over 300 draws per path), not to its rounding: with every query over the
// cache's values, bf16 and f16 fresh prefills err by up to 2.3e-3 and 2e-4.
TEST_P(LayerVariantsIsa, RandomLayersPrefillAndStepMatchFloat64) {
  Picker pick(20261215);
  std::mt19937_64 rng(20261216);
  std::normal_distribution<float> dist;
  const DType dtypes[] = {DType::f32, DType::bf16, DType::f16, DType::int8, DType::fp8_e4m3};
  for (int draw = 0; draw < 12; ++draw) {
    LayerConfig config;
    reference::Options oracle;
    config.d_model = pick(8, 72);
    config.heads_kv = pick(1, 3);
    config.heads_q = config.heads_kv * pick(1, 4);
    const std::int64_t rope = pick(0, 2);
    if (rope == 0) {
      config.head_dim = std::array<std::int64_t, 5>{1, 3, 5, 8, 17}[pick(0, 4)];
    } else {
      config.head_dim = std::array<std::int64_t, 5>{2, 4, 8, 16, 18}[pick(0, 4)];
      config.rope = RopeOptions{rope == 1 ? RopePairing::rotate_half : RopePairing::interleaved,
                                pick(0, 1) == 0 ? 10000.0 : 500000.0, 0};
    }
    config.attention.isa = GetParam();
    config.attention.threads = static_cast<int>(pick(1, 2));
    const std::int64_t hq = config.heads_q;
    if (pick(0, 2) == 0) config.attention.window = oracle.window = pick(1, 80);
    if (pick(0, 2) == 0) {
      config.attention.softcap = oracle.softcap = std::array<double, 3>{1.5, 5.0, 30.0}[pick(0, 2)];
    }
    std::vector<float> slopes, sinks;
    if (pick(0, 2) == 0) {
      for (std::int64_t h = 0; h < hq; ++h) slopes.push_back(std::exp2(-static_cast<float>(h + 1)));
      config.attention.alibi_slopes = ConstTensorView{slopes.data(), DType::f32, 1, {hq}, {1}};
      oracle.alibi_slopes.assign(slopes.begin(), slopes.end());
    }
    if (pick(0, 2) == 0) {
      for (std::int64_t h = 0; h < hq; ++h) sinks.push_back(dist(rng));
      config.attention.sinks = ConstTensorView{sinks.data(), DType::f32, 1, {hq}, {1}};
      oracle.sinks.assign(sinks.begin(), sinks.end());
    }
    const DType dtype = dtypes[pick(0, 4)];
    const std::int64_t block = pick(0, 1) == 0 ? 0 : 64;
    const std::int64_t rolling =
        config.attention.window && pick(0, 1) == 0 ? *config.attention.window + pick(0, 30) : 0;

    // The calls: (first sequence, sequences, tokens each); P_b seeded positions.
    const std::int64_t B = pick(1, 3), d = config.d_model, hkv = config.heads_kv,
                       dh = config.head_dim;
    std::vector<std::int64_t> P(static_cast<std::size_t>(B), 0);
    if (pick(0, 1) == 0) {
      for (auto& p : P) p = pick(1, 40);
    }
    struct Call {
      std::int64_t first, nb, n;
    };
    std::vector<Call> calls{{0, B, pick(1, 100)}};
    const auto some = [&](std::int64_t n) {
      const std::int64_t first = pick(0, B - 1);
      calls.push_back({first, pick(1, B - first), n});
    };
    if (pick(0, 1) == 0) some(pick(2, 40));
    for (std::int64_t s = pick(0, 4); s > 0; --s) calls.push_back({0, B, 1});
    for (std::int64_t s = pick(0, 2); s > 0; --s) some(1);
    std::vector<std::int64_t> T = P;
    for (const Call& c : calls)
      for (std::int64_t b = c.first; b < c.first + c.nb; ++b) T[b] += c.n;

    CausalSelfAttention layer(config);
    layer.init_random(static_cast<std::uint64_t>(100 + draw));
    SCOPED_TRACE("draw " + std::to_string(draw) + ": d " + std::to_string(d) + ", H " +
                 std::to_string(hq) + "/" + std::to_string(hkv) + ", d_h " + std::to_string(dh) +
                 ", rope " + std::to_string(rope) + ", " + to_string(dtype) + ", block " +
                 std::to_string(block) + ", rolling " + std::to_string(rolling) + ", B " +
                 std::to_string(B));
    std::vector<std::vector<float>> u(static_cast<std::size_t>(B)), got(u.size());
    std::vector<LayerOracle> ref(u.size());
    std::vector<HeldSequence> held;  // what the cache held, which queries were fresh
    for (std::int64_t b = 0; b < B; ++b) {
      u[b].resize(static_cast<std::size_t>(T[b] * d));
      for (float& x : u[b]) x = dist(rng);
      ref[b] = layer_oracle(layer, u[b], T[b], oracle);
      got[b].assign(u[b].size(), kPoison);
      held.emplace_back(T[b], hkv, dh);
    }
    KVCache cache({1, B, hkv, dh, 256, dtype, block, 0, rolling});
    for (std::int64_t b = 0; b < B; ++b) {  // seed: the oracle's post-RoPE K and V
      if (P[b] == 0) continue;
      std::vector<float> k(static_cast<std::size_t>(P[b] * hkv * dh)), v(k.size());
      for (std::size_t i = 0; i < k.size(); ++i) {
        k[i] = static_cast<float>(ref[b].k.data[i]);
        v[i] = static_cast<float>(ref[b].v.data[i]);
      }
      cache.append(0, b, ConstTensorView::bthd(k.data(), 1, P[b], hkv, dh),
                   ConstTensorView::bthd(v.data(), 1, P[b], hkv, dh));
      held[b].read_back(cache, b, 0, P[b]);
    }
    std::vector<std::int64_t> at = P;  // each sequence's next position
    for (const Call& c : calls) {
      std::vector<float> ub(static_cast<std::size_t>(c.nb * c.n * d)), ob(ub.size(), kPoison);
      for (std::int64_t i = 0; i < c.nb; ++i)
        std::copy_n(u[c.first + i].begin() + at[c.first + i] * d, c.n * d,
                    ub.begin() + i * c.n * d);
      if (c.n == 1)
        layer.step(ub, c.nb, cache, 0, ob, c.first);
      else
        layer.prefill(ub, c.nb, c.n, cache, 0, ob, c.first);
      for (std::int64_t i = 0; i < c.nb; ++i) {
        const std::int64_t b = c.first + i;
        std::copy_n(ob.begin() + i * c.n * d, c.n * d, got[b].begin() + at[b] * d);
        if (at[b] == 0 && !kernels::is_quantized(dtype)) {
          std::fill_n(held[b].fresh.begin(), c.n, true);
        }
        held[b].read_back(cache, b, at[b], at[b] + c.n);
        at[b] += c.n;
      }
    }
    for (std::int64_t b = 0; b < B; ++b) {
      EXPECT_EQ(cache.length(b), T[b]);
      const std::vector<double> want = held[b].expected(layer, ref[b]);
      const std::size_t from = static_cast<std::size_t>(P[b] * d);
      const std::vector<float> g(got[b].begin() + from, got[b].end());
      const std::vector<double> r(want.begin() + from, want.end());
      EXPECT_LE(rel_err_flat(g, r), kForwardBound) << "sequence " << b;
    }
  }
}

// Decode-step projections (at most 8 rows: one pass over each weight in chunks of 128 reduction
// rows, partial products summed in chunk order) against the float64 layer: d = 301 (chunks of
// 128, 128 and 45 rows; 45 = 4·11 + 1 leaves a single-row tail), W_O with 276 = 128 + 128 + 20
// reduction rows, three sequences on an fp32 cache. Prefill of 5 tokens each (15 rows: sgemm),
// a chunk of 2 tokens each (6 rows: the step path, through attention_decode), then 4 steps of
// batch 3 and 2 of batch 1 (sequence 1 only). Bound 1e-4 as for the other fp32 prefill / step
// checks (measured ≈ 1e-7).
TEST(Layer, StepProjectionsMatchFloat64AcrossChunks) {
  LayerConfig config;
  config.d_model = 301, config.heads_q = 6, config.heads_kv = 3, config.head_dim = 46;
  config.rope = RopeOptions{RopePairing::rotate_half, 10000.0, 0};
  CausalSelfAttention layer(config);
  layer.init_random(91);
  const std::int64_t d = 301, B = 3, P = 5, chunk = 2, steps = 4;
  const std::int64_t T[3] = {P + chunk + steps, P + chunk + steps + 2, P + chunk + steps};
  std::mt19937_64 rng(92);
  std::normal_distribution<float> dist;
  std::vector<float> u[3], got[3];
  LayerOracle ref[3];
  for (int b = 0; b < B; ++b) {
    u[b].resize(static_cast<std::size_t>(T[b] * d));
    for (float& x : u[b]) x = dist(rng);
    ref[b] = layer_oracle(layer, u[b], T[b], reference::Options{});
    got[b].assign(u[b].size(), kPoison);
  }
  KVCache cache({1, B, 3, 46, 64, DType::f32});
  // Tokens [t0, t0 + n) of sequences first … first + nb − 1 through prefill (step for n = 1).
  const auto run = [&](std::int64_t first, std::int64_t nb, std::int64_t t0, std::int64_t n) {
    std::vector<float> ub(static_cast<std::size_t>(nb * n * d)), ob(ub.size(), kPoison);
    for (std::int64_t b = 0; b < nb; ++b)
      std::copy_n(u[first + b].begin() + t0 * d, n * d, ub.begin() + b * n * d);
    if (n == 1)
      layer.step(ub, nb, cache, 0, ob, first);
    else
      layer.prefill(ub, nb, n, cache, 0, ob, first);
    for (std::int64_t b = 0; b < nb; ++b)
      std::copy_n(ob.begin() + b * n * d, n * d, got[first + b].begin() + t0 * d);
  };
  run(0, B, 0, P);
  run(0, B, P, chunk);
  for (std::int64_t s = 0; s < steps; ++s) run(0, B, P + chunk + s, 1);
  for (std::int64_t s = 0; s < 2; ++s) run(1, 1, P + chunk + steps + s, 1);
  for (int b = 0; b < B; ++b) {
    EXPECT_EQ(cache.length(b), T[b]);
    EXPECT_LE(rel_err_flat(got[b], ref[b].out), 1e-4) << "sequence " << b;
  }
}

// A step's result does not depend on the thread count (config.attention.threads), bit for bit:
// the projections' sums have a fixed order (OpenBLAS 0.3.21 sgemv did not: its transposed
// product changed in the last bits between 1, 2, 3 and 4 threads). d = 1024, Q/K/V widths
// 512 + 2·256 (enough work for a team), a prefill of 3 tokens for 2 sequences (6 rows), then
// steps of batch 2 and of batch 1.
TEST(Layer, StepIsBitwiseIndependentOfThreadCount) {
  std::mt19937_64 rng(93);
  std::normal_distribution<float> dist;
  const std::int64_t d = 1024, B = 2, P = 3, steps = 3;
  std::vector<float> u(static_cast<std::size_t>(B * (P + steps + 1) * d));
  for (float& x : u) x = dist(rng);
  const auto outputs = [&](int threads) {
    LayerConfig config;
    config.d_model = d, config.heads_q = 8, config.heads_kv = 4, config.head_dim = 64;
    config.rope = RopeOptions{RopePairing::rotate_half, 10000.0, 0};
    config.attention.threads = threads;
    CausalSelfAttention layer(config);
    layer.init_random(94);
    KVCache cache({1, B, 4, 64, 16, DType::f32});
    std::vector<float> all;
    const auto run = [&](std::int64_t nb, std::int64_t n, std::int64_t t0) {
      std::vector<float> in(static_cast<std::size_t>(nb * n * d)), out(in.size(), kPoison);
      std::copy_n(u.begin() + t0 * d, in.size(), in.begin());
      if (n == 1)
        layer.step(in, nb, cache, 0, out);
      else
        layer.prefill(in, nb, n, cache, 0, out);
      all.insert(all.end(), out.begin(), out.end());
    };
    run(B, P, 0);
    for (std::int64_t s = 0; s < steps; ++s) run(B, 1, B * P + s * B);
    run(1, 1, B * (P + steps));
    return all;
  };
  const std::vector<float> one = outputs(1);
  for (float x : one) ASSERT_TRUE(std::isfinite(x));
  for (int threads : {2, 3, 4}) {
    const std::vector<float> many = outputs(threads);
    ASSERT_EQ(many.size(), one.size());
    EXPECT_EQ(std::memcmp(many.data(), one.data(), one.size() * sizeof(float)), 0)
        << threads << " threads";
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, LayerVariantsIsa, AllIsas(), IsaName);

}  // namespace
}  // namespace tokenmix::testing
