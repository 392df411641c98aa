// Atomic, checksummed DCP saves (fsdp/checkpoint/checkpoint.h) and step directories.
//
// The protocol, collective over the group (ranks share the file system):
//   1. prepare: rank 0 creates the parent, removes stale `.<name>.partial` leftovers and creates a
//      fresh one; its verdict is broadcast, so nobody writes into a directory being removed.
//   2. write: each rank streams its items into `.<name>.partial/__<rank>_0.distcp`, hashing each,
//      and fsyncs the file; then all ranks exchange their metadata and checksums, or their error.
//   3. commit (rank 0, only if every rank succeeded): `.metadata` and `.fsdp_manifest.json` into
//      the partial directory, fsync it, swap it with `<name>` in one rename (RENAME_EXCHANGE when a
//      checkpoint is already there, so the name always points at a complete one), fsync the
//      parent, remove the old one; its verdict is broadcast.
// A crash anywhere before the swap leaves only the partial directory, which nothing reads.
// Where the file system cannot swap (NFS, older kernels), the old checkpoint is first renamed to
// `.<name>.aside`, then the new one in: a crash between the two leaves the old one complete at
// `.aside`, which latest_checkpoint returns and the next save into `<name>` renames back.
#include <torch/version.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <set>

#include "checkpoint/dcp_items.h"
#include "checkpoint/dcp_metadata.h"
#include "checkpoint/files.h"
#include "checkpoint/manifest.h"
#include "checkpoint/wire_error.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/errors.h"
#include "util/message.h"

namespace fsdp {
namespace checkpoint {
namespace {

constexpr const char* kWhat = "checkpoint save";

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

// What one rank wrote: DCP metadata for its items plus, in storage_data order, their checksums.
struct RankPart {
  dcp::Metadata meta;
  std::vector<std::string> hashes;
  std::string file;
  int64_t file_size = 0;
};

std::string encode(const RankPart& p) {
  std::string meta = dcp::encode_wire(p.meta);
  std::string out = "M" + std::to_string(meta.size()) + "\n" + meta + p.file + "\n" +
                    std::to_string(p.file_size) + "\n";
  for (const auto& h : p.hashes) out += h + "\n";
  return out;
}

RankPart decode(const std::string& msg, int rank) {
  const std::string where = detail::msg(detail::rank(rank), "'s save report");
  auto fail = [&]() -> RankPart { throw Error(detail::msg(kWhat, ": ", where, " is malformed")); };
  size_t pos = 1;
  auto line = [&]() {
    const size_t nl = msg.find('\n', pos);
    if (nl == std::string::npos) fail();
    std::string s = msg.substr(pos, nl - pos);
    pos = nl + 1;
    return s;
  };
  RankPart p;
  const size_t n = std::stoull(line());
  if (n > msg.size() - pos) return fail();
  p.meta = dcp::decode_wire(msg.substr(pos, n), where);
  pos += n;
  p.file = line();
  p.file_size = std::stoll(line());
  while (pos < msg.size()) p.hashes.push_back(line());
  if (p.hashes.size() != p.meta.storage_data.size()) return fail();
  return p;
}

// A sharded tensor's box, as the prepare exchange names it.
std::string chunk_id(const std::string& key, const std::vector<int64_t>& offsets) {
  std::string id = key;
  for (int64_t o : offsets) id += "\0" + std::to_string(o);
  return id;
}

// The boxes this rank holds, length-prefixed ("<n>:<id>" each; keys may hold any byte).
std::string held_chunks(const std::vector<items::FlatItem>& flat) {
  std::string out;
  for (const items::FlatItem& it : flat) {
    if (!it.value->is_sharded_tensor()) continue;
    for (const auto& s : it.value->sharded_tensor().local_shards()) {
      const std::string id = chunk_id(it.key, s.metadata.offsets);
      out += std::to_string(id.size()) + ":" + id;
    }
  }
  return out;
}

// Every rank checks every list (so all ranks agree on failing); only lower ranks' go `into`.
void parse_held(const std::string& msg, size_t pos, std::set<std::string>* into, int rank) {
  while (pos < msg.size()) {
    const size_t colon = msg.find(':', pos);
    size_t n = 0;
    if (colon == std::string::npos || colon == pos || colon - pos > 18 ||
        msg.find_first_not_of("0123456789", pos) != colon ||
        (n = std::stoull(msg.substr(pos, colon - pos))) > msg.size() - colon - 1)
      throw Error(detail::msg(kWhat, ": ", detail::rank(rank), "'s list of pieces is malformed"));
    if (into) into->insert(msg.substr(colon + 1, n));
    pos = colon + 1 + n;
  }
}

// Writes this rank's items (`flat`, DCP's flattening of its state dict) into `path`, except the
// boxes in `skip` (a lower rank writes those); returns what it wrote.
RankPart write_items(const std::vector<items::FlatItem>& flat, FileIO& io, const std::string& dir,
                     const std::string& file, int rank, const std::set<std::string>& skip) {
  RankPart part;
  part.file = file;
  files::OutFile out(io, files::join(dir, file), kWhat);
  std::map<std::string, size_t> index;
  // Each item is streamed into the file and hashed on the way, with no copy of its bytes.
  auto store = [&](dcp::Index idx, const std::function<void(const items::ByteSink&)>& produce) {
    const int64_t at = out.size();
    files::Xxh3Stream hash;
    produce([&](const char* data, size_t n) {
      out.append(data, n);
      hash.update(data, n);
    });
    part.meta.storage_data.emplace_back(std::move(idx),
                                        dcp::StorageInfo{file, at, out.size() - at});
    part.hashes.push_back(hash.hex());
  };
  for (const items::FlatItem& it : flat) {
    const StateValue& v = *it.value;
    if (rank == 0) part.meta.planner_data.emplace_back(it.key, it.path);
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
        for (const auto& s : v.sharded_tensor().local_shards()) {
          if (skip.count(chunk_id(it.key, s.metadata.offsets))) continue;
          chunks.emplace_back(dcp::ChunkMeta{s.metadata.offsets, s.metadata.sizes}, s.tensor);
        }
      }
      for (const auto& [c, t] : chunks) {
        item.tensor.chunks.push_back(c);
        store(dcp::Index{it.key, c.offsets, 0},
              [&t = t](const items::ByteSink& sink) { items::write_tensor_item(t, sink); });
      }
      merge_item(part.meta, index, it.key, item);
    } else if (rank == 0) {
      dcp::ItemMeta item;
      item.bytes = true;
      merge_item(part.meta, index, it.key, item);
      const std::string payload = items::value_payload(v, it.key);
      store(dcp::Index{it.key, std::nullopt, std::nullopt},
            [&payload](const items::ByteSink& sink) { sink(payload.data(), payload.size()); });
    }
  }
  out.finish();
  part.file_size = out.size();
  return part;
}

std::string torch_version() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}

// Where a save without an atomic swap keeps the old checkpoint while the new one moves in.
std::string aside_of(const std::string& dir) {
  return files::join(files::parent_of(dir), "." + files::base_of(dir) + ".aside");
}

// Undoes a save that died between its two renames (file systems without RENAME_EXCHANGE): the
// old checkpoint at `.aside` goes back to `dir` if nothing took its place, else it is garbage.
void restore_aside(FileIO& io, const std::string& dir) {
  const std::string aside = aside_of(dir);
  if (io.is_dir(aside) != 1) return;
  if (io.is_dir(dir) == 1) {
    files::remove_tree(io, aside, kWhat);
    return;
  }
  if (io.rename(aside, dir) != 0) {
    const int err = errno;  // before the message allocates
    files::io_error(kWhat, "restoring", detail::msg(aside, " to ", dir), err);
  }
  files::sync_dir(io, files::parent_of(dir), kWhat);
}

// Moves the complete checkpoint at `partial` to `dir` for good (the parent fsynced). Returns what
// is left to remove: the replaced checkpoint, moved to `partial + ".old"` (or, where that rename
// failed, wherever it is), or "" if nothing was replaced.
std::string move_into_place(FileIO& io, const std::string& partial, const std::string& dir) {
  const std::string parent = files::parent_of(dir), old = partial + ".old";
  const int existing = io.is_dir(dir);
  if (existing < 0) {
    const int err = errno;  // before the message allocates
    files::io_error(kWhat, "checking", dir, err);
  }
  if (existing == 0) {
    if (io.file_size(dir) >= 0)
      throw ValueError(detail::msg(kWhat, ": ", dir, " exists and is not a directory"));
    if (io.rename(partial, dir) != 0) {
      const int err = errno;  // before the message allocates
      files::io_error(kWhat, "renaming", detail::msg(partial, " to ", dir), err);
    }
    files::sync_dir(io, parent, kWhat);
    return "";
  }
  if (io.exchange(partial, dir) == 0) {
    // `partial` now holds the replaced checkpoint.
    const std::string garbage = io.rename(partial, old) == 0 ? old : partial;
    files::sync_dir(io, parent, kWhat);
    return garbage;
  }
  if (errno != EINVAL && errno != ENOSYS) {
    const int err = errno;  // before the message allocates
    files::io_error(kWhat, "swapping", detail::msg(partial, " with the checkpoint at ", dir), err);
  }
  // No atomic swap here: move the old one aside first, under the name readers and the next save
  // look for (restore_aside), and put it back if the new one cannot take its place.
  const std::string aside = aside_of(dir);
  if (io.rename(dir, aside) != 0) {
    const int err = errno;  // before the message allocates
    files::io_error(kWhat, "replacing the checkpoint at", dir, err);
  }
  if (io.rename(partial, dir) != 0) {
    const int err = errno;  // before the message allocates
    io.rename(aside, dir);
    files::io_error(kWhat, "replacing the checkpoint at", dir, err);
  }
  files::sync_dir(io, parent, kWhat);
  return io.rename(aside, old) == 0 ? old : aside;  // garbage once the new one is durable
}

// Rank 0's commit: metadata and manifest into `partial`, then the swap into `dir`.
void commit(FileIO& io, const std::vector<RankPart>& parts, const std::string& partial,
            const std::string& dir, const Annotations& annotations) {
  dcp::Metadata merged;
  manifest::Manifest mf;
  std::map<std::string, size_t> index;
  for (const RankPart& p : parts) {
    for (const auto& [k, item] : p.meta.state_dict_metadata) merge_item(merged, index, k, item);
    for (size_t i = 0; i < p.meta.storage_data.size(); ++i) {
      const auto& [idx, info] = p.meta.storage_data[i];
      mf.items.push_back(
          manifest::Item{idx.fqn, info.relative_path, info.offset, info.length, p.hashes[i]});
      merged.storage_data.push_back(p.meta.storage_data[i]);
    }
    if (merged.planner_data.empty()) merged.planner_data = p.meta.planner_data;
    mf.files[p.file] = p.file_size;
  }
  const std::string meta_bytes = dcp::serialize_metadata(merged);
  mf.library_version = FSDP_VERSION_STRING;
  mf.torch_version = torch_version();
  mf.world_size = static_cast<int>(parts.size());
  mf.created_unix = std::chrono::duration_cast<std::chrono::seconds>(
                        std::chrono::system_clock::now().time_since_epoch())
                        .count();
  mf.annotations = annotations;
  mf.metadata_xxh3 = files::xxh3_hex(meta_bytes);
  files::write_file(io, files::join(partial, ".metadata"), meta_bytes, kWhat);
  files::write_file(io, files::join(partial, manifest::kFileName), manifest::to_json(mf), kWhat);
  files::sync_dir(io, partial, kWhat);

  const std::string garbage = move_into_place(io, partial, dir);
  try {
    // The replaced checkpoint is unlinked in the background (tens of milliseconds for a large
    // one, which no rank waits for; the next save waits for it and removes a leftover of a
    // process that died first).
    if (garbage == partial + ".old")
      files::remove_tree_in_background(io, {garbage}, kWhat);
    else if (!garbage.empty())
      files::remove_tree(io, garbage, kWhat);  // it could not be renamed out of the way
  } catch (const std::exception& e) {
    TORCH_WARN("fsdp checkpoint: committed ", dir,
               " but could not remove the old copy: ", e.what());
  }
}

// Broadcasts rank 0's verdict (empty: fine).
std::string verdict(dist::ProcessGroup* group, const std::string& mine) {
  return group ? group->broadcast_bytes(mine, 0) : mine;
}

using Hook = std::function<void()>;

// One collective save in its three phases. Each phase ends in an exchange, so every rank leaves
// at the same phase and throws the same kind of error (wire_error.h); after a failure rank 0
// removes the partial directory, which no rank writes to any more.
class SaveRun {
 public:
  SaveRun(const SaveOptions& o, const std::string& dir_in)
      : group_(o.group()), io_(o.io() ? *o.io() : default_file_io()) {
    if (!group_ && dist::is_initialized()) group_ = &dist::default_group();
    rank_ = group_ ? group_->rank() : 0;
    dir_ = files::normalize(dir_in);
    const std::string name = files::base_of(dir_);
    if (name == "." || name == ".." || name == "/")
      throw ValueError(
          detail::msg(kWhat, ": ", detail::quote(dir_in), " does not name a directory to create"));
    partial_ = files::join(files::parent_of(dir_), "." + name + ".partial");
  }
  SaveRun(const SaveRun&) = delete;
  SaveRun& operator=(const SaveRun&) = delete;

  // 1. Rank 0 makes the partial directory; every rank says which boxes it holds, so that a box
  // several ranks hold (replicas under HYBRID_SHARD, NO_SHARD optimizer state) is written once,
  // by the lowest of them (DCP's dedup_save_plans). One small exchange.
  void prepare(const StateDict& state_dict, const Hook& before_prepare) {
    std::string error;  // encoded (wire_error.h)
    if (rank_ == 0) {
      try {
        // An earlier save's removal may still be running over the names cleaned up here.
        files::wait_for_background_removal();
        if (before_prepare) before_prepare();
        files::make_dirs(io_, files::parent_of(dir_), kWhat);
        restore_aside(io_, dir_);
        files::remove_tree(io_, partial_, kWhat);
        files::remove_tree(io_, partial_ + ".old", kWhat);
        if (io_.mkdir(partial_, 0755) != 0) {
          const int err = errno;  // before the message allocates
          files::io_error(kWhat, "creating", partial_, err);
        }
      } catch (const std::exception& e) {
        error = wire::encode(e);
      }
    }
    // DCP's flattening, once: the box lists and the writing both walk it.
    sd_ = state_dict;  // containers only; tensors are shared
    std::string held;
    try {
      if (error.empty()) {
        flat_ = items::flatten(sd_);
        held = "O" + held_chunks(flat_);
      }
    } catch (const std::exception& e) {
      error = wire::encode(e);
    }
    if (!error.empty()) held = "E" + error;
    const std::vector<std::string> prepared =
        group_ ? group_->all_gather_bytes(held) : std::vector<std::string>{held};
    error.clear();  // now the first failure of any rank
    std::string text;
    for (int r = 0; r < static_cast<int>(prepared.size()) && error.empty(); ++r) {
      const std::string& m = prepared[r];
      if (m.empty() || m[0] != 'O') {
        error = m.empty() ? std::string("Eno report") : m.substr(1);
        text = detail::msg(wire::message(error), " (on ", detail::rank(r), ")");
      } else {
        try {
          parse_held(m, 1, r < rank_ ? &skip_ : nullptr, r);
        } catch (const std::exception& e) {
          error = wire::encode(e);
          text = e.what();
        }
      }
    }
    if (!error.empty()) {
      remove_partial_on_rank0();
      wire::rethrow(error, text);
    }
  }

  // 2. Every rank writes its file of the boxes it is the lowest holder of; the reports (what it
  // wrote, with checksums, or its failure) are exchanged.
  void write() {
    std::string msg;
    try {
      msg = encode(write_items(flat_, io_, partial_, "__" + std::to_string(rank_) + "_0.distcp",
                               rank_, skip_));
    } catch (const std::exception& e) {
      msg = "E" + wire::encode(e);
    }
    reports_ = group_ ? group_->all_gather_bytes(msg) : std::vector<std::string>{msg};
    std::string failures, first;  // `first`: the first failure, encoded, whose kind is thrown
    for (size_t r = 0; r < reports_.size(); ++r) {
      if (!reports_[r].empty() && reports_[r][0] == 'M') continue;
      const std::string e = reports_[r].empty() ? std::string("Eno report") : reports_[r].substr(1);
      if (first.empty()) first = e;
      failures +=
          detail::msg(failures.empty() ? "" : "; ", detail::rank(r), ": ", wire::message(e));
    }
    if (!failures.empty()) {
      remove_partial_on_rank0();
      wire::rethrow(first,
                    detail::msg(kWhat, " of ", dir_, " failed, nothing was committed: ", failures));
    }
  }

  // 3. Rank 0 commits (the manifest, .metadata, the rename into place); its verdict is broadcast
  // and every rank returns or throws together.
  void finish(const Annotations& annotations, const Hook& after_commit) {
    std::string error;
    if (rank_ == 0) {
      try {
        std::vector<RankPart> parts;
        for (size_t r = 0; r < reports_.size(); ++r)
          parts.push_back(decode(reports_[r], static_cast<int>(r)));
        commit(io_, parts, partial_, dir_, annotations);
        if (after_commit) after_commit();
      } catch (const std::exception& e) {
        error = wire::encode(e);
      }
    }
    error = verdict(group_, error);
    if (!error.empty())
      wire::rethrow(error, rank_ == 0 ? wire::message(error)
                                      : detail::msg(wire::message(error), " (on rank 0)"));
  }

 private:
  void remove_partial_on_rank0() {
    if (rank_ != 0) return;
    try {
      files::remove_tree(io_, partial_, kWhat);
    } catch (const std::exception&) {  // the save's own error is the one to report
    }
  }

  dist::ProcessGroup* group_;
  FileIO& io_;
  int rank_ = 0;
  std::string dir_, partial_;
  StateDict sd_;  // the caller's containers; flat_ points into them
  std::vector<items::FlatItem> flat_;
  std::set<std::string> skip_;        // boxes a lower rank writes
  std::vector<std::string> reports_;  // per rank: encoded RankPart, or "E" + error
};

void save_impl(const StateDict& state_dict, const std::string& dir, const SaveOptions& o,
               const Hook& before_prepare, const Hook& after_commit) {
  SaveRun run(o, dir);
  run.prepare(state_dict, before_prepare);
  run.write();
  run.finish(o.annotations(), after_commit);
}

bool parse_step(const std::string& name, int64_t& step) {
  if (name.size() <= 5 || name.compare(0, 5, "step_") != 0 || name.size() > 5 + 18) return false;
  step = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return false;
    step = step * 10 + (name[i] - '0');
  }
  return std::to_string(step) == name.substr(5);  // no leading zeros: one name per step
}

}  // namespace

void save(const StateDict& state_dict, const std::string& dir, const SaveOptions& options) {
  save_impl(state_dict, dir, options, {}, {});
}

void save(const StateDict& state_dict, const std::string& dir, dist::ProcessGroup* group) {
  save(state_dict, dir, SaveOptions().group(group));
}

std::string step_dir(const std::string& root, int64_t step) {
  return files::join(files::normalize(root), "step_" + std::to_string(step));
}

std::vector<int64_t> list_steps(const std::string& root, FileIO* io_in) {
  FileIO& io = io_in ? *io_in : default_file_io();
  std::vector<std::string> names;
  std::vector<int64_t> steps;
  if (io.is_dir(root) != 1) return steps;
  if (io.list_dir(root, names) != 0) {
    const int err = errno;  // before the message allocates
    files::io_error("checkpoint", "listing", root, err);
  }
  for (const auto& n : names) {
    int64_t s = 0;
    if (parse_step(n, s) && io.file_size(files::join(files::join(root, n), ".metadata")) >= 0)
      steps.push_back(s);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::string save_step(const StateDict& state_dict, const std::string& root_in, int64_t step,
                      const SaveOptions& options) {
  if (step < 0) throw ValueError(detail::msg("checkpoint save_step: step ", step, " < 0"));
  FileIO& io = options.io() ? *options.io() : default_file_io();
  const std::string root = files::normalize(root_in);
  const std::string dir = step_dir(root, step);
  auto clean_stale = [&] {
    std::vector<std::string> names;
    if (io.is_dir(root) != 1 || io.list_dir(root, names) != 0) return;
    for (const auto& n : names) {
      int64_t s = 0;
      // ".step_N.partial": a save that died; ".step_N.partial.old": a replaced or dropped step
      // whose removal did not finish; ".step_N.aside": step N, if a save replacing it without
      // an atomic swap died half way (restored, or removed if the new one made it).
      for (const std::string suffix : {".partial", ".partial.old", ".aside"}) {
        if (n.size() > 1 + suffix.size() && n[0] == '.' &&
            n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0 &&
            parse_step(n.substr(1, n.size() - 1 - suffix.size()), s)) {
          if (suffix == ".aside")
            restore_aside(io, step_dir(root, s));
          else
            files::remove_tree(io, files::join(root, n), kWhat);
          break;
        }
      }
    }
  };
  auto point_latest = [&] {
    const std::string tmp = files::join(root, ".latest.tmp");
    files::write_file(io, tmp, "step_" + std::to_string(step) + "\n", kWhat);
    if (io.rename(tmp, files::join(root, "latest")) != 0) {
      const int err = errno;  // before the message allocates
      files::io_error(kWhat, "renaming", tmp, err);
    }
    files::sync_dir(io, root, kWhat);
    if (options.keep_last() <= 0) return;
    std::vector<int64_t> steps = list_steps(root, &io);
    const auto keep = static_cast<size_t>(options.keep_last());
    // Dropped steps are renamed out of sight at once and unlinked in the background.
    std::vector<std::string> dropped;
    for (size_t i = 0; i + keep < steps.size(); ++i) {
      if (steps[i] == step) continue;
      const std::string old = step_dir(root, steps[i]);
      const std::string hidden =
          files::join(root, ".step_" + std::to_string(steps[i]) + ".partial.old");
      files::wait_for_background_removal();  // it may be removing `hidden` from an earlier save
      if (io.rename(old, hidden) == 0) {
        dropped.push_back(hidden);
      } else {
        TORCH_WARN("fsdp checkpoint: keep_last could not remove ", old, ": ", std::strerror(errno));
      }
    }
    if (dropped.empty()) return;
    // The renames reach the disk before any unlink inside them: else a power cut could keep an
    // unlink and lose the rename, and a half-removed step would be listed again (crash points,
    // tests/test_crash_points.cpp).
    files::sync_dir(io, root, kWhat);
    files::remove_tree_in_background(io, dropped, kWhat);
  };
  save_impl(state_dict, dir, options, clean_stale, point_latest);
  return dir;
}

std::optional<std::string> latest_checkpoint(const std::string& root_in, FileIO* io_in) {
  FileIO& io = io_in ? *io_in : default_file_io();
  const std::string root = files::normalize(root_in);
  const std::string pointer = files::join(root, "latest");
  if (io.file_size(pointer) >= 0) {
    std::string name = files::read_file(io, pointer, 4096, "checkpoint latest");
    while (!name.empty() && (name.back() == '\n' || name.back() == '\r')) name.pop_back();
    int64_t s = 0;
    if (parse_step(name, s)) {
      const std::string dir = files::join(root, name);
      if (io.file_size(files::join(dir, ".metadata")) >= 0) return dir;
      // A save replacing this step without an atomic swap died between its two renames.
      if (io.file_size(files::join(aside_of(dir), ".metadata")) >= 0) return aside_of(dir);
    }
    TORCH_WARN("fsdp checkpoint: ", pointer, " names '", name,
               "', which is not a committed checkpoint; taking the newest step instead");
  }
  const std::vector<int64_t> steps = list_steps(root, &io);
  if (steps.empty()) return std::nullopt;
  return step_dir(root, steps.back());
}

}  // namespace checkpoint
}  // namespace fsdp
