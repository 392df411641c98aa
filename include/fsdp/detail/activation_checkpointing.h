// fsdp/detail/activation_checkpointing.h: the templates behind fsdp::checkpoint_module and
// fsdp::forward's checkpointing of marked modules (fsdp/activation_checkpointing.h, which includes
// this after declaring what it uses; include that one). Not an API: names here change without
// notice.
#pragma once

#include <cstddef>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/module.h>

#include "fsdp/detail/forward.h"

namespace fsdp {
namespace detail {

/// The options a module was marked with, or null if it is not marked.
const CheckpointOptions* checkpoint_mark(const torch::nn::Module* m);
/// True on the thread that is recomputing a checkpointed forward (inside its backward).
bool recomputing();

// Tensors in an argument list, in order, and the same list with them replaced.
inline void collect_tensor(std::vector<at::Tensor>& out, const at::Tensor& t) { out.push_back(t); }
template <typename T>
void collect_tensor(std::vector<at::Tensor>&, const T&) {}
inline at::Tensor replace_tensor(const at::Tensor&, const std::vector<at::Tensor>& ts, size_t& i) {
  return ts[i++];
}
template <typename T>
const T& replace_tensor(const T& x, const std::vector<at::Tensor>&, size_t&) {
  return x;
}

// A forward's output as a list of tensors and back: Tensor, vector<Tensor>, tuple<Tensor...>.
template <typename T>
struct OutputTensors : std::false_type {};
template <>
struct OutputTensors<at::Tensor> : std::true_type {
  static std::vector<at::Tensor> to(const at::Tensor& t) { return {t}; }
  static at::Tensor from(std::vector<at::Tensor> v) { return std::move(v.at(0)); }
};
template <>
struct OutputTensors<std::vector<at::Tensor>> : std::true_type {
  static std::vector<at::Tensor> to(const std::vector<at::Tensor>& v) { return v; }
  static std::vector<at::Tensor> from(std::vector<at::Tensor> v) { return v; }
};
template <typename... Ts>
struct OutputTensors<std::tuple<Ts...>>
    : std::bool_constant<(std::is_same_v<Ts, at::Tensor> && ...)> {
  static std::vector<at::Tensor> to(const std::tuple<Ts...>& t) {
    return std::apply([](const auto&... e) { return std::vector<at::Tensor>{e...}; }, t);
  }
  static std::tuple<Ts...> from(std::vector<at::Tensor> v) {
    return from_impl(std::move(v), std::index_sequence_for<Ts...>{});
  }
  template <size_t... I>
  static std::tuple<Ts...> from_impl(std::vector<at::Tensor> v, std::index_sequence<I...>) {
    return std::tuple<Ts...>(std::move(v.at(I))...);
  }
};

template <typename M, typename... Args>
using ForwardResult = std::decay_t<decltype(std::declval<M&>()->forward(std::declval<Args>()...))>;

/// Whether a module's forward with these arguments can be checkpointed: its result is made of
/// tensors and every argument can be kept until backward.
template <typename M, typename... Args>
constexpr bool checkpointable() {
  return OutputTensors<ForwardResult<M, Args...>>::value &&
         (std::is_copy_constructible_v<std::decay_t<Args>> && ...);
}

template <typename M>
std::vector<at::Tensor> raw_params(const M& module) {
  return module->parameters();
}

/// `module->forward(args...)` checkpointed (no ForwardScope: the caller has one where needed).
template <typename M, typename... Args>
auto checkpointed_forward(M& module, const CheckpointOptions& options, Args&&... args) {
  using Out = ForwardResult<M, Args...>;
  std::vector<at::Tensor> tensors;
  (collect_tensor(tensors, args), ...);
  // The module handle and the non-tensor arguments are kept for the recomputation; the tensors
  // are handed over separately, so that the checkpoint saves (and version-checks) them.
  auto kept = std::make_shared<std::tuple<std::decay_t<M>, std::decay_t<Args>...>>(
      module, std::forward<Args>(args)...);
  CheckpointFunction fn = [kept](const std::vector<at::Tensor>& ts) {
    return std::apply(
        [&ts](auto& m, const auto&... a) {
          size_t i = 0;
          // Braced: the arguments are evaluated, and the tensors replaced, left to right.
          return OutputTensors<Out>::to(std::apply(
              [&m](auto&&... r) { return m->forward(std::forward<decltype(r)>(r)...); },
              std::tuple<decltype(replace_tensor(a, ts, i))...>{replace_tensor(a, ts, i)...}));
        },
        *kept);
  };
  return OutputTensors<Out>::from(checkpoint_function(fn, tensors, raw_params(module), options));
}

[[noreturn]] void throw_not_checkpointable(const torch::nn::Module* m);

/// fsdp::forward's call of the module: checkpointed if the module is marked.
template <typename M, typename... Args>
ForwardResult<M, Args...> run_forward(M& module, Args&&... args) {
  const CheckpointOptions* mark = checkpoint_mark(raw(module));
  if constexpr (checkpointable<M, Args...>()) {
    if (mark != nullptr && torch::GradMode::is_enabled()) {
      return checkpointed_forward(module, *mark, std::forward<Args>(args)...);
    }
  } else {
    if (mark != nullptr) throw_not_checkpointable(raw(module));
  }
  return module->forward(std::forward<Args>(args)...);
}

}  // namespace detail

}  // namespace fsdp
