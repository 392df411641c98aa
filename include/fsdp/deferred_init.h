// fsdp/deferred_init.h: wrap a model that no rank ever holds whole, initialised exactly as the
// eagerly built model would be.
//
// LibTorch's module constructors allocate and initialise every parameter at once, and its C++
// frontend cannot build a module on the meta device, so wrapping `MyModel()` needs the whole
// model on every rank first. wrap_deferred() takes the constructor instead of the model:
//     auto model = fsdp::wrap_deferred([&] { return MyModel(config); }, options);
// and returns the same FullyShardedDataParallel that wrapping `MyModel(config)` would, holding,
// bit for bit, the shards the eager model would have (same seed, same world size or any other),
// while each rank holds only its share of the parameters (whole pages around it). docs/
// deferred_init.md explains how and measures it.
//
// The rule a constructor must follow: the tensors it creates and the random numbers it draws may
// depend on shapes, options and the global CPU generator, never on the values of another tensor
// of the model (copying one parameter into another, or deriving a parameter from another's
// values). DeferredInitOptions::verify, on by default, detects a constructor that breaks it and
// throws ValueError naming the parameter.
#pragma once

#include <functional>
#include <memory>
#include <type_traits>
#include <utility>

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

#include "fsdp/detail/deferred_init.h"
#include "fsdp/fully_sharded.h"
#include "fsdp/options.h"

namespace fsdp {

/// How wrap_deferred builds the model.
struct DeferredInitOptions {
  /// Builds the shards a second time with different contents behind the parameters this rank
  /// does not hold, and throws ValueError naming any kept parameter that came out differently (its
  /// constructor read another tensor's values). Costs one more run of the constructor (its memory
  /// is freed before the next). Default true; turn it off once a model's constructor is known to
  /// follow the rule. Ignored with sync_module_states (rank 0's values are broadcast).
  TORCH_ARG(bool, verify) = true;
};

/// Wraps the model `make()` returns without this rank allocating the parameters it does not hold:
/// each rank ends with what `FullyShardedDataParallel(make(), options_for(model))` would give it,
/// bit for bit, and leaves the global CPU generator where that would. `make` runs (on this
/// thread, on the CPU) three times with verify and twice without; it must build the same model
/// from the same seed each time and follow the rule above. `options_for(model)` gives the options
/// for one built instance (for `units` and `ignored_*`, which name its modules). Collective over
/// the options' process group. Throws ValueError if the runs differ.
/// With the options' sync_module_states (PyTorch's rank-0 path), rank 0 of the group builds the
/// whole model for real (once more: its constructor may read files or other tensors) and every
/// other rank ends with rank 0's values, received into its deferred model without ever holding
/// more than its share; the rule above and verify do not apply then.
template <typename Make, typename OptionsFor,
          typename = std::enable_if_t<std::is_invocable_v<OptionsFor, std::invoke_result_t<Make>&>>>
FullyShardedDataParallel wrap_deferred(Make&& make, OptionsFor&& options_for,
                                       const DeferredInitOptions& deferred = {}) {
  using ModuleType = std::invoke_result_t<Make>;
  return detail::wrap_deferred(
      [&]() {
        ModuleType m = make();
        detail::DeferredBuild b;
        if constexpr (!std::is_same_v<ModuleType, torch::nn::Sequential>) {
          b.any = torch::nn::AnyModule(m);
        }
        b.module = m.ptr();
        b.options = options_for(m);
        return b;
      },
      deferred);
}

/// wrap_deferred with the same options for every run (no `units` or `ignored_*`: those name
/// modules of one instance; use the form taking a function of the model).
template <typename Make>
FullyShardedDataParallel wrap_deferred(Make&& make, const FullyShardedOptions& options = {},
                                       const DeferredInitOptions& deferred = {}) {
  return wrap_deferred(
      std::forward<Make>(make), [&options](const std::invoke_result_t<Make>&) { return options; },
      deferred);
}

}  // namespace fsdp
