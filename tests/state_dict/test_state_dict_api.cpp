// get_/set_state_dict where users combine options (issue 37): the full checkpoint on rank 0,
// broadcast_from_rank0 with a 0-d parameter, a bad dict on one rank, and the state-dict
// utilities' seed semantics (distribute, similarity, copy, rekey, flatten). Each test failed on
// the code before the fix it names. The option matrix (test_sd_matrix.cpp) runs the rest.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>

#include "fsdp/checkpoint/state_dict.h"
#include "fsdp/errors.h"
#include "fsdp/optim_state_dict.h"
#include "fsdp/state_dict_utils.h"
#include "multi_rank.h"
#include "optim_testing.h"
#include "sd_matrix_model.h"
#include "state_dict_testing.h"
#include "tiny_lm.h"

namespace {

namespace ckpt = fsdp::checkpoint;
namespace mx = fsdp::testing::matrix;
using ckpt::StateDictOptions;
using fsdp::FullyShardedDataParallel;
using fsdp::ShardingStrategy;
using fsdp::StateDict;
using fsdp::StateList;
using fsdp::StateValue;
using fsdp::dist::ProcessGroup;
using fsdp::testing::error_of;
using fsdp::testing::run_ranks;

const ShardingStrategy kStrategies[] = {ShardingStrategy::FULL_SHARD,
                                        ShardingStrategy::SHARD_GRAD_OP, ShardingStrategy::NO_SHARD,
                                        ShardingStrategy::HYBRID_SHARD};
const auto kFull = StateDictOptions().full_state_dict(true);

// The matrix model wrapped, its five optimizers, trained `steps` steps.
struct Trained {
  mx::MatrixNet net;
  FullyShardedDataParallel model{nullptr};
  mx::Optimizers optims;
  Trained(uint64_t seed, ShardingStrategy s, bool orig, ProcessGroup& pg, int steps) : net(seed) {
    model = FullyShardedDataParallel(net, mx::matrix_options(net, s, orig, pg.size()));
    std::vector<std::vector<at::Tensor>> params(mx::unit_names().size());
    for (const auto& pf : model->param_fqns()) params[mx::unit_of(pf.fqns[0])].push_back(pf.param);
    optims = mx::make_optimizers(params);
    for (int step = 0; step < steps; ++step) {
      optims.zero_grad();
      auto idx = mx::matrix_tokens(step, pg.rank(), pg.size());
      mx::matrix_loss(model->forward(idx), idx).backward();
      optims.step();
    }
  }
  std::pair<StateDict, StateDict> full() {
    return ckpt::get_state_dict(model, optims.list(), kFull);
  }
};

// Every value compared, whatever its kind (issue 62: this once skipped bools, strings and list
// elements, so an optimizer's `betas` or `amsgrad` could differ unseen): the same kind (an int is
// not a double), bit-equal tensors of the same dtype and shape, sharded tensors piece by piece,
// lists element by element, dicts key by key in order. `path` names the first difference.
void expect_value_equal(const StateValue& v, const StateValue& w, const std::string& path);

void expect_equal(const StateDict& a, const StateDict& b, const std::string& what) {
  ASSERT_EQ(a.keys(), b.keys()) << what;
  for (const auto& [k, v] : a) expect_value_equal(v, b.at(k), what + "/" + k);
}

uint64_t bits_of(double x) {
  uint64_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

void expect_tensor_equal(const at::Tensor& t, const at::Tensor& u, const std::string& path) {
  ASSERT_EQ(t.defined(), u.defined()) << path;
  if (!t.defined()) return;
  EXPECT_EQ(t.scalar_type(), u.scalar_type()) << path;
  EXPECT_EQ(t.sizes(), u.sizes()) << path;
  if (t.scalar_type() == u.scalar_type() && t.sizes() == u.sizes()) {
    EXPECT_TRUE(torch::equal(t, u)) << path;
  }
}

void expect_value_equal(const StateValue& v, const StateValue& w, const std::string& path) {
  using Kind = StateValue::Kind;
  ASSERT_EQ(v.kind(), w.kind()) << path << ": " << fsdp::to_string(v.kind()) << " against "
                                << fsdp::to_string(w.kind());
  switch (v.kind()) {
    case Kind::NONE:
      return;
    case Kind::TENSOR:
      return expect_tensor_equal(v.tensor(), w.tensor(), path);
    case Kind::SHARDED_TENSOR: {
      const auto &s = v.sharded_tensor(), &t = w.sharded_tensor();
      EXPECT_EQ(s.size(), t.size()) << path;
      EXPECT_EQ(s.global_metadata(), t.global_metadata()) << path;
      ASSERT_EQ(s.local_shards().size(), t.local_shards().size()) << path;
      for (size_t i = 0; i < s.local_shards().size(); ++i) {
        const std::string at_i = path + " piece " + std::to_string(i);
        EXPECT_EQ(s.local_shards()[i].metadata, t.local_shards()[i].metadata) << at_i;
        expect_tensor_equal(s.local_shards()[i].tensor, t.local_shards()[i].tensor, at_i);
      }
      return;
    }
    case Kind::INT:
      EXPECT_EQ(v.to_int(), w.to_int()) << path;
      return;
    case Kind::DOUBLE:
      // Bit for bit: NaN equals NaN, -0.0 does not equal 0.0.
      EXPECT_EQ(bits_of(v.to_double()), bits_of(w.to_double()))
          << path << ": " << v.to_double() << " against " << w.to_double();
      return;
    case Kind::BOOL:
      EXPECT_EQ(v.to_bool(), w.to_bool()) << path;
      return;
    case Kind::STRING:
      EXPECT_EQ(v.string(), w.string()) << path;
      return;
    case Kind::LIST:
      ASSERT_EQ(v.list().size(), w.list().size()) << path;
      for (size_t i = 0; i < v.list().size(); ++i) {
        expect_value_equal(v.list()[i], w.list()[i], path + "[" + std::to_string(i) + "]");
      }
      return;
    case Kind::DICT:
      return expect_equal(v.dict(), w.dict(), path);
    default:
      FAIL() << path << ": a kind this comparison does not know";
  }
}

// A comparison that can fail: each kind's difference, planted in a copy, is caught (and named).
TEST(StateDictApi, ExpectEqualComparesEveryKind) {
  StateDict inner;
  inner.insert_or_assign("betas", StateList{StateValue(0.9), StateValue(0.999)});
  inner.insert_or_assign("amsgrad", StateValue(false));
  inner.insert_or_assign("params", StateList{StateValue("a.weight"), StateValue("b.bias")});
  inner.insert_or_assign("step", StateValue(int64_t{3}));
  inner.insert_or_assign("lr", StateValue(0.1));
  inner.insert_or_assign("exp_avg", StateValue(torch::arange(4, torch::kFloat)));
  inner.insert_or_assign("nothing", StateValue());
  StateDict base;
  base.insert_or_assign("group", inner);
  base.insert_or_assign("groups", StateList{StateValue(inner)});
  expect_equal(base, base, "itself");
  using Change = std::function<void(StateDict&)>;
  auto group = [](StateDict& d) -> StateDict& { return d.at("group").dict(); };
  const std::vector<std::pair<std::string, Change>> changes = {
      {"a list element", [&](StateDict& d) { group(d).at("betas").list()[1] = StateValue(0.99); }},
      {"a bool", [&](StateDict& d) { group(d).insert_or_assign("amsgrad", StateValue(true)); }},
      {"a string in a list",
       [&](StateDict& d) { group(d).at("params").list()[0] = StateValue("c.weight"); }},
      {"an int for a double",
       [&](StateDict& d) { group(d).insert_or_assign("lr", StateValue(int64_t{0})); }},
      {"an int", [&](StateDict& d) { group(d).insert_or_assign("step", StateValue(int64_t{4})); }},
      {"a dtype",
       [&](StateDict& d) {
         group(d).insert_or_assign("exp_avg", StateValue(torch::arange(4, torch::kDouble)));
       }},
      {"a value in a list's dict",
       [&](StateDict& d) {
         d.at("groups").list()[0].dict().insert_or_assign("step", StateValue(int64_t{5}));
       }},
      {"None for a value", [&](StateDict& d) { group(d).insert_or_assign("lr", StateValue()); }},
  };
  for (const auto& [what, change] : changes) {
    StateDict changed = base;  // lists and dicts by value; no tensor is changed in place
    change(changed);
    ::testing::TestPartResultArray failures;
    {
      ::testing::ScopedFakeTestPartResultReporter reporter(
          ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &failures);
      expect_equal(base, changed, what);
    }
    EXPECT_GT(failures.size(), 0) << what << " went unnoticed";
  }
}

// Each ShardedTensor in a state-dict tree, with its path.
void for_each_sharded(
    const StateValue& v, const std::string& path,
    const std::function<void(const fsdp::ShardedTensor&, const std::string&)>& f) {
  if (v.is_sharded_tensor()) f(v.sharded_tensor(), path);
  if (v.is_list()) {
    for (size_t i = 0; i < v.list().size(); ++i)
      for_each_sharded(v.list()[i], path + "[" + std::to_string(i) + "]", f);
  }
  if (v.is_dict()) {
    for (const auto& [k, w] : v.dict()) for_each_sharded(w, path + "/" + k, f);
  }
}

// Issue 62: PyTorch's W=4 oracle found that under HYBRID_SHARD (2 x 2 here) fsdp-cpp named a
// SHARDED dict's local pieces by global rank where PyTorch's ShardedTensor names them by rank in
// the shard group (the tensor's process group), while its global metadata names the default
// group's ranks (src/state_dict/global_placement.h). Only the W=4 oracle caught it; this holds it
// in C++: in the model's and the optimizers' dicts, a local piece names this rank's place in its
// shard group, and every entry of the global metadata a global rank of that same group.
TEST(StateDictApi, HybridShardPiecesAreNamedByShardGroupRank) {
  run_ranks(4, [](ProcessGroup& pg) {
    for (bool orig : {false, true}) {
      Trained t(1, ShardingStrategy::HYBRID_SHARD, orig, pg, 1);
      auto [msd, osd] = ckpt::get_state_dict(t.model, t.optims.list(), StateDictOptions());
      StateDict both;
      both.insert_or_assign("model", msd);
      both.insert_or_assign("optim", osd);
      int local = 0;
      for_each_sharded(both, orig ? "orig" : "flat",
                       [&](const fsdp::ShardedTensor& st, const std::string& path) {
                         for (const auto& piece : st.local_shards()) {
                           EXPECT_EQ(piece.metadata.placement_rank, pg.rank() % 2) << path;
                           ++local;
                         }
                         const int first = pg.rank() - pg.rank() % 2;  // {0, 1} or {2, 3}
                         for (const auto& m : st.global_metadata()) {
                           EXPECT_GE(m.placement_rank, first) << path;
                           EXPECT_LE(m.placement_rank, first + 1) << path;
                         }
                       });
      EXPECT_GT(local, 10) << "the dicts hold sharded pieces on every rank";
    }
  });
}

class Worlds : public ::testing::TestWithParam<int> {};

// Issue 37, scenario 1: a consolidated checkpoint, as PyTorch users take it. get with
// full_state_dict + cpu_offload leaves values on rank 0 and empty dicts elsewhere (the optimizer's
// too; before the fix ranks > 0 got {"state": {}, "param_groups": []}); set with the same options
// and the same dicts loads rank 0's everywhere (before: "the dict has 0 param groups" on every
// rank). Every strategy, both use_orig_params.
TEST_P(Worlds, FullCpuOffloadCheckpointRoundTrips) {
  run_ranks(GetParam(), [](ProcessGroup& pg) {
    const auto opts = StateDictOptions().full_state_dict(true).cpu_offload(true);
    for (ShardingStrategy s : kStrategies) {
      for (bool orig : {false, true}) {
        const std::string what = std::string(fsdp::to_string(s)) + (orig ? " orig" : " flat");
        Trained src(1, s, orig, pg, 2);
        auto [msd, osd] = ckpt::get_state_dict(src.model, src.optims.list(), opts);
        EXPECT_EQ(msd.empty(), pg.rank() != 0) << what;
        EXPECT_EQ(osd.empty(), pg.rank() != 0) << what;
        Trained dst(9, s, orig, pg, 0);
        ckpt::set_state_dict(dst.model, dst.optims.list(), msd, osd, opts);
        auto [want_m, want_o] = src.full();
        auto [got_m, got_o] = dst.full();
        expect_equal(got_m, want_m, what + " model");
        expect_equal(got_o, want_o, what + " optimizers");
        // Item 3: the optimizers alone, the same way (before: rank 0 entered the load's
        // collectives while the others returned).
        Trained dst2(9, s, orig, pg, 0);
        ckpt::set_optimizer_state_dict(dst2.model, dst2.optims.list(), osd, opts);
        expect_equal(dst2.full().second, want_o, what + " optimizers alone");
      }
    }
  });
}

// Issue 37, scenario 2: broadcast_from_rank0 with a 0-d parameter (gain), rank 0 holding dicts
// from a full get, the others passing empty ones. Before the fix rank 0 threw LibTorch's
// "self.dim() cannot be 0 to view Float as Byte" and the others "state value is Tensor, not
// ShardedTensor".
TEST_P(Worlds, BroadcastFromRank0WithAScalarParameter) {
  run_ranks(GetParam(), [](ProcessGroup& pg) {
    const auto bcast = StateDictOptions().full_state_dict(true).broadcast_from_rank0(true);
    for (ShardingStrategy s : kStrategies) {
      for (bool orig : {false, true}) {
        const std::string what = std::string(fsdp::to_string(s)) + (orig ? " orig" : " flat");
        Trained src(1, s, orig, pg, 2);
        auto [want_m, want_o] = src.full();
        ASSERT_EQ(want_m.at("gain").tensor().dim(), 0);
        const StateDict msd = pg.rank() == 0 ? want_m : StateDict();
        const StateDict osd = pg.rank() == 0 ? want_o : StateDict();
        Trained dst(9, s, orig, pg, 0);
        ckpt::set_state_dict(dst.model, dst.optims.list(), msd, osd, bcast);
        auto [got_m, got_o] = dst.full();
        expect_equal(got_m, want_m, what + " model");
        expect_equal(got_o, want_o, what + " optimizers");
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(StateDictApi, Worlds, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return "W" + std::to_string(info.param); });

// A dict one rank cannot use fails every rank at once, naming that rank, and changes nothing.
// Before, rank 1 threw alone while the others waited in the load's collectives until the
// timeout (here 10 s, so the old code fails the deadline below).
TEST(StateDictApi, ABadDictOnOneRankFailsEveryRankAtOnce) {
  fsdp::testing::RunOptions ro;
  ro.collective_timeout = std::chrono::seconds(10);
  ro.deadline = std::chrono::seconds(60);
  run_ranks(
      3,
      [](ProcessGroup& pg) {
        Trained src(1, ShardingStrategy::FULL_SHARD, true, pg, 2);
        const auto full = src.full();
        const StateDict& msd = full.first;
        const StateDict& osd = full.second;
        Trained dst(9, ShardingStrategy::FULL_SHARD, true, pg, 0);
        const auto before = dst.full();
        StateDict bad = osd;
        if (pg.rank() == 1) bad.erase("param_groups");
        const auto t0 = std::chrono::steady_clock::now();
        const std::string err =
            error_of([&] { ckpt::set_state_dict(dst.model, dst.optims.list(), msd, bad, kFull); });
        EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
        EXPECT_NE(err.find("param_groups"), std::string::npos) << err;
        if (pg.rank() != 1) {
          EXPECT_NE(err.find("rank 1"), std::string::npos) << err;
        }
        // A model dict on some ranks only (outside the full + cpu_offload case) is refused alike.
        const StateDict some = pg.rank() == 2 ? StateDict() : msd;
        const std::string mixed =
            error_of([&] { ckpt::set_state_dict(dst.model, dst.optims.list(), some, osd, kFull); });
        EXPECT_NE(mixed.find("rank 2 passed an empty model state dict"), std::string::npos)
            << mixed;
        // A strict load that would miss keys refuses before the optimizers are loaded.
        StateDict partial = msd;
        partial.erase("blocks.3.fc2.bias");
        const std::string missing = error_of(
            [&] { ckpt::set_state_dict(dst.model, dst.optims.list(), partial, osd, kFull); });
        EXPECT_NE(missing.find("Missing key(s) in state_dict: \"blocks.3.fc2.bias\""),
                  std::string::npos)
            << missing;
        const auto after = dst.full();
        expect_equal(after.first, before.first, "model unchanged");
        expect_equal(after.second, before.second, "optimizers unchanged");
      },
      ro);
}

// A SHARDED load takes a parameter held whole as a plain tensor: PyTorch's FSDP runs every
// strategy as NO_SHARD at world size 1, so its SHARDED dicts hold plain tensors there. Before,
// "'gain' must be a ShardedTensor in a SHARDED state dict".
TEST(StateDictApi, ShardedLoadTakesWholeTensors) {
  run_ranks(2, [](ProcessGroup& pg) {
    Trained src(1, ShardingStrategy::FULL_SHARD, false, pg, 2);
    const auto full = src.full();
    Trained dst(9, ShardingStrategy::FULL_SHARD, false, pg, 0);
    ckpt::set_state_dict(dst.model, dst.optims.list(), full.first, full.second,
                         StateDictOptions());  // SHARDED
    const auto got = dst.full();
    expect_equal(got.first, full.first, "model");
    expect_equal(got.second, full.second, "optimizers");
  });
}

// Item 4: broadcast_from_rank0 into plain replicas takes an optimizer dict the strict template
// copy refused: no state for a parameter that never had a gradient, a scheduler's "initial_lr"
// group key, group keys an older PyTorch did not write. The result equals loading it directly.
TEST(StateDictApi, PlainBroadcastTakesWhatADirectLoadTakes) {
  run_ranks(2, [](ProcessGroup& pg) {
    fsdp::testing::TinyLM src(3);
    auto opt = std::make_unique<torch::optim::Adam>(fsdp::testing::unique_params(src->parameters()),
                                                    torch::optim::AdamOptions(0.01));
    auto idx = fsdp::testing::lm_tokens(2, 5);
    fsdp::testing::lm_loss(src->forward(idx), idx).backward();
    opt->step();
    StateDict osd = ckpt::get_optimizer_state_dict(src, *opt, kFull);
    osd.at("state").dict().erase("blocks.2.fc2.bias");  // as if it never had a gradient
    StateDict group = osd.at("param_groups").list()[0].dict();
    group.insert_or_assign("initial_lr", 0.01);
    group.erase("fused");  // PyTorch < 2.0 wrote none of these
    group.erase("differentiable");
    osd.at("param_groups").list()[0] = StateValue(group);

    auto fresh = [] {
      fsdp::testing::TinyLM m(4);
      auto o = std::make_unique<torch::optim::Adam>(fsdp::testing::unique_params(m->parameters()),
                                                    torch::optim::AdamOptions(0.5));
      return std::make_pair(m, std::move(o));
    };
    auto [direct_m, direct_o] = fresh();
    ckpt::set_optimizer_state_dict(direct_m, *direct_o, osd, kFull);
    auto [b_m, b_o] = fresh();
    ckpt::set_optimizer_state_dict(b_m, *b_o, pg.rank() == 0 ? osd : StateDict(),
                                   StateDictOptions(kFull).broadcast_from_rank0(true));
    expect_equal(ckpt::get_optimizer_state_dict(b_m, *b_o, kFull),
                 ckpt::get_optimizer_state_dict(direct_m, *direct_o, kFull), "broadcast");
  });
}

// Item 5: distribute_state_dict copies numbers, strings and 0-d tensors from the full dict (a
// stale lr or step stayed before), fills pieces, and leaves keys only the template has alone.
TEST(StateDictApi, DistributeCopiesEveryValueAndKeepsExtraKeys) {
  StateDict full;
  full.insert_or_assign("w", torch::arange(12, torch::kFloat).view({3, 4}));
  full.insert_or_assign("step", torch::scalar_tensor(7.0));
  full.insert_or_assign("lr", 0.25);
  full.insert_or_assign("name", "adam");
  StateDict group;
  group.insert_or_assign("betas", StateList{StateValue(0.9), StateValue(0.99)});
  full.insert_or_assign("group", group);
  full.insert_or_assign("only_full", torch::ones({2}));

  StateDict local;
  local.insert_or_assign("w", fsdp::chunk_sharded(torch::zeros({3, 4}), 1, 2));
  at::Tensor step = torch::scalar_tensor(1.0);
  local.insert_or_assign("step", step);
  local.insert_or_assign("lr", 1.0);
  StateDict lg;
  lg.insert_or_assign("betas", StateList{StateValue(0.5), StateValue(0.5)});
  local.insert_or_assign("group", lg);
  local.insert_or_assign("extra", torch::full({2}, 3.0));
  fsdp::distribute_state_dict(full, local);

  const auto& piece = local.at("w").sharded_tensor().local_shards().at(0);
  EXPECT_TRUE(torch::equal(piece.tensor, full.at("w").tensor().narrow(0, 2, 1)));
  EXPECT_EQ(step.item<double>(), 7.0) << "a 0-d tensor is copied into the template's";
  EXPECT_EQ(local.at("lr").to_double(), 0.25);
  EXPECT_EQ(local.at("name").string(), "adam");
  EXPECT_EQ(local.at("group").dict().at("betas").list()[1].to_double(), 0.99);
  EXPECT_TRUE(torch::equal(local.at("extra").tensor(), torch::full({2}, 3.0)));
  EXPECT_FALSE(local.contains("only_full")) << "a tensor the template lacks is not this rank's";
  // A shape that differs is named, and nothing is written.
  StateDict wrong = full;
  wrong.insert_or_assign("w", torch::zeros({4, 3}));
  wrong.insert_or_assign("lr", 9.0);
  EXPECT_NE(error_of([&] { fsdp::distribute_state_dict(wrong, local); }).find("'w'"),
            std::string::npos);
  EXPECT_EQ(local.at("lr").to_double(), 0.25);
}

// Item 7: dict keys compare as sets, as in PyTorch; copy_state_dict leaves the companion's
// non-tensor values alone and returns the source's.
TEST(StateDictApi, SimilarityAndCopyCompareKeysAsSets) {
  StateDict a, b;
  a.insert_or_assign("x", torch::ones({2}));
  a.insert_or_assign("lr", 0.1);
  b.insert_or_assign("lr", 0.5);
  b.insert_or_assign("x", torch::zeros({2}));
  EXPECT_TRUE(fsdp::check_state_dict_similarity(a, b));
  b.insert_or_assign("y", 1.0);
  EXPECT_FALSE(fsdp::check_state_dict_similarity(a, b));
  b.erase("y");
  const StateDict copy = fsdp::copy_state_dict(a, b);
  EXPECT_TRUE(torch::equal(b.at("x").tensor(), torch::ones({2})));  // copied into b's tensor
  EXPECT_EQ(b.at("lr").to_double(), 0.5) << "the companion's own value stays";
  EXPECT_EQ(copy.at("lr").to_double(), 0.1);
  EXPECT_EQ(copy.keys(), a.keys());
  EXPECT_EQ(copy.at("x").tensor().data_ptr(), b.at("x").tensor().data_ptr());
}

// Item 8: re-keying a dict that is already keyed as asked returns it unchanged, even where a
// conversion would be impossible (flat parameters hold several FQNs).
TEST(StateDictApi, RekeyIsANoOpWhenAlreadyKeyed) {
  run_ranks(2, [](ProcessGroup& pg) {
    Trained t(1, ShardingStrategy::FULL_SHARD, false, pg, 1);
    fsdp::StateDictTypeGuard g(t.model, fsdp::StateDictType::FULL_STATE_DICT);
    torch::optim::Optimizer& adam = *t.optims.owned[0];
    const StateDict osd = fsdp::optim_state_dict(t.model, adam);
    expect_equal(
        fsdp::rekey_optim_state_dict(osd, fsdp::OptimStateKeyType::PARAM_NAME, t.model, adam), osd,
        "by name");
    // The other way still needs one FQN per parameter.
    EXPECT_NE(error_of([&] {
                fsdp::rekey_optim_state_dict(osd, fsdp::OptimStateKeyType::PARAM_ID, t.model, adam);
              }).find("use_orig_params"),
              std::string::npos);
  });
  fsdp::testing::TinyLM plain(1);
  auto opt =
      fsdp::testing::make_optimizer("Adam", fsdp::testing::unique_params(plain->parameters()));
  const StateDict by_name = ckpt::get_optimizer_state_dict(plain, *opt, kFull);
  const StateDict by_id =
      fsdp::rekey_optim_state_dict(by_name, fsdp::OptimStateKeyType::PARAM_ID, *plain, *opt);
  EXPECT_TRUE(by_id.at("param_groups").list()[0].dict().at("params").list()[0].is_int());
  const StateDict again =
      fsdp::rekey_optim_state_dict(by_id, fsdp::OptimStateKeyType::PARAM_ID, *plain, *opt);
  EXPECT_EQ(again.at("state").dict().keys(), by_id.at("state").dict().keys());
}

// Item 9: ignore_frozen_params drops frozen keys before submodule prefixes are stripped (they
// stayed before); a bool state value flattens (Python's bool is an int); an original parameter
// holding no elements on a rank gets no state there on load (it got a zero-size one before).
TEST(StateDictApi, FrozenBeforePrefixesBoolStatesAndNoEmptyStates) {
  run_ranks(2, [](ProcessGroup& pg) {
    Trained t(1, ShardingStrategy::FULL_SHARD, true, pg, 2);
    const auto opts =
        StateDictOptions().full_state_dict(true).ignore_frozen_params(true).keep_submodule_prefixes(
            false);
    const StateDict sd =
        ckpt::get_model_state_dict(t.model, opts, ckpt::Submodules{t.net->frozen.ptr()});
    EXPECT_TRUE(sd.empty()) << sd.keys().front();

    StateDict osd = t.full().second;
    StateDict st = osd.at("state").dict().at("tok.weight").dict();
    st.insert_or_assign("flag", true);
    osd.at("state").dict().insert_or_assign("tok.weight", st);
    EXPECT_TRUE(ckpt::flatten_optim_state_dict(osd).at("state.tok.weight.flag").is_bool());

    // blocks.3.fc2.bias (6 elements) lies wholly in one rank's shard of its unit at W=2.
    Trained dst(9, ShardingStrategy::FULL_SHARD, true, pg, 0);
    ckpt::set_state_dict(dst.model, dst.optims.list(), t.full().first, t.full().second, kFull);
    for (size_t i = 0; i < dst.optims.owned.size(); ++i) {
      // LibTorch's Adagrad (owned[3]), as PyTorch's, creates every parameter's state up front.
      if (i == 3) continue;
      auto& o = dst.optims.owned[i];
      for (auto& group : o->param_groups()) {
        for (auto& p : group.params()) {
          if (p.numel() != 0) continue;
          EXPECT_EQ(o->state().count(fsdp::compat::optim_state_key(p)), 0u)
              << "a parameter with no elements here has state on rank " << pg.rank();
        }
      }
    }
  });
}

}  // namespace
