// Judging other launchers' heartbeats (issue 60): each launcher bumps a counter in the job's store
// every keep_alive_interval; a watcher reads the counters now and then and gives a node up once
// its counter has not moved for `lost_after` (torchrun's keep_alive_interval x
// keep_alive_max_attempt).
//
// Counters, not timestamps: hosts' clocks need not agree. A watcher only sees a new value when it
// looks, up to one look after the beat, and it looks again only a look later; so a node is given
// up once its counter has stood still, as seen here, for lost_after minus two looks. That keeps
// the loss within lost_after of the node's last heartbeat, and a live node (which beats several
// times per lost_after) is never given up.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>

namespace fsdp_run {

class HeartbeatWatch {
 public:
  using Clock = std::chrono::steady_clock;
  using Seconds = std::chrono::duration<double>;

  /// `lost_after` in seconds; `look` the period of the watcher's looks.
  HeartbeatWatch(double lost_after, double look)
      : threshold_(std::max(lost_after - 2 * look, lost_after / 2)) {}

  /// How often to look so that the bound holds: an eighth of lost_after, at most a second.
  static double look_period(double lost_after) { return std::min(1.0, lost_after / 8); }

  /// Records node `node`'s counter as read at `now`; returns for how long it has stood still (0
  /// when it moved, or is seen for the first time).
  double see(int node, int64_t beat, Clock::time_point now) {
    auto it = seen_.find(node);
    if (it == seen_.end() || it->second.beat != beat) {
      seen_[node] = {beat, now};
      return 0;
    }
    return Seconds(now - it->second.since).count();
  }

  /// Whether a counter that has stood still for `still` seconds means the node is lost.
  bool lost(double still) const { return still >= threshold_; }

  /// Forgets a node (it left, or was given up): its next sighting starts afresh.
  void forget(int node) { seen_.erase(node); }
  void clear() { seen_.clear(); }

 private:
  struct Seen {
    int64_t beat;
    Clock::time_point since;
  };
  double threshold_;
  std::map<int, Seen> seen_;
};

}  // namespace fsdp_run
