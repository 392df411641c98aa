// FullyShardedDataParallel behaviours beyond plain training: memory, failures, gradient
// accumulation, clipping, summoning, auto-wrapping, mixed precision, module-state sync.
#include <gtest/gtest.h>
#include <signal.h>

#include <typeinfo>
#include <unordered_set>

#include "fsdp/errors.h"
#include "fsdp/fully_sharded.h"
#include "memory_watch.h"
#include "multi_rank.h"
#include "tiny_lm.h"

using fsdp::FullyShardedDataParallel;
using fsdp::FullyShardedOptions;
using fsdp::ShardingStrategy;
using fsdp::dist::ProcessGroup;
using fsdp::testing::BlockImpl;
using fsdp::testing::full_params;
using fsdp::testing::lm_loss;
using fsdp::testing::lm_options;
using fsdp::testing::lm_tokens;
using fsdp::testing::run_ranks;
using fsdp::testing::seeded_randn;
using fsdp::testing::TinyLM;
using fsdp::testing::TinyLMImpl;

namespace {

// Worst element-wise difference allowed between bfloat16 training at W=2 and the same wrapper at
// W=1: a few bfloat16 roundings (2^-8 relative) of parameters of magnitude ~0.5. Measured worst:
// 3.1e-3 (TinyLM, 3 SGD steps) and 7.8e-4 (unit used twice); one rank's gradient dropped moves
// them by 0.20 and 0.054, which the negative controls require to exceed the bound.
constexpr double kMixedPrecisionTol = 1e-2;
constexpr double kMixedPrecisionTwiceTol = 5e-3;

TEST(FsdpRuntime, ForwardKeepsAtMostTwoUnitsUnsharded) {
  run_ranks(2, [](ProcessGroup& pg) {
    TinyLM m(1);
    FullyShardedDataParallel model(m, lm_options(m));
    auto handles = model->handles();
    std::vector<int64_t> unit_bytes;
    for (auto* h : handles) unit_bytes.push_back(h->layout().padded_unsharded_numel * 4);
    std::sort(unit_bytes.rbegin(), unit_bytes.rend());
    const int64_t two_largest = unit_bytes[0] + unit_bytes[1];
    int64_t peak = 0, probes = 0;
    fsdp::testing::block_probe() = [&] {
      int64_t now = 0;
      for (auto* h : handles) now += h->unsharded_storage_bytes();
      peak = std::max(peak, now);
      ++probes;
    };
    for (int step = 0; step < 2; ++step) {
      auto idx = lm_tokens(3, 10 + pg.rank());
      lm_loss(model->forward(idx), idx).backward();
      for (auto* h : handles)
        EXPECT_EQ(h->unsharded_storage_bytes(), 0);  // all freed after backward
    }
    fsdp::testing::block_probe() = nullptr;
    EXPECT_EQ(probes, 6);
    EXPECT_GT(peak, 0);
    EXPECT_LE(peak, two_largest) << "peak " << peak << " B, two largest units " << two_largest
                                 << " B";
    int64_t all_units = 0;
    for (int64_t b : unit_bytes) all_units += b;
    EXPECT_LT(peak, all_units);  // the bound is not vacuous: the whole model never is unsharded
    if (pg.rank() == 0) {
      std::printf("forward peak unsharded %lld B; two largest units %lld B; all units %lld B\n",
                  static_cast<long long>(peak), static_cast<long long>(two_largest),
                  static_cast<long long>(all_units));
    }
  });
}

// The peak tensor memory of a step is a property of the step, not of thread timing. It used to
// move by a unit between steps with the same code (bench_scaling: 1.07 or 1.10 of its analytic
// bound at 50M parameters): Gloo's worker thread let go of the reduce-scatter's buffers, and of the
// scratch copy of a prefetched all-gather, at times that raced the next unit's backward.
TEST(FsdpRuntime, StepMemoryPeakIsTheSameOnEveryStep) {
  run_ranks(2, [](ProcessGroup& pg) {
    torch::manual_seed(0);
    torch::nn::Sequential stack;
    for (int i = 0; i < 6; ++i) {
      stack->push_back(torch::nn::Linear(160, 160));
      stack->push_back(torch::nn::ReLU());
    }
    FullyShardedDataParallel model(
        stack, FullyShardedOptions().process_group(pg).auto_wrap_policy(
                   fsdp::module_type_auto_wrap_policy<torch::nn::LinearImpl>()));
    torch::optim::SGD opt(model->parameters(), 0.01);
    const torch::Tensor x = seeded_randn({4, 160}, 7 + pg.rank());
    std::vector<int64_t> peaks;
    for (int step = 0; step < 18; ++step) {
      opt.zero_grad();
      {
        fsdp::testing::MemoryWatch watch;
        model->forward(x).pow(2).mean().backward();
        peaks.push_back(watch.peak());
      }
      opt.step();
    }
    // The first steps differ for good reasons: the first records the forward order that later
    // steps prefetch by, and the first optimizer step creates state.
    // What this guards against is a unit more or less from one step to the next (Gloo's threads
    // releasing a unit-sized buffer early or late). Two smaller things move legitimately: an
    // activation or two ([4, 160], 2560 B), since the flat gradient takes over the parameters'
    // memory; and, under load, a shard-sized buffer (half a unit here) that is sometimes freed
    // before the peak and sometimes after: with a busy loop on the other core, some steps peak
    // 52148 B lower than step 2, on LibTorch 1.13 at 3f569ea as with gradients sent in pieces.
    // The timing of the collectives' completions on Gloo's worker threads decides it. So the
    // tolerance is 0.6 of a unit: both causes fit in it, a unit does not.
    const int64_t unit_bytes = (160 * 160 + 160) * 4;
    for (size_t k = 3; k < peaks.size(); ++k) {
      EXPECT_LE(std::abs(peaks[k] - peaks[2]), unit_bytes * 6 / 10)
          << "rank " << pg.rank() << ", step " << k << ": peak " << peaks[k] << " B against "
          << peaks[2] << " B (a unit is " << unit_bytes << " B)";
    }
  });
}

TEST(FsdpRuntime, RankDyingMidStepFailsTheOthersWithinTheTimeout) {
  // A generous timeout: it bounds how long the survivors may take to notice, and must not expire
  // by accident at start-up on a loaded two-core machine (CI saw a flake with 3 s). A dead peer's
  // closed sockets usually fail the survivors at once; the timeout is the backstop.
  const auto timeout = std::chrono::milliseconds(10000);
  fsdp::testing::RunOptions opts;
  opts.collective_timeout = timeout;
  // Tearing down a Gloo group whose peer died may wait out the timeout once more per queued op.
  opts.grace = 4 * timeout;
  opts.report = false;
  auto results = run_ranks(
      3,
      [timeout](ProcessGroup& pg) {
        TinyLM m(1);
        FullyShardedDataParallel model(m, lm_options(m));
        int calls = 0;
        fsdp::testing::block_probe() = [&] {
          if (pg.rank() == 2 && ++calls == 5) ::raise(SIGKILL);  // second step, second block
        };
        auto t0 = std::chrono::steady_clock::now();
        try {
          for (int step = 0; step < 3; ++step) {
            auto idx = lm_tokens(4, step);
            lm_loss(model->forward(idx), idx).backward();
          }
          ADD_FAILURE() << "training went on without rank 2";
        } catch (const fsdp::DistError& e) {
          EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(pg.rank())),
                    std::string::npos)
              << e.what();
        } catch (const std::exception& e) {
          ADD_FAILURE() << "rank " << pg.rank() << ": expected a DistError, got "
                        << typeid(e).name() << ": " << e.what();
        }
        EXPECT_LT(std::chrono::steady_clock::now() - t0, 2 * timeout + std::chrono::seconds(2))
            << "rank " << pg.rank();
      },
      opts);
  EXPECT_TRUE(results[0].ok) << results[0].message;
  EXPECT_TRUE(results[1].ok) << results[1].message;
  EXPECT_FALSE(results[2].ok);
  EXPECT_NE(results[2].message.find("signal 9"), std::string::npos) << results[2].message;
}

// no_sync: two micro-batches accumulated locally, then one synchronised, equal the single-process
// gradient of all three.
TEST(FsdpRuntime, NoSyncAccumulatesLocallyThenReducesEverything) {
  for (bool orig : {false, true}) {
    run_ranks(2, [orig](ProcessGroup& pg) {
      TinyLM ref(4);
      for (int mb = 0; mb < 3; ++mb) {
        for (int r = 0; r < pg.size(); ++r) {
          auto idx = lm_tokens(2, 100 * mb + r);
          (lm_loss(ref->forward(idx), idx) / pg.size()).backward();
        }
      }
      torch::optim::SGD ref_opt(fsdp::testing::unique_params(ref->parameters()), 0.5);
      ref_opt.step();

      TinyLM m(4);
      FullyShardedDataParallel model(m, lm_options(m).use_orig_params(orig));
      torch::optim::SGD opt(fsdp::testing::unique_params(model->parameters()), 0.5);
      {
        fsdp::NoSyncGuard no_sync(model);
        for (int mb = 0; mb < 2; ++mb) {
          auto idx = lm_tokens(2, 100 * mb + pg.rank());
          lm_loss(model->forward(idx), idx).backward();
        }
      }
      auto idx = lm_tokens(2, 200 + pg.rank());
      lm_loss(model->forward(idx), idx).backward();
      opt.step();
      auto got = full_params(model);
      for (const auto& p : ref->named_parameters()) {
        EXPECT_TRUE(torch::allclose(got.at(p.key()), p.value(), 1e-5, 1e-6))
            << p.key() << " use_orig_params=" << orig;
      }
    });
  }
}

TEST(FsdpRuntime, ClipGradNormUsesTheGlobalNorm) {
  for (auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::NO_SHARD}) {
    run_ranks(3, [strategy](ProcessGroup& pg) {
      TinyLM ref(6);
      for (int r = 0; r < pg.size(); ++r) {
        auto idx = lm_tokens(2, 300 + r);
        (lm_loss(ref->forward(idx), idx) / pg.size()).backward();
      }
      auto params = fsdp::testing::unique_params(ref->parameters());
      double ref_norm = 0;
      for (auto& p : params)
        if (p.grad().defined()) ref_norm += p.grad().pow(2).sum().item<double>();
      ref_norm = std::sqrt(ref_norm);
      torch::nn::utils::clip_grad_norm_(params, 0.1);
      torch::optim::SGD ref_opt(params, 1.0);
      ref_opt.step();

      TinyLM m(6);
      FullyShardedDataParallel model(m, lm_options(m).sharding_strategy(strategy));
      auto idx = lm_tokens(2, 300 + pg.rank());
      lm_loss(model->forward(idx), idx).backward();
      const double norm = model->clip_grad_norm_(0.1);
      EXPECT_NEAR(norm, ref_norm, 1e-5 * ref_norm);
      torch::optim::SGD opt(fsdp::testing::unique_params(model->parameters()), 1.0);
      opt.step();
      auto got = full_params(model);
      for (const auto& p : ref->named_parameters()) {
        EXPECT_TRUE(torch::allclose(got.at(p.key()), p.value(), 1e-5, 1e-6)) << p.key();
      }
    });
  }
}

TEST(FsdpRuntime, SummonFullParamsWritesBackEdits) {
  run_ranks(2, [](ProcessGroup& pg) {
    TinyLM m(2);
    const auto before = m->blocks->ptr<BlockImpl>(1)->fc1->weight.detach().clone();
    FullyShardedDataParallel model(m, lm_options(m).use_orig_params(true));
    {
      fsdp::SummonFullParamsGuard full(model);
      auto w = m->blocks->ptr<BlockImpl>(1)->fc1->weight;
      EXPECT_TRUE(torch::equal(w, before));
      torch::NoGradGuard g;
      w.mul_(2);
    }
    for (auto* h : model->handles()) EXPECT_EQ(h->unsharded_storage_bytes(), 0);
    auto got = full_params(model);
    EXPECT_TRUE(torch::equal(got.at("blocks.1.fc1.weight"), before * 2));
    {  // without write-back, edits are dropped
      fsdp::SummonFullParamsGuard full(model, /*writeback=*/false);
      torch::NoGradGuard g;
      m->blocks->ptr<BlockImpl>(1)->fc1->weight.zero_();
    }
    EXPECT_TRUE(torch::equal(full_params(model).at("blocks.1.fc1.weight"), before * 2));
    (void)pg;
  });
}

TEST(FsdpRuntime, SequentialChildrenAreAutoWrappedAndTrainLikeOneProcess) {
  run_ranks(2, [](ProcessGroup& pg) {
    auto make = [] {
      fsdp::testing::seed_cpu(8);
      return torch::nn::Sequential(torch::nn::Linear(6, 9), torch::nn::Tanh(),
                                   torch::nn::Linear(9, 9), torch::nn::Linear(9, 3));
    };
    auto x = seeded_randn({4, 6}, 77);
    auto ref = make();
    ref->forward(x).pow(2).mean().backward();
    torch::optim::SGD(ref->parameters(), 0.3).step();

    auto seq = make();
    FullyShardedDataParallel model(
        seq, FullyShardedOptions().auto_wrap_policy(
                 fsdp::module_type_auto_wrap_policy<torch::nn::LinearImpl>()));
    EXPECT_EQ(model->unit_names(), (std::vector<std::string>{"", "3", "2", "0"}));
    EXPECT_EQ(model->handles()[0], nullptr);  // the root owns no parameters of its own
    auto local = x.narrow(0, 2 * pg.rank(), 2);
    // Mean over the local half: averaging across ranks gives the mean over the whole batch.
    model->forward(local).pow(2).mean().backward();
    torch::optim::SGD(model->parameters(), 0.3).step();
    auto got = full_params(model);
    for (const auto& p : ref->named_parameters()) {
      EXPECT_TRUE(torch::allclose(got.at(p.key()), p.value(), 1e-5, 1e-6)) << p.key();
    }
    // size-based policy: only modules with >= 60 unclaimed elements become units.
    auto seq2 = make();
    FullyShardedDataParallel by_size(
        seq2, FullyShardedOptions().auto_wrap_policy(fsdp::size_based_auto_wrap_policy(60)));
    EXPECT_EQ(by_size->unit_names(), (std::vector<std::string>{"", "2", "0"}));
  });
}

TEST(FsdpRuntime, MixedPrecisionMatchesASingleProcessCastingTheSameWay) {
  // The single process that casts the same way is the same wrapper at world size 1.
  // drop: rank 1's gradient contributes nothing (its loss is scaled by 0): the negative control
  // that the tolerance below must catch.
  auto run = [](ProcessGroup& pg, int64_t rows_per_rank, bool drop = false) {
    TinyLM m(9);
    auto opts = lm_options(m).mixed_precision(fsdp::MixedPrecision()
                                                  .param_dtype(at::kBFloat16)
                                                  .reduce_dtype(at::kFloat)
                                                  .buffer_dtype(at::kBFloat16));
    FullyShardedDataParallel model(m, opts);
    torch::optim::SGD opt(model->parameters(), 0.2);
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      auto idx = lm_tokens(4, 40 + step).narrow(0, pg.rank() * rows_per_rank, rows_per_rank);
      auto logits = model->forward(idx);
      EXPECT_EQ(logits.scalar_type(), at::kBFloat16);
      auto loss = lm_loss(logits.to(at::kFloat), idx);
      if (drop && pg.rank() == 1) loss = loss * 0;
      loss.backward();
      opt.step();
    }
    EXPECT_EQ(m->scale.scalar_type(), at::kBFloat16);
    return full_params(model);
  };
  fsdp::testing::TempDir tmp;
  const std::string file = tmp.file("single.pt");
  run_ranks(1, [&](ProcessGroup& pg) {
    auto got = run(pg, 4);
    // Ship the result to the parent through a file: ranks are separate processes.
    std::vector<torch::Tensor> vals;
    for (auto& [k, v] : got) vals.push_back(v);
    torch::save(vals, file);
  });
  std::vector<torch::Tensor> ref_vals;
  torch::load(ref_vals, file);
  run_ranks(2, [&](ProcessGroup& pg) {
    // bfloat16 forward/backward: per-rank halves round differently from the whole batch. The
    // bound is measured (kMixedPrecisionTol), far below what one rank's missing gradient does.
    auto worst = [&](const std::map<std::string, torch::Tensor>& got) {
      double w = 0;
      size_t i = 0;
      for (auto& [k, v] : got) {
        EXPECT_EQ(v.scalar_type(), at::kFloat) << k;
        w = std::max(w, (v - ref_vals.at(i++)).abs().max().item<double>());
      }
      return w;
    };
    const double ok = worst(run(pg, 2));
    const double dropped = worst(run(pg, 2, /*drop=*/true));
    if (pg.rank() == 0)
      std::printf("mixed precision: worst %.3g, dropped gradient %.3g\n", ok, dropped);
    EXPECT_LE(ok, kMixedPrecisionTol);
    EXPECT_GT(dropped, kMixedPrecisionTol);  // the control must fail the bound
  });
}

TEST(FsdpRuntime, SyncModuleStatesBroadcastsRankZero) {
  run_ranks(3, [](ProcessGroup& pg) {
    TinyLM m(100 + pg.rank());  // different initial weights per rank
    FullyShardedDataParallel model(m, lm_options(m).sync_module_states(true));
    TinyLM rank0(100);
    auto got = full_params(model);
    for (const auto& p : rank0->named_parameters()) {
      EXPECT_TRUE(torch::equal(got.at(p.key()), p.value())) << p.key();
    }
  });
}

TEST(FsdpRuntime, EvalForwardWithoutGradReshardsEverything) {
  run_ranks(2, [](ProcessGroup& pg) {
    TinyLM m(3);
    TinyLM ref(3);
    FullyShardedDataParallel model(m, lm_options(m));
    model->eval();
    EXPECT_FALSE(m->blocks->ptr<BlockImpl>(0)->is_training());
    torch::NoGradGuard no_grad;
    auto idx = lm_tokens(2, 5);
    auto out = model->forward(idx);
    EXPECT_TRUE(torch::allclose(out, ref->forward(idx), 1e-6, 1e-6));
    for (auto* h : model->handles()) EXPECT_EQ(h->unsharded_storage_bytes(), 0);
    (void)pg;
  });
}

TEST(FsdpRuntime, IgnoredModulesStayWholeAndUnmanaged) {
  run_ranks(2, [](ProcessGroup& pg) {
    TinyLM m(3);
    FullyShardedDataParallel model(m, lm_options(m).ignored_modules({m->frozen.ptr()}).units({}));
    EXPECT_EQ(m->frozen->weight.sizes(), (std::vector<int64_t>{8, 8}));
    EXPECT_FALSE(fsdp::is_fsdp_flattened(m->frozen->weight));
    auto names = model->unit_names();
    EXPECT_EQ(std::count(names.begin(), names.end(), "frozen"), 0);
    auto idx = lm_tokens(2, 5 + pg.rank());
    lm_loss(model->forward(idx), idx).backward();
  });
}

}  // namespace

namespace {

// Prefetching changes when all-gathers happen, never what they produce.
TEST(FsdpRuntime, PrefetchModesGiveBitIdenticalTraining) {
  run_ranks(2, [](ProcessGroup& pg) {
    auto train = [&](fsdp::BackwardPrefetch bwd, bool fwd) {
      TinyLM m(12);
      FullyShardedDataParallel model(
          m, lm_options(m).backward_prefetch(bwd).forward_prefetch(fwd).use_orig_params(true));
      torch::optim::Adam opt(fsdp::testing::unique_params(model->parameters()), 1e-2);
      for (int step = 0; step < 3; ++step) {
        opt.zero_grad();
        auto idx = lm_tokens(3, 60 + 10 * step + pg.rank());
        lm_loss(model->forward(idx), idx).backward();
        opt.step();
        for (auto* h : model->handles()) {
          EXPECT_FALSE(h->has_pending_unshard());
          EXPECT_EQ(h->unsharded_storage_bytes(), 0);
        }
      }
      return full_params(model);
    };
    const auto base = train(fsdp::BackwardPrefetch::NONE, false);
    for (auto [bwd, fwd] : {std::pair{fsdp::BackwardPrefetch::BACKWARD_PRE, true},
                            std::pair{fsdp::BackwardPrefetch::BACKWARD_POST, true},
                            std::pair{fsdp::BackwardPrefetch::BACKWARD_POST, false}}) {
      const auto got = train(bwd, fwd);
      for (const auto& [k, v] : base) {
        EXPECT_TRUE(torch::equal(got.at(k), v))
            << k << " backward_prefetch=" << static_cast<int>(bwd) << " forward_prefetch=" << fwd
            << " diff " << (got.at(k) - v).abs().max().item<float>();
      }
    }
  });
}

// A root with parameters of its own (a head) over three Blocks, each a unit. The root's forward
// ends last, so its backward comes first, and it is where the last block's gather should start
// (PyTorch prefetches in the order forwards ended, not began). `probe` runs on the gradient of the
// stack's output: after the head's backward, before the last block's.
struct HeadOverStackImpl : torch::nn::Module {
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};
  std::function<void()> probe;
  HeadOverStackImpl() {
    fsdp::testing::seed_cpu(37);
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 3; ++i) blocks->push_back(fsdp::testing::Block(6, 9));
    head = register_module("head", torch::nn::Linear(6, 4));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (size_t i = 0; i < blocks->size(); ++i) {
      auto block = blocks->ptr<BlockImpl>(i);
      x = fsdp::forward(block, x);
    }
    // A tensor of its own: the block's output carries the block's pre-backward hook, which
    // would run before a probe registered there.
    x = x * 1.0;
    x.register_hook([this](const torch::Tensor& g) {
      if (probe) probe();
      return g;
    });
    return head(x);
  }
};
TORCH_MODULE(HeadOverStack);

TEST(FsdpRuntime, RootBackwardPrefetchesTheLastUnitToFinishForward) {
  run_ranks(2, [](ProcessGroup& pg) {
    for (auto bwd : {fsdp::BackwardPrefetch::BACKWARD_PRE, fsdp::BackwardPrefetch::BACKWARD_POST,
                     fsdp::BackwardPrefetch::NONE}) {
      HeadOverStack m;
      FullyShardedDataParallel model(
          m, FullyShardedOptions().process_group(pg).backward_prefetch(bwd).auto_wrap_policy(
                 fsdp::module_type_auto_wrap_policy<BlockImpl>()));
      const auto names = model->unit_names();
      const auto it = std::find(names.begin(), names.end(), "blocks.2");
      ASSERT_NE(it, names.end());
      fsdp::FlatParamHandle* h = model->handles()[static_cast<size_t>(it - names.begin())];
      ASSERT_NE(h, nullptr);
      std::vector<bool> gathering;
      m->probe = [&] { gathering.push_back(h->has_pending_unshard() || h->is_unsharded()); };
      for (int step = 0; step < 2; ++step) {
        auto x = seeded_randn({3, 6}, 90 + step + pg.rank());
        model->forward(x).pow(2).sum().backward();
      }
      const bool want = bwd != fsdp::BackwardPrefetch::NONE;
      EXPECT_EQ(gathering, std::vector<bool>(2, want))
          << "backward_prefetch " << static_cast<int>(bwd);
    }
  });
}

// Four Blocks, each a unit, with a hook on the gradient of every block's output: it runs in
// backward after the block above has finished (its post-backward hook included) and before this
// block's backward starts, which is where the reduction of the block above should be in flight.
struct HookedStackImpl : torch::nn::Module {
  torch::nn::ModuleList blocks{nullptr};
  std::function<void()> between_blocks;
  HookedStackImpl() {
    fsdp::testing::seed_cpu(31);
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 4; ++i) blocks->push_back(fsdp::testing::Block(6, 9));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (size_t i = 0; i < blocks->size(); ++i) {
      auto block = blocks->ptr<BlockImpl>(i);
      x = fsdp::forward(block, x);
      if (between_blocks && i + 1 < blocks->size()) {
        x.register_hook([this](const torch::Tensor& g) {
          between_blocks();
          return g;
        });
      }
    }
    return x;
  }
};
TORCH_MODULE(HookedStack);

// max_inflight_grad_reductions: each unit's gradient reduction is still in flight while the
// backward of the unit before it runs (at most the limit of them), all are finished when
// backward returns, and the result is bit-identical to reducing inside the hook (0). Unset, it
// overlaps under NO_SHARD only.
void expect_overlapped_reductions(ProcessGroup& pg, ShardingStrategy strategy) {
  const std::string name = fsdp::to_string(strategy);
  auto train = [&](std::optional<int> inflight) {
    HookedStack m;
    auto options =
        FullyShardedOptions()
            .process_group(pg)
            .sharding_strategy(strategy)
            .bucket_cap_mb(0)  // one reduction per unit: test_grad_buckets has the buckets
            .auto_wrap_policy(fsdp::module_type_auto_wrap_policy<BlockImpl>());
    if (strategy == ShardingStrategy::HYBRID_SHARD) options.hybrid_shard_size(2);
    if (inflight) options.max_inflight_grad_reductions(*inflight);
    FullyShardedDataParallel model(m, options);
    auto handles = model->handles();
    std::vector<int> pending_seen;
    m->between_blocks = [&] {
      int n = 0;
      for (auto* h : handles) n += h && h->has_pending_reduce_grad();  // root: no handle
      pending_seen.push_back(n);
    };
    torch::optim::Adam opt(model->parameters(), 1e-2);
    for (int step = 0; step < 2; ++step) {
      opt.zero_grad();
      auto x = seeded_randn({3, 6}, 70 + 10 * step + pg.rank());
      model->forward(x).pow(2).sum().backward();
      for (auto* h : handles) EXPECT_FALSE(h && h->has_pending_reduce_grad()) << name;
      opt.step();
    }
    return std::pair{pending_seen, full_params(model)};
  };
  const auto [seen0, base] = train(0);
  EXPECT_EQ(seen0, std::vector<int>(6, 0)) << name;
  // Three hooks per backward: after block 3 one reduction is in flight, after blocks 2 and 1 as
  // many as the limit allows.
  const std::vector<int> one(6, 1), two{1, 2, 2, 1, 2, 2};
  const bool overlaps_by_default = strategy == ShardingStrategy::NO_SHARD;
  for (const auto& [inflight, want] : std::vector<std::pair<std::optional<int>, std::vector<int>>>{
           {1, one}, {2, two}, {std::nullopt, overlaps_by_default ? one : seen0}}) {
    const std::string limit = inflight ? std::to_string(*inflight) : "unset";
    const auto [seen, got] = train(inflight);
    EXPECT_EQ(seen, want) << name << " limit " << limit;
    for (const auto& [k, v] : base) {
      EXPECT_TRUE(torch::equal(got.at(k), v)) << k << " " << name << " limit " << limit << " diff "
                                              << (got.at(k) - v).abs().max().item<float>();
    }
  }
}

TEST(FsdpRuntime, GradientReductionOverlapsTheNextUnitsBackward) {
  run_ranks(2, [](ProcessGroup& pg) {
    for (auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP,
                          ShardingStrategy::NO_SHARD}) {
      expect_overlapped_reductions(pg, strategy);
    }
  });
  // HYBRID_SHARD: the replicas' all-reduce follows each shard group's reduce-scatter at the finish.
  run_ranks(4, [](ProcessGroup& pg) {
    expect_overlapped_reductions(pg, ShardingStrategy::HYBRID_SHARD);
  });
}

}  // namespace

namespace {

// An evaluation forward (grad mode on, no backward) between steps must not leave stale gradients
// that leak into the next step.
TEST(FsdpRuntime, ForwardWithoutBackwardBetweenStepsLeavesNoStaleGradients) {
  run_ranks(2, [](ProcessGroup& pg) {
    auto train = [&](bool eval_between) {
      TinyLM m(13);
      FullyShardedDataParallel model(m, lm_options(m).use_orig_params(true));
      torch::optim::SGD opt(fsdp::testing::unique_params(model->parameters()), 0.3);
      for (int step = 0; step < 3; ++step) {
        opt.zero_grad();
        auto idx = lm_tokens(2, 70 + step + 10 * pg.rank());
        lm_loss(model->forward(idx), idx).backward();
        opt.step();
        if (eval_between) model->forward(lm_tokens(2, 5));  // no backward
      }
      return full_params(model);
    };
    const auto plain = train(false);
    const auto with_eval = train(true);
    for (const auto& [k, v] : plain) EXPECT_TRUE(torch::equal(with_eval.at(k), v)) << k;
  });
}

struct TwiceImpl : torch::nn::Module {
  fsdp::testing::Block block{nullptr};
  torch::nn::Linear out{nullptr};
  TwiceImpl() {
    fsdp::testing::seed_cpu(14);
    block = register_module("block", fsdp::testing::Block(6, 7));
    out = register_module("out", torch::nn::Linear(6, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = fsdp::forward(block, x);
    h = fsdp::forward(block, h);  // the same unit twice in one step
    return out(h);
  }
};
TORCH_MODULE(Twice);

// Under mixed precision every reshard changes the parameters' dtype, so the second use of a unit
// gets new AccumulateGrad nodes; the unit must wait for all of them before reducing.
TEST(FsdpRuntime, UnitUsedTwicePerStepUnderMixedPrecision) {
  auto run = [](ProcessGroup& pg, int rows, bool drop = false) {
    Twice m;
    FullyShardedDataParallel model(
        m, FullyShardedOptions()
               .units({m->block.ptr()})
               .use_orig_params(true)
               .mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16)));
    torch::optim::SGD opt(model->parameters(), 0.1);
    for (int step = 0; step < 2; ++step) {
      opt.zero_grad();
      auto x = seeded_randn({4, 6}, 300 + step).narrow(0, pg.rank() * rows, rows);
      auto loss = model->forward(x).to(at::kFloat).pow(2).mean();
      if (drop && pg.rank() == 1) loss = loss * 0;
      loss.backward();
      opt.step();
      for (auto* h : model->handles()) EXPECT_EQ(h->unsharded_storage_bytes(), 0);
    }
    return full_params(model);
  };
  fsdp::testing::TempDir tmp;
  const std::string file = tmp.file("single.pt");
  run_ranks(1, [&](ProcessGroup& pg) {
    auto got = run(pg, 4);
    std::vector<torch::Tensor> vals;
    for (auto& [k, v] : got) vals.push_back(v);
    torch::save(vals, file);
  });
  run_ranks(2, [&](ProcessGroup& pg) {
    std::vector<torch::Tensor> ref;
    torch::load(ref, file);
    auto worst = [&](const std::map<std::string, torch::Tensor>& got) {
      double w = 0;
      size_t i = 0;
      for (auto& [k, v] : got) w = std::max(w, (v - ref.at(i++)).abs().max().item<double>());
      return w;
    };
    const double ok = worst(run(pg, 2));
    const double dropped = worst(run(pg, 2, /*drop=*/true));
    if (pg.rank() == 0)
      std::printf("unit used twice: worst %.3g, dropped gradient %.3g\n", ok, dropped);
    EXPECT_LE(ok, kMixedPrecisionTwiceTol);
    EXPECT_GT(dropped, kMixedPrecisionTwiceTol);
  });
}

}  // namespace
