// FlatParamHandle (detail::HandleImpl): flatten, shard, unshard, reshard, parameter views,
// write-back. Gradients are in gradients.cpp. Semantics follow PyTorch's FlatParamHandle
// (torch/distributed/fsdp/_flat_param.py); see docs/flat_param.md for the C++ differences (original
// parameters stay autograd leaves; the flat parameter always holds the shard).
#include <sstream>
#include <unordered_map>

#include <torch/cuda.h>

#include "flat_param/flattened.h"
#include "flat_param/handle_impl.h"
#include "fsdp/errors.h"
#include "util/message.h"
#include "util/tensor_utils.h"

namespace fsdp {

using namespace detail;  // the helpers of util/tensor_utils.h

namespace {

at::Tensor named_param(const ParamInfo& info) {
  auto params = info.module->named_parameters(/*recurse=*/false);
  const at::Tensor* p = params.find(info.param_name);
  if (p == nullptr) {
    throw ValueError(
        msg("module ", quote(info.module_name), " has no parameter ", quote(info.param_name)));
  }
  return *p;
}

// PyTorch FSDP's gradient pre-divide factor: doubled while it divides dp_size and is below
// dp_size / factor, i.e. roughly sqrt(dp_size) as a power of two. Dividing by it before the sum
// and by dp_size / factor after keeps fp16 sums from overflowing and small values from
// underflowing.
double predivide_factor(int dp_size) {
  int factor = 1;
  while (dp_size % factor == 0 && dp_size / factor > factor) factor *= 2;
  return factor;
}

// Padding is filled with a recognisable value (as PyTorch does); it never reaches user-visible
// results, and a 42 showing up where it should not is easy to spot.
constexpr double kPaddingValue = 42.0;

// Tied parameters are one TensorImpl registered on several modules: the first owner is primary.
// Moves each primary's info from `params` into `infos` and records every other owner in
// `shared`; returns the primaries' tensors, aligned with `infos`.
std::vector<at::Tensor> split_tied(std::vector<ParamInfo>& params, std::vector<ParamInfo>& infos,
                                   std::vector<SharedParamInfo>& shared) {
  std::unordered_map<const c10::TensorImpl*, int> seen;
  std::vector<at::Tensor> tensors;
  for (auto& ref : params) {
    if (!ref.module)
      throw ValueError(msg("FlatParamHandle: parameter ", quote(ref.fqn()), " has no module"));
    at::Tensor t = named_param(ref);
    auto it = seen.find(t.unsafeGetTensorImpl());
    if (it != seen.end()) {
      const ParamInfo& prim = infos[it->second];
      shared.push_back(SharedParamInfo{ref.param_name, ref.module, ref.module_name, prim.param_name,
                                       prim.module, prim.module_name, it->second});
      continue;
    }
    seen.emplace(t.unsafeGetTensorImpl(), static_cast<int>(infos.size()));
    infos.push_back(std::move(ref));
    tensors.push_back(t);
  }
  return tensors;
}

FlatParamLayout layout_of(const std::vector<ParamInfo>& infos,
                          const std::vector<at::Tensor>& params, int64_t aligned, int world_size,
                          bool sharded) {
  std::vector<std::string> fqns;
  std::vector<std::vector<int64_t>> shapes;
  for (size_t i = 0; i < params.size(); ++i) {
    fqns.push_back(infos[i].fqn());
    shapes.push_back(params[i].sizes().vec());
  }
  return FlatParamLayout::compute(fqns, shapes, aligned, world_size, sharded);
}

// This rank's chunk of the flattened parameters (padding included), padded to the chunk size:
// the elements of `flat = layout.flatten(params)` from rank * sharded_numel on, copied from each
// parameter straight into the chunk. The whole unit is never flattened: that took a unit of
// memory per unit wrapped, which malloc then kept (and most of it was thrown away at once).
at::Tensor shard_of(const FlatParamLayout& layout, const std::vector<at::Tensor>& params,
                    const at::TensorOptions& opts, int rank, int64_t shard_numel_padded) {
  int64_t total = 0;
  for (int64_t n : layout.numels_with_padding) total += n;
  const int64_t start = std::min<int64_t>(rank * layout.sharded_numel, total);
  const int64_t end = start + (layout.sharded_numel - shard_numel_padded);
  at::Tensor shard = at::zeros({layout.sharded_numel}, opts);
  int64_t offset = 0;
  size_t i = 0;
  for (size_t k = 0; k < layout.numels_with_padding.size(); ++k) {
    const int64_t n = layout.numels_with_padding[k];
    const int64_t lo = std::max(offset, start), hi = std::min(offset + n, end);
    if (lo < hi) {
      at::Tensor dst = shard.narrow(0, lo - start, hi - lo);
      if (layout.is_padding_mask[k]) {
        dst.fill_(kPaddingValue);
      } else {
        dst.copy_(params[i].detach().reshape({-1}).narrow(0, lo - offset, hi - lo));
      }
    }
    if (!layout.is_padding_mask[k]) ++i;
    offset += n;
  }
  return shard;
}

// Flatten (padding included), then keep this rank's chunk, padded to the chunk size: the flat
// parameter's data, on the CPU under offload_params and on options.device() otherwise.
at::Tensor flatten_and_shard(const FlatParamLayout& layout, const std::vector<at::Tensor>& params,
                             at::ScalarType orig, int rank, int64_t shard_numel_padded,
                             bool sharded, const FlatParamHandleOptions& options) {
  at::NoGradGuard no_grad;
  const auto opts = at::TensorOptions().dtype(orig).device(params[0].device());
  at::Tensor shard = sharded ? shard_of(layout, params, opts, rank, shard_numel_padded)
                             : layout.flatten(params, kPaddingValue);
  if (options.offload_params()) {
    shard = shard.to(at::kCPU);
    // Pinned when the compute device is a GPU (asynchronous copies); not otherwise, where
    // pinning would initialise CUDA for nothing.
    if (options.device().is_cuda()) shard = shard.pin_memory();
  } else {
    shard = shard.to(options.device());
  }
  return shard.detach();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Construction

HandleImpl::HandleImpl(std::vector<ParamInfo> params, dist::ProcessGroup group,
                       FlatParamHandleOptions options)
    : options_(std::move(options)), group_(std::move(group)) {
  if (params.empty()) throw ValueError("FlatParamHandle: expects a non-empty list of parameters");
  options_.device(detail::with_index(options_.device()));
  if (!group_.is_member()) {
    throw ValueError("FlatParamHandle: this rank is not a member of the given process group");
  }
  rank_ = group_.rank();
  world_size_ = group_.size();
  const bool hybrid = options_.sharding_strategy() == ShardingStrategy::HYBRID_SHARD ||
                      options_.sharding_strategy() == ShardingStrategy::HYBRID_SHARD_ZERO2;
  if (hybrid && !options_.replicate_group().is_member()) {
    throw ValueError(msg("FlatParamHandle: ", to_string(options_.sharding_strategy()),
                         " needs a replicate_group (see dist::make_hybrid_groups)"));
  }

  const std::vector<at::Tensor> tensors = split_tied(params, param_infos_, shared_param_infos_);
  validate_and_describe(tensors);
  params_ = tensors;

  const at::ScalarType orig = orig_dtype_;
  fwd_bwd_dtype_ = options_.param_dtype().value_or(orig);
  // As in PyTorch: a param dtype without a reduce dtype reduces in the param dtype.
  reduce_dtype_ = options_.reduce_dtype().value_or(options_.param_dtype().value_or(orig));

  const bool sharded = uses_sharded_strategy();
  // 16-byte alignment of the unsharded parameters in the dtype they are computed in (PyTorch's
  // _get_aligned_numel(_fwd_bwd_param_dtype)): fp32 parameters with a bf16 param_dtype align
  // every 8 elements, so padding and shard sizes match PyTorch's.
  const int64_t aligned =
      options_.use_orig_params() ? 16 / static_cast<int64_t>(c10::elementSize(fwd_bwd_dtype_)) : 0;
  layout_ = layout_of(param_infos_, params_, aligned, world_size_, sharded);
  shard_param_infos_ = layout_.shard_param_infos(rank_);
  shard_numel_padded_ = layout_.shard_numel_padded(rank_);
  is_grad_none_.assign(params_.size(), false);
  grad_view_attached_.assign(params_.size(), false);

  const int dp_size =
      world_size_ *
      (options_.replicate_group().is_member() ? options_.replicate_group().size() : 1);
  predivide_ = predivide_factor(dp_size);
  postdivide_ = dp_size / predivide_;

  flat_param_ =
      flatten_and_shard(layout_, params_, orig, rank_, shard_numel_padded_, sharded, options_);
  bool any_requires_grad = false;
  for (const auto& p : params_) any_requires_grad |= p.requires_grad();
  flat_param_.set_requires_grad(any_requires_grad);

  full_param_padded_ =
      freed_buffer(layout_.padded_unsharded_numel, fwd_bwd_dtype_, options_.device());
  if (fwd_bwd_dtype_ != orig) {
    full_prec_full_param_padded_ =
        freed_buffer(layout_.padded_unsharded_numel, orig, options_.device());
  }

  detail::mark_flattened(flat_param_, /*is_flat_param=*/true);
  for (const auto& p : params_) detail::mark_flattened(p, /*is_flat_param=*/false);
  reshard(true);
}

HandleImpl::~HandleImpl() {
  pending_unshard_.reset();
  detail::unmark_flattened(flat_param_);
  for (const auto& p : params_) detail::unmark_flattened(p);
}

void HandleImpl::validate_and_describe(const std::vector<at::Tensor>& tensors) {
  // Local checks first, each naming the parameter (PyTorch's messages, plus the FQN).
  std::optional<at::ScalarType> dtype;
  std::optional<at::Device> device;
  std::optional<bool> requires_grad;
  std::string first_fqn;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const std::string fqn = param_infos_[i].fqn();
    if (detail::is_flat_param(t))
      throw ValueError(msg("Cannot flatten a FlatParameter: ", quote(fqn)));
    if (is_fsdp_flattened(t)) {
      throw ValueError(
          msg("Cannot flatten ", quote(fqn), ": it is already managed by a FlatParamHandle"));
    }
    if (!t.is_floating_point()) {
      throw ValueError(msg("Cannot flatten integer dtype tensors: ", quote(fqn), " has dtype ",
                           t.scalar_type()));
    }
    if (dtype && t.scalar_type() != *dtype) {
      throw ValueError(msg("Must flatten tensors with uniform dtype but got ", *dtype, " (",
                           quote(first_fqn), ") and ", t.scalar_type(), " (", quote(fqn), ")"));
    }
    if (!options_.use_orig_params() && requires_grad && t.requires_grad() != *requires_grad) {
      throw ValueError(
          msg("Must flatten tensors with uniform requires_grad when use_orig_params=false, but ",
              quote(first_fqn), " has requires_grad=", (*requires_grad ? "true" : "false"), " and ",
              quote(fqn), " has requires_grad=", (t.requires_grad() ? "true" : "false")));
    }
    if (device && t.device() != *device) {
      throw ValueError(msg("Must flatten tensors on the same device but got both ", device->str(),
                           " (", quote(first_fqn), ") and ", t.device().str(), " (", quote(fqn),
                           ")"));
    }
    if (!dtype) first_fqn = fqn;
    dtype = t.scalar_type();
    device = t.device();
    requires_grad = t.requires_grad();
  }
  orig_dtype_ = *dtype;

  if (!options_.check_ranks_agree() || world_size_ == 1) return;
  // Every rank must flatten the same parameters, or the shards would not line up. Each rank sees
  // all descriptions, so all ranks find the same first mismatch and throw together (no hang).
  auto describe = [&](size_t i) {
    std::ostringstream os;
    os << param_infos_[i].fqn() << " dtype=" << c10::toString(tensors[i].scalar_type())
       << " shape=" << tensors[i].sizes() << " requires_grad=" << tensors[i].requires_grad();
    return os.str();
  };
  std::string mine;
  for (size_t i = 0; i < tensors.size(); ++i) mine += describe(i) + "\n";
  const auto all = group_.all_gather_bytes(mine);
  auto split = [](const std::string& s) {
    std::vector<std::string> lines;
    std::istringstream is(s);
    for (std::string line; std::getline(is, line);) lines.push_back(line);
    return lines;
  };
  const auto ref = split(all[0]);
  for (int r = 1; r < world_size_; ++r) {
    const auto other = split(all[r]);
    for (size_t i = 0; i < std::max(ref.size(), other.size()); ++i) {
      const std::string a = i < ref.size() ? ref[i] : "<none>";
      const std::string b = i < other.size() ? other[i] : "<none>";
      if (a != b) {
        throw ValueError(msg("FlatParamHandle: ranks disagree on parameter #", i, ": rank 0 has ",
                             quote(a), " but ", detail::rank(r), " has ", quote(b), " (group ",
                             quote(group_.name()), ")"));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Unshard / reshard

bool HandleImpl::force_full_precision() const {
  const bool mixed = fwd_bwd_dtype_ != orig_dtype_ || reduce_dtype_ != orig_dtype_;
  return mixed &&
         (training_state_ == HandleTrainingState::SUMMON_FULL_PARAMS || full_prec_in_eval_);
}

at::Tensor& HandleImpl::unsharded_buffer() {
  if (force_full_precision() && fwd_bwd_dtype_ != orig_dtype_) return full_prec_full_param_padded_;
  return full_param_padded_;
}

void HandleImpl::unshard() {
  if (!pending_unshard_) unshard_async();  // else a prefetch is in flight: just finish it
  wait_unshard();
}

void HandleImpl::unshard_async() {
  if (pending_unshard_) throw StateError("FlatParamHandle::unshard_async: an unshard is pending");
  throw_if_comm_failed("unshard");
  grad_scratch_ = at::Tensor();  // kept for a reduction that did not come: not held any longer
  // Views kept from forward (see reshard) serve backward as they are; anything else (a summon, a
  // state dict) first restores the sharded invariants and then unshards as usual, as PyTorch's
  // pre_unshard does, so that it gets full precision where it asks for it.
  if (skipped_sharded_views_ && training_state_ != HandleTrainingState::FORWARD &&
      training_state_ != HandleTrainingState::BACKWARD_PRE) {
    reshard(/*free_unsharded=*/false);
  }
  // Write-back reads the original parameters and updates the shard; it must precede the gather.
  // (While the views are kept it only checks that nobody replaced them.)
  if (options_.use_orig_params()) writeback_orig_params();
  if (unsharded_views_) return;
  check_flat_param_device("unshard");
  const bool full_prec = force_full_precision();
  const bool low_prec = fwd_bwd_dtype_ != orig_dtype_ && !full_prec;
  at::Tensor src = flat_param_.detach();
  if (low_prec) {
    mp_shard_ = src.to(options_.device(), fwd_bwd_dtype_);
    src = mp_shard_;
  } else if (options_.offload_params()) {
    src = src.to(options_.device());
  }
  if (!uses_sharded_strategy()) {
    unsharded_flat_ = src;
    return;
  }
  at::Tensor& buf = unsharded_buffer();
  if (full_prec && fwd_bwd_dtype_ != orig_dtype_) {
    // The low-precision copy may be stale once full-precision parameters are edited.
    if (!comm_failed_) free_storage(full_param_padded_);
    buffer_valid_ = false;
  }
  // Kept from forward (SHARD_GRAD_OP) and filled by a gather that succeeded: nothing to gather.
  const bool kept = storage_bytes(buf) > 0 && buffer_valid_;
  alloc_storage(buf);  // before taking views: ATen bounds-checks views against the storage
  unsharded_flat_ = buf.narrow(0, 0, layout_.unpadded_unsharded_numel);
  if (kept) return;
  buffer_valid_ = false;
  try {
    pending_unshard_ = std::make_unique<dist::Work>(group_.all_gather_into_tensor_async(buf, src));
  } catch (const DistError&) {
    // A pairwise all-gather that failed to start may have posted receives into `buf` already:
    // as after a failed wait, the buffer is never freed from here on.
    comm_failed_ = true;
    throw;
  }
}

void HandleImpl::wait_unshard() {
  if (unsharded_views_ && !pending_unshard_) return;
  if (pending_unshard_) {
    std::unique_ptr<dist::Work> w = std::move(pending_unshard_);
    // On failure the buffer stays allocated but invalid: after a timeout the backend may still
    // write into it, so it is never freed from then on; the group is unusable anyway (DistError).
    try {
      w->wait();
    } catch (...) {
      comm_failed_ = true;
      throw;
    }
    buffer_valid_ = true;
  }
  finish_unshard();
}

void HandleImpl::throw_if_comm_failed(const char* where) const {
  if (!comm_failed_) return;
  throw StateError(msg("FlatParamHandle::", where,
                       ": an earlier collective of this handle failed (", detail::rank(rank_),
                       ", group ", quote(group_.name()), "); the process group is unusable"));
}

void HandleImpl::check_flat_param_device(const char* where) const {
  const at::Device expected = options_.offload_params() ? at::Device(at::kCPU) : options_.device();
  if (flat_param_.device() == expected) return;
  throw StateError(msg(where, ": the flat parameter of the unit holding ", quote(layout_.fqns[0]),
                       " is on ", flat_param_.device().str(), " but ",
                       (options_.offload_params() ? "offload_params keeps it on the CPU"
                                                  : msg("its compute device is ", expected.str())),
                       " (", detail::rank(rank_),
                       "); it must not be moved after wrapping (e.g. by Module::to)"));
}

void HandleImpl::finish_unshard() {
  if (uses_sharded_strategy()) mp_shard_ = at::Tensor();  // the low-precision shard was gathered
  // Done when the views switch, not when a prefetch starts: a prefetch may be abandoned.
  if (options_.use_orig_params()) drop_flat_grad_if_all_none();
  use_unsharded_views(unsharded_flat_);
}

void HandleImpl::abandon_unshard() {
  if (!pending_unshard_) return;
  std::unique_ptr<dist::Work> w = std::move(pending_unshard_);
  try {
    w->wait();  // the peers sent their shards; receive them, then drop them
  } catch (...) {
    comm_failed_ = true;  // see wait_unshard: the buffer must outlive the failed collective
    throw;
  }
  buffer_valid_ = false;
  unsharded_flat_ = at::Tensor();
  mp_shard_ = at::Tensor();
  if (uses_sharded_strategy()) {
    release_unsharded_storage();
  }
}

at::Tensor HandleImpl::shard_to_gather() {
  throw_if_comm_failed("shard_to_gather");
  if (!uses_sharded_strategy() || unsharded_views_ || pending_unshard_) {
    throw StateError(
        msg("FlatParamHandle::shard_to_gather: the unit holding ", quote(layout_.fqns[0]), " is ",
            (uses_sharded_strategy() ? "unsharded or unsharding" : "not sharded (NO_SHARD)"), " (",
            detail::rank(rank_), ")"));
  }
  if (options_.use_orig_params()) writeback_orig_params();
  check_flat_param_device("shard_to_gather");
  // The shard is kept in the original dtype (mixed precision casts only a copy for compute), so
  // it is full precision as it is; under offload_params it lives on the CPU.
  at::Tensor src = flat_param_.detach();
  return options_.offload_params() ? src.to(options_.device()) : src;
}

void HandleImpl::use_unsharded_views(const at::Tensor& flat) {
  point_params_at(flat);
  unsharded_views_ = true;
}

// Each original parameter becomes the full-shaped view of `flat` at its offset. One that already
// is that view is left alone: re-pointing costs a few dispatcher calls per parameter, and under
// NO_SHARD, whose parameters never leave the flat parameter, every forward and every reshard of
// every unit would pay them for nothing. On a model of many small units that was most of what
// NO_SHARD added to a step's CPU time (issue 42, docs/performance.md).
void HandleImpl::point_params_at(const at::Tensor& flat) {
  layout_.check_unflat_input(flat, "FlatParamHandle (the original parameters' views)");
  at::Tensor base;  // `flat` without autograd history, made once a parameter has to move
  int64_t offset = 0;
  size_t i = 0;
  for (size_t k = 0; k < layout_.numels_with_padding.size(); ++k) {
    const int64_t numel = layout_.numels_with_padding[k];
    if (!layout_.is_padding_mask[k]) {
      if (!detail::is_view_at(params_[i], flat, offset, layout_.shapes[i])) {
        if (!base.defined()) base = flat.detach();
        set_param_data(params_[i], base.narrow(0, offset, numel).view(layout_.shapes[i]));
      }
      ++i;
    }
    offset += numel;
  }
}

void HandleImpl::reshard(bool free_unsharded) {
  if (pending_unshard_) abandon_unshard();  // a prefetch nobody used: its result is not needed
  // PyTorch's _skipped_use_sharded_views: when a forward under grad mode keeps the unsharded
  // parameters for backward (SHARD_GRAD_OP, HYBRID_SHARD_ZERO2) with use_orig_params, the original
  // parameters stay full-shaped views of them until backward, instead of turning into 1-D shard
  // views the user would see between forward and backward. No gradient views are exposed then.
  if (!free_unsharded && unsharded_views_ && options_.use_orig_params() &&
      uses_sharded_strategy() && training_state_ == HandleTrainingState::FORWARD &&
      at::GradMode::is_enabled() && !force_full_precision()) {
    skipped_sharded_views_ = true;
    return;
  }
  skipped_sharded_views_ = false;
  if (options_.use_orig_params()) {
    absorb_cleared_grad_views();
    use_sharded_views();
    use_sharded_grad_views();
  } else if (uses_sharded_strategy()) {
    // Without use_orig_params the original parameters are not usable between units: point them at
    // an empty tensor so an accidental use fails on shape instead of reading freed memory.
    // In the compute dtype and device, so that set_data does not reset the parameters' gradient
    // accumulators (it does when either changes) between forward and backward.
    at::Tensor empty =
        at::empty({0}, at::TensorOptions().dtype(fwd_bwd_dtype_).device(options_.device()));
    for (auto& p : params_) set_param_data(p, empty);
  } else {
    use_sharded_views();  // NO_SHARD: full-shaped views into the flat parameter
  }
  unsharded_views_ = false;
  unsharded_flat_ = at::Tensor();
  mp_shard_ = at::Tensor();
  // A full-precision gather (summon, eval) is never kept: the next forward may want low precision
  // and checks only the low-precision buffer's validity.
  if ((free_unsharded || force_full_precision()) && uses_sharded_strategy()) {
    if (free_unsharded) keep_param_memory_for_grad();
    release_unsharded_storage();
    buffer_valid_ = false;
  }
}

void HandleImpl::use_sharded_views() {
  if (!uses_sharded_strategy()) {
    point_params_at(flat_param_);
    return;
  }
  const at::Tensor flat = flat_param_.detach();
  at::Tensor empty = at::empty({0}, flat.options());
  for (size_t i = 0; i < params_.size(); ++i) {
    const ShardParamInfo& s = shard_param_infos_[i];
    // Flattened views: a parameter may be split across ranks, so its piece is 1-D.
    set_param_data(params_[i],
                   s.in_shard ? flat.narrow(0, s.offset_in_shard, s.numel_in_shard) : empty);
  }
}

void HandleImpl::release_unsharded_storage() {
  // After a failed collective c10d may still be writing into these buffers (Gloo keeps the
  // output tensors, not their memory, alive): freeing them would be a use-after-free. They are
  // kept until the handle is destroyed, which is all that is left to do with a broken group.
  if (comm_failed_) return;
  free_storage(full_param_padded_);
  free_storage(full_prec_full_param_padded_);
}

void HandleImpl::keep_param_memory_for_grad() {
  // Only in post-backward, whose reduction comes right after this reshard, so that the memory
  // changes hands without the peak ever holding it twice. Only on the CPU: CUDA's caching
  // allocator already reuses blocks without faulting them in, and its stream bookkeeping is
  // better left alone.
  if (training_state_ != HandleTrainingState::BACKWARD_POST || comm_failed_ ||
      !options_.device().is_cpu() || !flat_param_.requires_grad() || grad_scratch_.defined()) {
    return;
  }
  const size_t have = static_cast<size_t>(storage_bytes(full_param_padded_));
  const size_t need =
      static_cast<size_t>(layout_.padded_unsharded_numel) * c10::elementSize(reduce_dtype_);
  // The memory moves to the gradient's own storage; the buffer's storage is left freed exactly as
  // release_unsharded_storage leaves it, so a view of it still alive (one autograd saved under
  // retain_graph, one a user kept) sees no memory rather than the gradient, and the next
  // unshard allocates into it again as usual. Gloo still holding the completed all-gather's
  // tensors does not matter either: it no longer touches their memory.
  if (have == 0 || have < need) return;
  grad_scratch_ =
      tensor_on_memory(take_memory(full_param_padded_), have, layout_.padded_unsharded_numel,
                       at::TensorOptions().dtype(reduce_dtype_).device(at::kCPU));
}

int64_t HandleImpl::unsharded_storage_bytes() const {
  if (!uses_sharded_strategy()) return 0;
  return storage_bytes(full_param_padded_) + storage_bytes(full_prec_full_param_padded_);
}

void HandleImpl::writeback_unsharded() {
  if (!unsharded_views_ || !unsharded_flat_.defined()) {
    throw StateError("writeback_unsharded: the handle is not unsharded");
  }
  if (unsharded_flat_.scalar_type() != orig_dtype_) {
    throw StateError(msg("writeback_unsharded: the unsharded parameters are in low precision (",
                         unsharded_flat_.scalar_type(),
                         "); unshard in SUMMON_FULL_PARAMS state to edit full-precision values"));
  }
  at::NoGradGuard no_grad;
  if (!uses_sharded_strategy()) {
    if (!unsharded_flat_.is_same(flat_param_)) flat_param_.detach().copy_(unsharded_flat_);
    return;
  }
  const int64_t have = layout_.sharded_numel - shard_numel_padded_;
  if (have <= 0) return;
  flat_param_.detach()
      .narrow(0, 0, have)
      .copy_(unsharded_flat_.narrow(0, rank_ * layout_.sharded_numel, have));
}

// ---------------------------------------------------------------------------------------------
// Write-back

void HandleImpl::check_skipped_views_unchanged() const {
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor registered = named_param(param_infos_[i]);
    if (!registered.is_same(params_[i]) ||
        !aliases(params_[i], unsharded_flat_, layout_.param_offset(i), layout_.numels[i])) {
      throw ValueError(
          msg("FSDP does not support changing the parameters between forward and backward for ",
              to_string(options_.sharding_strategy()), ": ", quote(layout_.fqns[i]),
              " was replaced or its data reassigned (", detail::rank(rank_), ")"));
    }
  }
}

bool HandleImpl::writeback_orig_params() {
  if (skipped_sharded_views_) {
    check_skipped_views_unchanged();
    return false;
  }
  if (!options_.use_orig_params() || unsharded_views_) return false;
  finish_reduce_grad();  // it replaces or adds to the gradient checked below
  bool wrote_param = false;
  bool touched = false;
  at::NoGradGuard no_grad;
  const at::Tensor flat = flat_param_.detach();
  for (size_t i = 0; i < params_.size(); ++i) {
    // A module may have re-registered the name (only possible from inside the module class).
    at::Tensor registered = named_param(param_infos_[i]);
    const bool changed = !registered.is_same(params_[i]);
    if (changed) {
      detail::unmark_flattened(params_[i]);
      params_[i] = registered;
      detail::mark_flattened(params_[i], false);
    }
    if (!shard_param_infos_[i].in_shard) continue;
    const auto [off, numel] = local_range(i);
    const std::vector<int64_t> expected_shape =
        uses_sharded_strategy() ? std::vector<int64_t>{numel} : layout_.shapes[i];
    at::Tensor p = params_[i];
    if (changed || !aliases(p, flat, off, numel)) {
      if (p.sizes() != at::IntArrayRef(expected_shape)) {
        throw ValueError(msg("Cannot writeback when the parameter shape changes: ",
                             quote(layout_.fqns[i]), " expects ", shape(expected_shape),
                             " but got ", shape(p.sizes()), " (", detail::rank(rank_), ")"));
      }
      flat.narrow(0, off, numel).copy_(p.detach().reshape({-1}));
      wrote_param = touched = true;
    }
    if (grads_unreduced_) continue;  // full gradients from autograd, reduced later
    at::Tensor g = p.grad();
    at::Tensor fg = flat_param_.grad();
    if (!g.defined()) {
      if (fg.defined() && !is_grad_none_[i]) {
        fg.narrow(0, off, numel).zero_();
        is_grad_none_[i] = true;
        grad_view_attached_[i] = false;
      }
      continue;
    }
    if (aliases(g, fg, off, numel)) continue;
    if (g.sizes() != at::IntArrayRef(expected_shape)) {
      throw ValueError(msg(
          "Cannot writeback when the gradient shape changes: ", quote(layout_.fqns[i]), " expects ",
          shape(expected_shape), " but got ", shape(g.sizes()), " (", detail::rank(rank_), ")"));
    }
    if (!fg.defined()) {
      fg = at::zeros_like(flat);
      flat_param_.mutable_grad() = fg;
    }
    fg.narrow(0, off, numel).copy_(g.reshape({-1}));
    is_grad_none_[i] = false;
    touched = true;
  }
  for (const auto& sp : shared_param_infos_) {
    at::Tensor mine = named_param(ParamInfo{sp.param_name, sp.module, sp.module_name});
    if (!mine.is_same(params_[sp.prim_index])) {
      throw ValueError(msg("Changing shared parameters is not supported: ",
                           quote(ParamInfo{sp.param_name, sp.module, sp.module_name}.fqn()),
                           " no longer shares ", quote(layout_.fqns[sp.prim_index])));
    }
  }
  if (touched) {
    use_sharded_views();
    use_sharded_grad_views();
  }
  return wrote_param;
}

}  // namespace fsdp
