# Cross build for 64-bit ARM Linux with Debian's cross compiler (g++-aarch64-linux-gnu) against
# arm64 libraries installed through Debian multiarch (libopenblas-dev:arm64, libhwy-dev:arm64,
# libgtest-dev:arm64 under /usr/lib/aarch64-linux-gnu). Programs run under qemu-user.
#   cmake -S . -B build/aarch64 -G Ninja \
#         -DCMAKE_TOOLCHAIN_FILE=cmake/toolchains/aarch64-linux-gnu.cmake
# scripts/test-aarch64.sh does this, builds the unit tests and runs them under qemu-aarch64.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
# Multiarch: find_package/find_library look in /usr/lib/aarch64-linux-gnu (and never in the
# host's x86_64 directories); headers come from /usr/include (arch-independent) and
# /usr/include/aarch64-linux-gnu, which the Debian cross compiler searches by itself.
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
# pkg-config (OpenBLAS): the arm64 .pc files only.
set(ENV{PKG_CONFIG_LIBDIR} "/usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig")
set(ENV{PKG_CONFIG_PATH} "")
# Test programs (gtest discovery, ctest) run under qemu-user; the cross libc, libstdc++ and
# libgomp live in /usr/aarch64-linux-gnu, the multiarch arm64 libraries in the host's /usr/lib.
find_program(TOKENMIX_QEMU_AARCH64 NAMES qemu-aarch64 qemu-aarch64-static REQUIRED)
set(CMAKE_CROSSCOMPILING_EMULATOR ${TOKENMIX_QEMU_AARCH64} -L /usr/aarch64-linux-gnu)
