// Shared by the benchmark programs: fork W ranks that rendezvous over a TCPStore on loopback, run
// the same Google Benchmark suite with fixed iteration counts (every rank must issue the same
// collectives), and let rank 0 alone report.
//
// Measured and baseline cases are registered in interleaved rounds (baseline, measured, measured,
// baseline, ...), one repetition each, so that a noisy neighbour slows both alike; a case's figure
// is the median of its rounds. Google Benchmark's own random interleaving cannot be used: each
// rank would draw its own order and the ranks' collectives would no longer match.
//
// Rank 0 appends every measurement, with all its samples, as one JSON line to $FSDP_BENCH_OUT
// (when set); scripts/bench_report.py turns them into the suite's records, targets and plots.
#pragma once

#include <fcntl.h>
#include <sys/wait.h>
#include <torch/version.h>
#include <unistd.h>

#include <benchmark/benchmark.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "bench_env.h"
#include "fsdp/compat_backends.h"
#include "fsdp/fsdp.h"

namespace fsdp_bench {

/// Rank 0 prints every round as usual and keeps each case's seconds per iteration, by name and
/// argument, over its rounds.
class RecordingReporter : public benchmark::ConsoleReporter {
 public:
  RecordingReporter() : ConsoleReporter(OO_Tabular) {}
  std::map<std::pair<std::string, int64_t>, std::vector<double>> samples;
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const auto& r : runs) {
      if (r.run_type != Run::RT_Iteration) continue;
      const std::string& args = r.run_name.args;
      const size_t first = args.find_first_not_of('/');
      const int64_t arg = first == std::string::npos ? 0 : std::stoll(args.substr(first));
      samples[{r.run_name.function_name, arg}].push_back(
          r.GetAdjustedRealTime() / benchmark::GetTimeUnitMultiplier(r.time_unit));
    }
  }
  /// Median seconds per iteration of a case; 0 if it did not run.
  double get(const std::string& name, int64_t arg = 0) const {
    auto it = samples.find({name, arg});
    return it == samples.end() ? 0.0 : median(it->second);
  }
  std::vector<double> all(const std::string& name, int64_t arg = 0) const {
    auto it = samples.find({name, arg});
    return it == samples.end() ? std::vector<double>{} : it->second;
  }
};

class SilentReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

inline fsdp::dist::ProcessGroup*& group() {
  static fsdp::dist::ProcessGroup* pg = nullptr;
  return pg;
}

/// One benchmark case: a name, a function, its argument (a size) and fixed iterations.
struct Case {
  std::string name;
  void (*fn)(benchmark::State&);
  int64_t arg = 0;
  int64_t iterations = 1;
};

/// Registers `cases` `rounds` times, reversing the order every other round (so that neither the
/// baseline nor the measured case always runs first), one repetition each.
inline void register_rounds(const std::vector<Case>& cases, int rounds,
                            benchmark::TimeUnit unit = benchmark::kMillisecond) {
  for (int r = 0; r < rounds; ++r) {
    std::vector<Case> order = cases;
    if (r % 2) std::reverse(order.begin(), order.end());
    for (const Case& c : order) {
      auto* b = benchmark::RegisterBenchmark(c.name.c_str(), c.fn);
      if (c.arg) b->Arg(c.arg);
      b->Iterations(c.iterations)->Repetitions(1)->UseRealTime()->Unit(unit);
    }
  }
}

/// The device a benchmark computes on: $FSDP_BENCH_DEVICE, "cpu" (default; Gloo) or "cuda"
/// (NCCL; ranks may share one GPU, see run()).
inline const at::Device& device() {
  static const at::Device d(env_str("FSDP_BENCH_DEVICE", "cpu"));
  return d;
}
/// GPU work is asynchronous (NCCL's wait() only orders streams): each timed operation ends here.
inline void sync_device() {
  if (device().is_cuda()) torch::cuda::synchronize();
}

/// World size of a benchmark run: $FSDP_BENCH_WORLD, default 2.
inline int world_from_env() { return static_cast<int>(env_int("FSDP_BENCH_WORLD", 2)); }

/// Rounds per case: $FSDP_BENCH_ROUNDS, else `fallback`.
inline int rounds_from_env(int fallback) {
  return static_cast<int>(env_int("FSDP_BENCH_ROUNDS", fallback));
}

/// Appends one measurement to $FSDP_BENCH_OUT as a JSON line, with the LibTorch version and
/// backend it was taken with. `samples` are the per-round values; "median" is added.
inline void emit(nlohmann::json m, const std::vector<double>& samples = {}) {
  const char* path = std::getenv("FSDP_BENCH_OUT");
  if (!path || !*path) return;
  if (!samples.empty()) {
    m["samples"] = samples;
    m["median"] = median(samples);
  }
  m["libtorch"] = TORCH_VERSION;
  // Which part of scripts/bench.sh took it ("host", or "torch2" in the LibTorch 2.x chroot).
  if (const char* tag = std::getenv("FSDP_BENCH_TAG")) m["run"] = tag;
  if (!m.contains("backend") && group()) m["backend"] = group()->backend_name();
  std::ofstream out(path, std::ios::app);
  out << m.dump() << "\n";
}

/// Forks `world` ranks. Each registers its benchmarks with `register_all`, runs them, and rank 0
/// passes its recorded medians to `summarize`. Returns a process exit code.
inline int run(int argc, char** argv, int world, const std::function<void()>& register_all,
               const std::function<void(const RecordingReporter&)>& summarize) {
  auto server = fsdp::compat::make_tcp_store("127.0.0.1", 0, true, world, std::chrono::seconds(60));
  const uint16_t port = server->getPort();
  std::fflush(stdout);
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    pid_t pid = fork();
    if (pid != 0) {
      pids.push_back(pid);
      continue;
    }
    int rc = 1;
    try {
      at::set_num_threads(1);  // ranks share the cores
      if (device().is_cuda() && !std::getenv("NCCL_HOSTID")) {
        // Ranks sharing one GPU: NCCL accepts them only as different hosts
        // (tests/helpers/multi_rank.cpp).
        ::setenv("NCCL_HOSTID", ("fsdp-bench-rank-" + std::to_string(r)).c_str(), 1);
      }
      auto store =
          fsdp::compat::make_tcp_store("127.0.0.1", port, false, world, std::chrono::seconds(60));
      auto pg = fsdp::dist::init_process_group(
          fsdp::dist::InitOptions().rank(r).world_size(world).store(store).timeout(
              std::chrono::seconds(600)));
      group() = &pg;
      benchmark::Initialize(&argc, argv);
      register_all();
      if (r == 0) {
        RecordingReporter rep;
        benchmark::RunSpecifiedBenchmarks(&rep);
        summarize(rep);
      } else {
        SilentReporter silent;
        benchmark::RunSpecifiedBenchmarks(&silent);
      }
      pg.barrier();
      rc = 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d: %s\n", r, e.what());
    }
    std::fflush(stdout);
    _exit(rc);
  }
  int rc = 0;
  for (pid_t p : pids) {
    int status = 0;
    waitpid(p, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) rc = 1;
  }
  return rc;
}

/// The raw disk baseline: writes `bytes` from `data` as the file `path` (created or truncated),
/// looping over short writes, and fsyncs it.
inline void write_file_fsync(const std::string& path, const void* data, int64_t bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw std::runtime_error("raw write: cannot open " + path);
  const char* p = static_cast<const char*>(data);
  for (int64_t left = bytes; left > 0;) {
    const auto n = ::write(fd, p, static_cast<size_t>(left));
    if (n <= 0) throw std::runtime_error("raw write failed: " + path);
    p += n;
    left -= n;
  }
  ::fsync(fd);
  ::close(fd);
}

/// Untimed rounds first: the first collectives on a fresh pair pay for connection warm-up.
template <typename F>
void warm_up(F&& f, int rounds = 3) {
  for (int i = 0; i < rounds; ++i) f();
}

}  // namespace fsdp_bench
