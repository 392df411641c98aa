// broadcast_state_dict (_state_dict_utils.py's _broadcast_state_dict): one rank's full dict into
// every rank's template, one tensor at a time.
//
// The source first broadcasts a skeleton of its (flattened) dict: keys, value kinds, non-tensor
// values, tensor shapes and dtypes, and 0-d tensors inline (optimizer "step"s would otherwise cost
// one collective each). Every rank checks the skeleton against its template and the ranks
// exchange verdicts before any tensor moves, so a mismatch fails every rank and changes nothing.
#include <cstring>
#include <map>

#include "dist/agreement.h"
#include "fsdp/errors.h"
#include "fsdp/state_dict_utils.h"
#include "state_dict/from_rank0.h"
#include "util/message.h"
#include "util/tensor_utils.h"

namespace fsdp {
namespace {

using detail::msg;
using detail::quote;
using detail::rank;
using detail::shape;

// What the skeleton says of one key.
struct Entry {
  std::string key;
  ObjPath path;                // where the value sits in the nested dict
  StateValue value;            // non-tensor values, and 0-d tensors (CPU)
  bool tensor = false;         // a tensor of rank >= 1, broadcast separately
  std::vector<int64_t> shape;  // of a tensor
  at::ScalarType dtype = at::kFloat;
};

class Writer {
 public:
  template <typename T>
  void pod(const T& x) {
    out_.append(reinterpret_cast<const char*>(&x), sizeof(T));
  }
  void str(const std::string& s) {
    pod<uint64_t>(s.size());
    out_ += s;
  }
  std::string& bytes() { return out_; }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(const std::string& s) : s_(s) {}
  template <typename T>
  T pod() {
    need(sizeof(T));
    T x;
    std::memcpy(&x, s_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return x;
  }
  std::string str() {
    const auto n = pod<uint64_t>();
    need(n);
    std::string out = s_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  bool done() const { return pos_ == s_.size(); }

 private:
  void need(uint64_t n) const {
    if (n > s_.size() - pos_) throw InternalError("broadcast_state_dict: truncated skeleton");
  }
  const std::string& s_;
  size_t pos_ = 0;
};

// The source's skeleton: "1" + entries, or "0" + the reason it cannot broadcast.
std::string encode(const StateDict& flat, const FlattenMapping& mapping) {
  Writer w;
  w.pod<uint8_t>(1);
  for (const auto& [key, v] : flat) {
    w.str(key);
    const ObjPath& path = mapping.at(key);
    w.pod<uint64_t>(path.size());
    for (const auto& e : path) {
      const bool is_key = std::holds_alternative<std::string>(e);
      w.pod<uint8_t>(is_key ? 0 : 1);
      if (is_key) {
        w.str(std::get<std::string>(e));
      } else {
        w.pod<int64_t>(std::get<int64_t>(e));
      }
    }
    w.pod<uint8_t>(static_cast<uint8_t>(v.kind()));
    switch (v.kind()) {
      case StateValue::Kind::NONE:
        break;
      case StateValue::Kind::TENSOR: {
        const at::Tensor& t = v.tensor();
        w.pod<int8_t>(static_cast<int8_t>(t.scalar_type()));
        w.pod<uint64_t>(t.dim());
        for (int64_t s : t.sizes()) w.pod<int64_t>(s);
        if (t.dim() == 0) {
          const at::Tensor c = t.detach().to(at::kCPU).contiguous();
          w.str(std::string(static_cast<const char*>(c.data_ptr()), c.element_size()));
        }
        break;
      }
      case StateValue::Kind::INT:
        w.pod<int64_t>(v.to_int());
        break;
      case StateValue::Kind::DOUBLE:
        w.pod<double>(v.to_double());
        break;
      case StateValue::Kind::BOOL:
        w.pod<uint8_t>(v.to_bool() ? 1 : 0);
        break;
      case StateValue::Kind::STRING:
        w.str(v.string());
        break;
      default: {  // ShardedTensor (a flattened dict has no List or Dict left)
        Writer fail;
        fail.pod<uint8_t>(0);
        fail.str(
            msg(quote(key), " is a ", to_string(v.kind()),
                " on the source rank; broadcast_state_dict sends full tensors (gather first)"));
        return fail.bytes();
      }
    }
  }
  return w.bytes();
}

std::vector<Entry> decode(const std::string& bytes, int src) {
  Reader r(bytes);
  if (r.pod<uint8_t>() == 0) {
    throw ValueError(msg("broadcast_state_dict (source ", rank(src), "): ", r.str()));
  }
  std::vector<Entry> out;
  while (!r.done()) {
    Entry e;
    e.key = r.str();
    const auto depth = r.pod<uint64_t>();
    for (uint64_t i = 0; i < depth; ++i) {
      if (r.pod<uint8_t>() == 0) {
        e.path.emplace_back(r.str());
      } else {
        e.path.emplace_back(r.pod<int64_t>());
      }
    }
    const auto kind = static_cast<StateValue::Kind>(r.pod<uint8_t>());
    switch (kind) {
      case StateValue::Kind::NONE:
        break;
      case StateValue::Kind::TENSOR: {
        e.dtype = static_cast<at::ScalarType>(r.pod<int8_t>());
        const auto dim = r.pod<uint64_t>();
        for (uint64_t d = 0; d < dim; ++d) e.shape.push_back(r.pod<int64_t>());
        if (dim == 0) {
          const std::string raw = r.str();
          at::Tensor t = at::empty({}, at::TensorOptions().dtype(e.dtype));
          if (raw.size() != static_cast<size_t>(t.element_size())) {
            throw InternalError(msg("broadcast_state_dict: bad 0-d tensor for ", quote(e.key)));
          }
          std::memcpy(t.data_ptr(), raw.data(), raw.size());
          e.value = t;
        } else {
          e.tensor = true;
        }
        break;
      }
      case StateValue::Kind::INT:
        e.value = r.pod<int64_t>();
        break;
      case StateValue::Kind::DOUBLE:
        e.value = r.pod<double>();
        break;
      case StateValue::Kind::BOOL:
        e.value = r.pod<uint8_t>() != 0;
        break;
      case StateValue::Kind::STRING:
        e.value = r.str();
        break;
      default:
        throw InternalError("broadcast_state_dict: bad kind in skeleton");
    }
    out.push_back(std::move(e));
  }
  return out;
}

std::vector<int64_t> shape_of(const StateValue& v) {
  return v.is_tensor() ? v.tensor().sizes().vec() : v.sharded_tensor().size();
}

// This rank's problem with the skeleton, or "".
std::string check(const std::vector<Entry>& entries, const StateDict& local, bool strict,
                  LoadResult& result) {
  std::map<std::string, const Entry*> by_key;
  for (const auto& e : entries) by_key[e.key] = &e;
  std::string error;
  for (const auto& e : entries) {
    if (!local.contains(e.key)) {
      result.unexpected_keys.push_back(e.key);
      continue;
    }
    const StateValue& v = local.at(e.key);
    const bool local_tensor = v.is_tensor() || v.is_sharded_tensor();
    const bool src_tensor = e.tensor || e.value.is_tensor();
    if (local_tensor != src_tensor) {
      if (error.empty())
        error = msg(quote(e.key), " is a ", src_tensor ? "Tensor" : to_string(e.value.kind()),
                    " on the source rank but a ", to_string(v.kind()), " here");
    } else if (src_tensor && shape_of(v) != (e.tensor ? e.shape : std::vector<int64_t>{})) {
      if (error.empty())
        error = msg(quote(e.key), " has shape ", shape(e.tensor ? e.shape : std::vector<int64_t>{}),
                    " on the source rank but ", shape(shape_of(v)), " here");
    }
  }
  for (const auto& [k, v] : local) {
    if (!by_key.count(k)) result.missing_keys.push_back(k);
  }
  auto first = [](const std::vector<std::string>& keys) {
    return msg(quote(keys.front()),
               keys.size() > 1 ? msg(" and ", keys.size() - 1, " more key(s)") : "");
  };
  if (error.empty() && strict && !result.missing_keys.empty()) {
    error = msg("strict: the source rank's dict lacks ", first(result.missing_keys));
  } else if (error.empty() && strict && !result.unexpected_keys.empty()) {
    error = msg("strict: the template has no ", first(result.unexpected_keys));
  }
  return error;
}

// Copies `full` (or its boxes) into the local value, which keeps its own storage.
void fill(const at::Tensor& full, const StateValue& v) {
  at::NoGradGuard no_grad;
  if (v.is_tensor()) {
    v.tensor().copy_(full);
    return;
  }
  for (const auto& s : v.sharded_tensor().local_shards())
    s.tensor.copy_(box_view(full, s.metadata));
}

// The value at `path` inside `sd` (which has it: the path came from flattening `sd`).
StateValue& element(StateDict& sd, const ObjPath& path) {
  StateValue* v = &sd.at(std::get<std::string>(path.front()));
  for (size_t i = 1; i < path.size(); ++i) {
    if (std::holds_alternative<std::string>(path[i])) {
      v = &v->dict().at(std::get<std::string>(path[i]));
    } else {
      v = &v->list().at(static_cast<size_t>(std::get<int64_t>(path[i])));
    }
  }
  return *v;
}

at::Device device_of(const StateDict& flat) {
  for (const auto& [k, v] : flat) {
    if (v.is_tensor() && v.tensor().dim() > 0) return v.tensor().device();
    if (v.is_sharded_tensor() && !v.sharded_tensor().local_shards().empty())
      return v.sharded_tensor().local_shards().front().tensor.device();
  }
  return at::kCPU;
}

// Rank `src`'s skeleton of `sd`, on every rank (one broadcast).
std::vector<Entry> broadcast_skeleton(const StateDict& sd, dist::ProcessGroup& pg, int src) {
  if (src < 0 || src >= pg.size()) {
    throw ValueError(
        msg("broadcast_state_dict: source ", rank(src), " is not in the group of ", pg.size()));
  }
  std::string skeleton;
  if (pg.rank() == src) {
    try {
      const auto [flat, mapping] = flatten_state_dict(sd);
      skeleton = encode(flat, mapping);
    } catch (const ValueError& e) {  // e.g. a duplicated flatten key: still tell the others
      Writer fail;
      fail.pod<uint8_t>(0);
      fail.str(e.what());
      skeleton = fail.bytes();
    }
  }
  return decode(pg.broadcast_bytes(skeleton, src), src);
}

}  // namespace

StateDict detail::broadcast_structure(const StateDict& sd, dist::ProcessGroup& pg, int src) {
  const std::vector<Entry> entries = broadcast_skeleton(sd, pg, src);
  if (pg.rank() == src) return sd;
  StateDict flat;
  FlattenMapping mapping;
  for (const auto& e : entries) {
    flat.insert_or_assign(e.key,
                          e.tensor ? StateValue(ShardedTensor(e.shape, e.dtype, {})) : e.value);
    mapping[e.key] = e.path;
  }
  return unflatten_state_dict(flat, mapping);
}

StateDict detail::broadcast_whole_state_dict(const StateDict& sd, dist::ProcessGroup& pg, int src) {
  const std::vector<Entry> entries = broadcast_skeleton(sd, pg, src);
  const bool is_src = pg.rank() == src;
  const StateDict flat_src = is_src ? flatten_state_dict(sd).first : StateDict();
  StateDict flat;
  FlattenMapping mapping;
  for (const auto& e : entries) {
    mapping[e.key] = e.path;
    if (!e.tensor) {
      flat.insert_or_assign(e.key, e.value);
      continue;
    }
    at::Tensor buf = is_src ? flat_src.at(e.key).tensor().detach().to(at::kCPU).contiguous()
                            : at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
    pg.broadcast(buf, src);
    if (!is_src) flat.insert_or_assign(e.key, buf);
  }
  return is_src ? sd : unflatten_state_dict(flat, mapping);
}

LoadResult broadcast_state_dict(const StateDict& full, StateDict& local, dist::ProcessGroup& pg,
                                int src, bool strict) {
  const bool is_src = pg.rank() == src;
  const std::vector<Entry> entries = broadcast_skeleton(full, pg, src);

  const auto [flat_local, mapping] = flatten_state_dict(local);
  LoadResult result;
  const std::string mine = check(entries, flat_local, strict, result);
  const dist::Verdicts verdicts = dist::exchange_verdicts(
      &pg, mine.empty() ? dist::Verdict() : dist::Verdict::failed(ValueError(mine)));
  if (!mine.empty()) throw ValueError(msg("broadcast_state_dict (", rank(pg.rank()), "): ", mine));
  verdicts.throw_first([](int r, const std::string& e) {
    return msg("broadcast_state_dict aborted, nothing was copied: ", rank(r), ": ", e);
  });

  const at::Device device = device_of(flat_local);
  const StateDict flat_full = is_src ? flatten_state_dict(full).first : StateDict();
  for (const auto& e : entries) {
    const bool here = flat_local.contains(e.key);
    if (!e.tensor) {
      if (!here) continue;
      // In place, so that empty dicts and lists (which flattening drops) survive.
      StateValue& v = element(local, mapping.at(e.key));
      if (e.value.is_tensor()) {
        fill(e.value.tensor(), v);
      } else {
        v = e.value;
      }
      continue;
    }
    // One tensor in flight at a time: peak extra memory is the largest tensor.
    at::Tensor buf;
    if (is_src) {
      buf = flat_full.at(e.key).tensor().detach().to(device).contiguous();
    } else {
      buf = at::empty(e.shape, at::TensorOptions().dtype(e.dtype).device(device));
    }
    pg.broadcast(buf, src);
    if (here) fill(buf, flat_local.at(e.key));  // shares the pieces' storage with `local`
  }
  return result;
}

}  // namespace fsdp
