// Internal: which parameters an optimizer holds over a (wrapped or plain) model, and under which
// canonical FQNs; shared by optimizer-state export (optim_state_dict.cpp), import
// (optim_load.cpp) and the get_/set_state_dict API (state_dict_api.cpp). Defined in
// optim_kinds.cpp, next to the optimizer table: the two together are the optimizer in PyTorch's
// names.
#pragma once

#include <torch/optim/optimizer.h>

#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "fsdp/optim_state_dict.h"
#include "runtime/view.h"
#include "state_dict/optim_kinds.h"

namespace fsdp {
namespace detail {

/// One tensor of the model that an optimizer may hold.
struct OptEntry {
  at::Tensor param;   // as the optimizer holds it (flat parameter, original parameter, or plain)
  int unit = -1;      // index of the unit whose handle manages it; -1: plain (full-shaped state)
  bool flat = false;  // the unit's flat parameter (stands for all its parameters)
  std::vector<size_t> indices;               // handle parameter indices it stands for (unit >= 0)
  std::vector<std::string> fqns;             // canonical FQN per index (plain: the first FQN)
  std::vector<std::vector<int64_t>> shapes;  // full shape per FQN
  int group = -1;                            // optimizer param group; -1: not in the optimizer
};

/// The entries of a model, and how the optimizer's groups refer to them.
struct OptModel {
  std::shared_ptr<const RuntimeView> rt;  // null for a plain module
  std::vector<OptEntry> entries;  // managed ones in unit order, then plain ones (same on all ranks)
  std::map<std::string, std::pair<size_t, size_t>> by_fqn;  // FQN -> (entry, position)
  std::vector<std::vector<size_t>> groups;  // per optimizer group: its entries, in its order
  /// The range of FQN position `p` of managed entry `e` that this rank keeps: [lo, lo + n) of
  /// the flattened parameter, and where it goes in the local flat parameter. `held`: the rank's
  /// shard holds the parameter (PyTorch's in_shard, also under NO_SHARD, where an empty parameter
  /// at the start of the flat parameter is not held), which is when training gives an original
  /// parameter a gradient here (FlatParamHandle::use_sharded_grad_views), so optimizer state.
  struct Local {
    int64_t lo = 0, n = 0, offset = 0;
    bool held = false;
  };
  Local local(const OptEntry& e, size_t p) const;
};

/// Throws ValueError if the optimizer holds a tensor that is not a parameter of the model, or
/// one twice.
OptModel describe_model(FullyShardedDataParallel* model, const torch::nn::Module* plain,
                        torch::optim::Optimizer& optimizer);

}  // namespace detail
}  // namespace fsdp
