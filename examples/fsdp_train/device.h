// fsdp-train's device and memory: where a rank computes, and how much memory it has used.
#pragma once

#include <malloc.h>  // mallopt (glibc)
#include <sys/resource.h>

#include <torch/torch.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <utility>

#include "flags.h"
#include "fsdp/compat.h"
#include "fsdp/compat_cuda.h"
#include "fsdp/dist.h"

namespace fsdp_train {

// glibc raises its mmap threshold each time it frees a mapped block, up to 32 MiB; buffers below
// the raised threshold then come from the heap and stay there, fragmented, after they are freed.
// A sharded step frees and reallocates unit-sized buffers all the time, so each rank kept up to
// 27% above the analytic bound (measured: docs/deferred_init.md). A fixed threshold stops that.
inline void fix_mmap_threshold(int kb) {
#ifdef __GLIBC__
  if (kb > 0 && ::mallopt(M_MMAP_THRESHOLD, kb * 1024) != 1)
    fail("--mmap-threshold-kb " + std::to_string(kb) + " was refused by glibc's mallopt");
#else
  (void)kb;
#endif
}

// This process's peak resident set (ru_maxrss), in MB. Linux keeps it in the same counter as
// VmHWM, so after reset_peak_rss() it is the peak since the reset: the trainer keeps start-up's
// peak apart and reports the larger of the two as the run's.
inline double max_rss_mb() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // kilobytes on Linux
}

// The peak resident set since the last reset_peak_rss() (Linux's VmHWM), in MB; -1 where the
// kernel does not report it.
inline double peak_rss_since_reset_mb() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  }
  return -1;
}

// Starts VmHWM anew ("5" to /proc/self/clear_refs), so the training steps' peak can be told from
// start-up's: with --init eager start-up is the higher of the two, and would hide it.
inline void reset_peak_rss() {
  if (std::FILE* f = std::fopen("/proc/self/clear_refs", "w")) {
    std::fputs("5", f);
    std::fclose(f);
  }
}

// The GPUs' model as NVIDIA's driver names it ("NVIDIA H200"), read from
// /proc/driver/nvidia/gpus/*/information: LibTorch's C++ API has no device name without CUDA's
// own headers. Empty when there is no such file, or the GPUs are not all of one model (then
// which is this rank's cannot be told without CUDA's device order).
inline std::string gpu_model() {
  std::set<std::string> models;
  std::error_code ec;
  for (const auto& gpu : std::filesystem::directory_iterator("/proc/driver/nvidia/gpus", ec)) {
    std::ifstream in(gpu.path() / "information");
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("Model:", 0) != 0) continue;
      const size_t at = line.find_first_not_of(" \t", 6);
      models.insert(at == std::string::npos ? "" : line.substr(at));
    }
  }
  return models.size() == 1 ? *models.begin() : "";
}

// The dense bf16 tensor-core peak in TFLOP/s of the GPU models we know (NVIDIA's datasheets,
// without sparsity: what torchtitan counts MFU against); 0 for any other. A variant named in the
// model wins over the model's plain entry (an "H100 PCIe" is slower than an H100 SXM).
inline double known_bf16_peak_tflops(const std::string& model) {
  static const std::pair<const char*, double> kPeaks[] = {
      {"H100 PCIe", 756}, {"H100 NVL", 835}, {"H100", 989},  {"H200 NVL", 835}, {"H200", 989},
      {"H20", 148},       {"GB200", 2500},   {"B200", 2250}, {"A100", 312},     {"L40S", 362},
      {"L40", 181},       {"A10G", 70},      {"A10", 125},   {"L4", 121},
  };
  // The longest name the model contains: "L40S" before "L40" before "L4", "GB200" before "B200".
  double best = 0;
  size_t best_len = 0;
  for (const auto& [name, tflops] : kPeaks) {
    const size_t len = std::char_traits<char>::length(name);
    if (len > best_len && model.find(name) != std::string::npos) best = tflops, best_len = len;
  }
  return best;
}

// --peak-tflops made concrete: given, it stands; else on a GPU known to the table and with bf16
// compute, the table's; else 0 (no MFU). `peak_source` says which, for the start-up line.
inline void resolve_peak(Flags& f, bool cuda) {
  if (f.peak_tflops > 0) {
    f.peak_source = "--peak-tflops";
    return;
  }
  const std::string model = cuda ? gpu_model() : "";
  const double table = known_bf16_peak_tflops(model);
  if (table > 0 && f.mixed_precision == "bf16") {
    f.peak_tflops = table;
    f.peak_source = model + ", dense bf16 (examples/fsdp_train/device.h)";
  } else if (table > 0) {
    f.peak_source = "unknown: the table holds " + model + "'s bf16 peak, and this run is not bf16";
  } else {
    f.peak_source = cuda ? "unknown GPU" + (model.empty() ? "" : " " + model) : "unknown on a CPU";
  }
}

// The CUDA caching allocator's peak of allocated bytes on `device` since reset_cuda_peak_of, in
// MB; -1 on the CPU.
inline double cuda_peak_mb(const at::Device& device) {
  if (!device.is_cuda()) return -1;
  return static_cast<double>(fsdp::compat::cuda_peak_allocated_bytes(device.index())) / 1048576.0;
}

// What the CUDA caching allocator has handed out on `device` now, in MB; -1 on the CPU.
inline double cuda_allocated_mb(const at::Device& device) {
  if (!device.is_cuda()) return -1;
  return static_cast<double>(fsdp::compat::cuda_allocated_bytes(device.index())) / 1048576.0;
}

inline void reset_cuda_peak_of(const at::Device& device) {
  if (device.is_cuda()) fsdp::compat::reset_cuda_peak(device.index());
}

// --sync-debug for the steps that follow (on a GPU; nothing on the CPU).
inline void set_sync_debug(const Flags& f, bool on) {
  if (f.device.rfind("cuda", 0) != 0 || f.sync_debug == "off") return;
  using fsdp::compat::CudaSyncDebug;
  const bool set = fsdp::compat::set_cuda_sync_debug(
      !on ? CudaSyncDebug::kOff
          : (f.sync_debug == "error" ? CudaSyncDebug::kError : CudaSyncDebug::kWarn));
  if (!set) fail("--sync-debug: this build of fsdp-cpp has no CUDA side (USE_C10D_NCCL unset)");
}

// --device, --attention and --peak-tflops made concrete: auto is this local rank's GPU when
// LibTorch sees one (as torchrun users expect; ranks beyond the GPUs share them round robin), else
// the CPU; and the fused attention kernel on a GPU where LibTorch has one, the math path elsewhere
// (so the CPU computes what it always did).
inline void resolve_device(Flags& f, const fsdp::dist::EnvInfo& env) {
  const int local_rank = env.local_rank;
  const int gpus = torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
  if (f.device == "cuda" && gpus == 0)
    fail("--device cuda: LibTorch sees no CUDA device (is it a CUDA build, and a GPU visible?)");
  const bool cuda = f.device == "cuda" || (f.device == "auto" && gpus > 0);
  f.device = cuda ? "cuda:" + std::to_string(local_rank % gpus) : "cpu";
  // Ranks sharing a GPU: NCCL accepts them only as different hosts (docs/portability.md).
  if (cuda && env.local_world_size > gpus && std::getenv("NCCL_HOSTID") == nullptr)
    ::setenv("NCCL_HOSTID", ("fsdp-train-rank-" + std::to_string(env.rank)).c_str(), 1);
  if (f.attention == "fused" && !fsdp::compat::kHasFusedAttention)
    fail("--attention fused: this LibTorch (" + std::string(TORCH_VERSION) +
         ") has no scaled_dot_product_attention; use --attention math");
  if (f.attention == "auto")
    f.attention = cuda && fsdp::compat::kHasFusedAttention ? "fused" : "math";
  resolve_peak(f, cuda);
}

}  // namespace fsdp_train
