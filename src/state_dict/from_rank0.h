// Internal: loading dicts that only rank 0 holds (StateDictOptions::broadcast_from_rank0): the
// other ranks learn the structure, then values travel one tensor at a time and each rank keeps
// only its part, so no rank ever holds the whole model or optimizer state beyond rank 0's dict.
#pragma once

#include "fsdp/model_state_dict.h"
#include "fsdp/state_dict.h"

namespace fsdp {
namespace detail {

/// Rank `src`'s dict on `src`; on the other ranks its structure: the same nested keys and lists,
/// non-tensor values and 0-d tensors by value, every other tensor as a ShardedTensor of its shape
/// and dtype holding no pieces. One broadcast. Empty dicts and lists do not survive.
/// Throws ValueError (on every rank) if `src`'s dict holds a ShardedTensor.
StateDict broadcast_structure(const StateDict& sd, dist::ProcessGroup& pg, int src);

/// load_state_dict of a FULL dict that only rank 0 holds (the others pass an empty one): rank 0
/// checks it against the model, the ranks agree, then each parameter and buffer is broadcast in
/// turn and every rank copies its own range into its shard. Peak extra memory: one parameter.
/// Collective over the model's world group. Throws ValueError (every rank) before anything is
/// written if rank 0's dict does not fit; a collective failing midway (DistError) may leave the
/// model partly loaded, as the group is then unusable anyway.
LoadResult load_state_dict_from_rank0(FullyShardedDataParallel& model, const StateDict& sd,
                                      bool strict);

/// load_optim_state_dict of a FULL optimizer dict that only rank 0 holds: the same checks on
/// every rank against the broadcast structure, then each state tensor is broadcast in turn and
/// every rank keeps its range in the new state it builds. Peak extra memory: the new state (this
/// rank's shard of it, which replaces the old) plus one state tensor. All-or-nothing as
/// load_optim_state_dict. Collective over the model's world group.
void load_optim_state_dict_from_rank0(FullyShardedDataParallel& model,
                                      torch::optim::Optimizer& optimizer, const StateDict& osd);

}  // namespace detail
}  // namespace fsdp
