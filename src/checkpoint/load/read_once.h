// Internal: the collective load (LoadOptions::group, fsdp/checkpoint/checkpoint.h) that reads each
// stored item of a checkpoint once across a group and sends it to the ranks that need it, from
// directories that may differ between ranks (node-local disks, issue 40).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/checkpoint/file_io.h"
#include "fsdp/dist.h"
#include "fsdp/state_value.h"

namespace fsdp {
namespace checkpoint {
namespace read_once {

/// What load's errors name as their subject, with a group (read_once.cpp) or without (load.cpp).
inline constexpr const char* kWhat = "checkpoint load";

/// What one rank sends or receives in one round of the exchange, at most (an item larger than
/// this travels in a round of its own).
constexpr int64_t kRoundBytes = int64_t{64} << 20;

/// checkpoint::load with a group. `round_bytes` bounds the rounds (tests make it small).
void load(StateDict& state_dict, const std::string& dir, FileIO& io, bool verify,
          dist::ProcessGroup& group, int64_t round_bytes = kRoundBytes);

/// checkpoint::missing_files.
std::vector<std::string> unreadable_files(const std::string& dir, FileIO& io,
                                          dist::ProcessGroup& group);

}  // namespace read_once
}  // namespace checkpoint
}  // namespace fsdp
