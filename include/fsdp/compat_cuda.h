// fsdp/compat_cuda.h: what a trainer asks of CUDA that LibTorch's C++ API has no portable call for,
// the same on every LibTorch with CUDA and a harmless answer on a build without.
//
// The part of compat.h's job kept apart because it needs c10's CUDA headers, which only CUDA
// builds ship (the precompiled header every translation unit shares must not need them):
//  * the CUDA caching allocator's peak of allocated bytes, and its reset (what Python's
//    torch.cuda.max_memory_allocated and reset_peak_memory_stats read and reset);
//  * CUDA's synchronisation debug mode (torch.cuda.set_sync_debug_mode): a warning or an error
//    from every operation that makes the host wait for the device.
// A build has CUDA when CMake found LibTorch's CUDA libraries, which is also when it defines
// USE_C10D_NCCL (CMakeLists.txt); without, `kHasCuda` is false, the peak is -1 and the rest does
// nothing.
//
// Thread safety: the allocator's statistics are its own to guard; the sync debug mode is one
// process-wide setting, so set it from one thread.
#pragma once

#include <cstdint>

#ifdef USE_C10D_NCCL
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace fsdp {
namespace compat {

/// Whether this build has LibTorch's CUDA side.
#ifdef USE_C10D_NCCL
constexpr bool kHasCuda = true;
#else
constexpr bool kHasCuda = false;
#endif

/// The most bytes the CUDA caching allocator had handed out on `device` at once since the last
/// reset_cuda_peak (or since the process began): Python's torch.cuda.max_memory_allocated. -1
/// without CUDA.
inline int64_t cuda_peak_allocated_bytes(int device) {
#ifdef USE_C10D_NCCL
  // allocated_bytes[0] is the aggregate over the small and large pools (StatType::AGGREGATE).
  return c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device))
      .allocated_bytes[0]
      .peak;
#else
  (void)device;
  return -1;
#endif
}

/// The bytes the CUDA caching allocator has handed out on `device` now (Python's
/// torch.cuda.memory_allocated); -1 without CUDA.
inline int64_t cuda_allocated_bytes(int device) {
#ifdef USE_C10D_NCCL
  return c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device))
      .allocated_bytes[0]
      .current;
#else
  (void)device;
  return -1;
#endif
}

/// Starts the peak of cuda_peak_allocated_bytes anew from what is allocated now.
inline void reset_cuda_peak(int device) {
#ifdef USE_C10D_NCCL
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
#else
  (void)device;
#endif
}

/// CUDA's synchronisation debug mode: what happens when an operation makes the host wait for the
/// device (a `.item()`, a blocking copy, an explicit synchronize).
enum class CudaSyncDebug { kOff = 0, kWarn = 1, kError = 2 };

/// Sets the process's CUDA synchronisation debug mode; false (and nothing done) without CUDA.
inline bool set_cuda_sync_debug(CudaSyncDebug mode) {
#ifdef USE_C10D_NCCL
  c10::cuda::warning_state().set_sync_debug_mode(static_cast<c10::cuda::SyncDebugMode>(mode));
  return true;
#else
  (void)mode;
  return false;
#endif
}

}  // namespace compat
}  // namespace fsdp
