#!/usr/bin/env bash
# The AVX2-only CPU stage of scripts/test.sh: the Release build, run as on an x86-64 CPU with
# AVX2 + FMA and no AVX-512 (AMD Zen 3, Intel client CPUs since Alder Lake), whatever x86-64 CPU
# runs the tests (docs/design.md, "ISA confinement"):
#   1. scripts/check-isa-confinement.py over the library's objects, the shared library, the CLI,
#      the unit-test binary and (when given) the wheel's objects: no instruction beyond x86-64
#      outside a dispatched scope, so no initializer and no shared inline function is compiled
#      for an ISA the CPU may lack, whatever order the linker picks;
#   2. under `qemu-x86_64 -cpu max` (QEMU's TCG CPU: AVX2, FMA, F16C, no AVX-512) with no
#      TOKENMIX_CPU_CAP, so the library detects that CPU itself:
#      - `tokenmix info` starts and picks `avx2 (automatic)`;
#      - `tokenmix check` passes;
#      - the unit tests of each kernel family (forward, backward, decode over every cache dtype,
#        score variants, bf16/f16, the layer) on the avx2 and the portable path, a filter that
#        keeps this to a few minutes under emulation (the full suites run natively in the
#        ctest stages);
#      - the Python module from the installed wheel: import, one forward + backward through
#        tokenmix.torch.scaled_dot_product_attention, one decode step (python/tests/avx2_cpu_smoke.py);
#   3. on a host whose CPU has no avx512f, the same natively: that CPU is one, so the emulated run
#      (2) is left out there unless TOKENMIX_AVX2_CPU_QEMU=always (it would add 2.5 minutes and
#      test nothing the native run does not; scripts/test.sh --full leaves it out too, D-ci-9).
# Each failure is named; the exit status is non-zero if anything failed.
#
# Usage: scripts/test-avx2-cpu.sh BUILD_DIR [PYTHON]
#   BUILD_DIR  the Release build (build/release)
#   PYTHON     an interpreter with the tokenmix wheel and PyTorch installed (the venv of
#              python/run-tests.sh); without it the Python checks are not run, and say so.
# Environment: TOKENMIX_JOBS (parallel test processes, default 2); TOKENMIX_AVX2_CPU_QEMU=always
# (the emulated run on every host; default auto: only where the CPU has AVX-512).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

build=${1:?usage: test-avx2-cpu.sh BUILD_DIR [PYTHON]}
python=${2:-}
jobs=${TOKENMIX_JOBS:-2}
unset TOKENMIX_CPU_CAP TOKENMIX_ISA

if [[ "$(uname -m)" != "x86_64" ]]; then
  echo "test-avx2-cpu: not an x86-64 host ($(uname -m)); nothing to do"
  exit 0
fi
tool="$build/tools/cli/tokenmix"
tests="$build/tests/tokenmix_tests"
for f in "$tool" "$tests"; do
  [[ -x "$f" ]] || { echo "test-avx2-cpu: $f was not built" >&2; exit 1; }
done
if ! command -v qemu-x86_64 >/dev/null; then
  echo "test-avx2-cpu: qemu-x86_64 is missing (Debian qemu-user: scripts/install-deps.sh)" >&2
  exit 1
fi

failures=()
fail() {
  echo "test-avx2-cpu: FAILED: $*" >&2
  failures+=("$*")
}

# 1. Objects and binaries: the library's objects, the shared library, the CLI and the test
#    binary; with an interpreter, also the objects of the wheel's build (pyproject.toml's
#    build-dir; the extension itself is stripped by nanobind, so its objects are checked).
files=$(find "$build/src" -name '*.o' -path '*tokenmix_objects.dir*')
if [[ -n "$python" ]]; then
  wheel_objects=$(find build -maxdepth 1 -name 'python-cp*' -type d -exec find {} -name '*.o' \;)
  [[ -n "$wheel_objects" ]] || fail "no objects of the wheel's build under build/python-cp*"
  files+=" $wheel_objects"
fi
# shellcheck disable=SC2086
python3 scripts/check-isa-confinement.py $files "$build"/src/libtokenmix.so "$tool" "$tests" ||
  fail "ISA confinement (scripts/check-isa-confinement.py)"
extension=""
if [[ -n "$python" ]]; then
  extension=$("$python" -c 'import tokenmix._tokenmix as m; print(m.__file__)' 2>/dev/null) ||
    fail "the Python extension cannot be imported with $python"
fi

# The unit tests of each kernel family, on one path: the cases that keep the whole to about two
# minutes under emulation (tile edges, GQA, odd d_h, every cache dtype and kind, variants,
# bf16/f16 rounding, thread-count bit equality, finite differences); the measured times under
# QEMU on AMD Zen 3 are in docs/design.md, "ISA confinement". Left out under QEMU only:
# KVQuantDecode.Fp8DirectReadingSameBitsAsF16, which runs with MXCSR.DAZ set: QEMU 7.2 flushes
# f16 subnormals in VCVTPH2PS under DAZ, where the CPUs do not (the SDM: F16C conversions ignore
# DAZ; a Zen 3 gives 2^-24 for code 0x0001 with DAZ set, QEMU 0).
gtest_filter() {
  local p=$1 emulated=$2
  local -a cases=(
    "AllIsas/FlashKernels.MatchesFloat64ReferenceAcrossTileEdges/$p"
    "AllIsas/FlashKernels.BackwardMatchesFiniteDifferences/$p"
    "AllIsas/FlashKernels.BackwardTinyShapesMatchFloat64Reference/$p"
    "AllIsas/FlashKernels.BackwardPackingEdgesMatchFloat64Reference/$p"
    "AllIsas/FlashKernels.BackwardOnePassBitwiseIdenticalAcrossThreadCounts/$p"
    "Paths/AttentionPerIsa.*/$p"
    "AllIsas/Decode.PagedBitwiseEqualsContiguous/$p"
    "AllIsas/Decode.RollingCacheMatchesOracleAndFullCache/$p"
    "AllIsas/Decode.WindowIgnoresEverythingBeforeIt/$p"
    "AllIsas/DecodeMulti.MixedLengthsEveryDtypeAndCache/$p"
    "AllIsas/DecodeMulti.RowBlocksOfAtMostFourRowsEveryColumnSplit/$p"
    "AllIsas/KVQuantDecode.VariantsAndRollingCacheMatchOracle/$p"
    "AllIsas/KVQuantDecode.Int8RowsAndQuadsSameBits/$p"
    "AllIsas/KVQuantDecode.Int8QuadsExactOutsideTheFastReadingsRange/$p"
    "AllIsas/KVQuantWiden.*/$p"
    "AllIsas/VariantKernels.EachVariantAcrossTileEdges/$p"
    "AllIsas/Dropout.ForwardMatchesOracleWithTheSameMask/$p"
    "AllIsas/Dropout.BackwardMatchesOracleWithTheSameMask/$p"
    "AllIsas/ReducedPrecision.ForwardMatchesOracleAndRoundsTheFp32Path/$p"
    "AllIsas/ReducedPrecision.BackwardMatchesOracleAndRoundsTheFp32Path/$p"
    "AllIsas/LayerVariantsIsa.ForwardAndSinkGradientMatchFloat64/$p"
    "AllIsas/LayerVariantsIsa.RandomLayersPrefillAndStepMatchFloat64/$p"
    "AllIsas/SoftmaxExp.SpecialValues/$p"
    "AllIsas/SoftcapTanh.SpecialValues/$p"
    "AllIsas/SmallGemmChunk.*/$p"
  )
  [[ $emulated == 0 ]] && cases+=("AllIsas/KVQuantDecode.Fp8DirectReadingSameBitsAsF16/$p")
  local IFS=:
  echo "${cases[*]}"
}

# run_on NAME RUNNER... : the checks of 2, through RUNNER (empty: natively).
run_on() {
  local name=$1 start=$SECONDS out emulated=0
  shift
  [[ $1 == qemu-* ]] && emulated=1
  echo "== $name: tokenmix info"
  if ! out=$("$@" "$tool" info 2>&1); then
    echo "$out"
    fail "$name: tokenmix info did not start"
  elif ! grep -q '^kernel path: *avx2 (automatic)' <<<"$out"; then
    echo "$out"
    fail "$name: tokenmix info did not pick avx2 by itself"
  else
    grep -E '^(cpu|cpu features|available paths|kernel path):' <<<"$out" | cut -c1-100
  fi
  echo "== $name: tokenmix check"
  "$@" "$tool" check >"$logs/avx2-cpu-$name-check.log" 2>&1 ||
    { tail -n 20 "$logs/avx2-cpu-$name-check.log"; fail "$name: tokenmix check"; }
  tail -n 1 "$logs/avx2-cpu-$name-check.log"
  echo "== $name: unit tests of each kernel family on the avx2 and portable paths"
  local p i ran pids=() rcs=() paths=(avx2 portable)
  for i in "${!paths[@]}"; do
    "$@" "$tests" --gtest_filter="$(gtest_filter "${paths[$i]}" "$emulated")" \
      >"$logs/avx2-cpu-$name-${paths[$i]}.log" 2>&1 &
    pids[i]=$!
    if [[ $jobs -lt 2 ]]; then
      rcs[i]=0
      wait "${pids[$i]}" || rcs[i]=$?
    fi
  done
  for i in "${!paths[@]}"; do
    p=${paths[$i]}
    if [[ -z "${rcs[$i]:-}" ]]; then
      rcs[i]=0
      wait "${pids[$i]}" || rcs[i]=$?
    fi
    # Passed, none skipped (the path must run here), and the filter still names real tests.
    ran=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) tests\?\.$/\1/p' "$logs/avx2-cpu-$name-$p.log")
    if [[ ${rcs[$i]} -eq 0 && ${ran:-0} -ge 20 ]] &&
       ! grep -q '^\[  SKIPPED \]' "$logs/avx2-cpu-$name-$p.log"; then
      grep -E '^\[(  PASSED  |==========)\]' "$logs/avx2-cpu-$name-$p.log" | sed "s|^|$p: |"
    else
      tail -n 40 "$logs/avx2-cpu-$name-$p.log"
      fail "$name: unit tests on the $p path (log: $logs/avx2-cpu-$name-$p.log)"
    fi
  done
  if [[ -n "$python" && -n "$extension" ]]; then
    echo "== $name: the Python module (installed wheel)"
    (cd /tmp && "$@" "$python" "$OLDPWD/python/tests/avx2_cpu_smoke.py") ||
      fail "$name: the Python module"
  elif [[ -z "$python" ]]; then
    echo "== $name: the Python module: not run (no interpreter given)"
  fi
  echo "== $name: $((SECONDS - start)) s"
}

logs=build/test-logs
mkdir -p "$logs"
qemu_mode=${TOKENMIX_AVX2_CPU_QEMU:-auto}
if [[ $qemu_mode != auto && $qemu_mode != always ]]; then
  fail "TOKENMIX_AVX2_CPU_QEMU must be auto or always; got '$qemu_mode'"
elif grep -qw avx512f /proc/cpuinfo; then
  run_on qemu qemu-x86_64 -cpu max
  echo "== native: this CPU has AVX-512; the emulated run above is the AVX2-only one"
else
  [[ $qemu_mode == always ]] && run_on qemu qemu-x86_64 -cpu max
  run_on native env
  [[ $qemu_mode == auto ]] &&
    echo "== qemu: left out, this CPU has no AVX-512 (the native run is on an AVX2-only CPU; TOKENMIX_AVX2_CPU_QEMU=always runs both)"
fi

if [[ ${#failures[@]} -gt 0 ]]; then
  printf 'test-avx2-cpu: %d failure(s):\n' "${#failures[@]}"
  printf '  %s\n' "${failures[@]}"
  exit 1
fi
echo "test-avx2-cpu: everything passed"
