// Measures the CPU tensor memory a piece of code allocates, in every thread (c10d's worker threads
// free tensors too): while a MemoryWatch is alive, LibTorch's CPU allocator is wrapped by one that
// counts the bytes of blocks allocated since the watch began and not yet freed.
//
// Tensors allocated before the watch began are not counted when freed, so `peak()` is "at most
// this much extra" for code that replaces existing tensors: a conservative figure.
// One watch at a time per process; tests run ranks as processes, so each rank has its own.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "fsdp/compat.h"

namespace fsdp {
namespace testing {

class MemoryWatch : public c10::Allocator {
 public:
  MemoryWatch() : base_(c10::GetCPUAllocator()) { c10::SetCPUAllocator(this, /*priority=*/255); }
  ~MemoryWatch() override {
    counter_->closed = true;  // blocks freed later no longer count
    c10::SetCPUAllocator(base_, /*priority=*/255);
  }
  MemoryWatch(const MemoryWatch&) = delete;
  MemoryWatch& operator=(const MemoryWatch&) = delete;

  c10::DataPtr allocate(size_t n) FSDP_ALLOCATE_CONST override {
    c10::DataPtr inner = base_->allocate(n);
    auto* block = new Block{std::move(inner), n, counter_};
    void* data = block->inner.get();
    const c10::Device device = block->inner.device();
    counter_->add(static_cast<int64_t>(n));
    return c10::DataPtr(data, block, &Block::release, device);
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  // Pure virtual in LibTorch 2.x, absent in 1.13.
  void copy_data(void* dest, const void* src, std::size_t count) const {
    std::memcpy(dest, src, count);
  }

  /// Largest number of bytes allocated since the watch began and alive at the same moment.
  int64_t peak() const { return counter_->peak.load(); }
  int64_t current() const { return counter_->current.load(); }

 private:
  struct Counter {
    std::atomic<int64_t> current{0}, peak{0};
    std::atomic<bool> closed{false};
    void add(int64_t n) {
      if (closed) return;
      const int64_t now = current.fetch_add(n) + n;
      int64_t p = peak.load();
      while (now > p && !peak.compare_exchange_weak(p, now)) {
      }
    }
  };
  struct Block {
    c10::DataPtr inner;
    size_t bytes;
    std::shared_ptr<Counter> counter;  // outlives the watch if the block does
    static void release(void* ctx) {
      auto* b = static_cast<Block*>(ctx);
      b->counter->add(-static_cast<int64_t>(b->bytes));
      delete b;  // frees the block through the base allocator's deleter
    }
  };
  c10::Allocator* base_;
  std::shared_ptr<Counter> counter_ = std::make_shared<Counter>();
};

}  // namespace testing
}  // namespace fsdp
