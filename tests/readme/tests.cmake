# README example test (included by tests/CMakeLists.txt): the C++ block between
#   <!-- example:begin --> and <!-- example:end -->
# in README.md is extracted at configure time, compiled against tokenmix_static and run by ctest
# (`readme.example`). The example checks its own result, so the documentation cannot rot.
set(_readme ${PROJECT_SOURCE_DIR}/README.md)
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${_readme})  # re-extract on edit
file(READ ${_readme} _readme_text)
set(_begin "<!-- example:begin -->")
set(_end "<!-- example:end -->")
string(FIND "${_readme_text}" "${_begin}" _begin_at)
string(FIND "${_readme_text}" "${_end}" _end_at)
set(_readme_block "")
if(_begin_at GREATER -1 AND _end_at GREATER _begin_at)
  math(EXPR _length "${_end_at} - ${_begin_at}")
  string(SUBSTRING "${_readme_text}" ${_begin_at} ${_length} _between)
  # Greedy: the code runs from the opening ```cpp line to the last ``` before the end marker.
  string(REGEX MATCH "```cpp[ \t]*\r?\n(.*)```" _readme_block "${_between}")
endif()
if(NOT _readme_block)
  message(FATAL_ERROR "README.md: no ```cpp block between ${_begin} and ${_end} "
                      "(tests/readme/tests.cmake extracts and tests it)")
endif()
# Write through configure_file so an unchanged example does not trigger a rebuild.
file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/readme/readme_example.cpp.in "${CMAKE_MATCH_1}")
configure_file(${CMAKE_CURRENT_BINARY_DIR}/readme/readme_example.cpp.in
               ${CMAKE_CURRENT_BINARY_DIR}/readme/readme_example.cpp COPYONLY)

add_executable(tokenmix_readme_example ${CMAKE_CURRENT_BINARY_DIR}/readme/readme_example.cpp)
target_link_libraries(tokenmix_readme_example PRIVATE tokenmix_static)
add_test(NAME readme.example COMMAND tokenmix_readme_example)
set_tests_properties(readme.example PROPERTIES TIMEOUT 120 LABELS readme)
foreach(_var _readme _readme_text _begin _end _begin_at _end_at _length _between _readme_block)
  unset(${_var})
endforeach()
