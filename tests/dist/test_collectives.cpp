// ProcessGroup's all_reduce, broadcast, barrier and byte-string collectives over real Gloo
// processes at W = 1-4 and 6, and bfloat16 (which Gloo cannot reduce) through each collective.
#include <gtest/gtest.h>

#include <string>

#include "dist_testing.h"
#include "fsdp/dist.h"
#include "multi_rank.h"

using fsdp::dist::ProcessGroup;
using fsdp::dist::ReduceOp;
using fsdp::testing::rank_input;
using fsdp::testing::run_ranks;
using fsdp::testing::seeded_randn;

namespace {

class AllReduce : public ::testing::TestWithParam<int> {};
class Broadcast : public ::testing::TestWithParam<int> {};
class Bytes : public ::testing::TestWithParam<int> {};
class BFloat16 : public ::testing::TestWithParam<int> {};

TEST_P(AllReduce, SumAndAverage) {
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
  });
}

TEST_P(Broadcast, EveryDtypeAndAScalarThenABarrier) {
  const int W = GetParam();
  run_ranks(W, [](ProcessGroup& pg) {
    const int W = pg.size();
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
  });
}

// all_gather_bytes and broadcast_bytes.
TEST_P(Bytes, SizesDifferByRankAndCrossTheOneCollectiveSlot) {
  const int W = GetParam();
  run_ranks(W, [](ProcessGroup& pg) {
    const int W = pg.size();
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
TEST_P(BFloat16, GathersExactlyAndReducesInFloat32) {
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

FSDP_DIST_WORLD_SIZES(AllReduce);
FSDP_DIST_WORLD_SIZES(Broadcast);
FSDP_DIST_WORLD_SIZES(Bytes);
FSDP_DIST_WORLD_SIZES(BFloat16);

}  // namespace
