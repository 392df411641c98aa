// fsdp-run's command line (src/launch/options.h), parsed in-process: torchrun's options in both
// spellings and from PET_ variables, --rdzv-conf, the options a C++ launcher refuses, "did you
// mean", --nproc-per-node auto|cpu|gpu, where the job's store is, and the heartbeat's bounds.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "launch/options.h"

namespace {

using fsdp_run::Options;

struct Parsed {
  int code = -1;  // parse_options' result, then complete_options' (-1: go on)
  Options o;
  std::string err;  // what it printed on stderr
};

// fsdp-run ARGS..., parsed (and, when that goes on, completed).
Parsed parse(std::vector<std::string> args, bool complete = true) {
  args.insert(args.begin(), "fsdp-run");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  Parsed p;
  ::testing::internal::CaptureStderr();
  p.code = fsdp_run::parse_options(static_cast<int>(argv.size()), argv.data(), p.o);
  if (p.code < 0 && complete) p.code = fsdp_run::complete_options(p.o);
  p.err = ::testing::internal::GetCapturedStderr();
  return p;
}

TEST(LaunchOptions, TorchrunsOptionsInBothSpellings) {
  const std::vector<std::vector<std::string>> spellings = {
      {"--nnodes",
       "2:3",
       "--nproc-per-node",
       "3",
       "--rdzv-backend",
       "c10d",
       "--rdzv-endpoint",
       "node0:1234",
       "--rdzv-id",
       "job7",
       "--rdzv-conf",
       "join_timeout=20,last_call_timeout=4",
       "--max-restarts",
       "2",
       "--monitor-interval",
       "5",
       "--start-method",
       "fork",
       "--role",
       "trainer",
       "--no-python",
       "--log-dir",
       "/tmp/l",
       "--redirects",
       "3",
       "--tee",
       "0:1",
       "--local-ranks-filter",
       "0",
       "--node-rank",
       "1",
       "--local-addr",
       "10.0.0.2",
       "prog",
       "a"},
      {"--nnodes=2:3",
       "--nproc_per_node=3",
       "--rdzv_backend=c10d",
       "--rdzv_endpoint=node0:1234",
       "--rdzv_id=job7",
       "--rdzv_conf=join_timeout=20,last_call_timeout=4",
       "--max_restarts=2",
       "--monitor_interval=5",
       "--start_method=fork",
       "--role=trainer",
       "--no_python",
       "--log_dir=/tmp/l",
       "-r",
       "3",
       "-t",
       "0:1",
       "--local_ranks_filter=0",
       "--node_rank=1",
       "--local_addr=10.0.0.2",
       "prog",
       "a"},
  };
  for (const auto& args : spellings) {
    const Parsed p = parse(args);
    ASSERT_EQ(p.code, -1) << p.err;
    const Options& o = p.o;
    EXPECT_EQ(o.min_nodes, 2);
    EXPECT_EQ(o.max_nodes, 3);
    EXPECT_EQ(o.nproc, 3);
    EXPECT_TRUE(o.c10d());
    EXPECT_EQ(o.store_host, "node0");
    EXPECT_EQ(o.store_port, 1234);
    EXPECT_EQ(o.rdzv_id, "job7");
    EXPECT_EQ(o.run_id, "job7");  // TORCHELASTIC_RUN_ID is the rendezvous id, as in torchrun
    EXPECT_EQ(o.conf.join_timeout, 20);
    EXPECT_EQ(o.conf.last_call_timeout, 4);
    EXPECT_EQ(o.max_restarts, 2);
    EXPECT_EQ(o.start_method, "fork");
    EXPECT_EQ(o.role, "trainer");
    EXPECT_TRUE(o.no_python);
    EXPECT_EQ(o.log_dir, "/tmp/l");
    EXPECT_EQ(o.redirects, "3");
    EXPECT_EQ(o.tee, "0:1");
    EXPECT_EQ(o.local_ranks_filter, "0");
    EXPECT_EQ(o.node_rank, 1);
    EXPECT_EQ(o.local_addr, "10.0.0.2");
    EXPECT_EQ(o.command, (std::vector<std::string>{"prog", "a"}));
  }
}

// torchrun reads an option it was not given from PET_<NAME>; the command line wins.
TEST(LaunchOptions, PetVariablesStandInForOptionsNotGiven) {
  ::setenv("PET_NPROC_PER_NODE", "4", 1);
  ::setenv("PET_RDZV_CONF", "keep_alive_interval=2", 1);
  ::setenv("PET_STANDALONE", "1", 1);
  const Parsed from_env = parse({"prog"});
  const Parsed given = parse({"--nproc-per-node", "2", "prog"});
  ::unsetenv("PET_NPROC_PER_NODE");
  ::unsetenv("PET_RDZV_CONF");
  ::unsetenv("PET_STANDALONE");
  ASSERT_EQ(from_env.code, -1) << from_env.err;
  EXPECT_EQ(from_env.o.nproc, 4);
  EXPECT_EQ(from_env.o.conf.keep_alive_interval, 2);
  EXPECT_TRUE(from_env.o.standalone);
  ASSERT_EQ(given.code, -1) << given.err;
  EXPECT_EQ(given.o.nproc, 2);
}

TEST(LaunchOptions, RdzvConfTakesTorchrunsKeysAndNamesAWrongOne) {
  const Parsed ok = parse({"--nnodes", "2", "--rdzv-conf",
                           "join_timeout=30,last_call_timeout=5,close_timeout=7,read_timeout=9,"
                           "keep_alive_interval=2,keep_alive_max_attempt=4,is_host=false,"
                           "store_type=tcp",
                           "prog"});
  ASSERT_EQ(ok.code, -1) << ok.err;
  EXPECT_EQ(ok.o.conf.join_timeout, 30);
  EXPECT_EQ(ok.o.conf.last_call_timeout, 5);
  EXPECT_EQ(ok.o.conf.close_timeout, 7);
  EXPECT_EQ(ok.o.conf.read_timeout, 9);
  ASSERT_TRUE(ok.o.conf.is_host.has_value());
  EXPECT_FALSE(*ok.o.conf.is_host);
  EXPECT_EQ(ok.o.keep_alive, 2);
  EXPECT_EQ(ok.o.lost_after, 8);  // keep_alive_interval x keep_alive_max_attempt
  // ... and each reaches the rendezvous agent.
  const fsdp_run::AgentConfig c = fsdp_run::agent_config(ok.o);
  EXPECT_EQ(c.join_timeout, 30);
  EXPECT_EQ(c.last_call_timeout, 5);
  EXPECT_EQ(c.close_timeout, 7);
  EXPECT_EQ(c.read_timeout, 9);
  EXPECT_EQ(c.keep_alive_interval, 2);
  EXPECT_EQ(c.lost_after, 8);
  // is_host is c10d's: a static rendezvous' node 0 hosts the store whatever it says (torchrun's).
  EXPECT_EQ(c.store_role, fsdp_run::StoreRole::kHost);
  Parsed c10d = parse({"--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:9",
                       "--rdzv-conf", "is_host=false", "prog"});
  EXPECT_EQ(fsdp_run::agent_config(c10d.o).store_role, fsdp_run::StoreRole::kClient);
  c10d = parse({"--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:9", "p"});
  EXPECT_EQ(fsdp_run::agent_config(c10d.o).store_role, fsdp_run::StoreRole::kHostIfFree);
  // The static rendezvous' "timeout" is its join timeout.
  EXPECT_EQ(parse({"--rdzv-conf", "timeout=42", "prog"}).o.conf.join_timeout, 42);

  const Parsed typo = parse({"--rdzv-conf", "join_timout=30", "prog"});
  EXPECT_EQ(typo.code, 2);
  EXPECT_NE(typo.err.find("unknown key 'join_timout' (did you mean join_timeout?)"),
            std::string::npos)
      << typo.err;
  for (const char* bad : {"join_timeout=-1", "join_timeout=x", "is_host=maybe",
                          "keep_alive_max_attempt=2.5", "store_type=file"}) {
    const Parsed p = parse({"--rdzv-conf", bad, "prog"});
    EXPECT_EQ(p.code, 2) << bad;
    EXPECT_NE(p.err.find("--rdzv-conf"), std::string::npos) << p.err;
  }
  const Parsed clash = parse({"--join-timeout", "5", "--rdzv-conf", "join_timeout=6", "prog"});
  EXPECT_EQ(clash.code, 2);
  EXPECT_NE(clash.err.find("disagree"), std::string::npos) << clash.err;
}

TEST(LaunchOptions, AnUnknownOptionNamesTheNearestOne) {
  const Parsed p = parse({"--rdzv-backed", "c10d", "prog"});
  EXPECT_EQ(p.code, 2);
  EXPECT_NE(p.err.find("unknown option --rdzv-backed (did you mean --rdzv-backend?)"),
            std::string::npos)
      << p.err;
  const Parsed q = parse({"--nproc_per_nod=2", "prog"});
  EXPECT_EQ(q.code, 2);
  EXPECT_NE(q.err.find("did you mean --nproc_per_node?"), std::string::npos) << q.err;
  const Parsed far = parse({"--frobnicate", "prog"});
  EXPECT_EQ(far.code, 2);
  EXPECT_NE(far.err.find("unknown option --frobnicate"), std::string::npos) << far.err;
  EXPECT_EQ(far.err.find("did you mean"), std::string::npos) << far.err;
}

TEST(LaunchOptions, WhatACxxLauncherCannotDoIsRefusedWithTheReason) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"-m", "pkg.train"}, "python3 -u -m MODULE"},
      {{"--run-path", "/abs/train.py"}, "python3 -u SCRIPT"},
      {{"--logs-specs", "mine", "prog"}, "Python entry point"},
      {{"--rdzv-backend", "etcd", "prog"}, "needs an etcd server"},
      {{"--rdzv-backend", "zk", "prog"}, "expected static or c10d"},
      {{"--standalone", "--nnodes", "2", "prog"}, "this node only"},
      {{"--start-method", "thread", "prog"}, "--start-method"},
      {{"--redirects", "4", "prog"}, "--redirects/--tee"},
      {{"--local-ranks-filter", "0,x", "prog"}, "comma-separated list of integers"},
      {{"--nproc-per-node", "many", "prog"}, "expected N (1-9999), auto, cpu or gpu"},
      {{"--nnodes", "3:2", "prog"}, "MIN:MAX"},
      {{"--nnodes", "2", "--node-rank", "2", "prog"}, "--node-rank 2 is not below"},
  };
  for (const auto& [args, why] : cases) {
    const Parsed p = parse(args);
    EXPECT_EQ(p.code, 2) << args[0];
    EXPECT_NE(p.err.find(why), std::string::npos) << args[0] << ": " << p.err;
  }
}

TEST(LaunchOptions, NprocPerNodeAutoCpuGpuAsTorchrunDecides) {
  const int cpus = static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN));
  const int gpus = fsdp_run::gpu_count();
  const Parsed cpu = parse({"--nproc-per-node", "cpu", "prog"});
  ASSERT_EQ(cpu.code, -1) << cpu.err;
  EXPECT_EQ(cpu.o.nproc, cpus);
  const Parsed aut = parse({"--nproc-per-node", "auto", "prog"});
  ASSERT_EQ(aut.code, -1) << aut.err;
  EXPECT_EQ(aut.o.nproc, gpus > 0 ? gpus : cpus);
  const Parsed gpu = parse({"--nproc-per-node", "gpu", "prog"});
  if (gpus > 0) {
    EXPECT_EQ(gpu.o.nproc, gpus);
  } else {
    EXPECT_EQ(gpu.code, 2);
    EXPECT_NE(gpu.err.find("--nproc-per-node gpu: CUDA is not available"), std::string::npos)
        << gpu.err;
  }
}

TEST(LaunchOptions, TheJobsStoreIsWhereTorchrunPutsIt) {
  const Parsed st = parse({"--nnodes", "2", "prog"});
  EXPECT_EQ(st.o.store_host + ":" + std::to_string(st.o.store_port), "127.0.0.1:29500");
  EXPECT_EQ(st.o.node_rank, 0);  // static: torchrun's default node rank
  const Parsed named =
      parse({"--nnodes", "2", "--master-addr", "node0", "--master-port", "7", "p"});
  EXPECT_EQ(named.o.store_host + ":" + std::to_string(named.o.store_port), "node0:7");
  const Parsed c10d =
      parse({"--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0", "prog"});
  EXPECT_EQ(c10d.o.store_host + ":" + std::to_string(c10d.o.store_port), "node0:29400");
  EXPECT_EQ(c10d.o.node_rank, -1);  // c10d: the rendezvous assigns node ranks
  const Parsed local = parse({"--nnodes", "2", "--rdzv-backend", "c10d", "prog"});
  EXPECT_EQ(local.o.store_host + ":" + std::to_string(local.o.store_port), "localhost:29400");
  const Parsed v6 =
      parse({"--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "[::1]:5000", "prog"});
  EXPECT_EQ(v6.o.store_host + ":" + std::to_string(v6.o.store_port), "::1:5000");
  const Parsed bad =
      parse({"--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:x", "prog"});
  EXPECT_EQ(bad.code, 2);
  // One node: fsdp-run hosts its ranks' store at a port the kernel picks as it binds (0 here);
  // --standalone is that too.
  for (const auto& args : {std::vector<std::string>{"prog"},
                           std::vector<std::string>{"--standalone", "--rdzv-id", "x", "prog"}}) {
    const Parsed one = parse(args);
    ASSERT_EQ(one.code, -1) << one.err;
    EXPECT_FALSE(one.o.multi_node());
    EXPECT_EQ(one.o.store_port, 0);
    EXPECT_FALSE(one.o.port_chosen);
  }
}

TEST(LaunchOptions, TheHeartbeatBoundsComeFromKeepAliveOrHeartbeatTimeout) {
  const Parsed d = parse({"--nnodes", "2", "prog"});
  EXPECT_EQ(d.o.keep_alive, 5);   // torchrun's keep_alive_interval
  EXPECT_EQ(d.o.lost_after, 15);  // x keep_alive_max_attempt (3)
  const Parsed h = parse({"--nnodes", "2", "--heartbeat-timeout", "3", "prog"});
  EXPECT_EQ(h.o.lost_after, 3);
  EXPECT_EQ(h.o.keep_alive, 1);  // several heartbeats within the bound
}

TEST(LaunchOptions, NearestOptionByEditDistance) {
  const std::vector<std::string> known = {"--nnodes", "--node-rank", "--rdzv-id"};
  EXPECT_EQ(fsdp_run::nearest("--nnode", known), "--nnodes");
  EXPECT_EQ(fsdp_run::nearest("--node_rank", known), "--node-rank");
  EXPECT_EQ(fsdp_run::nearest("--zzzzzzz", known), "");
}

}  // namespace
