// Verifying and inspecting DCP checkpoints, and the load template built from what inspect reports
// (fsdp/checkpoint/checkpoint.h), all through CheckpointReader (dcp_reader.h). verify reads files
// that may be hostile: it collects each problem it finds, in the order of its checks, instead of
// stopping at the first.
#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include "checkpoint/dcp_items.h"
#include "checkpoint/dcp_reader.h"
#include "checkpoint/files.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/errors.h"
#include "util/tensor_utils.h"

namespace fsdp {
namespace checkpoint {
namespace {

constexpr const char* kVerify = "checkpoint verify";

using detail::shape_str;

// The manifest against the directory (every file of its size) and `.metadata` (as many items);
// without one, that it is missing.
void check_manifest(const CheckpointReader& o, FileIO& io, VerifyReport& rep) {
  const std::string& dir = o.dir();
  rep.has_manifest = o.manifest().has_value();
  if (!o.manifest()) {
    rep.problems.push_back(
        std::string(kVerify) + ": " + dir + " has no " + manifest::kFileName +
        ": nothing stronger than the items' zip CRC-32s can be checked (a checkpoint written by "
        "PyTorch?)");
    return;
  }
  rep.format_version = o.manifest()->format_version;
  rep.world_size = o.manifest()->world_size;
  for (const auto& [file, size] : o.manifest()->files) {
    const std::string path = files::join(dir, file);
    const int64_t actual = io.file_size(path);
    if (actual != size)
      rep.problems.push_back(
          std::string(kVerify) + ": " + path +
          (actual < 0 ? std::string(" is missing") : " has " + std::to_string(actual) + " bytes") +
          ", the manifest says " + std::to_string(size));
  }
  if (o.manifest()->items.size() != o.metadata().storage_data.size())
    rep.problems.push_back(std::string(kVerify) + ": the manifest lists " +
                           std::to_string(o.manifest()->items.size()) + " items, .metadata " +
                           std::to_string(o.metadata().storage_data.size()));
}

// Coverage: the chunks of tensor `key` tile it exactly (inside it, as parsing checked; disjoint;
// volumes add up). Chunks are tested pairwise for overlaps only up to dcp::kMaxPairwiseBoxes.
void check_coverage(const std::string& key, const dcp::TensorMeta& t,
                    std::vector<std::string>& problems) {
  int64_t numel = 1, volume = 0;
  for (int64_t s : t.size) numel *= s;
  for (const dcp::ChunkMeta& c : t.chunks) {
    int64_t v = 1;
    for (int64_t s : c.sizes) v *= s;
    volume += v;
  }
  if (t.chunks.size() <= dcp::kMaxPairwiseBoxes) {
    std::vector<dcp::Region> boxes;
    for (const dcp::ChunkMeta& c : t.chunks) {
      dcp::Region r{c.offsets, c.offsets};
      for (size_t d = 0; d < r.hi.size(); ++d) r.hi[d] += c.sizes[d];
      boxes.push_back(std::move(r));
    }
    for (size_t a = 0; a < boxes.size(); ++a)
      for (size_t b = a + 1; b < boxes.size(); ++b)
        if (dcp::overlap(boxes[a], boxes[b]))
          problems.push_back(std::string(kVerify) + ": '" + key + "' has overlapping chunks at " +
                             shape_str(t.chunks[a].offsets) + " and " +
                             shape_str(t.chunks[b].offsets));
  }
  if (volume != numel)
    problems.push_back(std::string(kVerify) + ": the chunks of '" + key + "' hold " +
                       std::to_string(volume) + " elements, the tensor " + std::to_string(numel));
}

// One stored item, at `place`: it belongs to a key, lies inside its file, matches its checksum
// and decodes to what `.metadata` says. Throws the first problem; counts what it read into `rep`.
void check_item(const CheckpointReader& o, const dcp::Index& idx, const dcp::StorageInfo& info,
                const std::string& place, CheckpointReader::Buffer& buf, VerifyReport& rep) {
  const dcp::ItemMeta* item = o.item(idx.fqn);
  if (!item)
    throw ValueError(std::string(kVerify) + ": " + place + " belongs to no key of .metadata");
  const std::string_view raw = o.read_item(idx.fqn, info, buf);
  rep.bytes += static_cast<int64_t>(raw.size());
  ++rep.items;
  if (item->bytes) {
    items::decode_value(raw.data(), raw.size(), std::string(kVerify) + ": " + place, o.check_crc());
    return;
  }
  if (!idx.offset)
    throw ValueError(std::string(kVerify) + ": " + place + " is a tensor item without offsets");
  const auto& chunks = item->tensor.chunks;
  auto c = std::find_if(chunks.begin(), chunks.end(),
                        [&](const dcp::ChunkMeta& x) { return x.offsets == *idx.offset; });
  if (c == chunks.end())
    throw ValueError(std::string(kVerify) + ": " + place + " is a chunk .metadata does not list");
  dcp::check_chunk(items::decode_tensor(raw.data(), raw.size(), std::string(kVerify) + ": " + place,
                                        o.check_crc()),
                   item->tensor.dtype, c->sizes, place, kVerify);
}

}  // namespace

VerifyReport verify(const std::string& dir_in, FileIO* io_in,
                    const std::function<void(int64_t, int64_t)>& progress) {
  FileIO& io = io_in ? *io_in : default_file_io();
  VerifyReport rep;
  std::optional<CheckpointReader> reader;
  try {
    reader.emplace(io, dir_in, /*verify=*/true, kVerify);
  } catch (const std::exception& e) {
    rep.problems.push_back(e.what());
    return rep;
  }
  const CheckpointReader& o = *reader;
  check_manifest(o, io, rep);
  for (const auto& [key, item] : o.metadata().state_dict_metadata)
    if (!item.bytes) check_coverage(key, item.tensor, rep.problems);
  // Every stored item: inside its file, its checksum, and what it decodes to.
  std::set<std::pair<std::string, std::vector<int64_t>>> stored;
  const auto total = static_cast<int64_t>(o.metadata().storage_data.size());
  int64_t done = 0;
  CheckpointReader::Buffer buf;
  for (const auto& [idx, info] : o.metadata().storage_data) {
    if (progress && done > 0) progress(done, total);
    ++done;
    const std::string place = o.where(idx.fqn, info);
    if (idx.offset) stored.insert({idx.fqn, *idx.offset});  // it has an entry, good bytes or not
    try {
      check_item(o, idx, info, place, buf, rep);
    } catch (const std::exception& e) {
      rep.problems.push_back(e.what());
    }
  }
  if (progress) progress(total, total);
  for (const auto& [key, item] : o.metadata().state_dict_metadata) {
    if (item.bytes) continue;
    for (const auto& c : item.tensor.chunks)
      if (!stored.count({key, c.offsets}))
        rep.problems.push_back(std::string(kVerify) + ": the chunk of '" + key + "' at " +
                               shape_str(c.offsets) + " has no storage entry");
  }
  return rep;
}

CheckpointInfo inspect(const std::string& dir, FileIO* io_in) {
  FileIO& io = io_in ? *io_in : default_file_io();
  const CheckpointReader r(io, dir, /*verify=*/true, "checkpoint inspect");
  CheckpointInfo info;
  if (const auto& mf = r.manifest()) {
    info.has_manifest = true;
    info.format_version = mf->format_version;
    info.world_size = mf->world_size;
    info.library_version = mf->library_version;
    info.torch_version = mf->torch_version;
    info.created_unix = mf->created_unix;
    info.annotations = mf->annotations;
  }
  std::map<std::string, int64_t> stored;
  std::set<std::string> files_seen;
  for (const auto& [idx, s] : r.metadata().storage_data) {
    stored[idx.fqn] += s.length;
    if (files_seen.insert(s.relative_path).second) info.files.push_back(s.relative_path);
  }
  for (const auto& [key, item] : r.metadata().state_dict_metadata) {
    CheckpointEntry e;
    e.key = key;
    e.tensor = !item.bytes;
    e.dtype = item.tensor.dtype;
    e.shape = item.tensor.size;
    e.chunks = item.bytes ? 1 : static_cast<int64_t>(item.tensor.chunks.size());
    e.stored_bytes = stored[key];
    info.entries.push_back(std::move(e));
  }
  return info;
}

StateDict full_template(const CheckpointInfo& info) {
  StateDict t;
  for (const auto& e : info.entries)
    t.insert_or_assign(e.key,
                       e.tensor ? StateValue(at::empty(e.shape, at::TensorOptions().dtype(e.dtype)))
                                : StateValue());
  return t;
}

}  // namespace checkpoint
}  // namespace fsdp
