// The FSDP runtime: what happens around each unit's forward and backward.
//
//   pre-forward   unshard (or finish a prefetch); hook the parameters' AccumulateGrad nodes;
//                 optionally prefetch the next unit
//   post-forward  reshard (freeing, or keeping the buffer for SHARD_GRAD_OP); hook the outputs
//   pre-backward  (hook on an output's gradient) unshard again; queue the end-of-backward
//                 callback; optionally prefetch the unit whose backward comes next
//   post-backward (when every parameter's gradient has been accumulated, and, in a unit with
//                 frozen parameters, every input's gradient too) reshard and reduce-scatter the
//                 gradients
//   end of backward  finish units whose gradients were only partly produced, reset
//
// Every decision depends only on the forward/backward sequence, which all ranks share, so every
// rank issues the same collectives in the same order.
#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <unordered_map>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "flat_param/grad_bucket.h"
#include "fsdp/errors.h"
#include "runtime/state.h"
#include "util/tensor_utils.h"

namespace fsdp {
namespace detail {
namespace {

std::mutex g_units_mu;
std::unordered_map<const torch::nn::Module*, std::shared_ptr<UnitRef>> g_units;

// The unit `step` places after (+1: forward prefetch, in forward_order) or before (-1: backward
// prefetch, in post_forward_order) the first occurrence of `idx` in `order`; -1 if there is none.
int neighbour_in(const std::vector<int>& order, int idx, int step) {
  const auto it = std::find(order.begin(), order.end(), idx);
  if (it == order.end()) return -1;
  const long j = static_cast<long>(it - order.begin()) + step;
  return j < 0 || j >= static_cast<long>(order.size()) ? -1 : order[static_cast<size_t>(j)];
}

bool keeps_params_after_forward(ShardingStrategy s) {
  return s == ShardingStrategy::SHARD_GRAD_OP || s == ShardingStrategy::HYBRID_SHARD_ZERO2;
}

// Runs after AccumulateGrad has stored a parameter's gradient.
class GradReadyHook : public torch::autograd::FunctionPostHook {
 public:
  GradReadyHook(std::weak_ptr<FsdpState> s, int u) : state_(std::move(s)), unit_(u) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (auto s = state_.lock()) s->on_grad_ready(unit_);
    return outputs;
  }

 private:
  std::weak_ptr<FsdpState> state_;
  int unit_;
};

}  // namespace

std::shared_ptr<UnitRef> find_unit(const torch::nn::Module* m) {
  std::lock_guard<std::mutex> lock(g_units_mu);
  auto it = g_units.find(m);
  if (it == g_units.end()) return nullptr;
  if (it->second->state.expired()) {
    g_units.erase(it);
    return nullptr;
  }
  return it->second;
}

void FsdpState::register_units() {
  std::lock_guard<std::mutex> lock(g_units_mu);
  for (const auto& u : units) {
    auto ref = std::make_shared<UnitRef>();
    ref->state = weak_from_this();
    ref->index = u->index;
    g_units[u->module.get()] = ref;
  }
}

void FsdpState::unregister_units() {
  std::lock_guard<std::mutex> lock(g_units_mu);
  for (const auto& u : units) g_units.erase(u->module.get());
}

// ---------------------------------------------------------------------------------------------
// ForwardScope

ForwardScope::ForwardScope(const torch::nn::Module* m) : unit_(find_unit(m)) {
  if (!unit_) return;
  auto s = unit_->state.lock();
  if (!s) {
    unit_.reset();
    return;
  }
  if (recomputing() && s->in_backward) {
    recompute_ = true;
    s->pre_recompute(unit_->index);
    return;
  }
  s->pre_forward(unit_->index);
}

ForwardScope::~ForwardScope() {
  // An exception inside the module's forward: leave the unit resharded, without hooks.
  if (unit_ && !done_) {
    if (auto s = unit_->state.lock()) {
      try {
        Unit& u = *s->units[unit_->index];
        if (u.handle) u.handle->reshard(true);
      } catch (...) {
      }
    }
  }
}

void ForwardScope::track_output(const at::Tensor& t) {
  if (!unit_ || recompute_ || !t.defined() || !t.requires_grad()) return;
  std::weak_ptr<FsdpState> weak = unit_->state;
  const int idx = unit_->index;
  t.register_hook([weak, idx](const at::Tensor&) {
    if (auto s = weak.lock()) s->pre_backward(idx);
  });
}

void ForwardScope::track_input(const at::Tensor& t) {
  if (!unit_) return;
  if (auto s = unit_->state.lock()) s->track_input(unit_->index, t);
}

void ForwardScope::post_forward() {
  if (!unit_ || done_) return;
  done_ = true;
  if (recompute_) return;  // its backward comes next: post-backward reshards
  if (auto s = unit_->state.lock()) s->post_forward(unit_->index);
}

at::Tensor forward_sequential(torch::nn::Sequential& seq, const at::Tensor& input) {
  at::Tensor x = input;
  for (auto& any : *seq) {
    ForwardScope scope(any.ptr().get());
    scope.track_input(x);
    const CheckpointOptions* mark = checkpoint_mark(any.ptr().get());
    if (mark != nullptr && torch::GradMode::is_enabled()) {
      CheckpointFunction fn = [any](const std::vector<at::Tensor>& in) mutable {
        return std::vector<at::Tensor>{any.forward(in.at(0))};
      };
      x = checkpoint_function(fn, {x}, any.ptr()->parameters(), *mark).at(0);
    } else {
      x = any.forward(x);
    }
    scope.track_output(x);
    scope.post_forward();
  }
  return x;
}

// ---------------------------------------------------------------------------------------------
// Forward

bool full_precision_in_eval() {
  const char* v = std::getenv("FSDP_USE_FULL_PREC_IN_EVAL");
  return v != nullptr && std::string(v) == "1";
}

void FsdpState::cast_buffers(bool full_precision) {
  const auto dtype = options.mixed_precision().buffer_dtype();
  if (!dtype || (buffers_cast && buffers_full_precision == full_precision)) return;
  buffers_cast = true;
  buffers_full_precision = full_precision;
  at::NoGradGuard no_grad;
  for (auto& b : root_module->buffers()) {
    if (!b.is_floating_point() || ignored_buffers.count(b.unsafeGetTensorImpl())) continue;
    // The first cast records the original dtype; FSDP_USE_FULL_PREC_IN_EVAL casts back to it for
    // evaluation and to buffer_dtype again for training, as PyTorch's root pre-forward does.
    auto it = buffer_orig_dtypes.emplace(b.unsafeGetTensorImpl(), b.scalar_type()).first;
    const at::ScalarType want = full_precision ? it->second : *dtype;
    if (b.scalar_type() != want) b.set_data(b.to(want));
  }
}

void FsdpState::reset_iteration() {
  // Reductions a backward left in flight (one that threw before its end): complete them, so that
  // the gradients they carry land and the ranks' collectives stay matched.
  launch_bucket();  // left open only by a backward that threw before its end
  while (!reducing.empty()) finish_oldest_reduction();
  if (!bucket_order.empty()) last_bucket_order = std::exchange(bucket_order, {});
  if (!bucket_buffers.empty()) keep_bucket_buffers();
  buckets_launched = 0;
  for (auto& u : units) {
    if (u->handle) {
      if (u->handle->has_pending_unshard()) u->handle->abandon_unshard();
      if (u->handle->is_unsharded() || u->handle->unsharded_storage_bytes() > 0) {
        u->handle->reshard(true);
      }
      u->handle->set_training_state(HandleTrainingState::IDLE);
    }
    u->forward_done = u->pre_backward_done = u->post_backward_done = false;
    u->grads_ready = u->inputs_hooked = u->inputs_ready = 0;
    u->input_unhooked = false;
    u->iter_nodes.clear();
  }
  post_forward_order.clear();  // recorded anew by every forward, as PyTorch does
  callback_queued = false;
  in_backward = false;
}

void FsdpState::pre_forward(int idx) {
  if (in_summon) throw StateError("forward called inside SummonFullParamsGuard");
  Unit& u = *units[idx];
  if (idx == 0) {
    // A new iteration starts at the root. Anything a forward without backward left unsharded
    // (eval under grad mode, an exception) is resharded first.
    reset_iteration();
    // Evaluation needs no gradient buckets, and may last long: what keep_grad_buckets kept goes.
    if (!root_module->is_training()) last_bucket_buffers.clear();
    cast_buffers(!root_module->is_training() && full_precision_in_eval());
  }
  u.forward_done = true;
  if (!order_recorded && (forward_order.empty() || forward_order.back() != idx)) {
    forward_order.push_back(idx);
  }
  if (!u.handle) return;
  u.handle->set_training_state(HandleTrainingState::FORWARD);
  u.handle->set_full_precision_in_eval(!u.module->is_training() && full_precision_in_eval());
  u.handle->reset_flat_param_grad_info_if_needed();
  u.handle->unshard();
  if (torch::GradMode::is_enabled()) hook_grad_accumulators(u);
  if (options.forward_prefetch() && order_recorded) prefetch(neighbour_in(forward_order, idx, +1));
}

void FsdpState::post_forward(int idx) {
  Unit& u = *units[idx];
  if (!u.handle) return;
  if (std::find(post_forward_order.begin(), post_forward_order.end(), idx) ==
      post_forward_order.end()) {
    post_forward_order.push_back(idx);
  }
  const bool grad = torch::GradMode::is_enabled();
  // The root's parameters are needed again as soon as backward starts: PyTorch keeps them.
  if (!(idx == 0 && grad)) {
    const bool keep = grad && keeps_params_after_forward(options.sharding_strategy());
    // Still in FORWARD state, as in PyTorch: the handle decides from it whether the original
    // parameters keep their unsharded views (skipped_use_sharded_views).
    u.handle->reshard(/*free_unsharded=*/!keep);
  }
  u.handle->set_training_state(HandleTrainingState::IDLE);
}

void FsdpState::hook_grad_accumulators(Unit& u) {
  auto params = u.handle->orig_params();
  u.hooked.resize(params.size());
  u.waits_for_inputs = false;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].requires_grad()) {
      u.waits_for_inputs = true;
      continue;
    }
    // Created here, after unshard, so its recorded shape and dtype are those of the forward.
    auto acc = torch::autograd::impl::grad_accumulator(params[i]);
    if (!acc) continue;
    if (acc != u.hooked[i]) {
      acc->add_post_hook(std::make_unique<GradReadyHook>(weak_from_this(), u.index));
      u.hooked[i] = acc;
    }
    if (std::find(u.iter_nodes.begin(), u.iter_nodes.end(), acc) == u.iter_nodes.end()) {
      u.iter_nodes.push_back(std::move(acc));
    }
  }
}

void FsdpState::prefetch(int idx) {
  if (idx < 0 || options.max_inflight_all_gathers() < 1) return;
  int inflight = 0;
  for (const auto& u : units) inflight += u->handle && u->handle->has_pending_unshard();
  if (inflight >= options.max_inflight_all_gathers()) return;
  Unit& u = *units[idx];
  if (!u.handle || u.handle->is_unsharded() || u.handle->has_pending_unshard()) return;
  // Only a unit whose turn is still ahead: in forward one not yet run, in backward one whose
  // gradients are not yet reduced. (Gathering a finished unit again would be wasted traffic.)
  if (u.post_backward_done || (u.forward_done && !u.pre_backward_done && !in_backward)) return;
  u.handle->unshard_async();
}

// ---------------------------------------------------------------------------------------------
// Backward

void FsdpState::pre_recompute(int idx) {
  // A unit run inside a checkpointed region: its forward ran without gradients, so it was
  // resharded with no hooks; now, in backward, its forward runs again just before its backward.
  // One unshard serves both (backward's, as its pre-backward hook would have made it), and the
  // parameters' gradient hooks are registered as a forward would.
  Unit& u = *units[idx];
  pre_backward(idx);
  if (!u.handle) return;
  u.handle->unshard();
  hook_grad_accumulators(u);
}

void FsdpState::pre_backward(int idx) {
  Unit& u = *units[idx];
  if (u.pre_backward_done) return;
  u.pre_backward_done = true;
  in_backward = true;
  if (!callback_queued) {
    callback_queued = true;
    std::weak_ptr<FsdpState> weak = weak_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([weak]() {
      if (auto s = weak.lock()) s->finalize_backward();
    });
  }
  if (!u.handle) return;
  u.handle->set_training_state(HandleTrainingState::BACKWARD_PRE);
  u.handle->unshard();
  u.handle->prepare_grads_for_backward();
  if (options.backward_prefetch() == BackwardPrefetch::BACKWARD_PRE) {
    prefetch(neighbour_in(post_forward_order, idx, -1));
  }
}

void FsdpState::on_grad_ready(int idx) {
  Unit& u = *units[idx];
  if (u.handle) u.handle->mark_grads_unreduced();
  ++u.grads_ready;
  post_backward_if_done(idx);
}

void FsdpState::track_input(int idx, const at::Tensor& t) {
  Unit& u = *units[idx];
  if (!u.waits_for_inputs || !torch::GradMode::is_enabled() || !t.defined() || !t.requires_grad()) {
    return;
  }
  if (t.is_leaf()) {
    u.input_unhooked = true;
    return;
  }
  // A non-leaf input is made by this iteration's forward, so the hook goes with its graph. It
  // fires once the input's gradient is complete: every use of it inside the unit, frozen
  // parameters' included, has run its backward by then.
  ++u.inputs_hooked;
  std::weak_ptr<FsdpState> weak = weak_from_this();
  t.register_hook([weak, idx](const at::Tensor&) {
    if (auto s = weak.lock()) s->on_input_grad(idx);
  });
}

void FsdpState::on_input_grad(int idx) {
  ++units[idx]->inputs_ready;
  post_backward_if_done(idx);
}

void FsdpState::post_backward_if_done(int idx) {
  Unit& u = *units[idx];
  if (u.post_backward_done || u.grads_ready < static_cast<int>(u.iter_nodes.size())) return;
  // With frozen parameters, the inputs' gradients too (see Unit::waits_for_inputs). A unit frozen
  // whole thus reshards as soon as its inputs' gradients are done (PyTorch's reshard-only hook)
  // rather than at the end of backward. Where no input needs a gradient, the frozen parameters'
  // backward can only serve the unit's own trainable parameters, all of whose gradients are in.
  if (u.waits_for_inputs && (u.input_unhooked || u.inputs_ready < u.inputs_hooked)) return;
  post_backward(idx);
}

void FsdpState::post_backward(int idx) {
  Unit& u = *units[idx];
  if (u.post_backward_done || !u.handle) return;
  u.post_backward_done = true;
  u.handle->set_training_state(HandleTrainingState::BACKWARD_POST);
  // Reduced whether or not this rank produced gradients (zeros are harmless), so that the
  // collective happens on every rank. Ranks must still run the same graph: which units finish
  // inside backward and which in finalize_backward follows from it.
  // Reshard first, as PyTorch's _post_backward_hook does: the unsharded parameters are not needed
  // by the reduction, and freeing them before it lowers the peak of backward by a unit.
  u.handle->reshard(true);
  if (sync_gradients && u.handle->flat_param().requires_grad()) {
    if (bucketed(*u.handle)) {
      add_to_bucket(idx);
    } else {
      start_reduction({idx}, [&u]() { u.handle->reduce_grad_async(); });
    }
  }
  u.handle->set_training_state(HandleTrainingState::IDLE);
  if (options.backward_prefetch() == BackwardPrefetch::BACKWARD_POST) {
    prefetch(neighbour_in(post_forward_order, idx, -1));
  }
}

void FsdpState::finalize_backward() {
  // Units whose gradients were only partly produced (unused parameters), or that were unsharded
  // for backward but produced none (frozen): finish them in reverse forward order, as their
  // backward would have run.
  for (auto it = forward_order.rbegin(); it != forward_order.rend(); ++it) {
    Unit& u = *units[*it];
    if ((u.forward_done || u.pre_backward_done) && !u.post_backward_done) post_backward(*it);
  }
  for (auto& u : units) {
    if ((u->forward_done || u->pre_backward_done) && !u->post_backward_done)
      post_backward(u->index);
  }
  // The optimizer step comes next: every gradient must be reduced before this returns
  // (reset_iteration launches the last bucket and finishes the reductions still in flight).
  order_recorded = true;
  reset_iteration();
}

void FsdpState::finish_prefetched_unshards_on_cpu() {
  // Gloo's all-gather receives into a scratch copy of the whole unit on its worker thread and
  // copies it out at the end, so a prefetch still in flight holds one more unit of memory. The
  // reduction about to start allocates the unit's flat gradient and (on LibTorch 1.13) the
  // all-to-all's receive buffer, the peak of backward; whether the prefetch's scratch copy was
  // still alive then varied with thread timing, and with it the peak, by a unit from run to run.
  // Finished first, it never is. It costs little: the next unit's pre-backward, which comes
  // right after this reduction, waits for the same all-gather, started a whole unit's backward
  // ago. On a GPU, NCCL gathers in place and a wait here would stall the compute stream instead.
  for (auto& other : units) {
    if (other->handle && other->handle->has_pending_unshard() &&
        other->handle->options().device().is_cpu()) {
      other->handle->wait_unshard();
    }
  }
}

void FsdpState::start_reduction(std::vector<int> group, const std::function<void()>& start) {
  // The reduction runs on the backend's threads (or stream) while autograd goes on with the
  // units before this one; at most `inflight` are in flight, each holding its units' gradients
  // (under the sharded strategies the unsharded ones), and finalize_backward (through
  // reset_iteration) finishes the rest.
  const FlatParamHandle& h = *units[group.front()]->handle;
  const int inflight =
      options.max_inflight_grad_reductions().value_or(h.uses_sharded_strategy() ? 0 : 1);
  while (!reducing.empty() && static_cast<int>(reducing.size()) >= std::max(inflight, 1)) {
    finish_oldest_reduction();
  }
  finish_prefetched_unshards_on_cpu();
  start();
  reducing.push_back(std::move(group));
  if (inflight <= 0) finish_oldest_reduction();
}

void FsdpState::finish_oldest_reduction() {
  const std::vector<int> group = std::move(reducing.front());
  reducing.pop_front();  // first: a failed collective is not waited for again
  // A bucket's first unit waits for its all-reduce; the others find it done. If it failed, each
  // of them throws when finished (here, or when its handle is next used).
  for (int i : group) units[i]->handle->finish_reduce_grad();
}

// ---------------------------------------------------------------------------------------------
// Gradient buckets (NO_SHARD): DDP's Reducer, over units. A bucket fills with the units whose
// post-backward comes next, and closes once it holds bucket_cap_bytes() (or at the end of
// backward). Which units share a bucket thus follows from the order of post-backwards and the
// units' sizes alone, the same on every rank, as the order of per-unit collectives already must.

bool FsdpState::bucketed(const FlatParamHandle& h) const {
  return !h.uses_sharded_strategy() && options.bucket_cap_mb() > 0;
}

int64_t FsdpState::bucket_cap_bytes() const {
  const double cap = options.bucket_cap_mb() * 1024 * 1024;
  // DDP's first bucket (kDefaultFirstBucketBytes): small, so that the first all-reduce starts
  // early in backward rather than after a whole cap's worth of gradients.
  return static_cast<int64_t>(buckets_launched == 0 ? std::min(cap, 1024.0 * 1024) : cap);
}

void FsdpState::add_to_bucket(int idx) {
  FlatParamHandle& h = *units[idx]->handle;
  // One collective carries one dtype on one device; a handle that finished its reduction early
  // (a unit whose gradients came again) launched the bucket already.
  if (open_bucket && (open_bucket->launched() || open_bucket->dtype() != h.reduce_dtype() ||
                      open_bucket->device() != h.options().device() ||
                      open_bucket->divide_after() != h.grad_bucket_divisions())) {
    launch_bucket();
  }
  if (!open_bucket) open_bucket = new_bucket(idx);
  h.reduce_grad_into(open_bucket);
  open_bucket_units.push_back(idx);
  bucket_order.push_back(idx);
  if (open_bucket->nbytes() >= bucket_cap_bytes()) launch_bucket();
}

// A bucket starting at unit `idx`, with a buffer for the units that followed it into the same
// bucket in the last backward: in steady training the same ones follow, each unit's gradient is
// written straight into its slice, and the all-reduce needs no copy.
std::shared_ptr<GradBucket> FsdpState::new_bucket(int idx) {
  const FlatParamHandle& h = *units[idx]->handle;
  const int64_t elem = static_cast<int64_t>(c10::elementSize(h.reduce_dtype()));
  const int64_t cap = bucket_cap_bytes();
  std::vector<double> divisions = h.grad_bucket_divisions();
  int64_t planned = 0;
  for (auto it = std::find(last_bucket_order.begin(), last_bucket_order.end(), idx);
       it != last_bucket_order.end(); ++it) {
    const FlatParamHandle& next = *units[*it]->handle;
    if (next.reduce_dtype() != h.reduce_dtype() ||
        next.options().device() != h.options().device() ||
        next.grad_bucket_divisions() != divisions) {
      break;
    }
    planned += next.layout().padded_unsharded_numel;
    if (planned * elem >= cap) break;
  }
  at::Tensor buffer;
  if (planned > 0) buffer = bucket_buffer(planned, h.reduce_dtype(), h.options().device());
  return std::make_shared<GradBucket>(units[idx]->handle->process_group(), h.reduce_dtype(),
                                      h.options().device(), std::move(divisions), buffer);
}

// A planned bucket's buffer. On the CPU (FullyShardedOptions::keep_grad_buckets) it is one of
// the last backward's, where one of the size wanted is held by nothing else any more. DDP's
// buckets live as long as its reducer; ours were freed with the gradients at every
// zero_grad(set_to_none) and allocated again in the next backward, and the C library hands large
// freed blocks back to the kernel, so they came back as fresh pages to fault in and zero: on
// LibTorch 2.6 the blocks model's step took 2,600 minor faults, DDP's 22-88, and 31 with this
// (docs/performance.md). A buffer is free once nothing else shares its storage: not a gradient
// the user kept, whole or as a view, nor one the next reduction adds into, nor the backend's hold
// on a collective just finished (then a fresh buffer is taken). Off the CPU the caching allocator
// keeps freed memory already, and its streams decide when memory may be reused.
at::Tensor FsdpState::bucket_buffer(int64_t numel, at::ScalarType dtype, at::Device device) {
  const auto opts = at::TensorOptions().dtype(dtype).device(device);
  if (!device.is_cpu() || !options.keep_grad_buckets()) return detail::empty_buffer(numel, opts);
  at::Tensor buffer;
  for (at::Tensor& b : last_bucket_buffers) {
    // Held only by this list: no other tensor object, and no other view of its storage.
    if (b.defined() && b.numel() == numel && b.scalar_type() == dtype && b.device() == device &&
        b.use_count() == 1 && b.storage().use_count() == 1) {
      buffer = std::exchange(b, at::Tensor());
      break;
    }
  }
  if (!buffer.defined()) buffer = detail::empty_buffer(numel, opts);
  bucket_buffers.push_back(buffer);
  return buffer;
}

// At the end of a backward: of its bucket buffers, keep for the next one those the units'
// gradients now live in (what zero_grad(set_to_none) will drop, and DDP would have kept); let go of
// the rest and of the last backward's. A buffer whose result was added into gradients kept from
// before (accumulation, or LibTorch 1.13's zero_grad, which zeroes in place) is not kept: it would
// be a second set of gradients held for nothing, since those gradients stay where they are.
void FsdpState::keep_bucket_buffers() {
  std::vector<at::Tensor> keep;
  for (at::Tensor& b : std::exchange(bucket_buffers, {})) {
    for (const auto& u : units) {
      if (!u->handle) continue;
      const at::Tensor& g = u->handle->flat_param().grad();
      if (g.defined() && g.storage().is_alias_of(b.storage())) {
        keep.push_back(std::move(b));
        break;
      }
    }
  }
  last_bucket_buffers = std::move(keep);
}

void FsdpState::launch_bucket() {
  if (!open_bucket) return;
  std::shared_ptr<GradBucket> bucket = std::move(open_bucket);
  open_bucket.reset();
  ++buckets_launched;
  start_reduction(std::exchange(open_bucket_units, {}), [&bucket]() { bucket->launch(); });
}

}  // namespace detail
}  // namespace fsdp
