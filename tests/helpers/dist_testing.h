// Helpers of the collective tests (tests/dist/): deterministic inputs, the world sizes each
// collective runs at, and the check that leaves the pairwise algorithms to Gloo.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "fsdp/dist.h"
#include "fsdp/errors.h"

namespace fsdp {
namespace testing {

// Rank r's deterministic input: integer-valued floats, so sums are exact in any order.
inline at::Tensor rank_input(int rank, int64_t n, at::ScalarType dtype = at::kFloat) {
  return (at::arange(n, at::kFloat) * 3 + rank * 7 - 5).to(dtype);
}

// The pairwise algorithms are Gloo's alone: on any other backend (NCCL, whose point-to-point
// order could deadlock them) each must be refused with a ValueError, at every group size. True
// where `pg` runs them; elsewhere checks the refusals, and the caller's pairwise checks end there.
inline bool runs_pairwise(dist::ProcessGroup& pg) {
  using dist::AllGatherAlgo;
  using dist::ReduceOp;
  using dist::ReduceScatterAlgo;
  if (pg.backend_name() == "gloo") return true;
  const int W = pg.size();
  EXPECT_THROW(
      pg.all_gather_into_tensor(at::empty({4 * W}), at::ones({4}), AllGatherAlgo::PAIRWISE),
      ValueError);
  EXPECT_THROW(pg.reduce_scatter_tensor(at::empty({4}), at::ones({4 * W}), ReduceOp::SUM,
                                        ReduceScatterAlgo::PAIRWISE),
               ValueError);
  std::vector<std::vector<at::Tensor>> chunks(static_cast<size_t>(W), {at::ones({4})});
  EXPECT_THROW(pg.reduce_scatter_pieces_async(at::empty({4}), chunks, ReduceOp::SUM,
                                              ReduceScatterAlgo::PAIRWISE),
               ValueError);
  return false;
}

inline std::string world_size_name(const ::testing::TestParamInfo<int>& info) {
  return "W" + std::to_string(info.param);
}

}  // namespace testing
}  // namespace fsdp

// Runs the cases of SUITE (a ::testing::TestWithParam<int>, the world size) at W = 1-4 as
// WorldSizes/SUITE, and at W = 6 as BeyondFourRanks/SUITE: beyond four ranks the pairwise
// reduce-scatter's pieces no longer fit in its two receive buffers at once, so it posts receives
// in the finish and sums in several passes. (The sanitizer build leaves BeyondFourRanks out.)
#define FSDP_DIST_WORLD_SIZES(SUITE)                                         \
  INSTANTIATE_TEST_SUITE_P(WorldSizes, SUITE, ::testing::Values(1, 2, 3, 4), \
                           ::fsdp::testing::world_size_name);                \
  INSTANTIATE_TEST_SUITE_P(BeyondFourRanks, SUITE, ::testing::Values(6),     \
                           ::fsdp::testing::world_size_name)
