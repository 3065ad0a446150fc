# Third-party dependencies, all from Debian packages (scripts/install-deps.sh installs them).
find_package(OpenMP REQUIRED)      # libgomp (g++)
find_package(PkgConfig REQUIRED)
pkg_check_modules(OPENBLAS REQUIRED IMPORTED_TARGET GLOBAL openblas)  # libopenblas-dev: sgemm
find_package(hwy CONFIG REQUIRED)  # libhwy-dev: Google Highway, portable SIMD for the kernels
