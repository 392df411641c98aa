// Internal: copies of a node-local save's data files on other hosts (SaveOptions::replicas), so
// that a checkpoint kept on hosts' own disks or in their memory (/dev/shm) survives the loss of a
// host: the bytes travel over the saving group (c10d), never through a shared file system.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dist/agreement.h"
#include "fsdp/checkpoint/file_io.h"
#include "fsdp/dist.h"

namespace fsdp {
namespace checkpoint {
namespace host_copies {

/// The hosts of a node-local save: each its ranks in ascending order, ordered by their lowest rank.
using Hosts = std::vector<std::vector<int>>;

/// The ranks that receive a copy of each rank's data file: for copy k = 1 .. min(replicas, number
/// of hosts) - 1, the rank at the same position (modulo that host's size) of the k-th host after
/// the rank's own. Distinct hosts, so `replicas` hosts hold every file (or every host, if fewer).
std::vector<std::vector<int>> receivers(const Hosts& hosts, int world, int replicas);

/// What one rank sends or receives in one exchange, at most.
constexpr int64_t kRoundBytes = int64_t{64} << 20;

/// Collective over `group`, every rank passing the same `files` (rank r's data file name, in
/// `dir` on its own host), `sizes` and `to` (receivers()). Sends this rank's file to its
/// receivers and writes, fsynced, each file it receives into `dir` under the same name: in rounds
/// (one all_to_all_single each) in which no rank sends or receives more than `round_bytes`, the
/// buffers allocated once; then one exchange of each sender's checksum of what it read, which
/// every receiver compares with its copy read back. Returns this rank's verdict: a rank that fails
/// goes on exchanging (or all stop together before the rounds), so every rank returns, and the
/// caller's exchange of verdicts (dist/agreement.h) decides.
dist::Verdict copy(dist::ProcessGroup& group, FileIO& io, const std::string& dir,
                   const std::vector<std::string>& files, const std::vector<int64_t>& sizes,
                   const std::vector<std::vector<int>>& to, int64_t round_bytes = kRoundBytes);

}  // namespace host_copies
}  // namespace checkpoint
}  // namespace fsdp
