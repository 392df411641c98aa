# Run by fsdp_add_test_suites (FsdpTestSuites.cmake) after TEST_EXECUTABLE is built: lists its
# GoogleTest suites and writes OUTPUT_FILE, which adds one ctest entry per suite.
#   TEST_EXECUTABLE  the test binary     TEST_TARGET  its target name (for messages)
#   OUTPUT_FILE      the file to write   RESULTS_DIR  where each suite run writes its JSON report
cmake_minimum_required(VERSION 3.16)

execute_process(
  COMMAND "${TEST_EXECUTABLE}" --gtest_list_tests
  OUTPUT_VARIABLE listing ERROR_VARIABLE errors RESULT_VARIABLE rc TIMEOUT 120)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${TEST_TARGET}: --gtest_list_tests failed (${rc}):\n${listing}${errors}")
endif()

# `Suite.` (maybe `Prefix/Suite.  # TypeParam = ...`) opens a suite; `  Case` (maybe
# `  Case/3  # GetParam() = ...`) is one of its cases. Disabled cases do not count: a suite
# of nothing but disabled cases gets no entry.
string(REPLACE "\n" ";" lines "${listing}")
set(suites "")
set(suite "")
foreach(line IN LISTS lines)
  if(line MATCHES "^([A-Za-z0-9_/]+)\\.")
    set(suite "${CMAKE_MATCH_1}")
    if(suite MATCHES "(^|/)DISABLED_")
      set(suite "")
    endif()
  elseif(suite AND line MATCHES "^  ([A-Za-z0-9_/]+)")
    if(NOT CMAKE_MATCH_1 MATCHES "^DISABLED_")
      if(NOT DEFINED count_${suite})
        list(APPEND suites "${suite}")
        set(count_${suite} 0)
      endif()
      math(EXPR count_${suite} "${count_${suite}} + 1")
    endif()
  endif()
endforeach()
if(NOT suites)
  message(FATAL_ERROR "${TEST_TARGET}: --gtest_list_tests listed no test:\n${listing}")
endif()

get_filename_component(workdir "${TEST_EXECUTABLE}" DIRECTORY)
set(text "# Written by cmake/FsdpListSuites.cmake from `${TEST_TARGET} --gtest_list_tests`.\n")
foreach(suite IN LISTS suites)
  string(REPLACE "/" "_" report "${suite}")
  # A case's own limit was 300 s; a suite gets that once plus a minute for each further case. The
  # multi-rank harness stops a hung run on its own well within that (RunOptions::deadline).
  math(EXPR timeout "300 + 60 * (${count_${suite}} - 1)")
  string(APPEND text
    "add_test([=[${suite}]=] [=[${TEST_EXECUTABLE}]=] [=[--gtest_filter=${suite}.*]=]"
    " [=[--gtest_output=json:${RESULTS_DIR}/${TEST_TARGET}.${report}.json]=])\n"
    "set_tests_properties([=[${suite}]=] PROPERTIES WORKING_DIRECTORY [=[${workdir}]=]"
    " RUN_SERIAL TRUE TIMEOUT ${timeout} SKIP_RETURN_CODE 77"
    " LABELS [=[${TEST_TARGET}]=])\n")
endforeach()
file(WRITE "${OUTPUT_FILE}" "${text}")
