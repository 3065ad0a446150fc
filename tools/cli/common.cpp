// tools/cli/common.cpp — helpers shared by the subcommands (see common.hpp).
#include "common.hpp"

#include <cblas.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <limits>

namespace tokenmix::cli {

void progress(const std::string& message) {
  std::cerr << "tokenmix: " << message << std::endl;
}

std::string fmt(double value, const char* format) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, value);
  return buf;
}

void add_variant_options(CLI::App* app, VariantFlags& f, const std::string& group) {
  app->add_option("--window", f.window,
                  "Sliding window W >= 1: a query sees only the last W positions up to its own "
                  "(Mistral, Gemma; FlashAttention's window_size = (W - 1, 0))")
      ->check(CLI::Range(std::int64_t{1}, std::numeric_limits<std::int64_t>::max()))
      ->group(group);
  app->add_option("--softcap", f.softcap,
                  "Logit soft-capping c > 0: scores c*tanh(z/c) after the scale (Gemma 2)")
      ->group(group);
  app->add_flag("--alibi", f.alibi,
                "ALiBi with the standard slopes m_h = 2^(-8(h+1)/H_q) (BLOOM, MPT)")
      ->group(group);
  app->add_option("--sinks", f.sinks,
                  "Attention sinks: one logit for every query head, or H_q comma-separated "
                  "values, one per head (gpt-oss)")
      ->delimiter(',')
      ->group(group);
  app->add_option("--dropout", f.dropout,
                  "Attention dropout p in [0, 1): the values are averaged with P*Z/(1-p), Z a "
                  "Philox mask kept with probability 1-p (training; forward and backward)")
      ->group(group);
  app->add_option("--dropout-seed", f.dropout_seed, "Seed of the dropout mask (default 0)")
      ->group(group);
}

bench::BenchVariants variants_from_flags(const CLI::App& app, const VariantFlags& f) {
  bench::BenchVariants v;
  if (app.count("--window") > 0) v.window = f.window;
  if (app.count("--softcap") > 0) {
    if (!std::isfinite(f.softcap) || !(f.softcap > 0.0))
      throw ArgumentError(ErrorCode::invalid_argument,
                          "--softcap must be a finite number > 0; got " + fmt(f.softcap, "%g"));
    v.softcap = f.softcap;
  }
  v.alibi = f.alibi;
  for (double s : f.sinks)
    if (!std::isfinite(s))
      throw ArgumentError(ErrorCode::invalid_argument,
                          "--sinks values must be finite; got " + fmt(s, "%g"));
  v.sinks = f.sinks;
  if (app.count("--dropout") > 0) {
    if (!(f.dropout >= 0.0 && f.dropout < 1.0))
      throw ArgumentError(
          ErrorCode::invalid_argument,
          "--dropout must be in [0, 1) (the probability of dropping a weight); got " +
              fmt(f.dropout, "%g"));
    v.dropout = f.dropout;
  }
  v.dropout_seed = f.dropout_seed;
  return v;
}

std::string given_variant_options(const CLI::App& app) {
  std::string s;
  for (const char* name :
       {"--window", "--softcap", "--alibi", "--sinks", "--dropout", "--dropout-seed"})
    if (app.count(name) > 0) s += (s.empty() ? "" : ", ") + std::string(name);
  return s;
}

void apply_blas_threads(int threads) {
  if (threads > 0) openblas_set_num_threads(threads);
}

}  // namespace tokenmix::cli
