// fsdp/model_state_dict.h: state dicts of a FullyShardedDataParallel model (PyTorch's
// FULL_STATE_DICT, SHARDED_STATE_DICT and LOCAL_STATE_DICT), saving and loading.
//
// Which API: for checkpoints and most new code, use get_state_dict / set_state_dict
// (fsdp/checkpoint/state_dict.h), which handles model and optimizer together; use this header
// to port code written against FSDP.state_dict_type() and the model's own state_dict().
//
//   {
//     fsdp::StateDictTypeGuard g(model, fsdp::StateDictType::FULL_STATE_DICT,
//                                fsdp::FullStateDictConfig().offload_to_cpu(true).rank0_only(true));
//     fsdp::StateDict sd = fsdp::state_dict(model);      // collective; empty on ranks > 0
//   }
//
// FULL:    keys are the unwrapped model's FQNs, in the order and with the values of
//          fsdp::module_state_dict(unwrapped model): parameters gathered one unit at a time, in
//          their original dtype, buffers included, tied parameters under every FQN. A sharded
//          unit's parameters are views of the one buffer its gather wrote, which the dict owns
//          (no copy; the buffer is the unit's flat parameter plus < W elements of padding), so
//          torch::save of one such value alone writes its unit's whole buffer, as for any view;
//          clone() it to keep it alone. NO_SHARD units' parameters, ignored parameters and
//          buffers are copies.
// SHARDED: the same keys; every parameter is a ShardedTensor over the (shard) group, cut as the
//          config's ShardLayout says (by default chunked on dim 0 with torch.chunk semantics, as
//          PyTorch does); buffers are plain tensors. Loads at any world size and from either
//          layout, given the pieces that cover what each rank needs; a parameter may also be a
//          plain tensor holding it whole (PyTorch's SHARDED dicts at world size 1 are FULL ones).
// LOCAL:   one key per unit, "<unit fqn>._flat_param" ("_flat_param" for the root): that unit's
//          flat-parameter shard as a 1-D ShardedTensor (padding dropped); buffers as plain tensors.
//          Loads only at the same world size and layout.
//
// Loading validates every key, shape, dtype and piece on every rank first and applies nothing
// unless all ranks succeeded, so a failed load leaves the model untouched everywhere.
// All functions here are collective over the model's process group.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "fsdp/fully_sharded.h"
#include "fsdp/state_value.h"

namespace fsdp {

enum class StateDictType { FULL_STATE_DICT, LOCAL_STATE_DICT, SHARDED_STATE_DICT };

/// How a SHARDED state dict cuts each parameter, and its optimizer state, into pieces. Both
/// layouts load, save and reshard alike (every consumer takes any boxes); they differ in cost.
enum class ShardLayout {
  /// PyTorch's: torch.chunk along dim 0 over the shard group. Producing it moves data between
  /// ranks: the model's units are all-gathered one at a time, optimizer state is routed.
  DIM0_CHUNKS,
  /// Each rank's part of its own flat-parameter shard, as it lies: a contiguous range of the
  /// parameter's row-major elements, held as at most 2 * ndim - 1 boxes (flat_range_boxes). No
  /// tensor communication at all; what a checkpoint save wants. A NO_SHARD unit's optimizer
  /// state (each rank holds it whole) is still chunked on dim 0.
  FLAT_SHARDS,
};

/// Called after each gather of a state dict starts, with the bytes this rank then holds in
/// gather buffers: for watching the memory a state dict costs (tests, benchmarks). Local; it must
/// not call collectives.
using GatherObserver = std::function<void(int64_t bytes)>;

/// The bytes of gather buffers a FULL state dict (model or optimizer) holds in flight by default.
constexpr int64_t kDefaultGatherWindowBytes = int64_t{16} << 20;

/// How FULL model state dicts are produced. PyTorch's defaults.
struct FullStateDictConfig {
  /// Move values to the CPU as they are gathered (one unit at a time). Default false; turn it
  /// on where the whole model does not fit on the device.
  TORCH_ARG(bool, offload_to_cpu) = false;
  /// Only rank 0 returns values; other ranks return an empty dict (they still take part).
  /// Default false; with offload_to_cpu, it keeps one CPU copy per job instead of one per rank.
  TORCH_ARG(bool, rank0_only) = false;
  /// Not in PyTorch. The gathers in flight hold at most this many bytes of gather buffers (but
  /// always one gather); small flat parameters are gathered together in buckets of at most 4 MiB.
  /// 0 gathers one flat parameter at a time. Every rank must pass the same value. Default
  /// kDefaultGatherWindowBytes (16 MiB).
  TORCH_ARG(int64_t, gather_window_bytes) = kDefaultGatherWindowBytes;
  /// Not in PyTorch. See GatherObserver; also called for each NO_SHARD unit it unshards.
  /// Default: none.
  TORCH_ARG(GatherObserver, on_gather);
};

/// How SHARDED model state dicts are produced.
struct ShardedStateDictConfig {
  /// Move the pieces to the CPU. Default false.
  TORCH_ARG(bool, offload_to_cpu) = false;
  /// How parameters are cut. Default DIM0_CHUNKS, PyTorch FSDP's own pieces, so that code written
  /// against its SHARDED_STATE_DICT sees what it expects. checkpoint::get_state_dict defaults to
  /// FLAT_SHARDS instead (StateDictOptions::shard_layout): its callers take any pieces, and a save
  /// should move no data between ranks.
  TORCH_ARG(ShardLayout, layout) = ShardLayout::DIM0_CHUNKS;
  /// Not in PyTorch. See GatherObserver: called after each unit is unsharded (DIM0_CHUNKS only;
  /// FLAT_SHARDS gathers nothing). Default: none.
  TORCH_ARG(GatherObserver, on_gather);
};

/// How LOCAL model state dicts are produced.
struct LocalStateDictConfig {
  /// Move the flat-parameter shards to the CPU. Default false.
  TORCH_ARG(bool, offload_to_cpu) = false;
};

/// How FULL optimizer state dicts are produced (see fsdp/optim_state_dict.h). PyTorch's defaults.
struct FullOptimStateDictConfig {
  /// Move values to the CPU as they are gathered. Default true, as PyTorch's.
  TORCH_ARG(bool, offload_to_cpu) = true;
  /// Only rank 0 returns values; other ranks return an empty dict (they still take part).
  /// Default false.
  TORCH_ARG(bool, rank0_only) = false;
  /// Not in PyTorch. As FullStateDictConfig's: the bytes of gathered state tensors in flight
  /// (small ones bucketed together); the same on every rank. Default kDefaultGatherWindowBytes.
  TORCH_ARG(int64_t, gather_window_bytes) = kDefaultGatherWindowBytes;
  /// Not in PyTorch. See GatherObserver: the bytes of unsharded state outside the shards.
  /// Default: none.
  TORCH_ARG(GatherObserver, on_gather);
};

/// How SHARDED optimizer state dicts are produced.
struct ShardedOptimStateDictConfig {
  /// Move the pieces to the CPU. Default true, as PyTorch's.
  TORCH_ARG(bool, offload_to_cpu) = true;
  /// How state tensors are cut. Default DIM0_CHUNKS, as ShardedStateDictConfig's.
  TORCH_ARG(ShardLayout, layout) = ShardLayout::DIM0_CHUNKS;
  /// Not in PyTorch. See GatherObserver. A SHARDED export routes pieces between ranks and
  /// gathers no state tensor whole, so it is never called: it is there to watch that it is not.
  /// Default: none.
  TORCH_ARG(GatherObserver, on_gather);
};

/// Sets the state-dict type (and its configs, for model and optimizer state dicts) of `model`
/// for its lifetime; restores the previous ones on destruction (PyTorch's
/// FSDP.state_dict_type). The default type is FULL_STATE_DICT with default configs.
class StateDictTypeGuard {
 public:
  StateDictTypeGuard(FullyShardedDataParallel& model, StateDictType type,
                     FullStateDictConfig config = {});
  StateDictTypeGuard(FullyShardedDataParallel& model, StateDictType type,
                     ShardedStateDictConfig config);
  StateDictTypeGuard(FullyShardedDataParallel& model, StateDictType type,
                     LocalStateDictConfig config);
  StateDictTypeGuard(FullyShardedDataParallel& model, StateDictType type,
                     FullStateDictConfig config, FullOptimStateDictConfig optim_config);
  StateDictTypeGuard(FullyShardedDataParallel& model, StateDictType type,
                     ShardedStateDictConfig config, ShardedOptimStateDictConfig optim_config);
  ~StateDictTypeGuard();
  StateDictTypeGuard(const StateDictTypeGuard&) = delete;
  StateDictTypeGuard& operator=(const StateDictTypeGuard&) = delete;

 private:
  std::shared_ptr<detail::StateDictSettings> settings_;
  StateDictType prev_type_;
  FullStateDictConfig prev_full_;
  ShardedStateDictConfig prev_sharded_;
  LocalStateDictConfig prev_local_;
  FullOptimStateDictConfig prev_full_optim_;
  ShardedOptimStateDictConfig prev_sharded_optim_;
};

/// PyTorch's `module.load_state_dict(sd, strict)` for an unwrapped LibTorch module: copies every
/// key of module_state_dict(module) found in `sd` into the module's tensor (cast to its dtype).
/// A ShardedTensor value loads if the pieces held here cover it. Missing or unexpected keys
/// raise ValueError with `strict` and are returned otherwise; a shape mismatch or a non-tensor
/// value raises ValueError naming the key. Nothing is written unless every key fits. Local.
LoadResult load_module_state_dict(torch::nn::Module& module, const StateDict& sd,
                                  bool strict = true);

/// The model's state dict in its current type (FULL on a NO_SHARD model, see load_state_dict).
/// Collective. Not allowed during forward/backward.
StateDict state_dict(FullyShardedDataParallel& model);

/// Loads `sd` (of the model's current type). With `strict`, missing or unexpected keys raise
/// ValueError listing them; otherwise they are returned and the rest is loaded. A shape mismatch
/// raises ValueError naming the key. Values of another dtype are cast on copy, as PyTorch's
/// `_load_from_state_dict` does (e.g. bfloat16 weights into a float32 model); with
/// `strict_dtype` a dtype mismatch raises ValueError naming the key instead. Original parameters
/// replaced since the last unshard (use_orig_params) are written back first, so the loaded values
/// win. Collective; all-or-nothing across ranks.
///
/// On a model with NO_SHARD units, SHARDED and LOCAL act as FULL with a default config (a warning
/// says so), for both state_dict and load_state_dict, as in PyTorch.
LoadResult load_state_dict(FullyShardedDataParallel& model, const StateDict& sd, bool strict = true,
                           bool strict_dtype = false);

}  // namespace fsdp
