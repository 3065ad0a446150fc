#!/usr/bin/env bash
# Installs the Debian 12 (bookworm) packages that tokenmix needs to build, test and benchmark.
#
# Idempotent: asks dpkg-query what is already installed and only runs `apt-get update` +
# `apt-get install` for what is missing, so a second run does nothing and needs no network.
# Works as root; otherwise uses sudo when it is available.
set -euo pipefail

# package               why
packages=(
  build-essential     # g++ 12, make, libc headers
  g++                 # C++20 compiler (also pulls libgomp for OpenMP)
  cmake               # >= 3.25
  ninja-build         # build tool used by scripts/*.sh
  ccache              # compiler cache: fresh clones (CI) rebuild the same sources (CMakeLists.txt)
  pkg-config          # locates OpenBLAS (cmake/Dependencies.cmake)
  libopenblas-dev     # sgemm for the layer projections
  libcli11-dev        # command-line parsing for tools/cli
  libgtest-dev        # GoogleTest (tests/unit); pulls the `googletest` sources package
  libbenchmark-dev    # Google Benchmark (benchmarks)
  libhwy-dev          # Highway: the AVX2/AVX-512 flash, backward and decode kernels
  libdnnl-dev         # oneDNN: the bf16 GEMM ceiling of `tokenmix bench --dtype bf16`
  ocl-icd-opencl-dev  # libOpenCL.so + CL headers: Debian's dnnl-config.cmake find_package()s
                      # OpenCL and fails the configure without it (libdnnl-dev lacks the dep)
  git
  python3             # the Python package (python/) and helper scripts
  python3-venv        # the persistent virtual environment of python/run-tests.sh
  python3-dev         # Python.h for the nanobind extension
  clang-format        # the one formatter (.clang-format; scripts/check-format.sh, test.sh stage)
  # Fuzzing and ThreadSanitizer (scripts/fuzz.sh, scripts/tsan.sh)
  clang               # clang 14: libFuzzer targets and the TSan build
  libclang-rt-14-dev  # compiler-rt: libFuzzer and the sanitizer runtimes for clang
  libomp-dev          # LLVM's OpenMP runtime (libomp), which ThreadSanitizer understands
  libomp5-14          # ... and its TSan annotation tool, libarcher.so
  # 64-bit ARM cross build, tests under qemu-user (scripts/test-aarch64.sh)
  g++-aarch64-linux-gnu  # cross compiler (pulls the arm64 libc, libstdc++ and libgomp)
  qemu-user              # qemu-aarch64 runs the arm64 test binary; qemu-x86_64 -cpu max is the
                         # AVX2-only CPU of scripts/test-avx2-cpu.sh (AVX2, no AVX-512)
  libopenblas-dev:arm64  # arm64 libraries through Debian multiarch (dpkg --add-architecture)
  libhwy-dev:arm64
  libgtest-dev:arm64
)

# arm64 packages need the architecture enabled in dpkg (Debian multiarch); the default
# debian.sources has no Architectures line, so apt then fetches the arm64 indexes too.
need_arch=0
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
  need_arch=1
fi

missing=()
native=$(dpkg --print-architecture)
for pkg in "${packages[@]}"; do
  # One line per installed architecture; "pkg" means the native (or an arch-all) package.
  want="$native|all"
  [[ "$pkg" == *:* ]] && want=${pkg##*:}
  if ! dpkg-query -W -f='${db:Status-Status} ${Architecture}\n' "$pkg" 2>/dev/null |
       grep -qE "^installed ($want)\$"; then
    missing+=("$pkg")
  fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps: all ${#packages[@]} packages already installed"
  exit 0
fi

if [[ $(id -u) -eq 0 ]]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1; then
  as_root=(sudo)
else
  echo "install-deps: missing packages: ${missing[*]}" >&2
  echo "install-deps: not root and sudo is not available; install them as root" >&2
  exit 1
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
if [[ $need_arch -eq 1 ]]; then
  echo "install-deps: enabling the arm64 architecture (dpkg --add-architecture arm64)"
  "${as_root[@]}" dpkg --add-architecture arm64
fi
"${as_root[@]}" apt-get update
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y --no-install-recommends "${missing[@]}"
echo "install-deps: done"
