// Collectives out of point-to-point sends and receives on the backend (Gloo): the reduce-scatter
// (ReduceScatterAlgo::PAIRWISE) and the all-gather (AllGatherAlgo::PAIRWISE).
//
// Reduce-scatter. Why not the all-to-all: alltoall_base needs a receive buffer the size of the
// whole input (W pieces, one of them this rank's own, copied locally by Gloo), so a unit's
// reduction holds two unit-sized buffers at the peak of backward: the flat gradient and that
// receive buffer. Here every rank sends piece q of its input to rank q, receives the first piece of
// its own chunk straight into the output (sums) and the others into at most two chunk-sized
// buffers, reused as the sum goes on, and reads its own piece in place: W=2 needs no scratch at
// all, W=4 one or two chunks where the all-to-all holds a whole unit. The sum is the all-to-all's,
// in rank order, so the results are bit-identical to ALL_TO_ALL.
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
#include "fsdp/errors.h"
#include "util/message.h"
#include "util/tensor_utils.h"

#include <ATen/TensorIterator.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

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

void sum_then_divide(const at::Tensor& acc, const std::vector<at::Tensor>& srcs,
                     const std::vector<double>& divisors, size_t count) {
  if (count > divisors.size() || count > 2) {
    throw InternalError("sum_then_divide: more fused divisors than the kernel applies");
  }
  const double s1 = count > 0 ? 1.0 / divisors[0] : 1.0;  // times 1: exact, as if not there
  const double s2 = count > 1 ? 1.0 / divisors[1] : 1.0;
  // Over ATen's intra-op threads, as add_ runs: TensorIterator's for_each calls the parallel_for
  // compiled into LibTorch (with its OpenMP). The header's own parallel_for would run serially
  // here, in a file built without -fopenmp: measured on 2 threads, 8M floats, 2.5 ms against 1.9
  // for add_ and div_.
  at::TensorIteratorConfig config;
  config.add_output(acc).add_input(acc);
  for (const auto& s : srcs) config.add_input(s);
  at::TensorIterator iter = config.build();
  const bool is_float = acc.scalar_type() == at::kFloat;
  if (!is_float && acc.scalar_type() != at::kDouble) {
    throw InternalError("sum_then_divide: float and double only");
  }
  const int k = static_cast<int>(srcs.size());
  const int ntensors = k + 2;  // the output, acc as an input, the sources
  auto loop = [&](auto zero) {
    using T = decltype(zero);
    iter.for_each([&](char** data, const int64_t* strides, int64_t size0, int64_t size1) {
      std::vector<const T*> src(static_cast<size_t>(k));  // per call: calls run on several threads
      for (int t = 0; t < ntensors; ++t) {
        if (strides[t] != static_cast<int64_t>(sizeof(T))) {
          throw InternalError("sum_then_divide: expected contiguous operands");
        }
      }
      for (int64_t j = 0; j < size1; ++j) {
        char* out = data[0] + j * strides[ntensors];
        if (out != data[1] + j * strides[ntensors + 1]) {
          throw InternalError("sum_then_divide: expected an in-place accumulator");
        }
        for (int t = 0; t < k; ++t) {
          src[static_cast<size_t>(t)] =
              reinterpret_cast<const T*>(data[t + 2] + j * strides[ntensors + t + 2]);
        }
        sum_then_scale(reinterpret_cast<T*>(out), src.data(), k, size0, static_cast<T>(s1),
                       static_cast<T>(s2));
      }
    });
  };
  if (is_float) {
    loop(0.0f);
  } else {
    loop(0.0);
  }
}

// What every point-to-point collective's state has: the state is shared by its finish, so that a
// failure can keep it alive for good (see keep_alive_for_good()). Outside the anonymous namespace:
// Exchange, declared in state.h, derives from it.
struct PointToPoint : PointToPointCall {
  explicit PointToPoint(PointToPointCall call) : PointToPointCall(std::move(call)) {}
  std::vector<std::pair<compat::WorkPtr, int>> sends;  // (send, peer)
};

namespace {

using fsdp::detail::msg;
using fsdp::detail::rank;

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
  std::vector<char> posted;  // per rank: its receives into a buffer are posted

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
      posted[static_cast<size_t>(q)] = 1;
      receive(q, bufs[static_cast<size_t>(b)], slot.first);
    }
  }

  // Rank q's pieces can be combined once waited for: ours, or received into a posted buffer.
  bool ready(int q) const { return q == rank || posted[static_cast<size_t>(q)] != 0; }

  // A sum of float or double adds several ranks' pieces in one pass (sum_then_divide).
  bool sums_in_one_pass() const {
    return (op == ReduceOp::SUM || op == ReduceOp::AVG) &&
           (out.scalar_type() == at::kFloat || out.scalar_type() == at::kDouble);
  }

  // out = out op (the pieces of `group`'s ranks, in order), or, with `first`, out = the first of
  // them op the rest. `last`: the sum's last addition, which also applies the fused divisors (if
  // any; the others, and all of them where none fuse, are divided after the sum). One pass over
  // the chunk for the whole group where sums_in_one_pass(), else one combine per rank.
  void combine_group(const std::vector<int>& group, bool first, bool last) const {
    const auto& own = chunks[static_cast<size_t>(rank)];
    // The stretches of the chunk over which every operand is one tensor: our own pieces where our
    // own chunk is in the group, else the whole chunk.
    struct Stretch {
      int64_t offset, length;
      size_t own_piece;
    };
    std::vector<Stretch> stretches;
    if (std::find(group.begin(), group.end(), rank) != group.end()) {
      for (size_t i = 0; i < own.size(); ++i)
        stretches.push_back({own_offsets[i], own[i].numel(), i});
    } else {
      stretches.push_back({0, n, 0});
    }
    const bool one_pass = sums_in_one_pass();
    for (const Stretch& st : stretches) {
      at::Tensor dst = out.narrow(0, st.offset, st.length);
      std::vector<at::Tensor> srcs;
      for (int q : group) {
        srcs.push_back(
            q == rank ? own[st.own_piece]
                      : bufs[static_cast<size_t>(recv_of[static_cast<size_t>(q)].second)].narrow(
                            0, st.offset, st.length));
      }
      if (first) {
        dst.copy_(srcs.front());
        srcs.erase(srcs.begin());
      }
      if (one_pass) {
        sum_then_divide(dst, srcs, divisors, last ? fused : 0);
      } else {
        for (const auto& src : srcs) combine_into(dst, src, op);
      }
    }
  }
};

// After a failed or timed-out wait, Gloo may still write into a receive buffer or read a sent
// piece, and its unbound buffers hold raw pointers to them. The state is kept alive for the rest
// of the process (the group is unusable anyway: State::failed makes later collectives refuse),
// in a list that is never destroyed, not even at exit, when Gloo's threads may still use it.
// Reachable from a global, it is not a leak to LeakSanitizer (scripts/sanitize.sh).
void keep_alive_for_good(const std::shared_ptr<PointToPoint>& p) {
  static std::mutex mu;
  static auto* kept = new std::vector<std::shared_ptr<PointToPoint>>();
  std::lock_guard<std::mutex> lock(mu);
  kept->push_back(p);
}

// After a failure of our own (a send or receive that could not be posted, a throw in the sum)
// the sends and receives already posted may still be in flight: the group is marked failed, as a
// failed wait marks it, and the state kept alive for good.
void abandon(const std::shared_ptr<PointToPoint>& p) {
  if (p->group_failed) p->group_failed->store(true);
  keep_alive_for_good(p);
}

// A send or receive that could not even be posted. Called from a catch block: c10d's errors are
// c10::Error, Gloo's own (a peer's socket already closed) other std::exceptions; either way the
// sends and receives posted before it must stay valid.
[[noreturn]] void fail_to_post(const std::shared_ptr<PointToPoint>& p, const std::string& step) {
  abandon(p);
  std::string reason = "unknown error";
  try {
    throw;
  } catch (const c10::Error& e) {
    reason = e.what_without_backtrace();
  } catch (const std::exception& e) {
    reason = e.what();
  } catch (...) {
  }
  throw DistError(msg(p->what, " failed while ", step, ": ", reason));
}

void wait_for(const std::shared_ptr<PointToPoint>& p, const compat::WorkPtr& w,
              const std::string& step) {
  try {
    wait_backend_work(w, p->timeout, p->group_failed, msg(p->what, " (", step, ")"));
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
  for (auto& [w, peer] : p->sends) wait_for(p, w, msg("sending to ", rank(peer)));
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

// The reduce-scatter's state, up to its receive buffers: the input's chunks, the output (or a
// chunk of our own standing in for it), the divisors, and where this rank's pieces start.
std::shared_ptr<Pairwise> make_pairwise(PointToPointCall call, const at::Tensor& out_flat,
                                        std::vector<std::vector<at::Tensor>> chunks, ReduceOp op,
                                        std::vector<double> divisors) {
  auto p = std::make_shared<Pairwise>(std::move(call));
  const int rank = p->rank, world = p->world;
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
  p->posted.resize(static_cast<size_t>(world));
  int64_t offset = 0;
  for (const auto& t : p->chunks[static_cast<size_t>(rank)]) {
    p->own_offsets.push_back(offset);
    offset += t.numel();
  }
  for (int q = 0; q < world; ++q) {
    if (q != rank) p->peers.push_back(q);
  }
  return p;
}

// The start: every send, the direct receive (`direct`), and the receives into the free buffers.
void post_pairwise(const std::shared_ptr<Pairwise>& p, bool direct) {
  const int tag = p->tag;
  const compat::BackendPtr& backend = p->backend;
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
}

// Rank q's piece of this rank's chunk, once received: its buffer index, or -1 for our own.
int arrived(const std::shared_ptr<Pairwise>& p, int q) {
  if (q == p->rank) return -1;
  auto& [ws, b] = p->recv_of[static_cast<size_t>(q)];
  wait_all(p, ws, msg("receiving from ", rank(q)));
  return b;
}

// Buffer b (none for -1) is free again: the next receive goes into it.
void release(const std::shared_ptr<Pairwise>& p, int b) {
  if (b < 0) return;
  p->free_bufs.push_back(b);
  try {
    p->post_next_receive();
  } catch (...) {
    fail_to_post(p, "posting a receive");
  }
}

// A step of our own that throws (an allocation, an internal check) abandons the state.
template <typename Step>
void locally(const std::shared_ptr<Pairwise>& p, const Step& step) {
  try {
    step();
  } catch (...) {
    abandon(p);
    throw;
  }
}

// The ranks whose pieces are combined into the output, in the order of the sum: after the direct
// receive's peer (0, or 1 on rank 0), the other of 0 and 1, then 2, 3, ... Waits for the direct
// receive first.
std::vector<int> sum_order(const std::shared_ptr<Pairwise>& p) {
  std::vector<int> order;
  if (p->has_direct) {
    const int first = p->peers[0];
    wait_all(p, p->direct, msg("receiving from ", rank(first)));
    order.push_back(first == 0 ? 1 : 0);
    for (int q = 2; q < p->world; ++q) order.push_back(q);
  } else {
    for (int q = 0; q < p->world; ++q) order.push_back(q);
  }
  return order;
}

// A sum of float or double takes the pieces that are ready together, in one pass over the chunk
// instead of one per piece: up to W=4 all of them (two buffers and our own), since every receive
// is posted at the start. While receives remain to be posted, a group holds at most one buffer,
// so that the other keeps receiving the next piece during the pass. Other ops and dtypes go one
// piece at a time, each combined while the next arrives.
void combine_in_order(const std::shared_ptr<Pairwise>& p, const std::vector<int>& order) {
  const bool batch = p->sums_in_one_pass();
  bool first = !p->has_direct;
  for (size_t i = 0; i < order.size();) {
    if (!p->ready(order[i])) {
      abandon(p);
      throw InternalError(
          msg("pairwise reduce-scatter: ", rank(order[i]), "'s pieces were never posted"));
    }
    std::vector<int> group{order[i++]};
    int buffers = group[0] == p->rank ? 0 : 1;
    while (batch && i < order.size() && p->ready(order[i])) {
      const bool buffered = order[i] != p->rank;
      if (buffered && buffers > 0 && p->next_post < p->peers.size()) break;
      buffers += buffered ? 1 : 0;
      group.push_back(order[i++]);
    }
    std::vector<int> held;  // the buffers the group's pieces are in
    for (int q : group) {
      const int b = arrived(p, q);
      if (b >= 0) held.push_back(b);
    }
    locally(p, [&] { p->combine_group(group, first, /*last=*/i == order.size()); });
    first = false;
    for (int b : held) release(p, b);
  }
}

// The finish (Work::wait): the sum, the divisions, the sends' completion, and the output.
void finish_pairwise(const std::shared_ptr<Pairwise>& p) {
  const std::vector<int> order = sum_order(p);
  combine_in_order(p, order);
  locally(p, [&] { divide_in_order(p->out, p->divisors, p->fused); });
  wait_sends(p);
  if (p->user_out.defined()) {
    p->user_out.copy_(p->out);
    release_completed(p->out);
  }
  for (auto& b : p->bufs) release_completed(b);
  // The input's pieces are dropped with the sends that referenced them: where they are the
  // caller's gradients, their memory goes back now, not when Gloo lets go of its work objects.
  p->chunks.clear();
}

}  // namespace

std::function<void()> start_pairwise_reduce_scatter(PointToPointCall call,
                                                    const at::Tensor& out_flat,
                                                    std::vector<std::vector<at::Tensor>> chunks,
                                                    ReduceOp op, std::vector<double> divisors) {
  if (!divisors.empty() && op != ReduceOp::SUM && op != ReduceOp::AVG) {
    throw InternalError("start_pairwise_reduce_scatter: divisors are for SUM and AVG only");
  }
  auto p = make_pairwise(std::move(call), out_flat, std::move(chunks), op, std::move(divisors));
  // For a sum, the lowest peer's piece (x0, or x1 on rank 0) is received straight into the
  // output, and the other of x0 and x1 is added to it in place: x0 + x1 either way round, the
  // same bits as the all-to-all's x0 + x1 (IEEE addition commutes; only the payload of a NaN
  // plus a NaN may differ). That saves W=2 its receive buffer and its page faults altogether. Not
  // for max/min, whose ties between +0 and -0 depend on the order.
  const bool direct = op == ReduceOp::SUM || op == ReduceOp::AVG;
  const size_t buffered = p->peers.size() - (direct ? 1 : 0);
  // Two buffers: with our own chunk read in place, every piece up to W=4 is received at once and a
  // sum adds them in one pass; beyond that, the next pieces arrive while those are combined.
  const int nbufs = static_cast<int>(std::min<size_t>(2, buffered));
  for (int b = 0; b < nbufs; ++b) {
    p->bufs.push_back(fsdp::detail::empty_buffer(p->n, p->out.options()));
    p->free_bufs.push_back(b);
  }
  post_pairwise(p, direct);
  return [p]() { finish_pairwise(p); };
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
    for (auto& [w, peer] : p->recvs)
      wait_for(p, w, msg("receiving from ", fsdp::detail::rank(peer)));
    p->recvs.clear();
    wait_sends(p);
    p->in = at::Tensor();
    p->out = at::Tensor();
  };
}

struct Exchange : PointToPoint {
  using PointToPoint::PointToPoint;
  std::vector<std::pair<compat::WorkPtr, int>> recvs;  // (receive, peer), in posting order
};

std::shared_ptr<Exchange> start_exchange(PointToPointCall call) {
  return std::make_shared<Exchange>(std::move(call));
}

void exchange_recv(const std::shared_ptr<Exchange>& x, int peer, const at::Tensor& dst) {
  try {
    std::vector<at::Tensor> t{dst};
    x->recvs.emplace_back(x->backend->recv(t, peer, x->tag), peer);
  } catch (...) {
    fail_to_post(x, msg("posting a receive from ", fsdp::detail::rank(peer)));
  }
}

void exchange_send(const std::shared_ptr<Exchange>& x, int peer, const at::Tensor& src) {
  try {
    std::vector<at::Tensor> t{src};
    x->sends.emplace_back(x->backend->send(t, peer, x->tag), peer);
  } catch (...) {
    fail_to_post(x, msg("sending to ", fsdp::detail::rank(peer)));
  }
}

void exchange_wait_from(const std::shared_ptr<Exchange>& x, int peer) {
  for (auto& [w, q] : x->recvs) {
    if (q != peer || !w) continue;
    wait_for(x, w, msg("receiving from ", fsdp::detail::rank(peer)));
    w.reset();  // waited: its tensor is no longer needed here
  }
}

void exchange_abandon(const std::shared_ptr<Exchange>& x) { abandon(x); }

void exchange_finish(const std::shared_ptr<Exchange>& x) {
  for (auto& [w, q] : x->recvs) {
    if (w) wait_for(x, w, msg("receiving from ", fsdp::detail::rank(q)));
  }
  x->recvs.clear();
  wait_sends(x);
}

}  // namespace detail
}  // namespace dist
}  // namespace fsdp
