// GoogleTest entry point shared by the fsdp-cpp test binaries.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cstdlib>

int main(int argc, char** argv) {
  // Tests use tiny tensors; one intra-op thread keeps ranks from fighting over the two cores, and
  // keeps libgomp's pool uninitialised in the parent, which forks the ranks. Through the
  // environment, which LibTorch reads when it first sizes its OpenMP pool, rather than
  // at::set_num_threads: that also creates LibTorch's pthreadpool, which every forked rank then
  // drops unfreed (LibTorch's fork handler), a leak LeakSanitizer would report in every rank of
  // every multi-rank test. The ranks call at::set_num_threads(1) themselves (multi_rank.cpp).
  ::setenv("OMP_NUM_THREADS", "1", 1);
  at::init_num_threads();
  ::testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  // ctest runs one process per suite (cmake/FsdpTestSuites.cmake): a process that ran cases and
  // skipped every one of them (no GPU, no Python reference) exits 77, which ctest reports as
  // skipped rather than passed. A partly skipped suite passes; scripts/test.sh counts its skips.
  const auto& unit = *::testing::UnitTest::GetInstance();
  if (rc == 0 && unit.test_to_run_count() > 0 &&
      unit.skipped_test_count() == unit.test_to_run_count()) {
    return 77;
  }
  return rc;
}
