# fsdp_add_test_suites(TARGET): registers one ctest entry per GoogleTest suite of TARGET.
#
# Why not gtest_discover_tests: it runs every test case in a process of its own, and a LibTorch
# process spends about half a second loading libtorch before the first test starts. Over the ~440
# cases of each build that was ~4 minutes per LibTorch version of pure start-up. One process per
# suite keeps what the per-case entries were for (a failing entry names its suite, a hung suite
# is killed by its own TIMEOUT, `ctest -R Suite` picks it) and pays the start-up ~50 times.
# Cases of one suite share a process: they must not rely on state another case leaves behind,
# which the suite's own order exercises on every run. For one entry per case (a bisection, a
# flaky case), configure with -DFSDP_TEST_PER_CASE=ON.
#
# The suites are listed after each build (a POST_BUILD step runs `TARGET --gtest_list_tests`) and
# written to a file that ctest includes, as gtest_discover_tests does. Each suite run writes its
# GoogleTest JSON report to ${FSDP_TEST_RESULTS_DIR}/<suite>.json; scripts/test.sh adds them up
# into the per-case counts it prints. A process whose every case was skipped (GTEST_SKIP) exits
# with 77 (tests/helpers/main.cpp), which ctest reports as skipped.
set(FSDP_TEST_RESULTS_DIR "${CMAKE_BINARY_DIR}/test-results" CACHE PATH
    "Where each GoogleTest suite run writes its JSON report")

function(fsdp_add_test_suites target)
  set(listing "${CMAKE_CURRENT_BINARY_DIR}/${target}_suites.cmake")
  set(include_file "${CMAKE_CURRENT_BINARY_DIR}/${target}_suites_include.cmake")
  add_custom_command(TARGET ${target} POST_BUILD
    COMMAND "${CMAKE_COMMAND}"
            -D "TEST_EXECUTABLE=$<TARGET_FILE:${target}>"
            -D "TEST_TARGET=${target}"
            -D "OUTPUT_FILE=${listing}"
            -D "RESULTS_DIR=${FSDP_TEST_RESULTS_DIR}"
            -P "${PROJECT_SOURCE_DIR}/cmake/FsdpListSuites.cmake"
    BYPRODUCTS "${listing}"
    VERBATIM)
  # ctest includes this wrapper; before the first build there is no listing yet, and the wrapper
  # says so instead of silently running nothing.
  file(WRITE "${include_file}"
    "if(EXISTS \"${listing}\")\n"
    "  include(\"${listing}\")\n"
    "else()\n"
    "  add_test(${target}_NOT_BUILT ${target}_NOT_BUILT)\n"
    "endif()\n")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${include_file}")
endfunction()
