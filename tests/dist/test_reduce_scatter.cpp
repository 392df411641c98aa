// ProcessGroup::reduce_scatter_tensor and reduce_scatter_pieces_async over real Gloo processes at
// W = 1-4 and 6: every algorithm and op, the rank-ordered sum, divide_by, calls in flight
// together; and the pairwise sum's kernel (sum_then_divide) on its own.
#include <gtest/gtest.h>

#include <limits>

#include <ATen/Parallel.h>

#include "dist/state.h"  // sum_then_divide
#include "dist_testing.h"
#include "fsdp/compat.h"
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

class ReduceScatter : public ::testing::TestWithParam<int> {};

TEST_P(ReduceScatter, EveryAlgorithmAndOp) {
  const int W = GetParam();
  run_ranks(W, [](ProcessGroup& pg) {
    const int W = pg.size();
    for (auto algo :
         {ReduceScatterAlgo::AUTO, ReduceScatterAlgo::ALL_TO_ALL, ReduceScatterAlgo::ALL_REDUCE,
          ReduceScatterAlgo::NATIVE, ReduceScatterAlgo::PAIRWISE}) {
      if (algo == ReduceScatterAlgo::PAIRWISE && !runs_pairwise(pg)) continue;
      for (auto op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::MAX, ReduceOp::MIN}) {
        for (int64_t n : {0, 1, 3, 4097}) {
          at::Tensor in = rank_input(pg.rank(), n * W);
          at::Tensor out = at::empty({n});
          if (algo == ReduceScatterAlgo::NATIVE && W > 1 && n > 0) {
            // Native must be right or refused: Gloo's native form sums whatever op it is given
            // (LibTorch 2.6), which must never come back as a MAX or MIN result.
            // NCCL's native reduce-scatter honours every op.
            const bool sum_like = op == ReduceOp::SUM || op == ReduceOp::AVG;
            const bool expect_native =
                pg.backend_name() == "nccl" ||
                (sum_like && fsdp::compat::native_flat_collectives(pg.backend_name()));
            try {
              pg.reduce_scatter_tensor(out, in, op, algo);
            } catch (const fsdp::ValueError& e) {
              ASSERT_FALSE(expect_native) << "native SUM refused: " << e.what();
              continue;
            }
            ASSERT_TRUE(expect_native)
                << "native reduce-scatter accepted op " << static_cast<int>(op);
          } else {
            pg.reduce_scatter_tensor(out, in, op, algo);
          }
          std::vector<at::Tensor> all;
          for (int r = 0; r < W; ++r)
            all.push_back(rank_input(r, n * W).narrow(0, pg.rank() * n, n));
          at::Tensor expect = all[0].clone();
          for (int r = 1; r < W; ++r) {
            if (op == ReduceOp::MAX)
              expect = at::maximum(expect, all[r]);
            else if (op == ReduceOp::MIN)
              expect = at::minimum(expect, all[r]);
            else
              expect += all[r];
          }
          if (op == ReduceOp::AVG) expect /= W;
          ASSERT_TRUE(at::equal(out, expect))
              << "algo=" << static_cast<int>(algo) << " op=" << static_cast<int>(op) << " n=" << n;
        }
      }
    }
  });
}

// The expected chunk of this rank: seeded_randn(seed0 + r) summed over ranks in rank order, then
// divided by W, computed on the device the group computes on (CUDA divides by a scalar through its
// reciprocal, so a CPU expectation would differ at W=3 under NCCL).
at::Tensor rank_ordered_avg(const ProcessGroup& pg, int64_t n, uint64_t seed0) {
  const int W = pg.size();
  const auto dev = pg.device();
  at::Tensor expect = seeded_randn({n * W}, seed0).narrow(0, pg.rank() * n, n).to(dev);
  for (int r = 1; r < W; ++r)
    expect.add_(seeded_randn({n * W}, seed0 + r).narrow(0, pg.rank() * n, n).to(dev));
  return expect.div_(W).cpu();
}

// alltoall + local sum, and the pairwise form, add the ranks' contributions in rank order, so even
// arbitrary floats come out bit-identical to a sequential sum: the property gradient reduction
// relies on.
TEST_P(ReduceScatter, AllToAllIsRankOrderedSum) {
  const int W = GetParam();
  run_ranks(W, [](ProcessGroup& pg) {
    const int W = pg.size();
    const int64_t n = 777;
    at::Tensor in = seeded_randn({n * W}, 100 + pg.rank());
    for (auto algo : {ReduceScatterAlgo::ALL_TO_ALL, ReduceScatterAlgo::PAIRWISE}) {
      if (algo == ReduceScatterAlgo::PAIRWISE && !runs_pairwise(pg)) continue;
      at::Tensor out = at::empty({n});
      pg.reduce_scatter_tensor(out, in, ReduceOp::AVG, algo);
      ASSERT_TRUE(at::equal(out, rank_ordered_avg(pg, n, 100))) << static_cast<int>(algo);
    }
  });
}

// Pairwise reductions in flight together, with an all-gather between them, finished in the reverse
// order of their start: each must get its own pieces. (From W=5 a rank posts some receives only in
// the finish; were the tag shared, the reduction finished first would take the pieces the peers
// sent for an earlier one.) The inputs are left as they were.
TEST_P(ReduceScatter, PairwiseReductionsInFlightTogetherKeepTheirOwnPieces) {
  const int W = GetParam();
  run_ranks(W, [](ProcessGroup& pg) {
    if (!runs_pairwise(pg)) return;
    const int W = pg.size();
    const int64_t n = 1031;
    constexpr int kInFlight = 3;
    std::vector<at::Tensor> ins, outs;
    std::vector<fsdp::dist::Work> works;
    at::Tensor gathered = at::empty({5 * W});
    fsdp::dist::Work gather;  // nothing to wait for until assigned
    EXPECT_TRUE(gather.waited());
    for (int k = 0; k < kInFlight; ++k) {
      ins.push_back(seeded_randn({n * W}, 1000 * (k + 1) + pg.rank()));
      outs.push_back(at::empty({n}));
      works.push_back(pg.reduce_scatter_tensor_async(outs[k], ins[k], ReduceOp::AVG,
                                                     ReduceScatterAlgo::PAIRWISE));
      if (k == 0) {
        gather = pg.all_gather_into_tensor_async(gathered, rank_input(pg.rank(), 5));
      }
    }
    for (int k = kInFlight - 1; k >= 0; --k) works[k].wait();
    gather.wait();
    for (int k = 0; k < kInFlight; ++k) {
      ASSERT_TRUE(at::equal(outs[k], rank_ordered_avg(pg, n, 1000 * (k + 1)))) << "k=" << k;
      ASSERT_TRUE(at::equal(ins[k], seeded_randn({n * W}, 1000 * (k + 1) + pg.rank())));
    }
    for (int r = 0; r < W; ++r) {
      ASSERT_TRUE(at::equal(gathered.narrow(0, 5 * r, 5), rank_input(r, 5)));
    }
  });
}

// A pairwise sum receives its first piece straight into the output: no scratch at all at W=2,
// one or two chunks above (where the all-to-all holds the whole input). An output that is a view
// of the input (in place: this rank's own chunk) must not be received into before its piece is
// read, and comes out right too. Both bit-identical to the rank-ordered sum.
TEST_P(ReduceScatter, PairwiseSumReceivesIntoTheOutputUnlessItAliasesTheInput) {
  const int W = GetParam();
  run_ranks(W, [](ProcessGroup& pg) {
    if (!runs_pairwise(pg)) return;
    const int W = pg.size();
    const int64_t n = 4099;
    const at::Tensor expect = rank_ordered_avg(pg, n, 300).mul_(W);  // the sum where W = 2^k
    at::Tensor in = seeded_randn({n * W}, 300 + pg.rank());
    at::Tensor out = at::empty({n});
    int64_t scratch = 0;
    {
      fsdp::testing::MemoryWatch watch;
      pg.reduce_scatter_tensor(out, in, ReduceOp::SUM, ReduceScatterAlgo::PAIRWISE);
      scratch = watch.peak();
    }
    if ((W & (W - 1)) == 0) {  // x W after / W is exact for powers of two only; else see below
      ASSERT_TRUE(at::equal(out, expect)) << "rank " << pg.rank();
    }
    const int64_t chunk = n * 4;
    const int64_t buffers = W <= 2 ? 0 : std::min(2, W - 2);
    EXPECT_EQ(scratch, buffers * chunk) << "rank " << pg.rank() << ", W=" << W;

    // In place: the output is this rank's chunk of the input.
    at::Tensor in2 = seeded_randn({n * W}, 300 + pg.rank());
    at::Tensor own = in2.narrow(0, pg.rank() * n, n);
    pg.reduce_scatter_tensor(own, in2, ReduceOp::SUM, ReduceScatterAlgo::PAIRWISE);
    ASSERT_TRUE(at::equal(own, out)) << "in-place pairwise sum differs on rank " << pg.rank();
  });
}

// divide_by: the sum divided by each divisor in turn, bit-identical to div_ calls after the
// reduction, whichever of them the pairwise sum's last addition applies in its own pass (leading
// powers of two) and whichever it leaves to div_ (1.5 and 3, and everything after them). The data
// reach the subnormal range (where a product of the two scales, or a division by their product,
// would round differently), overflow to infinity in the sum, and hold signed zeros; the output is
// given whole, as pieces, and in place (a view of this rank's own chunk).
TEST_P(ReduceScatter, DivideByEqualsDivisionsAfterTheSum) {
  const int W = GetParam();
  run_ranks(W, [](ProcessGroup& pg) {
    const int W = pg.size();
    const bool pairwise = runs_pairwise(pg);
    const int64_t n = 4099;
    const std::vector<std::vector<double>> divisor_lists = {{2},      {2, 2}, {4, 2},   {2, 1.5},
                                                            {1.5, 2}, {3},    {2, 4, 2}};
    for (auto dtype : {at::kFloat, at::kDouble}) {
      const double tiny = dtype == at::kFloat ? 1e-39 : 1e-310;  // subnormal
      const double huge = dtype == at::kFloat ? 3e38 : 1.7e308;
      at::Tensor in = seeded_randn({n * W}, 500 + pg.rank()).to(dtype);
      for (int q = 0; q < W; ++q) {
        at::Tensor c = in.narrow(0, q * n, n);
        c.narrow(0, 0, 64).mul_(tiny);  // subnormal sums
        c[64] = huge;                   // overflows to inf from W=2
        c[65] = -0.0;                   // -0 + -0 stays -0
        c[66] = pg.rank() % 2 ? 1.0 : -1.0;
      }
      for (auto op : {ReduceOp::SUM, ReduceOp::AVG}) {
        for (const auto& divisors : divisor_lists) {
          at::Tensor expect = at::empty({n}, dtype);
          pg.reduce_scatter_tensor(expect, in, op, ReduceScatterAlgo::ALL_TO_ALL);
          for (double d : divisors) expect.div_(d);
          const std::string what =
              std::string(c10::toString(dtype)) + " op " + std::to_string(static_cast<int>(op)) +
              ", " + std::to_string(divisors.size()) + " divisors from " +
              std::to_string(divisors[0]) + ", rank " + std::to_string(pg.rank());
          for (auto algo : {ReduceScatterAlgo::AUTO, ReduceScatterAlgo::ALL_TO_ALL,
                            ReduceScatterAlgo::PAIRWISE}) {
            if (algo == ReduceScatterAlgo::PAIRWISE && !pairwise) continue;
            at::Tensor out = at::empty({n}, dtype);
            pg.reduce_scatter_tensor(out, in, op, algo, divisors);
            ASSERT_TRUE(at::equal(out, expect)) << what << ", algo " << static_cast<int>(algo);
          }
          // As pieces (the first one short, then the rest of each chunk).
          std::vector<std::vector<at::Tensor>> chunks(static_cast<size_t>(W));
          for (int q = 0; q < W; ++q) {
            chunks[static_cast<size_t>(q)] = {in.narrow(0, q * n, 100),
                                              in.narrow(0, q * n + 100, n - 100)};
          }
          at::Tensor out = at::empty({n}, dtype);
          pg.reduce_scatter_pieces_async(out, chunks, op, ReduceScatterAlgo::AUTO, divisors).wait();
          ASSERT_TRUE(at::equal(out, expect)) << what << ", pieces";
          if (pairwise) {
            at::Tensor copy = in.clone();
            at::Tensor own = copy.narrow(0, pg.rank() * n, n);
            pg.reduce_scatter_tensor(own, copy, op, ReduceScatterAlgo::PAIRWISE, divisors);
            ASSERT_TRUE(at::equal(own, expect)) << what << ", in place";
          }
        }
      }
    }
    // Divisors are for sums, and must be finite and non-zero.
    at::Tensor in = at::ones({4 * W});
    at::Tensor out = at::empty({4});
    EXPECT_THROW(pg.reduce_scatter_tensor(out, in, ReduceOp::MAX, ReduceScatterAlgo::AUTO, {2}),
                 fsdp::ValueError);
    for (double bad :
         {0.0, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
      EXPECT_THROW(pg.reduce_scatter_tensor(out, in, ReduceOp::SUM, ReduceScatterAlgo::AUTO, {bad}),
                   fsdp::ValueError);
    }
    std::vector<std::vector<at::Tensor>> chunks(static_cast<size_t>(W), {at::ones({4})});
    EXPECT_THROW(
        pg.reduce_scatter_pieces_async(out, chunks, ReduceOp::MIN, ReduceScatterAlgo::AUTO, {2}),
        fsdp::ValueError);
    pg.barrier();
  });
}

// The pairwise sum's pieces as integers and float16: one combine per piece (the one-pass kernel
// is for float and double), still in rank order and equal to the all-to-all's sum.
TEST_P(ReduceScatter, PairwiseSumOfIntegersAndHalvesPieceByPiece) {
  const int W = GetParam();
  run_ranks(W, [](ProcessGroup& pg) {
    if (!runs_pairwise(pg)) return;
    const int W = pg.size();
    const int64_t n = 5;  // sums below 2048: exact in float16 too
    for (auto dtype : {at::kInt, at::kHalf}) {
      at::Tensor in = rank_input(pg.rank(), n * W, dtype);
      at::Tensor expect = at::zeros({n}, at::kFloat);
      for (int r = 0; r < W; ++r) expect += rank_input(r, n * W).narrow(0, pg.rank() * n, n);
      at::Tensor out = at::empty({n}, dtype), reference = at::empty({n}, dtype);
      pg.reduce_scatter_tensor(out, in, ReduceOp::SUM, ReduceScatterAlgo::PAIRWISE);
      pg.reduce_scatter_tensor(reference, in, ReduceOp::SUM, ReduceScatterAlgo::ALL_TO_ALL);
      ASSERT_TRUE(at::equal(out, reference)) << c10::toString(dtype) << ", rank " << pg.rank();
      ASSERT_TRUE(at::equal(out, expect.to(dtype))) << c10::toString(dtype);
    }
  });
}

// The sum kernel alone, against ATen: sources added in order, then the power-of-two divisors, on
// two intra-op threads over sizes TensorIterator splits between them (the multi-rank tests run
// one thread on small tensors), for 0 to 5 sources (more than three take a second pass).
TEST(SumThenDivide, EqualsAddThenDivOnSeveralThreads) {
  using fsdp::dist::detail::sum_then_divide;
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  const int64_t n = 300007;  // several of TensorIterator's 32768-element grains, odd
  for (auto dtype : {at::kFloat, at::kDouble}) {
    for (int k = 0; k <= 5; ++k) {
      for (const std::vector<double>& divisors :
           {std::vector<double>{}, std::vector<double>{2}, std::vector<double>{4, 2}}) {
        at::Tensor acc = seeded_randn({n}, 7, dtype);
        std::vector<at::Tensor> srcs;
        for (int j = 0; j < k; ++j) srcs.push_back(seeded_randn({n}, 8 + j, dtype));
        at::Tensor expect = acc.clone();
        for (const auto& src : srcs) expect.add_(src);
        for (double d : divisors) expect.div_(d);
        sum_then_divide(acc, srcs, divisors, divisors.size());
        EXPECT_TRUE(at::equal(acc, expect))
            << c10::toString(dtype) << ", " << k << " sources, " << divisors.size() << " divisors";
      }
    }
  }
  EXPECT_THROW(sum_then_divide(at::zeros({4}, at::kHalf), {at::zeros({4}, at::kHalf)}, {}, 0),
               fsdp::InternalError);
  EXPECT_THROW(sum_then_divide(at::zeros({4}), {}, {2}, 2), fsdp::InternalError);
  at::set_num_threads(threads);
}

FSDP_DIST_WORLD_SIZES(ReduceScatter);

}  // namespace
