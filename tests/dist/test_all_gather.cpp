// ProcessGroup::all_gather_into_tensor over real Gloo processes at W = 1-4 and 6: every
// algorithm, in place and out of place, several calls in flight, and the errors it raises.
#include <gtest/gtest.h>

#include "dist_testing.h"
#include "fsdp/dist.h"
#include "fsdp/errors.h"
#include "memory_watch.h"
#include "multi_rank.h"

using fsdp::dist::AllGatherAlgo;
using fsdp::dist::ProcessGroup;
using fsdp::dist::ReduceOp;
using fsdp::dist::ReduceScatterAlgo;
using fsdp::testing::rank_input;
using fsdp::testing::run_ranks;
using fsdp::testing::runs_pairwise;
using fsdp::testing::seeded_randn;

namespace {

class AllGather : public ::testing::TestWithParam<int> {};

TEST_P(AllGather, IntoTensor) {
  const int W = GetParam();
  run_ranks(W, [](ProcessGroup& pg) {
    for (int64_t n : {0, 1, 5, 1000}) {
      at::Tensor in = rank_input(pg.rank(), n);
      at::Tensor out = at::full({n * pg.size()}, -1.0f);
      pg.all_gather_into_tensor(out, in);
      for (int r = 0; r < pg.size(); ++r) {
        ASSERT_TRUE(at::equal(out.narrow(0, r * n, n), rank_input(r, n))) << "n=" << n;
      }
    }
  });
}

// Every algorithm, with dtypes Gloo moves as bytes, and in place (the input is this rank's own
// piece of the output). Pairwise receives straight into the output: it allocates nothing, where
// Gloo's own all-gather holds a scratch copy of the whole output (the control).
TEST_P(AllGather, EveryAlgorithmInPlaceAndWithoutScratch) {
  const int W = GetParam();
  run_ranks(W, [](ProcessGroup& pg) {
    const int W = pg.size();
    for (auto algo : {AllGatherAlgo::AUTO, AllGatherAlgo::NATIVE, AllGatherAlgo::PAIRWISE}) {
      if (algo == AllGatherAlgo::PAIRWISE && !runs_pairwise(pg)) continue;
      for (auto dtype : {at::kFloat, at::kDouble, at::kShort, at::kHalf}) {
        for (int64_t n : {0, 1, 5, 4097}) {
          const std::string what = "algo " + std::to_string(static_cast<int>(algo)) + ", " +
                                   c10::toString(dtype) + ", n=" + std::to_string(n);
          at::Tensor in = rank_input(pg.rank(), n, dtype);
          at::Tensor out = at::full({n * W}, -1, dtype);
          pg.all_gather_into_tensor(out, in, algo);
          at::Tensor inplace = at::full({n * W}, -1, dtype);
          at::Tensor own = inplace.narrow(0, pg.rank() * n, n);
          own.copy_(in);
          pg.all_gather_into_tensor(inplace, own, algo);
          for (int r = 0; r < W; ++r) {
            ASSERT_TRUE(at::equal(out.narrow(0, r * n, n), rank_input(r, n, dtype))) << what;
            ASSERT_TRUE(at::equal(inplace.narrow(0, r * n, n), rank_input(r, n, dtype))) << what;
          }
          ASSERT_TRUE(at::equal(in, rank_input(pg.rank(), n, dtype))) << what;
        }
      }
    }
    if (W == 1 || pg.backend_name() != "gloo") return;
    const int64_t n = 1 << 16;
    at::Tensor in = rank_input(pg.rank(), n);
    at::Tensor out = at::empty({n * W});
    int64_t pairwise = 0, native = 0;
    {
      fsdp::testing::MemoryWatch watch;
      pg.all_gather_into_tensor(out, in, AllGatherAlgo::PAIRWISE);
      pairwise = watch.peak();
    }
    {
      fsdp::testing::MemoryWatch watch;
      pg.all_gather_into_tensor(out, in, AllGatherAlgo::NATIVE);
      native = watch.peak();
    }
    EXPECT_EQ(pairwise, 0) << "rank " << pg.rank();
    EXPECT_GE(native, n * W * 4) << "rank " << pg.rank();
    // AUTO: Gloo's own below 4 MiB of output (the 256 KiB per rank above), pairwise from there.
    int64_t auto_small = 0, auto_big = 0;
    {
      fsdp::testing::MemoryWatch watch;
      pg.all_gather_into_tensor(out, in);
      auto_small = watch.peak();
    }
    const int64_t big = (int64_t{4} << 20) / 4 / W + 1;
    at::Tensor big_in = rank_input(pg.rank(), big);
    at::Tensor big_out = at::empty({big * W});
    {
      fsdp::testing::MemoryWatch watch;
      pg.all_gather_into_tensor(big_out, big_in);
      auto_big = watch.peak();
    }
    EXPECT_GE(auto_small, n * W * 4) << "rank " << pg.rank();
    EXPECT_EQ(auto_big, 0) << "rank " << pg.rank();
    for (int r = 0; r < W; ++r)
      ASSERT_TRUE(at::equal(big_out.narrow(0, r * big, big), rank_input(r, big)));
  });
}

// Pairwise all-gathers in flight together, waited for in the reverse order, and one started while
// a pairwise MAX reduce-scatter still has a receive to post (from W=4 its third peer's piece is
// received in the wait, into a buffer freed by the first two): each gets its own pieces, because
// each sends under a tag of its own. (Gloo matches messages of one tag in posting order; with a
// shared tag the all-gather's receive, posted first, would take the reduction's piece.) An input
// that overlaps the output anywhere but this rank's own piece is refused before anything is sent.
TEST_P(AllGather, PairwiseCallsInFlightTogetherAndOverlapRefused) {
  const int W = GetParam();
  run_ranks(W, [](ProcessGroup& pg) {
    if (!runs_pairwise(pg)) return;
    const int W = pg.size();
    const int64_t n = 1031;
    std::vector<at::Tensor> outs;
    std::vector<fsdp::dist::Work> works;
    for (int k = 0; k < 3; ++k) {
      outs.push_back(at::empty({n * W}));
      works.push_back(pg.all_gather_into_tensor_async(
          outs[k], seeded_randn({n}, 500 * (k + 1) + pg.rank()), AllGatherAlgo::PAIRWISE));
    }
    for (int k = 2; k >= 0; --k) works[k].wait();
    for (int k = 0; k < 3; ++k) {
      for (int r = 0; r < W; ++r) {
        ASSERT_TRUE(at::equal(outs[k].narrow(0, r * n, n), seeded_randn({n}, 500 * (k + 1) + r)))
            << "k=" << k << ", piece of rank " << r;
      }
    }
    {
      at::Tensor rs_in = seeded_randn({n * W}, 900 + pg.rank());
      at::Tensor rs_out = at::empty({n});
      auto rs =
          pg.reduce_scatter_tensor_async(rs_out, rs_in, ReduceOp::MAX, ReduceScatterAlgo::PAIRWISE);
      at::Tensor ag_out = at::empty({n * W});
      pg.all_gather_into_tensor_async(ag_out, seeded_randn({n}, 950 + pg.rank()),
                                      AllGatherAlgo::PAIRWISE)
          .wait();
      rs.wait();
      at::Tensor expect = seeded_randn({n * W}, 900);
      for (int r = 1; r < W; ++r) expect = at::maximum(expect, seeded_randn({n * W}, 900 + r));
      ASSERT_TRUE(at::equal(rs_out, expect.narrow(0, pg.rank() * n, n))) << "rank " << pg.rank();
      for (int r = 0; r < W; ++r) {
        ASSERT_TRUE(at::equal(ag_out.narrow(0, r * n, n), seeded_randn({n}, 950 + r)))
            << "all-gather beside a reduction, piece of rank " << r;
      }
    }
    if (W == 1) return;
    at::Tensor out = at::zeros({n * W});
    const int other = (pg.rank() + 1) % W;
    // A peer's piece, shifted by one element into it: overlaps, and is not this rank's own.
    const int64_t at_elem = other * n + (other == W - 1 ? -1 : 1);
    try {
      pg.all_gather_into_tensor(out, out.narrow(0, at_elem, n), AllGatherAlgo::PAIRWISE);
      FAIL() << "expected ValueError";
    } catch (const fsdp::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("overlaps the output"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(pg.rank())), std::string::npos);
    }
    pg.barrier();  // refused on every rank before any message: the group is still in step
    pg.all_gather_into_tensor(out, rank_input(pg.rank(), n), AllGatherAlgo::PAIRWISE);
    for (int r = 0; r < W; ++r) ASSERT_TRUE(at::equal(out.narrow(0, r * n, n), rank_input(r, n)));
  });
}

TEST_P(AllGather, ShapeMismatchIsValueErrorNamingTheOperation) {
  const int W = GetParam();
  run_ranks(W, [](ProcessGroup& pg) {
    at::Tensor in = at::ones({3});
    at::Tensor bad = at::empty({3 * pg.size() + 1});
    try {
      pg.all_gather_into_tensor(bad, in);
      FAIL() << "expected ValueError";
    } catch (const fsdp::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("all_gather_into_tensor"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(pg.rank())), std::string::npos);
    }
    // Local validation failed before any communication, so the group is still usable.
    pg.barrier();
  });
}

FSDP_DIST_WORLD_SIZES(AllGather);

}  // namespace
