# tests/cli/run_cli.cmake — driver of one CLI test (cmake -P), see tests.cmake.
#
# Runs TOOL with ARGS ('|'-separated) and fails (FATAL_ERROR → non-zero exit) unless:
#   the exit code equals EXPECT_RC (default 0);
#   stdout matches STDOUT_REGEX and does not match STDOUT_NOT_REGEX (when given);
#   stderr matches STDERR_REGEX (when given);
#   ONE_LINE_ERROR: stderr is exactly one line "tokenmix: error: <message>";
#   none of NOT_EXIST ('|'-separated paths) exists afterwards (they are removed before the run;
#   so are the CLEAN paths, outputs of a previous run that a success test will write again);
#   POST ('|'-separated command, e.g. the npy_tool checker) exits 0.
cmake_minimum_required(VERSION 3.25)
if(NOT DEFINED EXPECT_RC)
  set(EXPECT_RC 0)
endif()
string(REPLACE "|" ";" args "${ARGS}")
string(REPLACE "|" ";" not_exist "${NOT_EXIST}")
string(REPLACE "|" ";" clean "${CLEAN}")
string(REPLACE "|" ";" post "${POST}")
foreach(path IN LISTS not_exist clean)
  file(REMOVE "${path}")
endforeach()

execute_process(COMMAND "${TOOL}" ${args} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE err)
string(REPLACE ";" " " shown "${args}")
message("$ tokenmix ${shown}\n--- exit code: ${rc}\n--- stdout:\n${out}--- stderr:\n${err}---")

set(failures "")
if(NOT "${rc}" STREQUAL "${EXPECT_RC}")
  string(APPEND failures "exit code ${rc}, expected ${EXPECT_RC}\n")
endif()
if(DEFINED STDOUT_REGEX AND NOT out MATCHES "${STDOUT_REGEX}")
  string(APPEND failures "stdout does not match '${STDOUT_REGEX}'\n")
endif()
if(DEFINED STDOUT_NOT_REGEX AND out MATCHES "${STDOUT_NOT_REGEX}")
  string(APPEND failures "stdout matches '${STDOUT_NOT_REGEX}'\n")
endif()
if(DEFINED STDERR_REGEX AND NOT err MATCHES "${STDERR_REGEX}")
  string(APPEND failures "stderr does not match '${STDERR_REGEX}'\n")
endif()
if(ONE_LINE_ERROR)
  string(REGEX MATCHALL "\n" newlines "${err}")
  list(LENGTH newlines n)
  if(NOT n EQUAL 1 OR NOT err MATCHES "^tokenmix: error: [^\n]+\n$")
    string(APPEND failures "stderr is not exactly one line 'tokenmix: error: <message>'\n")
  endif()
endif()
foreach(path IN LISTS not_exist)
  if(EXISTS "${path}")
    string(APPEND failures "'${path}' exists but must not have been written\n")
  endif()
endforeach()
if(post)
  execute_process(COMMAND ${post} RESULT_VARIABLE post_rc OUTPUT_VARIABLE post_out
                  ERROR_VARIABLE post_err)
  message("--- check: ${post_out}${post_err}")
  if(NOT post_rc EQUAL 0)
    string(APPEND failures "check command failed (${post_rc})\n")
  endif()
endif()
if(failures)
  message(FATAL_ERROR "${failures}")
endif()
