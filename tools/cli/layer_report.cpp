// tools/cli/layer_report.cpp — the report of `tokenmix run` without files (layer_run.hpp): the
// phases' times and useful GFLOP/s (SPEC "Useful-work counts"), the check table with its bounds
// and verdict, and the KV-cache sizes of the layer (SPEC 4.8).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>

#include "common.hpp"
#include "layer_run.hpp"

namespace tokenmix::cli::layer_run {
namespace {

std::string human_bytes(std::uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  return u == 0 ? std::to_string(bytes) + " B" : fmt(v, "%.2f") + " " + units[u];
}

}  // namespace

int report(const LayerRunOptions& o, const LayerRunResult& r) {
  const std::int64_t B = r.batch, T = r.seq, S = r.decode_steps, d = kModel;
  const Isa path = r.path;
  const int threads = r.threads;
  const double fwd_s = r.forward_s, bwd_s = r.backward_s, check_s = r.check_s,
               prefill_s = r.prefill_s, steps_s = r.steps_s, decode_err = r.decode_err;
  const std::uint64_t cache_bytes = r.cache_bytes;
  const std::vector<CheckRow>& checks = r.checks;

  // Useful work (SPEC "Useful-work counts"): attention 4·d_h·H_q·P·B forward, 2.5× backward;
  // projections 2·B·T·d·(2·H_q·d_h + 2·H_kv·d_h) forward (Q, K, V, O), 2× that backward.
  const double attn_f = forward_flops(B, T, T, kHeadsQ, kHeadDim, true, CausalAlign::bottom_right);
  const double attn_b = backward_flops(B, T, T, kHeadsQ, kHeadDim, true, CausalAlign::bottom_right);
  const double proj_f = 2.0 * static_cast<double>(B) * static_cast<double>(T) *
                        static_cast<double>(d) *
                        static_cast<double>(2 * kHeadsQ * kHeadDim + 2 * kHeadsKv * kHeadDim);
  const double proj_b = 2.0 * proj_f;

  std::printf("\ntokenmix %s - Llama-3-8B-shaped causal self-attention layer\n", version());
  std::printf(
      "  B=%lld T=%lld d=%lld H_q=%lld H_kv=%lld (GQA, g=%lld) d_h=%lld, RoPE rotate-half "
      "base 500000\n",
      static_cast<long long>(B), static_cast<long long>(T), static_cast<long long>(d),
      static_cast<long long>(kHeadsQ), static_cast<long long>(kHeadsKv),
      static_cast<long long>(kHeadsQ / kHeadsKv), static_cast<long long>(kHeadDim));
  std::printf("  kernel path %s, %d threads, seed %llu\n\n", to_string(path), threads,
              static_cast<unsigned long long>(o.seed));

  std::printf("%-10s %10s %16s %17s %12s\n", "phase", "time [s]", "attention GFLOP",
              "projection GFLOP", "GFLOP/s");
  std::printf("%-10s %10.3f %16.2f %17.2f %12.1f\n", "forward", fwd_s, attn_f * 1e-9, proj_f * 1e-9,
              (attn_f + proj_f) / std::max(fwd_s, 1e-9) * 1e-9);
  std::printf("%-10s %10.3f %16.2f %17.2f %12.1f\n", "backward", bwd_s, attn_b * 1e-9,
              proj_b * 1e-9, (attn_b + proj_b) / std::max(bwd_s, 1e-9) * 1e-9);
  std::printf("%-10s %10.3f %16s %17s %12s\n", "check", check_s, "-", "-", "-");
  if (S > 0) {
    std::printf("%-10s %10.3f %16s %17s %12s   %.0f tokens/s\n", "prefill", prefill_s, "-", "-",
                "-", static_cast<double>(B * T) / std::max(prefill_s, 1e-9));
    std::printf("%-10s %10.3f %16s %17s %12s   %.1f tokens/s (%lld steps x B=%lld, %.2f ms/step)\n",
                "decode", steps_s, "-", "-", "-",
                static_cast<double>(B * S) / std::max(steps_s, 1e-9), static_cast<long long>(S),
                static_cast<long long>(B), steps_s / static_cast<double>(S) * 1e3);
  }
  std::printf(
      "  (useful FLOPs, SPEC \"Useful-work counts\": attention 4*d_h*H_q*P*B forward with\n"
      "   P = T(T+1)/2, 2.5x backward; projections 2*B*T*d*(2*H_q*d_h + 2*H_kv*d_h) "
      "forward, 2x backward)\n\n");
  if (S > 0) {
    // The step's roofline: the bytes a step must read (weights once, the K/V it attends to) at
    // the streaming read rate of this run; ratio = roofline time / measured time (≤ 1).
    const double steps = static_cast<double>(S);
    const double weights = static_cast<double>(r.step_weight_bytes);
    const double kv = static_cast<double>(r.step_cache_bytes) / steps;
    const double measured = r.step_calls_s / steps;
    const double roofline = (weights + kv) / (r.stream_gbps * 1e9);
    std::printf(
        "step roofline: %.2f ms measured, reads %.1f MB (weights %.1f MB + KV cache "
        "%.1f MB), streaming read %.1f GB/s -> roofline %.2f ms, ratio %.2f\n",
        measured * 1e3, (weights + kv) * 1e-6, weights * 1e-6, kv * 1e-6, r.stream_gbps,
        roofline * 1e3, roofline / std::max(measured, 1e-12));
    std::printf(
        "  (per step, the mean over the %lld steps; weights 4*d*(H_q*d_h + 2*H_kv*d_h) + "
        "4*H_q*d_h*d bytes,\n   KV cache = decode_bytes after the step's append; streaming read: "
        "median of %d passes\n   over 256 MiB on %d threads, interleaved with the first steps)\n\n",
        static_cast<long long>(S), r.stream_passes, threads);
  }

  double worst = 0.0;
  std::printf("%-58s %12s\n", "check vs float64 (max|x-r| / max|r|)", "rel. error");
  for (const CheckRow& c : checks) {
    if (c.skipped) {
      std::printf("  %-56s %12s\n", c.what.c_str(), "skipped");
      continue;
    }
    std::printf("  %-56s %12.2e\n", c.what.c_str(), c.error);
    worst = std::isnan(c.error) ? INFINITY : std::max(worst, c.error);
  }
  bool pass = worst <= kErrorBound;
  if (S > 0) {
    const double bound = decode_bound(o.cache_dtype);
    const bool ok = decode_err <= bound;
    // vs forward = vs the unquantized (fp32) K/V: for an int8 / fp8 cache, its quantization error.
    std::printf(
        "  %-56s %12.2e  (bound %.0e: %s)\n",
        ("decode: " + std::to_string(S) + " steps on a " + to_string(o.cache_dtype) +
         " cache vs forward" +
         (o.cache_dtype == DType::int8 || o.cache_dtype == DType::fp8_e4m3 ? " (unquantized)" : ""))
            .c_str(),
        decode_err, bound, ok ? "PASS" : "FAIL");
    pass = pass && ok;
  }
  std::printf("  %-56s %12.2e  (bound %.0e: %s)\n", "max", worst, kErrorBound,
              pass ? "PASS" : "FAIL");
  if (T <= kFullCheckMaxT)
    std::printf("  (*) relative to the largest reference entry of dW_Q, dW_K and dW_V together\n");
  std::printf("\n");

  // KV cache (SPEC 4.8): 2 · n · B · T · H_kv · d_h · sizeof(element), here n = B = T = 1.
  // int8 / fp8: one byte per element plus the fp32 scales, per token: V's row scale and K's share
  // of its tile's d_h channel scales (padded to 64 bytes, over 64 positions; SPEC "Quantized KV
  // cache"; the open tile's fp32 copy, per sequence, not counted).
  constexpr std::int64_t kQuantScaleBytes = 4 + (4 * kHeadDim + 63) / 64 * 64 / 64;
  std::printf("KV cache of this layer per token (SPEC 4.8: 2 * H_kv * d_h * sizeof(element))\n");
  std::printf("  %-22s %12s %12s %12s %18s\n", "", "fp32", "bf16/fp16", "int8/fp8+sc",
              "fp32, B*T tokens");
  for (const auto& [name, hkv] : {std::pair<const char*, std::int64_t>{"GQA (H_kv = 8)", kHeadsKv},
                                  {"MHA (H_kv = 32)", kHeadsQ}}) {
    std::printf("  %-22s %10llu B %10llu B %10llu B %18s\n", name,
                static_cast<unsigned long long>(kv_cache_bytes(1, 1, 1, hkv, kHeadDim, 4)),
                static_cast<unsigned long long>(kv_cache_bytes(1, 1, 1, hkv, kHeadDim, 2)),
                static_cast<unsigned long long>(kv_cache_bytes(1, 1, 1, hkv, kHeadDim, 1) +
                                                hkv * kQuantScaleBytes),
                human_bytes(kv_cache_bytes(1, B, T, hkv, kHeadDim, 4)).c_str());
  }
  std::printf("  GQA holds %lldx less than MHA for the same layer\n",
              static_cast<long long>(kHeadsQ / kHeadsKv));
  if (S > 0) {
    std::printf(
        "  decode-phase cache: %s, B=%lld x T_max=%lld positions: %s (KVCache::memory_bytes)\n",
        to_string(o.cache_dtype), static_cast<long long>(B), static_cast<long long>(T + S),
        human_bytes(cache_bytes).c_str());
  }
  std::fflush(stdout);
  if (!pass) {
    std::fprintf(stderr, "tokenmix: error: max relative error %.2e exceeds the bound %.0e\n", worst,
                 kErrorBound);
    return kExitCheckFailed;
  }
  return kExitOk;
}

}  // namespace tokenmix::cli::layer_run
