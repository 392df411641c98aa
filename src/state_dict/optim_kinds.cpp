// An optimizer in PyTorch's terms, as export (optim_state_dict.cpp), import (optim_load.cpp) and
// checkpoint/ need it: the optimizer table (see optim_kinds.h), LibTorch's *ParamState / *Options
// members under PyTorch's names; and, over a model, which parameters the optimizer holds under
// which canonical FQNs (see optim_entries.h). State names and group keys follow torch.optim 2.x;
// "step" is a 0-d float32 tensor in PyTorch's dicts and an int64 in LibTorch's state.
#include "state_dict/optim_kinds.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <c10/util/Type.h>

#include <typeinfo>
#include <unordered_set>

#include "fsdp/compat.h"
#include "fsdp/errors.h"
#include "state_dict/optim_entries.h"
#include "util/message.h"

namespace fsdp {
namespace detail {
namespace {

namespace to = torch::optim;

// One hyperparameter: how to read and set it on LibTorch's options, or (get == nullptr) a key
// only PyTorch has, exported with PyTorch's default.
template <class O>
struct Hyper {
  const char* name;
  StateValue (*get)(const O&);
  bool (*set)(O&, const StateValue&);  // false: the value has the wrong kind
  StateValue pytorch_default;
};

bool is_number(const StateValue& v) { return v.is_double() || v.is_int(); }

// A number, a bool, or a pair of numbers (betas), read from LibTorch options by a member getter.
#define FSDP_NUM(O, field)                                           \
  Hyper<O> {                                                         \
#field, [](const O& o) { return StateValue(double(o.field())); },  \
        [](O& o, const StateValue& v) {                                \
          if (!is_number(v)) return false;                             \
          o.field(v.to_double());                                      \
          return true;                                                 \
        },                                                             \
        StateValue() \
  }
#define FSDP_BOOL(O, field)                                  \
  Hyper<O> {                                                 \
#field, [](const O& o) { return StateValue(o.field()); },  \
        [](O& o, const StateValue& v) {                        \
          if (!v.is_bool()) return false;                      \
          o.field(v.to_bool());                                \
          return true;                                         \
        },                                                     \
        StateValue() \
  }
template <class O>
Hyper<O> betas() {
  return Hyper<O>{"betas",
                  [](const O& o) {
                    return StateValue(StateList{std::get<0>(o.betas()), std::get<1>(o.betas())});
                  },
                  [](O& o, const StateValue& v) {
                    if (!v.is_list() || v.list().size() != 2 || !is_number(v.list()[0]) ||
                        !is_number(v.list()[1]))
                      return false;
                    o.betas(std::make_tuple(v.list()[0].to_double(), v.list()[1].to_double()));
                    return true;
                  },
                  StateValue()};
}
template <class O>
Hyper<O> pytorch_only(const char* name, StateValue def) {
  return Hyper<O>{name, nullptr, nullptr, std::move(def)};
}

// PyTorch 2.7 on adds "decoupled_weight_decay" last to Adam's (false) and AdamW's (true) groups.
template <class O>
std::vector<Hyper<O>> adam_family(std::vector<Hyper<O>> h, bool decoupled) {
  if (compat::kAdamHasDecoupledWeightDecay) {
    h.push_back(pytorch_only<O>("decoupled_weight_decay", decoupled));
  }
  return h;
}

// PyTorch's per-optimizer group keys, in the order torch.optim 2.6 lists them.
template <class O>
const std::vector<Hyper<O>>& hypers();

template <>
const std::vector<Hyper<to::AdamOptions>>& hypers() {
  using O = to::AdamOptions;
  static const std::vector<Hyper<O>> h =
      adam_family<O>({FSDP_NUM(O, lr), betas<O>(), FSDP_NUM(O, eps), FSDP_NUM(O, weight_decay),
                      FSDP_BOOL(O, amsgrad), pytorch_only<O>("maximize", false),
                      pytorch_only<O>("foreach", {}), pytorch_only<O>("capturable", false),
                      pytorch_only<O>("differentiable", false), pytorch_only<O>("fused", {})},
                     false);
  return h;
}
template <>
const std::vector<Hyper<to::AdamWOptions>>& hypers() {
  using O = to::AdamWOptions;
  static const std::vector<Hyper<O>> h =
      adam_family<O>({FSDP_NUM(O, lr), betas<O>(), FSDP_NUM(O, eps), FSDP_NUM(O, weight_decay),
                      FSDP_BOOL(O, amsgrad), pytorch_only<O>("foreach", {}),
                      pytorch_only<O>("maximize", false), pytorch_only<O>("capturable", false),
                      pytorch_only<O>("differentiable", false), pytorch_only<O>("fused", {})},
                     true);
  return h;
}
template <>
const std::vector<Hyper<to::SGDOptions>>& hypers() {
  using O = to::SGDOptions;
  static const std::vector<Hyper<O>> h{FSDP_NUM(O, lr),
                                       FSDP_NUM(O, momentum),
                                       FSDP_NUM(O, dampening),
                                       FSDP_NUM(O, weight_decay),
                                       FSDP_BOOL(O, nesterov),
                                       pytorch_only<O>("maximize", false),
                                       pytorch_only<O>("foreach", {}),
                                       pytorch_only<O>("differentiable", false),
                                       pytorch_only<O>("fused", {})};
  return h;
}
template <>
const std::vector<Hyper<to::AdagradOptions>>& hypers() {
  using O = to::AdagradOptions;
  static const std::vector<Hyper<O>> h{FSDP_NUM(O, lr),
                                       FSDP_NUM(O, lr_decay),
                                       FSDP_NUM(O, eps),
                                       FSDP_NUM(O, weight_decay),
                                       FSDP_NUM(O, initial_accumulator_value),
                                       pytorch_only<O>("foreach", {}),
                                       pytorch_only<O>("maximize", false),
                                       pytorch_only<O>("differentiable", false),
                                       pytorch_only<O>("fused", {})};
  return h;
}
template <>
const std::vector<Hyper<to::RMSpropOptions>>& hypers() {
  using O = to::RMSpropOptions;
  static const std::vector<Hyper<O>> h{FSDP_NUM(O, lr),
                                       FSDP_NUM(O, momentum),
                                       FSDP_NUM(O, alpha),
                                       FSDP_NUM(O, eps),
                                       FSDP_BOOL(O, centered),
                                       FSDP_NUM(O, weight_decay),
                                       pytorch_only<O>("capturable", false),
                                       pytorch_only<O>("foreach", {}),
                                       pytorch_only<O>("maximize", false),
                                       pytorch_only<O>("differentiable", false)};
  return h;
}
#undef FSDP_NUM
#undef FSDP_BOOL

template <class O>
std::vector<std::pair<std::string, StateValue>> group_items(const to::OptimizerOptions& base) {
  const O& o = static_cast<const O&>(base);
  std::vector<std::pair<std::string, StateValue>> out;
  for (const auto& h : hypers<O>()) out.emplace_back(h.name, h.get ? h.get(o) : h.pytorch_default);
  return out;
}

template <class O>
std::unique_ptr<to::OptimizerOptions> apply_group(const to::OptimizerOptions& base,
                                                  const StateDict& group, std::string& error) {
  auto out = std::make_unique<O>(static_cast<const O&>(base));
  for (const auto& h : hypers<O>()) {
    if (!h.set) continue;  // PyTorch-only: accepted and ignored
    if (!group.contains(h.name)) {
      error += msg(error.empty() ? "" : "; ", "missing hyperparameter ", quote(h.name));
      continue;
    }
    const StateValue& v = group.at(h.name);
    if (!h.set(*out, v)) {
      error += msg(error.empty() ? "" : "; ", "hyperparameter ", quote(h.name),
                   " has the wrong kind (", to_string(v.kind()), ")");
    }
  }
  return out;
}

// Per-parameter state: step (if counted) and the tensors, by PyTorch name.
template <class S>
struct TensorField {
  at::Tensor (*get)(const S&);
  void (*set)(S&, const at::Tensor&);
};
#define FSDP_TENSOR(S, field)                                                           \
  TensorField<S> {                                                                      \
    [](const S& s) { return s.field(); }, [](S& s, const at::Tensor& t) { s.field(t); } \
  }

template <class S>
const std::vector<TensorField<S>>& tensor_fields();
template <>
const std::vector<TensorField<to::AdamParamState>>& tensor_fields() {
  using S = to::AdamParamState;
  static const std::vector<TensorField<S>> f{FSDP_TENSOR(S, exp_avg), FSDP_TENSOR(S, exp_avg_sq),
                                             FSDP_TENSOR(S, max_exp_avg_sq)};
  return f;
}
template <>
const std::vector<TensorField<to::AdamWParamState>>& tensor_fields() {
  using S = to::AdamWParamState;
  static const std::vector<TensorField<S>> f{FSDP_TENSOR(S, exp_avg), FSDP_TENSOR(S, exp_avg_sq),
                                             FSDP_TENSOR(S, max_exp_avg_sq)};
  return f;
}
template <>
const std::vector<TensorField<to::SGDParamState>>& tensor_fields() {
  using S = to::SGDParamState;
  static const std::vector<TensorField<S>> f{FSDP_TENSOR(S, momentum_buffer)};
  return f;
}
template <>
const std::vector<TensorField<to::AdagradParamState>>& tensor_fields() {
  using S = to::AdagradParamState;
  static const std::vector<TensorField<S>> f{FSDP_TENSOR(S, sum)};
  return f;
}
template <>
const std::vector<TensorField<to::RMSpropParamState>>& tensor_fields() {
  using S = to::RMSpropParamState;
  static const std::vector<TensorField<S>> f{
      FSDP_TENSOR(S, square_avg), FSDP_TENSOR(S, momentum_buffer), FSDP_TENSOR(S, grad_avg)};
  return f;
}
#undef FSDP_TENSOR

// SGD counts no steps; the others keep an int64 step.
template <class S>
constexpr bool kHasStep = !std::is_same_v<S, to::SGDParamState>;

template <class S>
ParamOptimState read_state(const to::OptimizerParamState& base) {
  const S& s = static_cast<const S&>(base);
  ParamOptimState out;
  if constexpr (kHasStep<S>) out.step = s.step();
  for (const auto& f : tensor_fields<S>()) out.tensors.push_back(f.get(s));
  return out;
}

template <class S>
std::unique_ptr<to::OptimizerParamState> make_state(const ParamOptimState& st) {
  auto s = std::make_unique<S>();
  if constexpr (kHasStep<S>) s->step(st.step.value_or(0));
  const auto& fields = tensor_fields<S>();
  for (size_t i = 0; i < fields.size() && i < st.tensors.size(); ++i) {
    if (st.tensors[i].defined()) fields[i].set(*s, st.tensors[i]);
  }
  return s;
}

template <class Opt>
bool is(const to::Optimizer& o) {
  return dynamic_cast<const Opt*>(&o) != nullptr;
}

template <class Opt, class O, class S>
OptimKind make_kind(const char* name, std::vector<std::string> tensor_names,
                    std::vector<bool> (*required)(const to::OptimizerOptions&)) {
  OptimKind k;
  k.name = name;
  k.has_step = kHasStep<S>;
  k.tensor_names = std::move(tensor_names);
  k.matches = &is<Opt>;
  k.read = &read_state<S>;
  k.make = &make_state<S>;
  k.group_items = &group_items<O>;
  k.apply_group = &apply_group<O>;
  k.required = required;
  return k;
}

OptimKind adagrad() {
  OptimKind k = make_kind<to::Adagrad, to::AdagradOptions, to::AdagradParamState>(
      "Adagrad", {"sum"}, [](const to::OptimizerOptions&) { return std::vector<bool>{true}; });
  k.initial = [](const at::Tensor& p, const to::OptimizerOptions& o) {
    auto s = std::make_unique<to::AdagradParamState>();
    s->step(0);
    s->sum(at::full_like(p.detach(),
                         static_cast<const to::AdagradOptions&>(o).initial_accumulator_value()));
    return std::unique_ptr<to::OptimizerParamState>(std::move(s));
  };
  return k;
}

const std::vector<OptimKind>& table() {
  static const std::vector<OptimKind> t{
      make_kind<to::Adam, to::AdamOptions, to::AdamParamState>(
          "Adam", {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
          [](const to::OptimizerOptions& o) {
            return std::vector<bool>{true, true, static_cast<const to::AdamOptions&>(o).amsgrad()};
          }),
      make_kind<to::AdamW, to::AdamWOptions, to::AdamWParamState>(
          "AdamW", {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
          [](const to::OptimizerOptions& o) {
            return std::vector<bool>{true, true, static_cast<const to::AdamWOptions&>(o).amsgrad()};
          }),
      make_kind<to::SGD, to::SGDOptions, to::SGDParamState>(
          "SGD", {"momentum_buffer"},
          [](const to::OptimizerOptions& o) {
            return std::vector<bool>{static_cast<const to::SGDOptions&>(o).momentum() != 0};
          }),
      adagrad(),
      make_kind<to::RMSprop, to::RMSpropOptions, to::RMSpropParamState>(
          "RMSprop", {"square_avg", "momentum_buffer", "grad_avg"},
          [](const to::OptimizerOptions& o) {
            const auto& r = static_cast<const to::RMSpropOptions&>(o);
            return std::vector<bool>{true, r.momentum() > 0, r.centered()};
          }),
  };
  return t;
}

}  // namespace

const OptimKind& optim_kind(const torch::optim::Optimizer& optimizer) {
  for (const auto& k : table()) {
    if (k.matches(optimizer)) return k;
  }
  throw ValueError(msg("optimizer state dicts: unsupported optimizer ",
                       c10::demangle(typeid(optimizer).name()),
                       "; supported are torch::optim Adam, AdamW, SGD, Adagrad and RMSprop "
                       "(add an entry to src/state_dict/optim_kinds.cpp)"));
}

// ---------------------------------------------------------------------------------------------
// Which parameters the optimizer holds over a model, under which FQNs (optim_entries.h)

namespace {

using Impl = const c10::TensorImpl*;

// The entries of a wrapped model: one per parameter of param_fqns(), managed (a flat parameter
// or an original parameter of a unit's handle) or plain (an ignored parameter).
std::vector<OptEntry> wrapped_entries(FullyShardedDataParallel& model, const RuntimeView& rt) {
  // Where each flat or original parameter lives.
  std::unordered_map<Impl, std::pair<int, int>> loc;  // impl -> (unit, index; -1 = flat)
  for (const auto& u : rt.units()) {
    if (!u.handle) continue;
    loc[u.handle->flat_param().unsafeGetTensorImpl()] = {u.index, -1};
    const auto params = u.handle->orig_params();
    for (size_t i = 0; i < params.size(); ++i) {
      loc[params[i].unsafeGetTensorImpl()] = {u.index, static_cast<int>(i)};
    }
  }
  std::vector<OptEntry> entries;
  for (const auto& pf : model->param_fqns()) {
    OptEntry e;
    e.param = pf.param;
    auto it = loc.find(pf.param.unsafeGetTensorImpl());
    if (it == loc.end()) {  // ignored parameter: plain
      e.fqns = {pf.fqns.front()};
      e.shapes = {pf.param.sizes().vec()};
    } else {
      e.unit = it->second.first;
      const FlatParamHandle& h = rt.handle(e.unit);
      const auto& l = h.layout();
      e.flat = it->second.second < 0;
      if (e.flat) {
        for (size_t i = 0; i < l.fqns.size(); ++i) e.indices.push_back(i);
      } else {
        e.indices = {static_cast<size_t>(it->second.second)};
      }
      for (size_t i : e.indices) {
        e.fqns.push_back(l.fqns[i]);
        e.shapes.push_back(l.shapes[i]);
      }
    }
    entries.push_back(std::move(e));
  }
  return entries;
}

// The entries of a plain module: all plain, a tied parameter once under its first FQN.
std::vector<OptEntry> plain_entries(const torch::nn::Module& plain) {
  std::vector<OptEntry> entries;
  std::unordered_set<Impl> seen;
  for (const auto& item : plain.named_parameters(/*recurse=*/true)) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;  // tied: first FQN
    OptEntry e;
    e.param = item.value();
    e.fqns = {item.key()};
    e.shapes = {item.value().sizes().vec()};
    entries.push_back(std::move(e));
  }
  return entries;
}

// Fills om.groups and each entry's group from the optimizer's param groups; `model` only words
// the error for a tensor the model lacks.
void assign_groups(OptModel& om, const std::unordered_map<Impl, size_t>& by_impl,
                   FullyShardedDataParallel* model, torch::optim::Optimizer& optimizer) {
  const auto& groups = optimizer.param_groups();
  om.groups.resize(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t j = 0; j < groups[g].params().size(); ++j) {
      const at::Tensor& p = groups[g].params()[j];
      auto it = by_impl.find(p.unsafeGetTensorImpl());
      if (it == by_impl.end()) {
        throw ValueError(msg("optimizer state dicts: parameter ", j,
                             " of the optimizer's param group ", g, " (shape ", shape(p.sizes()),
                             ") is not a parameter of the model",
                             model && !(*model)->options().use_orig_params()
                                 ? " (without use_orig_params, build the optimizer over the "
                                   "wrapped model's parameters(): its flat parameters)"
                                 : ""));
      }
      OptEntry& e = om.entries[it->second];
      if (e.group >= 0) {
        throw ValueError(msg("optimizer state dicts: the parameter ", quote(e.fqns.front()),
                             " is in the optimizer's param groups ", e.group, " and ", g));
      }
      e.group = static_cast<int>(g);
      om.groups[g].push_back(it->second);
    }
  }
}

}  // namespace

OptModel::Local OptModel::local(const OptEntry& e, size_t p) const {
  const FlatParamHandle& h = rt->handle(e.unit);
  const size_t i = e.indices[p];
  const ShardParamInfo& s = h.shard_param_infos()[i];
  if (!h.uses_sharded_strategy()) {
    return Local{0, h.layout().numels[i], h.layout().param_offset(i), s.in_shard};
  }
  if (!s.in_shard) return Local{0, 0, 0, false};
  return Local{s.intra_param_start_idx, s.numel_in_shard, s.offset_in_shard, true};
}

OptModel describe_model(FullyShardedDataParallel* model, const torch::nn::Module* plain,
                        torch::optim::Optimizer& optimizer) {
  OptModel om;
  if (model) {
    om.rt = std::make_shared<const RuntimeView>(**model);
    om.entries = wrapped_entries(*model, *om.rt);
  } else {
    om.entries = plain_entries(*plain);
  }
  std::unordered_map<Impl, size_t> by_impl;
  for (size_t e = 0; e < om.entries.size(); ++e) {
    by_impl[om.entries[e].param.unsafeGetTensorImpl()] = e;
    for (size_t p = 0; p < om.entries[e].fqns.size(); ++p)
      om.by_fqn[om.entries[e].fqns[p]] = {e, p};
  }
  assign_groups(om, by_impl, model, optimizer);
  return om;
}

}  // namespace detail
}  // namespace fsdp
