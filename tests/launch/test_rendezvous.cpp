// The launchers' rendezvous (src/launch/rendezvous.h) without the fsdp-run binary: agents in this
// process (threads) and, where a launcher must die or hang, agent_probe processes. Round
// formation, node ranks claimed in order of arrival, the store hosted by no launcher, restarts
// counted per round, the address chosen for a node's ranks, and the heartbeat while a round
// forms: a launcher lost then fails a job of fixed size within the bound, and an elastic round
// forms without it.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>

#include <chrono>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "command_testing.h"
#include "fsdp/compat_backends.h"
#include "launch/options.h"
#include "launch/rendezvous.h"
#include "multi_rank.h"

namespace {

using fsdp::testing::Background;
using fsdp::testing::count_lines_with;
using fsdp_run::AgentConfig;
using fsdp_run::AgentState;
using fsdp_run::JobAgent;
using fsdp_run::StoreRole;
using Clock = std::chrono::steady_clock;

const std::string kProbe = FSDP_AGENT_PROBE_BIN;

AgentConfig config(int port, int node, int nodes, StoreRole role) {
  AgentConfig c;
  c.min_nodes = c.max_nodes = nodes;
  c.node_rank = node;
  c.store_host = "127.0.0.1";
  c.store_port = port;
  c.store_role = role;
  c.join_timeout = 30;
  c.keep_alive_interval = 0.3;
  c.lost_after = 1.5;
  return c;
}

// Waits up to `limit` for `agent`'s state to satisfy `done`; the last state seen.
AgentState wait_for(JobAgent& agent, const std::function<bool(const AgentState&)>& done,
                    std::chrono::seconds limit = std::chrono::seconds(20)) {
  const auto until = Clock::now() + limit;
  AgentState st = agent.state();
  while (!done(st) && Clock::now() < until) {
    pollfd p{agent.fd(), POLLIN, 0};
    ::poll(&p, 1, 100);
    st = agent.state();
  }
  return st;
}

bool joined(const AgentState& st) { return st.joined || st.join_error; }

TEST(Rendezvous, ThreeNodesFormARoundAndAgreeOnTheRunIdAndTheirAddresses) {
  const int port = fsdp::testing::free_port();
  std::vector<std::unique_ptr<JobAgent>> agents;
  for (int i = 0; i < 3; ++i)
    agents.push_back(std::make_unique<JobAgent>(
        config(port, i, 3, i == 0 ? StoreRole::kHost : StoreRole::kClient)));
  std::set<std::string> run_ids;
  for (int i = 0; i < 3; ++i) {
    const AgentState st = wait_for(*agents[i], joined);
    ASSERT_TRUE(st.joined) << (st.join_error ? *st.join_error : "timed out");
    EXPECT_EQ(st.node_rank, i);
    EXPECT_EQ(st.group_rank, i);
    EXPECT_EQ(st.group_world, 3);
    EXPECT_EQ(st.members, "0,1,2");
    EXPECT_EQ(st.hosts_store, i == 0);
    run_ids.insert(st.run_id);
    ASSERT_TRUE(st.address);
    EXPECT_EQ(st.address->address, "127.0.0.1");
    EXPECT_EQ(st.address->why, "every node of the job is on this host");
  }
  EXPECT_EQ(run_ids.size(), 1u);
}

// c10d without --node-rank: node ranks in order of arrival; every launcher on the endpoint's
// machine tries to host the store and all but the first join it.
TEST(Rendezvous, NodeRanksAreClaimedInOrderOfArrival) {
  const int port = fsdp::testing::free_port();
  std::vector<std::unique_ptr<JobAgent>> agents;
  for (int i = 0; i < 3; ++i)
    agents.push_back(std::make_unique<JobAgent>(config(port, -1, 3, StoreRole::kHostIfFree)));
  std::set<int> ranks;
  int hosts = 0;
  for (auto& a : agents) {
    const AgentState st = wait_for(*a, joined);
    ASSERT_TRUE(st.joined) << (st.join_error ? *st.join_error : "timed out");
    ranks.insert(st.node_rank);
    hosts += st.hosts_store;
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2}));
  EXPECT_EQ(hosts, 1);
  // A fourth launcher finds no node rank left.
  JobAgent extra(config(port, -1, 3, StoreRole::kClient));
  const AgentState st = wait_for(extra, joined);
  ASSERT_TRUE(st.join_error);
  EXPECT_NE(st.join_error->find("every node rank of --nnodes 3 is taken"), std::string::npos)
      << *st.join_error;
}

// The job's store may be a TCPStore that no launcher runs (torchrun's c10d endpoint on a machine
// without a launcher): the launchers form the round as clients, and none waits to leave last.
TEST(Rendezvous, AStoreThatNoLauncherHostsServesTheJob) {
  const int port = fsdp::testing::free_port();
  auto store = fsdp::compat::make_tcp_store("127.0.0.1", static_cast<uint16_t>(port), true, -1,
                                            std::chrono::seconds(30));
  JobAgent a(config(port, -1, 2, StoreRole::kClient)), b(config(port, -1, 2, StoreRole::kClient));
  for (JobAgent* g : {&a, &b}) {
    const AgentState st = wait_for(*g, joined);
    ASSERT_TRUE(st.joined) << (st.join_error ? *st.join_error : "timed out");
    EXPECT_FALSE(st.hosts_store);
  }
  for (JobAgent* g : {&a, &b}) g->report_left();
  for (JobAgent* g : {&a, &b})
    EXPECT_TRUE(wait_for(*g, [](const AgentState& s) { return s.all_left; }).all_left);
}

// A failure on one node ends the round everywhere; after every node has left, the next round
// (a restart) forms with all of them, and nothing of the failed round is read again.
TEST(Rendezvous, AFailureEndsTheRoundEverywhereAndTheNextRoundForms) {
  const int port = fsdp::testing::free_port();
  std::vector<std::unique_ptr<JobAgent>> agents;
  for (int i = 0; i < 2; ++i) {
    AgentConfig c = config(port, i, 2, i == 0 ? StoreRole::kHost : StoreRole::kClient);
    c.max_restarts = 1;
    agents.push_back(std::make_unique<JobAgent>(c));
  }
  for (auto& a : agents) ASSERT_TRUE(wait_for(*a, joined).joined);
  agents[1]->report_failure(3, "rank 1 of node 1 exited with code 3");
  for (auto& a : agents) {
    const AgentState st = wait_for(*a, [](const AgentState& s) { return s.failure.has_value(); });
    ASSERT_TRUE(st.failure);
    EXPECT_EQ(st.failure->node, 1);
    EXPECT_EQ(st.failure->code, 3);
    a->report_left();
  }
  for (auto& a : agents) ASSERT_TRUE(wait_for(*a, [](const AgentState& s) { return s.left; }).left);
  for (auto& a : agents) a->next_round(1);
  for (auto& a : agents) {
    const AgentState st = wait_for(
        *a, [](const AgentState& s) { return (s.joined && s.round == 1) || s.join_error; });
    ASSERT_TRUE(st.joined) << (st.join_error ? *st.join_error : "timed out");
    EXPECT_EQ(st.round, 1);
    EXPECT_FALSE(st.failure) << "round 1 read round 0's failure";
  }
}

// While a round forms, each launcher says now and then whom it waits for.
TEST(Rendezvous, AFormingRoundSaysWhomItWaitsFor) {
  const int port = fsdp::testing::free_port();
  AgentConfig c = config(port, 0, 3, StoreRole::kHost);
  c.status_interval = 0.5;
  JobAgent a(c);
  JobAgent b(config(port, 1, 3, StoreRole::kClient));
  const AgentState st = wait_for(a, [](const AgentState& s) {
    for (const auto& line : s.news)
      if (line.find("2 of --nnodes 3 joined") != std::string::npos) return true;
    return false;
  });
  ASSERT_FALSE(st.news.empty());
  EXPECT_NE(st.news.back().find("fsdp-run: node 0: the job waits: 2 of --nnodes 3 joined (nodes "
                                "0,1); waiting for node rank(s) 2"),
            std::string::npos)
      << st.news.back();
}

// --- launchers that die or hang: agent_probe processes ---

// An agent_probe of the job whose store is at 127.0.0.1:`port` (c10d: --rdzv-endpoint), with a
// heartbeat every 0.3 s and a loss after 1.5 s, as config() gives the agents of this process.
std::string probe(int port, const std::string& args, bool c10d = false,
                  const std::string& conf = "") {
  const std::string where = c10d ? " --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:"
                                 : " --master-addr 127.0.0.1 --master-port ";
  return kProbe + where + std::to_string(port) +
         " --rdzv-conf keep_alive_interval=0.3,keep_alive_max_attempt=5" + conf + " " + args +
         " probe";
}

bool wait_output(Background& b, const std::string& text, int seconds = 20) {
  for (int k = 0; k < seconds * 10 && count_lines_with(b.output(), text) == 0; ++k)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  return count_lines_with(b.output(), text) > 0;
}

// A job of fixed size: a launcher killed while the job forms fails the join for everyone within
// keep_alive_interval x keep_alive_max_attempt (1.5 s here), naming the node, instead of waiting
// out --join-timeout.
TEST(Rendezvous, ALauncherLostWhileTheJobFormsFailsTheJoinNamingIt) {
  fsdp::testing::TempDir dir;
  const int port = fsdp::testing::free_port();
  AgentConfig c = config(port, 0, 3, StoreRole::kHost);
  c.join_timeout = 120;
  JobAgent node0(c);
  Background node1(probe(port, "--nnodes 3 --node-rank 1 --join-timeout 120"),
                   dir.file("node1.log"));
  ASSERT_TRUE(wait_output(node1, "node 1")) << node1.output();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // its first heartbeats counted
  ::kill(node1.pid(), SIGKILL);
  const auto t0 = Clock::now();
  const AgentState st = wait_for(node0, joined, std::chrono::seconds(30));
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  ASSERT_TRUE(st.join_error) << "still waiting";
  EXPECT_NE(st.join_error->find("node 1 ("), std::string::npos) << *st.join_error;
  EXPECT_NE(st.join_error->find(") was lost while the job formed: its launcher sent no heartbeat"),
            std::string::npos)
      << *st.join_error;
  EXPECT_LE(took, 1.5 + 0.5) << *st.join_error;
}

// Elastic: the same loss during the last call, with MIN nodes left: the round forms without it.
TEST(Rendezvous, AnElasticRoundFormsWithoutALauncherLostWhileItFormed) {
  fsdp::testing::TempDir dir;
  const int port = fsdp::testing::free_port();
  AgentConfig c = config(port, 0, 4, StoreRole::kHost);  // 2:4, so that three do not close it
  c.min_nodes = 2;
  c.last_call_timeout = 4;
  JobAgent node0(c);
  const std::string args = "--nnodes 2:4 --last-call-timeout 4 --node-rank ";
  Background node1(probe(port, args + "1"), dir.file("node1.log"));
  Background node2(probe(port, args + "2"), dir.file("node2.log"));
  ASSERT_TRUE(wait_output(node2, "node 2")) << node2.output();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  ::kill(node2.pid(), SIGKILL);
  const AgentState st = wait_for(node0, joined, std::chrono::seconds(30));
  ASSERT_TRUE(st.joined) << (st.join_error ? *st.join_error : "timed out");
  EXPECT_EQ(st.members, "0,1");
  bool said = false;
  for (const auto& line : st.news)
    said |= line.find("node 2 (") != std::string::npos &&
            line.find("was lost while the job formed") != std::string::npos &&
            line.find("the round forms without it") != std::string::npos;
  EXPECT_TRUE(said);
  EXPECT_TRUE(wait_output(node1, "joined round 0 group 1/2 members 0,1")) << node1.output();
}

// Node 0 coordinates; with the store elsewhere (here: hosted by this test), the others notice a
// hung node 0 by its heartbeat while the job forms.
TEST(Rendezvous, AHungNodeZeroIsNoticedByTheOthers) {
  fsdp::testing::TempDir dir;
  const int port = fsdp::testing::free_port();
  auto store = fsdp::compat::make_tcp_store("127.0.0.1", static_cast<uint16_t>(port), true, -1,
                                            std::chrono::seconds(30));
  Background node0(probe(port, "--nnodes 3 --node-rank 0", true, ",is_host=false"),
                   dir.file("node0.log"));
  ASSERT_TRUE(wait_output(node0, "node 0")) << node0.output();
  JobAgent node1(config(port, 1, 3, StoreRole::kClient));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  ::kill(node0.pid(), SIGSTOP);
  const AgentState st = wait_for(node1, joined, std::chrono::seconds(30));
  ::kill(node0.pid(), SIGKILL);
  ::kill(node0.pid(), SIGCONT);
  ASSERT_TRUE(st.join_error) << "still waiting";
  EXPECT_NE(st.join_error->find("node 0 ("), std::string::npos) << *st.join_error;
  EXPECT_NE(st.join_error->find("which forms the rounds, stopped answering"), std::string::npos)
      << *st.join_error;
}

}  // namespace
