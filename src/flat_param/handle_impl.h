// Internal: the state and the private helpers of a FlatParamHandle, kept out of the public header
// (fsdp/flat_param.h documents every public member; FlatParamHandle forwards each to the member of
// the same name here). Defined in handle.cpp (flatten, shard, unshard, reshard, write-back) and
// gradients.cpp (gradients).
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "fsdp/flat_param.h"

namespace fsdp {
namespace detail {

class HandleImpl {
 public:
  HandleImpl(std::vector<ParamInfo> params, dist::ProcessGroup group,
             FlatParamHandleOptions options = {});
  ~HandleImpl();
  HandleImpl(const HandleImpl&) = delete;
  HandleImpl& operator=(const HandleImpl&) = delete;

  // ---------------------------------------------------------------------------------------
  // Unshard / reshard

  void unshard();
  void unshard_async();
  void wait_unshard();
  bool has_pending_unshard() const { return static_cast<bool>(pending_unshard_); }
  void abandon_unshard();
  void reshard(bool free_unsharded = true);
  bool is_unsharded() const { return unsharded_views_; }
  at::Tensor shard_to_gather();
  bool skipped_use_sharded_views() const { return skipped_sharded_views_; }
  int64_t unsharded_storage_bytes() const;
  bool comm_failed() const { return comm_failed_; }

  // ---------------------------------------------------------------------------------------
  // Gradients

  void reduce_grad();
  void reduce_grad_async();
  void finish_reduce_grad();
  void reduce_grad_into(const std::shared_ptr<detail::GradBucket>& bucket);
  std::vector<double> grad_bucket_divisions() const;
  bool has_pending_reduce_grad() const { return static_cast<bool>(pending_reduce_); }
  void reduce_flat_grad(const at::Tensor& unsharded_flat_grad);
  void prepare_grads_for_backward();
  void mark_grads_unreduced();
  void unshard_grad();
  void reshard_grad();
  void reset_flat_param_grad_info_if_needed();
  at::Tensor take_orig_grads();
  void take_orig_grads_into(const at::Tensor& flat);

  // ---------------------------------------------------------------------------------------
  // Write-back (use_orig_params)

  bool writeback_orig_params();
  void writeback_unsharded();

  // ---------------------------------------------------------------------------------------
  // Accessors

  const at::Tensor& flat_param() const { return flat_param_; }
  at::Tensor sharded_grad() const;
  const FlatParamLayout& layout() const { return layout_; }
  const std::vector<ParamInfo>& param_infos() const { return param_infos_; }
  const std::vector<SharedParamInfo>& shared_param_infos() const { return shared_param_infos_; }
  const std::vector<ShardParamInfo>& shard_param_infos() const { return shard_param_infos_; }
  int64_t shard_numel_padded() const { return shard_numel_padded_; }
  FlatParamShardMetadata shard_metadata() const { return layout_.shard_metadata(rank_); }
  std::vector<at::Tensor> orig_params() const;
  const FlatParamHandleOptions& options() const { return options_; }
  dist::ProcessGroup& process_group() { return group_; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  bool uses_sharded_strategy() const {
    return options_.sharding_strategy() != ShardingStrategy::NO_SHARD;
  }
  at::ScalarType orig_dtype() const { return orig_dtype_; }
  at::ScalarType compute_dtype() const { return fwd_bwd_dtype_; }
  at::ScalarType reduce_dtype() const { return reduce_dtype_; }

  HandleTrainingState training_state() const { return training_state_; }
  void set_training_state(HandleTrainingState s) {
    training_state_ = s;
    if (s != HandleTrainingState::BACKWARD_POST) grad_scratch_ = at::Tensor();
  }
  void set_full_precision_in_eval(bool on) { full_prec_in_eval_ = on; }
  double gradient_predivide_factor() const { return predivide_; }
  double gradient_postdivide_factor() const { return postdivide_; }

 private:
  bool force_full_precision() const;
  void finish_unshard();
  // Starts reducing `g` (padded unsharded numel, reduce dtype, on device, owned: modified in
  // place) into pending_reduce_; finish_reduce_grad() completes it. `predivided`: `g` was divided
  // by copy_divisor() already (take_orig_grads(copy_divisor())); else it is divided here.
  void start_reduce(at::Tensor g, bool predivided);
  // take_orig_grads() with each gradient divided by `divisor` as it is copied.
  at::Tensor take_orig_grads(double divisor);
  // The division done before the reduction, while the gradients are copied into the flat gradient
  // (1: none); gradients.cpp says why it is placed where it is.
  double copy_divisor() const;
  // take_orig_grads' alternative that copies only small gradients: the gradient as chunks of
  // pieces for dist::ProcessGroup::reduce_scatter_pieces_async, or empty where it does not apply
  // (decided by the configuration and layout alone, the same on every rank).
  std::vector<std::vector<at::Tensor>> take_orig_grads_in_pieces();
  // A started reduction: the collective and both of its buffers, which the backend reads and
  // writes until the collective is done.
  struct PendingReduce {
    at::Tensor input;   // the unsharded flat gradient being reduced (undefined: sent in pieces)
    at::Tensor output;  // the reduced shard (the whole gradient under NO_SHARD)
    dist::Work work;
    std::vector<double> divide_after;  // the divisions finish_reduce_grad still owes `output`
    // Reduced in a bucket with other units' gradients (then `work` and `output` are unused): the
    // result is the bucket's slot `slot`.
    std::shared_ptr<detail::GradBucket> bucket;
    size_t slot = 0;
  };
  // Before any gradient is taken: an error leaves them all in place.
  void check_orig_grad_shapes() const;
  // The pre- and post-division of a reduction in `dtype` (less copy_divisor(), applied before
  // it), split into those the reduce-scatter applies itself (first; dist::ProcessGroup's
  // divide_by) and those finish_reduce_grad owes (second). The collective takes them for a
  // reduce-scatter (`scatter`) in float or double on the CPU without replicas; otherwise they are
  // owed: replicated shards divide after their all-reduce, and float16, bfloat16 and gradients
  // off the CPU keep the division where PyTorch has it.
  std::pair<std::vector<double>, std::vector<double>> split_divisions(at::ScalarType dtype,
                                                                      bool scatter) const;
  void check_grad_shape(size_t i, const at::Tensor& grad) const;
  at::Tensor& unsharded_buffer();
  void use_unsharded_views(const at::Tensor& unsharded_flat);
  void point_params_at(const at::Tensor& flat);
  void use_sharded_views();
  void use_sharded_grad_views();
  void absorb_cleared_grad_views();
  // Under offload: `reduced` (+ `existing`, if defined) into cpu_grad_, which becomes the grad.
  void offload_grad(const at::Tensor& reduced, const at::Tensor& existing);
  // PyTorch's _check_on_compute_device for the flat parameter: on the CPU under offload, else on
  // options().device(). Throws StateError naming the unit's first parameter and both devices.
  void check_flat_param_device(const char* where) const;
  // Throws StateError "FlatParamHandle::<where>: an earlier collective ... failed" once
  // comm_failed_.
  void throw_if_comm_failed(const char* where) const;
  // Throws ValueError if a parameter was replaced while skipped_sharded_views_.
  void check_skipped_views_unchanged() const;
  // {offset, numel} of original parameter i in the local flat parameter: its piece of the shard,
  // or the whole parameter under NO_SHARD. Meaningful only where shard_param_infos_[i].in_shard.
  std::pair<int64_t, int64_t> local_range(size_t i) const;
  // zero_grad(set_to_none) leaves every original gradient undefined: drop the flat gradient too
  // (unless it holds full gradients awaiting reduction). use_orig_params only.
  void drop_flat_grad_if_all_none();
  void release_unsharded_storage();
  // Called by reshard(free_unsharded) before the release: keeps the unsharded buffer's memory in
  // grad_scratch_ if the flat gradient can be built in it (see take_orig_grads).
  void keep_param_memory_for_grad();
  void validate_and_describe(const std::vector<at::Tensor>& tensors);

  FlatParamHandleOptions options_;
  dist::ProcessGroup group_;
  int rank_ = 0;
  int world_size_ = 1;
  at::ScalarType orig_dtype_ = at::kFloat;
  at::ScalarType fwd_bwd_dtype_ = at::kFloat;
  at::ScalarType reduce_dtype_ = at::kFloat;
  double predivide_ = 1.0;
  double postdivide_ = 1.0;
  HandleTrainingState training_state_ = HandleTrainingState::IDLE;

  std::vector<ParamInfo> param_infos_;
  std::vector<SharedParamInfo> shared_param_infos_;
  std::vector<at::Tensor> params_;  // original parameter tensors, same order as param_infos_
  FlatParamLayout layout_;
  std::vector<ShardParamInfo> shard_param_infos_;
  int64_t shard_numel_padded_ = 0;

  at::Tensor flat_param_;         // leaf; data = padded local shard (CPU under offload)
  at::Tensor full_param_padded_;  // unsharded buffer in fwd_bwd dtype; storage freed when resharded
  at::Tensor
      full_prec_full_param_padded_;  // unsharded buffer in orig dtype (summon + mixed precision)
  at::Tensor mp_shard_;              // low-precision shard on `device` during unshard
  at::Tensor cpu_grad_;              // offload: the sharded gradient's persistent CPU buffer
  at::Tensor unsharded_flat_;        // the unpadded view that original parameters point into
  // The unsharded parameters' memory, kept by a reshard in BACKWARD_POST for the flat gradient
  // take_orig_grads builds next (reduce dtype, padded unsharded numel); dropped on leaving that
  // state, so it never outlives the post-backward that kept it.
  at::Tensor grad_scratch_;
  bool unsharded_views_ = false;
  bool skipped_sharded_views_ = false;  // see skipped_use_sharded_views()
  // Set by mark_grads_unreduced() (autograd accumulated) and by reduce_grad_async (the gradients
  // are in flight), cleared when a reduction finishes: the original parameters' gradients then
  // hold unreduced results (e.g. accumulated under no_sync) or nothing, and must be neither
  // written back nor replaced by shard views.
  bool grads_unreduced_ = false;
  bool buffer_valid_ = false;  // the unsharded buffer holds the result of a successful gather
  bool comm_failed_ = false;   // an unshard's collective failed: never free its buffers
  bool full_prec_in_eval_ = false;
  at::Tensor unsharded_grad_;  // set between unshard_grad() and reshard_grad()
  std::vector<bool>
      is_grad_none_;  // per parameter: its gradient was reset to undefined by the user
  // Per parameter: its .grad() is a view of the sharded gradient that we attached. If such a
  // gradient is undefined later, the user cleared it (zero_grad(set_to_none)) and the sharded
  // gradient's slice must not come back on the next reshard.
  std::vector<bool> grad_view_attached_;
  std::unique_ptr<dist::Work> pending_unshard_;
  // Declared last, destroyed first: an unfinished reduction is waited for (its Work's destructor)
  // before anything it may still read or write is released.
  std::unique_ptr<PendingReduce> pending_reduce_;
};

}  // namespace detail
}  // namespace fsdp
