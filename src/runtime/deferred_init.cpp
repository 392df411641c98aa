// wrap_deferred: build a model without allocating the parameters this rank drops.
//
// How. A module constructor's allocations, and the random numbers its initialisers draw, come in
// the same order every time it runs from the same generator state. So the constructor runs under
// a replacement of LibTorch's CPU allocator that numbers the allocations of this thread:
//  1. A first run gives every allocation "fake" memory: address space whose pages all map one
//     small shared buffer, so the whole model costs next to nothing and its values are garbage.
//     That model is wrapped (with the caller's options, on the CPU) to learn the layout: which
//     parameters each unit flattens, and which of them reach into this rank's shard.
//  2. The generator is put back, and the constructor runs again. Now a flattened parameter gets
//     real memory only for the bytes this rank's shard holds of it (whole pages around them; the
//     rest of its address space is fake), or none if the shard holds none of it; buffers and
//     every temporary (anything freed during the first run) are real. Initialisers write whole
//     tensors, element by element from the generator, so the kept elements come out exactly as
//     in an eager run. That model is wrapped for good: flattening reads garbage only for elements
//     outside this rank's shard, which it discards.
// With verify, a run between the two computes the kept parameters with another fake buffer (a
// different period, a different fill) and compares fingerprints: a constructor that reads another
// tensor's values makes them differ.
// With sync_module_states (PyTorch's rank-0 path), rank 0's second run is an ordinary one (the
// whole model, real), and rank 0's values are broadcast into every other rank's second-run model
// before the wrap (rank0_values.h), each rank keeping only the bytes its plan made real.
#include "fsdp/deferred_init.h"

#include <malloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "dist/agreement.h"
#include "fsdp/compat.h"
#include "fsdp/dist.h"
#include "fsdp/errors.h"
#include "runtime/rank0_values.h"
#include "util/message.h"
#include "util/module_tree.h"

namespace fsdp {
namespace detail {
namespace {

size_t page_size() { return static_cast<size_t>(::sysconf(_SC_PAGESIZE)); }
size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// A fake allocation's address space: `total` bytes from `base`, of which pages [real_lo,
// real_hi) are private memory (a kept part of a parameter) and the rest map the shared buffer.
struct FakeRegion {
  char* base = nullptr;
  size_t total = 0, real_lo = 0, real_hi = 0;

  // Drops this process's page-table entries for the shared part. The data stays in the buffer
  // and comes back on the next touch; without this, each mapping of a buffer page counts once
  // more in the process's resident set (VmRSS) although it is one page of memory.
  void zap() const {
    if (real_lo > 0) ::madvise(base, real_lo, MADV_DONTNEED);
    if (total > real_hi) ::madvise(base + real_hi, total - real_hi, MADV_DONTNEED);
  }
};

// The physical memory behind every fake allocation: one buffer of `bytes`, mapped again and
// again. Its pages are shared by every fake tensor, which is the point: they hold garbage.
// Allocation i's mapping starts `i * stride` bytes into the buffer (0: all at its start), so
// that two backings with different strides lay the same run out differently.
class FakeBacking {
 public:
  FakeBacking(size_t bytes, size_t stride, unsigned char fill) : bytes_(bytes), stride_(stride) {
    fd_ = ::memfd_create("fsdp-deferred-init", MFD_CLOEXEC);
    if (fd_ < 0 || ::ftruncate(fd_, static_cast<off_t>(bytes)) != 0) {
      const int e = errno;
      if (fd_ >= 0) ::close(fd_);
      throw IOError(msg("wrap_deferred: cannot create the shared buffer behind the parameters "
                        "this rank drops (memfd_create/ftruncate): ",
                        std::strerror(e)),
                    e);
    }
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (p != MAP_FAILED) {
      std::memset(p, fill, bytes);
      ::munmap(p, bytes);
    }
  }
  ~FakeBacking() { ::close(fd_); }
  FakeBacking(const FakeBacking&) = delete;
  FakeBacking& operator=(const FakeBacking&) = delete;

  // Allocation `index`'s `n` bytes of address space mapping the buffer, except bytes [lo, hi)
  // (rounded out to pages), which are private memory of their own. A null base if the kernel
  // refuses (too many mappings: vm.max_map_count).
  FakeRegion map(size_t n, size_t index, size_t lo = 0, size_t hi = 0) const {
    const size_t page = page_size();
    FakeRegion r;
    r.total = round_up(n, page);
    void* base =
        ::mmap(nullptr, r.total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) return FakeRegion();
    r.base = static_cast<char*>(base);
    size_t from = index * stride_ % bytes_ / page * page;
    for (size_t off = 0; off < r.total; from = 0) {
      const size_t len = std::min(bytes_ - from, r.total - off);
      if (::mmap(r.base + off, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd_,
                 static_cast<off_t>(from)) == MAP_FAILED) {
        ::munmap(base, r.total);
        return FakeRegion();
      }
      off += len;
    }
    if (hi > lo) {
      r.real_lo = lo / page * page;
      r.real_hi = std::min(r.total, round_up(hi, page));
      if (::mmap(r.base + r.real_lo, r.real_hi - r.real_lo, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED) {
        ::munmap(base, r.total);
        return FakeRegion();
      }
    }
    return r;
  }

 private:
  size_t bytes_, stride_;
  int fd_ = -1;
};

constexpr size_t kBackingBytes = size_t{4} << 20;

// Where allocation i of a run goes: real memory, fake memory, or fake but for bytes [lo, hi).
struct Placement {
  enum Kind { REAL, FAKE, PARTIAL } kind = REAL;
  size_t lo = 0, hi = 0;
};

// What the allocator learned about the allocations of one run, in order.
struct AllocationLog {
  std::mutex mu;
  std::vector<size_t> bytes;               // requested size of allocation i
  std::vector<void*> data;                 // its address
  std::vector<bool> alive;                 // not yet freed
  std::vector<bool> fake;                  // given fake memory (wholly or partly)
  std::vector<size_t> mismatched;          // indices whose size differs from the plan's
  std::map<const void*, FakeRegion> live;  // every fake region not yet freed, by base
  std::vector<const void*> recent;         // those mapped since the last zap_recent()

  // Zaps the regions mapped since the last call (what an initialiser has written since). Later
  // writes to older ones (a second initialisation pass over the model) are zapped by the
  // allocator's sweeper, and at the end of the run by zap_live(). Requires `mu`.
  void zap_recent() {
    for (const void* base : recent) {
      auto it = live.find(base);
      if (it != live.end()) it->second.zap();
    }
    recent.clear();
  }
  void zap_live() {
    for (const auto& r : live) r.second.zap();
    recent.clear();
  }
};

// The context of a fake allocation's DataPtr: unmaps it, and marks it freed in its run's log
// (and no longer to zap: its addresses may serve a real allocation next).
struct FakeBlock {
  FakeRegion region;
  size_t index;
  std::shared_ptr<AllocationLog> log;

  static void release(void* ctx) {
    auto* b = static_cast<FakeBlock*>(ctx);
    {
      std::lock_guard<std::mutex> lock(b->log->mu);
      b->log->alive[b->index] = false;
      b->log->live.erase(b->region.base);
      ::munmap(b->region.base, b->region.total);
    }
    delete b;
  }
};

// The context of a real allocation made during a run: frees it through the real allocator's own
// deleter and marks it freed.
struct RealBlock {
  c10::DataPtr inner;
  size_t index;
  std::shared_ptr<AllocationLog> log;

  static void release(void* ctx) {
    auto* b = static_cast<RealBlock*>(ctx);
    {
      std::lock_guard<std::mutex> lock(b->log->mu);
      b->log->alive[b->index] = false;
    }
    delete b;  // frees `inner`
  }
};

// Replaces LibTorch's CPU allocator while alive. Allocations of the constructing thread are
// numbered; allocation i goes where `plan` says (every one is fake when `plan` is null). Other
// threads' allocations (the intra-op pool's scratch, c10d's workers) pass through.
class ReplayAllocator final : public c10::Allocator {
 public:
  ReplayAllocator(const FakeBacking& backing, const std::vector<Placement>* plan,
                  const std::vector<size_t>* planned_bytes)
      : backing_(backing),
        plan_(plan),
        planned_bytes_(planned_bytes),
        real_(c10::GetCPUAllocator()),
        owner_(std::this_thread::get_id()),
        log_(std::make_shared<AllocationLog>()) {
    c10::SetCPUAllocator(this, /*priority=*/255);
    sweeper_ = std::thread([this] { sweep(); });
  }
  ~ReplayAllocator() override {
    c10::SetCPUAllocator(real_, /*priority=*/255);
    {
      std::lock_guard<std::mutex> lock(log_->mu);
      stop_ = true;
    }
    wake_.notify_all();
    sweeper_.join();
    std::lock_guard<std::mutex> lock(log_->mu);
    log_->zap_live();
  }
  ReplayAllocator(const ReplayAllocator&) = delete;
  ReplayAllocator& operator=(const ReplayAllocator&) = delete;

  c10::DataPtr allocate(size_t n) FSDP_ALLOCATE_CONST override {
    if (std::this_thread::get_id() != owner_) return real_->allocate(n);
    std::lock_guard<std::mutex> lock(log_->mu);
    const size_t i = log_->bytes.size();
    const bool planned = plan_ && i < plan_->size();
    if (planned && (*planned_bytes_)[i] != n) log_->mismatched.push_back(i);
    Placement where;
    if (!plan_) where.kind = Placement::FAKE;
    if (planned) where = (*plan_)[i];
    // Whatever the last allocation's initialiser wrote to fake memory is written by now: drop
    // its page-table entries, so that the resident set counts the buffer's pages about once.
    log_->zap_recent();
    FakeRegion region;
    if (n > 0 && where.kind != Placement::REAL) {
      const bool part = where.kind == Placement::PARTIAL;
      region = backing_.map(n, i, part ? where.lo : 0, part ? std::min(where.hi, n) : 0);
      if (!region.base) {
        // Real memory instead would be the whole model this is here to avoid.
        throw IOError(msg("wrap_deferred: cannot map ", n, " bytes of address space for a ",
                          "parameter this rank does not hold (", i, " allocations so far; the ",
                          "kernel's vm.max_map_count may be too low for this model)"),
                      ENOMEM);
      }
    }
    const bool fake = region.base != nullptr;
    log_->bytes.push_back(n);
    log_->alive.push_back(true);
    log_->fake.push_back(fake);
    if (fake) {
      log_->data.push_back(region.base);
      log_->live[region.base] = region;
      log_->recent.push_back(region.base);
      return c10::DataPtr(region.base, new FakeBlock{region, i, log_}, &FakeBlock::release,
                          c10::Device(c10::DeviceType::CPU));
    }
    auto* block = new RealBlock{real_->allocate(n), i, log_};
    void* data = block->inner.get();
    log_->data.push_back(data);
    return c10::DataPtr(data, block, &RealBlock::release, c10::Device(c10::DeviceType::CPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  // Pure virtual in LibTorch 2.x, absent in 1.13.
  void copy_data(void* dest, const void* src, std::size_t count) const {
    std::memcpy(dest, src, count);
  }

  const std::shared_ptr<AllocationLog>& log() const { return log_; }

 private:
  // Every 10 ms, zaps every live fake region, 256 at a time under the log's lock (a region's
  // addresses may be reused by a real allocation once it is freed, so it must not be zapped
  // after that). Bounds what writes without allocations in between (an initialisation pass over
  // the finished model) add to the resident set.
  void sweep() {
    std::unique_lock<std::mutex> lock(log_->mu);
    while (!stop_) {
      wake_.wait_for(lock, std::chrono::milliseconds(10), [this] { return stop_; });
      const void* from = nullptr;
      while (!stop_) {
        auto it = log_->live.upper_bound(from);
        for (int n = 0; n < 256 && it != log_->live.end(); ++n, ++it) {
          it->second.zap();
          from = it->first;
        }
        if (it == log_->live.end()) break;
        lock.unlock();  // let the constructing thread allocate between batches
        lock.lock();
      }
    }
  }

  const FakeBacking& backing_;
  const std::vector<Placement>* plan_;
  const std::vector<size_t>* planned_bytes_;
  c10::Allocator* real_;
  std::thread::id owner_;
  std::shared_ptr<AllocationLog> log_;
  bool stop_ = false;  // guarded by log_->mu
  std::condition_variable wake_;
  std::thread sweeper_;
};

using ModulePtr = std::shared_ptr<torch::nn::Module>;

// Every parameter and buffer of `root` with its FQN (tied ones under each owner's name) and the
// index of the allocation its storage came from (SIZE_MAX if none of this run's).
struct TensorSite {
  std::string fqn;
  at::Tensor tensor;
  // Its bytes, and whether it is the whole of a contiguous storage of its own, as it was built
  // (wrapping replaces the tensor's data in place).
  size_t bytes = 0;
  // As built: the layout wrap may give the tensor another dtype (mixed precision).
  size_t element_size = 0;
  bool plain = false;
  const torch::nn::Module* module;
  std::string name;
  bool is_param;
  size_t allocation;
};

std::vector<TensorSite> tensor_sites(const ModulePtr& root, const AllocationLog& log) {
  std::unordered_map<const void*, size_t> index_of;
  for (size_t i = 0; i < log.data.size(); ++i) {
    if (log.alive[i] && log.data[i]) index_of[log.data[i]] = i;
  }
  std::vector<TensorSite> out;
  for (const auto& item : root->named_modules("", /*include_self=*/true)) {
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    auto add = [&](const std::string& name, const at::Tensor& t, bool is_param) {
      size_t at = SIZE_MAX;
      if (t.defined() && t.has_storage()) {
        auto it = index_of.find(t.storage().data_ptr().get());
        if (it != index_of.end()) at = it->second;
      }
      TensorSite site{prefix + name, t, 0, 0, false, item.value().get(), name, is_param, at};
      if (t.defined()) {
        site.element_size = t.element_size();
        site.bytes = static_cast<size_t>(t.numel()) * site.element_size;
        site.plain =
            t.is_contiguous() && t.storage_offset() == 0 && t.storage().nbytes() == site.bytes;
      }
      out.push_back(std::move(site));
    };
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      add(p.key(), p.value(), true);
    }
    for (const auto& b : item.value()->named_buffers(/*recurse=*/false)) {
      add(b.key(), b.value(), false);
    }
  }
  return out;
}

// The global CPU generator's state, put back before each run so that every run draws the same.
class GeneratorState {
 public:
  GeneratorState() : gen_(at::detail::getDefaultCPUGenerator()) {
    std::lock_guard<std::mutex> lock(gen_.mutex());
    state_ = gen_.get_state();
  }
  void restore() {
    std::lock_guard<std::mutex> lock(gen_.mutex());
    gen_.set_state(state_);
  }

 private:
  at::Generator gen_;
  at::Tensor state_;
};

// One run of the constructor under a ReplayAllocator; the log describes its allocations.
struct Run {
  DeferredBuild built;
  std::shared_ptr<AllocationLog> log;
};

Run run_constructor(const std::function<DeferredBuild()>& build, const FakeBacking& backing,
                    const std::vector<Placement>* plan, const std::vector<size_t>* planned_bytes) {
  Run r;
  {
    ReplayAllocator alloc(backing, plan, planned_bytes);
    r.built = build();
    r.log = alloc.log();
  }
  if (!r.built.module) throw ValueError("wrap_deferred: the constructor returned no module");
  return r;
}

// The first run's verdict: where each allocation goes in the runs that follow. A flattened
// parameter that reaches nowhere into this rank's shard is fake; one that does is fake but for the
// bytes the shard holds (real whole if it is not a plain contiguous tensor of its own
// allocation); everything else is real.
std::vector<Placement> placements(const Run& first) {
  const auto sites = tensor_sites(first.built.module, *first.log);
  std::map<std::pair<const torch::nn::Module*, std::string>, const TensorSite*> site_of;
  for (const auto& s : sites) {
    if (s.is_param) site_of[{s.module, s.name}] = &s;
  }
  // The layout: wrap this instance on the CPU, as the caller's options would (the device only
  // moves tensors, and rank 0's broadcast would only overwrite fake values).
  FullyShardedOptions options = first.built.options;
  options.device_id(std::nullopt);
  options.sync_module_states(false);
  FullyShardedDataParallel layout(
      std::make_shared<FullyShardedDataParallelImpl>(first.built.any, first.built.module, options));
  const std::vector<size_t>& bytes = first.log->bytes;
  std::vector<Placement> plan(bytes.size());
  std::vector<int> owners(bytes.size(), 0);
  for (FlatParamHandle* h : layout->handles()) {
    if (!h) continue;
    const auto& infos = h->param_infos();
    const auto& shard = h->shard_param_infos();
    for (size_t i = 0; i < infos.size(); ++i) {
      auto it = site_of.find({infos[i].module.get(), infos[i].param_name});
      if (it == site_of.end() || it->second->allocation == SIZE_MAX) continue;
      const size_t a = it->second->allocation;
      const TensorSite& site = *it->second;
      const size_t size = site.element_size;  // site.tensor's dtype is the layout wrap's now
      Placement& p = plan[a];
      if (++owners[a] > 1) {
        p = Placement();  // several parameters in one allocation: kept whole
      } else if (!shard[i].in_shard) {
        p.kind = Placement::FAKE;
      } else if (site.plain && site.bytes == bytes[a]) {
        p.kind = Placement::PARTIAL;
        p.lo = static_cast<size_t>(shard[i].intra_param_start_idx) * size;
        p.hi = static_cast<size_t>(shard[i].intra_param_end_idx + 1) * size;
      }
    }
  }
  return plan;
}

// Throws ValueError unless `run` allocated as the first run did.
void check_same_allocations(const Run& run, const AllocationLog& first, const char* which) {
  const AllocationLog& log = *run.log;
  if (log.mismatched.empty() && log.bytes.size() == first.bytes.size()) return;
  const size_t at = !log.mismatched.empty() ? log.mismatched.front()
                                            : std::min(log.bytes.size(), first.bytes.size());
  throw ValueError(msg("wrap_deferred: the constructor allocated differently in its ", which,
                       " run than in its first (", log.bytes.size(), " allocations against ",
                       first.bytes.size(), "; they part at allocation ", at,
                       "): it must build the same model, with the same tensors in the same "
                       "order, every time it runs from the same generator state"));
}

// A fingerprint of the bytes this rank keeps of every parameter, by FQN.
std::map<std::string, size_t> kept_fingerprints(const Run& run,
                                                const std::vector<Placement>& plan) {
  std::map<std::string, size_t> out;
  for (const auto& s : tensor_sites(run.built.module, *run.log)) {
    if (!s.is_param || s.allocation == SIZE_MAX || s.allocation >= plan.size()) continue;
    const Placement& p = plan[s.allocation];
    if (p.kind == Placement::FAKE) continue;
    const at::Tensor t = s.tensor.contiguous();
    const size_t all = static_cast<size_t>(t.numel()) * t.element_size();
    const size_t lo = p.kind == Placement::PARTIAL ? std::min(p.lo, all) : 0;
    const size_t hi = p.kind == Placement::PARTIAL ? std::min(p.hi, all) : all;
    const std::string_view kept(static_cast<const char*>(t.data_ptr()) + lo, hi - lo);
    out[s.fqn] = std::hash<std::string_view>()(kept);
  }
  return out;
}

// Every rank agrees or every rank throws: a rank whose constructor failed, or whose check did,
// must not leave the others waiting in the wrap that follows.
void agree_on(dist::ProcessGroup& group, const std::function<void()>& step) {
  dist::Verdict mine;
  try {
    step();
  } catch (const std::exception& e) {
    mine = dist::Verdict::failed(e);
  }
  dist::agree(&group, mine, [](int r, const std::string& m) {
    return msg("wrap_deferred failed on ", rank(r), ": ", m);
  });
}

dist::ProcessGroup group_of(const Run& run) {
  if (run.built.module && run.built.options.process_group()) {
    return *run.built.options.process_group();
  }
  return dist::default_group();
}

// With verify: throws ValueError naming a kept parameter whose bytes differ between the runs.
void check_same_values(const std::map<std::string, size_t>& probe, const Run& real,
                       const std::vector<Placement>& plan, int r) {
  for (const auto& [fqn, hash] : kept_fingerprints(real, plan)) {
    auto it = probe.find(fqn);
    if (it != probe.end() && it->second != hash) {
      throw ValueError(msg("wrap_deferred: parameter ", quote(fqn), " came out differently on ",
                           rank(r),
                           " in two runs of the constructor: its initialisation reads the "
                           "values of a tensor this rank does not hold (another parameter, or a "
                           "value computed from one). Initialise it from its own shape and the "
                           "generator only, or build the model eagerly"));
    }
  }
}

// Each parameter's numel and dtype, in module order (tied ones once): what the rank-0 broadcast
// needs every rank to agree on.
std::vector<std::pair<int64_t, at::ScalarType>> param_signature(const ModulePtr& module) {
  std::vector<std::pair<int64_t, at::ScalarType>> out;
  for (const auto& p : detail::distinct_parameters(*module))
    out.emplace_back(p.numel(), p.scalar_type());
  return out;
}

// The bytes of each parameter that `plan` made real in `run`.
KeptBytes kept_bytes(const Run& run, const std::vector<Placement>& plan) {
  auto kept = std::make_shared<std::unordered_map<const c10::TensorImpl*, Placement>>();
  for (const auto& s : tensor_sites(run.built.module, *run.log)) {
    if (s.is_param && s.allocation < plan.size())
      (*kept)[s.tensor.unsafeGetTensorImpl()] = plan[s.allocation];
  }
  return [kept](const at::Tensor& p) -> std::pair<size_t, size_t> {
    const auto all = static_cast<size_t>(p.numel()) * p.element_size();
    auto it = kept->find(p.unsafeGetTensorImpl());
    if (it == kept->end() || it->second.kind == Placement::REAL) return {0, all};
    if (it->second.kind == Placement::FAKE) return {0, 0};
    return {std::min(it->second.lo, all), std::min(it->second.hi, all)};
  };
}

// Slices of the rank-0 broadcast: what a rank other than 0 holds beyond its share meanwhile.
constexpr size_t kRank0SliceBytes = size_t{16} << 20;

}  // namespace

FullyShardedDataParallel wrap_deferred(const std::function<DeferredBuild()>& build,
                                       const DeferredInitOptions& deferred) {
  GeneratorState generator;
  // 4 MiB of shared buffer (resident, as the pages initialisers write are): a parameter of any
  // size maps onto it, one mapping per 4 MiB, so a model of 100 GB needs some 25,000 of the
  // kernel's default 65,530. Every allocation maps it from its start, so a value read back from
  // a dropped tensor is whatever was written there last. verify's buffer has another size and
  // fill, and starts each allocation elsewhere in it: a value read from a dropped tensor differs
  // between the two runs unless nothing overwrote it in either.
  const FakeBacking backing(kBackingBytes, 0, 0);
  Run first;
  std::exception_ptr failed;
  try {
    first = run_constructor(build, backing, nullptr, nullptr);
  } catch (...) {
    failed = std::current_exception();
  }
  dist::ProcessGroup group = group_of(first);
  agree_on(group, [&] {
    if (failed) std::rethrow_exception(failed);
  });
  // PyTorch's rank-0 path: rank 0 builds the whole model for real; the others build theirs
  // deferred, and rank 0's values are broadcast into it before the wrap (broadcast_rank0_values:
  // slices into a scratch buffer, of which each rank keeps only the bytes its plan made real).
  // The other ranks' own values do not matter, so there is nothing to verify.
  const bool sync = first.built.options.sync_module_states();
  const bool source = sync && group.rank() == 0;
  std::vector<std::pair<int64_t, at::ScalarType>> signature;
  if (sync) signature = param_signature(first.built.module);
  const std::vector<Placement> plan = placements(first);
  const std::vector<size_t> planned_bytes = first.log->bytes;
  const auto first_log = first.log;
  first = Run();  // the fake model and its wrapper go before the real one is built
  // The layout wrapper's shards went back to malloc, which keeps freed heap memory: hand it to
  // the kernel, or the resident set stays a share higher for the rest of the start-up.
  ::malloc_trim(0);

  Run real;
  const bool verify = deferred.verify() && !sync;
  agree_on(group, [&] {
    std::map<std::string, size_t> probe;
    if (verify) {
      const FakeBacking other(kBackingBytes - (size_t{7} << 12), size_t{37} << 12, 0x7f);
      generator.restore();
      Run run = run_constructor(build, other, &plan, &planned_bytes);
      check_same_allocations(run, *first_log, "verifying");
      probe = kept_fingerprints(run, plan);
    }
    generator.restore();
    if (source) {
      real.built = build();  // the whole model, as an eager construction makes it
      if (!real.built.module) throw ValueError("wrap_deferred: the constructor returned no module");
      if (param_signature(real.built.module) != signature) {
        throw ValueError(
            "wrap_deferred: with sync_module_states, rank 0's constructor built parameters of "
            "other sizes or dtypes in its second run than in its first");
      }
      return;
    }
    real = run_constructor(build, backing, &plan, &planned_bytes);
    check_same_allocations(real, *first_log, "second");
    if (verify) check_same_values(probe, real, plan, group.rank());
  });
  if (sync) {
    // Here rather than in the wrap, which would broadcast into the fake pages (resident once
    // written) whole tensors at a time.
    broadcast_rank0_values(real.built.module, group, source ? KeptBytes() : kept_bytes(real, plan),
                           kRank0SliceBytes);
    real.built.options.sync_module_states(false);
  }
  FullyShardedDataParallel wrapped(std::make_shared<FullyShardedDataParallelImpl>(
      std::move(real.built.any), real.built.module, std::move(real.built.options)));
  // The same for what wrapping allocated and freed (unit-sized buffers among it).
  ::malloc_trim(0);
  return wrapped;
}

}  // namespace detail
}  // namespace fsdp
