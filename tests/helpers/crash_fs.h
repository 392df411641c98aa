// A crash at every I/O point (issue 39): what a machine that loses power in the middle of a save,
// an export or a keep_last clean-up leaves on disk, for every point at which it can happen.
//
// JournalIO is a FileIO that records every change a rank makes to the file system (creates,
// truncations, writes with their bytes, fsyncs, mkdir, rename, the atomic swap, removals) into
// one journal file shared by all ranks. A rank holds a lock on the journal across each operation
// and its record, so the journal's order is an order in which the file system saw them.
//
// CrashEnumerator replays prefixes of that journal onto a snapshot of the tree taken before the
// operation began, with POSIX's durability rules: a file's bytes survive a power cut only once
// the file was fsynced after they were written; a name created, removed or renamed in a directory
// only once that directory was fsynced afterwards (both directories, for a rename between two).
// Until then each such change may be lost or kept, in any combination. For each crash point
// (after 0, 1, ..., N operations) it builds the trees where none of the pending changes is lost,
// where all are lost, and where each single one is lost (and, for ranks on several hosts, where
// all of one host's are lost: that host lost power, the others' page caches kept theirs),
// materialises each distinct tree in a directory and hands it to the test's check, which plays
// the restart.
//
// The model is inode-based, as file systems are: a write lands in the file it was made to even if
// the name that file was opened by is renamed or its creation is lost (then it is unreachable).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/checkpoint/file_io.h"

namespace fsdp {
namespace testing {
namespace crash {

enum class OpKind : uint8_t { CREATE, TRUNCATE, WRITE, FSYNC, MKDIR, RENAME, EXCHANGE, REMOVE };

/// One recorded change. Inodes are the real ones (st_ino) at the time of the call.
struct Op {
  OpKind kind = OpKind::FSYNC;
  int rank = 0;
  uint64_t ino = 0;             // CREATE/MKDIR: the new inode; TRUNCATE/WRITE/FSYNC: the target;
                                // RENAME/EXCHANGE: what name1 named
  uint64_t ino2 = 0;            // EXCHANGE: what name2 named
  uint64_t dir1 = 0, dir2 = 0;  // the directories whose entries change (RENAME: from, to)
  std::string name1, name2;
  int64_t offset = 0;  // WRITE
  std::string data;    // WRITE
  std::string path;    // for messages
};

/// "rank 1 write 64 bytes at 0 of /tmp/x/__1_0.distcp", for messages.
std::string describe(const Op& op);

/// A FileIO recording every change into the journal at `journal_path` (appended to; each rank
/// opens its own). Reads pass through unrecorded.
class JournalIO : public checkpoint::FileIO {
 public:
  JournalIO(const std::string& journal_path, int rank);
  ~JournalIO() override;
  JournalIO(const JournalIO&) = delete;
  JournalIO& operator=(const JournalIO&) = delete;

  int open(const std::string& path, int flags, int mode) override;
  int64_t write(int fd, const void* data, size_t n) override;
  int fsync(int fd) override;
  int close(int fd) override;
  int mkdir(const std::string& path, int mode) override;
  int rename(const std::string& from, const std::string& to) override;
  int exchange(const std::string& a, const std::string& b) override;
  int remove(const std::string& path) override;

 private:
  class Locked;
  void append(Op op);
  int move(OpKind kind, const std::string& a, const std::string& b);

  int journal_fd_ = -1;
  int rank_ = 0;
  std::mutex mutex_;  // flock excludes other processes, not this one's threads (async save)
  std::map<int, std::pair<uint64_t, std::string>> fd_file_;  // inode and path of each open fd
};

/// The journal's records, in order.
std::vector<Op> read_journal(const std::string& journal_path);

/// Counts of one enumeration.
struct CrashCounts {
  size_t operations = 0;  // records in the journal
  size_t points = 0;      // crash points: operations + 1
  size_t states = 0;      // (point, loss pattern) pairs built
  size_t checked = 0;     // distinct trees handed to the check
};

class CrashEnumerator {
 public:
  /// `top`: an existing directory whose whole tree the journal's operations stay inside; its
  /// current contents are the state before them (taken as durable). Call before the operation.
  explicit CrashEnumerator(const std::string& top);

  /// Reads the journal recorded since construction. Throws if an operation touched something
  /// outside `top`.
  void set_journal(std::vector<Op> ops);

  /// The operation's ranks are on several hosts (host_of(rank)): each host's pending changes are
  /// also lost alone, as a power cut of that host alone loses them.
  void set_hosts(std::function<int(int rank)> host_of) { host_of_ = std::move(host_of); }

  /// For every crash point and loss pattern, writes the tree `top` would have after the restart
  /// into `out` (replaced each time) and calls check(what, after_return): `what` describes the
  /// point and pattern for messages; `after_return` is true at the last point, where the
  /// operation had returned (and whatever it promised durable must be there). Distinct trees are
  /// checked once.
  CrashCounts for_each_state(
      const std::string& out,
      const std::function<void(const std::string& what, bool after_return)>& check) const;

 private:
  struct Node {
    bool dir = false;
    std::string data;
    std::map<std::string, int> entries;
  };
  // An Op with its inodes resolved to nodes of the model.
  struct Step {
    Op op;
    int node = -1, node2 = -1, dir1 = -1, dir2 = -1;
    size_t durable_after = SIZE_MAX;  // the index of the fsync that makes it durable
  };
  std::vector<Node> replay(size_t point, const std::vector<bool>& lost) const;
  std::vector<size_t> pending(size_t point) const;

  std::string top_;
  int top_node_ = 0;
  std::vector<Node> initial_;
  std::vector<Node> fresh_;  // the inodes the journal creates, empty
  std::map<uint64_t, int> initial_inodes_;
  std::vector<Step> steps_;
  size_t node_count_ = 0;
  std::function<int(int)> host_of_;
};

}  // namespace crash
}  // namespace testing
}  // namespace fsdp
