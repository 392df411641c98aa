// State-dict utilities (issue 10; PyTorch's torch/distributed/_state_dict_utils.py):
// flatten/unflatten, similarity, CPU companions and copies, gathering SHARDED dicts into full
// tensors and distributing full ones into pieces.
#include <gtest/gtest.h>

#include "fsdp/errors.h"
#include "fsdp/model_state_dict.h"
#include "fsdp/state_dict_utils.h"
#include "multi_rank.h"
#include "state_dict_testing.h"
#include "tiny_lm.h"

using fsdp::FullyShardedDataParallel;
using fsdp::StateDict;
using fsdp::StateDictType;
using fsdp::StateList;
using fsdp::StateValue;
using fsdp::dist::ProcessGroup;
using fsdp::testing::run_ranks;
using fsdp::testing::TinyLM;

namespace {

// Nested dicts and lists holding a 0-d tensor, a 2-D one, numbers, a bool, a string and None.
StateDict nested() {
  StateDict inner;
  inner.insert_or_assign("w", at::arange(6, at::kFloat).view({2, 3}));
  inner.insert_or_assign("step", at::scalar_tensor(3.0));
  StateDict in_list;
  in_list.insert_or_assign("lr", 0.01);
  in_list.insert_or_assign("params", StateList{StateValue("a.w"), StateValue("b")});
  StateDict sd;
  sd.insert_or_assign("state", StateDict());
  sd.at("state").dict().insert_or_assign("a", inner);
  sd.insert_or_assign("groups", StateList{StateValue(in_list), StateValue(int64_t{7})});
  sd.insert_or_assign("flag", true);
  sd.insert_or_assign("name", "x");
  sd.insert_or_assign("none", StateValue());
  return sd;
}

// StateDict is an ordered map: erasing a key keeps the others' order and their lookups.
TEST(StateDictUtils, EraseKeepsTheOrderAndTheLookupOfTheOtherKeys) {
  StateDict d;
  for (const char* k : {"a", "b", "c", "d"}) d.insert_or_assign(k, std::string(k));
  EXPECT_TRUE(d.erase("b"));
  EXPECT_FALSE(d.erase("b"));
  EXPECT_EQ(d.keys(), (std::vector<std::string>{"a", "c", "d"}));
  EXPECT_FALSE(d.contains("b"));
  EXPECT_EQ(d.at("c").string(), "c");
  EXPECT_EQ(d.at("d").string(), "d");
  d.insert_or_assign("c", std::string("c2"));  // replaced in place, found through the index
  d.insert_or_assign("e", std::string("e"));
  EXPECT_EQ(d.keys(), (std::vector<std::string>{"a", "c", "d", "e"}));
  EXPECT_EQ(d.at("c").string(), "c2");
  EXPECT_TRUE(d.erase("a"));
  EXPECT_TRUE(d.erase("e"));
  EXPECT_EQ(d.keys(), (std::vector<std::string>{"c", "d"}));
  EXPECT_EQ(d.at("d").string(), "d");
}

TEST(StateDictUtils, FlattenAndUnflattenRoundTrip) {
  const StateDict sd = nested();
  auto [flat, mapping] = fsdp::flatten_state_dict(sd);
  const std::vector<std::string> want{"state.a.w",
                                      "state.a.step",
                                      "groups.0.lr",
                                      "groups.0.params.0",
                                      "groups.0.params.1",
                                      "groups.1",
                                      "flag",
                                      "name",
                                      "none"};
  EXPECT_EQ(flat.keys(), want);
  EXPECT_EQ(flat.at("groups.0.params.1").string(), "b");
  EXPECT_TRUE(flat.at("state.a.step").tensor().dim() == 0);
  const StateDict back = fsdp::unflatten_state_dict(flat, mapping);
  EXPECT_TRUE(fsdp::check_state_dict_similarity(back, sd));
  EXPECT_TRUE(torch::equal(back.at("state").dict().at("a").dict().at("w").tensor(),
                           sd.at("state").dict().at("a").dict().at("w").tensor()));
  EXPECT_EQ(back.at("groups").list()[1].to_int(), 7);
  EXPECT_TRUE(back.at("none").is_none());
  // A key that is also a path collides.
  StateDict clash = sd;
  clash.insert_or_assign("state.a.w", 1.0);
  EXPECT_THROW(fsdp::flatten_state_dict(clash), fsdp::ValueError);
  // A flattened key without a path.
  flat.insert_or_assign("stray", 1.0);
  EXPECT_THROW(fsdp::unflatten_state_dict(flat, mapping), fsdp::ValueError);
}

TEST(StateDictUtils, SimilarityNoticesEveryDifference) {
  const StateDict sd = nested();
  EXPECT_TRUE(fsdp::check_state_dict_similarity(sd, sd));
  auto edit = [&](const std::function<void(StateDict&)>& f) {
    StateDict c = sd;
    StateDict inner = c.at("state").dict().at("a").dict();
    c.at("state").dict().insert_or_assign("a", inner);  // own copy of the nested containers
    f(c);
    return fsdp::check_state_dict_similarity(sd, c);
  };
  EXPECT_FALSE(edit([](StateDict& c) {
    c.at("state").dict().at("a").dict().insert_or_assign("w", at::zeros({3, 2}));
  }));
  EXPECT_FALSE(edit([](StateDict& c) {
    c.at("state").dict().at("a").dict().insert_or_assign("w", at::zeros({2, 3}, at::kDouble));
  }));
  EXPECT_FALSE(edit([](StateDict& c) { c.erase("flag"); }));
  EXPECT_FALSE(edit([](StateDict& c) { c.at("groups").list().pop_back(); }));
  EXPECT_FALSE(edit([](StateDict& c) { c.insert_or_assign("name", 1.0); }));
}

TEST(StateDictUtils, CpuCompanionTakesCopiesInItsOwnStorage) {
  const StateDict sd = nested();
  StateDict companion = fsdp::create_cpu_state_dict(sd);
  EXPECT_TRUE(fsdp::check_state_dict_similarity(companion, sd));
  const at::Tensor& cw = companion.at("state").dict().at("a").dict().at("w").tensor();
  const void* storage = cw.data_ptr();
  EXPECT_EQ(cw.abs().sum().item<float>(), 0.0f);
  fsdp::copy_state_dict(sd, companion);
  const at::Tensor& after = companion.at("state").dict().at("a").dict().at("w").tensor();
  EXPECT_EQ(after.data_ptr(), storage) << "the companion keeps its own storage";
  EXPECT_TRUE(torch::equal(after, sd.at("state").dict().at("a").dict().at("w").tensor()));
  EXPECT_FALSE(after.is_same(sd.at("state").dict().at("a").dict().at("w").tensor()));
  // A companion of another shape is refused, naming where.
  StateDict other = fsdp::create_cpu_state_dict(sd);
  StateDict inner = other.at("state").dict().at("a").dict();
  inner.insert_or_assign("w", at::zeros({3, 3}));
  other.at("state").dict().insert_or_assign("a", inner);
  try {
    fsdp::copy_state_dict(sd, other);
    ADD_FAILURE() << "expected a ValueError";
  } catch (const fsdp::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("state.a.w"), std::string::npos) << e.what();
  }
  const StateDict cpu = fsdp::offload_state_dict_to_cpu(sd);
  EXPECT_TRUE(fsdp::check_state_dict_similarity(cpu, sd));
}

// A SHARDED model state dict gathered at W=3 equals the FULL one, on the chosen ranks only; a
// full dict distributed into the SHARDED template gives back the pieces.
TEST(StateDictUtils, GatherAndDistributeShardedModelStateDicts) {
  run_ranks(3, [](ProcessGroup& pg) {
    TinyLM m(3);
    FullyShardedDataParallel model(m, fsdp::testing::lm_options(m));
    const StateDict full = fsdp::testing::full_of(model);
    StateDict sharded;
    {
      fsdp::StateDictTypeGuard g(model, StateDictType::SHARDED_STATE_DICT);
      sharded = fsdp::state_dict(model);
    }
    const StateDict gathered = fsdp::gather_state_dict(sharded, pg);
    fsdp::testing::expect_same(gathered, full, "gathered");
    const StateDict on_one = fsdp::gather_state_dict(sharded, pg, {1}, /*cpu_offload=*/true);
    EXPECT_EQ(on_one.empty(), pg.rank() != 1);
    if (pg.rank() == 1) fsdp::testing::expect_same(on_one, full, "rank 1 only");

    StateDict local = fsdp::create_cpu_state_dict(sharded);
    fsdp::distribute_state_dict(full, local);
    for (const auto& [k, v] : sharded) {
      if (!v.is_sharded_tensor()) continue;
      const auto& want = v.sharded_tensor().local_shards();
      const auto& got = local.at(k).sharded_tensor().local_shards();
      ASSERT_EQ(got.size(), want.size()) << k;
      for (size_t i = 0; i < want.size(); ++i)
        EXPECT_TRUE(torch::equal(got[i].tensor, want[i].tensor)) << k;
    }
    // Pieces nobody holds any more: every rank raises, naming the key.
    StateDict broken = sharded;
    fsdp::ShardedTensor t = broken.at("blocks.1.fc1.weight").sharded_tensor();
    t.local_shards().clear();
    broken.insert_or_assign("blocks.1.fc1.weight", t);
    try {
      fsdp::gather_state_dict(broken, pg);
      ADD_FAILURE() << "expected a ValueError";
    } catch (const fsdp::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("blocks.1.fc1.weight"), std::string::npos) << e.what();
    }
  });
}

// broadcast_state_dict from rank 1 of 3: every rank's template (plain tensors, SHARDED pieces,
// 0-d tensors, numbers and strings in nested dicts and lists) receives the source's values in its
// own storage; a template that does not fit fails every rank before anything is copied.
TEST(StateDictUtils, BroadcastStateDictFillsEveryRanksTemplate) {
  run_ranks(3, [](ProcessGroup& pg) {
    const StateDict src = nested();
    const at::Tensor big = at::arange(35, at::kFloat).view({7, 5});
    // The template: zeros of the same structure, with "big" cut into dim-0 chunks.
    auto template_of = [&] {
      StateDict t = fsdp::create_cpu_state_dict(nested());
      t.insert_or_assign("big", fsdp::chunk_sharded(at::zeros({7, 5}), pg.rank(), pg.size()));
      t.insert_or_assign("groups", StateList{StateValue(StateDict()), StateValue(int64_t{0})});
      t.at("groups").list()[0].dict().insert_or_assign("lr", 0.5);
      t.at("groups").list()[0].dict().insert_or_assign("params",
                                                       StateList{StateValue("?"), StateValue("?")});
      t.insert_or_assign("only_here", at::ones({2}));
      return t;
    };
    StateDict full = src;
    full.insert_or_assign("big", big);
    full.insert_or_assign("only_there", at::ones({3}));
    StateDict local = template_of();
    const at::Tensor w_storage = local.at("state").dict().at("a").dict().at("w").tensor();
    const fsdp::LoadResult r =
        fsdp::broadcast_state_dict(pg.rank() == 1 ? full : StateDict(), local, pg, /*src=*/1);
    EXPECT_EQ(r.missing_keys, std::vector<std::string>{"only_here"});
    EXPECT_EQ(r.unexpected_keys, std::vector<std::string>{"only_there"});
    const StateDict& a = local.at("state").dict().at("a").dict();
    EXPECT_TRUE(torch::equal(a.at("w").tensor(), at::arange(6, at::kFloat).view({2, 3})));
    EXPECT_TRUE(a.at("w").tensor().is_same(w_storage)) << "copied into the template's tensor";
    EXPECT_EQ(a.at("step").tensor().item<double>(), 3.0);
    EXPECT_EQ(local.at("groups").list()[0].dict().at("lr").to_double(), 0.01);
    EXPECT_EQ(local.at("groups").list()[0].dict().at("params").list()[1].string(), "b");
    EXPECT_EQ(local.at("groups").list()[1].to_int(), 7);
    EXPECT_EQ(local.at("name").string(), "x");
    for (const auto& piece : local.at("big").sharded_tensor().local_shards()) {
      const auto& m = piece.metadata;
      EXPECT_TRUE(torch::equal(piece.tensor, big.narrow(0, m.offsets[0], m.sizes[0])));
    }
    EXPECT_TRUE(torch::equal(local.at("only_here").tensor(), at::ones({2})));

    // strict: the template's extra key fails every rank, and nothing is copied.
    StateDict strict_local = template_of();
    StateDict all_but_extra = full;
    all_but_extra.erase("only_there");
    const std::string err = [&] {
      try {
        fsdp::broadcast_state_dict(pg.rank() == 1 ? all_but_extra : StateDict(), strict_local, pg,
                                   1, /*strict=*/true);
      } catch (const fsdp::ValueError& e) {
        return std::string(e.what());
      }
      return std::string("(no error)");
    }();
    EXPECT_NE(err.find("only_here"), std::string::npos) << err;
    EXPECT_EQ(strict_local.at("state").dict().at("a").dict().at("w").tensor().sum().item<double>(),
              0.0);
    // A template whose shape differs on rank 2 only: every rank fails, naming rank 2.
    StateDict odd = template_of();
    if (pg.rank() == 2) odd.insert_or_assign("big", at::zeros({5, 7}));
    try {
      fsdp::broadcast_state_dict(pg.rank() == 1 ? full : StateDict(), odd, pg, 1);
      ADD_FAILURE() << "a mismatched template must fail";
    } catch (const fsdp::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("rank 2"), std::string::npos) << e.what();
    }
    EXPECT_EQ(odd.at("state").dict().at("a").dict().at("w").tensor().sum().item<double>(), 0.0);
  });
}

}  // namespace
