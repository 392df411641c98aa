// Optimizer state dicts (issue 9; PyTorch's torch/distributed/fsdp/_optim_utils.py): FULL dicts of
// a wrapped model equal the single-process optimizer's, SHARDED dicts reshard across world sizes,
// strategies and use_orig_params and resume training, errors on one rank fail every rank and change
// nothing.
#include <gtest/gtest.h>

#include "fsdp/errors.h"
#include "fsdp/optim_state_dict.h"
#include "multi_rank.h"
#include "optim_testing.h"
#include "state_dict_testing.h"
#include "tiny_lm.h"

using fsdp::FullyShardedDataParallel;
using fsdp::ShardingStrategy;
using fsdp::StateDict;
using fsdp::StateDictType;
using fsdp::StateList;
using fsdp::StateValue;
using fsdp::dist::ProcessGroup;
using fsdp::testing::lm_loss;
using fsdp::testing::lm_options;
using fsdp::testing::lm_tokens;
using fsdp::testing::make_optimizer;
using fsdp::testing::osd_diff;
using fsdp::testing::run_ranks;
using fsdp::testing::TinyLM;
using fsdp::testing::unique_params;

namespace {

// FSDP's reduce-scatter sums the ranks' gradients in another order than the single process, so
// states drift by float rounding. Most optimizers drift below 1e-7 here; centered RMSprop divides
// by a difference of small numbers and drifts up to ~1e-5 at W=3. The bound: 1e-5 relative plus
// an absolute part of 2e-6, or, where larger, 4x the drift of hand-written data parallelism
// (all-reduced gradients, full optimizer on every rank) measured in the same run. The negative
// controls check that a state off by 1e-4 in one element fails the comparison.
constexpr double kRtol = 1e-5, kAtol = 2e-6;
constexpr int kSteps = 3;

// One data-parallel step of the global batch: rank r's micro-batch at step s is
// lm_tokens(2, 1000 s + r), and FSDP averages over ranks. The single process does the same sum.
void ref_step(TinyLM& ref, torch::optim::Optimizer& opt, int step, int world) {
  opt.zero_grad();
  for (int r = 0; r < world; ++r) {
    auto idx = lm_tokens(2, 1000 * step + r);
    (lm_loss(ref->forward(idx), idx) / world).backward();
  }
  opt.step();
}

void fsdp_step(FullyShardedDataParallel& model, torch::optim::Optimizer& opt, int step, int rank) {
  opt.zero_grad();
  auto idx = lm_tokens(2, 1000 * step + rank);
  lm_loss(model->forward(idx).to(at::kFloat), idx).backward();
  opt.step();
}

// Hand-written data parallelism: the full model and optimizer on every rank, gradients
// all-reduced and averaged. Its distance from the single process is the baseline drift.
void dp_step(TinyLM& model, torch::optim::Optimizer& opt, int step, ProcessGroup& pg) {
  opt.zero_grad();
  auto idx = lm_tokens(2, 1000 * step + pg.rank());
  lm_loss(model->forward(idx), idx).backward();
  for (auto& p : unique_params(model->parameters())) {
    if (!p.grad().defined()) continue;
    pg.all_reduce(p.grad());
    p.grad().div_(pg.size());
  }
  opt.step();
}

// `osd` with one thing changed that a correct comparison must notice.
StateDict perturbed(const StateDict& osd, double delta) {
  StateDict out = osd;
  StateDict& state = out.at("state").dict();
  for (auto& [fqn, v] : state) {
    StateDict d = v.dict();
    for (auto& [name, x] : d) {
      if (name == "step" || x.tensor().numel() == 0) continue;
      at::Tensor t = x.tensor().clone();
      t.view(-1)[0] += delta;
      d.insert_or_assign(name, t);
      state.insert_or_assign(fqn, d);
      return out;
    }
  }
  StateDict g = out.at("param_groups").list()[0].dict();  // no tensor state (plain SGD)
  g.insert_or_assign("lr", g.at("lr").to_double() * 1.001);
  out.at("param_groups").list()[0] = g;
  return out;
}

struct OsdCase {
  std::string kind;
  bool orig;
  int world;
};

class FullOsdWorld : public ::testing::TestWithParam<OsdCase> {};

// FULL dicts at W=1-4 equal the unwrapped optimizer's for the same training: same FQNs (the
// tied embedding once, as tok.weight; the frozen projection absent), names, kinds, steps,
// hyperparameters, and values within the data-parallel drift.
TEST_P(FullOsdWorld, EqualsTheSingleProcessOptimizer) {
  const OsdCase c = GetParam();
  run_ranks(c.world, [c](ProcessGroup& pg) {
    TinyLM ref(7);
    auto ref_opt = make_optimizer(c.kind, unique_params(ref->parameters()));
    TinyLM dp(7);
    auto dp_opt = make_optimizer(c.kind, unique_params(dp->parameters()));
    TinyLM m(7);
    FullyShardedDataParallel model(m, lm_options(m, ShardingStrategy::FULL_SHARD, c.orig));
    auto opt = make_optimizer(c.kind, unique_params(model->parameters()));
    for (int s = 0; s < kSteps; ++s) {
      ref_step(ref, *ref_opt, s, pg.size());
      dp_step(dp, *dp_opt, s, pg);
      fsdp_step(model, *opt, s, pg.rank());
    }
    const StateDict want = fsdp::optim_state_dict(*ref, *ref_opt);
    // The reference dict itself against torch::optim's own state objects, read without the
    // export's code (a shared mistake would otherwise pass both sides).
    EXPECT_EQ(
        fsdp::testing::raw_state_diff(want, fsdp::testing::raw_optim_state(*ref, *ref_opt), 0, 0),
        "");
    double dp_drift = 0;
    ASSERT_EQ(osd_diff(fsdp::optim_state_dict(*dp, *dp_opt), want, 1, 1, &dp_drift), "");
    const double atol = std::max(kAtol, 4 * dp_drift);
    const StateDict got = fsdp::optim_state_dict(model, *opt);
    double worst = 0;
    EXPECT_EQ(osd_diff(got, want, kRtol, atol, &worst), "") << c.kind;
    EXPECT_NE(osd_diff(got, perturbed(want, 1e-4 + 10 * atol), kRtol, atol), "")
        << "the comparison cannot fail";
    // The wrapped export against the unwrapped optimizer's own state, independently.
    EXPECT_EQ(fsdp::testing::raw_state_diff(got, fsdp::testing::raw_optim_state(*ref, *ref_opt),
                                            kRtol, atol),
              "")
        << c.kind;
    if (!want.at("state").dict().empty()) {  // negative control: one state left out is seen
      StateDict one_key = want;
      one_key.at("state").dict().erase(one_key.at("state").dict().keys().back());
      EXPECT_NE(fsdp::testing::raw_state_diff(one_key,
                                              fsdp::testing::raw_optim_state(*ref, *ref_opt), 0, 0),
                "");
    }
    EXPECT_FALSE(got.at("state").dict().contains("head.weight")) << "tied: once, as tok.weight";
    // Frozen parameters have no state, except under Adagrad, which creates every parameter's
    // state when it is constructed (PyTorch's does too).
    EXPECT_EQ(got.at("state").dict().contains("frozen.weight"), c.kind == "Adagrad");
    if (c.kind != "SGD") {
      EXPECT_TRUE(got.at("state").dict().contains("tok.weight"));
    }
    if (pg.rank() == 0) {
      std::printf(
          "largest difference from the single process: FSDP %.3g, hand-written data "
          "parallelism %.3g\n",
          worst, dp_drift);
    }
  });
}

std::vector<OsdCase> full_cases() {
  std::vector<OsdCase> out;
  for (const auto& k : fsdp::testing::optimizer_kinds())
    for (bool orig : {false, true})
      for (int w = 1; w <= 4; ++w) out.push_back({k, orig, w});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Optimizers, FullOsdWorld, ::testing::ValuesIn(full_cases()),
                         [](const auto& info) {
                           return info.param.kind + (info.param.orig ? "_orig" : "_flat") + "_W" +
                                  std::to_string(info.param.world);
                         });

// Full parameter values of a wrapped model and of a plain one agree within the drift.
void expect_params_close(FullyShardedDataParallel& model, TinyLM& ref) {
  const auto got = fsdp::testing::full_params(model);
  for (const auto& p : ref->named_parameters()) {
    EXPECT_TRUE(torch::allclose(got.at(p.key()), p.value(), kRtol, kAtol)) << p.key();
  }
}

// The acceptance scenario: SHARDED model + optimizer state saved at W=2 (FULL_SHARD, flat
// parameters), loaded at W=3 (SHARD_GRAD_OP, original parameters) and into an unwrapped model;
// training goes on as if never interrupted.
TEST(OptimStateDict, ShardedAtTwoResumesAtThreeAndUnwrapped) {
  fsdp::testing::TempDir tmp;
  const std::string dir = tmp.path();
  constexpr int kBefore = 2, kAfter = 2;
  run_ranks(2, [&dir](ProcessGroup& pg) {
    TinyLM m(7);
    FullyShardedDataParallel model(m, lm_options(m, ShardingStrategy::FULL_SHARD, false));
    auto opt = make_optimizer("Adam", unique_params(model->parameters()));
    for (int s = 0; s < kBefore; ++s) fsdp_step(model, *opt, s, pg.rank());
    fsdp::StateDictTypeGuard g(model, StateDictType::SHARDED_STATE_DICT,
                               fsdp::ShardedStateDictConfig(), fsdp::ShardedOptimStateDictConfig());
    fsdp::testing::save_pieces(fsdp::state_dict(model), pg.rank(), dir, "model_");
    const StateDict osd = fsdp::optim_state_dict(model, *opt);
    for (const auto& [fqn, v] : osd.at("state").dict()) {
      EXPECT_TRUE(v.dict().at("step").is_tensor()) << fqn;
      EXPECT_TRUE(v.dict().at("exp_avg").is_sharded_tensor()) << fqn;
    }
    fsdp::testing::save_osd(osd, pg.rank(), dir);
  });
  // The same training, uninterrupted, in one process.
  auto reference = [](int world_after) {
    TinyLM ref(7);
    auto opt = make_optimizer("Adam", unique_params(ref->parameters()));
    for (int s = 0; s < kBefore + kAfter; ++s)
      ref_step(ref, *opt, s, s < kBefore ? 2 : world_after);
    return std::make_pair(ref, std::move(opt));
  };
  run_ranks(3, [&dir, &reference](ProcessGroup& pg) {
    TinyLM m(99);  // other initial values, other hyperparameters: the load must replace both
    FullyShardedDataParallel model(m, lm_options(m, ShardingStrategy::SHARD_GRAD_OP, true));
    auto opt = make_optimizer("Adam", unique_params(model->parameters()));
    static_cast<torch::optim::AdamOptions&>(opt->param_groups()[0].options()).lr(0.5);
    {
      fsdp::StateDictTypeGuard g(model, StateDictType::SHARDED_STATE_DICT);
      fsdp::load_state_dict(model, fsdp::testing::load_pieces(2, dir, "model_"));
      fsdp::load_optim_state_dict(model, *opt, fsdp::testing::load_osd(2, dir));
    }
    EXPECT_DOUBLE_EQ(opt->param_groups()[0].options().get_lr(), 0.01);
    for (int s = kBefore; s < kBefore + kAfter; ++s) fsdp_step(model, *opt, s, pg.rank());
    auto [ref, ref_opt] = reference(3);
    expect_params_close(model, ref);
    EXPECT_EQ(osd_diff(fsdp::optim_state_dict(model, *opt), fsdp::optim_state_dict(*ref, *ref_opt),
                       kRtol, kAtol),
              "");
  });
  // Unwrapped, single process: the pieces of both saved ranks cover every tensor. (In a child:
  // LibTorch 2.x refuses autograd in processes forked after the parent used it.)
  run_ranks(1, [&dir, &reference](ProcessGroup&) {
    TinyLM m(99);
    {
      const StateDict saved = fsdp::testing::load_pieces(2, dir, "model_");
      at::NoGradGuard no_grad;
      for (auto& [k, v] : fsdp::module_state_dict(*m)) {
        const StateValue& s = saved.at(k);
        if (s.is_tensor()) {
          v.tensor().copy_(s.tensor());
        } else {
          at::Tensor t = v.tensor();
          s.sharded_tensor().copy_into(t);
        }
      }
    }
    auto opt = make_optimizer("Adam", unique_params(m->parameters()));
    fsdp::load_optim_state_dict(*m, *opt, fsdp::testing::load_osd(2, dir));
    for (int s = kBefore; s < kBefore + kAfter; ++s) ref_step(m, *opt, s, 1);
    auto [ref, ref_opt] = reference(1);
    for (const auto& p : ref->named_parameters()) {
      EXPECT_TRUE(torch::allclose(m->named_parameters()[p.key()], p.value(), kRtol, kAtol))
          << p.key();
    }
    // Negative control: without the optimizer state, resuming gives other parameters.
    TinyLM fresh(7);
    auto fresh_opt = make_optimizer("Adam", unique_params(fresh->parameters()));
    for (int s = 0; s < kBefore; ++s) ref_step(fresh, *fresh_opt, s, 2);
    fresh_opt = make_optimizer("Adam", unique_params(fresh->parameters()));  // state lost
    for (int s = kBefore; s < kBefore + kAfter; ++s) ref_step(fresh, *fresh_opt, s, 1);
    bool all_close = true;
    for (const auto& p : ref->named_parameters()) {
      all_close &= torch::allclose(fresh->named_parameters()[p.key()], p.value(), kRtol, kAtol);
    }
    EXPECT_FALSE(all_close) << "losing the optimizer state must show";
  });
}

// SHARDED export and import at the same world size give back the same state bit for bit, under
// every strategy (NO_SHARD falls back to FULL), with mixed precision and CPU offload.
struct RoundTrip {
  ShardingStrategy strategy;
  bool orig;
  bool mixed;
};
class ShardedOsdRoundTrip : public ::testing::TestWithParam<RoundTrip> {};

TEST_P(ShardedOsdRoundTrip, ReloadsBitExactly) {
  const RoundTrip c = GetParam();
  run_ranks(4, [c](ProcessGroup& pg) {
    auto options = [&](TinyLM& m) {
      auto o = lm_options(m, c.strategy, c.orig).hybrid_shard_size(2);
      if (c.mixed) {
        o.mixed_precision(
            fsdp::MixedPrecision().param_dtype(at::kBFloat16).buffer_dtype(at::kBFloat16));
        o.cpu_offload(fsdp::CPUOffload().offload_params(true));
      }
      return o;
    };
    TinyLM m(7);
    FullyShardedDataParallel model(m, options(m));
    auto opt = make_optimizer("AdamW_amsgrad", unique_params(model->parameters()));
    for (int s = 0; s < 2; ++s) fsdp_step(model, *opt, s, pg.rank());
    const StateDict full = fsdp::optim_state_dict(model, *opt);
    for (const auto& [fqn, v] : full.at("state").dict()) {
      EXPECT_EQ(v.dict().at("exp_avg").tensor().scalar_type(), at::kFloat)
          << fqn << ": state stays in the parameters' dtype";
    }
    for (auto layout : {fsdp::ShardLayout::DIM0_CHUNKS, fsdp::ShardLayout::FLAT_SHARDS}) {
      StateDict sharded;
      {
        fsdp::StateDictTypeGuard g(model, StateDictType::SHARDED_STATE_DICT,
                                   fsdp::ShardedStateDictConfig(),
                                   fsdp::ShardedOptimStateDictConfig().layout(layout));
        sharded = fsdp::optim_state_dict(model, *opt);
      }
      TinyLM m2(8);
      FullyShardedDataParallel model2(m2, options(m2));
      auto opt2 = make_optimizer("AdamW_amsgrad", unique_params(model2->parameters()));
      {
        fsdp::StateDictTypeGuard g(model2, StateDictType::SHARDED_STATE_DICT);
        fsdp::load_optim_state_dict(model2, *opt2, sharded);
      }
      EXPECT_EQ(osd_diff(fsdp::optim_state_dict(model2, *opt2), full, 0, 0), "")
          << "layout " << static_cast<int>(layout);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Strategies, ShardedOsdRoundTrip,
                         ::testing::Values(RoundTrip{ShardingStrategy::FULL_SHARD, false, false},
                                           RoundTrip{ShardingStrategy::FULL_SHARD, true, true},
                                           RoundTrip{ShardingStrategy::SHARD_GRAD_OP, true, false},
                                           RoundTrip{ShardingStrategy::NO_SHARD, false, false},
                                           RoundTrip{ShardingStrategy::NO_SHARD, true, false},
                                           RoundTrip{ShardingStrategy::HYBRID_SHARD, false, true},
                                           RoundTrip{ShardingStrategy::HYBRID_SHARD_ZERO2, true,
                                                     false}),
                         [](const auto& info) {
                           return std::string(fsdp::to_string(info.param.strategy)) +
                                  (info.param.orig ? "_orig" : "_flat") +
                                  (info.param.mixed ? "_mixed_offload" : "");
                         });

// Odd layouts: a 0-d parameter, an empty one, a 3-D one, sizes not divisible by the world size,
// and (with use_orig_params) a frozen bias in a trainable unit.
struct OddImpl : torch::nn::Module {
  torch::Tensor scalar, empty, cube, seven;
  torch::nn::Linear lin{nullptr};
  explicit OddImpl(bool freeze_bias) {
    fsdp::testing::seed_cpu(5);
    scalar = register_parameter("scalar", torch::randn({}));
    empty = register_parameter("empty", torch::empty({0, 3}));
    cube = register_parameter("cube", torch::randn({3, 2, 5}));
    seven = register_parameter("seven", torch::randn({7}));
    lin = register_module("lin", torch::nn::Linear(5, 3));
    if (freeze_bias) lin->bias.set_requires_grad(false);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = fsdp::forward(lin, x).pow(2).mean() * scalar.exp();
    return y + (cube.sum(0) * x.narrow(1, 0, 2).mean()).pow(2).sum() +
           seven.pow(2).sum() * x.abs().mean() + empty.sum();
  }
};
TORCH_MODULE(Odd);

TEST(OptimStateDict, OddLayoutsAtEveryWorldSize) {
  for (bool orig : {false, true}) {
    for (int world = 1; world <= 4; ++world) {
      run_ranks(world, [orig](ProcessGroup& pg) {
        auto batch = [&](int step, int r) {
          return fsdp::testing::seeded_randn({2, 5}, 77 * step + r);
        };
        Odd ref(orig);
        torch::optim::Adam ref_opt(unique_params(ref->parameters()),
                                   torch::optim::AdamOptions(0.01).eps(1e-3));
        Odd m(orig);
        FullyShardedDataParallel model(
            m, fsdp::FullyShardedOptions().units({m->lin.ptr()}).use_orig_params(orig));
        torch::optim::Adam opt(unique_params(model->parameters()),
                               torch::optim::AdamOptions(0.01).eps(1e-3));
        for (int s = 0; s < 3; ++s) {
          ref_opt.zero_grad();
          for (int r = 0; r < pg.size(); ++r) (ref->forward(batch(s, r)) / pg.size()).backward();
          ref_opt.step();
          opt.zero_grad();
          model->forward(batch(s, pg.rank())).backward();
          opt.step();
        }
        const StateDict full = fsdp::optim_state_dict(model, opt);
        EXPECT_EQ(osd_diff(full, fsdp::optim_state_dict(*ref, ref_opt), kRtol, kAtol), "")
            << "W" << pg.size() << (orig ? " orig" : " flat");
        for (auto layout : {fsdp::ShardLayout::DIM0_CHUNKS, fsdp::ShardLayout::FLAT_SHARDS}) {
          const bool flat = layout == fsdp::ShardLayout::FLAT_SHARDS;
          StateDict sharded;
          {
            fsdp::StateDictTypeGuard g(model, StateDictType::SHARDED_STATE_DICT,
                                       fsdp::ShardedStateDictConfig(),
                                       fsdp::ShardedOptimStateDictConfig().layout(layout));
            sharded = fsdp::optim_state_dict(model, opt);
          }
          const StateDict& st = sharded.at("state").dict();
          // DIM0_CHUNKS keeps 0-d state plain (as PyTorch); FLAT_SHARDS leaves it with the one
          // rank whose shard holds it.
          EXPECT_EQ(st.at("scalar").dict().at("exp_avg").is_sharded_tensor(), flat);
          EXPECT_TRUE(st.at("cube").dict().at("exp_avg").is_sharded_tensor());
          Odd m2(orig);
          FullyShardedDataParallel model2(
              m2, fsdp::FullyShardedOptions().units({m2->lin.ptr()}).use_orig_params(orig));
          torch::optim::Adam opt2(unique_params(model2->parameters()),
                                  torch::optim::AdamOptions(1));
          {
            fsdp::StateDictTypeGuard g(model2, StateDictType::SHARDED_STATE_DICT);
            fsdp::load_optim_state_dict(model2, opt2, sharded);
          }
          EXPECT_EQ(osd_diff(fsdp::optim_state_dict(model2, opt2), full, 0, 0), "")
              << "layout " << static_cast<int>(layout);
        }
      });
    }
  }
}

// Several param groups with their own hyperparameters, one unit's parameters split between them
// (use_orig_params), and a parameter frozen inside a trainable unit.
TEST(OptimStateDict, ParamGroupsSplitWithinAUnitAndFrozenParameters) {
  run_ranks(2, [](ProcessGroup& pg) {
    auto groups_of = [](torch::nn::Module& root) {
      std::vector<at::Tensor> fc1, rest;
      for (const auto& p : root.named_parameters()) {
        if (p.key() == "head.weight" || p.key().rfind("frozen", 0) == 0) continue;
        (p.key().find("fc1") != std::string::npos ? fc1 : rest).push_back(p.value());
      }
      std::vector<torch::optim::OptimizerParamGroup> g;
      g.emplace_back(fc1, std::make_unique<torch::optim::AdamOptions>(0.02));
      g.emplace_back(rest, std::make_unique<torch::optim::AdamOptions>(0.005));
      return g;
    };
    TinyLM ref(7);
    ref->blocks->ptr<fsdp::testing::BlockImpl>(1)->fc2->bias.set_requires_grad(false);
    torch::optim::Adam ref_opt(groups_of(*ref), torch::optim::AdamOptions(0.01));
    TinyLM m(7);
    m->blocks->ptr<fsdp::testing::BlockImpl>(1)->fc2->bias.set_requires_grad(false);
    FullyShardedDataParallel model(m, lm_options(m, ShardingStrategy::FULL_SHARD, true));
    torch::optim::Adam opt(groups_of(*model->module()), torch::optim::AdamOptions(0.01));
    for (int s = 0; s < 2; ++s) {
      ref_step(ref, ref_opt, s, pg.size());
      fsdp_step(model, opt, s, pg.rank());
    }
    const StateDict got = fsdp::optim_state_dict(model, opt);
    EXPECT_EQ(osd_diff(got, fsdp::optim_state_dict(*ref, ref_opt), kRtol, kAtol), "");
    EXPECT_FALSE(got.at("state").dict().contains("blocks.1.fc2.bias")) << "frozen: no state";
    EXPECT_DOUBLE_EQ(got.at("param_groups").list()[0].dict().at("lr").to_double(), 0.02);
    // Into a model whose groups hold the same parameters: loads; state and lr come back.
    TinyLM m2(3);
    m2->blocks->ptr<fsdp::testing::BlockImpl>(1)->fc2->bias.set_requires_grad(false);
    FullyShardedDataParallel model2(m2, lm_options(m2, ShardingStrategy::FULL_SHARD, true));
    torch::optim::Adam opt2(groups_of(*model2->module()), torch::optim::AdamOptions(0.01));
    static_cast<torch::optim::AdamOptions&>(opt2.param_groups()[1].options()).lr(1.0);
    fsdp::load_optim_state_dict(model2, opt2, got);
    EXPECT_EQ(osd_diff(fsdp::optim_state_dict(model2, opt2), got, 0, 0), "");
  });
}

// Peak memory of a FULL export with offload: the gathers in flight hold at most the gather window
// (one unit's state tensor at a time with a window of 0), small state tensors are gathered
// together, and every window gives the same state, bit for bit.
TEST(OptimStateDict, FullExportHoldsAtMostItsGatherWindow) {
  for (int world : {2, 3}) {
    run_ranks(world, [](ProcessGroup& pg) {
      TinyLM m(7);
      FullyShardedDataParallel model(m, lm_options(m, ShardingStrategy::FULL_SHARD, true));
      auto opt = make_optimizer("Adam", unique_params(model->parameters()));
      fsdp_step(model, *opt, 0, pg.rank());
      int64_t largest_unit = 0, all_units = 0;
      for (auto* h : model->handles()) {
        largest_unit = std::max(largest_unit, h->layout().padded_unsharded_numel);
        all_units += h->layout().padded_unsharded_numel;
      }
      int64_t peak = 0, calls = 0;
      auto probe = [&](int64_t bytes) {
        peak = std::max(peak, bytes);
        ++calls;
      };
      auto full_export = [&](int64_t window) {
        peak = 0;
        calls = 0;
        fsdp::StateDictTypeGuard g(model, StateDictType::FULL_STATE_DICT,
                                   fsdp::FullStateDictConfig(),
                                   fsdp::FullOptimStateDictConfig()
                                       .offload_to_cpu(true)
                                       .gather_window_bytes(window)
                                       .on_gather(probe));
        return fsdp::optim_state_dict(model, *opt);
      };
      const int64_t default_window = fsdp::FullOptimStateDictConfig().gather_window_bytes();
      const StateDict one_at_a_time = full_export(0);
      const int64_t peak_one = peak, calls_one = calls;
      {  // SHARDED routes pieces of the flat shards to the chunks: no unit is ever gathered.
        calls = 0;
        fsdp::StateDictTypeGuard g(model, StateDictType::SHARDED_STATE_DICT,
                                   fsdp::ShardedStateDictConfig(),
                                   fsdp::ShardedOptimStateDictConfig().on_gather(probe));
        const StateDict osd = fsdp::optim_state_dict(model, *opt);
        EXPECT_EQ(calls, 0);
      }
      // A window of two blocks' state tensors (a block's is about 1 KB gathered), and the default.
      for (int64_t window : {int64_t{2000}, default_window}) {
        const StateDict got = full_export(window);
        EXPECT_EQ(osd_diff(got, one_at_a_time, 0, 0), "") << "window " << window;
        EXPECT_LT(calls, calls_one) << "window " << window << ": nothing gathered together";
        // The window, plus the gather that was started last (input, output, and a bucket's
        // copies out: at most 2.5x a bucket's gathered bytes).
        EXPECT_LE(peak, window + 3 * std::max(largest_unit * 4, std::min<int64_t>(window, 4 << 20)))
            << "window " << window;
      }
      EXPECT_GT(calls_one, 0);
      // One unsharded flat state tensor of the largest unit, plus the shard it is assembled in.
      EXPECT_LE(peak_one, (largest_unit + largest_unit / pg.size()) * 4);
      // All state of all units at once would be far more (two state tensors per unit).
      EXPECT_LT(peak_one, 2 * all_units * 4);
      if (pg.rank() == 0) {
        std::printf(
            "W=%d: one at a time: %lld gathers, peak %lld bytes; one unit's unsharded state "
            "tensor %lld; all units' state %lld\n",
            pg.size(), static_cast<long long>(calls_one), static_cast<long long>(peak_one),
            static_cast<long long>(largest_unit * 4), static_cast<long long>(2 * all_units * 4));
      }
    });
  }
}

// A unit whose flat parameter and state tensors are over 1 MiB gathered goes through the gather
// queue alone, pairwise on Gloo, where a window of 0 gathers it with Gloo's own all-gather: both
// give the same FULL model and optimizer state, bit for bit, and the model's is what
// summon_full_params shows (365407 parameters: padded at W=2 and W=3).
TEST(OptimStateDict, FullExportOfAUnitOverOneMiBIsExact) {
  for (int world : {2, 3}) {
    run_ranks(world, [](ProcessGroup& pg) {
      torch::manual_seed(5);
      auto m = torch::nn::Sequential(torch::nn::Linear(600, 600), torch::nn::Tanh(),
                                     torch::nn::Linear(600, 7));
      FullyShardedDataParallel model(m, fsdp::FullyShardedOptions().process_group(pg));
      ASSERT_GE(model->handles().at(0)->layout().padded_unsharded_numel * 4, int64_t{1} << 20);
      torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
      const at::Tensor x = fsdp::testing::seeded_randn({4, 600}, 60 + pg.rank());
      model->forward(x).pow(2).mean().backward();
      opt.step();
      auto full = [&](int64_t window) {
        fsdp::StateDictTypeGuard g(model, StateDictType::FULL_STATE_DICT,
                                   fsdp::FullStateDictConfig().gather_window_bytes(window),
                                   fsdp::FullOptimStateDictConfig().gather_window_bytes(window));
        return std::make_pair(fsdp::state_dict(model), fsdp::optim_state_dict(model, opt));
      };
      const auto [msd0, osd0] = full(0);
      const auto [msd, osd] = full(fsdp::kDefaultGatherWindowBytes);
      fsdp::testing::expect_same(msd, msd0, "model, default window vs 0");
      EXPECT_EQ(osd_diff(osd, osd0, 0, 0), "");
      EXPECT_GT(osd.at("state").dict().size(), 0u);
      fsdp::SummonFullParamsGuard summon(model, /*writeback=*/false);
      for (const auto& item : model->module()->named_parameters())
        EXPECT_TRUE(at::equal(msd.at(item.key()).tensor(), item.value())) << item.key();
    });
  }
}

// rank0_only: rank 0 gets the dict, the others an empty one.
TEST(OptimStateDict, Rank0OnlyLeavesOtherRanksEmpty) {
  run_ranks(3, [](ProcessGroup& pg) {
    TinyLM m(7);
    FullyShardedDataParallel model(m, lm_options(m));
    auto opt = make_optimizer("Adam", unique_params(model->parameters()));
    fsdp_step(model, *opt, 0, pg.rank());
    fsdp::StateDictTypeGuard g(model, StateDictType::FULL_STATE_DICT, fsdp::FullStateDictConfig(),
                               fsdp::FullOptimStateDictConfig().rank0_only(true));
    const StateDict osd = fsdp::optim_state_dict(model, *opt);
    EXPECT_EQ(osd.empty(), pg.rank() != 0);
  });
}

// Each malformed dict, handed to one rank only, makes every rank raise a ValueError naming the
// problem, and leaves every rank's optimizer as it was.
TEST(OptimStateDict, ErrorsOnOneRankFailEveryRankAndChangeNothing) {
  using Edit = std::function<void(StateDict&)>;
  auto state_of = [](StateDict& osd, const std::string& fqn) -> StateDict& {
    return osd.at("state").dict().at(fqn).dict();
  };
  const std::vector<std::pair<std::string, Edit>> cases{
      {"unknown FQN 'blocks.9.fc1.weight'",
       [&](StateDict& o) {
         o.at("state").dict().insert_or_assign("blocks.9.fc1.weight",
                                               o.at("state").dict().at("tok.weight"));
       }},
      {"missing state 'exp_avg_sq' for 'blocks.0.fc1.weight'",
       [&](StateDict& o) { state_of(o, "blocks.0.fc1.weight").erase("exp_avg_sq"); }},
      {"unexpected state 'momentum_buffer' for 'blocks.0.fc2.bias'",
       [&](StateDict& o) {
         auto& s = state_of(o, "blocks.0.fc2.bias");
         s.insert_or_assign("momentum_buffer", s.at("exp_avg"));
       }},
      {"state 'exp_avg' of 'blocks.2.fc1.weight' has shape [13, 7], the parameter [13, 8]",
       [&](StateDict& o) {
         state_of(o, "blocks.2.fc1.weight").insert_or_assign("exp_avg", at::zeros({13, 7}));
       }},
      {"param group 0 does not match",
       [&](StateDict& o) {
         StateDict g = o.at("param_groups").list()[0].dict();
         StateList p = g.at("params").list();
         p.pop_back();
         g.insert_or_assign("params", p);
         o.at("param_groups").list()[0] = g;
       }},
      {"the dict has 2 param groups, the optimizer 1",
       [&](StateDict& o) {
         o.at("param_groups").list().push_back(o.at("param_groups").list()[0]);
       }},
      {"hyperparameter 'betas' has the wrong kind",
       [&](StateDict& o) {
         StateDict g = o.at("param_groups").list()[0].dict();
         g.insert_or_assign("betas", 0.9);
         o.at("param_groups").list()[0] = g;
       }},
  };
  for (const auto& [want, edit] : cases) {
    for (bool sharded : {false, true}) {
      run_ranks(2, [&, want = want, edit = edit](ProcessGroup& pg) {
        TinyLM m(7);
        FullyShardedDataParallel model(m, lm_options(m, ShardingStrategy::FULL_SHARD, false));
        auto opt = make_optimizer("Adam", unique_params(model->parameters()));
        fsdp_step(model, *opt, 0, pg.rank());
        const StateDict before = fsdp::optim_state_dict(model, *opt);
        fsdp::StateDictTypeGuard g(
            model, sharded ? StateDictType::SHARDED_STATE_DICT : StateDictType::FULL_STATE_DICT);
        StateDict osd = fsdp::optim_state_dict(model, *opt);
        fsdp_step(model, *opt, 1, pg.rank());  // the state moves on; a failed load keeps it
        const StateDict moved = [&] {
          fsdp::StateDictTypeGuard full(model, StateDictType::FULL_STATE_DICT);
          return fsdp::optim_state_dict(model, *opt);
        }();
        EXPECT_NE(osd_diff(moved, before, 0, 0), "");
        if (pg.rank() == 1) edit(osd);
        try {
          fsdp::load_optim_state_dict(model, *opt, osd);
          ADD_FAILURE() << "expected a ValueError for: " << want;
        } catch (const fsdp::ValueError& e) {
          const std::string msg = e.what();
          EXPECT_NE(msg.find(want), std::string::npos) << msg;
          EXPECT_NE(msg.find("rank 1"), std::string::npos) << msg;
        }
        fsdp::StateDictTypeGuard full(model, StateDictType::FULL_STATE_DICT);
        EXPECT_EQ(osd_diff(fsdp::optim_state_dict(model, *opt), moved, 0, 0), "") << want;
      });
    }
  }
}

// Pieces that do not cover what a rank needs fail every rank, naming the state.
TEST(OptimStateDict, ShardedPiecesMissingOnEveryRankFail) {
  run_ranks(2, [](ProcessGroup& pg) {
    TinyLM m(7);
    FullyShardedDataParallel model(m, lm_options(m));
    auto opt = make_optimizer("Adam", unique_params(model->parameters()));
    fsdp_step(model, *opt, 0, pg.rank());
    fsdp::StateDictTypeGuard g(model, StateDictType::SHARDED_STATE_DICT);
    StateDict osd = fsdp::optim_state_dict(model, *opt);
    // Every rank drops its pieces of one state: nobody holds rank 0's chunk any more.
    StateDict s = osd.at("state").dict().at("blocks.1.fc1.weight").dict();
    fsdp::ShardedTensor t = s.at("exp_avg").sharded_tensor();
    t.local_shards().clear();
    s.insert_or_assign("exp_avg", t);
    osd.at("state").dict().insert_or_assign("blocks.1.fc1.weight", s);
    EXPECT_THROW(
        {
          try {
            fsdp::load_optim_state_dict(model, *opt, osd);
          } catch (const fsdp::ValueError& e) {
            EXPECT_NE(std::string(e.what()).find("state 'exp_avg' of 'blocks.1.fc1.weight'"),
                      std::string::npos)
                << e.what();
            throw;
          }
        },
        fsdp::ValueError);
  });
}

// Re-keying between FQNs and parameter IDs round-trips, and needs one FQN per parameter.
TEST(OptimStateDict, RekeyBetweenNamesAndIds) {
  run_ranks(1, [](ProcessGroup&) {
    TinyLM m(7);
    auto opt = make_optimizer("Adam", unique_params(m->parameters()));
    ref_step(m, *opt, 0, 1);
    const StateDict by_name = fsdp::optim_state_dict(*m, *opt);
    const StateDict by_id =
        fsdp::rekey_optim_state_dict(by_name, fsdp::OptimStateKeyType::PARAM_ID, *m, *opt);
    EXPECT_TRUE(by_id.at("state").dict().contains("0"));  // tok.weight, the first parameter
    EXPECT_TRUE(by_id.at("param_groups").list()[0].dict().at("params").list()[0].is_int());
    const StateDict back =
        fsdp::rekey_optim_state_dict(by_id, fsdp::OptimStateKeyType::PARAM_NAME, *m, *opt);
    EXPECT_EQ(osd_diff(back, by_name, 0, 0), "");
    EXPECT_THROW(fsdp::load_optim_state_dict(*m, *opt, by_id), fsdp::ValueError);
  });
  run_ranks(2, [](ProcessGroup&) {
    TinyLM m(7);
    FullyShardedDataParallel model(m, lm_options(m, ShardingStrategy::FULL_SHARD, false));
    auto opt = make_optimizer("Adam", unique_params(model->parameters()));
    EXPECT_THROW(fsdp::rekey_optim_state_dict(fsdp::optim_state_dict(model, *opt),
                                              fsdp::OptimStateKeyType::PARAM_ID, model, *opt),
                 fsdp::ValueError);
  });
}

TEST(OptimStateDict, UnsupportedOptimizerAndLocalTypeAreNamed) {
  TinyLM m(7);
  torch::optim::LBFGS lbfgs(unique_params(m->parameters()));
  try {
    fsdp::optim_state_dict(*m, lbfgs);
    ADD_FAILURE() << "expected a ValueError";
  } catch (const fsdp::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("LBFGS"), std::string::npos) << e.what();
  }
  run_ranks(1, [](ProcessGroup&) {
    TinyLM m(7);
    FullyShardedDataParallel model(m, lm_options(m));
    auto opt = make_optimizer("Adam", unique_params(model->parameters()));
    fsdp::StateDictTypeGuard g(model, StateDictType::LOCAL_STATE_DICT);
    EXPECT_THROW(fsdp::optim_state_dict(model, *opt), fsdp::ValueError);
  });
}

}  // namespace
