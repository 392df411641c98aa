// Internal: how a saved state dict (model or optimizer) keeps a value, so that it does not alias
// the model's or optimizer's live memory. Used by model_state_dict.cpp and optim_state_dict.cpp.
#pragma once

#include <ATen/ATen.h>

namespace fsdp {
namespace detail {

/// A value a saved state dict (model or optimizer) keeps: under `offload` a device tensor is
/// copied to the CPU (to() copies already), anything else is cloned, unless `owned` (a view of a
/// gathered buffer nobody else holds, kept as it is).
inline at::Tensor kept_value(const at::Tensor& t, bool offload, bool owned = false) {
  if (offload && !t.is_cpu()) return t.to(at::kCPU);
  return owned ? t : t.clone();
}

}  // namespace detail
}  // namespace fsdp
