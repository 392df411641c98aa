// fsdp/detail/forward.h: the machinery behind fsdp::forward and FullyShardedDataParallel's
// forward (fully_sharded.h), which must be templates and so live in a header. Not an API: names
// here change without notice.
#pragma once

#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

namespace fsdp {
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
  // Constructed while a checkpointed forward is recomputed in backward: the unit is unsharded
  // for its backward and stays so (no reshard, no output hooks).
  bool recompute_ = false;
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

}  // namespace fsdp
