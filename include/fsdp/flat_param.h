// fsdp/flat_param.h: FlatParameter and FlatParamHandle, the core of fully sharded data parallelism.
//
// A FlatParamHandle takes the parameters of one FSDP unit (a module subtree), flattens them into a
// single 1-D "flat parameter", and keeps only this rank's shard of it (torch.chunk semantics). It
// can then
//   * unshard(): all-gather the full flat parameter and point every original parameter at a view
//     of it, so the module's unmodified forward computes with the full weights;
//   * reshard(): point the original parameters back at their shard (use_orig_params) or at empty
//     tensors, and free the unsharded storage for real (0 bytes);
//   * reduce_grad(): flatten the original parameters' gradients and reduce-scatter them into the
//     sharded gradient (all-reduce for NO_SHARD), averaging over the data-parallel ranks.
// It follows PyTorch's torch/distributed/fsdp/_flat_param.py, with one deliberate
// difference forced by the C++ frontend: LibTorch modules hold their parameters as members that
// fsdp-cpp cannot swap, so the original parameters stay autograd leaves (their data re-pointed with
// set_data) and gradients are collected from them rather than flowing into the flat parameter
// through view ops. See docs/flat_param.md.
//
// Ownership: the handle shares ownership of the modules it flattens (shared_ptr). It owns the flat
// parameter tensor, whose `.grad()` holds the sharded gradient after reduce_grad().
// Thread safety: none; a handle is driven by one thread, like the module it manages.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>

#include "fsdp/dist.h"
#include "fsdp/options.h"  // ShardingStrategy

namespace fsdp {

namespace detail {
class GradBucket;  // src/flat_param/grad_bucket.h
class HandleImpl;  // src/flat_param/handle_impl.h
}  // namespace detail

/// Where the handle is in a training step. Affects which buffers unshard() uses (full precision
/// while SUMMON_FULL_PARAMS) and nothing else here; the runtime sets it.
enum class HandleTrainingState { IDLE, FORWARD, BACKWARD_PRE, BACKWARD_POST, SUMMON_FULL_PARAMS };

/// One original parameter: the module that registers it, that module's FQN and the local name.
struct ParamInfo {
  std::string param_name;
  std::shared_ptr<torch::nn::Module> module;
  std::string module_name;
  /// module_name + "." + param_name (or param_name at the root).
  std::string fqn() const;
};

/// A further owner of a tied (shared) parameter. The first owner met in traversal order is the
/// primary one and appears in param_infos; every other owner is recorded here.
struct SharedParamInfo {
  std::string param_name;
  std::shared_ptr<torch::nn::Module> module;
  std::string module_name;
  std::string prim_param_name;
  std::shared_ptr<torch::nn::Module> prim_module;
  std::string prim_module_name;
  /// Index of the primary parameter in the handle's parameter list.
  int prim_index = 0;
};

/// Where one original parameter's data falls in this rank's shard. When `in_shard`,
/// flat_shard[offset_in_shard, offset_in_shard + numel_in_shard) holds
/// param.flatten()[intra_param_start_idx, intra_param_end_idx] (end inclusive, as in PyTorch).
/// When not `in_shard`, the other fields are -1.
/// Three shard descriptors, one per purpose: ShardParamInfo (here) is per parameter and per rank,
/// what FlatParamHandle computes and gradients and state dicts use; FlatParamShardMetadata sums
/// up one rank's shard as PyTorch's FlatParameter exposes it; ShardMetadata (state_value.h) is a
/// box of a ShardedTensor in a state dict or checkpoint.
struct ShardParamInfo {
  bool in_shard = false;
  int64_t offset_in_shard = -1;
  int64_t numel_in_shard = -1;
  int64_t intra_param_start_idx = -1;
  int64_t intra_param_end_idx = -1;
  bool operator==(const ShardParamInfo& o) const;
};

/// This rank's shard, described by the parameters it touches (PyTorch's FlatParamShardMetadata):
/// parameters without data here are left out; padding is not listed. For inspection and
/// PyTorch parity; the handle itself works from ShardParamInfo.
struct FlatParamShardMetadata {
  /// FQNs, relative to the same module as FlatParamLayout::fqns (see there).
  std::vector<std::string> param_names;
  std::vector<std::vector<int64_t>> param_shapes;
  std::vector<int64_t> param_numels;
  /// [start, end] (inclusive) into each parameter's flattened data.
  std::vector<std::pair<int64_t, int64_t>> param_offsets;
};

/// The layout of a flat parameter, independent of any rank's data. Computed by the handle; also
/// usable on its own to plan resharding (see FlatParamLayout::compute).
struct FlatParamLayout {
  /// One FQN per original (non-padding) parameter, as given to the handle: relative to the module
  /// handed to collect_params (for FullyShardedDataParallel, the wrapped model, so they are the
  /// canonical names a user sees, not names relative to the unit). PyTorch keeps them relative
  /// to the unit's module; prepend the unit's FQN to compare.
  std::vector<std::string> fqns;
  std::vector<std::vector<int64_t>> shapes;
  /// Per original parameter.
  std::vector<int64_t> numels;
  /// Per flat segment, padding segments included, in flat order.
  std::vector<int64_t> numels_with_padding;
  std::vector<bool> is_padding_mask;
  /// Numel of the flat parameter before chunking (alignment padding included).
  int64_t unpadded_unsharded_numel = 0;
  /// Chunk size: ceil(unpadded_unsharded_numel / world_size).
  int64_t sharded_numel = 0;
  /// sharded_numel * world_size.
  int64_t padded_unsharded_numel = 0;
  int world_size = 1;
  /// Each parameter starts at a multiple of this many elements (0: packed). PyTorch's
  /// _aligned_numel: 16 bytes of the compute dtype under use_orig_params.
  int64_t aligned_numel = 0;

  /// Lays out parameters of the given shapes. `aligned_numel` > 0 (use_orig_params) pads so each
  /// parameter starts at a multiple of it and the total is a multiple of world_size; 0 packs them.
  /// `sharded` false (NO_SHARD) keeps the whole flat parameter on every rank.
  static FlatParamLayout compute(const std::vector<std::string>& fqns,
                                 const std::vector<std::vector<int64_t>>& shapes,
                                 int64_t aligned_numel, int world_size, bool sharded = true);

  /// [start, end] (inclusive) of each flat segment (padding included) in the unsharded flat
  /// parameter.
  std::vector<std::pair<int64_t, int64_t>> flat_param_offsets() const;
  /// Offset of original parameter i in the unsharded flat parameter.
  int64_t param_offset(size_t i) const;
  /// PyTorch's flatten_tensors: the unsharded flat tensor (unpadded_unsharded_numel elements) of
  /// `tensors` (one per parameter, any shapes with the layout's numels, one dtype and device), with
  /// padding segments set to `padding_value`. What a handle shards, and what optimizer state is
  /// flattened with.
  at::Tensor flatten(const std::vector<at::Tensor>& tensors, double padding_value = 0.0) const;
  /// The inverse: each parameter's full-shaped view into `flat` (at least
  /// unpadded_unsharded_numel elements, e.g. the padded unsharded buffer).
  std::vector<at::Tensor> unflat_views(const at::Tensor& flat) const;
  /// Throws ValueError unless `flat` is 1-D with at least unpadded_unsharded_numel elements: what
  /// unflat_views() requires of its argument. `caller` names the operation in the message.
  void check_unflat_input(const at::Tensor& flat,
                          const char* caller = "FlatParamLayout::unflat_views") const;
  /// Shard infos of `rank`, one per original parameter.
  std::vector<ShardParamInfo> shard_param_infos(int rank) const;
  /// Elements of padding at the end of `rank`'s shard (torch.chunk tail or empty chunk).
  int64_t shard_numel_padded(int rank) const;
  /// shard_metadata() of `rank`.
  FlatParamShardMetadata shard_metadata(int rank) const;
};

/// Options of a FlatParamHandle (FullyShardedDataParallel fills them from FullyShardedOptions).
/// Defaults match PyTorch FSDP's.
struct FlatParamHandleOptions {
  /// How to shard (see ShardingStrategy). Default FULL_SHARD.
  TORCH_ARG(ShardingStrategy, sharding_strategy) = ShardingStrategy::FULL_SHARD;
  /// Keep the original parameters usable by an optimizer as views into the local shard, permit
  /// non-uniform requires_grad, and align each parameter to 16 bytes in the flat parameter.
  /// Default false.
  TORCH_ARG(bool, use_orig_params) = false;
  /// Keep the sharded parameter and gradient on the CPU (pinned when `device` is a GPU); copy to
  /// `device` for unshard. The sharded gradient is one CPU buffer kept for the handle's life
  /// (PyTorch's _cpu_grad), written again by every reduction. Default false.
  TORCH_ARG(bool, offload_params) = false;
  /// Mixed precision: dtype of the unsharded parameters used in forward/backward. Default:
  /// unset, the parameters' own.
  TORCH_ARG(std::optional<at::ScalarType>, param_dtype);
  /// Mixed precision: dtype in which gradients are reduced. Default: unset, param_dtype if that
  /// is set, else the parameters' own dtype.
  TORCH_ARG(std::optional<at::ScalarType>, reduce_dtype);
  /// Keep the sharded gradient in param_dtype instead of casting it back to the parameter dtype.
  /// Default false.
  TORCH_ARG(bool, keep_low_precision_grads) = false;
  /// Device on which forward and backward compute (and collectives run); "cuda" without an index
  /// means the current CUDA device. Default: the CPU. Without offload_params the flat parameter
  /// must stay on it: unshard and reduce_grad throw StateError naming both devices otherwise.
  TORCH_ARG(at::Device, device) = at::kCPU;
  /// Group across which replicas are all-reduced after the shard-group reduce-scatter
  /// (HYBRID_SHARD*). Default: a non-member group, meaning none.
  TORCH_ARG(dist::ProcessGroup, replicate_group);
  /// Check at construction that every rank flattens the same FQNs, shapes and dtypes (one small
  /// all-gather). Default true; turn it off only if the caller already guarantees it.
  TORCH_ARG(bool, check_ranks_agree) = true;
};

/// Deprecated (one release): the same type as ParamInfo, which names it everywhere now.
using ParamRef [[deprecated("use fsdp::ParamInfo, the same type")]] = ParamInfo;

/// Collects, in traversal order, the parameters registered on `root` and its descendants, as
/// `root->named_parameters()` would list them, skipping modules in `ignored_modules` (and their
/// subtrees) and parameters already owned by a FlatParamHandle. Tied parameters appear once per
/// owner. `prefix` is prepended to module names.
std::vector<ParamInfo> collect_params(
    const std::shared_ptr<torch::nn::Module>& root, const std::string& prefix = "",
    const std::vector<std::shared_ptr<torch::nn::Module>>& ignored_modules = {});

/// True if `t` is a flat parameter or an original parameter already owned by a handle.
bool is_fsdp_flattened(const at::Tensor& t);

class FlatParamHandle {
 public:
  /// Flattens `params` and shards the result across `group` (the shard group for HYBRID_SHARD*).
  /// Afterwards the handle is resharded: original parameters are views into the shard
  /// (use_orig_params) or empty; the unsharded storage holds 0 bytes.
  /// Throws ValueError, naming the parameter, if: `params` is empty; a parameter is itself a
  /// flat parameter or already flattened; dtypes are not one floating dtype; devices differ;
  /// requires_grad differs without use_orig_params; or (check_ranks_agree) another rank's
  /// parameters differ in FQN, shape, dtype or requires_grad.
  FlatParamHandle(std::vector<ParamInfo> params, dist::ProcessGroup group,
                  FlatParamHandleOptions options = {});
  ~FlatParamHandle();
  FlatParamHandle(const FlatParamHandle&) = delete;
  FlatParamHandle& operator=(const FlatParamHandle&) = delete;

  // ---------------------------------------------------------------------------------------
  // Unshard / reshard

  /// Makes the full parameters available: writes back changed original parameters
  /// (use_orig_params), all-gathers the shard (in param_dtype under mixed precision; in full
  /// precision while SUMMON_FULL_PARAMS) and points every original parameter at its full-shaped
  /// view. No-op where already unsharded; finishes a pending unshard_async(). NO_SHARD
  /// communicates nothing.
  void unshard();
  /// unshard() split in two for prefetching: start the all-gather now, finish later. Only one
  /// pending unshard per handle.
  void unshard_async();
  void wait_unshard();
  /// True between unshard_async() and the wait that finishes it.
  bool has_pending_unshard() const;
  /// Completes a pending unshard_async() (the collective must finish on every rank) but discards
  /// its result: parameters and gradients stay as they are and the buffer is freed. For a
  /// prefetch that turned out not to be needed.
  void abandon_unshard();
  /// Returns to the sharded state: original parameters become shard views (use_orig_params) or
  /// empty tensors, and, if `free_unsharded` (always, except to keep parameters between forward
  /// and backward under SHARD_GRAD_OP), the unsharded storage is freed. See
  /// skipped_use_sharded_views() for the one case where the views stay unsharded.
  void reshard(bool free_unsharded = true);
  /// True while the original parameters point at the unsharded flat parameter.
  bool is_unsharded() const;
  /// The padded local shard, in full precision (the original dtype) on the compute device: what
  /// unshard() would gather in a summon, for a caller that gathers the units itself. The FULL
  /// state dict does, to put several small units into one collective and to gather straight into
  /// memory the dict keeps (docs/state_dict.md). Parameters replaced since the last unshard
  /// (use_orig_params) are written back first, as unshard() does. Only for sharded strategies and
  /// while resharded (StateError otherwise: the unsharded views may hold newer values). The result
  /// may share the flat parameter's memory: read it, don't write it.
  at::Tensor shard_to_gather();
  /// PyTorch's `_skipped_use_sharded_views`: true after a reshard in FORWARD state under grad
  /// mode that keeps the unsharded storage (SHARD_GRAD_OP and HYBRID_SHARD_ZERO2 post-forward)
  /// with use_orig_params. The original parameters then stay full-shaped views of the kept
  /// unsharded parameters until backward (is_unsharded() stays true), rather than 1-D shard views;
  /// replacing one of them before backward is an error. An unshard outside FORWARD and
  /// BACKWARD_PRE (a summon, a state dict) or any other reshard ends it.
  bool skipped_use_sharded_views() const;
  /// Bytes currently allocated for unsharded parameter storage (0 after reshard, unless a
  /// collective failed: see comm_failed()).
  int64_t unsharded_storage_bytes() const;
  /// True once an unshard's collective failed (DistError). From then on the unsharded buffers are
  /// never freed or reused, because the backend may still write into them; the process group is
  /// unusable, and the handle is only good for destruction.
  bool comm_failed() const;

  // ---------------------------------------------------------------------------------------
  // Gradients

  /// Reduces the original parameters' gradients into the sharded gradient: flattens them (zeros
  /// where a parameter has no gradient), casts to reduce_dtype, reduce-scatters across the group
  /// averaging (pre- and post-divided as PyTorch FSDP does, to keep fp16 from overflowing), then
  /// all-reduces across replicate_group. For a sharded strategy on the CPU over Gloo with a
  /// float32 or float64 reduce dtype and a parameter of 512 KiB or more, the gradients are not
  /// flattened first: slices of 256 KiB and up are sent as they are
  /// (dist::ProcessGroup::reduce_scatter_pieces_async; the same sums, bit for bit). They are read
  /// until the reduction finishes (reduce_grad_async: until finish_reduce_grad), so a gradient
  /// tensor the caller still holds must not be written to before then. The result (in the
  /// parameter dtype unless keep_low_precision_grads) is added to an existing sharded gradient or
  /// becomes it; it is flat_param().grad() (on CPU under offload). Original parameters' gradients
  /// become shard views of it (use_orig_params) or are reset. Must be called while unsharded or
  /// right after reshard(), on every rank of the group. Requires the flat parameter to require
  /// grad.
  void reduce_grad();
  /// reduce_grad() split in two, so that the collective overlaps what the caller does next (the
  /// runtime: the backward of the units before this one). reduce_grad_async() takes the original
  /// parameters' gradients and starts the reduction; finish_reduce_grad() waits for it and
  /// updates the sharded gradient (and the gradient views). Until then flat_param().grad() does
  /// not include this reduction. One reduction is pending per handle at most: starting another,
  /// and every call that reads or changes gradients (prepare_grads_for_backward,
  /// mark_grads_unreduced, unshard_grad, reset_flat_param_grad_info_if_needed,
  /// writeback_orig_params), finishes the pending one first. finish_reduce_grad() is a no-op
  /// when none is pending; it throws DistError if the collective failed. comm_failed() is true
  /// from then on, the failed reduction stays pending (the backend may still write its buffers)
  /// and is never landed: finishing it again throws StateError, as every later collective does.
  void reduce_grad_async();
  void finish_reduce_grad();
  /// NO_SHARD, for the runtime's gradient buckets (FullyShardedOptions::bucket_cap_mb): like
  /// reduce_grad_async(), but the flat gradient is written into a new slot of `bucket` (in the
  /// handle's reduce dtype, on its device), whose one all-reduce reduces several units' gradients
  /// together once the runtime launches it. finish_reduce_grad() launches the bucket if nobody
  /// has yet (every rank does the same), waits for it and lands this handle's part, which keeps
  /// sharing the bucket's memory (not as an autograd view: zero_grad may detach_() it). Internal:
  /// the bucket type is not part of the public API.
  void reduce_grad_into(const std::shared_ptr<detail::GradBucket>& bucket);
  /// The divisions after the sum that a bucket of this handle's gradients applies (the averaging;
  /// float16 keeps its predivide before the sum). Units share a bucket only where these,
  /// reduce_dtype() and the device agree.
  std::vector<double> grad_bucket_divisions() const;
  /// True between reduce_grad_async() and the finish_reduce_grad() that completes it.
  bool has_pending_reduce_grad() const;
  /// Like reduce_grad() but for gradients the caller already flattened (padded unsharded numel,
  /// any floating dtype). For the runtime's hooks and for tests.
  void reduce_flat_grad(const at::Tensor& unsharded_flat_grad);
  /// With use_orig_params, the original parameters' gradients are views of the sharded gradient
  /// (so an optimizer's zero_grad reaches it), also while unsharded. Before autograd accumulates
  /// full-shaped gradients into them, call this: it drops those views (the values stay in the
  /// sharded gradient, which reduce_grad() adds to). The runtime calls it in pre-backward.
  void prepare_grads_for_backward();
  /// Declares that autograd accumulated gradients into the original parameters (the runtime
  /// calls this from its AccumulateGrad hooks). Until the next reduce_grad(), those full-shaped
  /// gradients are neither replaced by shard views on reshard() nor written back. A caller that
  /// drives the handle by hand calls reduce_grad() before reshard(), or calls this first.
  void mark_grads_unreduced();
  /// PyTorch's unshard_grad (use_orig_params, while unsharded): all-gathers the sharded gradient
  /// and makes each original parameter's gradient a full-shaped view of it. A rank without a
  /// gradient contributes zeros; if no rank has one, the gradients stay undefined. Collective.
  void unshard_grad();
  /// Undoes unshard_grad(): the original parameters' gradients are views of the sharded gradient
  /// again (edits to the unsharded gradients are not written back, as in PyTorch).
  void reshard_grad();
  /// PyTorch's `_reset_flat_param_grad_info_if_needed` (use_orig_params only; a no-op otherwise):
  /// drops the sharded gradient if every original parameter's gradient is undefined (an
  /// optimizer's zero_grad(set_to_none)), and recomputes flat_param().requires_grad() as "any
  /// original parameter requires grad", so parameters frozen or unfrozen after wrapping train
  /// correctly. The runtime calls it before each unit's forward.
  void reset_flat_param_grad_info_if_needed();
  /// The flattened, padded unsharded gradient built from the original parameters' gradients, in
  /// reduce_dtype (what reduce_grad() communicates); each parameter's gradient is released once
  /// copied. On the CPU, after a reshard() in BACKWARD_POST state (the runtime's post-backward:
  /// reshard, then reduce), it is built in the memory the unsharded parameters just gave up when
  /// that is large enough, instead of freshly allocated memory that the kernel must fault in
  /// again. Their storage is left freed as before: a view of it still held (autograd under
  /// retain_graph) sees no memory, never the gradient.
  at::Tensor take_orig_grads();
  /// take_orig_grads() into `flat` (padded unsharded numel, reduce dtype, on the device): every
  /// element is written, padding and missing gradients as zeros.
  void take_orig_grads_into(const at::Tensor& flat);

  // ---------------------------------------------------------------------------------------
  // Write-back (use_orig_params)

  /// Copies into the flat parameter (and its gradient) any original parameter or gradient that no
  /// longer aliases it: replaced with set_data, re-registered, or a gradient assigned anew. A
  /// parameter whose gradient was set to undefined zeroes its slice of the flat gradient.
  /// Returns true if a parameter was written back. Throws ValueError naming the parameter if its
  /// shape changed. Called by unshard(); callable any time the handle is resharded.
  bool writeback_orig_params();
  /// Copies this rank's part of the unsharded flat parameter back into the shard: for edits made
  /// to the full parameters (summon_full_params with writeback). Requires is_unsharded() and an
  /// unsharded buffer in the original dtype (no mixed precision, or SUMMON_FULL_PARAMS).
  void writeback_unsharded();

  // ---------------------------------------------------------------------------------------
  // Accessors

  /// The flat parameter: a 1-D leaf tensor holding this rank's padded shard (the whole flat
  /// parameter under NO_SHARD), requires_grad if any original parameter does. This is what an
  /// optimizer steps when use_orig_params is false.
  const at::Tensor& flat_param() const;
  /// The sharded gradient (undefined if none), same as flat_param().grad(); without a pending
  /// reduce_grad_async()'s contribution.
  at::Tensor sharded_grad() const;
  const FlatParamLayout& layout() const;
  const std::vector<ParamInfo>& param_infos() const;
  const std::vector<SharedParamInfo>& shared_param_infos() const;
  const std::vector<ShardParamInfo>& shard_param_infos() const;
  /// Padding at the end of this rank's shard.
  int64_t shard_numel_padded() const;
  /// This rank's shard in PyTorch's FlatParamShardMetadata form.
  FlatParamShardMetadata shard_metadata() const;
  /// Original parameters as currently registered, one per param_infos() entry.
  std::vector<at::Tensor> orig_params() const;
  const FlatParamHandleOptions& options() const;
  dist::ProcessGroup& process_group();
  int rank() const;
  int world_size() const;
  bool uses_sharded_strategy() const;
  /// Dtype of the original parameters (and of the flat parameter).
  at::ScalarType orig_dtype() const;
  /// Dtype used in forward/backward (param_dtype or orig_dtype).
  at::ScalarType compute_dtype() const;
  at::ScalarType reduce_dtype() const;

  HandleTrainingState training_state() const;
  /// Leaving BACKWARD_POST drops the unsharded parameters' memory that a reshard kept for the
  /// gradient reduction that follows it there (see take_orig_grads).
  void set_training_state(HandleTrainingState s);
  /// Unshard in full precision although param_dtype is set (PyTorch's FSDP_USE_FULL_PREC_IN_EVAL
  /// for modules in eval mode); the runtime sets it before each unit's forward.
  void set_full_precision_in_eval(bool on);
  /// The factor gradients are divided by before the reduce-scatter; the rest of the averaging
  /// (dp_size / predivide) happens after it. dp_size counts replicate_group ranks too.
  double gradient_predivide_factor() const;
  double gradient_postdivide_factor() const;

 private:
  std::unique_ptr<detail::HandleImpl> impl_;  // src/flat_param/handle_impl.h
};

}  // namespace fsdp
