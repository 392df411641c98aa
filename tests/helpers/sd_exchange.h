// State dicts across the language boundary for the state-dict matrix oracle (issue 37): the C++
// side of tests/oracle/sd_exchange.py, whose header documents the format (<stem>.json for the
// structure, <stem>.safetensors for the tensors, <stem>.error for a dict that raised).
#pragma once

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "fsdp/state_value.h"
#include "safetensors_io.h"

namespace fsdp {
namespace testing {
namespace sdx {

namespace detail {

inline std::string ints(const std::vector<int64_t>& v) { return json::int_list(v); }

inline std::string box(const ShardMetadata& m) {
  return "{\"offsets\":" + ints(m.offsets) + ",\"sizes\":" + ints(m.sizes) +
         ",\"rank\":" + std::to_string(m.placement_rank);
}

class Writer {
 public:
  std::vector<std::pair<std::string, at::Tensor>> tensors;

  std::string node(const StateValue& v) {
    switch (v.kind()) {
      case StateValue::Kind::NONE:
        return "{\"none\":null}";
      case StateValue::Kind::TENSOR:
        return "{\"tensor\":" + json::quote(put(v.tensor())) + "}";
      case StateValue::Kind::INT:
        return "{\"int\":\"" + std::to_string(v.to_int()) + "\"}";
      case StateValue::Kind::DOUBLE: {
        char buf[40];
        std::snprintf(buf, sizeof(buf), "%.17g", v.to_double());
        return "{\"float\":\"" + std::string(buf) + "\"}";
      }
      case StateValue::Kind::BOOL:
        return std::string("{\"bool\":") + (v.to_bool() ? "true" : "false") + "}";
      case StateValue::Kind::STRING:
        return "{\"str\":" + json::quote(v.string()) + "}";
      case StateValue::Kind::LIST: {
        std::string out = "{\"list\":[";
        for (size_t i = 0; i < v.list().size(); ++i) out += (i ? "," : "") + node(v.list()[i]);
        return out + "]}";
      }
      case StateValue::Kind::DICT:
        return dict(v.dict());
      case StateValue::Kind::SHARDED_TENSOR: {
        const ShardedTensor& t = v.sharded_tensor();
        std::string out = "{\"sharded\":{\"size\":" + ints(t.size()) + ",\"dtype\":\"" +
                          safetensors::dtype_name(t.dtype()) + "\",\"pieces\":[";
        for (size_t i = 0; i < t.local_shards().size(); ++i) {
          const Shard& s = t.local_shards()[i];
          out +=
              (i ? "," : "") + box(s.metadata) + ",\"tensor\":" + json::quote(put(s.tensor)) + "}";
        }
        out += "],\"global\":[";
        for (size_t i = 0; i < t.global_metadata().size(); ++i)
          out += (i ? "," : "") + box(t.global_metadata()[i]) + "}";
        return out + "]}}";
      }
    }
    return "";
  }

  std::string dict(const StateDict& d) {
    std::string out = "{\"dict\":[";
    bool first = true;
    for (const auto& [k, v] : d) {
      out += (first ? "[" : ",[") + json::quote(k) + "," + node(v) + "]";
      first = false;
    }
    return out + "]}";
  }

 private:
  std::string put(const at::Tensor& t) {
    tensors.emplace_back("t" + std::to_string(tensors.size()), t.detach().cpu().contiguous());
    return tensors.back().first;
  }
};

inline std::vector<int64_t> int_vector(const json::Value& v, const std::string& what) {
  std::vector<int64_t> out;
  for (const auto& x : v.array) out.push_back(x.as_int(what));
  return out;
}

inline ShardMetadata parse_box(const json::Value& v) {
  return ShardMetadata{int_vector(*v.find("offsets"), "offsets"),
                       int_vector(*v.find("sizes"), "sizes"),
                       static_cast<int>(v.find("rank")->as_int("rank"))};
}

inline StateValue parse(const json::Value& node, const safetensors::File& f) {
  if (node.kind != json::Value::Kind::OBJECT || node.object.size() != 1)
    throw std::runtime_error("sdx: a node is an object of one key");
  const std::string& kind = node.object[0].first;
  const json::Value& v = node.object[0].second;
  if (kind == "dict") {
    StateDict d;
    for (const auto& kv : v.array)
      d.insert_or_assign(kv.array.at(0).as_string("key"), parse(kv.array.at(1), f));
    return StateValue(std::move(d));
  }
  if (kind == "list") {
    StateList l;
    for (const auto& x : v.array) l.push_back(parse(x, f));
    return StateValue(std::move(l));
  }
  if (kind == "tensor") return StateValue(f.at(v.as_string("tensor")).clone());
  if (kind == "int") return StateValue(static_cast<int64_t>(std::stoll(v.as_string("int"))));
  if (kind == "float") return StateValue(std::stod(v.as_string("float")));
  if (kind == "bool") return StateValue(v.boolean);
  if (kind == "str") return StateValue(v.as_string("str"));
  if (kind == "none") return StateValue();
  if (kind == "sharded") {
    std::vector<Shard> pieces;
    for (const auto& p : v.find("pieces")->array)
      pieces.push_back(Shard{f.at(p.find("tensor")->as_string("tensor")).clone(), parse_box(p)});
    std::vector<ShardMetadata> global;
    for (const auto& m : v.find("global")->array) global.push_back(parse_box(m));
    return StateValue(
        ShardedTensor(int_vector(*v.find("size"), "size"),
                      safetensors::dtype_from_name(v.find("dtype")->as_string("dtype"), "sdx"),
                      std::move(pieces), std::move(global)));
  }
  throw std::runtime_error("sdx: unknown node " + kind);
}

}  // namespace detail

/// Writes `sd` as <stem>.json + <stem>.safetensors.
inline void write(const StateDict& sd, const std::string& stem) {
  std::remove((stem + ".error").c_str());
  detail::Writer w;
  const std::string structure = w.dict(sd);
  safetensors::write(stem + ".safetensors", w.tensors);
  std::ofstream out(stem + ".json");
  out << structure;
  if (!out) throw std::runtime_error("sdx: cannot write " + stem + ".json");
}

/// Records that producing the dict raised `message`.
inline void write_error(const std::string& message, const std::string& stem) {
  std::remove((stem + ".json").c_str());
  std::remove((stem + ".safetensors").c_str());
  std::ofstream(stem + ".error") << message;
}

/// True if <stem> holds a dict (not an error, not missing).
inline bool has_dict(const std::string& stem) { return std::ifstream(stem + ".json").good(); }

/// The dict at <stem>.
inline StateDict read(const std::string& stem) {
  std::ifstream in(stem + ".json");
  if (!in) throw std::runtime_error("sdx: no " + stem + ".json");
  std::stringstream ss;
  ss << in.rdbuf();
  const safetensors::File f = safetensors::read(stem + ".safetensors");
  return detail::parse(json::parse(ss.str()), f).dict();
}

}  // namespace sdx
}  // namespace testing
}  // namespace fsdp
