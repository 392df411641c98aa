// fsdp::dist over real Gloo processes: every collective at world sizes 1-4 and 6 with element
// counts 0, 1 and sizes not divisible by anything convenient, sub-groups, and failure behaviour;
// and the pairwise reduce-scatter's sum kernel on its own.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <functional>
#include <limits>
#include <optional>
#include <thread>
#include <tuple>

#include <ATen/Parallel.h>

#include "dist/state.h"  // sum_then_divide
#include "fsdp/compat.h"
#include "fsdp/compat_backends.h"
#include "fsdp/dist.h"
#include "fsdp/errors.h"
#include "fsdp/flat_param.h"
#include "fsdp/state_dict.h"  // the value model's deprecated header name: must still work
#include "memory_watch.h"
#include "multi_rank.h"
#include "util/message.h"
#include "util/tensor_utils.h"

using fsdp::dist::AllGatherAlgo;
using fsdp::dist::ProcessGroup;
using fsdp::dist::ReduceOp;
using fsdp::dist::ReduceScatterAlgo;
using fsdp::testing::run_ranks;
using fsdp::testing::seeded_randn;

namespace {

// Rank r's deterministic input: integer-valued floats, so sums are exact in any order.
at::Tensor rank_input(int rank, int64_t n, at::ScalarType dtype = at::kFloat) {
  return (at::arange(n, at::kFloat) * 3 + rank * 7 - 5).to(dtype);
}

class DistWorld : public ::testing::TestWithParam<int> {};

// The pairwise algorithms are Gloo's alone: on any other backend (NCCL, whose point-to-point
// order could deadlock them) each must be refused with a ValueError, at every group size. True
// where `pg` runs them; elsewhere checks the refusals, and the caller's pairwise checks end there.
bool runs_pairwise(ProcessGroup& pg) {
  if (pg.backend_name() == "gloo") return true;
  const int W = pg.size();
  EXPECT_THROW(
      pg.all_gather_into_tensor(at::empty({4 * W}), at::ones({4}), AllGatherAlgo::PAIRWISE),
      fsdp::ValueError);
  EXPECT_THROW(pg.reduce_scatter_tensor(at::empty({4}), at::ones({4 * W}), ReduceOp::SUM,
                                        ReduceScatterAlgo::PAIRWISE),
               fsdp::ValueError);
  std::vector<std::vector<at::Tensor>> chunks(static_cast<size_t>(W), {at::ones({4})});
  EXPECT_THROW(pg.reduce_scatter_pieces_async(at::empty({4}), chunks, ReduceOp::SUM,
                                              ReduceScatterAlgo::PAIRWISE),
               fsdp::ValueError);
  return false;
}

TEST_P(DistWorld, AllGatherIntoTensor) {
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
TEST_P(DistWorld, AllGatherEveryAlgorithmInPlaceAndWithoutScratch) {
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
TEST_P(DistWorld, PairwiseAllGathersInFlightTogetherAndOverlapRefused) {
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

TEST_P(DistWorld, ReduceScatterEveryAlgorithmAndOp) {
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
TEST_P(DistWorld, AllToAllReduceScatterIsRankOrderedSum) {
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
TEST_P(DistWorld, PairwiseReductionsInFlightTogetherKeepTheirOwnPieces) {
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
TEST_P(DistWorld, PairwiseSumReceivesIntoTheOutputUnlessItAliasesTheInput) {
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
TEST_P(DistWorld, ReduceScatterDivideByEqualsDivisionsAfterTheSum) {
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

TEST_P(DistWorld, AllReduceBroadcastBarrierAndBytes) {
  const int W = GetParam();
  run_ranks(W, [](ProcessGroup& pg) {
    const int W = pg.size();
    at::Tensor t = rank_input(pg.rank(), 6);
    pg.all_reduce(t, ReduceOp::SUM);
    at::Tensor expect = at::zeros({6});
    for (int r = 0; r < W; ++r) expect += rank_input(r, 6);
    ASSERT_TRUE(at::equal(t, expect));

    at::Tensor avg = rank_input(pg.rank(), 6, at::kDouble);
    pg.all_reduce(avg, ReduceOp::AVG);
    ASSERT_TRUE(at::allclose(avg, expect.to(at::kDouble) / W));

    // Also in dtypes some backend lacks (NCCL and Gloo have no int16): broadcast moves bytes.
    for (auto dtype : {at::kFloat, at::kShort, at::kHalf, at::kBool}) {
      at::Tensor b = rank_input(pg.rank(), 4, dtype);
      pg.broadcast(b, W - 1);
      ASSERT_TRUE(at::equal(b, rank_input(W - 1, 4, dtype))) << c10::toString(dtype);
    }
    // A 0-d tensor (a scalar parameter, an optimizer's step) travels in place too.
    at::Tensor scalar = at::scalar_tensor(pg.rank() + 0.5, at::kFloat);
    pg.broadcast(scalar, W - 1);
    ASSERT_EQ(scalar.dim(), 0);
    ASSERT_EQ(scalar.item<float>(), W - 0.5f);
    pg.barrier();

    // Sizes differ by rank, one is empty, and the bytes include NULs.
    std::string mine = pg.rank() == 0 ? std::string() : std::string(pg.rank() * 3, '\0') + "x";
    auto all = pg.all_gather_bytes(mine);
    ASSERT_EQ(static_cast<int>(all.size()), W);
    for (int r = 0; r < W; ++r) {
      std::string want = r == 0 ? std::string() : std::string(r * 3, '\0') + "x";
      ASSERT_EQ(all[r], want) << "rank " << r;
    }
    std::string got = pg.broadcast_bytes(pg.rank() == 0 ? "hello from 0" : "ignored");
    ASSERT_EQ(got, "hello from 0");
    // Around the one-collective slot (120 bytes of payload) and well past it, on some ranks only:
    // the remainders travel in a second collective that every rank must agree to run.
    auto pattern = [](size_t n, int r) {
      std::string b(n, '\0');
      for (size_t i = 0; i < n; ++i)
        b[i] = static_cast<char>((i * 7 + static_cast<size_t>(r)) & 0xff);
      return b;
    };
    for (size_t base : {size_t{119}, size_t{120}, size_t{121}, size_t{30000}}) {
      auto size_of = [&](int r) { return r % 2 ? base : base / 3; };
      auto got_all = pg.all_gather_bytes(pattern(size_of(pg.rank()), pg.rank()));
      ASSERT_EQ(static_cast<int>(got_all.size()), W);
      for (int r = 0; r < W; ++r) ASSERT_EQ(got_all[r], pattern(size_of(r), r)) << base << " " << r;
      const int src = W - 1;
      ASSERT_EQ(pg.broadcast_bytes(pg.rank() == src ? pattern(base, src) : "x", src),
                pattern(base, src))
          << base;
    }
  });
}

// Gloo lacks bfloat16 kernels: data moves bit-exactly, reductions run in float32. (NCCL reduces
// bfloat16 natively: there only bfloat16 rounding of the float32 sum is expected.)
TEST_P(DistWorld, BFloat16GathersExactlyAndReducesInFloat32) {
  const int W = GetParam();
  run_ranks(W, [](ProcessGroup& pg) {
    const int W = pg.size();
    at::Tensor in = seeded_randn({5}, 7 + pg.rank(), at::kBFloat16);
    at::Tensor out = at::empty({5 * W}, at::kBFloat16);
    pg.all_gather_into_tensor(out, in);
    for (int r = 0; r < W; ++r) {
      ASSERT_TRUE(at::equal(out.narrow(0, 5 * r, 5), seeded_randn({5}, 7 + r, at::kBFloat16)));
    }
    at::Tensor sum32 = at::zeros({5 * W});
    for (int r = 0; r < W; ++r)
      sum32 += seeded_randn({5 * W}, 20 + r, at::kBFloat16).to(at::kFloat);
    at::Tensor rs = at::empty({5}, at::kBFloat16);
    pg.reduce_scatter_tensor(rs, seeded_randn({5 * W}, 20 + pg.rank(), at::kBFloat16));
    at::Tensor ar = seeded_randn({5 * W}, 20 + pg.rank(), at::kBFloat16);
    pg.all_reduce(ar);
    if (pg.backend_name() == "gloo") {
      ASSERT_TRUE(at::equal(rs, sum32.narrow(0, 5 * pg.rank(), 5).to(at::kBFloat16)));
      ASSERT_TRUE(at::equal(ar, sum32.to(at::kBFloat16)));
    } else {
      const double tol = W * 8.0 / 256;  // W-1 bfloat16 roundings of sums of |x| < 4
      ASSERT_TRUE(at::allclose(rs.to(at::kFloat), sum32.narrow(0, 5 * pg.rank(), 5), 0, tol));
      ASSERT_TRUE(at::allclose(ar.to(at::kFloat), sum32, 0, tol));
    }
    at::Tensor b = seeded_randn({3}, 99 + pg.rank(), at::kBFloat16);
    pg.broadcast(b, 0);
    ASSERT_TRUE(at::equal(b, seeded_randn({3}, 99, at::kBFloat16)));
  });
}

TEST_P(DistWorld, ShapeMismatchIsValueErrorNamingTheOperation) {
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

// The pairwise sum's pieces as integers and float16: one combine per piece (the one-pass kernel
// is for float and double), still in rank order and equal to the all-to-all's sum.
TEST_P(DistWorld, PairwiseSumOfIntegersAndHalvesPieceByPiece) {
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

INSTANTIATE_TEST_SUITE_P(WorldSizes, DistWorld, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "W" + std::to_string(info.param); });
// Beyond four ranks the pairwise reduce-scatter's pieces no longer fit in its two receive buffers
// at once: it posts receives in the finish and sums in several passes.
INSTANTIATE_TEST_SUITE_P(BeyondFourRanks, DistWorld, ::testing::Values(6),
                         [](const auto& info) { return "W" + std::to_string(info.param); });

// The sum kernel alone, against ATen: sources added in order, then the power-of-two divisors, on
// two intra-op threads over sizes TensorIterator splits between them (the multi-rank tests run
// one thread on small tensors), for 0 to 5 sources (more than three take a second pass).
// The deprecated names of issue 38's renames still compile and mean what the new ones do
// (docs/migration.md); each warns where it is used, silenced here.
TEST(Dist, DeprecatedNamesStillWork) {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  fsdp::dist::Work w;
  EXPECT_TRUE(w.waited());
  EXPECT_EQ(w.done(), w.waited());
  static_assert(std::is_same_v<fsdp::ParamRef, fsdp::ParamInfo>);
#pragma GCC diagnostic pop
  fsdp::StateDict sd;  // from the old header
  sd.insert_or_assign("x", int64_t{1});
  EXPECT_TRUE(sd.contains("x"));
}

TEST(Dist, SumThenDivideEqualsAddThenDivOnSeveralThreads) {
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

TEST(Dist, SubGroupsAndHybridLayout) {
  run_ranks(4, [](ProcessGroup& pg) {
    // Odd sub-group with a permuted rank order; rank 1 is outside it.
    ProcessGroup sub = pg.new_group({3, 0, 2});
    if (pg.rank() == 1) {
      EXPECT_FALSE(sub.is_member());
      EXPECT_THROW(sub.barrier(), fsdp::StateError);
    } else {
      ASSERT_TRUE(sub.is_member());
      const std::vector<int> order{3, 0, 2};
      EXPECT_EQ(sub.size(), 3);
      EXPECT_EQ(order[sub.rank()], pg.rank());
      EXPECT_EQ(sub.global_ranks(), order);
      at::Tensor t = at::full({2}, static_cast<float>(pg.rank()));
      sub.all_reduce(t);
      EXPECT_TRUE(at::equal(t, at::full({2}, 5.0f)));
    }
    auto h = fsdp::dist::make_hybrid_groups(pg, 2);
    ASSERT_TRUE(h.shard.is_member());
    ASSERT_TRUE(h.replicate.is_member());
    EXPECT_EQ(h.shard.size(), 2);
    EXPECT_EQ(h.replicate.size(), 2);
    EXPECT_EQ(h.shard.rank(), pg.rank() % 2);
    EXPECT_EQ(h.replicate.rank(), pg.rank() / 2);
    at::Tensor s = at::full({1}, static_cast<float>(pg.rank()));
    h.shard.all_reduce(s);  // {0,1} -> 1, {2,3} -> 5
    EXPECT_EQ(s.item<float>(), pg.rank() < 2 ? 1.0f : 5.0f);
    at::Tensor r = at::full({1}, static_cast<float>(pg.rank()));
    h.replicate.all_reduce(r);  // {0,2} -> 2, {1,3} -> 4
    EXPECT_EQ(r.item<float>(), pg.rank() % 2 == 0 ? 2.0f : 4.0f);
    EXPECT_THROW(fsdp::dist::make_hybrid_groups(pg, 3), fsdp::ValueError);
  });
}

// Rank 1 never joins `call` and stays alive, so that rank 0's failure is a timeout, not a closed
// socket: rank 0 gets a DistError containing each of `expected`, within a bounded time.
void expect_times_out(const std::function<void(ProcessGroup&)>& call,
                      const std::vector<std::string>& expected) {
  fsdp::testing::RunOptions opts;
  opts.collective_timeout = std::chrono::milliseconds(1500);
  run_ranks(
      2,
      [&](ProcessGroup& pg) {
        if (pg.rank() == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(4000));
          return;
        }
        auto t0 = std::chrono::steady_clock::now();
        try {
          call(pg);
          ADD_FAILURE() << "expected a DistError";
        } catch (const fsdp::DistError& e) {
          const std::string msg = e.what();
          for (const auto& part : expected) EXPECT_NE(msg.find(part), std::string::npos) << msg;
        }
        EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(3 * 1500));
      },
      opts);
}

TEST(Dist, CollectiveTimesOutWithErrorNamingOpAndRank) {
  expect_times_out([](ProcessGroup& pg) { pg.all_reduce(at::ones({4})); },
                   {"all_reduce", "rank 0 of 2"});
}

// A pairwise all-gather (AUTO's choice on Gloo from 4 MiB) whose peer never joins: the receive
// from that peer times out, and the error names it.
TEST(Dist, PairwiseAllGatherTimesOutNamingThePeer) {
  expect_times_out(
      [](ProcessGroup& pg) {
        pg.all_gather_into_tensor(at::empty({8}), at::ones({4}), AllGatherAlgo::PAIRWISE);
      },
      {"all_gather_into_tensor", "rank 0 of 2", "from rank 1"});
}

TEST(Dist, DeadPeerBecomesDistErrorNotHang) {
  // The timeout bounds how long survivors take to notice; it must not expire by accident during
  // start-up on a loaded machine, and tearing the group down may wait it out once more.
  fsdp::testing::RunOptions opts;
  opts.collective_timeout = std::chrono::milliseconds(10000);
  opts.grace = 4 * opts.collective_timeout;
  opts.report = false;
  auto results = run_ranks(
      3,
      [](ProcessGroup& pg) {
        // Dies mid-job. Not right after a collective (init's barrier is one): rank 2 could leave
        // it before its last message reached the others, who would then fail there, outside the
        // check below (seen on a loaded machine). The pause lets them finish it first.
        if (pg.rank() == 2) {
          std::this_thread::sleep_for(std::chrono::milliseconds(500));
          ::raise(SIGKILL);
        }
        auto t0 = std::chrono::steady_clock::now();
        EXPECT_THROW(pg.all_reduce(at::ones({1 << 16})), fsdp::DistError);
        EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(2 * 10000));
      },
      opts);
  EXPECT_TRUE(results[0].ok) << results[0].message;
  EXPECT_TRUE(results[1].ok) << results[1].message;
  EXPECT_FALSE(results[2].ok);
  EXPECT_NE(results[2].message.find("signal 9"), std::string::npos) << results[2].message;
}

// Rank 0 stopped (SIGSTOP, a hung host) after its TCPStore began to listen: the kernel still
// completes the others' connections from the backlog, but nothing ever answers. LibTorch 2.6's
// store client waited for its ping's reply with no limit (found by scripts/chaos.py); the
// rendezvous must end in a DistError within the timeout instead.
TEST(Dist, StoreThatNeverAnswersIsAnErrorNotAHang) {
  fsdp::testing::RunOptions opts;
  opts.init_group = false;
  run_ranks(
      1,
      [](ProcessGroup&) {
        const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
        ASSERT_GE(fd, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        socklen_t len = sizeof a;
        ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
        ASSERT_EQ(::listen(fd, 16), 0);  // never accept()ed, never answered
        ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
        const auto t0 = std::chrono::steady_clock::now();
        try {
          fsdp::dist::init_process_group(fsdp::dist::InitOptions()
                                             .rank(1)
                                             .world_size(2)
                                             .master_addr("127.0.0.1")
                                             .master_port(ntohs(a.sin_port))
                                             .timeout(std::chrono::milliseconds(1500)));
          ADD_FAILURE() << "the rendezvous succeeded with a store that never answers";
        } catch (const fsdp::DistError& e) {
          EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
          EXPECT_NE(std::string(e.what()).find("127.0.0.1:" + std::to_string(ntohs(a.sin_port))),
                    std::string::npos)
              << e.what();
        }
        // The timeout, the 2 s the store's own retries get, and slack for a loaded machine.
        EXPECT_LT(std::chrono::steady_clock::now() - t0,
                  std::chrono::milliseconds(1500 + 2000 + 3000));
        // Leave at once: the abandoned connect thread may still hold the socket.
        ::close(fd);
      },
      opts);
}

// Under a launcher that hosts the job's store (fsdp-run across hosts, torchrun), every rank is a
// client: here the test process hosts it on the port MASTER_PORT names, so a rank 0 that tried to
// host it too would fail to bind. Negative control: without TORCHELASTIC_USE_AGENT_STORE, rank 0
// does try, and fails.
TEST(Dist, InitUnderALauncherThatHostsTheStore) {
  auto store = fsdp::compat::make_tcp_store("127.0.0.1", 0, /*is_server=*/true, -1,
                                            std::chrono::seconds(30));
  const int port = store->getPort();
  const int64_t keys_before = store->getNumKeys();
  for (const bool agent : {true, false}) {
    fsdp::testing::RunOptions opts;
    opts.init_group = false;
    opts.report = agent;
    if (!agent) opts.grace = std::chrono::seconds(1);
    auto results = fsdp::testing::run_ranks(
        2,
        [port, agent](ProcessGroup&) {
          const char* r = std::getenv("FSDP_TEST_RANK");
          ASSERT_NE(r, nullptr);
          ::setenv("RANK", r, 1);
          ::setenv("WORLD_SIZE", "2", 1);
          ::setenv("MASTER_ADDR", "127.0.0.1", 1);
          ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
          ::setenv("TORCHELASTIC_USE_AGENT_STORE", agent ? "True" : "False", 1);
          ::setenv("TORCHELASTIC_RESTART_COUNT", "3", 1);
          const auto env = fsdp::dist::env_info();
          EXPECT_EQ(env.agent_store, agent);
          EXPECT_EQ(env.restart_count, 3);
          auto pg = fsdp::dist::init_process_group(
              fsdp::dist::InitOptions().backend("gloo").timeout(std::chrono::seconds(10)));
          at::Tensor t = at::ones({3});
          pg.all_reduce(t);
          EXPECT_TRUE(at::equal(t, at::full({3}, 2.0f)));
          fsdp::dist::destroy_process_group();
        },
        opts);
    if (agent) {
      EXPECT_GT(store->getNumKeys(), keys_before) << "the ranks rendezvoused elsewhere";
    } else {
      ASSERT_FALSE(results[0].ok) << "rank 0 hosted a second store on a port in use";
      EXPECT_NE(results[0].message.find("TCPStore 127.0.0.1:" + std::to_string(port)),
                std::string::npos)
          << results[0].message;
    }
  }
  // PyTorch's spelling only: "true" is not "True".
  ::setenv("TORCHELASTIC_USE_AGENT_STORE", "true", 1);
  EXPECT_FALSE(fsdp::dist::env_info().agent_store);
  ::setenv("TORCHELASTIC_RESTART_COUNT", "x", 1);
  EXPECT_THROW(fsdp::dist::env_info(), fsdp::ValueError);
  ::unsetenv("TORCHELASTIC_USE_AGENT_STORE");
  ::unsetenv("TORCHELASTIC_RESTART_COUNT");
}

TEST(Dist, InitFromTorchrunEnvironment) {
  // A free port for rank 0's TCPStore; the children read it from MASTER_PORT.
  const int port = fsdp::testing::free_port();
  fsdp::testing::RunOptions opts;
  opts.init_group = false;
  // Each child sets the variables torchrun would have set, then initialises from them alone.
  run_ranks(
      2,
      [port](ProcessGroup&) {
        const char* r = std::getenv("FSDP_TEST_RANK");  // set by the harness
        ASSERT_NE(r, nullptr);
        ::setenv("RANK", r, 1);
        ::setenv("WORLD_SIZE", "2", 1);
        ::setenv("LOCAL_RANK", r, 1);
        ::setenv("LOCAL_WORLD_SIZE", "2", 1);
        ::setenv("MASTER_ADDR", "127.0.0.1", 1);
        ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
        auto env = fsdp::dist::env_info();
        EXPECT_EQ(env.world_size, 2);
        EXPECT_EQ(env.master_port, port);
        auto pg = fsdp::dist::init_process_group(
            fsdp::dist::InitOptions().timeout(std::chrono::seconds(20)));
        EXPECT_TRUE(fsdp::dist::is_initialized());
        EXPECT_EQ(pg.rank(), std::atoi(r));
        EXPECT_EQ(pg.size(), 2);
    // "auto": NCCL where LibTorch has CUDA and a GPU is visible (CPU tensors then go through
    // it), else Gloo.
#ifdef USE_C10D_NCCL
        EXPECT_EQ(pg.backend_name(), torch::cuda::is_available() ? "nccl" : "gloo");
#else
        EXPECT_EQ(pg.backend_name(), "gloo");
#endif
        at::Tensor t = at::ones({3});
        fsdp::dist::default_group().all_reduce(t);
        EXPECT_TRUE(at::equal(t, at::full({3}, 2.0f)));
      },
      opts);
}

// Programs started by mpirun or srun find their layout without torchrun's variables; torchrun's
// win when several launchers' are present, and one launcher's are never mixed with another's.
TEST(Dist, EnvInfoReadsMpirunAndSlurm) {
  const char* all[] = {"RANK",
                       "WORLD_SIZE",
                       "LOCAL_RANK",
                       "LOCAL_WORLD_SIZE",
                       "OMPI_COMM_WORLD_RANK",
                       "OMPI_COMM_WORLD_SIZE",
                       "OMPI_COMM_WORLD_LOCAL_RANK",
                       "OMPI_COMM_WORLD_LOCAL_SIZE",
                       "SLURM_PROCID",
                       "SLURM_NTASKS",
                       "SLURM_LOCALID",
                       "SLURM_NTASKS_PER_NODE",
                       "SLURM_TASKS_PER_NODE"};
  for (const char* v : all) ::unsetenv(v);
  EXPECT_EQ(fsdp::dist::env_info().launcher, "none");
  EXPECT_EQ(fsdp::dist::env_info().world_size, 1);

  ::setenv("SLURM_PROCID", "5", 1);
  ::setenv("SLURM_NTASKS", "8", 1);
  ::setenv("SLURM_LOCALID", "1", 1);
  ::setenv("SLURM_TASKS_PER_NODE", "4(x2)", 1);
  auto e = fsdp::dist::env_info();
  EXPECT_EQ(e.launcher, "slurm");
  EXPECT_EQ(std::make_tuple(e.rank, e.world_size, e.local_rank, e.local_world_size),
            std::make_tuple(5, 8, 1, 4));

  ::setenv("OMPI_COMM_WORLD_RANK", "2", 1);
  ::setenv("OMPI_COMM_WORLD_SIZE", "3", 1);
  ::setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0", 1);
  ::setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "1", 1);
  e = fsdp::dist::env_info();
  EXPECT_EQ(e.launcher, "mpirun");
  EXPECT_EQ(std::make_tuple(e.rank, e.world_size, e.local_rank, e.local_world_size),
            std::make_tuple(2, 3, 0, 1));

  ::setenv("RANK", "1", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  e = fsdp::dist::env_info();
  EXPECT_EQ(e.launcher, "torchrun");
  EXPECT_EQ(std::make_tuple(e.rank, e.world_size, e.local_rank, e.local_world_size),
            std::make_tuple(1, 2, 1, 2))
      << "LOCAL_* default from torchrun's own RANK and WORLD_SIZE, not from Open MPI's";

  ::setenv("OMPI_COMM_WORLD_SIZE", "three", 1);
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
  EXPECT_THROW(fsdp::dist::env_info(), fsdp::ValueError);
  for (const char* v : all) ::unsetenv(v);
}

TEST(Dist, EnvInfoRejectsMalformedVariables) {
  ::setenv("WORLD_SIZE", "two", 1);
  EXPECT_THROW(fsdp::dist::env_info(), fsdp::ValueError);
  ::unsetenv("WORLD_SIZE");
  EXPECT_THROW(fsdp::dist::default_group(), fsdp::StateError);
  EXPECT_THROW(fsdp::dist::init_process_group(fsdp::dist::InitOptions().rank(3).world_size(2)),
               fsdp::ValueError);
}

}  // namespace

// The one message builder (util/message.h): each marker prints what the hand-made concatenations
// it replaced printed, which the word-for-word message tests elsewhere rely on.
TEST(MessageText, MarkersPrintKeyRankShapeAndNumbersAsTheMessagesAlwaysDid) {
  using fsdp::detail::msg;
  using fsdp::detail::quote;
  using fsdp::detail::rank;
  using fsdp::detail::shape;
  const std::string key = "layers.0.weight";  // a std::string: std::quoted must not win
  const std::vector<int64_t> sizes{2, 3};
  const size_t n = 7;
  EXPECT_EQ(msg("load: ", quote(key), " has shape ", shape(sizes), " on ", rank(3), ", ", n,
                " elements of ", at::kFloat, " (", int64_t{-1}, ' ', shape({}), ")"),
            "load: 'layers.0.weight' has shape [2, 3] on rank 3, 7 elements of Float (-1 [])");
  EXPECT_EQ(msg(std::string_view("a"), std::string("b"), "c", at::Device("cpu")), "abccpu");
  EXPECT_EQ(fsdp::detail::shape_str({4}), "[4]");
}
