// A small GPT-like model for runtime tests: token embedding tied to the output head, a frozen
// projection, three residual blocks in a ModuleList, and a buffer. Units are marked with
// fsdp::forward, so the same code runs unwrapped in a single process.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <map>
#include <string>
#include <unordered_set>
#include <vector>

#include "fsdp/fully_sharded.h"
#include "multi_rank.h"

namespace fsdp {
namespace testing {

/// Called at the start of every Block's forward, when set (tests observe memory from it).
inline std::function<void()>& block_probe() {
  static std::function<void()> probe;
  return probe;
}

struct BlockImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  BlockImpl(int64_t d, int64_t h) {
    fc1 = register_module("fc1", torch::nn::Linear(d, h));
    fc2 = register_module("fc2", torch::nn::Linear(h, d));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    if (block_probe()) block_probe()();
    return x + fc2(torch::tanh(fc1(x)));
  }
};
TORCH_MODULE(Block);

// Output projection whose weight *is* the embedding's (one tensor registered on both modules).
struct TiedHeadImpl : torch::nn::Module {
  torch::Tensor weight;
  explicit TiedHeadImpl(const torch::Tensor& w) { weight = register_parameter("weight", w); }
  torch::Tensor forward(const torch::Tensor& x) { return torch::matmul(x, weight.t()); }
};
TORCH_MODULE(TiedHead);

struct TinyLMImpl : torch::nn::Module {
  static constexpr int64_t kVocab = 11, kDim = 8, kHidden = 13, kBlocks = 3;
  torch::nn::Embedding tok{nullptr};
  torch::nn::Linear frozen{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  TiedHead head{nullptr};
  torch::Tensor scale;  // a buffer

  explicit TinyLMImpl(uint64_t seed = 0) {
    fsdp::testing::seed_cpu(seed);
    tok = register_module("tok", torch::nn::Embedding(kVocab, kDim));
    frozen = register_module("frozen", torch::nn::Linear(kDim, kDim));
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < kBlocks; ++i) blocks->push_back(Block(kDim, kHidden));
    head = register_module("head", TiedHead(tok->weight));
    scale = register_buffer("scale", torch::linspace(0.5, 1.5, kDim));
  }

  torch::Tensor forward(const torch::Tensor& idx) {
    auto x = tok(idx) * scale;
    x = fsdp::forward(frozen, x);
    for (size_t i = 0; i < blocks->size(); ++i) {
      auto b = blocks->ptr<BlockImpl>(i);
      x = fsdp::forward(b, x);
    }
    return head(x);
  }
};
TORCH_MODULE(TinyLM);

/// A reproducible batch of `rows` sequences of 5 token ids, the same on every rank for a seed.
inline torch::Tensor lm_tokens(int64_t rows, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return torch::randint(TinyLMImpl::kVocab, {rows, 5}, gen, torch::kLong);
}

/// Next-token-style loss of TinyLM's logits against the tokens (mean cross-entropy).
inline torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, TinyLMImpl::kVocab}),
                                              target.reshape({-1}));
}

/// TinyLM's usual wrapping: `frozen` and every block are units, the root holds the rest.
inline FullyShardedOptions lm_options(TinyLM& m, ShardingStrategy s = ShardingStrategy::FULL_SHARD,
                                      bool use_orig_params = false) {
  return FullyShardedOptions()
      .auto_wrap_policy(fsdp::module_type_auto_wrap_policy<BlockImpl>())
      .units({m->frozen.ptr()})
      .sharding_strategy(s)
      .use_orig_params(use_orig_params);
}

/// Every parameter's full value by FQN, cloned (summoned without write-back). Collective.
inline std::map<std::string, torch::Tensor> full_params(FullyShardedDataParallel& model) {
  fsdp::SummonFullParamsGuard g(model, false);
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : model->module()->named_parameters())
    out[p.key()] = p.value().detach().clone();
  return out;
}

/// optimizer.zero_grad(set_to_none=true), whatever the LibTorch version's default is (1.13 zeroes
/// in place, 2.x sets to none).
inline void zero_grad_set_to_none(torch::optim::Optimizer& opt) {
  for (auto& group : opt.param_groups()) {
    for (auto& p : group.params()) p.mutable_grad().reset();
  }
}

/// LibTorch lists a tied parameter once per owner; an optimizer must see it once.
inline std::vector<torch::Tensor> unique_params(const std::vector<torch::Tensor>& ps) {
  std::vector<torch::Tensor> out;
  std::unordered_set<const void*> seen;
  for (const auto& p : ps) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  }
  return out;
}

}  // namespace testing
}  // namespace fsdp
