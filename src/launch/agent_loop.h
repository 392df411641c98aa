// The rendezvous agent's thread (rendezvous.h), in two phases: joining a round (agent_join.cpp:
// the store, a node rank, the job's shape, a round that forms, the address the ranks bind) and
// watching it run (agent_watch.cpp: failures, heartbeats, leaving, newcomers). Every store call
// may throw (the store's host is gone); that ends the job.
#pragma once

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "launch/heartbeats.h"
#include "launch/rendezvous.h"

namespace fsdp_run {

/// What the launcher and the agent thread share.
struct JobAgent::Shared {
  explicit Shared(const AgentConfig& c) : cfg(c) {}
  ~Shared() {
    for (int fd : pipe)
      if (fd >= 0) ::close(fd);
  }

  const AgentConfig cfg;
  int pipe[2] = {-1, -1};
  std::mutex mu;
  std::condition_variable cv;
  // Asked by the launcher.
  std::optional<Failure> to_post;
  bool to_leave = false;
  int next_round = 0;  // the round the launcher wants to join next
  bool stop = false;
  bool finished = false;  // the thread has returned
  // Learnt by the thread.
  AgentState state;
  std::chrono::steady_clock::time_point last_heard{};  // epoch until the store first answered

  // Wakes the launcher's poll (the pipe is non-blocking: a full pipe already says "news").
  void notify() {
    const char b = 1;
    [[maybe_unused]] ssize_t n = ::write(pipe[1], &b, 1);
  }
};

namespace agent {

using Clock = std::chrono::steady_clock;
using Seconds = std::chrono::duration<double>;

// How often the agent looks at the store: the delay with which a failure elsewhere is noticed.
constexpr std::chrono::milliseconds kTick{200};

inline std::chrono::milliseconds ms(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}
inline std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
inline std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

std::string encode(const Failure& f);
Failure decode(const std::string& s);
std::string join_list(const std::vector<int>& v);
std::vector<int> split_list(const std::string& s);
std::string nnodes_text(const AgentConfig& c);

// A failure that ends the join: the message the launcher prints.
struct JoinError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace agent

// The agent thread's work, one object per job. The job runs in rounds, one per (re)start of the
// ranks: the keys of round k live under "round/<k>/", so that nothing of a failed round is read by
// the next.
class AgentLoop {
 public:
  explicit AgentLoop(std::shared_ptr<JobAgent::Shared> s);
  void run();

 private:
  // --- agent_join.cpp: once per job ---
  void open_store();
  bool try_claim(int node);
  void claim_node_rank();
  void handshake();
  std::string wait_for_key(const std::string& key, const char* what);
  // --- agent_join.cpp: once per round ---
  void join_round();
  void reclaim_after_loss();
  std::vector<int> everyone();
  std::vector<int> form_round();
  std::vector<int> close_round();
  void while_forming(bool& stopped);
  void judge_forming_heartbeats();
  void drop_lost_node(int node, double silent);
  void say_whom_we_wait_for();
  void choose_address();
  [[noreturn]] void fail_join(const std::string& what);
  void withdraw();
  void give_up_join(const std::string& why);

  // --- agent_watch.cpp: while a round runs ---
  bool watch();
  bool look(const std::optional<Failure>& to_post, bool to_leave);
  void check_waiting();
  void check_heartbeats();
  void check_coordinator();
  void lost_store(const std::string& why);

  // --- shared helpers (agent_watch.cpp) ---
  c10d::Store& store() { return *store_; }
  int64_t count(const std::string& key) { return store().add(key, 0); }
  std::string rk(const std::string& key) const;  // a key of the current round
  std::string where() const;                     // "host:port" of the store
  std::string node_name(int node);               // "node 1 (host-b)"
  bool post_failure(const Failure& f);
  std::optional<Failure> posted_failure();
  void give_up(int node);
  void beat();
  bool sleep_or_stop(std::chrono::milliseconds d);
  void heard();
  void news(const std::string& line);
  template <typename F>
  void learn(F change) {
    std::lock_guard<std::mutex> lock(s_->mu);
    change(s_->state);
    s_->notify();
  }

  std::shared_ptr<JobAgent::Shared> s_;
  const AgentConfig& cfg_;
  c10::intrusive_ptr<c10d::Store> store_;
  bool hosts_store_ = false;
  int node_ = -1;  // this launcher's node rank, once claimed
  std::string run_id_;
  int round_ = 0;
  bool joined_ = false, posted_ = false, left_ = false, all_left_ = false, known_failure_ = false;
  bool late_ = false;              // came to a job whose first round had formed
  bool watch_coordinator_ = true;  // node 0's heartbeat needs watching: it does not host the store
  int64_t lost_at_claim_ = 0;      // lost/<node rank> when this launcher claimed it
  std::vector<int> members_;       // the node ranks of round_
  HeartbeatWatch watch_;           // the others' heartbeats (node 0), or node 0's (the others)
  double look_period_;             // how often watch_ looks
  std::string lost_nodes_;         // node 0: the nodes dropped while round_ formed, for messages
  std::string last_address_line_;  // the last line said about this node's ranks' address
  std::chrono::steady_clock::time_point last_beat_{}, last_look_{}, last_waiting_check_{},
      last_status_{};
};

}  // namespace fsdp_run
