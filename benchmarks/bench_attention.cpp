// benchmarks/bench_attention.cpp — Google Benchmark view of the same measurements as
// `tokenmix bench`: the sgemm ceiling and our forward, with useful GFLOP/s as a counter.
//   tokenmix_benchmarks --benchmark_filter=Forward --benchmark_repetitions=5
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <random>
#include <vector>

#include "tokenmix/tokenmix.hpp"

namespace {

std::vector<float> random_vector(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist;
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// C = A B, 2048³ fp32 through OpenBLAS: the ceiling every attention figure is compared to.
void BM_SgemmCeiling(benchmark::State& state) {
  const int n = 2048;
  auto a = random_vector(std::size_t(n) * n, 1), b = random_vector(std::size_t(n) * n, 2);
  std::vector<float> c(a.size());
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f,
                c.data(), n);
    benchmark::DoNotOptimize(c.data());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * n * n * n, benchmark::Counter::kIsIterationInvariantRate,
                                                 benchmark::Counter::kIs1000);
}
BENCHMARK(BM_SgemmCeiling)->Unit(benchmark::kMillisecond)->UseRealTime();

// Causal forward, B=1, H_q=32, H_kv=8, d_h=128; argument: T; second argument: isa index.
void BM_Forward(benchmark::State& state) {
  const std::int64_t T = state.range(0), Hq = 32, Hkv = 8, D = 128;
  const auto isa = static_cast<tokenmix::Isa>(state.range(1));
  tokenmix::AttentionOptions opt;
  try {
    opt.isa = tokenmix::resolve_isa(isa);
  } catch (const tokenmix::Error& e) {
    state.SkipWithError(e.what());
    return;
  }
  auto q = random_vector(std::size_t(T * Hq * D), 3), k = random_vector(std::size_t(T * Hkv * D), 4),
       v = random_vector(std::size_t(T * Hkv * D), 5);
  std::vector<float> o(q.size()), lse(std::size_t(Hq * T));
  for (auto _ : state) {
    tokenmix::attention_forward(tokenmix::ConstTensorView::bthd(q.data(), 1, T, Hq, D),
                                tokenmix::ConstTensorView::bthd(k.data(), 1, T, Hkv, D),
                                tokenmix::ConstTensorView::bthd(v.data(), 1, T, Hkv, D),
                                tokenmix::TensorView::bthd(o.data(), 1, T, Hq, D),
                                tokenmix::TensorView::bht(lse.data(), 1, Hq, T), opt);
    benchmark::DoNotOptimize(o.data());
  }
  const double flops = tokenmix::forward_flops(1, T, T, Hq, D, true, tokenmix::CausalAlign::bottom_right);
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
  state.SetLabel(tokenmix::to_string(opt.isa));
}
BENCHMARK(BM_Forward)
    ->ArgsProduct({{512, 2048, 8192}, {int(tokenmix::Isa::portable), int(tokenmix::Isa::avx2), int(tokenmix::Isa::avx512)}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
