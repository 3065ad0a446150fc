// tools/cli/layer_run.hpp — `tokenmix run` without files, in three parts:
//   run_layer.cpp     the demo: one Llama-3-8B-shaped layer, forward, backward, prefill + decode
//   layer_check.cpp   its checks against the float64 oracle (and decode against forward)
//   layer_report.cpp  the report: timings, useful GFLOP/s, the check table, KV-cache sizes
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "run.hpp"
#include "tokenmix/tokenmix.hpp"

namespace tokenmix::cli::layer_run {

/// The layer (SPEC 4.1–4.5, 4.8): d = 4096, H_q = 32, H_kv = 8 (g = 4, GQA), d_h = 128, RoPE
/// rotate-half with base 500000.
inline constexpr std::int64_t kModel = 4096, kHeadsQ = 32, kHeadsKv = 8, kHeadDim = 128;
inline constexpr double kRopeBase = 500000.0;

/// Bound on every relative error of the check. float32 rounding is 6e-8; the longest sums here
/// (K = 4096 in the projections, T·B in the weight gradients) stay well below 1e-5 in practice.
inline constexpr double kErrorBound = 1e-4;
/// Longest sequence for which the check runs the oracle's full-length backward (layer_check.cpp).
inline constexpr std::int64_t kFullCheckMaxT = 256;
/// Bound for decode-vs-forward with a bf16/f16 cache: K and V are rounded to 8 (bf16) or 11
/// (f16) significant bits on write, a relative error of at most 2^-9 per element that enters
/// both the scores and the values; 2·2^-9 ≈ 4e-3 (tests/unit/test_kv_cache.cpp uses the same).
/// With an fp32 cache the bound is kErrorBound.
inline constexpr double kDecodeBoundLowPrecision = 4e-3;
/// Bounds for decode-vs-forward with a quantized cache (SPEC "Quantized KV cache"; the error
/// against the unquantized computation, reported): int8 rounds each element to within
/// max|x|/254 of its row, and a row of d_h = 128 N(0, σ²) values has max|x| ≈ 3σ: ≈ 2^-6.4 σ;
/// fp8 E4M3 to within 2^-4 relative (3 mantissa bits). Twice that (scores and values), as for
/// bf16/f16: 2^-5 and 2^-3 (measured here: ≈ 9e-3 and ≈ 3.5e-2 for T = 32 … 256).
inline constexpr double kDecodeBoundInt8 = 0x1.0p-5;
inline constexpr double kDecodeBoundFp8 = 0x1.0p-3;
/// The decode-vs-forward bound of a cache dtype.
inline constexpr double decode_bound(DType cache_dtype) {
  return cache_dtype == DType::f32        ? kErrorBound
         : cache_dtype == DType::int8     ? kDecodeBoundInt8
         : cache_dtype == DType::fp8_e4m3 ? kDecodeBoundFp8
                                          : kDecodeBoundLowPrecision;
}

/// One line of the check table: what was compared and its rel_err (testkit).
struct CheckRow {
  std::string what;
  double error = 0.0;
  bool skipped = false;
};

/// What the demo measured and checked, for the report.
struct LayerRunResult {
  std::int64_t batch = 0, seq = 0, decode_steps = 0;
  Isa path = Isa::portable;
  int threads = 0;
  double forward_s = 0.0, backward_s = 0.0, check_s = 0.0, prefill_s = 0.0, steps_s = 0.0;
  std::vector<CheckRow> checks;
  double decode_err = 0.0;  ///< generated outputs vs one forward (decode phase only)
  /// The step's roofline (decode phase only): what the steps read and a streaming read's rate.
  /// Each step reads the weights once (step_weight_bytes: 4·d·(H_q·d_h + 2·H_kv·d_h) for
  /// W_Q, W_K, W_V and 4·H_q·d_h·d for W_O) and the K/V its queries attend to (decode_bytes,
  /// summed over the steps in step_cache_bytes). step_calls_s: the step() calls alone;
  /// stream_gbps: bench::StreamRead on the same threads, the median of passes interleaved with
  /// the first steps.
  std::uint64_t step_weight_bytes = 0, step_cache_bytes = 0;
  double step_calls_s = 0.0, stream_gbps = 0.0;
  int stream_passes = 0;
  std::uint64_t cache_bytes = 0;  ///< KVCache::memory_bytes of the decode phase
};

/// The checks of the forward and backward (layer_check.cpp): slices recomputed in float64 from
/// the tensors the forward saved.
std::vector<CheckRow> check_layer(const CausalSelfAttention& layer, std::span<const float> out,
                                  std::span<const float> d_out, const LayerGradients& grads);

/// The check of the decode phase: the S generated outputs of each sequence against one forward
/// over all T + S tokens (u: [B, T, d], u_new: [B, S, d], generated: [B, S, d]).
double check_decode(CausalSelfAttention& layer, std::span<const float> u,
                    std::span<const float> u_new, std::span<const float> generated, std::int64_t B,
                    std::int64_t T, std::int64_t S);

/// Prints the report on stdout; returns kExitOk, or kExitCheckFailed (with the error line on
/// stderr) when an error exceeds its bound.
int report(const LayerRunOptions& options, const LayerRunResult& result);

}  // namespace tokenmix::cli::layer_run
