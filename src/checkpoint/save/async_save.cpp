// AsyncSaver (fsdp/checkpoint/async_save.h): a CPU snapshot into reused staging buffers, then
// checkpoint::save on a thread of its own with a process group of its own.
#include "fsdp/checkpoint/async_save.h"

#include <c10/util/Exception.h>

#include <functional>
#include <numeric>

#include "checkpoint/save/stream_copy.h"

namespace fsdp {
namespace checkpoint {

AsyncSaver::AsyncSaver(const SaveOptions& options) : options_(options) {
  dist::ProcessGroup* group = options.group();
  if (!group && dist::is_initialized()) group = &dist::default_group();
  if (group) {
    std::vector<int> ranks(static_cast<size_t>(group->size()));
    std::iota(ranks.begin(), ranks.end(), 0);
    own_group_ = std::make_unique<dist::ProcessGroup>(group->new_group(ranks));
  }
  // Null group with no default group: a single process, as checkpoint::save.
  options_.group(own_group_.get());
}

AsyncSaver::~AsyncSaver() {
  try {
    wait();
  } catch (const std::exception& e) {
    TORCH_WARN("fsdp AsyncSaver: the last save failed and nobody waited for it: ", e.what());
  }
}

void AsyncSaver::wait() {
  if (worker_.joinable()) worker_.join();
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

int64_t AsyncSaver::staging_bytes() const {
  int64_t n = 0;
  for (const auto& t : staging_) n += static_cast<int64_t>(t.numel()) * t.element_size();
  return n;
}

namespace {

// A CPU copy of `state_dict` in `staging`: the k-th tensor met in traversal order goes to buffer
// k, reused if it still fits; buffers no longer used are freed.
StateDict snapshot(const StateDict& state_dict, std::vector<at::Tensor>& staging) {
  size_t next = 0;
  auto stage = [&](const at::Tensor& t) {
    if (next == staging.size()) staging.emplace_back();
    at::Tensor& buf = staging[next++];
    if (!buf.defined() || buf.sizes() != t.sizes() || buf.scalar_type() != t.scalar_type())
      buf = at::empty(t.sizes(), t.options().device(at::kCPU).requires_grad(false));
    // Large contiguous CPU tensors of the same dtype (what a sharded state dict holds) are
    // copied with streaming stores: this copy is all the time training is blocked.
    if (t.device().is_cpu() && t.layout() == at::kStrided && !t.is_quantized() && !t.is_conj() &&
        !t.is_neg() && t.is_contiguous() && buf.is_contiguous() &&
        t.scalar_type() == buf.scalar_type() && t.numel() > 0)
      stream_copy(buf.data_ptr(), t.data_ptr(), static_cast<size_t>(t.numel()) * t.element_size());
    else
      buf.copy_(t.detach());
    return buf;
  };
  std::function<StateValue(const StateValue&)> copy = [&](const StateValue& v) -> StateValue {
    if (v.is_tensor()) return stage(v.tensor());
    if (v.is_sharded_tensor()) {
      const ShardedTensor& s = v.sharded_tensor();
      std::vector<Shard> shards;
      for (const auto& piece : s.local_shards())
        shards.push_back({stage(piece.tensor), piece.metadata});
      return ShardedTensor(s.size(), s.dtype(), std::move(shards), s.global_metadata());
    }
    if (v.is_dict()) {
      StateDict d;
      for (const auto& [k, x] : v.dict()) d.insert_or_assign(k, copy(x));
      return d;
    }
    if (v.is_list()) {
      StateList l;
      for (const auto& x : v.list()) l.push_back(copy(x));
      return l;
    }
    return v;
  };
  at::NoGradGuard no_grad;
  StateDict out = copy(StateValue(state_dict)).dict();
  staging.resize(next);
  return out;
}

// Runs `write(snap)` on a new thread, which owns the snapshot: it lives exactly as long as the
// write. An exception lands in `error` (owned by the saver, which joins the thread before
// reading it or dying).
std::thread write_in_background(StateDict snap, std::function<void(const StateDict&)> write,
                                std::exception_ptr& error) {
  return std::thread([snap = std::move(snap), write = std::move(write), &error] {
    try {
      write(snap);
    } catch (...) {
      error = std::current_exception();
    }
  });
}

}  // namespace

void AsyncSaver::save(const StateDict& state_dict, const std::string& dir) {
  wait();
  worker_ = write_in_background(
      snapshot(state_dict, staging_),
      [this, dir](const StateDict& snap) { checkpoint::save(snap, dir, options_); }, error_);
}

void AsyncSaver::save_step(const StateDict& state_dict, const std::string& root, int64_t step) {
  wait();
  worker_ = write_in_background(
      snapshot(state_dict, staging_),
      [this, root, step](const StateDict& snap) {
        checkpoint::save_step(snap, root, step, options_);
      },
      error_);
}

}  // namespace checkpoint
}  // namespace fsdp
