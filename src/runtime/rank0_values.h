// Internal: wrap_deferred's rank-0 path (sync_module_states). Rank 0 holds its model whole; every
// other rank holds a deferred model whose parameters are real only where its shard keeps them.
#pragma once

#include <torch/nn/module.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <utility>

#include "fsdp/dist.h"

namespace fsdp {
namespace detail {

/// The bytes [first, second) of a parameter that are real memory on this rank (its shard's part);
/// the rest is fake and must not be written.
using KeptBytes = std::function<std::pair<size_t, size_t>(const at::Tensor& param)>;

/// Broadcasts the parameters (each tied tensor once) and buffers of `module` from rank 0 of
/// `group`, in module order, in slices of at most `slice_bytes`. Rank 0 sends from its tensors.
/// Every other rank receives each slice into a scratch buffer and copies into the parameter only
/// the bytes `kept` names, so that it never holds more than one slice beyond its share (receiving
/// into the parameter itself would make every fake page it covers resident); buffers are real
/// everywhere and are received in place. Collective; every rank's module must list the same
/// tensors (numel and dtype) in the same order, which wrap_deferred checks first.
void broadcast_rank0_values(const std::shared_ptr<torch::nn::Module>& module,
                            dist::ProcessGroup& group, const KeptBytes& kept, size_t slice_bytes);

}  // namespace detail
}  // namespace fsdp
