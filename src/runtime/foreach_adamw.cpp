// ForeachAdamW::step: torch::optim::AdamW's arithmetic, operation for operation and in the same
// order, over lists of tensors (see fsdp/foreach_adamw.h). Every `_foreach_*` call below stands
// for the per-tensor call of LibTorch's step named beside it; that correspondence is what keeps
// the CPU result bit-identical, so keep it when changing either side.
#include "fsdp/foreach_adamw.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cmath>
#include <map>
#include <memory>

#include "fsdp/compat.h"
#include "fsdp/errors.h"
#include "util/message.h"

namespace fsdp {
namespace {

namespace to = torch::optim;

// The parameters of one group that take the same step t (in a training loop, all of them; a
// parameter that missed steps for want of a gradient has its own t, and its own bias correction).
struct Bucket {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs;
  std::vector<to::AdamWParamState*> states;
};

}  // namespace

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
    std::vector<at::Tensor> decayed;
    std::map<int64_t, Bucket> buckets;
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
      decayed.push_back(p);
      Bucket& b = buckets[state.step()];
      b.params.push_back(p);
      b.grads.push_back(p.grad());
      b.exp_avgs.push_back(state.exp_avg());
      b.exp_avg_sqs.push_back(state.exp_avg_sq());
      b.states.push_back(&state);
    }
    if (decayed.empty()) continue;
    // p.mul_(1 - lr * weight_decay): LibTorch decays before the moments, from the same value.
    if (options.weight_decay() != 0)
      at::_foreach_mul_(decayed, 1 - options.lr() * options.weight_decay());
    const double beta1 = std::get<0>(options.betas()), beta2 = std::get<1>(options.betas());
    for (auto& [t, b] : buckets) {
      const double bias_correction1 = 1 - std::pow(beta1, t);
      const double bias_correction2 = 1 - std::pow(beta2, t);
      at::_foreach_mul_(b.exp_avgs, beta1);               // exp_avg.mul_(beta1)
      at::_foreach_add_(b.exp_avgs, b.grads, 1 - beta1);  //   .add_(grad, 1 - beta1)
      at::_foreach_mul_(b.exp_avg_sqs, beta2);            // exp_avg_sq.mul_(beta2)
      at::_foreach_addcmul_(b.exp_avg_sqs, b.grads, b.grads, 1 - beta2);  // .addcmul_(...)
      std::vector<at::Tensor> denom;
      if (options.amsgrad()) {
        for (size_t i = 0; i < b.states.size(); ++i) {
          at::Tensor& m = b.states[i]->max_exp_avg_sq();
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
  }
  return loss;
}

}  // namespace fsdp
