// Internal: the one table that maps each supported torch::optim optimizer onto PyTorch's names
// for its per-parameter state and its param-group hyperparameters. Adding an optimizer is one
// entry in optim_kinds.cpp.
#pragma once

#include <torch/optim/optimizer.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/state_value.h"

namespace fsdp {
namespace detail {

/// One parameter's optimizer state in PyTorch's terms.
struct ParamOptimState {
  std::optional<int64_t> step;      // set for optimizers that count steps
  std::vector<at::Tensor> tensors;  // aligned with OptimKind::tensor_names; undefined = absent
};

struct OptimKind {
  std::string name;                       // "Adam", as PyTorch calls the class
  bool has_step = false;                  // "step" is part of the state
  std::vector<std::string> tensor_names;  // PyTorch's names, in PyTorch's order

  /// The optimizer is of this kind.
  bool (*matches)(const torch::optim::Optimizer&) = nullptr;
  /// Reads a LibTorch per-parameter state.
  ParamOptimState (*read)(const torch::optim::OptimizerParamState&) = nullptr;
  /// Makes a LibTorch per-parameter state (tensors already in place and owned).
  std::unique_ptr<torch::optim::OptimizerParamState> (*make)(const ParamOptimState&) = nullptr;
  /// A group's hyperparameters as PyTorch names them (without "params"), LibTorch's own values
  /// first, then PyTorch-only keys with PyTorch's defaults.
  std::vector<std::pair<std::string, StateValue>> (*group_items)(
      const torch::optim::OptimizerOptions&) = nullptr;
  /// A copy of `options` with the hyperparameters of `group` (a dict's param group) applied;
  /// appends a message to `error` (naming the key) for a missing or ill-typed hyperparameter.
  /// PyTorch-only keys and keys no optimizer knows (e.g. a scheduler's "initial_lr") are ignored.
  std::unique_ptr<torch::optim::OptimizerOptions> (*apply_group)(
      const torch::optim::OptimizerOptions& options, const StateDict& group,
      std::string& error) = nullptr;
  /// Tensor states a parameter of a group with these options has once stepped (e.g. Adam:
  /// max_exp_avg_sq only with amsgrad). Missing ones are an error on load.
  std::vector<bool> (*required)(const torch::optim::OptimizerOptions&) = nullptr;
  /// For optimizers that create every parameter's state at construction (Adagrad): that initial
  /// state, given to parameters a loaded dict has no state for (LibTorch's step() assumes it
  /// exists). Null for the others, whose parameters then have no state until stepped.
  std::unique_ptr<torch::optim::OptimizerParamState> (*initial)(
      const at::Tensor& param, const torch::optim::OptimizerOptions&) = nullptr;
};

/// The entry for `optimizer`; throws ValueError naming its type if unsupported.
const OptimKind& optim_kind(const torch::optim::Optimizer& optimizer);

}  // namespace detail
}  // namespace fsdp
