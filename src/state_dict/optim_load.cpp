// Loading optimizer state dicts keyed by canonical FQNs (torch/distributed/fsdp/_optim_utils.py:
// _flatten_optim_state_dict, _flatten_optim_state, _shard_orig_param_state, then torch.optim's
// load_state_dict). Every rank builds the complete new state and group options first, checking
// everything; the ranks exchange verdicts; the optimizer changes only if all of them succeeded.
#include <set>
#include <sstream>

#include "dist/agreement.h"
#include "fsdp/errors.h"
#include "fsdp/optim_state_dict.h"
#include "state_dict/from_rank0.h"
#include "state_dict/optim_entries.h"
#include "state_dict/piece_exchange.h"
#include "util/message.h"

namespace fsdp {
namespace {

using detail::msg;
using detail::OptEntry;
using detail::OptimKind;
using detail::OptModel;
using detail::ParamOptimState;
using detail::quote;
using detail::rank;
using detail::RuntimeView;
using detail::shape;

struct LoadPlan {
  std::string error;
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> options;  // per group
  std::vector<std::optional<ParamOptimState>> states;                    // per entry
  void fail(const std::string& e) {
    if (error.empty()) error = e;
  }
};

std::string list_text(const std::vector<std::string>& v, size_t max = 4) {
  std::string out;
  for (size_t i = 0; i < v.size() && i < max; ++i) out += msg(i ? ", " : "", quote(v[i]));
  if (v.size() > max) out += msg(", ... (", v.size(), " in all)");
  return out.empty() ? "none" : out;
}

// Param groups: same count, same parameters per group; hyperparameters from the dict.
void plan_groups(const OptModel& om, torch::optim::Optimizer& opt, const OptimKind& kind,
                 const StateDict& osd, LoadPlan& plan) {
  plan.options.resize(om.groups.size());
  if (!osd.contains("param_groups") || !osd.at("param_groups").is_list()) {
    plan.fail("the dict has no \"param_groups\" list");
    return;
  }
  const StateList& groups = osd.at("param_groups").list();
  if (groups.size() != om.groups.size()) {
    plan.fail(
        msg("the dict has ", groups.size(), " param groups, the optimizer ", om.groups.size()));
    return;
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::string where = msg("param group ", g);
    if (!groups[g].is_dict() || !groups[g].dict().contains("params") ||
        !groups[g].dict().at("params").is_list()) {
      plan.fail(msg(where, " is not a dict with a \"params\" list"));
      continue;
    }
    const StateDict& gd = groups[g].dict();
    std::set<std::string> theirs, ours;
    for (const auto& p : gd.at("params").list()) {
      if (!p.is_string()) {
        plan.fail(msg(where, " lists a parameter by ", to_string(p.kind()),
                      ", not by FQN (rekey_optim_state_dict converts parameter IDs to FQNs)"));
        break;
      }
      theirs.insert(p.string());
    }
    for (size_t e : om.groups[g])
      for (const auto& f : om.entries[e].fqns) ours.insert(f);
    std::vector<std::string> missing, extra;
    for (const auto& f : ours)
      if (!theirs.count(f)) missing.push_back(f);
    for (const auto& f : theirs)
      if (!ours.count(f)) extra.push_back(f);
    if (!missing.empty() || !extra.empty()) {
      plan.fail(msg(where, " does not match the optimizer's: the optimizer's group also holds ",
                    list_text(missing), "; the dict's group also lists ", list_text(extra)));
      continue;
    }
    std::string err;
    plan.options[g] = kind.apply_group(opt.param_groups()[g].options(), gd, err);
    if (!err.empty()) plan.fail(msg(where, ": ", err));
  }
}

// The checked state of one FQN: step and each tensor state (Tensor or ShardedTensor) by name.
struct FqnState {
  bool present = false;
  std::optional<int64_t> step;
  std::vector<const StateValue*> values;  // per tensor name; null = absent
};

FqnState check_fqn_state(const std::string& fqn, const std::vector<int64_t>& shape,
                         const StateValue& v, const OptimKind& kind,
                         const torch::optim::OptimizerOptions& options, LoadPlan& plan) {
  FqnState s;
  s.values.assign(kind.tensor_names.size(), nullptr);
  if (!v.is_dict()) {
    plan.fail(msg("the state of ", quote(fqn), " is ", to_string(v.kind()), ", not a dict"));
    return s;
  }
  s.present = true;
  std::string names = kind.has_step ? "step" : "";
  for (const auto& n : kind.tensor_names) names += msg(names.empty() ? "" : ", ", n);
  for (const auto& [k, x] : v.dict()) {
    if (kind.has_step && k == "step") {
      if (x.is_tensor() && x.tensor().numel() == 1) {
        s.step = static_cast<int64_t>(x.tensor().item<double>());
      } else if (x.is_int() || x.is_double()) {
        s.step = static_cast<int64_t>(x.to_double());
      } else {
        plan.fail(msg("state 'step' of ", quote(fqn), " is ", to_string(x.kind()),
                      ", not a number or a 0-d tensor"));
      }
      continue;
    }
    size_t n = 0;
    while (n < kind.tensor_names.size() && kind.tensor_names[n] != k) ++n;
    if (n == kind.tensor_names.size()) {
      plan.fail(msg("unexpected state ", quote(k), " for ", quote(fqn), " (", kind.name, " keeps ",
                    names, ")"));
      continue;
    }
    if (x.is_none()) continue;  // PyTorch 1.x SGD without momentum saves None
    std::vector<int64_t> got;
    if (x.is_tensor()) {
      got = x.tensor().sizes().vec();
    } else if (x.is_sharded_tensor()) {
      got = x.sharded_tensor().size();
    } else {
      plan.fail(msg("state ", quote(k), " of ", quote(fqn), " is ", to_string(x.kind()),
                    ", not a tensor"));
      continue;
    }
    if (got != shape) {
      plan.fail(msg("state ", quote(k), " of ", quote(fqn), " has shape ", detail::shape(got),
                    ", the parameter ", detail::shape(shape)));
      continue;
    }
    s.values[n] = &x;
  }
  if (kind.has_step && !s.step) {
    plan.fail(msg("missing state 'step' for ", quote(fqn)));
  }
  const std::vector<bool> req = kind.required(options);
  for (size_t n = 0; n < req.size(); ++n) {
    if (req[n] && !s.values[n]) {
      plan.fail(msg("missing state ", quote(kind.tensor_names[n]), " for ", quote(fqn), " (",
                    kind.name, " keeps ", names, " with these hyperparameters)"));
    }
  }
  return s;
}

// One load, phase by phase over the state the phases share: check the dict (plan), fetch the
// ranges of managed parameters' ShardedTensor states (collective), build every entry's new state,
// agree on the verdict (collective), apply.
//
// `from_rank0`: `osd` is rank 0's dict there and its structure elsewhere (tensors as empty
// ShardedTensors, see detail::broadcast_structure); each tensor state is broadcast from rank 0
// when its turn comes and this rank keeps its range. The order of those broadcasts depends only
// on the structure and the model, so every rank makes the same ones.
struct OsdLoad {
  const OptModel& om;
  torch::optim::Optimizer& opt;
  const OptimKind& kind;
  const RuntimeView* rt;
  const bool from_rank0;
  LoadPlan plan;
  const StateDict empty;
  const StateDict* state = &empty;                                       // the dict's "state"
  std::vector<std::vector<FqnState>> fs;                                 // per entry, per FQN
  std::map<std::pair<size_t, size_t>, std::vector<at::Tensor>> fetched;  // (entry, pos) -> per name
  detail::ScratchBuffers scratch;  // receive buffers under from_rank0: one state tensor at a time

  OsdLoad(const OptModel& om, torch::optim::Optimizer& opt, bool from_rank0)
      : om(om),
        opt(opt),
        kind(detail::optim_kind(opt)),
        rt(om.rt.get()),
        from_rank0(from_rank0),
        scratch(from_rank0 ? largest_numel(om) : 0) {}

  static int64_t largest_numel(const OptModel& om) {
    int64_t largest = 0;
    for (const auto& en : om.entries)
      for (const auto& shape : en.shapes)
        largest = std::max(largest, c10::multiply_integers(shape));
    return largest;
  }

  void run(const StateDict& osd) {
    check(osd);
    if (rt && !from_rank0) fetch();
    build();
    agree();
    apply();
  }

  void check(const StateDict& osd);
  void fetch();
  at::Tensor range_of(size_t e, size_t p, size_t n, int64_t lo, int64_t len);
  void build();
  std::optional<int64_t> common_step(size_t e);
  void build_tensor(size_t e, size_t n, ParamOptimState& ns);
  void agree() const;
  void apply();
};

// The dict against the optimizer: its groups, then each FQN's state against its parameter and
// its group's (new) hyperparameters.
void OsdLoad::check(const StateDict& osd) {
  plan_groups(om, opt, kind, osd, plan);
  if (!osd.contains("state") || !osd.at("state").is_dict()) {
    plan.fail("the dict has no \"state\" dict");
  } else {
    state = &osd.at("state").dict();
  }
  // Every FQN in the dict must be a parameter the optimizer holds.
  for (const auto& [fqn, v] : *state) {
    auto it = om.by_fqn.find(fqn);
    if (it == om.by_fqn.end() || om.entries[it->second.first].group < 0) {
      plan.fail(
          msg("unknown FQN ", quote(fqn), " in \"state\": not a parameter the optimizer holds"));
    }
  }
  // Check each FQN's state against its parameter and its group's (new) hyperparameters.
  fs.resize(om.entries.size());
  for (size_t e = 0; e < om.entries.size(); ++e) {
    const OptEntry& en = om.entries[e];
    fs[e].resize(en.fqns.size());
    if (en.group < 0) continue;
    const auto& options =
        plan.options[en.group] ? *plan.options[en.group] : opt.param_groups()[en.group].options();
    for (size_t p = 0; p < en.fqns.size(); ++p) {
      if (state->contains(en.fqns[p])) {
        fs[e][p] =
            check_fqn_state(en.fqns[p], en.shapes[p], state->at(en.fqns[p]), kind, options, plan);
      }
    }
  }
}

// ShardedTensor values of managed parameters: fetch this rank's ranges (collective; the same
// requests on every rank: every managed FQN times every tensor state name).
void OsdLoad::fetch() {
  std::vector<detail::RangeRequest> reqs;
  std::vector<std::tuple<size_t, size_t, size_t>> where;
  for (size_t e = 0; e < om.entries.size(); ++e) {
    const OptEntry& en = om.entries[e];
    if (en.unit < 0) continue;
    for (size_t p = 0; p < en.fqns.size(); ++p) {
      const auto r = om.local(en, p);
      for (size_t n = 0; n < kind.tensor_names.size(); ++n) {
        detail::RangeRequest q;
        q.name = msg("state ", quote(kind.tensor_names[n]), " of ", quote(en.fqns[p]));
        q.shape = en.shapes[p];
        q.lo = r.lo;
        q.n = r.n;
        const StateValue* v = fs[e][p].present ? fs[e][p].values[n] : nullptr;
        if (v && v->is_sharded_tensor()) q.pieces = &v->sharded_tensor();
        reqs.push_back(std::move(q));
        where.emplace_back(e, p, n);
      }
    }
  }
  std::string err;
  const std::vector<at::Tensor> got = detail::exchange_ranges(rt->world_group(), reqs, err);
  if (!err.empty()) plan.fail("" + err);
  for (size_t i = 0; i < got.size(); ++i) {
    auto [e, p, n] = where[i];
    auto& slot = fetched[{e, p}];
    slot.resize(kind.tensor_names.size());
    slot[n] = got[i];
  }
}

// This rank's part of one FQN's tensor state `n`: elements [lo, lo + len) of the flattened
// tensor (undefined if absent or already reported).
at::Tensor OsdLoad::range_of(size_t e, size_t p, size_t n, int64_t lo, int64_t len) {
  const StateValue* v = fs[e][p].values[n];
  if (!v) return at::Tensor();
  const std::vector<int64_t>& shape = om.entries[e].shapes[p];
  // A 0-d state (of a 0-d parameter) came inline with the structure, as a tensor on every rank.
  if (from_rank0 && !shape.empty()) {  // one full tensor in flight; the caller keeps the range
    dist::ProcessGroup& pg = rt->world_group();
    const at::Tensor& param = om.entries[e].param;
    at::Tensor buf =
        pg.rank() == 0 ? scratch.as(v->tensor().detach(), v->tensor().scalar_type(), param.device())
                       : scratch.get(shape, v->sharded_tensor().dtype(), param.device());
    pg.broadcast(buf, 0);
    return buf.reshape({-1}).narrow(0, lo, len);
  }
  if (v->is_tensor()) return v->tensor().reshape({-1}).narrow(0, lo, len);
  if (om.entries[e].unit >= 0) {
    auto it = fetched.find({e, p});
    return it == fetched.end() ? at::Tensor() : it->second[n];
  }
  try {
    return v->sharded_tensor().flat_range(lo, len, msg(quote(om.entries[e].fqns[p])));
  } catch (const ValueError& ex) {
    plan.fail(msg("state ", quote(kind.tensor_names[n]), " of ", quote(om.entries[e].fqns[p]), ": ",
                  ex.what()));
    return at::Tensor();
  }
}

// Build each entry's new state.
void OsdLoad::build() {
  plan.states.resize(om.entries.size());
  for (size_t e = 0; e < om.entries.size(); ++e) {
    const OptEntry& en = om.entries[e];
    if (en.group < 0) continue;
    bool any = false, all = true;
    for (size_t p = 0; p < en.fqns.size(); ++p) {
      any |= fs[e][p].present;
      all &= fs[e][p].present;
    }
    const std::optional<int64_t> step = common_step(e);
    if (!any) continue;
    if (!all && kind.has_step) {
      std::vector<std::string> without;
      for (size_t p = 0; p < en.fqns.size(); ++p)
        if (!fs[e][p].present) without.push_back(en.fqns[p]);
      plan.fail(msg("a flat parameter mixes parameters with and without state: ",
                    list_text(without), " have none, so 'step' cannot be flattened"));
      continue;
    }
    ParamOptimState ns;
    ns.step = step;
    ns.tensors.resize(kind.tensor_names.size());
    for (size_t n = 0; n < kind.tensor_names.size(); ++n) build_tensor(e, n, ns);
    // An original parameter this rank's shard does not hold gets no state, as training leaves it
    // (its gradient stays undefined) and as PyTorch's _shard_orig_param_state gives it none.
    if (en.unit >= 0 && !en.flat && !om.local(en, 0).held) continue;
    plan.states[e] = std::move(ns);
  }
}

// The 'step' of entry `e`: its FQNs' (the parameters of one flat parameter must agree).
std::optional<int64_t> OsdLoad::common_step(size_t e) {
  const OptEntry& en = om.entries[e];
  std::optional<int64_t> step;
  for (size_t p = 0; p < en.fqns.size(); ++p) {
    if (!fs[e][p].present || !fs[e][p].step) continue;
    if (step && *step != *fs[e][p].step) {
      plan.fail(msg("the parameters of one flat parameter must have the same 'step', but ",
                    quote(en.fqns[0]), " has ", *step, " and ", quote(en.fqns[p]), " ",
                    *fs[e][p].step));
    }
    step = fs[e][p].step;
  }
  return step;
}

// Tensor state `n` of entry `e` into `ns`, in the shape the optimizer holds it here.
void OsdLoad::build_tensor(size_t e, size_t n, ParamOptimState& ns) {
  const OptEntry& en = om.entries[e];
  bool has_n = false;
  for (size_t p = 0; p < en.fqns.size(); ++p) has_n |= fs[e][p].present && fs[e][p].values[n];
  if (!has_n) return;
  const at::TensorOptions popts = en.param.options().requires_grad(false);
  if (en.unit < 0) {  // plain: the whole tensor
    const int64_t numel = en.param.numel();
    at::Tensor t = range_of(e, 0, n, 0, numel);
    if (t.defined()) ns.tensors[n] = t.reshape(en.param.sizes()).to(popts).clone();
    return;
  }
  if (!en.flat) {  // an original parameter: its piece of this rank's shard
    const auto r = om.local(en, 0);
    at::Tensor t = range_of(e, 0, n, r.lo, r.n);  // first: collective under from_rank0
    if (r.n != en.param.numel()) {
      plan.fail(msg(quote(en.fqns[0]), " holds ", en.param.numel(),
                    " elements on this rank, its shard ", r.n));
      return;
    }
    if (t.defined()) ns.tensors[n] = t.reshape(en.param.sizes()).to(popts).clone();
    return;
  }
  // A flat parameter: this rank's shard of the flattened state; zeros where a parameter
  // has none (as PyTorch's _flatten_tensor_optim_state) and in the padding.
  at::Tensor flat = at::zeros({en.param.numel()}, popts);
  for (size_t p = 0; p < en.fqns.size(); ++p) {
    const auto r = om.local(en, p);
    if (!fs[e][p].present) continue;
    at::Tensor t = range_of(e, p, n, r.lo, r.n);  // also where r.n == 0: collective
    if (t.defined() && r.n > 0) flat.narrow(0, r.offset, r.n).copy_(t);
  }
  ns.tensors[n] = flat;
}

// All-or-nothing across ranks. Every rank reports every failing rank's problem: one rank's bad
// dict often makes the others fail too (pieces they needed from it are missing), and the first
// cause should be visible wherever the error is caught.
void OsdLoad::agree() const {
  const dist::Verdicts all = dist::exchange_verdicts(
      rt ? &rt->world_group() : nullptr,
      plan.error.empty() ? dist::Verdict() : dist::Verdict::failed(ValueError(plan.error)));
  all.throw_first([&](int, const std::string&) {
    return msg("load_optim_state_dict failed, nothing was loaded: ", all.failures(rt != nullptr));
  });
}

// Apply: the dict replaces the optimizer's state and hyperparameters.
void OsdLoad::apply() {
  for (size_t g = 0; g < plan.options.size(); ++g) {
    opt.param_groups()[g].set_options(std::move(plan.options[g]));
  }
  for (size_t e = 0; e < om.entries.size(); ++e) {
    const OptEntry& en = om.entries[e];
    if (en.group < 0) continue;
    const auto key = compat::optim_state_key(en.param);
    if (plan.states[e]) {
      opt.state()[key] = kind.make(*plan.states[e]);
    } else if (kind.initial) {
      opt.state()[key] = kind.initial(en.param, opt.param_groups()[en.group].options());
    } else {
      opt.state().erase(key);
    }
  }
}

void load_impl(const OptModel& om, torch::optim::Optimizer& opt, const StateDict& osd,
               bool from_rank0 = false) {
  OsdLoad(om, opt, from_rank0).run(osd);
}

}  // namespace

void load_optim_state_dict(FullyShardedDataParallel& model, torch::optim::Optimizer& optimizer,
                           const StateDict& osd) {
  const detail::RuntimeView rt(*model);
  rt.require_idle("load_optim_state_dict");
  load_impl(detail::describe_model(&model, nullptr, optimizer), optimizer, osd);
}

void load_optim_state_dict(const torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                           const StateDict& osd) {
  load_impl(detail::describe_model(nullptr, &model, optimizer), optimizer, osd);
}

namespace detail {

void load_optim_state_dict_from_rank0(FullyShardedDataParallel& model,
                                      torch::optim::Optimizer& optimizer, const StateDict& osd) {
  const detail::RuntimeView rt(*model);
  rt.require_idle("load_optim_state_dict (broadcast_from_rank0)");
  StateDict structure = broadcast_structure(osd, rt.world_group(), 0);
  for (const char* k : {"state", "param_groups"}) {  // empty ones vanish in transit
    if (!structure.contains(k)) {
      structure.insert_or_assign(
          k, std::string(k) == "state" ? StateValue(StateDict()) : StateValue(StateList()));
    }
  }
  load_impl(detail::describe_model(&model, nullptr, optimizer), optimizer,
            rt.world_group().rank() == 0 ? osd : structure, /*from_rank0=*/true);
}

}  // namespace detail

}  // namespace fsdp
