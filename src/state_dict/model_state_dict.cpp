// FULL / SHARDED / LOCAL state dicts of a wrapped model
// (torch/distributed/fsdp/_state_dict_utils.py).
#include "fsdp/model_state_dict.h"

#include <algorithm>
#include <map>

#include "fsdp/errors.h"
#include "runtime/view.h"
#include "state_dict/flat_shard_boxes.h"
#include "state_dict/gather_queue.h"
#include "state_dict/global_placement.h"
#include "state_dict/kept_value.h"
#include "state_dict/key_map.h"
#include "state_dict/no_shard_fallback.h"
#include "state_dict/settings.h"
#include "state_dict/wrapped_model.h"

namespace fsdp {

namespace detail {

dist::ProcessGroup& state_dict_group(const FullyShardedDataParallelImpl& model) {
  return RuntimeView(model).world_group();
}

bool is_wrapped_module(const torch::nn::Module* m) { return is_unit_module(m); }

KeyMap key_map(const RuntimeView& rt) {
  KeyMap km;
  std::map<const c10::TensorImpl*, ParamLoc> loc;
  for (const auto& u : rt.units()) {
    if (!u.handle) continue;
    auto params = u.handle->orig_params();
    for (size_t i = 0; i < params.size(); ++i) {
      loc[params[i].unsafeGetTensorImpl()] = ParamLoc{u.index, i};
    }
  }
  for (const auto& item : rt.root_module().named_modules("", true)) {
    const std::string& prefix = item.key();
    auto name = [&](const std::string& n) { return prefix.empty() ? n : prefix + "." + n; };
    for (const auto& p : item.value()->named_parameters(false)) {
      const std::string k = name(p.key());
      km.order.push_back(k);
      auto it = loc.find(p.value().unsafeGetTensorImpl());
      if (it != loc.end()) {
        km.managed[k] = it->second;
      } else {
        km.unmanaged[k] = p.value();
      }
    }
    for (const auto& b : item.value()->named_buffers(false)) {
      const std::string k = name(b.key());
      km.order.push_back(k);
      km.unmanaged[k] = b.value();
    }
  }
  return km;
}

std::string flat_key(const UnitView& u) {
  return u.fqn.empty() ? "_flat_param" : u.fqn + "._flat_param";
}

FlatShardBoxes::FlatShardBoxes(const FlatParamLayout& layout) : layout_(layout) {
  for (int r = 0; r < layout.world_size; ++r) infos_.push_back(layout.shard_param_infos(r));
}

std::vector<ShardMetadata> FlatShardBoxes::of(size_t i) const {
  std::vector<ShardMetadata> all;
  for (int r = 0; r < layout_.world_size; ++r) {
    const ShardParamInfo& s = infos_[r][i];
    if (!s.in_shard) continue;
    for (auto& b :
         flat_range_boxes(layout_.shapes[i], s.intra_param_start_idx, s.numel_in_shard, r))
      all.push_back(std::move(b));
  }
  return all;
}

}  // namespace detail

namespace {

using detail::flat_key;
using detail::key_map;
using detail::KeyMap;
using detail::RuntimeView;

// The value of an ignored parameter or a buffer as saved: cloned, in its original dtype.
at::Tensor unmanaged_value(const RuntimeView& rt, const at::Tensor& t, bool offload) {
  at::Tensor v = t.detach();
  const at::ScalarType saved = rt.original_dtype(t);
  if (saved != v.scalar_type()) v = v.to(saved);
  return detail::kept_value(v, offload);
}

// The state dict in the model's key order: each managed parameter's value from `values` (by unit
// and index in its handle), every other key's as unmanaged_value saves it.
template <typename V>
StateDict in_key_order(const RuntimeView& rt, const KeyMap& km,
                       const std::map<std::pair<int, size_t>, V>& values, bool offload) {
  StateDict sd;
  for (const auto& k : km.order) {
    auto m = km.managed.find(k);
    if (m != km.managed.end()) {
      sd.insert_or_assign(k, values.at({m->second.unit, m->second.index}));
    } else {
      sd.insert_or_assign(k, unmanaged_value(rt, km.unmanaged.at(k), offload));
    }
  }
  return sd;
}

// Unshards each unit in turn (full precision; only the NO_SHARD ones with `no_shard_only`) and
// calls `take(unit, param index, full value)`. The values are the live parameters (NO_SHARD) or
// views of a buffer freed at the reshard: they must be copied to be kept.
template <typename F>
void unshard_units(const RuntimeView& rt, bool no_shard_only, const GatherObserver& on_gather,
                   F&& take) {
  for (const auto& u : rt.units()) {
    if (!u.handle || (no_shard_only && u.handle->uses_sharded_strategy())) continue;
    FlatParamHandle& h = *u.handle;
    h.set_training_state(HandleTrainingState::SUMMON_FULL_PARAMS);
    try {
      h.unshard();
      if (on_gather) on_gather(h.unsharded_storage_bytes());
      auto params = h.orig_params();
      for (size_t i = 0; i < params.size(); ++i) take(u.index, i, params[i].detach());
    } catch (...) {
      h.reshard(true);
      h.set_training_state(HandleTrainingState::IDLE);
      throw;
    }
    h.reshard(true);
    h.set_training_state(HandleTrainingState::IDLE);
  }
}

StateDict full_state_dict(const RuntimeView& rt, const FullStateDictConfig& cfg) {
  const bool keep = !cfg.rank0_only() || rt.world_group().rank() == 0;
  const KeyMap km = key_map(rt);
  std::map<std::pair<int, size_t>, at::Tensor> values;
  // Sharded units are not unsharded: their shards go through a GatherQueue, which gathers small
  // units several to a collective (a Gloo all-gather of a few hundred KB is bound by its fixed
  // cost) and large ones straight into fresh memory. The values are views of that memory, which
  // nobody else holds: kept as they are, as a copy would double the memory written and faulted
  // in, most of consolidation's cost on the CPU (docs/performance.md). Every rank gathers (the
  // collective needs them all); only those that keep the result hold on to it.
  detail::GatherQueue gathers(cfg.gather_window_bytes(), cfg.on_gather());
  for (const auto& u : rt.units()) {
    if (!u.handle || !u.handle->uses_sharded_strategy()) continue;
    FlatParamHandle& h = *u.handle;
    const int unit = u.index;
    gathers.add(
        h.process_group(), h.shard_to_gather(), [&, unit, &l = h.layout()](const at::Tensor& full) {
          if (!keep) return;
          const auto views = l.unflat_views(full);  // padded: the views end before the padding
          for (size_t i = 0; i < views.size(); ++i)
            values[{unit, i}] = detail::kept_value(views[i], cfg.offload_to_cpu(), /*owned=*/true);
        });
  }
  gathers.finish();
  // NO_SHARD units hold their whole parameters: copied from the live values.
  unshard_units(rt, /*no_shard_only=*/true, cfg.on_gather(),
                [&](int u, size_t i, const at::Tensor& full) {
                  if (keep) values[{u, i}] = detail::kept_value(full, cfg.offload_to_cpu());
                });
  if (!keep) return StateDict();
  return in_key_order(rt, km, values, cfg.offload_to_cpu());
}

// SHARDED and LOCAL run only on fully sharded models: NoShardFallback (state_dict) turned any
// request on a model with NO_SHARD units into FULL.
StateDict sharded_state_dict(const RuntimeView& rt, const ShardedStateDictConfig& cfg) {
  const bool offload = cfg.offload_to_cpu();
  const KeyMap km = key_map(rt);
  const int rank = rt.shard_group().rank(), world = rt.shard_group().size();
  std::map<std::pair<int, size_t>, ShardedTensor> values;
  if (cfg.layout() == ShardLayout::FLAT_SHARDS) {
    for (const auto& u : rt.units()) {
      if (!u.handle) continue;
      FlatParamHandle& h = *u.handle;
      // Parameters replaced since the last unshard (use_orig_params) go into the shard first.
      if (h.options().use_orig_params()) h.writeback_orig_params();
      const detail::FlatShardBoxes boxes(h.layout());
      const at::Tensor flat = h.flat_param().detach();
      for (size_t i = 0; i < h.layout().shapes.size(); ++i) {
        const auto& shape = h.layout().shapes[i];
        if (h.layout().numels[i] ==
            0) {  // no shard holds any of it: one empty piece, as chunk_sharded
          values[{u.index, i}] = chunk_sharded(at::empty(shape, flat.options()), rank, world);
          continue;
        }
        const ShardParamInfo& s = h.shard_param_infos()[i];
        at::Tensor data =
            s.in_shard ? flat.narrow(0, s.offset_in_shard, s.numel_in_shard) : flat.narrow(0, 0, 0);
        data = detail::kept_value(data, offload);
        values[{u.index, i}] = sharded_from_flat_range(
            shape, s.in_shard ? s.intra_param_start_idx : 0, data, rank, boxes.of(i));
      }
    }
  } else {
    unshard_units(rt, /*no_shard_only=*/false, cfg.on_gather(),
                  [&](int u, size_t i, const at::Tensor& full) {
                    ShardedTensor t = chunk_sharded(full, rank, world);
                    values[{u, i}] = offload ? t.to(at::kCPU) : t;
                  });
  }
  return in_key_order(rt, km, values, offload);
}

ShardedTensor local_flat_value(const FlatParamHandle& h, bool offload) {
  const auto& l = h.layout();
  const int rank = h.rank();
  std::vector<ShardMetadata> all;
  std::vector<Shard> mine;
  for (int r = 0; r < h.world_size(); ++r) {
    const int64_t valid = l.sharded_numel - l.shard_numel_padded(r);
    if (valid <= 0) continue;
    ShardMetadata m{{r * l.sharded_numel}, {valid}, r};
    all.push_back(m);
    if (r == rank) {
      at::Tensor data = h.flat_param().detach().narrow(0, 0, valid);
      mine.push_back(Shard{detail::kept_value(data, offload), m});
    }
  }
  return ShardedTensor({l.unpadded_unsharded_numel}, h.orig_dtype(), std::move(mine),
                       std::move(all));
}

StateDict local_state_dict(const RuntimeView& rt, const LocalStateDictConfig& cfg) {
  const bool offload = cfg.offload_to_cpu();
  const KeyMap km = key_map(rt);
  StateDict sd;
  std::vector<bool> emitted(rt.units().size(), false);
  for (const auto& k : km.order) {
    auto m = km.managed.find(k);
    if (m == km.managed.end()) {
      sd.insert_or_assign(k, unmanaged_value(rt, km.unmanaged.at(k), offload));
      continue;
    }
    // A unit's flat parameter takes the place of the first of its parameters.
    const int u = m->second.unit;
    if (emitted[u]) continue;
    emitted[u] = true;
    sd.insert_or_assign(flat_key(rt.units()[u]), local_flat_value(rt.handle(u), offload));
  }
  return sd;
}
}  // namespace

namespace detail {
NoShardFallback::NoShardFallback(const RuntimeView& rt, StateDictSettings& cfg) : cfg_(cfg) {
  if (cfg.type == StateDictType::FULL_STATE_DICT) return;
  bool no_shard = false;
  for (const auto& u : rt.units()) no_shard |= u.handle && !u.handle->uses_sharded_strategy();
  if (!no_shard) return;
  // PyTorch's _replace_with_full_state_dict_type: NO_SHARD has nothing to shard, so the other
  // types fall back to FULL (with a default config) and say so. A SHARDED config's observer
  // still watches the gathers made in its place.
  TORCH_WARN("When using NO_SHARD for ShardingStrategy, full_state_dict will be returned.");
  active_ = true;
  prev_type_ = cfg.type;
  prev_full_ = cfg.full;
  cfg.type = StateDictType::FULL_STATE_DICT;
  cfg.full = FullStateDictConfig().on_gather(
      prev_type_ == StateDictType::SHARDED_STATE_DICT ? cfg.sharded.on_gather() : GatherObserver());
}
NoShardFallback::~NoShardFallback() {
  if (!active_) return;
  cfg_.type = prev_type_;
  cfg_.full = prev_full_;
}
}  // namespace detail

StateDict state_dict(FullyShardedDataParallel& model) {
  const detail::RuntimeView rt(*model);
  detail::StateDictSettings& cfg = *detail::StateDictSettings::of(*model);
  rt.require_idle("state_dict");
  detail::NoShardFallback fallback(rt, cfg);
  switch (cfg.type) {
    case StateDictType::FULL_STATE_DICT:
      return full_state_dict(rt, cfg.full);
    case StateDictType::SHARDED_STATE_DICT:
    case StateDictType::LOCAL_STATE_DICT: {
      StateValue sd(cfg.type == StateDictType::SHARDED_STATE_DICT
                        ? sharded_state_dict(rt, cfg.sharded)
                        : local_state_dict(rt, cfg.local));
      detail::place_on_global_ranks(sd, rt.shard_group());
      return std::move(sd.dict());
    }
  }
  throw InternalError("unknown StateDictType");
}

// ---------------------------------------------------------------------------------------------

StateDictTypeGuard::StateDictTypeGuard(FullyShardedDataParallel& model, StateDictType type,
                                       FullStateDictConfig config)
    : settings_(detail::StateDictSettings::of(*model)),
      prev_type_(settings_->type),
      prev_full_(settings_->full),
      prev_sharded_(settings_->sharded),
      prev_local_(settings_->local),
      prev_full_optim_(settings_->full_optim),
      prev_sharded_optim_(settings_->sharded_optim) {
  settings_->type = type;
  settings_->full = config;
}

StateDictTypeGuard::StateDictTypeGuard(FullyShardedDataParallel& model, StateDictType type,
                                       ShardedStateDictConfig config)
    : StateDictTypeGuard(model, type, FullStateDictConfig()) {
  settings_->full = prev_full_;
  settings_->sharded = config;
}

StateDictTypeGuard::StateDictTypeGuard(FullyShardedDataParallel& model, StateDictType type,
                                       LocalStateDictConfig config)
    : StateDictTypeGuard(model, type, FullStateDictConfig()) {
  settings_->full = prev_full_;
  settings_->local = config;
}

StateDictTypeGuard::StateDictTypeGuard(FullyShardedDataParallel& model, StateDictType type,
                                       FullStateDictConfig config,
                                       FullOptimStateDictConfig optim_config)
    : StateDictTypeGuard(model, type, config) {
  settings_->full_optim = optim_config;
}

StateDictTypeGuard::StateDictTypeGuard(FullyShardedDataParallel& model, StateDictType type,
                                       ShardedStateDictConfig config,
                                       ShardedOptimStateDictConfig optim_config)
    : StateDictTypeGuard(model, type, config) {
  settings_->sharded_optim = optim_config;
}

StateDictTypeGuard::~StateDictTypeGuard() {
  settings_->full_optim = prev_full_optim_;
  settings_->sharded_optim = prev_sharded_optim_;
  settings_->type = prev_type_;
  settings_->full = prev_full_;
  settings_->sharded = prev_sharded_;
  settings_->local = prev_local_;
}

}  // namespace fsdp
