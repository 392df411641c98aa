// Internal: a wrapped model's state-dict type and configs, which StateDictTypeGuard sets and
// state_dict, load_state_dict, optim_state_dict and load_optim_state_dict read (PyTorch keeps
// them on the FSDP module as _state_dict_type and _state_dict_config). They belong to this layer:
// the wrapper only stores them, as an opaque pointer the runtime never looks at.
#pragma once

#include <memory>

#include "fsdp/fully_sharded.h"
#include "fsdp/model_state_dict.h"

namespace fsdp {
namespace detail {

struct StateDictSettings {
  StateDictType type = StateDictType::FULL_STATE_DICT;
  FullStateDictConfig full;
  ShardedStateDictConfig sharded;
  LocalStateDictConfig local;
  FullOptimStateDictConfig full_optim;
  ShardedOptimStateDictConfig sharded_optim;

  /// The settings of `model`, made with the defaults on first use. Shared, so a guard may
  /// outlive the model.
  static const std::shared_ptr<StateDictSettings>& of(const FullyShardedDataParallelImpl& model) {
    if (!model.state_dict_settings_)
      model.state_dict_settings_ = std::make_shared<StateDictSettings>();
    return model.state_dict_settings_;
  }
};

}  // namespace detail
}  // namespace fsdp
