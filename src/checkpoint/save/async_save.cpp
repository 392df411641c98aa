// AsyncSaver (fsdp/checkpoint/async_save.h): a CPU snapshot into reused staging buffers, then
// checkpoint::save on a thread of its own with a process group of its own.
#include "fsdp/checkpoint/async_save.h"

#include <c10/util/Exception.h>

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

StateDict AsyncSaver::snapshot(const StateDict& state_dict) {
  size_t next = 0;
  // The k-th tensor met in traversal order goes to staging buffer k, reused if it still fits.
  auto stage = [&](const at::Tensor& t) {
    if (next == staging_.size()) staging_.emplace_back();
    at::Tensor& buf = staging_[next++];
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
  staging_.resize(next);  // buffers no longer used are freed
  return out;
}

void AsyncSaver::start(const StateDict& state_dict, std::function<void(const StateDict&)> write) {
  wait();
  // The thread owns the snapshot: it lives exactly as long as the write.
  worker_ = std::thread([this, snap = snapshot(state_dict), write = std::move(write)] {
    try {
      write(snap);
    } catch (...) {
      error_ = std::current_exception();
    }
  });
}

void AsyncSaver::save(const StateDict& state_dict, const std::string& dir) {
  start(state_dict, [this, dir](const StateDict& snap) { checkpoint::save(snap, dir, options_); });
}

void AsyncSaver::save_step(const StateDict& state_dict, const std::string& root, int64_t step) {
  start(state_dict, [this, root, step](const StateDict& snap) {
    checkpoint::save_step(snap, root, step, options_);
  });
}

}  // namespace checkpoint
}  // namespace fsdp
