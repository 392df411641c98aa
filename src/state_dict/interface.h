// Internal: what the state-dict layer offers checkpoint/ beyond the public API, and the only
// header of state_dict/ that checkpoint/ includes (scripts/check_layers.py): loading from rank 0,
// which parameters an optimizer holds under which FQNs, and the two facts about a wrapped model
// the unified state-dict API needs.
#pragma once

#include "fsdp/fully_sharded.h"
#include "state_dict/from_rank0.h"
#include "state_dict/optim_entries.h"

namespace fsdp {
namespace detail {

/// The group a wrapped model's state-dict calls are collective over: all its data-parallel ranks
/// (shard x replicate groups).
dist::ProcessGroup& state_dict_group(const FullyShardedDataParallelImpl& model);

/// Whether `m` is the module of a unit of a live wrapped model: its parameters are then
/// flat-parameter views, and state dicts must be taken through the wrapper.
bool is_wrapped_module(const torch::nn::Module* m);

}  // namespace detail
}  // namespace fsdp
