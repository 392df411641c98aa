// The runtime's view for the layers above it (runtime/view.h).
#include "runtime/view.h"

#include "fsdp/errors.h"
#include "runtime/state.h"
#include "util/message.h"

namespace fsdp {
namespace detail {

RuntimeView::RuntimeView(const FullyShardedDataParallelImpl& model) : state_(model.state_) {
  units_.reserve(state_->units.size());
  for (const auto& u : state_->units) units_.push_back(UnitView{u->index, u->fqn, u->handle.get()});
}

FlatParamHandle& RuntimeView::handle(int unit) const {
  FlatParamHandle* h = units_.at(static_cast<size_t>(unit)).handle;
  if (h == nullptr) {
    throw InternalError(
        msg("unit ", unit, " (", quote(units_[unit].fqn), ") has no flat parameter"));
  }
  return *h;
}

torch::nn::Module& RuntimeView::root_module() const { return *state_->root_module; }
dist::ProcessGroup& RuntimeView::world_group() const { return state_->world_group; }
dist::ProcessGroup& RuntimeView::shard_group() const { return state_->shard_group; }

at::ScalarType RuntimeView::original_dtype(const at::Tensor& buffer) const {
  auto it = state_->buffer_orig_dtypes.find(buffer.unsafeGetTensorImpl());
  return it == state_->buffer_orig_dtypes.end() ? buffer.scalar_type() : it->second;
}

void RuntimeView::require_idle(const char* what) const {
  if (state_->in_backward || state_->in_summon) {
    throw StateError(msg(what, ": not allowed during backward or summon_full_params"));
  }
  state_->reset_iteration();
}

bool is_unit_module(const torch::nn::Module* m) { return find_unit(m) != nullptr; }

}  // namespace detail
}  // namespace fsdp
