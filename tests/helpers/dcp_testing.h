// Shared by the DCP checkpoint tests: a sample state dict with every kind of value (and a variant
// with a row-sharded tensor whose values tell saves apart), blank templates of it, DCP's flat keys,
// and the text tests/dcp/dcp_python.py "values" prints, so that C++ and Python states compare as
// strings.
#pragma once

#include <algorithm>
#include <charconv>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/state_value.h"

namespace fsdp {
namespace testing {

/// The whole file (empty if it cannot be read).
inline std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

/// The float32 tensor `key` (a DCP key such as "model.w") of the checkpoint in `dir`, read whole
/// into a template of `shape` filled with -1.
inline at::Tensor load_tensor(const std::string& dir, const std::string& key, at::IntArrayRef shape,
                              const checkpoint::LoadOptions& options = {}) {
  StateDict t;
  t.insert_or_assign(key, at::full(shape, -1.0));
  checkpoint::load(t, dir, options);
  return t.at(key).tensor();
}

/// Replaces the file's contents.
inline void write_bytes(const std::string& path, const std::string& b) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << b;
}

// Python's repr of a float (shortest round trip, "1.0" rather than "1").
inline std::string py_float(double x) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, x);
  std::string s(buf, r.ptr);
  if (s.find_first_of(".eninf") == std::string::npos) s += ".0";
  return s;
}

inline std::string py_repr(const StateValue& v) {
  switch (v.kind()) {
    case StateValue::Kind::NONE:
      return "None";
    case StateValue::Kind::BOOL:
      return v.to_bool() ? "True" : "False";
    case StateValue::Kind::INT:
      return std::to_string(v.to_int());
    case StateValue::Kind::DOUBLE:
      return py_float(v.to_double());
    case StateValue::Kind::STRING:
      return "'" + v.string() + "'";
    case StateValue::Kind::LIST: {
      std::string out = "[";
      for (size_t i = 0; i < v.list().size(); ++i) out += (i ? ", " : "") + py_repr(v.list()[i]);
      return out + "]";
    }
    default:
      return "?";
  }
}

// What tests/dcp/dcp_python.py "values" prints, for a flat dict of DCP keys.
inline std::string values_text(const StateDict& flat) {
  std::vector<std::string> lines;
  for (const auto& [k, v] : flat) {
    if (v.is_tensor()) {
      const at::Tensor t = v.tensor().to(at::kDouble).reshape({-1});
      std::string vals;
      for (int64_t i = 0; i < t.numel(); ++i)
        vals += (i ? "," : "") + py_float(t[i].item<double>());
      std::string dtype = c10::toString(v.tensor().scalar_type());
      const std::map<std::string, std::string> names{
          {"Float", "float32"}, {"BFloat16", "bfloat16"}, {"Long", "int64"}, {"Double", "float64"}};
      lines.push_back(k + " " + names.at(dtype) + " " + vals);
    } else {
      lines.push_back(k + " value " + py_repr(v));
    }
  }
  std::sort(lines.begin(), lines.end());
  std::string out;
  for (const auto& l : lines) out += l + "\n";
  return out;
}

inline StateDict sample() {
  StateDict model;
  model.insert_or_assign("w", at::arange(12, at::kFloat).reshape({3, 4}));
  model.insert_or_assign("b", at::tensor({0.5, -1.0, 2.0}).to(at::kBFloat16));
  model.insert_or_assign("i", at::tensor({1, 2}, at::kLong));
  model.insert_or_assign("s", at::scalar_tensor(2.5));
  model.insert_or_assign("e", at::zeros({0, 3}));
  StateDict st;
  st.insert_or_assign("step", at::scalar_tensor(3.0));
  st.insert_or_assign("exp_avg", at::full({3, 4}, 0.25));
  StateDict state;
  state.insert_or_assign("w", st);
  StateDict group;
  group.insert_or_assign("lr", 0.01);
  group.insert_or_assign("betas", StateList{StateValue(0.9), StateValue(0.999)});
  group.insert_or_assign("params", StateList{StateValue("w")});
  group.insert_or_assign("amsgrad", false);
  StateDict optim;
  optim.insert_or_assign("state", state);
  optim.insert_or_assign("param_groups", StateList{StateValue(group)});
  StateDict sd;
  sd.insert_or_assign("model", model);
  sd.insert_or_assign("optim", optim);
  sd.insert_or_assign("epoch", int64_t{7});
  sd.insert_or_assign("name", "run");
  return sd;
}

// A state dict whose "model.w" (6 x 5) is split by rows over `world` ranks, plus the sample's
// plain tensors and values; `scale` tells saves apart.
inline StateDict sharded_sample(int rank, int world, double scale) {
  StateDict sd = sample();
  const at::Tensor full = at::arange(30, at::kFloat).reshape({6, 5}) * scale;
  const int64_t rows = 6 / world + (rank < 6 % world ? 1 : 0);
  int64_t start = 0;
  for (int r = 0; r < rank; ++r) start += 6 / world + (r < 6 % world ? 1 : 0);
  std::vector<Shard> shards;
  if (rows > 0)
    shards.push_back(
        {full.narrow(0, start, rows).clone(), ShardMetadata{{start, 0}, {rows, 5}, rank}});
  sd.at("model").dict().insert_or_assign("sharded",
                                         ShardedTensor({6, 5}, at::kFloat, std::move(shards)));
  sd.at("model").dict().at("w").tensor().mul_(scale);
  return sd;
}

// The full value of "model.sharded" saved with `scale`, read back from `dir` into one tensor.
inline at::Tensor load_full_sharded(const std::string& dir) {
  return load_tensor(dir, "model.sharded", {6, 5});
}

// Whether this rank's part of `got` (a load into sharded_sample's structure at `world` ranks)
// is what sharded_sample(rank, world, scale) holds: its "model.sharded" pieces and "model.w".
inline bool holds_sample(const StateDict& got, int rank, int world, double scale) {
  const StateDict want = sharded_sample(rank, world, scale);
  const auto& a = got.at("model").dict().at("sharded").sharded_tensor().local_shards();
  const auto& b = want.at("model").dict().at("sharded").sharded_tensor().local_shards();
  bool same = a.size() == b.size() && at::equal(got.at("model").dict().at("w").tensor(),
                                                want.at("model").dict().at("w").tensor());
  for (size_t i = 0; same && i < a.size(); ++i) same = at::equal(a[i].tensor, b[i].tensor);
  return same;
}

inline double saved_scale(const std::string& dir) {
  const at::Tensor t = load_full_sharded(dir);
  return t[1][0].item<double>() / 5.0;
}

// A template of `sd`'s structure: tensors of the same shape filled with -1, values replaced.
inline StateValue blank(const StateValue& v) {
  if (v.is_tensor()) return at::full(v.tensor().sizes(), -1, v.tensor().options());
  if (v.is_dict()) {
    StateDict d;
    for (const auto& [k, x] : v.dict()) d.insert_or_assign(k, blank(x));
    return d;
  }
  if (v.is_list()) {
    StateList l;
    for (const auto& x : v.list()) l.push_back(blank(x));
    return l;
  }
  return StateValue();
}

inline StateDict flat_of(const StateDict& sd) {
  // DCP keys for the sample: its lists hold no dicts below param_groups' entries.
  StateDict out;
  std::function<void(const StateValue&, const std::string&)> go = [&](const StateValue& v,
                                                                      const std::string& k) {
    if (v.is_dict()) {
      for (const auto& [kk, x] : v.dict()) go(x, k.empty() ? kk : k + "." + kk);
    } else if (v.is_list() && !v.list().empty() && v.list()[0].is_dict()) {
      for (size_t i = 0; i < v.list().size(); ++i) go(v.list()[i], k + "." + std::to_string(i));
    } else {
      out.insert_or_assign(k, v);
    }
  };
  go(StateValue(sd), "");
  return out;
}

}  // namespace testing
}  // namespace fsdp
