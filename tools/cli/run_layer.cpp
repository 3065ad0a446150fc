// tools/cli/run_layer.cpp — `tokenmix run` without files: the demo. One Llama-3-8B-shaped
// attention layer (layer_run.hpp: d = 4096, H_q = 32, H_kv = 8, g = 4, d_h = 128, RoPE
// rotate-half with base 500000; SPEC 4.1–4.5, 4.8) with seeded random weights
// (CausalSelfAttention::init_random), input U ~ N(0, 1) [B, T, d] and upstream gradient
// dO ~ N(0, 1) [B, T, d].
//
// Phases: forward, backward, check, decode. The decode phase prefills the T tokens into a KV
// cache (KVCache, bf16 by default) and generates --decode-steps more one at a time
// (CausalSelfAttention::step), timing each step against its roofline: the bytes it reads
// (weights once, plus the K/V it attends to) at the streaming read rate measured in the same
// run (bench::StreamRead, passes interleaved with the first steps). The checks are in
// layer_check.cpp, the report in layer_report.cpp.
#include <algorithm>
#include <string>
#include <vector>

#include "bench.hpp"
#include "common.hpp"
#include "layer_run.hpp"
#include "run.hpp"

namespace tokenmix::cli {

int run_layer(const LayerRunOptions& o) {
  using namespace layer_run;
  const std::int64_t B = o.batch, T = o.seq, d = kModel;
  LayerConfig config;
  config.d_model = kModel;
  config.heads_q = kHeadsQ;
  config.heads_kv = kHeadsKv;
  config.head_dim = kHeadDim;
  config.rope = RopeOptions{RopePairing::rotate_half, kRopeBase, 0};
  config.attention.threads = o.threads;
  config.attention.isa = o.isa;
  LayerRunResult r;
  r.batch = B;
  r.seq = T;
  r.path = resolve_isa(o.isa);
  r.threads = o.threads > 0 ? o.threads : default_threads();

  progress(
      "setting up a Llama-3-8B-shaped layer (d=4096, H_q=32, H_kv=8, d_h=128, RoPE base "
      "500000), B=" +
      std::to_string(B) + ", T=" + std::to_string(T) + ", seed " + std::to_string(o.seed));
  CausalSelfAttention layer(config);
  layer.init_random(o.seed);
  const std::size_t n = static_cast<std::size_t>(B * T * d);
  const std::vector<float> u = random_normal(n, o.seed * 2654435761u + 1);
  const std::vector<float> d_out = random_normal(n, o.seed * 2654435761u + 2);
  std::vector<float> out(n);

  progress("forward (" + std::string(to_string(r.path)) + " kernels, " + std::to_string(r.threads) +
           " threads)");
  Stopwatch fwd_clock;
  layer.forward(u, B, T, out);
  r.forward_s = fwd_clock.seconds();

  progress("backward");
  LayerGradients grads;
  Stopwatch bwd_clock;
  layer.backward(d_out, grads);
  r.backward_s = bwd_clock.seconds();

  progress("check against the float64 reference");
  Stopwatch check_clock;
  r.checks = check_layer(layer, out, d_out, grads);
  r.check_s = check_clock.seconds();

  // Decode: prefill, then one token per step, against one forward over T + S tokens.
  const std::int64_t S = o.decode_steps;
  r.decode_steps = S;
  if (S > 0) {
    progress("decode: prefill " + std::to_string(T) + " tokens into a " + to_string(o.cache_dtype) +
             " KV cache, then " + std::to_string(S) + " steps of one token");
    KVCacheConfig kc;
    kc.layers = 1;
    kc.batch = B;
    kc.heads_kv = kHeadsKv;
    kc.head_dim = kHeadDim;
    kc.capacity = T + S;
    kc.dtype = o.cache_dtype;
    KVCache cache(kc);
    r.cache_bytes = cache.memory_bytes();
    const std::vector<float> u_new =
        random_normal(static_cast<std::size_t>(B * S * d), o.seed * 2654435761u + 3);
    std::vector<float> prefill_out(n), step_in(static_cast<std::size_t>(B * d)),
        step_out(static_cast<std::size_t>(B * d)), generated(static_cast<std::size_t>(B * S * d));
    Stopwatch prefill_clock;
    layer.prefill(u, B, T, cache, 0, prefill_out);
    r.prefill_s = prefill_clock.seconds();
    // The roofline's ceiling: a 256 MiB buffer (far beyond any L3), one untimed pass, then one
    // pass before each of the first kStreamPasses steps (outside the steps' clocks).
    constexpr int kStreamPasses = 9;
    bench::StreamRead stream(std::size_t{256} << 20);
    (void)stream.pass_gbps(r.threads);
    std::vector<double> gbps;
    const std::int64_t qw = kHeadsQ * kHeadDim, kw = kHeadsKv * kHeadDim;
    r.step_weight_bytes = static_cast<std::uint64_t>(4 * d * (qw + 2 * kw) + 4 * qw * d);
    double steps_s = 0.0;
    for (std::int64_t s = 0; s < S; ++s) {
      for (std::int64_t b = 0; b < B; ++b)  // token s of every sequence: u_new [B, S, d]
        std::copy_n(u_new.begin() + (b * S + s) * d, d, step_in.begin() + b * d);
      if (s < kStreamPasses) gbps.push_back(stream.pass_gbps(r.threads));
      Stopwatch step_clock;
      layer.step(step_in, B, cache, 0, step_out);
      r.step_calls_s += step_clock.seconds();
      Stopwatch copy_clock;
      // The K/V this step's query attended to: after its append (SPEC "decode bytes").
      r.step_cache_bytes += decode_bytes(cache, 0, 0, B);
      for (std::int64_t b = 0; b < B; ++b)
        std::copy_n(step_out.begin() + b * d, d, generated.begin() + (b * S + s) * d);
      steps_s += copy_clock.seconds();
    }
    r.steps_s = steps_s + r.step_calls_s;
    std::sort(gbps.begin(), gbps.end());
    r.stream_passes = static_cast<int>(gbps.size());
    r.stream_gbps = gbps[gbps.size() / 2];
    r.decode_err = check_decode(layer, u, u_new, generated, B, T, S);
  }
  return report(o, r);
}

}  // namespace tokenmix::cli
