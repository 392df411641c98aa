// fsdp/compat.h: every difference between LibTorch 1.13 and 2.x that fsdp-cpp depends on.
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
//  * TCPStore construction: only TCPStore(host, TCPStoreOptions) exists in both, so it is the only
//    form used. Since 2.4 TCPStoreOptions::useLibUV defaults to true, and builds without libuv
//    (Debian's) then throw; we default it to false (see make_tcp_store).
//  * PyTorch's Adam/AdamW group key "decoupled_weight_decay" (2.7 on):
//  kAdamHasDecoupledWeightDecay.
//  * The key type of torch::optim's per-parameter state map (std::string of the TensorImpl address
//    in 1.13, void* since about 2.2).
//  * The handle to an autograd node (std::shared_ptr<Node> up to 2.6, c10::intrusive_ptr<Node> in
//    2.14): `compat::AutogradNodePtr`, taken from grad_accumulator's own return type.
//
// Thread safety: everything here is stateless.
#pragma once

#include <torch/version.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

#ifdef USE_C10D_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#ifdef USE_C10D_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
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

namespace detail {
// Whether TCPStoreOptions has the `useLibUV` field (2.3 on): detected, not inferred from versions.
template <typename T, typename = void>
struct HasUseLibUV : std::false_type {};
template <typename T>
struct HasUseLibUV<T, std::void_t<decltype(std::declval<T&>().useLibUV)>> : std::true_type {};

template <typename T>
void set_use_libuv(T& opts, bool on) {
  if constexpr (HasUseLibUV<T>::value) opts.useLibUV = on;
  (void)opts;
  (void)on;
}
}  // namespace detail

/// Whether TCPStore should use its libuv backend: only when USE_LIBUV=1 is set (Python reads the
/// same variable). PyTorch 2.4+ defaults to libuv, which Debian's builds lack; the classic backend
/// exists in every build and speaks the same protocol, so it is the safe default.
inline bool tcp_store_use_libuv() {
  const char* v = std::getenv("USE_LIBUV");
  return v != nullptr && std::string(v) == "1";
}

/// Connects to (or, with `is_server`, hosts) a c10d TCPStore.
/// `port` 0 with `is_server` picks a free port; read it back with store->getPort().
inline c10::intrusive_ptr<c10d::TCPStore> make_tcp_store(const std::string& host,
                                                         std::uint16_t port, bool is_server,
                                                         int world_size,
                                                         std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.port = port;
  opts.isServer = is_server;
  if (world_size > 0) opts.numWorkers = static_cast<std::size_t>(world_size);
  // Waiting for every worker in the constructor would serialize start-up; fsdp::dist's first
  // barrier does the waiting, under the group's timeout.
  opts.waitWorkers = false;
  opts.timeout = timeout;
  detail::set_use_libuv(opts, tcp_store_use_libuv());
  return c10::make_intrusive<c10d::TCPStore>(host, opts);
}

#ifdef USE_C10D_GLOO
/// Creates a Gloo backend over `store`. `hostname` picks the network interface (an address of this
/// host); empty means Gloo's default device for this host's name.
inline BackendPtr make_gloo_backend(const StorePtr& store, int rank, int size,
                                    std::chrono::milliseconds timeout, const std::string& hostname,
                                    int threads) {
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  if (hostname.empty()) {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  } else {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
  }
  opts->threads = threads;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
}
#endif

#ifdef USE_C10D_NCCL
/// Creates an NCCL backend over `store` (CUDA tensors only).
inline BackendPtr make_nccl_backend(const StorePtr& store, int rank, int size,
                                    std::chrono::milliseconds timeout) {
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
}
#endif

/// Flushes and closes a backend whose last handle is going away, as PyTorch's
/// destroy_process_group does. Only NCCL needs it: ProcessGroupNCCL destroyed without shutdown()
/// aborts its communicators, cutting off peers still finishing a collective with this rank.
/// `shutdown()` is public on ProcessGroupNCCL in 2.6 and 2.14 (read in their headers) and was
/// run on 2.11; older releases keep c10d's destructor behaviour. Gloo needs nothing.
inline void shutdown_backend(const BackendPtr& backend, const std::string& backend_name) {
#if defined(USE_C10D_NCCL) && \
    (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 6))
  if (backend_name == "nccl") {
    if (auto* nccl = dynamic_cast<c10d::ProcessGroupNCCL*>(backend.get())) nccl->shutdown();
  }
#endif
  (void)backend;
  (void)backend_name;
}

/// The device whose tensors the backend named `backend_name` reduces and moves: NCCL's is the
/// CUDA device current when the group is created (set it per rank, as with
/// torch.cuda.set_device, before init_process_group); every other backend's is the CPU. Chosen
/// here, once, for all of fsdp::dist: a collective given tensors elsewhere stages them through
/// this device, as PyTorch's all_gather_object does for NCCL.
inline at::Device collective_device(const std::string& backend_name) {
#ifdef USE_C10D_NCCL
  if (backend_name == "nccl") return at::Device(at::kCUDA, c10::cuda::current_device());
#endif
  (void)backend_name;
  return at::Device(at::kCPU);
}

/// An owning handle to an autograd node, as grad_accumulator returns it (shared_ptr or
/// intrusive_ptr depending on the release): detected, not inferred from version numbers.
using AutogradNodePtr =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

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

}  // namespace compat
}  // namespace fsdp
