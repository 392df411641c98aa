// State-dict helpers shared by the state-dict test suites.
#pragma once

#include <gtest/gtest.h>

#include <torch/serialize.h>

#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "fsdp/errors.h"
#include "fsdp/model_state_dict.h"

namespace fsdp {
namespace testing {

/// The message of the fsdp::Error `fn` throws, or "(no error)".
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const fsdp::Error& e) {
    return e.what();
  }
  return "(no error)";
}

/// As error_of, when the error is an `E`; otherwise "(not the expected kind) " + its message.
template <typename E, typename Fn>
std::string error_of_kind(Fn&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  } catch (const fsdp::Error& e) {
    return std::string("(not the expected kind) ") + e.what();
  }
  return "(no error)";
}

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

/// SHARDED pieces written by each rank to files (flat dicts of Tensor / ShardedTensor values), then
/// loaded at other world sizes: load_pieces gives every loading rank all pieces of all saved ranks.
inline void save_pieces(const StateDict& sd, int rank, const std::string& dir,
                        const std::string& prefix = "") {
  std::vector<at::Tensor> tensors;
  std::ofstream meta(dir + "/" + prefix + "meta_" + std::to_string(rank) + ".txt");
  for (const auto& [k, v] : sd) {
    if (v.is_tensor()) {
      meta << k << " T";
      tensors.push_back(v.tensor());
    } else {
      const auto& st = v.sharded_tensor();
      meta << k << " S " << st.size().size();
      for (auto d : st.size()) meta << " " << d;
      meta << " " << st.local_shards().size();
      for (const auto& s : st.local_shards()) {
        for (auto o : s.metadata.offsets) meta << " " << o;
        tensors.push_back(s.tensor);
      }
    }
    meta << "\n";
  }
  torch::save(tensors, dir + "/" + prefix + "data_" + std::to_string(rank) + ".pt");
}

inline StateDict load_pieces(int saved_world, const std::string& dir,
                             const std::string& prefix = "") {
  StateDict sd;
  std::map<std::string, std::vector<fsdp::Shard>> pieces;
  std::map<std::string, std::vector<int64_t>> shapes;
  std::vector<std::string> order;
  for (int r = 0; r < saved_world; ++r) {
    std::vector<at::Tensor> tensors;
    torch::load(tensors, dir + "/" + prefix + "data_" + std::to_string(r) + ".pt");
    std::ifstream meta(dir + "/" + prefix + "meta_" + std::to_string(r) + ".txt");
    size_t ti = 0;
    for (std::string line; std::getline(meta, line);) {
      std::istringstream is(line);
      std::string key, kind;
      is >> key >> kind;
      if (r == 0) order.push_back(key);
      if (kind == "T") {
        if (r == 0) sd.insert_or_assign(key, tensors[ti]);
        ++ti;
        continue;
      }
      size_t dims, n;
      is >> dims;
      std::vector<int64_t> shape(dims);
      for (auto& d : shape) is >> d;
      shapes[key] = shape;
      is >> n;
      for (size_t i = 0; i < n; ++i) {
        std::vector<int64_t> off(dims);
        for (auto& o : off) is >> o;
        const auto& t = tensors[ti++];
        pieces[key].push_back(Shard{t, {off, t.sizes().vec(), r}});
      }
    }
  }
  StateDict out;
  for (const auto& k : order) {
    if (sd.contains(k)) {
      out.insert_or_assign(k, sd.at(k));
    } else {
      out.insert_or_assign(k, ShardedTensor(shapes[k], at::kFloat, pieces[k]));
    }
  }
  return out;
}

}  // namespace testing
}  // namespace fsdp
