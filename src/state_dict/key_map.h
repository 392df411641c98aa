// Internal: how the keys of a wrapped model's state dict map onto its units: which keys are
// parameters a unit's flat parameter holds (and where), which are plain tensors (ignored
// parameters, buffers), and the key a LOCAL dict saves a unit's flat parameter under. Shared by
// saving (model_state_dict.cpp, which implements it) and loading (load_state_dict.cpp).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "runtime/view.h"

namespace fsdp {
namespace detail {

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

}  // namespace detail
}  // namespace fsdp
