// fsdp/options.h: the choices a user makes when wrapping a model (PyTorch FSDP's constructor
// arguments): how to shard, in what precision, where parameters live, what becomes a unit and
// how communication overlaps compute. FullyShardedDataParallel (fully_sharded.h) takes them.
//
// Every option states its default, which is PyTorch FSDP's unless it says otherwise; what the
// options cost in time and memory, measured, is in docs/performance.md.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "fsdp/dist.h"

namespace fsdp {

/// How parameters, gradients and optimizer state are split across ranks (PyTorch's names). The
/// first choice to make: FULL_SHARD saves the most memory; SHARD_GRAD_OP trades memory for one
/// all-gather less per step; NO_SHARD is DistributedDataParallel; the HYBRID kinds shard within
/// a node and replicate across nodes, keeping the all-gathers off the slower network.
enum class ShardingStrategy {
  /// Shard parameters, gradients and optimizer state; free full parameters after forward.
  FULL_SHARD,
  /// As FULL_SHARD, but keep the full parameters from forward until after backward (ZeRO-2).
  SHARD_GRAD_OP,
  /// No sharding: every rank holds everything and gradients are all-reduced (DDP).
  NO_SHARD,
  /// FULL_SHARD within a shard group (a node), replicated across the replicate group.
  HYBRID_SHARD,
  /// SHARD_GRAD_OP within a shard group, replicated across the replicate group.
  HYBRID_SHARD_ZERO2,
};

/// "FULL_SHARD", "NO_SHARD", ...
const char* to_string(ShardingStrategy s);

/// When to all-gather the next unit during backward (PyTorch's BackwardPrefetch).
enum class BackwardPrefetch {
  /// No prefetching: each unit is gathered when its backward needs it.
  NONE,
  /// When a unit's backward starts, start gathering the unit whose backward comes next: the one
  /// whose forward ended just before this one's (for the root, the last unit to end its forward).
  BACKWARD_PRE,
  /// When a unit's gradients are reduced, start gathering that same next unit.
  BACKWARD_POST,
};

/// Mixed precision (PyTorch's MixedPrecision). Leave it default for full precision.
struct MixedPrecision {
  /// Dtype of parameters during forward and backward. Default: unset, the parameters' own.
  TORCH_ARG(std::optional<at::ScalarType>, param_dtype);
  /// Dtype of gradient reduction. Default: unset, param_dtype when that is set, else the
  /// parameters' own. Set it to float32 with a bfloat16 param_dtype for exact sums.
  TORCH_ARG(std::optional<at::ScalarType>, reduce_dtype);
  /// Dtype buffers are cast to at the first forward. Default: unset, the buffers' own.
  TORCH_ARG(std::optional<at::ScalarType>, buffer_dtype);
  /// Keep sharded gradients in param_dtype rather than casting them back to the parameters'
  /// dtype. Default false.
  TORCH_ARG(bool, keep_low_precision_grads) = false;
  /// Cast floating-point tensor arguments of the wrapped module's forward to param_dtype (as
  /// PyTorch's cast_root_forward_inputs). Default true.
  TORCH_ARG(bool, cast_root_forward_inputs) = true;
};

/// CPU offload (PyTorch's CPUOffload).
struct CPUOffload {
  /// Keep sharded parameters and gradients on the CPU, copying them to the compute device for
  /// each unshard. Default false. Pays where the GPU cannot hold the shards; costs a copy a unit.
  TORCH_ARG(bool, offload_params) = false;
};

/// Decides whether a submodule becomes its own unit. Called bottom-up (children before parents)
/// with the module, its FQN in the wrapped model, and the number of parameter elements in its
/// subtree not already claimed by a unit below it. The wrapped module itself is always a unit.
using AutoWrapPolicy = std::function<bool(const std::shared_ptr<torch::nn::Module>& module,
                                          const std::string& fqn, int64_t unwrapped_numel)>;

/// Wraps every module whose unclaimed subtree holds at least `min_num_params` elements.
AutoWrapPolicy size_based_auto_wrap_policy(int64_t min_num_params = 100000000);

/// Wraps every module whose class is one of `Impls` (e.g. MyBlockImpl, torch::nn::LinearImpl):
/// for a transformer, its block class, so that each block is one unit.
template <typename... Impls>
AutoWrapPolicy module_type_auto_wrap_policy() {
  return [](const std::shared_ptr<torch::nn::Module>& m, const std::string&, int64_t) {
    return (... || (std::dynamic_pointer_cast<Impls>(m) != nullptr));
  };
}

/// Options of FullyShardedDataParallel, grouped by what they affect.
struct FullyShardedOptions {
  // ---- What is sharded, across whom, and where it computes ----

  /// Group to shard across. Default: dist::default_group(). For HYBRID_SHARD*: the whole world.
  TORCH_ARG(std::optional<dist::ProcessGroup>, process_group);
  /// How to shard (see ShardingStrategy). Default FULL_SHARD.
  TORCH_ARG(ShardingStrategy, sharding_strategy) = ShardingStrategy::FULL_SHARD;
  /// HYBRID_SHARD*: ranks per shard group (consecutive ranks, one node). Default:
  /// $LOCAL_WORLD_SIZE.
  TORCH_ARG(std::optional<int>, hybrid_shard_size);
  /// Compute device. Default: the device the parameters are on. A module built on the CPU is
  /// moved there (its managed parameters and buffers; ignored modules stay). ValueError for a
  /// parameter already on another GPU, or under NCCL for a device other than the group's (set
  /// each rank's device before init_process_group).
  TORCH_ARG(std::optional<at::Device>, device_id);
  /// Broadcast parameters and buffers from rank 0 before sharding. Default false. Turn it on
  /// when ranks initialise their models with different random seeds.
  TORCH_ARG(bool, sync_module_states) = false;

  // ---- What becomes a unit ----

  /// Submodules to make units, in addition to those the policy picks. Default: none (only the
  /// wrapped module, and what auto_wrap_policy picks).
  TORCH_ARG(std::vector<std::shared_ptr<torch::nn::Module>>, units);
  /// Picks further units (module_type_auto_wrap_policy, size_based_auto_wrap_policy). Default:
  /// none. Without units the whole model is one unit, gathered whole: no memory is saved.
  TORCH_ARG(AutoWrapPolicy, auto_wrap_policy);
  /// Modules whose parameters and buffers FSDP leaves alone (not sharded, not reduced).
  /// Default: none.
  TORCH_ARG(std::vector<std::shared_ptr<torch::nn::Module>>, ignored_modules);
  /// Parameters FSDP leaves alone. Default: none.
  TORCH_ARG(std::vector<at::Tensor>, ignored_params);

  // ---- What optimizers see; precision; where shards live ----

  /// Expose the original parameters (as views into the shard) to parameters() and optimizers,
  /// instead of the flat parameters. Default false. Turn it on for per-parameter optimizer
  /// groups, or for frozen and trainable parameters in one unit.
  TORCH_ARG(bool, use_orig_params) = false;
  /// Parameter, reduction and buffer dtypes (see MixedPrecision). Default: full precision.
  TORCH_ARG(MixedPrecision, mixed_precision) = MixedPrecision();
  /// Sharded parameters and gradients on the CPU (see CPUOffload). Default: no offload.
  TORCH_ARG(CPUOffload, cpu_offload) = CPUOffload();

  // ---- How communication overlaps compute ----

  /// When to gather the next unit in backward. Default BACKWARD_PRE, which overlaps the most;
  /// BACKWARD_POST holds one unit fewer unsharded at the backward peak; NONE, fewer still.
  TORCH_ARG(BackwardPrefetch, backward_prefetch) = BackwardPrefetch::BACKWARD_PRE;
  /// Start gathering the next unit (in the order of the first forward) when a unit's forward
  /// starts. Default false, as in PyTorch. It holds one more unit unsharded during forward, and
  /// pays where ranks would otherwise wait for each other at every gather (CPU-bound steps).
  TORCH_ARG(bool, forward_prefetch) = false;
  /// At most this many prefetched all-gathers in flight. Default 1 (PyTorch's
  /// limit_all_gathers: the current unit and one prefetched are unsharded at a time).
  TORCH_ARG(int, max_inflight_all_gathers) = 1;
  /// At most this many gradient reductions (units, or NO_SHARD's buckets) in flight while
  /// autograd computes the units before them; 0 reduces inside each unit's hook and waits.
  /// Default: unset, 1 under NO_SHARD (overlap costs no memory there) and 0 under the sharded
  /// strategies (each reduction in flight keeps a unit's unsharded gradient alive). Set 1 there
  /// to trade some peak memory for shorter steps (docs/performance.md).
  TORCH_ARG(std::optional<int>, max_inflight_grad_reductions);

  // ---- NO_SHARD's gradient buckets (DistributedDataParallel's) ----

  /// NO_SHARD: all-reduce the gradients of consecutive units together in buckets of at least
  /// this many MiB, one collective per bucket, each started as soon as it is full (the first of a
  /// backward closes at 1 MiB, as in DDP). 0: one all-reduce per unit, as Python FSDP's
  /// NO_SHARD. Ignored by the sharded strategies. Default 25, DDP's. Details and the sizes
  /// measured: docs/fully_sharded.md and docs/performance.md.
  TORCH_ARG(double, bucket_cap_mb) = 25;
  /// NO_SHARD on the CPU: keep a backward's bucket memory once its gradients are dropped and
  /// reduce the next backward into it, as DDP's buckets live as long as its reducer; freed, it
  /// comes back as fresh pages to fault in every step. Costs one set of gradients held from
  /// zero_grad to the next backward. Default true; false gives that memory back. When a buffer
  /// is kept or never reused: docs/fully_sharded.md.
  TORCH_ARG(bool, keep_grad_buckets) = true;
};

}  // namespace fsdp
