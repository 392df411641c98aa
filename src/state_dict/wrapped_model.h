// Internal: the two facts about a wrapped model that the get_/set_state_dict API
// (state_dict_api.cpp) needs beyond the public API: its state-dict group, and whether a module is
// a live unit's. With them come what that API uses of loading from rank 0 and of the optimizer's
// entries.
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
