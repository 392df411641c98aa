// Internal: the forms an optimizers' state dict takes in the get_/set_ API
// (torch.distributed.checkpoint.state_dict) and the conversions between them: several optimizers'
// dicts merged into one and split back per optimizer, and the flat one-level form
// (flatten_optim_state_dict in the public header).
#pragma once

#include <torch/optim/optimizer.h>

#include <functional>
#include <string>

#include "fsdp/state_value.h"
#include "state_dict/wrapped_model.h"

namespace fsdp {
namespace checkpoint {
namespace optim_forms {

/// The keys of an optimizer state dict (PyTorch's names).
inline constexpr const char* kState = "state";
inline constexpr const char* kGroups = "param_groups";
inline constexpr const char* kParams = "params";

/// Which parameters, under which FQNs, an optimizer holds over the call's model.
using DescribeOptimizer = std::function<fsdp::detail::OptModel(torch::optim::Optimizer&)>;

/// PyTorch's _split_optim_state_dict: the part of a merged {"state", "param_groups"} dict that
/// belongs to `opt`, the state of its parameters and the param groups that list them. A dict
/// keyed by parameter IDs is one optimizer's own and returned whole. Throws ValueError if the
/// dict lacks "state" or "param_groups", or a group lists parameters of several optimizers.
StateDict split_for(const DescribeOptimizer& describe, torch::optim::Optimizer& opt,
                    const StateDict& osd);

/// PyTorch's _unflatten_optim_state_dict: the nested dict of `optimizers` from the flat form,
/// their param groups in order, each listing the FQNs of its parameters. Throws ValueError for a
/// key of neither form, an FQN no optimizer holds, or one group's parameters carrying different
/// values for a group key.
StateDict unflatten_optim(const DescribeOptimizer& describe,
                          const std::vector<torch::optim::Optimizer*>& optimizers,
                          const StateDict& flat);

}  // namespace optim_forms
}  // namespace checkpoint
}  // namespace fsdp
