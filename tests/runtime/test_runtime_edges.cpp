// Runtime behaviours at the edges (first found wrong by the core review, issue 7), each checked
// against an unwrapped single-process reference: buffers of ignored modules under buffer_dtype,
// requires_grad changed after wrapping, gradients cleared with set_to_none while a unit was
// unsharded.
#include <gtest/gtest.h>

#include <set>

#include "fsdp/errors.h"
#include "fsdp/fully_sharded.h"
#include "fsdp/model_state_dict.h"
#include "multi_rank.h"
#include "offload_testing.h"
#include "reference_training.h"
#include "tiny_lm.h"

using fsdp::FullyShardedDataParallel;
using fsdp::FullyShardedOptions;
using fsdp::ShardingStrategy;
using fsdp::dist::ProcessGroup;
using fsdp::testing::BlockImpl;
using fsdp::testing::expect_params_close;
using fsdp::testing::full_params;
using fsdp::testing::lm_loss;
using fsdp::testing::lm_options;
using fsdp::testing::lm_tokens;
using fsdp::testing::run_ranks;
using fsdp::testing::step_with_reference;
using fsdp::testing::TinyLM;
using fsdp::testing::TinyLMImpl;
using fsdp::testing::zero_grad_set_to_none;

namespace {

// A module with a float buffer, to be ignored by FSDP.
struct StatsImpl : torch::nn::Module {
  torch::Tensor running;
  StatsImpl() { running = register_buffer("running", torch::linspace(0.1, 0.9, 8) / 3.0); }
  torch::Tensor forward(const torch::Tensor& x) { return x * running.to(x.scalar_type()); }
};
TORCH_MODULE(Stats);

struct WithStatsImpl : TinyLMImpl {
  Stats stats{nullptr};
  WithStatsImpl() : TinyLMImpl(21) { stats = register_module("stats", Stats()); }
  torch::Tensor forward(const torch::Tensor& idx) {
    return TinyLMImpl::forward(idx) + stats(torch::ones({8})).sum();
  }
};
TORCH_MODULE(WithStats);

}  // namespace

// PyTorch never casts buffers of ignored modules to buffer_dtype (they are outside FSDP's care),
// and its state-dict hook leaves them alone. Casting loses precision even if cast back later.
TEST(RuntimeEdges, IgnoredModuleBuffersKeepTheirDtypeUnderBufferDtype) {
  run_ranks(2, [](ProcessGroup&) {
    WithStats m;
    const torch::Tensor before = m->stats->running.clone();
    FullyShardedDataParallel model(
        m, FullyShardedOptions()
               .auto_wrap_policy(fsdp::module_type_auto_wrap_policy<BlockImpl>())
               .units({m->frozen.ptr()})
               .ignored_modules({m->stats.ptr()})
               .mixed_precision(fsdp::MixedPrecision().buffer_dtype(at::kBFloat16)));
    auto idx = lm_tokens(2, 3);
    lm_loss(model->forward(idx), idx).backward();
    EXPECT_EQ(m->scale.scalar_type(), at::kBFloat16);  // a managed buffer is cast
    EXPECT_EQ(m->stats->running.scalar_type(), at::kFloat);
    EXPECT_TRUE(torch::equal(m->stats->running, before));  // bit-exact, never round-tripped
    fsdp::StateDictTypeGuard guard(model, fsdp::StateDictType::FULL_STATE_DICT);
    auto sd = fsdp::state_dict(model);
    EXPECT_TRUE(torch::equal(sd.at("stats.running").tensor(), before));
  });
}

// The seed recomputes flat_param.requires_grad every iteration (_reset_flat_param_grad_info_if_
// needed). A unit whose parameters were all frozen at wrap time and are unfrozen later must train
// like the unwrapped model does.
TEST(RuntimeEdges, UnfreezingAUnitFrozenAtWrapTimeTrainsIt) {
  for (int W : {2, 3}) {
    run_ranks(W, [](ProcessGroup& pg) {
      const int W = pg.size();
      TinyLM m(31);
      TinyLM ref(31);
      FullyShardedDataParallel model(m, lm_options(m).use_orig_params(true));
      for (auto& p : m->frozen->parameters()) p.set_requires_grad(true);
      for (auto& p : ref->frozen->parameters()) p.set_requires_grad(true);
      torch::optim::SGD opt(fsdp::testing::unique_params(model->parameters()), 0.5);
      torch::optim::SGD ref_opt(fsdp::testing::unique_params(ref->parameters()), 0.5);
      for (int step = 0; step < 3; ++step) {
        step_with_reference(model, opt, ref, ref_opt, lm_tokens(2 * W, 90 + step), pg.rank(), 2);
      }
      const auto got = full_params(model);
      const TinyLM init(31);
      expect_params_close(got, ref);
      // The control: the unfrozen weights did move (a skipped reduce would leave them, or leave
      // ranks apart).
      EXPECT_FALSE(torch::equal(got.at("frozen.weight"), init->frozen->weight));
    });
  }
}

// Frozen weights beside trainable biases in one unit (bias-only fine-tuning; LoRA's frozen base
// weights are alike): the biases' gradients are in before autograd has used the frozen weights
// for the gradient of the unit's input, so a unit resharded then would free weights backward
// still reads ("out of bounds for storage of size 0" before the fix). Such a unit waits for its
// inputs' gradients too. Trains like the unwrapped model on the whole batch, under the sharded
// strategies, with and without use_orig_params.
TEST(RuntimeEdges, FrozenWeightsBesideTrainableBiasesTrainLikeOneProcess) {
  for (auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP}) {
    for (bool orig : {true, false}) {
      run_ranks(orig ? 3 : 2, [strategy, orig](ProcessGroup& pg) {
        const int W = pg.size();
        auto freeze_weights = [](TinyLM& lm) {
          for (size_t b = 0; b < lm->blocks->size(); ++b) {
            lm->blocks->ptr<BlockImpl>(b)->fc1->weight.set_requires_grad(false);
            lm->blocks->ptr<BlockImpl>(b)->fc2->weight.set_requires_grad(false);
          }
        };
        TinyLM m(33), ref(33);
        // Without use_orig_params a unit's parameters must agree on requires_grad, so there only
        // TinyLM's `frozen` unit is frozen: whole, with an input that needs a gradient, it now
        // reshards once that gradient is done instead of at the end of backward.
        if (orig) {
          freeze_weights(m);
          freeze_weights(ref);
        }
        FullyShardedDataParallel model(m, lm_options(m, strategy, orig));
        torch::optim::SGD opt(fsdp::testing::unique_params(model->parameters()), 0.5);
        torch::optim::SGD ref_opt(fsdp::testing::unique_params(ref->parameters()), 0.5);
        for (int step = 0; step < 3; ++step) {
          step_with_reference(model, opt, ref, ref_opt, lm_tokens(2 * W, 40 + step), pg.rank(), 2);
        }
        const auto got = full_params(model);
        expect_params_close(got, ref);
        const TinyLM init(33);
        const auto b1 = init->blocks->ptr<BlockImpl>(1);
        EXPECT_FALSE(torch::equal(got.at("blocks.1.fc1.bias"), b1->fc1->bias))
            << "the biases train";
        EXPECT_EQ(torch::equal(got.at("blocks.1.fc1.weight"), b1->fc1->weight), orig);
        EXPECT_TRUE(torch::equal(got.at("frozen.weight"), init->frozen->weight));
      });
    }
  }
}

// And freezing after wrapping: the frozen parameters stay put while the rest trains.
TEST(RuntimeEdges, FreezingAfterWrapStopsTheUpdates) {
  run_ranks(2, [](ProcessGroup& pg) {
    TinyLM m(32);
    FullyShardedDataParallel model(m, lm_options(m).use_orig_params(true));
    auto b0 = m->blocks->ptr<BlockImpl>(0);
    for (auto& p : b0->parameters()) p.set_requires_grad(false);
    torch::optim::SGD opt(fsdp::testing::unique_params(model->parameters()), 0.5);
    const auto before = full_params(model);
    for (int step = 0; step < 2; ++step) {
      auto idx = lm_tokens(2, 95 + step + 7 * pg.rank());
      opt.zero_grad();
      lm_loss(model->forward(idx), idx).backward();
      opt.step();
    }
    const auto after = full_params(model);
    EXPECT_TRUE(torch::equal(after.at("blocks.0.fc1.weight"), before.at("blocks.0.fc1.weight")));
    EXPECT_FALSE(torch::equal(after.at("blocks.1.fc1.weight"), before.at("blocks.1.fc1.weight")));
    int seen = 0;
    for (auto* h : model->handles()) {
      if (h->layout().fqns[0] != "blocks.0.fc1.weight") continue;
      EXPECT_FALSE(h->flat_param().requires_grad());
      ++seen;
    }
    EXPECT_EQ(seen, 1);
  });
}

// zero_grad(set_to_none) issued while a unit is unsharded (the root stays unsharded after a
// forward under grad mode that no backward followed) must clear its gradient: the stale sharded
// gradient must not come back on the next reshard and be added to the next step's.
class ClearedGradsAfterEvalForward : public ::testing::TestWithParam<ShardingStrategy> {};

TEST_P(ClearedGradsAfterEvalForward, MatchTrainingWithoutTheExtraForward) {
  const ShardingStrategy strategy = GetParam();
  run_ranks(2, [strategy](ProcessGroup& pg) {
    auto train = [&](bool eval_between, bool set_to_none) {
      TinyLM m(13);
      FullyShardedDataParallel model(
          m, lm_options(m).use_orig_params(true).sharding_strategy(strategy));
      torch::optim::SGD opt(fsdp::testing::unique_params(model->parameters()), 0.3);
      for (int step = 0; step < 3; ++step) {
        if (set_to_none) {
          zero_grad_set_to_none(opt);
        } else {
          for (auto& p : opt.param_groups()[0].params()) {
            if (p.grad().defined()) p.mutable_grad().zero_();
          }
        }
        auto idx = lm_tokens(2, 70 + step + 10 * pg.rank());
        lm_loss(model->forward(idx), idx).backward();
        opt.step();
        if (eval_between) model->forward(lm_tokens(2, 5));  // no backward
      }
      return full_params(model);
    };
    for (bool set_to_none : {true, false}) {
      const auto plain = train(false, set_to_none);
      const auto with_eval = train(true, set_to_none);
      for (const auto& [k, v] : plain) {
        EXPECT_TRUE(torch::equal(with_eval.at(k), v)) << k << " set_to_none=" << set_to_none;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Strategies, ClearedGradsAfterEvalForward,
                         ::testing::Values(ShardingStrategy::FULL_SHARD,
                                           ShardingStrategy::SHARD_GRAD_OP,
                                           ShardingStrategy::NO_SHARD),
                         [](const auto& info) { return fsdp::to_string(info.param); });

// PyTorch's _get_param_to_fqns: every parameter an optimizer can hold, once, with canonical FQNs
// (tied: the first owner's name first), covering every name of the unwrapped model exactly once.
TEST(RuntimeEdges, ParamFqnsCoverEveryParameterOnce) {
  run_ranks(2, [](ProcessGroup&) {
    for (bool orig : {false, true}) {
      TinyLM m(41);
      std::set<std::string> names;
      for (const auto& p : TinyLM(41)->named_parameters()) names.insert(p.key());
      FullyShardedDataParallel model(
          m, lm_options(m).use_orig_params(orig).ignored_modules({m->blocks[2]}));
      const auto entries = model->param_fqns();
      std::multiset<std::string> listed;
      std::set<const c10::TensorImpl*> params;
      for (const auto& e : entries) {
        ASSERT_FALSE(e.fqns.empty());
        listed.insert(e.fqns.begin(), e.fqns.end());
        EXPECT_TRUE(params.insert(e.param.unsafeGetTensorImpl()).second) << e.fqns[0];
      }
      // A flat parameter lists its original parameters, not the other owners of a tied one
      // (head.weight is tok.weight's second name; PyTorch's flat_param._fqns omit it too).
      if (!orig) names.erase("head.weight");
      EXPECT_EQ(std::set<std::string>(listed.begin(), listed.end()), names) << "orig=" << orig;
      EXPECT_EQ(listed.size(), names.size()) << "each name once";
      // The optimizer's parameters are exactly the listed ones.
      std::set<const c10::TensorImpl*> opt;
      for (const auto& p : fsdp::testing::unique_params(model->parameters()))
        opt.insert(p.unsafeGetTensorImpl());
      EXPECT_EQ(opt, params) << "orig=" << orig;
      if (orig) {
        bool tie = false;
        for (const auto& e : entries) {
          if (e.fqns[0] != "tok.weight") continue;
          EXPECT_EQ(e.fqns, (std::vector<std::string>{"tok.weight", "head.weight"}));
          tie = true;
        }
        EXPECT_TRUE(tie);
      }
    }
  });
}

// The layout's flatten and unflat_views (what optimizer-state flattening uses) are inverse, with
// padding where the layout says.
TEST(RuntimeEdges, LayoutFlattenAndUnflatViewsRoundTrip) {
  std::vector<std::vector<int64_t>> shapes{{}, {0}, {7}, {5, 3}, {5}};
  std::vector<std::string> fqns{"s", "e", "o", "w", "b"};
  for (int64_t align : {0, 4}) {
    auto l = fsdp::FlatParamLayout::compute(fqns, shapes, align, 3, true);
    EXPECT_EQ(l.aligned_numel, align);
    std::vector<at::Tensor> ts;
    for (size_t i = 0; i < shapes.size(); ++i)
      ts.push_back(fsdp::testing::seeded_randn(shapes[i], 10 + i));
    at::Tensor flat = l.flatten(ts, -7.0);
    ASSERT_EQ(flat.numel(), l.unpadded_unsharded_numel);
    auto views = l.unflat_views(flat);
    for (size_t i = 0; i < ts.size(); ++i) EXPECT_TRUE(torch::equal(views[i], ts[i])) << fqns[i];
    int64_t pad = 0, off = 0;
    for (size_t k = 0; k < l.numels_with_padding.size(); ++k) {
      if (l.is_padding_mask[k]) {
        EXPECT_TRUE((flat.narrow(0, off, l.numels_with_padding[k]) == -7.0).all().item<bool>());
        pad += l.numels_with_padding[k];
      }
      off += l.numels_with_padding[k];
    }
    EXPECT_EQ(pad > 0, align > 0);
    ts[3] = ts[3].reshape({15, 1});  // any shape with the right numel flattens
    EXPECT_NO_THROW(l.flatten(ts));
    ts[3] = at::zeros({4});
    EXPECT_THROW(l.flatten(ts), fsdp::ValueError);
  }
}

// PyTorch's FSDP_USE_FULL_PREC_IN_EVAL=1: a model in eval mode computes in full precision despite
// param_dtype (and training goes back to it). Without the variable, eval stays in bfloat16: the
// control that shows the comparison can fail.
TEST(RuntimeEdges, FullPrecisionInEvalWithTheEnvironmentVariable) {
  run_ranks(2, [](ProcessGroup& pg) {
    for (auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP}) {
      for (bool env : {true, false}) {
        if (env) {
          ::setenv("FSDP_USE_FULL_PREC_IN_EVAL", "1", 1);
        } else {
          ::unsetenv("FSDP_USE_FULL_PREC_IN_EVAL");
        }
        TinyLM m(51);
        TinyLM ref(51);
        FullyShardedDataParallel model(
            m, lm_options(m).sharding_strategy(strategy).mixed_precision(
                   fsdp::MixedPrecision().param_dtype(at::kBFloat16).buffer_dtype(at::kBFloat16)));
        auto idx = lm_tokens(2, 60 + pg.rank());
        model->eval();
        for (bool grad : {false, true}) {  // eval with and without grad mode
          torch::AutoGradMode mode(grad);
          const at::Tensor out = model->forward(idx);
          const at::Tensor want = ref->forward(idx);
          const double diff = (out.to(at::kFloat) - want).abs().max().item<double>();
          if (env) {
            EXPECT_EQ(out.scalar_type(), at::kFloat);
            EXPECT_LT(diff, 1e-5) << fsdp::to_string(strategy) << " grad=" << grad;
          } else {
            EXPECT_EQ(out.scalar_type(), at::kBFloat16);
            EXPECT_GT(diff, 1e-3) << "bfloat16 eval should differ from float32";
          }
        }
        model->train();
        const at::Tensor logits = model->forward(idx);
        EXPECT_EQ(logits.scalar_type(), at::kBFloat16);    // training keeps param_dtype
        EXPECT_EQ(m->scale.scalar_type(), at::kBFloat16);  // and buffer_dtype
        lm_loss(logits.to(at::kFloat), idx).backward();
        for (auto* h : model->handles()) EXPECT_EQ(h->unsharded_storage_bytes(), 0);
      }
    }
    ::unsetenv("FSDP_USE_FULL_PREC_IN_EVAL");
  });
}

// Summoning with gradients (PyTorch's summon_full_params(with_grads=True), unshard_grad): every
// trainable parameter's grad() is its full, averaged gradient, equal to the unwrapped model's on
// the whole batch; afterwards the sharded gradients are exactly as before.
TEST(RuntimeEdges, SummonWithGradsShowsFullGradients) {
  run_ranks(2, [](ProcessGroup& pg) {
    for (auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP,
                          ShardingStrategy::NO_SHARD}) {
      TinyLM m(81);
      TinyLM ref(81);
      FullyShardedDataParallel model(
          m, lm_options(m).use_orig_params(true).sharding_strategy(strategy));
      auto idx = lm_tokens(4, 82);
      lm_loss(model->forward(idx.narrow(0, 2 * pg.rank(), 2)), idx.narrow(0, 2 * pg.rank(), 2))
          .backward();
      lm_loss(ref->forward(idx), idx).backward();
      std::vector<at::Tensor> before;
      for (auto* h : model->handles()) {
        before.push_back(h->sharded_grad().defined() ? h->sharded_grad().clone() : at::Tensor());
      }
      {
        fsdp::SummonFullParamsGuard g(model, /*writeback=*/false, /*with_grads=*/true);
        for (const auto& p : ref->named_parameters()) {
          const at::Tensor got = m->named_parameters()[p.key()].grad();
          if (!p.value().requires_grad()) {
            EXPECT_FALSE(got.defined()) << p.key();
            continue;
          }
          ASSERT_TRUE(got.defined()) << p.key();
          EXPECT_EQ(got.sizes(), p.value().sizes()) << p.key();
          EXPECT_TRUE(torch::allclose(got, p.value().grad(), 1e-5, 1e-7))
              << fsdp::to_string(strategy) << " " << p.key() << " max diff "
              << (got - p.value().grad()).abs().max().item<float>();
        }
      }
      size_t i = 0;
      for (auto* h : model->handles()) {
        const at::Tensor g = h->sharded_grad();
        EXPECT_EQ(g.defined(), before[i].defined());
        if (g.defined()) {
          EXPECT_TRUE(torch::equal(g, before[i]));
        }
        ++i;
      }
    }
  });
}

namespace {
fsdp::FlatParamHandle* handle_of(FullyShardedDataParallel& model, const std::string& first_fqn) {
  for (auto* h : model->handles()) {
    if (h != nullptr && h->layout().fqns[0] == first_fqn) return h;
  }
  throw std::runtime_error("no unit starts with " + first_fqn);
}
}  // namespace

// PyTorch's _skipped_use_sharded_views: under SHARD_GRAD_OP with use_orig_params a forward under
// grad mode keeps the unsharded parameters for backward, and the original parameters stay their
// full-shaped views until then (FULL_SHARD frees them, so they are 1-D shard views). Training is
// unchanged, and it equals one process on the whole batch.
TEST(RuntimeEdges, ShardGradOpKeepsUnshardedViewsBetweenForwardAndBackward) {
  run_ranks(2, [](ProcessGroup& pg) {
    for (auto strategy : {ShardingStrategy::SHARD_GRAD_OP, ShardingStrategy::FULL_SHARD}) {
      const bool keeps = strategy == ShardingStrategy::SHARD_GRAD_OP;
      TinyLM m(41);
      TinyLM ref(41);
      FullyShardedDataParallel model(m, lm_options(m, strategy, /*use_orig_params=*/true));
      fsdp::FlatParamHandle* h = handle_of(model, "blocks.1.fc1.weight");
      auto weight = [](TinyLM& lm) { return lm->blocks->ptr<BlockImpl>(1)->fc1->weight; };
      torch::optim::SGD opt(fsdp::testing::unique_params(model->parameters()), 0.5);
      torch::optim::SGD ref_opt(fsdp::testing::unique_params(ref->parameters()), 0.5);
      for (int step = 0; step < 2; ++step) {
        auto idx = lm_tokens(4, 70 + step);
        auto local = idx.narrow(0, 2 * pg.rank(), 2);
        opt.zero_grad();
        auto loss = lm_loss(model->forward(local), local);
        // Between forward and backward.
        EXPECT_EQ(h->skipped_use_sharded_views(), keeps) << fsdp::to_string(strategy);
        if (keeps) {
          EXPECT_EQ(weight(m).sizes(), weight(ref).sizes());
          EXPECT_TRUE(torch::allclose(weight(m), weight(ref), 1e-5, 1e-6)) << "step " << step;
        } else {
          EXPECT_EQ(weight(m).dim(), 1);
        }
        loss.backward();
        EXPECT_FALSE(h->skipped_use_sharded_views());
        EXPECT_EQ(weight(m).dim(), 1) << "a shard view again after backward";
        opt.step();
        ref_opt.zero_grad();
        lm_loss(ref->forward(idx), idx).backward();
        ref_opt.step();
      }
      // A forward without grad mode keeps nothing, so there is nothing to skip.
      {
        torch::NoGradGuard no_grad;
        model->forward(lm_tokens(2, 77));
        EXPECT_FALSE(h->skipped_use_sharded_views());
        EXPECT_EQ(weight(m).dim(), 1);
      }
      const auto got = full_params(model);
      for (const auto& p : ref->named_parameters()) {
        EXPECT_TRUE(torch::allclose(got.at(p.key()), p.value(), 1e-5, 1e-6))
            << fsdp::to_string(strategy) << " " << p.key();
      }
    }
  });
}

// While the views are kept, a parameter replaced before backward is an error naming it, as in
// PyTorch (it would otherwise be silently lost: backward runs on the kept unsharded values).
TEST(RuntimeEdges, ReplacingAKeptParameterBeforeBackwardIsAnError) {
  run_ranks(2, [](ProcessGroup& pg) {
    TinyLM m(42);
    FullyShardedDataParallel model(
        m, lm_options(m, ShardingStrategy::SHARD_GRAD_OP, /*use_orig_params=*/true));
    auto idx = lm_tokens(2, 43 + pg.rank());
    auto loss = lm_loss(model->forward(idx), idx);
    {
      torch::NoGradGuard no_grad;
      m->blocks->ptr<BlockImpl>(1)->fc1->weight.set_data(torch::zeros({13, 8}));
    }
    try {
      loss.backward();
      ADD_FAILURE() << "backward accepted a parameter replaced after forward";
    } catch (const std::exception& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("between forward and backward for SHARD_GRAD_OP"), std::string::npos)
          << msg;
      EXPECT_NE(msg.find("blocks.1.fc1.weight"), std::string::npos) << msg;
    }
  });
}

// PyTorch's _cpu_grad: under offload the sharded gradient is one CPU buffer kept for the handle's
// life; after zero_grad(set_to_none) the next backward writes into the same buffer (no
// allocation per step), and training is bit-identical to training without offload.
TEST(RuntimeEdges, OffloadReusesOneGradientBufferPerUnit) {
  run_ranks(2, [](ProcessGroup& pg) {
    for (auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::NO_SHARD}) {
      fsdp::testing::expect_offload_reuses_one_gradient_buffer(pg.rank(), strategy, at::kCPU);
    }
  });
}
