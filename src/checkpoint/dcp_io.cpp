// save / load of StateDicts as DCP FileSystem checkpoints (see fsdp/checkpoint/checkpoint.h and
// docs/checkpoint_format.md). Items are complete torch.save archives: tensors through
// torch::pickle_save / pickle_load, other values as our own protocol-2 pickle in LibTorch's zip
// container, read back through the restricted reader.
#include "fsdp/checkpoint/checkpoint.h"

#include <caffe2/serialize/inline_container.h>
#include <sys/stat.h>
#include <torch/serialize.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

#include "checkpoint/dcp_metadata.h"
#include "checkpoint/pickle.h"
#include "fsdp/errors.h"

namespace fsdp {
namespace checkpoint {
namespace {

using pickle::Node;
using pickle::NodePtr;

// One value of the state dict under its DCP key.
struct FlatItem {
  std::string key;
  std::vector<dcp::PathElement> path;
  StateValue* value;
};

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

std::string join(const std::string& dir, const std::string& file) { return dir + "/" + file; }

// Adds `item` under `key`, or its chunks to the key's entry if it has one (a tensor saved by
// several ranks, or in several pieces); `index` maps keys to their entries.
void merge_item(dcp::Metadata& m, std::map<std::string, size_t>& index, const std::string& key,
                dcp::ItemMeta item) {
  auto [it, fresh] = index.emplace(key, m.state_dict_metadata.size());
  if (fresh) {
    m.state_dict_metadata.emplace_back(key, std::move(item));
    return;
  }
  auto& chunks = m.state_dict_metadata[it->second].second.tensor.chunks;
  chunks.insert(chunks.end(), item.tensor.chunks.begin(), item.tensor.chunks.end());
}

// ---- item payloads ----

std::string tensor_payload(const at::Tensor& t) {
  at::Tensor c = t.detach().to(at::kCPU).contiguous();
  // A view would drag its whole storage into the archive (DCP clones such tensors too).
  if (c.storage_offset() != 0 ||
      c.storage().nbytes() != static_cast<size_t>(c.numel()) * c.element_size()) {
    c = c.clone();
  }
  const std::vector<char> bytes = torch::pickle_save(c);
  return std::string(bytes.begin(), bytes.end());
}

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

// A torch.save archive holding one non-tensor value.
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

// ---- files ----

void write_file(const std::string& path, const std::string& data) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) throw Error("checkpoint save: cannot create " + path + ": " + std::strerror(errno));
  const size_t n = std::fwrite(data.data(), 1, data.size(), f);
  const bool ok = n == data.size() && std::fflush(f) == 0;
  const int err = errno;
  std::fclose(f);
  if (!ok) throw Error("checkpoint save: writing " + path + " failed: " + std::strerror(err));
}

std::string read_range(const std::string& path, int64_t offset, int64_t length) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) throw ValueError("checkpoint load: cannot open " + path);
  const int64_t size = static_cast<int64_t>(f.tellg());
  if (offset > size || length > size - offset) {
    throw ValueError("checkpoint load: " + path + " has " + std::to_string(size) +
                     " bytes, an item lies at [" + std::to_string(offset) + ", " +
                     std::to_string(offset) + " + " + std::to_string(length) + ")");
  }
  std::string out(static_cast<size_t>(length), '\0');
  f.seekg(offset);
  f.read(out.data(), length);
  if (!f) throw ValueError("checkpoint load: reading " + path + " failed");
  return out;
}

std::string dims_text(const std::vector<int64_t>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}

}  // namespace

// ---------------------------------------------------------------------------------------------

void save(const StateDict& state_dict, const std::string& dir, dist::ProcessGroup* group) {
  if (!group && dist::is_initialized()) group = &dist::default_group();
  const int rank = group ? group->rank() : 0;
  StateDict sd = state_dict;  // containers only; tensors are shared
  std::string error;
  dcp::Metadata mine;
  try {
    if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST)
      throw Error("checkpoint save: cannot create " + dir + ": " + std::strerror(errno));
    const std::string file = "__" + std::to_string(rank) + "_0.distcp";
    std::string data;
    std::map<std::string, size_t> index;
    auto add_item = [&](const std::string& key, const dcp::ItemMeta& item) {
      merge_item(mine, index, key, item);
    };
    auto store = [&](dcp::Index idx, const std::string& payload) {
      mine.storage_data.emplace_back(std::move(idx),
                                     dcp::StorageInfo{file, static_cast<int64_t>(data.size()),
                                                      static_cast<int64_t>(payload.size())});
      data += payload;
    };
    for (const FlatItem& it : flatten(sd)) {
      const StateValue& v = *it.value;
      if (rank == 0) mine.planner_data.emplace_back(it.key, it.path);
      if (v.is_tensor() || v.is_sharded_tensor()) {
        dcp::ItemMeta item;
        item.tensor.dtype = v.is_tensor() ? v.tensor().scalar_type() : v.sharded_tensor().dtype();
        dcp::dtype_name(item.tensor.dtype);  // throws for a dtype DCP cannot store
        item.tensor.size = v.is_tensor() ? v.tensor().sizes().vec() : v.sharded_tensor().size();
        std::vector<std::pair<dcp::ChunkMeta, at::Tensor>> chunks;
        if (v.is_tensor()) {
          if (rank == 0)  // replicated: saved once
            chunks.emplace_back(
                dcp::ChunkMeta{std::vector<int64_t>(item.tensor.size.size(), 0), item.tensor.size},
                v.tensor());
        } else {
          for (const auto& s : v.sharded_tensor().local_shards())
            chunks.emplace_back(dcp::ChunkMeta{s.metadata.offsets, s.metadata.sizes}, s.tensor);
        }
        for (const auto& [c, t] : chunks) {
          item.tensor.chunks.push_back(c);
          store(dcp::Index{it.key, c.offsets, 0}, tensor_payload(t));
        }
        add_item(it.key, item);
      } else if (rank == 0) {
        dcp::ItemMeta item;
        item.bytes = true;
        add_item(it.key, item);
        store(dcp::Index{it.key, std::nullopt, std::nullopt}, value_payload(v, it.key));
      }
    }
    write_file(join(dir, file), data);
  } catch (const std::exception& e) {
    error = e.what();
  }
  // One small exchange: each rank's chunks and storage entries (as a metadata pickle), or its
  // error, so that a failure anywhere fails every rank.
  const std::string msg = error.empty() ? "M" + dcp::serialize_metadata(mine) : "E" + error;
  const std::vector<std::string> all =
      group ? group->all_gather_bytes(msg) : std::vector<std::string>{msg};
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty() || all[r][0] != 'E') continue;
    throw Error(r == static_cast<size_t>(rank) ? all[r].substr(1)
                                               : "checkpoint save failed on rank " +
                                                     std::to_string(r) + ": " + all[r].substr(1));
  }
  std::string commit_error;
  if (rank == 0) {
    try {
      dcp::Metadata merged;
      std::map<std::string, size_t> index;
      for (const auto& m : all) {
        dcp::Metadata part = dcp::parse_metadata(m.substr(1), "rank metadata");
        for (auto& [k, item] : part.state_dict_metadata)
          merge_item(merged, index, k, std::move(item));
        merged.storage_data.insert(merged.storage_data.end(), part.storage_data.begin(),
                                   part.storage_data.end());
        if (merged.planner_data.empty()) merged.planner_data = std::move(part.planner_data);
      }
      // `.metadata` last, through a rename, so a reader never sees half of it.
      write_file(join(dir, ".metadata.tmp"), dcp::serialize_metadata(merged));
      if (std::rename(join(dir, ".metadata.tmp").c_str(), join(dir, ".metadata").c_str()) != 0)
        throw Error("checkpoint save: renaming .metadata in " + dir + ": " + std::strerror(errno));
    } catch (const std::exception& e) {
      commit_error = e.what();
    }
  }
  // Everyone returns once the checkpoint is complete (or fails with rank 0).
  if (group) commit_error = group->broadcast_bytes(commit_error, 0);
  if (!commit_error.empty()) throw Error(commit_error);
}

void load(StateDict& state_dict, const std::string& dir) {
  const std::string meta_path = join(dir, ".metadata");
  std::string meta_bytes;
  {
    std::ifstream f(meta_path, std::ios::binary | std::ios::ate);
    if (!f)
      throw ValueError("checkpoint load: " + meta_path +
                       " does not exist (incomplete or no checkpoint)");
    const auto size = static_cast<int64_t>(f.tellg());
    constexpr int64_t kMaxMetadata = int64_t{64} << 20;  // the pickle reader's limit
    if (size > kMaxMetadata)
      throw ValueError("checkpoint load: " + meta_path + " has " + std::to_string(size) +
                       " bytes, more than the " + std::to_string(kMaxMetadata) + " accepted");
    meta_bytes = read_range(meta_path, 0, size);
  }
  const dcp::Metadata md = dcp::parse_metadata(meta_bytes, meta_path);
  std::map<std::string, const dcp::ItemMeta*> items;
  for (const auto& [k, item] : md.state_dict_metadata) items[k] = &item;
  std::map<std::pair<std::string, std::vector<int64_t>>, const dcp::StorageInfo*> chunk_at;
  std::map<std::string, const dcp::StorageInfo*> bytes_at;
  for (const auto& [idx, info] : md.storage_data) {
    if (idx.offset) {
      chunk_at[{idx.fqn, *idx.offset}] = &info;
    } else {
      bytes_at[idx.fqn] = &info;
    }
  }

  // Plan: which saved chunk fills which part of which target, all checked before any change.
  struct Copy {
    at::Tensor dst;                       // a view of the target
    std::vector<int64_t> src_lo, extent;  // region of the chunk
  };
  struct Read {
    std::string first;  // the key, for messages
    std::vector<Copy> second;
    at::ScalarType dtype = at::kFloat;
  };
  std::map<const dcp::StorageInfo*, Read> reads;
  std::vector<std::pair<StateValue*, const dcp::StorageInfo*>> values;
  for (const FlatItem& it : flatten(state_dict)) {
    StateValue& v = *it.value;
    auto found = items.find(it.key);
    if (found == items.end())
      throw ValueError("checkpoint load: " + dir + " has no '" + it.key + "'");
    const dcp::ItemMeta& item = *found->second;
    if (!(v.is_tensor() || v.is_sharded_tensor())) {
      if (!item.bytes)
        throw ValueError("checkpoint load: '" + it.key + "' is a tensor in " + dir +
                         ", the state dict holds a " + to_string(v.kind()));
      auto b = bytes_at.find(it.key);
      if (b == bytes_at.end())
        throw ValueError("checkpoint load: no storage entry for '" + it.key + "' in " + dir);
      values.emplace_back(&v, b->second);
      continue;
    }
    if (item.bytes) throw ValueError("checkpoint load: '" + it.key + "' is not a tensor in " + dir);
    const std::vector<int64_t> shape =
        v.is_tensor() ? v.tensor().sizes().vec() : v.sharded_tensor().size();
    if (shape != item.tensor.size)
      throw ValueError("checkpoint load: '" + it.key + "' has shape " +
                       dims_text(item.tensor.size) + " in " + dir + ", the state dict " +
                       dims_text(shape));
    // The boxes this rank holds of the tensor.
    std::vector<std::pair<ShardMetadata, at::Tensor>> boxes;
    if (v.is_tensor()) {
      boxes.emplace_back(ShardMetadata{std::vector<int64_t>(shape.size(), 0), shape, 0},
                         v.tensor());
    } else {
      for (const auto& s : v.sharded_tensor().local_shards())
        boxes.emplace_back(s.metadata, s.tensor);
    }
    for (const auto& [box, target] : boxes) {
      at::Tensor covered = at::zeros(box.sizes, at::kBool);
      for (const auto& c : item.tensor.chunks) {
        std::vector<int64_t> lo(shape.size()), hi(shape.size());
        bool overlap = true;
        for (size_t d = 0; d < shape.size(); ++d) {
          lo[d] = std::max(box.offsets[d], c.offsets[d]);
          hi[d] = std::min(box.offsets[d] + box.sizes[d], c.offsets[d] + c.sizes[d]);
          overlap = overlap && hi[d] > lo[d];
        }
        if (!overlap) continue;
        auto info = chunk_at.find({it.key, c.offsets});
        if (info == chunk_at.end())
          throw ValueError("checkpoint load: no storage entry for '" + it.key + "' chunk at " +
                           dims_text(c.offsets) + " in " + dir);
        at::Tensor dst = target, mark = covered;
        Copy cp;
        for (size_t d = 0; d < shape.size(); ++d) {
          const auto dd = static_cast<int64_t>(d);
          dst = dst.narrow(dd, lo[d] - box.offsets[d], hi[d] - lo[d]);
          mark = mark.narrow(dd, lo[d] - box.offsets[d], hi[d] - lo[d]);
          cp.src_lo.push_back(lo[d] - c.offsets[d]);
          cp.extent.push_back(hi[d] - lo[d]);
        }
        mark.fill_(true);
        cp.dst = dst;
        auto& r = reads[info->second];
        r.first = it.key;
        r.dtype = item.tensor.dtype;
        r.second.push_back(std::move(cp));
      }
      const int64_t missing = covered.numel() - covered.sum().item<int64_t>();
      if (missing > 0)
        throw ValueError("checkpoint load: " + std::to_string(missing) + " element(s) of '" +
                         it.key + "' in the box at " + dims_text(box.offsets) + " of size " +
                         dims_text(box.sizes) + " are in no chunk saved in " + dir);
    }
  }
  // Apply: each needed chunk read once.
  at::NoGradGuard no_grad;
  for (auto& [info, job] : reads) {
    const std::string path = join(dir, info->relative_path);
    const std::string raw = read_range(path, info->offset, info->length);
    at::Tensor chunk;
    try {
      chunk = torch::pickle_load(std::vector<char>(raw.begin(), raw.end())).toTensor();
    } catch (const std::exception& e) {
      throw ValueError("checkpoint load: '" + job.first + "' in " + path + " at " +
                       std::to_string(info->offset) + " is not a readable tensor: " + e.what());
    }
    if (chunk.scalar_type() != job.dtype)
      throw ValueError("checkpoint load: '" + job.first + "' chunk in " + path + " holds " +
                       c10::toString(chunk.scalar_type()) + ", the metadata says " +
                       c10::toString(job.dtype));
    for (auto& cp : job.second) {
      at::Tensor src = chunk;
      if (src.dim() != static_cast<int64_t>(cp.extent.size()))
        throw ValueError("checkpoint load: '" + job.first + "' chunk in " + path +
                         " has the wrong number of dims");
      for (size_t d = 0; d < cp.extent.size(); ++d) {
        const auto dd = static_cast<int64_t>(d);
        if (cp.src_lo[d] + cp.extent[d] > src.size(dd))
          throw ValueError("checkpoint load: '" + job.first + "' chunk in " + path +
                           " is smaller than its metadata says");
        src = src.narrow(dd, cp.src_lo[d], cp.extent[d]);
      }
      cp.dst.copy_(src);
    }
  }
  for (auto& [v, info] : values) {
    const std::string path = join(dir, info->relative_path);
    const std::string raw = read_range(path, info->offset, info->length);
    std::string pkl;
    try {
      std::istringstream in(raw);
      caffe2::serialize::PyTorchStreamReader reader(&in);
      auto [data, size] = reader.getRecord("data.pkl");
      pkl.assign(static_cast<const char*>(data.get()), size);
    } catch (const std::exception& e) {
      throw ValueError("checkpoint load: an item in " + path + " at " +
                       std::to_string(info->offset) + " is not a torch.save archive: " + e.what());
    }
    pickle::NodePtr node;
    try {
      node = pickle::read(pkl, {});
    } catch (const pickle::PickleError& e) {
      throw ValueError("checkpoint load: the value at " + std::to_string(info->offset) + " in " +
                       path + ": " + e.what());
    }
    *v = from_node(node, path);
  }
}

}  // namespace checkpoint
}  // namespace fsdp
