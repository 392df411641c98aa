// See gather_queue.h.
#include "state_dict/gather_queue.h"

#include <algorithm>

#include "util/tensor_utils.h"

namespace fsdp {
namespace detail {

namespace {

// A tensor whose gathered size is under this is coalesced with others. At 1 MiB a gather alone
// already moves its bytes at about the raw collective's bandwidth (docs/performance.md).
constexpr int64_t kCoalesceBelowBytes = int64_t{1} << 20;
// A bucket's gathered size at most: the copies into and out of the bucket stay small next to the
// state itself, and a few buckets fit in the default window.
constexpr int64_t kBucketBytes = int64_t{4} << 20;

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

}  // namespace

GatherQueue::GatherQueue(int64_t window_bytes, std::function<void(int64_t)> probe)
    : window_(std::max<int64_t>(window_bytes, 0)), probe_(std::move(probe)) {}

GatherQueue::~GatherQueue() = default;  // each Gather's Work waits for itself as it goes

void GatherQueue::add(dist::ProcessGroup& pg, at::Tensor shard, Done done) {
  shard = shard.reshape({-1}).contiguous();
  const int64_t out_bytes = nbytes(shard) * pg.size();
  const int64_t cap = std::min(kBucketBytes, window_);
  const bool small = out_bytes < kCoalesceBelowBytes && out_bytes <= cap;
  if (!bucket_.empty() &&
      (!small || bucket_pg_.backend() != pg.backend() || bucket_bytes_ + out_bytes > cap ||
       bucket_[0].shard.scalar_type() != shard.scalar_type() ||
       bucket_[0].shard.device() != shard.device())) {
    flush_bucket();
  }
  if (small) {
    bucket_pg_ = pg;  // handles keep copies of one group: compared by their backend above
    bucket_.push_back(Piece{std::move(shard), std::move(done)});
    bucket_bytes_ += out_bytes;
    return;
  }
  Gather g;
  g.pieces.push_back(Piece{std::move(shard), std::move(done)});
  start(pg, std::move(g));
}

void GatherQueue::flush_bucket() {
  if (bucket_.empty()) return;
  Gather g;
  g.pieces = std::move(bucket_);
  bucket_.clear();
  bucket_bytes_ = 0;
  start(bucket_pg_, std::move(g));
}

void GatherQueue::start(dist::ProcessGroup& pg, Gather g) {
  if (g.pieces.size() == 1) {
    g.in = g.pieces[0].shard;
    g.bytes = nbytes(g.in);
  } else {
    std::vector<at::Tensor> shards;
    for (const auto& p : g.pieces) shards.push_back(p.shard);
    g.in = at::cat(shards);
    g.bytes = nbytes(g.in) * (1 + pg.size());  // the input and, at the finish, the copies out
  }
  // Fresh memory the gather writes whole: huge pages from a unit's size (util/huge_pages.h).
  g.out = empty_buffer(g.in.numel() * pg.size(), g.in.options());
  g.bytes += nbytes(g.out);
  // On Gloo, pairwise from 1 MiB rather than AUTO's 4 MiB: Gloo's own all-gather receives into
  // a scratch output it allocates afresh and then copies out, which on top of the fresh memory
  // the dict keeps cost more than the transfer (8M parameters in 2 MB units and state tensors,
  // W=2: consolidation 35-40 ms pairwise against 62 ms native; docs/performance.md). AUTO's
  // threshold stays for training, where pairwise below 4 MiB measured slower (docs/dist.md).
  const bool pairwise = pg.backend_name() == "gloo" && nbytes(g.out) >= kCoalesceBelowBytes;
  g.work.emplace(pg.all_gather_into_tensor_async(
      g.out, g.in, pairwise ? dist::AllGatherAlgo::PAIRWISE : dist::AllGatherAlgo::AUTO));
  g.world = pg.size();
  in_flight_bytes_ += g.bytes;
  in_flight_.push_back(std::move(g));
  if (probe_) probe_(in_flight_bytes_);
  while (!in_flight_.empty() && in_flight_bytes_ > window_) finish_oldest();
}

void GatherQueue::finish_oldest() {
  Gather g = std::move(in_flight_.front());
  in_flight_.pop_front();
  in_flight_bytes_ -= g.bytes;
  g.work->wait();
  if (g.pieces.size() == 1) {
    g.pieces[0].done(g.out);
    return;
  }
  // The bucket's result is rank-major: rank r's shards side by side at r x total. Each tensor's
  // column of it, one piece per rank, is its gathered whole.
  const int64_t total = g.in.numel();
  const at::Tensor rows = g.out.view({g.world, total});
  int64_t offset = 0;
  for (auto& p : g.pieces) {
    const int64_t n = p.shard.numel();
    at::Tensor full = empty_buffer(n * g.world, g.out.options());
    full.view({g.world, n}).copy_(rows.narrow(1, offset, n));
    offset += n;
    p.done(full);
  }
}

void GatherQueue::finish() {
  flush_bucket();
  while (!in_flight_.empty()) finish_oldest();
}

}  // namespace detail
}  // namespace fsdp
