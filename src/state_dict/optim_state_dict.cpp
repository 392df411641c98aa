// Exporting optimizer state dicts keyed by canonical FQNs (torch/distributed/fsdp/_optim_utils.py:
// _optim_state_dict, _convert_state_with_flat_params / _with_orig_params, _unflatten_param_groups)
// and re-keying them. Loading is in optim_load.cpp; which parameters the optimizer holds under
// which FQNs (describe_model) in optim_kinds.cpp.
#include <deque>
#include <optional>
#include <sstream>

#include "fsdp/errors.h"
#include "fsdp/optim_state_dict.h"
#include "state_dict/flat_shard_boxes.h"
#include "state_dict/gather_queue.h"
#include "state_dict/global_placement.h"
#include "state_dict/kept_value.h"
#include "state_dict/optim_entries.h"
#include "state_dict/piece_exchange.h"
#include "state_dict/settings.h"
#include "util/message.h"

namespace fsdp {

namespace {

using detail::msg;
using detail::OptEntry;
using detail::OptimKind;
using detail::OptModel;
using detail::ParamOptimState;
using detail::quote;
using detail::RuntimeView;

const torch::optim::OptimizerParamState* find_state(torch::optim::Optimizer& opt,
                                                    const at::Tensor& p) {
  auto it = opt.state().find(compat::optim_state_key(p));
  return it == opt.state().end() ? nullptr : it->second.get();
}

StateValue step_value(int64_t step) {
  return StateValue(at::scalar_tensor(static_cast<double>(step), at::kFloat));
}

// What the ranks know about one managed entry's state, merged over the shard group.
struct Merged {
  bool has = false;
  int64_t step = 0;
  std::vector<int> dtype;  // per tensor name; -1: no rank has it
};

// One exchange of every managed entry's local state description over `pg`.
std::vector<Merged> merge_presence(const OptModel& om, const OptimKind& kind,
                                   const std::vector<std::optional<ParamOptimState>>& local,
                                   dist::ProcessGroup& pg) {
  std::ostringstream os;
  for (size_t e = 0; e < om.entries.size(); ++e) {
    if (om.entries[e].unit < 0) continue;
    if (!local[e]) {
      os << "0\n";
      continue;
    }
    os << "1 " << local[e]->step.value_or(0);
    for (const auto& t : local[e]->tensors) os << " " << (t.defined() ? int(t.scalar_type()) : -1);
    os << "\n";
  }
  const auto all = pg.all_gather_bytes(os.str());
  std::vector<Merged> out(om.entries.size());
  for (auto& m : out) m.dtype.assign(kind.tensor_names.size(), -1);
  for (const auto& blob : all) {
    std::istringstream is(blob);
    for (size_t e = 0; e < om.entries.size(); ++e) {
      if (om.entries[e].unit < 0) continue;
      std::string line;
      std::getline(is, line);
      std::istringstream ls(line);
      int has = 0;
      ls >> has;
      if (!has) continue;
      int64_t step = 0;
      ls >> step;
      Merged& m = out[e];
      // A rank holding no elements of an original parameter gets no gradient for it and does
      // not step it; the ranks that hold elements agree, and count highest.
      m.step = m.has ? std::max(m.step, step) : step;
      m.has = true;
      for (auto& d : m.dtype) {
        int dt = -1;
        ls >> dt;
        if (d < 0) d = dt;
      }
    }
  }
  return out;
}

// SHARDED, routed: one state tensor of one FQN, as asked of the piece exchange.
struct ChunkJob {
  std::string fqn;
  size_t name;
  std::vector<int64_t> shape;
  at::ScalarType dtype;
  int rank;
  std::vector<ShardMetadata> chunks;  // every rank's dim-0 chunk (chunk_metadata)
  at::Device device;                  // the state's (the piece exchange assembles on the CPU)
};

// One export, phase by phase over the state the phases share: managed entries (collective on
// every rank), then, on the ranks that return the dict, plain entries and the dict itself.
//
// Managed entries. FULL (and state that stays whole): gather one unit's state tensor at a time.
// SHARDED: route each parameter's piece of every rank's flat shard straight to the ranks whose
// dim-0 chunk needs it (one piece exchange for the whole call); no unit is ever whole.
struct OsdExport {
  const OptModel& om;
  torch::optim::Optimizer& opt;
  const OptimKind& kind;
  const bool sharded, offload, flat_shards;
  const FullOptimStateDictConfig& gathering;  // the FULL export's window and observer
  bool keep = true;  // this rank returns the dict: every rank does, under rank0_only rank 0 only
  std::vector<std::optional<ParamOptimState>> local;  // per entry: this rank's state
  std::vector<Merged> merged;                         // per managed entry, over the shard group
  std::map<std::string, StateDict> per_fqn;           // the state by FQN, as it is exported
  std::vector<ChunkJob> jobs;                         // SHARDED, routed: what to make of...
  std::vector<detail::RangeRequest> reqs;             // ...the piece exchange's answers to these
  std::deque<ShardedTensor> held;                     // the pieces reqs point to

  OsdExport(const OptModel& om, torch::optim::Optimizer& opt, bool sharded, bool offload,
            bool rank0_only, bool flat_shards, const FullOptimStateDictConfig& gathering)
      : om(om),
        opt(opt),
        kind(detail::optim_kind(opt)),
        sharded(sharded),
        offload(offload),
        flat_shards(flat_shards),
        gathering(gathering),
        local(om.entries.size()) {
    for (size_t e = 0; e < om.entries.size(); ++e) {
      if (om.entries[e].group < 0) continue;
      if (const auto* s = find_state(opt, om.entries[e].param)) local[e] = kind.read(*s);
    }
    keep = !rank0_only || !om.rt || om.rt->world_group().rank() == 0;
  }

  at::Tensor out_tensor(const at::Tensor& t, bool owned = false) const {
    return detail::kept_value(t, offload, owned);
  }

  StateDict& start(const std::string& fqn, int64_t step) {
    StateDict& d = per_fqn[fqn];
    if (kind.has_step && !d.contains("step")) d.insert_or_assign("step", step_value(step));
    return d;
  }

  StateDict run() {
    if (om.rt) managed();
    if (!keep) return StateDict();
    plain();
    return assemble();
  }

  void managed();
  void unit(const detail::UnitView& u, detail::GatherQueue& gathers);
  void chunk_state(FlatParamHandle& h, const std::vector<size_t>& mine, size_t n,
                   at::ScalarType dtype, const detail::FlatShardBoxes* as_stored);
  void route(const OptEntry& en, size_t p, size_t n, at::ScalarType dtype, int64_t lo,
             const at::Tensor& data, int rank, int world);
  void gather_state(FlatParamHandle& h, const std::vector<size_t>& mine, size_t n,
                    at::ScalarType dtype, detail::GatherQueue& gathers);
  void finish(const FlatParamLayout& l, size_t n, const std::vector<size_t>& mine,
              const at::Tensor& full, bool fresh);
  void place_chunks(const RuntimeView& rt);
  void plain();
  StateDict assemble();
};

void OsdExport::managed() {
  const RuntimeView& rt = *om.rt;
  merged = merge_presence(om, kind, local, rt.shard_group());
  // FULL: each unit's state tensor is gathered whole, several at a time (gather_queue.h).
  detail::GatherQueue gathers(gathering.gather_window_bytes(), gathering.on_gather());
  for (const auto& u : rt.units()) {
    if (u.handle) unit(u, gathers);
  }
  gathers.finish();
  if (!reqs.empty()) place_chunks(rt);
}

// Each state tensor of the unit's entries that some rank has state for.
void OsdExport::unit(const detail::UnitView& u, detail::GatherQueue& gathers) {
  FlatParamHandle& h = *u.handle;
  std::vector<size_t> mine;  // entries of this unit with state somewhere
  for (size_t e = 0; e < om.entries.size(); ++e) {
    if (om.entries[e].unit == u.index && merged[e].has) mine.push_back(e);
  }
  if (mine.empty()) return;
  if (keep) {
    for (size_t e : mine)
      for (const auto& fqn : om.entries[e].fqns) start(fqn, merged[e].step);
  }
  // As PyTorch: SHARDED chunks the state of flat parameters under every strategy (under
  // NO_SHARD too, where each rank holds it whole), and of original parameters only where
  // they are sharded (NO_SHARD then gives plain tensors, as _convert_state_with_orig_params).
  const bool chunk = sharded && (h.uses_sharded_strategy() || om.entries[mine[0]].flat);
  // ShardLayout::FLAT_SHARDS: each rank's pieces as they lie in its shard, nothing routed.
  std::optional<detail::FlatShardBoxes> as_stored;
  if (chunk && flat_shards && h.uses_sharded_strategy()) as_stored.emplace(h.layout());
  for (size_t n = 0; n < kind.tensor_names.size(); ++n) {
    int dtype = -1;
    for (size_t e : mine) dtype = dtype >= 0 ? dtype : merged[e].dtype[n];
    if (dtype < 0) continue;  // no parameter of this unit has this state
    const auto type = static_cast<at::ScalarType>(dtype);
    if (chunk) {
      chunk_state(h, mine, n, type, as_stored ? &*as_stored : nullptr);
    } else {
      gather_state(h, mine, n, type, gathers);
    }
  }
}

// SHARDED: each parameter's piece of this rank's flat state `n`, kept as it lies (`as_stored`)
// or routed to the ranks whose chunk needs it.
void OsdExport::chunk_state(FlatParamHandle& h, const std::vector<size_t>& mine, size_t n,
                            at::ScalarType dtype, const detail::FlatShardBoxes* as_stored) {
  const auto opts = at::TensorOptions().dtype(dtype);
  const int rank = h.process_group().rank(), world = h.process_group().size();
  for (size_t e : mine) {
    if (merged[e].dtype[n] < 0) continue;
    const OptEntry& en = om.entries[e];
    // This rank's flat state (the flat parameter's, or this parameter's piece).
    at::Tensor flat;
    if (local[e] && local[e]->tensors[n].defined()) {
      flat = local[e]->tensors[n].reshape({-1}).to(opts);
    }
    for (size_t p = 0; p < en.indices.size(); ++p) {
      const auto r = om.local(en, p);
      const std::vector<int64_t>& shape = en.shapes[p];
      const at::Tensor data =
          flat.defined() ? flat.narrow(0, en.flat ? r.offset : 0, r.n) : at::zeros({r.n}, opts);
      if (as_stored) {
        const bool empty = c10::multiply_integers(shape) == 0;
        per_fqn[en.fqns[p]].insert_or_assign(
            kind.tensor_names[n], empty
                                      ? chunk_sharded(at::empty(shape, opts), rank, world)
                                      : sharded_from_flat_range(shape, r.lo, out_tensor(data), rank,
                                                                as_stored->of(en.indices[p])));
        continue;
      }
      route(en, p, n, dtype, r.lo, data, rank, world);
    }
  }
}

// Offers `data` (elements [lo, lo + data.numel()) of FQN `p` of `en`'s flattened state `n`) to
// the piece exchange and asks it for this rank's dim-0 chunk of that state.
void OsdExport::route(const OptEntry& en, size_t p, size_t n, at::ScalarType dtype, int64_t lo,
                      const at::Tensor& data, int rank, int world) {
  const std::vector<int64_t>& shape = en.shapes[p];
  held.push_back(sharded_from_flat_range(shape, lo, data, rank));
  detail::RangeRequest q;
  q.name = msg("state ", quote(kind.tensor_names[n]), " of ", quote(en.fqns[p]));
  q.shape = shape;
  q.pieces = &held.back();
  ChunkJob job{en.fqns[p], n, shape, dtype, rank, chunk_metadata(shape, world), en.param.device()};
  if (shape.empty()) {
    q.n = 1;  // a 0-d state stays plain (as PyTorch keeps zero-dim state): all need it
  } else {
    int64_t row = 1;  // elements per index of dim 0
    for (size_t d = 1; d < shape.size(); ++d) row *= shape[d];
    for (const auto& m : job.chunks) {
      if (m.placement_rank != rank) continue;
      q.lo = m.offsets[0] * row;
      q.n = m.numel();
    }
  }
  reqs.push_back(std::move(q));
  jobs.push_back(std::move(job));
}

// FULL (and state that stays whole): this rank's flat shard of state `n`, gathered whole where
// the unit is sharded; finish() then takes it.
void OsdExport::gather_state(FlatParamHandle& h, const std::vector<size_t>& mine, size_t n,
                             at::ScalarType dtype, detail::GatherQueue& gathers) {
  const auto opts = at::TensorOptions().dtype(dtype);
  const FlatParamLayout& l = h.layout();
  at::Tensor shard;
  if (mine.size() == 1 && om.entries[mine[0]].flat && local[mine[0]] &&
      local[mine[0]]->tensors[n].defined()) {
    shard = local[mine[0]]->tensors[n].reshape({-1}).to(opts);
  } else {  // original parameters (or a rank without the state): assemble the flat shard
    shard = at::zeros({h.flat_param().numel()}, opts);
    for (size_t e : mine) {
      if (!local[e] || !local[e]->tensors[n].defined()) continue;
      const auto r = om.local(om.entries[e], 0);
      if (r.n > 0) shard.narrow(0, r.offset, r.n).copy_(local[e]->tensors[n].reshape({-1}));
    }
  }
  if (h.uses_sharded_strategy() && h.world_size() > 1) {
    gathers.add(h.process_group(), std::move(shard), [this, &l, n, mine](const at::Tensor& full) {
      finish(l, n, mine, full, /*fresh=*/true);
    });
  } else {
    finish(l, n, mine, shard, /*fresh=*/false);
  }
}

// Takes one unit's gathered state tensor `n`.
void OsdExport::finish(const FlatParamLayout& l, size_t n, const std::vector<size_t>& mine,
                       const at::Tensor& full, bool fresh) {
  if (!keep) return;
  const std::vector<at::Tensor> views = l.unflat_views(full);
  // A freshly gathered buffer is kept whole and its views returned, without a copy each
  // (as the model's FULL state dict does), where the returned states fill most of it; one
  // mostly of parameters without state (frozen ones, say) is not kept for a few of them.
  int64_t returned = 0;
  for (size_t e : mine) {
    if (merged[e].dtype[n] < 0) continue;
    for (size_t idx : om.entries[e].indices) returned += l.numels[idx];
  }
  const bool owned = fresh && 2 * returned >= full.numel();
  for (size_t e : mine) {
    if (merged[e].dtype[n] < 0) continue;
    const OptEntry& en = om.entries[e];
    for (size_t p = 0; p < en.indices.size(); ++p) {
      per_fqn[en.fqns[p]].insert_or_assign(kind.tensor_names[n],
                                           out_tensor(views[en.indices[p]], owned));
    }
  }
}

// SHARDED, routed: one piece exchange for all requests; each answer becomes this rank's chunk.
void OsdExport::place_chunks(const RuntimeView& rt) {
  // Over the shard group: every rank of it holds pieces of the same flat shards. (Under
  // hybrid sharding each replica group exchanges within itself.)
  std::string error;
  const std::vector<at::Tensor> got = detail::exchange_ranges(rt.shard_group(), reqs, error);
  if (!error.empty()) throw StateError(msg("optim_state_dict: ", error));  // a bug, not input
  for (size_t i = 0; i < jobs.size(); ++i) {
    ChunkJob& j = jobs[i];
    // On the state's own device unless offloaded, as PyTorch keeps its chunks.
    const at::Device device = offload ? at::Device(at::kCPU) : j.device;
    if (j.shape.empty()) {
      per_fqn[j.fqn].insert_or_assign(kind.tensor_names[j.name],
                                      out_tensor(got[i].reshape(at::IntArrayRef{}).to(device)));
      continue;
    }
    std::vector<Shard> mine;
    for (const auto& m : j.chunks) {
      if (m.placement_rank != j.rank) continue;
      mine.push_back(Shard{got[i].view(m.sizes).to(device), m});
    }
    per_fqn[j.fqn].insert_or_assign(
        kind.tensor_names[j.name],
        ShardedTensor(j.shape, j.dtype, std::move(mine), std::move(j.chunks)));
  }
}

// Plain entries (ignored parameters, unwrapped models): their own full state.
void OsdExport::plain() {
  for (size_t e = 0; e < om.entries.size(); ++e) {
    const OptEntry& en = om.entries[e];
    if (en.unit >= 0 || !local[e]) continue;
    StateDict& d = start(en.fqns[0], local[e]->step.value_or(0));
    for (size_t n = 0; n < kind.tensor_names.size(); ++n) {
      if (local[e]->tensors[n].defined())
        d.insert_or_assign(kind.tensor_names[n], out_tensor(local[e]->tensors[n]));
    }
  }
}

// The dict: states and param groups in the optimizer's order, as PyTorch lists them.
StateDict OsdExport::assemble() {
  StateDict state;
  StateList groups;
  for (size_t g = 0; g < om.groups.size(); ++g) {
    StateList params;
    for (size_t e : om.groups[g]) {
      for (const auto& fqn : om.entries[e].fqns) {
        params.emplace_back(fqn);
        auto it = per_fqn.find(fqn);
        if (it != per_fqn.end()) state.insert_or_assign(fqn, std::move(it->second));
      }
    }
    StateDict group;
    for (auto& [k, v] : kind.group_items(opt.param_groups()[g].options())) {
      group.insert_or_assign(k, std::move(v));
    }
    group.insert_or_assign("params", std::move(params));
    groups.emplace_back(std::move(group));
  }
  StateDict osd;
  osd.insert_or_assign("state", std::move(state));
  osd.insert_or_assign("param_groups", std::move(groups));
  return osd;
}

// `gathering`: the window and observer of the export's gathers (a SHARDED export should make
// none: its observer is there to watch that).
StateDict export_osd(const OptModel& om, torch::optim::Optimizer& opt, bool sharded, bool offload,
                     bool rank0_only, bool flat_shards = false,
                     const FullOptimStateDictConfig& gathering = {}) {
  return OsdExport(om, opt, sharded, offload, rank0_only, flat_shards, gathering).run();
}

}  // namespace

StateDict optim_state_dict(FullyShardedDataParallel& model, torch::optim::Optimizer& optimizer) {
  const detail::RuntimeView rt(*model);
  detail::StateDictSettings& cfg = *detail::StateDictSettings::of(*model);
  rt.require_idle("optim_state_dict");
  if (cfg.type == StateDictType::LOCAL_STATE_DICT) {
    throw ValueError(
        "optim_state_dict: LOCAL_STATE_DICT is not supported for optimizer state dicts (as in "
        "PyTorch); use FULL_STATE_DICT or SHARDED_STATE_DICT");
  }
  const bool sharded = cfg.type == StateDictType::SHARDED_STATE_DICT;
  const FullOptimStateDictConfig& full = cfg.full_optim;
  const OptModel om = detail::describe_model(&model, nullptr, optimizer);
  // PyTorch's _reset_flat_param_grad_info_if_needed: requires_grad follows the parameters.
  for (const auto& u : rt.units()) {
    if (u.handle) u.handle->reset_flat_param_grad_info_if_needed();
  }
  StateValue osd(export_osd(
      om, optimizer, sharded, sharded ? cfg.sharded_optim.offload_to_cpu() : full.offload_to_cpu(),
      !sharded && full.rank0_only(),
      sharded && cfg.sharded_optim.layout() == ShardLayout::FLAT_SHARDS,
      sharded ? FullOptimStateDictConfig().on_gather(cfg.sharded_optim.on_gather()) : full));
  if (sharded) detail::place_on_global_ranks(osd, rt.shard_group());
  return std::move(osd.dict());
}

StateDict optim_state_dict(const torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  const OptModel om = detail::describe_model(nullptr, &model, optimizer);
  return export_osd(om, optimizer, /*sharded=*/false, /*offload=*/false, /*rank0_only=*/false);
}

// ---------------------------------------------------------------------------------------------
// Re-keying

namespace {

bool all_digits(const std::string& k) {
  return !k.empty() && k.find_first_not_of("0123456789") == std::string::npos;
}

// True if `osd` is already keyed the way `to` asks: every "state" key a parameter ID and every
// "params" entry an Int (PARAM_ID), or no "state" key an ID and every "params" entry a string
// (PARAM_NAME). An empty dict is both, as in PyTorch (whose test is all() over the keys).
bool keyed_as(const StateDict& osd, OptimStateKeyType to) {
  const bool ids = to == OptimStateKeyType::PARAM_ID;
  if (osd.contains("state") && osd.at("state").is_dict()) {
    for (const auto& [k, v] : osd.at("state").dict()) {
      if (all_digits(k) != ids) return false;
    }
  }
  if (osd.contains("param_groups") && osd.at("param_groups").is_list()) {
    for (const auto& g : osd.at("param_groups").list()) {
      if (!g.is_dict() || !g.dict().contains("params") || !g.dict().at("params").is_list())
        return false;
      for (const auto& p : g.dict().at("params").list()) {
        if (ids ? !p.is_int() : !p.is_string()) return false;
      }
    }
  }
  return true;
}

StateDict rekey(const StateDict& osd, OptimStateKeyType to, const OptModel& om) {
  // Position in the optimizer's parameter list <-> FQN.
  std::vector<std::string> fqn_of;
  for (const auto& g : om.groups) {
    for (size_t e : g) {
      if (om.entries[e].fqns.size() != 1) {
        throw ValueError(
            msg("rekey_optim_state_dict: the optimizer holds a flat parameter standing for ",
                om.entries[e].fqns.size(), " parameters; parameter IDs need use_orig_params=true"));
      }
      fqn_of.push_back(om.entries[e].fqns[0]);
    }
  }
  std::map<std::string, int64_t> id_of;
  for (size_t i = 0; i < fqn_of.size(); ++i) id_of[fqn_of[i]] = static_cast<int64_t>(i);
  auto convert = [&](const std::string& key) -> std::string {
    if (to == OptimStateKeyType::PARAM_ID) {
      auto it = id_of.find(key);
      if (it == id_of.end())
        throw ValueError(
            msg("rekey_optim_state_dict: ", quote(key), " is not a parameter the optimizer holds"));
      return std::to_string(it->second);
    }
    size_t pos = 0;
    int64_t id = -1;
    try {
      id = std::stoll(key, &pos);
    } catch (...) {
      pos = 0;
    }
    if (pos != key.size() || id < 0 || id >= static_cast<int64_t>(fqn_of.size())) {
      throw ValueError(msg("rekey_optim_state_dict: ", quote(key),
                           " is not a parameter ID of the optimizer (0..", fqn_of.size(), ")"));
    }
    return fqn_of[id];
  };
  StateDict out;
  StateDict state;
  for (const auto& [k, v] : osd.at("state").dict()) state.insert_or_assign(convert(k), v);
  out.insert_or_assign("state", std::move(state));
  if (osd.contains("param_groups")) {
    StateList groups;
    for (const auto& gv : osd.at("param_groups").list()) {
      StateDict g = gv.dict();
      StateList params;
      for (const auto& p : g.at("params").list()) {
        const std::string key = p.is_string() ? p.string() : std::to_string(p.to_int());
        const std::string k = convert(key);
        if (to == OptimStateKeyType::PARAM_ID) {
          params.emplace_back(static_cast<int64_t>(std::stoll(k)));
        } else {
          params.emplace_back(k);
        }
      }
      g.insert_or_assign("params", std::move(params));
      groups.emplace_back(std::move(g));
    }
    out.insert_or_assign("param_groups", std::move(groups));
  }
  return out;
}

}  // namespace

StateDict rekey_optim_state_dict(const StateDict& osd, OptimStateKeyType key_type,
                                 FullyShardedDataParallel& model,
                                 torch::optim::Optimizer& optimizer) {
  if (keyed_as(osd, key_type)) return osd;  // PyTorch returns it unchanged (a defensive call)
  return rekey(osd, key_type, detail::describe_model(&model, nullptr, optimizer));
}

StateDict rekey_optim_state_dict(const StateDict& osd, OptimStateKeyType key_type,
                                 const torch::nn::Module& model,
                                 torch::optim::Optimizer& optimizer) {
  if (keyed_as(osd, key_type)) return osd;
  return rekey(osd, key_type, detail::describe_model(nullptr, &model, optimizer));
}

}  // namespace fsdp
