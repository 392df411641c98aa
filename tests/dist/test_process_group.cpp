// Process groups over real Gloo processes: sub-groups and the hybrid layout, initialisation from
// a launcher's environment (torchrun, a launcher that hosts the store, mpirun, Slurm), and what a
// group does when a peer is late, dead or never answers.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <functional>
#include <thread>
#include <tuple>

#include <torch/cuda.h>

#include "fsdp/compat.h"
#include "fsdp/compat_backends.h"
#include "fsdp/dist.h"
#include "fsdp/errors.h"
#include "fsdp/flat_param.h"
#include "fsdp/state_dict.h"  // the value model's deprecated header name: must still work
#include "multi_rank.h"

using fsdp::dist::AllGatherAlgo;
using fsdp::dist::ProcessGroup;
using fsdp::testing::run_ranks;

namespace {

TEST(SubGroups, PermutedOddGroupAndHybridLayout) {
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

TEST(GroupFailures, CollectiveTimesOutWithErrorNamingOpAndRank) {
  expect_times_out([](ProcessGroup& pg) { pg.all_reduce(at::ones({4})); },
                   {"all_reduce", "rank 0 of 2"});
}

// A pairwise all-gather (AUTO's choice on Gloo from 4 MiB) whose peer never joins: the receive
// from that peer times out, and the error names it.
TEST(GroupFailures, PairwiseAllGatherTimesOutNamingThePeer) {
  expect_times_out(
      [](ProcessGroup& pg) {
        pg.all_gather_into_tensor(at::empty({8}), at::ones({4}), AllGatherAlgo::PAIRWISE);
      },
      {"all_gather_into_tensor", "rank 0 of 2", "from rank 1"});
}

TEST(GroupFailures, DeadPeerBecomesDistErrorNotHang) {
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
TEST(GroupFailures, StoreThatNeverAnswersIsAnErrorNotAHang) {
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

// The launcher: a process of its own that hosts a store until killed, as fsdp-run's agent does.
// Not this process, which forks the ranks: a store server runs a thread, and a rank forked while
// it holds memory would find that memory unreachable (LeakSanitizer reports it in every rank).
struct LauncherStore {
  pid_t pid = -1;
  int port = 0;
  LauncherStore() {
    int fds[2];
    if (::pipe(fds) != 0) return;
    pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      auto store = fsdp::compat::make_tcp_store("127.0.0.1", 0, /*is_server=*/true, -1,
                                                std::chrono::seconds(30));
      const int p = store->getPort();
      if (::write(fds[1], &p, sizeof p) != sizeof p) ::_exit(1);
      ::close(fds[1]);
      for (;;) ::pause();
    }
    ::close(fds[1]);
    if (pid < 0 || ::read(fds[0], &port, sizeof port) != sizeof port) port = 0;
    ::close(fds[0]);
  }
  ~LauncherStore() {
    if (pid <= 0) return;
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }
  // Asked by a client that is gone again before the test forks anything.
  int64_t keys() const {
    return fsdp::compat::make_tcp_store("127.0.0.1", port, false, -1, std::chrono::seconds(30))
        ->getNumKeys();
  }
};

// Under a launcher that hosts the job's store (fsdp-run across hosts, torchrun), every rank is a
// client: here a launcher process hosts it on the port MASTER_PORT names, so a rank 0 that tried
// to host it too would fail to bind. Negative control: without TORCHELASTIC_USE_AGENT_STORE, rank
// 0 does try, and fails.
TEST(InitProcessGroup, UnderALauncherThatHostsTheStore) {
  const LauncherStore store;
  ASSERT_GT(store.port, 0) << "cannot start the launcher's store";
  const int port = store.port;
  const int64_t keys_before = store.keys();
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
      EXPECT_GT(store.keys(), keys_before) << "the ranks rendezvoused elsewhere";
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

// device_id, PyTorch's init_process_group(device_id=...): a GPU that is not there is refused
// before any rendezvous, naming the device and what is visible; a CPU device changes nothing.
TEST(InitProcessGroup, DeviceIdNamesADeviceThatIsNotThere) {
  const int gpus = torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
  const at::Device missing(at::kCUDA, static_cast<c10::DeviceIndex>(gpus));
  try {
    fsdp::dist::init_process_group(
        fsdp::dist::InitOptions().rank(0).world_size(1).device_id(missing));
    ADD_FAILURE() << "expected a ValueError";
  } catch (const fsdp::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("device_id " + missing.str() + " is not available: " +
                                         std::to_string(gpus) + " CUDA devices are visible"),
              std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(fsdp::dist::is_initialized());
  fsdp::testing::RunOptions opts;
  opts.init_group = false;
  const int port = fsdp::testing::free_port();
  run_ranks(
      1,
      [port](ProcessGroup&) {
        auto pg = fsdp::dist::init_process_group(fsdp::dist::InitOptions()
                                                     .backend("gloo")
                                                     .rank(0)
                                                     .world_size(1)
                                                     .master_addr("127.0.0.1")
                                                     .master_port(port)
                                                     .device_id(at::Device(at::kCPU))
                                                     .timeout(std::chrono::seconds(20)));
        EXPECT_EQ(pg.device(), at::Device(at::kCPU));
        fsdp::dist::destroy_process_group();
      },
      opts);
}

TEST(InitProcessGroup, FromTorchrunEnvironment) {
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
TEST(EnvInfo, ReadsMpirunAndSlurm) {
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

TEST(EnvInfo, RejectsMalformedVariables) {
  ::setenv("WORLD_SIZE", "two", 1);
  EXPECT_THROW(fsdp::dist::env_info(), fsdp::ValueError);
  ::unsetenv("WORLD_SIZE");
  EXPECT_THROW(fsdp::dist::default_group(), fsdp::StateError);
  EXPECT_THROW(fsdp::dist::init_process_group(fsdp::dist::InitOptions().rank(3).world_size(2)),
               fsdp::ValueError);
}

// The deprecated names of issue 38's renames still compile and mean what the new ones do
// (docs/migration.md); each warns where it is used, silenced here.
TEST(DeprecatedNames, StillCompileAndMeanTheNewOnes) {
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

}  // namespace
