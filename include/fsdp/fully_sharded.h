// fsdp/fully_sharded.h: FullyShardedDataParallel, sharded training of any torch::nn::Module.
//
// Wrapping a module splits its parameters into FSDP *units*, each flattened and sharded by its own
// FlatParamHandle: the wrapped (root) module, plus every submodule chosen by `units` or by the
// auto-wrap policy. During a step each unit is unsharded just before it runs and resharded right
// after, so only one unit (two with prefetching) is whole at a time; in backward it is unsharded
// again, its gradients are reduce-scattered once they are all ready, and it is resharded.
//
// LibTorch has no module forward hooks, so the model marks where a unit runs by calling
//     x = fsdp::forward(block, x);          // instead of block->forward(x) or block(x)
// fsdp::forward calls the module's own forward; around it, it unshards and reshards when the
// module is a unit of a wrapped model, and does nothing else otherwise, so the same model code runs
// unchanged in a single process. A module marked by apply_activation_checkpointing runs
// checkpointed (fsdp/activation_checkpointing.h). Children of a wrapped torch::nn::Sequential are
// driven this way automatically. docs/fully_sharded.md has a worked example.
//
// Thread safety: a wrapped model is used by one thread at a time, like any LibTorch module. All
// ranks of the process group must run the same forward/backward sequence.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include "fsdp/activation_checkpointing.h"
#include "fsdp/detail/forward.h"
#include "fsdp/dist.h"
#include "fsdp/flat_param.h"
#include "fsdp/options.h"

namespace fsdp {

/// Runs `module->forward(args...)`; if `module` is a unit of a wrapped model, unshards it first
/// and reshards it after (registering its backward hooks on the output's tensors). Accepts a
/// module holder (Linear), a shared_ptr to an Impl, or a Sequential (whose children are then
/// driven through fsdp::forward one by one).
template <typename M, typename... Args>
auto forward(M& module, Args&&... args) {
  if constexpr (std::is_same_v<std::decay_t<M>, torch::nn::Sequential> && sizeof...(Args) == 1) {
    return detail::forward_sequential(module, static_cast<const at::Tensor&>(args)...);
  } else {
    detail::ForwardScope scope(detail::raw(module));
    if (scope.active()) (detail::track_input(scope, args), ...);
    auto out = detail::run_forward(module, std::forward<Args>(args)...);
    if (scope.active()) {
      detail::track(scope, out);
      scope.post_forward();
    }
    return out;
  }
}

class FullyShardedDataParallelImpl : public torch::nn::Module {
 public:
  /// Wraps `module` (a module holder such as `MyModel` or `torch::nn::Sequential`). Collective
  /// over the process group. Throws ValueError if units overlap illegally or ranks disagree on
  /// the model (see FlatParamHandle).
  template <typename ModuleType>
  explicit FullyShardedDataParallelImpl(ModuleType module, FullyShardedOptions options = {})
      : FullyShardedDataParallelImpl(torch::nn::AnyModule(module), module.ptr(),
                                     std::move(options)) {}
  /// A Sequential (AnyModule cannot hold one): its children run one by one through
  /// fsdp::forward, so any of them can be a unit.
  explicit FullyShardedDataParallelImpl(torch::nn::Sequential module,
                                        FullyShardedOptions options = {})
      : FullyShardedDataParallelImpl(torch::nn::AnyModule(), module.ptr(), std::move(options)) {}
  FullyShardedDataParallelImpl(torch::nn::AnyModule any, std::shared_ptr<torch::nn::Module> module,
                               FullyShardedOptions options);
  ~FullyShardedDataParallelImpl() override;

  /// Runs the wrapped module's forward (returning a Tensor) as the root unit.
  template <typename... Args>
  at::Tensor forward(Args&&... args) {
    return forward_as<at::Tensor>(std::forward<Args>(args)...);
  }
  /// forward() for modules returning another type.
  template <typename Out, typename... Args>
  Out forward_as(Args&&... args) {
    detail::ForwardScope scope(module_.get());
    // In eval with FSDP_USE_FULL_PREC_IN_EVAL=1 the units compute in full precision: no cast.
    const bool full_prec = !is_training() && detail::full_precision_in_eval();
    const at::ScalarType cast =
        options_.mixed_precision().cast_root_forward_inputs() && !full_prec
            ? options_.mixed_precision().param_dtype().value_or(at::ScalarType::Undefined)
            : at::ScalarType::Undefined;
    (detail::track_input(scope, args), ...);  // before the cast: its copy has the gradient path
    Out out = run_inner<Out>(detail::cast_arg(std::forward<Args>(args), cast)...);
    detail::track(scope, out);
    scope.post_forward();
    return out;
  }

  /// The wrapped module (its parameters are views managed by FSDP).
  std::shared_ptr<torch::nn::Module> module() const { return module_; }
  /// One handle per unit, root first then in wrapping order; null for a root without parameters
  /// of its own.
  std::vector<FlatParamHandle*> handles() const;
  /// FQN (in the wrapped module) of each unit's module, aligned with handles(); "" is the root.
  std::vector<std::string> unit_names() const;
  const FullyShardedOptions& options() const { return options_; }
  /// Group parameters are sharded across (the shard group under hybrid sharding).
  dist::ProcessGroup& process_group();

  /// A parameter an optimizer over this model's parameters() holds, with its canonical FQNs.
  struct ParamFqns {
    at::Tensor param;
    /// Without use_orig_params, the FQNs of the flat parameter's original parameters in flat
    /// order; with it, the one parameter's FQNs (a tied parameter: the first owner's FQN in
    /// module order first, then every other). Names as in the unwrapped model.
    std::vector<std::string> fqns;
  };
  /// Every distinct parameter of parameters() (flat parameters or original parameters, and
  /// ignored ones) once, with its FQNs: PyTorch's _get_param_to_fqns, what optimizer state dicts
  /// key by. Order: units as in handles(), parameters in flat order, then ignored parameters.
  std::vector<ParamFqns> param_fqns() const;

  /// Clips gradients by their global norm over all ranks and all units (PyTorch's
  /// FSDP.clip_grad_norm_): the true norm of the full gradient, not of this rank's shard. Returns
  /// the total norm before clipping. Collective. `norm_type` may be infinity.
  double clip_grad_norm_(double max_norm, double norm_type = 2.0);

  void train(bool on = true) override;

 private:
  friend class NoSyncGuard;
  friend class SummonFullParamsGuard;
  friend class detail::RuntimeView;         // the runtime's interface to the layers above
  friend struct detail::StateDictSettings;  // the state-dict layer's per-model settings
  template <typename Out, typename... Args>
  Out run_inner(Args&&... args) {
    if constexpr (sizeof...(Args) == 1 && std::is_same_v<Out, at::Tensor> &&
                  (std::is_convertible_v<Args, at::Tensor> && ...)) {
      if (sequential_) {
        torch::nn::Sequential seq(sequential_);
        return detail::forward_sequential(seq, static_cast<const at::Tensor&>(args)...);
      }
    }
    return any_.forward<Out>(std::forward<Args>(args)...);
  }
  torch::nn::AnyModule any_;
  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<torch::nn::SequentialImpl> sequential_;  // set when the wrapped module is one
  FullyShardedOptions options_;
  std::shared_ptr<detail::FsdpState> state_;
  // The state-dict type and configs StateDictTypeGuard sets: owned by the state-dict layer,
  // created there on first use, opaque here.
  mutable std::shared_ptr<detail::StateDictSettings> state_dict_settings_;
};
TORCH_MODULE(FullyShardedDataParallel);

/// Within its scope, backward accumulates gradients locally without communication (PyTorch's
/// no_sync()); the first backward after it reduces everything accumulated.
class NoSyncGuard {
 public:
  explicit NoSyncGuard(FullyShardedDataParallel& model);
  ~NoSyncGuard();
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;

 private:
  std::shared_ptr<detail::FsdpState> state_;
  bool prev_;
};

/// Within its scope every unit is unsharded in full precision, so the wrapped module holds its
/// complete parameters (for evaluation or export). With `writeback`, edits made to them are copied
/// into the shards when the scope ends. Collective. Not allowed during forward/backward.
class SummonFullParamsGuard {
 public:
  /// `with_grads` (use_orig_params only, as in PyTorch) also unshards the gradients: every
  /// parameter's grad() is then its full gradient (zeros where a rank had none).
  explicit SummonFullParamsGuard(FullyShardedDataParallel& model, bool writeback = true,
                                 bool with_grads = false);
  ~SummonFullParamsGuard() noexcept(false);
  SummonFullParamsGuard(const SummonFullParamsGuard&) = delete;
  SummonFullParamsGuard& operator=(const SummonFullParamsGuard&) = delete;

 private:
  std::shared_ptr<detail::FsdpState> state_;
  bool writeback_;
  bool with_grads_;
  int uncaught_ = 0;  // std::uncaught_exceptions() at construction
};

}  // namespace fsdp
