// The model and optimizers of the state-dict option matrix (tests/sd_matrix.cpp), with the odd
// layouts the matrix must survive: a weight tied across two modules (tok.weight = head.weight),
// a 0-d parameter (gain), an empty parameter (blocks.0.empty, 0 elements), a parameter that
// never gets a gradient (blocks.1.unused) (see Variant for the PyTorch comparison's twin), a frozen
// unit (frozen), sizes no world size divides, and a buffer. tests/oracle/sd_matrix.py is its Python
// twin (same FQNs, order and math).
//
// Units: `frozen` and each of the four blocks; the root holds tok/head, gain and the buffer.
// Five optimizers, one per kind, each over whole units so that every strategy and
// use_orig_params can take them: Adam (two param groups: the root's parameters, and the frozen
// unit's, which never get state), AdamW (amsgrad) on blocks.0, SGD with momentum on blocks.1,
// Adagrad on blocks.2, RMSprop (momentum, centered) on blocks.3.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "fsdp/checkpoint/state_dict.h"
#include "fsdp/fully_sharded.h"
#include "multi_rank.h"

namespace fsdp {
namespace testing {
namespace matrix {

// Sizes no world size 2-4 divides, yet each torch.chunk's into W non-empty pieces (PyTorch's
// get_state_dict fails a SHARDED dict where a rank holds no piece of a parameter, so the PyTorch
// comparison needs that; the empty parameter still leaves ranks without a piece here).
constexpr int64_t kVocab = 11, kDim = 7, kHidden = 11, kBlocks = 4;
constexpr int64_t kGlobalRows = 12;  // every world size 1-4 divides it

/// What the PyTorch comparison needs changed, because PyTorch 2.6's FSDP (with its
/// get_state_dict) cannot take it: a 0-d parameter ("FSDP doesn't support scalar parameters"),
/// a rank holding no piece of a parameter in a SHARDED dict (torch.chunk gives fewer pieces than
/// ranks, as for 6 rows over 4: get_state_dict's is_meta check fails there, "Only single local
/// shard is supported"), an empty parameter
/// in one (its ranks' empty shards "overlap"), and under use_orig_params a trainable parameter
/// without optimizer state ("<fqn> is not in the optimizer state"). The twin has gain of 7
/// elements (the forward uses their mean, which for the 0-d gain is the value), no empty
/// parameter, and under use_orig_params gives `unused` a (zero) gradient.
struct Variant {
  bool scalar_gain = true;
  bool empty = true;
  bool unused_gets_grad = false;
};

struct MBlockImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::Tensor empty, unused;  // registered on blocks 0 and 1 only
  bool unused_gets_grad = false;
  MBlockImpl(int index, const Variant& v) : unused_gets_grad(v.unused_gets_grad) {
    fc1 = register_module("fc1", torch::nn::Linear(kDim, kHidden));
    fc2 = register_module("fc2", torch::nn::Linear(kHidden, kDim));
    if (index == 0 && v.empty) empty = register_parameter("empty", torch::zeros({0, kDim}));
    if (index == 1) unused = register_parameter("unused", torch::randn({7}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = fc2(torch::tanh(fc1(x)));
    if (empty.defined()) h = h + empty.sum();  // a zero-size gradient, every step
    if (unused.defined() && unused_gets_grad) h = h + 0 * unused.sum();
    return x + h;
  }
};
TORCH_MODULE(MBlock);

struct MHeadImpl : torch::nn::Module {
  torch::Tensor weight;
  explicit MHeadImpl(const torch::Tensor& w) { weight = register_parameter("weight", w); }
  torch::Tensor forward(const torch::Tensor& x) { return torch::matmul(x, weight.t()); }
};
TORCH_MODULE(MHead);

struct MatrixNetImpl : torch::nn::Module {
  torch::nn::Embedding tok{nullptr};
  torch::Tensor gain;
  torch::nn::Linear frozen{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  MHead head{nullptr};
  torch::Tensor scale;

  // The frozen unit is the same for every seed: a restored model takes it from its own
  // construction where the dict leaves it out (ignore_frozen_params), as a user's would.
  explicit MatrixNetImpl(uint64_t seed, const Variant& variant = {}) {
    seed_cpu(1000 + seed);
    tok = register_module("tok", torch::nn::Embedding(kVocab, kDim));
    const float g = 1.0f + 0.01f * static_cast<float>(seed);
    gain = register_parameter("gain", variant.scalar_gain ? torch::tensor(g) : torch::full({7}, g));
    seed_cpu(77);
    frozen = register_module("frozen", torch::nn::Linear(kDim, kDim));
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
    seed_cpu(2000 + seed);
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < kBlocks; ++i) blocks->push_back(MBlock(i, variant));
    head = register_module("head", MHead(tok->weight));
    scale = register_buffer("scale", torch::linspace(0.5, 1.5, kDim));
  }

  torch::Tensor forward(const torch::Tensor& idx) {
    auto x = tok(idx) * scale;
    x = fsdp::forward(frozen, x);
    for (size_t i = 0; i < blocks->size(); ++i) {
      auto block = blocks->ptr<MBlockImpl>(i);
      x = fsdp::forward(block, x);
    }
    return head(x) * gain.mean();
  }
};
TORCH_MODULE(MatrixNet);

/// The wrapping: `frozen` and every block are units. Hybrid sharding: pure replication at W=2,
/// pure sharding at W=3, 2 x 2 at W=4; or `hybrid_shard_size` ranks per shard group.
inline FullyShardedOptions matrix_options(MatrixNet& m, ShardingStrategy s, bool use_orig_params,
                                          int world, int hybrid_shard_size = 0) {
  FullyShardedOptions o;
  o.units().push_back(m->frozen.ptr());
  for (size_t i = 0; i < m->blocks->size(); ++i) o.units().push_back(m->blocks[i]);
  o.sharding_strategy(s).use_orig_params(use_orig_params);
  if (s == ShardingStrategy::HYBRID_SHARD) {
    const int by_world = world == 4 ? 2 : world == 2 ? 1 : world;
    o.hybrid_shard_size(hybrid_shard_size > 0 ? hybrid_shard_size : by_world);
  }
  return o;
}

/// The five optimizers over a model's parameters as the optimizers see them (`params_of(unit)`:
/// the flat parameter, or the original parameters, of a unit, or of the root for "").
struct Optimizers {
  std::vector<std::unique_ptr<torch::optim::Optimizer>> owned;
  checkpoint::Optimizers list() const {
    checkpoint::Optimizers out;
    for (const auto& o : owned) out.push_back(o.get());
    return out;
  }
  void zero_grad() {
    for (auto& o : owned) o->zero_grad();
  }
  void step() {
    for (auto& o : owned) o->step();
  }
};

/// `params`: the parameters of units "" (the root), "frozen", "blocks.0" ... "blocks.3", in the
/// form the optimizers must hold (flat or original).
inline Optimizers make_optimizers(const std::vector<std::vector<at::Tensor>>& params) {
  namespace o = torch::optim;
  Optimizers out;
  std::vector<o::OptimizerParamGroup> adam_groups;
  adam_groups.emplace_back(params[0], std::make_unique<o::AdamOptions>(0.02));
  adam_groups.emplace_back(params[1], std::make_unique<o::AdamOptions>(0.005));
  for (auto& g : adam_groups) static_cast<o::AdamOptions&>(g.options()).eps(1e-3);
  out.owned.push_back(std::make_unique<o::Adam>(adam_groups, o::AdamOptions(0.02).eps(1e-3)));
  out.owned.push_back(std::make_unique<o::AdamW>(
      params[2], o::AdamWOptions(0.01).eps(1e-3).amsgrad(true).weight_decay(0.1)));
  out.owned.push_back(
      std::make_unique<o::SGD>(params[3], o::SGDOptions(0.05).momentum(0.9).nesterov(true)));
  out.owned.push_back(std::make_unique<o::Adagrad>(params[4], o::AdagradOptions(0.05)));
  out.owned.push_back(std::make_unique<o::RMSprop>(
      params[5], o::RMSpropOptions(0.01).eps(1e-3).momentum(0.5).centered(true)));
  return out;
}

/// The unit names make_optimizers takes parameters of, in order.
inline const std::vector<std::string>& unit_names() {
  static const std::vector<std::string> n{"",         "frozen",   "blocks.0",
                                          "blocks.1", "blocks.2", "blocks.3"};
  return n;
}

/// Which unit an FQN belongs to (its index in unit_names()).
inline size_t unit_of(const std::string& fqn) {
  for (size_t i = unit_names().size(); i-- > 1;) {
    if (fqn.rfind(unit_names()[i] + ".", 0) == 0) return i;
  }
  return 0;
}

/// Step `step`'s tokens for rank `rank` of `world`: its rows of a global batch of kGlobalRows
/// sequences of 5 tokens, the same global batch at every world size.
inline torch::Tensor matrix_tokens(int step, int rank, int world) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  torch::Tensor all = torch::randint(kVocab, {kGlobalRows, 5}, gen, torch::kLong);
  const int64_t rows = kGlobalRows / world;
  return all.narrow(0, rank * rows, rows);
}

inline torch::Tensor matrix_loss(const torch::Tensor& logits, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), target.reshape({-1}));
}

}  // namespace matrix
}  // namespace testing
}  // namespace fsdp
