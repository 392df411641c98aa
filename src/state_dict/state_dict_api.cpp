// get_/set_ model and optimizer state dicts for wrapped and plain models
// (torch/distributed/checkpoint/state_dict.py, torch/distributed/checkpoint/state_dict.py): option
// checks, the state-dict type a wrapped model is put in for the call, submodule and
// frozen-parameter filtering, and the optimizer half (zero-step state initialisation, merging and
// splitting several optimizers' dicts, the flat form, and loading from rank 0).
#include "fsdp/checkpoint/state_dict.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <exception>
#include <functional>
#include <optional>
#include <set>

#include "dist/agreement.h"
#include "fsdp/errors.h"
#include "fsdp/optim_state_dict.h"
#include "fsdp/state_dict_utils.h"
#include "state_dict/load_keys.h"
#include "state_dict/optim_dict_forms.h"
#include "state_dict/wrapped_model.h"
#include "util/message.h"

namespace fsdp {
namespace checkpoint {
namespace {

using detail::msg;
using detail::quote;
using detail::rank;
using optim_forms::kGroups;
using optim_forms::kParams;
using optim_forms::kState;

// The model a call works on: a wrapped model, or a plain module.
struct Target {
  mutable FullyShardedDataParallel wrapped{nullptr};
  torch::nn::Module* plain = nullptr;
  /// The unwrapped module tree (whose names are the canonical FQNs).
  torch::nn::Module& inner() const { return wrapped ? *wrapped->module() : *plain; }
  /// The group collectives of this call run over, if any.
  dist::ProcessGroup* group() const {
    if (wrapped) return &detail::state_dict_group(*wrapped);
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
        detail::is_wrapped_module(m)) {
      const std::string where = item.key().empty() ? "the module itself" : msg(quote(item.key()));
      throw ValueError(msg(
          "state dict API: ", where,
          " is (part of) a FullyShardedDataParallel model, so its parameters are flat-parameter "
          "views (PyTorch: 'contains _flat_param ... the model is not the root module'); pass "
          "the wrapped model itself"));
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
    if (optimizers[i] == nullptr) throw ValueError(msg("optimizer ", i, " is null"));
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
      throw ValueError(msg("submodules[", i, "] (",
                           submodules[i] ? submodules[i]->name() : std::string("null"),
                           ") is not a module of the model"));
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
        msg("The option indicates that model state_dict is required to save or load, but model "
            "state_dict is empty (",
            rank(t.rank()), ")."));
  }
  if (osd && osd->empty() && !rank0_holds_all && !o.broadcast_from_rank0()) {
    throw ValueError(
        msg("The option indicates that model state_dict is required to save, or load but optim "
            "state_dict is empty (",
            rank(t.rank()), ")."));
  }
  if (msd) {
    for (const auto& [k, v] : *msd) {
      if (k.find("_flat_param") != std::string::npos) {
        throw ValueError(msg(quote(k),
                             " contains _flat_param: a LOCAL state dict (or a key of a model that "
                             "is not the root module); these functions use FULL or SHARDED dicts "
                             "keyed by the unwrapped model's FQNs"));
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
              FullStateDictConfig()
                  .offload_to_cpu(o.cpu_offload())
                  .rank0_only(o.cpu_offload())
                  .on_gather(o.on_gather()),
              FullOptimStateDictConfig()
                  .offload_to_cpu(o.cpu_offload())
                  .rank0_only(o.cpu_offload() || o.broadcast_from_rank0())
                  .on_gather(o.on_gather()));
  } else {
    g.emplace(model, StateDictType::SHARDED_STATE_DICT,
              ShardedStateDictConfig()
                  .offload_to_cpu(o.cpu_offload())
                  .layout(o.shard_layout())
                  .on_gather(o.on_gather()),
              ShardedOptimStateDictConfig()
                  .offload_to_cpu(o.cpu_offload())
                  .layout(o.shard_layout())
                  .on_gather(o.on_gather()));
  }
}

// PyTorch's _maybe_full_or_cpu_state_dict. FULL dicts of wrapped models are already gathered
// (and on rank 0 only where the config said so); plain modules hold whole tensors.
// With full_state_dict and cpu_offload only rank 0 keeps values: the other ranks get empty dicts,
// optimizer dicts included (PyTorch's ranks_only=(0,) empties every container there).
StateDict full_or_cpu(StateDict sd, const Target& t, const StateDictOptions& o) {
  if (o.full_state_dict() && o.cpu_offload() && t.rank() != 0) return StateDict();
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
// gradients and zero learning rate, which leaves the parameters as they are. On a wrapped model
// only the parameters that training gives gradients get one: not an original parameter
// (use_orig_params) that this rank's shard does not hold, which the runtime leaves without a
// gradient, so without state (PyTorch fakes one for every parameter, so a freshly initialised
// optimizer there has states that training never makes, and a checkpoint template taken from it
// asks for keys a trained model's checkpoint lacks). `skip` lists those parameters.
void init_optim_state(torch::optim::Optimizer& opt,
                      const std::set<const c10::TensorImpl*>& skip = {}) {
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
      if (p.requires_grad() && !skip.count(p.unsafeGetTensorImpl())) {
        p.mutable_grad() = at::zeros_like(p);
      }
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
    throw ValueError(
        msg("initialising the optimizer's state (one step with zero learning rate) failed: ",
            e.what()));
  }
  restore();
}

optim_forms::DescribeOptimizer describer(const Target& t) {
  return [t](torch::optim::Optimizer& opt) {
    return t.wrapped ? detail::describe_model(&t.wrapped, nullptr, opt)
                     : detail::describe_model(nullptr, t.plain, opt);
  };
}

// The zero-step state initialisation of every optimizer (see init_optim_state).
void init_optim_states(const Target& t, const Optimizers& optimizers) {
  for (torch::optim::Optimizer* opt : optimizers) {
    if (!opt->state().empty()) continue;
    std::set<const c10::TensorImpl*> skip;
    if (t.wrapped) {
      const detail::OptModel om = describer(t)(*opt);
      for (const auto& en : om.entries) {
        if (en.unit >= 0 && !en.flat && !om.local(en, 0).held) {
          skip.insert(en.param.unsafeGetTensorImpl());
        }
      }
    }
    init_optim_state(*opt, skip);
  }
}

// PyTorch's "<fqn> is not in the optimizer state" (_optim_utils.py's
// _convert_state_with_orig_params): under use_orig_params, a unit some of whose parameters the
// optimizers hold must have all its trainable ones held. A trainable parameter left out of every
// optimizer is usually a mistake (it was meant to be frozen, or added); PyTorch refuses the dict
// rather than save it silently. Several optimizers may share a unit's parameters between them.
void check_units_covered(const Target& t, const Optimizers& optimizers) {
  if (!t.wrapped || !t.wrapped->options().use_orig_params() || optimizers.empty()) return;
  std::map<int, std::set<std::string>> held;
  std::map<int, std::vector<std::string>> trainable;
  for (size_t i = 0; i < optimizers.size(); ++i) {
    const detail::OptModel om = describer(t)(*optimizers[i]);
    for (const auto& en : om.entries) {
      if (en.unit < 0 || en.flat) continue;
      if (en.group >= 0) held[en.unit].insert(en.fqns.front());
      if (i == 0 && en.param.requires_grad()) trainable[en.unit].push_back(en.fqns.front());
    }
  }
  for (const auto& [unit, fqns] : held) {
    for (const auto& fqn : trainable[unit]) {
      if (fqns.count(fqn)) continue;
      std::string unit_params, optim_params;
      for (const auto& f : trainable[unit]) unit_params += msg(unit_params.empty() ? "" : ", ", f);
      for (const auto& f : fqns) optim_params += msg(optim_params.empty() ? "" : ", ", f);
      throw ValueError(msg(fqn,
                           " is not in the optimizer state. The unit has the trainable "
                           "parameters [",
                           unit_params, "] while the optimizers hold [", optim_params,
                           "] (freeze it with requires_grad(false), or give it to "
                           "an optimizer)"));
    }
  }
}

// A call's local preparation, agreed on before its first collective. Every rank runs `prepare`
// (which may throw, and returns flags for the others); where the call is collective (`pg`), the
// ranks then exchange verdicts (dist/agreement.h). If any rank failed, every rank throws: the
// failed one its own error, the others an error of the same kind naming it. Without this a rank
// whose dict is malformed would fail alone while the others waited in a collective it never
// joins, until the timeout. Returns every rank's flags (only this rank's where not collective).
std::vector<std::string> agree(dist::ProcessGroup* pg, const std::string& api,
                               const std::function<std::string()>& prepare) {
  const dist::Verdict mine = dist::Verdict::of([&] {
    try {
      return prepare();
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {  // LibTorch's own (c10::Error): an fsdp error instead
      throw ValueError(msg(api, ": ", e.what()));
    }
  });
  return dist::agree(pg, mine, [&](int r, const std::string& error) {
    return msg(api, " failed on ", rank(r), " (this is ", rank(pg->rank()),
               "); nothing was changed: ", error);
  });
}

// Before a get's first collective, on every rank: the optimizers must cover their units
// (check_units_covered) and hold state (init_optim_states). Agreed, so that a rank that refuses
// makes every rank throw rather than leave the others waiting in the gather.
void prepare_optimizers_for_get(const Target& t, const Optimizers& optimizers,
                                const std::string& api) {
  agree(t.wrapped ? t.group() : nullptr, api, [&] {
    check_units_covered(t, optimizers);
    init_optim_states(t, optimizers);
    return std::string();
  });
}

StateDict get_optim_impl(const Target& t, const Optimizers& optimizers, const StateDictOptions& o) {
  StateDict state;
  StateList groups;
  std::optional<StateDictTypeGuard> guard;
  enter_type(guard, t, o);
  for (torch::optim::Optimizer* opt : optimizers) {
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
  if (o.ignore_frozen_params()) {
    // By FQN, before submodule prefixes are stripped (as PyTorch). Original parameters keep
    // their requires_grad flag in the wrapped module's tree; a tied parameter goes under every
    // name.
    for (const auto& p : t.inner().named_parameters(/*recurse=*/true)) {
      if (!p.value().requires_grad()) sd.erase(p.key());
    }
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
  std::vector<std::string> meta;
  for (const auto& [k, v] : sd) {
    if (v.is_tensor() && v.tensor().is_meta()) meta.push_back(k);
  }
  for (const auto& k : meta) sd.erase(k);
  return full_or_cpu(std::move(sd), t, o);
}

// The optimizers' part of set_*. `parts` holds each optimizer's dict where this rank supplies
// values; `from_rank0` (the same on every rank) loads rank 0's everywhere.
void load_optimizers(const Target& t, const Optimizers& optimizers,
                     const std::vector<StateDict>& parts, bool from_rank0,
                     const StateDictOptions& o) {
  if (!from_rank0) {
    // An empty dict is only allowed where it means "nothing for this rank": a plain module's
    // full + cpu_offload dict on ranks > 0 (a wrapped model's is loaded from rank 0).
    for (size_t i = 0; i < parts.size(); ++i) {
      std::optional<StateDictTypeGuard> guard;
      enter_type(guard, t, o);
      if (t.wrapped) {
        load_optim_state_dict(t.wrapped, *optimizers[i], parts[i]);
      } else {
        load_optim_state_dict(*t.plain, *optimizers[i], parts[i]);
      }
    }
    return;
  }
  dist::ProcessGroup& pg = *t.group();
  for (size_t i = 0; i < optimizers.size(); ++i) {
    const StateDict part = pg.rank() == 0 ? parts[i] : StateDict();
    if (t.wrapped) {  // each state tensor in turn; every rank keeps its range
      detail::load_optim_state_dict_from_rank0(t.wrapped, *optimizers[i], part);
      continue;
    }
    // Plain replicas hold whole states anyway: every rank receives rank 0's dict and loads it as
    // rank 0 does, so a state rank 0's dict lacks (a parameter that never had a gradient) or a
    // group key of another PyTorch version is handled alike everywhere (PyTorch's broadcast is
    // not strict for optimizers).
    StateDict whole = detail::broadcast_whole_state_dict(part, pg, 0);
    for (const char* k : {kState, kGroups}) {  // empty ones vanish in transit
      if (!whole.contains(k)) {
        whole.insert_or_assign(
            k, std::string(k) == kState ? StateValue(StateDict()) : StateValue(StateList()));
      }
    }
    load_optim_state_dict(*t.plain, *optimizers[i], whole);
  }
}

// A strict load's key check, made before anything is loaded: PyTorch's load_state_dict raises
// only after set_state_dict's optimizers took their dicts, leaving them loaded and the model not.
// PyTorch's message alone leaves a user who saved with ignore_frozen_params (and loads with the
// same options, strict by default) to guess; ours says which option loads such a dict.
void check_model_keys(const Target& t, const StateDict& msd, const StateDictOptions& o) {
  LoadResult r;
  std::set<std::string> keys;
  for (const auto& key : module_state_dict(t.inner()).keys()) {
    keys.insert(key);
    if (!msd.contains(key)) r.missing_keys.push_back(key);
  }
  for (const auto& [key, v] : msd)
    if (!keys.count(key)) r.unexpected_keys.push_back(key);
  std::string error = fsdp::detail::load_keys_error(r);
  if (error.empty()) return;
  std::set<std::string> frozen;
  for (const auto& p : t.inner().named_parameters(/*recurse=*/true)) {
    if (!p.value().requires_grad()) frozen.insert(p.key());
  }
  const bool only_frozen_missing =
      r.unexpected_keys.empty() &&
      std::all_of(r.missing_keys.begin(), r.missing_keys.end(),
                  [&](const std::string& k) { return frozen.count(k) != 0; });
  if (only_frozen_missing && o.ignore_frozen_params()) {
    error +=
        msg(" The missing keys are frozen parameters, which ignore_frozen_params leaves out of the "
            "dicts it gets; load such a dict with strict(false) (the frozen parameters keep their "
            "values), as PyTorch's set_state_dict needs too.");
  } else if (only_frozen_missing) {
    error +=
        msg(" The missing keys are frozen parameters: a dict taken with ignore_frozen_params loads "
            "with strict(false).");
  }
  throw ValueError(error);
}

// Where set_* takes the model's values from, decided alike on every rank.
enum class ModelFrom { NOWHERE, OWN, RANK0 };

// `flags[r][0]` is 'm' where rank r passed a non-empty model dict. Throws ValueError (on every
// rank alike, from the same flags) where the ranks' dicts do not fit together.
ModelFrom model_source(const Target& t, const StateDictOptions& o,
                       const std::vector<std::string>& flags) {
  dist::ProcessGroup* pg = t.group();
  const bool multi = pg && pg->size() > 1;
  if (o.broadcast_from_rank0() && multi) return ModelFrom::RANK0;
  if (!t.wrapped || !multi) return ModelFrom::OWN;  // local: an empty dict loads nothing
  // A wrapped model over several ranks: what the ranks passed decides.
  std::vector<int> with, without;
  for (size_t r = 0; r < flags.size(); ++r)
    (flags[r][0] == 'm' ? with : without).push_back(static_cast<int>(r));
  if (with.empty()) return ModelFrom::NOWHERE;  // an empty dict loads nothing (PyTorch)
  if (without.empty()) return ModelFrom::OWN;
  // What a full_state_dict + cpu_offload get leaves: values on rank 0, empty dicts elsewhere.
  // (PyTorch's FSDP would wait forever here: rank 0 loads while the others skip the load.)
  if (o.full_state_dict() && o.cpu_offload() && with.front() == 0) return ModelFrom::RANK0;
  throw ValueError(
      msg("set_model_state_dict: ", rank(without.front()), " passed an empty model state dict but ",
          rank(with.front()),
          " did not; every rank passes its dict, or rank 0 alone with broadcast_from_rank0 (or "
          "with full_state_dict and cpu_offload)"));
}

LoadResult load_model(const Target& t, const StateDict& msd, const StateDictOptions& o,
                      ModelFrom from) {
  if (from == ModelFrom::NOWHERE) return LoadResult();
  if (from == ModelFrom::RANK0) {
    if (t.wrapped) return detail::load_state_dict_from_rank0(t.wrapped, msd, o.strict());
    // A replica per rank: rank 0's values go straight into every rank's own tensors.
    StateDict local = module_state_dict(*t.plain);
    return broadcast_state_dict(msd, local, *t.group(), 0, o.strict());
  }
  if (msd.empty()) return LoadResult();  // an empty dict loads nothing, as in PyTorch
  if (!t.wrapped) return load_module_state_dict(*t.plain, msd, o.strict());
  std::optional<StateDictTypeGuard> guard;
  enter_type(guard, t, o);
  return load_state_dict(t.wrapped, msd, o.strict());
}

// set_*: the optimizers first, then the model, as in PyTorch. `msd` null: optimizers only;
// `osd` null: the model only. `optim_only` (PyTorch's): an empty model dict means optimizers
// only (set_state_dict; not under broadcast_from_rank0, where ranks > 0 pass empty dicts but
// take part).
LoadResult set_impl(const Target& t, const Optimizers& optimizers, const StateDict* msd,
                    const StateDict* osd, const StateDictOptions& o, bool optim_only,
                    const std::string& api) {
  dist::ProcessGroup* pg = t.group();
  const bool multi = pg && pg->size() > 1;
  const int rank = multi ? pg->rank() : 0;
  // Rank 0's optimizer dict is loaded everywhere under broadcast_from_rank0, and for a wrapped
  // model under full_state_dict + cpu_offload (PyTorch's optim_state_dict_to_load, whose
  // rank0_only those options set).
  const bool optim_rank0 = osd && multi && o.full_state_dict() &&
                           (o.broadcast_from_rank0() || (t.wrapped && o.cpu_offload()));
  const bool collective = multi && (t.wrapped || o.broadcast_from_rank0());
  std::vector<StateDict> parts;
  auto prepare = [&]() -> std::string {
    verify_options(t, o, optim_only, optimizers, {});
    verify_state_dict(t, optim_only ? nullptr : msd, osd, o, false);
    // The dict this rank supplies (under broadcast_from_rank0 only rank 0's is loaded).
    if (msd && !optim_only && o.strict() && !msd->empty() &&
        (!o.broadcast_from_rank0() || rank == 0)) {
      check_model_keys(t, *msd, o);
    }
    init_optim_states(t, optimizers);
    if (osd && !osd->empty() && (!optim_rank0 || rank == 0)) {
      const StateDict nested = osd->contains(kState)
                                   ? *osd
                                   : optim_forms::unflatten_optim(describer(t), optimizers, *osd);
      for (torch::optim::Optimizer* opt : optimizers)
        parts.push_back(optim_forms::split_for(describer(t), *opt, nested));
    }
    std::string flags(1, msd && !msd->empty() ? 'm' : '-');
    return flags + (osd && !osd->empty() ? 'o' : '-');
  };
  const std::vector<std::string> flags = agree(collective ? pg : nullptr, api, prepare);
  // Everything that can be refused is refused before anything is loaded.
  if (optim_rank0 && flags[0][1] != 'o') {
    throw ValueError(msg(api,
                         ": rank 0 holds no optimizer state dict, and its dict is the one "
                         "loaded (broadcast_from_rank0, or full_state_dict with cpu_offload)"));
  }
  const ModelFrom from = msd ? model_source(t, o, flags) : ModelFrom::NOWHERE;
  if (osd) load_optimizers(t, optimizers, parts, optim_rank0, o);
  return msd ? load_model(t, *msd, o, from) : LoadResult();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Public API

StateDict unflatten_optim_state_dict(torch::nn::Module& model, const Optimizers& optimizers,
                                     const StateDict& flat) {
  const Target t = resolve(model);
  verify_options(t, StateDictOptions(), true, optimizers, {});
  return optim_forms::unflatten_optim(describer(t), optimizers, flat);
}

StateDict get_model_state_dict(torch::nn::Module& model, const StateDictOptions& options,
                               const Submodules& submodules) {
  const Target t = resolve(model);
  const auto prefixes = verify_options(t, options, false, {}, submodules);
  StateDict sd = get_model_impl(t, options, prefixes);
  verify_state_dict(t, &sd, nullptr, options, !prefixes.empty());
  return sd;
}

std::pair<StateDict, StateDict> get_state_dict(torch::nn::Module& model,
                                               const Optimizers& optimizers,
                                               const StateDictOptions& options,
                                               const Submodules& submodules) {
  const Target t = resolve(model);
  const auto prefixes = verify_options(t, options, false, optimizers, submodules);
  if (!optimizers.empty()) prepare_optimizers_for_get(t, optimizers, "get_state_dict");
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

StateDict get_optimizer_state_dict(torch::nn::Module& model, const Optimizers& optimizers,
                                   const StateDictOptions& options, const Submodules& submodules) {
  const Target t = resolve(model);
  const auto prefixes = verify_options(t, options, true, optimizers, submodules);
  prepare_optimizers_for_get(t, optimizers, "get_optimizer_state_dict");
  StateDict osd = get_optim_impl(t, optimizers, options);
  verify_state_dict(t, nullptr, &osd, options, !prefixes.empty());
  return osd;
}

StateDict get_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                   const StateDictOptions& options, const Submodules& submodules) {
  return get_optimizer_state_dict(model, Optimizers{&optimizer}, options, submodules);
}

LoadResult set_model_state_dict(torch::nn::Module& model, const StateDict& model_state_dict,
                                const StateDictOptions& options) {
  const Target t = resolve(model);
  return set_impl(t, {}, &model_state_dict, nullptr, options, /*optim_only=*/false,
                  "set_model_state_dict");
}

void set_optimizer_state_dict(torch::nn::Module& model, const Optimizers& optimizers,
                              const StateDict& optim_state_dict, const StateDictOptions& options) {
  const Target t = resolve(model);
  set_impl(t, optimizers, nullptr, &optim_state_dict, options, /*optim_only=*/true,
           "set_optimizer_state_dict");
}

void set_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                              const StateDict& optim_state_dict, const StateDictOptions& options) {
  set_optimizer_state_dict(model, Optimizers{&optimizer}, optim_state_dict, options);
}

LoadResult set_state_dict(torch::nn::Module& model, const Optimizers& optimizers,
                          const StateDict& model_state_dict, const StateDict& optim_state_dict,
                          const StateDictOptions& options) {
  const Target t = resolve(model);
  const bool optim_only = model_state_dict.empty() && !options.broadcast_from_rank0();
  return set_impl(t, optimizers, &model_state_dict,
                  optimizers.empty() ? nullptr : &optim_state_dict, options, optim_only,
                  "set_state_dict");
}

LoadResult set_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                          const StateDict& model_state_dict, const StateDict& optim_state_dict,
                          const StateDictOptions& options) {
  return set_state_dict(model, Optimizers{&optimizer}, model_state_dict, optim_state_dict, options);
}

}  // namespace checkpoint
}  // namespace fsdp
