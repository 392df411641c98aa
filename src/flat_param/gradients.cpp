// FlatParamHandle (detail::HandleImpl), gradients: flattening the original parameters' gradients,
// reducing them into the sharded gradient, and the gradient views handed to optimizers
// (use_orig_params).
#include "flat_param/grad_bucket.h"
#include "flat_param/handle_impl.h"
#include "fsdp/errors.h"
#include "util/message.h"
#include "util/tensor_utils.h"

namespace fsdp {

using detail::HandleImpl;
using detail::msg;
using detail::quote;
using detail::shape;
using detail::storage_alias;

void HandleImpl::mark_grads_unreduced() {
  finish_reduce_grad();  // its finish clears the flag this sets
  grads_unreduced_ = true;
}

void HandleImpl::prepare_grads_for_backward() {
  finish_reduce_grad();
  if (!options_.use_orig_params()) return;
  // Shard-shaped gradient views cannot take autograd's full-shaped gradients; the values stay in
  // flat_param().grad(), and reduce_grad() adds the new ones to them.
  const at::Tensor fg = flat_param_.grad();
  if (!fg.defined()) return;
  absorb_cleared_grad_views();
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor g = params_[i].grad();
    if (g.defined() && g.storage().is_alias_of(fg.storage())) params_[i].mutable_grad().reset();
    grad_view_attached_[i] = false;
  }
}

void HandleImpl::absorb_cleared_grad_views() {
  if (!options_.use_orig_params() || grads_unreduced_) return;
  at::Tensor fg = flat_param_.grad();
  bool all_none = true;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (grad_view_attached_[i] && !params_[i].grad().defined()) {
      // Cleared by the user while we were not looking (e.g. while unsharded for an eval forward):
      // as in writeback_orig_params, its slice of the sharded gradient is zero from now on.
      if (fg.defined() && shard_param_infos_[i].in_shard) {
        const auto [off, n] = local_range(i);
        fg.narrow(0, off, n).zero_();
      }
      is_grad_none_[i] = true;
      grad_view_attached_[i] = false;
    }
    // Not drop_flat_grad_if_all_none's test: right after a reduce while unsharded no original
    // parameter has a gradient yet, but the fresh sharded gradient must stay.
    all_none &= is_grad_none_[i] || !params_[i].requires_grad();
  }
  if (all_none && fg.defined()) flat_param_.mutable_grad().reset();
}

void HandleImpl::drop_flat_grad_if_all_none() {
  bool all_none = true;
  for (const auto& p : params_) all_none &= !p.grad().defined();
  if (all_none && !grads_unreduced_) flat_param_.mutable_grad().reset();
}

std::pair<int64_t, int64_t> HandleImpl::local_range(size_t i) const {
  if (!uses_sharded_strategy()) return {layout_.param_offset(i), layout_.numels[i]};
  return {shard_param_infos_[i].offset_in_shard, shard_param_infos_[i].numel_in_shard};
}

void HandleImpl::unshard_grad() {
  if (!options_.use_orig_params()) {
    throw StateError("unshard_grad: gradients can be unsharded only with use_orig_params=true");
  }
  if (!unsharded_views_) throw StateError("unshard_grad: the handle is not unsharded");
  if (unsharded_grad_.defined()) return;
  finish_reduce_grad();
  at::NoGradGuard no_grad;
  const at::Tensor g = flat_param_.grad();
  // Every rank takes part in the gather; one without a gradient sends zeros.
  at::Tensor any = at::full({1}, g.defined() ? 1 : 0, at::kInt);
  group_.all_reduce(any, dist::ReduceOp::MAX);
  if (any.item<int>() == 0) return;
  const auto opts = at::TensorOptions().dtype(orig_dtype_).device(options_.device());
  at::Tensor shard = g.defined() ? g.detach().to(opts) : at::zeros({flat_param_.numel()}, opts);
  if (uses_sharded_strategy()) {
    unsharded_grad_ = at::empty({layout_.padded_unsharded_numel}, opts);
    group_.all_gather_into_tensor(unsharded_grad_, shard.contiguous());
  } else {
    unsharded_grad_ = shard.clone();
  }
  const std::vector<at::Tensor> views = layout_.unflat_views(unsharded_grad_);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].requires_grad()) params_[i].mutable_grad() = views[i];
  }
}

void HandleImpl::reshard_grad() {
  if (!unsharded_grad_.defined()) return;
  unsharded_grad_ = at::Tensor();
  for (auto& p : params_) p.mutable_grad().reset();
  use_sharded_grad_views();  // back to what it was before unshard_grad
}

void HandleImpl::reset_flat_param_grad_info_if_needed() {
  finish_reduce_grad();
  if (!options_.use_orig_params()) return;
  absorb_cleared_grad_views();
  drop_flat_grad_if_all_none();
  bool requires_grad = false;
  for (const auto& p : params_) requires_grad |= p.requires_grad();
  flat_param_.set_requires_grad(requires_grad);
}

void HandleImpl::use_sharded_grad_views() {
  if (grads_unreduced_) return;  // full gradients awaiting reduce_grad stay where they are
  const at::Tensor g = flat_param_.grad();
  for (size_t i = 0; i < params_.size(); ++i) {
    const ShardParamInfo& s = shard_param_infos_[i];
    if (!g.defined() || !s.in_shard || !params_[i].requires_grad() || is_grad_none_[i]) {
      params_[i].mutable_grad().reset();
      grad_view_attached_[i] = false;
      continue;
    }
    grad_view_attached_[i] = true;
    params_[i].mutable_grad() = uses_sharded_strategy()
                                    ? storage_alias(g, s.offset_in_shard, {s.numel_in_shard})
                                    : storage_alias(g, layout_.param_offset(i), layout_.shapes[i]);
  }
}

// ---------------------------------------------------------------------------------------------
// Gradients

void HandleImpl::check_grad_shape(size_t i, const at::Tensor& grad) const {
  if (grad.numel() != layout_.numels[i]) {
    throw ValueError(msg("gradient of ", quote(layout_.fqns[i]), " has shape ", shape(grad.sizes()),
                         " but the parameter has shape ", shape(layout_.shapes[i]), " (",
                         detail::rank(rank_), ")"));
  }
}

namespace {

// take_orig_grads_into without its shape check, for callers that have made it already.
void move_grads_into(const FlatParamLayout& layout, std::vector<at::Tensor>& params,
                     const at::Tensor& flat, double divisor) {
  at::NoGradGuard no_grad;
  // One walk over the layout's entries writes every element once: a gradient where there is one
  // (divided by `divisor` on the way, as DDP's reducer divides while copying into its bucket),
  // zero in alignment padding, the trailing padding and the ranges of parameters without a
  // gradient. (Zero-filling the whole buffer first, or dividing it afterwards, would cost one more
  // pass over the unit on every backward.)
  int64_t offset = 0;
  size_t i = 0;
  for (size_t k = 0; k < layout.numels_with_padding.size(); ++k) {
    const int64_t numel = layout.numels_with_padding[k];
    at::Tensor dst = flat.narrow(0, offset, numel);
    offset += numel;
    if (layout.is_padding_mask[k]) {
      dst.zero_();
      continue;
    }
    const at::Tensor g = params[i].grad();
    if (g.defined()) {
      if (divisor != 1.0 && g.scalar_type() == dst.scalar_type()) {
        at::div_out(dst, g.reshape({-1}), divisor);
      } else {
        // Another dtype (mixed precision's reduce_dtype): converted first, then divided, as the
        // reduction would divide it. (LibTorch 2's div.out refuses an out of another dtype.)
        dst.copy_(g.reshape({-1}));
        if (divisor != 1.0) dst.div_(divisor);
      }
      params[i].mutable_grad().reset();
    } else {
      dst.zero_();
    }
    ++i;
  }
  if (offset < flat.numel()) flat.narrow(0, offset, flat.numel() - offset).zero_();
}

void throw_if_nothing_to_reduce(const detail::HandleImpl& h) {
  if (!h.flat_param().requires_grad()) {
    throw StateError(msg("reduce_grad: no parameter of this handle requires grad (first: ",
                         quote(h.layout().fqns[0]), ")"));
  }
}

}  // namespace

void HandleImpl::check_orig_grad_shapes() const {
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor g = params_[i].grad();
    if (g.defined()) check_grad_shape(i, g);
  }
}

// Moves the original parameters' gradients into one padded flat gradient in the reduce dtype.
// Each is released as soon as it is copied, so that the flat gradient and autograd's per-parameter
// gradients do not all coexist: at the peak of a unit's backward that would double its gradient
// memory. Shapes are checked first, so that an error leaves every gradient in place.
at::Tensor HandleImpl::take_orig_grads() { return take_orig_grads(1.0); }

at::Tensor HandleImpl::take_orig_grads(double divisor) {
  check_orig_grad_shapes();
  // In the unsharded parameters' memory if the reshard before kept it (keep_param_memory_for_grad).
  at::Tensor flat = grad_scratch_.defined()
                        ? std::exchange(grad_scratch_, at::Tensor())
                        : detail::empty_buffer(
                              layout_.padded_unsharded_numel,
                              at::TensorOptions().dtype(reduce_dtype_).device(options_.device()));
  move_grads_into(layout_, params_, flat, divisor);
  return flat;
}

void HandleImpl::take_orig_grads_into(const at::Tensor& flat) {
  check_orig_grad_shapes();
  move_grads_into(layout_, params_, flat, 1.0);
}

void HandleImpl::reduce_grad() {
  reduce_grad_async();
  finish_reduce_grad();
}

void HandleImpl::reduce_grad_async() {
  throw_if_nothing_to_reduce(*this);
  finish_reduce_grad();  // a reduction still in flight adds to the gradient this one adds to
  check_flat_param_device("reduce_grad");  // before the gradients are taken: an error keeps them
  throw_if_comm_failed("reduce_grad");
  std::vector<std::vector<at::Tensor>> chunks = take_orig_grads_in_pieces();
  if (!chunks.empty()) {
    at::NoGradGuard no_grad;
    at::Tensor out = detail::empty_buffer(
        layout_.sharded_numel, at::TensorOptions().dtype(reduce_dtype_).device(at::kCPU));
    auto [by_collective, owed] = split_divisions(reduce_dtype_, /*scatter=*/true);
    dist::Work w = group_.reduce_scatter_pieces_async(out, std::move(chunks), dist::ReduceOp::SUM,
                                                      dist::ReduceScatterAlgo::AUTO, by_collective);
    pending_reduce_.reset(
        new PendingReduce{at::Tensor(), std::move(out), std::move(w), std::move(owed), nullptr, 0});
    grads_unreduced_ = true;
    return;
  }
  // Freshly built (no copy needed), with the division owed before the reduction done in the copy.
  start_reduce(take_orig_grads(copy_divisor()), /*predivided=*/true);
}

void HandleImpl::reduce_grad_into(const std::shared_ptr<detail::GradBucket>& bucket) {
  if (uses_sharded_strategy()) {
    throw StateError(
        msg("reduce_grad_into: gradient buckets are for NO_SHARD (", detail::rank(rank_), ")"));
  }
  throw_if_nothing_to_reduce(*this);
  if (bucket->dtype() != reduce_dtype_ || bucket->device() != options_.device() ||
      bucket->divide_after() != grad_bucket_divisions() || bucket->launched()) {
    throw InternalError(
        "reduce_grad_into: a bucket of another dtype, device or averaging, or launched");
  }
  finish_reduce_grad();
  check_flat_param_device("reduce_grad");
  throw_if_comm_failed("reduce_grad");
  check_orig_grad_shapes();  // before the slot: an error must not leave an unwritten one behind
  const size_t k = bucket->add_slot(layout_.padded_unsharded_numel);
  at::Tensor g = bucket->slot(k);
  move_grads_into(layout_, params_, g, copy_divisor());
  grad_scratch_ = at::Tensor();  // the unsharded parameters' memory is not needed for it
  // The divisions this reduction owes after it are the bucket's, done once for all of its units.
  pending_reduce_.reset(new PendingReduce{at::Tensor(), at::Tensor(), dist::Work(), {}, bucket, k});
  grads_unreduced_ = true;
}

std::vector<double> HandleImpl::grad_bucket_divisions() const {
  return split_divisions(reduce_dtype_, /*scatter=*/false).second;
}

namespace {

constexpr int64_t kPieceMinBytes = int64_t{256} << 10;  // below: copying beats a message

// One of the layout's runs over [0, W * n): a parameter's gradient (flattened), or zeros
// (padding, or a parameter without a gradient).
struct Run {
  int64_t begin, numel;
  bool param;       // a parameter's range (else padding)
  at::Tensor grad;  // flat, contiguous, reduce dtype; undefined: zeros
};

// The runs of `layout`, padding to world_size chunks of layout.sharded_numel included. Each
// parameter's gradient is flattened: a view of autograd's own where that is a contiguous CPU
// tensor of `reduce_dtype`, else a converted copy.
std::vector<Run> grad_runs(const FlatParamLayout& layout, const std::vector<at::Tensor>& params,
                           at::ScalarType reduce_dtype, int world_size) {
  std::vector<Run> runs;
  int64_t offset = 0;
  size_t i = 0;
  for (size_t k = 0; k < layout.numels_with_padding.size(); ++k) {
    const int64_t numel = layout.numels_with_padding[k];
    const bool param = !layout.is_padding_mask[k];
    if (numel > 0) {
      at::Tensor g = param ? params[i].grad() : at::Tensor();
      if (g.defined()) {
        g = g.reshape({-1});
        if (g.scalar_type() != reduce_dtype || !g.device().is_cpu() || !g.is_contiguous() ||
            g.layout() != at::kStrided || g.is_neg() || g.is_conj()) {
          g = g.to(at::TensorOptions().dtype(reduce_dtype).device(at::kCPU),
                   /*non_blocking=*/false, /*copy=*/true)
                  .resolve_neg()
                  .resolve_conj()
                  .contiguous();
        }
      }
      runs.push_back({offset, numel, param, g});
    }
    if (param) ++i;
    offset += numel;
  }
  const int64_t n = layout.sharded_numel;
  if (offset < n * world_size) {
    runs.push_back({offset, n * world_size - offset, /*param=*/false, at::Tensor()});
  }
  return runs;
}

// `runs` cut into world_size chunks of n elements, each a list of pieces: slices of the large
// parameter runs, and one buffer per stretch of small ones between them.
std::vector<std::vector<at::Tensor>> pieces_of(const std::vector<Run>& runs, int64_t n,
                                               int world_size, at::ScalarType dtype) {
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
  std::vector<std::vector<at::Tensor>> chunks(static_cast<size_t>(world_size));
  const auto opts = at::TensorOptions().dtype(dtype).device(at::kCPU);
  size_t r = 0;
  for (int q = 0; q < world_size; ++q) {
    const int64_t lo = q * n, hi = lo + n;
    // Pieces of [lo, hi) too small to send alone, gathered until the next large one.
    std::vector<std::pair<const Run*, std::pair<int64_t, int64_t>>> small;  // (run, [a, b))
    auto flush = [&]() {
      if (small.empty()) return;
      const int64_t a0 = small.front().second.first, b1 = small.back().second.second;
      at::Tensor buf = at::empty({b1 - a0}, opts);
      for (const auto& [run, ab] : small) {
        at::Tensor dst = buf.narrow(0, ab.first - a0, ab.second - ab.first);
        if (run->grad.defined()) {
          dst.copy_(run->grad.narrow(0, ab.first - run->begin, ab.second - ab.first));
        } else {
          dst.zero_();
        }
      }
      chunks[static_cast<size_t>(q)].push_back(buf);
      small.clear();
    };
    for (; r < runs.size() && runs[r].begin < hi; ++r) {
      const Run& run = runs[r];
      const int64_t a = std::max(run.begin, lo), b = std::min(run.begin + run.numel, hi);
      if (run.param && (b - a) * elem >= kPieceMinBytes) {  // the layout alone decides
        flush();
        chunks[static_cast<size_t>(q)].push_back(run.grad.defined()
                                                     ? run.grad.narrow(0, a - run.begin, b - a)
                                                     : at::zeros({b - a}, opts));
      } else {
        small.push_back({&run, {a, b}});
      }
      if (run.begin + run.numel > hi) break;  // continues in the next chunk
    }
    flush();
  }
  return chunks;
}

}  // namespace

// The unsharded gradient as the reduce-scatter's chunks, each a list of pieces: slices of
// autograd's own gradients where they are large (sent as they are: no copy), the small ones
// between them copied together, with the padding's zeros, into one buffer per run (one message
// rather than many). Each piece is one message, so whether this path is taken and where the
// pieces start and end depend on the handle's configuration and layout alone, never on this
// rank's gradients (ranks may differ there: a parameter unused on one rank has no gradient): a
// gradient that is missing, strided or of another dtype is stood in for by zeros or a converted
// copy of the same extent. Empty (the flat path) unless the reduction is a sharded one over Gloo
// on the CPU in float32 or float64 (float16 is predivided in place, and bfloat16 travels as
// float32 over Gloo), and some parameter is large enough to be worth messages of its own.
std::vector<std::vector<at::Tensor>> HandleImpl::take_orig_grads_in_pieces() {
  std::vector<std::vector<at::Tensor>> chunks;
  if (!uses_sharded_strategy() || world_size_ < 2 || group_.backend_name() != "gloo" ||
      !options_.device().is_cpu() ||
      (reduce_dtype_ != at::kFloat && reduce_dtype_ != at::kDouble)) {
    return chunks;
  }
  const int64_t elem = static_cast<int64_t>(c10::elementSize(reduce_dtype_));
  bool any_large = false;
  for (int64_t numel : layout_.numels) any_large = any_large || numel * elem >= 2 * kPieceMinBytes;
  if (!any_large) return chunks;
  check_orig_grad_shapes();  // before anything is taken: an error keeps them
  at::NoGradGuard no_grad;
  const std::vector<Run> runs = grad_runs(layout_, params_, reduce_dtype_, world_size_);
  chunks = pieces_of(runs, layout_.sharded_numel, world_size_, reduce_dtype_);
  // The gradients now travel in the pieces (released when the reduction finishes), and the
  // unsharded parameters' memory kept for a flat gradient is not needed.
  for (auto& p : params_) p.mutable_grad().reset();
  if (grad_scratch_.defined()) {
    detail::free_storage(grad_scratch_);
    grad_scratch_ = at::Tensor();
  }
  return chunks;
}

void HandleImpl::reduce_flat_grad(const at::Tensor& unsharded_flat_grad) {
  if (unsharded_flat_grad.numel() != layout_.padded_unsharded_numel) {
    throw ValueError(msg("reduce_flat_grad: expects ", layout_.padded_unsharded_numel,
                         " elements but got ", unsharded_flat_grad.numel()));
  }
  finish_reduce_grad();
  check_flat_param_device("reduce_flat_grad");
  at::NoGradGuard no_grad;
  // A private copy: the caller's tensor is never scaled, and the result is never a view.
  at::Tensor g = unsharded_flat_grad.reshape({-1}).to(options_.device(), reduce_dtype_);
  if (g.is_alias_of(unsharded_flat_grad)) g = g.clone();
  start_reduce(std::move(g), /*predivided=*/false);
  finish_reduce_grad();
}

// PyTorch divides by the predivide factor (a power of two) before the reduction and by the rest
// after, to keep float16 sums in range. Scaling by a power of two commutes exactly with every
// rounded sum in a binary format (short of overflow and subnormals), so where the place makes no
// difference to the bits it is chosen for speed: in the copy for an all-reduce (NO_SHARD: as many
// elements before it as after, and a pass over them saved, as DDP's reducer divides while copying
// into its bucket); after a reduce-scatter, onto W times fewer elements, for float32 and float64.
// float16 keeps PyTorch's order.
double HandleImpl::copy_divisor() const {
  return !uses_sharded_strategy() || reduce_dtype_ == at::kHalf ? predivide_ : 1.0;
}

void HandleImpl::start_reduce(at::Tensor g, bool predivided) {
  at::NoGradGuard no_grad;
  throw_if_comm_failed("reduce_grad");
  if (!predivided && copy_divisor() != 1.0) g.div_(copy_divisor());
  if (uses_sharded_strategy()) {
    at::Tensor out = detail::empty_buffer(layout_.sharded_numel, g.options());
    auto [by_collective, owed] = split_divisions(g.scalar_type(), /*scatter=*/true);
    dist::Work w = group_.reduce_scatter_tensor_async(out, g, dist::ReduceOp::SUM,
                                                      dist::ReduceScatterAlgo::AUTO, by_collective);
    pending_reduce_.reset(
        new PendingReduce{std::move(g), std::move(out), std::move(w), std::move(owed), nullptr, 0});
  } else {
    std::vector<double> owed = split_divisions(g.scalar_type(), /*scatter=*/false).second;
    dist::Work w = group_.all_reduce_async(g, dist::ReduceOp::SUM);
    pending_reduce_.reset(new PendingReduce{g, g, std::move(w), std::move(owed), nullptr, 0});
  }
  // Until the finish the gradients are neither in the original parameters (taken) nor in the
  // sharded gradient: a reshard must not take the empty original gradients for a zero_grad that
  // drops the sharded one, nor attach views that the finish would replace.
  grads_unreduced_ = true;
}

std::pair<std::vector<double>, std::vector<double>> HandleImpl::split_divisions(
    at::ScalarType dtype, bool scatter) const {
  std::vector<double> divisors;
  // The predivide is owed here only where it is not done in the copy (copy_divisor).
  if (predivide_ > 1 && copy_divisor() == 1.0) divisors.push_back(predivide_);
  if (postdivide_ > 1) divisors.push_back(postdivide_);
  // With replicas, the shard is summed over them after the reduce-scatter, and PyTorch divides
  // after that sum: (a + b) / d is not a / d + b / d once d is not a power of two. float16 and
  // bfloat16 keep their divisions in finish_reduce_grad: Gloo sums bfloat16 in float32 and
  // rounds on the way back, and a division before that rounding would change the bits. So do
  // gradients off the CPU: over Gloo they are reduced in a CPU copy, and CUDA divides by a scalar
  // through its reciprocal, as PyTorch's FSDP does on the device (the fused pass is CPU only).
  const bool by_collective = scatter && !options_.replicate_group().is_member() &&
                             (dtype == at::kFloat || dtype == at::kDouble) &&
                             options_.device().is_cpu();
  if (by_collective) return {std::move(divisors), {}};
  return {{}, std::move(divisors)};
}

void HandleImpl::finish_reduce_grad() {
  if (!pending_reduce_) return;
  // A reduction kept after its collective failed (see below) must never land: its result is
  // garbage, and the backend may still be writing it.
  throw_if_comm_failed("finish_reduce_grad");
  at::NoGradGuard no_grad;
  at::Tensor out;
  try {
    if (pending_reduce_->bucket) {
      pending_reduce_->bucket->launch();  // no-op once the runtime has
      pending_reduce_->bucket->wait();
      out = pending_reduce_->bucket->result(pending_reduce_->slot);
    } else {
      pending_reduce_->work.wait();
      out = pending_reduce_->output;
    }
    // HYBRID_SHARD: the replicas' shards are summed after the shard group's reduce-scatter.
    if (options_.replicate_group().is_member()) {
      options_.replicate_group().all_reduce(out, dist::ReduceOp::SUM);
    }
  } catch (...) {
    // As for a failed unshard: after a timeout the backend may still write into the buffers, so
    // they are never freed (the pending reduction is kept, and the group is unusable anyway).
    comm_failed_ = true;
    throw;
  }
  // The unsharded gradient was the reduce-scatter's input, built by take_orig_grads or copied by
  // reduce_flat_grad for this reduction alone. Gloo's work object keeps a reference until its
  // worker thread lets go, some time after the completion: freed here, the unit of memory it
  // holds is gone before the next unit's backward starts, on every run alike (see
  // release_completed in dist/collectives.cpp; CPU only, where wait() means done).
  if (uses_sharded_strategy() && pending_reduce_->input.defined() &&
      pending_reduce_->input.device().is_cpu() && !pending_reduce_->input.is_same(out)) {
    detail::free_storage(pending_reduce_->input);
  }
  const std::vector<double> owed = std::move(pending_reduce_->divide_after);
  pending_reduce_.reset();
  for (double d : owed) out.div_(d);
  const at::ScalarType target = options_.keep_low_precision_grads() ? fwd_bwd_dtype_ : orig_dtype_;
  out = out.to(target);

  at::Tensor existing = flat_param_.grad();
  const bool accumulate = existing.defined() && existing.sizes() == out.sizes();
  if (options_.offload_params()) {
    offload_grad(out, accumulate ? existing : at::Tensor());
  } else if (accumulate) {
    existing.add_(out.to(existing.scalar_type()));
  } else {
    flat_param_.mutable_grad() = out;
  }
  for (auto& p : params_) p.mutable_grad().reset();
  std::fill(is_grad_none_.begin(), is_grad_none_.end(), false);
  std::fill(grad_view_attached_.begin(), grad_view_attached_.end(), false);
  grads_unreduced_ = false;
  if (options_.use_orig_params() && !unsharded_views_) use_sharded_grad_views();
}

// PyTorch's _cpu_grad: under offload the sharded gradient lives in one CPU buffer kept for the
// handle's life (pinned when the compute device is CUDA, so that the device-to-host copy needs no
// staging), rather than a pageable allocation per backward. It survives zero_grad(set_to_none):
// the next reduction writes into it again.
void HandleImpl::offload_grad(const at::Tensor& reduced, const at::Tensor& existing) {
  if (!cpu_grad_.defined() || cpu_grad_.sizes() != reduced.sizes() ||
      cpu_grad_.scalar_type() != reduced.scalar_type()) {
    cpu_grad_ = at::empty(reduced.sizes(), reduced.options().device(at::kCPU));
    if (options_.device().is_cuda()) cpu_grad_ = cpu_grad_.pin_memory();
  }
  if (existing.defined() && existing.is_same(cpu_grad_) && reduced.device().is_cpu()) {
    cpu_grad_.add_(reduced);  // accumulating in place, one pass
  } else if (existing.defined()) {
    // Accumulated on the compute device, as PyTorch's _saved_grad_shard is, then copied over.
    cpu_grad_.copy_(reduced.add(existing.to(reduced.device(), reduced.scalar_type())));
  } else {
    cpu_grad_.copy_(reduced);
  }
  flat_param_.mutable_grad() = cpu_grad_;
}

at::Tensor HandleImpl::sharded_grad() const { return flat_param_.grad(); }

std::vector<at::Tensor> HandleImpl::orig_params() const { return params_; }

}  // namespace fsdp
