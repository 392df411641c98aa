// State-dict helpers shared by the state-dict test suites.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "fsdp/model_state_dict.h"

namespace fsdp {
namespace testing {

/// The model's FULL state dict (whatever type it is set to otherwise). Collective.
inline StateDict full_of(FullyShardedDataParallel& model) {
  StateDictTypeGuard g(model, StateDictType::FULL_STATE_DICT);
  return state_dict(model);
}

/// Two dicts of plain tensors have the same keys in the same order, dtypes and values (bit-exact).
inline void expect_same(const StateDict& a, const StateDict& b, const std::string& what) {
  ASSERT_EQ(a.keys(), b.keys()) << what;
  for (const auto& [k, v] : a) {
    const auto& w = b.at(k).tensor();
    EXPECT_EQ(v.tensor().scalar_type(), w.scalar_type()) << what << " " << k;
    EXPECT_TRUE(torch::equal(v.tensor(), w)) << what << " " << k;
  }
}

}  // namespace testing
}  // namespace fsdp
