// FlatParamHandle, the public face: each member forwards to detail::HandleImpl
// (handle_impl.h), which holds the state, so that the public header declares no private helper.
#include "flat_param/handle_impl.h"

namespace fsdp {

FlatParamHandle::FlatParamHandle(std::vector<ParamInfo> params, dist::ProcessGroup group,
                                 FlatParamHandleOptions options)
    : impl_(std::make_unique<detail::HandleImpl>(std::move(params), std::move(group),
                                                 std::move(options))) {}

FlatParamHandle::~FlatParamHandle() = default;

void FlatParamHandle::unshard() { impl_->unshard(); }
void FlatParamHandle::unshard_async() { impl_->unshard_async(); }
void FlatParamHandle::wait_unshard() { impl_->wait_unshard(); }
bool FlatParamHandle::has_pending_unshard() const { return impl_->has_pending_unshard(); }
void FlatParamHandle::abandon_unshard() { impl_->abandon_unshard(); }
void FlatParamHandle::reshard(bool free_unsharded) { impl_->reshard(free_unsharded); }
bool FlatParamHandle::is_unsharded() const { return impl_->is_unsharded(); }
at::Tensor FlatParamHandle::shard_to_gather() { return impl_->shard_to_gather(); }
bool FlatParamHandle::skipped_use_sharded_views() const {
  return impl_->skipped_use_sharded_views();
}
int64_t FlatParamHandle::unsharded_storage_bytes() const {
  return impl_->unsharded_storage_bytes();
}
bool FlatParamHandle::comm_failed() const { return impl_->comm_failed(); }
void FlatParamHandle::reduce_grad() { impl_->reduce_grad(); }
void FlatParamHandle::reduce_grad_async() { impl_->reduce_grad_async(); }
void FlatParamHandle::finish_reduce_grad() { impl_->finish_reduce_grad(); }
void FlatParamHandle::reduce_grad_into(const std::shared_ptr<detail::GradBucket>& bucket) {
  impl_->reduce_grad_into(bucket);
}
std::vector<double> FlatParamHandle::grad_bucket_divisions() const {
  return impl_->grad_bucket_divisions();
}
bool FlatParamHandle::has_pending_reduce_grad() const { return impl_->has_pending_reduce_grad(); }
void FlatParamHandle::reduce_flat_grad(const at::Tensor& unsharded_flat_grad) {
  impl_->reduce_flat_grad(unsharded_flat_grad);
}
void FlatParamHandle::prepare_grads_for_backward() { impl_->prepare_grads_for_backward(); }
void FlatParamHandle::mark_grads_unreduced() { impl_->mark_grads_unreduced(); }
void FlatParamHandle::unshard_grad() { impl_->unshard_grad(); }
void FlatParamHandle::reshard_grad() { impl_->reshard_grad(); }
void FlatParamHandle::reset_flat_param_grad_info_if_needed() {
  impl_->reset_flat_param_grad_info_if_needed();
}
at::Tensor FlatParamHandle::take_orig_grads() { return impl_->take_orig_grads(); }
void FlatParamHandle::take_orig_grads_into(const at::Tensor& flat) {
  impl_->take_orig_grads_into(flat);
}
bool FlatParamHandle::writeback_orig_params() { return impl_->writeback_orig_params(); }
void FlatParamHandle::writeback_unsharded() { impl_->writeback_unsharded(); }
const at::Tensor& FlatParamHandle::flat_param() const { return impl_->flat_param(); }
at::Tensor FlatParamHandle::sharded_grad() const { return impl_->sharded_grad(); }
const FlatParamLayout& FlatParamHandle::layout() const { return impl_->layout(); }
const std::vector<ParamInfo>& FlatParamHandle::param_infos() const { return impl_->param_infos(); }
const std::vector<SharedParamInfo>& FlatParamHandle::shared_param_infos() const {
  return impl_->shared_param_infos();
}
const std::vector<ShardParamInfo>& FlatParamHandle::shard_param_infos() const {
  return impl_->shard_param_infos();
}
int64_t FlatParamHandle::shard_numel_padded() const { return impl_->shard_numel_padded(); }
FlatParamShardMetadata FlatParamHandle::shard_metadata() const { return impl_->shard_metadata(); }
std::vector<at::Tensor> FlatParamHandle::orig_params() const { return impl_->orig_params(); }
const FlatParamHandleOptions& FlatParamHandle::options() const { return impl_->options(); }
dist::ProcessGroup& FlatParamHandle::process_group() { return impl_->process_group(); }
int FlatParamHandle::rank() const { return impl_->rank(); }
int FlatParamHandle::world_size() const { return impl_->world_size(); }
bool FlatParamHandle::uses_sharded_strategy() const { return impl_->uses_sharded_strategy(); }
at::ScalarType FlatParamHandle::orig_dtype() const { return impl_->orig_dtype(); }
at::ScalarType FlatParamHandle::compute_dtype() const { return impl_->compute_dtype(); }
at::ScalarType FlatParamHandle::reduce_dtype() const { return impl_->reduce_dtype(); }
HandleTrainingState FlatParamHandle::training_state() const { return impl_->training_state(); }
void FlatParamHandle::set_training_state(HandleTrainingState s) { impl_->set_training_state(s); }
void FlatParamHandle::set_full_precision_in_eval(bool on) { impl_->set_full_precision_in_eval(on); }
double FlatParamHandle::gradient_predivide_factor() const {
  return impl_->gradient_predivide_factor();
}
double FlatParamHandle::gradient_postdivide_factor() const {
  return impl_->gradient_postdivide_factor();
}

}  // namespace fsdp
