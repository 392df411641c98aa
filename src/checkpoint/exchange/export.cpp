// Exports of consolidated tensors as safetensors and `.pt` (fsdp/checkpoint/export.h).
// A Source lists tensors (name, dtype, shape) and fetches one at a time, so a checkpoint is
// exported with about one tensor in memory; the writers only see Sources.
#include "fsdp/checkpoint/export.h"

#include <caffe2/serialize/inline_container.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>

#include "checkpoint/dcp/items.h"
#include "checkpoint/dcp/reader.h"
#include "checkpoint/formats/pickle.h"
#include "checkpoint/formats/tensor_formats.h"
#include "checkpoint/formats/torch_archive.h"
#include "checkpoint/storage/files.h"
#include "fsdp/errors.h"
#include "util/message.h"

namespace fsdp {
namespace checkpoint {
namespace {

using detail::msg;
using detail::quote;

constexpr const char* kExportWhat = "checkpoint export";

struct Entry {
  std::string name;  // as exported
  std::string key;   // in the source
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  int64_t nbytes;
};

struct Source {
  std::vector<Entry> entries;
  // A contiguous CPU tensor, valid until the next fetch (the writers copy it out before that).
  std::function<at::Tensor(const Entry&)> fetch;
};

bool under(const std::string& key, const std::string& prefix) {
  return key.size() > prefix.size() && key.compare(0, prefix.size(), prefix) == 0;
}

Entry entry(const std::string& key, const std::string& prefix, at::ScalarType dtype,
            const std::vector<int64_t>& shape) {
  return Entry{key.substr(prefix.size()), key, dtype, shape,
               formats::checked_nbytes(shape, dtype, msg(quote(key)))};
}

void no_tensors(const std::string& where, const std::string& prefix) {
  throw ValueError(
      msg(kExportWhat, ": ", where, " has no tensor under the prefix ", quote(prefix)));
}

// The prefix an export uses when its options give none. "model." for the {"model": ...,
// "optim": ...} layout of fsdp-train and of PyTorch's get_state_dict recipes (tensors under
// "model." and something under "optim.", or every tensor under "model."); otherwise "": every
// tensor under its full key, as in a plain model state dict (dcp.save(get_model_state_dict(m))).
// `keys`: every key, with whether it holds a tensor.
std::string layout_prefix(const std::vector<std::pair<std::string, bool>>& keys) {
  bool model = false, optim = false, only_model = true;
  for (const auto& [key, is_tensor] : keys) {
    optim |= under(key, "optim.");
    if (!is_tensor) continue;
    model |= under(key, "model.");
    only_model &= under(key, "model.");
  }
  return model && (optim || only_model) ? "model." : "";
}

Source from_checkpoint(const CheckpointReader& reader, const std::optional<std::string>& given) {
  std::vector<std::pair<std::string, bool>> keys;
  for (const auto& [key, item] : reader.metadata().state_dict_metadata)
    keys.emplace_back(key, !item.bytes);
  const std::string prefix = given ? *given : layout_prefix(keys);
  Source src;
  for (const auto& [key, item] : reader.metadata().state_dict_metadata)
    if (!item.bytes && (prefix.empty() || under(key, prefix)))
      src.entries.push_back(entry(key, prefix, item.tensor.dtype, item.tensor.size));
  if (src.entries.empty()) no_tensors(reader.dir(), prefix);
  const std::map<std::string, int64_t> stored = dcp::stored_bytes(reader.metadata());
  for (const Entry& e : src.entries) {
    auto it = stored.find(e.key);
    dcp::check_claim(kExportWhat, reader.dir(), e.key, e.nbytes,
                     it == stored.end() ? 0 : it->second);
  }
  // Every tensor is read into the same memory, as large as the largest, and through the same read
  // buffer: each is written out before the next is fetched, so the export faults in its memory
  // once, where a fresh tensor and a fresh read buffer per tensor cost a page fault for every 4 KiB
  // of the checkpoint, twice (docs/performance.md, "Checkpoints").
  struct Scratch {
    CheckpointReader::Buffer buf;
    at::Storage storage;
  };
  int64_t largest = 0;
  for (const Entry& e : src.entries) largest = std::max(largest, e.nbytes);
  auto scratch = std::make_shared<Scratch>();
  scratch->storage = at::empty({largest}, at::kByte).storage();
  src.fetch = [&reader, scratch](const Entry& e) {
    at::Tensor t = at::empty({0}, at::TensorOptions().dtype(e.dtype));
    t.set_(scratch->storage, 0, e.shape);
    StateDict one;
    one.insert_or_assign(e.key, t);
    reader.fill(one, scratch->buf);
    return one.at(e.key).tensor();
  };
  return src;
}

Source from_state_dict(const StateDict& state_dict, const std::optional<std::string>& given) {
  StateDict sd = state_dict;  // containers only
  auto tensors = std::make_shared<std::map<std::string, at::Tensor>>();
  const std::vector<items::FlatItem> flat = items::flatten(sd);
  std::vector<std::pair<std::string, bool>> keys;
  for (const items::FlatItem& it : flat)
    keys.emplace_back(it.key, it.value->is_tensor() || it.value->is_sharded_tensor());
  const std::string prefix = given ? *given : layout_prefix(keys);
  Source src;
  for (const items::FlatItem& it : flat) {
    if (!(prefix.empty() || under(it.key, prefix))) continue;
    if (it.value->is_sharded_tensor())
      throw ValueError(
          msg(kExportWhat, ": ", quote(it.key),
              " is a ShardedTensor; export a FULL state dict, or save a checkpoint and "
              "export that"));
    if (!it.value->is_tensor()) continue;
    const at::Tensor& t = it.value->tensor();
    src.entries.push_back(entry(it.key, prefix, t.scalar_type(), t.sizes().vec()));
    (*tensors)[it.key] = t;
  }
  if (src.entries.empty()) no_tensors("the state dict", prefix);
  src.fetch = [tensors](const Entry& e) {
    return tensors->at(e.key).detach().to(at::kCPU).contiguous();
  };
  return src;
}

at::Tensor fetch_checked(const Source& src, const Entry& e) {
  at::Tensor t = src.fetch(e).contiguous();
  if (t.scalar_type() != e.dtype || t.sizes().vec() != e.shape)
    throw StateError(msg(kExportWhat, ": ", quote(e.key), " changed while it was exported"));
  return t;
}

void commit_file(FileIO& io, const std::string& tmp, const std::string& path) {
  if (io.rename(tmp, path) != 0) {
    const int err = errno;  // before the message allocates
    files::io_error(kExportWhat, "renaming", msg(tmp, " to ", path), err);
  }
}

std::vector<std::string> write_safetensors(const Source& src, const std::string& out_dir,
                                           const ExportOptions& o) {
  FileIO& io = o.io() ? *o.io() : default_file_io();
  for (const Entry& e : src.entries) formats::safetensors_dtype(e.dtype, msg(quote(e.key)));
  // Greedy split in order, each file up to max_shard_bytes (a larger tensor alone).
  std::vector<std::vector<const Entry*>> groups(1);
  int64_t in_group = 0, total = 0;
  for (const Entry& e : src.entries) {
    if (o.max_shard_bytes() > 0 && !groups.back().empty() &&
        in_group + e.nbytes > o.max_shard_bytes()) {
      groups.emplace_back();
      in_group = 0;
    }
    groups.back().push_back(&e);
    in_group += e.nbytes;
    total += e.nbytes;
  }
  files::make_dirs(io, out_dir, kExportWhat);
  std::vector<std::string> written;
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  for (size_t g = 0; g < groups.size(); ++g) {
    std::string name = "model.safetensors";
    if (groups.size() > 1) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", g + 1, groups.size());
      name = buf;
    }
    nlohmann::ordered_json header = nlohmann::ordered_json::object();
    nlohmann::ordered_json meta = {{"format", "pt"}};
    for (const auto& [k, v] : o.metadata()) meta[k] = v;
    header["__metadata__"] = meta;
    int64_t at = 0;
    for (const Entry* e : groups[g]) {
      header[e->name] = {{"dtype", formats::safetensors_dtype(e->dtype, e->key)},
                         {"shape", e->shape},
                         {"data_offsets", {at, at + e->nbytes}}};
      at += e->nbytes;
      weight_map[e->name] = name;
    }
    std::string h = header.dump();
    h.append((8 - h.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
    const std::string path = files::join(out_dir, name);
    files::OutFile out(io, path + ".tmp", kExportWhat);
    char len[8];
    for (int k = 0; k < 8; ++k) len[k] = static_cast<char>((h.size() >> (8 * k)) & 0xff);
    out.append(len, 8);
    out.append(h);
    for (const Entry* e : groups[g]) {
      const at::Tensor t = fetch_checked(src, *e);
      out.append(t.data_ptr(), static_cast<size_t>(e->nbytes));
    }
    out.finish();
    commit_file(io, path + ".tmp", path);
    written.push_back(path);
  }
  if (groups.size() > 1) {
    const nlohmann::ordered_json index = {{"metadata", {{"total_size", total}}},
                                          {"weight_map", weight_map}};
    const std::string path = files::join(out_dir, "model.safetensors.index.json");
    files::write_file(io, path + ".tmp", index.dump(2) + "\n", kExportWhat);
    commit_file(io, path + ".tmp", path);
    written.push_back(path);
  }
  files::sync_dir(io, out_dir, kExportWhat);
  return written;
}

void write_pt(const Source& src, const std::string& out_file, const ExportOptions& o) {
  using pickle::Node;
  using pickle::NodePtr;
  FileIO& io = o.io() ? *o.io() : default_file_io();
  const std::string parent = files::parent_of(out_file);
  files::make_dirs(io, parent, kExportWhat);
  const std::string tmp = out_file + ".tmp";
  {
    files::OutFile out(io, tmp, kExportWhat);
    archive::ArchiveWriter zip([&out](const char* data, size_t n) { out.append(data, n); });
    std::vector<std::pair<NodePtr, NodePtr>> entries;
    for (size_t i = 0; i < src.entries.size(); ++i) {
      const Entry& e = src.entries[i];
      const at::Tensor t = fetch_checked(src, e);
      const std::string key = std::to_string(i);
      zip.record("data/" + key, t.data_ptr(), static_cast<size_t>(e.nbytes));
      entries.emplace_back(Node::str(e.name), archive::tensor_node(e.dtype, key, t.sizes(),
                                                                   t.strides(), t.numel(), e.key));
    }
    const std::string pkl = pickle::write(Node::dict(std::move(entries)));
    zip.record("data.pkl", pkl.data(), pkl.size());
    zip.record("byteorder", "little", 6);
    zip.finish();
    out.finish();
  }
  commit_file(io, tmp, out_file);
  files::sync_dir(io, parent, kExportWhat);
}

}  // namespace

std::vector<std::string> export_safetensors(const std::string& checkpoint_dir,
                                            const std::string& out_dir,
                                            const ExportOptions& options) {
  FileIO& io = options.io() ? *options.io() : default_file_io();
  const CheckpointReader reader(io, checkpoint_dir, /*verify=*/true, kExportWhat);
  return write_safetensors(from_checkpoint(reader, options.prefix()), out_dir, options);
}

std::vector<std::string> save_safetensors(const StateDict& state_dict, const std::string& out_dir,
                                          const ExportOptions& options) {
  return write_safetensors(from_state_dict(state_dict, options.prefix()), out_dir, options);
}

void export_pt(const std::string& checkpoint_dir, const std::string& out_file,
               const ExportOptions& options) {
  FileIO& io = options.io() ? *options.io() : default_file_io();
  const CheckpointReader reader(io, checkpoint_dir, /*verify=*/true, kExportWhat);
  write_pt(from_checkpoint(reader, options.prefix()), out_file, options);
}

void save_pt(const StateDict& state_dict, const std::string& out_file,
             const ExportOptions& options) {
  write_pt(from_state_dict(state_dict, options.prefix()), out_file, options);
}

}  // namespace checkpoint
}  // namespace fsdp
