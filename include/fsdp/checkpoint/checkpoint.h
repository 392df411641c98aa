// fsdp/checkpoint/checkpoint.h: saving and loading a StateDict as a PyTorch DCP checkpoint
// directory (torch.distributed.checkpoint's FileSystem layout, docs/checkpoint_format.md), so
// that stock Python's dcp.load reads what we save and we load what dcp.save wrote; and, beyond
// DCP, checkpoints that are committed atomically, verified by checksums and safe to open.
//
//   auto [msd, osd] = fsdp::checkpoint::get_state_dict(model, opt);
//   fsdp::StateDict sd;
//   sd.insert_or_assign("model", msd);
//   sd.insert_or_assign("optim", osd);
//   fsdp::checkpoint::save_step(sd, "ckpt", step, SaveOptions().keep_last(3));  // ckpt/step_<N>
//   ...
//   if (auto dir = fsdp::checkpoint::latest_checkpoint("ckpt")) {
//     fsdp::checkpoint::load(sd, *dir);                  // fills sd's tensors in place
//     fsdp::checkpoint::set_state_dict(model, opt, sd.at("model").dict(), sd.at("optim").dict());
//   }
//
// Keys are DCP's (PyTorch 2.4+): nested dicts joined with dots, and lists by index where they hold
// dicts, tensors or such lists ("optim.state.fc.weight.exp_avg", "optim.param_groups.0.lr"); a
// list of plain values such as "params" or "betas" is one value. Every ShardedTensor piece is a
// chunk saved by the rank holding it (no tensor moves between ranks); plain tensors and other
// values are saved once, by rank 0.
//
// What a save guarantees (all ranks must see the same file system, as with DCP, unless
// SaveOptions::node_local, below):
//  - Atomic: everything is written into `.<name>.partial` next to `dir` and fsynced; once every
//    rank has reported success, rank 0 writes `.metadata` and `.fsdp_manifest.json`, swaps the
//    directory into place with one rename and fsyncs the parent. A save that fails or is killed
//    leaves any earlier checkpoint at `dir` intact; its leftover is removed by the next save.
//  - Verified: the manifest records an xxh3-64 checksum of every stored item and of `.metadata`,
//    the saving world size and the format version; `load` checks every item it reads, `verify`
//    checks them all. A checkpoint without a manifest (written by Python) loads with a warning
//    that it cannot be verified.
//  - Safe to open: `.metadata` is read by a restricted unpickler that executes nothing and accepts
//    only DCP's own classes; every size, offset and name is checked before use.
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/checkpoint/file_io.h"
#include "fsdp/dist.h"
#include "fsdp/state_value.h"

namespace fsdp {
namespace checkpoint {

using Annotations = std::map<std::string, std::string>;
// Aliases, because TORCH_ARG spells its getter `const T&`: with `T = X*` that would be `const X*&`.
using GroupPtr = dist::ProcessGroup*;
using FileIOPtr = FileIO*;

/// How save() and save_step() write a checkpoint.
struct SaveOptions {
  /// The group that saves (every member calls save). Null: the default group if one exists,
  /// otherwise this process alone.
  TORCH_ARG(GroupPtr, group) = nullptr;
  /// Where file operations go (tests inject faults here). Null: default_file_io().
  TORCH_ARG(FileIOPtr, io) = nullptr;
  /// Free-form facts recorded in the manifest (e.g. {"sharding_strategy", "FULL_SHARD"}).
  /// Default: none.
  TORCH_ARG(Annotations, annotations);
  /// save_step only: after a successful save, remove all but the newest `keep_last` step
  /// directories. Default 0, which keeps everything.
  TORCH_ARG(int, keep_last) = 0;
  /// For hosts that share no file system: each rank writes into its own host's `dir`, the
  /// lowest rank of each host prepares and commits it, and every host's directory gets the whole
  /// `.metadata` and a manifest of the files it holds; a two-phase commit keeps hosts in step
  /// (agreed_latest_checkpoint resolves a crash between them). Load with LoadOptions::group.
  /// Default false. The protocol: docs/checkpoint_format.md, "Node-local saves".
  TORCH_ARG(bool, node_local) = false;
  /// node_local only: how many hosts hold each data file. With 2, each rank's file is also
  /// copied (checksummed, over `group`) to the next host, so losing any one host's directory
  /// loses nothing; it costs `replicas` times the bytes of a plain save. Capped at the number of
  /// hosts. Default 1, one copy. ValueError below 1, or above 1 without node_local.
  TORCH_ARG(int, replicas) = 1;
};

/// How load() reads a checkpoint.
struct LoadOptions {
  /// Where file operations go. Null: default_file_io().
  TORCH_ARG(FileIOPtr, io) = nullptr;
  /// Check every item read against the manifest's checksum (and `.metadata`'s own). Default
  /// true; turning it off saves one pass over the bytes read and trusts the disk.
  TORCH_ARG(bool, verify) = true;
  /// Default null: a local load, each rank reading what it needs (replicas read the same bytes).
  /// A group: a collective load over it (every member calls load) that reads each stored item
  /// once, on one rank, and sends it over the group to the other ranks that need it; see load().
  TORCH_ARG(GroupPtr, group) = nullptr;
};

/// Writes `state_dict` to the directory `dir`, atomically (see above): this rank's chunks go to
/// `__<rank>_0.distcp`. Collective over the group: three small exchanges (prepare, each rank's
/// metadata and checksums or its error, commit), no tensor traffic. Replaces a checkpoint that is
/// already at `dir`. Throws ValueError for values DCP cannot hold and Error for I/O failures,
/// naming the file and the rank; a failure on any rank fails every rank and commits nothing.
void save(const StateDict& state_dict, const std::string& dir, const SaveOptions& options = {});
void save(const StateDict& state_dict, const std::string& dir, dist::ProcessGroup* group);

/// Fills `state_dict` (a template: plain tensors receive whole values, ShardedTensor pieces their
/// boxes, other values are replaced) from the checkpoint in `dir`, written at any world size.
/// Each rank reads only the chunks overlapping what it holds. Throws ValueError naming the key
/// for a key the checkpoint lacks, a shape that differs, or elements no saved chunk covers (with
/// the uncovered count) before anything in `state_dict` is changed. A data file that is short,
/// does not decode or fails its checksum is a ValueError naming the file, offset and key, found
/// when that item is read: values read before it have been filled already, and a large chunk read
/// straight into its destination has left its unverified bytes there (items are read one at a
/// time, so memory stays at about one chunk; run `verify` first to rule this out). Local: no
/// communication.
///
/// With `options.group()` the load is collective and reads every stored byte once across the
/// group, however many ranks need it (HYBRID_SHARD's replicas, values every rank holds), and `dir`
/// may be a different directory on each rank: a node-local one holding only some of the data
/// files. The ranks exchange what each needs and which data files each can read (stat only);
/// every needed item is then read by one rank that can read it (one that needs it if possible,
/// balancing bytes), checked against the manifest, and sent to the others in rounds of at most
/// 64 MiB per rank. `.metadata` and the manifest are read once, by the lowest rank whose `dir`
/// has them, so a rank whose disk holds nothing of the checkpoint still loads. Errors are those
/// of a local load, raised on every rank together (naming the rank that met them), plus a
/// ValueError naming a data file that no rank can read.
void load(StateDict& state_dict, const std::string& dir, const LoadOptions& options = {});

/// The data files of the checkpoint in `dir` that no member of `group` can read (missing, or
/// shorter than its items reach, in every rank's `dir`; stat only), in `.metadata`'s order: empty
/// when a collective load (LoadOptions::group) will find every file. Collective; `dir` may differ
/// between ranks, as for that load, whose errors it raises for a missing or unreadable
/// `.metadata`. What a resume checks before choosing node-local copies (SaveOptions::replicas)
/// that may have lost files with a host.
std::vector<std::string> missing_files(const std::string& dir, dist::ProcessGroup& group,
                                       FileIO* io = nullptr);

/// What `verify` found.
struct VerifyReport {
  bool has_manifest = false;
  int format_version = 0;             // 0 without a manifest
  int world_size = 0;                 // saving world size, from the manifest
  int64_t items = 0;                  // items checked
  int64_t bytes = 0;                  // bytes read and hashed
  std::vector<std::string> problems;  // each names the file (and key); empty when all is well
  /// A node-local save's directory (SaveOptions::node_local) holds only its host's data files:
  /// the others, named here, are in other hosts' directories and were not checked.
  std::vector<std::string> elsewhere;
  bool ok() const { return problems.empty(); }
};

/// One key of a checkpoint, as `inspect` reports it.
struct CheckpointEntry {
  std::string key;
  bool tensor = false;  // else a non-tensor value (DCP "bytes")
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  int64_t chunks = 0;        // stored boxes (DCP calls them chunks)
  int64_t stored_bytes = 0;  // bytes of its items in the data files
};

/// What a checkpoint holds, from `.metadata` and the manifest (no data file is read).
struct CheckpointInfo {
  bool has_manifest = false;
  int format_version = 0;
  int world_size = 0;  // that saved it; 0 without a manifest
  std::string library_version, torch_version;
  int64_t created_unix = 0;
  Annotations annotations;
  std::vector<std::string> files;        // data files
  std::vector<CheckpointEntry> entries;  // in `.metadata` order
};

/// Throws ValueError as `load` does for a missing, incomplete or unreadable checkpoint.
CheckpointInfo inspect(const std::string& dir, FileIO* io = nullptr);

/// A template for `load` holding every key of the checkpoint: tensors allocated with their saved
/// shape and dtype, values as None (load replaces them).
StateDict full_template(const CheckpointInfo& info);

/// Reads every stored byte of the checkpoint in `dir` and checks it: `.metadata` parses and its
/// checksum matches, every tensor's chunks cover it exactly once, every item lies inside its file,
/// its checksum matches and it decodes to what the metadata says (dtype and shape). Problems are
/// collected, not thrown; only an unreadable `.metadata` or manifest ends the check early (as a
/// problem). Without a manifest the checksums cannot be checked and that is reported as a problem
/// too.
/// `progress(done, total)` is called after each item, if given.
VerifyReport verify(const std::string& dir, FileIO* io = nullptr,
                    const std::function<void(int64_t, int64_t)>& progress = {});

// ---- step directories ----

/// Gathers the directories of a node-local save (SaveOptions::node_local), one per host, as each
/// host committed it, into one ordinary checkpoint at `out` that any loader reads (stock DCP
/// included): every data file copied once, from a directory that holds it at the size the
/// manifest records; `.metadata` as it is; the manifest without its list of local files. Written
/// like a save: into `.<name>.partial`, fsynced, renamed into place (a checkpoint already at `out`
/// is a ValueError), then verified. Throws ValueError naming a data file no directory holds, or
/// directories whose `.metadata` differ (not one checkpoint), and CorruptionError if the result
/// fails verification (it is then removed).
void assemble(const std::vector<std::string>& dirs, const std::string& out, FileIO* io = nullptr);

/// `root/step_<step>`.
std::string step_dir(const std::string& root, int64_t step);

/// Saves into step_dir(root, step) as `save` does, then points `root/latest` at it (written
/// atomically) and applies `keep_last`. Stale `.step_*.partial` leftovers of killed saves in
/// `root` are removed first (and a `.step_N.aside` put back; see latest_checkpoint). Returns the
/// directory.
std::string save_step(const StateDict& state_dict, const std::string& root, int64_t step,
                      const SaveOptions& options = {});

/// The steps in `root` that hold a committed checkpoint (a `.metadata`), ascending.
std::vector<int64_t> list_steps(const std::string& root, FileIO* io = nullptr);

/// The directory `root/latest` names, if it holds a committed checkpoint; otherwise the newest
/// committed step (with a warning when `latest` exists but names no committed checkpoint);
/// nullopt if there is none. One exception: on a file system without an atomic directory swap
/// (NFS, kernels before 3.15), a save replacing step N moves the old step N to `.step_N.aside`
/// before renaming the new one in; if it died in between, `latest` still names step N and the
/// old copy's path (`root/.step_N.aside`) is returned. The next save_step renames it back.
std::optional<std::string> latest_checkpoint(const std::string& root, FileIO* io = nullptr);

/// The checkpoint under `root` that every member of `group` resumes from (collective): the newest
/// step that every rank with any step lists; nullopt if none. On a shared file system that is
/// latest_checkpoint's; with node-local saves it skips a step that a crash committed on some hosts
/// only, and a rank whose disk is empty (a new host) follows the others (a collective load finds
/// the files where they are). The path returned is under this rank's own `root` (the hosts'
/// roots may differ), whether or not that rank holds the step.
std::optional<std::string> agreed_latest_checkpoint(const std::string& root,
                                                    dist::ProcessGroup& group,
                                                    FileIO* io = nullptr);

}  // namespace checkpoint
}  // namespace fsdp
