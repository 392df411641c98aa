// Activation checkpointing (fsdp/activation_checkpointing.h): gradients bit-identical to the same
// model without it, in one process and under FSDP at W = 1-4 with every strategy; what a
// checkpointed call recomputes and when; and the all-gathers a checkpointed unit costs.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <map>
#include <optional>
#include <string>

#include "dist/fault_point.h"
#include "fsdp/activation_checkpointing.h"
#include "fsdp/errors.h"
#include "fsdp/fully_sharded.h"
#include "multi_rank.h"

using fsdp::FullyShardedDataParallel;
using fsdp::FullyShardedOptions;
using fsdp::ShardingStrategy;
using fsdp::dist::ProcessGroup;
using fsdp::testing::run_ranks;
using fsdp::testing::seed_cpu;

namespace {

// Counts the checkpointed blocks' forwards: a recomputation is a second forward of the block.
std::atomic<int> g_block_forwards{0};

// A block whose activations dominate: two linear layers around GELU and dropout, residual.
struct DropBlockImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout drop{nullptr};
  DropBlockImpl(int64_t d, int64_t h, double p) {
    fc1 = register_module("fc1", torch::nn::Linear(d, h));
    fc2 = register_module("fc2", torch::nn::Linear(h, d));
    drop = register_module("drop", torch::nn::Dropout(p));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    ++g_block_forwards;
    return x + fc2(drop(torch::gelu(fc1(x))));
  }
};
TORCH_MODULE(DropBlock);

// Embedding, blocks (FSDP units when wrapped), a block that stays in the root unit, a head.
struct NetImpl : torch::nn::Module {
  static constexpr int64_t kVocab = 13, kDim = 8, kHidden = 24, kBlocks = 3;
  torch::nn::Embedding tok{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  DropBlock mid{nullptr};  // not a unit: checkpointed inside the root unit
  torch::nn::Linear head{nullptr};
  explicit NetImpl(uint64_t seed) {
    seed_cpu(seed);
    tok = register_module("tok", torch::nn::Embedding(kVocab, kDim));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < kBlocks; ++i) blocks->push_back(DropBlock(kDim, kHidden, 0.25));
    mid = register_module("mid", DropBlock(kDim, kHidden, 0.25));
    head = register_module("head", torch::nn::Linear(kDim, kVocab));
  }
  // Set: the blocks (units, when wrapped) and `mid` run inside one checkpointed call.
  bool one_region = false;
  torch::Tensor body(const torch::Tensor& in) {
    auto x = in;
    for (size_t i = 0; i < blocks->size(); ++i) {
      auto b = blocks->ptr<DropBlockImpl>(i);
      x = fsdp::forward(b, x);
      if (i == 0) x = fsdp::forward(mid, x);
    }
    return x;
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    auto x = tok(idx);
    if (one_region) {
      auto fn = [this](const std::vector<torch::Tensor>& in) {
        return std::vector<torch::Tensor>{body(in[0])};
      };
      x = fsdp::checkpoint_function(fn, {x})[0];
    } else {
      x = body(x);
    }
    return head(x);
  }
};
TORCH_MODULE(Net);

torch::Tensor tokens(int64_t rows, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return torch::randint(NetImpl::kVocab, {rows, 6}, gen, torch::kLong);
}

torch::Tensor loss_of(const torch::Tensor& logits, const torch::Tensor& idx) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, NetImpl::kVocab}).to(at::kFloat),
                                              idx.reshape({-1}));
}

enum class Ckpt { kNone, kUnits, kUnitsAndMid };

std::vector<std::shared_ptr<torch::nn::Module>> block_units(Net& net) {
  std::vector<std::shared_ptr<torch::nn::Module>> units;
  for (size_t i = 0; i < net->blocks->size(); ++i) units.push_back(net->blocks[i]);
  return units;
}

struct TrainCase {
  int world = 2;
  ShardingStrategy strategy = ShardingStrategy::FULL_SHARD;
  bool bf16 = false;
  bool no_sync = false;
  bool use_orig_params = false;
  bool preserve_rng = true;
  // CPU offload with forward prefetching and BACKWARD_POST (the default is BACKWARD_PRE).
  bool offload_and_prefetch = false;
};

// Three SGD steps of the wrapped Net (dropout on, a different seed per rank); the full
// parameters after them.
std::map<std::string, torch::Tensor> train(const ProcessGroup& pg, const TrainCase& c, Ckpt ckpt) {
  Net net(7);
  // The blocks are units; `mid`, a DropBlock too, stays in the root unit.
  auto opts = FullyShardedOptions()
                  .units(block_units(net))
                  .sharding_strategy(c.strategy)
                  .use_orig_params(c.use_orig_params);
  if (c.strategy == ShardingStrategy::HYBRID_SHARD ||
      c.strategy == ShardingStrategy::HYBRID_SHARD_ZERO2) {
    opts.hybrid_shard_size(c.world % 2 == 0 ? 2 : c.world);
  }
  if (c.bf16) opts.mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16));
  if (c.offload_and_prefetch) {
    opts.cpu_offload(fsdp::CPUOffload().offload_params(true))
        .forward_prefetch(true)
        .backward_prefetch(fsdp::BackwardPrefetch::BACKWARD_POST);
  }
  FullyShardedDataParallel model(net, opts);
  const auto ck = fsdp::CheckpointOptions().preserve_rng_state(c.preserve_rng);
  if (ckpt != Ckpt::kNone) {
    EXPECT_EQ(fsdp::apply_activation_checkpointing(model, fsdp::checkpoint_units(), ck), 3);
  }
  if (ckpt == Ckpt::kUnitsAndMid) {
    EXPECT_EQ(fsdp::apply_activation_checkpointing(
                  net, [&](const auto& m, const std::string&) { return m == net->mid.ptr(); }, ck),
              1);
  }
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.5));
  seed_cpu(100 + static_cast<uint64_t>(pg.rank()));  // dropout's masks differ across ranks
  for (int step = 0; step < 3; ++step) {
    sgd.zero_grad();
    const uint64_t seed = 10 * static_cast<uint64_t>(step) + static_cast<uint64_t>(pg.rank());
    if (c.no_sync) {
      fsdp::NoSyncGuard guard(model);
      auto idx = tokens(2, seed + 1000);
      loss_of(model->forward(idx), idx).backward();
    }
    auto idx = tokens(2, seed);
    loss_of(model->forward(idx), idx).backward();
    sgd.step();
  }
  auto out = fsdp::testing::full_params(model);
  fsdp::clear_activation_checkpointing(model.ptr());
  return out;
}

// Whether every parameter is bit-identical; the first that is not is named.
::testing::AssertionResult same_params(const std::map<std::string, torch::Tensor>& a,
                                       const std::map<std::string, torch::Tensor>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "different parameter sets";
  for (const auto& [name, t] : a) {
    if (!torch::equal(t, b.at(name))) {
      return ::testing::AssertionFailure()
             << name << " differs by " << (t - b.at(name)).abs().max().item<double>();
    }
  }
  return ::testing::AssertionSuccess();
}

// ---- One process, no FSDP ----

struct PairImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr};
  PairImpl() {
    a = register_module("a", torch::nn::Linear(4, 4));
    b = register_module("b", torch::nn::Linear(4, 4));
  }
  // Two tensor inputs, a non-tensor one, two outputs.
  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x, const torch::Tensor& y,
                                                   double scale) {
    auto h = torch::dropout(torch::tanh(a(x) + b(y)), 0.5, is_training());
    return {h * scale, (h * y).sum(-1)};
  }
};
TORCH_MODULE(Pair);

std::vector<torch::Tensor> grads_of(const std::vector<torch::Tensor>& ts) {
  std::vector<torch::Tensor> out;
  for (const auto& t : ts) out.push_back(t.grad().defined() ? t.grad().clone() : torch::Tensor());
  return out;
}

TEST(ActivationCheckpointing, SeveralInputsAndOutputsGiveTheSameGradientsAsWithout) {
  auto run = [](bool checkpointed, bool preserve_rng) {
    seed_cpu(3);
    Pair p;
    auto x = torch::randn({5, 4}, torch::requires_grad());
    auto y = torch::randn({5, 4});  // needs no gradient
    seed_cpu(11);
    std::tuple<torch::Tensor, torch::Tensor> out;
    if (checkpointed) {
      auto fn = [&p](const std::vector<torch::Tensor>& in) {
        auto [u, v] = p->forward(in[0], in[1], 2.5);
        return std::vector<torch::Tensor>{u, v};
      };
      auto o = fsdp::checkpoint_function(
          fn, {x, y}, p->parameters(), fsdp::CheckpointOptions().preserve_rng_state(preserve_rng));
      out = {o[0], o[1]};
    } else {
      out = p->forward(x, y, 2.5);
    }
    // A random draw between forward and backward: the recomputation must not see it, nor move
    // the generator the user sees afterwards.
    auto noise = torch::rand({3});
    ((std::get<0>(out) * 3).sum() + std::get<1>(out).pow(2).sum()).backward();
    auto after = torch::rand({3});
    std::vector<torch::Tensor> ts = p->parameters();
    ts.push_back(x);
    auto g = grads_of(ts);
    g.push_back(noise);
    g.push_back(after);
    EXPECT_FALSE(y.grad().defined());
    return g;
  };
  const auto plain = run(false, true);
  const auto ckpt = run(true, true);
  ASSERT_EQ(plain.size(), ckpt.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], ckpt[i])) << i;
  // Negative control: without the RNG state restored, dropout draws another mask.
  const auto unrestored = run(true, false);
  bool differs = false;
  for (size_t i = 0; i + 2 < plain.size(); ++i) differs |= !torch::equal(plain[i], unrestored[i]);
  EXPECT_TRUE(differs);
}

TEST(ActivationCheckpointing, ModuleFormRecomputesOnceInBackwardAndNeverWithoutGrad) {
  seed_cpu(5);
  DropBlock block(4, 16, 0.0);
  auto x = torch::randn({3, 4});  // data: only the parameters need gradients
  g_block_forwards = 0;
  auto y = fsdp::checkpoint_module(block, x);
  EXPECT_EQ(g_block_forwards.load(), 1);
  EXPECT_TRUE(y.requires_grad());  // the parameters inside do
  y.sum().backward();
  EXPECT_EQ(g_block_forwards.load(), 2);
  for (const auto& p : block->parameters()) EXPECT_TRUE(p.grad().defined());
  {
    torch::NoGradGuard no_grad;
    g_block_forwards = 0;
    auto z = fsdp::checkpoint_module(block, x);
    EXPECT_FALSE(z.requires_grad());
    EXPECT_EQ(g_block_forwards.load(), 1);
  }
  // Nothing requires grad: a plain call.
  for (auto& p : block->parameters()) p.set_requires_grad(false);
  g_block_forwards = 0;
  EXPECT_FALSE(fsdp::checkpoint_module(block, x).requires_grad());
  EXPECT_EQ(g_block_forwards.load(), 1);
}

TEST(ActivationCheckpointing, NestedAndRepeatedCallsMatchThePlainGradients) {
  auto run = [](int mode) {
    seed_cpu(9);
    DropBlock inner(4, 8, 0.3), outer(4, 8, 0.3);
    auto x = torch::randn({6, 4}, torch::requires_grad());
    seed_cpu(1);
    torch::Tensor y;
    if (mode == 0) {
      y = outer(inner(inner(x)));
    } else {
      // The outer region holds a checkpointed call of `inner`, used twice.
      auto fn = [&](const std::vector<torch::Tensor>& in) {
        auto h = fsdp::checkpoint_module(inner, in[0]);
        h = fsdp::checkpoint_module(inner, h);
        return std::vector<torch::Tensor>{outer(h)};
      };
      y = fsdp::checkpoint_function(fn, {x})[0];
    }
    y.pow(2).sum().backward();
    auto ps = inner->parameters();
    for (const auto& p : outer->parameters()) ps.push_back(p);
    ps.push_back(x);
    return grads_of(ps);
  };
  const auto plain = run(0), nested = run(1);
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], nested[i])) << i;
}

// CPU autocast (bfloat16) on for a scope, as torch.autocast("cpu") is.
class CpuAutocast {
 public:
  CpuAutocast() : was_(fsdp::compat::autocast_enabled(at::kCPU)) {
    fsdp::compat::set_autocast_dtype(at::kCPU, at::kBFloat16);
    fsdp::compat::set_autocast_enabled(at::kCPU, true);
    at::autocast::increment_nesting();
  }
  ~CpuAutocast() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    fsdp::compat::set_autocast_enabled(at::kCPU, was_);
  }

 private:
  bool was_;
};

// The recomputation runs with the autocast state of the forward, not of the backward: a forward
// under CPU autocast and a backward outside it give the plain run's gradients, which differ from
// those of a float32 forward (what a recomputation outside autocast would give).
TEST(ActivationCheckpointing, TheRecomputationHasTheForwardsAutocastState) {
  auto run = [](bool autocast, bool checkpointed) {
    seed_cpu(4);
    DropBlock block(8, 16, 0.0);
    auto x = torch::randn({4, 8}, torch::requires_grad());
    torch::Tensor y;
    {
      std::optional<CpuAutocast> on;
      if (autocast) on.emplace();
      y = checkpointed ? fsdp::checkpoint_module(block, x) : block(x);
    }
    EXPECT_FALSE(fsdp::compat::autocast_enabled(at::kCPU));
    y.to(at::kFloat).pow(2).sum().backward();
    auto g = grads_of(block->parameters());
    g.push_back(x.grad().clone());
    return g;
  };
  const auto plain = run(true, false), ckpt = run(true, true), fp32 = run(false, false);
  bool differs = false;
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_TRUE(torch::equal(plain[i], ckpt[i])) << i;
    differs |= !torch::equal(plain[i].to(at::kFloat), fp32[i]);
  }
  EXPECT_TRUE(differs);  // autocast did change the arithmetic
}

TEST(ActivationCheckpointing, AnInputModifiedBeforeBackwardIsAnError) {
  DropBlock block(4, 8, 0.0);
  auto x = torch::randn({2, 4}, torch::requires_grad());
  auto h = x * 2;
  auto y = fsdp::checkpoint_module(block, h);
  {
    torch::NoGradGuard no_grad;
    h.add_(1);
  }
  EXPECT_THROW(y.sum().backward(), c10::Error);
}

TEST(ActivationCheckpointing, PoliciesMarkModulesForFsdpForward) {
  Net net(1);
  // every_kth over the four DropBlocks in module order (blocks.0-2, mid): 0 and 2.
  std::vector<std::string> picked;
  auto policy = fsdp::every_kth(fsdp::checkpoint_module_types<DropBlockImpl>(), 2);
  EXPECT_EQ(fsdp::apply_activation_checkpointing(
                net,
                [&](const std::shared_ptr<torch::nn::Module>& m, const std::string& fqn) {
                  const bool yes = policy(m, fqn);
                  if (yes) picked.push_back(fqn);
                  return yes;
                }),
            2);
  EXPECT_EQ(picked, (std::vector<std::string>{"blocks.0", "blocks.2"}));
  auto idx = tokens(2, 3);
  g_block_forwards = 0;
  loss_of(net(idx), idx).backward();
  EXPECT_EQ(g_block_forwards.load(), 4 + 2);  // two of the four blocks ran again
  EXPECT_EQ(fsdp::clear_activation_checkpointing(net.ptr()), 2);
  g_block_forwards = 0;
  loss_of(net(idx), idx).backward();
  EXPECT_EQ(g_block_forwards.load(), 4);
  EXPECT_THROW(fsdp::every_kth(fsdp::checkpoint_module_types<DropBlockImpl>(), 0),
               fsdp::ValueError);
}

struct Opaque {
  torch::Tensor t;
};
struct OpaqueOutImpl : torch::nn::Module {
  Opaque forward(const torch::Tensor& x) { return {x * 2}; }
};
TORCH_MODULE(OpaqueOut);

TEST(ActivationCheckpointing, AMarkedModuleWhoseOutputCannotBeCheckpointedIsNamed) {
  auto parent = std::make_shared<torch::nn::Module>();
  OpaqueOut m;
  parent->register_module("opaque", m);
  fsdp::apply_activation_checkpointing(parent,
                                       [](const auto&, const std::string&) { return true; });
  auto x = torch::randn({2}, torch::requires_grad());
  try {
    fsdp::forward(m, x);
    ADD_FAILURE() << "no error";
  } catch (const fsdp::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("is marked for checkpointing"), std::string::npos);
  }
  fsdp::clear_activation_checkpointing(parent);
}

// ---- Under FSDP ----
// A suite of its own, so that ctest runs it in a process of its own: LibTorch 2.x refuses to run
// autograd in a child forked after the parent ran a backward (the suite above does).

TEST(FsdpActivationCheckpointing, TrainingIsBitIdenticalWithAndWithoutAtEveryWorldAndStrategy) {
  for (int world = 1; world <= 4; ++world) {
    run_ranks(world, [world](ProcessGroup& pg) {
      for (auto s : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP,
                     ShardingStrategy::NO_SHARD, ShardingStrategy::HYBRID_SHARD,
                     ShardingStrategy::HYBRID_SHARD_ZERO2}) {
        TrainCase c;
        c.world = world;
        c.strategy = s;
        c.use_orig_params = world == 3;
        SCOPED_TRACE(std::string(fsdp::to_string(s)) + " W=" + std::to_string(world));
        const auto plain = train(pg, c, Ckpt::kNone);
        EXPECT_TRUE(same_params(plain, train(pg, c, Ckpt::kUnitsAndMid)));
      }
    });
  }
}

TEST(FsdpActivationCheckpointing,
     MixedPrecisionNoSyncOffloadAndPrefetchAreBitIdenticalAndTheRngControlFails) {
  run_ranks(2, [](ProcessGroup& pg) {
    TrainCase c;
    c.bf16 = true;
    c.no_sync = true;
    const auto plain = train(pg, c, Ckpt::kNone);
    EXPECT_TRUE(same_params(plain, train(pg, c, Ckpt::kUnits)));
    EXPECT_TRUE(same_params(plain, train(pg, c, Ckpt::kUnitsAndMid)));
    // Negative control: dropout's masks drawn afresh in the recomputation.
    c.preserve_rng = false;
    EXPECT_FALSE(same_params(plain, train(pg, c, Ckpt::kUnitsAndMid)));
    TrainCase o;
    o.offload_and_prefetch = true;
    EXPECT_TRUE(same_params(train(pg, o, Ckpt::kNone), train(pg, o, Ckpt::kUnitsAndMid)));
  });
}

std::atomic<int> g_all_gathers{0};
void count_all_gathers(const char* what) {
  if (std::strstr(what, "all_gather") != nullptr) ++g_all_gathers;
}

// One training step's forward and backward; the all-gathers it issued. Also zeroes the count of
// blocks' forwards.
int step_all_gathers(FullyShardedDataParallel& model, const torch::Tensor& idx) {
  g_all_gathers = 0;
  g_block_forwards = 0;
  fsdp::dist::detail::set_fault_hook(count_all_gathers);
  loss_of(model->forward(idx), idx).backward();
  fsdp::dist::detail::set_fault_hook(nullptr);
  return g_all_gathers.load();
}

// A FULL_SHARD unit is all-gathered in forward and once in backward, checkpointed or not: the
// recomputation uses backward's unshard. The root is gathered once (kept for backward).
TEST(FsdpActivationCheckpointing, FullShardGathersEachCheckpointedUnitTwicePerStep) {
  run_ranks(2, [](ProcessGroup& pg) {
    for (const Ckpt ckpt : {Ckpt::kNone, Ckpt::kUnits, Ckpt::kUnitsAndMid}) {
      Net net(7);
      std::vector<std::shared_ptr<torch::nn::Module>> units;
      for (size_t i = 0; i < net->blocks->size(); ++i) units.push_back(net->blocks[i]);
      FullyShardedDataParallel model(net, FullyShardedOptions().units(units));
      if (ckpt != Ckpt::kNone)
        fsdp::apply_activation_checkpointing(model, fsdp::checkpoint_units());
      if (ckpt == Ckpt::kUnitsAndMid) {
        fsdp::apply_activation_checkpointing(
            net, [&](const auto& m, const std::string&) { return m == net->mid.ptr(); });
      }
      for (int step = 0; step < 2; ++step) {
        auto idx = tokens(2, static_cast<uint64_t>(step + pg.rank()));
        EXPECT_EQ(step_all_gathers(model, idx), 2 * NetImpl::kBlocks + 1) << "step " << step;
        // The recomputations did happen: each checkpointed block ran twice.
        const int recomputed = ckpt == Ckpt::kNone ? 0 : ckpt == Ckpt::kUnits ? 3 : 4;
        EXPECT_EQ(g_block_forwards.load(), 4 + recomputed);
      }
      fsdp::clear_activation_checkpointing(model.ptr());
    }
  });
}

// A checkpointed region holding whole units (the blocks run inside one checkpointed call made by
// the root's module): each nested unit is unsharded once in backward, at its recomputation, and
// kept for its backward: still two all-gathers a unit, and the same weights.
TEST(FsdpActivationCheckpointing, UnitsInsideACheckpointedRegionAreGatheredOnceInBackward) {
  run_ranks(2, [](ProcessGroup& pg) {
    auto run = [&](bool region) {
      Net net(7);
      net->one_region = region;
      FullyShardedDataParallel model(net, FullyShardedOptions().units(block_units(net)));
      torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.5));
      seed_cpu(50 + static_cast<uint64_t>(pg.rank()));
      for (int step = 0; step < 2; ++step) {
        sgd.zero_grad();
        auto idx = tokens(2, static_cast<uint64_t>(step + 3 * pg.rank()));
        EXPECT_EQ(step_all_gathers(model, idx), 2 * NetImpl::kBlocks + 1) << "step " << step;
        EXPECT_EQ(g_block_forwards.load(), region ? 8 : 4);
        for (auto* h : model->handles()) {
          if (h != nullptr) {
            EXPECT_EQ(h->unsharded_storage_bytes(), 0);
          }
        }
        sgd.step();
      }
      return fsdp::testing::full_params(model);
    };
    const auto plain = run(false);
    EXPECT_TRUE(same_params(plain, run(true)));
  });
}

}  // namespace
