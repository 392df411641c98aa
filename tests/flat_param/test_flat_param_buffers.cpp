// How a FlatParamHandle holds its unit-sized buffers on the CPU: huge pages for the memory it
// allocates on every step, and gradients sent to the reduce-scatter in pieces rather than copied
// into one flat gradient first. Real Gloo processes, as everywhere.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include "fsdp/dist.h"
#include "fsdp/errors.h"
#include "fsdp/flat_param.h"
#include "fsdp/fully_sharded.h"
#include "memory_watch.h"
#include "multi_rank.h"

using fsdp::FlatParamHandle;
using fsdp::FlatParamHandleOptions;
using fsdp::FullyShardedDataParallel;
using fsdp::ShardingStrategy;
using fsdp::dist::ProcessGroup;
using fsdp::dist::ReduceOp;
using fsdp::dist::ReduceScatterAlgo;
using fsdp::testing::run_ranks;
using fsdp::testing::seeded_randn;

namespace {

// The kernel's transparent-huge-page mode: "always", "madvise", "never", or "" where it has none.
std::string thp_mode() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  std::getline(f, line);
  const size_t a = line.find('['), b = line.find(']');
  return a == std::string::npos || b == std::string::npos ? "" : line.substr(a + 1, b - a - 1);
}

// kB of the mapping holding the middle of `t`'s memory that are backed by transparent huge pages
// (/proc/self/smaps). The middle: the advice covers whole pages only, so the block's first page,
// shared with the allocator's header, is a mapping of its own.
int64_t anon_huge_kb_in(const at::Tensor& t) {
  std::ifstream f("/proc/self/smaps");
  const auto addr = reinterpret_cast<uintptr_t>(t.data_ptr()) + t.nbytes() / 2;
  bool inside = false;
  for (std::string line; std::getline(f, line);) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find(' ')) {
      inside = lo <= addr && addr < hi;
    } else if (inside && line.rfind("AnonHugePages:", 0) == 0) {
      return std::stoll(line.substr(14));
    }
  }
  return -1;
}

// An unshard of a unit of 4 MiB and up (where AUTO is pairwise on Gloo) allocates the unit's
// unsharded buffer and nothing else. Gloo's own all-gather also
// held a scratch copy of the whole unit (received into, then copied out of), alive on its worker
// thread while a prefetch was in flight: the fourth unit at the peak of FULL_SHARD's backward
// (bench_scaling, 50M parameters, W=4: 1.106 of the analytic bound; 1.05 without it).
TEST(FlatParamHandleBuffers, UnshardAllocatesTheUnshardedBufferAndNothingElse) {
  for (int W : {2, 3, 4}) {
    run_ranks(W, [](ProcessGroup& pg) {
      auto m = std::make_shared<torch::nn::Module>();
      m->register_parameter("w", seeded_randn({1031, 1031}, 1));  // 4.25 MB
      m->register_parameter("b", seeded_randn({31}, 2));
      FlatParamHandle h(fsdp::collect_params(m), pg);
      const int64_t unit_bytes = h.layout().padded_unsharded_numel * 4;
      for (int k = 0; k < 2; ++k) {  // the second one on memory the first gave back
        int64_t peak = 0;
        {
          // The unsharded buffer comes from its storage's allocator, the one at the handle's
          // construction, which the watch does not wrap: the watch sees everything else.
          fsdp::testing::MemoryWatch watch;
          h.unshard();
          peak = watch.peak();
        }
        EXPECT_EQ(peak, 0) << "rank " << pg.rank() << " of " << pg.size() << ", a unit is "
                           << unit_bytes << " B";
        EXPECT_EQ(h.orig_params()[0].storage().nbytes(), static_cast<size_t>(unit_bytes));
        EXPECT_TRUE(at::equal(h.orig_params()[0], seeded_randn({1031, 1031}, 1)));
        EXPECT_TRUE(at::equal(h.orig_params()[1], seeded_randn({31}, 2)));
        h.reshard();
      }
    });
  }
}

// shard_to_gather gives a caller that gathers units itself (the FULL state dict) what unshard()
// would gather: the padded local shard, in the original dtype under mixed precision, with
// parameters replaced since the last unshard written back. It refuses, naming the unit, where the
// shard may not hold the newest values (unsharded) and under NO_SHARD.
TEST(FlatParamHandleBuffers, ShardToGatherIsWhatUnshardGathers) {
  run_ranks(2, [](ProcessGroup& pg) {
    auto make = [] {
      auto m = std::make_shared<torch::nn::Module>();
      m->register_parameter("w", seeded_randn({5, 7}, 1));
      m->register_parameter("b", seeded_randn({3}, 2));
      return m;
    };
    auto m = make();
    FlatParamHandle h(fsdp::collect_params(m), pg,
                      FlatParamHandleOptions().use_orig_params(true).param_dtype(at::kHalf));
    const at::Tensor shard = h.shard_to_gather();
    EXPECT_EQ(shard.scalar_type(), at::kFloat) << "full precision";
    EXPECT_EQ(shard.numel(), h.layout().padded_unsharded_numel / 2);
    at::Tensor full = at::empty({h.layout().padded_unsharded_numel});
    pg.all_gather_into_tensor(full, shard);
    std::vector<at::Tensor> views = h.layout().unflat_views(full);
    EXPECT_TRUE(at::equal(views[0], seeded_randn({5, 7}, 1)));
    EXPECT_TRUE(at::equal(views[1], seeded_randn({3}, 2)));
    // Parameters replaced (not their sharded views written) are written back first.
    for (auto& p : h.orig_params()) p.set_data(at::full_like(p, 3.0));
    pg.all_gather_into_tensor(full, h.shard_to_gather());
    views = h.layout().unflat_views(full);
    EXPECT_TRUE(at::equal(views[0], at::full({5, 7}, 3.0))) << "written back";
    EXPECT_TRUE(at::equal(views[1], at::full({3}, 3.0)));
    h.unshard();
    try {
      h.shard_to_gather();
      ADD_FAILURE() << "unsharded";
    } catch (const fsdp::StateError& e) {
      EXPECT_NE(std::string(e.what()).find("'w'"), std::string::npos) << e.what();
    }
    h.reshard();
    auto m2 = make();
    FlatParamHandle k(fsdp::collect_params(m2), pg,
                      FlatParamHandleOptions().sharding_strategy(ShardingStrategy::NO_SHARD));
    EXPECT_THROW(k.shard_to_gather(), fsdp::StateError);
  });
}

// Unit-sized buffers allocated anew on every step get huge pages (util/huge_pages.h): 4 KiB
// faults made a 64-256 MB unshard 0.65-0.82 of the raw all-gather's speed. The control, a plain
// tensor written whole, shows that the check sees the difference where THP is "madvise".
TEST(FlatParamHandleBuffers, UnitSizedBuffersGetHugePages) {
  const std::string mode = thp_mode();
  if (mode != "madvise" && mode != "always") GTEST_SKIP() << "no transparent huge pages here";
  run_ranks(2, [mode](ProcessGroup& pg) {
    auto m = std::make_shared<torch::nn::Module>();
    m->register_parameter("w", torch::ones({16 << 20}));  // 64 MB unsharded
    FlatParamHandle h(fsdp::collect_params(m), pg);
    h.unshard();
    EXPECT_GT(anon_huge_kb_in(h.orig_params()[0]), 0) << "the unsharded flat parameter";
    for (auto& p : h.orig_params()) p.mutable_grad() = torch::ones_like(p);
    h.set_training_state(fsdp::HandleTrainingState::BACKWARD_POST);
    h.reshard();
    h.reduce_grad();
    h.set_training_state(fsdp::HandleTrainingState::IDLE);
    const at::Tensor g = h.flat_param().grad();  // 32 MB: the reduce-scatter's fresh output
    ASSERT_TRUE(g.defined());
    EXPECT_TRUE(g.eq(1).all().item<bool>());  // the average of ones
    EXPECT_GT(anon_huge_kb_in(g), 0) << "the sharded gradient";
    if (mode == "madvise") {
      at::Tensor plain = at::empty({16 << 20});
      plain.fill_(1);
      EXPECT_EQ(anon_huge_kb_in(plain), 0) << "control: a tensor nobody advised";
    }
  });
}

// Parameters large enough to be sent as they are (>= 256 KiB), small ones between them that are
// copied together, and sizes that leave padding at the end (and, with use_orig_params, alignment
// padding between parameters), so chunk boundaries fall inside parameters and inside padding.
std::shared_ptr<torch::nn::Module> mixed_unit() {
  auto m = std::make_shared<torch::nn::Module>();
  m->register_parameter("big", torch::zeros({300001}));
  m->register_parameter("bias", torch::zeros({7}));
  m->register_parameter("mid", torch::zeros({401, 333}));
  m->register_parameter("tiny", torch::zeros({3}));
  m->register_parameter("tail", torch::zeros({70001}));
  return m;
}

void give_grads(FlatParamHandle& h, int rank) {
  const auto params = h.orig_params();
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].mutable_grad() = seeded_randn(params[i].sizes(), 500 + 31 * rank + i);
  }
}

class GradPieces : public ::testing::TestWithParam<std::tuple<int, bool>> {};

// The reduction of gradients sent in pieces is the reduction of the flat gradient, bit for bit
// (the same sums in the same rank order), and it never holds a flat gradient: a unit less memory.
TEST_P(GradPieces, ReduceToTheFlatGradientsResultBitForBitHoldingAUnitLess) {
  const auto [world, orig] = GetParam();
  run_ranks(world, [orig = orig](ProcessGroup& pg) {
    FlatParamHandle h(fsdp::collect_params(mixed_unit()), pg,
                      FlatParamHandleOptions().use_orig_params(orig));
    const int64_t unit_bytes = h.layout().padded_unsharded_numel * 4;
    h.unshard();

    // The reference: the same gradients flattened by take_orig_grads and reduced flat.
    give_grads(h, pg.rank());
    h.reduce_flat_grad(h.take_orig_grads());
    const at::Tensor expected = h.flat_param().grad().clone();
    h.flat_param().mutable_grad().reset();

    give_grads(h, pg.rank());
    const at::Tensor kept_grad = h.orig_params()[0].grad();  // a caller's reference survives
    const at::Tensor kept_copy = kept_grad.clone();
    int64_t pieces_peak = 0;
    {
      fsdp::testing::MemoryWatch watch;
      h.reduce_grad();
      pieces_peak = watch.peak();
    }
    ASSERT_TRUE(h.flat_param().grad().defined());
    EXPECT_TRUE(at::equal(h.flat_param().grad(), expected)) << "rank " << pg.rank();
    EXPECT_TRUE(at::equal(kept_grad, kept_copy)) << "the gradients sent are not modified";
    // The flat path holds the flat gradient, a whole unit, besides the output and the receive
    // buffers (measured: 1.5 units at W=2, with the path switched off); in pieces, only those.
    EXPECT_LT(pieces_peak, unit_bytes) << "pieces " << pieces_peak << " B, unit " << unit_bytes;
  });
}

// Ranks whose gradients differ in kind (one lacks a large and a small gradient, as a parameter
// unused on that rank would; another hands in a strided gradient) still cut their chunks alike, so
// the messages pair, and the result is the flat path's (zeros where a gradient is missing).
TEST_P(GradPieces, RanksWhoseGradientsDifferStillReduceAlike) {
  const auto [world, orig] = GetParam();
  run_ranks(world, [orig = orig](ProcessGroup& pg) {
    FlatParamHandle h(fsdp::collect_params(mixed_unit()), pg,
                      FlatParamHandleOptions().use_orig_params(orig));
    h.unshard();
    auto grads = [&] {
      give_grads(h, pg.rank());
      auto params = h.orig_params();
      if (pg.rank() == 1) {
        params[2].mutable_grad().reset();  // "mid", 534 KB
        params[3].mutable_grad().reset();  // "tiny"
      }
      if (pg.rank() == 2) params[2].mutable_grad() = seeded_randn({333, 401}, 4242).t();
    };
    grads();
    h.reduce_flat_grad(h.take_orig_grads());
    const at::Tensor expected = h.flat_param().grad().clone();
    h.flat_param().mutable_grad().reset();
    grads();
    h.reduce_grad();
    ASSERT_TRUE(h.flat_param().grad().defined());
    EXPECT_TRUE(at::equal(h.flat_param().grad(), expected)) << "rank " << pg.rank();
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, GradPieces,
                         ::testing::Combine(::testing::Values(2, 3, 4), ::testing::Bool()),
                         [](const auto& info) {
                           return "W" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_orig" : "_flat");
                         });

// The runtime end to end with gradients large enough to travel in pieces (a 640 KB weight, small
// biases between): FULL_SHARD training matches plain data parallelism by hand (gradients
// all-reduced and averaged) step for step, at W=2 and at W=3 (padding, cuts inside parameters).
TEST(GradPiecesRuntime, FullShardTrainingMatchesDataParallelByHand) {
  for (int world : {2, 3}) {
    run_ranks(world, [](ProcessGroup& pg) {
      auto make = [] {
        torch::manual_seed(3);
        return torch::nn::Sequential(torch::nn::Linear(400, 400), torch::nn::ReLU(),
                                     torch::nn::Linear(400, 8));
      };
      torch::nn::Sequential ref = make();
      FullyShardedDataParallel model(make(), fsdp::FullyShardedOptions().process_group(pg));
      torch::optim::SGD ref_opt(ref->parameters(), 0.1);
      torch::optim::SGD opt(model->parameters(), 0.1);
      for (int step = 0; step < 3; ++step) {
        const torch::Tensor x = seeded_randn({6, 400}, 900 + 10 * step + pg.rank());
        ref_opt.zero_grad();
        ref->forward(x).pow(2).mean().backward();
        for (auto& p : ref->parameters()) pg.all_reduce(p.mutable_grad(), ReduceOp::AVG);
        ref_opt.step();
        opt.zero_grad();
        model->forward(x).pow(2).mean().backward();
        opt.step();
      }
      fsdp::SummonFullParamsGuard full(model, /*writeback=*/false);
      const auto got = model->module()->named_parameters();
      for (const auto& item : ref->named_parameters()) {
        const at::Tensor* g = got.find(item.key());
        ASSERT_NE(g, nullptr) << item.key();
        EXPECT_TRUE(at::allclose(*g, item.value(), 1e-5, 1e-6))
            << item.key() << " on rank " << pg.rank() << ": max diff "
            << (*g - item.value()).abs().max().item<float>();
      }
    });
  }
}

// ProcessGroup::reduce_scatter_pieces_async: pieces of any sizes (the same on every rank), every
// op, against reduce_scatter_tensor of their concatenation; other algorithms concatenate.
TEST(ReduceScatterPieces, EqualsTheFlatReduceScatterAndRefusesBadChunks) {
  for (int world : {2, 3}) {
    run_ranks(world, [](ProcessGroup& pg) {
      const int W = pg.size();
      const int64_t n = 1001;
      const at::Tensor flat = seeded_randn({n * W}, 77 + pg.rank());
      // Chunk q in three pieces of sizes that differ from chunk to chunk, one of them empty.
      std::vector<std::vector<at::Tensor>> chunks(static_cast<size_t>(W));
      for (int q = 0; q < W; ++q) {
        const int64_t a = 10 * (q + 1), b = 500;
        chunks[static_cast<size_t>(q)] = {flat.narrow(0, q * n, a), flat.narrow(0, q * n + a, 0),
                                          flat.narrow(0, q * n + a, b),
                                          flat.narrow(0, q * n + a + b, n - a - b)};
      }
      for (auto op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::MAX, ReduceOp::MIN}) {
        for (auto algo : {ReduceScatterAlgo::AUTO, ReduceScatterAlgo::ALL_TO_ALL}) {
          at::Tensor expected = at::empty({n});
          pg.reduce_scatter_tensor(expected, flat, op, ReduceScatterAlgo::ALL_TO_ALL);
          at::Tensor out = at::empty({n});
          pg.reduce_scatter_pieces_async(out, chunks, op, algo).wait();
          EXPECT_TRUE(at::equal(out, expected)) << "op " << static_cast<int>(op);
        }
      }
      at::Tensor out = at::empty({n});
      auto fewer = chunks;
      fewer.pop_back();
      EXPECT_THROW(pg.reduce_scatter_pieces_async(out, fewer), fsdp::ValueError);
      auto shorter = chunks;
      shorter[0].pop_back();
      EXPECT_THROW(pg.reduce_scatter_pieces_async(out, shorter), fsdp::ValueError);
      auto wrong_dtype = chunks;
      wrong_dtype[1][0] = wrong_dtype[1][0].to(at::kDouble);
      EXPECT_THROW(pg.reduce_scatter_pieces_async(out, wrong_dtype), fsdp::ValueError);
      pg.barrier();
    });
  }
}

}  // namespace
