// The rendezvous agent while a round runs: failures posted and read, heartbeats, leaving, and
// (elastic) newcomers; with the helpers both phases share. See agent_loop.h and rendezvous.h.
#include <algorithm>
#include <exception>

#include "launch/agent_loop.h"

namespace fsdp_run {

using agent::bytes;
using agent::Clock;
using agent::kTick;
using agent::ms;
using agent::Seconds;
using agent::text;

std::string AgentLoop::rk(const std::string& key) const {
  return "round/" + std::to_string(round_) + "/" + key;
}

std::string AgentLoop::where() const {
  return cfg_.store_host + ":" + std::to_string(cfg_.store_port);
}

std::string AgentLoop::node_name(int node) {
  const std::string id = std::to_string(node);
  const bool known = store().check({"host/" + id});
  return "node " + id + (known ? " (" + text(store().get("host/" + id)) + ")" : std::string());
}

// Posts `f` as the round's failure unless one was posted before; true if it was ours.
bool AgentLoop::post_failure(const Failure& f) {
  if (store().add(rk("failures"), 1) != 1) return false;
  store().set(rk("failure"), bytes(agent::encode(f)));
  return true;
}

std::optional<Failure> AgentLoop::posted_failure() {
  if (!store().check({rk("failure")})) return std::nullopt;
  return agent::decode(text(store().get(rk("failure"))));
}

// Node 0: node rank i's launcher is gone; its claim is released once (node/<i> counts the
// claims that stand, lost/<i> the ones given up).
void AgentLoop::give_up(int node) {
  const std::string id = std::to_string(node);
  if (count("node/" + id) > count("lost/" + id)) store().add("lost/" + id, 1);
}

// This node's heartbeat, once per keep_alive_interval.
void AgentLoop::beat() {
  if (Clock::now() - last_beat_ < ms(cfg_.keep_alive_interval)) return;
  store().add("alive/" + std::to_string(node_), 1);
  last_beat_ = Clock::now();
}

// Sleeps up to `d`, or until the launcher asks for something. True if asked to stop.
bool AgentLoop::sleep_or_stop(std::chrono::milliseconds d) {
  std::unique_lock<std::mutex> lock(s_->mu);
  s_->cv.wait_for(lock, d, [&] { return s_->stop; });
  return s_->stop;
}

void AgentLoop::heard() {
  std::lock_guard<std::mutex> lock(s_->mu);
  s_->last_heard = Clock::now();
}

void AgentLoop::news(const std::string& line) {
  learn([&](AgentState& st) { st.news.push_back(line); });
}

// While a round runs: posts what the launcher reports, bumps the heartbeat, watches for the
// round's failure and for lost nodes (node 0 everyone's, the others node 0's), and for everyone
// having left. True when the launcher asks for the next round, false when there is nothing more
// to do.
bool AgentLoop::watch() {
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
bool AgentLoop::look(const std::optional<Failure>& to_post, bool to_leave) {
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
    store().set(rk("left/") + std::to_string(node_), bytes("1"));
    store().add(rk("left"), 1);
    left_ = true;
    learn([](AgentState& st) { st.left = true; });
  }
  // Everyone's ranks have ended: say so ("done") before the launcher hears it and exits, so
  // that the store's host, whose process holds the store, goes last.
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
    if (!hosts_store_) return false;
  }
  if (all_left_) {
    if (count(rk("done")) < members) return true;
    learn([](AgentState& st) { st.all_done = true; });
    return false;
  }
  beat();
  if (known_failure_ || Clock::now() - last_look_ < ms(look_period_)) return true;
  last_look_ = Clock::now();
  if (node_ == 0) {
    check_heartbeats();
    if (!known_failure_) check_waiting();
  } else if (watch_coordinator_) {
    check_coordinator();
  }
  return true;
}

// Node 0, elastic: a node waiting to join the next round (a host back, or one more up to MAX)
// ends this one, so that the next starts with it, as torchrun's agents do.
void AgentLoop::check_waiting() {
  if (!cfg_.elastic() || static_cast<int>(members_.size()) >= cfg_.max_nodes) return;
  // Only while every node's ranks still run: once one has left, the round is ending anyway (a
  // finished job is not started again for a newcomer; a failed one restarts with it).
  if (left_ || count(rk("left")) > 0) return;
  if (Clock::now() - last_waiting_check_ < std::chrono::seconds(1)) return;
  last_waiting_check_ = Clock::now();
  const std::string next = "round/" + std::to_string(round_ + 1) + "/";
  if (count(next + "joined") == 0) return;
  std::string who;
  for (int i = 0; i < cfg_.max_nodes; ++i)
    if (store().check({next + "in/" + std::to_string(i)}))
      who += (who.empty() ? "" : ", ") + node_name(i);
  post_failure(Failure{-1, 1,
                       who + " waiting to join: every node stops its ranks and starts them "
                             "again with it (a membership change, which --max-restarts does "
                             "not count)",
                       true});
}

// Node 0: a node whose heartbeat has stood still for lost_after, and that has not left this
// round, is lost; that is the round's failure.
void AgentLoop::check_heartbeats() {
  for (int i : members_) {
    if (i == 0) continue;
    const std::string id = std::to_string(i);
    const double still = watch_.see(i, count("alive/" + id), Clock::now());
    if (!watch_.lost(still) || store().check({rk("left/") + id})) continue;
    const std::string who = node_name(i);
    give_up(i);  // a new launcher may take its place
    post_failure(Failure{i, 1,
                         who + " stopped answering: its launcher sent no heartbeat for " +
                             std::to_string(static_cast<int>(still + 0.5)) +
                             " s (keep_alive_interval x keep_alive_max_attempt)"});
    return;  // the next look reads the failure back
  }
}

// The others watch node 0, which forms the rounds: when the store lives elsewhere (a c10d
// endpoint on another host), its loss would otherwise go unnoticed until the next round.
void AgentLoop::check_coordinator() {
  if (count("node/0") <= count("lost/0") || store().check({rk("left/0")})) {
    watch_.forget(0);
    return;
  }
  const double still = watch_.see(0, count("alive/0"), Clock::now());
  if (!watch_.lost(still)) return;
  post_failure(Failure{0, 1,
                       node_name(0) + ", which forms the rounds, stopped answering: its launcher " +
                           "sent no heartbeat for " +
                           std::to_string(static_cast<int>(still + 0.5)) +
                           " s (keep_alive_interval x keep_alive_max_attempt)"});
}

void AgentLoop::lost_store(const std::string& why) {
  learn([&](AgentState& st) {
    st.store_lost = true;
    if (!st.failure)
      st.failure = Failure{0, 1,
                           "lost the job's store at " + where() + ": " + why +
                               "; the host that held it (node 0's, or the one --rdzv-endpoint "
                               "names) or its launcher is gone"};
  });
}

}  // namespace fsdp_run
