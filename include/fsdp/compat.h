// fsdp/compat.h: every difference between LibTorch 1.13 and 2.x that fsdp-cpp depends on (with
// fsdp/compat_backends.h, its part for building c10d backends).
//
// Nothing else in the library tests TORCH_VERSION_*; code that needs a version-dependent type or
// call goes through a name declared here. The differences covered:
//  * c10d class layout: up to 1.13 ProcessGroupGloo/NCCL derive from c10d::ProcessGroup; from 2.0
//  on
//    they derive from c10d::Backend and ProcessGroup is a dispatching front end. fsdp-cpp talks to
//    the backend object directly (`compat::Backend`), which has the same collective virtuals in
//    both.
//  * Which collectives a backend implements natively (Gloo gained _allgather_base and
//    _reduce_scatter_base around 2.2); `compat::native_flat_collectives` says when to try them
//    (fsdp::dist falls back to an emulation if the backend still refuses at the call), and
//    `compat::native_reduce_scatter_honours` which reduce ops a native reduce-scatter gets right
//    (Gloo's sums whatever op it is asked for, checked on 2.6 and 2.14).
//  * How c10d stores and backends are built (TCPStore's options, Gloo's devices, NCCL's shutdown):
//    in fsdp/compat_backends.h, the one other compat header. It includes Gloo's and NCCL's
//    headers, so only code that builds a backend includes it (fsdp::dist, the tests'
//    and benchmarks' launchers, a user's own backend for ProcessGroup::from_backend); fsdp.h and
//    the public API do not.
//  * PyTorch's Adam/AdamW group key "decoupled_weight_decay" (2.7 on):
//  kAdamHasDecoupledWeightDecay.
//  * The key type of torch::optim's per-parameter state map (std::string of the TensorImpl address
//    in 1.13, void* since about 2.2).
//  * Autocast's state per device type (at::autocast's per-device functions from 2.4; the CPU- and
//    CUDA-named ones before): `compat::autocast_enabled` and friends.
//  * The handle to an autograd node (std::shared_ptr<Node> up to 2.6, c10::intrusive_ptr<Node> in
//    2.14): `compat::AutogradNodePtr`, taken from grad_accumulator's own return type.
//  * The fused attention of 2.0 on (at::scaled_dot_product_attention): `compat::kHasFusedAttention`
//    and `compat::causal_fused_attention`.
//
// Thread safety: everything here is stateless.
#pragma once

#include <torch/version.h>

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include <ATen/autocast_mode.h>
#if TORCH_VERSION_MAJOR >= 2
#include <ATen/ops/scaled_dot_product_attention.h>
#endif
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

namespace fsdp {
namespace compat {

/// The LibTorch version this translation unit is compiled against, as major * 100 + minor.
constexpr int kTorchVersion = TORCH_VERSION_MAJOR * 100 + TORCH_VERSION_MINOR;

/// The c10d object that implements collectives for one backend (Gloo, NCCL).
#if TORCH_VERSION_MAJOR >= 2
using Backend = c10d::Backend;
#else
using Backend = c10d::ProcessGroup;
#endif
using BackendPtr = c10::intrusive_ptr<Backend>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using StorePtr = c10::intrusive_ptr<c10d::Store>;

/// Moved to fsdp/compat_backends.h (issue 38, docs/migration.md). A forwarder here would need the
/// Gloo and NCCL headers whose removal from this header was the point of the move, so the old
/// names are kept as deleted catch-alls instead: code that calls one without the new header fails
/// to compile at the call, with the compiler's note pointing at the line that names the header to
/// include. Code that includes fsdp/compat_backends.h calls the real functions, which always win
/// over a C-style variadic (the worst match overload resolution knows).
[[deprecated("moved to fsdp/compat_backends.h: include it")]] int make_tcp_store(...) = delete;
[[deprecated("moved to fsdp/compat_backends.h: include it")]] int make_gloo_backend(...) = delete;
[[deprecated("moved to fsdp/compat_backends.h: include it")]] int make_nccl_backend(...) = delete;
[[deprecated("moved to fsdp/compat_backends.h: include it")]] int shutdown_backend(...) = delete;
[[deprecated("moved to fsdp/compat_backends.h: include it")]] int collective_device(...) = delete;

/// True when the backend named `backend_name` implements `_allgather_base` and
/// `_reduce_scatter_base` (one flat tensor in, one flat tensor out) for the tensors it is given.
/// NCCL always does; Gloo does from about 2.2 on. Where this is false fsdp::dist emulates them.
inline bool native_flat_collectives(const std::string& backend_name) {
  if (backend_name == "nccl") return true;
  return kTorchVersion >= 202 && backend_name == "gloo";
}

/// True when a native reduce-scatter on `backend_name` applies `op` as asked. Gloo's
/// `_reduce_scatter_base` ignores the op and sums (LibTorch 2.6 and 2.14), so only SUM is trusted.
inline bool native_reduce_scatter_honours(const std::string& backend_name, c10d::ReduceOp op) {
  if (backend_name == "nccl") return true;
  return op == c10d::ReduceOp::SUM;
}

/// An owning handle to an autograd node, as grad_accumulator returns it (shared_ptr or
/// intrusive_ptr depending on the release): detected, not inferred from version numbers.
using AutogradNodePtr =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

/// Autocast's switch and dtype for CPU or CUDA (what activation checkpointing restores before it
/// recomputes). The per-device-type functions came with 2.4 by PyTorch's history (2.6 verified);
/// before, one function per device (1.13 verified).
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
inline bool autocast_enabled(c10::DeviceType d) { return at::autocast::is_autocast_enabled(d); }
inline void set_autocast_enabled(c10::DeviceType d, bool on) {
  at::autocast::set_autocast_enabled(d, on);
}
inline at::ScalarType autocast_dtype(c10::DeviceType d) {
  return at::autocast::get_autocast_dtype(d);
}
inline void set_autocast_dtype(c10::DeviceType d, at::ScalarType t) {
  at::autocast::set_autocast_dtype(d, t);
}
#else
inline bool autocast_enabled(c10::DeviceType d) {
  return d == c10::DeviceType::CPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
}
inline void set_autocast_enabled(c10::DeviceType d, bool on) {
  d == c10::DeviceType::CPU ? at::autocast::set_cpu_enabled(on) : at::autocast::set_enabled(on);
}
inline at::ScalarType autocast_dtype(c10::DeviceType d) {
  return d == c10::DeviceType::CPU ? at::autocast::get_autocast_cpu_dtype()
                                   : at::autocast::get_autocast_gpu_dtype();
}
inline void set_autocast_dtype(c10::DeviceType d, at::ScalarType t) {
  d == c10::DeviceType::CPU ? at::autocast::set_autocast_cpu_dtype(t)
                            : at::autocast::set_autocast_gpu_dtype(t);
}
#endif
/// PyTorch's Adam and AdamW param groups carry "decoupled_weight_decay" since 2.7 (absent in 2.6,
/// present in 2.14). Optimizer state dicts export the group keys of the PyTorch that matches the
/// LibTorch they are built against.
constexpr bool kAdamHasDecoupledWeightDecay = TORCH_VERSION_MAJOR > 2 ||
                                              (TORCH_VERSION_MAJOR == 2 &&
                                               TORCH_VERSION_MINOR >= 7);

/// `c10::Allocator::allocate` is const in 1.13 and not in 2.6 or 2.14 (verified); the change came
/// with 2.3 by PyTorch's history (not built here). For allocators written outside LibTorch (the
/// tests' counting allocator): `DataPtr allocate(size_t n) FSDP_ALLOCATE_CONST override`.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define FSDP_ALLOCATE_CONST
#else
#define FSDP_ALLOCATE_CONST const
#endif

/// Key under which torch::optim keeps a parameter's state in `Optimizer::state()`.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 2)
using OptimStateKey = void*;
template <typename T>
inline OptimStateKey optim_state_key(const T& param) {
  return param.unsafeGetTensorImpl();
}
#else
using OptimStateKey = std::string;
template <typename T>
inline OptimStateKey optim_state_key(const T& param) {
  std::ostringstream os;
  os << param.unsafeGetTensorImpl();
  return os.str();
}
#endif

/// True where LibTorch has at::scaled_dot_product_attention (2.0 on): fused attention kernels
/// (flash or memory-efficient on CUDA, a blocked kernel on the CPU) that never hold the T x T
/// probabilities whole.
constexpr bool kHasFusedAttention = TORCH_VERSION_MAJOR >= 2;

/// Causal softmax(q k^T / sqrt(hd)) v over q, k, v of shape [B, H, T, hd], by the fused kernel.
/// Where LibTorch has none (1.13; see kHasFusedAttention) it throws std::invalid_argument: the
/// caller chooses the math path instead, which computes the same within rounding.
inline at::Tensor causal_fused_attention(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v) {
#if TORCH_VERSION_MAJOR >= 2
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                          /*is_causal=*/true);
#else
  (void)q, (void)k, (void)v;
  throw std::invalid_argument("LibTorch " + std::to_string(TORCH_VERSION_MAJOR) + "." +
                              std::to_string(TORCH_VERSION_MINOR) +
                              " has no scaled_dot_product_attention (2.0 and later have)");
#endif
}

}  // namespace compat
}  // namespace fsdp
