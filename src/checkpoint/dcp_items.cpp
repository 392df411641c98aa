// DCP items of a StateDict (dcp_items.h): key flattening and torch.save archive payloads.
// Tensors go through torch::pickle_save / pickle_load; other values are our own protocol-2 pickle
// in LibTorch's zip container, read back through the restricted reader.
#include "checkpoint/dcp_items.h"

#include <caffe2/serialize/inline_container.h>
#include <torch/serialize.h>

#include <sstream>

#include "checkpoint/pickle.h"
#include "fsdp/errors.h"

namespace fsdp {
namespace checkpoint {
namespace items {
namespace {

using pickle::Node;
using pickle::NodePtr;

// DCP's rule (_traverse_state_dict, 2.4+): a list is descended into if it holds a dict, a tensor
// or a list that is itself descended into; otherwise it is one value (a list of strings, betas).
bool descend(const StateValue& list) {
  for (const auto& x : list.list()) {
    if (x.is_dict() || x.is_tensor() || x.is_sharded_tensor()) return true;
    if (x.is_list() && descend(x)) return true;
  }
  return false;
}

// DCP's traversal: dicts always, lists where `descend` says so.
void flatten(StateValue& v, const std::string& key, std::vector<dcp::PathElement>& path,
             std::vector<FlatItem>& out) {
  if (v.is_dict()) {
    for (auto& [k, x] : v.dict()) {
      path.emplace_back(k);
      flatten(x, key.empty() ? k : key + "." + k, path, out);
      path.pop_back();
    }
  } else if (v.is_list() && descend(v)) {
    for (size_t i = 0; i < v.list().size(); ++i) {
      path.emplace_back(static_cast<int64_t>(i));
      flatten(v.list()[i], key + "." + std::to_string(i), path, out);
      path.pop_back();
    }
  } else {
    out.push_back(FlatItem{key, path, &v});
  }
}

}  // namespace

std::vector<FlatItem> flatten(StateDict& sd) {
  std::vector<FlatItem> out;
  std::vector<dcp::PathElement> path;
  for (auto& [k, v] : sd) {
    path.emplace_back(k);
    flatten(v, k, path, out);
    path.pop_back();
  }
  return out;
}

// ---- item payloads ----

std::vector<char> tensor_payload(const at::Tensor& t) {
  at::Tensor c = t.detach().to(at::kCPU).contiguous();
  // A view would drag its whole storage into the archive (DCP clones such tensors too).
  if (c.storage_offset() != 0 ||
      c.storage().nbytes() != static_cast<size_t>(c.numel()) * c.element_size()) {
    c = c.clone();
  }
  return torch::pickle_save(c);
}

namespace {

NodePtr to_node(const StateValue& v, const std::string& key) {
  switch (v.kind()) {
    case StateValue::Kind::None:
      return Node::none();
    case StateValue::Kind::Bool:
      return Node::boolean(v.to_bool());
    case StateValue::Kind::Int:
      return Node::integer(v.to_int());
    case StateValue::Kind::Double:
      return Node::real(v.to_double());
    case StateValue::Kind::String:
      return Node::str(v.string());
    case StateValue::Kind::List: {
      std::vector<NodePtr> items;
      for (const auto& x : v.list()) items.push_back(to_node(x, key));
      return Node::list(std::move(items));
    }
    case StateValue::Kind::Dict: {
      std::vector<std::pair<NodePtr, NodePtr>> entries;
      for (const auto& [k, x] : v.dict()) entries.emplace_back(Node::str(k), to_node(x, key));
      return Node::dict(std::move(entries));
    }
    default:
      throw ValueError("checkpoint save: '" + key + "' holds a " + to_string(v.kind()) +
                       " inside a value DCP stores as bytes");
  }
}

}  // namespace

std::string value_payload(const StateValue& v, const std::string& key) {
  const std::string pkl = pickle::write(to_node(v, key));
  std::string out;
  {
    caffe2::serialize::PyTorchStreamWriter w([&](const void* data, size_t n) {
      out.append(static_cast<const char*>(data), n);
      return n;
    });
    w.writeRecord("data.pkl", pkl.data(), pkl.size());
    w.writeEndOfFile();
  }
  return out;
}

namespace {

// A pickle's memo can make a list contain itself, and nesting costs stack: both end here.
constexpr int kMaxValueDepth = 64;

StateValue from_node(const NodePtr& n, const std::string& key, int depth = 0) {
  if (depth > kMaxValueDepth)
    throw ValueError("checkpoint load: a value in " + key + " is nested deeper than " +
                     std::to_string(kMaxValueDepth) + " levels (or contains itself)");
  switch (n->kind) {
    case Node::Kind::None:
      return StateValue();
    case Node::Kind::Bool:
      return StateValue(n->b);
    case Node::Kind::Int:
      return StateValue(n->i);
    case Node::Kind::Float:
      return StateValue(n->f);
    case Node::Kind::Str:
      return StateValue(n->s);
    case Node::Kind::Tuple:
    case Node::Kind::List: {
      StateList l;
      for (const auto& x : n->items) l.push_back(from_node(x, key, depth + 1));
      return StateValue(std::move(l));
    }
    case Node::Kind::Dict: {
      StateDict d;
      for (const auto& [k, x] : n->entries) {
        if (!k->is(Node::Kind::Str))
          throw ValueError("checkpoint load: '" + key + "' holds a dict with a non-str key");
        d.insert_or_assign(k->s, from_node(x, key, depth + 1));
      }
      return StateValue(std::move(d));
    }
    default:
      throw ValueError("checkpoint load: '" + key + "' holds a Python " + to_string(n->kind) +
                       ", which a StateDict cannot hold");
  }
}

}  // namespace

std::string dims_text(const std::vector<int64_t>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}

at::Tensor decode_tensor(const std::vector<char>& raw, const std::string& where) {
  try {
    const c10::IValue v = torch::pickle_load(raw);
    if (!v.isTensor()) throw ValueError("it holds a " + v.tagKind() + ", not a tensor");
    return v.toTensor();
  } catch (const std::exception& e) {  // LibTorch's errors and ours alike
    throw ValueError(where + " is not a readable tensor: " + e.what());
  }
}

StateValue decode_value(const std::vector<char>& raw, const std::string& where) {
  std::string pkl;
  try {
    std::istringstream in(std::string(raw.begin(), raw.end()));
    caffe2::serialize::PyTorchStreamReader reader(&in);
    auto [data, size] = reader.getRecord("data.pkl");
    pkl.assign(static_cast<const char*>(data.get()), size);
  } catch (const std::exception& e) {
    throw ValueError(where + " is not a torch.save archive: " + e.what());
  }
  pickle::NodePtr node;
  try {
    node = pickle::read(pkl, {});
  } catch (const pickle::PickleError& e) {
    throw ValueError(where + ": " + e.what());
  }
  return from_node(node, where);
}

}  // namespace items
}  // namespace checkpoint
}  // namespace fsdp
