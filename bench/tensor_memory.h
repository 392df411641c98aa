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

#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>

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
  void reset_peak() { peak_.store(live_.load()); }

  // LibTorch 1.13 declares `allocate(size_t) const`, 2.x `allocate(size_t)`; defining both (and
  // 2.x's copy_data) without `override` makes this class implement whichever the headers declare.
  c10::DataPtr allocate(size_t n) const { return counted(n); }
  c10::DataPtr allocate(size_t n) { return counted(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const {
    std::memcpy(dest, src, count);
  }

 private:
  explicit TensorMemory(c10::Allocator* base) : base_(base) {}

  struct Block {
    c10::DataPtr inner;  // freed by the wrapped allocator when the Block is deleted
    size_t bytes;
    const TensorMemory* owner;
  };
  static void release(void* ctx) {
    auto* b = static_cast<Block*>(ctx);
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
    return c10::DataPtr(data, block, &TensorMemory::release, device);
  }

  c10::Allocator* base_;
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
