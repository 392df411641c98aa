// Internal: the registry of tensors a FlatParamHandle flattened (layout.cpp), behind the public
// is_fsdp_flattened(); handle.cpp marks its flat parameter and original parameters.
#pragma once

#include <ATen/ATen.h>

namespace fsdp {
namespace detail {

/// Records `t` (weakly: the entry dies with the tensor) as a flat parameter or as an original
/// parameter that was flattened into one.
void mark_flattened(const at::Tensor& t, bool is_flat_param);
void unmark_flattened(const at::Tensor& t);
/// True if `t` is a live flat parameter (flattening one again is an error).
bool is_flat_param(const at::Tensor& t);

}  // namespace detail
}  // namespace fsdp
