// Collectives out of point-to-point sends and receives on the backend (Gloo): the reduce-scatter
// (ReduceScatterAlgo::kPairwise) and the all-gather (AllGatherAlgo::kPairwise).
//
// Reduce-scatter. Why not the all-to-all: alltoall_base needs a receive buffer the size of the
// whole input (W pieces, one of them this rank's own, copied locally by Gloo), so a unit's
// reduction holds two unit-sized buffers at the peak of backward: the flat gradient and that
// receive buffer. Here every rank sends piece q of its input to rank q, receives the first piece of
// its own chunk straight into the output (sums) and the others into at most two chunk-sized
// buffers, reused as the sum goes on, and reads its own piece in place: W=2 needs no scratch at
// all, W=4 one or two chunks where the all-to-all holds a whole unit. The sum is the all-to-all's,
// in rank order, so the results are bit-identical to kAllToAll.
//
// The sends and the first receives are posted at the start; the sum, and the receives that reuse a
// buffer, run in the finish (Work::wait), each wait bounded by the group's timeout.
//
// All-gather. Gloo's allgather (1.13's list form and 2.x's _allgather_base alike) receives into a
// scratch tensor of the whole output on its worker thread and then copies every rank's piece into
// the caller's output: a unit-sized allocation (fresh memory, faulted in page by page) and a copy
// of the unit on every unshard, and one more unit alive while a prefetch is in flight, the peak of
// FULL_SHARD's backward. Here every rank sends its input to each peer and receives each peer's
// input straight into that peer's place in the output; nothing is allocated or copied but its own
// piece.
//
// Every call uses a tag of its own (a per-group counter, advanced identically on every rank, as
// collectives are called in the same order), so collectives in flight together never take each
// other's messages.
#include "dist/add_scaled.h"
#include "dist/state.h"
#include "flat_param/tensor_utils.h"
#include "fsdp/errors.h"

#include <ATen/TensorIterator.h>

#include <cmath>
#include <deque>

namespace fsdp {
namespace dist {
namespace detail {

void combine_into(const at::Tensor& acc, const at::Tensor& src, ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVG:
      acc.add_(src);
      break;
    case ReduceOp::MAX:
      at::maximum_out(const_cast<at::Tensor&>(acc), acc, src);
      break;
    case ReduceOp::MIN:
      at::minimum_out(const_cast<at::Tensor&>(acc), acc, src);
      break;
  }
}

void divide_in_order(const at::Tensor& t, const std::vector<double>& divisors, size_t from) {
  for (size_t i = from; i < divisors.size(); ++i) t.div_(divisors[i]);
}

size_t fusable_divisors(at::ScalarType dtype, const std::vector<double>& divisors) {
  if (dtype != at::kFloat && dtype != at::kDouble) return 0;
  size_t count = 0;
  for (double d : divisors) {
    int exponent = 0;
    // A power of two whose reciprocal is a normal float: 2^-k is then exact in either type.
    if (count == 2 || !std::isfinite(d) || std::frexp(d, &exponent) != 0.5 || exponent < -120 ||
        exponent > 120) {
      break;
    }
    ++count;
  }
  return count;
}

void add_then_divide(const at::Tensor& acc, const at::Tensor& src,
                     const std::vector<double>& divisors, size_t count) {
  const double s1 = 1.0 / divisors[0];
  const double s2 = count > 1 ? 1.0 / divisors[1] : 1.0;  // times 1: exact, as if not there
  // Over ATen's intra-op threads, as add_ runs: TensorIterator's for_each calls the parallel_for
  // compiled into LibTorch (with its OpenMP). The header's own parallel_for would run serially
  // here, in a file built without -fopenmp: measured on 2 threads, 8M floats, 2.5 ms against 1.9
  // for add_ and div_.
  at::TensorIterator iter =
      at::TensorIteratorConfig().add_output(acc).add_input(acc).add_input(src).build();
  const bool is_float = acc.scalar_type() == at::kFloat;
  const int64_t elem = is_float ? 4 : 8;
  iter.for_each([&](char** data, const int64_t* strides, int64_t size0, int64_t size1) {
    for (int64_t j = 0; j < size1; ++j) {
      char* out = data[0] + j * strides[3];
      const char* in = data[1] + j * strides[4];
      const char* other = data[2] + j * strides[5];
      if (out != in || strides[0] != elem || strides[1] != elem || strides[2] != elem) {
        throw InternalError("add_then_divide: expected contiguous, in-place operands");
      }
      if (is_float) {
        add_then_scale(reinterpret_cast<float*>(out), reinterpret_cast<const float*>(other), size0,
                       static_cast<float>(s1), static_cast<float>(s2));
      } else {
        add_then_scale(reinterpret_cast<double*>(out), reinterpret_cast<const double*>(other),
                       size0, s1, s2);
      }
    }
  });
}

namespace {

// What every point-to-point collective's state has: the state is shared by its finish, so that a
// failure can keep it alive for good (see keep_alive_for_good()).
struct PointToPoint : PointToPointCall {
  explicit PointToPoint(PointToPointCall call) : PointToPointCall(std::move(call)) {}
  std::vector<std::pair<compat::WorkPtr, int>> sends;  // (send, peer)
};

// The reduce-scatter's state.
struct Pairwise : PointToPoint {
  using PointToPoint::PointToPoint;
  std::vector<std::vector<at::Tensor>> chunks;  // chunks[q]: the pieces of input chunk q
  std::vector<int64_t> own_offsets;             // where each of chunks[rank]'s pieces starts
  at::Tensor out;
  at::Tensor user_out;  // the caller's output where `out` is a chunk of our own (see the start)
  int64_t n = 0;
  ReduceOp op = ReduceOp::SUM;
  std::vector<double> divisors;  // applied to the sum in turn
  size_t fused = 0;              // how many of them the last addition applies (fusable_divisors)
  std::vector<at::Tensor> bufs;  // chunk-sized receive buffers
  std::deque<int> free_bufs;     // indices into bufs
  std::vector<int> peers;        // the other ranks, in rank order
  size_t next_post = 0;          // peers[next_post] is the next to receive into a buffer
  bool has_direct = false;       // the lowest peer's chunk is received straight into `out`
  std::vector<compat::WorkPtr> direct;  // ... by these receives
  // Per rank: the receives of its pieces of this rank's chunk, and the buffer they land in.
  std::vector<std::pair<std::vector<compat::WorkPtr>, int>> recv_of;

  // Posts the receives of rank q's pieces of this rank's chunk into `dst`: one per piece, of the
  // piece's size, so that they pair with q's sends (every rank splits chunk `rank` alike). Each
  // is kept in `works` (owned by this state) as soon as it is posted: should a later one fail to
  // post, those already posted stay alive with the state (see keep_alive_for_good()).
  void receive(int q, const at::Tensor& dst, std::vector<compat::WorkPtr>& works) {
    const auto& own = chunks[static_cast<size_t>(rank)];
    for (size_t i = 0; i < own.size(); ++i) {
      std::vector<at::Tensor> t{dst.narrow(0, own_offsets[i], own[i].numel())};
      works.push_back(backend->recv(t, q, tag));
    }
  }

  void post_next_receive() {
    while (next_post < peers.size() && !free_bufs.empty()) {
      const int q = peers[next_post++];
      const int b = free_bufs.front();
      free_bufs.pop_front();
      auto& slot = recv_of[static_cast<size_t>(q)];
      slot.second = b;
      receive(q, bufs[static_cast<size_t>(b)], slot.first);
    }
  }

  // acc (chunk-sized) = acc op (this rank's own chunk), or a copy of it (`first`), piece by piece;
  // `last`: the sum's last addition, which also applies the fused divisors (if any; the others,
  // and all of them where none fuse, are divided after the sum).
  void combine_own(const at::Tensor& acc, bool first, bool last) const {
    const auto& own = chunks[static_cast<size_t>(rank)];
    for (size_t i = 0; i < own.size(); ++i) {
      at::Tensor dst = acc.narrow(0, own_offsets[i], own[i].numel());
      if (first) {
        dst.copy_(own[i]);
      } else if (last && fused > 0) {
        add_then_divide(dst, own[i], divisors, fused);
      } else {
        combine_into(dst, own[i], op);
      }
    }
  }
};

// After a failed or timed-out wait, Gloo may still write into a receive buffer or read a sent
// piece, and its unbound buffers hold raw pointers to them. The state is kept alive for the rest
// of the process (the group is unusable anyway: State::failed makes later collectives refuse).
void keep_alive_for_good(const std::shared_ptr<PointToPoint>& p) {
  new std::shared_ptr<PointToPoint>(p);  // deliberately leaked, see above
}

// A send or receive that could not even be posted. Called from a catch block: c10d's errors are
// c10::Error, Gloo's own (a peer's socket already closed) other std::exceptions; either way the
// sends and receives posted before it must stay valid.
[[noreturn]] void fail_to_post(const std::shared_ptr<PointToPoint>& p, const std::string& step) {
  if (p->group_failed) p->group_failed->store(true);
  keep_alive_for_good(p);
  std::string reason = "unknown error";
  try {
    throw;
  } catch (const c10::Error& e) {
    reason = e.what_without_backtrace();
  } catch (const std::exception& e) {
    reason = e.what();
  } catch (...) {
  }
  throw DistError(p->what + " failed while " + step + ": " + reason);
}

void wait_for(const std::shared_ptr<PointToPoint>& p, const compat::WorkPtr& w,
              const std::string& step) {
  try {
    wait_backend_work(w, p->timeout, p->group_failed, p->what + " (" + step + ")");
  } catch (...) {
    keep_alive_for_good(p);
    throw;
  }
}

void wait_all(const std::shared_ptr<PointToPoint>& p, std::vector<compat::WorkPtr>& ws,
              const std::string& step) {
  for (auto& w : ws) wait_for(p, w, step);
  ws.clear();
}

void wait_sends(const std::shared_ptr<PointToPoint>& p) {
  for (auto& [w, peer] : p->sends) wait_for(p, w, "sending to rank " + std::to_string(peer));
  p->sends.clear();
}

bool aliases_any(const at::Tensor& out, const std::vector<std::vector<at::Tensor>>& chunks) {
  for (const auto& c : chunks) {
    for (const auto& t : c) {
      if (t.numel() > 0 && out.storage().is_alias_of(t.storage())) return true;
    }
  }
  return false;
}

}  // namespace

std::function<void()> start_pairwise_reduce_scatter(PointToPointCall call,
                                                    const at::Tensor& out_flat,
                                                    std::vector<std::vector<at::Tensor>> chunks,
                                                    ReduceOp op, std::vector<double> divisors) {
  if (!divisors.empty() && op != ReduceOp::SUM && op != ReduceOp::AVG) {
    throw InternalError("start_pairwise_reduce_scatter: divisors are for SUM and AVG only");
  }
  auto p = std::make_shared<Pairwise>(std::move(call));
  const int rank = p->rank, world = p->world, tag = p->tag;
  const compat::BackendPtr& backend = p->backend;
  p->chunks = std::move(chunks);
  p->out = out_flat;
  // An output that shares memory with the input (in place: this rank's own chunk) is written only
  // after every piece was read and every send is done; until then the sum goes to a chunk of its
  // own. Writing it directly would overwrite this rank's piece before it is added.
  if (aliases_any(out_flat, p->chunks) || !out_flat.is_contiguous()) {
    p->user_out = out_flat;
    p->out = fsdp::detail::empty_buffer(out_flat.numel(), out_flat.options());
  }
  p->n = out_flat.numel();
  p->op = op;
  p->divisors = std::move(divisors);
  p->fused = fusable_divisors(out_flat.scalar_type(), p->divisors);
  p->recv_of.resize(static_cast<size_t>(world));
  int64_t offset = 0;
  for (const auto& t : p->chunks[static_cast<size_t>(rank)]) {
    p->own_offsets.push_back(offset);
    offset += t.numel();
  }
  for (int q = 0; q < world; ++q) {
    if (q != rank) p->peers.push_back(q);
  }
  // For a sum, the lowest peer's piece (x0, or x1 on rank 0) is received straight into the
  // output, and the other of x0 and x1 is added to it in place: x0 + x1 either way round, the
  // same bits as the all-to-all's x0 + x1 (IEEE addition commutes; only the payload of a NaN
  // plus a NaN may differ). That saves W=2 its receive buffer and its page faults altogether. Not
  // for max/min, whose ties between +0 and -0 depend on the order.
  const bool direct = op == ReduceOp::SUM || op == ReduceOp::AVG;
  const size_t buffered = p->peers.size() - (direct ? 1 : 0);
  // Two buffers let the next piece arrive while one is combined.
  const int nbufs = static_cast<int>(std::min<size_t>(2, buffered));
  for (int b = 0; b < nbufs; ++b) {
    p->bufs.push_back(fsdp::detail::empty_buffer(p->n, p->out.options()));
    p->free_bufs.push_back(b);
  }
  try {
    for (int q : p->peers) {
      for (const auto& piece : p->chunks[static_cast<size_t>(q)]) {
        std::vector<at::Tensor> t{piece};
        p->sends.emplace_back(backend->send(t, q, tag), q);
      }
    }
    if (direct) {
      p->has_direct = true;
      p->receive(p->peers[0], p->out, p->direct);
      p->next_post = 1;
    }
    p->post_next_receive();
  } catch (...) {
    fail_to_post(p, "starting");
  }

  return [p]() {
    // Rank q's piece of this rank's chunk, once received: its buffer index, or -1 for our own.
    auto arrived = [&](int q) -> int {
      if (q == p->rank) return -1;
      auto& [ws, b] = p->recv_of[static_cast<size_t>(q)];
      wait_all(p, ws, "receiving from rank " + std::to_string(q));
      return b;
    };
    // For SUM and AVG (the only ops with divisors) the last combine is an addition: `direct`
    // received the first piece into the output, so no later combine is a `first`.
    auto combine = [&](int b, bool first, bool last) {
      if (b < 0) {
        p->combine_own(p->out, first, last);
      } else if (first) {
        p->out.copy_(p->bufs[static_cast<size_t>(b)]);
      } else if (last && p->fused > 0) {
        add_then_divide(p->out, p->bufs[static_cast<size_t>(b)], p->divisors, p->fused);
      } else {
        combine_into(p->out, p->bufs[static_cast<size_t>(b)], p->op);
      }
    };
    auto release = [&](int b) {
      if (b < 0) return;
      p->free_bufs.push_back(b);
      try {
        p->post_next_receive();
      } catch (...) {
        fail_to_post(p, "posting a receive");
      }
    };
    int q = 0;
    if (p->has_direct) {
      const int first = p->peers[0];  // 0, or 1 on rank 0
      wait_all(p, p->direct, "receiving from rank " + std::to_string(first));
      const int b = arrived(first == 0 ? 1 : 0);
      combine(b, /*first=*/false, /*last=*/p->world == 2);
      release(b);
      q = 2;
    }
    for (; q < p->world; ++q) {
      const int b = arrived(q);
      combine(b, /*first=*/q == 0, /*last=*/q == p->world - 1);
      release(b);
    }
    divide_in_order(p->out, p->divisors, p->fused);
    wait_sends(p);
    if (p->user_out.defined()) {
      p->user_out.copy_(p->out);
      release_completed(p->out);
    }
    for (auto& b : p->bufs) release_completed(b);
    // The input's pieces are dropped with the sends that referenced them: where they are the
    // caller's gradients, their memory goes back now, not when Gloo lets go of its work objects.
    p->chunks.clear();
  };
}

namespace {

// The all-gather's state.
struct PairwiseGather : PointToPoint {
  using PointToPoint::PointToPoint;
  at::Tensor out, in;
  std::vector<std::pair<compat::WorkPtr, int>> recvs;  // (receive, peer)
};

}  // namespace

std::function<void()> start_pairwise_all_gather(PointToPointCall call, const at::Tensor& out_flat,
                                                const at::Tensor& in_flat) {
  auto p = std::make_shared<PairwiseGather>(std::move(call));
  const int rank = p->rank, world = p->world, tag = p->tag;
  const compat::BackendPtr& backend = p->backend;
  p->out = out_flat;
  p->in = in_flat;
  const int64_t n = in_flat.numel();
  at::Tensor own = out_flat.narrow(0, static_cast<int64_t>(rank) * n, n);
  // An input that shares memory with the output is this rank's own piece of it (the caller
  // refuses any other overlap): nothing to copy.
  const bool in_place = in_flat.data_ptr() == own.data_ptr();
  try {
    // Peers in the order rank+1, rank+2, ...: at W >= 3 the ranks do not all send to rank 0 first.
    for (int k = 1; k < world; ++k) {
      const int q = (rank + k) % world;
      std::vector<at::Tensor> dst{out_flat.narrow(0, static_cast<int64_t>(q) * n, n)};
      p->recvs.emplace_back(backend->recv(dst, q, tag), q);
    }
    for (int k = 1; k < world; ++k) {
      const int q = (rank + k) % world;
      std::vector<at::Tensor> src{in_flat};
      p->sends.emplace_back(backend->send(src, q, tag), q);
    }
  } catch (...) {
    fail_to_post(p, "starting");
  }
  // The own piece is copied while the peers' pieces travel.
  if (!in_place) own.copy_(in_flat);
  return [p]() {
    for (auto& [w, peer] : p->recvs) wait_for(p, w, "receiving from rank " + std::to_string(peer));
    p->recvs.clear();
    wait_sends(p);
    p->in = at::Tensor();
    p->out = at::Tensor();
  };
}

}  // namespace detail
}  // namespace dist
}  // namespace fsdp
