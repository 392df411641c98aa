// Utilities on any StateDict (torch/distributed/_state_dict_utils.py).
#include "fsdp/state_dict_utils.h"

#include <functional>

#include "fsdp/errors.h"
#include "state_dict/piece_exchange.h"
#include "util/message.h"

namespace fsdp {
namespace {

using detail::msg;
using detail::quote;
using detail::shape;

std::string path_text(const ObjPath& path) {
  std::string out;
  for (const auto& e : path) {
    if (!out.empty()) out += ".";
    out += std::holds_alternative<std::string>(e) ? std::get<std::string>(e)
                                                  : std::to_string(std::get<int64_t>(e));
  }
  return out;
}

// Calls visit(path, value) for every terminal value, in order.
void traverse(const StateValue& v, ObjPath& path,
              const std::function<void(const ObjPath&, const StateValue&)>& visit) {
  if (v.is_dict()) {
    for (const auto& [k, x] : v.dict()) {
      path.emplace_back(k);
      traverse(x, path, visit);
      path.pop_back();
    }
  } else if (v.is_list()) {
    for (size_t i = 0; i < v.list().size(); ++i) {
      path.emplace_back(static_cast<int64_t>(i));
      traverse(v.list()[i], path, visit);
      path.pop_back();
    }
  } else {
    visit(path, v);
  }
}

void traverse(const StateDict& sd,
              const std::function<void(const ObjPath&, const StateValue&)>& visit) {
  ObjPath path;
  for (const auto& [k, v] : sd) {
    path.emplace_back(k);
    traverse(v, path, visit);
    path.pop_back();
  }
}

// The same structure with every terminal value replaced by fn(value).
StateValue map_values(const StateValue& v, const std::function<StateValue(const StateValue&)>& fn) {
  if (v.is_dict()) {
    StateDict d;
    for (const auto& [k, x] : v.dict()) d.insert_or_assign(k, map_values(x, fn));
    return d;
  }
  if (v.is_list()) {
    StateList l;
    for (const auto& x : v.list()) l.push_back(map_values(x, fn));
    return l;
  }
  return fn(v);
}

StateDict map_values(const StateDict& sd, const std::function<StateValue(const StateValue&)>& fn) {
  return map_values(StateValue(sd), fn).dict();
}

const std::string& key_of(const PathElement& e, const ObjPath& path) {
  if (!std::holds_alternative<std::string>(e)) {
    throw ValueError(msg("unflatten_state_dict: path ", quote(path_text(path)),
                         " indexes a dict with a number"));
  }
  return std::get<std::string>(e);
}

size_t index_of(const PathElement& e, const ObjPath& path) {
  if (!std::holds_alternative<int64_t>(e) || std::get<int64_t>(e) < 0) {
    throw ValueError(
        msg("unflatten_state_dict: path ", quote(path_text(path)), " indexes a list with a key"));
  }
  return static_cast<size_t>(std::get<int64_t>(e));
}

// PyTorch's _set_element: walks `path` from `root`, creating dicts (next element a key) and lists
// (next element an index) as needed; lists grow with None.
void set_element(StateDict& root, const ObjPath& path, const StateValue& value) {
  StateValue* cur = nullptr;  // null: the root dict
  auto step_into = [&](const PathElement& at, StateValue def) {
    if (!cur || cur->is_dict()) {
      StateDict& d = cur ? cur->dict() : root;
      const std::string& k = key_of(at, path);
      if (!d.contains(k)) d.insert_or_assign(k, std::move(def));
      cur = &d.at(k);
    } else {
      StateList& l = cur->list();
      const size_t i = index_of(at, path);
      if (l.size() <= i) l.resize(i + 1);
      if (l[i].is_none()) l[i] = std::move(def);
      cur = &l[i];
    }
  };
  for (size_t i = 1; i < path.size(); ++i) {
    step_into(path[i - 1], std::holds_alternative<std::string>(path[i]) ? StateValue(StateDict())
                                                                        : StateValue(StateList()));
  }
  const PathElement& last = path.back();
  if (!cur || cur->is_dict()) {
    (cur ? cur->dict() : root).insert_or_assign(key_of(last, path), value);
  } else {
    StateList& l = cur->list();
    const size_t i = index_of(last, path);
    if (l.size() <= i) l.resize(i + 1);
    l[i] = value;
  }
}

// Dict keys as sets (PyTorch compares set(keys)): the same entries in another order match.
bool same_keys(const StateDict& a, const StateDict& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [k, v] : a)
    if (!b.contains(k)) return false;
  return true;
}

bool similar(const StateValue& a, const StateValue& b) {
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case StateValue::Kind::DICT: {
      if (!same_keys(a.dict(), b.dict())) return false;
      for (const auto& [k, v] : a.dict())
        if (!similar(v, b.dict().at(k))) return false;
      return true;
    }
    case StateValue::Kind::LIST: {
      if (a.list().size() != b.list().size()) return false;
      for (size_t i = 0; i < a.list().size(); ++i)
        if (!similar(a.list()[i], b.list()[i])) return false;
      return true;
    }
    case StateValue::Kind::TENSOR:
      return a.tensor().sizes() == b.tensor().sizes() &&
             a.tensor().scalar_type() == b.tensor().scalar_type();
    case StateValue::Kind::SHARDED_TENSOR:
      return a.sharded_tensor().size() == b.sharded_tensor().size() &&
             a.sharded_tensor().dtype() == b.sharded_tensor().dtype();
    default:
      return true;
  }
}

// Copies the tensors of `src` into those at the same place in `dst` and returns `src`'s
// structure holding `dst`'s tensors and `src`'s other values (PyTorch's _copy_state_dict: the
// companion keeps its own containers and non-tensor values). Copies nothing unless `apply`.
StateValue copy_into(const StateValue& src, const StateValue& dst, ObjPath& path, bool non_blocking,
                     bool apply) {
  auto fail = [&](const std::string& why) {
    throw ValueError(msg("copy_state_dict: at ", quote(path_text(path)), ": ", why));
  };
  const bool src_tensor = src.is_tensor() || src.is_sharded_tensor();
  if ((src_tensor || src.is_dict() || src.is_list()) && src.kind() != dst.kind()) {
    fail(
        msg("the source holds ", to_string(src.kind()), ", the companion ", to_string(dst.kind())));
  }
  if (src.is_dict()) {
    if (!same_keys(src.dict(), dst.dict())) fail("the dicts have different keys");
    StateDict out;
    for (const auto& [k, v] : src.dict()) {
      path.emplace_back(k);
      out.insert_or_assign(k, copy_into(v, dst.dict().at(k), path, non_blocking, apply));
      path.pop_back();
    }
    return out;
  }
  if (src.is_list()) {
    if (src.list().size() != dst.list().size()) fail("the lists have different lengths");
    StateList out;
    for (size_t i = 0; i < src.list().size(); ++i) {
      path.emplace_back(static_cast<int64_t>(i));
      out.push_back(copy_into(src.list()[i], dst.list()[i], path, non_blocking, apply));
      path.pop_back();
    }
    return out;
  }
  if (!src_tensor) return src;
  std::vector<std::pair<at::Tensor, at::Tensor>> pairs;  // companion <- source
  if (src.is_tensor()) {
    pairs.emplace_back(dst.tensor(), src.tensor());
  } else {
    const auto& s = src.sharded_tensor().local_shards();
    const auto& d = dst.sharded_tensor().local_shards();
    if (s.size() != d.size()) fail("the sharded tensors hold different numbers of pieces");
    for (size_t i = 0; i < s.size(); ++i) {
      if (!(s[i].metadata == d[i].metadata)) fail("the sharded tensors' pieces differ");
      pairs.emplace_back(d[i].tensor, s[i].tensor);
    }
  }
  for (auto& [to, from] : pairs) {
    if (to.sizes() != from.sizes() || to.scalar_type() != from.scalar_type()) {
      fail(msg("shape or dtype differs: ", from.scalar_type(), " of ", from.numel(),
               " elements into ", to.scalar_type(), " of ", to.numel()));
    }
  }
  if (apply) {
    for (auto& [to, from] : pairs) to.copy_(from, non_blocking);  // shares dst's storage
  }
  return dst;
}

at::Tensor cpu_zeros_like(const at::Tensor& t) {
  at::Tensor z = at::zeros(t.sizes(), at::TensorOptions().dtype(t.scalar_type()));
  // Pinned memory makes copies from the GPU asynchronous. Only for tensors that are on one:
  // asking whether CUDA exists would initialise it, and a process that has done so can no longer
  // fork workers that use CUDA.
  return t.is_cuda() ? z.pin_memory() : z;
}

}  // namespace

std::pair<StateDict, FlattenMapping> flatten_state_dict(const StateDict& sd) {
  StateDict flat;
  FlattenMapping mapping;
  traverse(sd, [&](const ObjPath& path, const StateValue& v) {
    const std::string key = path_text(path);
    if (flat.contains(key))
      throw ValueError(msg("flatten_state_dict: duplicated flatten key ", quote(key)));
    flat.insert_or_assign(key, v);
    mapping[key] = path;
  });
  return {std::move(flat), std::move(mapping)};
}

StateDict unflatten_state_dict(const StateDict& flat, const FlattenMapping& mapping) {
  StateDict nested;
  for (const auto& [k, v] : flat) {
    auto it = mapping.find(k);
    if (it == mapping.end() || it->second.empty()) {
      throw ValueError(msg("unflatten_state_dict: no path for key ", quote(k), " in the mapping"));
    }
    set_element(nested, it->second, v);
  }
  return nested;
}

bool check_state_dict_similarity(const StateDict& a, const StateDict& b) {
  return similar(StateValue(a), StateValue(b));
}

StateDict offload_state_dict_to_cpu(const StateDict& sd) {
  return map_values(sd, [](const StateValue& v) -> StateValue {
    if (v.is_tensor()) return v.tensor().to(at::kCPU);
    if (v.is_sharded_tensor()) return v.sharded_tensor().to(at::kCPU);
    return v;
  });
}

StateDict create_cpu_state_dict(const StateDict& sd) {
  return map_values(sd, [](const StateValue& v) -> StateValue {
    if (v.is_tensor()) return cpu_zeros_like(v.tensor());
    if (!v.is_sharded_tensor()) return v;
    const ShardedTensor& t = v.sharded_tensor();
    std::vector<Shard> pieces;
    for (const auto& s : t.local_shards())
      pieces.push_back(Shard{cpu_zeros_like(s.tensor), s.metadata});
    return ShardedTensor(t.size(), t.dtype(), std::move(pieces), t.global_metadata());
  });
}

StateDict copy_state_dict(const StateDict& src, const StateDict& companion, bool non_blocking) {
  // Checked whole first: a mismatch anywhere leaves every companion tensor as it was.
  ObjPath path;
  copy_into(StateValue(src), StateValue(companion), path, non_blocking, /*apply=*/false);
  return copy_into(StateValue(src), StateValue(companion), path, non_blocking, /*apply=*/true)
      .dict();
}

StateDict gather_state_dict(const StateDict& sd, dist::ProcessGroup& pg,
                            const std::vector<int>& ranks_only, bool cpu_offload) {
  const bool target = ranks_only.empty() || std::find(ranks_only.begin(), ranks_only.end(),
                                                      pg.rank()) != ranks_only.end();
  // Every ShardedTensor, in traversal order (the same on every rank: same structure).
  std::vector<detail::RangeRequest> reqs;
  traverse(sd, [&](const ObjPath& path, const StateValue& v) {
    if (!v.is_sharded_tensor()) return;
    const ShardedTensor& t = v.sharded_tensor();
    detail::RangeRequest q;
    q.name = msg(quote(path_text(path)));
    q.shape = t.size();
    q.n = target ? t.numel() : 0;
    q.pieces = &t;
    reqs.push_back(std::move(q));
  });
  std::string error;
  const std::vector<at::Tensor> got = detail::exchange_ranges(pg, reqs, error);
  if (!error.empty()) throw ValueError(msg("gather_state_dict: ", error));
  if (!target) return StateDict();
  size_t next = 0;
  return map_values(sd, [&](const StateValue& v) -> StateValue {
    at::Tensor t;
    if (v.is_sharded_tensor()) {
      // On the device of this rank's pieces (PyTorch's local_shard_device), the CPU if none.
      const auto& pieces = v.sharded_tensor().local_shards();
      const at::Device device = pieces.empty() ? at::Device(at::kCPU) : pieces[0].tensor.device();
      t = got[next++].view(v.sharded_tensor().size()).to(device);
    } else if (v.is_tensor()) {
      t = v.tensor();
    } else {
      return v;
    }
    return cpu_offload ? t.to(at::kCPU) : t;
  });
}

void distribute_state_dict(const StateDict& full, StateDict& local) {
  const auto [flat_full, full_paths] = flatten_state_dict(full);
  const auto [flat_local, local_paths] = flatten_state_dict(local);  // shares local's tensors
  auto shape_of = [](const StateValue& v) {
    return v.is_tensor() ? v.tensor().sizes().vec() : v.sharded_tensor().size();
  };
  // Checked whole first: a shape mismatch anywhere leaves the template as it was.
  for (const auto& [key, v] : flat_full) {
    if (!v.is_tensor() || v.tensor().dim() == 0 || !flat_local.contains(key)) continue;
    const StateValue& dst = flat_local.at(key);
    if ((dst.is_tensor() || dst.is_sharded_tensor()) && shape_of(dst) != v.tensor().sizes().vec()) {
      throw ValueError(msg("distribute_state_dict: ", quote(key), " has shape ",
                           shape(v.tensor().sizes()), " in the full dict, ", shape(shape_of(dst)),
                           " in the local one"));
    }
  }
  at::NoGradGuard no_grad;
  // Copies `src` into the template's tensor or pieces at `key`; false if it holds none there of
  // that shape.
  auto fill = [&](const std::string& key, const at::Tensor& src) {
    if (!flat_local.contains(key)) return false;
    const StateValue& dst = flat_local.at(key);
    if (!(dst.is_tensor() || dst.is_sharded_tensor()) || shape_of(dst) != src.sizes().vec())
      return false;
    if (dst.is_tensor()) {
      at::Tensor t = dst.tensor();  // shares the template's storage
      t.copy_(src);
    } else {
      for (const auto& piece : dst.sharded_tensor().local_shards()) {
        at::Tensor t = piece.tensor;
        t.copy_(box_view(src, piece.metadata));
      }
    }
    return true;
  };
  for (const auto& [key, v] : flat_full) {
    const bool have = flat_local.contains(key);
    const ObjPath& path = have ? local_paths.at(key) : full_paths.at(key);
    if (v.is_tensor() && v.tensor().dim() > 0) {
      // Where the template has no such path: not this rank's (PyTorch skips it).
      if (have && !fill(key, v.tensor())) set_element(local, path, v);
      continue;
    }
    if (v.is_tensor() && fill(key, v.tensor())) continue;
    set_element(local, path, v.is_tensor() ? StateValue(v.tensor().to(at::kCPU)) : v);
  }
}

}  // namespace fsdp
