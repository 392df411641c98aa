// fsdp-train's compute-only step (--compute-only): the model unwrapped, on this rank's device,
// trained on this rank's rows with the same optimizer and no communication at all. It is the
// compute an FSDP step cannot do without, so the FSDP step's time over this one's is FSDP's
// exposed overhead (gathering, reducing, flattening, and whatever of it compute does not hide).
//
// With bf16 it does what FSDP's mixed precision does, by hand: the model's weights are bf16 for
// forward and backward, and float32 master copies (made from the float32 initial weights, as
// FSDP's flat parameters are) take the gradients cast to float32 and the optimizer's step, then
// are cast back into the bf16 weights. At one rank it therefore follows the FSDP run's losses
// (tested against it); at more, each rank trains its own copy on its own rows, so only its speed
// is comparable.
#pragma once

#include <torch/torch.h>

#include <vector>

#include "gpt.h"

namespace fsdp_train {

// Each parameter once: a tied weight is listed by both modules that hold it.
inline std::vector<torch::Tensor> unique_params(const std::vector<torch::Tensor>& all) {
  std::vector<torch::Tensor> out;
  for (const auto& p : all) {
    bool seen = false;
    for (const auto& q : out) seen |= q.is_same(p);
    if (!seen) out.push_back(p);
  }
  return out;
}

class PlainModel {
 public:
  PlainModel(gpt::GPT model, const at::Device& device, bool bf16) : model_(std::move(model)) {
    model_->to(device);
    params_ = unique_params(model_->parameters());  // the tied head's weight is listed twice
    if (!bf16) return;
    for (const auto& p : params_) masters_.push_back(p.detach().clone().set_requires_grad(true));
    model_->to(torch::kBFloat16);
  }

  /// What the optimizer steps: the float32 masters with bf16, else the model's own parameters.
  std::vector<at::Tensor> optimizer_params() const { return bf16() ? masters_ : params_; }

  torch::Tensor forward(const torch::Tensor& x) { return model_->forward(x); }

  /// Before forward: no gradients left from the last step (backward allocates them anew).
  void zero_grad() {
    for (auto& p : params_) p.mutable_grad().reset();
  }

  /// After backward, before the optimizer: the bf16 gradients moved into the masters, as float32
  /// (the bf16 ones are freed before the optimizer's step, as FSDP frees its unsharded gradients).
  /// Without bf16 there is nothing to move: the optimizer steps the model's own parameters.
  void gradients_to_masters() {
    for (size_t i = 0; i < masters_.size(); ++i) {
      const at::Tensor& g = params_[i].grad();
      masters_[i].mutable_grad() = g.defined() ? g.to(torch::kFloat) : at::Tensor();
      params_[i].mutable_grad().reset();
    }
  }

  /// After the optimizer: the masters' new values into the bf16 weights (rounded to nearest).
  void masters_to_weights() {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < masters_.size(); ++i) params_[i].copy_(masters_[i]);
  }

  /// Parameter elements, each tied tensor once.
  int64_t numel() const {
    int64_t n = 0;
    for (const auto& p : params_) n += p.numel();
    return n;
  }

 private:
  bool bf16() const { return !masters_.empty(); }

  gpt::GPT model_;
  std::vector<at::Tensor> params_;   // the model's, each once
  std::vector<at::Tensor> masters_;  // bf16 only: float32 copies, params_'s order
};

}  // namespace fsdp_train
