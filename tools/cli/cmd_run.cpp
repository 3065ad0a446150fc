// tools/cli/cmd_run.cpp — `tokenmix run`: option parsing and the choice between its two modes.
//
//   tokenmix run [--seq T] [--batch B] [--seed S] [--threads N] [--isa NAME]
//       one Llama-3-8B-shaped layer forward and backward, checked against float64 (run_layer.cpp)
//   tokenmix run --q q.npy --k k.npy --v v.npy --out o.npy [--lse lse.npy] [--scale S]
//                [--no-causal] [--align bottom_right|top_left]
//                [--window W] [--softcap C] [--alibi] [--sinks V[,V...]]
//                [--dout do.npy --dq dq.npy --dk dk.npy --dv dv.npy [--dsinks ds.npy]]
//                [--threads N] [--isa NAME]
//       attention on your tensors (run_npy.cpp), with the score variants of SPEC "Score variants
//       used by real models"
#include <CLI/CLI.hpp>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common.hpp"
#include "run.hpp"

namespace tokenmix::cli {
namespace {

struct RunArgs {
  LayerRunOptions layer;
  NpyRunOptions files;
  double scale = 0.0;
  bool no_causal = false;
  std::string align = "bottom_right";
  int threads = 0;
  std::string isa = "auto";
  std::string cache_dtype = "bf16";
  VariantFlags variants;
};

std::string join_missing(const std::vector<std::string>& names) {
  std::string s;
  for (std::size_t i = 0; i < names.size(); ++i) s += (i ? ", " : "") + names[i];
  return s;
}

[[noreturn]] void usage_error(const std::string& message) {
  throw ArgumentError(ErrorCode::invalid_argument, message);
}

int run_command(CLI::App& sub, RunArgs& a) {
  const Isa isa = parse_isa(a.isa, "--isa");
  resolve_isa(isa);  // fail now (UnsupportedError) if the path cannot run here
  apply_blas_threads(a.threads);

  const std::vector<std::string> file_opts = {"--q",    "--k",  "--v",  "--out", "--lse",
                                              "--dout", "--dq", "--dk", "--dv",  "--dsinks"};
  const std::vector<std::string> attention_opts = {"--scale", "--no-causal", "--align"};
  const std::vector<std::string> layer_opts = {"--seq", "--batch", "--seed", "--decode-steps",
                                               "--cache-dtype"};
  auto given = [&](const std::string& name) { return sub.count(name) > 0; };

  bool file_mode = false;
  for (const auto& o : file_opts) file_mode = file_mode || given(o);

  if (!file_mode) {
    for (const auto& o : attention_opts)
      if (given(o))
        usage_error(o +
                    " applies only to file mode (--q, --k, --v, --out); the built-in layer "
                    "run always uses the causal bottom_right mask and scale 1/sqrt(d_h)");
    const std::string variants = given_variant_options(sub);
    if (!variants.empty())
      usage_error(variants +
                  ": the score variants apply only to file mode (--q, --k, --v, --out); the "
                  "built-in layer run is checked against a plain causal float64 layer");
    a.layer.threads = a.threads;
    a.layer.isa = isa;
    a.layer.cache_dtype = parse_cache_dtype(a.cache_dtype, "--cache-dtype");
    return run_layer(a.layer);
  }

  for (const auto& o : layer_opts)
    if (given(o))
      usage_error(o + " applies only to the built-in layer run, not to file mode (--q)");
  std::vector<std::string> missing;
  for (const auto& o : {"--q", "--k", "--v", "--out"})
    if (!given(o)) missing.emplace_back(o);
  if (!missing.empty())
    usage_error("file mode needs --q, --k, --v and --out; missing " + join_missing(missing));
  const bool any_grad =
      given("--dout") || given("--dq") || given("--dk") || given("--dv") || given("--dsinks");
  if (any_grad) {
    missing.clear();
    for (const auto& o : {"--dout", "--dq", "--dk", "--dv"})
      if (!given(o)) missing.emplace_back(o);
    if (!missing.empty())
      usage_error("the backward pass needs all of --dout, --dq, --dk and --dv; missing " +
                  join_missing(missing));
  }
  if (given("--dsinks") && !given("--sinks"))
    usage_error("--dsinks is the gradient of the attention sinks: it needs --sinks");

  NpyRunOptions& f = a.files;
  if (given("--scale")) {
    if (!std::isfinite(a.scale)) usage_error("--scale must be finite; got " + fmt(a.scale, "%g"));
    f.attention.scale = a.scale;
  }
  f.attention.causal = !a.no_causal;
  f.attention.align = parse_causal_align(a.align, "--align");
  f.attention.threads = a.threads;
  f.attention.isa = isa;
  f.variants = variants_from_flags(sub, a.variants);
  return run_npy(f);
}

}  // namespace

Command add_run_command(CLI::App& parent) {
  CLI::App* sub = parent.add_subcommand(
      "run",
      "Run attention. Without files: one Llama-3-8B-shaped layer (d=4096, H_q=32, H_kv=8, "
      "d_h=128, RoPE base 500000) forward and backward on seeded random weights, checked "
      "against float64, with timings and GFLOP/s. With --q/--k/--v/--out: attention on your "
      ".npy tensors [B, T, H, d_h].");
  auto args = std::make_shared<RunArgs>();
  RunArgs& a = *args;

  sub->add_option("--seq", a.layer.seq, "Sequence length T of the built-in run")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20));
  sub->add_option("--batch", a.layer.batch, "Batch size B of the built-in run")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1024}));
  sub->add_option("--seed", a.layer.seed, "Seed of the random weights, input and dO")
      ->capture_default_str();
  sub->add_option("--threads", a.threads, "Threads (0 = all, the default)")
      ->capture_default_str()
      ->check(CLI::Range(0, 4096));
  sub->add_option("--isa", a.isa, "Kernel path: auto, portable, avx2, avx512, avx512_bf16, neon")
      ->capture_default_str();
  sub->add_option(
         "--decode-steps", a.layer.decode_steps,
         "Tokens generated one at a time with the KV cache after the prefill (0 = no decode phase)")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 16));
  sub->add_option("--cache-dtype", a.cache_dtype,
                  "KV-cache element type of the decode phase: f32, bf16, f16, int8, fp8_e4m3 "
                  "(int8/fp8: K per channel over each closed 64-key tile, V per row; the error vs "
                  "forward is the quantization's)")
      ->capture_default_str()
      ->check(CLI::IsMember({"f32", "bf16", "f16", "int8", "fp8_e4m3"}));

  auto* files = "Files (.npy, float32 or float64, C order)";
  sub->add_option("--q", a.files.q, "Queries [B, T_q, H_q, d_h]")->group(files);
  sub->add_option("--k", a.files.k, "Keys [B, T_k, H_kv, d_h]")->group(files);
  sub->add_option("--v", a.files.v, "Values [B, T_k, H_kv, d_h]")->group(files);
  sub->add_option("--out", a.files.out, "Output O [B, T_q, H_q, d_h] (written)")->group(files);
  sub->add_option("--lse", a.files.lse, "Row log-sum-exp [B, H_q, T_q] (written)")->group(files);
  sub->add_option("--dout", a.files.dout, "Gradient dO [B, T_q, H_q, d_h]: runs the backward pass")
      ->group(files);
  sub->add_option("--dq", a.files.dq, "Gradient dQ (written; needs --dout)")->group(files);
  sub->add_option("--dk", a.files.dk, "Gradient dK (written; needs --dout)")->group(files);
  sub->add_option("--dv", a.files.dv, "Gradient dV (written; needs --dout)")->group(files);
  sub->add_option("--dsinks", a.files.dsinks,
                  "Gradient of the sinks [H_q] (written; needs --dout and --sinks)")
      ->group(files);
  sub->add_option("--scale", a.scale, "Score scale s (default 1/sqrt(d_h))")->group(files);
  sub->add_flag("--no-causal", a.no_causal, "Attend to every key (no causal mask)")->group(files);
  sub->add_option("--align", a.align, "Causal diagonal when T_q != T_k: bottom_right or top_left")
      ->capture_default_str()
      ->group(files);
  add_variant_options(sub, a.variants, "Score variants (file mode; SPEC \"Score variants\")");

  return {sub, [sub, args] { return run_command(*sub, *args); }};
}

}  // namespace tokenmix::cli
