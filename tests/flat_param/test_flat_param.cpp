// FlatParamHandle over real Gloo processes at world sizes 1-4: round trips, storage accounting,
// gradient reduction against a computed average, mixed precision, offload, write-back, errors.
#include <gtest/gtest.h>
#include <signal.h>

#include <thread>

#include "flat_param_model.h"
#include "fsdp/errors.h"
#include "fsdp/flat_param.h"
#include "memory_watch.h"
#include "multi_rank.h"

using fsdp::FlatParamHandle;
using fsdp::FlatParamHandleOptions;
using fsdp::ShardingStrategy;
using fsdp::dist::ProcessGroup;
using fsdp::testing::Net;
using fsdp::testing::run_ranks;
using fsdp::testing::seeded_randn;

namespace {

struct Config {
  int world;
  ShardingStrategy strategy;
  bool use_orig_params;
  bool offload;
};

std::string config_name(const ::testing::TestParamInfo<Config>& info) {
  const Config& c = info.param;
  return "W" + std::to_string(c.world) + "_" + fsdp::to_string(c.strategy) +
         (c.use_orig_params ? "_orig" : "_flat") + (c.offload ? "_offload" : "");
}

FlatParamHandleOptions options_for(const Config& c) {
  return FlatParamHandleOptions()
      .sharding_strategy(c.strategy)
      .use_orig_params(c.use_orig_params)
      .offload_params(c.offload);
}

// The gradient rank r feeds in for parameter i: distinct per rank and parameter, reproducible on
// every rank without communication.
at::Tensor grad_for(int rank, size_t i, at::IntArrayRef shape) {
  return seeded_randn(shape, 1000 + 37 * rank + i);
}

class FlatParamRoundTrip : public ::testing::TestWithParam<Config> {};

TEST_P(FlatParamRoundTrip, ShardUnshardReproducesEveryParameterBitExactly) {
  const Config cfg = GetParam();
  run_ranks(cfg.world, [cfg](ProcessGroup& pg) {
    Net net(/*seed=*/7);
    auto before = fsdp::testing::snapshot(*net);
    FlatParamHandle h(fsdp::collect_params(net.ptr()), pg, options_for(cfg));

    ASSERT_EQ(h.param_infos().size(), 6u);  // 7 FQNs, one of them a tie
    ASSERT_EQ(h.shared_param_infos().size(), 1u);
    EXPECT_EQ(h.shared_param_infos()[0].module_name, "head");
    EXPECT_EQ(h.shared_param_infos()[0].prim_module_name, "lin");
    const bool sharded = cfg.strategy != ShardingStrategy::NO_SHARD;
    EXPECT_EQ(h.unsharded_storage_bytes(), 0);
    EXPECT_EQ(h.flat_param().device().type(), at::kCPU);

    // The shard is this rank's torch.chunk of the flattened parameters, zero-padded.
    const auto& l = h.layout();
    EXPECT_EQ(h.flat_param().numel(), l.sharded_numel);
    if (sharded) {
      for (size_t i = 0; i < h.param_infos().size(); ++i) {
        const auto& s = h.shard_param_infos()[i];
        if (!s.in_shard) continue;
        auto expect = before[0].second;  // placeholder, replaced below
        for (const auto& [fqn, t] : before)
          if (fqn == l.fqns[i]) expect = t;
        ASSERT_TRUE(
            at::equal(h.flat_param().narrow(0, s.offset_in_shard, s.numel_in_shard),
                      expect.reshape({-1}).narrow(0, s.intra_param_start_idx, s.numel_in_shard)))
            << l.fqns[i];
        if (cfg.use_orig_params) {
          // Between unshards the original parameter is a 1-D view of its piece of the shard.
          ASSERT_TRUE(h.orig_params()[i].is_alias_of(h.flat_param())) << l.fqns[i];
          ASSERT_EQ(h.orig_params()[i].numel(), s.numel_in_shard);
        }
      }
    }

    for (int round = 0; round < 2; ++round) {
      h.unshard();
      EXPECT_TRUE(h.is_unsharded());
      if (sharded) {
        EXPECT_EQ(h.unsharded_storage_bytes(), l.padded_unsharded_numel * 4);
      }
      auto after = fsdp::testing::snapshot(*net);
      ASSERT_EQ(after.size(), before.size());
      for (size_t i = 0; i < before.size(); ++i) {
        EXPECT_EQ(after[i].first, before[i].first);
        EXPECT_EQ(after[i].second.sizes(), before[i].second.sizes()) << before[i].first;
        EXPECT_TRUE(at::equal(after[i].second, before[i].second)) << before[i].first;
      }
      EXPECT_TRUE(net->head->tied.is_same(net->lin->weight));
      h.reshard();
      EXPECT_FALSE(h.is_unsharded());
      EXPECT_EQ(h.unsharded_storage_bytes(), 0);
    }
  });
}

TEST_P(FlatParamRoundTrip, ReducedGradientIsTheAverageNarrowedToTheShard) {
  const Config cfg = GetParam();
  run_ranks(cfg.world, [cfg](ProcessGroup& pg) {
    Net net(3);
    FlatParamHandle h(fsdp::collect_params(net.ptr()), pg, options_for(cfg));
    const auto& l = h.layout();
    // Expected unsharded flat gradient: average of every rank's gradients, zeros at padding.
    at::Tensor avg = at::zeros({l.padded_unsharded_numel});
    for (int r = 0; r < pg.size(); ++r) {
      for (size_t i = 0; i < l.fqns.size(); ++i) {
        avg.narrow(0, l.param_offset(i), l.numels[i])
            .add_(grad_for(r, i, l.shapes[i]).reshape({-1}));
      }
    }
    avg.div_(pg.size());
    const int64_t start =
        cfg.strategy == ShardingStrategy::NO_SHARD ? 0 : pg.rank() * l.sharded_numel;
    at::Tensor expect = avg.narrow(0, start, l.sharded_numel);

    for (int step = 1; step <= 2; ++step) {
      h.unshard();
      auto params = h.orig_params();
      for (size_t i = 0; i < params.size(); ++i)
        params[i].mutable_grad() = grad_for(pg.rank(), i, l.shapes[i]);
      h.reduce_grad();
      h.reshard();
      at::Tensor g = h.sharded_grad();
      ASSERT_TRUE(g.defined());
      EXPECT_EQ(g.device().type(), at::kCPU);
      // Pre/post-division and the reduction order change the last bits: fp32 tolerance.
      EXPECT_TRUE(at::allclose(g, expect * step, 1e-5, 1e-6))
          << "step " << step << " max diff " << (g - expect * step).abs().max().item<float>();
      if (cfg.use_orig_params) {
        for (size_t i = 0; i < params.size(); ++i) {
          const auto& s = h.shard_param_infos()[i];
          if (!s.in_shard || s.numel_in_shard == 0) continue;
          ASSERT_TRUE(params[i].grad().defined()) << l.fqns[i];
          EXPECT_TRUE(params[i].grad().is_alias_of(g)) << l.fqns[i];
        }
      } else {
        for (const auto& p : params) EXPECT_FALSE(p.grad().defined());
      }
    }
  });
}

// The flat gradient is written without zero-filling it first (take_orig_grads): gaps, padding and
// parameters without a gradient must still reduce to exactly zero, and every parameter's gradient
// is released. The buffer is allocated right after a NaN-filled one of the same size is freed, so
// that stale memory would show (a negative control: zero-filling nothing makes this fail).
TEST(FlatParamHandle, ParametersWithoutAGradientGapsAndPaddingReduceToZero) {
  for (bool orig : {false, true}) {
    run_ranks(3, [orig](ProcessGroup& pg) {
      Net net(3);
      FlatParamHandle h(fsdp::collect_params(net.ptr()), pg,
                        FlatParamHandleOptions().use_orig_params(orig));
      const auto& l = h.layout();
      const size_t skipped = 1;  // this parameter gets no gradient on any rank
      at::Tensor sum = at::zeros({l.padded_unsharded_numel});
      for (int r = 0; r < pg.size(); ++r)
        for (size_t i = 0; i < l.fqns.size(); ++i)
          if (i != skipped)
            sum.narrow(0, l.param_offset(i), l.numels[i])
                .add_(grad_for(r, i, l.shapes[i]).reshape({-1}));
      const at::Tensor expect =
          (sum / pg.size()).narrow(0, pg.rank() * l.sharded_numel, l.sharded_numel);
      h.unshard();
      auto params = h.orig_params();
      for (size_t i = 0; i < params.size(); ++i)
        if (i != skipped) params[i].mutable_grad() = grad_for(pg.rank(), i, l.shapes[i]);
      { at::Tensor stale = at::full({l.padded_unsharded_numel}, NAN); }
      h.reduce_grad();
      const at::Tensor g = h.sharded_grad();
      ASSERT_TRUE(g.defined());
      EXPECT_FALSE(at::isnan(g).any().item<bool>()) << "stale memory reached the gradient";
      EXPECT_TRUE(at::allclose(g, expect, 1e-5, 1e-6))
          << "max diff " << (g - expect).abs().max().item<float>();
      if (!orig) {
        for (size_t i = 0; i < params.size(); ++i) {
          EXPECT_FALSE(params[i].grad().defined()) << i;
        }
      }
      h.reshard();
    });
  }
}

// The runtime's post-backward reshards and then reduces. On the CPU the flat gradient is then built
// in the memory the unsharded parameters just gave up (already faulted in, the same size): no
// allocation, the right values, and a view of the parameters kept from before (as autograd keeps
// saved tensors under retain_graph) is left without memory rather than showing the gradient.
// Outside post-backward, or where the parameters' dtype is narrower than the reduce dtype, the
// gradient gets memory of its own.
TEST(FlatParamHandle, PostBackwardReshardHandsTheParametersMemoryToTheFlatGradient) {
  run_ranks(3, [](ProcessGroup& pg) {
    using State = fsdp::HandleTrainingState;
    struct Case {
      const char* name;
      State state;
      bool leave_state_first;  // BACKWARD_POST left before the gradient is built
      at::ScalarType param_dtype;
      bool reuses;
    };
    for (const Case& c :
         {Case{"post-backward", State::BACKWARD_POST, false, at::kFloat, true},
          Case{"idle", State::IDLE, false, at::kFloat, false},
          Case{"post-backward left", State::BACKWARD_POST, true, at::kFloat, false},
          Case{"bf16 params, f32 reduce", State::BACKWARD_POST, false, at::kBFloat16, false}}) {
      Net net(3);
      FlatParamHandle h(
          fsdp::collect_params(net.ptr()), pg,
          FlatParamHandleOptions().param_dtype(c.param_dtype).reduce_dtype(at::kFloat));
      const auto& l = h.layout();
      h.unshard();
      auto params = h.orig_params();
      for (size_t i = 0; i < params.size(); ++i)
        params[i].mutable_grad() = grad_for(pg.rank(), i, l.shapes[i]).to(c.param_dtype);
      const at::Tensor kept = params[0].detach();  // a view of the unsharded parameters
      h.set_training_state(c.state);
      at::Tensor flat;
      int64_t allocated = 0;
      {
        fsdp::testing::MemoryWatch watch;
        h.reshard();
        if (c.leave_state_first) h.set_training_state(State::IDLE);
        flat = h.take_orig_grads();
        allocated = watch.peak();
      }
      h.set_training_state(State::IDLE);
      EXPECT_EQ(allocated, c.reuses ? 0 : l.padded_unsharded_numel * 4)
          << c.name << ", rank " << pg.rank();
      EXPECT_EQ(kept.storage().nbytes(), 0u) << c.name << ": a stale view kept memory";
      ASSERT_EQ(flat.numel(), l.padded_unsharded_numel);
      at::Tensor expect = at::zeros({l.padded_unsharded_numel});
      for (size_t i = 0; i < params.size(); ++i) {
        expect.narrow(0, l.param_offset(i), l.numels[i])
            .copy_(grad_for(pg.rank(), i, l.shapes[i]).to(c.param_dtype).reshape({-1}));
        EXPECT_FALSE(params[i].grad().defined()) << c.name << ", " << l.fqns[i];
      }
      EXPECT_TRUE(at::equal(flat, expect)) << c.name << ", rank " << pg.rank();
    }
  });
}

std::vector<Config> round_trip_configs() {
  std::vector<Config> out;
  for (int w : {1, 2, 3, 4}) {
    for (bool orig : {false, true}) {
      out.push_back({w, ShardingStrategy::FULL_SHARD, orig, false});
    }
  }
  out.push_back({3, ShardingStrategy::FULL_SHARD, false, true});
  out.push_back({2, ShardingStrategy::FULL_SHARD, true, true});
  out.push_back({3, ShardingStrategy::NO_SHARD, false, false});
  out.push_back({2, ShardingStrategy::NO_SHARD, true, false});
  out.push_back({4, ShardingStrategy::SHARD_GRAD_OP, true, false});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Configs, FlatParamRoundTrip, ::testing::ValuesIn(round_trip_configs()),
                         config_name);

// The whole point: autograd through the module's own forward, with parameters that are views into
// the unsharded flat parameter, then reduce-scatter, equals averaging per-rank gradients.
TEST(FlatParamHandle, AutogradThroughUnshardedViewsMatchesDataParallelAverage) {
  run_ranks(3, [](ProcessGroup& pg) {
    Net ref(11);
    std::vector<at::Tensor> inputs;
    for (int r = 0; r < pg.size(); ++r) inputs.push_back(seeded_randn({4, 3}, 50 + r));
    // Reference: gradient of each rank's loss on the unwrapped model, averaged.
    for (const auto& x : inputs) ref->loss(x).backward();
    Net net(11);
    FlatParamHandle h(fsdp::collect_params(net.ptr()), pg);
    h.unshard();
    net->loss(inputs[pg.rank()]).backward();
    h.reduce_grad();
    h.reshard();
    at::Tensor full = at::empty({h.layout().padded_unsharded_numel});
    pg.all_gather_into_tensor(full, h.sharded_grad());
    const auto& l = h.layout();
    auto ref_params = ref->named_parameters();
    for (size_t i = 0; i < l.fqns.size(); ++i) {
      at::Tensor expect = ref_params[l.fqns[i]].grad();
      if (!expect.defined()) expect = at::zeros(l.shapes[i]);
      at::Tensor got = full.narrow(0, l.param_offset(i), l.numels[i]).view(l.shapes[i]);
      EXPECT_TRUE(at::allclose(got, expect / pg.size(), 1e-5, 1e-6)) << l.fqns[i];
    }
  });
}

TEST(FlatParamHandle, MixedPrecisionGathersLowPrecisionAndSummonsFullPrecision) {
  run_ranks(2, [](ProcessGroup& pg) {
    Net net(5);
    auto before = fsdp::testing::snapshot(*net);
    FlatParamHandle h(fsdp::collect_params(net.ptr()), pg,
                      FlatParamHandleOptions().param_dtype(at::kBFloat16));
    EXPECT_EQ(h.compute_dtype(), at::kBFloat16);
    EXPECT_EQ(h.reduce_dtype(), at::kBFloat16);  // inferred from param_dtype, as in PyTorch
    EXPECT_EQ(h.flat_param().scalar_type(), at::kFloat);
    h.unshard();
    EXPECT_EQ(h.unsharded_storage_bytes(), h.layout().padded_unsharded_numel * 2);
    auto low = fsdp::testing::snapshot(*net);
    for (size_t i = 0; i < before.size(); ++i) {
      EXPECT_EQ(low[i].second.scalar_type(), at::kBFloat16) << low[i].first;
      EXPECT_TRUE(at::equal(low[i].second, before[i].second.to(at::kBFloat16))) << low[i].first;
    }
    auto params = h.orig_params();
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].mutable_grad() = at::ones_like(params[i]);  // bf16, like autograd would produce
    }
    h.reduce_grad();
    h.reshard();
    EXPECT_EQ(h.unsharded_storage_bytes(), 0);
    EXPECT_EQ(h.sharded_grad().scalar_type(), at::kFloat);  // cast back to the parameter dtype

    h.set_training_state(fsdp::HandleTrainingState::SUMMON_FULL_PARAMS);
    h.unshard();
    auto full = fsdp::testing::snapshot(*net);
    for (size_t i = 0; i < before.size(); ++i) {
      EXPECT_EQ(full[i].second.scalar_type(), at::kFloat);
      EXPECT_TRUE(at::equal(full[i].second, before[i].second)) << full[i].first;
    }
    // Edit the full parameters and write them back into the shards.
    {
      at::NoGradGuard g;
      net->odd.fill_(2.5);
    }
    h.writeback_unsharded();
    h.reshard();
    h.set_training_state(fsdp::HandleTrainingState::IDLE);
    h.unshard();
    EXPECT_TRUE(at::equal(net->odd, at::full({7}, 2.5, at::kBFloat16)));
    h.reshard();
  });
}

TEST(FlatParamHandle, KeepLowPrecisionGradsKeepsTheShardedGradientInParamDtype) {
  run_ranks(2, [](ProcessGroup& pg) {
    Net net(5);
    FlatParamHandle h(fsdp::collect_params(net.ptr()), pg,
                      FlatParamHandleOptions()
                          .param_dtype(at::kHalf)
                          .reduce_dtype(at::kFloat)
                          .keep_low_precision_grads(true));
    EXPECT_EQ(h.reduce_dtype(), at::kFloat);
    h.unshard();
    for (auto& p : h.orig_params()) p.mutable_grad() = at::full_like(p, 0.5);
    h.reduce_grad();
    h.reshard();
    EXPECT_EQ(h.sharded_grad().scalar_type(), at::kHalf);
  });
}

TEST(FlatParamHandle, ShardGradOpKeepsUnshardedStorageUntilFreed) {
  run_ranks(2, [](ProcessGroup& pg) {
    Net net(1);
    FlatParamHandle h(fsdp::collect_params(net.ptr()), pg,
                      FlatParamHandleOptions().sharding_strategy(ShardingStrategy::SHARD_GRAD_OP));
    h.unshard_async();
    h.wait_unshard();
    const int64_t bytes = h.unsharded_storage_bytes();
    EXPECT_GT(bytes, 0);
    h.reshard(/*free_unsharded=*/false);
    EXPECT_EQ(h.unsharded_storage_bytes(), bytes);
    h.unshard();  // reuses the kept buffer
    EXPECT_EQ(net->odd.numel(), 7);
    h.reshard(true);
    EXPECT_EQ(h.unsharded_storage_bytes(), 0);
  });
}

// Under NO_SHARD the parameters are left alone when they already view the flat parameter where
// they should (re-pointing them every forward cost most of NO_SHARD's CPU time on models of many
// small units). That check must still catch every way of pointing elsewhere: other memory, the
// right memory at another offset, the right offset in another shape.
TEST(FlatParamHandle, NoShardPointsStrayParametersBackAtTheFlatParameter) {
  run_ranks(2, [](ProcessGroup& pg) {
    Net net(4);
    FlatParamHandle h(fsdp::collect_params(net.ptr()), pg,
                      FlatParamHandleOptions().sharding_strategy(ShardingStrategy::NO_SHARD));
    const auto& l = h.layout();
    auto params = net->named_parameters();
    auto points_home = [&](const std::string& fqn) {
      const size_t i = std::find(l.fqns.begin(), l.fqns.end(), fqn) - l.fqns.begin();
      const at::Tensor& p = params[fqn];
      const at::Tensor& flat = h.flat_param();
      return p.storage().is_alias_of(flat.storage()) && p.sizes() == l.shapes[i] &&
             p.storage_offset() == flat.storage_offset() + l.param_offset(i);
    };
    auto stray = [&] {
      const at::NoGradGuard no_grad;
      const at::Tensor lin_w = net->lin->weight.detach();
      net->odd.set_data(net->odd.detach().clone());   // other memory
      net->lin->weight.set_data(lin_w.view({3, 5}));  // the right offset in another shape
      net->head->w.set_data(lin_w);                   // another offset (lin.weight's)
      ASSERT_FALSE(points_home("odd"));
      ASSERT_FALSE(points_home("lin.weight"));
      ASSERT_FALSE(points_home("head.w"));
    };
    const std::vector<std::string> names{"scalar",     "empty",    "odd",
                                         "lin.weight", "lin.bias", "head.w"};
    for (const auto& n : names) EXPECT_TRUE(points_home(n)) << n << " after wrapping";
    stray();
    h.unshard();
    for (const auto& n : names) EXPECT_TRUE(points_home(n)) << n << " after unshard";
    stray();
    h.reshard();
    for (const auto& n : names) EXPECT_TRUE(points_home(n)) << n << " after reshard";
    // A step through the parameters pointed back reaches the flat gradient.
    h.unshard();
    net->loss(seeded_randn({4, 3}, 9)).backward();
    h.reduce_grad();
    h.reshard();
    ASSERT_TRUE(h.sharded_grad().defined());
    EXPECT_GT(h.sharded_grad().abs().sum().item<double>(), 0);
  });
}

TEST(FlatParamHandle, HybridShardAveragesAcrossBothGroups) {
  run_ranks(4, [](ProcessGroup& pg) {
    auto groups = fsdp::dist::make_hybrid_groups(pg, 2);
    Net net(2);
    FlatParamHandle h(fsdp::collect_params(net.ptr()), groups.shard,
                      FlatParamHandleOptions()
                          .sharding_strategy(ShardingStrategy::HYBRID_SHARD)
                          .replicate_group(groups.replicate));
    EXPECT_EQ(h.world_size(), 2);
    EXPECT_EQ(h.gradient_predivide_factor() * h.gradient_postdivide_factor(), 4.0);
    h.unshard();
    for (auto& p : h.orig_params()) p.mutable_grad() = at::full_like(p, pg.rank() + 1.0);
    h.reduce_grad();
    h.reshard();
    // Mean of 1, 2, 3, 4 over all four ranks, wherever this rank's shard has real data.
    const int64_t have = h.layout().sharded_numel - h.shard_numel_padded();
    EXPECT_TRUE(at::allclose(h.sharded_grad().narrow(0, 0, have), at::full({have}, 2.5f)));
  });
}

// reduce_grad_async(): the gradients are taken at once, the sharded gradient changes only when
// the reduction is finished (by finish_reduce_grad() or by the next call that touches gradients),
// and the result is bit-identical to reduce_grad()'s.
TEST(FlatParamHandle, AsyncReductionLandsWhenFinished) {
  run_ranks(2, [](ProcessGroup& pg) {
    for (auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::NO_SHARD}) {
      const auto opts = FlatParamHandleOptions().sharding_strategy(strategy).use_orig_params(true);
      Net net_sync(3), net_async(3);
      FlatParamHandle sync(fsdp::collect_params(net_sync.ptr()), pg, opts);
      FlatParamHandle async(fsdp::collect_params(net_async.ptr()), pg, opts);
      const auto& l = sync.layout();
      auto feed = [&](FlatParamHandle& h, int step) {
        h.unshard();
        auto params = h.orig_params();
        for (size_t i = 0; i < params.size(); ++i)
          params[i].mutable_grad() = grad_for(pg.rank() + 2 * step, i, l.shapes[i]);
      };
      for (int step = 0; step < 2; ++step) {
        feed(sync, step);
        sync.reduce_grad();
        sync.reshard();
        feed(async, step);
        const at::Tensor before =
            async.sharded_grad().defined() ? async.sharded_grad().clone() : at::Tensor();
        async.reduce_grad_async();
        EXPECT_TRUE(async.has_pending_reduce_grad());
        for (const auto& p : async.orig_params()) EXPECT_FALSE(p.grad().defined());  // taken
        // Not landed yet: the first step has no sharded gradient, the second the first's.
        EXPECT_EQ(async.sharded_grad().defined(), before.defined());
        if (before.defined()) {
          EXPECT_TRUE(torch::equal(async.sharded_grad(), before));
        }
        async.reshard();
        // Step 0 finishes explicitly; step 1 through the next gradient call.
        if (step == 0) {
          async.finish_reduce_grad();
        } else {
          async.prepare_grads_for_backward();
        }
        EXPECT_FALSE(async.has_pending_reduce_grad());
        ASSERT_TRUE(async.sharded_grad().defined());
        EXPECT_TRUE(torch::equal(async.sharded_grad(), sync.sharded_grad()))
            << fsdp::to_string(strategy) << " step " << step;
        async.finish_reduce_grad();  // nothing pending: a no-op
      }
    }
  });
}

TEST(FlatParamHandle, WritebackOfReplacedParametersAndGradients) {
  run_ranks(2, [](ProcessGroup& pg) {
    Net net(9);
    const at::Tensor weight_before = net->lin->weight.detach().clone();
    FlatParamHandle h(fsdp::collect_params(net.ptr()), pg,
                      FlatParamHandleOptions().use_orig_params(true));
    const auto& l = h.layout();
    const size_t odd = 2;  // scalar, empty, odd, lin.weight, lin.bias, head.w
    ASSERT_EQ(l.fqns[odd], "odd");
    const auto& s = h.shard_param_infos()[odd];
    at::Tensor p = h.orig_params()[odd];
    if (s.in_shard) {
      // Replaced: new storage, so the shard no longer sees it until written back.
      p.set_data(at::full({s.numel_in_shard}, 100.0f + pg.rank()));
      EXPECT_FALSE(p.is_alias_of(h.flat_param()));
      p.mutable_grad() = at::full({s.numel_in_shard}, 3.0f);
    }
    // In place through the view: the shard sees it at once (no write-back needed).
    {
      at::NoGradGuard g;
      if (h.shard_param_infos()[3].in_shard) h.orig_params()[3].add_(1000.0);
    }
    bool wrote = h.writeback_orig_params();
    EXPECT_EQ(wrote, s.in_shard);
    if (s.in_shard) {
      EXPECT_TRUE(h.orig_params()[odd].is_alias_of(h.flat_param()));
      EXPECT_TRUE(at::equal(h.sharded_grad().narrow(0, s.offset_in_shard, s.numel_in_shard),
                            at::full({s.numel_in_shard}, 3.0f)));
    }
    h.unshard();
    // Every element of `odd` now holds 100 + the rank that owns it.
    for (int64_t e = 0; e < 7; ++e) {
      const int64_t flat_index = l.param_offset(odd) + e;
      const int owner = static_cast<int>(flat_index / l.sharded_numel);
      EXPECT_EQ(net->odd[e].item<float>(), 100.0f + owner) << e;
    }
    // Each element of lin.weight lies in exactly one rank's shard, and that rank added 1000.
    EXPECT_TRUE(at::equal(net->lin->weight, weight_before + 1000.0));
    h.reshard();

    // A shape change cannot be written back.
    if (s.in_shard) {
      h.orig_params()[odd].set_data(at::zeros({s.numel_in_shard + 1}));
      EXPECT_THROW(h.writeback_orig_params(), fsdp::ValueError);
    }
  });
}

TEST(FlatParamHandle, ErrorsNameTheParameter) {
  run_ranks(1, [](ProcessGroup& pg) {
    auto expect_error = [](auto&& fn, const std::string& needle) {
      try {
        fn();
        ADD_FAILURE() << "expected ValueError mentioning " << needle;
      } catch (const fsdp::ValueError& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
    };
    {  // mixed dtypes
      auto m = std::make_shared<torch::nn::Module>();
      m->register_parameter("a", torch::ones({2}));
      m->register_parameter("b", torch::ones({2}, torch::kDouble));
      expect_error([&] { FlatParamHandle h(fsdp::collect_params(m), pg); }, "'b'");
    }
    {  // integer tensors
      auto m = std::make_shared<torch::nn::Module>();
      m->register_parameter("steps", torch::ones({2}, torch::kLong), /*requires_grad=*/false);
      expect_error([&] { FlatParamHandle h(fsdp::collect_params(m), pg); }, "'steps'");
    }
    {  // non-uniform requires_grad without use_orig_params; fine with it
      auto m = std::make_shared<torch::nn::Module>();
      m->register_parameter("train", torch::ones({2}));
      m->register_parameter("frozen", torch::ones({2}), /*requires_grad=*/false);
      expect_error([&] { FlatParamHandle h(fsdp::collect_params(m), pg); }, "'frozen'");
      FlatParamHandle ok(fsdp::collect_params(m), pg,
                         FlatParamHandleOptions().use_orig_params(true));
      EXPECT_TRUE(ok.flat_param().requires_grad());
    }
    {  // flattening twice, and flattening a flat parameter
      Net net(0);
      FlatParamHandle h(fsdp::collect_params(net.ptr()), pg);
      EXPECT_TRUE(fsdp::collect_params(net.ptr()).empty());  // already owned: skipped
      std::vector<fsdp::ParamInfo> again{{"odd", net.ptr(), ""}};
      expect_error([&] { FlatParamHandle h2(again, pg); }, "'odd'");
      auto holder = std::make_shared<torch::nn::Module>();
      holder->register_parameter("flat", h.flat_param());
      EXPECT_TRUE(fsdp::collect_params(holder).empty());
      std::vector<fsdp::ParamInfo> flat{{"flat", holder, ""}};
      expect_error([&] { FlatParamHandle h3(flat, pg); }, "FlatParameter: 'flat'");
    }
    expect_error([&] { FlatParamHandle h({}, pg); }, "non-empty");
  });
}

TEST(FlatParamHandle, RanksThatDisagreeOnTheModelAllRaiseNamingTheParameter) {
  run_ranks(3, [](ProcessGroup& pg) {
    auto m = std::make_shared<torch::nn::Module>();
    m->register_parameter("same", torch::ones({4}));
    m->register_parameter("differs", torch::ones({pg.rank() == 2 ? 6 : 5}));
    try {
      FlatParamHandle h(fsdp::collect_params(m), pg);
      ADD_FAILURE() << "expected ValueError";
    } catch (const fsdp::ValueError& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find("differs"), std::string::npos) << msg;
      EXPECT_NE(msg.find("rank 2"), std::string::npos) << msg;
    }
    pg.barrier();  // every rank raised and the group is still usable: nobody hangs
  });
}

}  // namespace

namespace {

// The failure tests: two ranks, of which rank 1 is SIGKILLed by kill_rank_one_soon in the middle
// of a collective; rank 0 must see the failure and pass its checks.
void run_with_rank_one_killed(const fsdp::testing::RankBody& body) {
  fsdp::testing::RunOptions opts;
  opts.collective_timeout = std::chrono::milliseconds(10000);  // not to expire during start-up
  opts.grace = 4 * opts.collective_timeout;
  opts.report = false;
  auto results = run_ranks(2, body, opts);
  EXPECT_TRUE(results[0].ok) << results[0].message;
  EXPECT_FALSE(results[1].ok);
}

// On rank 1: dies half a second from now, once rank 0 has entered its next collective.
void kill_rank_one_soon(const ProcessGroup& pg) {
  if (pg.rank() != 1) return;
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  ::raise(SIGKILL);
}

}  // namespace

// After an unshard's collective fails (a peer died), the backend may still write into the
// unsharded buffer: reshard must not free it, and the handle refuses further unshards instead of
// starting another gather into the same memory.
TEST(FlatParamFailure, FailedUnshardKeepsItsBufferAndRefusesMore) {
  run_with_rank_one_killed([](ProcessGroup& pg) {
    Net net(5);
    FlatParamHandle h(fsdp::collect_params(net.ptr()), pg, FlatParamHandleOptions());
    kill_rank_one_soon(pg);  // rank 0 has finished init and is about to gather
    EXPECT_THROW(h.unshard(), fsdp::DistError);
    EXPECT_TRUE(h.comm_failed());
    h.reshard(true);
    EXPECT_GT(h.unsharded_storage_bytes(), 0) << "a buffer a failed gather targets was freed";
    EXPECT_THROW(h.unshard(), fsdp::StateError);
  });
}

// A reduction whose collective failed is never landed by a later call that finishes pending
// reductions (its buffers may still be written by the backend): that call refuses, as the next
// unshard does, and the sharded gradient stays as it was.
TEST(FlatParamFailure, FailedReductionIsNeverLandedLater) {
  run_with_rank_one_killed([](ProcessGroup& pg) {
    Net net(5);
    FlatParamHandle h(fsdp::collect_params(net.ptr()), pg, FlatParamHandleOptions());
    h.unshard();
    for (auto& p : h.orig_params()) p.mutable_grad() = at::ones_like(p);
    h.reshard(true);
    kill_rank_one_soon(pg);  // rank 0 is about to reduce
    h.reduce_grad_async();
    EXPECT_THROW(h.finish_reduce_grad(), fsdp::DistError);
    EXPECT_TRUE(h.comm_failed());
    EXPECT_TRUE(h.has_pending_reduce_grad()) << "buffers a failed reduction targets were freed";
    EXPECT_THROW(h.prepare_grads_for_backward(), fsdp::StateError);
    EXPECT_THROW(h.finish_reduce_grad(), fsdp::StateError);
    EXPECT_FALSE(h.sharded_grad().defined()) << "a failed reduction was landed";
  });
}
