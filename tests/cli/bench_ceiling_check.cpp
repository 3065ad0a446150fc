// tests/cli/bench_ceiling_check.cpp — helper test of the CLI tests (tests/cli/tests.cmake): the
// rule by which `tokenmix bench` warns that its sgemm ceiling is below the CPU's
// (bench::sgemm_ceiling_warning: OpenBLAS runs a kernel without AVX-512 where tokenmix's kernels
// run AVX-512), for given core names and CPUs, so the expectation does not depend on the CPU that
// runs it. Exit 0 if every check holds, 1 otherwise (each failure printed).
#include <cstdio>
#include <string>

#include "bench.hpp"

namespace {
int failures = 0;
void expect(bool ok, const char* what) {
  if (!ok) {
    std::printf("FAILED: %s\n", what);
    ++failures;
  }
}
}  // namespace

int main() {
  using tokenmix::bench::sgemm_ceiling_warning;
  // AVX-512 kernels against an AVX2 sgemm (OPENBLAS_CORETYPE=Haswell on an AMD Zen 5): warned,
  // naming the kernel, the variable and the way out.
  const std::string w = sgemm_ceiling_warning("Haswell", true, "Haswell");
  expect(w.find("OpenBLAS's Haswell kernel") != std::string::npos, "names the kernel");
  expect(w.find("OPENBLAS_CORETYPE=Haswell") != std::string::npos, "names the variable's value");
  expect(w.find("OPENBLAS_CORETYPE=SKYLAKEX") != std::string::npos, "says how to fix it");
  expect(!sgemm_ceiling_warning("Zen", true, nullptr).empty(), "Zen kernel, AVX-512 CPU");
  expect(sgemm_ceiling_warning("Zen", true, nullptr).find("OPENBLAS_CORETYPE=Zen") ==
             std::string::npos,
         "no variable named when it is unset");
  // OpenBLAS's AVX-512 kernels, any case: no warning.
  for (const char* wide : {"SkylakeX", "Cooperlake", "SapphireRapids", "SKYLAKEX"})
    expect(sgemm_ceiling_warning(wide, true, nullptr).empty(), wide);
  // tokenmix without AVX-512 (an AVX2-only CPU, TOKENMIX_CPU_CAP=avx2, ARM): never.
  expect(sgemm_ceiling_warning("Haswell", false, "Haswell").empty(), "AVX2 kernels, AVX2 sgemm");
  expect(sgemm_ceiling_warning("NEOVERSEN1", false, nullptr).empty(), "ARM");
  std::printf("%s\n", failures == 0 ? "bench_ceiling_check: all checks hold" : "");
  return failures == 0 ? 0 : 1;
}
