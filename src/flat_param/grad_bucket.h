// Internal (exported to runtime/): a gradient bucket, DDP's Reducer bucket for NO_SHARD. Several
// units' flat gradients are reduced by one all-reduce instead of one each, so that a backward of
// many small units pays a collective's latency a few times rather than once per unit.
//
// Each unit's flat gradient gets a slot (add_slot), written by FlatParamHandle::reduce_grad_into
// and reduced when the bucket is launched; afterwards each slot's result shares the one reduced
// buffer's storage and becomes the unit's gradient (DDP's gradient_as_bucket_view, for the flat
// gradients: the bucket is freed with the last of them). The runtime sizes a bucket from the
// previous iteration's order of units ("planned"): when it is right, as it is in steady training,
// every slot is a slice of one buffer allocated up front (on the CPU, the last iteration's, once
// its gradients are dropped: see FsdpState::bucket_buffer) and the bucket costs no copy over the
// unbucketed reduction. When it is not (the first iteration, or units that arrive in another order
// or another size) the slots that do not fit get their own buffers, copied into one at launch.
// Either way what is reduced, and where each unit's result is, depends only on the order and
// sizes of the units added, which every rank shares.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "fsdp/dist.h"

namespace fsdp {
namespace detail {

class GradBucket {
 public:
  /// For tests only (the buckets' negative control): called by launch() on this process's every
  /// bucket with the buffer about to be reduced and each slot's range in it, once the slots'
  /// gradients are in it; it may change what the bucket sends, as a bucket that lost a gradient
  /// would. Null, the default, costs one atomic load per bucket.
  using LaunchHook = void (*)(const at::Tensor& buffer, const std::vector<int64_t>& offsets,
                              const std::vector<int64_t>& numels);
  static void set_launch_hook(LaunchHook hook);

  /// A bucket reduced over `group`, holding gradients of `dtype` on `device`, whose sum wait()
  /// divides by each of `divide_after` in turn (the averaging every unit of the bucket owes; one
  /// pass over the bucket instead of one per unit). `planned`, if defined, is a 1-D buffer of
  /// `dtype` on `device` (its contents are overwritten) that the slots fill in order from its
  /// start while they fit.
  GradBucket(dist::ProcessGroup group, at::ScalarType dtype, at::Device device,
             std::vector<double> divide_after, at::Tensor planned);

  /// A slot of `numel` elements to write a flat gradient into before launch(); returns its index.
  /// Every element of it must be written (the buffer is not zeroed).
  size_t add_slot(int64_t numel);
  at::Tensor slot(size_t k) const { return slots_.at(k); }
  /// Elements and bytes in the slots so far.
  int64_t numel() const { return numel_; }
  int64_t nbytes() const;
  at::ScalarType dtype() const { return dtype_; }
  const std::vector<double>& divide_after() const { return divide_after_; }
  at::Device device() const { return device_; }

  /// Starts the all-reduce (SUM) of every slot, as one collective. Idempotent: a handle that must
  /// finish its reduction before the runtime launched the bucket launches it (the same on every
  /// rank: the ranks run the same program). No slot may be added after it.
  void launch();
  bool launched() const { return launched_; }
  /// Waits for the all-reduce and divides the sum; then result(k) is slot k reduced. Idempotent.
  /// Throws DistError if the collective failed, and again on every later call (each unit of the
  /// bucket learns of it).
  void wait();
  /// Slot k's reduced values, in the bucket's storage (not an autograd view of it: an optimizer
  /// may detach_() a gradient in place). Valid after wait().
  at::Tensor result(size_t k) const;

 private:
  dist::ProcessGroup group_;
  at::ScalarType dtype_;
  at::Device device_;
  std::vector<double> divide_after_;
  at::Tensor planned_;  // given up front; slots fill it from the start while they fit
  std::vector<at::Tensor> slots_;
  std::vector<int64_t> offsets_;  // each slot's offset in the reduced buffer
  int64_t numel_ = 0;
  bool in_plan_ = true;  // every slot so far is a slice of planned_
  at::Tensor buffer_;    // what is reduced (set by launch)
  dist::Work work_;
  bool launched_ = false, waited_ = false;
  std::string failure_;  // the collective's error, for the units that wait after the first
};

}  // namespace detail
}  // namespace fsdp
