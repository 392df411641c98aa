// fsdp-run's multi-host agent: see rendezvous.h.
#include "launch/rendezvous.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "fsdp/compat_backends.h"

namespace fsdp_run {

namespace {

using Clock = std::chrono::steady_clock;
using Seconds = std::chrono::duration<double>;

// How often the agent looks at the store: the delay with which a failure elsewhere is noticed.
constexpr std::chrono::milliseconds kTick{200};
constexpr std::chrono::seconds kHeartbeat{1};
// How long node 0 keeps the store up for the others to read a failure before it exits.
constexpr std::chrono::seconds kFailureLinger{5};

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

std::string encode(const Failure& f) {
  return std::to_string(f.node) + "\n" + std::to_string(f.code) + "\n" +
         (f.membership_change ? "membership" : "failure") + "\n" + f.what;
}

Failure decode(const std::string& s) {
  Failure f;
  size_t at[3];
  for (int i = 0; i < 3; ++i) {
    at[i] = s.find('\n', i == 0 ? 0 : at[i - 1] + 1);
    if (at[i] == std::string::npos) {
      f.what = s;
      return f;
    }
  }
  try {
    f.node = std::stoi(s.substr(0, at[0]));
    f.code = std::stoi(s.substr(at[0] + 1, at[1] - at[0] - 1));
  } catch (const std::exception&) {
    f.code = 1;
  }
  f.membership_change = s.compare(at[1] + 1, at[2] - at[1] - 1, "membership") == 0;
  f.what = s.substr(at[2] + 1);
  return f;
}

std::string nnodes_text(const AgentConfig& c) {
  return c.elastic() ? std::to_string(c.min_nodes) + ":" + std::to_string(c.max_nodes)
                     : std::to_string(c.max_nodes);
}

std::string config_text(const AgentConfig& c) {
  return "--nnodes " + nnodes_text(c) + " --nproc-per-node " + std::to_string(c.nproc_per_node) +
         " --max-restarts " + std::to_string(c.max_restarts);
}

std::string join_list(const std::vector<int>& v) {
  std::string s;
  for (int i : v) s += (s.empty() ? "" : ",") + std::to_string(i);
  return s;
}

std::vector<int> split_list(const std::string& s) {
  std::vector<int> v;
  for (size_t at = 0; at < s.size();) {
    size_t comma = s.find(',', at);
    if (comma == std::string::npos) comma = s.size();
    v.push_back(std::stoi(s.substr(at, comma - at)));
    at = comma + 1;
  }
  return v;
}

// A failure that ends the join: the message the launcher prints.
struct JoinError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace

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
  Clock::time_point last_heard{};  // epoch until the first successful round

  // Wakes the launcher's poll (the pipe is non-blocking: a full pipe already says "news").
  void notify() {
    const char b = 1;
    [[maybe_unused]] ssize_t n = ::write(pipe[1], &b, 1);
  }
};

namespace {

// The agent thread's work, one object per job. Every store call may throw (the store's host is
// gone); that ends the job. The job runs in rounds, one per (re)start of the ranks: the keys of
// round k live under "round/<k>/", so that nothing of a failed round is read by the next.
class AgentLoop {
 public:
  explicit AgentLoop(std::shared_ptr<JobAgent::Shared> s) : s_(std::move(s)), cfg_(s_->cfg) {}

  void run() {
    try {
      handshake();
    } catch (const std::exception& e) {
      give_up_join(e.what());
      return;
    }
    for (;;) {
      try {
        join_round();
      } catch (const std::exception& e) {
        give_up_join(e.what());
        return;
      }
      if (!watch()) return;  // else the launcher asked for the next round
    }
  }

 private:
  c10d::Store& store() { return *store_; }
  int64_t count(const std::string& key) { return store().add(key, 0); }
  // A key of the current round.
  std::string rk(const std::string& key) const {
    return "round/" + std::to_string(round_) + "/" + key;
  }

  std::string where() const { return cfg_.master_addr + ":" + std::to_string(cfg_.master_port); }

  // Node 0 hosts the store; the others connect, retrying until the join timeout.
  void open_store() {
    const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg_.join_timeout * 1000));
    const bool host = cfg_.node_rank == 0;
    try {
      auto tcp = fsdp::compat::make_tcp_store(
          cfg_.master_addr, static_cast<std::uint16_t>(cfg_.master_port), host, -1, timeout);
      store_ = c10::make_intrusive<c10d::PrefixStore>("/fsdp-run", tcp);
    } catch (const std::exception& e) {
      if (host)
        throw JoinError("node 0 could not host the job's store on port " +
                        std::to_string(cfg_.master_port) + ": " + e.what() +
                        " (is the port in use? --master-port chooses another)");
      throw JoinError("node " + std::to_string(cfg_.node_rank) +
                      " could not reach the job's store at " + where() + " within " +
                      std::to_string(static_cast<int>(cfg_.join_timeout)) + " s: " + e.what() +
                      " (is fsdp-run running on node rank 0 with the same --master-addr and "
                      "--master-port?)");
    }
    heard();
  }

  // Posts `f` as the round's failure unless one was posted before; true if it was ours.
  bool post_failure(const Failure& f) {
    if (store().add(rk("failures"), 1) != 1) return false;
    store().set(rk("failure"), bytes(encode(f)));
    return true;
  }

  std::optional<Failure> posted_failure() {
    if (!store().check({rk("failure")})) return std::nullopt;
    return decode(text(store().get(rk("failure"))));
  }

  // Fails the join for everyone with `what`, and for this launcher. A launcher that came to a
  // running job fails alone: the job goes on without it.
  [[noreturn]] void fail_join(const std::string& what) {
    if (!late_) post_failure(Failure{cfg_.node_rank, 2, what});
    throw JoinError(what);
  }

  // Once per job: the store, the job's shape checked against node 0's, this node's rank claimed.
  // A launcher that comes to a running job (a host back after it was lost, or one more, up to
  // MAX) joins the round after the last one that formed.
  void handshake() {
    open_store();
    if (cfg_.node_rank != 0 && store().check({"formed"})) {
      late_ = true;
      round_ = std::stoi(text(store().get("formed"))) + 1;
    }
    if (cfg_.node_rank == 0) {
      run_id_ = new_run_id();
      store().set("run_id", bytes(run_id_));
      store().set("config", bytes(config_text(cfg_)));
    } else {
      const std::string theirs = text(store().get("config"));  // waits until node 0 set it
      if (theirs != config_text(cfg_))
        fail_join("node " + std::to_string(cfg_.node_rank) + " was started with " +
                  config_text(cfg_) + " but node 0 with " + theirs +
                  "; every node must be given the same");
      run_id_ = text(store().get("run_id"));
    }
    // Node rank i is free once node 0 has given its launcher up as lost.
    const std::string id = std::to_string(cfg_.node_rank);
    lost_at_claim_ = count("lost/" + id);
    if (store().add("node/" + id, 1) != lost_at_claim_ + 1) {
      store().add("node/" + id, -1);  // a claim refused does not stand
      fail_join("two launchers were started with --node-rank " + id +
                (late_ ? " (if this one replaces a launcher that is gone, node 0 frees its node "
                         "rank once it has been silent for --heartbeat-timeout: start this one "
                         "again after that)"
                       : ""));
    }
    store().set("host/" + id, bytes(JobAgent::host_name()));
  }

  // Joins round_ and waits until it has formed with this node (elastic: a node too late for a
  // round waits for the next one).
  void join_round() {
    // A launcher that node 0 gave up (it was silent: its host hung, then came back) claims its
    // node rank again, as a new launcher there would: whichever comes first keeps it, and the
    // other leaves rather than join twice.
    const std::string id = std::to_string(cfg_.node_rank);
    if (const int64_t lost = count("lost/" + id); lost != lost_at_claim_) {
      if (store().add("node/" + id, 1) != lost + 1) {
        store().add("node/" + id, -1);
        throw JoinError("node " + id +
                        " was given up as lost (its launcher silent past --heartbeat-timeout, or "
                        "missing from a round), and another fsdp-run has taken node rank " +
                        id + " since");
      }
      lost_at_claim_ = lost;
    }
    for (;; ++round_) {
      store().set(rk("in/") + std::to_string(cfg_.node_rank), bytes("1"));
      store().add(rk("joined"), 1);
      joined_ = true;
      members_ = cfg_.elastic() ? form_round() : everyone();
      if (std::find(members_.begin(), members_.end(), cfg_.node_rank) != members_.end()) break;
    }
    posted_ = left_ = all_left_ = known_failure_ = false;
    beats_.clear();  // heartbeats are judged afresh each round
    const int group_rank = static_cast<int>(
        std::find(members_.begin(), members_.end(), cfg_.node_rank) - members_.begin());
    learn([&](AgentState& st) {
      st = AgentState{};
      st.joined = true;
      st.round = round_;
      st.run_id = run_id_;
      st.group_rank = group_rank;
      st.group_world = static_cast<int>(members_.size());
      st.members = join_list(members_);
    });
  }

  // A job of fixed size: every node, once all have joined.
  std::vector<int> everyone() {
    wait_for_everyone();
    if (cfg_.node_rank == 0) store().set("formed", bytes(std::to_string(round_)));
    std::vector<int> all(static_cast<size_t>(cfg_.max_nodes));
    for (int i = 0; i < cfg_.max_nodes; ++i) all[static_cast<size_t>(i)] = i;
    return all;
  }

  // Elastic: node 0 forms the round once MAX nodes have joined, or MIN have and
  // last_call_timeout has passed since; the others wait for the list.
  std::vector<int> form_round() {
    const auto ms = [](double s) {
      return std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
    };
    // The others wait longer than node 0, which says why a round could not form.
    const auto deadline = Clock::now() + ms(cfg_.join_timeout) +
                          (cfg_.node_rank == 0 ? ms(0) : ms(cfg_.last_call_timeout + 10));
    bool enough = false;  // MIN nodes have joined, since enough_since
    Clock::time_point enough_since{};
    for (;;) {
      if (auto f = posted_failure()) throw JoinError(f->what);
      if (store().check({rk("members")})) return split_list(text(store().get(rk("members"))));
      if (cfg_.node_rank == 0) {
        const int64_t n = count(rk("joined"));
        if (n < cfg_.min_nodes) enough = false;  // a node took its join back (withdraw)
        if (n >= cfg_.min_nodes && !enough) {
          enough = true;
          enough_since = Clock::now();
        }
        if (n >= cfg_.max_nodes ||
            (enough && Clock::now() - enough_since >= ms(cfg_.last_call_timeout)))
          return close_round();
      }
      heard();
      if (Clock::now() >= deadline) {
        // --join-timeout bounds the wait for MIN nodes, not the last call after them.
        if (cfg_.node_rank == 0 && count(rk("joined")) >= cfg_.min_nodes) return close_round();
        break;
      }
      if (sleep_or_stop(kTick)) {
        withdraw();
        throw JoinError("stopped while waiting for the other nodes");
      }
    }
    if (cfg_.node_rank != 0)
      fail_join((round_ > 0 ? "restart " + std::to_string(round_) : std::string("the job")) +
                " did not form: node 0 named no members (is its fsdp-run running with --nnodes " +
                nnodes_text(cfg_) + "?)");
    fail_join("only " + std::to_string(count(rk("joined"))) + " node(s) joined" +
              (round_ > 0 ? " restart " + std::to_string(round_) : std::string()) + " within " +
              std::to_string(static_cast<int>(cfg_.join_timeout)) +
              " s (--join-timeout); --nnodes " + nnodes_text(cfg_) + " needs at least " +
              std::to_string(cfg_.min_nodes));
  }

  // Node 0, elastic: the round's members are the nodes that joined it so far; a node joining
  // after this waits for the next round.
  std::vector<int> close_round() {
    std::vector<int> members;
    for (int i = 0; i < cfg_.max_nodes; ++i)
      if (store().check({rk("in/") + std::to_string(i)})) members.push_back(i);
    // A node of the last round that did not come back is given up, so that a new launcher may
    // take its node rank (its old one, if it was only slow, claims it again: join_round).
    for (int i : members_)
      if (std::find(members.begin(), members.end(), i) == members.end()) give_up(i);
    store().set(rk("members"), bytes(join_list(members)));
    store().set("formed", bytes(std::to_string(round_)));
    return members;
  }

  // Node 0: node rank i's launcher is gone; its claim is released once (node/<i> counts the
  // claims that stand, lost/<i> the ones given up).
  void give_up(int i) {
    const std::string id = std::to_string(i);
    if (count("node/" + id) > count("lost/" + id)) store().add("lost/" + id, 1);
  }

  void wait_for_everyone() {
    const auto deadline =
        Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(cfg_.join_timeout * 1000));
    for (;;) {
      if (auto f = posted_failure()) throw JoinError(f->what);
      if (count(rk("joined")) >= cfg_.max_nodes) return;
      heard();
      if (Clock::now() >= deadline) break;
      if (sleep_or_stop(kTick)) {
        withdraw();
        throw JoinError("stopped while waiting for the other nodes");
      }
    }
    std::string missing;
    for (int i = 0; i < cfg_.max_nodes; ++i)
      if (!store().check({rk("in/") + std::to_string(i)}))
        missing += (missing.empty() ? "" : ", ") + std::to_string(i);
    fail_join("node rank(s) " + missing + " did not join" +
              (round_ > 0 ? " restart " + std::to_string(round_) : std::string()) + " within " +
              std::to_string(static_cast<int>(cfg_.join_timeout)) + " s (--join-timeout); is " +
              "fsdp-run running there with --nnodes " + nnodes_text(cfg_) + " and --master-addr " +
              cfg_.master_addr + " --master-port " + std::to_string(cfg_.master_port) + "?");
  }

  // This launcher was stopped (Ctrl-C) while it waited for a round: it takes its join back, so
  // that node 0 neither counts it into the round nor (elastic) restarts the running job for it.
  // If the round closed with it meanwhile, the others would wait for its ranks until its
  // heartbeat is missed: it posts a failure instead, which starts the next round without it.
  void withdraw() {
    if (!joined_) return;
    try {
      const std::string id = std::to_string(cfg_.node_rank);
      if (store().deleteKey(rk("in/") + id)) store().add(rk("joined"), -1);
      joined_ = false;
      if (store().check({rk("members")})) {
        const std::vector<int> m = split_list(text(store().get(rk("members"))));
        if (std::find(m.begin(), m.end(), cfg_.node_rank) != m.end())
          post_failure(Failure{cfg_.node_rank, 2,
                               "node " + id + " was stopped as round " + std::to_string(round_) +
                                   " formed with it"});
      }
    } catch (const std::exception&) {
      // The store is gone: there is no join left to take back.
    }
  }

  // Sleeps up to `d`, or until the launcher asks for something. True if asked to stop.
  bool sleep_or_stop(std::chrono::milliseconds d) {
    std::unique_lock<std::mutex> lock(s_->mu);
    s_->cv.wait_for(lock, d, [&] { return s_->stop; });
    return s_->stop;
  }

  void heard() {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->last_heard = Clock::now();
  }

  // While a round runs: posts what the launcher reports, bumps the heartbeat, watches for the
  // round's failure and (node 0) for lost nodes and for everyone having left. True when the
  // launcher asks for the next round, false when there is nothing more to do.
  bool watch() {
    bool done = false;  // this round: nothing more to watch
    for (;;) {
      std::optional<Failure> to_post;
      bool to_leave = false;
      {
        std::unique_lock<std::mutex> lock(s_->mu);
        s_->cv.wait_for(lock, kTick, [&] {
          return s_->stop || (s_->next_round > round_ && left_) || (s_->to_post && !posted_) ||
                 (s_->to_leave && !left_);
        });
        if (s_->stop) return false;
        if (s_->next_round > round_ && left_) {
          round_ = s_->next_round;
          s_->to_post.reset();
          s_->to_leave = false;
          return true;
        }
        to_post = s_->to_post;
        to_leave = s_->to_leave;
      }
      if (done) continue;
      try {
        done = !look(to_post, to_leave);
        heard();
      } catch (const std::exception& e) {
        lost_store(e.what());
        return false;
      }
    }
  }

  // One look at the store. False when this round needs no more looks.
  bool look(const std::optional<Failure>& to_post, bool to_leave) {
    if (to_post && !posted_) {
      post_failure(*to_post);
      posted_ = true;
    }
    if (!known_failure_) {
      if (auto f = posted_failure()) {
        known_failure_ = true;
        learn([&](AgentState& st) { st.failure = *f; });
      }
    }
    if (to_leave && !left_) {
      store().set(rk("left/") + std::to_string(cfg_.node_rank), bytes("1"));
      store().add(rk("left"), 1);
      left_ = true;
      learn([](AgentState& st) { st.left = true; });
    }
    // Everyone's ranks have ended: say so ("done") before the launcher hears it and exits, so
    // that node 0, whose process holds the store, goes last.
    const auto members = static_cast<int64_t>(members_.size());
    if (left_ && !all_left_ && count(rk("left")) >= members) {
      // Every node posts its failure before it leaves: read after the count, it is final.
      if (!known_failure_) {
        if (auto f = posted_failure()) {
          known_failure_ = true;
          learn([&](AgentState& st) { st.failure = *f; });
        }
      }
      store().add(rk("done"), 1);
      all_left_ = true;
      learn([](AgentState& st) { st.all_left = true; });
      if (cfg_.node_rank != 0) return false;
    }
    if (cfg_.node_rank != 0) {
      if (Clock::now() - last_beat_ >= kHeartbeat) {
        store().add("alive/" + std::to_string(cfg_.node_rank), 1);
        last_beat_ = Clock::now();
      }
      return true;
    }
    if (all_left_) {
      if (count(rk("done")) < members) return true;
      learn([](AgentState& st) { st.all_done = true; });
      return false;
    }
    if (!known_failure_) check_heartbeats();
    if (!known_failure_) check_waiting();
    return true;
  }

  // Node 0, elastic: a node waiting to join the next round (a host back, or one more up to MAX)
  // ends this one, so that the next starts with it, as torchrun's agents do.
  void check_waiting() {
    if (!cfg_.elastic() || static_cast<int>(members_.size()) >= cfg_.max_nodes) return;
    // Only while every node's ranks still run: once one has left, the round is ending anyway (a
    // finished job is not started again for a newcomer; a failed one restarts with it).
    if (left_ || count(rk("left")) > 0) return;
    if (Clock::now() - last_waiting_check_ < kHeartbeat) return;
    last_waiting_check_ = Clock::now();
    const std::string next = "round/" + std::to_string(round_ + 1) + "/";
    if (count(next + "joined") == 0) return;
    std::string who;
    for (int i = 0; i < cfg_.max_nodes; ++i) {
      const std::string id = std::to_string(i);
      if (!store().check({next + "in/" + id})) continue;
      who +=
          (who.empty() ? "node " : ", node ") + id + " (" + text(store().get("host/" + id)) + ")";
    }
    post_failure(Failure{-1, 1,
                         who + " waiting to join: every node stops its ranks and starts them "
                               "again with it (a membership change, which --max-restarts does "
                               "not count)",
                         true});
  }

  // Node 0: a node whose heartbeat has not moved for heartbeat_timeout, and that has not left
  // this round, is lost; that is the round's failure.
  void check_heartbeats() {
    if (Clock::now() - last_beat_ < kHeartbeat) return;
    last_beat_ = Clock::now();
    for (int i : members_) {
      if (i == 0) continue;
      const std::string id = std::to_string(i);
      const int64_t beat = count("alive/" + id);
      auto it = beats_.find(i);
      if (it == beats_.end() || it->second.first != beat) {
        beats_[i] = {beat, Clock::now()};
        continue;
      }
      const double silent = Seconds(Clock::now() - it->second.second).count();
      if (silent < cfg_.heartbeat_timeout || store().check({rk("left/") + id})) continue;
      const std::string host = text(store().get("host/" + id));
      give_up(i);  // a new launcher may take its place
      post_failure(Failure{i, 1,
                           "node " + id + " (" + host + ") stopped answering: its launcher sent " +
                               "no heartbeat for " + std::to_string(static_cast<int>(silent)) +
                               " s (--heartbeat-timeout)"});
      return;  // the next look reads the failure back
    }
  }

  void lost_store(const std::string& why) {
    learn([&](AgentState& st) {
      st.store_lost = true;
      if (!st.failure)
        st.failure = Failure{0, 1,
                             "lost the job's store at " + where() +
                                 " (hosted by node 0's fsdp-run): " + why +
                                 "; node 0's host or launcher is gone"};
    });
  }

  // The join failed: node 0 keeps the store up a little for the others to read why (until every
  // launcher that had joined this round has given up too), then the launcher hears of it.
  void give_up_join(const std::string& why) {
    if (store_ && joined_) {
      const auto until = Clock::now() + kFailureLinger;
      try {
        store().add(rk("gave_up"), 1);
        if (cfg_.node_rank == 0)
          while (Clock::now() < until && count(rk("gave_up")) < count(rk("joined")))
            if (sleep_or_stop(kTick)) break;
      } catch (const std::exception&) {
      }
    }
    learn([&](AgentState& st) { st.join_error = why; });
  }

  template <typename F>
  void learn(F change) {
    std::lock_guard<std::mutex> lock(s_->mu);
    change(s_->state);
    s_->notify();
  }

  std::shared_ptr<JobAgent::Shared> s_;
  const AgentConfig& cfg_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::string run_id_;
  int round_ = 0;
  bool joined_ = false, posted_ = false, left_ = false, all_left_ = false, known_failure_ = false;
  bool late_ = false;          // came to a job whose first round had formed
  int64_t lost_at_claim_ = 0;  // lost/<node rank> when this launcher claimed it
  std::vector<int> members_;   // the node ranks of round_
  Clock::time_point last_beat_{}, last_waiting_check_{};
  std::map<int, std::pair<int64_t, Clock::time_point>> beats_;  // node -> (beat, when it moved)
};

}  // namespace

std::string new_run_id() {
  std::random_device rd;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%08x%08x", rd(), rd());
  return buf;
}

JobAgent::JobAgent(const AgentConfig& config) : shared_(std::make_shared<Shared>(config)) {
  if (::pipe2(shared_->pipe, O_CLOEXEC | O_NONBLOCK) != 0)
    throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
  std::thread([s = shared_] {
    AgentLoop(s).run();
    std::lock_guard<std::mutex> lock(s->mu);
    s->finished = true;
    s->cv.notify_all();
  }).detach();
}

JobAgent::~JobAgent() {
  std::lock_guard<std::mutex> lock(shared_->mu);
  shared_->stop = true;
  shared_->cv.notify_all();
}

int JobAgent::fd() const { return shared_->pipe[0]; }

AgentState JobAgent::state() {
  char buf[64];
  while (::read(shared_->pipe[0], buf, sizeof buf) > 0) {
  }
  std::lock_guard<std::mutex> lock(shared_->mu);
  return shared_->state;
}

void JobAgent::report_failure(int code, const std::string& what) {
  std::lock_guard<std::mutex> lock(shared_->mu);
  if (!shared_->to_post) shared_->to_post = Failure{shared_->cfg.node_rank, code, what};
  shared_->cv.notify_all();
}

void JobAgent::next_round(int round) {
  std::lock_guard<std::mutex> lock(shared_->mu);
  shared_->next_round = round;
  shared_->state.joined = false;
  shared_->cv.notify_all();
}

void JobAgent::withdraw(std::chrono::milliseconds limit) {
  std::unique_lock<std::mutex> lock(shared_->mu);
  shared_->stop = true;
  shared_->cv.notify_all();
  shared_->cv.wait_for(lock, limit, [&] { return shared_->finished; });
}

void JobAgent::report_left() {
  std::lock_guard<std::mutex> lock(shared_->mu);
  shared_->to_leave = true;
  shared_->cv.notify_all();
}

double JobAgent::silent_for() const {
  std::lock_guard<std::mutex> lock(shared_->mu);
  if (shared_->last_heard == Clock::time_point{}) return 0;
  return Seconds(Clock::now() - shared_->last_heard).count();
}

std::string JobAgent::host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "unknown host";
  return buf;
}

}  // namespace fsdp_run
