// fsdp/detail/deferred_init.h: what wrap_deferred's templates (fsdp/deferred_init.h) hand to
// the library. Not an API.
#pragma once

#include <functional>
#include <memory>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>

#include "fsdp/fully_sharded.h"
#include "fsdp/options.h"

namespace fsdp {

struct DeferredInitOptions;

namespace detail {

// One run of the user's constructor: the module and the options to wrap this instance with.
struct DeferredBuild {
  torch::nn::AnyModule any;  // empty for a Sequential, as FullyShardedDataParallelImpl takes it
  std::shared_ptr<torch::nn::Module> module;
  FullyShardedOptions options;
};

// The work of wrap_deferred (runtime/deferred_init.cpp); `build` runs the constructor.
FullyShardedDataParallel wrap_deferred(const std::function<DeferredBuild()>& build,
                                       const DeferredInitOptions& deferred);

}  // namespace detail

}  // namespace fsdp
