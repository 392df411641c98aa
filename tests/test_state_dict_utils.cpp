// State-dict utilities (issue 10, seed 003): flatten/unflatten, similarity, CPU companions and
// copies, gathering SHARDED dicts into full tensors and distributing full ones into pieces.
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

}  // namespace
