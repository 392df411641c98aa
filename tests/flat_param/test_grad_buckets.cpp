// NO_SHARD's gradient buckets (FullyShardedOptions::bucket_cap_mb, DDP's Reducer over units):
// training with buckets of any size gives the gradients and weights of one all-reduce per unit
// (bit-identical where the arithmetic is: W <= 2, where each element's sum has one order), across
// world sizes 1-4, mixed precision, CPU offload, use_orig_params, no_sync, a frozen unit, a unit
// unused in some steps and a parameter that never gets a gradient; the sharded strategies ignore
// the option. A negative control (one unit's gradient left out of its bucket on one rank) must
// fail the same comparison.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <thread>

#include "flat_param/grad_bucket.h"
#include "fsdp/errors.h"
#include "fsdp/fully_sharded.h"
#include "memory_watch.h"
#include "multi_rank.h"
#include "tiny_lm.h"

using fsdp::FullyShardedDataParallel;
using fsdp::FullyShardedOptions;
using fsdp::ShardingStrategy;
using fsdp::dist::ProcessGroup;
using fsdp::testing::full_params;
using fsdp::testing::run_ranks;
using fsdp::testing::seeded_randn;

namespace {

// A block with a parameter that forward never uses: its slice of the flat gradient is zeros.
struct SpareBlockImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::Tensor spare;
  SpareBlockImpl(int64_t d, int64_t h) {
    fc1 = register_module("fc1", torch::nn::Linear(d, h));
    fc2 = register_module("fc2", torch::nn::Linear(h, d));
    spare = register_parameter("spare", torch::ones({3}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::tanh(fc1(x))); }
};
TORCH_MODULE(SpareBlock);

// Root: an input projection. Units: six blocks of different (odd) widths, a frozen projection
// between them, and a block used on odd steps only.
struct BucketNetImpl : torch::nn::Module {
  static constexpr int64_t kDim = 6;
  torch::nn::Linear in{nullptr}, frozen{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  SpareBlock rare{nullptr};
  BucketNetImpl() {
    fsdp::testing::seed_cpu(3);
    in = register_module("in", torch::nn::Linear(kDim, kDim));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t h : {5, 9, 3, 17, 7, 11}) blocks->push_back(SpareBlock(kDim, h));
    frozen = register_module("frozen", torch::nn::Linear(kDim, kDim));
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
    rare = register_module("rare", SpareBlock(kDim, 4));
  }
  torch::Tensor forward(const torch::Tensor& x, bool use_rare) {
    auto y = in(x);
    for (size_t i = 0; i < blocks->size(); ++i) {
      auto block = blocks->ptr<SpareBlockImpl>(i);
      y = fsdp::forward(block, y);
      if (i == 2) y = fsdp::forward(frozen, y);
    }
    if (use_rare) y = fsdp::forward(rare, y);
    return y;
  }
};
TORCH_MODULE(BucketNet);

// BucketNet's wrapping: every block a unit, `frozen` a unit of its own, the root the rest.
FullyShardedOptions bucket_net_options(ProcessGroup& pg, BucketNet& m, ShardingStrategy s,
                                       double cap_mb) {
  return FullyShardedOptions()
      .process_group(pg)
      .sharding_strategy(s)
      .bucket_cap_mb(cap_mb)
      .auto_wrap_policy(fsdp::module_type_auto_wrap_policy<SpareBlockImpl>())
      .units({m->frozen.ptr()});
}

struct Config {
  std::string name;
  ShardingStrategy strategy = ShardingStrategy::NO_SHARD;
  bool orig = false, offload = false, no_sync = false, mixed = false;
};

// Gradients after each backward (by handle, flat; use_orig_params: by parameter) and the final
// weights, for one bucket size.
struct Trace {
  std::vector<std::vector<at::Tensor>> grads;
  std::map<std::string, at::Tensor> weights;
};

// The negative control's fault: rank 1's buckets send zeros in place of their first unit's
// gradient, as a bucket that left that gradient out would (the gradient itself is intact).
void leave_first_gradient_out(const at::Tensor& buffer, const std::vector<int64_t>& offsets,
                              const std::vector<int64_t>& numels) {
  if (!numels.empty()) buffer.narrow(0, offsets[0], numels[0]).zero_();
}

Trace train(ProcessGroup& pg, const Config& c, double cap_mb, bool drop_one = false) {
  BucketNet m;
  auto options = bucket_net_options(pg, m, c.strategy, cap_mb).use_orig_params(c.orig);
  if (c.strategy == ShardingStrategy::HYBRID_SHARD)
    options.hybrid_shard_size(pg.size() % 2 == 0 ? 2 : 1);
  if (c.offload) options.cpu_offload(fsdp::CPUOffload().offload_params(true));
  if (c.mixed) {
    // bfloat16 compute, float16 reduction (float16 takes PyTorch's predivide before the sum).
    options.mixed_precision(
        fsdp::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kHalf));
  }
  struct Hook {
    explicit Hook(bool on) {
      if (on) fsdp::detail::GradBucket::set_launch_hook(leave_first_gradient_out);
    }
    ~Hook() { fsdp::detail::GradBucket::set_launch_hook(nullptr); }
  } hook(drop_one && pg.rank() == 1);
  FullyShardedDataParallel model(m, options);
  torch::optim::Adam opt(fsdp::testing::unique_params(model->parameters()), 1e-2);
  Trace t;
  auto loss = [&](int step, int micro) {
    auto x = seeded_randn({4, BucketNetImpl::kDim}, 100 * step + 10 * micro + pg.rank());
    return model->forward(x, step % 2 == 1).pow(2).mean();
  };
  for (int step = 0; step < 4; ++step) {
    opt.zero_grad();
    if (c.no_sync) {
      fsdp::NoSyncGuard guard(model);
      loss(step, 1).backward();
    }
    loss(step, 0).backward();
    std::vector<at::Tensor> g;
    if (c.orig) {
      for (const auto& p : model->named_parameters()) {
        if (p.value().grad().defined()) g.push_back(p.value().grad().clone());
      }
    } else {
      for (auto* h : model->handles()) {
        if (h && h->flat_param().grad().defined()) g.push_back(h->flat_param().grad().clone());
      }
    }
    t.grads.push_back(std::move(g));
    opt.step();
  }
  t.weights = full_params(model);
  return t;
}

// Largest element-wise difference between two traces (infinity where their shapes differ).
double max_diff(const Trace& a, const Trace& b) {
  double worst = 0;
  auto diff = [&](const at::Tensor& x, const at::Tensor& y) {
    if (!x.sizes().equals(y.sizes())) return worst = INFINITY;
    return worst =
               std::max(worst, (x.to(at::kDouble) - y.to(at::kDouble)).abs().max().item<double>());
  };
  if (a.grads.size() != b.grads.size()) return INFINITY;
  for (size_t s = 0; s < a.grads.size(); ++s) {
    if (a.grads[s].size() != b.grads[s].size()) return INFINITY;
    for (size_t i = 0; i < a.grads[s].size(); ++i) diff(a.grads[s][i], b.grads[s][i]);
  }
  for (const auto& [k, v] : a.weights) {
    if (!b.weights.count(k)) return INFINITY;
    diff(v, b.weights.at(k));
  }
  return worst;
}

// Bucket sizes: none (one all-reduce per unit), a few units per bucket (the model's units hold
// 50-250 float32 elements: about 0.2-1 KB), and everything in one bucket.
const std::vector<double> kCaps{0.0005, 0.002, 25};

// Over Gloo at W >= 3, how a buffer is split among the ranks decides the order of each element's
// sum, so a bucket may round differently from the unit alone: an ulp or a few of the reduce
// dtype at the gradients' magnitude (up to about 0.1 here). Measured worst (W=3-4, 4 Adam steps,
// gradients and weights): float32 1.2e-7, float16 reductions 6.1e-5 (one float16 ulp at 0.06).
constexpr double kReorderTol = 1e-6, kReorderTolHalf = 5e-4;

void expect_buckets_match(ProcessGroup& pg, const Config& c) {
  const Trace base = train(pg, c, 0);
  ASSERT_EQ(base.grads.size(), 4u);
  for (double cap : kCaps) {
    const double d = max_diff(train(pg, c, cap), base);
    const bool exact = pg.size() <= 2 || c.strategy != ShardingStrategy::NO_SHARD;
    if (exact) {
      EXPECT_EQ(d, 0.0) << c.name << " W=" << pg.size() << " cap " << cap << " MB";
    } else {
      EXPECT_LE(d, c.mixed ? kReorderTolHalf : kReorderTol)
          << c.name << " W=" << pg.size() << " cap " << cap << " MB";
      if (pg.rank() == 0) {
        std::printf("%s W=%d cap %g MB: max difference %.3g\n", c.name.c_str(), pg.size(), cap, d);
      }
    }
  }
}

const std::vector<Config>& configs() {
  static const std::vector<Config> all{
      {"plain"},
      {"use_orig_params", ShardingStrategy::NO_SHARD, true},
      {"cpu offload", ShardingStrategy::NO_SHARD, false, true},
      {"no_sync", ShardingStrategy::NO_SHARD, false, false, true},
      {"mixed precision", ShardingStrategy::NO_SHARD, false, false, false, true},
      {"orig + no_sync + offload", ShardingStrategy::NO_SHARD, true, true, true},
      {"FULL_SHARD (ignores buckets)", ShardingStrategy::FULL_SHARD},
      {"SHARD_GRAD_OP (ignores buckets)", ShardingStrategy::SHARD_GRAD_OP, true},
      {"HYBRID_SHARD (ignores buckets)", ShardingStrategy::HYBRID_SHARD},
  };
  return all;
}

TEST(GradBuckets, BucketedTrainingEqualsOneAllReducePerUnit) {
  for (int world : {1, 2, 3, 4}) {
    run_ranks(world, [](ProcessGroup& pg) {
      for (const Config& c : configs()) expect_buckets_match(pg, c);
    });
  }
}

// The comparison above can fail: a bucket that leaves one unit's gradient out (rank 1 sends zeros
// for it, while the gradient autograd computed is intact) moves the result by far more than the
// bound, whatever the bucket size.
TEST(GradBuckets, NegativeControlAGradientLeftOutIsCaught) {
  run_ranks(2, [](ProcessGroup& pg) {
    const Config c{"plain"};
    const Trace base = train(pg, c, 0);
    for (double cap : kCaps) {
      const double d = max_diff(train(pg, c, cap, /*drop_one=*/true), base);
      EXPECT_GT(d, 100 * kReorderTol) << "cap " << cap;
    }
  });
}

// Gradient_as_bucket_view for the flat gradients: the units of one bucket hold views of its one
// buffer (no copy back, no second allocation); with buckets off each unit has its own.
TEST(GradBuckets, UnitsOfABucketShareItsBuffer) {
  run_ranks(2, [](ProcessGroup& pg) {
    auto distinct_storages = [&](double cap) {
      BucketNet m;
      FullyShardedDataParallel model(m, bucket_net_options(pg, m, ShardingStrategy::NO_SHARD, cap));
      std::vector<size_t> per_step;
      for (int step = 0; step < 3; ++step) {
        for (auto* h : model->handles()) {
          if (h) h->flat_param().mutable_grad().reset();
        }
        model->forward(seeded_randn({4, BucketNetImpl::kDim}, step), false).sum().backward();
        std::set<const void*> storages;
        for (auto* h : model->handles()) {
          if (h && h->flat_param().grad().defined()) {
            storages.insert(h->flat_param().grad().storage().data());
          }
        }
        per_step.push_back(storages.size());
      }
      return per_step;
    };
    // 7 units with gradients (root + 6 blocks; `rare` unused): 7 buffers without buckets, one
    // with a bucket big enough. (The first bucket of a backward closes at 1 MiB: far above.)
    EXPECT_EQ(distinct_storages(0), std::vector<size_t>(3, 7));
    EXPECT_EQ(distinct_storages(25), std::vector<size_t>(3, 1));
    const std::vector<size_t> small = distinct_storages(0.001);
    for (size_t n : small) {
      EXPECT_GT(n, 1u);
      EXPECT_LT(n, 7u);
    }
  });
}

// DDP's buckets live as long as its reducer; ours are kept on the CPU (keep_grad_buckets, the
// default) and reused once nothing holds them (FsdpState::bucket_buffer). Steps whose gradients
// are dropped (zero_grad(set_to_none)) reduce in one buffer, the same from the second planned step
// on. A gradient the user keeps, whole, as a view of one unit's part, or as an original
// parameter's gradient (use_orig_params), or that the next backward accumulates into, is never
// written by a later bucket, and a buffer the gradients do not live in is not kept; a forward in
// eval mode lets the kept buffer go. With keep_grad_buckets(false) nothing outlives the
// gradients. Every step's gradients equal one all-reduce per unit's, bit for bit (W=2).
// One Gloo worker thread: a barrier's completion then means every collective before it has been
// let go of by the backend (see the pause below).
fsdp::testing::RunOptions one_gloo_worker() {
  fsdp::testing::RunOptions o;
  o.gloo_threads = 1;
  return o;
}

TEST(GradBuckets, ABucketBufferIsReusedOnlyOnceNothingHoldsIt) {
  run_ranks(
      2,
      [](ProcessGroup& pg) {
        struct Run {
          Trace trace;                       // gradients per backward, per handle (clones)
          std::vector<const void*> buffers;  // per backward: the root's gradient storage
          // Per step: whether the last step's root gradient storage outlived dropping the
          // gradients; at the end, whether the last one outlived an eval forward too.
          std::vector<bool> outlived;
          bool outlived_eval = false;
          std::vector<std::pair<at::Tensor, at::Tensor>>
              held;  // (kept by the user, its value then)
        };
        // Gloo's worker thread lets go of a finished all-reduce's buffer a moment after wait()
        // returns; until it does, the buffer is neither reused nor freed (correctly, but this test
        // checks that it is). With one worker thread (below) Gloo runs the group's collectives in
        // order, so a barrier's completion nearly always means every all-reduce before it has been
        // let go of; CI once saw a buffer still held after it (1 run in many), so a buffer that is
        // still alive then gets up to 300 ms more to go. What we keep stays alive however long
        // one waits, so the wait cannot turn a kept buffer into a released one.
        auto pause = [&pg]() { pg.barrier(); };
        auto still_alive = [](const c10::weak_intrusive_ptr<c10::StorageImpl>& w) {
          for (int i = 0; i < 30 && !w.expired(); ++i) {
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          }
          return !w.expired();
        };
        auto run = [&](double cap, bool keep_buckets, bool orig) {
          BucketNet m;
          FullyShardedDataParallel model(m,
                                         bucket_net_options(pg, m, ShardingStrategy::NO_SHARD, cap)
                                             .keep_grad_buckets(keep_buckets)
                                             .use_orig_params(orig));
          Run r;
          auto drop_grads = [&]() {  // zero_grad(set_to_none), on the flat and original parameters
            for (auto* h : model->handles()) {
              if (h) h->flat_param().mutable_grad().reset();
            }
            for (auto& p : m->parameters()) p.mutable_grad().reset();
          };
          auto root_grad = [&]() { return model->handles()[0]->flat_param().grad(); };
          auto keep = [&](const at::Tensor& t) { r.held.emplace_back(t, t.clone()); };
          c10::weak_intrusive_ptr<c10::StorageImpl> last(c10::intrusive_ptr<c10::StorageImpl>{});
          // 0-3: dropped before each (2: under use_orig_params, an original parameter's gradient
          // kept); 4: the root's whole gradient kept; 5: a view of one unit's kept; 6: none dropped
          // (accumulated into the last); 7-8: dropped again.
          for (int step = 0; step < 9; ++step) {
            if (step == 2 && orig) keep(m->in->weight.grad());
            if (step == 4) keep(root_grad());
            if (step == 5)
              keep(model->handles()[3]->flat_param().grad().narrow(0, 1, 3));  // a block
            if (step != 6) drop_grads();
            pause();
            r.outlived.push_back(still_alive(last));
            model->forward(seeded_randn({4, BucketNetImpl::kDim}, 10 * step + pg.rank()), false)
                .sum()
                .backward();
            std::vector<at::Tensor> g;
            for (auto* h : model->handles()) {
              if (h && h->flat_param().grad().defined())
                g.push_back(h->flat_param().grad().clone());
            }
            r.trace.grads.push_back(std::move(g));
            r.buffers.push_back(root_grad().storage().data());
            last = root_grad().storage().getWeakStorageImpl();
          }
          drop_grads();
          m->eval();
          {
            at::NoGradGuard no_grad;
            model->forward(seeded_randn({4, BucketNetImpl::kDim}, 99), false);
          }
          pause();
          r.outlived_eval = still_alive(last);
          return r;
        };
        const Run base = run(0, true, false), bucketed = run(25, true, false),
                  unkept = run(25, false, false), base_orig = run(0, true, true),
                  orig = run(25, true, true);
        for (const auto& [ref, other] :
             {std::pair{&base, &bucketed}, {&base, &unkept}, {&base_orig, &orig}}) {
          ASSERT_EQ(ref->trace.grads.size(), 9u);
          EXPECT_EQ(max_diff(other->trace, ref->trace), 0.0);
          for (const auto& [kept, value] : other->held) {
            EXPECT_TRUE(at::equal(kept, value)) << "a gradient the user kept was overwritten";
          }
        }
        const auto& b = bucketed.buffers;
        // Step 0 has no plan (each unit its own slot, copied into one buffer at launch), step 1 the
        // first planned buffer; from step 2 on it is reused while nothing holds it.
        EXPECT_EQ(b[2], b[1]);
        EXPECT_EQ(b[3], b[1]);
        EXPECT_NE(b[4], b[3]);  // step 3's is kept by the user
        EXPECT_NE(b[5], b[4]);  // a view of step 4's is kept
        EXPECT_EQ(b[8], b[7]);
        EXPECT_NE(orig.buffers[2], orig.buffers[1]);  // an original parameter's gradient is kept
        EXPECT_EQ(orig.buffers[3], orig.buffers[2]);
        const auto& o = bucketed.outlived;
        EXPECT_FALSE(o[1]);  // step 0's buffer was the bucket's own, not planned: not kept
        EXPECT_TRUE(o[2]);   // planned ones are kept for the next backward
        EXPECT_TRUE(o[3]);
        // Step 6 added into step 5's gradients: its bucket was not where they live, so nothing of
        // it was kept, and step 5's buffer went with the gradients once they were dropped.
        EXPECT_FALSE(o[7]);
        EXPECT_TRUE(o[8]);
        EXPECT_FALSE(bucketed.outlived_eval) << "an eval forward kept the buckets";
        for (int s : {1, 2, 3, 7, 8}) EXPECT_FALSE(unkept.outlived[s]) << "step " << s;
      },
      one_gloo_worker());
}

// Where zero_grad keeps the gradients and zeroes them (LibTorch 1.13's default), every bucket's sum
// is added into them and its buffer is needed no longer: keeping it for the next backward would
// hold a second set of gradients for nothing. After steady steps of that kind, the memory left
// from all of training is the gradients themselves.
TEST(GradBuckets, BucketsAddedIntoKeptGradientsAreNotKept) {
  run_ranks(
      2,
      [](ProcessGroup& pg) {
        BucketNet m;
        FullyShardedDataParallel model(m,
                                       bucket_net_options(pg, m, ShardingStrategy::NO_SHARD, 25));
        fsdp::testing::MemoryWatch watch;  // from before the first gradient
        for (int s = 0; s < 5; ++s) {
          for (auto* h : model->handles()) {
            if (h && h->flat_param().grad().defined()) h->flat_param().mutable_grad().zero_();
          }
          model->forward(seeded_randn({4, BucketNetImpl::kDim}, s + pg.rank()), false)
              .sum()
              .backward();
          pg.barrier();  // Gloo's one worker has let go of this backward's buffers
        }
        int64_t grad_bytes = 0;
        for (auto* h : model->handles()) {
          if (h && h->flat_param().grad().defined()) grad_bytes += h->flat_param().grad().nbytes();
        }
        ASSERT_GT(grad_bytes, 0);
        // What is live only falls from here (Gloo letting go of a last buffer): wait up to 5 s for
        // it.
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
        while (watch.current() >= grad_bytes * 3 / 2 &&
               std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        EXPECT_LT(watch.current(), grad_bytes * 3 / 2)
            << "a bucket outlived its backward beside " << grad_bytes << " bytes of gradients";
      },
      one_gloo_worker());
}

// A GradBucket on its own: slots filled in the planned buffer and beyond it (its own buffers,
// copied at launch), reduced as one and divided once, each result a slice of one buffer.
TEST(GradBuckets, BucketSlotsReduceTogetherPlannedOrNot) {
  run_ranks(2, [](ProcessGroup& pg) {
    for (int64_t planned : {0, 5, 9, 20}) {
      fsdp::detail::GradBucket b(pg, at::kFloat, at::kCPU, {2.0},
                                 planned > 0 ? at::full({planned}, -1.0f) : at::Tensor());
      const std::vector<int64_t> sizes{5, 4, 3};
      for (int64_t n : sizes) {
        const size_t k = b.add_slot(n);
        b.slot(k).copy_(at::arange(n, at::kFloat) + 10 * static_cast<double>(k) + pg.rank());
      }
      EXPECT_EQ(b.numel(), 12);
      EXPECT_EQ(b.nbytes(), 48);
      b.launch();
      b.launch();  // idempotent
      EXPECT_THROW(b.add_slot(1), fsdp::InternalError);
      b.wait();
      b.wait();
      for (size_t k = 0; k < sizes.size(); ++k) {
        const at::Tensor want =
            (2 * (at::arange(sizes[k], at::kFloat) + 10 * static_cast<double>(k)) + 1) / 2.0;
        EXPECT_TRUE(at::equal(b.result(k), want)) << "planned " << planned << " slot " << k;
        EXPECT_EQ(b.result(k).storage().data(), b.result(0).storage().data());
      }
    }
  });
}

// A rank killed inside backward, with gradients in buckets: every survivor's step fails with a
// DistError naming its rank within the timeout, whichever unit of the failed bucket finishes
// first, and nothing hangs.
TEST(GradBuckets, RankDyingInBackwardFailsTheBucketsOnEveryOtherRank) {
  const auto timeout = std::chrono::milliseconds(10000);
  fsdp::testing::RunOptions opts;
  opts.collective_timeout = timeout;
  opts.grace = 4 * timeout;  // a Gloo group whose peer died may wait out the timeout per queued op
  opts.report = false;
  for (double cap : {0.002, 25.0}) {
    auto results = run_ranks(
        3,
        [timeout, cap](ProcessGroup& pg) {
          BucketNet m;
          int calls = 0;
          if (pg.rank() == 2) {
            m->blocks->ptr<SpareBlockImpl>(1)->fc1->weight.register_hook([&](const at::Tensor& g) {
              if (++calls == 2) ::raise(SIGKILL);  // the second step's backward
              return g;
            });
          }
          FullyShardedDataParallel model(
              m, bucket_net_options(pg, m, ShardingStrategy::NO_SHARD, cap));
          const auto t0 = std::chrono::steady_clock::now();
          try {
            for (int step = 0; step < 3; ++step) {
              model->forward(seeded_randn({4, BucketNetImpl::kDim}, step), false).sum().backward();
            }
            ADD_FAILURE() << "training went on without rank 2 (cap " << cap << ")";
          } catch (const fsdp::DistError& e) {
            EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(pg.rank())),
                      std::string::npos)
                << e.what();
          }
          EXPECT_LT(std::chrono::steady_clock::now() - t0, 2 * timeout + std::chrono::seconds(2));
        },
        opts);
    EXPECT_TRUE(results[0].ok) << "cap " << cap << ": " << results[0].message;
    EXPECT_TRUE(results[1].ok) << "cap " << cap << ": " << results[1].message;
    EXPECT_FALSE(results[2].ok);
  }
}

TEST(GradBuckets, NegativeBucketCapIsRejected) {
  run_ranks(1, [](ProcessGroup& pg) {
    BucketNet m;
    try {
      FullyShardedDataParallel model(m, FullyShardedOptions().process_group(pg).bucket_cap_mb(-1));
      ADD_FAILURE() << "accepted bucket_cap_mb(-1)";
    } catch (const fsdp::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("bucket_cap_mb"), std::string::npos) << e.what();
    }
  });
}

}  // namespace
