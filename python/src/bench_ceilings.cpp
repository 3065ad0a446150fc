// python/src/bench_ceilings.cpp — the benchmark ceilings of `tokenmix bench`
// (tools/bench/ceilings.hpp, the library tokenmix_ceilings) for `python -m tokenmix.bench`:
// the sgemm and bf16 GEMM ceilings, the streaming read, the passes' median and spread. The same
// C++ code as the CLI's, so the Python bench's ratios are to the CLI's ceilings, measured in the
// same process as PyTorch. Internal (names start with bench_ / Bench): tokenmix.bench wraps them.
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings.hpp"
#include "ceilings.hpp"

namespace tokenmix_py {

using namespace nb::literals;
namespace bench = tmx::bench;

namespace {

// The objects hold their operands (48 MiB for the sgemm, the buffer for the read) and are used
// with the GIL released: one lock each, as KVCache and the layer have.
struct PySgemmCeiling {
  bench::SgemmCeiling sgemm;
  std::mutex mutex;
};
struct PyStreamRead {
  explicit PyStreamRead(std::size_t bytes) : read(bytes) {}
  bench::StreamRead read;
  std::mutex mutex;
};

// threads 0 = all (default_threads()), as every binding takes it; out of [0, INT_MAX] →
// ArgumentError naming `fn` (thread_count).
int ceiling_threads(const IntArg& threads, const char* fn) {
  const int t = thread_count(threads, fn);
  return t == 0 ? tmx::default_threads() : t;
}

}  // namespace

void bind_bench_ceilings(nb::module_& m) {
  nb::class_<PySgemmCeiling>(m, "BenchSgemmCeiling")
      .def(nb::init<>())
      .def(
          "pass_gflops",
          [](PySgemmCeiling& self, IntArg threads, int calls) {
            const int t = ceiling_threads(threads, "BenchSgemmCeiling.pass_gflops");
            nb::gil_scoped_release release;
            std::lock_guard lock(self.mutex);
            return self.sgemm.pass_gflops(t, calls);
          },
          "threads"_a, "calls"_a)
      .def(
          "best_gflops",
          [](PySgemmCeiling& self, IntArg threads, int repeats) {
            const int t = ceiling_threads(threads, "BenchSgemmCeiling.best_gflops");
            nb::gil_scoped_release release;
            std::lock_guard lock(self.mutex);
            return self.sgemm.best_gflops(t, repeats);
          },
          "threads"_a, "repeats"_a = 10);

  nb::class_<PyStreamRead>(m, "BenchStreamRead")
      .def(
          "__init__",
          [](PyStreamRead* self, IntArg bytes) {
            const std::int64_t b = int64_arg(bytes, "BenchStreamRead", "bytes");
            if (b < 0) {
              argument_error(tmx::ErrorCode::invalid_argument,
                             "BenchStreamRead: bytes must be >= 16384; got " + std::to_string(b));
            }
            nb::gil_scoped_release release;
            new (self) PyStreamRead(static_cast<std::size_t>(b));
          },
          "bytes"_a)
      .def(
          "pass_gbps",
          [](PyStreamRead& self, IntArg threads) {
            const int t = ceiling_threads(threads, "BenchStreamRead.pass_gbps");
            nb::gil_scoped_release release;
            std::lock_guard lock(self.mutex);
            return self.read.pass_gbps(t);
          },
          "threads"_a)
      .def_prop_ro("bytes", [](const PyStreamRead& self) { return self.read.bytes(); })
      .def_prop_ro("kind", [](const PyStreamRead& self) { return self.read.kind(); });

  m.def("bench_sgemm_core", &bench::sgemm_core);
  m.def("bench_sgemm_ceiling_warning", [] { return bench::sgemm_ceiling_warning(); });
  m.def("bench_cpu_has_bf16_gemm", &bench::cpu_has_bf16_gemm);
  m.def("bench_have_onednn", &bench::have_onednn);
  m.def(
      "bench_gemm_ceiling_choice",
      [](const std::string& dtype) {
        const bench::GemmCeilingChoice c = bench::gemm_ceiling_choice(parse_dtype(dtype));
        return std::make_pair(c.bf16_gemm, c.kind);
      },
      "dtype"_a);
  m.def(
      "bench_bf16_gemm_ceiling",
      [](IntArg threads, int repeats) {
        const int t = ceiling_threads(threads, "bench_bf16_gemm_ceiling");
        std::string kind;
        double gflops = 0.0;
        {
          nb::gil_scoped_release release;
          gflops = bench::bf16_gemm_ceiling_gflops(t, kind, repeats);
        }
        return std::make_pair(gflops, kind);
      },
      "threads"_a, "repeats"_a = 10);
  m.def(
      "bench_ceiling_spread",
      [](const std::vector<double>& passes) {
        const bench::CeilingSpread s = bench::ceiling_spread(passes);
        return std::make_tuple(s.median, s.min, s.max);
      },
      "passes"_a);
  m.def("bench_after_sgemm_pause_s", [] { return bench::kAfterSgemmMs / 1e3; });
}

}  // namespace tokenmix_py
