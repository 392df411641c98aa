// State dicts at the edges the core review (issue 7) named, and FULL state dicts that keep the
// gathered buffers rather than copies of them: loads after parameters were replaced,
// dtype casts on load, NO_SHARD falling back to FULL, layout alignment in the compute dtype and
// NO_SHARD padding, and awkward parameter layouts (0-d, empty, dim0 < W, a rank with an empty
// shard, frozen and trainable parameters in one unit, a weight tied across two units).
#include <gtest/gtest.h>

#include "flat_param_model.h"
#include "fsdp/errors.h"
#include "fsdp/flat_param.h"
#include "fsdp/model_state_dict.h"
#include "fsdp/optim_state_dict.h"
#include "multi_rank.h"
#include "state_dict_testing.h"
#include "tiny_lm.h"

using fsdp::FlatParamHandle;
using fsdp::FlatParamHandleOptions;
using fsdp::FullyShardedDataParallel;
using fsdp::FullyShardedOptions;
using fsdp::ShardingStrategy;
using fsdp::StateDict;
using fsdp::StateDictType;
using fsdp::StateValue;
using fsdp::dist::ProcessGroup;
using fsdp::testing::BlockImpl;
using fsdp::testing::expect_same;
using fsdp::testing::full_of;
using fsdp::testing::lm_options;
using fsdp::testing::run_ranks;
using fsdp::testing::TinyLM;

namespace {

// ---------------------------------------------------------------------------------------------

// The seed loads inside an unshard with writeback: a parameter replaced with set_data before the
// load is written back first, so the loaded value wins over it (before the fix the next unshard
// copied the stale replacement over the loaded value).
TEST(StateDictEdges, LoadAfterSetDataKeepsTheLoadedValues) {
  run_ranks(2, [](ProcessGroup&) {
    for (auto type : {StateDictType::FULL_STATE_DICT, StateDictType::SHARDED_STATE_DICT}) {
      TinyLM a(61);
      FullyShardedDataParallel src(a, lm_options(a, ShardingStrategy::FULL_SHARD, true));
      const StateDict expect = full_of(src);
      StateDict saved;
      {
        fsdp::StateDictTypeGuard g(src, type);
        saved = fsdp::state_dict(src);
      }
      TinyLM b(62);
      FullyShardedDataParallel dst(b, lm_options(b, ShardingStrategy::FULL_SHARD, true));
      {
        torch::NoGradGuard no_grad;
        auto w = b->blocks->ptr<BlockImpl>(1)->fc1->weight;  // a shard view under use_orig_params
        w.set_data(torch::full(w.sizes(), 5.0f));            // no longer aliases the flat shard
      }
      {
        fsdp::StateDictTypeGuard g(dst, type);
        fsdp::load_state_dict(dst, saved);
      }
      expect_same(full_of(dst), expect, "after load");
    }
  });
}

// PyTorch's _load_from_state_dict copies with a cast: bfloat16 weights load into a float32 model.
// strict_dtype refuses instead, naming the key, on every rank.
TEST(StateDictEdges, LoadCastsDtypesUnlessStrictDtype) {
  run_ranks(2, [](ProcessGroup& pg) {
    for (auto type : {StateDictType::FULL_STATE_DICT, StateDictType::SHARDED_STATE_DICT}) {
      TinyLM a(63);
      FullyShardedDataParallel src(a, lm_options(a, ShardingStrategy::FULL_SHARD, false));
      StateDict bf16 = full_of(src);
      StateDict expect = bf16;
      for (auto& [k, v] : bf16) v = StateValue(v.tensor().to(at::kBFloat16));
      for (auto& [k, v] : expect) v = StateValue(v.tensor().to(at::kBFloat16).to(at::kFloat));
      StateDict to_load = bf16;
      if (type == StateDictType::SHARDED_STATE_DICT) {
        for (auto& [k, v] : to_load) {
          if (k == "scale") continue;  // buffers stay plain tensors
          v = StateValue(fsdp::chunk_sharded(v.tensor(), pg.rank(), pg.size()));
        }
      }
      TinyLM b(64);
      FullyShardedDataParallel dst(b, lm_options(b, ShardingStrategy::FULL_SHARD, false));
      fsdp::StateDictTypeGuard g(dst, type);
      try {
        fsdp::load_state_dict(dst, to_load, /*strict=*/true, /*strict_dtype=*/true);
        ADD_FAILURE() << "strict_dtype accepted bfloat16 values";
      } catch (const fsdp::ValueError& e) {
        EXPECT_NE(std::string(e.what()).find("dtype mismatch for '"), std::string::npos)
            << e.what();
      }
      fsdp::load_state_dict(dst, to_load);
      expect_same(full_of(dst), expect, "bf16 cast");
    }
  });
}

// The seed falls back to FULL (with a warning) for SHARDED and LOCAL under NO_SHARD.
// The values of one unit in a FULL state dict: they share one storage, the padded unsharded flat
// parameter (or flat state) the gather wrote, and hold nothing else but padding (under
// use_orig_params each parameter starts at 16 bytes, and the whole is a multiple of W).
void expect_one_gathered_buffer(const std::vector<at::Tensor>& values, int W,
                                const std::string& what) {
  ASSERT_FALSE(values.empty()) << what;
  int64_t bytes = 0;
  for (const auto& v : values) {
    EXPECT_EQ(v.storage().data(), values[0].storage().data()) << what << ": copied";
    bytes += v.numel() * v.element_size();
  }
  const auto held = static_cast<int64_t>(values[0].storage().nbytes());
  EXPECT_GE(held, bytes) << what;
  const int64_t padding = (W + 4 * static_cast<int64_t>(values.size())) * values[0].element_size();
  EXPECT_LT(held, bytes + padding) << what << ": more than the padding";
}

// A FULL state dict keeps each unit's gathered buffer (model) or gathered flat state (optimizer)
// and returns views of it, instead of copying every value out of a buffer it then frees: on the
// CPU the copy doubled the memory written and faulted in. The state dict owns that memory:
// training on and gathering again leave its values as they were. An optimizer state of which
// the unit's parameters with state fill less than half (most of the unit frozen) is copied out,
// so that the state dict does not hold a mostly frozen unit's worth for it.
TEST(StateDictEdges, FullStateDictsOwnTheGatheredBuffers) {
  for (int world : {2, 3}) {
    run_ranks(world, [](ProcessGroup& pg) {
      const int W = pg.size();
      TinyLM a(71);
      auto blocks = a->blocks;
      // Block 1: only the biases train (21 of 229 elements), as in a fine-tune.
      blocks->ptr<BlockImpl>(1)->fc1->weight.set_requires_grad(false);
      blocks->ptr<BlockImpl>(1)->fc2->weight.set_requires_grad(false);
      FullyShardedDataParallel model(a, lm_options(a, ShardingStrategy::FULL_SHARD, true));
      torch::optim::Adam opt(fsdp::testing::unique_params(model->parameters()),
                             torch::optim::AdamOptions(0.05));
      auto step = [&](uint64_t seed) {
        fsdp::testing::zero_grad_set_to_none(opt);
        const at::Tensor tokens = fsdp::testing::lm_tokens(4, seed + pg.rank());
        fsdp::testing::lm_loss(model->forward(tokens), tokens).backward();
        opt.step();
      };
      step(10);
      const auto params = fsdp::testing::full_params(model);
      const StateDict sd = full_of(model);
      const StateDict osd = fsdp::optim_state_dict(model, opt);
      auto block_values = [&](int b) {
        std::vector<at::Tensor> out;
        for (const char* p : {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"})
          out.push_back(sd.at("blocks." + std::to_string(b) + "." + p).tensor());
        return out;
      };
      expect_one_gathered_buffer(block_values(0), W, "model, block 0");
      expect_one_gathered_buffer(block_values(2), W, "model, block 2");
      expect_one_gathered_buffer(block_values(1), W, "model, block 1 (frozen weights)");
      const StateDict& state = osd.at("state").dict();
      for (const char* name : {"exp_avg", "exp_avg_sq"}) {
        std::vector<at::Tensor> states;
        for (const char* p : {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"})
          states.push_back(state.at(std::string("blocks.0.") + p).dict().at(name).tensor());
        expect_one_gathered_buffer(states, W, std::string("optimizer, block 0, ") + name);
        for (const char* p : {"fc1.bias", "fc2.bias"}) {
          const at::Tensor v = state.at(std::string("blocks.1.") + p).dict().at(name).tensor();
          EXPECT_EQ(static_cast<int64_t>(v.storage().nbytes()), v.numel() * v.element_size())
              << "block 1's " << p << " " << name << ": the state dict holds more than it";
        }
      }
      std::map<std::string, at::Tensor> kept;
      for (const auto& [k, v] : state.at("blocks.0.fc1.weight").dict()) {
        if (v.is_tensor()) kept[k] = v.tensor().clone();
      }
      // Training on writes new parameters and state; a new gather allocates afresh.
      step(20);
      const StateDict sd2 = full_of(model);
      const StateDict osd2 = fsdp::optim_state_dict(model, opt);
      for (const auto& [k, v] : params) {
        if (k.rfind("blocks.", 0) != 0) continue;
        ASSERT_TRUE(at::equal(sd.at(k).tensor(), v)) << k << " changed after training on";
      }
      EXPECT_FALSE(
          at::equal(sd2.at("blocks.0.fc1.weight").tensor(), params.at("blocks.0.fc1.weight")))
          << "the control: training on changed the parameters";
      for (const auto& [k, v] : kept) {
        EXPECT_TRUE(at::equal(state.at("blocks.0.fc1.weight").dict().at(k).tensor(), v)) << k;
      }
      for (const auto& h : model->handles()) EXPECT_EQ(h->unsharded_storage_bytes(), 0);
    });
  }
}

TEST(StateDictEdges, NoShardFallsBackToFull) {
  run_ranks(2, [](ProcessGroup&) {
    for (auto type : {StateDictType::SHARDED_STATE_DICT, StateDictType::LOCAL_STATE_DICT}) {
      TinyLM a(65);
      FullyShardedDataParallel model(a, lm_options(a, ShardingStrategy::NO_SHARD, true));
      const StateDict expect = full_of(model);
      StateDict got;
      {
        fsdp::StateDictTypeGuard g(model, type);
        got = fsdp::state_dict(model);
      }
      expect_same(got, expect, "NO_SHARD fallback");
      TinyLM b(66);
      FullyShardedDataParallel dst(b, lm_options(b, ShardingStrategy::NO_SHARD, true));
      {
        fsdp::StateDictTypeGuard g(dst, type);
        fsdp::load_state_dict(dst, got);
      }
      expect_same(full_of(dst), expect, "NO_SHARD load");
    }
  });
}

// PyTorch aligns use_orig_params parameters to 16 bytes of the *compute* dtype: with float32
// parameters and a bfloat16 param_dtype every parameter starts at a multiple of 8 elements. And
// the flat parameter is padded to a multiple of the world size whatever the strategy.
TEST(StateDictEdges, AlignmentFollowsTheComputeDtypeAndNoShardIsPadded) {
  run_ranks(3, [](ProcessGroup& pg) {
    struct Case {
      ShardingStrategy strategy;
      std::optional<at::ScalarType> param_dtype;
      int64_t align;
    };
    for (const Case& c : {Case{ShardingStrategy::FULL_SHARD, at::kBFloat16, 8},
                          Case{ShardingStrategy::FULL_SHARD, std::nullopt, 4},
                          Case{ShardingStrategy::NO_SHARD, at::kBFloat16, 8},
                          Case{ShardingStrategy::NO_SHARD, std::nullopt, 4}}) {
      fsdp::testing::Net net(3);
      FlatParamHandle h(fsdp::collect_params(net.ptr()), pg,
                        FlatParamHandleOptions()
                            .sharding_strategy(c.strategy)
                            .use_orig_params(true)
                            .param_dtype(c.param_dtype));
      const auto& l = h.layout();
      bool any_padding_for_alignment = false;
      for (size_t i = 0; i < l.fqns.size(); ++i) {
        EXPECT_EQ(l.param_offset(i) % c.align, 0) << l.fqns[i] << " align " << c.align;
        any_padding_for_alignment |= l.param_offset(i) % 8 != 0;
      }
      // Net's sizes (1, 0, 7, 15, 5, 15) make the two alignments differ: the control.
      EXPECT_EQ(any_padding_for_alignment, c.align == 4);
      EXPECT_EQ(l.unpadded_unsharded_numel % pg.size(), 0) << fsdp::to_string(c.strategy);
    }
  });
}

// SHARDED loads where the ranks must exchange pieces. Pieces may be any boxes (here column
// blocks, not dim-0 chunks), one rank may hold everything and the others nothing, and one rank's
// malformed pieces must make every rank raise (no rank may index with another's metadata, crash
// or wait for a timeout) while nothing is loaded.
StateDict as_column_blocks(const StateDict& full, int rank, int world, bool everything) {
  StateDict out;
  for (const auto& [k, v] : full) {
    const at::Tensor& t = v.tensor();
    if (k == "scale") {
      out.insert_or_assign(k, t);
      continue;
    }
    std::vector<fsdp::Shard> pieces;
    const int64_t cols = t.dim() == 2 ? t.size(1) : 0;
    for (int r = 0; r < world; ++r) {
      if (!everything && r != rank) continue;
      if (t.dim() == 2) {
        // torch.chunk along dim 1: column blocks, each a box that is not a flat run.
        const int64_t chunk = (cols + world - 1) / world;
        const int64_t c0 = std::min<int64_t>(r * chunk, cols);
        const int64_t c1 = std::min<int64_t>(c0 + chunk, cols);
        if (c1 <= c0) continue;
        pieces.push_back(
            fsdp::Shard{t.narrow(1, c0, c1 - c0).contiguous(), {{0, c0}, {t.size(0), c1 - c0}, r}});
      } else {
        auto ch = fsdp::chunk_sharded(t, r, world);
        for (auto& s : ch.local_shards()) pieces.push_back(s);
      }
    }
    out.insert_or_assign(k, fsdp::ShardedTensor(t.sizes().vec(), t.scalar_type(), pieces));
  }
  return out;
}

TEST(StateDictEdges, ShardedLoadExchangesAnyBoxesFromAnyHolder) {
  run_ranks(3, [](ProcessGroup& pg) {
    TinyLM a(71);
    FullyShardedDataParallel src(a, lm_options(a, ShardingStrategy::FULL_SHARD, false));
    const StateDict expect = full_of(src);
    for (int mode = 0; mode < 2; ++mode) {
      // mode 0: every rank its own column blocks; mode 1: rank 0 all of them, others none.
      const bool everything = mode == 1 && pg.rank() == 0;
      StateDict sd = as_column_blocks(expect, pg.rank(), pg.size(), everything);
      if (mode == 1 && pg.rank() != 0) sd = as_column_blocks(expect, pg.rank(), 0, false);
      for (bool orig : {false, true}) {
        TinyLM b(72);
        FullyShardedDataParallel dst(b, lm_options(b, ShardingStrategy::SHARD_GRAD_OP, orig));
        {
          fsdp::StateDictTypeGuard g(dst, StateDictType::SHARDED_STATE_DICT);
          fsdp::load_state_dict(dst, sd);
        }
        expect_same(full_of(dst), expect, "mode " + std::to_string(mode));
      }
    }
  });
}

TEST(StateDictEdges, MalformedPiecesOnOneRankFailEveryRankAndLoadNothing) {
  fsdp::testing::RunOptions opts;
  opts.collective_timeout = std::chrono::milliseconds(20000);
  run_ranks(
      3,
      [](ProcessGroup& pg) {
        TinyLM a(73);
        FullyShardedDataParallel src(a, lm_options(a, ShardingStrategy::FULL_SHARD, false));
        const StateDict truth = full_of(src);
        StateDict sd = as_column_blocks(truth, pg.rank(), pg.size(), false);
        if (pg.rank() == 1) {
          // A 2-D parameter described as 1-D: its metadata has the wrong dimension count.
          const at::Tensor w = truth.at("blocks.0.fc1.weight").tensor().reshape({-1});
          sd.insert_or_assign("blocks.0.fc1.weight", fsdp::chunk_sharded(w, 1, 3));
        }
        TinyLM b(74);
        FullyShardedDataParallel dst(b, lm_options(b, ShardingStrategy::FULL_SHARD, false));
        const StateDict before = full_of(dst);
        const auto t0 = std::chrono::steady_clock::now();
        try {
          fsdp::StateDictTypeGuard g(dst, StateDictType::SHARDED_STATE_DICT);
          fsdp::load_state_dict(dst, sd);
          ADD_FAILURE() << "a malformed piece on rank 1 was accepted";
        } catch (const fsdp::ValueError& e) {
          EXPECT_NE(std::string(e.what()).find("blocks.0.fc1.weight"), std::string::npos)
              << e.what();
        }
        // Raised promptly, from the verdict exchange, not from a collective's timeout.
        EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(10000));
        expect_same(full_of(dst), before, "after the refused load");
      },
      opts);
}

// Every state-dict type round-trips on a model with every awkward layout at once, at W 1-4.
struct AwkwardImpl : torch::nn::Module {
  torch::Tensor scalar, empty, rows;  // 0-d, 0 elements, dim0 = 2 < W (for W 3, 4)
  torch::nn::Linear mixed{nullptr};   // weight trainable, bias frozen: one unit (use_orig_params)
  torch::nn::Linear a{nullptr};
  fsdp::testing::TiedHead b{nullptr};  // its weight is a's: tied across two units
  AwkwardImpl() {
    fsdp::testing::seed_cpu(70);
    scalar = register_parameter("scalar", torch::randn({}));
    empty = register_parameter("empty", torch::empty({0, 3}));
    rows = register_parameter("rows", torch::randn({2, 3}));
    mixed = register_module("mixed", torch::nn::Linear(3, 3));
    mixed->bias.set_requires_grad(false);
    a = register_module("a", torch::nn::Linear(3, 2));
    b = register_module("b", fsdp::testing::TiedHead(a->weight));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = fsdp::forward(mixed, x) * scalar + rows.sum() + empty.sum();
    return fsdp::forward(a, h) + fsdp::forward(b, h);
  }
};
TORCH_MODULE(Awkward);

class AwkwardWorld : public ::testing::TestWithParam<int> {};

TEST_P(AwkwardWorld, EveryTypeRoundTripsAndTrainsOn) {
  run_ranks(GetParam(), [](ProcessGroup& pg) {
    auto make = [](Awkward& m) {
      return FullyShardedDataParallel(m, FullyShardedOptions()
                                             .units({m->mixed.ptr(), m->a.ptr(), m->b.ptr()})
                                             .use_orig_params(true));
    };
    for (auto type : {StateDictType::FULL_STATE_DICT, StateDictType::SHARDED_STATE_DICT,
                      StateDictType::LOCAL_STATE_DICT}) {
      Awkward m;
      auto model = make(m);
      {
        torch::optim::SGD opt(fsdp::testing::unique_params(model->parameters()), 0.1);
        auto x = fsdp::testing::seeded_randn({2, 3}, 500 + pg.rank());
        model->forward(x).pow(2).sum().backward();
        opt.step();
      }
      const StateDict expect = full_of(model);
      ASSERT_TRUE(expect.contains("a.weight") && expect.contains("b.weight"));
      EXPECT_TRUE(torch::equal(expect.at("a.weight").tensor(), expect.at("b.weight").tensor()));
      EXPECT_EQ(expect.at("scalar").tensor().dim(), 0);
      StateDict saved;
      {
        fsdp::StateDictTypeGuard g(model, type);
        saved = fsdp::state_dict(model);
      }
      Awkward n;
      {
        torch::NoGradGuard no_grad;
        for (auto& p : n->parameters()) p.add_(1.0);
      }
      auto dst = make(n);
      {
        fsdp::StateDictTypeGuard g(dst, type);
        fsdp::load_state_dict(dst, saved);
      }
      expect_same(full_of(dst), expect, "awkward round trip");
      // The tie survives: one more step moves both names together.
      torch::optim::SGD opt(fsdp::testing::unique_params(dst->parameters()), 0.1);
      dst->forward(fsdp::testing::seeded_randn({2, 3}, 600)).pow(2).sum().backward();
      opt.step();
      const StateDict after = full_of(dst);
      EXPECT_TRUE(torch::equal(after.at("a.weight").tensor(), after.at("b.weight").tensor()));
      EXPECT_TRUE(torch::equal(after.at("mixed.bias").tensor(), expect.at("mixed.bias").tensor()));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, AwkwardWorld, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "W" + std::to_string(info.param); });

}  // namespace
