// Test helpers: any StateDict (nested dicts and lists, tensors, ShardedTensors with their global
// metadata, numbers, strings, None) to a file and back exactly, key order included; and the
// union of several ranks' dicts, as a loader that reads every saved rank's pieces sees them.
// For carrying dicts between the processes of different world sizes in tests; the library's own
// format is the DCP checkpoint.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "fsdp/state_value.h"

namespace fsdp {
namespace testing {
namespace sdio {

// A ShardedTensor travels as a dict carrying this key; a dict's key order as the list under
// kOrder (c10's Dict keeps insertion order, but pickling does not promise it).
inline const char* const kSharded = "__sharded_tensor__";
inline const char* const kOrder = "__key_order__";

inline c10::IValue ints(const std::vector<int64_t>& v) { return c10::IValue(v); }
inline std::vector<int64_t> ints(const c10::IValue& v) { return v.toIntVector(); }

inline c10::IValue box(const ShardMetadata& m) {
  c10::impl::GenericList l(c10::AnyType::get());
  l.push_back(ints(m.offsets));
  l.push_back(ints(m.sizes));
  l.push_back(static_cast<int64_t>(m.placement_rank));
  return l;
}
inline ShardMetadata unbox(const c10::IValue& v) {
  const auto l = v.toList();
  return ShardMetadata{ints(l.get(0)), ints(l.get(1)), static_cast<int>(l.get(2).toInt())};
}

inline c10::IValue to_ivalue(const StateValue& v);

inline c10::IValue to_ivalue(const StateDict& d) {
  c10::impl::GenericDict out(c10::StringType::get(), c10::AnyType::get());
  std::vector<std::string> order;
  for (const auto& [k, x] : d) {
    out.insert(k, to_ivalue(x));
    order.push_back(k);
  }
  out.insert(kOrder, c10::IValue(order));
  return out;
}

inline c10::IValue to_ivalue(const StateValue& v) {
  switch (v.kind()) {
    case StateValue::Kind::NONE:
      return c10::IValue();
    case StateValue::Kind::TENSOR:
      return v.tensor().detach().cpu().contiguous();
    case StateValue::Kind::INT:
      return v.to_int();
    case StateValue::Kind::DOUBLE:
      return v.to_double();
    case StateValue::Kind::BOOL:
      return v.to_bool();
    case StateValue::Kind::STRING:
      return v.string();
    case StateValue::Kind::LIST: {
      c10::impl::GenericList l(c10::AnyType::get());
      for (const auto& x : v.list()) l.push_back(to_ivalue(x));
      return l;
    }
    case StateValue::Kind::DICT:
      return to_ivalue(v.dict());
    case StateValue::Kind::SHARDED_TENSOR: {
      const ShardedTensor& t = v.sharded_tensor();
      c10::impl::GenericList pieces(c10::AnyType::get()), global(c10::AnyType::get());
      for (const auto& s : t.local_shards()) {
        c10::impl::GenericList p(c10::AnyType::get());
        p.push_back(box(s.metadata));
        p.push_back(s.tensor.detach().cpu().contiguous());
        pieces.push_back(p);
      }
      for (const auto& m : t.global_metadata()) global.push_back(box(m));
      c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
      d.insert(kSharded, ints(t.size()));
      d.insert("dtype", static_cast<int64_t>(t.dtype()));
      d.insert("pieces", pieces);
      d.insert("global", global);
      return d;
    }
  }
  throw std::runtime_error("sdio: unknown kind");
}

inline StateValue from_ivalue(const c10::IValue& v);

inline StateDict dict_from_ivalue(const c10::IValue& v) {
  const auto d = v.toGenericDict();
  StateDict out;
  const auto order = d.at(kOrder).toList();
  for (size_t i = 0; i < order.size(); ++i) {
    const std::string k = order.get(i).toStringRef();
    out.insert_or_assign(k, from_ivalue(d.at(k)));
  }
  return out;
}

inline StateValue from_ivalue(const c10::IValue& v) {
  if (v.isNone()) return StateValue();
  if (v.isTensor()) return StateValue(v.toTensor());
  if (v.isInt()) return StateValue(v.toInt());
  if (v.isDouble()) return StateValue(v.toDouble());
  if (v.isBool()) return StateValue(v.toBool());
  if (v.isString()) return StateValue(v.toStringRef());
  if (v.isList()) {
    StateList l;
    const auto list = v.toList();
    for (size_t i = 0; i < list.size(); ++i) l.push_back(from_ivalue(list.get(i)));
    return StateValue(std::move(l));
  }
  const auto d = v.toGenericDict();
  if (!d.contains(kSharded)) return StateValue(dict_from_ivalue(v));
  std::vector<Shard> pieces;
  const auto ps = d.at("pieces").toList();
  for (size_t i = 0; i < ps.size(); ++i) {
    const auto l = ps.get(i).toList();
    pieces.push_back(Shard{l.get(1).toTensor(), unbox(l.get(0))});
  }
  std::vector<ShardMetadata> global;
  const auto gs = d.at("global").toList();
  for (size_t i = 0; i < gs.size(); ++i) global.push_back(unbox(gs.get(i)));
  return StateValue(ShardedTensor(ints(d.at(kSharded)),
                                  static_cast<at::ScalarType>(d.at("dtype").toInt()),
                                  std::move(pieces), std::move(global)));
}

inline void save(const StateDict& sd, const std::string& path) {
  const std::vector<char> bytes = torch::jit::pickle_save(to_ivalue(sd));
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("sdio: cannot write " + path);
}

inline StateDict load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("sdio: cannot read " + path);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                std::istreambuf_iterator<char>());
  return dict_from_ivalue(torch::jit::pickle_load(bytes));
}

/// The union of several ranks' dicts: a ShardedTensor holds every rank's local pieces (each
/// distinct box once); anything else is taken from the first dict that has the key. Keys in
/// first-seen order.
inline StateValue merge(const std::vector<const StateValue*>& vs) {
  const StateValue& first = *vs.front();
  if (first.is_dict()) {
    StateDict out;
    std::vector<std::string> keys;
    for (const StateValue* v : vs) {
      if (!v->is_dict()) continue;
      for (const auto& [k, x] : v->dict())
        if (!out.contains(k)) out.insert_or_assign(k, StateValue());
    }
    for (auto& [k, x] : out) {
      std::vector<const StateValue*> parts;
      for (const StateValue* v : vs)
        if (v->is_dict() && v->dict().contains(k)) parts.push_back(&v->dict().at(k));
      x = merge(parts);
    }
    return StateValue(std::move(out));
  }
  if (!first.is_sharded_tensor()) return first;
  std::vector<Shard> pieces;
  for (const StateValue* v : vs) {
    if (!v->is_sharded_tensor()) continue;
    for (const auto& s : v->sharded_tensor().local_shards()) {
      bool seen = false;
      for (const auto& p : pieces)
        seen |= p.metadata.offsets == s.metadata.offsets && p.metadata.sizes == s.metadata.sizes;
      if (!seen) pieces.push_back(s);
    }
  }
  const ShardedTensor& t = first.sharded_tensor();
  return StateValue(ShardedTensor(t.size(), t.dtype(), std::move(pieces), t.global_metadata()));
}

inline StateDict merge(const std::vector<StateDict>& dicts) {
  if (dicts.empty()) return StateDict();
  std::vector<StateValue> holders;
  for (const auto& d : dicts) holders.emplace_back(d);
  std::vector<const StateValue*> ptrs;
  for (const auto& h : holders) ptrs.push_back(&h);
  return merge(ptrs).dict();
}

}  // namespace sdio
}  // namespace testing
}  // namespace fsdp
