// tools/cli/cmd_bench.cpp — `tokenmix bench forward|backward|decode`: our kernels next to the
// machine's ceilings measured in the same run (tools/bench): fp32 GEMM (OpenBLAS sgemm) for
// forward/backward (a bf16 GEMM through oneDNN with --dtype bf16), streaming read bandwidth and
// the fp32 GEMM for decode (its roofline time is the larger of bytes / read ceiling and useful
// FLOPs / sgemm ceiling). --window, --softcap, --alibi and --sinks time a score variant (SPEC
// "Score variants used by real models"); the JSON records them.
#include <CLI/CLI.hpp>
#include <iostream>
#include <string>
#include <vector>

#include "bench.hpp"
#include "common.hpp"

namespace tokenmix::cli {

Command add_bench_command(CLI::App& parent) {
  CLI::App* app = parent.add_subcommand(
      "bench",
      "Benchmark a kernel against the machine's ceilings measured in the same run (forward, "
      "backward: useful GFLOP/s vs OpenBLAS sgemm 2048^3; decode: KV bytes read per second vs "
      "streaming read bandwidth, useful GFLOP/s vs sgemm, and the roofline time max(bytes / read "
      "ceiling, FLOPs / sgemm ceiling) as a ratio to the step's time; error vs the float64 "
      "reference on a slice)");
  struct Options {
    std::string op = "forward";
    bench::BenchConfig config;
    std::vector<std::string> isas{"auto"};
    std::string align = "bottom_right";
    bool no_causal = false;
    std::vector<std::string> cache_dtypes{"f32", "bf16", "f16"};
    VariantFlags variants;
    std::string dtype = "f32";
  };
  auto o = std::make_shared<Options>();
  app->add_option("op", o->op, "What to measure: forward, backward or decode")
      ->check(CLI::IsMember({"forward", "backward", "decode"}))
      ->capture_default_str();
  app->add_option("--batch", o->config.batch, "Batch sizes B, one case each (comma-separated)")
      ->delimiter(',')
      ->capture_default_str();
  app->add_option("--tq,--t", o->config.tq, "Query lengths T_q, one case each (comma-separated)")
      ->delimiter(',')
      ->capture_default_str();
  app->add_option("--tk", o->config.tk, "Key length T_k (default: = T_q)");
  app->add_option("--hq", o->config.hq, "Query heads H_q")->capture_default_str();
  app->add_option("--hkv", o->config.hkv, "Key/value heads H_kv")->capture_default_str();
  app->add_option("--dh", o->config.dh, "Head width d_h")->capture_default_str();
  app->add_option("--threads", o->config.threads, "Thread counts, one case each (0 = all)")
      ->delimiter(',')
      ->capture_default_str();
  app->add_option("--isa", o->isas,
                  "Kernel paths: auto, portable, avx2, avx512, avx512_bf16, neon (comma-separated)")
      ->delimiter(',')
      ->capture_default_str();
  app->add_option("--align", o->align, "Causal alignment: bottom_right or top_left")
      ->capture_default_str();
  app->add_flag("--no-causal", o->no_causal, "Full (non-causal) attention");
  app->add_option("--repeats", o->config.repeats, "Timed runs per case (the median is reported)")
      ->capture_default_str();
  app->add_option("--rounds", o->config.rounds,
                  "decode: visit the whole case list this many times, round-robin; each case's "
                  "figures are the medians of its rounds x repeats samples (steps and ceiling "
                  "passes), so a slow phase of a shared machine takes part of every case")
      ->capture_default_str();
  app->add_option("--gemm-n", o->config.gemm_n,
                  "The sgemm ceiling's size n (n^3 GEMM; below 2048 it measures less than the "
                  "CPU's rate: quick runs and tests)")
      ->capture_default_str();
  app->add_option("--read-mib", o->config.read_mib,
                  "decode: the streaming-read ceiling's buffer in MiB (far above the L3 cache "
                  "to measure memory)")
      ->capture_default_str();
  app->add_flag("--json", o->config.json, "One JSON object per line per case instead of a table");
  app->add_option("--cache-tokens", o->config.cache_tokens,
                  "decode: cached positions T_k per sequence, one case each (comma-separated)")
      ->delimiter(',')
      ->capture_default_str();
  app->add_option("--cache-dtype", o->cache_dtypes,
                  "decode: KV-cache element types f32, bf16, f16, int8, fp8_e4m3 (int8/fp8: "
                  "K per channel over each closed 64-key tile, V per row; bytes count elements, "
                  "scales and the open tile)")
      ->delimiter(',')
      ->check(CLI::IsMember({"f32", "bf16", "f16", "int8", "fp8_e4m3"}))
      ->capture_default_str();
  app->add_option("--dtype", o->dtype,
                  "Activation dtype: f32, bf16 or f16 (forward/backward: q, k, v, out and the "
                  "gradients; decode: the queries and outputs). bf16 is measured against a bf16 "
                  "GEMM (oneDNN), f32 and f16 against sgemm")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}))
      ->capture_default_str();
  app->add_option("--tnew", o->config.tnew,
                  "decode: new query positions per sequence T_new, one case each "
                  "(comma-separated; > 1: speculative decoding)")
      ->delimiter(',')
      ->capture_default_str();
  app->add_option("--lengths", o->config.lengths,
                  "decode: cache lengths of the B sequences: equal (each --cache-tokens T_k) or "
                  "mixed (sequence b holds L_b uniform in [T_k - T_k/2, T_k + T_k/2], drawn by "
                  "std::mt19937_64 with the fixed seed 16, so the same B and T_k always give the "
                  "same lengths); bytes and FLOPs count each sequence's own length")
      ->check(CLI::IsMember({"equal", "mixed"}))
      ->capture_default_str();
  app->add_option("--kv-profile", o->config.kv_profile,
                  "decode: K values: normal (N(0, 1)) or real (outlier channels x10-x30, "
                  "per-channel offsets, massive tokens: testkit::apply_real_keys)")
      ->check(CLI::IsMember({"normal", "real"}))
      ->capture_default_str();
  app->add_option("--kv-outlier", o->config.kv_outlier,
                  "decode: multiply K and V channel 0 of every head by this (an outlier channel; "
                  "1 = none); the JSON's err_vs_unquantized is the error against the unrounded "
                  "K/V")
      ->capture_default_str();
  add_variant_options(app, o->variants,
                      "Score variants (every case; recorded in the JSON; useful FLOPs count only "
                      "the pairs a window leaves visible)");

  return {
      app, [app, o]() {
        bench::BenchConfig cfg = o->config;
        cfg.op = o->op;
        cfg.causal = !o->no_causal;
        cfg.align = parse_causal_align(o->align, "--align");
        cfg.variants = variants_from_flags(*app, o->variants);
        cfg.isas.clear();
        for (const std::string& name : o->isas) cfg.isas.push_back(parse_isa(name, "--isa"));
        cfg.dtype = o->dtype == "f32" ? DType::f32 : o->dtype == "bf16" ? DType::bf16 : DType::f16;
        cfg.cache_dtypes.clear();
        for (const std::string& name : o->cache_dtypes) {
          cfg.cache_dtypes.push_back(parse_cache_dtype(name, "--cache-dtype"));
        }
        bench::run(cfg, std::cout);
        return kExitOk;
      }};
}

}  // namespace tokenmix::cli
