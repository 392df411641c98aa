// GradBucket: several units' flat gradients reduced by one all-reduce (see grad_bucket.h).
#include "flat_param/grad_bucket.h"

#include <atomic>

#include "fsdp/errors.h"
#include "util/message.h"
#include "util/tensor_utils.h"

namespace fsdp {
namespace detail {
namespace {
std::atomic<GradBucket::LaunchHook> g_launch_hook{nullptr};
}  // namespace

void GradBucket::set_launch_hook(LaunchHook hook) { g_launch_hook.store(hook); }

GradBucket::GradBucket(dist::ProcessGroup group, at::ScalarType dtype, at::Device device,
                       std::vector<double> divide_after, at::Tensor planned)
    : group_(std::move(group)),
      dtype_(dtype),
      device_(device),
      divide_after_(std::move(divide_after)),
      planned_(std::move(planned)) {
  if (planned_.defined() && (planned_.dim() != 1 || planned_.scalar_type() != dtype ||
                             planned_.device() != device || !planned_.is_contiguous())) {
    throw InternalError(
        "GradBucket: the planned buffer is not 1-D and contiguous in the bucket's "
        "dtype on its device");
  }
}

int64_t GradBucket::nbytes() const {
  return numel_ * static_cast<int64_t>(c10::elementSize(dtype_));
}

size_t GradBucket::add_slot(int64_t numel) {
  if (launched_) {
    throw InternalError("GradBucket::add_slot: the bucket was launched already");
  }
  const auto opts = at::TensorOptions().dtype(dtype_).device(device_);
  in_plan_ = in_plan_ && planned_.defined() && numel_ + numel <= planned_.numel();
  slots_.push_back(in_plan_ ? planned_.narrow(0, numel_, numel) : empty_buffer(numel, opts));
  offsets_.push_back(numel_);
  numel_ += numel;
  return slots_.size() - 1;
}

void GradBucket::launch() {
  if (launched_) return;
  launched_ = true;
  at::NoGradGuard no_grad;
  if (in_plan_ && planned_.defined() && numel_ == planned_.numel()) {
    buffer_ = planned_;  // the plan held: the slots are the buffer already
  } else if (slots_.size() == 1 && !in_plan_) {
    buffer_ = slots_[0];  // one unit alone: its own buffer, as without buckets
  } else {
    // The plan did not hold (or only partly): one exact buffer, so that no unfilled end of the
    // planned one stays alive as long as the gradients that view it.
    buffer_ = empty_buffer(numel_, at::TensorOptions().dtype(dtype_).device(device_));
    for (size_t k = 0; k < slots_.size(); ++k) {
      buffer_.narrow(0, offsets_[k], slots_[k].numel()).copy_(slots_[k]);
    }
  }
  planned_ = at::Tensor();
  for (size_t k = 0; k < slots_.size(); ++k) {
    slots_[k] = buffer_.narrow(0, offsets_[k], slots_[k].numel());
  }
  if (const LaunchHook hook = g_launch_hook.load(std::memory_order_relaxed)) {
    std::vector<int64_t> numels;
    for (const auto& s : slots_) numels.push_back(s.numel());
    hook(buffer_, offsets_, numels);
  }
  work_ = group_.all_reduce_async(buffer_, dist::ReduceOp::SUM);
}

void GradBucket::wait() {
  if (!launched_) throw InternalError("GradBucket::wait: the bucket was not launched");
  if (!waited_) {
    waited_ = true;
    try {
      work_.wait();
    } catch (const std::exception& e) {
      failure_ = e.what();
      throw;
    }
    // Element by element what each unit's own division would do, in the same order.
    at::NoGradGuard no_grad;
    for (double d : divide_after_) buffer_.div_(d);
  } else if (!failure_.empty()) {
    throw DistError(msg("a gradient bucket's all_reduce failed: ", failure_));
  }
}

at::Tensor GradBucket::result(size_t k) const {
  if (!waited_ || !failure_.empty()) {
    throw InternalError("GradBucket::result: the bucket's all_reduce has not completed");
  }
  // Sharing the buffer's storage but not an autograd view of it: an optimizer's zero_grad may
  // detach_() a gradient in place, which a view forbids (DDP's gradient_as_bucket_view caveat).
  const at::Tensor& s = slots_.at(k);
  return storage_alias(buffer_, s.storage_offset() - buffer_.storage_offset(), s.sizes());
}

}  // namespace detail
}  // namespace fsdp
