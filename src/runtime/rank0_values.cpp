// wrap_deferred's rank-0 path: rank 0's values into every rank's deferred model
// (rank0_values.h).
#include "runtime/rank0_values.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

#include "util/module_tree.h"

namespace fsdp {
namespace detail {

namespace {

// `t` as a 1-D byte tensor over the same memory (t is contiguous).
at::Tensor bytes_of(const at::Tensor& t) {
  return at::from_blob(t.data_ptr(), {static_cast<int64_t>(t.numel() * t.element_size())},
                       at::TensorOptions().dtype(at::kByte).device(t.device()));
}

void broadcast_param(const at::Tensor& param, dist::ProcessGroup& group, const KeptBytes& kept,
                     size_t slice_bytes, at::Tensor& scratch) {
  const bool source = group.rank() == 0;
  // A non-contiguous parameter is received whole into a contiguous copy (never the case for the
  // parameters stock modules make, which wrap_deferred keeps real whole anyway).
  const at::Tensor dense = param.is_contiguous() ? param : param.contiguous();
  const at::Tensor all = bytes_of(dense);
  const auto total = static_cast<size_t>(all.numel());
  const std::pair<size_t, size_t> keep = source ? std::pair<size_t, size_t>{0, total} : kept(param);
  for (size_t lo = 0; lo < total; lo += slice_bytes) {
    const size_t n = std::min(slice_bytes, total - lo);
    at::Tensor slice = all.narrow(0, static_cast<int64_t>(lo), static_cast<int64_t>(n));
    if (source) {
      group.broadcast(slice, 0);
      continue;
    }
    at::Tensor into = scratch.narrow(0, 0, static_cast<int64_t>(n));
    group.broadcast(into, 0);
    const size_t a = std::max(lo, keep.first), b = std::min(lo + n, keep.second);
    if (a < b)
      std::memcpy(static_cast<char*>(slice.data_ptr()) + (a - lo),
                  static_cast<const char*>(into.data_ptr()) + (a - lo), b - a);
  }
  if (!source && !param.is_contiguous()) param.copy_(dense);
}

}  // namespace

void broadcast_rank0_values(const std::shared_ptr<torch::nn::Module>& module,
                            dist::ProcessGroup& group, const KeptBytes& kept, size_t slice_bytes) {
  at::NoGradGuard no_grad;
  at::Tensor scratch;
  if (group.rank() != 0) scratch = at::empty({static_cast<int64_t>(slice_bytes)}, at::kByte);
  for (const at::Tensor& p : detail::distinct_parameters(*module)) {
    if (p.numel() == 0) continue;
    broadcast_param(p, group, kept, slice_bytes, scratch);  // p itself: `kept` knows its impl
  }
  for (const at::Tensor& b : module->buffers()) {
    if (b.numel() > 0) group.broadcast(b.detach(), 0);
  }
}

}  // namespace detail
}  // namespace fsdp
