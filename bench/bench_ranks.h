// Shared by the benchmark programs: fork W ranks that rendezvous over a TCPStore on loopback, run
// the same Google Benchmark suite with fixed iteration counts (every rank must issue the same
// collectives), and let rank 0 alone report.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <benchmark/benchmark.h>

#include <cstdio>
#include <functional>
#include <map>
#include <string>

#include "fsdp/fsdp.h"

namespace fsdp_bench {

/// Rank 0 prints as usual and keeps the median time (seconds) of every benchmark by name and
/// argument, for the ratio tables printed afterwards.
class RecordingReporter : public benchmark::ConsoleReporter {
 public:
  RecordingReporter() : ConsoleReporter(OO_Tabular) {}
  std::map<std::pair<std::string, int64_t>, double> seconds;
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const auto& r : runs) {
      // Medians of the repetitions: robust to a noisy neighbour on a shared machine.
      if (r.run_type != Run::RT_Aggregate || r.aggregate_name != "median") continue;
      const std::string& args = r.run_name.args;
      const size_t first = args.find_first_not_of('/');
      const int64_t arg = first == std::string::npos ? 0 : std::stoll(args.substr(first));
      seconds[{r.run_name.function_name, arg}] =
          r.GetAdjustedRealTime() / benchmark::GetTimeUnitMultiplier(r.time_unit);
    }
  }
  double get(const std::string& name, int64_t arg = 0) const {
    auto it = seconds.find({name, arg});
    return it == seconds.end() ? 0.0 : it->second;
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
      auto store =
          fsdp::compat::make_tcp_store("127.0.0.1", port, false, world, std::chrono::seconds(60));
      auto pg = fsdp::dist::init_process_group(
          fsdp::dist::InitOptions().rank(r).world_size(world).store(store).timeout(
              std::chrono::seconds(300)));
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

/// World size of a benchmark run: $FSDP_BENCH_WORLD, default 2.
inline int world_from_env() {
  const char* w = std::getenv("FSDP_BENCH_WORLD");
  return w ? std::atoi(w) : 2;
}

/// Untimed rounds first: the first collectives on a fresh pair pay for connection warm-up.
template <typename F>
void warm_up(F&& f, int rounds = 3) {
  for (int i = 0; i < rounds; ++i) f();
}

}  // namespace fsdp_bench
