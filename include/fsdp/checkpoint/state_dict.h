// fsdp/checkpoint/state_dict.h: one API for the state dicts of a model and its optimizers, whether
// the model is wrapped in FullyShardedDataParallel or a plain LibTorch module (PyTorch's
// torch.distributed.checkpoint.state_dict).
//
// Which API: this one, for checkpoints and for new code. fsdp/model_state_dict.h and
// fsdp/optim_state_dict.h are PyTorch FSDP1's older API (state_dict_type), for ported code.
//
//   namespace ckpt = fsdp::checkpoint;
//   auto [msd, osd] = ckpt::get_state_dict(model, optimizer);           // SHARDED pieces
//   ...                                                               // save, restart, ...
//   ckpt::set_state_dict(model, optimizer, msd, osd);                  // any world size
//
//   auto opts = ckpt::StateDictOptions().full_state_dict(true).cpu_offload(true);
//   auto full = ckpt::get_model_state_dict(model, opts);               // values on rank 0 only
//
// Keys are canonical FQNs either way: the names of the unwrapped model's named_parameters() and
// named_buffers(), so a wrapped model and the same model unwrapped give equal dicts (FULL form).
// Optimizer dicts are PyTorch's {"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn]}]}
// (see fsdp/optim_state_dict.h), the optimizers' dicts merged into one.
//
// On a wrapped model these functions set the model's state-dict type for the call (FULL when
// full_state_dict, SHARDED otherwise, with configs derived from the options as PyTorch does)
// and restore the caller's afterwards; they are collective over its process group. On a plain
// module they are local, except set_* with broadcast_from_rank0 (collective over the default
// process group) and get_* with full_state_dict and cpu_offload (which asks it for the rank).
//
// Errors: where a call is collective, every rank checks its options and dicts first and the
// ranks agree before anything moves or is loaded; if any rank's check fails, every rank throws
// (that rank its own error, the others one of the same kind naming it) and nothing is changed,
// so a bad dict on one rank never leaves the others waiting in a collective. A strict load's key
// check is made then too, so set_state_dict never loads the optimizers of a model it refuses.
//
// A plain module that contains a wrapped model (or is a unit inside one) is rejected: pass the
// wrapped model itself (PyTorch's "... contains _flat_param ... not the root module").
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <utility>
#include <vector>

#include "fsdp/model_state_dict.h"
#include "fsdp/state_value.h"

namespace fsdp {
namespace checkpoint {

/// How get_* and set_* behave (PyTorch's StateDictOptions, same fields and defaults).
struct StateDictOptions {
  /// Return full tensors (gathered; no ShardedTensor) instead of this rank's pieces. On load: the
  /// given dict holds full tensors. Default false; true for an export or a single-file save.
  TORCH_ARG(bool, full_state_dict) = false;
  /// Move every tensor to the CPU. With full_state_dict too, only rank 0 receives values; the
  /// other ranks get empty dicts, the optimizers' included (to bound host memory, as in
  /// PyTorch). On load into a wrapped model, rank 0's dicts are then the ones loaded, so ranks > 0
  /// may pass the empty dicts they got: the optimizers' always come from rank 0 (PyTorch's
  /// rank0_only), the model's where any rank passed none (where every rank passes one, each
  /// loads its own). PyTorch's FSDP waits forever in that model load; see docs/state_dict_api.md.
  /// Default false.
  TORCH_ARG(bool, cpu_offload) = false;
  /// Leave out parameters with requires_grad == false from the model state dict (by FQN, before
  /// submodule prefixes are stripped). The optimizers' dict is unaffected, as in PyTorch:
  /// parameters that never get a gradient have no state there anyway. Default false.
  TORCH_ARG(bool, ignore_frozen_params) = false;
  /// With `submodules`: keep the submodule's prefix in the keys ("blocks.0.fc1.weight") or strip
  /// it ("fc1.weight"). Default true.
  TORCH_ARG(bool, keep_submodule_prefixes) = true;
  /// On load: missing or unexpected model keys raise ValueError (PyTorch's "Error(s) in loading
  /// state_dict") before anything is loaded; else they are skipped and returned. Default true.
  TORCH_ARG(bool, strict) = true;
  /// On load: rank 0 holds the full dicts, the other ranks pass empty ones (anything else they
  /// pass is ignored); values are broadcast a bounded amount at a time and each rank keeps only
  /// what it owns. Requires full_state_dict. On a plain module every rank receives rank 0's
  /// optimizer dicts whole (replicas hold whole states anyway) and loads them as rank 0 does;
  /// as in PyTorch, only the model's keys are held to `strict`. Default false.
  TORCH_ARG(bool, broadcast_from_rank0) = false;
  /// Optimizer dicts as one flat level: "state.<fqn>.<name>" and "param_groups.<fqn>.<key>"
  /// (values that are lists, like Adam's betas, stay lists). set_* accepts both forms.
  /// Default false.
  TORCH_ARG(bool, flatten_optimizer_state_dict) = false;
  /// Not in PyTorch. How a wrapped model's pieces are cut when full_state_dict is false. By
  /// default each rank returns its flat-parameter shards as they lie (ShardLayout::FLAT_SHARDS):
  /// no tensor communication, so get_state_dict + checkpoint::save moves no data between ranks
  /// (as with PyTorch's per-parameter FSDP2). DIM0_CHUNKS gives PyTorch FSDP1's pieces at the
  /// cost of gathering. set_* accepts either, from any world size.
  TORCH_ARG(ShardLayout, shard_layout) = ShardLayout::FLAT_SHARDS;
  /// Not in PyTorch. Watches a wrapped model's gathers (see GatherObserver in
  /// fsdp/model_state_dict.h), model and optimizers alike: with the default FLAT_SHARDS layout,
  /// get_* gathers nothing. Default: none.
  TORCH_ARG(GatherObserver, on_gather);
};

/// Submodules to restrict get_* to (pointers into the model's module tree).
using Submodules = std::vector<std::shared_ptr<torch::nn::Module>>;
/// The optimizers of a model (not owned).
using Optimizers = std::vector<torch::optim::Optimizer*>;

/// The model's state dict. With `submodules`, only keys under them (see
/// keep_submodule_prefixes). Throws ValueError for a submodule not in the model, for
/// broadcast_from_rank0 without full_state_dict, and if the result is empty though the options
/// require values (PyTorch's "model state_dict is required ... but empty").
StateDict get_model_state_dict(torch::nn::Module& model, const StateDictOptions& options = {},
                               const Submodules& submodules = {});

/// The optimizers' state dict, merged. An optimizer that has no state yet gets it first by one
/// step with zero learning rate and zero gradients, which leaves the parameters unchanged
/// (PyTorch's _init_optim_state); that throws StateError if a parameter already has a gradient.
/// On a wrapped model only the parameters that training gives gradients get state so: not an
/// original parameter (use_orig_params) holding no elements on this rank. Under
/// use_orig_params, a unit some of whose parameters the optimizers hold must have all its
/// trainable ones held (several optimizers may share a unit): ValueError "<fqn> is not in the
/// optimizer state" otherwise, as in PyTorch.
StateDict get_optimizer_state_dict(torch::nn::Module& model, const Optimizers& optimizers,
                                   const StateDictOptions& options = {},
                                   const Submodules& submodules = {});
StateDict get_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                   const StateDictOptions& options = {},
                                   const Submodules& submodules = {});

/// Both: {model state dict, optimizers' state dict}.
std::pair<StateDict, StateDict> get_state_dict(torch::nn::Module& model,
                                               const Optimizers& optimizers,
                                               const StateDictOptions& options = {},
                                               const Submodules& submodules = {});
std::pair<StateDict, StateDict> get_state_dict(torch::nn::Module& model,
                                               torch::optim::Optimizer& optimizer,
                                               const StateDictOptions& options = {},
                                               const Submodules& submodules = {});

/// Loads a model state dict (full tensors with full_state_dict, else pieces as get_* returns
/// them, from any world size). Returns the keys skipped when not strict. An empty dict loads
/// nothing (and, with strict, raises ValueError unless broadcast_from_rank0, or full_state_dict
/// with cpu_offload, is set). On a wrapped model the ranks pass their dicts together: if some
/// pass an empty one and others not, rank 0's is loaded everywhere under full_state_dict +
/// cpu_offload, and anything else raises ValueError on every rank. Keys that name a flat
/// parameter ("_flat_param", a LOCAL state dict) raise ValueError.
LoadResult set_model_state_dict(torch::nn::Module& model, const StateDict& model_state_dict,
                                const StateDictOptions& options = {});

/// Loads an optimizers' state dict as get_optimizer_state_dict returns it (either form): each
/// optimizer takes the param groups and state of its own parameters. An empty dict raises
/// ValueError unless broadcast_from_rank0 (ranks > 0) or full_state_dict with cpu_offload; with
/// either, on a wrapped model (and with broadcast_from_rank0 on a plain one), rank 0's dict is
/// the one loaded on every rank, and ValueError is raised on every rank if rank 0's is empty.
void set_optimizer_state_dict(torch::nn::Module& model, const Optimizers& optimizers,
                              const StateDict& optim_state_dict,
                              const StateDictOptions& options = {});
void set_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                              const StateDict& optim_state_dict,
                              const StateDictOptions& options = {});

/// Both; the optimizers first, as in PyTorch. An empty model dict means "optimizers only" (on a
/// wrapped model: on every rank). Returns the model's skipped keys.
LoadResult set_state_dict(torch::nn::Module& model, const Optimizers& optimizers,
                          const StateDict& model_state_dict, const StateDict& optim_state_dict,
                          const StateDictOptions& options = {});
LoadResult set_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                          const StateDict& model_state_dict, const StateDict& optim_state_dict,
                          const StateDictOptions& options = {});

/// PyTorch's _flatten_optim_state_dict: {"state": {fqn: {name: v}}, "param_groups": [...]} as
/// {"state.<fqn>.<name>": v, "param_groups.<fqn>.<key>": v}. Throws ValueError for a state value
/// that is not a tensor (or ShardedTensor), a number or a bool (Python's bool is an int).
StateDict flatten_optim_state_dict(const StateDict& osd);

/// The inverse, for `optimizers` over `model`: their param groups in order, each listing the
/// FQNs of its parameters found in `flat`. Throws ValueError if the parameters of one group
/// carry different values for a group key.
StateDict unflatten_optim_state_dict(torch::nn::Module& model, const Optimizers& optimizers,
                                     const StateDict& flat);

// Module holders (FullyShardedDataParallel, MyModel, ...) are accepted wherever a module is.
template <typename T, typename... A>
StateDict get_model_state_dict(torch::nn::ModuleHolder<T>& m, A&&... a) {
  return get_model_state_dict(*m, std::forward<A>(a)...);
}
template <typename T, typename O, typename... A>
StateDict get_optimizer_state_dict(torch::nn::ModuleHolder<T>& m, O&& o, A&&... a) {
  return get_optimizer_state_dict(*m, std::forward<O>(o), std::forward<A>(a)...);
}
template <typename T, typename O, typename... A>
std::pair<StateDict, StateDict> get_state_dict(torch::nn::ModuleHolder<T>& m, O&& o, A&&... a) {
  return get_state_dict(*m, std::forward<O>(o), std::forward<A>(a)...);
}
template <typename T, typename... A>
LoadResult set_model_state_dict(torch::nn::ModuleHolder<T>& m, A&&... a) {
  return set_model_state_dict(*m, std::forward<A>(a)...);
}
template <typename T, typename O, typename... A>
void set_optimizer_state_dict(torch::nn::ModuleHolder<T>& m, O&& o, A&&... a) {
  set_optimizer_state_dict(*m, std::forward<O>(o), std::forward<A>(a)...);
}
template <typename T, typename O, typename... A>
LoadResult set_state_dict(torch::nn::ModuleHolder<T>& m, O&& o, A&&... a) {
  return set_state_dict(*m, std::forward<O>(o), std::forward<A>(a)...);
}
template <typename T>
StateDict unflatten_optim_state_dict(torch::nn::ModuleHolder<T>& m, const Optimizers& o,
                                     const StateDict& flat) {
  return unflatten_optim_state_dict(*m, o, flat);
}

}  // namespace checkpoint
}  // namespace fsdp
