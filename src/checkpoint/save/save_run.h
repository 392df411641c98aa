// Internal: one collective save (save.cpp) and the two protocols that decide where its directory
// lives and who commits it: one directory that every rank shares (save.cpp), or one directory per
// host on node-local disks, with copies of each data file on other hosts (node_local.cpp). The
// phases every save runs (prepare, write) are SaveRun's; what differs is a Protocol's.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/dcp/metadata.h"
#include "dist/agreement.h"
#include "fsdp/checkpoint/checkpoint.h"

namespace fsdp {
namespace checkpoint {
namespace save_run {

inline constexpr const char* kWhat = "checkpoint save";

/// What one rank wrote: DCP metadata for its items plus, in storage_data order, their checksums.
struct RankPart {
  dcp::Metadata meta;
  std::vector<std::string> hashes;
  std::string file;
  int64_t file_size = 0;
};

/// What the phases of one save share.
struct SaveState {
  dist::ProcessGroup* group = nullptr;  // null: a save by this process alone
  FileIO* io = nullptr;
  int rank = 0;
  std::string dir, partial;          // the checkpoint's directory and its partial twin
  bool leader = false;               // prepares and commits this rank's directory
  std::vector<std::string> reports;  // once written: every rank's encoded RankPart

  /// Every rank's RankPart, decoded from `reports`.
  std::vector<RankPart> parts() const;
  /// Every rank's verdict (dist/agreement.h).
  dist::Verdicts exchange(const dist::Verdict& mine) const {
    return dist::exchange_verdicts(group, mine);
  }
  /// Throws, on every rank alike, the first failure among `verdicts`, saying `what` failed and on
  /// which rank.
  void throw_first_failure(const dist::Verdicts& verdicts, const char* what) const;
  /// After a failure: the leader removes the partial directory, which no rank writes to any more.
  void remove_partial_on_leader() const;
  /// The leader's verdict on `step`, run there (a throw becomes a failed verdict); on every other
  /// rank a clean verdict, for the exchange that follows.
  dist::Verdict on_leader(const std::function<void()>& step) const;
};

/// Where a save's directory lives, and so who prepares and commits it.
class Protocol {
 public:
  virtual ~Protocol() = default;
  /// Before anything is written: which ranks share this rank's directory, and so `s.leader`.
  /// Collective.
  virtual void find_leader(SaveState& s) = 0;
  /// The leader's clearing of what earlier saves left, before it makes the partial directory.
  virtual void clear_leftovers(const SaveState&) {}
  /// Once every rank has written its file (`s.reports`): what else must be written before the
  /// commit. Collective.
  virtual void after_write(SaveState&) {}
  /// The commit: the directory complete and in place on every host, or nowhere; `after_commit`
  /// runs on each leader once every host has it. Collective.
  virtual void commit(SaveState& s, const Annotations& annotations,
                      const std::function<void()>& after_commit) = 0;
};

/// One directory on a file system every rank shares; rank 0 leads it (save.cpp).
std::unique_ptr<Protocol> shared_directory();

/// One directory per host, on disks only that host sees; each host's lowest rank leads its own,
/// and `replicas` hosts hold every data file (node_local.cpp).
std::unique_ptr<Protocol> node_local_directories(int replicas);

/// The commit's first half: `.metadata` and the manifest (naming `local_files` in a node-local
/// save) into `partial`, fsynced with it.
void write_commit_files(FileIO& io, const std::vector<RankPart>& parts, const std::string& partial,
                        const Annotations& annotations, std::vector<std::string> local_files);

/// The commit's second half: the complete `partial` swapped into `dir`, the old one removed.
void install(FileIO& io, const std::string& partial, const std::string& dir);

}  // namespace save_run
}  // namespace checkpoint
}  // namespace fsdp
