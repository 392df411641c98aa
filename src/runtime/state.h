// Internal: the runtime state of one wrapped model and its units.
#pragma once

#include <memory>
#include <vector>

#include <torch/csrc/autograd/function.h>

#include <deque>
#include <functional>
#include <map>
#include <unordered_set>

#include "fsdp/activation_checkpointing.h"
#include "fsdp/fully_sharded.h"

namespace fsdp {
namespace detail {

/// One FSDP unit: a module subtree whose parameters one FlatParamHandle owns.
struct Unit {
  int index = 0;
  std::string fqn;  // in the wrapped module; "" for the root
  std::shared_ptr<torch::nn::Module> module;
  std::unique_ptr<FlatParamHandle> handle;  // null for a root without parameters of its own
  // The AccumulateGrad node carrying our post hook, per original parameter (the latest one).
  // Holding it keeps the hook alive across iterations (autograd keeps only a weak reference).
  std::vector<compat::AutogradNodePtr> hooked;
  // Every AccumulateGrad node this iteration's forwards hooked: usually one per parameter, more
  // when a unit runs twice and set_data (dtype or device change) made autograd create new ones.
  // post-backward runs once all of them have fired.
  std::vector<compat::AutogradNodePtr> iter_nodes;

  // A unit with frozen parameters (requires_grad false) must not reshard when its trainable
  // parameters' gradients are in: autograd may still need the frozen ones for the gradient of
  // the unit's inputs (a frozen weight's matmul, after its bias's gradient is done). So its
  // post-backward also waits for the gradient of every input that requires it (set in
  // hook_grad_accumulators; see track_input).
  bool waits_for_inputs = false;

  // Per iteration.
  bool forward_done = false;
  bool pre_backward_done = false;
  bool post_backward_done = false;
  int grads_ready = 0;
  int inputs_hooked = 0;  // inputs whose gradient hook this iteration's forwards registered
  int inputs_ready = 0;   // ... of which have fired
  // An input that requires grad but is a leaf, which gets no hook (it would stay on the user's
  // tensor across iterations): the post-backward then comes at the end of backward.
  bool input_unhooked = false;
};

struct UnitRef {
  std::weak_ptr<FsdpState> state;
  int index = 0;
};

class FsdpState : public std::enable_shared_from_this<FsdpState> {
 public:
  FullyShardedOptions options;
  dist::ProcessGroup shard_group;
  std::optional<dist::ProcessGroup> replicate_group;
  std::vector<std::unique_ptr<Unit>> units;  // units[0] is the root
  std::vector<int> forward_order;            // unit indices in the order of the first forward
  // Units with a handle in the order their forward ended, this iteration (first use only):
  // PyTorch's backward-prefetch order. It differs from forward_order for nested units: a parent,
  // the root included, ends after its children, so its backward, which comes first, prefetches
  // the last child.
  std::vector<int> post_forward_order;
  bool order_recorded = false;
  bool sync_gradients = true;
  bool callback_queued = false;
  bool in_backward = false;  // from the first pre-backward hook to the end-of-backward callback
  bool in_summon = false;
  // Units whose gradient reduction is in flight, one entry per collective (a bucket's units
  // together), oldest first (see post_backward).
  std::deque<std::vector<int>> reducing;
  // NO_SHARD's gradient bucket being filled (FullyShardedOptions::bucket_cap_mb) and its units;
  // the buckets this backward launched (the first one is smaller).
  std::shared_ptr<GradBucket> open_bucket;
  std::vector<int> open_bucket_units;
  int buckets_launched = 0;
  // Units in the order their gradients entered buckets, this backward and the last: a new
  // bucket's buffer is sized from the last one (see new_bucket).
  std::vector<int> bucket_order, last_bucket_order;
  // The CPU buffers of this backward's buckets, and those of the last one that its gradients live
  // in, kept to be reused (FullyShardedOptions::keep_grad_buckets; see bucket_buffer).
  std::vector<at::Tensor> bucket_buffers, last_bucket_buffers;
  bool buffers_cast = false;
  bool buffers_full_precision = false;  // buffers currently in their original dtypes
  std::shared_ptr<torch::nn::Module> root_module;
  dist::ProcessGroup world_group;  // all data-parallel ranks (shard x replicate)
  std::vector<at::Tensor> ignored_params;
  // Buffers of ignored modules: never cast to buffer_dtype (PyTorch skips _ignored_buffer_names).
  std::unordered_set<const c10::TensorImpl*> ignored_buffers;
  std::map<const c10::TensorImpl*, at::ScalarType> buffer_orig_dtypes;  // set by buffer_dtype casts

  void pre_forward(int u);
  void post_forward(int u);
  void pre_backward(int u);
  /// A unit reached while a checkpointed forward is recomputed in backward.
  void pre_recompute(int u);
  void on_grad_ready(int u);
  void track_input(int u, const at::Tensor& t);
  void on_input_grad(int u);
  // Post-backward, once the unit's gradients, and the inputs' it waits for, are all in.
  void post_backward_if_done(int u);
  void post_backward(int u);
  void finalize_backward();
  /// Reshards whatever a forward without backward left unsharded; resets per-iteration flags.
  void reset_iteration();
  void register_units();
  void unregister_units();

 private:
  void hook_grad_accumulators(Unit& unit);
  void prefetch(int u);
  void finish_oldest_reduction();
  // Starts a unit's gradient reduction, or a bucket's, keeping at most
  // max_inflight_grad_reductions collectives in flight.
  void start_reduction(std::vector<int> group, const std::function<void()>& start);
  bool bucketed(const FlatParamHandle& h) const;
  int64_t bucket_cap_bytes() const;
  void add_to_bucket(int u);
  std::shared_ptr<GradBucket> new_bucket(int u);
  at::Tensor bucket_buffer(int64_t numel, at::ScalarType dtype, at::Device device);
  void keep_bucket_buffers();
  void launch_bucket();
  void finish_prefetched_unshards_on_cpu();
  void cast_buffers(bool full_precision);
};

}  // namespace detail
}  // namespace fsdp
