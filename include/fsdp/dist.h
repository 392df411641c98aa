// fsdp/dist.h: the distributed layer. Process groups and the collectives FSDP needs, over c10d.
//
// Every collective in fsdp-cpp goes through fsdp::dist::ProcessGroup, which gives:
//  * one code path whatever the backend: flat all-gather and reduce-scatter are native where the
//    backend has them (NCCL, Gloo in LibTorch >= 2.2) and emulated where not (Gloo in 1.13);
//  * a timeout on every wait: a dead or diverging peer turns into fsdp::DistError naming the
//    operation, the group and this rank, never a hang;
//  * torchrun-compatible initialisation (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//    MASTER_ADDR, MASTER_PORT) over c10d's TCPStore, plus sub-groups and the 2-D layout that
//    hybrid sharding uses.
//
// Thread safety: a ProcessGroup is a cheap, copyable handle to shared state. Like c10d's, a group
// must be used by one thread at a time, and all members must issue the same collectives in the
// same order.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/arg.h>

#include "fsdp/compat.h"

namespace fsdp {
namespace dist {

/// Reduction applied by all_reduce and reduce_scatter. AVG is computed as SUM followed by a
/// division by the group size (Gloo rejects c10d's AVG).
enum class ReduceOp { SUM, AVG, MAX, MIN };

/// How reduce_scatter is carried out where the backend has no native flat reduce-scatter. AUTO
/// is the right choice almost always; how each works and what it costs: docs/dist.md.
enum class ReduceScatterAlgo {
  /// Native on NCCL; PAIRWISE on Gloo, HIERARCHICAL on a group routed by host from 64 KiB.
  AUTO,
  /// alltoall of the W chunks, then a local sum in rank order (deterministic).
  ALL_TO_ALL,
  /// all_reduce of the whole tensor, then keep this rank's chunk: moves about twice the bytes.
  ALL_REDUCE,
  /// The backend's _reduce_scatter_base. Throws where the backend lacks it.
  NATIVE,
  /// Gloo only: point-to-point pieces summed in rank order (the same bits as ALL_TO_ALL), with
  /// at most 2/W of the input in scratch. Sends under tags of its own from 0 up: code sending on
  /// the same c10d backend directly must not use them.
  PAIRWISE,
  /// Gloo only, on a group routed by host (ProcessGroup::hosts() > 1): PAIRWISE within each
  /// host, then across hosts, so only each host's sums leave it. ValueError elsewhere.
  HIERARCHICAL,
  // Deprecated spellings, listed once in docs/migration.md; removed in the next release.
  kAuto [[deprecated("use ReduceScatterAlgo::AUTO")]] = AUTO,
  kAllToAll [[deprecated("use ReduceScatterAlgo::ALL_TO_ALL")]] = ALL_TO_ALL,
  kAllReduce [[deprecated("use ReduceScatterAlgo::ALL_REDUCE")]] = ALL_REDUCE,
  kNative [[deprecated("use ReduceScatterAlgo::NATIVE")]] = NATIVE,
  kPairwise [[deprecated("use ReduceScatterAlgo::PAIRWISE")]] = PAIRWISE,
};

/// How all_gather_into_tensor is carried out. AUTO is the right choice almost always; how each
/// works and what it costs: docs/dist.md.
enum class AllGatherAlgo {
  /// Native on NCCL; on Gloo PAIRWISE from 4 MiB of output and NATIVE below, HIERARCHICAL on a
  /// group routed by host from 64 KiB.
  AUTO,
  /// The backend's own all-gather (on Gloo through a scratch copy of the whole output).
  NATIVE,
  /// Gloo only: every peer's input received straight into its place in the output; allocates
  /// nothing. Refuses (ValueError) an input overlapping the output except at its own piece.
  PAIRWISE,
  /// Gloo only, on a group routed by host (ProcessGroup::hosts() > 1): an exchange across hosts,
  /// then forwarding within each, so each host sends its share once. ValueError elsewhere.
  HIERARCHICAL,
  // Deprecated spellings, listed once in docs/migration.md; removed in the next release.
  kAuto [[deprecated("use AllGatherAlgo::AUTO")]] = AUTO,
  kNative [[deprecated("use AllGatherAlgo::NATIVE")]] = NATIVE,
  kPairwise [[deprecated("use AllGatherAlgo::PAIRWISE")]] = PAIRWISE,
};

/// How init_process_group finds its peers. Every field left unset is read from the environment
/// variables torchrun sets.
struct InitOptions {
  /// "gloo", "nccl" or "auto" (NCCL where LibTorch has CUDA and a GPU is visible, else Gloo).
  /// Default "auto".
  TORCH_ARG(std::string, backend) = "auto";
  /// This rank's accelerator, as PyTorch's init_process_group(device_id=...): a CUDA device
  /// becomes the current one before the group is created (torch.cuda.set_device), so NCCL's
  /// collectives run, and other devices' tensors stage, there. Usually cuda:$LOCAL_RANK. Default:
  /// the current device. ValueError for a CUDA device where fsdp-cpp was built without NCCL, or
  /// an index LibTorch does not see; ignored for a CPU device.
  TORCH_ARG(std::optional<at::Device>, device_id);
  /// This process's rank. Default: $RANK.
  TORCH_ARG(std::optional<int>, rank);
  /// Number of processes. Default: $WORLD_SIZE.
  TORCH_ARG(std::optional<int>, world_size);
  /// Address of the rank-0 host running the TCPStore. Default: $MASTER_ADDR, else 127.0.0.1.
  TORCH_ARG(std::optional<std::string>, master_addr);
  /// Port of the TCPStore. Default: $MASTER_PORT, else 29500.
  TORCH_ARG(std::optional<int>, master_port);
  /// An existing store to rendezvous on instead of creating a TCPStore (e.g. a FileStore).
  /// Default: none, a TCPStore at master_addr:master_port.
  TORCH_ARG(compat::StorePtr, store);
  /// Limit on every collective and on the rendezvous. Default: 30 minutes, as in PyTorch.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(30);
  /// Address of this host for Gloo's transport. Default: $FSDP_GLOO_HOSTNAME; else the
  /// interfaces $GLOO_SOCKET_IFNAME names; else fsdp-run's $FSDP_NODE_ADDR; else 127.0.0.1 for a
  /// loopback master; else the local address of the route to the master (the full order, and
  /// the errors a wrong choice gives: docs/dist.md, "Initialisation").
  TORCH_ARG(std::optional<std::string>, gloo_hostname);
  /// Gloo worker threads per group. Default 2.
  TORCH_ARG(int, gloo_threads) = 2;
  /// Route the default group's large collectives by host (the HIERARCHICAL algorithms, and
  /// all_reduce within, across, then within hosts), so each host sends others only its share.
  /// Gloo only. Default: $FSDP_HOST_AWARE (0 or 1), else on when the launcher's layout puts the
  /// ranks on several hosts, more than one and the same number on each, in consecutive blocks.
  /// The ranks agree at start-up; where they cannot, the group stays flat and rank 0 says why
  /// (docs/dist.md, "Routed by host").
  TORCH_ARG(std::optional<bool>, host_aware);
};

/// Rank layout read from the environment, as torchrun sets it.
struct EnvInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  /// Whose variables gave the layout: "torchrun" (also fsdp-run), "mpirun", "slurm" or "none".
  std::string launcher = "none";
  /// TORCHELASTIC_USE_AGENT_STORE=True: the launcher (fsdp-run across hosts, torchrun) hosts the
  /// TCPStore at MASTER_ADDR:MASTER_PORT, so every rank, rank 0 included, connects to it as a
  /// client, and the ranks' keys live under "/worker/attempt_<restart_count>", as in PyTorch.
  bool agent_store = false;
  /// TORCHELASTIC_RESTART_COUNT: how many times the launcher has restarted the job (0 at first).
  int restart_count = 0;
};

/// Reads the rank layout from the first launcher whose variables are set:
///  * torchrun and fsdp-run: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE;
///  * Open MPI's mpirun: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK,
///    OMPI_COMM_WORLD_LOCAL_SIZE;
///  * Slurm's srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, and SLURM_NTASKS_PER_NODE (else
///    the first count of SLURM_TASKS_PER_NODE).
/// MASTER_ADDR and MASTER_PORT come from the environment in every case (mpirun and srun set
/// neither: export them, e.g. the first host of the allocation), and so do torchelastic's
/// TORCHELASTIC_USE_AGENT_STORE and TORCHELASTIC_RESTART_COUNT. Missing variables take the
/// defaults above (a single process); malformed ones throw ValueError naming the variable.
EnvInfo env_info();

class ProcessGroup;
namespace detail {
struct GroupInternals;  // src/dist/state.h
}  // namespace detail

/// A collective in flight. wait() blocks until it is done (at most the group's timeout), finishes
/// any local work the collective needs (copies, sums) and rethrows failures as DistError.
/// Destroying an unwaited Work waits for it first, swallowing errors; call wait() to see them.
class Work {
 public:
  /// A Work with nothing to wait for. (Defined out of line: Pending is complete only there.)
  Work();
  Work(Work&&) noexcept;
  Work& operator=(Work&&) noexcept;
  ~Work();
  /// Blocks until done. Idempotent. Throws DistError on failure or timeout.
  /// Under NCCL, as in PyTorch, wait() on a collective of CUDA tensors makes the current CUDA
  /// stream wait for it and returns without blocking the CPU (results staged back to another
  /// device are copied, which does wait). A collective that never completes is then ended by
  /// c10d's watchdog after the group's timeout, which takes the process down with an error
  /// naming the operation; set TORCH_NCCL_BLOCKING_WAIT=1 to have wait() block and throw
  /// DistError instead (at the cost of the CPU waiting for every collective).
  void wait();
  /// True once wait() has run (or there was nothing to wait for): not whether the collective has
  /// finished, which c10d's isCompleted() tells and this API does not poll.
  bool waited() const { return !pending_; }
  /// Deprecated (one release): waited(), whose name says what it means.
  [[deprecated("done() means wait() has run; use waited()")]] bool done() const { return waited(); }

 private:
  friend struct detail::GroupInternals;
  struct Pending;
  std::unique_ptr<Pending> pending_;
};

/// A group of processes that run collectives together. Obtained from init_process_group(),
/// ProcessGroup::new_group() or ProcessGroup::from_backend(). A default-constructed group is
/// "not a member" (what new_group returns on ranks outside the new group).
class ProcessGroup {
 public:
  ProcessGroup() = default;

  /// Wraps an existing c10d backend object. `global_ranks` maps group ranks to ranks of the
  /// default group (identity if empty). `store` is needed only for new_group().
  static ProcessGroup from_backend(compat::BackendPtr backend, std::string name,
                                   std::chrono::milliseconds timeout, compat::StorePtr store = {},
                                   std::vector<int> global_ranks = {});

  /// False for the placeholder new_group() returns to non-members.
  bool is_member() const { return static_cast<bool>(state_); }
  int rank() const;
  int size() const;
  const std::string& name() const;
  std::chrono::milliseconds timeout() const;
  /// "gloo" or "nccl".
  std::string backend_name() const;
  /// How many hosts this group's collectives are routed across (InitOptions::host_aware): 1 for a
  /// group whose collectives are flat (every group but a routed default group).
  int hosts() const;
  /// Rank in the default group of each member, indexed by group rank.
  const std::vector<int>& global_ranks() const;
  /// The underlying c10d object, for callers that need something not wrapped here.
  compat::BackendPtr backend() const;
  /// The device the backend communicates from: the CPU for Gloo; for NCCL the CUDA device that
  /// was current when the group was created. Collectives accept tensors on any device: one that
  /// is elsewhere is copied to this device for the collective and its result copied back (for
  /// NCCL, CPU metadata such as flags, sizes and names; for Gloo, CUDA tensors).
  at::Device device() const;

  // ---- Collectives. All members must call them in the same order with matching shapes. ----
  // Each blocking form is the async form followed by wait(). Tensors must be contiguous; those
  // not on device() are staged through it (see device()). Inputs are not modified unless stated.

  /// output (numel = W * input.numel()) receives every rank's `input`, in rank order. `input` may
  /// be this rank's own piece of `output` (in place); it must not overlap it anywhere else
  /// (PAIRWISE refuses that).
  void all_gather_into_tensor(const at::Tensor& output, const at::Tensor& input,
                              AllGatherAlgo algo = AllGatherAlgo::AUTO);
  Work all_gather_into_tensor_async(const at::Tensor& output, const at::Tensor& input,
                                    AllGatherAlgo algo = AllGatherAlgo::AUTO);

  /// output (numel = input.numel() / W) receives this rank's chunk of the element-wise reduction
  /// of every rank's `input`. input.numel() must be divisible by W. `input` is left unchanged; the
  /// emulations allocate scratch: ALL_TO_ALL and ALL_REDUCE one buffer of input's size, PAIRWISE
  /// at most two of output's (none at W=2 for SUM and AVG, whose first piece it receives straight
  /// into `output`).
  ///
  /// `divide_by` (SUM and AVG only; finite, non-zero): the result is then divided by each in turn
  /// (after AVG's W), each division rounded as ATen's div_ rounds it: what FSDP's gradient pre-
  /// and post-division need. PAIRWISE on float and double applies the leading powers of two (at
  /// most two) in the pass of the sum's last addition, one pass over the output fewer per divisor
  /// and the same bits; any other divisor is a div_ of its own.
  void reduce_scatter_tensor(const at::Tensor& output, const at::Tensor& input,
                             ReduceOp op = ReduceOp::SUM,
                             ReduceScatterAlgo algo = ReduceScatterAlgo::AUTO,
                             const std::vector<double>& divide_by = {});
  Work reduce_scatter_tensor_async(const at::Tensor& output, const at::Tensor& input,
                                   ReduceOp op = ReduceOp::SUM,
                                   ReduceScatterAlgo algo = ReduceScatterAlgo::AUTO,
                                   const std::vector<double>& divide_by = {});

  /// reduce_scatter_tensor with the input in pieces rather than one flat tensor: chunks[q] lists
  /// the contiguous tensors whose concatenation (flattened) is the chunk of the input that rank q
  /// receives the reduction of, output.numel() elements in all. With PAIRWISE (AUTO on Gloo)
  /// every piece is sent as it is, saving the copy that flattening them costs (FSDP sends
  /// autograd's gradients this way); each piece is one message, so chunk q must be split into
  /// pieces of the same sizes on every rank. Other algorithms, tensors off device(), one rank,
  /// an empty output and dtypes Gloo cannot reduce (bfloat16) go through one concatenated copy.
  /// Pieces are of output's dtype and are not modified; the Work holds them until it has been
  /// waited on. `divide_by` as for reduce_scatter_tensor.
  Work reduce_scatter_pieces_async(const at::Tensor& output,
                                   std::vector<std::vector<at::Tensor>> chunks,
                                   ReduceOp op = ReduceOp::SUM,
                                   ReduceScatterAlgo algo = ReduceScatterAlgo::AUTO,
                                   const std::vector<double>& divide_by = {});

  /// Rank r's `input` is split into W consecutive runs of input_split_sizes[q] elements; run q goes
  /// to rank q, and `output` receives, in rank order, output_split_sizes[r] elements from each
  /// rank r (PyTorch's all_to_all_single). Sizes must agree pairwise across ranks; empty split
  /// lists mean equal splits. Any dtype (data moves as bytes where the backend lacks the type).
  void all_to_all_single(const at::Tensor& output, const at::Tensor& input,
                         const std::vector<int64_t>& output_split_sizes,
                         const std::vector<int64_t>& input_split_sizes);

  /// In place: `tensor` becomes the reduction over all ranks.
  void all_reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::SUM);
  Work all_reduce_async(const at::Tensor& tensor, ReduceOp op = ReduceOp::SUM);

  /// In place: `tensor` becomes rank `src`'s value (src is a group rank).
  void broadcast(const at::Tensor& tensor, int src = 0);

  /// Blocks until every member has arrived (or the timeout passes).
  void barrier();

  /// Every rank's `bytes`, indexed by rank. For small metadata (shapes, names, verdicts): sizes
  /// differ freely between ranks. One collective when every message fits in 120 bytes, a second
  /// for the rest otherwise.
  std::vector<std::string> all_gather_bytes(const std::string& bytes);
  /// Rank `src`'s `bytes` on every rank (other ranks' argument is ignored). One collective up to
  /// 120 bytes, two beyond.
  std::string broadcast_bytes(const std::string& bytes, int src = 0);

  /// Creates a sub-group of `ranks` (ranks of *this* group, any order; the new group's rank i is
  /// ranks[i]). Collective over this group: every member must call it with the same list, even
  /// ranks not in it, which get a non-member placeholder.
  ProcessGroup new_group(const std::vector<int>& ranks);

 private:
  // The state every handle of a group shares, and the helpers that reach into it, are internal
  // to src/dist/ (state.h).
  friend struct detail::GroupInternals;
  struct State;
  explicit ProcessGroup(std::shared_ptr<State> s) : state_(std::move(s)) {}
  std::shared_ptr<State> state_;
};

/// Creates the default (world) group: rendezvous over a TCPStore (or `opts.store`), then a Gloo or
/// NCCL backend. Rank 0 hosts the store, unless the launcher does
/// (TORCHELASTIC_USE_AGENT_STORE=True, set by fsdp-run across hosts and by torchrun: every rank is
/// then a client, as in PyTorch). Throws DistError if the rendezvous times out. Creating a Gloo
/// group sets SIGPIPE to be ignored if the program left it at its default (as Python does at
/// start-up): otherwise a peer dying mid-collective kills this process with SIGPIPE instead of
/// failing the collective with a DistError.
ProcessGroup init_process_group(const InitOptions& opts = InitOptions());

/// The group init_process_group created. Throws StateError if there is none.
ProcessGroup& default_group();
/// True once init_process_group succeeded (and until destroy_process_group).
bool is_initialized();
/// Forgets the default group. Its backend is destroyed when the last handle goes away (models
/// and sub-groups keep theirs). An NCCL backend is first shut down gracefully, so that
/// collectives still in flight with peers complete, unless a collective of the group failed.
void destroy_process_group();

/// The two groups hybrid sharding uses: parameters are sharded within `shard` (consecutive ranks,
/// typically one node) and replicated across `replicate` (ranks with the same position in each
/// shard group).
struct HybridGroups {
  ProcessGroup shard;
  ProcessGroup replicate;
};

/// Splits `world` into world.size() / shard_size shard groups of consecutive ranks and shard_size
/// replicate groups. Collective over `world`. Throws ValueError unless shard_size divides the size.
HybridGroups make_hybrid_groups(ProcessGroup& world, int shard_size);

}  // namespace dist
}  // namespace fsdp
