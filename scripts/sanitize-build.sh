#!/usr/bin/env bash
# The sanitizer build, build/sanitize, shared by scripts/test.sh --full (its ASan + UBSan ctest)
# and scripts/fuzz.sh (the libFuzzer targets): clang, AddressSanitizer + UBSan
# (-DTOKENMIX_SANITIZE=ON) and the fuzz targets with libFuzzer's coverage instrumentation
# (-DTOKENMIX_BUILD_FUZZERS=ON); not the benchmarks (the Release build has them). One build instead
# of a GCC one for the tests and a clang one for the fuzzers: the library, the tools and the tests
# compile once (D-ci-11). Everything at -O1 with line tables (-g1) and the assertions on (no
# NDEBUG): the build takes 1.3× as long as at -O0 and its ctest half the time.
# On a CPU without AVX-512 the AVX-512 kernels could not run here: not compiled (their build was
# 45 % of this build's compile time; D-ci-10). A CPU with AVX-512 builds and runs them.
#
# Usage: scripts/sanitize-build.sh [TARGET...]   (default: everything)
# Environment: TOKENMIX_JOBS (parallel build jobs, default 2).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
jobs=${TOKENMIX_JOBS:-2}
dir=build/sanitize

avx512_kernels=ON
if [[ "$(uname -m)" == x86_64 ]] && ! grep -qw avx512f /proc/cpuinfo; then
  avx512_kernels=OFF
fi
# A build directory configured with another compiler (GCC, before D-ci-11) starts afresh: CMake
# cannot change the compiler of a configured tree.
if [[ -f "$dir/CMakeCache.txt" ]] &&
   ! grep -q '^CMAKE_CXX_COMPILER:[A-Z]*=.*clang++' "$dir/CMakeCache.txt"; then
  echo "sanitize-build.sh: $dir was configured for another compiler: starting it afresh"
  rm -rf "$dir"
fi
cmake -S . -B "$dir" -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" \
  -DTOKENMIX_SANITIZE=ON -DTOKENMIX_BUILD_FUZZERS=ON -DTOKENMIX_BUILD_BENCHMARKS=OFF \
  -DTOKENMIX_SIMD_AVX512="$avx512_kernels"
if [[ $# -gt 0 ]]; then
  cmake --build "$dir" --parallel "$jobs" --target "$@"
else
  cmake --build "$dir" --parallel "$jobs"
fi
