// tests/unit/test_ceilings.cpp — the benchmark ceilings (tools/bench/ceilings.hpp, the library
// tokenmix_ceilings that `tokenmix bench`, benchmarks/ and the Python extension share): the
// passes' median and spread, the sgemm and streaming-read passes, the dtype's GEMM ceiling
// choice (also under TOKENMIX_CPU_CAP), the bf16 GEMM ceiling, and every argument error.
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <string>
#include <vector>

#include "ceilings.hpp"
#include "test_util.hpp"
#include "tokenmix/tokenmix.hpp"

namespace tokenmix::testing {
namespace {

namespace bench = tokenmix::bench;

TEST(BenchCeilings, MedianAndSpreadOfPasses) {
  EXPECT_EQ(bench::median({3.0, 1.0, 2.0}), 2.0);
  EXPECT_EQ(bench::median({4.0, 1.0, 3.0, 2.0}), 2.5);  // the mean of the two middle ones
  EXPECT_EQ(bench::median({7.0}), 7.0);
  const bench::CeilingSpread s = bench::ceiling_spread({140.0, 99.0, 162.0, 136.0, 150.0});
  EXPECT_EQ(s.median, 140.0);
  EXPECT_EQ(s.min, 99.0);
  EXPECT_EQ(s.max, 162.0);
  EXPECT_THROW(bench::median({}), ArgumentError);
  EXPECT_THROW(bench::ceiling_spread({}), ArgumentError);
}

TEST(BenchCeilings, SgemmPassIsAPositiveFiniteRate) {
  bench::SgemmCeiling sgemm;
  const double pass = sgemm.pass_gflops(1, 1);
  EXPECT_TRUE(std::isfinite(pass) && pass > 0.0) << pass;
  // Two calls' best is a pass too; best_gflops warms up first and takes the best of `repeats`.
  const double best = sgemm.best_gflops(1, 2);
  EXPECT_TRUE(std::isfinite(best) && best > 0.0) << best;
  EXPECT_EQ(sgemm.flops(), 2.0 * 2048 * 2048 * 2048);
  EXPECT_EQ(sgemm.kind(), "openblas_sgemm_2048");
  // Another size (tokenmix bench --gemm-n): its FLOPs and kind; a size outside [16, 16384] is an
  // ArgumentError naming it.
  bench::SgemmCeiling small(96);
  EXPECT_EQ(small.n(), 96);
  EXPECT_EQ(small.flops(), 2.0 * 96 * 96 * 96);
  EXPECT_EQ(small.kind(), "openblas_sgemm_96");
  EXPECT_GT(small.pass_gflops(1, 1), 0.0);
  EXPECT_EQ(bench::gemm_ceiling_choice(DType::f32, 96).kind, "openblas_sgemm_96");
  for (const int n : {15, 0, -4, 16385}) {
    try {
      bench::SgemmCeiling bad(n);
      ADD_FAILURE() << "n = " << n << " accepted";
    } catch (const ArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("[16, 16384]; got " + std::to_string(n)),
                std::string::npos)
          << e.what();
    }
    EXPECT_THROW((void)bench::gemm_ceiling_choice(DType::f32, n), ArgumentError) << n;
  }
  EXPECT_FALSE(bench::sgemm_core().empty());
  for (const auto& [threads, calls] : {std::pair{0, 1}, std::pair{-1, 1}, std::pair{1, 0}})
    EXPECT_THROW(sgemm.pass_gflops(threads, calls), ArgumentError) << threads << " " << calls;
  EXPECT_THROW(sgemm.best_gflops(1, 0), ArgumentError);
}

TEST(BenchCeilings, StreamReadSizesKindsAndPasses) {
  const bench::StreamRead eight(std::size_t{8} << 20);
  EXPECT_EQ(eight.bytes(), std::size_t{8} << 20);
  EXPECT_EQ(eight.kind(), "stream_read_8MiB");
  // Rounded down to whole 16 KiB blocks.
  const bench::StreamRead odd(40000);
  EXPECT_EQ(odd.bytes(), std::size_t{32768});
  EXPECT_EQ(odd.kind(), "stream_read_32KiB");
  bench::StreamRead read(std::size_t{4} << 20);
  const double gbps = read.pass_gbps(1);
  EXPECT_TRUE(std::isfinite(gbps) && gbps > 0.0) << gbps;
  EXPECT_THROW(read.pass_gbps(0), ArgumentError);
  try {
    bench::StreamRead tiny(16383);
    ADD_FAILURE() << "a buffer under one block was accepted";
  } catch (const ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("at least 16384 bytes; got 16383"), std::string::npos)
        << e.what();
  }
}

TEST(BenchCeilings, WidestSumAddsEveryElement) {
  std::vector<float> x(4096);
  double expected = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<float>(i % 7);  // small integers: every partial sum is exact in fp32
    expected += x[i];
  }
  EXPECT_EQ(bench::sum_floats_widest(x.data(), x.size()), expected);
  EXPECT_EQ(bench::sum_floats_widest(x.data() + 64, 64), 190.0f);  // 64..127: 9 × 21 + 1
}

// The rule of gemm_ceiling_choice, from what the CPU and the build have (so it holds on any CPU).
void expect_choice_rule() {
  for (DType dt : {DType::f32, DType::f16}) {
    const bench::GemmCeilingChoice c = bench::gemm_ceiling_choice(dt);
    EXPECT_FALSE(c.bf16_gemm);
    EXPECT_EQ(c.kind, "openblas_sgemm_2048");
  }
  const bench::GemmCeilingChoice bf16 = bench::gemm_ceiling_choice(DType::bf16);
  if (!bench::cpu_has_bf16_gemm()) {
    EXPECT_FALSE(bf16.bf16_gemm);
    EXPECT_EQ(bf16.kind.rfind("openblas_sgemm_2048 (no bf16 GEMM instructions on this CPU", 0), 0u)
        << bf16.kind;
  } else if (!bench::have_onednn()) {
    EXPECT_FALSE(bf16.bf16_gemm);
    EXPECT_EQ(bf16.kind.rfind("openblas_sgemm_2048 (this build has no oneDNN", 0), 0u) << bf16.kind;
  } else {
    EXPECT_TRUE(bf16.bf16_gemm);
    EXPECT_EQ(bf16.kind, "onednn_bf16_gemm_2048");
  }
}

TEST(BenchCeilings, GemmCeilingChoicePerDtype) {
  expect_choice_rule();
  // TOKENMIX_CPU_CAP=avx2 hides the bf16 GEMM instructions (as on AMD Zen 3): sgemm, said so.
  ScopedEnv cap("TOKENMIX_CPU_CAP", "avx2");
  EXPECT_FALSE(bench::cpu_has_bf16_gemm());
  const bench::GemmCeilingChoice bf16 = bench::gemm_ceiling_choice(DType::bf16);
  EXPECT_FALSE(bf16.bf16_gemm);
  EXPECT_EQ(bf16.kind.rfind("openblas_sgemm_2048 (no bf16 GEMM instructions", 0), 0u) << bf16.kind;
  expect_choice_rule();
}

TEST(BenchCeilings, Bf16GemmCeilingRunsOrSaysWhyNot) {
  std::string kind = "unchanged";
  EXPECT_THROW(bench::bf16_gemm_ceiling_gflops(0, kind, 1), ArgumentError);
  EXPECT_THROW(bench::bf16_gemm_ceiling_gflops(1, kind, 0), ArgumentError);
  EXPECT_EQ(kind, "unchanged");
  if (!bench::have_onednn()) {
    EXPECT_THROW(bench::bf16_gemm_ceiling_gflops(1, kind, 1), UnsupportedError);
    return;
  }
  try {
    const double gflops = bench::bf16_gemm_ceiling_gflops(1, kind, 1);
    EXPECT_TRUE(std::isfinite(gflops) && gflops > 0.0) << gflops;
    EXPECT_EQ(kind.rfind("onednn_bf16_gemm_2048 (", 0), 0u) << kind;
  } catch (const UnsupportedError& e) {
    // oneDNN without a bf16 matmul for this CPU: only where the CPU has no bf16 GEMM.
    EXPECT_FALSE(bench::cpu_has_bf16_gemm()) << e.what();
    EXPECT_NE(std::string(e.what()).find("oneDNN has no bf16 matmul"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace tokenmix::testing
