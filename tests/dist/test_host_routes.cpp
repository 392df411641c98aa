// Collectives routed by host (InitOptions::host_aware, src/dist/host_routes.cpp), on loopback
// ranks that torchrun's variables place on 2 hosts x 2 ranks. The bytes they save at the host
// boundary are measured on emulated hosts (scripts/host_traffic.py); here: the results.
//
// Each check knows what the routed form computes bit for bit (sums in host order: each host's
// ranks first, then the hosts) and that it is not what the flat form computes (so a routing that
// silently fell back to the flat path fails), and that every rank ends with the same bits.
#include <gtest/gtest.h>

#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fsdp/compat_backends.h"
#include "fsdp/dist.h"
#include "fsdp/errors.h"
#include "multi_rank.h"

namespace {

using fsdp::dist::AllGatherAlgo;
using fsdp::dist::ProcessGroup;
using fsdp::dist::ReduceOp;
using fsdp::dist::ReduceScatterAlgo;
using fsdp::testing::run_ranks;
using fsdp::testing::seeded_randn;

using fsdp::testing::init_as_hosts;

fsdp::testing::RunOptions own_init() {
  fsdp::testing::RunOptions o;
  o.init_group = false;
  return o;
}

// Rank r's input in every check: reproducible on every rank.
at::Tensor input_of(int r, int64_t numel, at::ScalarType dtype, uint64_t salt) {
  return seeded_randn({numel}, 1000 * salt + static_cast<uint64_t>(r), at::kDouble)
      .mul(1.0 + r)
      .to(dtype);
}

// The host-order sum of every rank's input: ((x0 + x1 + ... ) per host, then over hosts.
at::Tensor host_order_sum(int world, int per_host, int64_t numel, at::ScalarType dtype,
                          uint64_t salt) {
  at::Tensor total;
  for (int h = 0; h < world / per_host; ++h) {
    at::Tensor host = input_of(h * per_host, numel, dtype, salt).clone();
    for (int j = 1; j < per_host; ++j) host.add_(input_of(h * per_host + j, numel, dtype, salt));
    total = total.defined() ? total.add_(host) : host;
  }
  return total;
}

at::Tensor rank_order_sum(int world, int64_t numel, at::ScalarType dtype, uint64_t salt) {
  at::Tensor total = input_of(0, numel, dtype, salt).clone();
  for (int r = 1; r < world; ++r) total.add_(input_of(r, numel, dtype, salt));
  return total;
}

// Every rank holds the same bits of `t`.
void expect_same_on_every_rank(ProcessGroup& pg, const at::Tensor& t, const std::string& what) {
  at::Tensor all = at::empty({pg.size() * t.numel()}, t.options());
  pg.all_gather_into_tensor(all, t.reshape(-1).contiguous(), AllGatherAlgo::NATIVE);
  for (int r = 1; r < pg.size(); ++r) {
    EXPECT_TRUE(at::equal(all.narrow(0, 0, t.numel()), all.narrow(0, r * t.numel(), t.numel())))
        << what << ": rank " << r << " differs from rank 0";
  }
}

void check_routed_collectives(ProcessGroup& pg, int world, int per_host) {
  const int rank = pg.rank();
  ASSERT_EQ(pg.hosts(), world / per_host);
  // 40,000 floats: 160 KB, routed by AUTO (from 64 KiB); 4,002 is under it and not divisible by
  // the host size.
  const int64_t n = 40000;
  // All-gather, AUTO and HIERARCHICAL, out of place and in place: exact.
  for (AllGatherAlgo algo : {AllGatherAlgo::AUTO, AllGatherAlgo::HIERARCHICAL}) {
    at::Tensor out = at::full({world * n}, -1.0f);
    pg.all_gather_into_tensor(out, input_of(rank, n, at::kFloat, 1), algo);
    at::Tensor in_place = at::full({world * n}, -1.0f);
    in_place.narrow(0, rank * n, n).copy_(input_of(rank, n, at::kFloat, 1));
    pg.all_gather_into_tensor(in_place, in_place.narrow(0, rank * n, n), algo);
    for (int r = 0; r < world; ++r) {
      EXPECT_TRUE(at::equal(out.narrow(0, r * n, n), input_of(r, n, at::kFloat, 1))) << r;
      EXPECT_TRUE(at::equal(in_place.narrow(0, r * n, n), input_of(r, n, at::kFloat, 1))) << r;
    }
  }
  // Reduce-scatter: the host-order sum of this rank's chunk, divided as asked; not the flat sum.
  for (ReduceScatterAlgo algo : {ReduceScatterAlgo::AUTO, ReduceScatterAlgo::HIERARCHICAL}) {
    at::Tensor out = at::empty({n}, at::kFloat);
    pg.reduce_scatter_tensor(out, input_of(rank, world * n, at::kFloat, 2), ReduceOp::AVG, algo,
                             {2.0});
    at::Tensor want = host_order_sum(world, per_host, world * n, at::kFloat, 2)
                          .narrow(0, rank * n, n)
                          .div_(world)
                          .div_(2.0);
    EXPECT_TRUE(at::equal(out, want)) << "max diff " << (out - want).abs().max().item<float>();
    at::Tensor flat = rank_order_sum(world, world * n, at::kFloat, 2).narrow(0, rank * n, n);
    EXPECT_FALSE(at::equal(out, flat.div_(world).div_(2.0)))
        << "the routed sum equals the flat one: nothing was routed?";
  }
  // In pieces (how FSDP hands over gradients), with MAX (exact in any order).
  {
    at::Tensor in = input_of(rank, world * n, at::kFloat, 3);
    std::vector<std::vector<at::Tensor>> chunks(static_cast<size_t>(world));
    for (int q = 0; q < world; ++q)
      chunks[q] = {in.narrow(0, q * n, 100), in.narrow(0, q * n + 100, n - 100)};
    at::Tensor out = at::empty({n}, at::kFloat);
    pg.reduce_scatter_pieces_async(out, chunks, ReduceOp::MAX).wait();
    at::Tensor want = input_of(0, world * n, at::kFloat, 3);
    for (int r = 1; r < world; ++r) want = at::maximum(want, input_of(r, world * n, at::kFloat, 3));
    EXPECT_TRUE(at::equal(out, want.narrow(0, rank * n, n)));
  }
  // All-reduce: sizes divisible by the host size and not (the tail goes flat), double and
  // bfloat16 (through float32); every rank the same bits, close to the exact sum.
  for (int64_t numel : {int64_t{n}, int64_t{n + 3}, int64_t{4002}}) {
    for (at::ScalarType dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
      at::Tensor t = input_of(rank, numel, dtype, 4);
      pg.all_reduce(t, ReduceOp::SUM);
      expect_same_on_every_rank(pg, t, "all_reduce");
      // The exact sum of the inputs as they were (bfloat16 rounds them); the result is rounded
      // once (bfloat16: summed in float32).
      at::Tensor exact = at::zeros({numel}, at::kDouble);
      for (int r = 0; r < world; ++r) exact.add_(input_of(r, numel, dtype, 4).to(at::kDouble));
      EXPECT_TRUE(
          at::allclose(t.to(at::kDouble), exact, dtype == at::kBFloat16 ? 1e-2 : 1e-5, 1e-5))
          << numel << " " << dtype;
      if (dtype == at::kFloat && numel % per_host == 0 && world / per_host == 2 &&
          numel * 4 >= (64 << 10)) {
        // Two hosts: (host 0's sum) + (host 1's sum), which commutes, so exact.
        EXPECT_TRUE(at::equal(t, host_order_sum(world, per_host, numel, dtype, 4)));
      }
    }
  }
  // AVG and MAX all-reduce.
  {
    at::Tensor t = input_of(rank, n + 1, at::kFloat, 5);
    pg.all_reduce(t, ReduceOp::AVG);
    EXPECT_TRUE(
        at::allclose(t, rank_order_sum(world, n + 1, at::kFloat, 5).div_(world), 1e-5, 1e-6));
    at::Tensor m = input_of(rank, n + 1, at::kFloat, 6);
    pg.all_reduce(m, ReduceOp::MAX);
    at::Tensor want = input_of(0, n + 1, at::kFloat, 6);
    for (int r = 1; r < world; ++r) want = at::maximum(want, input_of(r, n + 1, at::kFloat, 6));
    EXPECT_TRUE(at::equal(m, want));
  }
  // A collective still in flight while the next starts (FSDP's prefetch): tags keep them apart.
  {
    at::Tensor a = at::empty({world * n}, at::kFloat), b = at::empty({world * n}, at::kFloat);
    fsdp::dist::Work wa = pg.all_gather_into_tensor_async(a, input_of(rank, n, at::kFloat, 7));
    at::Tensor rs = at::empty({n}, at::kFloat);
    fsdp::dist::Work wr =
        pg.reduce_scatter_tensor_async(rs, input_of(rank, world * n, at::kFloat, 8));
    fsdp::dist::Work wb = pg.all_gather_into_tensor_async(b, input_of(rank, n, at::kFloat, 9));
    wb.wait();
    wr.wait();
    wa.wait();
    for (int r = 0; r < world; ++r) {
      EXPECT_TRUE(at::equal(a.narrow(0, r * n, n), input_of(r, n, at::kFloat, 7)));
      EXPECT_TRUE(at::equal(b.narrow(0, r * n, n), input_of(r, n, at::kFloat, 9)));
    }
    EXPECT_TRUE(at::equal(
        rs, host_order_sum(world, per_host, world * n, at::kFloat, 8).narrow(0, rank * n, n)));
  }
  // Sub-groups are flat, and HIERARCHICAL says so instead of falling back.
  std::vector<int> all;
  for (int r = 0; r < world; ++r) all.push_back(r);
  ProcessGroup sub = pg.new_group(all);
  EXPECT_EQ(sub.hosts(), 1);
  at::Tensor out = at::empty({world * n}, at::kFloat);
  EXPECT_THROW(sub.all_gather_into_tensor(out, at::zeros({n}), AllGatherAlgo::HIERARCHICAL),
               fsdp::ValueError);
}

TEST(HostRoutes, CollectivesOnTwoHostsOfTwoRanks) {
  run_ranks(
      4,
      [](ProcessGroup&) {
        ProcessGroup pg = init_as_hosts(4, 2);
        check_routed_collectives(pg, 4, 2);
      },
      own_init());
}

// Beyond CI's world sizes (run by hand: --gtest_also_run_disabled_tests): 2 x 3 and 3 x 2.
TEST(HostRoutes, DISABLED_CollectivesOnSixRanks) {
  for (int per_host : {3, 2}) {
    run_ranks(
        6,
        [per_host](ProcessGroup&) {
          ProcessGroup pg = init_as_hosts(6, per_host);
          check_routed_collectives(pg, 6, per_host);
        },
        own_init());
  }
}

// A rank that dies as a routed collective starts (its host's peer and its counterpart on the
// other host are in different steps of it): every other rank raises DistError, none hangs.
TEST(HostRoutes, ARankThatDiesFailsEveryOtherRankWithDistError) {
  // SIGSTOP (a hang, no socket closes) where the first step blocks the call: the reduce-scatter.
  const std::pair<const char*, int> cases[] = {{"all_gather", SIGKILL},
                                               {"reduce_scatter", SIGKILL},
                                               {"all_reduce", SIGKILL},
                                               {"reduce_scatter", SIGSTOP}};
  for (const auto& [which, sig] : cases) {
    fsdp::testing::RunOptions o = own_init();
    o.report = false;
    o.grace = std::chrono::seconds(30);
    o.deadline = std::chrono::seconds(sig == SIGSTOP ? 18 : 120);  // the stopped rank is killed
    const std::string name = which;
    const int signal = sig;
    auto results = run_ranks(
        4,
        [name, signal](ProcessGroup&) {
          ProcessGroup pg = init_as_hosts(4, 2, std::nullopt, nullptr, std::chrono::seconds(5));
          ASSERT_EQ(pg.hosts(), 2);
          // Gloo's connect returns on one rank before its peers have finished theirs: without
          // this barrier, rank 3 could die while rank 1 still connects their group, and rank 1
          // would fail in init (a DistError too, but not the case under test).
          pg.barrier();
          // Rank 3 dies once every other rank has left the barrier (its last messages are still
          // on their way when rank 3 returns from it) and is about to enter the collective: each
          // says so in the harness's store, and rank 3 waits for all three, not for a time.
          auto store = fsdp::compat::make_tcp_store(
              "127.0.0.1", static_cast<uint16_t>(std::atoi(std::getenv("FSDP_TEST_STORE_PORT"))),
              false, -1, std::chrono::seconds(30));
          const std::string left = "host_routes_left_barrier_" + name + std::to_string(signal);
          if (pg.rank() == 3) {
            while (store->add(left, 0) < 3)
              std::this_thread::sleep_for(std::chrono::milliseconds(5));
            ::raise(signal);
          } else {
            store->add(left, 1);
          }
          const int64_t n = 40000;
          const auto start = std::chrono::steady_clock::now();
          try {
            if (name == "all_gather") {
              at::Tensor out = at::empty({4 * n}, at::kFloat);
              pg.all_gather_into_tensor(out, at::ones({n}));
            } else if (name == "reduce_scatter") {
              at::Tensor out = at::empty({n}, at::kFloat);
              pg.reduce_scatter_tensor(out, at::ones({4 * n}));
            } else {
              at::Tensor t = at::ones({n});
              pg.all_reduce(t);
            }
            ADD_FAILURE() << name << " completed without rank 3";
          } catch (const fsdp::DistError& e) {
            const double s =
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            EXPECT_LT(s, 15.0) << name << ": " << e.what();
            EXPECT_NE(std::string(e.what()).find(" on group 'default"), std::string::npos)
                << e.what();
          }
        },
        o);
    ASSERT_EQ(results.size(), 4u);
    for (int r = 0; r < 3; ++r) {
      EXPECT_TRUE(results[r].ok) << which << " " << sig << ": rank " << r << ": "
                                 << results[r].message;
      EXPECT_FALSE(results[r].killed) << which << " " << sig << ": rank " << r << " hung";
    }
    EXPECT_FALSE(results[3].ok);
  }
}

// No routes unless every rank's layout says several hosts in consecutive blocks, or when switched
// off; the collectives are then the flat ones.
TEST(HostRoutes, FlatWhenTheLayoutIsNotHostsOrRoutingIsOff) {
  struct Case {
    const char* what;
    std::optional<bool> host_aware;
    const char* env;  // FSDP_HOST_AWARE on host 0's ranks (0, 1)
    int (*local_rank_of)(int, int);
    const char* env_host1 = "same";  // and on host 1's (2, 3): "same" as host 0's, or this
  };
  const Case cases[] = {
      {"ranks not numbered host by host", std::nullopt, nullptr,
       [](int r, int per_host) { return r / per_host; }},
      {"InitOptions::host_aware(false)", false, nullptr, nullptr},
      {"FSDP_HOST_AWARE=0", std::nullopt, "0", nullptr},
      // Set on one host only (an operator's slip): every rank still agrees, flat.
      {"FSDP_HOST_AWARE=0 on host 1 only", std::nullopt, nullptr, nullptr, "0"},
      {"FSDP_HOST_AWARE=1 on host 0, 0 on host 1", std::nullopt, "1", nullptr, "0"},
  };
  for (const Case& c : cases) {
    run_ranks(
        4,
        [&c](ProcessGroup&) {
          const bool host1 = std::atoi(std::getenv("FSDP_TEST_RANK")) >= 2;
          const char* env = host1 && std::string(c.env_host1) != "same" ? c.env_host1 : c.env;
          if (env) ::setenv("FSDP_HOST_AWARE", env, 1);
          ProcessGroup pg = init_as_hosts(4, 2, c.host_aware, c.local_rank_of);
          EXPECT_EQ(pg.hosts(), 1) << c.what;
          const int64_t n = 40000;
          at::Tensor out = at::empty({n}, at::kFloat);
          pg.reduce_scatter_tensor(out, input_of(pg.rank(), 4 * n, at::kFloat, 2));
          EXPECT_TRUE(
              at::equal(out, rank_order_sum(4, 4 * n, at::kFloat, 2).narrow(0, pg.rank() * n, n)))
              << c.what;
        },
        own_init());
  }
}

}  // namespace
