// Internal: how a saved SHARDED or LOCAL state dict (model or optimizer) names the ranks that
// hold its pieces: by rank in the default group, as PyTorch does. Used by model_state_dict.cpp
// and optim_state_dict.cpp.
#pragma once

#include <vector>

#include "fsdp/dist.h"
#include "fsdp/state_value.h"

namespace fsdp {
namespace detail {

/// Every ShardedTensor in `v` (nested dicts and lists too) with its global metadata's placements
/// renamed from ranks of the shard group `g` to ranks of the default group, as PyTorch names them
/// (under hybrid sharding each replica group's pieces then name their own ranks). The local
/// pieces keep their rank in `g`: PyTorch's ShardedTensor places a local shard by its rank in
/// the tensor's process group (checked against PyTorch 2.6's FSDP at W=4, 2 x 2 hybrid, by
/// tests/oracle/sd_matrix.py). Nothing here reads a local piece's placement.
inline void place_on_global_ranks(StateValue& v, const dist::ProcessGroup& g) {
  const std::vector<int>& global = g.global_ranks();
  auto rename = [&](ShardMetadata& m) {
    if (m.placement_rank >= 0 && m.placement_rank < static_cast<int>(global.size()))
      m.placement_rank = global[m.placement_rank];
  };
  if (v.is_sharded_tensor()) {
    const ShardedTensor& t = v.sharded_tensor();
    std::vector<Shard> pieces = t.local_shards();
    std::vector<ShardMetadata> all = t.global_metadata();
    for (auto& m : all) rename(m);
    v = ShardedTensor(t.size(), t.dtype(), std::move(pieces), std::move(all));
  } else if (v.is_dict()) {
    for (auto& [k, x] : v.dict()) place_on_global_ranks(x, g);
  } else if (v.is_list()) {
    for (auto& x : v.list()) place_on_global_ranks(x, g);
  }
}

}  // namespace detail
}  // namespace fsdp
