// tools/cli/common.hpp — what the subcommands of the `tokenmix` tool share: how a subcommand is
// registered, progress lines, timing, the error metric and conversions to the float64 oracle.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "reference/reference.hpp"
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

/// The error metric of every check: max_i |x_i − r_i| / max_i |r_i| (max-norm error relative to
/// the max-norm of the reference; 0/0 counts as 0). A NaN in x counts as an infinite error.
struct ErrorAccumulator {
  double max_diff = 0.0;
  double max_ref = 0.0;
  void add(double x, double r);
  double value() const;
};
double rel_err(std::span<const float> x, std::span<const double> r);

/// Copies a contiguous float tensor of `shape` (rank ≤ 4, padded with 1s) into the oracle's type.
reference::Tensor64 to_tensor64(std::span<const float> data, std::array<std::int64_t, 4> shape);

/// Seeded N(0, sigma) values.
std::vector<float> random_normal(std::size_t n, std::uint64_t seed, double sigma = 1.0);

/// "1.23e-06"-style and fixed formatting helpers.
std::string fmt(double value, const char* format);

/// Sets the thread count of both the attention kernels (via options) and OpenBLAS.
void apply_blas_threads(int threads);

}  // namespace tokenmix::cli
