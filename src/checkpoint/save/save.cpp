// Atomic, checksummed DCP saves (fsdp/checkpoint/checkpoint.h); step directories are in
// step_dirs.cpp.
//
// The protocol, collective over the group (ranks share the file system):
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
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <set>

#include "checkpoint/dcp/items.h"
#include "checkpoint/dcp/manifest.h"
#include "checkpoint/dcp/metadata.h"
#include "checkpoint/save/host_copies.h"
#include "checkpoint/save/protocol.h"
#include "checkpoint/storage/files.h"
#include "dist/agreement.h"
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

// A fresh name for one save's probe files (node-local saves), so that a probe a killed save
// left behind is never taken for a peer's.
std::string probe_nonce() {
  std::random_device rd;
  const uint64_t x =
      (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(x));
  return buf;
}

using protocol::Hook;

// The hosts of a node-local save from every rank's probe view (a '0'/'1' per rank: whose probe it
// sees, then '/' and its replicas): each a set of ranks that all see exactly that set. Computed
// alike on every rank, so all agree, or all throw the same error.
host_copies::Hosts hosts_of(const std::vector<std::string>& views, const std::string& parent) {
  const int world = static_cast<int>(views.size());
  host_copies::Hosts hosts;
  std::vector<bool> placed(views.size());
  for (int r = 0; r < world; ++r) {
    if (placed[static_cast<size_t>(r)]) continue;
    const std::string& view = views[static_cast<size_t>(r)];
    if (view[static_cast<size_t>(r)] != '1')
      throw IOError(
          detail::msg(kWhat, ": ", detail::rank(r), " cannot see its own probe in ", parent), 0);
    std::vector<int> host;
    for (int q = 0; q < world; ++q) {
      if (view[static_cast<size_t>(q)] != '1') continue;
      if (views[static_cast<size_t>(q)] != view || placed[static_cast<size_t>(q)])
        throw ValueError(detail::msg(kWhat, ": ranks ", r, " and ", q, " see different sets of ",
                                     "ranks sharing ", parent, ": a file system that is neither ",
                                     "shared nor node-local"));
      placed[static_cast<size_t>(q)] = true;
      host.push_back(q);
    }
    hosts.push_back(std::move(host));
  }
  return hosts;
}

// One collective save in its three phases. Each phase ends in an exchange, so every rank leaves
// at the same phase and throws the same kind of error (dist/agreement.h); after a failure rank 0
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
    if (o.replicas() < 1 || (o.replicas() > 1 && !o.node_local()))
      throw ValueError(detail::msg(kWhat, " of ", dir_, ": replicas(", o.replicas(), ") ",
                                   o.replicas() < 1
                                       ? "must be at least 1"
                                       : "needs node_local(true): on a shared file "
                                         "system every file is already on every host"));
    node_local_ = o.node_local() && group_ && group_->size() > 1;
    replicas_ = o.replicas();
    leader_ = rank_ == 0;
  }
  SaveRun(const SaveRun&) = delete;
  SaveRun& operator=(const SaveRun&) = delete;

  // Node-local saves: the ranks that see this rank's directory (its host), found by each leaving
  // an empty probe file beside `dir` and listing whose probes it sees. Every rank of a host must
  // see exactly the same ranks. The host's lowest rank leads it: it does what rank 0 does in a
  // shared save. Two small exchanges (three with the nonce's broadcast).
  void find_host() {
    if (!node_local_) return;
    const int world = group_->size();
    const std::string parent = files::parent_of(dir_);
    const std::string stem = "." + files::base_of(dir_) + ".probe-" +
                             group_->broadcast_bytes(rank_ == 0 ? probe_nonce() : "", 0) + "-";
    const std::string mine = files::join(parent, stem + std::to_string(rank_));
    const dist::Verdict probed = dist::Verdict::of([&] {
      files::make_dirs(io_, parent, kWhat);
      files::write_file(io_, mine, "", kWhat);
      return std::string();
    });
    try {
      throw_first_failure(exchange(probed), "probing which ranks share ");
    } catch (...) {
      io_.remove(mine);  // the save fails here: leave no probe behind
      throw;
    }
    const dist::Verdict seen = dist::Verdict::of([&] {
      std::string seen(static_cast<size_t>(world), '0');
      std::vector<std::string> names;
      if (io_.list_dir(parent, names) != 0) {
        const int err = errno;  // before the message allocates
        files::io_error(kWhat, "listing", parent, err);
      }
      for (const auto& n : names) {
        if (n.compare(0, stem.size(), stem) != 0) continue;
        const std::string r = n.substr(stem.size());
        if (!r.empty() && r.size() < 8 && r.find_first_not_of("0123456789") == std::string::npos &&
            std::stoi(r) < world)
          seen[static_cast<size_t>(std::stoi(r))] = '1';
      }
      return seen + "/" + std::to_string(replicas_);
    });
    const dist::Verdicts seen_by_all = exchange(seen);
    io_.remove(mine);  // every rank has listed: the probe has served (a failure leaves it to the
                       // next save's leader, which removes stale probes)
    throw_first_failure(seen_by_all, "probing which ranks share ");
    const std::vector<std::string> views = seen_by_all.payloads();
    // Every rank must plan the same copies (host_copies::receivers).
    const auto w = static_cast<size_t>(world);
    for (int r = 1; r < world; ++r)
      if (views[static_cast<size_t>(r)].substr(w) != views[0].substr(w))
        throw ValueError(detail::msg(
            kWhat, " of ", dir_, ": ranks 0 and ", r, " pass different SaveOptions::replicas (",
            views[0].substr(w + 1), " and ", views[static_cast<size_t>(r)].substr(w + 1), ")"));
    hosts_ = hosts_of(views, parent);
    for (const auto& h : hosts_)
      if (std::find(h.begin(), h.end(), rank_) != h.end()) host_ = h;
    leader_ = host_.front() == rank_;
    stale_probes_ = stem;
  }

  // 1. Rank 0 makes the partial directory; every rank says which boxes it holds, so that a box
  // several ranks hold (replicas under HYBRID_SHARD, NO_SHARD optimizer state) is written once,
  // by the lowest of them (DCP's dedup_save_plans). One small exchange.
  void prepare(const StateDict& state_dict, const Hook& before_prepare) {
    dist::Verdict mine;
    if (leader_) {
      mine = dist::Verdict::of([&] {
        // An earlier save's removal may still be running over the names cleaned up here.
        files::wait_for_background_removal();
        if (node_local_) remove_stale_probes();
        if (before_prepare) before_prepare();
        files::make_dirs(io_, files::parent_of(dir_), kWhat);
        restore_aside(io_, dir_);
        files::remove_tree(io_, partial_, kWhat);
        files::remove_tree(io_, partial_ + ".old", kWhat);
        if (io_.mkdir(partial_, 0755) != 0) {
          const int err = errno;  // before the message allocates
          files::io_error(kWhat, "creating", partial_, err);
        }
        return std::string();
      });
    }
    // DCP's flattening, once: the box lists and the writing both walk it.
    sd_ = state_dict;  // containers only; tensors are shared
    if (mine.ok()) {
      mine = dist::Verdict::of([&] {
        flat_ = items::flatten(sd_);
        return held_chunks(flat_);
      });
    }
    const dist::Verdicts prepared = exchange(mine);
    try {
      prepared.throw_first([](int r, const std::string& e) {
        return detail::msg(e, " (on ", detail::rank(r), ")");
      });
      for (int r = 0; r < static_cast<int>(prepared.size()); ++r)
        parse_held(prepared[static_cast<size_t>(r)].payload(), 0, r < rank_ ? &skip_ : nullptr, r);
    } catch (...) {
      remove_partial_on_leader();
      throw;
    }
  }

  // 2. Every rank writes its file of the boxes it is the lowest holder of; the reports (what it
  // wrote, with checksums, or its failure) are exchanged.
  void write() {
    const dist::Verdicts reports = exchange(dist::Verdict::of([&] {
      return encode(write_items(flat_, io_, partial_, "__" + std::to_string(rank_) + "_0.distcp",
                                rank_, skip_));
    }));
    if (!reports.ok()) {
      remove_partial_on_leader();
      reports.throw_first([&](int, const std::string&) {  // the first one's kind, every failure
        return detail::msg(kWhat, " of ", dir_,
                           " failed, nothing was committed: ", reports.failures());
      });
    }
    reports_ = reports.payloads();
  }

  // 2b. Node-local saves with replicas: every rank's file also goes to ranks of the next hosts
  // (host_copies.h), so a lost host's files are still somewhere. Ends in a verdict exchange.
  void copy_to_other_hosts() {
    if (!node_local_) return;
    copies_to_ = host_copies::receivers(hosts_, group_->size(), replicas_);
    if (std::all_of(copies_to_.begin(), copies_to_.end(), [](const auto& t) { return t.empty(); }))
      return;  // one host, or replicas(1)
    std::vector<std::string> names;
    std::vector<int64_t> sizes;
    for (const RankPart& p : parts()) {
      names.push_back(p.file);
      sizes.push_back(p.file_size);
    }
    const dist::Verdicts copied =
        exchange(host_copies::copy(*group_, io_, partial_, names, sizes, copies_to_));
    if (!copied.ok()) remove_partial_on_leader();
    throw_first_failure(copied, "nothing was committed: copying data files to other hosts, on ");
  }

  // 3. Rank 0 commits (the manifest, .metadata, the rename into place): only once every rank has
  // agreed to it, so that a rank lost before the commit leaves none (issue 62, item 3: the
  // commit used to come before the last exchange, and a rank lost in it left a checkpoint
  // committed by a save that failed). Its verdict is broadcast and every rank returns or throws
  // together.
  void finish(const Annotations& annotations, const Hook& after_commit) {
    if (node_local_) return finish_node_local(annotations, after_commit);
    dist::Verdict mine;
    if (rank_ == 0) {
      mine = dist::Verdict::of([&] {
        write_commit_files(io_, parts(), partial_, annotations, {});
        return std::string();
      });
    }
    // The agreement: rank 0's files are ready, and every rank is still here to say so (a rank
    // lost here fails this exchange on every other rank, rank 0 included, before the commit).
    if (exchange(mine).ok() && rank_ == 0) {
      mine = dist::Verdict::of([&] {
        install(io_, partial_, dir_);
        if (after_commit) after_commit();
        return std::string();
      });
    }
    const dist::Verdict committed = dist::broadcast_verdict(group_, mine, 0);
    if (committed.ok()) return;
    if (rank_ == 0) committed.raise(committed.message());
    committed.raise(detail::msg(committed.message(), " (on rank 0)"));
  }

 private:
  std::vector<RankPart> parts() const {
    std::vector<RankPart> out;
    for (size_t r = 0; r < reports_.size(); ++r)
      out.push_back(decode(reports_[r], static_cast<int>(r)));
    return out;
  }

  // A node-local commit, in two phases so that no host swaps in a step another host could not
  // complete: every leader makes its directory complete and durable; only if all succeeded does
  // each swap it in; only once every host holds the new step does after_commit run (the `latest`
  // pointer, keep_last's removals), so no host drops an old step another host still needs.
  void finish_node_local(const Annotations& annotations, const Hook& after_commit) {
    dist::Verdict mine;
    if (leader_) {
      mine = dist::Verdict::of([&] {
        std::vector<RankPart> all = parts();
        std::vector<std::string> local;  // none listed: one host holds every file
        if (hosts_.size() > 1)
          for (size_t r = 0; r < all.size(); ++r)
            if (on_this_host(static_cast<int>(r))) local.push_back(all[r].file);
        write_commit_files(io_, all, partial_, annotations, std::move(local));
        return std::string();
      });
    }
    const dist::Verdicts completed = exchange(mine);
    if (!completed.ok()) remove_partial_on_leader();
    throw_first_failure(completed, "nothing was committed: completing the directory of ");
    if (leader_) {
      mine = dist::Verdict::of([&] {
        install(io_, partial_, dir_);
        return std::string();
      });
    }
    throw_first_failure(exchange(mine),
                        "committed on some hosts only: swapping in the directory of ");
    if (leader_ && after_commit) {
      mine = dist::Verdict::of([&] {
        after_commit();
        return std::string();
      });
    }
    throw_first_failure(exchange(mine), "committed, then failed on the host of ");
  }

  // Whether this host's directory holds rank r's data file: r is one of its ranks, or sent a copy
  // to one of them.
  bool on_this_host(int r) const {
    auto here = [&](int q) { return std::find(host_.begin(), host_.end(), q) != host_.end(); };
    if (here(r)) return true;
    if (copies_to_.empty()) return false;
    const auto& to = copies_to_[static_cast<size_t>(r)];
    return std::any_of(to.begin(), to.end(), here);
  }

  // Every rank's verdict (dist/agreement.h).
  dist::Verdicts exchange(const dist::Verdict& mine) {
    return dist::exchange_verdicts(group_, mine);
  }
  // Throws, on every rank alike, the first failure among `verdicts`, saying `what` failed and on
  // which rank.
  void throw_first_failure(const dist::Verdicts& verdicts, const char* what) {
    verdicts.throw_first([&](int r, const std::string& e) {
      return detail::msg(kWhat, " of ", dir_, ": ", what, detail::rank(r), ": ", e);
    });
  }
  // Probe files of earlier node-local saves into this name that were killed before removing them.
  void remove_stale_probes() {
    const std::string parent = files::parent_of(dir_);
    const std::string prefix = "." + files::base_of(dir_) + ".probe-";
    std::vector<std::string> names;
    if (io_.list_dir(parent, names) != 0) return;
    for (const auto& n : names)
      if (n.compare(0, prefix.size(), prefix) == 0 &&
          n.compare(0, stale_probes_.size(), stale_probes_) != 0)
        io_.remove(files::join(parent, n));
  }

  void remove_partial_on_leader() {
    if (!leader_) return;
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
  std::vector<std::string> reports_;  // per rank: its encoded RankPart
  bool node_local_ = false;
  int replicas_ = 1;
  bool leader_ = false;                      // prepares and commits this rank's directory
  host_copies::Hosts hosts_;                 // node-local: every host's ranks
  std::vector<int> host_;                    // node-local: the ranks sharing this rank's directory
  std::vector<std::vector<int>> copies_to_;  // node-local: who holds a copy of each rank's file
  std::string stale_probes_;  // node-local: this save's probe names' prefix (not stale)
};

void save_impl(const StateDict& state_dict, const std::string& dir, const SaveOptions& o,
               const Hook& before_prepare, const Hook& after_commit) {
  SaveRun run(o, dir);
  run.find_host();
  run.prepare(state_dict, before_prepare);
  run.write();
  run.copy_to_other_hosts();
  run.finish(o.annotations(), after_commit);
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
