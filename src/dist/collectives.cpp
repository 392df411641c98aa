// Collectives over c10d with timeouts, and the emulations LibTorch 1.13's Gloo needs.
//
// Gloo in 1.13 has neither _allgather_base nor reduce_scatter. All-gather is pairwise send/recv
// from 4 MiB of output by default (pairwise.cpp): Gloo's own receives into a scratch tensor of the
// whole output on its worker thread and copies each rank's piece into place, in 1.13 (the list form
// of allgather whose outputs are views into the flat output) and in 2.x's _allgather_base alike.
// Reduce-scatter becomes pairwise send/recv (pairwise.cpp, the default), alltoall_base (each rank
// receives the W pieces of its own chunk into one buffer, then sums them locally in rank order) or
// allreduce of the whole tensor followed by a narrow. bench/bench_collectives measures which is
// faster.
#include <ATen/Parallel.h>

#include <cmath>
#include <functional>

#include "dist/fault_point.h"
#include "dist/state.h"
#include "fsdp/errors.h"
#include "util/message.h"
#include "util/tensor_utils.h"

namespace fsdp {
namespace dist {

using fsdp::detail::msg;
using fsdp::detail::quote;

std::string detail::describe(const char* op, const ProcessGroup& g) {
  return msg(op, " on group ", quote(g.name()), " (", fsdp::detail::rank(g.rank()), " of ",
             g.size(), ", global ", fsdp::detail::rank(g.global_ranks()[g.rank()]), ")");
}

namespace {

std::atomic<detail::FaultHook> g_fault_hook{nullptr};

// The test hook of fault_point.h, at the start of every collective.
void at_fault_point(const char* op, const ProcessGroup& g) {
  if (const detail::FaultHook hook = g_fault_hook.load(std::memory_order_relaxed))
    hook(detail::describe(op, g).c_str());
}

}  // namespace

void detail::set_fault_hook(FaultHook hook) { g_fault_hook.store(hook); }
detail::FaultHook detail::fault_hook() { return g_fault_hook.load(); }

namespace {

using detail::describe;

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVG:  // SUM, then divided by the group size here
      return c10d::ReduceOp::SUM;
    case ReduceOp::MAX:
      return c10d::ReduceOp::MAX;
    case ReduceOp::MIN:
      return c10d::ReduceOp::MIN;
  }
  throw InternalError("unknown ReduceOp");
}

void check_flat(const char* op, const ProcessGroup& g, const at::Tensor& t, const char* which) {
  if (!t.defined()) throw ValueError(msg(describe(op, g), ": ", which, " tensor is undefined"));
  if (!t.is_contiguous()) {
    throw ValueError(msg(describe(op, g), ": ", which, " tensor must be contiguous"));
  }
}

// Gloo (in 1.13 at least) has no bfloat16 or bool kernels. Moving data is dtype-blind, so those
// travel as raw bytes; reductions of bfloat16 are computed in float32 and rounded once at
// the end (more accurate than a bfloat16 reduction, documented in docs/dist.md).
bool gloo_lacks(const std::string& backend, at::ScalarType t) {
  return backend == "gloo" && (t == at::kBFloat16 || t == at::kBool);
}
// Collectives that only move data (all-gather, broadcast) send bytes whatever the dtype and
// backend: which dtypes a backend accepts varies (Gloo has no 16-bit integers and LibTorch 2.14's
// native Gloo all-gather rejects float16; NCCL has no 16-bit integers either), bytes always work,
// and moving them is the same copy (numel scales by the element size).
// A 0-d tensor (a scalar parameter, an optimizer's step) cannot be viewed as another dtype: it goes
// as its one-element 1-d view, which aliases it as the byte view must.
at::Tensor as_wire(const at::Tensor& t) { return (t.dim() == 0 ? t.view({1}) : t).view(at::kByte); }

// Staging (ProcessGroup::device()): NCCL takes CUDA tensors only, and Gloo's CUDA support varies
// by op and release, so a tensor that is not on the group's device travels through a copy there.
// This is what lets every metadata collective of the library (flags, sizes, names, CPU pieces)
// run unchanged over NCCL, and CUDA models run over Gloo.
bool elsewhere(const at::Device& d, const at::Tensor& t) { return t.device() != d; }
// Where the collective writes its result for `t`: `t` itself, or a fresh tensor on the device.
at::Tensor staged_output(const at::Device& d, const at::Tensor& t) {
  return elsewhere(d, t) ? at::empty(t.sizes(), t.options().device(d)) : t;
}
at::Tensor staged_input(const at::Device& d, const at::Tensor& t) {
  return elsewhere(d, t) ? t.to(d) : t;
}

// The finish step of a collective that ran on a stand-in (a staged copy, a float32 copy of a type
// Gloo lacks): wait for it, then copy its result into the caller's tensor.
std::function<void()> copy_back(Work inner, const at::Tensor& dst, const at::Tensor& src) {
  auto shared = std::make_shared<Work>(std::move(inner));
  return [shared, dst, src]() {
    shared->wait();
    if (!src.is_same(dst)) dst.copy_(src);
  };
}

// divide_by: finite, non-zero divisors of a sum.
void check_divisors(const char* op, const ProcessGroup& g, ReduceOp op_kind,
                    const std::vector<double>& divide_by) {
  if (divide_by.empty()) return;
  if (op_kind != ReduceOp::SUM && op_kind != ReduceOp::AVG) {
    throw ValueError(msg(describe(op, g), ": divide_by is for SUM and AVG only"));
  }
  for (double d : divide_by) {
    if (!std::isfinite(d) || d == 0.0) {
      throw ValueError(msg(describe(op, g), ": divide_by holds ", std::to_string(d),
                           "; divisors must be finite and non-zero"));
    }
  }
}

// What a reduce-scatter divides its sum by, in turn: W for AVG, then the caller's divide_by.
std::vector<double> divisors_of(ReduceOp op_kind, int world, const std::vector<double>& divide_by) {
  std::vector<double> divisors;
  if (op_kind == ReduceOp::AVG) divisors.push_back(world);
  divisors.insert(divisors.end(), divide_by.begin(), divide_by.end());
  return divisors;
}

// The pairwise algorithms post point-to-point sends and receives that only Gloo runs safely in
// any order: NCCL ignores tags and runs a pair's sends and receives in order on one stream, so
// two ranks that each send (or each receive) first wait for each other once a piece outgrows
// NCCL's buffer, with no timeout to end it. Refused on every other backend, at any group size
// (the same program must not work at W=1 and hang at W=2).
void pairwise_needs_gloo(const char* op, const ProcessGroup& g, const std::string& backend,
                         const char* algo) {
  if (backend != "gloo") {
    throw ValueError(msg(describe(op, g), ": ", algo, " needs the gloo backend, not ", backend));
  }
}

}  // namespace

std::vector<std::vector<at::Tensor>> detail::equal_chunks(const at::Tensor& in_flat, int world,
                                                          int64_t n) {
  std::vector<std::vector<at::Tensor>> chunks(static_cast<size_t>(world));
  for (int q = 0; q < world; ++q) chunks[static_cast<size_t>(q)] = {in_flat.narrow(0, q * n, n)};
  return chunks;
}

detail::PointToPointCall ProcessGroup::State::next_point_to_point(std::string what) {
  if (const detail::FaultHook hook = g_fault_hook.load(std::memory_order_relaxed))
    hook(what.c_str());
  detail::PointToPointCall call;
  call.backend = backend;
  call.rank = rank;
  call.world = size;
  call.tag = static_cast<int>(next_pairwise_tag++ & 0x7fffffffu);
  call.timeout = detail::work_timeout(backend_name, timeout);
  call.group_failed = failed;
  call.what = std::move(what);
  return call;
}

Work detail::GroupInternals::launch(const ProcessGroup& self, const char* op, compat::WorkPtr work,
                                    std::function<void()> finish) {
  Work w;
  w.pending_ = std::make_unique<Work::Pending>();
  w.pending_->work = std::move(work);
  w.pending_->finish = std::move(finish);
  w.pending_->what = describe(op, self);
  w.pending_->group_failed = self.state_->failed;
  w.pending_->timeout = detail::work_timeout(self.state_->backend_name, self.state_->timeout);
  return w;
}

// Starting a collective can itself throw (a backend that lacks the op, a closed connection).
#define FSDP_START(op, expr)                                                       \
  [&]() -> compat::WorkPtr {                                                       \
    at_fault_point(op, *this);                                                     \
    try {                                                                          \
      return (expr);                                                               \
    } catch (const c10::Error& e) {                                                \
      state_->failed->store(true);                                                 \
      throw DistError(msg(describe(op, *this), ": ", e.what_without_backtrace())); \
    }                                                                              \
  }()

// ---------------------------------------------------------------------------------------------
// All-gather

// From this output size up, AUTO on Gloo is pairwise. Measured in training steps (bench_scaling,
// W=2, FULL_SHARD, LibTorch 1.13, interleaved A/B of the two): with 2 MB units pairwise made the
// step 20% slower (178 against 147 ms: about 1 ms more per all-gather, there in flight beside the
// computation), with 5 MB units the two were level (336 against 340 ms), with 12.5 MB units
// pairwise was 8% faster (720 against 785 ms) and holds a unit less at the peak. Small outputs
// cost little memory anyway.
constexpr int64_t kPairwiseAllGatherMinBytes = int64_t{4} << 20;

// Pieces land in the output while the input is still being sent (PAIRWISE, HIERARCHICAL): an
// input inside the output must be this rank's own piece of it (in place), where nothing lands.
void detail::GroupInternals::check_in_place_piece(const ProcessGroup& self, const char* op,
                                                  const at::Tensor& out_flat,
                                                  const at::Tensor& in_flat) {
  const State& s = Internals::checked_state(self, op);
  const auto lo = reinterpret_cast<uintptr_t>(out_flat.data_ptr());
  const auto from = reinterpret_cast<uintptr_t>(in_flat.data_ptr());
  const auto bytes = static_cast<uintptr_t>(in_flat.numel() * in_flat.element_size());
  const bool overlaps = from < lo + bytes * s.size && from + bytes > lo;
  if (overlaps && from != lo + bytes * s.rank) {
    throw ValueError(msg(describe(op, self),
                         ": the input overlaps the output other than at this "
                         "rank's own piece of it (bytes ",
                         bytes * s.rank, " to ", bytes * (s.rank + 1), " of the output)"));
  }
}

Work ProcessGroup::all_gather_into_tensor_async(const at::Tensor& output, const at::Tensor& input,
                                                AllGatherAlgo algo) {
  const char* op = "all_gather_into_tensor";
  State& s = Internals::checked_state(*this, op);
  check_flat(op, *this, output, "output");
  check_flat(op, *this, input, "input");
  if (output.numel() != input.numel() * s.size || output.scalar_type() != input.scalar_type()) {
    throw ValueError(msg(describe(op, *this), ": output has ", output.numel(), " elements of ",
                         output.scalar_type(), ", expected ", input.numel() * s.size, " of ",
                         input.scalar_type()));
  }
  if (algo == AllGatherAlgo::PAIRWISE) {
    pairwise_needs_gloo(op, *this, s.backend_name, "AllGatherAlgo::PAIRWISE");
  }
  const bool by_host =
      Internals::routed(*this, op, algo == AllGatherAlgo::HIERARCHICAL, algo == AllGatherAlgo::AUTO,
                        output.numel() * output.element_size());
  if (elsewhere(s.device, output) || elsewhere(s.device, input)) {
    at::Tensor out = staged_output(s.device, output);
    return Internals::launch(
        *this, op, {},
        copy_back(all_gather_into_tensor_async(out, staged_input(s.device, input), algo), output,
                  out));
  }
  // Gloo divides by the element count (SIGFPE on 0); every member passes the same shapes, so all
  // of them skip together.
  if (s.size == 1 || input.numel() == 0) {
    output.view(-1).copy_(input.view(-1).repeat({s.size}));
    return Internals::launch(*this, op, {});
  }
  at::Tensor out_flat = as_wire(output.view(-1));
  at::Tensor in_flat = as_wire(input.view(-1));
  if (by_host) {
    Internals::check_in_place_piece(*this, op, out_flat, in_flat);
    return Internals::routed_all_gather(*this, out_flat, in_flat);
  }
  if (algo == AllGatherAlgo::AUTO) {
    // Gloo's own all-gather allocates and copies a whole output's worth on every call (see
    // pairwise.cpp): pairwise from kPairwiseAllGatherMinBytes, where that matters (docs/dist.md).
    const bool big = out_flat.numel() * out_flat.element_size() >= kPairwiseAllGatherMinBytes;
    algo = s.backend_name == "gloo" && big ? AllGatherAlgo::PAIRWISE : AllGatherAlgo::NATIVE;
  }
  if (algo == AllGatherAlgo::PAIRWISE) {
    Internals::check_in_place_piece(*this, op, out_flat, in_flat);
    return Internals::launch(*this, op, {},
                             detail::start_pairwise_all_gather(
                                 s.next_point_to_point(describe(op, *this)), out_flat, in_flat));
  }
  if (compat::native_flat_collectives(s.backend_name)) {
    return Internals::launch(
        *this, op,
        FSDP_START(op, s.backend->_allgather_base(out_flat, in_flat, c10d::AllgatherOptions())));
  }
  std::vector<std::vector<at::Tensor>> outs(1);
  const int64_t n = in_flat.numel();
  for (int r = 0; r < s.size; ++r) outs[0].push_back(out_flat.narrow(0, r * n, n));
  std::vector<at::Tensor> ins{in_flat};
  c10d::AllgatherOptions opts;
  opts.timeout = s.timeout;
  return Internals::launch(*this, op, FSDP_START(op, s.backend->allgather(outs, ins, opts)));
}

void ProcessGroup::all_gather_into_tensor(const at::Tensor& output, const at::Tensor& input,
                                          AllGatherAlgo algo) {
  all_gather_into_tensor_async(output, input, algo).wait();
}

// ---------------------------------------------------------------------------------------------
// Reduce-scatter

namespace {

// reduce_scatter_tensor's argument checks, in the order their errors take precedence.
void check_reduce_scatter_args(const char* op, const ProcessGroup& g, int world,
                               const std::string& backend, const at::Tensor& output,
                               const at::Tensor& input, ReduceOp op_kind, ReduceScatterAlgo algo,
                               const std::vector<double>& divide_by) {
  check_divisors(op, g, op_kind, divide_by);
  check_flat(op, g, output, "output");
  check_flat(op, g, input, "input");
  const int64_t n = output.numel();
  if (input.numel() != n * world || output.scalar_type() != input.scalar_type()) {
    throw ValueError(msg(describe(op, g), ": input has ", input.numel(), " elements of ",
                         input.scalar_type(), ", expected ", n * world, " (output ", n, " x ",
                         world, " ranks) of ", output.scalar_type()));
  }
  if (algo == ReduceScatterAlgo::PAIRWISE) {
    pairwise_needs_gloo(op, g, backend, "ReduceScatterAlgo::PAIRWISE");
  }
}

// The algorithm a reduce-scatter of op_kind over `backend` runs: `algo` as given, or AUTO's
// choice. Throws for NATIVE where the backend's native form would not honour op_kind.
ReduceScatterAlgo resolve_reduce_scatter_algo(const char* op, const ProcessGroup& g,
                                              const std::string& backend, ReduceOp op_kind,
                                              ReduceScatterAlgo algo) {
  const bool native_ok = compat::native_flat_collectives(backend) &&
                         compat::native_reduce_scatter_honours(backend, to_c10d(op_kind));
  if (algo == ReduceScatterAlgo::NATIVE && !native_ok) {
    // Refuse rather than return a silently wrong reduction (Gloo's native form always sums).
    throw ValueError(msg(describe(op, g), ": the ", backend,
                         " backend has no native reduce-scatter that honours this op; use AUTO"));
  }
  if (algo == ReduceScatterAlgo::AUTO) {
    // Measured with bench/bench_collectives (docs/dist.md): on Gloo, alltoall + local sum is
    // 2-3x faster than allreduce + narrow from 1 MiB per rank up (half the bytes) and level or
    // ahead below; its rank-ordered sum is also reproducible bit for bit. Pairwise moves the same
    // bytes with the same sum, 1.4-2.7x faster again, holding 1/W or 2/W of the input in scratch
    // where the all-to-all holds all of it. Gloo's own
    // _reduce_scatter_base (LibTorch 2.x) is no better than allreduce + narrow: it is exactly
    // that, on a clone of the input made on the caller's thread and released by Gloo's worker
    // thread whenever it drops its work, so it also costs a unit of memory at a moment that
    // varies from run to run. Native is the default only where it is a real reduce-scatter.
    algo = native_ok && backend != "gloo" ? ReduceScatterAlgo::NATIVE : ReduceScatterAlgo::PAIRWISE;
  }
  return algo;
}

// The finish step of ALL_TO_ALL: `recv` holds the W pieces of this rank's chunk, n elements each,
// in rank order; they are combined into out_flat, `divide` divides the result, and `recv` goes.
template <typename Divide>
std::function<void()> combine_all_to_all(at::Tensor recv, at::Tensor out_flat, ReduceOp op_kind,
                                         int world, int64_t n, Divide divide) {
  return [recv, out_flat, op_kind, world, n, divide]() {
    // Rank order, one row at a time: every rank reduces its chunk in the same order, so the
    // result is deterministic and equals a sequential sum over ranks 0..W-1.
    // The first two rows are combined straight into the output (one pass, not a copy and
    // then an add); the same sums in the same order.
    int r = 1;
    if (op_kind == ReduceOp::SUM || op_kind == ReduceOp::AVG) {
      at::Tensor out = out_flat;
      at::add_out(out, recv.narrow(0, 0, n), recv.narrow(0, n, n));
      r = 2;
    } else {
      out_flat.copy_(recv.narrow(0, 0, n));
    }
    for (; r < world; ++r) detail::combine_into(out_flat, recv.narrow(0, r * n, n), op_kind);
    divide();
    detail::release_completed(recv);
  };
}

}  // namespace

// Long because it is one dispatch: the stand-ins (staging, float32 for bfloat16), then the route
// by host or one of four algorithms, each a few lines; split up, the choice would be scattered.
Work ProcessGroup::reduce_scatter_tensor_async(const at::Tensor& output, const at::Tensor& input,
                                               ReduceOp op_kind, ReduceScatterAlgo algo,
                                               const std::vector<double>& divide_by) {
  const char* op = "reduce_scatter_tensor";
  State& s = Internals::checked_state(*this, op);
  check_reduce_scatter_args(op, *this, s.size, s.backend_name, output, input, op_kind, algo,
                            divide_by);
  const bool by_host =
      Internals::routed(*this, op, algo == ReduceScatterAlgo::HIERARCHICAL,
                        algo == ReduceScatterAlgo::AUTO, input.numel() * input.element_size());
  const int64_t n = output.numel();
  if (elsewhere(s.device, output) || elsewhere(s.device, input)) {
    at::Tensor out = staged_output(s.device, output);
    return Internals::launch(
        *this, op, {},
        copy_back(reduce_scatter_tensor_async(out, staged_input(s.device, input), op_kind, algo,
                                              divide_by),
                  output, out));
  }
  if (gloo_lacks(s.backend_name, input.scalar_type()) && s.size > 1 && n > 0) {
    if (input.scalar_type() == at::kBool) {
      throw ValueError(msg(describe(op, *this), ": bool tensors cannot be reduced over Gloo"));
    }
    at::Tensor out32 = at::empty({n}, output.options().dtype(at::kFloat));
    return Internals::launch(*this, op, {},
                             copy_back(reduce_scatter_tensor_async(out32, input.to(at::kFloat),
                                                                   op_kind, algo, divide_by),
                                       output.view(-1), out32));
  }
  at::Tensor out_flat = output.view(-1);
  at::Tensor in_flat = input.view(-1);
  const int world = s.size;
  std::vector<double> divisors = divisors_of(op_kind, world, divide_by);
  auto divide = [out_flat, divisors]() { detail::divide_in_order(out_flat, divisors); };
  if (world == 1 || n == 0) {
    out_flat.copy_(in_flat);
    divide();
    return Internals::launch(*this, op, {});
  }
  if (by_host) {
    return Internals::routed_reduce_scatter(
        *this, op, out_flat, detail::equal_chunks(in_flat, world, n), op_kind, std::move(divisors));
  }
  switch (resolve_reduce_scatter_algo(op, *this, s.backend_name, op_kind, algo)) {
    case ReduceScatterAlgo::NATIVE: {
      c10d::ReduceScatterOptions opts;
      opts.reduceOp = to_c10d(op_kind);
      opts.timeout = s.timeout;
      auto w = FSDP_START(op, s.backend->_reduce_scatter_base(out_flat, in_flat, opts));
      return Internals::launch(*this, op, std::move(w), divide);
    }
    case ReduceScatterAlgo::ALL_TO_ALL: {
      at::Tensor recv = fsdp::detail::empty_buffer(in_flat.numel(), in_flat.options());
      c10d::AllToAllOptions opts;
      opts.timeout = s.timeout;
      std::vector<int64_t> splits;  // empty: equal splits
      auto w = FSDP_START(op, s.backend->alltoall_base(recv, in_flat, splits, splits, opts));
      return Internals::launch(
          *this, op, std::move(w),
          combine_all_to_all(std::move(recv), out_flat, op_kind, world, n, divide));
    }
    case ReduceScatterAlgo::ALL_REDUCE: {
      at::Tensor tmp = in_flat.clone();
      c10d::AllreduceOptions opts;
      opts.reduceOp = to_c10d(op_kind);
      opts.timeout = s.timeout;
      std::vector<at::Tensor> ts{tmp};
      auto w = FSDP_START(op, s.backend->allreduce(ts, opts));
      const int64_t start = static_cast<int64_t>(s.rank) * n;
      return Internals::launch(*this, op, std::move(w), [tmp, out_flat, start, n, divide]() {
        out_flat.copy_(tmp.narrow(0, start, n));
        divide();
        detail::release_completed(tmp);
      });
    }
    case ReduceScatterAlgo::PAIRWISE:
      return Internals::launch_pairwise(*this, op, out_flat,
                                        detail::equal_chunks(in_flat, world, n), op_kind,
                                        std::move(divisors));
    case ReduceScatterAlgo::AUTO:
    case ReduceScatterAlgo::HIERARCHICAL:  // routed above
      break;
  }
  throw InternalError("reduce_scatter_tensor: unhandled algorithm");
}

void ProcessGroup::reduce_scatter_tensor(const at::Tensor& output, const at::Tensor& input,
                                         ReduceOp op, ReduceScatterAlgo algo,
                                         const std::vector<double>& divide_by) {
  reduce_scatter_tensor_async(output, input, op, algo, divide_by).wait();
}

Work ProcessGroup::reduce_scatter_pieces_async(const at::Tensor& output,
                                               std::vector<std::vector<at::Tensor>> chunks,
                                               ReduceOp op_kind, ReduceScatterAlgo algo,
                                               const std::vector<double>& divide_by) {
  const char* op = "reduce_scatter_pieces";
  State& s = Internals::checked_state(*this, op);
  check_divisors(op, *this, op_kind, divide_by);
  check_flat(op, *this, output, "output");
  const int64_t n = output.numel();
  if (chunks.size() != static_cast<size_t>(s.size)) {
    throw ValueError(msg(describe(op, *this), ": expected ", s.size, " chunks (one per rank), got ",
                         chunks.size()));
  }
  if (algo == ReduceScatterAlgo::PAIRWISE) {
    pairwise_needs_gloo(op, *this, s.backend_name, "ReduceScatterAlgo::PAIRWISE");
  }
  const bool by_host = Internals::routed(*this, op, algo == ReduceScatterAlgo::HIERARCHICAL,
                                         algo == ReduceScatterAlgo::AUTO,
                                         n * s.size * static_cast<int64_t>(output.element_size()));
  bool on_device = !elsewhere(s.device, output);
  for (size_t q = 0; q < chunks.size(); ++q) {
    int64_t total = 0;
    std::vector<at::Tensor> kept;
    for (const at::Tensor& t : chunks[q]) {
      const std::string which = msg("piece of chunk ", q);
      check_flat(op, *this, t, which.c_str());
      if (t.scalar_type() != output.scalar_type()) {
        throw ValueError(msg(describe(op, *this), ": ", which, " is ", t.scalar_type(),
                             ", the output ", output.scalar_type()));
      }
      total += t.numel();
      on_device = on_device && !elsewhere(s.device, t);
      if (t.numel() > 0) kept.push_back(t.view(-1));  // empty pieces are no messages
    }
    if (total != n) {
      throw ValueError(
          msg(describe(op, *this), ": chunk ", q, " has ", total, " elements, the output ", n));
    }
    chunks[q] = std::move(kept);
  }
  const bool pairwise = by_host || algo == ReduceScatterAlgo::PAIRWISE ||
                        (algo == ReduceScatterAlgo::AUTO && s.backend_name == "gloo");
  if (!pairwise || !on_device || s.size == 1 || n == 0 ||
      gloo_lacks(s.backend_name, output.scalar_type())) {
    // Everything else goes through the flat form, on one concatenated copy of the input.
    std::vector<at::Tensor> all;
    for (auto& c : chunks) all.insert(all.end(), c.begin(), c.end());
    at::Tensor flat = all.empty() ? at::empty({0}, output.options()) : at::cat(all);
    return reduce_scatter_tensor_async(output, flat, op_kind, algo, divide_by);
  }
  if (by_host) {
    return Internals::routed_reduce_scatter(*this, op, output.view(-1), std::move(chunks), op_kind,
                                            divisors_of(op_kind, s.size, divide_by));
  }
  return Internals::launch_pairwise(*this, op, output.view(-1), std::move(chunks), op_kind,
                                    divisors_of(op_kind, s.size, divide_by));
}

Work detail::GroupInternals::launch_pairwise(ProcessGroup& self, const char* op,
                                             const at::Tensor& out_flat,
                                             std::vector<std::vector<at::Tensor>> chunks,
                                             ReduceOp op_kind, std::vector<double> divisors) {
  State& s = Internals::checked_state(self, op);
  std::function<void()> finish =
      detail::start_pairwise_reduce_scatter(s.next_point_to_point(describe(op, self)), out_flat,
                                            std::move(chunks), op_kind, std::move(divisors));
  return Internals::launch(self, op, {}, std::move(finish));
}

// ---------------------------------------------------------------------------------------------
// All-to-all

void ProcessGroup::all_to_all_single(const at::Tensor& output, const at::Tensor& input,
                                     const std::vector<int64_t>& output_split_sizes,
                                     const std::vector<int64_t>& input_split_sizes) {
  const char* op = "all_to_all_single";
  State& s = Internals::checked_state(*this, op);
  check_flat(op, *this, output, "output");
  check_flat(op, *this, input, "input");
  auto check_splits = [&](const std::vector<int64_t>& splits, const at::Tensor& t,
                          const char* which) {
    if (splits.empty()) {
      if (t.numel() % s.size != 0) {
        throw ValueError(msg(describe(op, *this), ": ", which, " has ", t.numel(),
                             " elements, not divisible into equal splits"));
      }
      return;
    }
    int64_t total = 0;
    for (int64_t n : splits) {
      if (n < 0) throw ValueError(msg(describe(op, *this), ": negative ", which, " split size"));
      total += n;
    }
    if (static_cast<int>(splits.size()) != s.size || total != t.numel()) {
      throw ValueError(msg(describe(op, *this), ": ", splits.size(), " ", which,
                           " split sizes summing to ", total, " for ", t.numel(), " elements and ",
                           s.size, " ranks"));
    }
  };
  check_splits(output_split_sizes, output, "output");
  check_splits(input_split_sizes, input, "input");
  if (output.scalar_type() != input.scalar_type()) {
    throw ValueError(msg(describe(op, *this), ": input and output dtypes differ"));
  }
  if (elsewhere(s.device, output) || elsewhere(s.device, input)) {
    at::Tensor out = staged_output(s.device, output);
    all_to_all_single(out, staged_input(s.device, input), output_split_sizes, input_split_sizes);
    if (!out.is_same(output)) output.copy_(out);
    return;
  }
  if (s.size == 1) {
    output.view(-1).copy_(input.view(-1));
    return;
  }
  // Bytes on the wire: dtype-blind, and every backend moves uint8.
  const int64_t esz = static_cast<int64_t>(input.element_size());
  auto scaled = [esz](const std::vector<int64_t>& splits) {
    std::vector<int64_t> out;
    for (int64_t n : splits) out.push_back(n * esz);
    return out;
  };
  std::vector<int64_t> out_splits = scaled(output_split_sizes);
  std::vector<int64_t> in_splits = scaled(input_split_sizes);
  at::Tensor out_bytes = output.view(-1).view(at::kByte);
  at::Tensor in_bytes = input.view(-1).view(at::kByte);
  c10d::AllToAllOptions opts;
  opts.timeout = s.timeout;
  Internals::launch(
      *this, op,
      FSDP_START(op, s.backend->alltoall_base(out_bytes, in_bytes, out_splits, in_splits, opts)))
      .wait();
}

// ---------------------------------------------------------------------------------------------
// All-reduce, broadcast, barrier

Work ProcessGroup::all_reduce_async(const at::Tensor& tensor, ReduceOp op_kind) {
  const char* op = "all_reduce";
  State& s = Internals::checked_state(*this, op);
  check_flat(op, *this, tensor, "input");
  if (s.size == 1 || tensor.numel() == 0) return Internals::launch(*this, op, {});
  if (elsewhere(s.device, tensor)) {
    at::Tensor t = staged_input(s.device, tensor);
    return Internals::launch(*this, op, {}, copy_back(all_reduce_async(t, op_kind), tensor, t));
  }
  if (gloo_lacks(s.backend_name, tensor.scalar_type())) {
    if (tensor.scalar_type() == at::kBool) {
      throw ValueError(msg(describe(op, *this), ": bool tensors cannot be reduced over Gloo"));
    }
    at::Tensor t32 = tensor.to(at::kFloat);
    return Internals::launch(*this, op, {}, copy_back(all_reduce_async(t32, op_kind), tensor, t32));
  }
  if (Internals::routed(*this, op, false, true,
                        tensor.numel() * static_cast<int64_t>(tensor.element_size()))) {
    return Internals::routed_all_reduce(*this, tensor, op_kind);
  }
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(op_kind);
  opts.timeout = s.timeout;
  std::vector<at::Tensor> ts{tensor};
  auto w = FSDP_START(op, s.backend->allreduce(ts, opts));
  const int world = s.size;
  return Internals::launch(*this, op, std::move(w), [tensor, op_kind, world]() {
    if (op_kind == ReduceOp::AVG) tensor.div_(world);
  });
}

void ProcessGroup::all_reduce(const at::Tensor& tensor, ReduceOp op) {
  all_reduce_async(tensor, op).wait();
}

void ProcessGroup::broadcast(const at::Tensor& tensor, int src) {
  const char* op = "broadcast";
  State& s = Internals::checked_state(*this, op);
  check_flat(op, *this, tensor, "input");
  if (src < 0 || src >= s.size) {
    throw ValueError(
        msg(describe(op, *this), ": source ", fsdp::detail::rank(src), " is out of range"));
  }
  if (s.size == 1 || tensor.numel() == 0) return;
  if (elsewhere(s.device, tensor)) {
    at::Tensor t = staged_input(s.device, tensor);
    broadcast(t, src);
    tensor.copy_(t);
    return;
  }
  c10d::BroadcastOptions opts;
  opts.rootRank = src;
  opts.timeout = s.timeout;
  std::vector<at::Tensor> ts{as_wire(tensor)};
  Internals::launch(*this, op, FSDP_START(op, s.backend->broadcast(ts, opts))).wait();
}

void ProcessGroup::barrier() {
  const char* op = "barrier";
  State& s = Internals::checked_state(*this, op);
  if (s.size == 1) return;
  c10d::BarrierOptions opts;
  opts.timeout = s.timeout;
  Internals::launch(*this, op, FSDP_START(op, s.backend->barrier(opts))).wait();
}

}  // namespace dist
}  // namespace fsdp
