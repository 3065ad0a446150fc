// tools/cli/common.hpp — what the subcommands of the `tokenmix` tool share: how a subcommand is
// registered, progress lines, timing, formatting and option parsing (the error metric and the
// rest of the checking scaffolding is the testing toolkit's, tools/testkit).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "bench.hpp"
#include "reference/reference.hpp"
#include "testkit.hpp"
#include "tokenmix/tokenmix.hpp"

namespace CLI {
class App;
}

namespace tokenmix::cli {

/// Exit codes of the tool: 0 success, 1 a check failed (or an error bound was exceeded),
/// 2 bad usage, bad input or any error reported by the library.
inline constexpr int kExitOk = 0;
inline constexpr int kExitCheckFailed = 1;
inline constexpr int kExitError = 2;

/// A registered subcommand: its CLI11 app and what to run once the command line has parsed.
struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;
};

Command add_run_command(CLI::App& parent);
Command add_check_command(CLI::App& parent);
Command add_info_command(CLI::App& parent);
Command add_bench_command(CLI::App& parent);

/// "tokenmix: <message>" on stderr, flushed (progress as each phase starts).
void progress(const std::string& message);

/// Seconds since construction.
class Stopwatch {
 public:
  Stopwatch() : start_(std::chrono::steady_clock::now()) {}
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

/// The error metric, seeded inputs and the case table come from the testing toolkit
/// (tools/testkit), shared with the unit tests and the benchmarks.
using testkit::ErrorAccumulator;
using testkit::random_normal;
using testkit::rel_err;

/// The score-variant options of `tokenmix run` and `tokenmix bench` (SPEC "Score variants used by
/// real models"), as parsed: --window W, --softcap C, --alibi, --sinks V[,V...], and attention
/// dropout: --dropout P, --dropout-seed S.
struct VariantFlags {
  std::int64_t window = 0;
  double softcap = 0.0;
  bool alibi = false;
  std::vector<double> sinks;
  double dropout = 0.0;            ///< --dropout P (docs/design.md D.1)
  std::uint64_t dropout_seed = 0;  ///< --dropout-seed S
};
/// Adds the four options to `app` (in option group `group`).
void add_variant_options(CLI::App* app, VariantFlags& flags, const std::string& group);
/// The variants the command line asked for; ArgumentError (exit 2) for a --softcap that is not a
/// finite number > 0, a non-finite --sinks value or a --dropout outside [0, 1) (--window's range
/// is checked by the parser).
bench::BenchVariants variants_from_flags(const CLI::App& app, const VariantFlags& flags);
/// The names of the variant options given ("--window, --alibi"), "" when none.
std::string given_variant_options(const CLI::App& app);

/// "1.23e-06"-style and fixed formatting helpers.
std::string fmt(double value, const char* format);

/// Sets the thread count of both the attention kernels (via options) and OpenBLAS.
void apply_blas_threads(int threads);

}  // namespace tokenmix::cli
