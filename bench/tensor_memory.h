// Live and peak bytes of CPU tensor storage, counted by an allocator that wraps LibTorch's own.
//
// Resident memory (VmHWM) mixes tensors with LibTorch's code pages, Gloo's buffers and whatever
// malloc keeps cached, so it cannot be compared with an analytic bound of parameter, gradient,
// optimizer and activation bytes. Every CPU tensor's storage, however, comes from the allocator
// registered for the CPU device: wrapping it counts exactly the bytes the bound is about.
// The benchmarks report peak RSS next to it for orientation.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <execinfo.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace fsdp_bench {

class TensorMemory : public c10::Allocator {
 public:
  /// Installs the counter as the CPU allocator of this process (once; later calls return it).
  static TensorMemory& install() {
    static TensorMemory* self = [] {
      auto* m = new TensorMemory(c10::GetCPUAllocator());
      c10::SetCPUAllocator(m, /*priority=*/100);
      return m;
    }();
    return *self;
  }

  int64_t live() const { return live_.load(); }
  int64_t peak() const { return peak_.load(); }
  /// Starts a new peak from what is live now.
  void reset_peak() {
    peak_.store(live_.load());
    std::lock_guard<std::mutex> g(trace_mu_);
    at_peak_.clear();
  }

  /// With $FSDP_BENCH_TRACE_PEAK=<MB> set, the blocks of that size and up that were live at the
  /// latest peak, each with its allocating call stack (for `addr2line -C -f -e <binary>
  /// <+offset>`), printed to stderr: what to look at when a peak is above its analytic bound.
  void print_peak_blocks(const char* title) const {
    if (trace_min_ == 0) return;
    std::lock_guard<std::mutex> g(trace_mu_);
    std::fprintf(stderr, "== %s: peak %.2f MB, %zu blocks >= %zu bytes live at it\n", title,
                 peak_.load() / 1e6, at_peak_.size(), trace_min_);
    for (const auto& b : at_peak_) {
      std::fprintf(stderr, "-- %.3f MB\n", b.bytes / 1e6);
      char** syms = backtrace_symbols(b.stack.data(), static_cast<int>(b.stack.size()));
      for (size_t i = 2; syms && i < b.stack.size(); ++i) std::fprintf(stderr, "   %s\n", syms[i]);
      std::free(syms);
    }
  }

  // LibTorch 1.13 declares `allocate(size_t) const`, 2.x `allocate(size_t)`; defining both (and
  // 2.x's copy_data) without `override` makes this class implement whichever the headers declare.
  c10::DataPtr allocate(size_t n) const { return counted(n); }
  c10::DataPtr allocate(size_t n) { return counted(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const {
    std::memcpy(dest, src, count);
  }

 private:
  explicit TensorMemory(c10::Allocator* base) : base_(base) {
    if (const char* mb = std::getenv("FSDP_BENCH_TRACE_PEAK"))
      trace_min_ = static_cast<size_t>(std::atof(mb) * 1e6);
  }

  struct Traced {
    size_t bytes;
    std::vector<void*> stack;
  };
  struct Block {
    c10::DataPtr inner;  // freed by the wrapped allocator when the Block is deleted
    size_t bytes;
    const TensorMemory* owner;
  };
  static void release(void* ctx) {
    auto* b = static_cast<Block*>(ctx);
    if (b->owner->trace_min_ && b->bytes >= b->owner->trace_min_) {
      std::lock_guard<std::mutex> g(b->owner->trace_mu_);
      b->owner->traced_.erase(b->inner.get());
    }
    b->owner->live_ -= static_cast<int64_t>(b->bytes);
    delete b;
  }
  c10::DataPtr counted(size_t n) const {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    auto* block = new Block{std::move(inner), n, this};
    const int64_t now = live_ += static_cast<int64_t>(n);
    int64_t p = peak_.load();
    while (now > p && !peak_.compare_exchange_weak(p, now)) {
    }
    if (trace_min_) trace(data, n, now > p);
    return c10::DataPtr(data, block, &TensorMemory::release, device);
  }

  // Slow (a call stack per large block), so only with $FSDP_BENCH_TRACE_PEAK.
  void trace(void* data, size_t n, bool new_peak) const {
    std::lock_guard<std::mutex> g(trace_mu_);
    if (n >= trace_min_) {
      Traced t{n, std::vector<void*>(24)};
      t.stack.resize(static_cast<size_t>(backtrace(t.stack.data(), 24)));
      traced_[data] = std::move(t);
    }
    if (new_peak) {
      at_peak_.clear();
      for (const auto& kv : traced_) at_peak_.push_back(kv.second);
    }
  }

  c10::Allocator* base_;
  size_t trace_min_ = 0;
  mutable std::mutex trace_mu_;
  mutable std::map<void*, Traced> traced_;
  mutable std::vector<Traced> at_peak_;
  mutable std::atomic<int64_t> live_{0};
  mutable std::atomic<int64_t> peak_{0};
};

/// This process's peak resident set (VmHWM) in bytes; `reset_peak_rss` starts it anew (Linux's
/// clear_refs 5), so that a forked rank does not inherit its parent's.
inline int64_t peak_rss() {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  int64_t kb = 0;
  while (std::fgets(line, sizeof line, f))
    if (std::strncmp(line, "VmHWM:", 6) == 0) kb = std::atoll(line + 6);
  std::fclose(f);
  return kb * 1024;
}
inline void reset_peak_rss() {
  if (FILE* f = std::fopen("/proc/self/clear_refs", "w")) {
    std::fputs("5", f);
    std::fclose(f);
  }
}

}  // namespace fsdp_bench
