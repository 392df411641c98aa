// Internal: how the keys of a wrapped model's state dict map onto its units, shared by saving
// (model_state_dict.cpp) and loading (load_state_dict.cpp); and how saving keeps a value.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "runtime/view.h"
#include "state_dict/settings.h"
#include "util/tensor_utils.h"  // shape_str, dim_outside

namespace fsdp {
namespace detail {

/// A value a saved state dict (model or optimizer) keeps: under `offload` a device tensor is
/// copied to the CPU (to() copies already), anything else is cloned, unless `owned` (a view of a
/// gathered buffer nobody else holds, kept as it is).
inline at::Tensor kept_value(const at::Tensor& t, bool offload, bool owned = false) {
  if (offload && !t.is_cpu()) return t.to(at::kCPU);
  return owned ? t : t.clone();
}

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

/// While alive, a SHARDED or LOCAL state-dict type on a model with NO_SHARD units acts as FULL
/// with a default config (PyTorch's _replace_with_full_state_dict_type), with a warning.
class NoShardFallback {
 public:
  NoShardFallback(const RuntimeView& rt, StateDictSettings& cfg);
  ~NoShardFallback();
  NoShardFallback(const NoShardFallback&) = delete;
  NoShardFallback& operator=(const NoShardFallback&) = delete;

 private:
  StateDictSettings& cfg_;
  bool active_ = false;
  StateDictType prev_type_ = StateDictType::FULL_STATE_DICT;
  FullStateDictConfig prev_full_;
};

// Where a managed parameter lives: unit index and index in its handle.
struct ParamLoc {
  int unit = -1;
  size_t index = 0;
};

// What each key of the unwrapped model's state dict is.
struct KeyMap {
  std::vector<std::string> order;               // module_state_dict order
  std::map<std::string, ParamLoc> managed;      // parameters owned by a handle (all FQNs)
  std::map<std::string, at::Tensor> unmanaged;  // ignored parameters and buffers
};

KeyMap key_map(const RuntimeView& rt);
/// "<unit fqn>._flat_param", or "_flat_param" for the root.
std::string flat_key(const UnitView& u);

/// Every shard-group rank's boxes of each parameter of a sharded flat-parameter layout: what
/// each rank holds of it in its flat shard, cut by flat_range_boxes (ShardLayout::FLAT_SHARDS),
/// placed on that rank. The global metadata of a FLAT_SHARDS value.
class FlatShardBoxes {
 public:
  explicit FlatShardBoxes(const FlatParamLayout& layout);
  std::vector<ShardMetadata> of(size_t param_index) const;

 private:
  const FlatParamLayout& layout_;
  std::vector<std::vector<ShardParamInfo>> infos_;  // per rank, per parameter
};

}  // namespace detail
}  // namespace fsdp
