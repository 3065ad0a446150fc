#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/: clang, ASan + UBSan + libFuzzer coverage) in the sanitizer
# build, build/sanitize (scripts/sanitize-build.sh, shared with scripts/test.sh --full's sanitizer
# tests: D-ci-11), replays the committed corpus through ctest (seeds and every input that once
# found a bug: the regression tests), then fuzzes the targets side by side, each for about
# TOKENMIX_FUZZ_SECONDS seconds of CPU time (default 60), starting from that corpus. New interesting inputs go to build/fuzz-corpus/<target>
# (not committed); a crash, leak, timeout or sanitizer report leaves its input in
# build/fuzz-artifacts/ and fails the script. To turn a finding into a regression test: fix it,
# then copy the input into fuzz/corpus/<target>/ (ctest replays it from then on).
#
#   bash scripts/fuzz.sh                      # all targets
#   bash scripts/fuzz.sh fuzz_npy             # one target
#   build/sanitize/fuzz/fuzz_api build/fuzz-artifacts/crash-...   # reproduce one input
#
# Environment: TOKENMIX_JOBS (build jobs, and fuzz targets run side by side; default 2),
# TOKENMIX_FUZZ_SECONDS.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
jobs=${TOKENMIX_JOBS:-2}
seconds=${TOKENMIX_FUZZ_SECONDS:-60}
dir=build/sanitize
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(fuzz_npy fuzz_api fuzz_cli)

bash scripts/sanitize-build.sh "${targets[@]}" || exit 1

# The kernels run with two threads (as on the CI machine) whatever the core count.
export OMP_NUM_THREADS=2
export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:allocator_may_return_null=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
# libomp 14 loses its hot team's thread records when a team grows (scripts/test.sh, D-ci-11).
export KMP_HOT_TEAMS_MAX_LEVEL=0
failed=0

# 1. Regression: the committed corpus, every input once.
regex=$(IFS='|'; echo "${targets[*]}")
ctest --test-dir "$dir" --output-on-failure --no-tests=error -R "^fuzz\\.(${regex})\\.corpus$" ||
  failed=1

# 2. Fuzzing, one target after the other.
mkdir -p build/fuzz-artifacts build/fuzz-logs
# fuzz_target TARGET WALL_SECONDS: its report on stdout; exit 1 on a finding.
fuzz_target() {
  local t=$1 wall=$2 log="build/fuzz-logs/$1.log" start=$SECONDS
  mkdir -p "build/fuzz-corpus/$t"
  # -close_fd_mask=1: the CLI's --help text would flood stdout. Errors and reports: stderr, log.
  if "$dir/fuzz/$t" -max_total_time="$wall" -timeout=20 -rss_limit_mb=2048 -max_len=4096 \
       -close_fd_mask=1 -print_final_stats=1 -artifact_prefix="build/fuzz-artifacts/$t-" \
       "build/fuzz-corpus/$t" "fuzz/corpus/$t" >"$log" 2>&1; then
    echo "fuzz.sh: $t: $(grep -E '^stat::number_of_executed_units' "$log" | awk '{print $2}') runs," \
      "$(grep -E '^stat::new_units_added' "$log" | awk '{print $2}') new inputs," \
      "$((SECONDS - start)) s, no finding"
  else
    echo "fuzz.sh: $t FAILED: finding in build/fuzz-artifacts/ (end of $log below)"
    grep -v -E '^tokenmix: error:' "$log" | tail -n 60
    return 1
  fi
}
# The targets run side by side, all at once, each for ⌈seconds × targets / jobs⌉ of wall time, so
# each gets about the seconds of CPU time on the jobs cores: three targets on two cores, 90 s of
# wall time where one after the other took 180 s, and two at a time then the third alone (one core
# idle) 120 s (D-ci-10, D-ci-11). Each one's report is printed whole when it ends.
wall=$seconds
if [[ ${#targets[@]} -gt $jobs ]]; then
  wall=$(((seconds * ${#targets[@]} + jobs - 1) / jobs))
fi
echo "fuzz.sh: ${targets[*]}: side by side on ${jobs} cores, ${wall} s each (about ${seconds} s of" \
  "CPU time each; logs: build/fuzz-logs/)"
pids=()
reports=()
for t in "${targets[@]}"; do
  reports+=("build/fuzz-logs/$t.report")
  fuzz_target "$t" "$wall" >"${reports[-1]}" 2>&1 &
  pids+=($!)
done
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || failed=1
  cat "${reports[$i]}"
done
exit $failed
