# Third-party dependencies, all from Debian packages (scripts/install-deps.sh installs them).
find_package(OpenMP REQUIRED)      # libgomp (g++)
find_package(PkgConfig REQUIRED)
pkg_check_modules(OPENBLAS REQUIRED IMPORTED_TARGET GLOBAL openblas)  # libopenblas-dev: sgemm
# oneDNN (libdnnl-dev, installed by scripts/install-deps.sh): the bf16 GEMM ceiling of
# `tokenmix bench --dtype bf16` and `python -m tokenmix.bench --dtype bf16` only
# (tools/bench/ceilings.hpp); without it their bf16 ceiling is the sgemm, and ceiling_kind says so.
find_package(dnnl CONFIG QUIET)
find_package(hwy CONFIG REQUIRED)  # libhwy-dev: Google Highway, portable SIMD for the kernels
