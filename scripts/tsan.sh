#!/usr/bin/env bash
# ThreadSanitizer run of the multi-threaded kernel tests (build/tsan).
#
# TSan only understands synchronisation it can see. GCC's OpenMP runtime (libgomp) is not
# instrumented, so its barriers and work sharing look like races and the reports drown real
# ones. This build therefore uses clang with LLVM's OpenMP runtime (libomp, Debian libomp-14-dev)
# and loads libomp's TSan annotation tool, Archer (libarcher.so from libomp5-14), through the
# OpenMP tools interface (OMP_TOOL_LIBRARIES): it tells TSan about every barrier, task and
# reduction, so what remains is a real race in tokenmix code. Reports halt the run.
# The SIMD forward/backward kernels run their teams too: their parallel region is opened
# outside the Highway target code (RunTeam, kernels/kernel_skeleton.hpp), which clang 14 needs.
#
# Environment: TOKENMIX_JOBS (build jobs, default 2); TOKENMIX_TSAN_FILTER (gtest filter);
# OMP_NUM_THREADS (default 4: more threads than cores interleave more).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
jobs=${TOKENMIX_JOBS:-2}
dir=build/tsan
archer=$(clang++ -print-resource-dir >/dev/null 2>&1 && ls /usr/lib/llvm-*/lib/libarcher.so 2>/dev/null | sort -V | tail -n 1)
if [[ -z "$archer" ]]; then
  echo "tsan.sh: libarcher.so not found (Debian package libomp5-14)" >&2
  exit 1
fi

# -O1 with line tables only (-gline-tables-only: the reports keep files and lines): a test source
# compiled in 99 s instead of 149 s at RelWithDebInfo's -O2 -g (D-ci-9).
cmake -S . -B "$dir" -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -gline-tables-only -DNDEBUG" -DTOKENMIX_TSAN=ON -DTOKENMIX_BUILD_CLI=OFF -DTOKENMIX_BUILD_BENCHMARKS=OFF \
  -DTOKENMIX_BUILD_PYTHON=OFF -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST || exit 1
cmake --build "$dir" --parallel "$jobs" --target tokenmix_tests || exit 1

# The kernel tests that run OpenMP teams: flash forward/backward on every path, GQA/causality,
# merge, decode and the KV cache. (Layer tests spend their time in OpenBLAS, which is not
# instrumented.)
# The oracle-heavy decode and table tests are left out (their time is the float64 oracle; the
# decode kernel's threading is exercised by the other Decode tests): the CI stays under 40 min.
# The decode and KV cache suites' avx512_bf16 instances too: that path's decode kernels are the
# avx512 path's functions (dispatch/registry.cpp). So are the decode tests of register blocking
# and prefetch order (TallBlocksOddStepCounts, PrefetchOrderChangesNoBit: their teams are every
# other decode test's) and the portable instance of RunsAcrossChunksHeadsAndSequences (its avx2
# instance runs the same chunking across 1-3 threads): under TSan they were 530 of the stage's
# 740 s, 80% of it in their float64 oracle and inputs (performance.md, D-ci-9).
filter=${TOKENMIX_TSAN_FILTER:-'*Flash*:*Attention*:*Gqa*:*GQA*:*Decode*:*KVCache*:*Merge*:*VariantKernels.Sink*:*VariantKernels.NaN*:*Dropout.BitwiseIdentical*-*VariantsMatchFloat64Reference*:*MatchesFloat64ReferenceAllDtypesAndCaches*:*RollingCacheMatchesOracle*:*AttentionVsReference*:*Decode*/avx512_bf16:*KVCache*/avx512_bf16:*DecodeMulti.TallBlocksOddStepCounts/*:*DecodeMulti.PrefetchOrderChangesNoBit/*:*DecodeMulti.RunsAcrossChunksHeadsAndSequences/portable'}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export OMP_TOOL_LIBRARIES=$archer

# ignore_noninstrumented_modules: libomp itself is not instrumented; Archer asks for it.
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:history_size=4:ignore_noninstrumented_modules=1"
echo "tsan.sh: OMP_TOOL_LIBRARIES=$archer OMP_NUM_THREADS=$OMP_NUM_THREADS filter=$filter"
"$dir/tests/tokenmix_tests" --gtest_filter="$filter" --gtest_brief=1
