// Loading FULL / SHARDED / LOCAL state dicts into a wrapped model: every rank plans its copies
// and checks every key, shape, dtype and piece; the ranks exchange verdicts; nothing is written
// unless all of them succeeded.
#include <algorithm>
#include <map>
#include <set>
#include <sstream>

#include "dist/agreement.h"
#include "fsdp/errors.h"
#include "fsdp/model_state_dict.h"
#include "runtime/view.h"
#include "state_dict/from_rank0.h"
#include "state_dict/key_map.h"
#include "state_dict/load_keys.h"
#include "state_dict/no_shard_fallback.h"
#include "state_dict/piece_exchange.h"
#include "state_dict/settings.h"
#include "util/message.h"

namespace fsdp {
namespace {

using detail::flat_key;
using detail::key_map;
using detail::KeyMap;
using detail::msg;
using detail::ParamLoc;
using detail::quote;
using detail::rank;
using detail::RuntimeView;
using detail::shape;

struct Plan {
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // dst <- src (copy_ casts)
  bool strict_dtype = false;                              // reject instead of casting
  std::string error;                                      // first problem found on this rank
  LoadResult result;
  void fail(const std::string& e) {
    if (error.empty()) error = e;
  }
};

// Plans the copy of this rank's part of a managed parameter from `src_range(start, n)`.
template <typename Range>
void plan_param(const RuntimeView& rt, const ParamLoc& loc, Range&& src_range, Plan& plan) {
  FlatParamHandle& h = rt.handle(loc.unit);
  const ShardParamInfo& s = h.shard_param_infos()[loc.index];
  const auto& l = h.layout();
  at::Tensor flat = h.flat_param().detach();
  if (!h.uses_sharded_strategy()) {
    plan.copies.emplace_back(flat.narrow(0, l.param_offset(loc.index), l.numels[loc.index]),
                             src_range(0, l.numels[loc.index]));
  } else if (s.in_shard && s.numel_in_shard > 0) {
    plan.copies.emplace_back(flat.narrow(0, s.offset_in_shard, s.numel_in_shard),
                             src_range(s.intra_param_start_idx, s.numel_in_shard));
  }
}

void check_shape_dtype(const std::string& key, at::IntArrayRef got, at::ScalarType got_dtype,
                       at::IntArrayRef want, at::ScalarType want_dtype, int rank, Plan& plan) {
  if (got != want) {
    plan.fail(msg("size mismatch for ", quote(key), ": copying a param with shape ", shape(got),
                  " from the state dict, the shape in the current model is ", shape(want), " (",
                  detail::rank(rank), ")"));
  } else if (got_dtype != want_dtype && plan.strict_dtype) {
    plan.fail(msg("dtype mismatch for ", quote(key), ": the state dict has ", got_dtype,
                  ", the model ", want_dtype, " (", detail::rank(rank), ")"));
  }
}

// As PyTorch loads inside an unshard with writeback: parameters the user replaced (set_data)
// since the last unshard are written into the flat parameter first, or the next unshard would
// copy them over what a load writes.
void writeback_all(const RuntimeView& rt, Plan& plan) {
  for (const auto& u : rt.units()) {
    if (!u.handle) continue;
    try {
      u.handle->writeback_orig_params();
    } catch (const std::exception& e) {
      plan.fail(e.what());
    }
  }
}

// All-or-nothing across ranks (dist/agreement.h): returns only if no rank's plan failed;
// otherwise every rank throws, with its own error or the first failing rank's.
void agree_or_throw(dist::ProcessGroup& pg, const std::string& error) {
  const dist::Verdicts all = dist::exchange_verdicts(
      &pg, error.empty() ? dist::Verdict() : dist::Verdict::failed(ValueError(error)));
  if (!error.empty()) throw ValueError(msg("load_state_dict: ", error));
  all.throw_first([](int r, const std::string& e) {
    return msg("load_state_dict aborted, nothing was loaded: ", rank(r), " failed: ", e);
  });
}

void plan_unmanaged(const RuntimeView& rt, const std::string& key, const at::Tensor& target,
                    const StateValue& v, Plan& plan, int rank) {
  if (!v.is_tensor()) {
    plan.fail(msg(quote(key), " must be a Tensor, the state dict has ", to_string(v.kind())));
    return;
  }
  check_shape_dtype(key, v.tensor().sizes(), v.tensor().scalar_type(), target.sizes(),
                    rt.original_dtype(target), rank, plan);
  plan.copies.emplace_back(target.detach(), v.tensor());
}

// SHARDED: this rank's range of every managed parameter, assembled from whatever pieces the
// ranks' dicts hold (piece_exchange.h). Undefined where this rank's dict lacks the key.
std::map<std::string, at::Tensor> exchange_pieces(const RuntimeView& rt, const KeyMap& km,
                                                  const StateDict& sd, Plan& plan) {
  std::vector<detail::RangeRequest> reqs;
  std::vector<std::string> keys;
  for (const auto& k : km.order) {
    auto m = km.managed.find(k);
    if (m == km.managed.end()) continue;
    const FlatParamHandle& h = rt.handle(m->second.unit);
    const ShardParamInfo& s = h.shard_param_infos()[m->second.index];
    detail::RangeRequest q;
    q.name = msg(quote(k));
    q.shape = h.layout().shapes[m->second.index];
    q.lo = s.in_shard ? s.intra_param_start_idx : 0;
    q.n = s.in_shard ? s.numel_in_shard : 0;
    if (sd.contains(k) && sd.at(k).is_sharded_tensor()) q.pieces = &sd.at(k).sharded_tensor();
    reqs.push_back(std::move(q));
    keys.push_back(k);
  }
  // Over all data-parallel ranks: the dict may have been cut for another layout than this
  // (e.g. 4 chunks saved without hybrid sharding, loaded as 2 x 2).
  std::string error;
  std::vector<at::Tensor> got = detail::exchange_ranges(rt.world_group(), reqs, error);
  if (!error.empty()) plan.fail(error);
  std::map<std::string, at::Tensor> ranges;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (got[i].defined()) ranges.emplace(keys[i], got[i]);
  }
  return ranges;
}

// LOCAL: the unit's flat-parameter shard as this rank saved it, which loads only into the same
// shard (same world size and layout).
void plan_local_unit(FlatParamHandle& h, const std::string& fk, const StateValue& v, Plan& plan) {
  const auto& l = h.layout();
  if (!v.is_sharded_tensor()) {
    plan.fail(msg(quote(fk), " must be a ShardedTensor in a LOCAL state dict, it is ",
                  to_string(v.kind())));
    return;
  }
  const ShardedTensor& t = v.sharded_tensor();
  const int64_t valid = l.sharded_numel - h.shard_numel_padded();
  const Shard* mine = nullptr;
  for (const auto& s : t.local_shards()) {
    if (s.metadata.offsets == std::vector<int64_t>{h.rank() * l.sharded_numel} &&
        s.metadata.sizes == std::vector<int64_t>{valid}) {
      mine = &s;
    }
  }
  if (t.size() != std::vector<int64_t>{l.unpadded_unsharded_numel} ||
      (plan.strict_dtype && t.dtype() != h.orig_dtype()) || (valid > 0 && mine == nullptr)) {
    plan.fail(msg(quote(fk), " does not match this rank's flat parameter (", rank(h.rank()), " of ",
                  h.world_size(), ", ", l.unpadded_unsharded_numel, " elements, shard at ",
                  h.rank() * l.sharded_numel, " of ", valid,
                  "): LOCAL state dicts load only at the world size and layout that saved "
                  "them; use SHARDED_STATE_DICT to reshard"));
    return;
  }
  if (valid > 0) {
    plan.copies.emplace_back(h.flat_param().detach().narrow(0, 0, valid), mine->tensor);
  }
}

// FULL (or a whole tensor in a SHARDED dict): this rank's range is cut from the tensor itself.
void plan_whole_param(const RuntimeView& rt, const std::string& k, const ParamLoc& loc,
                      const StateValue& v, int rank, Plan& plan) {
  if (!v.is_tensor()) {
    plan.fail(msg(quote(k), " must be a Tensor in a FULL state dict, it is ", to_string(v.kind())));
    return;
  }
  const FlatParamHandle& h = rt.handle(loc.unit);
  const at::Tensor& t = v.tensor();
  check_shape_dtype(k, t.sizes(), t.scalar_type(), h.layout().shapes[loc.index], h.orig_dtype(),
                    rank, plan);
  if (!plan.error.empty()) return;
  plan_param(
      rt, loc, [&](int64_t start, int64_t n) { return t.reshape({-1}).narrow(0, start, n); }, plan);
}

// SHARDED: this rank's range comes from what exchange_pieces assembled.
void plan_sharded_param(const RuntimeView& rt, const std::string& k, const ParamLoc& loc,
                        const StateValue& v, const std::map<std::string, at::Tensor>& ranges,
                        int rank, Plan& plan) {
  if (!v.is_sharded_tensor()) {
    plan.fail(msg(quote(k), " must be a ShardedTensor or a Tensor in a SHARDED state dict, it is ",
                  to_string(v.kind())));
    return;
  }
  const FlatParamHandle& h = rt.handle(loc.unit);
  const ShardedTensor& t = v.sharded_tensor();
  check_shape_dtype(k, t.size(), t.dtype(), h.layout().shapes[loc.index], h.orig_dtype(), rank,
                    plan);
  if (!plan.error.empty()) return;
  // The exchange gives every rank holding the key exactly its range, which starts at its
  // intra-param start; it is absent only where the exchange already failed the plan.
  auto got = ranges.find(k);
  if (got == ranges.end()) {
    plan.fail(msg(quote(k), ": no range assembled (", detail::rank(rank), ")"));
    return;
  }
  const ShardParamInfo& s = h.shard_param_infos()[loc.index];
  const int64_t lo = s.in_shard ? s.intra_param_start_idx : 0;
  plan_param(
      rt, loc, [&](int64_t start, int64_t n) { return got->second.narrow(0, start - lo, n); },
      plan);
}

Plan plan_load(const RuntimeView& rt, StateDictType type, const StateDict& sd, bool strict_dtype) {
  Plan plan;
  plan.strict_dtype = strict_dtype;
  writeback_all(rt, plan);
  const KeyMap km = key_map(rt);
  const int rank = rt.world_group().rank();
  // SHARDED: each rank's range of each parameter, where the ranks had to exchange pieces.
  const std::map<std::string, at::Tensor> ranges = type == StateDictType::SHARDED_STATE_DICT
                                                       ? exchange_pieces(rt, km, sd, plan)
                                                       : std::map<std::string, at::Tensor>{};
  std::map<std::string, bool> expected;
  auto expect = [&](const std::string& k) {
    expected[k] = true;
    if (!sd.contains(k)) plan.result.missing_keys.push_back(k);
  };
  std::vector<bool> unit_done(rt.units().size(), false);
  for (const auto& k : km.order) {
    auto m = km.managed.find(k);
    if (m == km.managed.end()) {
      expect(k);
      if (sd.contains(k)) plan_unmanaged(rt, k, km.unmanaged.at(k), sd.at(k), plan, rank);
      continue;
    }
    const ParamLoc loc = m->second;
    if (type == StateDictType::LOCAL_STATE_DICT) {
      if (unit_done[loc.unit]) continue;
      unit_done[loc.unit] = true;
      const std::string fk = flat_key(rt.units()[loc.unit]);
      expect(fk);
      if (sd.contains(fk)) plan_local_unit(rt.handle(loc.unit), fk, sd.at(fk), plan);
      continue;
    }
    expect(k);
    if (!sd.contains(k)) continue;
    const StateValue& v = sd.at(k);
    // A SHARDED dict may hold a parameter whole, as a plain tensor: PyTorch's FSDP runs every
    // strategy as NO_SHARD at world size 1, and its SHARDED dicts are then FULL ones.
    if (type == StateDictType::FULL_STATE_DICT || v.is_tensor()) {
      plan_whole_param(rt, k, loc, v, rank, plan);
    } else {
      plan_sharded_param(rt, k, loc, v, ranges, rank, plan);
    }
  }
  for (const auto& [k, v] : sd) {
    if (!expected.count(k)) plan.result.unexpected_keys.push_back(k);
  }
  return plan;
}

std::string key_list(const std::vector<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) out += msg(out.empty() ? "\"" : ", \"", k, "\"");
  return out;
}

// What a key of the model's state dict must be: shape, dtype and device of the model's own tensor.
struct Target {
  std::vector<int64_t> shape;
  at::ScalarType dtype;
  at::Device device;
};

Target target_of(const RuntimeView& rt, const KeyMap& km, const std::string& k) {
  auto m = km.managed.find(k);
  if (m != km.managed.end()) {
    const FlatParamHandle& h = rt.handle(m->second.unit);
    return Target{h.layout().shapes[m->second.index], h.orig_dtype(), h.flat_param().device()};
  }
  const at::Tensor& t = km.unmanaged.at(k);
  return Target{t.sizes().vec(), rt.original_dtype(t), t.device()};
}

// Rank 0's check of its dict against the model (which every rank shares): the plan's error and
// the keys it will skip.
void check_root_dict(const RuntimeView& rt, const KeyMap& km, const StateDict& sd, bool strict,
                     Plan& plan) {
  for (const auto& k : km.order) {
    if (!sd.contains(k)) {
      plan.result.missing_keys.push_back(k);
      continue;
    }
    const StateValue& v = sd.at(k);
    if (!v.is_tensor()) {
      plan.fail(
          msg(quote(k), " must be a Tensor in a full state dict, it is ", to_string(v.kind())));
      continue;
    }
    const Target want = target_of(rt, km, k);
    check_shape_dtype(k, v.tensor().sizes(), v.tensor().scalar_type(), want.shape, want.dtype, 0,
                      plan);
  }
  for (const auto& [k, v] : sd) {
    if (!km.managed.count(k) && !km.unmanaged.count(k)) plan.result.unexpected_keys.push_back(k);
  }
  if (plan.error.empty() && strict) plan.error = detail::load_keys_error(plan.result);
}

// Rank 0's skipped keys (`root_result`) on every rank. One broadcast.
LoadResult broadcast_skipped_keys(dist::ProcessGroup& pg, const LoadResult& root_result) {
  // The skipped keys, one per line: missing, then a blank line, then unexpected.
  std::string lists;
  if (pg.rank() == 0) {
    for (const auto& k : root_result.missing_keys) lists += k + "\n";
    lists += "\n";
    for (const auto& k : root_result.unexpected_keys) lists += k + "\n";
  }
  lists = pg.broadcast_bytes(lists, 0);
  LoadResult result;
  std::vector<std::string>* into = &result.missing_keys;
  size_t start = 0;
  for (size_t nl; (nl = lists.find('\n', start)) != std::string::npos; start = nl + 1) {
    if (nl == start && into == &result.missing_keys) {
      into = &result.unexpected_keys;
      continue;
    }
    into->push_back(lists.substr(start, nl - start));
  }
  return result;
}

// Broadcasts each of rank 0's values (all but the `missing_keys`) in turn; each rank copies only
// its range of it into its shard. One tensor in flight at a time.
void broadcast_values(const RuntimeView& rt, const KeyMap& km, const StateDict& sd,
                      const std::vector<std::string>& missing_keys) {
  dist::ProcessGroup& pg = rt.world_group();
  const bool root = pg.rank() == 0;
  const std::set<std::string> missing(missing_keys.begin(), missing_keys.end());
  std::set<std::pair<int, size_t>> done;  // a tied parameter arrives once
  int64_t largest = 0;
  for (const auto& k : km.order)
    largest = std::max(largest, c10::multiply_integers(target_of(rt, km, k).shape));
  detail::ScratchBuffers scratch(largest);
  at::NoGradGuard no_grad;
  for (const auto& k : km.order) {
    if (missing.count(k)) continue;
    auto m = km.managed.find(k);
    if (m != km.managed.end() && !done.insert({m->second.unit, m->second.index}).second) continue;
    const auto [shape, dtype, device] = target_of(rt, km, k);
    at::Tensor buf = root ? scratch.as(sd.at(k).tensor().detach(), dtype, device)
                          : scratch.get(shape, dtype, device);
    pg.broadcast(buf, 0);
    if (m == km.managed.end()) {
      km.unmanaged.at(k).detach().copy_(buf);
      continue;
    }
    Plan one;
    plan_param(
        rt, m->second,
        [&](int64_t start, int64_t n) { return buf.reshape({-1}).narrow(0, start, n); }, one);
    for (auto& [dst, src] : one.copies) dst.copy_(src);
  }
}

}  // namespace

LoadResult load_state_dict(FullyShardedDataParallel& model, const StateDict& sd, bool strict,
                           bool strict_dtype) {
  const detail::RuntimeView rt(*model);
  detail::StateDictSettings& cfg = *detail::StateDictSettings::of(*model);
  rt.require_idle("load_state_dict");
  detail::NoShardFallback fallback(rt, cfg);  // SHARDED/LOCAL on NO_SHARD units load as FULL
  Plan plan = plan_load(rt, cfg.type, sd, strict_dtype);
  if (plan.error.empty() && strict) plan.error = detail::load_keys_error(plan.result);
  // Non-strict loads skip keys; every rank must skip the same ones, or ranks would end up with
  // different models. (`strict` is the same on every rank, so all or none take part. A rank that
  // already failed sends a marker and is not compared: its own error is reported below.)
  if (!strict) {
    const std::string failed =
        "\x01"
        "failed";
    const std::string mine = plan.error.empty() ? msg(key_list(plan.result.missing_keys), "|",
                                                      key_list(plan.result.unexpected_keys))
                                                : failed;
    const auto all = rt.world_group().all_gather_bytes(mine);
    for (size_t r = 0; r < all.size() && plan.error.empty(); ++r) {
      if (all[r] != failed && all[r] != mine) {
        plan.error = msg("ranks disagree on the keys to skip: ", rank(rt.world_group().rank()),
                         " misses/ignores ", mine, ", ", rank(r), " ", all[r]);
      }
    }
  }
  // All-or-nothing across ranks: apply only if every rank's plan is sound.
  agree_or_throw(rt.world_group(), plan.error);
  at::NoGradGuard no_grad;
  for (auto& [dst, src] : plan.copies) dst.copy_(src);
  return plan.result;
}

namespace detail {

LoadResult load_state_dict_from_rank0(FullyShardedDataParallel& model, const StateDict& sd,
                                      bool strict) {
  const detail::RuntimeView rt(*model);
  rt.require_idle("load_state_dict (broadcast_from_rank0)");
  dist::ProcessGroup& pg = rt.world_group();
  Plan plan;  // only its error and result are used: copies are made as tensors arrive
  writeback_all(rt, plan);
  const KeyMap km = key_map(rt);
  // Rank 0 checks its dict against the model, then tells the others which keys it will send;
  // nothing moves unless every rank agrees.
  if (pg.rank() == 0) check_root_dict(rt, km, sd, strict, plan);
  agree_or_throw(pg, plan.error);
  LoadResult result = broadcast_skipped_keys(pg, plan.result);
  broadcast_values(rt, km, sd, result.missing_keys);
  return result;
}

}  // namespace detail
}  // namespace fsdp
