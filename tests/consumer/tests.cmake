# Install test (included by tests/CMakeLists.txt): installs this build into a scratch prefix,
# then builds and runs the standalone project in tests/consumer/ against it, once with
# tokenmix::tokenmix (shared) and once with tokenmix::tokenmix_static. See run_install_test.cmake.
set(_consumer_args
  -DTOKENMIX_BUILD_DIR=${PROJECT_BINARY_DIR}
  -DCONSUMER_SOURCE_DIR=${CMAKE_CURRENT_LIST_DIR}
  -DWORK_DIR=${PROJECT_BINARY_DIR}/install-test
  -DGENERATOR=${CMAKE_GENERATOR}
  -DMAKE_PROGRAM=${CMAKE_MAKE_PROGRAM}
  -DCXX_COMPILER=${CMAKE_CXX_COMPILER}
  -DBUILD_TYPE=$<CONFIG>
  -DSANITIZE=${TOKENMIX_SANITIZE})
add_test(NAME install.consumer
         COMMAND ${CMAKE_COMMAND} ${_consumer_args} -P ${CMAKE_CURRENT_LIST_DIR}/run_install_test.cmake)
# Builds a small project: give it time on a loaded 2-core machine.
set_tests_properties(install.consumer PROPERTIES TIMEOUT 600 LABELS install)
unset(_consumer_args)
