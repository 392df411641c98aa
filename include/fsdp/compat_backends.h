// fsdp/compat_backends.h: building c10d stores and backends on LibTorch 1.13 and 2.x.
//
// The part of compat.h's job (every LibTorch version difference in one place) that only code
// building a backend needs: fsdp::dist, the tests' and benchmarks' launchers, and a program that
// brings its own backend to ProcessGroup::from_backend. It includes Gloo's and NCCL's c10d
// headers, so neither fsdp.h nor any other public header includes it. The differences covered:
//  * TCPStore construction: only TCPStore(host, TCPStoreOptions) exists in both, so it is the only
//    form used. Since 2.4 TCPStoreOptions::useLibUV defaults to true, and builds without libuv
//    (Debian's) then throw; we default it to false (see make_tcp_store).
//  * NCCL's shutdown() before its last handle goes (2.6 on), and which device a backend's
//    collectives use.
//
// Thread safety: everything here is stateless.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <utility>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#ifdef USE_C10D_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#ifdef USE_C10D_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "fsdp/compat.h"

namespace fsdp {
namespace compat {

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
/// Creates a Gloo backend over `store` with one device per network interface named in
/// `interfaces` ("eth0", as GLOO_SOCKET_IFNAME lists them; Gloo spreads its connections over
/// them), or, when that is empty, on `hostname` (an address of this host), or Gloo's default
/// device for this host's name when that is empty too.
inline BackendPtr make_gloo_backend(const StorePtr& store, int rank, int size,
                                    std::chrono::milliseconds timeout,
                                    const std::vector<std::string>& interfaces,
                                    const std::string& hostname, int threads) {
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  for (const auto& name : interfaces)
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
  if (interfaces.empty() && hostname.empty())
    opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  if (interfaces.empty() && !hostname.empty())
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
  opts->threads = threads;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
}

/// The same on one address (`hostname`; empty: Gloo's default device for this host's name).
inline BackendPtr make_gloo_backend(const StorePtr& store, int rank, int size,
                                    std::chrono::milliseconds timeout, const std::string& hostname,
                                    int threads) {
  return make_gloo_backend(store, rank, size, timeout, {}, hostname, threads);
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

/// Makes CUDA device `index` the current one (torch.cuda.set_device). False where fsdp-cpp was
/// built without NCCL, whose CUDA runtime this needs.
inline bool set_cuda_device(int index) {
#ifdef USE_C10D_NCCL
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(index));
  return true;
#else
  (void)index;
  return false;
#endif
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

}  // namespace compat
}  // namespace fsdp
