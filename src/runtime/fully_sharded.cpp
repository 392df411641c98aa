// FullyShardedDataParallel: choosing units, building their handles, and the public operations
// that span units (gradient clipping, no_sync, summon_full_params).
#include <cmath>
#include <exception>
#include <functional>
#include <limits>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "fsdp/errors.h"
#include "runtime/state.h"
#include "util/message.h"
#include "util/module_tree.h"
#include "util/tensor_utils.h"

namespace fsdp {

AutoWrapPolicy size_based_auto_wrap_policy(int64_t min_num_params) {
  return [min_num_params](const std::shared_ptr<torch::nn::Module>&, const std::string&,
                          int64_t unwrapped_numel) { return unwrapped_numel >= min_num_params; };
}

namespace {

using ModulePtr = std::shared_ptr<torch::nn::Module>;
using Impl = const c10::TensorImpl*;

using detail::msg;
using detail::quote;
using detail::rank;
using detail::under;

// Everything the wrapper needs to know about the model's module tree, gathered once.
struct Tree {
  std::vector<std::pair<std::string, ModulePtr>> modules;     // pre-order, root first ("")
  std::unordered_map<Impl, std::vector<std::string>> owners;  // parameter -> owning module FQNs
  std::unordered_map<Impl, int64_t> numel;
};

Tree scan(const ModulePtr& root, const std::unordered_set<Impl>& ignored,
          const std::vector<std::string>& ignored_prefixes) {
  Tree t;
  for (const auto& item : root->named_modules("", true)) {
    if (detail::under_any(item.key(), ignored_prefixes)) continue;
    t.modules.emplace_back(item.key(), item.value());
    for (const auto& p : item.value()->named_parameters(false)) {
      Impl impl = p.value().unsafeGetTensorImpl();
      if (ignored.count(impl)) continue;
      t.owners[impl].push_back(item.key());
      t.numel[impl] = p.value().numel();
    }
  }
  return t;
}

// The shard group (and, under hybrid sharding, the replicate group) units communicate over, and
// the world group they span together.
void set_up_groups(detail::FsdpState& st, const FullyShardedOptions& options,
                   dist::ProcessGroup& world) {
  const ShardingStrategy strategy = options.sharding_strategy();
  const bool hybrid = strategy == ShardingStrategy::HYBRID_SHARD ||
                      strategy == ShardingStrategy::HYBRID_SHARD_ZERO2;
  if (hybrid) {
    const int shard_size = options.hybrid_shard_size().value_or(dist::env_info().local_world_size);
    auto groups = dist::make_hybrid_groups(world, shard_size);
    st.shard_group = groups.shard;
    st.replicate_group = groups.replicate;
  } else {
    st.shard_group = world;
  }
  st.world_group = world;
}

// Parameters (and the module subtrees) no unit takes.
struct Ignored {
  std::unordered_set<Impl> params;
  std::vector<std::string> prefixes;
};

// Ignored parameters and modules stay out of every unit. Also records them (and the ignored
// modules' buffers) in the state.
Ignored collect_ignored(const ModulePtr& module, const FullyShardedOptions& options,
                        detail::FsdpState& st) {
  Ignored ignored;
  for (const auto& p : options.ignored_params()) ignored.params.insert(p.unsafeGetTensorImpl());
  st.ignored_params = options.ignored_params();
  for (const auto& item : module->named_modules("", true)) {
    for (const auto& ig : options.ignored_modules()) {
      if (ig.get() != item.value().get()) continue;
      ignored.prefixes.push_back(item.key());
      for (const auto& p : ig->parameters()) {
        ignored.params.insert(p.unsafeGetTensorImpl());
        st.ignored_params.push_back(p);
      }
      for (const auto& b : ig->buffers()) st.ignored_buffers.insert(b.unsafeGetTensorImpl());
    }
  }
  return ignored;
}

// NCCL communicates from the device current when the group was created; computing on another
// GPU would route every unshard and reduction through that one (or, with every rank on cuda:0,
// fail inside NCCL). Checked before the module is moved. (Computing on the CPU over NCCL is
// allowed, if slow: its tensors are staged through the GPU.)
void check_compute_device(const ModulePtr& module, const FullyShardedOptions& options,
                          const dist::ProcessGroup& world) {
  const at::Device compute = options.device_id() ? detail::with_index(*options.device_id())
                             : module->parameters().empty() ? world.device()
                                                            : module->parameters()[0].device();
  if (world.backend_name() == "nccl" && compute.is_cuda() && compute != world.device()) {
    throw ValueError(msg("FullyShardedDataParallel: ", rank(world.rank()), " computes on ",
                         compute.str(), " but its NCCL group communicates from ",
                         world.device().str(),
                         "; set each rank's CUDA device (e.g. "
                         "c10::cuda::set_device(local_rank)) before init_process_group"));
  }
}

// PyTorch's _move_module_to_device: a module built on the CPU moves to `dev` (parameters and
// buffers of the managed modules) before anything is synced or flattened.
void move_to_device(const ModulePtr& module, const at::Device& dev, const Ignored& ignored,
                    const detail::FsdpState& st, const dist::ProcessGroup& world) {
  at::NoGradGuard no_grad;
  auto move = [&](const std::string& kind, const std::string& name, at::Tensor t) {
    if (t.device() == dev) return;
    if (!t.device().is_cpu()) {
      throw ValueError(
          msg("FullyShardedDataParallel: inconsistent compute device and device_id on ",
              rank(world.rank()), ": ", kind, " ", quote(name), " is on ", t.device().str(),
              ", device_id is ", dev.str()));
    }
    t.set_data(t.to(dev));
  };
  for (const auto& p : module->named_parameters()) {
    if (!ignored.params.count(p.value().unsafeGetTensorImpl())) {
      move("parameter", p.key(), p.value());
    }
  }
  for (const auto& b : module->named_buffers()) {
    if (!st.ignored_buffers.count(b.value().unsafeGetTensorImpl())) {
      move("buffer", b.key(), b.value());
    }
  }
}

// Rank 0's values everywhere, before anything is flattened (PyTorch's sync_module_states).
void sync_module_states(const ModulePtr& module, dist::ProcessGroup& world) {
  at::NoGradGuard no_grad;
  for (auto& p : detail::distinct_parameters(*module)) world.broadcast(p.data(), 0);
  for (auto& b : module->buffers()) world.broadcast(b.data(), 0);
}

// The FQNs of the modules given in `units`.
std::set<std::string> explicit_unit_fqns(const Tree& tree, const FullyShardedOptions& options) {
  std::unordered_map<const torch::nn::Module*, std::string> fqn_of;
  for (const auto& [fqn, m] : tree.modules) fqn_of[m.get()] = fqn;
  std::set<std::string> explicit_units;
  for (const auto& m : options.units()) {
    auto it = fqn_of.find(m.get());
    if (it == fqn_of.end()) {
      throw ValueError(
          "FullyShardedDataParallel: a module given in `units` is not part of the "
          "wrapped model (or is ignored)");
    }
    explicit_units.insert(it->second);
  }
  return explicit_units;
}

// The units chosen, and which unit each parameter belongs to.
struct UnitChoice {
  std::vector<std::string> fqns;  // innermost first, the root ("") last
  std::unordered_map<Impl, std::string> claimed_by;
};

// Choose units bottom-up: a module's subtree is visited before the module itself. A parameter
// belongs to the innermost unit whose subtree contains *every* module that registers it, so a
// weight tied across two units goes to their common ancestor (the root at the latest).
UnitChoice choose_units(const Tree& tree, const std::set<std::string>& explicit_units,
                        const FullyShardedOptions& options) {
  UnitChoice choice;
  auto& claimed_by = choice.claimed_by;
  auto claimable = [&](Impl impl, const std::string& root) {
    if (claimed_by.count(impl)) return false;
    for (const auto& o : tree.owners.at(impl)) {
      if (!under(o, root)) return false;
    }
    return true;
  };
  for (auto it = tree.modules.rbegin(); it != tree.modules.rend(); ++it) {
    const std::string& fqn = it->first;
    if (fqn.empty()) continue;  // the root is always a unit, handled last
    int64_t unwrapped = 0;
    for (const auto& [impl, owners] : tree.owners) {
      if (claimable(impl, fqn)) unwrapped += tree.numel.at(impl);
    }
    const bool wrap =
        explicit_units.count(fqn) ||
        (options.auto_wrap_policy() && options.auto_wrap_policy()(it->second, fqn, unwrapped));
    if (!wrap || unwrapped == 0) continue;
    for (const auto& [impl, owners] : tree.owners) {
      if (claimable(impl, fqn)) claimed_by[impl] = fqn;
    }
    choice.fqns.push_back(fqn);
  }
  for (const auto& [impl, owners] : tree.owners) {
    if (!claimed_by.count(impl)) claimed_by[impl] = "";
  }
  choice.fqns.push_back("");
  return choice;
}

FlatParamHandleOptions handle_options(const FullyShardedOptions& options,
                                      const detail::FsdpState& st, const ModulePtr& module) {
  FlatParamHandleOptions hopts;
  hopts.sharding_strategy(options.sharding_strategy())
      .use_orig_params(options.use_orig_params())
      .offload_params(options.cpu_offload().offload_params())
      .param_dtype(options.mixed_precision().param_dtype())
      .reduce_dtype(options.mixed_precision().reduce_dtype())
      .keep_low_precision_grads(options.mixed_precision().keep_low_precision_grads());
  if (st.replicate_group) hopts.replicate_group(*st.replicate_group);
  if (options.device_id()) {
    hopts.device(detail::with_index(*options.device_id()));
  } else if (!module->parameters().empty()) {
    hopts.device(module->parameters()[0].device());
  }
  return hopts;
}

// One unit: its module and a handle over the parameters claimed by it (none for a root without
// parameters of its own). Collective over the shard group when it builds a handle.
std::unique_ptr<detail::Unit> build_unit(const std::string& ufqn, const Tree& tree,
                                         const UnitChoice& choice, detail::FsdpState& st,
                                         const FlatParamHandleOptions& hopts) {
  std::vector<ParamInfo> refs;
  for (const auto& [mfqn, m] : tree.modules) {
    if (!under(mfqn, ufqn)) continue;
    for (const auto& p : m->named_parameters(false)) {
      auto c = choice.claimed_by.find(p.value().unsafeGetTensorImpl());
      if (c != choice.claimed_by.end() && c->second == ufqn) {
        refs.push_back(ParamInfo{p.key(), m, mfqn});
      }
    }
  }
  auto unit = std::make_unique<detail::Unit>();
  unit->fqn = ufqn;
  for (const auto& [mfqn, m] : tree.modules) {
    if (mfqn == ufqn) unit->module = m;
  }
  if (!refs.empty()) {
    unit->handle = std::make_unique<FlatParamHandle>(std::move(refs), st.shard_group, hopts);
  }
  return unit;
}

// Root first (index 0), then the other units innermost-first; handles are built innermost-first
// on every rank, so their collectives line up.
void build_units(detail::FsdpState& st, const Tree& tree, const UnitChoice& choice,
                 const FlatParamHandleOptions& hopts) {
  std::vector<std::unique_ptr<detail::Unit>> built;
  for (const auto& ufqn : choice.fqns) built.push_back(build_unit(ufqn, tree, choice, st, hopts));
  st.units.push_back(std::move(built.back()));
  built.pop_back();
  for (auto& u : built) st.units.push_back(std::move(u));
  for (size_t i = 0; i < st.units.size(); ++i) st.units[i]->index = static_cast<int>(i);
}

// Without use_orig_params, what parameters() shows: the flat parameters, then the ignored ones.
// In module order (pre-order of the units' modules), as PyTorch's nested FSDP modules list their
// flat parameters: an optimizer built over parameters() then orders its state and param groups
// as PyTorch's would.
void register_flat_params(torch::nn::Module& self, const Tree& tree, const detail::FsdpState& st,
                          const FullyShardedOptions& options) {
  int k = 0;
  for (const auto& [mfqn, m] : tree.modules) {
    for (const auto& u : st.units) {
      if (u->handle && u->fqn == mfqn) {
        self.register_parameter("_flat_param_" + std::to_string(k++), u->handle->flat_param(),
                                u->handle->flat_param().requires_grad());
      }
    }
  }
  int j = 0;
  for (const auto& p : options.ignored_params()) {
    self.register_parameter("_ignored_param_" + std::to_string(j++), p, p.requires_grad());
  }
  for (const auto& m : options.ignored_modules()) {
    for (const auto& p : m->parameters()) {
      self.register_parameter("_ignored_param_" + std::to_string(j++), p, p.requires_grad());
    }
  }
}

}  // namespace

FullyShardedDataParallelImpl::FullyShardedDataParallelImpl(
    torch::nn::AnyModule any, std::shared_ptr<torch::nn::Module> module,
    FullyShardedOptions options)
    : any_(std::move(any)), module_(std::move(module)), options_(std::move(options)) {
  if (!module_) throw ValueError("FullyShardedDataParallel: null module");
  if (!(options_.bucket_cap_mb() >= 0) || options_.bucket_cap_mb() > 1e6) {
    throw ValueError(msg("FullyShardedDataParallel: bucket_cap_mb must be in [0, 1e6], got ",
                         options_.bucket_cap_mb()));
  }
  sequential_ = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(module_);
  state_ = std::make_shared<detail::FsdpState>();
  auto& st = *state_;
  st.options = options_;
  st.root_module = module_;

  dist::ProcessGroup world =
      options_.process_group() ? *options_.process_group() : dist::default_group();
  set_up_groups(st, options_, world);
  const Ignored ignored = collect_ignored(module_, options_, st);
  check_compute_device(module_, options_, world);
  if (options_.device_id() && !options_.device_id()->is_cpu()) {
    move_to_device(module_, detail::with_index(*options_.device_id()), ignored, st, world);
  }
  if (options_.sync_module_states()) sync_module_states(module_, world);

  const Tree tree = scan(module_, ignored.params, ignored.prefixes);
  const std::set<std::string> explicit_units = explicit_unit_fqns(tree, options_);
  const UnitChoice choice = choose_units(tree, explicit_units, options_);
  build_units(st, tree, choice, handle_options(options_, st, module_));
  st.register_units();

  // What parameters() shows: the flat parameters, or the original ones through the wrapped module.
  if (options_.use_orig_params()) {
    register_module("_fsdp_wrapped_module", module_);
  } else {
    register_flat_params(*this, tree, st, options_);
  }
}

FullyShardedDataParallelImpl::~FullyShardedDataParallelImpl() {
  if (state_) state_->unregister_units();
}

std::vector<FlatParamHandle*> FullyShardedDataParallelImpl::handles() const {
  std::vector<FlatParamHandle*> out;
  for (const auto& u : state_->units) out.push_back(u->handle.get());
  return out;
}

std::vector<FullyShardedDataParallelImpl::ParamFqns> FullyShardedDataParallelImpl::param_fqns()
    const {
  std::vector<ParamFqns> out;
  std::unordered_set<Impl> seen;
  for (const auto& u : state_->units) {
    if (!u->handle) continue;
    const FlatParamHandle& h = *u->handle;
    const auto& l = h.layout();
    if (!options_.use_orig_params()) {
      out.push_back(ParamFqns{h.flat_param(), l.fqns});
      seen.insert(h.flat_param().unsafeGetTensorImpl());
      continue;
    }
    const auto params = h.orig_params();
    for (size_t i = 0; i < params.size(); ++i) {
      ParamFqns e{params[i], {l.fqns[i]}};
      for (const auto& sp : h.shared_param_infos()) {
        if (sp.prim_index == static_cast<int>(i)) {
          e.fqns.push_back(ParamInfo{sp.param_name, sp.module, sp.module_name}.fqn());
        }
      }
      seen.insert(params[i].unsafeGetTensorImpl());
      out.push_back(std::move(e));
    }
  }
  // Ignored parameters, under their names in the wrapped module (all owners of a tied one).
  std::unordered_map<Impl, size_t> at_index;
  for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
    Impl impl = item.value().unsafeGetTensorImpl();
    if (seen.count(impl)) continue;
    bool ignored = false;
    for (const auto& p : state_->ignored_params) ignored |= p.unsafeGetTensorImpl() == impl;
    if (!ignored) continue;
    auto it = at_index.find(impl);
    if (it == at_index.end()) {
      at_index.emplace(impl, out.size());
      out.push_back(ParamFqns{item.value(), {item.key()}});
    } else {
      out[it->second].fqns.push_back(item.key());
    }
  }
  return out;
}

std::vector<std::string> FullyShardedDataParallelImpl::unit_names() const {
  std::vector<std::string> out;
  for (const auto& u : state_->units) out.push_back(u->fqn);
  return out;
}

dist::ProcessGroup& FullyShardedDataParallelImpl::process_group() { return state_->shard_group; }

void FullyShardedDataParallelImpl::train(bool on) {
  torch::nn::Module::train(on);
  module_->train(on);
}

double FullyShardedDataParallelImpl::clip_grad_norm_(double max_norm, double norm_type) {
  auto& st = *state_;
  const bool inf = std::isinf(norm_type);
  // Sharded gradients partition the full gradient across the shard group, so their contributions
  // are summed (or maxed) over it; replicated ones (NO_SHARD, ignored) count once.
  double sharded = 0, replicated = 0;
  std::vector<at::Tensor> grads;
  auto contribution = [&](const at::Tensor& g) {
    at::Tensor g64 = g.to(at::kDouble);
    return inf ? g64.abs().max().item<double>() : g64.norm(norm_type).pow(norm_type).item<double>();
  };
  auto combine = [&](double& acc, double v) { acc = inf ? std::max(acc, v) : acc + v; };
  for (const auto& u : st.units) {
    if (!u->handle) continue;
    at::Tensor g = u->handle->sharded_grad();
    if (!g.defined() || g.numel() == 0) continue;
    grads.push_back(g);
    combine(u->handle->uses_sharded_strategy() ? sharded : replicated, contribution(g));
  }
  std::unordered_set<Impl> seen;  // a tied or doubly-listed ignored parameter counts once
  for (const auto& p : parameters()) {
    if (is_fsdp_flattened(p) || !p.grad().defined()) continue;
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    grads.push_back(p.grad());
    combine(replicated, contribution(p.grad()));
  }
  at::Tensor t = at::full({1}, sharded, at::kDouble);
  st.shard_group.all_reduce(t, inf ? dist::ReduceOp::MAX : dist::ReduceOp::SUM);
  double total = t.item<double>();
  combine(total, replicated);
  if (!inf) total = std::pow(total, 1.0 / norm_type);
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0) {
    at::NoGradGuard no_grad;
    for (auto& g : grads) g.mul_(coef);
  }
  return total;
}

// ---------------------------------------------------------------------------------------------
// Guards

NoSyncGuard::NoSyncGuard(FullyShardedDataParallel& model)
    : state_(model->state_), prev_(model->state_->sync_gradients) {
  state_->sync_gradients = false;
}

NoSyncGuard::~NoSyncGuard() { state_->sync_gradients = prev_; }

SummonFullParamsGuard::SummonFullParamsGuard(FullyShardedDataParallel& model, bool writeback,
                                             bool with_grads)
    : state_(model->state_), writeback_(writeback), with_grads_(with_grads) {
  auto& st = *state_;
  if (st.in_summon) throw StateError("SummonFullParamsGuard: already summoned");
  if (with_grads && !st.options.use_orig_params()) {
    throw ValueError("SummonFullParamsGuard: with_grads=true requires use_orig_params=true");
  }
  st.reset_iteration();
  st.in_summon = true;
  try {
    for (auto& u : st.units) {
      if (!u->handle) continue;
      u->handle->set_training_state(HandleTrainingState::SUMMON_FULL_PARAMS);
      u->handle->unshard();
      if (with_grads) u->handle->unshard_grad();
    }
  } catch (...) {
    // Leave the model usable: everything back to sharded, no summon in progress.
    st.in_summon = false;
    for (auto& u : st.units) {
      if (!u->handle) continue;
      try {
        u->handle->reshard_grad();
        u->handle->reshard(true);
      } catch (...) {
      }
      u->handle->set_training_state(HandleTrainingState::IDLE);
    }
    throw;
  }
  uncaught_ = std::uncaught_exceptions();
}

SummonFullParamsGuard::~SummonFullParamsGuard() noexcept(false) {
  auto& st = *state_;
  st.in_summon = false;
  // While unwinding from another exception, edits are dropped rather than written back, and
  // nothing may throw (that would terminate the program).
  const bool unwinding = std::uncaught_exceptions() > uncaught_;
  std::exception_ptr first;
  for (auto& u : st.units) {
    if (!u->handle) continue;
    try {
      if (writeback_ && !unwinding) u->handle->writeback_unsharded();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
    if (with_grads_) u->handle->reshard_grad();
    try {
      u->handle->reshard(true);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
    u->handle->set_training_state(HandleTrainingState::IDLE);
  }
  if (first && !unwinding) std::rethrow_exception(first);
}

}  // namespace fsdp
