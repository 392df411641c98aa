// GoogleTest entry point shared by the fsdp-cpp test binaries.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  // Tests use tiny tensors; one intra-op thread keeps ranks from fighting over the two cores, and
  // keeps libgomp's pool uninitialised in the parent, which forks the ranks.
  at::set_num_threads(1);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
