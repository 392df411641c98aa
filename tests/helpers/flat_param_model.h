// A small model with every awkward parameter layout FSDP must handle: a 0-d parameter, an empty
// one, sizes not divisible by the world size, a submodule, and a weight tied across two modules.
#pragma once

#include <torch/torch.h>

#include "multi_rank.h"

namespace fsdp {
namespace testing {

struct HeadImpl : torch::nn::Module {
  torch::Tensor w;
  torch::Tensor tied;  // the same tensor as the parent's lin->weight
  explicit HeadImpl(const torch::Tensor& shared) {
    w = register_parameter("w", torch::randn({5, 3}));
    tied = register_parameter("tied", shared);
  }
};
TORCH_MODULE(Head);

struct NetImpl : torch::nn::Module {
  torch::Tensor scalar, empty, odd;
  torch::nn::Linear lin{nullptr};
  Head head{nullptr};
  explicit NetImpl(uint64_t seed = 0) {
    fsdp::testing::seed_cpu(seed);
    scalar = register_parameter("scalar", torch::randn({}));
    empty = register_parameter("empty", torch::empty({0}));
    odd = register_parameter("odd", torch::randn({7}));
    lin = register_module("lin", torch::nn::Linear(3, 5));
    head = register_module("head", Head(lin->weight));
  }
  // Uses every parameter, the tied one through both owners.
  torch::Tensor loss(const torch::Tensor& x) {
    auto y = lin->forward(x) * scalar;
    return y.pow(2).sum() + odd.pow(2).sum() * 0.5 + (head->w * head->tied).sum() + empty.sum();
  }
};
TORCH_MODULE(Net);

/// Values of every parameter, by FQN, as the unwrapped model lists them.
inline std::vector<std::pair<std::string, torch::Tensor>> snapshot(torch::nn::Module& m) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : m.named_parameters()) out.emplace_back(p.key(), p.value().detach().clone());
  return out;
}

}  // namespace testing
}  // namespace fsdp
