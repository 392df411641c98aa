// The state-dict value model, ShardedTensor, and FULL / SHARDED / LOCAL state dicts of wrapped
// models at world sizes 1-4, including resharding and failed loads.
#include <gtest/gtest.h>

#include <fstream>
#include <limits>
#include <optional>
#include <sstream>

#include "fsdp/errors.h"
#include "fsdp/model_state_dict.h"
#include "multi_rank.h"
#include "state_dict_testing.h"
#include "tiny_lm.h"

using fsdp::FullyShardedDataParallel;
using fsdp::FullyShardedOptions;
using fsdp::ShardedTensor;
using fsdp::ShardingStrategy;
using fsdp::StateDict;
using fsdp::StateDictType;
using fsdp::StateValue;
using fsdp::dist::ProcessGroup;
using fsdp::testing::BlockImpl;
using fsdp::testing::expect_same;
using fsdp::testing::full_of;
using fsdp::testing::lm_options;
using fsdp::testing::load_pieces;
using fsdp::testing::run_ranks;
using fsdp::testing::save_pieces;
using fsdp::testing::TinyLM;

namespace {

// ---------------------------------------------------------------------------------------------
// Value model

TEST(StateDictValue, KeepsInsertionOrderAndHoldsEveryKind) {
  StateDict inner;
  inner.insert_or_assign("lr", 0.1);
  inner.insert_or_assign("params", StateValue(fsdp::StateList{"a.weight", "b.bias"}));
  StateDict sd;
  sd.insert_or_assign("z", torch::ones({2}));
  sd.insert_or_assign("a", int64_t{3});
  sd.insert_or_assign("m", true);
  sd.insert_or_assign("s", "text");
  sd.insert_or_assign("none", StateValue());
  sd.insert_or_assign("group", inner);
  EXPECT_EQ(sd.keys(), (std::vector<std::string>{"z", "a", "m", "s", "none", "group"}));
  sd.insert_or_assign("a", 4);  // replacing keeps the position
  EXPECT_EQ(sd.keys()[1], "a");
  EXPECT_EQ(sd.at("a").to_int(), 4);
  EXPECT_DOUBLE_EQ(sd.at("a").to_double(), 4.0);
  EXPECT_TRUE(sd.at("m").to_bool());
  EXPECT_EQ(sd.at("s").string(), "text");
  EXPECT_TRUE(sd.at("none").is_none());
  EXPECT_EQ(sd.at("group").dict().at("params").list()[1].string(), "b.bias");
  EXPECT_TRUE(sd.erase("z"));
  EXPECT_FALSE(sd.erase("z"));
  EXPECT_EQ(sd.keys().front(), "a");
  EXPECT_EQ(sd.at("group").dict().keys(), (std::vector<std::string>{"lr", "params"}));
  // Copies copy containers: editing the copy leaves the original alone.
  StateDict copy = sd;
  copy.at("group").dict().insert_or_assign("lr", 0.5);
  EXPECT_DOUBLE_EQ(sd.at("group").dict().at("lr").to_double(), 0.1);
  // Wrong kinds and keys are errors that say what was there.
  try {
    sd.at("s").tensor();
    FAIL();
  } catch (const fsdp::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("str"), std::string::npos) << e.what();
  }
  EXPECT_THROW(sd.at("missing"), fsdp::ValueError);
}

TEST(ShardedTensor, ChunkFollowsTorchChunkAndFlatRangesReassemble) {
  auto full = torch::arange(30, torch::kFloat).reshape({5, 6});
  // torch.chunk(5 rows, 4) -> 2, 2, 1 rows; rank 3 holds nothing.
  std::vector<ShardedTensor> parts;
  for (int r = 0; r < 4; ++r) parts.push_back(fsdp::chunk_sharded(full, r, 4));
  ASSERT_EQ(parts[0].global_metadata().size(), 3u);
  EXPECT_EQ(parts[2].local_shards()[0].metadata.offsets, (std::vector<int64_t>{4, 0}));
  EXPECT_EQ(parts[2].local_shards()[0].metadata.sizes, (std::vector<int64_t>{1, 6}));
  EXPECT_TRUE(parts[3].local_shards().empty());
  // All pieces together give back any flattened range, bit for bit.
  std::vector<fsdp::Shard> all;
  for (auto& p : parts)
    for (auto& s : p.local_shards()) all.push_back(s);
  ShardedTensor whole({5, 6}, torch::kFloat, all);
  EXPECT_TRUE(torch::equal(whole.flat_range(7, 20, "x"), full.reshape({-1}).narrow(0, 7, 20)));
  // One rank's pieces alone cannot.
  EXPECT_THROW(parts[0].flat_range(10, 5, "x"), fsdp::ValueError);
  // 0-d and empty tensors.
  auto scalar = fsdp::chunk_sharded(torch::tensor(2.5), 0, 3);
  EXPECT_EQ(scalar.local_shards().size(), 1u);
  EXPECT_TRUE(fsdp::chunk_sharded(torch::tensor(2.5), 1, 3).local_shards().empty());
  EXPECT_EQ(scalar.flat_range(0, 1, "s").item<float>(), 2.5f);
  auto empty = fsdp::chunk_sharded(torch::empty({0, 3}), 0, 2);
  EXPECT_EQ(empty.numel(), 0);
  // Malformed pieces are rejected.
  EXPECT_THROW(ShardedTensor({4}, torch::kFloat, {fsdp::Shard{torch::ones({3}), {{2}, {3}, 0}}}),
               fsdp::ValueError);
  EXPECT_THROW(ShardedTensor({4}, torch::kFloat, {fsdp::Shard{torch::ones({2}), {{0}, {3}, 0}}}),
               fsdp::ValueError);
  EXPECT_THROW(ShardedTensor({4}, torch::kDouble, {fsdp::Shard{torch::ones({2}), {{0}, {2}, 0}}}),
               fsdp::ValueError);
  // An offset whose sum with the size would wrap past INT64_MAX is outside too, not "negative".
  const int64_t huge = std::numeric_limits<int64_t>::max() - 1;
  EXPECT_THROW(ShardedTensor({4}, torch::kFloat, {fsdp::Shard{torch::ones({2}), {{huge}, {2}, 0}}}),
               fsdp::ValueError);
  EXPECT_THROW(ShardedTensor({4}, torch::kFloat, {}, {fsdp::ShardMetadata{{huge}, {huge}, 1}}),
               fsdp::ValueError);
}

// The flat-range form of a piece: every range of every small shape becomes at most 2N - 1 boxes
// that hold exactly its elements in order, and a ShardedTensor built from a range gives it back.
TEST(ShardedTensor, FlatRangesAreAtMost2NMinus1Boxes) {
  const std::vector<std::vector<int64_t>> shapes{{},        {0},          {7},          {3, 4},
                                                 {2, 3, 4}, {2, 1, 3, 2}, {3, 3, 2, 2}, {3, 0, 2}};
  size_t worst = 0, ranges = 0;
  for (const auto& shape : shapes) {
    const at::Tensor full =
        torch::arange(c10::multiply_integers(shape), torch::kFloat).reshape(shape);
    const int64_t numel = full.numel();
    const size_t limit = shape.empty() ? 1 : 2 * shape.size() - 1;
    for (int64_t lo = 0; lo <= numel; ++lo) {
      for (int64_t n = 0; lo + n <= numel; ++n) {
        const auto boxes = fsdp::flat_range_boxes(shape, lo, n, /*rank=*/2);
        ASSERT_LE(boxes.size(), limit) << "shape " << full.sizes() << " range " << lo << "+" << n;
        worst = std::max(worst, boxes.size());
        ++ranges;
        std::vector<at::Tensor> parts;  // the boxes' elements, in order
        for (const auto& b : boxes) {
          EXPECT_EQ(b.placement_rank, 2);
          at::Tensor part = full;
          for (size_t d = 0; d < b.offsets.size(); ++d)
            part = part.narrow(static_cast<int64_t>(d), b.offsets[d], b.sizes[d]);
          parts.push_back(part.reshape({-1}));
        }
        const at::Tensor want = full.reshape({-1}).narrow(0, lo, n);
        const at::Tensor got = parts.empty() ? torch::empty({0}) : torch::cat(parts);
        ASSERT_TRUE(torch::equal(got, want))
            << "shape " << full.sizes() << " range " << lo << "+" << n;
        const ShardedTensor st = fsdp::sharded_from_flat_range(shape, lo, want.clone(), 2);
        ASSERT_TRUE(torch::equal(st.flat_range(lo, n, "r"), want));
      }
    }
  }
  EXPECT_EQ(worst, 7u) << "a 4-D range reaches the bound: 3 boxes each side of a middle one";
  std::printf("%zu ranges, at most %zu boxes for one\n", ranges, worst);
  EXPECT_GT(ranges, 500u);
  // The pieces are views of the data: no copy.
  const at::Tensor data = torch::arange(5, torch::kFloat);
  const ShardedTensor st = fsdp::sharded_from_flat_range({3, 4}, 2, data, 0);
  EXPECT_EQ(st.local_shards().front().tensor.data_ptr(), data.data_ptr());
  EXPECT_THROW(fsdp::flat_range_boxes({3, 4}, 10, 3), fsdp::ValueError);
  EXPECT_THROW(fsdp::sharded_from_flat_range({3, 4}, 0, torch::zeros({2, 2}), 0), fsdp::ValueError);
}

// ---------------------------------------------------------------------------------------------
// Wrapped models

// Moves every parameter away from its initial value, through a real training step.
void train_step(FullyShardedDataParallel& model, int rank) {
  auto idx = torch::randint(TinyLM::Impl::kVocab, {2, 5},
                            at::make_generator<at::CPUGeneratorImpl>(900 + rank));
  // A tied weight is listed once per owner by LibTorch: the optimizer must see it once.
  torch::optim::SGD opt(fsdp::testing::unique_params(model->parameters()), 0.5);
  opt.zero_grad();  // gradients of an earlier step must not carry over
  torch::nn::functional::cross_entropy(model->forward(idx).reshape({-1, TinyLM::Impl::kVocab}),
                                       idx.reshape({-1}))
      .backward();
  opt.step();
}

struct Cfg {
  int world;
  ShardingStrategy strategy;
  bool orig;
};
class StateDictWorld : public ::testing::TestWithParam<Cfg> {};

TEST_P(StateDictWorld, FullEqualsUnwrappedModelBitExactly) {
  const Cfg c = GetParam();
  run_ranks(c.world, [c](ProcessGroup&) {
    TinyLM plain(21);
    const StateDict expect = fsdp::module_state_dict(*plain);
    TinyLM m(21);
    FullyShardedDataParallel model(m, lm_options(m, c.strategy, c.orig));
    const StateDict got = full_of(model);
    expect_same(got, expect, "FULL vs unwrapped");
    EXPECT_TRUE(got.contains("tok.weight") && got.contains("head.weight"));  // tied: both FQNs
    for (auto* h : model->handles()) EXPECT_EQ(h->unsharded_storage_bytes(), 0);
  });
}

TEST_P(StateDictWorld, EveryTypeRoundTrips) {
  const Cfg c = GetParam();
  run_ranks(c.world, [c](ProcessGroup& pg) {
    // SHARDED twice: PyTorch's dim-0 chunks, and the flat shards as they lie.
    std::vector<std::pair<StateDictType, fsdp::ShardLayout>> types{
        {StateDictType::FULL_STATE_DICT, fsdp::ShardLayout::DIM0_CHUNKS}};
    if (c.strategy != ShardingStrategy::NO_SHARD) {
      types.push_back({StateDictType::SHARDED_STATE_DICT, fsdp::ShardLayout::DIM0_CHUNKS});
      types.push_back({StateDictType::SHARDED_STATE_DICT, fsdp::ShardLayout::FLAT_SHARDS});
      types.push_back({StateDictType::LOCAL_STATE_DICT, fsdp::ShardLayout::DIM0_CHUNKS});
    }
    for (auto [type, layout] : types) {
      const std::string what = "round trip of type " + std::to_string(static_cast<int>(type)) +
                               " layout " + std::to_string(static_cast<int>(layout));
      TinyLM a(31);
      FullyShardedDataParallel src(a, lm_options(a, c.strategy, c.orig));
      train_step(src, pg.rank());
      const StateDict expect = full_of(src);
      StateDict saved;
      int gathered = 0;
      {
        // The observer goes with the config of the type that gathers: FULL's, or SHARDED's.
        const fsdp::GatherObserver count = [&](int64_t) { ++gathered; };
        std::optional<fsdp::StateDictTypeGuard> g;
        if (type == StateDictType::FULL_STATE_DICT) {
          g.emplace(src, type, fsdp::FullStateDictConfig().on_gather(count));
        } else {
          g.emplace(src, type, fsdp::ShardedStateDictConfig().layout(layout).on_gather(count));
        }
        saved = fsdp::state_dict(src);
      }
      if (layout == fsdp::ShardLayout::FLAT_SHARDS) {
        EXPECT_EQ(gathered, 0) << "FLAT_SHARDS must not unshard any unit";
        // The global metadata tiles each parameter exactly, and names this rank's pieces.
        for (const auto& [k, v] : saved) {
          if (!v.is_sharded_tensor()) continue;
          const fsdp::ShardedTensor& t = v.sharded_tensor();
          int64_t total = 0;
          for (const auto& m : t.global_metadata()) total += m.numel();
          EXPECT_EQ(total, std::max<int64_t>(t.numel(), 0)) << k;
          for (const auto& s : t.local_shards())
            EXPECT_NE(std::find(t.global_metadata().begin(), t.global_metadata().end(), s.metadata),
                      t.global_metadata().end())
                << k;
        }
      } else if (type != StateDictType::LOCAL_STATE_DICT) {
        EXPECT_GT(gathered, 0) << "the probe must see gathering (negative control)";
      }
      TinyLM b(32);  // different initial values
      FullyShardedDataParallel dst(b, lm_options(b, c.strategy, c.orig));
      {
        fsdp::StateDictTypeGuard g(dst, type);
        auto res = fsdp::load_state_dict(dst, saved);
        EXPECT_TRUE(res.missing_keys.empty() && res.unexpected_keys.empty());
      }
      expect_same(full_of(dst), expect, what);
      // The loaded model trains on from there like the original.
      train_step(src, pg.rank());
      train_step(dst, pg.rank());
      expect_same(full_of(dst), full_of(src), "after a further step");
    }
  });
}

std::vector<Cfg> cfgs() {
  std::vector<Cfg> out;
  for (int w : {1, 2, 3, 4}) {
    out.push_back({w, ShardingStrategy::FULL_SHARD, false});
    out.push_back({w, ShardingStrategy::FULL_SHARD, true});
  }
  out.push_back({2, ShardingStrategy::NO_SHARD, false});
  out.push_back({3, ShardingStrategy::SHARD_GRAD_OP, true});
  return out;
}
INSTANTIATE_TEST_SUITE_P(Worlds, StateDictWorld, ::testing::ValuesIn(cfgs()), [](const auto& info) {
  return "W" + std::to_string(info.param.world) + "_" + fsdp::to_string(info.param.strategy) +
         (info.param.orig ? "_orig" : "_flat");
});

TEST(ModelStateDict, Rank0OnlyAndOffload) {
  run_ranks(3, [](ProcessGroup& pg) {
    for (auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::NO_SHARD}) {
      TinyLM m(4);
      FullyShardedDataParallel model(m, lm_options(m, strategy, false));
      const StateDict expect = full_of(model);
      StateDict sd;
      {
        fsdp::StateDictTypeGuard g(
            model, StateDictType::FULL_STATE_DICT,
            fsdp::FullStateDictConfig().rank0_only(true).offload_to_cpu(true));
        sd = fsdp::state_dict(model);
      }
      // Values must be clones: a training step updates the flat parameters in place and
      // reshards (freeing gathered storage), which a view would follow or lose.
      train_step(model, pg.rank());
      if (pg.rank() != 0) {
        EXPECT_TRUE(sd.empty());
        continue;
      }
      ASSERT_EQ(sd.size(), fsdp::module_state_dict(*TinyLM(4)).size());
      for (const auto& [k, v] : sd) EXPECT_TRUE(v.tensor().device().is_cpu()) << k;
      expect_same(sd, expect, std::string("rank0_only ") + fsdp::to_string(strategy));
    }
  });
}

TEST(ModelStateDict, MixedPrecisionStateDictKeepsOriginalDtypes) {
  run_ranks(2, [](ProcessGroup& pg) {
    TinyLM m(5);
    auto opts =
        lm_options(m, ShardingStrategy::FULL_SHARD, false)
            .mixed_precision(
                fsdp::MixedPrecision().param_dtype(at::kBFloat16).buffer_dtype(at::kBFloat16));
    FullyShardedDataParallel model(m, opts);
    train_step(model, pg.rank());
    EXPECT_EQ(m->scale.scalar_type(), at::kBFloat16);  // buffers were cast for compute
    // The float32 truth: full-precision parameters as summoned (gathered in float32).
    std::map<std::string, torch::Tensor> truth;
    {
      fsdp::SummonFullParamsGuard s(model, false);
      for (const auto& p : m->named_parameters()) truth[p.key()] = p.value().detach().clone();
    }
    for (auto type : {StateDictType::FULL_STATE_DICT, StateDictType::SHARDED_STATE_DICT}) {
      fsdp::StateDictTypeGuard g(model, type);
      StateDict sd = fsdp::state_dict(model);
      for (const auto& [k, v] : sd) {
        const auto dtype = v.is_tensor() ? v.tensor().scalar_type() : v.sharded_tensor().dtype();
        EXPECT_EQ(dtype, at::kFloat) << k;
        if (!truth.count(k)) continue;
        // Bit-exact: gathering in bfloat16 and casting up would lose the low mantissa bits.
        if (v.is_tensor()) {
          EXPECT_TRUE(torch::equal(v.tensor(), truth.at(k))) << k;
        } else {
          for (const auto& s : v.sharded_tensor().local_shards()) {
            at::Tensor want = truth.at(k);
            for (size_t d = 0; d < s.metadata.offsets.size(); ++d)
              want = want.narrow(d, s.metadata.offsets[d], s.metadata.sizes[d]);
            EXPECT_TRUE(torch::equal(s.tensor, want)) << k;
          }
        }
      }
      EXPECT_NO_THROW(fsdp::load_state_dict(model, sd));
    }
  });
}

// FULL gathering never unshards a sharded unit: the flat shards go through a gather queue whose
// gathers in flight hold at most its window (one unit at a time with a window of 0), with small
// units gathered several to a collective, and every window gives the unwrapped model's values
// bit for bit, with and without rank0_only (offload on, as for a checkpoint).
TEST(ModelStateDict, FullGatheringHoldsAtMostItsWindow) {
  for (int world : {2, 3}) {
    run_ranks(world, [](ProcessGroup& pg) {
      const StateDict expect = fsdp::module_state_dict(*TinyLM(6));
      TinyLM m(6);
      FullyShardedDataParallel model(m, lm_options(m, ShardingStrategy::FULL_SHARD, true));
      auto handles = model->handles();
      int64_t largest = 0;
      for (auto* h : handles) largest = std::max(largest, h->layout().padded_unsharded_numel * 4);
      int64_t peak = 0, unsharded = 0;
      int calls = 0;
      auto probe = [&](int64_t bytes) {
        peak = std::max(peak, bytes);
        for (auto* h : handles) unsharded += h->unsharded_storage_bytes();
        ++calls;
      };
      const int64_t default_window = fsdp::FullStateDictConfig().gather_window_bytes();
      auto full = [&](int64_t window, bool rank0_only) {
        peak = 0;
        calls = 0;
        fsdp::StateDictTypeGuard g(model, StateDictType::FULL_STATE_DICT,
                                   fsdp::FullStateDictConfig()
                                       .offload_to_cpu(true)
                                       .rank0_only(rank0_only)
                                       .gather_window_bytes(window)
                                       .on_gather(probe));
        return fsdp::state_dict(model);
      };
      const StateDict one_at_a_time = full(0, false);
      const int calls_one = calls;
      const int64_t peak_one = peak;
      expect_same(one_at_a_time, expect, "window 0");
      EXPECT_EQ(calls_one, static_cast<int>(handles.size())) << "one gather per unit";
      // One unit's gathered flat parameter and the shard it is gathered from.
      EXPECT_GT(peak_one, 0);
      EXPECT_LE(peak_one, largest + largest / pg.size());
      // A window of about two blocks (a block's flat parameter is about 1 KB gathered), and the
      // default, which takes all of this model's units into one bucket.
      for (int64_t window : {int64_t{2000}, default_window}) {
        for (bool rank0_only : {false, true}) {
          const std::string what =
              "window " + std::to_string(window) + (rank0_only ? " rank0_only" : "");
          const StateDict got = full(window, rank0_only);
          EXPECT_LT(calls, calls_one) << what << ": nothing gathered together";
          // The window, plus the gather started last (input, output and a bucket's copies out).
          EXPECT_LE(peak,
                    window + 3 * std::max(largest, std::min<int64_t>(window, int64_t{4} << 20)))
              << what;
          if (rank0_only && pg.rank() != 0) {
            EXPECT_TRUE(got.empty()) << what;
          } else {
            expect_same(got, expect, what);
          }
        }
      }
      EXPECT_EQ(unsharded, 0) << "a unit was unsharded during FULL gathering";
      if (pg.rank() == 0) {
        std::printf("W=%d: %d units, largest %lld bytes gathered; window 0 peak %lld bytes\n",
                    pg.size(), calls_one, static_cast<long long>(largest),
                    static_cast<long long>(peak_one));
      }
    });
  }
}

// Trains at W=2 and writes the SHARDED pieces of each rank, and rank 0's FULL values, to `dir`.
void write_sharded_checkpoint_at_two(const std::string& dir) {
  run_ranks(2, [&dir](ProcessGroup& pg) {
    TinyLM m(41);
    FullyShardedDataParallel model(m, lm_options(m, ShardingStrategy::FULL_SHARD, false));
    train_step(model, pg.rank());
    StateDict full = full_of(model);
    fsdp::StateDictTypeGuard g(model, StateDictType::SHARDED_STATE_DICT);
    save_pieces(fsdp::state_dict(model), pg.rank(), dir);
    if (pg.rank() == 0) {
      std::vector<torch::Tensor> vals;
      for (const auto& [k, v] : full) vals.push_back(v.tensor());
      torch::save(vals, dir + "/expected.pt");
    }
  });
}

TEST(ModelStateDict, ShardedSavedAtTwoLoadsAtThreeAndOne) {
  fsdp::testing::TempDir tmp;
  const std::string dir = tmp.path();
  write_sharded_checkpoint_at_two(dir);
  for (int world : {3, 1}) {
    for (bool orig : {false, true}) {
      run_ranks(world, [orig, &dir](ProcessGroup&) {
        std::vector<torch::Tensor> expected;
        torch::load(expected, dir + "/expected.pt");
        TinyLM m(99);
        FullyShardedDataParallel model(m, lm_options(m, ShardingStrategy::FULL_SHARD, orig));
        {
          fsdp::StateDictTypeGuard g(model, StateDictType::SHARDED_STATE_DICT);
          fsdp::load_state_dict(model, load_pieces(2, dir));
        }
        StateDict got = full_of(model);
        ASSERT_EQ(got.size(), expected.size());
        size_t i = 0;
        for (const auto& [k, v] : got) EXPECT_TRUE(torch::equal(v.tensor(), expected[i++])) << k;
      });
    }
  }
}

// One rank holds every piece (read from storage), the other only its own: the ranks exchange
// pieces, the duplicates that creates must not confuse coverage.
TEST(ModelStateDict, ShardedLoadWithUnevenlySuppliedPieces) {
  fsdp::testing::TempDir tmp;
  const std::string dir = tmp.path();
  write_sharded_checkpoint_at_two(dir);  // this test's own files: it runs alone or shuffled
  run_ranks(2, [&dir](ProcessGroup& pg) {
    std::vector<torch::Tensor> expected;
    torch::load(expected, dir + "/expected.pt");
    StateDict all = load_pieces(2, dir);
    StateDict sd = all;
    if (pg.rank() == 1) {
      for (auto& [k, v] : sd) {
        if (!v.is_sharded_tensor()) continue;
        std::vector<fsdp::Shard> own;
        for (const auto& s : v.sharded_tensor().local_shards())
          if (s.metadata.placement_rank == 1) own.push_back(s);
        v = ShardedTensor(v.sharded_tensor().size(), v.sharded_tensor().dtype(), own);
      }
    }
    TinyLM m(98);
    FullyShardedDataParallel model(m, lm_options(m, ShardingStrategy::FULL_SHARD, false));
    {
      fsdp::StateDictTypeGuard g(model, StateDictType::SHARDED_STATE_DICT);
      fsdp::load_state_dict(model, sd);
    }
    StateDict got = full_of(model);
    size_t i = 0;
    for (const auto& [k, v] : got) EXPECT_TRUE(torch::equal(v.tensor(), expected[i++])) << k;
  });
}

TEST(ModelStateDict, StrictnessShapesDtypesAndAllOrNothing) {
  run_ranks(2, [](ProcessGroup& pg) {
    TinyLM m(7);
    FullyShardedDataParallel model(m, lm_options(m, ShardingStrategy::FULL_SHARD, true));
    const StateDict good = full_of(model);
    auto expect_error = [&](const StateDict& sd, const std::string& needle, bool strict = true,
                            bool strict_dtype = false) {
      try {
        fsdp::load_state_dict(model, sd, strict, strict_dtype);
        ADD_FAILURE() << "expected ValueError mentioning " << needle;
      } catch (const fsdp::ValueError& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
      expect_same(full_of(model), good, "after a failed load");
    };
    StateDict missing = good;
    missing.erase("blocks.1.fc2.bias");
    missing.insert_or_assign("extra.weight", torch::ones({1}));
    expect_error(missing, "Missing key(s) in state_dict: \"blocks.1.fc2.bias\"");
    expect_error(missing, "Unexpected key(s) in state_dict: \"extra.weight\"");
    StateDict shape = good;
    shape.insert_or_assign("blocks.0.fc1.weight", torch::zeros({13, 9}));
    expect_error(shape, "blocks.0.fc1.weight");
    StateDict dtype = good;
    dtype.insert_or_assign("blocks.2.fc2.bias", torch::zeros({8}, torch::kDouble));
    expect_error(dtype, "dtype mismatch for 'blocks.2.fc2.bias'", true, /*strict_dtype=*/true);
    // Only rank 1's dict is bad: every rank refuses and nothing is loaded anywhere.
    StateDict one_bad = good;
    for (auto& [k, v] : one_bad) v = v.tensor() + 1;  // would change every value if applied
    if (pg.rank() == 1) one_bad.insert_or_assign("scale", torch::zeros({3}));
    expect_error(one_bad, "scale");
    // Non-strict: loads what matches and reports the rest.
    StateDict partial = good;
    partial.erase("tok.weight");
    partial.insert_or_assign("bogus", torch::ones({1}));
    auto res = fsdp::load_state_dict(model, partial, /*strict=*/false);
    EXPECT_EQ(res.missing_keys, std::vector<std::string>{"tok.weight"});
    EXPECT_EQ(res.unexpected_keys, std::vector<std::string>{"bogus"});
  });
}

TEST(ModelStateDict, LocalNeedsTheSameWorldSizeAndShardedNeedsSharding) {
  run_ranks(2, [](ProcessGroup&) {
    TinyLM m(8);
    FullyShardedDataParallel model(m, lm_options(m, ShardingStrategy::FULL_SHARD, false));
    StateDict local;
    {
      fsdp::StateDictTypeGuard g(model, StateDictType::LOCAL_STATE_DICT);
      local = fsdp::state_dict(model);
      EXPECT_TRUE(local.contains("_flat_param"));
      EXPECT_TRUE(local.contains("blocks.0._flat_param"));
      EXPECT_TRUE(local.contains("scale"));
    }
    // Pretend it came from another world size: shift the piece's offset.
    auto& st = local.at("blocks.0._flat_param").sharded_tensor();
    for (auto& s : st.local_shards()) s.metadata.offsets[0] += 1;
    fsdp::StateDictTypeGuard g(model, StateDictType::LOCAL_STATE_DICT);
    EXPECT_THROW(fsdp::load_state_dict(model, local), fsdp::ValueError);
  });
}

}  // namespace

namespace {

TEST(ModelStateDict, HybridShardRoundTripsFullAndSharded) {
  run_ranks(4, [](ProcessGroup& pg) {
    for (auto layout : {fsdp::ShardLayout::DIM0_CHUNKS, fsdp::ShardLayout::FLAT_SHARDS})
      for (auto type : {StateDictType::FULL_STATE_DICT, StateDictType::SHARDED_STATE_DICT}) {
        TinyLM a(51);
        FullyShardedDataParallel src(
            a, lm_options(a, ShardingStrategy::HYBRID_SHARD, false).hybrid_shard_size(2));
        train_step(src, pg.rank());
        const StateDict expect = full_of(src);
        EXPECT_EQ(expect.keys(), fsdp::module_state_dict(*TinyLM(51)).keys());
        StateDict saved;
        {
          fsdp::StateDictTypeGuard g(src, type, fsdp::ShardedStateDictConfig().layout(layout));
          saved = fsdp::state_dict(src);
        }
        TinyLM b(52);
        FullyShardedDataParallel dst(
            b, lm_options(b, ShardingStrategy::HYBRID_SHARD, true).hybrid_shard_size(2));
        {
          fsdp::StateDictTypeGuard g(dst, type);
          fsdp::load_state_dict(dst, saved);
        }
        expect_same(full_of(dst), expect, "hybrid round trip");
      }
  });
}

}  // namespace
