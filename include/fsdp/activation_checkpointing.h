// fsdp/activation_checkpointing.h: activation checkpointing (PyTorch's torch.utils.checkpoint and
// FSDP's apply_activation_checkpointing) for LibTorch modules, aware of FSDP units.
//
// Sharding divides parameters, gradients and optimizer state by the world size but leaves
// activations whole; for long sequences and many layers they are most of peak memory. A
// checkpointed call runs its forward without keeping the intermediate tensors autograd would save
// and runs it again in backward, just before its gradient is needed: memory falls to the call's
// inputs, and a step costs about one more forward.
//
//   x = fsdp::checkpoint_module(block, x);           // one call, checkpointed
//   fsdp::apply_activation_checkpointing(model, fsdp::checkpoint_module_types<BlockImpl>());
//   x = fsdp::forward(block, x);                     // then every marked block is checkpointed
//
// Semantics are those of PyTorch's checkpoint: the recomputation sees the RNG state of the forward
// (dropout draws the same mask; CPU, and each CUDA device an input is on) and its autocast state,
// so gradients are bit-identical to the same model run without checkpointing. Under
// torch::NoGradGuard (or for a call where nothing requires grad) the call simply runs. Inputs
// saved for the recomputation must not be modified in place before backward (autograd's version
// check says so). A checkpointed graph is backpropagated once, unless retain_graph is passed.
//
// With FSDP: when the checkpointed module is a unit (or sits inside one), the recomputation uses
// the parameters the unit's backward unshards anyway, so a FULL_SHARD unit is all-gathered twice
// per step, as without checkpointing: in forward, and once in backward for both the recomputation
// and the gradients. Units nested inside a checkpointed region are unsharded once in backward too
// (at their recomputation, kept for their backward).
//
// How it is built, and what C++ cannot do: LibTorch has no saved-tensor hooks callable from C++
// (at::SavedTensorDefaultHooks takes Python objects), so PyTorch's non-reentrant checkpoint, which
// discards what autograd saves, cannot be written here. Ours is the reentrant kind: a C++ autograd
// function runs the forward with gradients off, and in its backward recomputes with gradients on
// and backpropagates the recomputed graph, so parameters' gradients accumulate as usual (FSDP's
// hooks fire as without checkpointing). Two consequences, both also true of PyTorch's reentrant
// checkpoint: only tensors passed as inputs (and returned as outputs) cross the boundary, so a
// callable must take the tensors it differentiates through as inputs (parameters reached inside
// are fine); and torch::autograd::grad() with explicit `inputs` cannot see through a checkpointed
// call to the parameters inside it (backward() can). Selective checkpointing (keeping chosen
// intermediate outputs) needs the same saved-tensor hooks and is not offered; split the call
// instead, checkpointing only the part whose activations are cheap to recompute.
//
// Thread safety: a checkpointed call and its backward run on the threads autograd uses; marking
// modules (apply_activation_checkpointing) must not race with forwards.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "fsdp/detail/forward.h"

namespace fsdp {

/// Options of a checkpointed call.
struct CheckpointOptions {
  /// Restore, before recomputing, the RNG state the forward started from (PyTorch's
  /// preserve_rng_state), so that random operations (dropout) draw the same values. Default
  /// true; false skips keeping a copy of the generator state per call, and gradients then
  /// differ wherever the forward draws random numbers.
  TORCH_ARG(bool, preserve_rng_state) = true;
};

/// A checkpointable computation: tensors in, tensors out. It may read parameters and any other
/// state it captures; it must compute the same thing when called again with the same inputs.
using CheckpointFunction =
    std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs)>;

/// Runs `fn(inputs)` checkpointed and returns its outputs. `params`: the parameters `fn` reads
/// (what decides, when no input requires grad, whether the outputs need a gradient path); a call
/// where neither an input nor a param requires grad, or one under NoGradGuard, just runs `fn`.
/// Outputs that are not floating point carry no gradient.
std::vector<at::Tensor> checkpoint_function(const CheckpointFunction& fn,
                                            const std::vector<at::Tensor>& inputs,
                                            const std::vector<at::Tensor>& params = {},
                                            const CheckpointOptions& options = {});

/// Decides which modules apply_activation_checkpointing marks: called with each module and its
/// FQN below the root given to it (PyTorch's check_fn).
using CheckpointPolicy =
    std::function<bool(const std::shared_ptr<torch::nn::Module>& module, const std::string& fqn)>;

/// Marks every module below `root` (the root itself excluded, as in PyTorch) for which `policy`
/// says yes; fsdp::forward then runs each marked module checkpointed. Returns how many were
/// marked. `root` may be any module; for a FullyShardedDataParallel the modules below the one it
/// wraps are asked, by their FQNs in the unwrapped model. A module stays marked until cleared or
/// destroyed.
int apply_activation_checkpointing(const std::shared_ptr<torch::nn::Module>& root,
                                   const CheckpointPolicy& policy,
                                   const CheckpointOptions& options = {});
template <typename M>
int apply_activation_checkpointing(const torch::nn::ModuleHolder<M>& root,
                                   const CheckpointPolicy& policy,
                                   const CheckpointOptions& options = {}) {
  return apply_activation_checkpointing(root.ptr(), policy, options);
}
/// Unmarks every module below `root`. Returns how many were marked.
int clear_activation_checkpointing(const std::shared_ptr<torch::nn::Module>& root);

/// Every module whose class is one of `Impls` (a transformer's block class).
template <typename... Impls>
CheckpointPolicy checkpoint_module_types() {
  return [](const std::shared_ptr<torch::nn::Module>& m, const std::string&) {
    return (... || (std::dynamic_pointer_cast<Impls>(m) != nullptr));
  };
}
/// Every `k`-th module `policy` picks, in module order, starting with the first (k = 2: blocks
/// 0, 2, 4...): to checkpoint only part of the model when memory allows. The count runs over the
/// returned policy's life: make a new one for each apply_activation_checkpointing.
CheckpointPolicy every_kth(CheckpointPolicy policy, int k);
/// Every FSDP unit but a wrapped model's root (whose forward is the whole model): to checkpoint
/// each unit, whatever wrap policy made the units. Apply it once the model is wrapped.
CheckpointPolicy checkpoint_units();

}  // namespace fsdp

// The templates behind checkpoint_module and fsdp::forward: after the declarations they use.
#include "fsdp/detail/activation_checkpointing.h"

namespace fsdp {

/// Runs `module->forward(args...)` checkpointed; if `module` is an FSDP unit, inside the unit's
/// unshard and reshard as fsdp::forward does (the recomputation reuses backward's unshard). The
/// forward must return a Tensor, a std::vector<Tensor> or a std::tuple of Tensors; non-tensor
/// arguments are copied and kept until backward.
template <typename M, typename... Args>
auto checkpoint_module(M& module, Args&&... args) {
  static_assert(detail::checkpointable<M, Args...>(),
                "checkpoint_module: the forward must return Tensor, vector<Tensor> or "
                "tuple<Tensor...>, and its arguments must be copyable");
  detail::ForwardScope scope(detail::raw(module));
  if (scope.active()) (detail::track_input(scope, args), ...);
  auto out = detail::checkpointed_forward(module, CheckpointOptions(), std::forward<Args>(args)...);
  if (scope.active()) {
    detail::track(scope, out);
    scope.post_forward();
  }
  return out;
}

}  // namespace fsdp
