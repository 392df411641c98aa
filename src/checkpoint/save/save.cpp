// Atomic, checksummed DCP saves (fsdp/checkpoint/checkpoint.h); step directories are in
// step_dirs.cpp, the node-local protocol in node_local.cpp (save_run.h).
//
// The shared protocol, collective over the group (ranks share the file system):
//   1. prepare: rank 0 creates the parent, removes stale `.<name>.partial` leftovers and creates a
//      fresh one; its verdict is broadcast, so nobody writes into a directory being removed.
//   2. write: each rank streams its items into `.<name>.partial/__<rank>_0.distcp`, hashing each,
//      and fsyncs the file; then all ranks exchange their metadata and checksums, or their error.
//   3. commit (rank 0, only if every rank succeeded): `.metadata` and `.fsdp_manifest.json` into
//      the partial directory, fsync it; then every rank agrees to the commit (one small
//      exchange: a rank lost before it, or while it runs, leaves nothing committed); then swap it
//      with `<name>` in one rename (RENAME_EXCHANGE when a checkpoint is already there, so the
//      name always points at a complete one), fsync the parent, remove the old one; its verdict
//      is broadcast (a rank lost then had agreed: the checkpoint it agreed to stands).
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
#include <memory>
#include <optional>
#include <set>

#include "checkpoint/dcp/items.h"
#include "checkpoint/dcp/manifest.h"
#include "checkpoint/dcp/metadata.h"
#include "checkpoint/save/protocol.h"
#include "checkpoint/save/save_run.h"
#include "checkpoint/storage/files.h"
#include "dist/agreement.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/errors.h"
#include "fsdp_version.h"  // generated: FSDP_VERSION_STRING
#include "util/message.h"

namespace fsdp {
namespace checkpoint {
namespace {

using save_run::kWhat;
using save_run::RankPart;
using save_run::SaveState;

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

std::string encode(const RankPart& p) {
  std::string meta = dcp::encode_wire(p.meta);
  std::string out = std::to_string(meta.size()) + "\n" + meta + p.file + "\n" +
                    std::to_string(p.file_size) + "\n";
  for (const auto& h : p.hashes) out += h + "\n";
  return out;
}

RankPart decode(const std::string& msg, int rank) {
  const std::string where = detail::msg(detail::rank(rank), "'s save report");
  // Our own message between ranks: one that does not parse is a bug, not bad input.
  auto fail = [&]() -> RankPart {
    throw InternalError(detail::msg(kWhat, ": ", where, " is malformed"));
  };
  size_t pos = 0;
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
      throw InternalError(
          detail::msg(kWhat, ": ", detail::rank(rank), "'s list of pieces is malformed"));
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

}  // namespace

namespace save_run {

// The commit's first half: `.metadata` and the manifest (naming `local_files` in a node-local
// save) into `partial`, fsynced with it.
void write_commit_files(FileIO& io, const std::vector<RankPart>& parts, const std::string& partial,
                        const Annotations& annotations, std::vector<std::string> local_files) {
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
  mf.local_files = std::move(local_files);
  files::write_file(io, files::join(partial, ".metadata"), meta_bytes, kWhat);
  files::write_file(io, files::join(partial, manifest::kFileName), manifest::to_json(mf), kWhat);
  files::sync_dir(io, partial, kWhat);
}

// The commit's second half: the complete `partial` swapped into `dir`, the old one removed.
void install(FileIO& io, const std::string& partial, const std::string& dir) {
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

std::vector<RankPart> SaveState::parts() const {
  std::vector<RankPart> out;
  for (size_t r = 0; r < reports.size(); ++r)
    out.push_back(decode(reports[r], static_cast<int>(r)));
  return out;
}

void SaveState::throw_first_failure(const dist::Verdicts& verdicts, const char* what) const {
  verdicts.throw_first([&](int r, const std::string& e) {
    return detail::msg(kWhat, " of ", dir, ": ", what, detail::rank(r), ": ", e);
  });
}

dist::Verdict SaveState::on_leader(const std::function<void()>& step) const {
  if (!leader) return dist::Verdict();
  return dist::Verdict::of([&] {
    step();
    return std::string();
  });
}

void SaveState::remove_partial_on_leader() const {
  if (!leader) return;
  try {
    files::remove_tree(*io, partial, kWhat);
  } catch (const std::exception&) {  // the save's own error is the one to report
  }
}

}  // namespace save_run

namespace {

using protocol::Hook;

// One directory on a file system every rank shares. Rank 0 commits (the manifest, .metadata, the
// rename into place) only once every rank has agreed to it, so that a rank lost before the commit
// leaves none (issue 62, item 3: the commit used to come before the last exchange, and a rank
// lost in it left a checkpoint committed by a save that failed). Its verdict is broadcast and
// every rank returns or throws together.
class SharedDirectory final : public save_run::Protocol {
 public:
  void find_leader(SaveState& s) override { s.leader = s.rank == 0; }

  void commit(SaveState& s, const Annotations& annotations,
              const std::function<void()>& after_commit) override {
    dist::Verdict mine = s.on_leader(
        [&] { save_run::write_commit_files(*s.io, s.parts(), s.partial, annotations, {}); });
    // The agreement: rank 0's files are ready, and every rank is still here to say so (a rank
    // lost here fails this exchange on every other rank, rank 0 included, before the commit).
    if (s.exchange(mine).ok()) {
      mine = s.on_leader([&] {
        save_run::install(*s.io, s.partial, s.dir);
        if (after_commit) after_commit();
      });
    }
    const dist::Verdict committed = dist::broadcast_verdict(s.group, mine, 0);
    if (committed.ok()) return;
    if (s.rank == 0) committed.raise(committed.message());
    committed.raise(detail::msg(committed.message(), " (on rank 0)"));
  }
};

// One collective save: the phases every save runs, around those of its protocol (save_run.h).
// Each phase ends in an exchange, so every rank leaves at the same phase and throws the same kind
// of error (dist/agreement.h); after a failure the leader removes the partial directory, which no
// rank writes to any more.
class SaveRun {
 public:
  SaveRun(const SaveOptions& o, const std::string& dir_in) {
    s_.group = o.group();
    s_.io = o.io() ? o.io() : &default_file_io();
    if (!s_.group && dist::is_initialized()) s_.group = &dist::default_group();
    s_.rank = s_.group ? s_.group->rank() : 0;
    s_.dir = files::normalize(dir_in);
    const std::string name = files::base_of(s_.dir);
    if (name == "." || name == ".." || name == "/")
      throw ValueError(
          detail::msg(kWhat, ": ", detail::quote(dir_in), " does not name a directory to create"));
    s_.partial = files::join(files::parent_of(s_.dir), "." + name + ".partial");
    if (o.replicas() < 1 || (o.replicas() > 1 && !o.node_local()))
      throw ValueError(detail::msg(kWhat, " of ", s_.dir, ": replicas(", o.replicas(), ") ",
                                   o.replicas() < 1
                                       ? "must be at least 1"
                                       : "needs node_local(true): on a shared file "
                                         "system every file is already on every host"));
    if (o.node_local() && s_.group && s_.group->size() > 1)
      protocol_ = save_run::node_local_directories(o.replicas());
    else
      protocol_ = std::make_unique<SharedDirectory>();
  }
  SaveRun(const SaveRun&) = delete;
  SaveRun& operator=(const SaveRun&) = delete;

  void run(const StateDict& state_dict, const Annotations& annotations, const Hook& before_prepare,
           const Hook& after_commit) {
    protocol_->find_leader(s_);
    prepare(state_dict, before_prepare);
    write();
    protocol_->after_write(s_);
    protocol_->commit(s_, annotations, after_commit);
  }

 private:
  // 1. The leader makes the partial directory; every rank says which boxes it holds, so that a
  // box several ranks hold (replicas under HYBRID_SHARD, NO_SHARD optimizer state) is written
  // once, by the lowest of them (DCP's dedup_save_plans). One small exchange.
  void prepare(const StateDict& state_dict, const Hook& before_prepare) {
    dist::Verdict mine = s_.on_leader([&] {
      // An earlier save's removal may still be running over the names cleaned up here.
      files::wait_for_background_removal();
      protocol_->clear_leftovers(s_);
      if (before_prepare) before_prepare();
      FileIO& io = *s_.io;
      files::make_dirs(io, files::parent_of(s_.dir), kWhat);
      restore_aside(io, s_.dir);
      files::remove_tree(io, s_.partial, kWhat);
      files::remove_tree(io, s_.partial + ".old", kWhat);
      if (io.mkdir(s_.partial, 0755) != 0) {
        const int err = errno;  // before the message allocates
        files::io_error(kWhat, "creating", s_.partial, err);
      }
    });
    // DCP's flattening, once: the box lists and the writing both walk it.
    sd_ = state_dict;  // containers only; tensors are shared
    if (mine.ok()) {
      mine = dist::Verdict::of([&] {
        flat_ = items::flatten(sd_);
        return held_chunks(flat_);
      });
    }
    const dist::Verdicts prepared = s_.exchange(mine);
    try {
      prepared.throw_first([](int r, const std::string& e) {
        return detail::msg(e, " (on ", detail::rank(r), ")");
      });
      for (int r = 0; r < static_cast<int>(prepared.size()); ++r)
        parse_held(prepared[static_cast<size_t>(r)].payload(), 0, r < s_.rank ? &skip_ : nullptr,
                   r);
    } catch (...) {
      s_.remove_partial_on_leader();
      throw;
    }
  }

  // 2. Every rank writes its file of the boxes it is the lowest holder of; the reports (what it
  // wrote, with checksums, or its failure) are exchanged.
  void write() {
    const dist::Verdicts reports = s_.exchange(dist::Verdict::of([&] {
      return encode(write_items(flat_, *s_.io, s_.partial,
                                "__" + std::to_string(s_.rank) + "_0.distcp", s_.rank, skip_));
    }));
    if (!reports.ok()) {
      s_.remove_partial_on_leader();
      reports.throw_first([&](int, const std::string&) {  // the first one's kind, every failure
        return detail::msg(kWhat, " of ", s_.dir,
                           " failed, nothing was committed: ", reports.failures());
      });
    }
    s_.reports = reports.payloads();
  }

  SaveState s_;
  std::unique_ptr<save_run::Protocol> protocol_;
  StateDict sd_;  // the caller's containers; flat_ points into them
  std::vector<items::FlatItem> flat_;
  std::set<std::string> skip_;  // boxes a lower rank writes
};

void save_impl(const StateDict& state_dict, const std::string& dir, const SaveOptions& o,
               const Hook& before_prepare, const Hook& after_commit) {
  SaveRun(o, dir).run(state_dict, o.annotations(), before_prepare, after_commit);
}

}  // namespace

std::string protocol::aside_of(const std::string& dir) { return checkpoint::aside_of(dir); }
void protocol::restore_aside(FileIO& io, const std::string& dir) {
  checkpoint::restore_aside(io, dir);
}
void protocol::save_impl(const StateDict& state_dict, const std::string& dir,
                         const SaveOptions& options, const Hook& before_prepare,
                         const Hook& after_commit) {
  checkpoint::save_impl(state_dict, dir, options, before_prepare, after_commit);
}

void save(const StateDict& state_dict, const std::string& dir, const SaveOptions& options) {
  save_impl(state_dict, dir, options, {}, {});
}

void save(const StateDict& state_dict, const std::string& dir, dist::ProcessGroup* group) {
  save(state_dict, dir, SaveOptions().group(group));
}

}  // namespace checkpoint
}  // namespace fsdp
