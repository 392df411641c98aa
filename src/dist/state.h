// Internal: the shared state behind fsdp::dist::ProcessGroup handles.
#pragma once

#include <atomic>
#include <functional>
#include <memory>

#include "dist/gloo_device.h"
#include "fsdp/dist.h"

namespace fsdp {
namespace dist {
namespace detail {

// What a point-to-point collective (pairwise.cpp) takes of its group for one call: the backend
// and the ranks, the timeout its waits use, the group's failure flag, the call's own tag and its
// description for errors.
struct PointToPointCall {
  compat::BackendPtr backend;
  int rank = 0, world = 1, tag = 0;
  std::chrono::milliseconds timeout{0};
  std::shared_ptr<std::atomic<bool>> group_failed;
  std::string what;
};

}  // namespace detail

// The routes of a default group whose collectives go by host (host_routes.cpp): ranks
// h * per_host .. h * per_host + per_host - 1 are host h's.
struct HostRoutes {
  ProcessGroup local;   // this host's ranks, by local rank
  ProcessGroup across;  // the ranks of this rank's local rank, one per host, by host
  int hosts = 1, per_host = 1, host = 0, local_rank = 0;
};

struct ProcessGroup::State {
  compat::BackendPtr backend;
  std::string name;
  std::string backend_name;
  at::Device device{at::kCPU};  // compat::collective_device(backend_name)
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{0};
  compat::StorePtr store;  // for sub-group rendezvous; may be null
  std::vector<int> global_ranks;
  int next_subgroup = 0;  // advanced identically on every member by new_group
  // The tag of the next pairwise reduce-scatter or all-gather, advanced identically on every member
  // (each call sends and receives under a tag of its own; pairwise.cpp).
  uint32_t next_pairwise_tag = 0;
  // The next pairwise collective's call, under the next tag (collectives.cpp).
  detail::PointToPointCall next_point_to_point(std::string what);
  detail::GlooDevice gloo_device{{}, "127.0.0.1", "lo", "the default"};
  int gloo_threads = 2;
  // Set once a collective of this group failed to start or to finish (shared with its pending
  // Works). The backend is then left to its own destructor (NCCL: abort) rather than shut down
  // gracefully, which would wait for collectives a dead peer never completes.
  std::shared_ptr<std::atomic<bool>> failed = std::make_shared<std::atomic<bool>>(false);
  // Set on a default group routed by host (InitOptions::host_aware); null: flat collectives.
  std::shared_ptr<const HostRoutes> routes;

  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  ~State();  // process_group.cpp: shuts the backend down when the last handle goes
};

namespace detail {

// What the members of ProcessGroup share and the public API does not show: the state behind a
// handle and the steps the collectives have in common. Static functions taking the group first,
// so that dist.h declares only one friend and none of them.
struct GroupInternals {
  using State = ProcessGroup::State;

  // The group's state; StateError naming `op` on a non-member placeholder.
  static State& checked_state(const ProcessGroup& self, const char* op);

  // The Work of collective `op` on `self`: waits for `work` (if any; bounded by the group's
  // timeout), then runs `finish`.
  static Work launch(const ProcessGroup& self, const char* op, compat::WorkPtr work,
                     std::function<void()> finish = {});
  // ReduceScatterAlgo::PAIRWISE over `chunks` (see reduce_scatter_pieces_async), under the
  // group's next pairwise tag; the sum is then divided by `divisors` in turn.
  static Work launch_pairwise(ProcessGroup& self, const char* op, const at::Tensor& out_flat,
                              std::vector<std::vector<at::Tensor>> chunks, ReduceOp op_kind,
                              std::vector<double> divisors);
  // ValueError unless `in_flat` is this rank's own piece of `out_flat` or outside it.
  static void check_in_place_piece(const ProcessGroup& self, const char* op,
                                   const at::Tensor& out_flat, const at::Tensor& in_flat);
  // new_group's work, under a name every member agrees on (which is also its store prefix).
  static ProcessGroup new_named_group(ProcessGroup& self, const std::vector<int>& ranks,
                                      const std::string& name);

  // Host routing (host_routes.cpp). `routed` says whether a collective of `bytes` goes by host:
  // always for HIERARCHICAL (ValueError on a group without routes), from 64 KiB for AUTO.
  static bool routed(const ProcessGroup& self, const char* op, bool hierarchical, bool automatic,
                     int64_t bytes);
  static Work routed_all_gather(ProcessGroup& self, const at::Tensor& out_flat,
                                const at::Tensor& in_flat);
  static Work routed_reduce_scatter(ProcessGroup& self, const char* op, const at::Tensor& out_flat,
                                    std::vector<std::vector<at::Tensor>> chunks, ReduceOp op_kind,
                                    std::vector<double> divisors);
  static Work routed_all_reduce(ProcessGroup& self, const at::Tensor& tensor, ReduceOp op_kind);
  // Collective over `self`: agrees on host routes from every rank's layout and builds them.
  static void route_by_host(ProcessGroup& self, const EnvInfo& env, std::optional<bool> wanted);
};

}  // namespace detail

using Internals = detail::GroupInternals;

struct Work::Pending {
  compat::WorkPtr work;          // null when the collective completed synchronously
  std::function<void()> finish;  // local post-processing once `work` is done
  std::string what;              // "all_gather_into_tensor on group 'default' (rank 1 of 2)"
  std::chrono::milliseconds timeout{0};
  std::shared_ptr<std::atomic<bool>> group_failed;  // the group's State::failed
};

namespace detail {

// "<op> on group '<name>' (rank r of W, global rank g)": how every error of a collective begins.
std::string describe(const char* op, const ProcessGroup& g);

// The timeout Work waits with on `backend_name`: the group's, except on NCCL (0: none).
std::chrono::milliseconds work_timeout(const std::string& backend_name,
                                       std::chrono::milliseconds group_timeout);

// Waits for a backend work, bounded by `timeout` when it is positive. A failure sets
// `group_failed` and becomes DistError("<what> failed: <reason>").
void wait_backend_work(const compat::WorkPtr& work, std::chrono::milliseconds timeout,
                       const std::shared_ptr<std::atomic<bool>>& group_failed,
                       const std::string& what);

// Frees (CPU) the storage of a collective's scratch buffer once wait() has seen it complete.
void release_completed(const at::Tensor& scratch);

// Element-wise combine of `src` into `acc`: the local half of an emulated reduce-scatter.
void combine_into(const at::Tensor& acc, const at::Tensor& src, ReduceOp op);

// A flat tensor as `count` chunks of n elements, one piece each: the chunks form of the
// reduce-scatters (reduce_scatter_pieces_async, start_pairwise_reduce_scatter).
std::vector<std::vector<at::Tensor>> equal_chunks(const at::Tensor& in_flat, int count, int64_t n);

// Divides `t` in place by divisors[from], divisors[from + 1], ... in turn (ATen's div_): what a
// reduce-scatter does to its sum for AVG and for the caller's divide_by.
void divide_in_order(const at::Tensor& t, const std::vector<double>& divisors, size_t from = 0);

// How many of `divisors`, from the front, can be applied in the pass of the sum's last addition
// (sum_then_divide): powers of two (so that scaling by the reciprocal is exact), at most two, for
// float and double. The rest go through divide_in_order afterwards.
size_t fusable_divisors(at::ScalarType dtype, const std::vector<double>& divisors);

// acc = (((acc + srcs[0]) + srcs[1]) + ...) / divisors[0] / ... / divisors[count - 1], in one pass
// over float or double, bit-identical to one add_ per source in order followed by `count` div_
// calls. acc and the sources: contiguous, of one dtype and size, none overlapping acc;
// count <= fusable_divisors(dtype, divisors).
void sum_then_divide(const at::Tensor& acc, const std::vector<at::Tensor>& srcs,
                     const std::vector<double>& divisors, size_t count);

// Starts ReduceScatterAlgo::PAIRWISE (pairwise.cpp): posts the sends and the first
// receives and returns the finish step for Work (receives the rest, sums in rank order into
// `out_flat`, divides by `divisors` in turn, the leading powers of two in the last addition's
// pass; divisors are for SUM and AVG only). The input is given as chunks[q], the non-empty 1-D
// pieces whose concatenation is the chunk rank q receives the reduction of; each piece is one
// message, so every rank must split a chunk alike. Failures throw DistError naming `call.what` and
// set the group's failure flag.
std::function<void()> start_pairwise_reduce_scatter(PointToPointCall call,
                                                    const at::Tensor& out_flat,
                                                    std::vector<std::vector<at::Tensor>> chunks,
                                                    ReduceOp op, std::vector<double> divisors);

// Starts AllGatherAlgo::PAIRWISE (pairwise.cpp): posts a receive of every peer's input into its
// place in `out_flat` and a send of `in_flat` to every peer, copies this rank's own piece (unless
// `in_flat` is that piece already) and returns the finish step for Work (waits for all of them).
// `in_flat` must not overlap `out_flat` anywhere else.
std::function<void()> start_pairwise_all_gather(PointToPointCall call, const at::Tensor& out_flat,
                                                const at::Tensor& in_flat);

// A point-to-point exchange under one call's tag (pairwise.cpp), the building block of the
// host-routed collectives (host_routes.cpp): each receive lands straight in its place and each
// send is one message, matched per peer in the order they are posted, so a rank must post its
// sends to a peer in the order that peer posts the matching receives. Sends may be posted after
// the start (of data that has arrived since). Failures throw DistError naming call.what, set the
// group's failure flag and keep the exchange alive for good (Gloo may still use its tensors).
struct Exchange;
std::shared_ptr<Exchange> start_exchange(PointToPointCall call);
void exchange_recv(const std::shared_ptr<Exchange>& x, int peer, const at::Tensor& dst);
void exchange_send(const std::shared_ptr<Exchange>& x, int peer, const at::Tensor& src);
// Waits for every receive posted so far from `peer`.
void exchange_wait_from(const std::shared_ptr<Exchange>& x, int peer);
// Waits for every receive and send, then lets go of their tensors.
void exchange_finish(const std::shared_ptr<Exchange>& x);
// After a failure elsewhere: marks the group failed and keeps the exchange alive for good, since
// its posted receives may still write into their tensors.
void exchange_abandon(const std::shared_ptr<Exchange>& x);

}  // namespace detail
}  // namespace dist
}  // namespace fsdp
