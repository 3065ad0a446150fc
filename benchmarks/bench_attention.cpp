// benchmarks/bench_attention.cpp — Google Benchmark view of the `tokenmix bench` measurements,
// on the same machinery (tools/bench): the sgemm ceiling (bench::SgemmCeiling), and forward and
// backward (bench::AttentionRun: the bench's inputs, call and useful-FLOP count) on the bench's
// default shapes (bench::BenchConfig: B = 1, H_q = 32, H_kv = 8, d_h = 128, causal, T_q = T_k
// in its default list), with useful GFLOP/s as a counter.
// BM_SmallCall times the tiny per-call shapes of generation (issue 18).
//   tokenmix_benchmarks --benchmark_filter=Forward --benchmark_repetitions=5
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "bench.hpp"
#include "testkit.hpp"
#include "tokenmix/tokenmix.hpp"

namespace {

using tokenmix::bench::AttentionRun;
using tokenmix::bench::BenchConfig;
using tokenmix::bench::SgemmCeiling;

// C = A B, 2048³ fp32 through OpenBLAS: the ceiling every attention figure is compared to.
void BM_SgemmCeiling(benchmark::State& state) {
  SgemmCeiling sgemm;
  for (auto _ : state) sgemm.run_once();
  state.counters["GFLOP/s"] = benchmark::Counter(
      sgemm.flops(), benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_SgemmCeiling)->Unit(benchmark::kMillisecond)->UseRealTime();

// One bench case; arguments: T (= T_q = T_k) and the isa index.
void run_case(benchmark::State& state, bool backward) {
  const auto isa = static_cast<tokenmix::Isa>(state.range(1));
  if (const std::string why = tokenmix::testkit::isa_unavailable_reason(isa); !why.empty()) {
    state.SkipWithError(why.c_str());
    return;
  }
  const BenchConfig defaults;
  const tokenmix::testkit::AttentionShape shape{
      defaults.batch.front(), state.range(0), state.range(0),  defaults.hq,
      defaults.hkv,           defaults.dh,    defaults.causal, defaults.align};
  AttentionRun run(shape, backward, isa, /*threads=*/0);
  run.forward();
  for (auto _ : state) run.call();
  state.counters["GFLOP/s"] =
      benchmark::Counter(run.useful_flops(), benchmark::Counter::kIsIterationInvariantRate,
                         benchmark::Counter::kIs1000);
  state.SetLabel(tokenmix::to_string(isa));
}

void BM_Forward(benchmark::State& state) {
  run_case(state, false);
}
void BM_Backward(benchmark::State& state) {
  run_case(state, true);
}

// The bench's default T list times every concrete kernel path.
void bench_args(benchmark::internal::Benchmark* b) {
  std::vector<std::int64_t> isas;
  for (tokenmix::Isa isa : tokenmix::testkit::concrete_isas())
    isas.push_back(static_cast<int>(isa));
  b->ArgsProduct({BenchConfig{}.tq, isas})->Unit(benchmark::kMillisecond)->UseRealTime();
}
BENCHMARK(BM_Forward)->Apply(bench_args);
BENCHMARK(BM_Backward)->Apply(bench_args);

// Per-call time of generation's tiny calls (the shapes of `python -m tokenmix.bench --overhead`,
// the library call alone): T_q, T_k, H_q, H_kv (B = 1, d_h = 64), causal (top-left), backward.
void BM_SmallCall(benchmark::State& state) {
  const tokenmix::testkit::AttentionShape shape{1,
                                                state.range(0),
                                                state.range(1),
                                                state.range(2),
                                                state.range(3),
                                                64,
                                                state.range(4) != 0,
                                                tokenmix::CausalAlign::top_left};
  AttentionRun run(shape, state.range(5) != 0, tokenmix::Isa::automatic, /*threads=*/0);
  run.forward();
  for (auto _ : state) run.call();
}
BENCHMARK(BM_SmallCall)
    ->ArgNames({"Tq", "Tk", "Hq", "Hkv", "causal", "bwd"})
    ->Args({8, 8, 4, 4, 1, 0})
    ->Args({8, 8, 4, 4, 1, 1})
    ->Args({1, 128, 8, 2, 0, 0})
    ->Args({1, 1024, 8, 2, 0, 0})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
