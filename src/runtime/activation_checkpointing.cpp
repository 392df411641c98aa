// Activation checkpointing (fsdp/activation_checkpointing.h): a C++ autograd function that runs
// its forward with gradients off and, in its backward, recomputes it with gradients on and
// backpropagates the recomputed graph (PyTorch's reentrant checkpoint; why not the non-reentrant
// kind: see the header).
#include <atomic>
#include <mutex>
#include <unordered_map>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/variable.h>

#include "fsdp/activation_checkpointing.h"
#include "fsdp/errors.h"
#include "runtime/state.h"

namespace fsdp {
namespace detail {
namespace {

// ---- Which modules fsdp::forward checkpoints ----

struct Mark {
  std::weak_ptr<torch::nn::Module> module;  // a stale address (module destroyed) is no mark
  CheckpointOptions options;
};
std::mutex g_marks_mu;
std::unordered_map<const torch::nn::Module*, Mark> g_marks;
std::atomic<int> g_mark_count{0};  // fsdp::forward's fast path: nothing is marked

thread_local int t_recomputing = 0;

// ---- The state a recomputation restores ----

// The generators' states at the forward: the CPU's, and each CUDA device's an input is on. None
// (empty) where the call does not preserve them.
struct RngStates {
  std::vector<std::pair<at::Generator, at::Tensor>> saved;

  static RngStates capture(const std::vector<at::Tensor>& inputs) {
    RngStates r;
    std::vector<at::Device> devices{at::Device(at::kCPU)};
    for (const auto& t : inputs) {
      if (t.defined() && t.is_cuda() &&
          std::find(devices.begin(), devices.end(), t.device()) == devices.end()) {
        devices.push_back(t.device());
      }
    }
    for (const auto& d : devices) {
      at::Generator gen = at::globalContext().defaultGenerator(d);
      std::lock_guard<std::mutex> lock(gen.mutex());
      r.saved.emplace_back(gen, gen.get_state());
    }
    return r;
  }
  void restore() const {
    for (const auto& [gen, state] : saved) {
      at::Generator g = gen;
      std::lock_guard<std::mutex> lock(g.mutex());
      g.set_state(state);
    }
  }
};

struct AutocastState {
  bool cpu_enabled = false, cuda_enabled = false, cache_enabled = true;
  at::ScalarType cpu_dtype = at::kBFloat16, cuda_dtype = at::kHalf;

  static AutocastState capture() {
    AutocastState a;
    a.cpu_enabled = compat::autocast_enabled(at::kCPU);
    a.cuda_enabled = compat::autocast_enabled(at::kCUDA);
    a.cpu_dtype = compat::autocast_dtype(at::kCPU);
    a.cuda_dtype = compat::autocast_dtype(at::kCUDA);
    a.cache_enabled = at::autocast::is_autocast_cache_enabled();
    return a;
  }
  void apply() const {
    compat::set_autocast_enabled(at::kCPU, cpu_enabled);
    compat::set_autocast_enabled(at::kCUDA, cuda_enabled);
    compat::set_autocast_dtype(at::kCPU, cpu_dtype);
    compat::set_autocast_dtype(at::kCUDA, cuda_dtype);
    at::autocast::set_autocast_cache_enabled(cache_enabled);
  }
};

// Sets the forward's RNG and autocast state and marks the thread as recomputing; puts back what
// was there when it ends, so that backward leaves the user's RNG stream where it was.
class RecomputeScope {
 public:
  RecomputeScope(const RngStates& rng, const AutocastState& autocast,
                 const std::vector<at::Tensor>& inputs)
      : autocast_(AutocastState::capture()) {
    if (!rng.saved.empty()) {
      current_rng_ = RngStates::capture(inputs);
      rng.restore();
    }
    autocast.apply();
    // As an autocast region of its own (PyTorch's recomputation enters torch.autocast): the casts
    // of parameters it caches are dropped when the outermost region ends, not kept (stale after
    // the optimizer's step, and a copy of every parameter held).
    autocast_region_ = autocast.cpu_enabled || autocast.cuda_enabled;
    if (autocast_region_) at::autocast::increment_nesting();
    ++t_recomputing;
  }
  ~RecomputeScope() {
    --t_recomputing;
    if (autocast_region_ && at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    autocast_.apply();
    current_rng_.restore();
  }
  RecomputeScope(const RecomputeScope&) = delete;
  RecomputeScope& operator=(const RecomputeScope&) = delete;

 private:
  AutocastState autocast_;
  RngStates current_rng_;
  bool autocast_region_ = false;
};

// What the autograd function keeps from forward to backward besides the saved inputs.
struct Recompute : torch::CustomClassHolder {
  CheckpointFunction fn;
  RngStates rng;
  AutocastState autocast;
  size_t num_inputs = 0;  // the real inputs; a placeholder may follow them (see below)
};

class CheckpointNode : public torch::autograd::Function<CheckpointNode> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList tensors,
                                                const c10::intrusive_ptr<Recompute>& r) {
    std::vector<at::Tensor> inputs(tensors.begin(), tensors.begin() + r->num_inputs);
    ctx->save_for_backward(inputs);
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(r);
    ctx->set_materialize_grads(false);
    std::vector<at::Tensor> outputs = r->fn(inputs);
    for (const auto& o : outputs) {
      // Integer and boolean outputs carry no gradient (autograd's own test of the dtype).
      if (o.defined() && !torch::autograd::isDifferentiableType(o.scalar_type())) {
        ctx->mark_non_differentiable({o});
      }
    }
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto r = ctx->saved_data["recompute"].toCapsule();
    auto* rec = static_cast<Recompute*>(r.get());
    const std::vector<at::Tensor> saved = ctx->get_saved_variables();
    std::vector<at::Tensor> inputs;
    inputs.reserve(saved.size());
    for (const auto& s : saved) {
      // Leaves of the recomputed graph, so that backward accumulates their gradients here.
      at::Tensor d = s.defined() ? s.detach() : s;
      if (d.defined() && s.requires_grad()) d.requires_grad_(true);
      inputs.push_back(std::move(d));
    }
    std::vector<at::Tensor> outputs;
    {
      RecomputeScope scope(rec->rng, rec->autocast, inputs);
      at::AutoGradMode grad_on(true);
      outputs = rec->fn(inputs);
    }
    if (outputs.size() != grads.size()) {
      throw StateError("activation checkpointing: the recomputed forward returned " +
                       std::to_string(outputs.size()) + " outputs where the forward returned " +
                       std::to_string(grads.size()) +
                       ": a checkpointed function must compute the same thing when called again");
    }
    std::vector<at::Tensor> roots, root_grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (grads[i].defined() && outputs[i].defined() && outputs[i].requires_grad()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grads[i]);
      }
    }
    // Parameters' gradients accumulate as in any backward (and FSDP's hooks on them fire); the
    // inputs' land in the leaves made above and are this function's result.
    if (!roots.empty()) torch::autograd::backward(roots, root_grads);
    torch::autograd::variable_list result;
    for (const auto& in : inputs) result.push_back(in.defined() ? in.grad() : at::Tensor());
    result.resize(result.size() + 2);  // the placeholder, and the non-tensor argument
    return result;
  }
};

}  // namespace

bool recomputing() { return t_recomputing > 0; }

const CheckpointOptions* checkpoint_mark(const torch::nn::Module* m) {
  if (g_mark_count.load(std::memory_order_relaxed) == 0) return nullptr;
  std::lock_guard<std::mutex> lock(g_marks_mu);
  auto it = g_marks.find(m);
  if (it == g_marks.end()) return nullptr;
  if (it->second.module.lock().get() != m) {
    g_marks.erase(it);
    --g_mark_count;
    return nullptr;
  }
  return &it->second.options;  // stable: unordered_map nodes do not move
}

void throw_not_checkpointable(const torch::nn::Module* m) {
  throw ValueError("activation checkpointing: module '" + m->name() +
                   "' is marked for checkpointing, but its forward returns neither a Tensor, a "
                   "vector of Tensors nor a tuple of Tensors, or takes an argument that cannot be "
                   "copied; unmark it (clear_activation_checkpointing) or checkpoint a part of it");
}

// The modules a policy is asked about: those below `root`, or, for an FSDP wrapper, below the
// module it wraps (its flat parameters aside, the wrapper has no children of its own to offer).
std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> candidates(
    const std::shared_ptr<torch::nn::Module>& root, const char* who) {
  if (!root) throw ValueError(std::string(who) + ": the root module is null");
  std::shared_ptr<torch::nn::Module> top = root;
  if (auto w = std::dynamic_pointer_cast<FullyShardedDataParallelImpl>(root)) top = w->module();
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> out;
  for (const auto& item : top->named_modules("", /*include_self=*/false)) {
    out.emplace_back(item.key(), item.value());
  }
  return out;
}

}  // namespace detail

std::vector<at::Tensor> checkpoint_function(const CheckpointFunction& fn,
                                            const std::vector<at::Tensor>& inputs,
                                            const std::vector<at::Tensor>& params,
                                            const CheckpointOptions& options) {
  if (!fn) throw ValueError("checkpoint_function: the function is empty");
  auto needs_grad = [](const std::vector<at::Tensor>& ts) {
    return std::any_of(ts.begin(), ts.end(),
                       [](const at::Tensor& t) { return t.defined() && t.requires_grad(); });
  };
  const bool input_grad = needs_grad(inputs);
  if (!torch::GradMode::is_enabled() || (!input_grad && !needs_grad(params))) return fn(inputs);
  auto r = c10::make_intrusive<detail::Recompute>();
  r->fn = fn;
  r->num_inputs = inputs.size();
  if (options.preserve_rng_state()) r->rng = detail::RngStates::capture(inputs);
  r->autocast = detail::AutocastState::capture();
  std::vector<at::Tensor> tensors = inputs;
  // Autograd's function only records a backward when an input requires grad. Where only the
  // parameters inside do (the first block, fed data), a placeholder leaf that requires grad
  // stands in for them; it receives no gradient.
  if (!input_grad) tensors.push_back(at::empty({0}).requires_grad_(true));
  return detail::CheckpointNode::apply(at::TensorList(tensors), r);
}

int apply_activation_checkpointing(const std::shared_ptr<torch::nn::Module>& root,
                                   const CheckpointPolicy& policy,
                                   const CheckpointOptions& options) {
  if (!policy) throw ValueError("apply_activation_checkpointing: the policy is empty");
  int marked = 0;
  for (const auto& [fqn, module] : detail::candidates(root, "apply_activation_checkpointing")) {
    if (!policy(module, fqn)) continue;
    std::lock_guard<std::mutex> lock(detail::g_marks_mu);
    if (detail::g_marks.insert_or_assign(module.get(), detail::Mark{module, options}).second) {
      ++detail::g_mark_count;
    }
    ++marked;
  }
  return marked;
}

int clear_activation_checkpointing(const std::shared_ptr<torch::nn::Module>& root) {
  int cleared = 0;
  const auto modules = detail::candidates(root, "clear_activation_checkpointing");
  std::lock_guard<std::mutex> lock(detail::g_marks_mu);
  for (const auto& [fqn, module] : modules) {
    if (detail::g_marks.erase(module.get()) > 0) {
      --detail::g_mark_count;
      ++cleared;
    }
  }
  return cleared;
}

CheckpointPolicy every_kth(CheckpointPolicy policy, int k) {
  if (!policy) throw ValueError("every_kth: the policy is empty");
  if (k < 1) throw ValueError("every_kth: k must be at least 1, got " + std::to_string(k));
  auto seen = std::make_shared<int64_t>(0);
  return [policy = std::move(policy), k, seen](const std::shared_ptr<torch::nn::Module>& m,
                                               const std::string& fqn) {
    return policy(m, fqn) && (*seen)++ % k == 0;
  };
}

CheckpointPolicy checkpoint_units() {
  return [](const std::shared_ptr<torch::nn::Module>& m, const std::string&) {
    auto unit = detail::find_unit(m.get());
    return unit != nullptr && unit->index > 0;
  };
}

}  // namespace fsdp
