// bench_fresh_memory: what writing fresh memory costs on this machine, against writing memory
// that is already faulted in. Everything in the suite that allocates a buffer and fills it
// (an unshard, a reduction's output, the FULL state dict's result) pays this on top of the bytes
// it moves, so it is the machine's side of those figures, recorded in the same run.
//
// One process, no LibTorch. For each size in $FSDP_BENCH_FRESH_MB (whole megabytes, default
// 256,600: a large unit, and the whole model and Adam state of 50M parameters per rank at W=2),
// each round times a memset of:
//   faulted      a buffer written before (the baseline: what the raw collectives write into)
//   4k_hot       a fresh mapping, right after an equal mapping was written and unmapped
//   huge_hot     the same, advised MADV_HUGEPAGE (what src/util/huge_pages.h does)
//   4k_cold      a fresh mapping after $FSDP_BENCH_FRESH_PAUSE_S seconds (default 3) with nothing
//   huge_cold    freed: the pause a trainer has between two FULL state dicts or checkpoints
//
// "cold" differs from "hot" where the kernel hands freed memory back to a hypervisor (virtio-
// balloon free page reporting reports free 2 MiB blocks about 2 s after they are freed): touching
// it again then faults on the host as well (docs/performance.md, "Fresh memory").
// Rounds reverse their order every time, as in the other programs. It prints the medians and
// appends every sample to $FSDP_BENCH_OUT (scripts/bench_report.py makes records of them).
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_env.h"

namespace {

using fsdp_bench::median;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void* map_fresh(size_t bytes, bool huge) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::perror("bench_fresh_memory: mmap");
    std::exit(1);
  }
  if (huge) madvise(p, bytes, MADV_HUGEPAGE);  // ignored where THP is off; the figure says so
  return p;
}

// Time one memset of a fresh mapping. `hot`: write and unmap an equal mapping just before, so
// that the kernel has just-freed memory to give (as in a training loop, which frees a unit's
// buffer and allocates the next within milliseconds).
double time_fresh(size_t bytes, bool huge, bool hot) {
  if (hot) {
    void* q = map_fresh(bytes, huge);
    std::memset(q, 2, bytes);
    munmap(q, bytes);
  }
  void* p = map_fresh(bytes, huge);
  const auto t0 = std::chrono::steady_clock::now();
  std::memset(p, 1, bytes);
  const double s = seconds_since(t0);
  munmap(p, bytes);
  return s;
}

// Interleaved rounds of every case at one size; prints the medians and appends the samples to
// $FSDP_BENCH_OUT.
void measure(int64_t mb, double pause, int rounds) {
  const size_t bytes = static_cast<size_t>(mb * 1e6);
  std::vector<char> faulted(bytes, 0);  // written once here: the baseline writes it again
  const std::vector<std::string> cases{"faulted", "4k_hot", "huge_hot", "4k_cold", "huge_cold"};
  std::map<std::string, std::vector<double>> samples;
  for (int r = 0; r < rounds; ++r) {
    std::vector<std::string> order = cases;
    if (r % 2) std::reverse(order.begin(), order.end());
    for (const std::string& c : order) {
      double s;
      if (c == "faulted") {
        const auto t0 = std::chrono::steady_clock::now();
        std::memset(faulted.data(), r + 1, bytes);
        s = seconds_since(t0);
      } else {
        const bool huge = c.rfind("huge", 0) == 0, hot = c.find("hot") != std::string::npos;
        if (!hot) std::this_thread::sleep_for(std::chrono::duration<double>(pause));
        s = time_fresh(bytes, huge, hot);
      }
      samples[c].push_back(s);
    }
  }

  const double base = median(samples["faulted"]);
  std::printf("\nwriting %lld MB, medians of %d interleaved rounds (cold: after a %.1f s pause)\n",
              static_cast<long long>(mb), rounds, pause);
  std::printf("%-10s %10s %8s %10s   %s\n", "", "ms", "GB/s", "/ faulted", "samples (ms)");
  for (const std::string& c : cases) {
    const double t = median(samples[c]);
    std::string all;
    for (double x : samples[c]) all += " " + std::to_string(static_cast<int>(x * 1e3 + 0.5));
    std::printf("%-10s %10.1f %8.2f %10.2f  %s\n", c.c_str(), t * 1e3, bytes / t / 1e9, t / base,
                all.c_str());
  }

  if (const char* path = std::getenv("FSDP_BENCH_OUT"); path && *path) {
    std::ofstream out(path, std::ios::app);
    for (const std::string& c : cases) {
      nlohmann::json m{{"bench", "fresh_memory"},
                       {"case", c},
                       {"bytes", static_cast<double>(bytes)},
                       {"pause_s", pause},
                       {"unit", "s"},
                       {"samples", samples[c]},
                       {"median", median(samples[c])}};
      if (const char* tag = std::getenv("FSDP_BENCH_TAG")) m["run"] = tag;
      out << m.dump() << "\n";
    }
  }
}

}  // namespace

int main() {
  const double pause = fsdp_bench::env_double("FSDP_BENCH_FRESH_PAUSE_S", 3);
  const int rounds = static_cast<int>(fsdp_bench::env_int("FSDP_BENCH_ROUNDS", 5));
  const std::vector<int64_t> sizes = fsdp_bench::env_list("FSDP_BENCH_FRESH_MB", {256, 600});
  for (int64_t mb : sizes) {
    if (mb <= 0 || rounds < 1 || pause < 0) {
      std::fprintf(stderr,
                   "bench_fresh_memory: FSDP_BENCH_FRESH_MB (a list of sizes), "
                   "FSDP_BENCH_ROUNDS and FSDP_BENCH_FRESH_PAUSE_S must be positive\n");
      return 2;
    }
  }
  for (int64_t mb : sizes) measure(mb, pause, rounds);
  return 0;
}
