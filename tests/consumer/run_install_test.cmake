# Install test, run by ctest (`install.consumer`, registered in tests.cmake) as
#   cmake -DTOKENMIX_BUILD_DIR=... -DCONSUMER_SOURCE_DIR=... -DWORK_DIR=... [-DGENERATOR=...]
#         [-DMAKE_PROGRAM=...] [-DCXX_COMPILER=...] [-DBUILD_TYPE=...] [-DSANITIZE=ON] -P <this file>
#
# 1. `cmake --install` the already built tree into a fresh prefix WORK_DIR/prefix;
# 2. configure tests/consumer against that prefix only (find_package(tokenmix)), build it;
# 3. run the consumer linked to tokenmix::tokenmix (shared) and to tokenmix::tokenmix_static;
# 4. run the installed command-line tool, if it was installed.
# Any failure stops the script with FATAL_ERROR, which ctest reports as a failed test.
cmake_minimum_required(VERSION 3.25)

foreach(var TOKENMIX_BUILD_DIR CONSUMER_SOURCE_DIR WORK_DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_install_test.cmake: -D${var}=... is required")
  endif()
endforeach()
if(NOT BUILD_TYPE)
  set(BUILD_TYPE Release)
endif()

set(prefix ${WORK_DIR}/prefix)
set(build ${WORK_DIR}/build)
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

function(run step)
  list(JOIN ARGN " " command_line)
  message(STATUS "[install test] ${step}: ${command_line}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "[install test] ${step} failed (${rc})")
  endif()
endfunction()

# 1. Install.
run("install" ${CMAKE_COMMAND} --install ${TOKENMIX_BUILD_DIR} --prefix ${prefix} --config ${BUILD_TYPE})
if(NOT EXISTS ${prefix}/include/tokenmix/tokenmix.hpp)
  message(FATAL_ERROR "[install test] the public headers were not installed under ${prefix}/include")
endif()
file(GLOB_RECURSE config_file ${prefix}/*/tokenmixConfig.cmake)
if(NOT config_file)
  message(FATAL_ERROR "[install test] no tokenmixConfig.cmake was installed under ${prefix}")
endif()

# 2. Configure and build the consumer against the prefix (and nothing else: no package registry).
set(configure_args -S ${CONSUMER_SOURCE_DIR} -B ${build}
    -DCMAKE_BUILD_TYPE=${BUILD_TYPE} -DCMAKE_PREFIX_PATH=${prefix}
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF)
if(GENERATOR)
  list(APPEND configure_args -G ${GENERATOR})
endif()
if(MAKE_PROGRAM)
  list(APPEND configure_args -DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM})
endif()
if(CXX_COMPILER)
  list(APPEND configure_args -DCMAKE_CXX_COMPILER=${CXX_COMPILER})
endif()
if(SANITIZE)
  # A sanitized libtokenmix needs the sanitizer runtimes in the executable that loads it.
  set(san -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer)
  list(JOIN san " " san)
  list(APPEND configure_args "-DCMAKE_CXX_FLAGS=${san}" "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined")
endif()
run("configure consumer" ${CMAKE_COMMAND} ${configure_args})

# The consumer must have found the package we just installed, not some other copy.
file(STRINGS ${build}/CMakeCache.txt found_dir REGEX "^tokenmix_DIR:")
string(REGEX REPLACE "^tokenmix_DIR:[A-Z]+=" "" found_dir "${found_dir}")
file(REAL_PATH "${found_dir}" found_dir)
file(REAL_PATH "${prefix}" real_prefix)
string(FIND "${found_dir}" "${real_prefix}/" pos)
if(NOT pos EQUAL 0)
  message(FATAL_ERROR "[install test] consumer found tokenmix in ${found_dir}, not under ${prefix}")
endif()

run("build consumer" ${CMAKE_COMMAND} --build ${build} --parallel 2)

# 3. Run it, against the shared and the static library.
foreach(exe consumer_shared consumer_static)
  run("run ${exe}" ${build}/${exe})
endforeach()

# 4. The installed CLI must start from the prefix (no build-tree paths baked in).
if(EXISTS ${prefix}/bin/tokenmix)
  run("run installed CLI" ${prefix}/bin/tokenmix --help)
endif()
message(STATUS "[install test] passed")
