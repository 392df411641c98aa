// Internal: whole flat tensors gathered from their shards, several at a time, for the FULL model
// state dict (one gather per unit's flat parameter) and optimizer state dict (one per unit and
// state: exp_avg, exp_avg_sq, ...).
//
// Why not one blocking all-gather each: a gather of a few hundred KB is bound by the collective's
// fixed cost, not by its bandwidth. Over Gloo on loopback (2 cores, W=2) a 250 KB all-gather took
// 0.55 ms where 12 MB took 3.6 ms, so a 1M-parameter model's Adam state (32 such gathers) took
// 18 ms to move 8 MB. Small gathers are therefore coalesced: their shards are copied side by side
// into one input, gathered once, and each tensor's pieces copied out of the rank-major result
// (a copy of a small tensor costs far less than a collective). Large ones are gathered alone,
// straight into the fresh buffer the caller keeps. Gathers run asynchronously, up to a window of
// bytes in gather buffers, so the next is on the wire while the last one's views are taken.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <vector>

#include <torch/types.h>

#include "fsdp/dist.h"

namespace fsdp {
namespace detail {

class GatherQueue {
 public:
  /// Called with each gathered tensor (shard.numel() x W elements, rank r's shard at r x
  /// shard.numel()), in the order the gathers were added.
  using Done = std::function<void(const at::Tensor& full)>;

  /// `window_bytes`: gathers in flight hold at most this many bytes of gather buffers (input,
  /// output and a bucket's copies), but always at least one gather; 0 gathers one tensor at a
  /// time with nothing coalesced. `probe` (may be empty) is told the bytes held after each start.
  /// The default window (kDefaultGatherWindowBytes, 16 MiB) keeps a few coalesced buckets of
  /// small tensors in flight at once; a unit or state tensor of several MB is gathered alone (at
  /// 12.5 MB each, two in flight were no faster on loopback Gloo, and each holds fresh memory).
  GatherQueue(int64_t window_bytes, std::function<void(int64_t)> probe);
  /// Waits for what is still in flight (errors swallowed: a DistError already propagates).
  ~GatherQueue();
  GatherQueue(const GatherQueue&) = delete;
  GatherQueue& operator=(const GatherQueue&) = delete;

  /// Gathers `shard` (this rank's piece; every rank of `pg` passes the same numel and dtype, in
  /// the same order of calls) over `pg`. `done` runs at the latest
  /// in finish(). Throws DistError as the collectives do.
  void add(dist::ProcessGroup& pg, at::Tensor shard, Done done);
  /// Starts what is pending and runs every `done`.
  void finish();

 private:
  struct Piece {
    at::Tensor shard;
    Done done;
  };
  struct Gather {
    std::vector<Piece> pieces;  // one: gathered straight into `out`; more: into a bucket
    at::Tensor in, out;
    int64_t bytes = 0;
    int world = 1;
    std::optional<dist::Work> work;  // last: destroyed (waited for) before the buffers go
  };

  void flush_bucket();
  void start(dist::ProcessGroup& pg, Gather g);
  void finish_oldest();

  int64_t window_;
  std::function<void(int64_t)> probe_;
  dist::ProcessGroup bucket_pg_;  // the group of bucket_
  std::vector<Piece> bucket_;     // small shards waiting to be gathered together
  int64_t bucket_bytes_ = 0;      // output bytes of bucket_
  std::deque<Gather> in_flight_;
  int64_t in_flight_bytes_ = 0;
};

}  // namespace detail
}  // namespace fsdp
