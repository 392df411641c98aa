// Internal: how the keys of a wrapped model's state dict map onto its units, shared by saving
// (model_state_dict.cpp) and loading (load_state_dict.cpp); and how saving keeps a value.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "flat_param/tensor_utils.h"  // shape_str, dim_outside
#include "runtime/state.h"

namespace fsdp {
namespace detail {

/// A value a saved state dict (model or optimizer) keeps: under `offload` a device tensor is
/// copied to the CPU (to() copies already), anything else is cloned, unless `owned` (a view of a
/// gathered buffer nobody else holds, kept as it is).
inline at::Tensor kept_value(const at::Tensor& t, bool offload, bool owned = false) {
  if (offload && !t.is_cpu()) return t.to(at::kCPU);
  return owned ? t : t.clone();
}

/// While alive, a SHARDED or LOCAL state-dict type on a model with NO_SHARD units acts as FULL
/// with a default config (PyTorch's _replace_with_full_state_dict_type), with a warning.
class NoShardFallback {
 public:
  explicit NoShardFallback(FsdpState& st);
  ~NoShardFallback();
  NoShardFallback(const NoShardFallback&) = delete;
  NoShardFallback& operator=(const NoShardFallback&) = delete;

 private:
  FsdpState& st_;
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

KeyMap key_map(FsdpState& st);
/// Throws StateError during backward or summon; reshards whatever a forward left unsharded.
void require_idle(FsdpState& st, const char* what);
/// "<unit fqn>._flat_param", or "_flat_param" for the root.
std::string flat_key(const Unit& u);

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
