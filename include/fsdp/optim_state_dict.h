// fsdp/optim_state_dict.h: optimizer state dicts of sharded (and unwrapped) models, keyed by the
// canonical parameter FQNs, in PyTorch's shape (torch/distributed/fsdp/_optim_utils.py).
//
// Which API: for checkpoints and new code, get_state_dict / set_state_dict
// (fsdp/checkpoint/state_dict.h) give the same dicts for model and optimizers together; this
// header is PyTorch FSDP1's optim_state_dict API, for ported code.
//
//   {
//     fsdp::StateDictTypeGuard g(model, fsdp::StateDictType::SHARDED_STATE_DICT,
//                                fsdp::ShardedStateDictConfig(),
//                                fsdp::ShardedOptimStateDictConfig());
//     fsdp::StateDict osd = fsdp::optim_state_dict(model, optimizer);     // collective
//     ...                                                              // (save it, later:)
//     fsdp::load_optim_state_dict(model, optimizer, osd);             // any world size/strategy
//   }
//
// The dict, as PyTorch FSDP's optim_state_dict returns it:
//   {"state":        {fqn: {"step": 0-d float32 tensor, "exp_avg": tensor, ...}, ...},
//    "param_groups": [{"lr": 0.001, "betas": [0.9, 0.999], ..., "params": [fqn, ...]}, ...]}
// * Keys are the unwrapped model's parameter FQNs. A tied parameter appears once, under its
//   first FQN in module order. A parameter without state (never stepped, frozen, not in the
//   optimizer) has no entry under "state".
// * FULL: every state tensor has its parameter's shape. SHARDED: every positive-dimension state
//   tensor is a ShardedTensor chunked on dim 0 across the shard group, like its parameter in the
//   SHARDED model state dict; "step" and state of ignored parameters stay plain. LOCAL is not
//   supported (as in PyTorch). Under NO_SHARD, as in PyTorch, flat parameters' state is still
//   chunked (each rank cuts its chunk locally) while original parameters' state stays plain.
// * Optimizers: torch::optim Adam, AdamW, SGD, Adagrad, RMSprop, with PyTorch's state names (see
//   docs/optim_state_dict.md). Group keys LibTorch lacks (maximize, foreach, ...) get PyTorch's
//   defaults on export and are ignored on import. Any other optimizer: ValueError naming it.
//
// Memory and traffic (per rank, beyond the shards and the returned dict): FULL export gathers one
// state tensor of one unit at a time, so the peak is one unit's padded unsharded flat numel times
// the state's element size (plus the local flat shard it assembles with use_orig_params). The
// returned values of a gathered state are views of that buffer, kept without a copy, where the
// parameters with that state fill at least half of it (else they are copied out, so a mostly
// frozen unit's buffer is not kept for a few small states): see model_state_dict.h on views.
// SHARDED export and import move pieces with the piece exchange: one metadata all-gather per call,
// then per state tensor one all_to_all_single carrying only the elements a rank's chunk (export) or
// shard (import) needs; peak: what a rank sends for one tensor plus twice its range of it. No unit
// is ever whole. FULL import communicates nothing beyond the verdict. Presence, dtypes and steps
// of all state travel in one metadata all-gather per export.
//
// All functions taking a FullyShardedDataParallel are collective over its process group; the
// overloads taking a plain torch::nn::Module are local, so a single-process run produces and
// consumes the same dicts (FULL form; SHARDED values whose local pieces cover each tensor load
// too).
#pragma once

#include <torch/optim/optimizer.h>

#include <functional>

#include "fsdp/model_state_dict.h"
#include "fsdp/state_value.h"

namespace fsdp {

/// The optimizer state dict of a wrapped model, in the model's state-dict type (FULL or SHARDED,
/// see StateDictTypeGuard; FullOptimStateDictConfig::rank0_only leaves ranks > 0 with an empty
/// dict, offload_to_cpu moves gathered values to the CPU). Collective. Throws ValueError for an
/// unsupported optimizer, LOCAL_STATE_DICT, or an optimizer holding tensors that are not the
/// model's parameters.
StateDict optim_state_dict(FullyShardedDataParallel& model, torch::optim::Optimizer& optimizer);

/// The same dict for an unwrapped model: what a single-process run of the same training holds.
StateDict optim_state_dict(const torch::nn::Module& model, torch::optim::Optimizer& optimizer);

/// PyTorch's optim_state_dict_to_load followed by optimizer.load_state_dict: sets this rank's
/// optimizer state and group hyperparameters from a FULL or SHARDED dict (plain tensors or
/// ShardedTensors, saved at any world size and with any sharding strategy or use_orig_params).
/// Each state tensor is flattened per unit like its parameter and this rank's shard is kept;
/// within a flat parameter, parameters without a tensor state get zeros (as in PyTorch), and
/// "step" must be the same for all of them. State is cast to the parameter's dtype.
///
/// Throws ValueError naming the FQN, the state key, the rank and the shapes for: an unknown FQN,
/// a missing, unexpected or mis-shaped state, pieces that do not cover what a rank needs, or
/// param groups that differ from the optimizer's (count or parameters). Every rank raises if any
/// does, and nothing is changed anywhere (all-or-nothing). Collective.
void load_optim_state_dict(FullyShardedDataParallel& model, torch::optim::Optimizer& optimizer,
                           const StateDict& osd);

/// The same for an unwrapped model and its optimizer (local).
void load_optim_state_dict(const torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                           const StateDict& osd);

/// How "state" and "params" refer to parameters (PyTorch's OptimStateKeyType).
enum class OptimStateKeyType {
  /// Canonical FQNs (what optim_state_dict returns).
  PARAM_NAME,
  /// Positions in the optimizer's parameter list, all groups in order (torch.optim's own keys):
  /// "state" keys are the decimal strings "0", "1", ... and "params" lists Int values.
  PARAM_ID,
};

/// Re-keys a FULL dict between FQNs and parameter IDs of `optimizer` over `model` (e.g. to hand
/// a dict to code that keys by position). A dict already keyed as asked is returned unchanged,
/// whatever the model (PyTorch's early return; a common defensive call). Otherwise parameter IDs
/// need one FQN per optimizer parameter, so a wrapped model must use use_orig_params (a flat
/// parameter stands for many FQNs): ValueError otherwise, and for keys that name no parameter.
/// Local (no communication).
StateDict rekey_optim_state_dict(const StateDict& osd, OptimStateKeyType key_type,
                                 FullyShardedDataParallel& model,
                                 torch::optim::Optimizer& optimizer);
StateDict rekey_optim_state_dict(const StateDict& osd, OptimStateKeyType key_type,
                                 const torch::nn::Module& model,
                                 torch::optim::Optimizer& optimizer);

}  // namespace fsdp
