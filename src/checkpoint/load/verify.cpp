// Verifying and inspecting DCP checkpoints, the load template built from what inspect reports, and
// assembling a node-local save's directories into one (fsdp/checkpoint/checkpoint.h), all through
// CheckpointReader (dcp/reader.h). verify reads files that may be hostile: it collects each problem
// it finds, in the order of its checks, instead of stopping at the first.
#include <algorithm>
#include <cerrno>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>

#include "checkpoint/dcp/items.h"
#include "checkpoint/dcp/reader.h"
#include "checkpoint/formats/tensor_formats.h"
#include "checkpoint/storage/files.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/errors.h"
#include "util/message.h"
#include "util/tensor_utils.h"

namespace fsdp {
namespace checkpoint {
namespace {

constexpr const char* kVerify = "checkpoint verify";

using detail::msg;
using detail::quote;
using detail::shape;

// The manifest against the directory (every file of its size) and `.metadata` (as many items);
// without one, that it is missing.
void check_manifest(const CheckpointReader& o, FileIO& io, VerifyReport& rep) {
  const std::string& dir = o.dir();
  rep.has_manifest = o.manifest().has_value();
  if (!o.manifest()) {
    rep.problems.push_back(msg(
        kVerify, ": ", dir, " has no ", manifest::kFileName,
        ": nothing stronger than the items' zip CRC-32s can be checked (a checkpoint written by "
        "PyTorch?)"));
    return;
  }
  rep.format_version = o.manifest()->format_version;
  rep.world_size = o.manifest()->world_size;
  for (const auto& [file, size] : o.manifest()->files) {
    if (!o.manifest()->holds(file)) {
      rep.elsewhere.push_back(file);
      continue;
    }
    const std::string path = files::join(dir, file);
    const int64_t actual = io.file_size(path);
    if (actual != size)
      rep.problems.push_back(
          msg(kVerify, ": ", path,
              actual < 0 ? std::string(" is missing") : msg(" has ", actual, " bytes"),
              ", the manifest says ", size));
  }
  if (o.manifest()->items.size() != o.metadata().storage_data.size())
    rep.problems.push_back(msg(kVerify, ": the manifest lists ", o.manifest()->items.size(),
                               " items, .metadata ", o.metadata().storage_data.size()));
}

// The element count of a box of `sizes`, or nullopt where it does not fit an int64. The metadata
// is not trusted: a shape of 2^32 x 2^32 would otherwise count as 0 elements and pass.
std::optional<int64_t> checked_numel(const std::vector<int64_t>& sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) {
    if (__builtin_mul_overflow(n, s, &n)) return std::nullopt;
  }
  return n;
}

// The problem of two chunks of `key` that overlap, as both overlap checks report it.
std::string overlap_problem(const std::string& key, const dcp::ChunkMeta& a,
                            const dcp::ChunkMeta& b) {
  return msg(kVerify, ": ", quote(key), " has overlapping chunks at ", shape(a.offsets), " and ",
             shape(b.offsets));
}

// Beyond kMaxPairwiseBoxes chunks, where testing every pair is too slow, the chunks' boundaries
// cut the tensor into a grid of cells and each chunk claims its cells: a cell claimed twice is an
// overlap. Exact for any boxes; the work is bounded by the cells (each claimed once where the
// chunks tile) and capped at kMaxCells, beyond which coverage is reported as not checkable
// rather than passed. (The volume check alone would pass an overlap with a hole of equal size.)
void check_overlaps_on_grid(const std::string& key, const dcp::TensorMeta& t,
                            std::vector<std::string>& problems) {
  constexpr int64_t kMaxCells = int64_t{1} << 24;
  const size_t nd = t.size.size();
  std::vector<std::vector<int64_t>> cuts(nd);
  int64_t cells = 1;
  for (size_t d = 0; d < nd; ++d) {
    cuts[d] = {0, t.size[d]};
    for (const dcp::ChunkMeta& c : t.chunks) {
      cuts[d].push_back(c.offsets[d]);
      cuts[d].push_back(c.offsets[d] + c.sizes[d]);
    }
    std::sort(cuts[d].begin(), cuts[d].end());
    cuts[d].erase(std::unique(cuts[d].begin(), cuts[d].end()), cuts[d].end());
    if (__builtin_mul_overflow(cells, static_cast<int64_t>(cuts[d].size()) - 1, &cells) ||
        cells > kMaxCells) {
      problems.push_back(msg(kVerify, ": cannot check that the ", t.chunks.size(), " chunks of ",
                             quote(key), " do not overlap: their boundaries cut it into more than ",
                             kMaxCells, " cells"));
      return;
    }
  }
  std::vector<int32_t> owner(static_cast<size_t>(cells), -1);
  for (size_t i = 0; i < t.chunks.size(); ++i) {
    const dcp::ChunkMeta& c = t.chunks[i];
    std::vector<int64_t> lo(nd), hi(nd), at(nd);
    bool empty = false;
    for (size_t d = 0; d < nd; ++d) {
      auto cell = [&](int64_t x) {
        return std::lower_bound(cuts[d].begin(), cuts[d].end(), x) - cuts[d].begin();
      };
      lo[d] = at[d] = cell(c.offsets[d]);
      hi[d] = cell(c.offsets[d] + c.sizes[d]);
      empty = empty || lo[d] == hi[d];
    }
    if (empty) continue;  // holds no element: overlaps nothing
    for (;;) {            // every cell of the chunk, the last dimension fastest
      int64_t flat = 0;
      for (size_t d = 0; d < nd; ++d)
        flat = flat * (static_cast<int64_t>(cuts[d].size()) - 1) + at[d];
      int32_t& o = owner[static_cast<size_t>(flat)];
      if (o >= 0) {
        problems.push_back(overlap_problem(key, t.chunks[static_cast<size_t>(o)], c));
        return;
      }
      o = static_cast<int32_t>(i);
      size_t d = nd;
      while (d > 0 && ++at[d - 1] == hi[d - 1]) {
        at[d - 1] = lo[d - 1];
        --d;
      }
      if (d == 0) break;
    }
  }
}

// Coverage: the chunks of tensor `key` tile it exactly (inside it, as parsing checked; disjoint,
// pairwise up to dcp::kMaxPairwiseBoxes and on a grid beyond; volumes add up, without overflow).
void check_coverage(const std::string& key, const dcp::TensorMeta& t,
                    std::vector<std::string>& problems) {
  const std::optional<int64_t> numel = checked_numel(t.size);
  if (!numel) {
    problems.push_back(msg(kVerify, ": ", quote(key), " has shape ", shape(t.size),
                           ", more elements than an int64 counts"));
    return;
  }
  // Each chunk lies inside the tensor (parse_metadata), so only the sum can overflow, and only
  // where chunks overlap.
  int64_t volume = 0;
  bool past_int64 = false;
  for (const dcp::ChunkMeta& c : t.chunks) {
    const std::optional<int64_t> v = checked_numel(c.sizes);
    past_int64 = past_int64 || !v || __builtin_add_overflow(volume, *v, &volume);
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
          problems.push_back(overlap_problem(key, t.chunks[a], t.chunks[b]));
  } else {
    check_overlaps_on_grid(key, t, problems);
  }
  if (past_int64 || volume != *numel)
    problems.push_back(msg(kVerify, ": the chunks of ", quote(key), " hold ",
                           past_int64 ? std::string("more than 2^63") : std::to_string(volume),
                           " elements, the tensor ", *numel));
}

// One stored item, at `place`: it belongs to a key, lies inside its file, matches its checksum
// and decodes to what `.metadata` says. Throws the first problem; counts what it read into `rep`.
void check_item(const CheckpointReader& o, const dcp::Index& idx, const dcp::StorageInfo& info,
                const std::string& place, CheckpointReader::Buffer& buf, VerifyReport& rep) {
  const dcp::ItemMeta* item = o.item(idx.fqn);
  if (!item) throw ValueError(msg(kVerify, ": ", place, " belongs to no key of .metadata"));
  const std::string_view raw = o.read_item(idx.fqn, info, buf);
  rep.bytes += static_cast<int64_t>(raw.size());
  ++rep.items;
  if (item->bytes) {
    items::decode_value(raw.data(), raw.size(), msg(kVerify, ": ", place), o.check_crc());
    return;
  }
  if (!idx.offset) throw ValueError(msg(kVerify, ": ", place, " is a tensor item without offsets"));
  const auto& chunks = item->tensor.chunks;
  auto c = std::find_if(chunks.begin(), chunks.end(),
                        [&](const dcp::ChunkMeta& x) { return x.offsets == *idx.offset; });
  if (c == chunks.end())
    throw ValueError(msg(kVerify, ": ", place, " is a chunk .metadata does not list"));
  dcp::check_chunk(
      items::decode_tensor(raw.data(), raw.size(), msg(kVerify, ": ", place), o.check_crc()),
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
    if (o.manifest() && !o.manifest()->holds(info.relative_path)) continue;  // on another host
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
        rep.problems.push_back(msg(kVerify, ": the chunk of ", quote(key), " at ", shape(c.offsets),
                                   " has no storage entry"));
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
  std::map<std::string, int64_t> stored = dcp::stored_bytes(r.metadata());
  std::set<std::string> files_seen;
  for (const auto& [idx, s] : r.metadata().storage_data) {
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

void assemble(const std::vector<std::string>& dirs, const std::string& out_in, FileIO* io_in) {
  constexpr const char* kAssemble = "checkpoint assemble";
  FileIO& io = io_in ? *io_in : default_file_io();
  if (dirs.empty()) throw ValueError(msg(kAssemble, ": no directories to assemble"));
  const std::string out = files::normalize(out_in);
  if (io.is_dir(out) != 0 || io.file_size(out) >= 0)
    throw ValueError(msg(kAssemble, ": ", out, " already exists"));
  // The first directory's `.metadata` is copied as it was read.
  const CheckpointReader::Files kept = CheckpointReader::read_files(io, dirs[0], kAssemble);
  std::vector<std::unique_ptr<CheckpointReader>> parts;  // not copied: it points into itself
  parts.push_back(std::make_unique<CheckpointReader>(io, dirs[0], kept, true, kAssemble));
  for (size_t i = 1; i < dirs.size(); ++i)
    parts.push_back(std::make_unique<CheckpointReader>(io, dirs[i], /*verify=*/true, kAssemble));
  const CheckpointReader& first = *parts[0];
  if (!first.manifest())
    throw ValueError(msg(kAssemble, ": ", first.dir(), " has no ", manifest::kFileName));
  manifest::Manifest whole = *first.manifest();
  for (const auto& p : parts)
    if (!p->manifest() || p->manifest()->metadata_xxh3 != whole.metadata_xxh3)
      throw ValueError(msg(kAssemble, ": ", p->dir(), " and ", first.dir(),
                           " hold different checkpoints (their .metadata differ)"));
  const std::string partial =
      files::join(files::parent_of(out), "." + files::base_of(out) + ".partial");
  files::make_dirs(io, files::parent_of(out), kAssemble);
  files::remove_tree(io, partial, kAssemble);
  if (io.mkdir(partial, 0755) != 0) {
    const int err = errno;  // before the message allocates
    files::io_error(kAssemble, "creating", partial, err);
  }
  try {
    std::vector<char> block(size_t{1} << 20);
    for (const auto& entry : whole.files) {
      const std::string& file = entry.first;  // a lambda captures no structured binding in C++17
      const int64_t size = entry.second;
      auto from = std::find_if(parts.begin(), parts.end(), [&](const auto& p) {
        return p->manifest()->holds(file) && io.file_size(files::join(p->dir(), file)) == size;
      });
      if (from == parts.end())
        throw ValueError(msg(kAssemble, ": no directory holds ", quote(file), " (", size,
                             " bytes): its host's directory is missing from the list"));
      const std::string src = files::join((*from)->dir(), file);
      files::OutFile dst(io, files::join(partial, file), kAssemble);
      for (int64_t at = 0; at < size;) {
        const int64_t n = std::min<int64_t>(static_cast<int64_t>(block.size()), size - at);
        files::pread_all(io, src, at, n, block.data(), kAssemble);
        dst.append(block.data(), static_cast<size_t>(n));
        at += n;
      }
      dst.finish();
    }
    whole.local_files.clear();
    files::write_file(io, files::join(partial, ".metadata"), kept.metadata, kAssemble);
    files::write_file(io, files::join(partial, manifest::kFileName), manifest::to_json(whole),
                      kAssemble);
    files::sync_dir(io, partial, kAssemble);
    if (io.rename(partial, out) != 0) {
      const int err = errno;  // before the message allocates
      files::io_error(kAssemble, "renaming", msg(partial, " to ", out), err);
    }
    files::sync_dir(io, files::parent_of(out), kAssemble);
  } catch (...) {
    files::remove_tree(io, partial, kAssemble);
    throw;
  }
  const VerifyReport rep = verify(out, &io);
  if (!rep.ok()) {
    files::remove_tree(io, out, kAssemble);
    throw CorruptionError(msg(kAssemble, ": the assembled ", out,
                              " fails verification (removed): ", rep.problems.front()));
  }
}

std::map<std::string, int64_t> dcp::stored_bytes(const Metadata& md) {
  std::map<std::string, int64_t> stored;
  for (const auto& [idx, s] : md.storage_data) {
    int64_t& n = stored[idx.fqn];
    if (__builtin_add_overflow(n, std::max<int64_t>(s.length, 0), &n))
      n = std::numeric_limits<int64_t>::max();
  }
  return stored;
}

void dcp::check_claim(const char* what, const std::string& where, const std::string& key,
                      int64_t nbytes, int64_t stored) {
  if (nbytes <= stored) return;
  throw CorruptionError(msg(what, ": ", quote(key), " claims ", nbytes, " bytes, but ", where,
                            " stores ", stored,
                            " for it: its metadata is damaged (nothing was allocated for it)"));
}

StateDict full_template(const CheckpointInfo& info) {
  for (const auto& e : info.entries) {
    if (e.tensor) {
      dcp::check_claim("full_template", "the checkpoint", e.key,
                       formats::checked_nbytes(e.shape, e.dtype, msg(quote(e.key))),
                       e.stored_bytes);
    }
  }
  StateDict t;
  for (const auto& e : info.entries)
    t.insert_or_assign(e.key,
                       e.tensor ? StateValue(at::empty(e.shape, at::TensorOptions().dtype(e.dtype)))
                                : StateValue());
  return t;
}

}  // namespace checkpoint
}  // namespace fsdp
