// A GoogleTest harness that runs a test body on N ranks as N real processes.
//
// run_ranks(W, body) forks W children. Each child connects to a TCPStore hosted by the parent on
// loopback (as torchrun's agent does; FSDP_TEST_RANK holds its rank), creates the default process
// group with fsdp::dist::init_process_group and runs body(group). A child fails if body throws or
// records a GoogleTest failure; its exception message comes back to the parent over a pipe. When
// one rank fails, the others get `grace` to fail on their own (a peer's death should surface as a
// DistError, and the tests check that), then are killed. Every failure is reported in the parent
// as a GoogleTest failure naming the rank.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>

#include <mutex>

#include "fsdp/dist.h"

namespace fsdp {
namespace testing {

struct RunOptions {
  /// Limit on the whole run; past it every rank still alive is killed and reported.
  std::chrono::milliseconds deadline{std::chrono::seconds(120)};
  /// Timeout of the process group's collectives.
  std::chrono::milliseconds collective_timeout{std::chrono::seconds(30)};
  /// How long the surviving ranks may run after the first rank failed.
  std::chrono::milliseconds grace{std::chrono::seconds(5)};
  /// Report failures through GoogleTest (true), or only return them (false) for tests that expect
  /// ranks to fail.
  bool report = true;
  /// Create the default group before calling body (true), or hand body a non-member placeholder
  /// and let it initialise on its own (tests of init_process_group itself). Either way the
  /// harness's TCPStore listens on 127.0.0.1 at the port $FSDP_TEST_STORE_PORT names.
  bool init_group = true;
  /// Gloo's worker threads in the default group (InitOptions::gloo_threads). With one, the
  /// backend runs its collectives in order and lets go of one before it starts the next.
  int gloo_threads = 2;
};

/// The backend run_ranks creates: $FSDP_TEST_BACKEND, else "gloo". scripts/gpu-check.sh runs
/// suites with "nccl" (tensors the tests keep on the CPU are then staged through the GPU).
std::string test_backend();

/// Outcome of one rank.
struct RankResult {
  int rank = 0;
  bool ok = false;
  bool killed = false;  // killed by the harness (deadline or grace expired)
  std::string message;  // exception text or exit status
};

using RankBody = std::function<void(dist::ProcessGroup& pg)>;

/// Runs `body` on `world_size` processes. Returns each rank's outcome.
std::vector<RankResult> run_ranks(int world_size, const RankBody& body,
                                  const RunOptions& opts = RunOptions());

/// Inside run_ranks with RunOptions::init_group false: initialises the default group from
/// torchrun's variables as a launcher that put `per_host` ranks on each host would set them
/// (LOCAL_RANK from `local_rank_of`, consecutive blocks unless a test says otherwise), so that
/// the group routes its collectives by host. The store is the harness's, as torchrun's agent hosts
/// it for its workers: a port picked for rank 0 to bind could be taken by one of the many sockets
/// the ranks open meanwhile (a rare failure seen under load).
dist::ProcessGroup init_as_hosts(int world, int per_host,
                                 std::optional<bool> host_aware = std::nullopt,
                                 int (*local_rank_of)(int rank, int per_host) = nullptr,
                                 std::chrono::milliseconds timeout = std::chrono::seconds(30));

/// A fresh directory for one test's files, removed (with its contents) when the object that made
/// it is destroyed in the process that made it: create it in the test body before run_ranks, so
/// the forked ranks share it. Tests never share files, so any one runs alone or shuffled.
class TempDir {
 public:
  TempDir();
  /// In `base` rather than $TMPDIR or /tmp.
  explicit TempDir(const std::string& base);
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
  int owner_pid_ = 0;
};

/// A TCP port free right now on loopback (the OS picks it; another process may take it before
/// it is bound again).
uint16_t free_port();

/// torch::manual_seed for the CPU generator only. torch::manual_seed also seeds every CUDA device,
/// which initialises CUDA in the calling process; a test's parent process that did so could no
/// longer fork ranks that use CUDA ("initialization error"), so tests seed through this.
inline void seed_cpu(uint64_t seed) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_current_seed(seed);
}

/// Convenience: fixed-seed random tensor that every rank can reproduce without communication.
at::Tensor seeded_randn(at::IntArrayRef shape, uint64_t seed, at::ScalarType dtype = at::kFloat);

}  // namespace testing
}  // namespace fsdp
