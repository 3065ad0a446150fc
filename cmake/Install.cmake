# Installs headers, both libraries and a CMake package so that consumers can write
#   find_package(tokenmix REQUIRED)
#   target_link_libraries(app PRIVATE tokenmix::tokenmix)   # or tokenmix::tokenmix_static
include(CMakePackageConfigHelpers)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/tokenmix DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS tokenmix_shared tokenmix_static EXPORT tokenmixTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
if(TOKENMIX_BUILD_CLI)
  install(TARGETS tokenmix_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
install(EXPORT tokenmixTargets NAMESPACE tokenmix:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tokenmix)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/tokenmixConfig.cmake.in
  ${PROJECT_BINARY_DIR}/tokenmixConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tokenmix)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/tokenmixConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/tokenmixConfig.cmake ${PROJECT_BINARY_DIR}/tokenmixConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tokenmix)
