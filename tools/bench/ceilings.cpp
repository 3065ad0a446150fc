// tools/bench/ceilings.cpp — see ceilings.hpp.
#include "ceilings.hpp"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <random>

#ifdef TOKENMIX_HAVE_ONEDNN
#include <oneapi/dnnl/dnnl.hpp>
#endif

#include "kernels/kv_element.hpp"
#include "tokenmix/error.hpp"
#include "tokenmix/runtime.hpp"
#include "util/huge_pages.hpp"

namespace tokenmix::bench {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The GEMM operands: N(0, 1) from std::mt19937_64 seeded 1 and 2, the same draws as
// testkit::random_normal (which this library does not link: the wheel carries no test toolkit).
std::vector<float> normal_draws(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist(0.0, 1.0);
  std::vector<float> out(n);
  for (auto& x : out) x = static_cast<float>(dist(rng));
  return out;
}

void check_at_least_one(const char* what, long long value) {
  if (value < 1)
    throw ArgumentError(
        ErrorCode::invalid_argument,
        std::string("bench: ") + what + " must be >= 1; got " + std::to_string(value));
}

}  // namespace

double median(std::vector<double> v) {
  if (v.empty()) throw ArgumentError(ErrorCode::invalid_argument, "bench: the median of no values");
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

CeilingSpread ceiling_spread(const std::vector<double>& passes) {
  if (passes.empty())
    throw ArgumentError(ErrorCode::invalid_argument, "bench: a ceiling's spread needs a pass");
  const auto [lo, hi] = std::minmax_element(passes.begin(), passes.end());
  return {median(passes), *lo, *hi};
}

namespace {
int checked_gemm_n(int n) {
  if (n < 16 || n > 16384) {
    throw ArgumentError(
        ErrorCode::invalid_argument,
        "bench: the sgemm ceiling's size n must be in [16, 16384]; got " + std::to_string(n));
  }
  return n;
}
}  // namespace

SgemmCeiling::SgemmCeiling(int n)
    : n_(checked_gemm_n(n)),
      a_(normal_draws(static_cast<std::size_t>(n_) * static_cast<std::size_t>(n_), 1)),
      b_(normal_draws(a_.size(), 2)),
      c_(a_.size()) {}

void SgemmCeiling::run_once() {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n_, n_, n_, 1.0f, a_.data(), n_, b_.data(),
              n_, 0.0f, c_.data(), n_);
}

double SgemmCeiling::best_gflops(int threads, int repeats) {
  check_at_least_one("the sgemm ceiling's repeats", repeats);
  (void)pass_gflops(threads, 1);  // warm-up
  return pass_gflops(threads, repeats);
}

double SgemmCeiling::pass_gflops(int threads, int calls) {
  check_at_least_one("the sgemm ceiling's threads", threads);
  check_at_least_one("the sgemm ceiling's calls", calls);
  openblas_set_num_threads(threads);
  double best = 0.0;
  for (int r = 0; r < calls; ++r) {
    const auto t0 = Clock::now();
    run_once();
    best = std::max(best, flops() / seconds_since(t0) * 1e-9);
  }
  openblas_set_num_threads(default_threads());
  return best;
}

std::string sgemm_core() {
  const char* name = openblas_get_corename();
  return name != nullptr ? name : "unknown";
}

std::string sgemm_ceiling_warning() {
  // (TOKENMIX_CPU_CAP=avx2: AVX2 kernels, and an AVX2 sgemm is their ceiling.)
  return sgemm_ceiling_warning(sgemm_core(), cpu_features().avx512f,
                               std::getenv("OPENBLAS_CORETYPE"));
}

std::string sgemm_ceiling_warning(std::string core, bool avx512, const char* forced) {
  if (!avx512) return "";
  std::string lower = core;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
  // OpenBLAS 0.3's kernel families with an AVX-512 sgemm.
  for (const char* wide : {"skylakex", "cooperlake", "sapphirerapids"})
    if (lower == wide) return "";
  return "the sgemm ceiling runs OpenBLAS's " + core +
         " kernel, which has no AVX-512, on a CPU whose AVX-512 tokenmix's kernels use" +
         (forced != nullptr ? std::string(" (OPENBLAS_CORETYPE=") + forced + ")" : std::string()) +
         ": the ceiling is below this CPU's and ratios to it are too high; "
         "OPENBLAS_CORETYPE=SKYLAKEX runs OpenBLAS's AVX-512 kernel";
}

bool cpu_has_bf16_gemm() {
  const CpuFeatures& f = cpu_features();
  return f.avx512_bf16 || f.amx_bf16;
}

bool have_onednn() {
#ifdef TOKENMIX_HAVE_ONEDNN
  return true;
#else
  return false;
#endif
}

GemmCeilingChoice gemm_ceiling_choice(DType dtype, int sgemm_n) {
  const std::string sgemm = "openblas_sgemm_" + std::to_string(checked_gemm_n(sgemm_n));
  if (dtype != DType::bf16) return {false, sgemm};
  if (!cpu_has_bf16_gemm()) {
    return {false, sgemm +
                       " (no bf16 GEMM instructions on this CPU: the fp32 GEMM over the "
                       "widened operands is its fastest)"};
  }
  if (!have_onednn()) {
    return {false, sgemm +
                       " (this build has no oneDNN for the bf16 GEMM ceiling: install "
                       "libdnnl-dev, scripts/install-deps.sh, and rebuild; ratios to the sgemm "
                       "are too high)"};
  }
  return {true, "onednn_bf16_gemm_2048"};
}

double bf16_gemm_ceiling_gflops(int threads, std::string& kind, int repeats) {
  check_at_least_one("the bf16 GEMM ceiling's threads", threads);
  check_at_least_one("the bf16 GEMM ceiling's repeats", repeats);
#ifdef TOKENMIX_HAVE_ONEDNN
  using dnnl::memory;
  constexpr memory::dim n = SgemmCeiling::kN;
  const std::vector<float> a32 = normal_draws(std::size_t{n} * n, 1),
                           b32 = normal_draws(a32.size(), 2);
  std::vector<std::uint16_t> a(a32.size()), b(b32.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    a[i] = kernels::f32_to_bf16(a32[i]);
    b[i] = kernels::f32_to_bf16(b32[i]);
  }
  std::vector<float> c(a.size());
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);  // oneDNN's OpenMP runtime takes the default team size
  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(eng);
  const memory::desc a_md({n, n}, memory::data_type::bf16, memory::format_tag::ab);
  const memory::desc b_md({n, n}, memory::data_type::bf16, memory::format_tag::ab);
  const memory::desc c_md({n, n}, memory::data_type::f32, memory::format_tag::ab);
  dnnl::matmul::primitive_desc pd;
  try {
    pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, c_md), eng);
  } catch (const dnnl::error& e) {
    omp_set_num_threads(saved);
    throw UnsupportedError(std::string("bench: oneDNN has no bf16 matmul for this CPU (") +
                           e.what() + "); its ceiling is the sgemm over widened operands");
  }
  const dnnl::matmul prim(pd);
  memory am(a_md, eng, a.data()), bm(b_md, eng, b.data()), cm(c_md, eng, c.data());
  double best = 0.0;
  for (int r = 0; r < repeats + 1; ++r) {  // first run is a warm-up
    const auto t0 = Clock::now();
    prim.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
    stream.wait();
    const double s = seconds_since(t0);
    if (r > 0) best = std::max(best, 2.0 * n * n * n / s * 1e-9);
  }
  omp_set_num_threads(saved);
  kind = std::string("onednn_bf16_gemm_2048 (") + pd.impl_info_str() + ")";
  return best;
#else
  (void)kind;
  throw UnsupportedError(
      "bench: the bf16 ceiling needs oneDNN, which this build lacks (install libdnnl-dev: "
      "scripts/install-deps.sh, then reconfigure)");
#endif
}

StreamRead::StreamRead(std::size_t bytes)
    : buf_(bytes / sizeof(float) / kBlockFloats * kBlockFloats) {
  const std::size_t n = buf_.size();
  if (n == 0) {
    throw ArgumentError(ErrorCode::invalid_argument,
                        "bench: the streaming-read buffer must hold at least 16384 bytes; got " +
                            std::to_string(bytes));
  }
  // Same page treatment as the KV cache, so the ceiling is not handicapped.
  detail::back_with_huge_pages(buf_.data(), n * sizeof(float));
  float* buf = buf_.data();
#pragma omp parallel for schedule(static)
  for (std::size_t i = 0; i < n; ++i) buf[i] = static_cast<float>(i & 7);
}

double StreamRead::pass_gbps(int threads) {
  check_at_least_one("the streaming read's threads", threads);
  const std::size_t blocks = buf_.size() / kBlockFloats;
  const float* buf = buf_.data();
  const auto t0 = Clock::now();
  double total = 0.0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(+ : total)
  for (std::size_t blk = 0; blk < blocks; ++blk)  // 16 KiB per iteration, widest vectors
    total += sum_floats_widest(buf + blk * kBlockFloats, kBlockFloats);
  const double s = seconds_since(t0);
  sink_ += total;
  return static_cast<double>(bytes()) / s * 1e-9;
}

std::string StreamRead::kind() const {
  const std::size_t b = bytes();
  constexpr std::size_t kKiB = 1024, kMiB = kKiB << 10, kGiB = kMiB << 10;
  if (b % kGiB == 0) return "stream_read_" + std::to_string(b / kGiB) + "GiB";
  if (b % kMiB == 0) return "stream_read_" + std::to_string(b / kMiB) + "MiB";
  return "stream_read_" + std::to_string(b / kKiB) + "KiB";
}

}  // namespace tokenmix::bench
