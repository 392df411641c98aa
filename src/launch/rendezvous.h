// fsdp-run's agent for jobs that span hosts (issues 40, 60): the launchers of one job meet in the
// job's TCPStore, as torchrun's agents do, and keep each other informed there. The store is hosted
// by the launcher of node rank 0 (static rendezvous, --master-addr:--master-port), by the launcher
// on the machine that --rdzv-endpoint names (c10d rendezvous), or by a TCPStore already listening
// there that no launcher runs.
//
// Two roles, usually one launcher's: the store's host keeps it up until everyone is done; node
// rank 0 coordinates (it forms the rounds and judges the others' heartbeats). With c10d and no
// --node-rank, each launcher takes the lowest node rank that is free, in the order they arrive.
//
// The job runs in rounds: round 0, then one per restart (--max-restarts). What the launchers say
// to each other, under the store prefix "/fsdp-run/" (with --rdzv-id X: "/fsdp-run/X/"; the
// ranks' own keys live under "/worker/attempt_<round>/", PyTorch's prefix when the agent hosts
// the store):
//   config            node 0's --nnodes, --nproc-per-node and --max-restarts; every other node's
//                     must match
//   run_id            the job's TORCHELASTIC_RUN_ID (--rdzv-id, or node 0's random one)
//   node/<i>          how many launchers claim node rank i (more than one is an error)
//   host/<i>          node i's host name, for messages
//   store_host        the node rank whose launcher hosts the store, if one does
//   route/<i>         node i's route to the store (node_address.h): the address its ranks are
//                     reached by is chosen from these once a round forms
//   alive/<i>         node i's heartbeat, a counter it bumps every keep_alive_interval from the
//                     moment it claims its node rank; node 0 watches everyone's (a node silent for
//                     keep_alive_interval x keep_alive_max_attempt is lost, also while a round
//                     forms), and every other node watches node 0's (unless node 0 hosts the
//                     store, whose loss is noticed anyway)
//   lost/<i>          how often node 0 gave node i up (its launcher silent): a new launcher may
//                     then claim node rank i again
//   formed            the last round that formed (elastic: a new launcher joins the one after)
// and for each round k, under "round/<k>/":
//   in/<i>, joined    who has joined round k; its ranks start when all have (elastic, --nnodes
//                     MIN:MAX: when MAX have, or MIN have and --last-call-timeout has passed)
//   lost_nodes        the nodes node 0 dropped while round k formed, "1 (host-b), 3 (host-d)"
//   members           the nodes of round k, "0,1,3", set by node 0 when it formed; each node's
//                     GROUP_RANK is its place in the list, and the ranks are numbered densely
//   failures, failure the round's first failure (a counter decides who is first), as
//                     "<node>\n<exit code>\n<kind>\n<sentence>" (kind: "failure", or
//                     "membership" when node 0 saw a node waiting for the next round)
//   left, left/<i>    the launchers whose ranks have all ended (after posting their failure,
//                     if any): once all have and no failure was posted, the job succeeded
//   done              the launchers that saw everyone leave; the store's host exits last, so
//                     nobody loses the store early
//   gave_up           the launchers that gave up a failed join (the store's host waits for them)
//
// All store traffic happens on the agent's own thread, so that a store that does not answer (its
// host hung) never blocks the launcher's loop: the loop polls fd() next to its ranks' output, and
// notices a silent store through silent_for().
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "launch/node_address.h"

namespace fsdp_run {

/// A fresh TORCHELASTIC_RUN_ID: 16 random hex digits (node 0's is handed to every node).
std::string new_run_id();

/// Who hosts the job's store.
enum class StoreRole {
  kHost,        // this launcher (node 0 of a static rendezvous; c10d's is_host=true)
  kClient,      // another process, on another machine or this one
  kHostIfFree,  // this launcher, unless the port is taken (another launcher of the job on this
                // machine hosts it: torchrun's fallback when is_host was inferred)
};

/// Settings of one launcher in a multi-host job (the seconds are torchrun's --rdzv-conf keys).
struct AgentConfig {
  int min_nodes = 2, max_nodes = 2;  // --nnodes N (both N) or MIN:MAX (elastic)
  int node_rank = 0;  // this launcher's node, 0 .. max_nodes-1; -1: the lowest free one
  int nproc_per_node = 1;
  std::string store_host;  // the job's store, as the user wrote it
  int store_port = 29500;
  StoreRole store_role = StoreRole::kClient;
  std::string rdzv_id = "none";   // --rdzv-id: "none" (torchrun's default) shares the plain prefix
  std::string run_id;             // the job's TORCHELASTIC_RUN_ID if fixed (--rdzv-id), else node 0
                                  // draws one
  double join_timeout = 600;      // every launcher must have joined by then
  double last_call_timeout = 30;  // elastic: once MIN nodes joined, how long a round waits for
                                  // more before it starts
  double close_timeout = 30;      // the store's host waits this long, at most, for the others to
                                  // read how a failed join ended
  double read_timeout = 60;       // a store call still unanswered by then fails (once connected)
  double keep_alive_interval = 5;  // a heartbeat this often
  double lost_after = 15;  // silent this long: lost (keep_alive_interval x keep_alive_max_attempt)
  double status_interval = 30;      // while a round forms, a line on whom it waits for this often
  int max_restarts = 0;             // restarts of the job after a failure (torchrun's)
  std::string local_addr;           // --local-addr: this node's address for its ranks
  bool gloo_address_given = false;  // GLOO_SOCKET_IFNAME / FSDP_GLOO_HOSTNAME set: the ranks
                                    // choose, and an address of ours is only a fallback
  bool elastic() const { return min_nodes < max_nodes; }
};

/// The first failure anywhere in the job.
struct Failure {
  int node = -1;     // node rank where it happened
  int code = 1;      // exit code the launchers exit with
  std::string what;  // one sentence naming the node, host and rank, e.g. "rank 3 (local rank 1,
                     // pid 812) on node 1 (host-b) was killed by signal 9 (SIGKILL)"
  // Not a failure (elastic): a node waits to join, so every node stops its ranks and starts the
  // next round with it, as torchrun does; --max-restarts does not count these.
  bool membership_change = false;
};

/// What the agent has learnt, as of the last call to state().
struct AgentState {
  int node_rank = -1;                  // this launcher's node rank, once claimed
  bool hosts_store = false;            // this launcher hosts the job's store (it leaves last)
  std::optional<NodeAddress> address;  // once joined: the address this node's ranks bind
  std::vector<std::string> news;  // lines for the launcher to print, oldest first (whom a forming
                                  // round waits for, who was lost): it prints each once
  bool joined = false;            // every launcher joined `round`: start the ranks
  int round = 0;                  // the round joined (0, then 1 per restart)
  int group_rank = 0;             // this node's index among the round's nodes
  int group_world = 0;            // how many nodes the round has
  std::string members;            // the round's node ranks, "0,1,3"
  std::optional<std::string> join_error;  // the job cannot start: why
  std::string run_id;                     // the job's TORCHELASTIC_RUN_ID, once joined
  std::optional<Failure> failure;         // the job's first failure, once known
  bool left = false;                      // report_left() has reached the store
  bool all_left = false;                  // after left: every launcher's ranks have ended
  bool all_done = false;                  // the store's host: every launcher has seen all_left
  bool store_lost = false;                // the job's store is gone: no restart is possible
};

class JobAgent {
 public:
  /// Starts the agent thread, which hosts the store or connects to it (retrying until
  /// join_timeout), claims a node rank, checks that every launcher agrees on the job's shape, and
  /// waits until all have joined. Returns at once; fd() turns readable when there is news.
  explicit JobAgent(const AgentConfig& config);
  /// Asks the thread to stop; never waits for it (a thread stuck on a hung store is abandoned).
  ~JobAgent();
  JobAgent(const JobAgent&) = delete;
  JobAgent& operator=(const JobAgent&) = delete;

  /// Readable when the state changed; state() drains it.
  int fd() const;
  AgentState state();

  /// This host's first failed rank: posted as the job's failure unless another came first.
  void report_failure(int code, const std::string& what);
  /// This host's ranks have all ended this round (successfully or not).
  void report_left();
  /// After report_left(): join round `round` (a restart); state().joined turns true when every
  /// launcher has (elastic: once the round has formed with this node, perhaps a later round than
  /// `round` if this node came too late for it), or join_error says why not.
  void next_round(int round);
  /// The launcher was stopped (a signal) while it waited for a round to form: the thread takes
  /// this node's join back, so that node 0 neither counts it into the round nor restarts the job
  /// for it, and ends. Waits for that up to `limit` (a thread stuck on a hung store is abandoned).
  void withdraw(std::chrono::milliseconds limit);
  /// Seconds since the agent last heard from the store (0 while it has not started talking).
  double silent_for() const;

  struct Shared;  // what the launcher and the agent thread share (rendezvous.cpp)

 private:
  std::shared_ptr<Shared> shared_;
};

}  // namespace fsdp_run
