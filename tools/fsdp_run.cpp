// fsdp-run: start one process per rank on this node, as PyTorch's torchrun does, with torchrun's
// options (src/launch/options.h; docs/running.md maps each of them).
//
//   fsdp-run --nproc-per-node 2 ./fsdp-train --steps 100
//   fsdp-run --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500
//            --nproc-per-node 4 ./fsdp-train ...            (and --node-rank 1 on node1)
//   fsdp-run --nnodes 2 --rdzv-backend c10d --rdzv-endpoint node0:29400 --nproc-per-node 4 ...
//
// One start of the ranks is a round (src/launch/supervisor.h). With --max-restarts N, a failed job
// is started again (every rank, on every node) at most N times, with TORCHELASTIC_RESTART_COUNT
// counting the restarts, as with torchrun; the program resumes from its latest checkpoint itself.
//
// Across hosts (--nnodes > 1) the launchers meet in the job's TCPStore (src/launch/rendezvous.h),
// as torchrun's agents do: they check that they agree on the job's shape, start their ranks only
// once all have joined (within --join-timeout, watching each other's heartbeats meanwhile), choose
// the address each node's ranks are reached by, and tell each other of the first failure, so that
// a rank failing or dying on any host stops every host's ranks within a second or so. With
// --nnodes MIN:MAX the job is elastic: a round starts once MAX launchers have joined, or MIN have
// and the last call has passed; a lost node fails the round, and the next forms without it; a
// launcher that comes back, or one more up to MAX, is taken in by a membership change.
//
// It links c10d's TCPStore only (no torch/torch.h): it starts in a fraction of a second.
#include <poll.h>
#include <signal.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "launch/local_store.h"
#include "launch/options.h"
#include "launch/rank_output.h"
#include "launch/rendezvous.h"
#include "launch/supervisor.h"

namespace {

using Clock = std::chrono::steady_clock;
using fsdp_run::AgentState;
using fsdp_run::JobAgent;
using fsdp_run::Options;

// Prints what the agent has to say that was not printed yet.
void print_news(const AgentState& st, size_t& printed) {
  for (; printed < st.news.size(); ++printed)
    std::fprintf(stderr, "%s\n", st.news[printed].c_str());
}

// Takes what a formed round says about this node into `o`.
void take_round(Options& o, const AgentState& st) {
  o.run_id = st.run_id;  // every node hands its ranks node 0's
  o.round = st.round;    // later than asked where this node came too late for a round
  o.node_rank = st.node_rank;
  o.group_rank = st.group_rank;
  o.group_world = st.group_world;
  if (st.address) {
    o.node_addr = st.address->address;
    o.node_addr_why = st.address->why;
  }
  if (o.elastic())
    std::fprintf(stderr,
                 "fsdp-run: round %d formed with nodes %s (%d of --nnodes %s): node %d is group "
                 "rank %d, ranks %d-%d of %d\n",
                 o.round, st.members.c_str(), o.group_world, o.nnodes.c_str(), o.node_rank,
                 o.group_rank, o.group_rank * o.nproc, (o.group_rank + 1) * o.nproc - 1, o.world());
}

// Across hosts: waits, still answering signals, until every node's launcher has joined round
// o.round. Returns -1 to go on, else the exit code.
int await_round(Options& o, JobAgent& agent, size_t& printed) {
  // The agent's own waits end at the join timeout (plus the last call); this bounds a store call
  // that never returns (a store host stopped after it began to listen).
  const double limit =
      o.conf.join_timeout + (o.elastic() ? o.conf.last_call_timeout : 0) + o.grace + 20;
  const auto deadline =
      Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(limit * 1000));
  const std::string store = o.store_host + ":" + std::to_string(o.store_port);
  const std::string node = o.node_rank >= 0 ? "node " + std::to_string(o.node_rank) : "this node";
  for (;;) {
    if (Clock::now() >= deadline) {
      std::fprintf(stderr,
                   "fsdp-run: %s: the job cannot start: the job's store at %s did not answer "
                   "within --join-timeout (%g s)\n",
                   node.c_str(), store.c_str(), o.conf.join_timeout);
      return 2;
    }
    // The store's host hung, or its link went down: its store accepts nothing and answers
    // nothing, so the agent's calls never return. Its silence is the sign.
    if (agent.silent_for() > o.lost_after) {
      std::fprintf(stderr,
                   "fsdp-run: %s: the job cannot %s: the job's store at %s has not answered for "
                   "%d s (its host hung or unreachable?)\n",
                   node.c_str(), o.round == 0 ? "start" : "restart", store.c_str(),
                   static_cast<int>(agent.silent_for()));
      return 2;
    }
    pollfd fds[2] = {{fsdp_run::signal_fd(), POLLIN, 0}, {agent.fd(), POLLIN, 0}};
    if (::poll(fds, 2, 1000) < 0 && errno != EINTR) {
      std::fprintf(stderr, "fsdp-run: poll: %s\n", std::strerror(errno));
      return 2;
    }
    unsigned char sig = 0;
    while (::read(fsdp_run::signal_fd(), &sig, 1) == 1) {
      if (sig == SIGCHLD) continue;
      std::fprintf(stderr, "fsdp-run: stopped by signal %d while waiting for the other nodes\n",
                   sig);
      agent.withdraw(std::chrono::seconds(2));  // this node's join taken back, as it goes
      return 128 + sig;
    }
    const AgentState st = agent.state();
    print_news(st, printed);
    if (st.join_error) {
      const std::string who =
          st.node_rank >= 0 ? "node " + std::to_string(st.node_rank) : std::string("this node");
      std::fprintf(stderr, "fsdp-run: %s: the job cannot %s: %s\n", who.c_str(),
                   o.round == 0 ? "start" : "restart", st.join_error->c_str());
      return 2;
    }
    if (st.joined && st.round >= o.round) {
      take_round(o, st);
      return -1;
    }
  }
}

// Across hosts: starts the agent (round 0) or asks it for the next round, and waits for it.
int join_job(Options& o, std::unique_ptr<JobAgent>& agent, size_t& printed) {
  if (agent) {
    agent->next_round(o.round);
    return await_round(o, *agent, printed);
  }
  try {
    agent = std::make_unique<JobAgent>(fsdp_run::agent_config(o));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp-run: %s\n", e.what());
    return 2;
  }
  return await_round(o, *agent, printed);
}

// Across hosts the agent's thread may be inside a store call when the launcher is done: leave
// without running static destructors under it.
[[noreturn]] void leave(int code) {
  std::fflush(nullptr);
  std::_Exit(code);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (int code = fsdp_run::parse_options(argc, argv, o); code >= 0) return code;
  if (int code = fsdp_run::complete_options(o); code >= 0) return code;
  if (!fsdp_run::install_signal_handlers()) return 2;
  fsdp_run::RankLogs logs(o);
  std::shared_ptr<void> local_store;  // one node: the ranks' store, up for every round
  if (!o.multi_node()) {
    std::string why;
    if (!(local_store = fsdp_run::host_local_store(o, why))) {
      std::fprintf(stderr, "fsdp-run: %s\n", why.c_str());
      return 2;
    }
  }
  std::unique_ptr<JobAgent> agent;
  size_t printed = 0;  // the agent's news lines printed so far
  for (;; ++o.round) {
    if (o.multi_node())
      if (int code = join_job(o, agent, printed); code >= 0) leave(code);
    if (o.round > 0 && agent && !o.elastic())
      std::fprintf(stderr, "fsdp-run: restart %d: every node has rejoined; starting the ranks\n",
                   o.round);
    const fsdp_run::RoundOutcome r = fsdp_run::run_round(o, logs, agent.get());
    if (r.restarting && r.membership_change) {
      std::fprintf(stderr,
                   "fsdp-run: restarting every rank for the membership change (--max-restarts "
                   "does not count it), TORCHELASTIC_RESTART_COUNT=%d\n",
                   o.round + 1);
      continue;
    }
    if (r.restarting) {
      ++o.restarts;
      std::fprintf(stderr,
                   "fsdp-run: restarting every rank: restart %d of %d (--max-restarts), "
                   "TORCHELASTIC_RESTART_COUNT=%d\n",
                   o.restarts, o.max_restarts, o.round + 1);
      continue;
    }
    if (r.failed && o.max_restarts > 0 && o.restarts == o.max_restarts)
      std::fprintf(stderr, "fsdp-run: no restarts left (--max-restarts %d)\n", o.max_restarts);
    if (agent) leave(r.code);
    return r.code;
  }
}
