// Internal: loading dicts that only rank 0 holds (StateDictOptions::broadcast_from_rank0): the
// other ranks learn the structure, then values travel one tensor at a time and each rank keeps
// only its part, so no rank ever holds the whole model or optimizer state beyond rank 0's dict.
//
// Each piece lives with the code it shares most with:
// - ScratchBuffers: here (inline), for both loads below;
// - broadcast_structure, broadcast_whole_state_dict: broadcast_state_dict.cpp, beside
//   broadcast_state_dict, whose skeleton they send;
// - load_state_dict_from_rank0: load_state_dict.cpp, which checks and copies as load_state_dict;
// - load_optim_state_dict_from_rank0: optim_load.cpp, which checks and builds the new state as
//   load_optim_state_dict.
#pragma once

#include "fsdp/model_state_dict.h"
#include "fsdp/state_value.h"

#include <algorithm>
#include <vector>

namespace fsdp {
namespace detail {

/// Receive buffers reused across the tensors of one load from rank 0, one per dtype and device,
/// sized for the largest tensor. Allocating one per tensor would briefly hold two: c10d's worker
/// thread may drop its reference to a finished broadcast's tensor only after the caller moved on.
/// A tensor `get` returns is valid until the next call.
class ScratchBuffers {
 public:
  explicit ScratchBuffers(int64_t max_numel) : max_numel_(max_numel) {}
  at::Tensor get(at::IntArrayRef shape, at::ScalarType dtype, at::Device device) {
    const int64_t numel = c10::multiply_integers(shape);
    for (auto& b : bufs_) {
      if (b.scalar_type() == dtype && b.device() == device && b.numel() >= numel)
        return b.narrow(0, 0, numel).view(shape);
    }
    bufs_.push_back(
        at::empty({std::max(numel, max_numel_)}, at::TensorOptions().dtype(dtype).device(device)));
    return bufs_.back().narrow(0, 0, numel).view(shape);
  }
  /// `src` itself if it already has the dtype and device and is contiguous, else a copy of it in
  /// a scratch buffer (the sending side).
  at::Tensor as(const at::Tensor& src, at::ScalarType dtype, at::Device device) {
    if (src.scalar_type() == dtype && src.device() == device && src.is_contiguous()) return src;
    return get(src.sizes(), dtype, device).copy_(src);
  }

 private:
  int64_t max_numel_;
  std::vector<at::Tensor> bufs_;
};

/// Rank `src`'s dict on `src`; on the other ranks its structure: the same nested keys and lists,
/// non-tensor values and 0-d tensors by value, every other tensor as a ShardedTensor of its shape
/// and dtype holding no pieces. One broadcast. Empty dicts and lists do not survive.
/// Throws ValueError (on every rank) if `src`'s dict holds a ShardedTensor.
StateDict broadcast_structure(const StateDict& sd, dist::ProcessGroup& pg, int src);

/// Rank `src`'s dict (full tensors and other values) on every rank, tensors received one at a
/// time into tensors of their own on the CPU: for plain replicas, which hold whole states anyway.
/// Empty dicts and lists do not survive. Throws ValueError (on every rank) if `src`'s dict holds
/// a ShardedTensor. Collective over `pg`.
StateDict broadcast_whole_state_dict(const StateDict& sd, dist::ProcessGroup& pg, int src);

/// load_state_dict of a FULL dict that only rank 0 holds (the others pass an empty one): rank 0
/// checks it against the model, the ranks agree, then each parameter and buffer is broadcast in
/// turn and every rank copies its own range into its shard. Peak extra memory: one parameter.
/// Collective over the model's world group. Throws ValueError (every rank) before anything is
/// written if rank 0's dict does not fit; a collective failing midway (DistError) may leave the
/// model partly loaded, as the group is then unusable anyway.
LoadResult load_state_dict_from_rank0(FullyShardedDataParallel& model, const StateDict& sd,
                                      bool strict);

/// load_optim_state_dict of a FULL optimizer dict that only rank 0 holds: the same checks on
/// every rank against the broadcast structure, then each state tensor is broadcast in turn and
/// every rank keeps its range in the new state it builds. Peak extra memory: the new state (this
/// rank's shard of it, which replaces the old) plus one state tensor. All-or-nothing as
/// load_optim_state_dict. Collective over the model's world group.
void load_optim_state_dict_from_rank0(FullyShardedDataParallel& model,
                                      torch::optim::Optimizer& optimizer, const StateDict& osd);

}  // namespace detail
}  // namespace fsdp
