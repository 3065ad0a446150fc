// tools/bench/ceilings.hpp — the machine's ceilings that every benchmark figure is a ratio to:
// the fp32 GEMM (OpenBLAS sgemm 2048³), the bf16 GEMM (oneDNN, where the CPU has bf16 GEMM
// instructions), the streaming read, and the median + spread of passes interleaved with timed
// calls. One implementation, linked by `tokenmix bench` (tools/bench/bench.cpp, the library
// tokenmix_bench), `tokenmix run`'s layer report, benchmarks/ and the Python extension
// (python/src/bench_ceilings.cpp: `python -m tokenmix.bench` measures the same ceilings in the
// same process as PyTorch). Internal (the library tokenmix_ceilings): not part of tokenmix's API.
// It needs only the library, OpenBLAS, Highway and OpenMP (and oneDNN where the build has it),
// not the testing toolkit or the float64 oracle, so the wheel can carry it.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "tokenmix/tensor.hpp"

namespace tokenmix::bench {

/// The middle value of `v` (the mean of the two middle ones for an even count); ArgumentError
/// for an empty `v`.
double median(std::vector<double> v);

/// The median of a ceiling's passes and their spread (D-bench-10: one slow pass on a shared
/// machine decides no ratio).
struct CeilingSpread {
  double median, min, max;
};
/// ArgumentError when `passes` is empty.
CeilingSpread ceiling_spread(const std::vector<double>& passes);

/// Pause after an sgemm pass before anything timed that must not share the cores: OpenBLAS's
/// worker threads spin for up to 2^28 TSC cycles (0.13 s at 2.1 GHz) after a call before they
/// sleep; a read pass right after the sgemm once measured 17.8 GB/s against 34.8 for its
/// neighbours (Intel Xeon, docs/performance.md, D-bench-5).
inline constexpr int kAfterSgemmMs = 200;

/// The fp32 GEMM ceiling of forward and backward: C = A B, n × n (n = 2048 unless asked: `tokenmix
/// bench --gemm-n`, a smaller GEMM for quick runs and tests, below the CPU's rate), through
/// OpenBLAS, on seeded N(0, 1) inputs. `tokenmix bench`, benchmarks/ (Google Benchmark) and
/// `python -m tokenmix.bench` all time this one. ArgumentError unless 16 ≤ n ≤ 16384.
class SgemmCeiling {
 public:
  static constexpr int kN = 2048;  ///< the ceiling's size
  explicit SgemmCeiling(int n = kN);
  void run_once();  ///< one cblas_sgemm call
  int n() const { return n_; }
  double flops() const { return 2.0 * n_ * n_ * n_; }  ///< per call
  /// What the JSON's ceiling_kind says: "openblas_sgemm_2048", ...
  std::string kind() const { return "openblas_sgemm_" + std::to_string(n_); }
  /// Best GFLOP/s of `repeats` calls after a warm-up, with `threads` OpenBLAS threads (OpenBLAS's
  /// two-thread rate varies a lot from run to run on a shared VM: take enough).
  double best_gflops(int threads, int repeats = 10);
  /// Best GFLOP/s of `calls` calls with `threads` OpenBLAS threads, no warm-up: one pass of a
  /// ceiling interleaved with timed calls (D-bench-5, D-bench-10). ArgumentError unless
  /// threads ≥ 1 and calls ≥ 1.
  double pass_gflops(int threads, int calls);

 private:
  int n_;
  std::vector<float> a_, b_, c_;
};

/// OpenBLAS's kernel family for sgemm (openblas_get_corename(): "Haswell", "SkylakeX", ...),
/// detected or forced by OPENBLAS_CORETYPE; recorded with every result (BenchResult::sgemm_core).
std::string sgemm_core();

/// Empty, or why the sgemm ceiling is below this CPU's: OpenBLAS runs a kernel without AVX-512
/// on a CPU whose AVX-512 tokenmix's kernels use (OPENBLAS_CORETYPE=Haswell on an AMD Zen 5:
/// 212 GFLOP/s on two threads where its AVX-512 kernel does 405, docs/performance.md, D-bench-1),
/// so ratios to it come out too high (ratio_roofline above 1). `tokenmix bench` and `python -m
/// tokenmix.bench` print it.
std::string sgemm_ceiling_warning();
/// The rule behind it, for a given OpenBLAS core name (any case), whether tokenmix's kernels run
/// AVX-512, and OPENBLAS_CORETYPE's value (nullptr: unset).
std::string sgemm_ceiling_warning(std::string core, bool avx512, const char* forced);

/// Whether the CPU has bf16 GEMM instructions (AVX512-BF16 or AMX-BF16, as CpuFeatures reports
/// them under TOKENMIX_CPU_CAP).
bool cpu_has_bf16_gemm();
/// Whether this build has oneDNN (libdnnl-dev when it was configured): the bf16 GEMM ceiling.
bool have_onednn();

/// Which GEMM ceiling forward and backward use for activations of a dtype: the bf16 GEMM
/// (bf16_gemm_ceiling_gflops) for bf16 where the CPU has bf16 GEMM instructions and the build
/// has oneDNN; the sgemm everywhere else (f16 runs fp32 products on widened operands; bf16
/// without bf16 GEMM instructions has no faster GEMM than the fp32 one over widened operands).
/// `kind` is what the JSON's ceiling_kind says: "openblas_sgemm_2048", with the reason in
/// parentheses where bf16 falls back to it; for the bf16 GEMM, a placeholder that
/// bf16_gemm_ceiling_gflops replaces with the library and ISA it ran.
struct GemmCeilingChoice {
  bool bf16_gemm;
  std::string kind;
};
/// `sgemm_n`: the sgemm's size (SgemmCeiling::n), named in `kind`.
GemmCeilingChoice gemm_ceiling_choice(DType dtype, int sgemm_n = SgemmCeiling::kN);

/// The bf16 GEMM: C (f32) = A B with A, B bf16, n = 2048, through oneDNN's matmul (its best ISA
/// here: AMX or AVX512-BF16), `threads` OpenMP threads; best GFLOP/s of `repeats` after a
/// warm-up. `kind` receives a description (library, ISA). Throws UnsupportedError when this
/// build has no oneDNN (libdnnl-dev) or oneDNN has no bf16 matmul for the CPU; ArgumentError
/// unless threads ≥ 1 and repeats ≥ 1.
double bf16_gemm_ceiling_gflops(int threads, std::string& kind, int repeats = 10);

/// Σ p[0, n) (n a multiple of 64) with the widest vectors the CPU has (stream_read_hwy.cpp).
float sum_floats_widest(const float* p, std::size_t n);

/// Streaming read bandwidth: `threads` threads sum a buffer of `bytes` (≫ L3; rounded down to
/// whole 16 KiB blocks), backed by transparent huge pages like the KV cache. Each pass_gbps() is
/// one timed read; the decode bench interleaves passes with its timed steps and reports the
/// median of each, so load that drifts during a run (a shared VM) weighs on the ceiling and the
/// kernel alike. ArgumentError for a buffer under one block, or threads < 1.
class StreamRead {
 public:
  static constexpr std::size_t kBlockFloats = 4096;  ///< 16 KiB per OpenMP iteration
  explicit StreamRead(std::size_t bytes = std::size_t{1} << 30);
  double pass_gbps(int threads);
  std::size_t bytes() const { return buf_.size() * sizeof(float); }
  /// What the JSON's ceiling_gbps_kind says: "stream_read_1GiB", "stream_read_8MiB", ...
  std::string kind() const;

 private:
  std::vector<float> buf_;
  double sink_ = 0.0;  // keeps the sums observable
};

}  // namespace tokenmix::bench
