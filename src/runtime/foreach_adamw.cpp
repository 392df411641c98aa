// ForeachAdamW::step: torch::optim::AdamW's arithmetic, operation for operation and in the same
// order, over lists of tensors (see fsdp/foreach_adamw.h). Every `_foreach_*` call below stands
// for the per-tensor call of LibTorch's step named beside it; that correspondence is what keeps
// the CPU result bit-identical, so keep it when changing either side. AdamWKernel::kFused hands
// each list to ATen's `_fused_adamw_` instead.
#include "fsdp/foreach_adamw.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cmath>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "fsdp/compat.h"
#include "fsdp/compat_optim.h"
#include "fsdp/errors.h"
#include "util/message.h"

namespace fsdp {
namespace {

namespace to = torch::optim;

// The parameters of one group that take the same step t (in a training loop, all of them; a
// parameter that missed steps for want of a gradient has its own t, and its own bias correction),
// and live on one device in one dtype (what a fused kernel's lists must share).
struct Bucket {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs;
  std::vector<to::AdamWParamState*> states;
};
using BucketKey = std::tuple<int64_t, int, int, int>;  // t, dtype, device type, device index

BucketKey key_of(int64_t t, const at::Tensor& p) {
  return {t, static_cast<int>(p.scalar_type()), static_cast<int>(p.device().type()),
          static_cast<int>(p.device().index())};
}

// The foreach step of one bucket: LibTorch's AdamW::step, operation for operation.
void foreach_step(Bucket& b, int64_t t, const to::AdamWOptions& options) {
  // p.mul_(1 - lr * weight_decay): LibTorch decays before the moments, from the same value.
  if (options.weight_decay() != 0)
    at::_foreach_mul_(b.params, 1 - options.lr() * options.weight_decay());
  const double beta1 = std::get<0>(options.betas()), beta2 = std::get<1>(options.betas());
  const double bias_correction1 = 1 - std::pow(beta1, t);
  const double bias_correction2 = 1 - std::pow(beta2, t);
  at::_foreach_mul_(b.exp_avgs, beta1);                               // exp_avg.mul_(beta1)
  at::_foreach_add_(b.exp_avgs, b.grads, 1 - beta1);                  //   .add_(grad, 1 - beta1)
  at::_foreach_mul_(b.exp_avg_sqs, beta2);                            // exp_avg_sq.mul_(beta2)
  at::_foreach_addcmul_(b.exp_avg_sqs, b.grads, b.grads, 1 - beta2);  // .addcmul_(...)
  std::vector<at::Tensor> denom;
  if (options.amsgrad()) {
    for (size_t i = 0; i < b.states.size(); ++i) {
      at::Tensor& m = b.max_exp_avg_sqs[i];
      torch::max_out(m, b.exp_avg_sqs[i], m);
      denom.push_back(m.sqrt());
    }
  } else {
    denom = at::_foreach_sqrt(b.exp_avg_sqs);  // exp_avg_sq.sqrt()
  }
  at::_foreach_div_(denom, std::sqrt(bias_correction2));  // / sqrt(bias_correction2)
  at::_foreach_add_(denom, options.eps());                // .add_(eps)
  // p.addcdiv_(exp_avg, denom, -step_size)
  at::_foreach_addcdiv_(b.params, b.exp_avgs, denom, -(options.lr() / bias_correction1));
}

// The fused step of one bucket. The kernel reads each tensor's step count from a float tensor on
// its device (PyTorch keeps one per parameter); the bucket's parameters share t, so one tensor,
// made by a fill on the device (no copy from the host to wait for), stands for all of them.
void fused_step(Bucket& b, int64_t t, const to::AdamWOptions& options) {
  const at::Tensor step =
      at::full({}, static_cast<double>(t), b.params.front().options().dtype(at::kFloat));
  const std::vector<at::Tensor> steps(b.params.size(), step);
  compat::fused_adamw_(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.max_exp_avg_sqs, steps,
                       options.lr(), std::get<0>(options.betas()), std::get<1>(options.betas()),
                       options.weight_decay(), options.eps(), options.amsgrad());
}

void check_kernel(AdamWKernel kernel) {
  if (kernel == AdamWKernel::kFused && !compat::kHasFusedAdamW)
    throw ValueError(detail::msg("ForeachAdamW: AdamWKernel::kFused needs LibTorch 2.4 or later (",
                                 "_fused_adamw_ on the CPU); this is ", TORCH_VERSION,
                                 "; use AdamWKernel::kForeach"));
}

}  // namespace

ForeachAdamW::ForeachAdamW(std::vector<to::OptimizerParamGroup> param_groups,
                           to::AdamWOptions defaults, AdamWKernel kernel)
    : to::AdamW(std::move(param_groups), std::move(defaults)), kernel_(kernel) {
  check_kernel(kernel);
}

ForeachAdamW::ForeachAdamW(std::vector<at::Tensor> params, to::AdamWOptions defaults,
                           AdamWKernel kernel)
    : to::AdamW(std::move(params), std::move(defaults)), kernel_(kernel) {
  check_kernel(kernel);
}

at::Tensor ForeachAdamW::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    auto& group = param_groups_[g];
    auto& options = static_cast<to::AdamWOptions&>(group.options());
    std::map<BucketKey, Bucket> buckets;
    for (size_t i = 0; i < group.params().size(); ++i) {
      at::Tensor& p = group.params()[i];
      if (!p.grad().defined()) continue;
      if (p.grad().is_sparse())
        throw ValueError(
            detail::msg("ForeachAdamW: parameter ", i, " of group ", g,
                        " has a sparse gradient; AdamW does not support sparse gradients"));
      auto it = state_.find(compat::optim_state_key(p));
      if (it == state_.end()) {  // as LibTorch: zeros shaped like the parameter, step 0
        auto state = std::make_unique<to::AdamWParamState>();
        state->step(0);
        state->exp_avg(torch::zeros_like(p, at::MemoryFormat::Preserve));
        state->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
        if (options.amsgrad())
          state->max_exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
        it = state_.emplace(compat::optim_state_key(p), std::move(state)).first;
      }
      auto& state = static_cast<to::AdamWParamState&>(*it->second);
      state.step(state.step() + 1);
      Bucket& b = buckets[key_of(state.step(), p)];
      b.params.push_back(p);
      b.grads.push_back(p.grad());
      b.exp_avgs.push_back(state.exp_avg());
      b.exp_avg_sqs.push_back(state.exp_avg_sq());
      if (options.amsgrad()) b.max_exp_avg_sqs.push_back(state.max_exp_avg_sq());
      b.states.push_back(&state);
    }
    for (auto& [key, b] : buckets) {
      if (kernel_ == AdamWKernel::kFused) {
        fused_step(b, std::get<0>(key), options);
      } else {
        foreach_step(b, std::get<0>(key), options);
      }
    }
  }
  return loss;
}

}  // namespace fsdp
