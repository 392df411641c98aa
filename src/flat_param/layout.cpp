// FlatParamLayout (where each parameter lies in the flat parameter and in each rank's shard),
// parameter collection, and the registry of tensors already owned by a FlatParamHandle.
#include <mutex>
#include <unordered_map>

#include "flat_param/flattened.h"
#include "fsdp/errors.h"
#include "fsdp/flat_param.h"
#include "util/message.h"
#include "util/module_tree.h"

namespace fsdp {

const char* to_string(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::FULL_SHARD:
      return "FULL_SHARD";
    case ShardingStrategy::SHARD_GRAD_OP:
      return "SHARD_GRAD_OP";
    case ShardingStrategy::NO_SHARD:
      return "NO_SHARD";
    case ShardingStrategy::HYBRID_SHARD:
      return "HYBRID_SHARD";
    case ShardingStrategy::HYBRID_SHARD_ZERO2:
      return "HYBRID_SHARD_ZERO2";
  }
  return "?";
}

std::string ParamInfo::fqn() const {
  return module_name.empty() ? param_name : module_name + "." + param_name;
}

bool ShardParamInfo::operator==(const ShardParamInfo& o) const {
  return in_shard == o.in_shard && offset_in_shard == o.offset_in_shard &&
         numel_in_shard == o.numel_in_shard && intra_param_start_idx == o.intra_param_start_idx &&
         intra_param_end_idx == o.intra_param_end_idx;
}

// ---------------------------------------------------------------------------------------------
// Layout

FlatParamLayout FlatParamLayout::compute(const std::vector<std::string>& fqns,
                                         const std::vector<std::vector<int64_t>>& shapes,
                                         int64_t aligned_numel, int world_size, bool sharded) {
  if (fqns.size() != shapes.size()) {
    throw InternalError("FlatParamLayout::compute: fqns and shapes differ in length");
  }
  if (world_size < 1) throw ValueError("FlatParamLayout: world size must be positive");
  FlatParamLayout l;
  l.fqns = fqns;
  l.shapes = shapes;
  l.world_size = sharded ? world_size : 1;
  l.aligned_numel = aligned_numel;
  int64_t total = 0;
  auto pad = [&](int64_t n) {
    l.numels_with_padding.push_back(n);
    l.is_padding_mask.push_back(true);
    total += n;
  };
  for (const auto& shape : shapes) {
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    if (aligned_numel > 0) {
      // Each parameter starts at an aligned element offset (16 bytes), as PyTorch requires for
      // use_orig_params so that views of the flat parameter are suitably aligned.
      const int64_t to_pad = aligned_numel - total % aligned_numel;
      if (to_pad > 0 && to_pad < aligned_numel) pad(to_pad);
    }
    l.numels.push_back(numel);
    l.numels_with_padding.push_back(numel);
    l.is_padding_mask.push_back(false);
    total += numel;
  }
  // With alignment (use_orig_params) PyTorch pads to a multiple of the world size whatever the
  // strategy, NO_SHARD included.
  if (aligned_numel > 0) {
    const int64_t to_pad = world_size - total % world_size;
    if (to_pad > 0 && to_pad < world_size) pad(to_pad);
  }
  l.unpadded_unsharded_numel = total;
  if (sharded) {
    l.sharded_numel = (total + world_size - 1) / world_size;  // torch.chunk's chunk size
    l.padded_unsharded_numel = l.sharded_numel * world_size;
  } else {
    l.sharded_numel = total;
    l.padded_unsharded_numel = total;
  }
  return l;
}

at::Tensor FlatParamLayout::flatten(const std::vector<at::Tensor>& tensors,
                                    double padding_value) const {
  if (tensors.size() != numels.size()) {
    throw ValueError(detail::msg("FlatParamLayout::flatten: expects ", numels.size(),
                                 " tensors but got ", tensors.size()));
  }
  if (tensors.empty()) return at::empty({0});
  const auto opts = tensors[0].options();
  std::vector<at::Tensor> pieces;
  size_t idx = 0;
  for (size_t k = 0; k < numels_with_padding.size(); ++k) {
    if (is_padding_mask[k]) {
      pieces.push_back(at::full({numels_with_padding[k]}, padding_value, opts));
      continue;
    }
    const at::Tensor& t = tensors[idx];
    if (t.numel() != numels[idx]) {
      throw ValueError(detail::msg("FlatParamLayout::flatten: ", detail::quote(fqns[idx]), " has ",
                                   t.numel(), " elements, the layout ", numels[idx]));
    }
    pieces.push_back(t.detach().reshape({-1}));
    ++idx;
  }
  return at::cat(pieces);
}

void FlatParamLayout::check_unflat_input(const at::Tensor& flat, const char* caller) const {
  if (flat.dim() != 1 || flat.numel() < unpadded_unsharded_numel) {
    throw ValueError(detail::msg(caller, ": expects a 1-D tensor of at least ",
                                 unpadded_unsharded_numel, " elements, got shape ",
                                 detail::shape(flat.sizes())));
  }
}

std::vector<at::Tensor> FlatParamLayout::unflat_views(const at::Tensor& flat) const {
  check_unflat_input(flat);
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < numels.size(); ++i) {
    out.push_back(flat.narrow(0, param_offset(i), numels[i]).view(shapes[i]));
  }
  return out;
}

std::vector<std::pair<int64_t, int64_t>> FlatParamLayout::flat_param_offsets() const {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t start = 0;
  for (int64_t n : numels_with_padding) {
    out.emplace_back(start, start + n - 1);
    start += n;
  }
  return out;
}

int64_t FlatParamLayout::param_offset(size_t i) const {
  int64_t off = 0;
  size_t idx = 0;
  for (size_t k = 0; k < numels_with_padding.size(); ++k) {
    if (is_padding_mask[k]) {
      off += numels_with_padding[k];
      continue;
    }
    if (idx == i) return off;
    off += numels_with_padding[k];
    ++idx;
  }
  throw InternalError(detail::msg("FlatParamLayout::param_offset: index ", i, " out of range"));
}

int64_t FlatParamLayout::shard_numel_padded(int rank) const {
  if (world_size == 1) return sharded_numel - unpadded_unsharded_numel;
  const int64_t have = std::max<int64_t>(
      0, std::min<int64_t>(sharded_numel, unpadded_unsharded_numel - rank * sharded_numel));
  return sharded_numel - have;
}

std::vector<ShardParamInfo> FlatParamLayout::shard_param_infos(int rank) const {
  // The rank's interval [start, end] of the padded unsharded flat parameter; NO_SHARD holds it all.
  const int64_t start = world_size == 1 ? 0 : rank * sharded_numel;
  const int64_t end = start + sharded_numel - 1;  // inclusive; < start when the shard is empty
  std::vector<ShardParamInfo> infos;
  const auto offsets = flat_param_offsets();
  for (size_t k = 0; k < offsets.size(); ++k) {
    if (is_padding_mask[k]) continue;
    const auto [pstart, pend] = offsets[k];
    ShardParamInfo info;
    // Same overlap test as PyTorch, so that 0-numel parameters classify identically.
    const bool overlaps = sharded_numel > 0 && start <= pend && end >= pstart;
    if (overlaps) {
      info.in_shard = true;
      if (start <= pstart) {
        info.intra_param_start_idx = 0;
        info.offset_in_shard = pstart - start;
      } else {
        info.intra_param_start_idx = start - pstart;
        info.offset_in_shard = 0;
      }
      info.intra_param_end_idx = std::min(pend, end) - pstart;
      info.numel_in_shard = info.intra_param_end_idx - info.intra_param_start_idx + 1;
    }
    infos.push_back(info);
  }
  return infos;
}

FlatParamShardMetadata FlatParamLayout::shard_metadata(int rank) const {
  FlatParamShardMetadata md;
  const auto infos = shard_param_infos(rank);
  for (size_t i = 0; i < infos.size(); ++i) {
    if (!infos[i].in_shard) continue;
    md.param_names.push_back(fqns[i]);
    md.param_shapes.push_back(shapes[i]);
    md.param_numels.push_back(numels[i]);
    md.param_offsets.emplace_back(infos[i].intra_param_start_idx, infos[i].intra_param_end_idx);
  }
  return md;
}

// ---------------------------------------------------------------------------------------------
// Registry of flattened tensors. LibTorch tensors cannot carry Python-style attributes, so the
// "_fsdp_flattened" mark lives here, keyed by TensorImpl and guarded by a weak reference so a
// recycled address never matches a dead tensor.

namespace detail {
namespace {
struct Entry {
  c10::weak_intrusive_ptr<c10::TensorImpl> weak;
  bool is_flat_param;
};
std::mutex g_mu;
std::unordered_map<const c10::TensorImpl*, Entry> g_registry;

const Entry* find_locked(const at::Tensor& t) {
  auto it = g_registry.find(t.unsafeGetTensorImpl());
  if (it == g_registry.end()) return nullptr;
  auto alive = it->second.weak.lock();
  if (!alive || alive.get() != t.unsafeGetTensorImpl()) {
    g_registry.erase(it);
    return nullptr;
  }
  return &it->second;
}
}  // namespace

void mark_flattened(const at::Tensor& t, bool is_flat_param) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_registry.erase(t.unsafeGetTensorImpl());
  g_registry.emplace(
      t.unsafeGetTensorImpl(),
      Entry{c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()), is_flat_param});
}

void unmark_flattened(const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_registry.erase(t.unsafeGetTensorImpl());
}

bool is_flat_param(const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(g_mu);
  const Entry* e = find_locked(t);
  return e != nullptr && e->is_flat_param;
}
}  // namespace detail

bool is_fsdp_flattened(const at::Tensor& t) {
  if (!t.defined()) return false;
  std::lock_guard<std::mutex> lock(detail::g_mu);
  return detail::find_locked(t) != nullptr;
}

std::vector<ParamInfo> collect_params(
    const std::shared_ptr<torch::nn::Module>& root, const std::string& prefix,
    const std::vector<std::shared_ptr<torch::nn::Module>>& ignored_modules) {
  if (!root) throw ValueError("collect_params: null module");
  std::vector<ParamInfo> out;
  std::vector<std::string> ignored_prefixes;
  auto modules = root->named_modules(prefix, /*include_self=*/true);
  for (const auto& item : modules) {
    for (const auto& ig : ignored_modules) {
      if (ig.get() == item.value().get()) ignored_prefixes.push_back(item.key());
    }
  }
  for (const auto& item : modules) {
    const std::string& name = item.key();
    if (detail::under_any(name, ignored_prefixes)) continue;
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      if (is_fsdp_flattened(p.value())) continue;
      out.push_back(ParamInfo{p.key(), item.value(), name});
    }
  }
  return out;
}

}  // namespace fsdp
