#!/usr/bin/env bash
# The Python stage of scripts/test.sh (CI): builds the tokenmix wheel (`pip wheel .`, the same
# CMake project with TOKENMIX_BUILD_PYTHON=ON), installs it into a virtual environment, runs
# pytest on python/tests, then a one-round smoke run of `python -m tokenmix.bench`.
#
# Usage: python/run-tests.sh [--full]. Without --full (README's everyday scripts/test.sh) pytest
# deselects the tests marked slow (pyproject.toml: torch.compile with inductor, four-process
# worlds, T = 8192, bench runs; each has a faster sibling that runs) and the smoke run is left
# out; --full (scripts/test.sh --full, CI) runs everything.
#
# The virtual environment is persistent, outside the work tree:
#   ${TOKENMIX_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenmix/venv}
# so NumPy, ml_dtypes, PyTorch, pytest, scikit-build-core, nanobind, Hugging Face transformers
# (for test_transformers.py: tiny models built from configs, nothing downloaded), matplotlib
# (tokenmix.plot, test_plot.py) and pytest-xdist (the tests on TOKENMIX_JOBS workers)
# come from PyPI once per machine and only when missing (PyPI's Linux torch wheel is the CUDA
# build: ~0.5 GB plus
# ~3 GB of nvidia-* wheels that `import torch` needs even on a CPU-only machine; PyPI carries no
# CPU-only torch wheel). Later runs reuse it and need no network. No test is ever skipped for a
# missing package: a package that cannot be installed fails this stage.
#
# Environment: TOKENMIX_JOBS (build jobs, default 2), TOKENMIX_VENV, PYTHON (default python3).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

full=0
for arg in "$@"; do
  case $arg in
    --full) full=1 ;;
    *) echo "usage: python/run-tests.sh [--full]   (unknown argument: $arg)" >&2; exit 2 ;;
  esac
done

jobs=${TOKENMIX_JOBS:-2}
python=${PYTHON:-python3}
venv=${TOKENMIX_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenmix/venv}
wheel_dir=build/python/wheel

as_root() {
  if [[ $(id -u) -eq 0 ]]; then "$@"; elif command -v sudo >/dev/null 2>&1; then sudo "$@"; else
    echo "python/run-tests.sh: need root to run: $*" >&2; return 1; fi
}

# Debian's own python3 lacks venv (ensurepip) and the C headers unless python3-venv and
# python3-dev are installed; other interpreters (pyenv, ...) ship both.
if ! "$python" - <<'PY'
import ensurepip, os, sys, sysconfig
sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")) else 1)
PY
then
  echo "== installing python3-venv and python3-dev (Debian packages) for $python"
  as_root apt-get update -q
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-venv python3-dev
fi

# A venv whose interpreter vanished or changed version is rebuilt.
want=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
have=$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true)
if [[ "$have" != "$want" ]]; then
  echo "== creating virtual environment $venv (Python $want)"
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
py="$venv/bin/python"
echo "== virtual environment: $venv ($("$py" --version))"

# Packages, installed only when missing (module name = requirement).
missing=()
for spec in numpy:numpy torch:torch pytest:pytest scikit_build_core:scikit-build-core \
            nanobind:nanobind transformers:transformers \
            ml_dtypes:ml_dtypes matplotlib:matplotlib xdist:pytest-xdist; do
  "$py" -c "import ${spec%%:*}" 2>/dev/null || missing+=("${spec#*:}")
done
if [[ ${#missing[@]} -gt 0 ]]; then
  echo "== pip install ${missing[*]}"
  start=$SECONDS
  "$py" -m pip install --progress-bar off "${missing[@]}"
  echo "== installed in $((SECONDS - start)) s"
fi
"$py" -c 'import numpy, torch, transformers as t
print("numpy", numpy.__version__, "| torch", torch.__version__, "| transformers", t.__version__)'

# Build the wheel (incremental in build/python-<tag>: pyproject.toml) and install it. The compiler
# is CMake's default (c++), as in scripts/test.sh's C++ builds, not Python's sysconfig CXX (g++,
# which scikit-build-core sets when CXX is unset): ccache keys on the compiler's name, so the
# wheel's objects are then the release build's cache hits instead of a fifth compile of the
# kernels (with the build directory at build/release's depth, see pyproject.toml).
export CXX=${CXX:-c++}
echo "== pip wheel ."
rm -rf "$wheel_dir"
CMAKE_BUILD_PARALLEL_LEVEL=$jobs "$py" -m pip wheel --no-build-isolation --no-deps -w "$wheel_dir" .
wheel=$(ls "$wheel_dir"/tokenmix-*.whl)
"$py" -m pip install --force-reinstall --no-deps "$wheel"

# Tests run against the installed package (pytest's rootdir is the repository; the source
# tree's python/tokenmix is not on sys.path).
# TOKENMIX_JOBS pytest workers (pytest-xdist; 1: no workers): the tests are mostly short,
# single-threaded calls, inductor compiles and subprocess worlds, so two workers on the 2-core
# machine take the --full pytest from 258 s to 187 s (D-ci-11).
echo "== pytest ($jobs workers)"
workers=()
[[ $jobs -gt 1 ]] && workers=(-n "$jobs")
if [[ $full -eq 1 ]]; then
  "$py" -m pytest python/tests -p no:cacheprovider -ra "${workers[@]}"
else
  "$py" -m pytest python/tests -p no:cacheprovider -ra -m "not slow" "${workers[@]}"
  echo "== (the tests marked slow and the benchmark smoke run: python/run-tests.sh --full)"
  exit 0
fi

echo "== benchmark smoke run"
(cd /tmp && "$py" -m tokenmix.bench --seq 128 --repeats 1 --heads-q 4 --heads-kv 2 --head-dim 32)
(cd /tmp && "$py" -m tokenmix.bench --seq 128 --repeats 1 --heads-q 4 --heads-kv 2 --head-dim 32 \
  --dtype bf16)
