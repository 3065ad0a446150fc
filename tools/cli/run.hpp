// tools/cli/run.hpp — the two modes of `tokenmix run` (cmd_run.cpp parses and picks one).
#pragma once

#include <cstdint>
#include <string>

#include "bench.hpp"
#include "tokenmix/tokenmix.hpp"

namespace tokenmix::cli {

/// Default mode: one Llama-3-8B-shaped layer on seeded random weights and input.
struct LayerRunOptions {
  std::int64_t seq = 1024;
  std::int64_t batch = 1;
  std::uint64_t seed = 20240418;  ///< Llama-3 release date
  int threads = 0;                ///< 0 = default_threads()
  Isa isa = Isa::automatic;
  std::int64_t decode_steps = 64;   ///< tokens generated one by one after the prefill
  DType cache_dtype = DType::bf16;  ///< KV-cache element type of the decode phase
};
int run_layer(const LayerRunOptions& options);

/// File mode: attention forward (and optionally backward) on .npy tensors [B, T, H, d_h].
struct NpyRunOptions {
  std::string q, k, v, out, lse;
  std::string dout, dq, dk, dv;   ///< all empty, or all set
  std::string dsinks;             ///< optional (needs dout and variants.sinks)
  AttentionOptions attention;     ///< scale, causal, align, threads, isa
  bench::BenchVariants variants;  ///< window, softcap, ALiBi, sinks (resolved for H_q of q)
};
int run_npy(const NpyRunOptions& options);

}  // namespace tokenmix::cli
