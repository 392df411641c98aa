// Internal: what SHARDED and LOCAL state-dict types become on a model with NO_SHARD units (FULL),
// for the duration of one state_dict or load_state_dict call. Implemented in
// model_state_dict.cpp; used there and by load_state_dict.cpp.
#pragma once

#include "runtime/view.h"
#include "state_dict/settings.h"

namespace fsdp {
namespace detail {

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

}  // namespace detail
}  // namespace fsdp
