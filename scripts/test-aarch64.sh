#!/usr/bin/env bash
# 64-bit ARM: cross-builds the library and its unit tests with Debian's g++-aarch64-linux-gnu
# (toolchain file cmake/toolchains/aarch64-linux-gnu.cmake; arm64 OpenBLAS, Highway and
# GoogleTest from Debian multiarch, installed by scripts/install-deps.sh) into build/aarch64 and
# runs the unit tests under qemu-user (qemu-aarch64). The tests compare every kernel path the
# (emulated) CPU offers, and the portable path, with the float64 oracle, exactly as on x86.
#
# Environment: TOKENMIX_JOBS (build jobs, default 2); TOKENMIX_AARCH64_FILTER (a --gtest_filter,
# default all tests but Dispatch.HugeHeadWidthIsAResourceErrorOnEveryPath, which sizes memory from
# the host); QEMU_CPU (qemu's CPU model, default max).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
jobs=${TOKENMIX_JOBS:-2}
dir=build/aarch64
start=$SECONDS

cmake -S . -B "$dir" -G Ninja \
  -DCMAKE_TOOLCHAIN_FILE="$PWD/cmake/toolchains/aarch64-linux-gnu.cmake" \
  -DCMAKE_BUILD_TYPE=Release \
  -DTOKENMIX_BUILD_CLI=OFF -DTOKENMIX_BUILD_BENCHMARKS=OFF -DTOKENMIX_BUILD_PYTHON=OFF \
  -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST
cmake --build "$dir" --parallel "$jobs" --target tokenmix_tests
built=$SECONDS

export QEMU_LD_PREFIX=/usr/aarch64-linux-gnu
export QEMU_CPU=${QEMU_CPU:-max}
# The loader comes from the cross glibc (QEMU_LD_PREFIX) but the test's RUNPATH reaches the
# multiarch libc6:arm64 in /usr/lib/aarch64-linux-gnu, a different glibc build: with the two
# mixed, pthread_create spins forever (the first OpenMP region, and OpenBLAS's thread pool,
# never start). Take libc, libstdc++ and libgomp from the cross glibc, matching its loader.
export LD_LIBRARY_PATH=/usr/aarch64-linux-gnu/lib
# OpenBLAS on one thread (its pool hung with the mixed glibc above; kept single-threaded).
export OPENBLAS_NUM_THREADS=1
# Left out under emulation only: Dispatch.HugeHeadWidthIsAResourceErrorOnEveryPath reserves
# 12 TiB of PROT_NONE address space (outputs nothing may write), which qemu-user backs with host
# memory until the OOM killer ends the run; natively (x86 CI, a real ARM machine) it runs.
qemu-aarch64 "$dir/tests/tokenmix_tests" --gtest_brief=1 \
  --gtest_filter="${TOKENMIX_AARCH64_FILTER:-*-Dispatch.HugeHeadWidthIsAResourceErrorOnEveryPath}"
echo "test-aarch64: build $((built - start)) s, tests $((SECONDS - built)) s under qemu-aarch64"
