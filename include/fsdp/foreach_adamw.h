// fsdp/foreach_adamw.h: LibTorch's AdamW, stepped as a few multi-tensor operations per parameter
// group instead of a dozen operations per parameter.
//
// torch::optim::AdamW::step() walks its parameters one at a time, so a step launches about ten
// kernels per tensor: on a GPU, hundreds of small launches with use_orig_params, which PyTorch's
// Python optimizers avoid with `foreach=True` (the default on CUDA) or `fused=True`. ForeachAdamW
// is that torch::optim::AdamW: the same options, the same per-parameter state (AdamWParamState,
// so get_state_dict/set_state_dict, checkpoints and LibTorch's serialization see an AdamW), and
// the same arithmetic, issued through ATen's `_foreach_*` operations over all the parameters of a
// group that share a step count:
//
//   p *= 1 - lr * weight_decay                         (decoupled weight decay)
//   m = beta1 m + (1 - beta1) g
//   v = beta2 v + (1 - beta2) g^2
//   p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//
// On the CPU ATen runs a `_foreach_*` operation as the per-tensor operation it stands for, so the
// result is bit for bit LibTorch's AdamW's (tested); on CUDA it is one multi-tensor kernel per
// operation, whose results agree within float rounding. amsgrad, a closure, and sparse gradients
// behave as in torch::optim::AdamW (amsgrad's running maximum is taken tensor by tensor).
//
// AdamWKernel::kFused issues each list as ATen's `_fused_adamw_` instead (PyTorch's
// `fused=True`): one kernel for the whole step of a list, where the foreach path runs about ten.
// Its arithmetic is a fused kernel's own (a lerp for the first moment, the bias corrections in
// float), so it agrees with LibTorch's AdamW within float rounding, not bit for bit (tested). It
// needs LibTorch 2.4 or later (compat::kHasFusedAdamW); before, constructing one throws.
//
//   auto opt = fsdp::ForeachAdamW(model->parameters(), torch::optim::AdamWOptions(3e-4));
//   auto fused = fsdp::ForeachAdamW(params, options, fsdp::AdamWKernel::kFused);
//
// Thread safety: as any torch::optim::Optimizer, one thread steps it at a time.
#pragma once

#include <torch/optim/adamw.h>

#include <utility>
#include <vector>

namespace fsdp {

/// How a ForeachAdamW issues its step.
enum class AdamWKernel {
  kForeach,  ///< ATen's `_foreach_*` operations: bit for bit LibTorch's AdamW on the CPU
  kFused,    ///< ATen's `_fused_adamw_`: one kernel per list (LibTorch 2.4 on)
};

class ForeachAdamW : public torch::optim::AdamW {
 public:
  /// Throws fsdp::ValueError for AdamWKernel::kFused where LibTorch has no fused AdamW.
  explicit ForeachAdamW(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                        torch::optim::AdamWOptions defaults = {},
                        AdamWKernel kernel = AdamWKernel::kForeach);
  explicit ForeachAdamW(std::vector<at::Tensor> params, torch::optim::AdamWOptions defaults = {},
                        AdamWKernel kernel = AdamWKernel::kForeach);

  /// One AdamW step over every parameter that has a gradient; returns the closure's loss, if any.
  at::Tensor step(LossClosure closure = nullptr) override;

  /// The kernel this optimizer steps with.
  AdamWKernel kernel() const { return kernel_; }

 private:
  AdamWKernel kernel_;
};

}  // namespace fsdp
