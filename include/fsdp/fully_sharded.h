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
// unchanged in a single process. Children of a wrapped torch::nn::Sequential are driven this way
// automatically. docs/fully_sharded.md has a worked example.
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

#include "fsdp/dist.h"
#include "fsdp/flat_param.h"

namespace fsdp {

/// When to all-gather the next unit during backward (PyTorch's BackwardPrefetch).
enum class BackwardPrefetch {
  NONE,
  /// When a unit's backward starts, start gathering the unit whose backward comes next: the one
  /// whose forward ended just before this one's (for the root, the last unit to end its forward).
  BACKWARD_PRE,
  /// When a unit's gradients are reduced, start gathering that same next unit.
  BACKWARD_POST,
};

/// Mixed precision (PyTorch's MixedPrecision). Unset dtypes mean "as the parameters are".
struct MixedPrecision {
  /// Dtype of parameters during forward and backward.
  TORCH_ARG(std::optional<at::ScalarType>, param_dtype);
  /// Dtype of gradient reduction (defaults to param_dtype when that is set).
  TORCH_ARG(std::optional<at::ScalarType>, reduce_dtype);
  /// Dtype buffers are cast to at the first forward.
  TORCH_ARG(std::optional<at::ScalarType>, buffer_dtype);
  /// Keep sharded gradients in param_dtype rather than casting them back.
  TORCH_ARG(bool, keep_low_precision_grads) = false;
  /// Cast floating-point tensor arguments of the wrapped module's forward to param_dtype (as
  /// PyTorch's cast_root_forward_inputs).
  TORCH_ARG(bool, cast_root_forward_inputs) = true;
};

/// CPU offload (PyTorch's CPUOffload): sharded parameters and gradients live on the CPU.
struct CPUOffload {
  TORCH_ARG(bool, offload_params) = false;
};

/// Decides whether a submodule becomes its own unit. Called bottom-up (children before parents)
/// with the module, its FQN in the wrapped model, and the number of parameter elements in its
/// subtree not already claimed by a unit below it. The wrapped module itself is always a unit.
using AutoWrapPolicy = std::function<bool(const std::shared_ptr<torch::nn::Module>& module,
                                          const std::string& fqn, int64_t unwrapped_numel)>;

/// Wraps every module whose unclaimed subtree holds at least `min_num_params` elements.
AutoWrapPolicy size_based_auto_wrap_policy(int64_t min_num_params = 100000000);

/// Wraps every module whose class is one of `Impls` (e.g. MyBlockImpl, torch::nn::LinearImpl).
template <typename... Impls>
AutoWrapPolicy module_type_auto_wrap_policy() {
  return [](const std::shared_ptr<torch::nn::Module>& m, const std::string&, int64_t) {
    return (... || (std::dynamic_pointer_cast<Impls>(m) != nullptr));
  };
}

/// Options of FullyShardedDataParallel. Defaults match PyTorch FSDP's.
struct FullyShardedOptions {
  /// Group to shard across. Default: dist::default_group(). For HYBRID_SHARD*: the whole world.
  TORCH_ARG(std::optional<dist::ProcessGroup>, process_group);
  TORCH_ARG(ShardingStrategy, sharding_strategy) = ShardingStrategy::FULL_SHARD;
  /// HYBRID_SHARD*: ranks per shard group (consecutive ranks, one node). Default:
  /// $LOCAL_WORLD_SIZE.
  TORCH_ARG(std::optional<int>, hybrid_shard_size);
  TORCH_ARG(MixedPrecision, mixed_precision) = MixedPrecision();
  TORCH_ARG(CPUOffload, cpu_offload) = CPUOffload();
  /// Expose the original parameters (as views into the shard) to parameters() and optimizers,
  /// instead of the flat parameters.
  TORCH_ARG(bool, use_orig_params) = false;
  /// Submodules to make units, in addition to those the policy picks.
  TORCH_ARG(std::vector<std::shared_ptr<torch::nn::Module>>, units);
  TORCH_ARG(AutoWrapPolicy, auto_wrap_policy);
  TORCH_ARG(BackwardPrefetch, backward_prefetch) = BackwardPrefetch::BACKWARD_PRE;
  /// Start gathering the next unit (in the order of the first forward) when a unit's forward
  /// starts. Off by default, as in PyTorch; it holds one more unit unsharded during forward, and
  /// pays where ranks would otherwise wait for each other at every gather (CPU-bound steps; the
  /// figures are in docs/performance.md).
  TORCH_ARG(bool, forward_prefetch) = false;
  /// At most this many prefetched all-gathers in flight (PyTorch's limit_all_gathers allows 2
  /// unsharded units at a time: the current one and one prefetched).
  TORCH_ARG(int, max_inflight_all_gathers) = 1;
  /// At most this many units' gradient reductions in flight during backward: a unit's
  /// reduce-scatter (all-reduce under NO_SHARD) runs while autograd computes the gradients of the
  /// units before it, and is waited for when the limit is reached or at the end of backward (as
  /// PyTorch's reduce-scatter on its own CUDA stream is). 0 reduces inside the unit's
  /// post-backward hook and waits. Unset (the default): 1 under NO_SHARD, where the buffer in
  /// flight is the gradient itself, so overlapping costs no memory; 0 under the sharded
  /// strategies, where each reduction in flight keeps its unit's unsharded gradient alive through
  /// the next unit's backward, the peak of FULL_SHARD training (on the CPU, somewhat more peak
  /// memory for somewhat shorter steps; the figures are in docs/performance.md).
  TORCH_ARG(std::optional<int>, max_inflight_grad_reductions);
  /// NO_SHARD (DistributedDataParallel's bucket_cap_mb): the gradients of consecutive units, in
  /// the order backward finishes them, are all-reduced together in buckets of at least this many
  /// MiB (a bucket closes with the unit that reaches it), one collective per bucket instead of
  /// one per unit. Each bucket starts as soon as it is full, while autograd goes on with the units
  /// before it (max_inflight_grad_reductions counts buckets); as in DDP the first bucket of a
  /// backward closes at 1 MiB already, so that communication starts early, and the last one at
  /// the end of backward. Each unit's reduced gradient shares its bucket's memory (no copy back,
  /// and, once the layout is known from the previous step, no copy in); where zero_grad keeps
  /// gradients between steps (LibTorch 1.13's default), up to two buckets of new gradients live
  /// beside them during backward (docs/performance.md, Memory). 0: one all-reduce per unit, as
  /// Python FSDP's NO_SHARD. The sums are the same; over Gloo at W >= 3 a
  /// different split of the buffer may round differently (as DDP's bucket sizes do). Ignored by
  /// the sharded strategies (why: docs/performance.md). Default 25, DDP's.
  TORCH_ARG(double, bucket_cap_mb) = 25;
  /// NO_SHARD's buckets on the CPU (bucket_cap_mb > 0): keep a backward's bucket memory, once the
  /// gradients that live in it are dropped (zero_grad with set_to_none, LibTorch 2's default), and
  /// reduce the next backward into it, as DDP's buckets live as long as its reducer. Freed
  /// instead, the C library returns such large blocks to the kernel and every backward faults them
  /// in again as fresh pages (on the 48-unit benchmark under LibTorch 2.6, 2,600 faults and about
  /// 2% of each step). The cost is the memory of one set of gradients held from zero_grad until
  /// the next backward that reduces (through no_sync steps too; a forward in eval mode lets it
  /// go), as DDP holds it; false gives it back. A buffer is never reused while a tensor shares its
  /// storage (a gradient kept by the user, whole or as a view, an original parameter's gradient
  /// under use_orig_params, one the next backward adds into; memory aliased by raw pointer, as
  /// from_blob does, is not seen), and none is kept where the gradients do not live in it
  /// (accumulation into gradients that zero_grad kept, LibTorch 1.13's default; a reduce_dtype
  /// other than the gradients'; CPU offload). GPUs keep their caching allocator.
  TORCH_ARG(bool, keep_grad_buckets) = true;
  /// Broadcast parameters and buffers from rank 0 before sharding.
  TORCH_ARG(bool, sync_module_states) = false;
  /// Modules whose parameters and buffers FSDP leaves alone (not sharded, not reduced).
  TORCH_ARG(std::vector<std::shared_ptr<torch::nn::Module>>, ignored_modules);
  /// Parameters FSDP leaves alone.
  TORCH_ARG(std::vector<at::Tensor>, ignored_params);
  /// Compute device. Default: the device the parameters are on. As in PyTorch, a module built on
  /// the CPU is moved there first (its managed parameters and buffers; ignored modules stay);
  /// a parameter already on another GPU is a ValueError. Under NCCL the compute GPU must be the
  /// group's (ProcessGroup::device(): set each rank's device before init_process_group), else
  /// ValueError.
  TORCH_ARG(std::optional<at::Device>, device_id);
};

namespace detail {
class FsdpState;
class RuntimeView;
struct StateDictSettings;
struct UnitRef;
/// The unit `m` is registered as, or null if `m` is not a unit of any wrapped model.
std::shared_ptr<UnitRef> find_unit(const torch::nn::Module* m);
/// Around a unit's forward: unshards on construction, reshards in post_forward().
class ForwardScope {
 public:
  explicit ForwardScope(const torch::nn::Module* m);
  ~ForwardScope();
  bool active() const { return static_cast<bool>(unit_); }
  /// Registers the pre-backward hook on a forward output (ignored unless it requires grad).
  void track_output(const at::Tensor& t);
  /// Registers a post-backward wait on a forward input (units with frozen parameters only).
  void track_input(const at::Tensor& t);
  void post_forward();

 private:
  std::shared_ptr<UnitRef> unit_;
  bool done_ = false;
};

inline void track(ForwardScope& s, const at::Tensor& t) { s.track_output(t); }
inline void track(ForwardScope& s, const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts) s.track_output(t);
}
template <typename... Ts>
void track(ForwardScope& s, const std::tuple<Ts...>& t) {
  std::apply([&](const auto&... e) { (track(s, e), ...); }, t);
}
template <typename T>
void track(ForwardScope&, const T&) {}  // non-tensor outputs carry no gradient

inline void track_input(ForwardScope& s, const at::Tensor& t) { s.track_input(t); }
inline void track_input(ForwardScope& s, const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts) s.track_input(t);
}
template <typename T>
void track_input(ForwardScope&, const T&) {}

/// Root-forward argument casting for mixed precision: floating tensors to `dtype`, the rest as is.
/// PyTorch's FSDP_USE_FULL_PREC_IN_EVAL: with the environment variable set to "1", units of a model
/// in eval mode (train(false)) compute in the parameters' own dtype despite a param_dtype.
bool full_precision_in_eval();

/// `dtype` Undefined: no cast. (A plain ScalarType rather than an optional: GCC 12 at -O2 warns,
/// wrongly, that an inlined optional's payload may be used uninitialized, in every program that
/// builds forward() with -Wall.)
inline at::Tensor cast_arg(const at::Tensor& t, at::ScalarType dtype) {
  return dtype != at::ScalarType::Undefined && t.defined() && t.is_floating_point() ? t.to(dtype)
                                                                                    : t;
}
template <typename T, typename = std::enable_if_t<!std::is_same_v<std::decay_t<T>, at::Tensor>>>
T&& cast_arg(T&& x, at::ScalarType) {
  return std::forward<T>(x);
}

inline const torch::nn::Module* raw(const torch::nn::Module& m) { return &m; }
template <typename T>
const torch::nn::Module* raw(const std::shared_ptr<T>& m) {
  return m.get();
}
template <typename T>
const torch::nn::Module* raw(const torch::nn::ModuleHolder<T>& m) {
  return m.get();
}
/// Runs a Sequential's children one by one, each through its own ForwardScope.
at::Tensor forward_sequential(torch::nn::Sequential& seq, const at::Tensor& input);
}  // namespace detail

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
    auto out = module->forward(std::forward<Args>(args)...);
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
