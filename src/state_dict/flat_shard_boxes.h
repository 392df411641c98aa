// Internal: the global metadata of a sharded flat-parameter layout, parameter by parameter: which
// boxes of each parameter every rank holds in its flat shard (ShardLayout::FLAT_SHARDS).
// Implemented in model_state_dict.cpp; used there and by optim_state_dict.cpp (a flat
// parameter's optimizer states are sharded as it is).
#pragma once

#include <vector>

#include "fsdp/flat_param.h"
#include "fsdp/state_value.h"

namespace fsdp {
namespace detail {

/// Every shard-group rank's boxes of each parameter of a sharded flat-parameter layout: what
/// each rank holds of it in its flat shard, cut by flat_range_boxes (ShardLayout::FLAT_SHARDS),
/// placed on that rank. The global metadata of a FLAT_SHARDS value.
class FlatShardBoxes {
 public:
  explicit FlatShardBoxes(const FlatParamLayout& layout);
  std::vector<ShardMetadata> of(size_t param_index) const;

 private:
  const FlatParamLayout& layout_;
  std::vector<std::vector<ShardParamInfo>> infos_;  // per rank, per parameter
};

}  // namespace detail
}  // namespace fsdp
