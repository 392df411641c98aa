// fsdp-run, the launcher (issue 12), run as a user runs it, with small shell programs as ranks:
// torchrun's variables, rank-prefixed whole lines, a dying rank stopping the others (SIGTERM,
// then SIGKILL after the grace period) with a non-zero exit naming it, SIGINT forwarded, and bad
// usage answered with one line. Across nodes (issue 40; two launchers on loopback): the job's
// store hosted by node 0's launcher, a failure on any node stopping every node, the join's checks
// and time limit, and a lost node. fsdp-train's tests run real Gloo programs under it.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <iterator>

#include <memory>
#include <set>
#include <thread>

#include "command_testing.h"
#include "multi_rank.h"

namespace {

using fsdp::testing::Background;
using fsdp::testing::count_lines_with;
using fsdp::testing::run_shell;

const std::string kRun = FSDP_RUN_BIN;

TEST(FsdpRun, GivesEachRankTorchrunsVariablesAndPrefixesItsLines) {
  const auto r = run_shell(kRun +
                           " --nproc-per-node 3 sh -c 'echo \"vars $RANK $LOCAL_RANK $WORLD_SIZE "
                           "$LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR $MASTER_PORT\"; "
                           "echo to-stderr >&2; printf no-newline'");
  ASSERT_EQ(r.rc, 0) << r.out;
  std::set<std::string> ports;
  for (int rank = 0; rank < 3; ++rank) {
    const std::string want = "[r" + std::to_string(rank) + "] vars " + std::to_string(rank) + " " +
                             std::to_string(rank) + " 3 3 0 127.0.0.1 ";
    const size_t at = r.out.find(want);
    ASSERT_NE(at, std::string::npos) << want << "\n" << r.out;
    ports.insert(r.out.substr(at + want.size(), r.out.find('\n', at) - at - want.size()));
    const std::string prefix = "[r" + std::to_string(rank) + "] ";
    EXPECT_EQ(count_lines_with(r.out, prefix + "to-stderr"), 1) << r.out;
    EXPECT_EQ(count_lines_with(r.out, prefix + "no-newline"), 1) << "a last partial line\n"
                                                                 << r.out;
  }
  ASSERT_EQ(ports.size(), 1u) << "every rank must get the same MASTER_PORT\n" << r.out;
  EXPECT_GT(std::stoi(*ports.begin()), 0);
}

// Waits up to a minute for a line of `b`'s output that contains `text`.
bool wait_for_line(Background& b, const std::string& text) {
  for (int k = 0; k < 600; ++k) {
    if (count_lines_with(b.output(), text) > 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

// Two launchers of one job on loopback, as on two hosts: node 0's hosts the job's store.
struct TwoNodes {
  fsdp::testing::TempDir dir;
  std::string port = std::to_string(fsdp::testing::free_port());
  std::unique_ptr<Background> node[2];

  // `args` go to each fsdp-run before PROGRAM; `program[i]` is node i's.
  void start(const std::string& args, const std::string (&program)[2]) {
    for (int i = 0; i < 2; ++i) {
      node[i] = std::make_unique<Background>(kRun + " --nnodes 2 --node-rank " + std::to_string(i) +
                                                 " --master-addr 127.0.0.1 --master-port " + port +
                                                 " " + args + " " + program[i],
                                             dir.file("node" + std::to_string(i) + ".log"));
    }
  }
  std::string output(int i) const { return node[i]->output(); }
};

// Node 1 of 2: global ranks 2 and 3; every rank gets the store that node 0's launcher hosts, as a
// client (TORCHELASTIC_USE_AGENT_STORE=True), and the same run id; no prefixes when asked.
TEST(FsdpRunNodes, RanksGetGlobalNumbersAndTheLaunchersStore) {
  TwoNodes job;
  const std::string vars =
      "sh -c 'echo \"$RANK/$WORLD_SIZE $LOCAL_RANK/$LOCAL_WORLD_SIZE $GROUP_RANK "
      "$MASTER_ADDR:$MASTER_PORT agent=$TORCHELASTIC_USE_AGENT_STORE "
      "restarts=$TORCHELASTIC_RESTART_COUNT run=$TORCHELASTIC_RUN_ID\"'";
  job.start("--nproc-per-node 2 --no-prefix", {vars, vars});
  for (int i = 0; i < 2; ++i)
    ASSERT_EQ(job.node[i]->wait(std::chrono::seconds(60)), 0) << job.output(i);
  const std::string out0 = job.output(0), out1 = job.output(1);
  const std::string where = " 127.0.0.1:" + job.port + " agent=True restarts=0 run=";
  EXPECT_EQ(count_lines_with(out0, "0/4 0/2 0" + where), 1) << out0;
  EXPECT_EQ(count_lines_with(out0, "1/4 1/2 0" + where), 1) << out0;
  EXPECT_EQ(count_lines_with(out1, "2/4 0/2 1" + where), 1) << out1;
  EXPECT_EQ(count_lines_with(out1, "3/4 1/2 1" + where), 1) << out1;
  EXPECT_EQ(count_lines_with(out1, "[r"), 0) << out1;
  const auto run_id = [](const std::string& out) {
    const size_t at = out.find("run=");
    return at == std::string::npos ? std::string()
                                   : out.substr(at + 4, out.find('\n', at) - at - 4);
  };
  EXPECT_EQ(run_id(out0).size(), 16u) << out0;
  EXPECT_EQ(run_id(out0), run_id(out1)) << "every node must hand its ranks node 0's run id";
}

// A rank failing on one node stops every node's ranks within seconds (the others sleep 60 s),
// and both launchers exit with its code, naming its node and rank: node 1's rank 3 exits 3; then
// node 0's rank 0 (the store's own host) dies of SIGKILL.
TEST(FsdpRunNodes, AFailureOnAnyNodeStopsEveryNode) {
  const std::string sleeper = "sh -c 'sleep 60'";
  {
    TwoNodes job;
    job.start("--nproc-per-node 2 --grace-period 1",
              {sleeper, "sh -c '[ $RANK = 3 ] && { sleep 1; exit 3; }; sleep 60'"});
    for (int i = 0; i < 2; ++i) {
      EXPECT_EQ(job.node[i]->wait(std::chrono::seconds(20)), 3) << job.output(i);
      EXPECT_NE(job.output(i).find("rank 3 (local rank 1) on node 1 ("), std::string::npos)
          << job.output(i);
      EXPECT_NE(job.output(i).find("exited with code 3"), std::string::npos) << job.output(i);
    }
    EXPECT_NE(job.output(0).find("; stopping this node's ranks"), std::string::npos)
        << job.output(0);
  }
  {
    TwoNodes job;
    job.start("--nproc-per-node 1 --grace-period 1", {"sh -c 'sleep 1; kill -9 $$'", sleeper});
    for (int i = 0; i < 2; ++i) {
      EXPECT_EQ(job.node[i]->wait(std::chrono::seconds(20)), 128 + 9) << job.output(i);
      EXPECT_NE(job.output(i).find("rank 0 (local rank 0) on node 0 ("), std::string::npos)
          << job.output(i);
      EXPECT_NE(job.output(i).find("was killed by signal 9 (SIGKILL)"), std::string::npos)
          << job.output(i);
    }
  }
}

// Launchers that disagree on the job's shape, or claim the same node rank, stop at once, before
// any rank starts; a node that never comes ends the join after --join-timeout, naming it.
TEST(FsdpRunNodes, TheJoinChecksTheJobsShapeAndWaitsBoundedly) {
  const std::string echo = "sh -c 'echo started'";
  {
    TwoNodes job;
    job.node[0] = std::make_unique<Background>(kRun + " --nnodes 2 --node-rank 0 --master-port " +
                                                   job.port + " --nproc-per-node 2 " + echo,
                                               job.dir.file("node0.log"));
    job.node[1] = std::make_unique<Background>(kRun + " --nnodes 2 --node-rank 1 --master-port " +
                                                   job.port + " --nproc-per-node 1 " + echo,
                                               job.dir.file("node1.log"));
    for (int i = 0; i < 2; ++i) {
      EXPECT_EQ(job.node[i]->wait(std::chrono::seconds(30)), 2) << job.output(i);
      EXPECT_NE(job.output(i).find("node 1 was started with --nnodes 2 --nproc-per-node 1 "
                                   "--max-restarts 0 but node 0 with --nnodes 2 "
                                   "--nproc-per-node 2 --max-restarts 0"),
                std::string::npos)
          << job.output(i);
      EXPECT_EQ(count_lines_with(job.output(i), "] started"), 0) << job.output(i);
    }
  }
  {
    TwoNodes job;
    job.node[0] = std::make_unique<Background>(
        kRun + " --nnodes 3 --node-rank 0 --master-port " + job.port + " --join-timeout 20 " + echo,
        job.dir.file("node0.log"));
    job.node[1] = std::make_unique<Background>(
        kRun + " --nnodes 3 --node-rank 1 --master-port " + job.port + " " + echo,
        job.dir.file("node1.log"));
    Background again(kRun + " --nnodes 3 --node-rank 1 --master-port " + job.port + " " + echo,
                     job.dir.file("node1b.log"));
    EXPECT_EQ(job.node[0]->wait(std::chrono::seconds(30)), 2) << job.output(0);
    EXPECT_NE(job.output(0).find("two launchers were started with --node-rank 1"),
              std::string::npos)
        << job.output(0);
  }
  {
    TwoNodes job;
    job.node[0] = std::make_unique<Background>(
        kRun + " --nnodes 2 --node-rank 0 --master-port " + job.port + " --join-timeout 2 " + echo,
        job.dir.file("node0.log"));
    EXPECT_EQ(job.node[0]->wait(std::chrono::seconds(30)), 2) << job.output(0);
    EXPECT_NE(job.output(0).find("node rank(s) 1 did not join within 2 s (--join-timeout)"),
              std::string::npos)
        << job.output(0);
  }
}

// Across nodes every launcher agrees on a restart: node 1's rank fails in the first round only,
// a second after node 0's rank has succeeded, and both nodes' ranks run again, under the same run
// id, and succeed (a node whose ranks succeeded still restarts when the round failed elsewhere).
TEST(FsdpRunNodes, EveryNodeRestartsTogether) {
  TwoNodes job;
  const std::string program =
      "sh -c 'echo \"round $TORCHELASTIC_RESTART_COUNT run $TORCHELASTIC_RUN_ID\"; "
      "[ $RANK = 1 ] && [ $TORCHELASTIC_RESTART_COUNT = 0 ] && { sleep 1; exit 3; }; exit 0'";
  job.start("--nproc-per-node 1 --max-restarts 2", {program, program});
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(job.node[i]->wait(std::chrono::seconds(60)), 0) << job.output(i);
    EXPECT_EQ(count_lines_with(job.output(i), "] round 0 run "), 1) << job.output(i);
    EXPECT_EQ(count_lines_with(job.output(i), "] round 1 run "), 1) << job.output(i);
    EXPECT_EQ(count_lines_with(job.output(i), "fsdp-run: restart 1: every node has rejoined"), 1)
        << job.output(i);
  }
  EXPECT_NE(job.output(0).find("rank 1 (local rank 0) on node 1 ("), std::string::npos)
      << job.output(0);
}

// Each case loses a node after the round formed (every rank has said "started"), not during the
// join (FsdpRunNodes.ALauncherLostWhileTheJobForms*): a launcher that stops answering (SIGSTOP:
// a hung host) is lost after --heartbeat-timeout, and the job fails on node 0, naming it; a lost
// node 0 (its launcher killed, and so the store) is noticed by node 1, which stops its ranks and
// names it; so is a hung node 0, by its silence. Waiting for "started" makes the cases hold on a
// loaded machine, where a fixed 2 s once fell before the round had formed (issue 62, item 9).
TEST(FsdpRunNodes, ALostNodeEndsTheJobAfterTheRoundFormed) {
  const std::string sleeper = "sh -c 'echo started; sleep 60'";
  auto started = [](TwoNodes& job) {
    for (int k = 0; k < 600; ++k) {
      if (count_lines_with(job.output(0), "] started") == 1 &&
          count_lines_with(job.output(1), "] started") == 1)
        return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return false;
  };
  {
    TwoNodes job;
    job.start("--nproc-per-node 1 --grace-period 1 --heartbeat-timeout 2", {sleeper, sleeper});
    ASSERT_TRUE(started(job)) << job.output(0) << job.output(1);
    ::kill(job.node[1]->pid(), SIGSTOP);
    EXPECT_EQ(job.node[0]->wait(std::chrono::seconds(30)), 1) << job.output(0);
    // Node 0 names node 1; unless node 1 stopped in the middle of a request to the store, which
    // on LibTorch 1.13 stalls the store's one daemon thread (it reads a request to its end):
    // then node 0, which hosts it, sees its store silent and ends the job on that, within the
    // same bound (1 run in 14 beside a build, before node 1 stopped watching node 0's heartbeat).
    const bool named =
        job.output(0).find("node 1 (") != std::string::npos &&
        job.output(0).find(") stopped answering: its launcher sent no heartbeat for ") !=
            std::string::npos;
    const bool stalled = job.output(0).find("has not answered for") != std::string::npos;
    EXPECT_TRUE(named || stalled) << job.output(0);
    ::kill(job.node[1]->pid(), SIGKILL);
    ::kill(job.node[1]->pid(), SIGCONT);
  }
  {
    TwoNodes job;
    job.start("--nproc-per-node 1 --grace-period 1", {sleeper, sleeper});
    ASSERT_TRUE(started(job)) << job.output(0) << job.output(1);
    ::kill(job.node[0]->pid(), SIGKILL);
    EXPECT_EQ(job.node[1]->wait(std::chrono::seconds(30)), 1) << job.output(1);
    EXPECT_NE(job.output(1).find("lost the job's store at 127.0.0.1:" + job.port),
              std::string::npos)
        << job.output(1);
  }
  {
    // Node 0 hung (SIGSTOP): its store accepts and never answers; node 1 notices the silence.
    TwoNodes job;
    job.start("--nproc-per-node 1 --grace-period 1 --heartbeat-timeout 2", {sleeper, sleeper});
    ASSERT_TRUE(started(job)) << job.output(0) << job.output(1);
    ::kill(job.node[0]->pid(), SIGSTOP);
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_EQ(job.node[1]->wait(std::chrono::seconds(30)), 1) << job.output(1);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(8)) << job.output(1);
    EXPECT_NE(job.output(1).find("the job's store at 127.0.0.1:" + job.port +
                                 " has not answered for 2 s"),
              std::string::npos)
        << job.output(1);
    ::kill(job.node[0]->pid(), SIGKILL);
    ::kill(job.node[0]->pid(), SIGCONT);
  }
}

// A launcher killed while the job forms (torchrun's keep-alive, at its defaults: a heartbeat
// every 5 s, lost after 3 missed): node 0 of a job of fixed size logs the loss within 15 s of the
// kill, naming the node, and exits non-zero within 20 s, instead of waiting out --join-timeout
// (600 s). Without the heartbeat while the job forms, node 0 waited for node 1 until then.
TEST(FsdpRunNodes, ALauncherLostWhileTheJobFormsEndsAJobOfFixedSize) {
  fsdp::testing::TempDir dir;
  const std::string port = std::to_string(fsdp::testing::free_port());
  auto launch = [&](int i) {
    return std::make_unique<Background>(kRun + " --nnodes 3 --node-rank " + std::to_string(i) +
                                            " --master-addr 127.0.0.1 --master-port " + port +
                                            " --grace-period 1 --status-interval 0.5 echo started",
                                        dir.file("node" + std::to_string(i) + ".log"));
  };
  auto node0 = launch(0), node1 = launch(1);
  // Node 1 has joined once node 0's line on whom it waits for counts it (a fixed pause was not
  // enough for a launcher's start-up beside a build).
  ASSERT_TRUE(wait_for_line(*node0, "joined (nodes 0,1)")) << node0->output();
  ::kill(node1->pid(), SIGKILL);
  const auto t0 = std::chrono::steady_clock::now();
  double logged = -1;
  for (int k = 0; k < 250 && logged < 0; ++k) {
    if (node0->output().find("was lost while the job formed") != std::string::npos)
      logged = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    else
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_GE(logged, 0) << node0->output();
  EXPECT_LE(logged, 15.5) << node0->output();  // 15 s, and this loop's own 0.1 s steps
  const int rc = node0->wait(std::chrono::seconds(20));
  const double ended = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(rc, 2) << node0->output();
  EXPECT_LE(ended, 20.0) << node0->output();
  EXPECT_NE(node0->output().find("node 1 ("), std::string::npos) << node0->output();
  EXPECT_EQ(count_lines_with(node0->output(), "] started"), 0) << node0->output();
  std::printf("launcher killed while the job formed: loss logged after %.1f s, exit after %.1f s\n",
              logged, ended);
}

// The same loss in an elastic job that still has MIN nodes: the round forms without the lost
// node, once its last call is over (a quicker heartbeat here, 1 s x 3; --nnodes 2:4, so that the
// three that join do not close the round at once).
TEST(FsdpRunNodes, ALauncherLostWhileTheJobFormsIsLeftOutOfAnElasticRound) {
  fsdp::testing::TempDir dir;
  const std::string port = std::to_string(fsdp::testing::free_port());
  std::unique_ptr<Background> node[3];
  for (int i = 0; i < 3; ++i)
    node[i] = std::make_unique<Background>(
        kRun + " --nnodes 2:4 --node-rank " + std::to_string(i) +
            " --master-addr 127.0.0.1 --master-port " + port +
            " --rdzv-conf keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=8 "
            "--grace-period 1 --status-interval 0.5 sh -c 'echo \"start world $WORLD_SIZE\"'",
        dir.file("node" + std::to_string(i) + ".log"));
  ASSERT_TRUE(wait_for_line(*node[0], "joined (nodes 0,1,2)")) << node[0]->output();
  ::kill(node[2]->pid(), SIGKILL);
  for (int i : {0, 1}) EXPECT_EQ(node[i]->wait(std::chrono::seconds(40)), 0) << node[i]->output();
  EXPECT_NE(node[0]->output().find("node 2 ("), std::string::npos) << node[0]->output();
  EXPECT_NE(node[0]->output().find("was lost while the job formed"), std::string::npos)
      << node[0]->output();
  EXPECT_NE(node[0]->output().find("round 0 formed with nodes 0,1 (2 of --nnodes 2:4)"),
            std::string::npos)
      << node[0]->output();
  EXPECT_EQ(count_lines_with(node[1]->output(), "] start world 2"), 1) << node[1]->output();
}

// The store's host lost while the job forms (torchrun: the others' rendezvous calls fail): killed,
// its store's connections close and node 1 stops at once, naming the store; hung (SIGSTOP), its
// store answers nothing and node 1 stops after --heartbeat-timeout of silence, naming it.
TEST(FsdpRunNodes, TheStoresHostLostWhileTheJobFormsEndsTheJoin) {
  for (const int sig : {SIGKILL, SIGSTOP}) {
    fsdp::testing::TempDir dir;
    const std::string port = std::to_string(fsdp::testing::free_port());
    auto launch = [&](int i) {
      return std::make_unique<Background>(
          kRun + " --nnodes 3 --node-rank " + std::to_string(i) +
              " --master-addr 127.0.0.1 --master-port " + port +
              " --heartbeat-timeout 2 --status-interval 0.5 echo started",
          dir.file("node" + std::to_string(i) + ".log"));
    };
    auto node0 = launch(0);
    auto node1 = launch(1);
    ASSERT_TRUE(wait_for_line(*node1, "joined (nodes 0,1)")) << node1->output();
    ::kill(node0->pid(), sig);
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_EQ(node1->wait(std::chrono::seconds(20)), 2) << node1->output();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(sig == SIGKILL ? 3 : 6))
        << node1->output();
    EXPECT_NE(node1->output().find("the job's store at 127.0.0.1:" + port), std::string::npos)
        << node1->output();
    ::kill(node0->pid(), SIGKILL);
    ::kill(node0->pid(), SIGCONT);
  }
}

// torchrun's c10d spelling: no --node-rank, the store at --rdzv-endpoint, hosted by whichever
// launcher on that machine comes first (the other joins it), node ranks in order of arrival; the
// underscore forms on one of the launchers.
TEST(FsdpRunNodes, TorchrunsC10dRendezvousWithoutNodeRanks) {
  fsdp::testing::TempDir dir;
  const std::string port = std::to_string(fsdp::testing::free_port());
  const std::string vars =
      "sh -c 'echo \"rank $RANK/$WORLD_SIZE group $GROUP_RANK run "
      "$TORCHELASTIC_RUN_ID at $MASTER_ADDR:$MASTER_PORT\"'";
  Background a(kRun +
                   " --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint "
                   "127.0.0.1:" +
                   port + " --rdzv-id job42 " + vars,
               dir.file("a.log"));
  Background b(kRun +
                   " --nnodes=2 --nproc_per_node=2 --rdzv_backend=c10d "
                   "--rdzv_endpoint=127.0.0.1:" +
                   port + " --rdzv_id=job42 " + vars,
               dir.file("b.log"));
  ASSERT_EQ(a.wait(std::chrono::seconds(60)), 0) << a.output();
  ASSERT_EQ(b.wait(std::chrono::seconds(60)), 0) << b.output();
  const std::string both = a.output() + b.output();
  for (int r = 0; r < 4; ++r)
    EXPECT_EQ(count_lines_with(both, "] rank " + std::to_string(r) + "/4 group " +
                                         std::to_string(r / 2) + " run job42 at 127.0.0.1:" + port),
              1)
        << both;
}

// torchrun's --log-dir, --redirects and --tee: each local rank's streams in
// DIR/<run id>_<8 characters>/attempt_<restart>/<local rank>/std{out,err}.log, teed to the console
// or (redirected) not, --local-ranks-filter keeping a rank off the console, and
// TORCHELASTIC_ERROR_FILE beside them.
TEST(FsdpRun, LogDirKeepsEachRanksStreamsWhereTorchrunDoes) {
  fsdp::testing::TempDir dir;
  const std::string program =
      "sh -c 'echo \"out $RANK\"; echo \"err $RANK\" >&2; echo \"file $TORCHELASTIC_ERROR_FILE\"'";
  auto run = [&](const std::string& logs, const std::string& args) {
    return run_shell(kRun + " --nproc-per-node 2 --rdzv-id myjob --log-dir " + dir.file(logs) +
                     " " + args + " " + program);
  };
  auto read = [](const std::string& path) {
    std::ifstream f(path);
    return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  };
  auto run_dir = [&](const std::string& logs) {
    const auto r = run_shell("ls -d " + dir.file(logs) + "/myjob_*");
    return r.out.substr(0, r.out.find('\n'));
  };
  const auto tee = run("tee", "--redirects 3 --tee 3");
  ASSERT_EQ(tee.rc, 0) << tee.out;
  const std::string d = run_dir("tee");
  ASSERT_EQ(d.size(), dir.file("tee").size() + std::string("/myjob_").size() + 8) << d;
  EXPECT_NE(tee.out.find("fsdp-run: log directory set to: " + d), std::string::npos) << tee.out;
  for (int r = 0; r < 2; ++r) {
    const std::string at = d + "/attempt_0/" + std::to_string(r);
    EXPECT_EQ(read(at + "/stdout.log"),
              "out " + std::to_string(r) + "\nfile " + at + "/error.json\n");
    EXPECT_EQ(read(at + "/stderr.log"), "err " + std::to_string(r) + "\n");
    EXPECT_EQ(count_lines_with(tee.out, "[r" + std::to_string(r) + "] out " + std::to_string(r)), 1)
        << tee.out;
  }
  const auto quiet = run("quiet", "--redirects 3");  // to the files only
  ASSERT_EQ(quiet.rc, 0) << quiet.out;
  EXPECT_EQ(count_lines_with(quiet.out, "] out "), 0) << quiet.out;
  EXPECT_EQ(read(run_dir("quiet") + "/attempt_0/1/stderr.log"), "err 1\n");
  const auto some = run("some", "--redirects 0:1 --local-ranks-filter 1");
  ASSERT_EQ(some.rc, 0) << some.out;
  EXPECT_EQ(count_lines_with(some.out, "[r0] "), 0) << some.out;  // filtered
  EXPECT_EQ(count_lines_with(some.out, "[r1] out 1"), 1) << some.out;
  EXPECT_EQ(read(run_dir("some") + "/attempt_0/0/stdout.log").substr(0, 6), "out 0\n");
  EXPECT_EQ(read(run_dir("some") + "/attempt_0/1/stdout.log"), "");  // not redirected
}

// --nnodes MIN:MAX (issue 41): three launchers of a 2:3 job. Round 0 has all three; node 2's
// launcher stopped (a hung host) is noticed by its silence, and the next round forms with nodes 0
// and 1, numbered densely (world size 2); a launcher started again on node rank 2 waits for the
// next round, and node 0 ends the running one to take it back (a membership change, which the
// used-up --max-restarts 1 does not count): the third round has all three again. The hung
// launcher, when it wakes up, leaves without disturbing them.
TEST(FsdpRunNodes, ElasticRoundsShrinkAndGrowBack) {
  fsdp::testing::TempDir dir;
  const std::string port = std::to_string(fsdp::testing::free_port());
  const std::string finish = dir.file("finish");
  const std::string program =
      "sh -c 'echo \"start $TORCHELASTIC_RESTART_COUNT world $WORLD_SIZE rank $RANK group "
      "$GROUP_RANK of $GROUP_WORLD_SIZE\"; while [ ! -e " +
      finish + " ]; do sleep 0.1; done'";
  std::unique_ptr<Background> node[3];
  auto launch = [&](int i, const std::string& log) {
    node[i] = std::make_unique<Background>(
        kRun + " --nnodes 2:3 --node-rank " + std::to_string(i) +
            " --master-addr 127.0.0.1 --master-port " + port +
            " --nproc-per-node 1 --max-restarts 1 --heartbeat-timeout 2 --last-call-timeout 1 "
            "--grace-period 1 " +
            program,
        dir.file(log));
  };
  auto wait_for = [&](int i, const std::string& text, int times = 1) {
    for (int k = 0; k < 300 && count_lines_with(node[i]->output(), text) < times; ++k)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    return count_lines_with(node[i]->output(), text) >= times;
  };
  for (int i = 0; i < 3; ++i) launch(i, "node" + std::to_string(i) + ".log");
  for (int i = 0; i < 3; ++i)
    ASSERT_TRUE(wait_for(
        i, "] start 0 world 3 rank " + std::to_string(i) + " group " + std::to_string(i) + " of 3"))
        << node[i]->output();

  ::kill(node[2]->pid(), SIGSTOP);  // the host hangs
  std::unique_ptr<Background> hung = std::move(node[2]);
  ASSERT_TRUE(wait_for(1, "] start 1 world 2 rank 1 group 1 of 2")) << node[1]->output();
  ASSERT_TRUE(wait_for(0, "] start 1 world 2 rank 0 group 0 of 2")) << node[0]->output();
  EXPECT_NE(node[0]->output().find("node 2 ("), std::string::npos) << node[0]->output();
  EXPECT_NE(node[0]->output().find(") stopped answering"), std::string::npos) << node[0]->output();
  EXPECT_EQ(count_lines_with(node[1]->output(),
                             "fsdp-run: round 1 formed with nodes 0,1 (2 of --nnodes 2:3): node 1 "
                             "is group rank 1, ranks 1-1 of 2"),
            1)
      << node[1]->output();

  launch(2, "node2-again.log");  // node rank 2 is free again: node 0 gave it up
  for (int i = 0; i < 3; ++i)
    ASSERT_TRUE(wait_for(
        i, "] start 2 world 3 rank " + std::to_string(i) + " group " + std::to_string(i) + " of 3"))
        << node[i]->output();
  EXPECT_NE(node[0]->output().find("node 2 ("), std::string::npos);
  for (int i = 0; i < 2; ++i)
    EXPECT_EQ(count_lines_with(node[i]->output(),
                               "restarting every rank for the membership change (--max-restarts "
                               "does not count it), TORCHELASTIC_RESTART_COUNT=2"),
              1)
        << node[i]->output();
  EXPECT_NE(node[0]->output().find(" waiting to join: every node stops its ranks"),
            std::string::npos)
      << node[0]->output();

  ::kill(hung->pid(), SIGCONT);
  EXPECT_NE(hung->wait(std::chrono::seconds(30)), 0) << hung->output();
  std::this_thread::sleep_for(std::chrono::seconds(1));
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(count_lines_with(node[i]->output(), "] start 3 "), 0) << node[i]->output();

  std::ofstream(finish) << "";
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(node[i]->wait(std::chrono::seconds(30)), 0) << node[i]->output();
}

// A launcher stopped with Ctrl-C while it waits for a 2:3 job's round to form takes its join
// back: the round forms with the two nodes that are there (not at once with three when the next
// comes, nor at the last call with one), and their ranks run and end well. Without the
// withdrawal node 0 counted the stopped node in and its ranks were waited for until its
// heartbeat was missed.
TEST(FsdpRunNodes, ALauncherStoppedWhileWaitingTakesItsJoinBack) {
  fsdp::testing::TempDir dir;
  const std::string port = std::to_string(fsdp::testing::free_port());
  std::unique_ptr<Background> node[3];
  auto launch = [&](int i) {
    node[i] = std::make_unique<Background>(
        kRun + " --nnodes 2:3 --node-rank " + std::to_string(i) +
            " --master-addr 127.0.0.1 --master-port " + port +
            " --nproc-per-node 1 --heartbeat-timeout 30 --last-call-timeout 4 --grace-period 1 "
            "sh -c 'echo \"start world $WORLD_SIZE group $GROUP_RANK of $GROUP_WORLD_SIZE\"'",
        dir.file("node" + std::to_string(i) + ".log"));
  };
  launch(0);
  launch(2);
  // Node 2 has joined (the store answers within milliseconds); with node 0 that is MIN, and the
  // last call has begun.
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  ::kill(node[2]->pid(), SIGINT);
  EXPECT_EQ(node[2]->wait(std::chrono::seconds(10)), 128 + SIGINT) << node[2]->output();
  EXPECT_NE(node[2]->output().find("stopped by signal 2 while waiting for the other nodes"),
            std::string::npos)
      << node[2]->output();
  launch(1);
  for (int i : {0, 1}) EXPECT_EQ(node[i]->wait(std::chrono::seconds(30)), 0) << node[i]->output();
  EXPECT_EQ(
      count_lines_with(node[0]->output(), "round 0 formed with nodes 0,1 (2 of --nnodes 2:3)"), 1)
      << node[0]->output();
  EXPECT_EQ(count_lines_with(node[1]->output(), "] start world 2 group 1 of 2"), 1)
      << node[1]->output();
  EXPECT_EQ(count_lines_with(node[0]->output(), "restart"), 0) << node[0]->output();
}

// On one node fsdp-run hosts its ranks' store itself, bound before any rank starts and kept for
// every restart (issue 62, item 5): rank 0 used to bind a port fsdp-run had found free a moment
// before, a new one per restart, and anything could take it in between. Every rank, rank 1
// included, finds the port listening as it starts, the same port in both rounds, and is the
// store's client. (Before this, rank 1's first connection was refused: nothing listened yet.)
// Rank 1 fails round 0 only once rank 0 has written its line (a marker file says so): otherwise
// fsdp-run may stop rank 0 before it prints, and the count would test the scheduler.
TEST(FsdpRun, TheRanksStoreListensBeforeAnyRankStartsAndStaysForRestarts) {
  fsdp::testing::TempDir dir;
  const std::string marker = dir.file("rank0-printed");
  const auto r = run_shell(
      kRun +
      " --nproc-per-node 2 --max-restarts 1 bash -c 'if exec 3<>/dev/tcp/127.0.0.1/$MASTER_PORT; "
      "then echo \"listening $MASTER_PORT agent=$TORCHELASTIC_USE_AGENT_STORE\"; fi; "
      "[ $RANK = 0 ] && touch " +
      marker +
      "; "
      "if [ $TORCHELASTIC_RESTART_COUNT = 0 ] && [ $RANK = 1 ]; then "
      "i=0; while [ ! -e " +
      marker +
      " ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done; "
      "exit 3; fi; exit 0'");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_EQ(count_lines_with(r.out, "] listening "), 4) << r.out;
  EXPECT_EQ(count_lines_with(r.out, " agent=True"), 4) << r.out;
  std::set<std::string> ports;
  for (size_t at = 0; (at = r.out.find("] listening ", at)) != std::string::npos; ++at)
    ports.insert(r.out.substr(at + 12, r.out.find(' ', at + 12) - at - 12));
  EXPECT_EQ(ports.size(), 1u) << r.out;
}

// Rank 1 dies of SIGKILL; rank 0 ignores SIGTERM (so it takes SIGKILL after the grace period),
// rank 2 stops on SIGTERM. fsdp-run names rank 1 and exits 128 + 9 within seconds, not after the
// 60 s the others would sleep.
TEST(FsdpRun, OneRankDyingStopsTheOthers) {
  const auto r = run_shell(kRun +
                           " --nproc-per-node 3 --grace-period 1 sh -c '"
                           "if [ $RANK = 0 ]; then trap \"echo ignoring TERM\" TERM; fi; "
                           "if [ $RANK = 1 ]; then sleep 0.3; kill -9 $$; fi; "
                           "i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done'");
  EXPECT_EQ(r.rc, 128 + 9) << r.out;
  EXPECT_NE(r.out.find("fsdp-run: failed: rank 1 (local rank 1) was killed by signal 9 (SIGKILL)"),
            std::string::npos)
      << r.out;
  EXPECT_LT(r.seconds, 30) << "the other ranks were not stopped\n" << r.out;

  const auto e = run_shell(kRun + " --nproc-per-node 2 sh -c '[ $RANK = 1 ] && exit 3; exit 0'");
  EXPECT_EQ(e.rc, 3) << e.out;
  EXPECT_NE(e.out.find("rank 1 (local rank 1) exited with code 3"), std::string::npos) << e.out;
  EXPECT_EQ(run_shell(kRun + " --nproc-per-node 2 true").rc, 0);
}

TEST(FsdpRun, ForwardsSigintToEveryRank) {
  fsdp::testing::TempDir dir;
  Background run(kRun +
                     " --nproc-per-node 2 sh -c 'trap \"echo got INT; exit 5\" INT; "
                     "echo ready; while :; do sleep 0.1; done'",
                 dir.file("log"));
  for (int i = 0; i < 100 && count_lines_with(run.output(), "ready") < 2; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_EQ(count_lines_with(run.output(), "ready"), 2) << run.output();
  ::kill(run.pid(), SIGINT);
  EXPECT_EQ(run.wait(std::chrono::seconds(30)), 128 + SIGINT) << run.output();
  EXPECT_EQ(count_lines_with(run.output(), "got INT"), 2) << run.output();
}

// --max-restarts (issue 41): every rank is started again after a failure, with
// TORCHELASTIC_RESTART_COUNT counting; the last failure ends the job once the restarts are used
// up; a signal to fsdp-run is never followed by a restart.
TEST(FsdpRun, MaxRestartsStartsEveryRankAgain) {
  // Rank 1 fails only after rank 0 has printed its line (a marker file says so): otherwise
  // fsdp-run may stop rank 0 before its shell has echoed, and the count below would be a race.
  fsdp::testing::TempDir marks;
  const auto r = run_shell(
      kRun + " --nproc-per-node 2 --max-restarts 2 sh -c 'c=$TORCHELASTIC_RESTART_COUNT; " +
      "echo \"round $c of $TORCHELASTIC_MAX_RESTARTS\"; touch " + marks.file("r") +
      "$RANK-$c; [ $RANK = 1 ] && [ $c -lt 2 ] || exit 0; " + "for i in $(seq 600); do [ -e " +
      marks.file("r") + "0-$c ] && exit 3; sleep 0.05; done; exit 4'");
  EXPECT_EQ(r.rc, 0) << r.out;
  for (int round = 0; round < 3; ++round)
    EXPECT_EQ(count_lines_with(r.out, "round " + std::to_string(round) + " of 2"), 2) << r.out;
  EXPECT_EQ(count_lines_with(r.out, "fsdp-run: restarting every rank: restart "), 2) << r.out;
  EXPECT_EQ(
      count_lines_with(r.out, "restart 2 of 2 (--max-restarts), TORCHELASTIC_RESTART_COUNT=2"), 1)
      << r.out;

  const auto e = run_shell(kRun + " --nproc-per-node 2 --max-restarts 1 sh -c 'exit 3'");
  EXPECT_EQ(e.rc, 3) << e.out;
  EXPECT_EQ(count_lines_with(e.out, "fsdp-run: restarting every rank"), 1) << e.out;
  EXPECT_EQ(count_lines_with(e.out, "fsdp-run: no restarts left (--max-restarts 1)"), 1) << e.out;

  fsdp::testing::TempDir dir;
  Background run(kRun + " --nproc-per-node 2 --max-restarts 3 sh -c 'echo ready; sleep 60'",
                 dir.file("log"));
  for (int i = 0; i < 100 && count_lines_with(run.output(), "ready") < 2; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ::kill(run.pid(), SIGINT);
  EXPECT_EQ(run.wait(std::chrono::seconds(30)), 128 + SIGINT) << run.output();
  EXPECT_EQ(count_lines_with(run.output(), "restarting"), 0) << run.output();
}

TEST(FsdpRun, BadUsageIsOneLine) {
  struct Case {
    std::string args, message;
    int rc;
  } cases[] = {
      {"", "no PROGRAM given", 2},
      {"--bogus true", "unknown option --bogus", 2},
      {"--nnodes 2 --node-rank 2 true", "--node-rank 2 is not below --nnodes 2", 2},
      {"--nnodes 3:2 true", "--nnodes 3:2: expected N or MIN:MAX with 1 <= MIN <= MAX", 2},
      {"--nnodes 0 true", "--nnodes 0: expected N or MIN:MAX", 2},
      {"--nnodes 2:x true", "--nnodes 2:x: expected N or MIN:MAX", 2},
      {"--nnodes 1:3 --node-rank 3 true", "--node-rank 3 is not below MAX of --nnodes 1:3", 2},
      {"--nproc-per-node 0 true", "--nproc-per-node", 2},
      {"--rdzv-backed c10d true", "unknown option --rdzv-backed (did you mean --rdzv-backend?)", 2},
      {"--rdzv-conf last_cal_timeout=3 true",
       "unknown key 'last_cal_timeout' (did you mean last_call_timeout?)", 2},
      {"-m pkg.train", "fsdp-run ... python3 -u -m MODULE", 2},
      {"/nonexistent/program", "cannot run /nonexistent/program", 127},
  };
  for (const auto& c : cases) {
    const auto r = run_shell(kRun + " " + c.args);
    EXPECT_EQ(r.rc, c.rc) << c.args << "\n" << r.out;
    EXPECT_NE(r.out.find(c.message), std::string::npos) << c.args << "\n" << r.out;
  }
  const auto h = run_shell(kRun + " --help");
  EXPECT_EQ(h.rc, 0);
  EXPECT_NE(h.out.find("--nproc-per-node"), std::string::npos) << h.out;
  // Grouped as torchrun's --help groups them.
  size_t at = 0;
  for (const char* group : {"Worker/node size", "Rendezvous", "User-code launch",
                            "Compatible with torch.distributed.launch", "fsdp-run's own"}) {
    const size_t found = h.out.find(group, at);
    EXPECT_NE(found, std::string::npos) << group << "\n" << h.out;
    at = found == std::string::npos ? at : found;
  }
}

}  // namespace
