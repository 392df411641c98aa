// The checkpoint operations that the crash-point and error-point enumerations (issue 39; the
// tests test_crash_points.cpp and test_error_points.cpp) run under a recording or failing FileIO,
// and for each the check of what a restart sees afterwards.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <functional>
#include <string>
#include <utility>

#include "dcp_testing.h"
#include "fsdp/checkpoint/file_io.h"
#include "multi_rank.h"

namespace fsdp {
namespace testing {

inline bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

inline bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Stderr silenced for a scope: latest_checkpoint warns about every `latest` naming a lost step,
// which hundreds of crash states here do on purpose.
class QuietStderr {
 public:
  QuietStderr() {
    std::fflush(stderr);
    saved_ = ::dup(2);
    const int null = ::open("/dev/null", O_WRONLY);
    ::dup2(null, 2);
    ::close(null);
  }
  ~QuietStderr() {
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
  }

 private:
  int saved_ = -1;
};

/// The "model.sharded" value (6 x 5) saved with `scale`.
at::Tensor expected_sharded(double scale);

/// "" if `dir` verifies and holds what the save with `scale` wrote; else why not.
std::string holds(const std::string& dir, double scale);

// An operation on `world` ranks under test: `before` builds the starting state in `top` (on the
// same ranks, default FileIO), `act` is the operation through `io`, `check` judges a restart's
// view of `top` (`ok`: the operation returned; false after a crash or a failure) on every rank of
// the restart (`restart_world` ranks after a crash, `world` after an error).
struct Operation {
  using Before = std::function<void(dist::ProcessGroup&, const std::string& top)>;
  using Act =
      std::function<void(dist::ProcessGroup&, const std::string& top, checkpoint::FileIO& io)>;
  using Check = std::function<void(dist::ProcessGroup&, const std::string& top, bool ok,
                                   const std::string& what)>;
  Operation(const char* name_in, int world_in, Before before_in, Act act_in, Check check_in)
      : name(name_in),
        world(world_in),
        before(std::move(before_in)),
        act(std::move(act_in)),
        check(std::move(check_in)) {}

  const char* name;
  int world;
  Before before;
  Act act;
  Check check;
  /// Ranks of the restart after a crash (each with its own copy of the tree): more than one where
  /// the check is collective, as for node-local saves, where rank r of W plays host r * hosts / W.
  int restart_world = 1;
  /// Several hosts: the host of each rank of the operation, whose pending changes a power cut of
  /// that host alone loses (CrashEnumerator::set_hosts). Null: one machine.
  std::function<int(int rank)> host_of;
  /// Crash states checked: every one (1), or the first of each kind and every `stride`-th
  /// (PointSampler; FSDP_TEST_POINT_STRIDE overrides it).
  long stride = 1;
};

/// The operation called `name` (operations listed in checkpoint_operations.cpp).
const Operation& operation(const std::string& name);

// Where the enumerations keep their thousands of small trees: in memory (/dev/shm) where there is
// one, as the durability they model is the journal's, not the scratch disk's (three times
// faster here: fsync on a tmpfs costs nothing).
std::string scratch_base();

}  // namespace testing
}  // namespace fsdp
