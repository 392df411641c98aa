// Imports of safetensors and `.pt` files (fsdp/checkpoint/export.h). Every size and offset in a
// file is checked against the file before anything is allocated for it; `.pt` pickles go through
// the restricted reader, so nothing in them runs.
#include <caffe2/serialize/inline_container.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include "checkpoint/files.h"
#include "checkpoint/pickle.h"
#include "checkpoint/tensor_formats.h"
#include "fsdp/checkpoint/export.h"
#include "fsdp/errors.h"

namespace fsdp {
namespace checkpoint {
namespace {

constexpr int64_t kMaxHeader = int64_t{100} << 20;  // the reference reader's limit

[[noreturn]] void bad(const std::string& path, const std::string& what) {
  throw ValueError("safetensors " + path + ": " + what);
}

nlohmann::json parse_json(const std::string& text, const std::string& path) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    bad(path, std::string("the header is not valid JSON: ") + e.what());
  }
}

void read_safetensors_file(FileIO& io, const std::string& path, StateDict& out) {
  const int64_t size = io.file_size(path);
  if (size < 0) bad(path, "cannot open it: " + std::string(std::strerror(errno)));
  if (size < 8) bad(path, "shorter than its 8-byte header length");
  const std::string len_bytes = files::read_range(io, path, 0, 8, "safetensors");
  uint64_t n = 0;
  for (int k = 7; k >= 0; --k) n = (n << 8) | static_cast<unsigned char>(len_bytes[k]);
  if (n > static_cast<uint64_t>(kMaxHeader) || static_cast<int64_t>(n) > size - 8)
    bad(path, "header length " + std::to_string(n) + " exceeds the limit or the file (" +
                  std::to_string(size) + " bytes)");
  const nlohmann::json h =
      parse_json(files::read_range(io, path, 8, static_cast<int64_t>(n), "safetensors"), path);
  if (!h.is_object()) bad(path, "the header is not a JSON object");
  const int64_t data_start = 8 + static_cast<int64_t>(n);
  const int64_t data_size = size - data_start;
  struct Spec {
    std::string name;
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    int64_t begin, end;
  };
  std::vector<Spec> specs;
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) bad(path, "__metadata__ is not an object");
      for (const auto& v : *it)
        if (!v.is_string()) bad(path, "__metadata__ values must be strings");
      continue;
    }
    const std::string what = "tensor '" + it.key() + "'";
    const nlohmann::json& t = *it;
    if (!t.is_object() || !t.contains("dtype") || !t.contains("shape") ||
        !t.contains("data_offsets"))
      bad(path, what + " lacks dtype, shape or data_offsets");
    if (!t["dtype"].is_string()) bad(path, what + ": dtype is not a string");
    const std::string dtype = t["dtype"].get<std::string>();
    Spec s{it.key(), at::kFloat, {}, 0, 0};
    bool known = false;
    for (const auto& d : formats::dtype_names())
      if (dtype == d.safetensors) {
        s.dtype = d.dtype;
        known = true;
      }
    if (!known) bad(path, what + ": unsupported dtype '" + dtype + "'");
    if (!t["shape"].is_array() || t["shape"].size() > 64) bad(path, what + ": bad shape");
    for (const auto& d : t["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) bad(path, what + ": bad shape");
      s.shape.push_back(d.get<int64_t>());
    }
    const auto& off = t["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_integer() ||
        !off[1].is_number_integer())
      bad(path, what + ": data_offsets must be two integers");
    s.begin = off[0].get<int64_t>();
    s.end = off[1].get<int64_t>();
    const int64_t nbytes =
        formats::checked_nbytes(s.shape, s.dtype, "safetensors " + path + ": " + what);
    if (s.begin < 0 || s.end < s.begin || s.end > data_size || s.end - s.begin != nbytes)
      bad(path, what + ": data_offsets [" + std::to_string(s.begin) + ", " + std::to_string(s.end) +
                    "] do not hold its " + std::to_string(nbytes) + " bytes inside the " +
                    std::to_string(data_size) + "-byte data");
    if (out.contains(s.name)) bad(path, what + " appears twice");
    specs.push_back(std::move(s));
  }
  // As the reference reader: tensors tile the data exactly, without overlaps or gaps.
  std::vector<const Spec*> order;
  for (const auto& s : specs) order.push_back(&s);
  std::sort(order.begin(), order.end(),
            [](const Spec* a, const Spec* b) { return a->begin < b->begin; });
  int64_t at = 0;
  for (const Spec* s : order) {
    if (s->begin != at) bad(path, "tensor '" + s->name + "' overlaps another or leaves a gap");
    at = s->end;
  }
  if (at != data_size) bad(path, "the data has bytes no tensor covers");
  for (const Spec& s : specs) {
    at::Tensor t = at::empty(s.shape, at::TensorOptions().dtype(s.dtype));
    if (s.end > s.begin)
      files::read_into(io, path, data_start + s.begin, s.end - s.begin, t.data_ptr(),
                       "safetensors");
    out.insert_or_assign(s.name, t);
  }
}

// ---- .pt ----

std::set<std::pair<std::string, std::string>> pt_globals() {
  std::set<std::pair<std::string, std::string>> g = {
      {"torch._utils", "_rebuild_tensor_v2"},
      {"collections", "OrderedDict"},
  };
  for (const auto& d : formats::dtype_names()) g.insert({"torch", d.storage});
  return g;
}

class PtReader {
 public:
  PtReader(caffe2::serialize::PyTorchStreamReader& zip, std::string path, int64_t file_size)
      : zip_(zip), path_(std::move(path)), file_size_(file_size) {}

  StateValue value(const pickle::NodePtr& n, const std::string& where, int depth = 0) {
    using K = pickle::Node::Kind;
    if (depth > 64) fail(where + " is nested deeper than 64 levels");
    switch (n->kind) {
      case K::None:
        return StateValue();
      case K::Bool:
        return StateValue(n->b);
      case K::Int:
        return StateValue(n->i);
      case K::Float:
        return StateValue(n->f);
      case K::Str:
        return StateValue(n->s);
      case K::List:
      case K::Tuple: {
        StateList l;
        for (size_t i = 0; i < n->items.size(); ++i)
          l.push_back(value(n->items[i], where + "[" + std::to_string(i) + "]", depth + 1));
        return StateValue(std::move(l));
      }
      case K::Dict: {
        StateDict d;
        for (const auto& [k, v] : n->entries) {
          if (!k->is(K::Str)) fail(where + " has a key that is not a str");
          d.insert_or_assign(k->s, value(v, where.empty() ? k->s : where + "." + k->s, depth + 1));
        }
        return StateValue(std::move(d));
      }
      case K::Object:
        if (n->class_name() == "torch._utils._rebuild_tensor_v2") return tensor(*n, where);
        fail(where + " is a " + n->class_name() + ", which fsdp-cpp does not read");
      default:
        fail(where + " is a Python " + pickle::to_string(n->kind) +
             ", which a StateDict cannot hold");
    }
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw ValueError("load_pt " + path_ + ": " + what);
  }

  std::vector<int64_t> ints(const pickle::NodePtr& n, const std::string& what) const {
    if (!n->is(pickle::Node::Kind::Tuple)) fail(what + " is not a tuple");
    std::vector<int64_t> out;
    for (const auto& x : n->items) {
      if (!x->is(pickle::Node::Kind::Int)) fail(what + " holds a non-integer");
      out.push_back(x->i);
    }
    return out;
  }

  at::Tensor tensor(const pickle::Node& call, const std::string& where) {
    using K = pickle::Node::Kind;
    const auto& a = call.items;
    if (a.size() < 4 || !a[0]->is(K::PersId) || !a[1]->is(K::Int))
      fail("tensor '" + where + "' has unexpected _rebuild_tensor_v2 arguments");
    const pickle::NodePtr& pid = a[0]->items[0];
    if (!pid->is(K::Tuple) || pid->items.size() != 5 || !pid->items[0]->is(K::Str) ||
        pid->items[0]->s != "storage" || !pid->items[1]->is(K::Global) ||
        !pid->items[2]->is(K::Str) || !pid->items[4]->is(K::Int))
      fail("tensor '" + where + "' refers to its storage in an unexpected way");
    at::ScalarType dtype = at::kFloat;
    bool known = false;
    for (const auto& d : formats::dtype_names())
      if (pid->items[1]->name == d.storage) {
        dtype = d.dtype;
        known = true;
      }
    if (!known) fail("tensor '" + where + "' has storage class " + pid->items[1]->class_name());
    const std::string key = pid->items[2]->s;
    const int64_t numel = pid->items[4]->i;
    const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
    if (numel < 0 || numel > file_size_ / item)
      fail("tensor '" + where + "' claims a storage of " + std::to_string(numel) +
           " elements, more than the file holds");
    at::Tensor storage = storage_of(key, dtype, numel, where);
    const int64_t offset = a[1]->i;
    const std::vector<int64_t> size = ints(a[2], "the size of '" + where + "'");
    const std::vector<int64_t> stride = ints(a[3], "the stride of '" + where + "'");
    if (size.size() != stride.size())
      fail("tensor '" + where + "': size and stride differ in length");
    // The furthest element must lie inside the storage.
    int64_t last = offset;
    bool empty = false;
    for (size_t d = 0; d < size.size(); ++d) {
      if (size[d] < 0 || stride[d] < 0) fail("tensor '" + where + "': negative size or stride");
      if (size[d] == 0) empty = true;
    }
    if (!empty) {
      for (size_t d = 0; d < size.size(); ++d) {
        if (stride[d] != 0 && size[d] - 1 > (INT64_MAX - last) / stride[d])
          fail("tensor '" + where + "': its extent overflows");
        last += (size[d] - 1) * stride[d];
      }
      if (offset < 0 || last >= numel)
        fail("tensor '" + where + "' reaches element " + std::to_string(last) +
             " of a storage of " + std::to_string(numel));
    }
    return storage.as_strided(size, stride, offset).clone();
  }

  at::Tensor storage_of(const std::string& key, at::ScalarType dtype, int64_t numel,
                        const std::string& where) {
    auto it = storages_.find(key);
    if (it != storages_.end()) {
      if (it->second.scalar_type() != dtype || it->second.numel() != numel)
        fail("storage " + key + " is used with two dtypes or sizes");
      return it->second;
    }
    const std::string record = "data/" + key;
    if (key.empty() || key.find('/') != std::string::npos || !zip_.hasRecord(record))
      fail("tensor '" + where + "' refers to a missing storage record '" + record + "'");
    at::DataPtr data;
    size_t n = 0;
    try {
      std::tie(data, n) = zip_.getRecord(record);
    } catch (const std::exception& e) {
      fail("record " + record + " cannot be read: " + e.what());
    }
    const int64_t want = numel * static_cast<int64_t>(c10::elementSize(dtype));
    if (static_cast<int64_t>(n) != want)
      fail("record " + record + " has " + std::to_string(n) + " bytes, tensor '" + where +
           "' needs " + std::to_string(want));
    at::Tensor t = at::empty({numel}, at::TensorOptions().dtype(dtype));
    if (n > 0) std::memcpy(t.data_ptr(), data.get(), n);
    storages_[key] = t;
    return t;
  }

  caffe2::serialize::PyTorchStreamReader& zip_;
  std::string path_;
  int64_t file_size_;
  std::map<std::string, at::Tensor> storages_;
};

}  // namespace

StateDict load_safetensors(const std::string& path_in, FileIO* io_in) {
  FileIO& io = io_in ? *io_in : default_file_io();
  std::string path = files::normalize(path_in);
  if (io.is_dir(path) == 1) {
    const std::string index = files::join(path, "model.safetensors.index.json");
    path = io.file_size(index) >= 0 ? index : files::join(path, "model.safetensors");
  }
  StateDict out;
  const std::string suffix = ".index.json";
  if (path.size() > suffix.size() &&
      path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0) {
    const nlohmann::json index =
        parse_json(files::read_file(io, path, kMaxHeader, "safetensors"), path);
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
      bad(path, "the index has no weight_map object");
    std::map<std::string, std::vector<std::string>> by_file;
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
      if (!it->is_string()) bad(path, "weight_map['" + it.key() + "'] is not a file name");
      const std::string f = it->get<std::string>();
      if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..")
        bad(path, "weight_map names '" + f + "', not a file beside the index");
      by_file[f].push_back(it.key());
    }
    const std::string dir = files::parent_of(path);
    for (const auto& [f, names] : by_file) {
      StateDict part;
      read_safetensors_file(io, files::join(dir, f), part);
      for (const auto& name : names)
        if (!part.contains(name))
          bad(path, "the index puts '" + name + "' in " + f + ", which does not hold it");
      for (auto& [k, v] : part) {
        if (out.contains(k)) bad(path, "'" + k + "' is in two files");
        out.insert_or_assign(k, v);
      }
    }
    return out;
  }
  read_safetensors_file(io, path, out);
  return out;
}

StateDict load_pt(const std::string& path) {
  FileIO& io = default_file_io();
  const int64_t size = io.file_size(path);
  if (size < 0) throw ValueError("load_pt: cannot open " + path + ": " + std::strerror(errno));
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> zip;
  std::string pkl;
  try {
    zip = std::make_unique<caffe2::serialize::PyTorchStreamReader>(path);
    if (zip->hasRecord("constants.pkl") || !zip->hasRecord("data.pkl"))
      throw ValueError(
          "it is not a torch.save archive of data (a TorchScript archive from "
          "torch::save or torch.jit.save? read those with torch::load)");
    auto [data, n] = zip->getRecord("data.pkl");
    pkl.assign(static_cast<const char*>(data.get()), n);
  } catch (const ValueError& e) {
    throw ValueError("load_pt " + path + ": " + e.what());
  } catch (const std::exception& e) {
    throw ValueError("load_pt " + path +
                     ": not a zip archive written by torch.save (files in the legacy, pre-1.6 "
                     "format must be re-saved by Python): " +
                     e.what());
  }
  pickle::ReadLimits limits;
  limits.persistent_ids = true;
  pickle::NodePtr root;
  try {
    root = pickle::read(pkl, pt_globals(), limits);
  } catch (const pickle::PickleError& e) {
    throw ValueError("load_pt " + path + ": " + e.what());
  }
  if (!root->is(pickle::Node::Kind::Dict))
    throw ValueError("load_pt " + path + ": the file holds a " + pickle::to_string(root->kind) +
                     ", not a dict");
  PtReader reader(*zip, path, size);
  return reader.value(root, "").dict();
}

}  // namespace checkpoint
}  // namespace fsdp
