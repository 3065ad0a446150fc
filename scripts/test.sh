#!/usr/bin/env bash
# README's test command, and with --full what CI runs (.ci/run). From a fresh Debian 12 machine:
#   1. install the Debian packages (scripts/install-deps.sh; does nothing if all are there),
#      then check that every C++ file is clang-formatted (scripts/check-format.sh);
#   2. Release build of everything in build/release, then ctest (the kernel suites once per path
#      this CPU has); then the tests that take the automatically chosen path again with
#      TOKENMIX_CPU_CAP=avx2 and =portable (the library then behaves as on a CPU without the
#      capped features);
#   3. Python package (python/run-tests.sh): `pip wheel .` into a persistent virtual environment
#      (${XDG_CACHE_HOME:-$HOME/.cache}/tokenmix/venv; NumPy, PyTorch and transformers installed
#      from PyPI once, when missing), then pytest on python/tests (exit status 5, "no tests ran",
#      is a failure), without the tests marked slow (each has a faster sibling; --full runs them);
#   4. the AVX2-only CPU (scripts/test-avx2-cpu.sh, x86-64 only): no instruction beyond x86-64
#      outside a dispatched call in any object (scripts/check-isa-confinement.py), then the CLI,
#      the kernels' unit tests on the avx2 and portable paths and the Python module under
#      `qemu-x86_64 -cpu max` (AVX2, no AVX-512) where this CPU has AVX-512, natively where it
#      has none;
# and with --full (CI) also:
#   5. the sanitizer build (scripts/sanitize-build.sh, build/sanitize): clang, -O1 with
#      assertions, AddressSanitizer + UBSan, of the library, tools, tests and libFuzzer targets
#      (not the benchmarks), then ctest under the sanitizers;
#   6. fuzzing (scripts/fuzz.sh): the libFuzzer targets of that build, about a minute each;
#   7. ThreadSanitizer (scripts/tsan.sh): the multi-threaded kernel tests.
# Both ctest runs include the install test `install.consumer` (tests/consumer: `cmake --install`
# into a scratch prefix, then a standalone find_package(tokenmix) project built against it with
# the shared and the static library) and `readme.example` (the C++ example in README.md).
# Every stage runs even if an earlier one failed (a stage whose build failed skips its tests);
# a summary with timings comes last. Exit status is non-zero if anything failed.
#
# 64-bit ARM (cross build, tests under qemu-user) is scripts/test-aarch64.sh, run separately.
#
# Usage: scripts/test.sh [--full]
# Environment: TOKENMIX_JOBS (parallel build and test jobs, default 2); TOKENMIX_FUZZ_SECONDS
# (fuzzing time per target, default 60).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
root=$(pwd)

full=0
for arg in "$@"; do
  case $arg in
    --full) full=1 ;;
    *)
      echo "usage: scripts/test.sh [--full]   (unknown argument: $arg)" >&2
      exit 2
      ;;
  esac
done

jobs=${TOKENMIX_JOBS:-2}
release_dir=build/release
sanitize_dir=build/sanitize
logs=build/test-logs

stage_names=()
stage_results=()
stage_times=()
stage_notes=()
failed_tests=()   # for the summary: "  stage:", then its failed tests, one per line
failed=0
script_start=$SECONDS

# record NAME RESULT SECONDS [NOTE]
record() {
  stage_names+=("$1")
  stage_results+=("$2")
  stage_times+=("$3")
  stage_notes+=("${4:-}")
  [[ "$2" == "FAILED" ]] && failed=1
  return 0
}

banner() {
  printf '\n==================== %s ====================\n' "$*"
}

# run_stage NAME COMMAND... : runs the command, records passed/FAILED and the time taken.
run_stage() {
  local name=$1 start=$SECONDS
  shift
  banner "$name"
  if "$@"; then
    record "$name" passed $((SECONDS - start))
    return 0
  fi
  record "$name" FAILED $((SECONDS - start))
  return 1
}

# build_stage NAME DIR CMAKE_ARGS... : configure (Ninja) and build everything in DIR.
build_stage() {
  local name=$1 dir=$2
  shift 2
  run_stage "$name" bash -c '
    set -e
    dir=$1; jobs=$2; shift 2
    cmake -S . -B "$dir" -G Ninja "$@"
    cmake --build "$dir" --parallel "$jobs"
  ' build_stage "$dir" "$jobs" "$@"
}

# test_stage NAME DIR [LOG_TAG [CTEST_ARGS...]] : ctest in DIR; the note says how many tests
# ran and which failed. Variables in the environment (e.g. TOKENMIX_CPU_CAP) reach the tests.
test_stage() {
  local name=$1 dir=$2 tag=${3:-} start=$SECONDS log
  shift $(($# < 3 ? $# : 3))
  log="$logs/$(basename "$dir")${tag:+-$tag}-ctest.log"
  banner "$name"
  ctest --test-dir "$dir" --output-on-failure --no-tests=error --parallel "$jobs" "$@" 2>&1 |
    tee "$log"
  local rc=${PIPESTATUS[0]} note counts failed_list
  counts=$(grep -E 'tests passed, [0-9]+ tests? failed out of [0-9]+' "$log" | tail -n 1)
  note=${counts:-no ctest summary}
  if [[ $rc -ne 0 && -s "$dir/Testing/Temporary/LastTestsFailed.log" ]]; then
    # "99:Suite.Case/avx2  # GetParam() = ..." -> "Suite.Case/avx2"
    failed_list=$(cut -d: -f2- "$dir/Testing/Temporary/LastTestsFailed.log" | sed 's/  #.*//')
    failed_tests+=("  $name:" "$(sed 's/^/    /' <<<"$failed_list")")
  fi
  if grep -qE 'install\.consumer .*Passed' "$log"; then
    note="$note; install test passed"
  elif grep -qE 'install\.consumer' "$log"; then
    note="$note; install test FAILED"
  fi
  if [[ $rc -eq 0 ]]; then
    record "$name" passed $((SECONDS - start)) "$note"
  else
    record "$name" FAILED $((SECONDS - start)) "$note"
  fi
}

skip() {
  record "$1" skipped 0 "${2:-}"
}

summary() {
  banner "tokenmix test summary"
  local i
  for i in "${!stage_names[@]}"; do
    printf '%-34s %-8s %6ss  %s\n' "${stage_names[$i]}" "${stage_results[$i]}" \
      "${stage_times[$i]}" "${stage_notes[$i]}"
  done
  printf '%-34s %-8s %6ss\n' "total" "" $((SECONDS - script_start))
  if [[ ${#failed_tests[@]} -gt 0 ]]; then
    echo
    echo "failed tests (full output above and in $root/$logs):"
    printf '%s\n' "${failed_tests[@]}"
  fi
  if [[ $failed -ne 0 ]]; then
    echo "test.sh: FAILED (logs in $root/$logs)"
  else
    echo "test.sh: everything passed"
  fi
}

banner "environment"
uname -srm
grep -m1 'model name' /proc/cpuinfo 2>/dev/null || true
echo "cores: $(nproc), jobs: $jobs"

# 1. Packages. Without them nothing else can work, so a failure here stops the script.
if ! run_stage "dependencies" bash scripts/install-deps.sh; then
  summary
  exit 1
fi
g++ --version | head -n 1
cmake --version | head -n 1
mkdir -p "$logs"

# 1b. Format: every tracked C++ file exactly as clang-format leaves it (scripts/check-format.sh).
run_stage "format: clang-format" bash scripts/check-format.sh

# 2. Release: everything, all tests: the kernel suites run once per path this CPU has
#    (AllIsas/…, Paths/…, SimdIsas/…: avx2, avx512, avx512_bf16, portable). Then the tests that
#    take whatever path dispatch picks, with the CPU features the library detects capped
#    (TOKENMIX_CPU_CAP): once to AVX2 and once to the portable path, so an AVX2-only CPU and a
#    CPU without x86 SIMD are tested on every machine (the library then behaves exactly as
#    there: paths, `tokenmix info`, TOKENMIX_ISA and AttentionOptions::isa requests). Left out
#    of the capped runs: the per-path suites (their avx2 and portable instances ran above, the
#    same calls), the bench and timed `tokenmix run` tests (ceilings and timings, not paths) and
#    the install test (it only rebuilds the library).
#    The decode suites are not run on the avx512_bf16 path: its decode kernels are the avx512
#    path's functions (dispatch/registry.cpp; only its bf16 forward differs), run by the avx512
#    instances (D-ci-5).
cap_excluded='^(AllIsas|Paths|SimdIsas)/|^cli_bench_|^cli_run_small_|^install\.'
same_decode='/(Decode|DecodeMulti|KVQuantDecode|KVQuantWiden|KVCacheLayer)[.].*/avx512_bf16'
if build_stage "release: configure + build" "$release_dir" -DCMAKE_BUILD_TYPE=Release; then
  test_stage "release: ctest" "$release_dir" "" --exclude-regex "$same_decode"
  for cap in avx2 portable; do
    TOKENMIX_CPU_CAP=$cap test_stage "release: ctest, CPU cap $cap" "$release_dir" "cap-$cap" \
      --exclude-regex "$cap_excluded"
  done
else
  skip "release: ctest" "build failed"
  skip "release: ctest, CPU cap avx2" "build failed"
  skip "release: ctest, CPU cap portable" "build failed"
fi

# 3. Python package and its tests against PyTorch; independent of the C++ stages above.
python_stage() {
  local name="python: wheel + pytest" start=$SECONDS log="$logs/python-pytest.log" rc note
  banner "$name"
  local args=()
  [[ $full -eq 1 ]] && args=(--full)
  env -u ASAN_OPTIONS -u UBSAN_OPTIONS -u LSAN_OPTIONS TOKENMIX_JOBS="$jobs" \
    bash python/run-tests.sh "${args[@]}" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  note=$(grep -E '^=+ .*(passed|failed|errors?|no tests ran|deselected).* in [0-9.]+s' "$log" | tail -n 1 | tr -d '=')
  note=$(echo ${note:-no pytest summary})
  if [[ $rc -eq 0 ]]; then
    record "$name" passed $((SECONDS - start)) "$note"
  else
    record "$name" FAILED $((SECONDS - start)) "$note (exit $rc)"
  fi
}
python_stage

# 4. The AVX2-only CPU (scripts/test-avx2-cpu.sh): whatever x86-64 CPU runs this, the build is
#    run as on one without AVX-512, under QEMU (and natively where the CPU has none).
venv=${TOKENMIX_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenmix/venv}
if [[ "$(uname -m)" != x86_64 ]]; then
  skip "avx2-only CPU" "not an x86-64 host"
elif [[ ! -x "$release_dir/tests/tokenmix_tests" || ! -x "$release_dir/tools/cli/tokenmix" ]]; then
  skip "avx2-only CPU" "release build failed"
else
  avx2_python=()
  if "$venv/bin/python" -c 'import tokenmix, torch' 2>/dev/null; then
    avx2_python=("$venv/bin/python")
  fi
  # (The emulated run where the CPU has AVX-512, the native one where it has none, --full too:
  # the emulation of a CPU this one is would add 2.5 minutes to CI and test nothing more, D-ci-9;
  # TOKENMIX_AVX2_CPU_QEMU=always runs both.)
  qemu_mode=${TOKENMIX_AVX2_CPU_QEMU:-auto}
  run_stage "avx2-only CPU" env -u ASAN_OPTIONS -u UBSAN_OPTIONS -u LSAN_OPTIONS \
    TOKENMIX_JOBS="$jobs" TOKENMIX_AVX2_CPU_QEMU="$qemu_mode" \
    bash scripts/test-avx2-cpu.sh "$release_dir" "${avx2_python[@]}"
  [[ ${#avx2_python[@]} -eq 0 ]] && stage_notes[-1]="the Python module not installed: not run"
fi

if [[ $full -eq 0 ]]; then
  summary
  echo "(scripts/test.sh --full adds the sanitizer, fuzzing and ThreadSanitizer stages: CI runs it)"
  exit $failed
fi

# 5. Debug + AddressSanitizer + UndefinedBehaviorSanitizer. The options apply to the test
#    programs, to gtest's test discovery during the build and to the install test's consumer.
export ASAN_OPTIONS="halt_on_error=1:abort_on_error=0:detect_leaks=1:strict_string_checks=1:check_initialization_order=1:strict_init_order=1:detect_stack_use_after_return=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
if [[ -f tests/sanitizer/lsan.supp ]]; then
  export LSAN_OPTIONS="suppressions=$root/tests/sanitizer/lsan.supp:print_suppressions=0"
fi
#    LLVM's OpenMP runtime (libomp 14, which clang links) loses its hot team's thread records when
#    a team grows (LeakSanitizer: "direct leak" of 1440-byte objects from __kmp_fork_call in every
#    test that changes the thread count); without hot teams it keeps them (D-ci-11).
export KMP_HOT_TEAMS_MAX_LEVEL=0
#    One clang build for these tests and the fuzzers (scripts/sanitize-build.sh, D-ci-11); on a CPU
#    without AVX-512 without the AVX-512 kernels, which could not run here (D-ci-10).
if run_stage "sanitize: configure + build" bash scripts/sanitize-build.sh; then
  # The float64-oracle-heavy tests (their time is the oracle's, 25 s per path under ASan) run in
  # the three Release stages above; the sanitizer stage runs everything else (the CI's 40 min).
  # Nor are the decode suites run again on the avx512_bf16 path here: its decode kernels are the
  # avx512 path's functions (kernels/registry.cpp; only its bf16 forward differs), which the
  # avx512 instances run under the sanitizers (108 s of test time on AMD Zen 4, D-ci-5).
  # Nor the portable instances of the longest oracle tests (decode's register blocking, prefetch
  # order and chunking, the quantized caches' oracle and rolling ring, the reduced-precision
  # shapes: 104 s of the stage's 842 s of test time on AMD Zen 3, and 35 s after): the portable
  # kernels run under the sanitizers in every other test of these suites, and these run there on
  # the SIMD paths and unsanitized on the portable one above (D-ci-11).
  portable_longest='/(DecodeMulti[.](TallBlocksOddStepCounts|PrefetchOrderChangesNoBit|RunsAcrossChunksHeadsAndSequences)|KVQuantDecode[.](MatchesFloat64OracleOverDequantizedCache|RollingRingOverClosedTiles)|ReducedPrecision[.]RandomShapesMatchOracleAndRoundTheFp32Path)/portable( |$)'
  test_stage "sanitize: ctest" "$sanitize_dir" "" --exclude-regex \
    'VariantsMatchFloat64Reference|MatchesFloat64ReferenceAllDtypesAndCaches|RollingCacheMatchesOracle|PrefillThenStepsEqualsFullForward|VariantsAcrossShapesAndAlignments|CombinedVariantsMatchOracleBackward|AttentionVsReference|'"$same_decode|$portable_longest"
else
  skip "sanitize: ctest" "build failed"
fi

# 6. Fuzzing (scripts/fuzz.sh): the libFuzzer targets of the sanitizer build (built above);
#    replays the committed corpus (past crashes included) through ctest, then fuzzes each target
#    for TOKENMIX_FUZZ_SECONDS (default 60) seconds. Its own sanitizer options.
run_stage "fuzz: build, corpus, ${TOKENMIX_FUZZ_SECONDS:-60} s per target" \
  env -u ASAN_OPTIONS -u UBSAN_OPTIONS -u LSAN_OPTIONS bash scripts/fuzz.sh

# 7. ThreadSanitizer (scripts/tsan.sh): clang + LLVM's OpenMP (libomp) with its TSan
#    annotations (libarcher), the multi-threaded kernel tests.
run_stage "tsan: kernel tests" env -u ASAN_OPTIONS -u UBSAN_OPTIONS -u LSAN_OPTIONS -u KMP_HOT_TEAMS_MAX_LEVEL \
  bash scripts/tsan.sh

summary
exit $failed
