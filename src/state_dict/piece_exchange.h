// Internal: moving the elements of sharded tensors between ranks so that each rank gets exactly
// the flat range it needs, whatever pieces (boxes) the ranks hold. Shared by model loads (a
// parameter's range in a flat-parameter shard) and optimizer-state loads (the same, per state).
#pragma once

#include <string>
#include <vector>

#include "fsdp/dist.h"
#include "fsdp/state_value.h"

namespace fsdp {
namespace detail {

/// One tensor to assemble: the same list, in the same order and with the same names and shapes,
/// on every rank of the group (only `lo`, `n` and `pieces` differ between ranks).
struct RangeRequest {
  std::string name;            // for messages, e.g. "'fc.weight'"
  std::vector<int64_t> shape;  // the whole tensor's shape
  int64_t lo = 0;              // this rank needs elements [lo, lo + n) of the row-major tensor
  int64_t n = 0;
  const ShardedTensor* pieces = nullptr;  // this rank's pieces of it (null: it has none)
};

/// For each request this rank holds pieces for, a 1-D tensor of exactly its range; undefined
/// where it holds none (the caller reports that as missing) or where no rank holds any (a state
/// nobody has). If every rank's own pieces cover its ranges, nothing is communicated beyond one
/// flag; otherwise one metadata exchange for all requests, then one all_to_all_single per request
/// that sends each rank only the parts of pieces inside its range. Peak extra memory per rank:
/// what it sends for one request plus twice its own range of it.
///
/// Everything received is validated before use, and every decision is computed from gathered
/// metadata alone, so all ranks take the same collectives whatever they hold. Problems (malformed
/// pieces, elements no rank holds) go to `error` (first one kept) and the request is skipped on
/// every rank alike; the caller must still run its verdict exchange.
std::vector<at::Tensor> exchange_ranges(dist::ProcessGroup& pg,
                                        const std::vector<RangeRequest>& requests,
                                        std::string& error);

}  // namespace detail
}  // namespace fsdp
