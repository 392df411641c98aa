// FlatParamLayout against layouts computed by hand from PyTorch's rules (torch.chunk sharding,
// 16-byte alignment with use_orig_params), including 0-d, empty and non-divisible parameters.
#include <gtest/gtest.h>

#include "fsdp/errors.h"
#include "fsdp/flat_param.h"

using fsdp::FlatParamLayout;
using fsdp::ShardParamInfo;

namespace {

const std::vector<std::string> kFqns{"a", "b", "c", "d", "e"};
// 6 + 1 (0-d) + 0 (empty) + 5 + 3 = 15 elements: not divisible by 4.
const std::vector<std::vector<int64_t>> kShapes{{3, 2}, {}, {0}, {5}, {3}};

ShardParamInfo in(int64_t off, int64_t n, int64_t s, int64_t e) { return {true, off, n, s, e}; }
ShardParamInfo out() { return {}; }

TEST(FlatParamLayout, PackedAwkwardLayoutMatchesHandComputation) {
  auto l = FlatParamLayout::compute(kFqns, kShapes, /*aligned_numel=*/0, /*world_size=*/4);
  EXPECT_EQ(l.unpadded_unsharded_numel, 15);
  EXPECT_EQ(l.sharded_numel, 4);
  EXPECT_EQ(l.padded_unsharded_numel, 16);
  EXPECT_EQ(l.numels, (std::vector<int64_t>{6, 1, 0, 5, 3}));
  EXPECT_EQ(l.numels_with_padding, l.numels);
  // Segments: a [0,5], b [6,6], c [7,6] (empty), d [7,11], e [12,14].
  const std::vector<std::vector<ShardParamInfo>> expect{
      {in(0, 4, 0, 3), out(), out(), out(), out()},
      // rank 1 holds [4,7]: the 0-numel parameter at 7 counts as in the shard, as in PyTorch.
      {in(0, 2, 4, 5), in(2, 1, 0, 0), in(3, 0, 0, -1), in(3, 1, 0, 0), out()},
      {out(), out(), out(), in(0, 4, 1, 4), out()},
      {out(), out(), out(), out(), in(0, 3, 0, 2)},
  };
  for (int r = 0; r < 4; ++r) {
    auto infos = l.shard_param_infos(r);
    ASSERT_EQ(infos.size(), 5u);
    for (size_t i = 0; i < 5; ++i)
      EXPECT_EQ(infos[i], expect[r][i]) << "rank " << r << " param " << i;
  }
  EXPECT_EQ(l.shard_numel_padded(0), 0);
  EXPECT_EQ(l.shard_numel_padded(2), 0);
  EXPECT_EQ(l.shard_numel_padded(3), 1);

  auto md = l.shard_metadata(1);
  EXPECT_EQ(md.param_names, (std::vector<std::string>{"a", "b", "c", "d"}));
  EXPECT_EQ(md.param_numels, (std::vector<int64_t>{6, 1, 0, 5}));
  EXPECT_EQ(md.param_shapes[1], std::vector<int64_t>{});
  EXPECT_EQ(md.param_offsets,
            (std::vector<std::pair<int64_t, int64_t>>{{4, 5}, {0, 0}, {0, -1}, {0, 0}}));
}

TEST(FlatParamLayout, AlignedLayoutPadsEachParameterAndTheTotal) {
  // fp32 with 16-byte alignment: every parameter starts at a multiple of 4 elements.
  auto l = FlatParamLayout::compute(kFqns, kShapes, /*aligned_numel=*/4, /*world_size=*/4);
  EXPECT_EQ(l.numels_with_padding, (std::vector<int64_t>{6, 2, 1, 3, 0, 5, 3, 3, 1}));
  EXPECT_EQ(l.is_padding_mask,
            (std::vector<bool>{false, true, false, true, false, false, true, false, true}));
  EXPECT_EQ(l.unpadded_unsharded_numel, 24);
  EXPECT_EQ(l.sharded_numel, 6);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(l.param_offset(i) % 4, 0) << i;
  EXPECT_EQ(l.param_offset(3), 12);
  EXPECT_EQ(l.param_offset(4), 20);
  // rank 2 holds [12,17]: all of d (12..16) and nothing else.
  auto infos = l.shard_param_infos(2);
  EXPECT_EQ(infos[3], in(0, 5, 0, 4));
  EXPECT_FALSE(infos[4].in_shard);
}

TEST(FlatParamLayout, MoreRanksThanElementsGivesEmptyPaddedShards) {
  // torch.chunk(3 elements, 4) gives 3 chunks of 1: rank 3 holds an empty shard padded to 1.
  auto l = FlatParamLayout::compute({"x"}, {{3}}, 0, 4);
  EXPECT_EQ(l.sharded_numel, 1);
  EXPECT_EQ(l.shard_numel_padded(3), 1);
  EXPECT_FALSE(l.shard_param_infos(3)[0].in_shard);
  EXPECT_EQ(l.shard_param_infos(2)[0], in(0, 1, 2, 2));
  // torch.chunk(6, 4) gives 3 chunks of 2, not 4 chunks: rank 3 is empty again.
  auto l6 = FlatParamLayout::compute({"x"}, {{6}}, 0, 4);
  EXPECT_EQ(l6.sharded_numel, 2);
  EXPECT_EQ(l6.shard_numel_padded(3), 2);
}

TEST(FlatParamLayout, AllEmptyParametersShardToNothing) {
  auto l = FlatParamLayout::compute({"x", "y"}, {{0}, {0, 3}}, 0, 3);
  EXPECT_EQ(l.unpadded_unsharded_numel, 0);
  EXPECT_EQ(l.sharded_numel, 0);
  for (int r = 0; r < 3; ++r) {
    for (const auto& i : l.shard_param_infos(r)) EXPECT_FALSE(i.in_shard);
  }
}

TEST(FlatParamLayout, NoShardKeepsEverythingOnEveryRank) {
  auto l = FlatParamLayout::compute(kFqns, kShapes, 0, 4, /*sharded=*/false);
  EXPECT_EQ(l.sharded_numel, 15);
  EXPECT_EQ(l.padded_unsharded_numel, 15);
  EXPECT_EQ(l.shard_param_infos(3)[4], in(12, 3, 0, 2));
  EXPECT_EQ(l.shard_numel_padded(3), 0);
}

}  // namespace
