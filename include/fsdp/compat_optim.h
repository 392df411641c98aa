// fsdp/compat_optim.h: the optimizer kernels that differ between LibTorch releases.
//
// The part of compat.h's job (every LibTorch version difference in one place) that only the
// optimizers need, kept out of compat.h so that the precompiled header every translation unit
// shares does not carry it (compat_backends.h is split off for the same reason). The differences:
//  * ATen's fused AdamW step (`_fused_adamw_`: one kernel for a whole list of tensors, what
//    PyTorch's `AdamW(fused=True)` runs). CUDA has it from 2.0 and the CPU from 2.4 (2.6
//    verified; 1.13 has neither), so `kHasFusedAdamW` is true from 2.4 on, where both devices do.
//
// Thread safety: everything here is stateless.
#pragma once

#include <torch/version.h>

#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace fsdp {
namespace compat {

/// True where LibTorch has `_fused_adamw_` on the CPU and on CUDA (2.4 on).
constexpr bool kHasFusedAdamW = TORCH_VERSION_MAJOR > 2 ||
                                (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4);

/// One fused AdamW step over lists of tensors of one device and dtype, as ATen's `_fused_adamw_`
/// defines it: `steps[i]` (a float tensor on the parameters' device) is the step count already
/// advanced for this step; `max_exp_avg_sqs` is empty unless `amsgrad`. Where LibTorch has no such
/// kernel (see kHasFusedAdamW) it throws std::invalid_argument: callers check kHasFusedAdamW first.
inline void fused_adamw_(const std::vector<at::Tensor>& params,
                         const std::vector<at::Tensor>& grads,
                         const std::vector<at::Tensor>& exp_avgs,
                         const std::vector<at::Tensor>& exp_avg_sqs,
                         const std::vector<at::Tensor>& max_exp_avg_sqs,
                         const std::vector<at::Tensor>& steps, double lr, double beta1,
                         double beta2, double weight_decay, double eps, bool amsgrad) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2,
                    weight_decay, eps, amsgrad, /*maximize=*/false);
#else
  (void)params, (void)grads, (void)exp_avgs, (void)exp_avg_sqs, (void)max_exp_avg_sqs, (void)steps,
      (void)lr, (void)beta1, (void)beta2, (void)weight_decay, (void)eps, (void)amsgrad;
  throw std::invalid_argument("LibTorch " + std::to_string(TORCH_VERSION_MAJOR) + "." +
                              std::to_string(TORCH_VERSION_MINOR) +
                              " has no _fused_adamw_ on the CPU (2.4 and later have)");
#endif
}

}  // namespace compat
}  // namespace fsdp
