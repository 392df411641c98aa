// get_/set_ model and optimizer state dicts for wrapped and plain models (seed 001,
// torch/distributed/checkpoint/state_dict.py): option checks, the state-dict type a wrapped model
// is put in for the call, submodule and frozen-parameter filtering, and the optimizer half
// (zero-step state initialisation, merging and splitting several optimizers' dicts, the flat
// form, and loading from rank 0).
#include "fsdp/checkpoint/state_dict.h"

#include <map>
#include <optional>
#include <set>

#include "fsdp/errors.h"
#include "fsdp/optim_state_dict.h"
#include "fsdp/state_dict_utils.h"
#include "state_dict/from_rank0.h"
#include "state_dict/optim_entries.h"

namespace fsdp {
namespace checkpoint {
namespace {

const char* const kState = "state";
const char* const kGroups = "param_groups";
const char* const kParams = "params";

// The model a call works on: a wrapped model, or a plain module.
struct Target {
  mutable FullyShardedDataParallel wrapped{nullptr};
  torch::nn::Module* plain = nullptr;
  /// The unwrapped module tree (whose names are the canonical FQNs).
  torch::nn::Module& inner() const { return wrapped ? *wrapped->module() : *plain; }
  /// The group collectives of this call run over, if any.
  dist::ProcessGroup* group() const {
    if (wrapped) return &wrapped->runtime_state()->world_group;
    return dist::is_initialized() ? &dist::default_group() : nullptr;
  }
  int rank() const { return group() ? group()->rank() : 0; }
  int world() const { return group() ? group()->size() : 1; }
};

Target resolve(torch::nn::Module& model) {
  Target t;
  if (auto* impl = dynamic_cast<FullyShardedDataParallelImpl*>(&model)) {
    t.wrapped = FullyShardedDataParallel(
        std::dynamic_pointer_cast<FullyShardedDataParallelImpl>(impl->shared_from_this()));
    return t;
  }
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    const torch::nn::Module* m = item.value().get();
    if (dynamic_cast<const FullyShardedDataParallelImpl*>(m) != nullptr ||
        detail::find_unit(m) != nullptr) {
      const std::string where = item.key().empty() ? "the module itself" : "'" + item.key() + "'";
      throw ValueError(
          "state dict API: " + where +
          " is (part of) a FullyShardedDataParallel model, so its parameters are flat-parameter "
          "views (PyTorch: 'contains _flat_param ... the model is not the root module'); pass "
          "the wrapped model itself");
    }
  }
  t.plain = &model;
  return t;
}

// PyTorch's _verify_options: the option rules, and the submodules' key prefixes.
std::vector<std::string> verify_options(const Target& t, const StateDictOptions& o, bool optim_only,
                                        const Optimizers& optimizers,
                                        const Submodules& submodules) {
  if (optim_only && optimizers.empty()) {
    throw ValueError("Optimizers are not passed in but optim_only is set to True.");
  }
  for (size_t i = 0; i < optimizers.size(); ++i) {
    if (optimizers[i] == nullptr) throw ValueError("optimizer " + std::to_string(i) + " is null");
  }
  if (o.broadcast_from_rank0() && !o.full_state_dict()) {
    throw ValueError("full_state_dict must be True when broadcast_from_rank0 is True.");
  }
  std::vector<std::string> prefixes;
  if (submodules.empty()) return prefixes;
  const auto named = t.inner().named_modules("", /*include_self=*/true);
  for (size_t i = 0; i < submodules.size(); ++i) {
    bool found = false;
    for (const auto& item : named) {
      if (item.value().get() != submodules[i].get()) continue;
      prefixes.push_back(item.key().empty() ? "" : item.key() + ".");  // the root: every key
      found = true;
      break;
    }
    if (!found) {
      throw ValueError("submodules[" + std::to_string(i) + "] (" +
                       (submodules[i] ? submodules[i]->name() : std::string("null")) +
                       ") is not a module of the model");
    }
  }
  return prefixes;
}

// PyTorch's _verify_state_dict.
void verify_state_dict(const Target& t, const StateDict* msd, const StateDict* osd,
                       const StateDictOptions& o, bool have_prefixes) {
  const bool rank0_holds_all = o.cpu_offload() && o.full_state_dict();
  if (msd && msd->empty() && !have_prefixes && !o.ignore_frozen_params() && !rank0_holds_all &&
      o.strict() && !o.broadcast_from_rank0()) {
    throw ValueError(
        "The option indicates that model state_dict is required to save or load, but model "
        "state_dict is empty (rank " +
        std::to_string(t.rank()) + ").");
  }
  if (osd && osd->empty() && !rank0_holds_all && !o.broadcast_from_rank0()) {
    throw ValueError(
        "The option indicates that model state_dict is required to save, or load but optim "
        "state_dict is empty (rank " +
        std::to_string(t.rank()) + ").");
  }
  if (msd) {
    for (const auto& [k, v] : *msd) {
      if (k.find("_flat_param") != std::string::npos) {
        throw ValueError("'" + k +
                         "' contains _flat_param: a LOCAL state dict (or a key of a model that "
                         "is not the root module); these functions use FULL or SHARDED dicts "
                         "keyed by the unwrapped model's FQNs");
      }
    }
  }
}

// The model's state-dict type for the call (PyTorch's fsdp_context), restored on destruction.
void enter_type(std::optional<StateDictTypeGuard>& g, const Target& t, const StateDictOptions& o) {
  if (!t.wrapped) return;
  auto model = t.wrapped;
  if (o.full_state_dict()) {
    g.emplace(model, StateDictType::FULL_STATE_DICT,
              FullStateDictConfig().offload_to_cpu(o.cpu_offload()).rank0_only(o.cpu_offload()),
              FullOptimStateDictConfig()
                  .offload_to_cpu(o.cpu_offload())
                  .rank0_only(o.cpu_offload() || o.broadcast_from_rank0()));
  } else {
    g.emplace(model, StateDictType::SHARDED_STATE_DICT,
              ShardedStateDictConfig().offload_to_cpu(o.cpu_offload()).layout(o.shard_layout()),
              ShardedOptimStateDictConfig()
                  .offload_to_cpu(o.cpu_offload())
                  .layout(o.shard_layout()));
  }
}

// PyTorch's _maybe_full_or_cpu_state_dict. FULL dicts of wrapped models are already gathered
// (and on rank 0 only where the config said so); plain modules hold whole tensors.
StateDict full_or_cpu(StateDict sd, const Target& t, const StateDictOptions& o) {
  if (o.full_state_dict() && o.cpu_offload() && t.plain && t.rank() != 0) return StateDict();
  if (o.cpu_offload()) return offload_state_dict_to_cpu(sd);
  return sd;
}

// ---------------------------------------------------------------------------------------------
// Optimizers

// LibTorch's optimizer options expose lr through a virtual that the base class does not
// implement; the five supported optimizers (and LBFGS) do.
std::optional<double> lr_of(torch::optim::OptimizerParamGroup& g) {
  try {
    return g.options().get_lr();
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// PyTorch's _init_optim_state: an optimizer without state gets it by one step with zero
// gradients and zero learning rate, which leaves the parameters as they are.
void init_optim_state(torch::optim::Optimizer& opt) {
  if (!opt.state().empty()) return;
  auto& groups = opt.param_groups();
  for (auto& g : groups) {
    for (auto& p : g.params()) {
      if (p.grad().defined()) {
        throw StateError(
            "state_dict can only be used if the optimizer states are initialized (usually after "
            "one step() with gradients) or gradients are None. For the later case, state_dict "
            "will fake the gradients as zero to initialize the optimizer states. However, the "
            "gradients are not None.");
      }
    }
  }
  std::vector<std::optional<double>> lrs;
  for (auto& g : groups) {
    for (auto& p : g.params()) {
      if (p.requires_grad()) p.mutable_grad() = at::zeros_like(p);
    }
    lrs.push_back(lr_of(g));
    if (lrs.back()) g.options().set_lr(0.0);
  }
  auto restore = [&] {
    for (size_t i = 0; i < groups.size(); ++i) {
      if (lrs[i]) groups[i].options().set_lr(*lrs[i]);
      for (auto& p : groups[i].params()) p.mutable_grad().reset();  // zero_grad(set_to_none)
    }
  };
  try {
    opt.step(nullptr);
  } catch (const std::exception& e) {
    restore();
    throw ValueError(std::string("initialising the optimizer's state (one step with zero "
                                 "learning rate) failed: ") +
                     e.what());
  }
  restore();
}

detail::OptModel describe(const Target& t, torch::optim::Optimizer& opt) {
  return t.wrapped ? detail::describe_model(&t.wrapped, nullptr, opt)
                   : detail::describe_model(nullptr, t.plain, opt);
}

// True if two hyperparameter values are the same (numbers, strings, lists of them).
bool same_value(const StateValue& a, const StateValue& b) {
  if ((a.is_int() || a.is_double()) && (b.is_int() || b.is_double()))
    return a.to_double() == b.to_double();
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case StateValue::Kind::None:
      return true;
    case StateValue::Kind::Bool:
      return a.to_bool() == b.to_bool();
    case StateValue::Kind::String:
      return a.string() == b.string();
    case StateValue::Kind::List:
      if (a.list().size() != b.list().size()) return false;
      for (size_t i = 0; i < a.list().size(); ++i)
        if (!same_value(a.list()[i], b.list()[i])) return false;
      return true;
    default:
      return false;
  }
}

std::string value_text(const StateValue& v) {
  if (v.is_int()) return std::to_string(v.to_int());
  if (v.is_double()) return std::to_string(v.to_double());
  if (v.is_bool()) return v.to_bool() ? "True" : "False";
  if (v.is_string()) return v.string();
  if (v.is_list()) {
    std::string out = "[";
    for (size_t i = 0; i < v.list().size(); ++i) out += (i ? ", " : "") + value_text(v.list()[i]);
    return out + "]";
  }
  return to_string(v.kind());
}

// PyTorch's _split_optim_state_dict: the part of a merged dict that belongs to `opt`: the state
// of its parameters and the param groups that list them.
StateDict split_for(const Target& t, torch::optim::Optimizer& opt, const StateDict& osd) {
  if (!osd.contains(kState) || !osd.contains(kGroups)) {
    throw ValueError("optimizer state dict: expected the keys \"state\" and \"param_groups\"");
  }
  const StateDict& state = osd.at(kState).dict();
  bool all_ids = !state.empty();
  for (const auto& [k, v] : state)
    all_ids = all_ids && !k.empty() && k.find_first_not_of("0123456789") == std::string::npos;
  if (all_ids) return osd;  // keyed by parameter IDs: one optimizer's own dict
  const detail::OptModel om = describe(t, opt);
  std::set<std::string> mine;
  for (const auto& g : om.groups)
    for (size_t e : g) mine.insert(om.entries[e].fqns.begin(), om.entries[e].fqns.end());
  StateDict out_state;
  for (const auto& [fqn, v] : state) {
    if (mine.count(fqn)) out_state.insert_or_assign(fqn, v);
  }
  StateList out_groups;
  const StateList& groups = osd.at(kGroups).list();
  for (size_t i = 0; i < groups.size(); ++i) {
    const StateList& params = groups[i].dict().at(kParams).list();
    size_t ours = 0;
    for (const auto& p : params) ours += p.is_string() && mine.count(p.string()) ? 1 : 0;
    if (ours == 0) continue;
    if (ours != params.size()) {
      throw ValueError("optimizer state dict: param_groups[" + std::to_string(i) +
                       "] lists parameters of more than one of the given optimizers");
    }
    out_groups.push_back(groups[i]);
  }
  StateDict out;
  out.insert_or_assign(kState, std::move(out_state));
  out.insert_or_assign(kGroups, std::move(out_groups));
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Flat optimizer dicts

StateDict flatten_optim_state_dict(const StateDict& osd) {
  StateDict out;
  for (const auto& [fqn, st] : osd.at(kState).dict()) {
    for (const auto& [name, v] : st.dict()) {
      if (!v.is_tensor() && !v.is_sharded_tensor() && !v.is_int() && !v.is_double()) {
        throw ValueError(
            "Flattening optimizer state_dict only supports tensor, int, float states now. Type "
            "is " +
            std::string(to_string(v.kind())) + " (state '" + fqn + "', '" + name + "').");
      }
      out.insert_or_assign(std::string(kState) + "." + fqn + "." + name, v);
    }
  }
  for (const auto& g : osd.at(kGroups).list()) {
    for (const auto& p : g.dict().at(kParams).list()) {
      for (const auto& [k, v] : g.dict()) {
        if (k == kParams) continue;
        out.insert_or_assign(std::string(kGroups) + "." + p.string() + "." + k, v);
      }
    }
  }
  return out;
}

namespace {

StateDict unflatten_optim(const Target& t, const Optimizers& optimizers, const StateDict& flat) {
  // "<prefix>.<fqn>.<name>": state names and group keys never contain dots, FQNs may.
  std::map<std::string, StateDict> states, group_values;
  for (const auto& [k, v] : flat) {
    const bool is_state = k.rfind(std::string(kState) + ".", 0) == 0;
    const bool is_group = k.rfind(std::string(kGroups) + ".", 0) == 0;
    const size_t dot = k.rfind('.');
    const size_t start =
        is_state ? std::string(kState).size() + 1 : std::string(kGroups).size() + 1;
    if ((!is_state && !is_group) || dot == std::string::npos || dot <= start) {
      throw ValueError("flattened optimizer state dict: unexpected key '" + k +
                       "' (keys are \"state.<fqn>.<name>\" and \"param_groups.<fqn>.<key>\")");
    }
    const std::string fqn = k.substr(start, dot - start);
    (is_state ? states : group_values)[fqn].insert_or_assign(k.substr(dot + 1), v);
  }
  std::set<std::string> known;
  StateDict state;
  StateList groups;
  for (torch::optim::Optimizer* opt : optimizers) {
    const detail::OptModel om = describe(t, *opt);
    for (const auto& g : om.groups) {
      StateDict group;
      StateList params;
      std::string first;
      for (size_t e : g) {
        for (const auto& fqn : om.entries[e].fqns) {
          known.insert(fqn);
          params.emplace_back(fqn);
          auto s = states.find(fqn);
          if (s != states.end()) state.insert_or_assign(fqn, s->second);
          auto gv = group_values.find(fqn);
          if (gv == group_values.end()) continue;
          for (const auto& [key, v] : gv->second) {
            if (!group.contains(key)) {
              group.insert_or_assign(key, v);
              if (first.empty()) first = fqn;
            } else if (!same_value(group.at(key), v)) {
              throw ValueError(
                  "All the parameters in the same parameter group should have the same saved "
                  "param_group value. But " +
                  fqn + "." + key + " is " + value_text(v) + " while other(s) is " +
                  value_text(group.at(key)) + ".");
            }
          }
        }
      }
      group.insert_or_assign(kParams, std::move(params));
      groups.emplace_back(std::move(group));
    }
  }
  for (const auto* m : {&states, &group_values}) {
    for (const auto& [fqn, v] : *m) {
      if (!known.count(fqn)) {
        throw ValueError("flattened optimizer state dict: '" + fqn +
                         "' is not a parameter of the given optimizers");
      }
    }
  }
  StateDict out;
  out.insert_or_assign(kState, std::move(state));
  out.insert_or_assign(kGroups, std::move(groups));
  return out;
}

StateDict get_optim_impl(const Target& t, const Optimizers& optimizers, const StateDictOptions& o) {
  StateDict state;
  StateList groups;
  std::optional<StateDictTypeGuard> guard;
  enter_type(guard, t, o);
  for (torch::optim::Optimizer* opt : optimizers) {
    init_optim_state(*opt);
    StateDict osd =
        t.wrapped ? optim_state_dict(t.wrapped, *opt) : optim_state_dict(*t.plain, *opt);
    if (osd.empty()) continue;  // rank0_only, on another rank
    for (const auto& [fqn, v] : osd.at(kState).dict()) state.insert_or_assign(fqn, v);
    for (const auto& g : osd.at(kGroups).list()) groups.push_back(g);
  }
  StateDict out;
  out.insert_or_assign(kState, std::move(state));
  out.insert_or_assign(kGroups, std::move(groups));
  if (o.flatten_optimizer_state_dict()) out = flatten_optim_state_dict(out);
  return full_or_cpu(std::move(out), t, o);
}

StateDict get_model_impl(const Target& t, const StateDictOptions& o,
                         const std::vector<std::string>& prefixes) {
  StateDict sd;
  {
    std::optional<StateDictTypeGuard> guard;
    enter_type(guard, t, o);
    sd = t.wrapped ? state_dict(t.wrapped) : module_state_dict(*t.plain);
  }
  if (!prefixes.empty()) {
    StateDict kept;
    for (const auto& [fqn, v] : sd) {
      for (const auto& prefix : prefixes) {
        if (fqn.rfind(prefix, 0) != 0) continue;
        kept.insert_or_assign(o.keep_submodule_prefixes() ? fqn : fqn.substr(prefix.size()), v);
      }
    }
    sd = std::move(kept);
  }
  if (o.ignore_frozen_params()) {
    // Original parameters keep their requires_grad flag in the wrapped module's tree; a tied
    // parameter goes under every name.
    for (const auto& p : t.inner().named_parameters(/*recurse=*/true)) {
      if (!p.value().requires_grad()) sd.erase(p.key());
    }
  }
  std::vector<std::string> meta;
  for (const auto& [k, v] : sd) {
    if (v.is_tensor() && v.tensor().is_meta()) meta.push_back(k);
  }
  for (const auto& k : meta) sd.erase(k);
  return full_or_cpu(std::move(sd), t, o);
}

void set_optim_impl(const Target& t, const Optimizers& optimizers, const StateDict& osd_in,
                    const StateDictOptions& o) {
  for (torch::optim::Optimizer* opt : optimizers) init_optim_state(*opt);
  dist::ProcessGroup* pg = t.group();
  const bool broadcast = o.broadcast_from_rank0() && pg && pg->size() > 1;
  const bool source = !broadcast || pg->rank() == 0;
  if (!broadcast && osd_in.empty()) return;  // full + cpu_offload: nothing for this rank
  StateDict osd;
  if (source) {
    osd = osd_in.contains(kState) ? osd_in : unflatten_optim(t, optimizers, osd_in);
  }
  for (torch::optim::Optimizer* opt : optimizers) {
    const StateDict part = source ? split_for(t, *opt, osd) : StateDict();
    if (!broadcast) {
      std::optional<StateDictTypeGuard> guard;
      enter_type(guard, t, o);
      if (t.wrapped) {
        load_optim_state_dict(t.wrapped, *opt, part);
      } else {
        load_optim_state_dict(*t.plain, *opt, part);
      }
      continue;
    }
    if (t.wrapped) {  // each state tensor in turn; every rank keeps its range
      detail::load_optim_state_dict_from_rank0(t.wrapped, *opt, part);
      continue;
    }
    // Plain replicas hold whole states anyway: rank 0's values go into a template of this
    // rank's own (its current state, as a dict), one tensor at a time, then load.
    StateDict local = optim_state_dict(*t.plain, *opt);
    broadcast_state_dict(part, local, *pg, 0, /*strict=*/true);
    load_optim_state_dict(*t.plain, *opt, local);
  }
}

LoadResult set_model_impl(const Target& t, const StateDict& msd, const StateDictOptions& o) {
  if (msd.empty() && !o.broadcast_from_rank0()) return LoadResult();
  dist::ProcessGroup* pg = t.group();
  const bool broadcast = o.broadcast_from_rank0() && pg && pg->size() > 1;
  if (t.wrapped) {
    if (broadcast) return detail::load_state_dict_from_rank0(t.wrapped, msd, o.strict());
    std::optional<StateDictTypeGuard> guard;
    enter_type(guard, t, o);
    return load_state_dict(t.wrapped, msd, o.strict());
  }
  if (!broadcast) return load_module_state_dict(*t.plain, msd, o.strict());
  // A replica per rank: rank 0's values go straight into every rank's own tensors.
  StateDict local = module_state_dict(*t.plain);
  return broadcast_state_dict(msd, local, *pg, 0, o.strict());
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Public API

StateDict unflatten_optim_state_dict(torch::nn::Module& model, const Optimizers& optimizers,
                                     const StateDict& flat) {
  const Target t = resolve(model);
  verify_options(t, StateDictOptions(), true, optimizers, {});
  return unflatten_optim(t, optimizers, flat);
}

StateDict get_model_state_dict(torch::nn::Module& model, const StateDictOptions& options,
                               const Submodules& submodules) {
  const Target t = resolve(model);
  const auto prefixes = verify_options(t, options, false, {}, submodules);
  StateDict sd = get_model_impl(t, options, prefixes);
  verify_state_dict(t, &sd, nullptr, options, !prefixes.empty());
  return sd;
}

StateDict get_optimizer_state_dict(torch::nn::Module& model, const Optimizers& optimizers,
                                   const StateDictOptions& options, const Submodules& submodules) {
  const Target t = resolve(model);
  const auto prefixes = verify_options(t, options, true, optimizers, submodules);
  StateDict osd = get_optim_impl(t, optimizers, options);
  verify_state_dict(t, nullptr, &osd, options, !prefixes.empty());
  return osd;
}

StateDict get_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                   const StateDictOptions& options, const Submodules& submodules) {
  return get_optimizer_state_dict(model, Optimizers{&optimizer}, options, submodules);
}

std::pair<StateDict, StateDict> get_state_dict(torch::nn::Module& model,
                                               const Optimizers& optimizers,
                                               const StateDictOptions& options,
                                               const Submodules& submodules) {
  const Target t = resolve(model);
  const auto prefixes = verify_options(t, options, false, optimizers, submodules);
  StateDict msd = get_model_impl(t, options, prefixes);
  StateDict osd = optimizers.empty() ? StateDict() : get_optim_impl(t, optimizers, options);
  verify_state_dict(t, &msd, optimizers.empty() ? nullptr : &osd, options, !prefixes.empty());
  return {std::move(msd), std::move(osd)};
}

std::pair<StateDict, StateDict> get_state_dict(torch::nn::Module& model,
                                               torch::optim::Optimizer& optimizer,
                                               const StateDictOptions& options,
                                               const Submodules& submodules) {
  return get_state_dict(model, Optimizers{&optimizer}, options, submodules);
}

LoadResult set_model_state_dict(torch::nn::Module& model, const StateDict& model_state_dict,
                                const StateDictOptions& options) {
  const Target t = resolve(model);
  verify_options(t, options, false, {}, {});
  verify_state_dict(t, &model_state_dict, nullptr, options, false);
  return set_model_impl(t, model_state_dict, options);
}

void set_optimizer_state_dict(torch::nn::Module& model, const Optimizers& optimizers,
                              const StateDict& optim_state_dict, const StateDictOptions& options) {
  const Target t = resolve(model);
  verify_options(t, options, true, optimizers, {});
  verify_state_dict(t, nullptr, &optim_state_dict, options, false);
  set_optim_impl(t, optimizers, optim_state_dict, options);
}

void set_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                              const StateDict& optim_state_dict, const StateDictOptions& options) {
  set_optimizer_state_dict(model, Optimizers{&optimizer}, optim_state_dict, options);
}

LoadResult set_state_dict(torch::nn::Module& model, const Optimizers& optimizers,
                          const StateDict& model_state_dict, const StateDict& optim_state_dict,
                          const StateDictOptions& options) {
  const Target t = resolve(model);
  // Under broadcast_from_rank0 the other ranks pass an empty model dict but must take part.
  const bool optim_only = model_state_dict.empty() && !options.broadcast_from_rank0();
  verify_options(t, options, optim_only, optimizers, {});
  verify_state_dict(t, optim_only ? nullptr : &model_state_dict,
                    optimizers.empty() ? nullptr : &optim_state_dict, options, false);
  if (!optimizers.empty()) set_optim_impl(t, optimizers, optim_state_dict, options);
  return optim_only ? LoadResult() : set_model_impl(t, model_state_dict, options);
}

LoadResult set_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                          const StateDict& model_state_dict, const StateDict& optim_state_dict,
                          const StateDictOptions& options) {
  return set_state_dict(model, Optimizers{&optimizer}, model_state_dict, optim_state_dict, options);
}

}  // namespace checkpoint
}  // namespace fsdp
