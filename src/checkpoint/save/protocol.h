// Internal: what the step directories (step_dirs.cpp) use of the save protocol (save.cpp).
#pragma once

#include <functional>
#include <string>

#include "fsdp/checkpoint/checkpoint.h"

namespace fsdp {
namespace checkpoint {
namespace protocol {

using Hook = std::function<void()>;

/// save(), with `before_prepare` run by each directory's leader (rank 0 of a shared save) before
/// it prepares, and `after_commit` once the new checkpoint is in place (in a node-local save, on
/// every host); a throw from either fails the save on every rank.
void save_impl(const StateDict& state_dict, const std::string& dir, const SaveOptions& options,
               const Hook& before_prepare, const Hook& after_commit);

/// Where a save without an atomic swap keeps the old checkpoint while the new one moves in.
std::string aside_of(const std::string& dir);

/// Undoes a save that died between its two renames (file systems without RENAME_EXCHANGE): the
/// old checkpoint at `.aside` goes back to `dir` if nothing took its place, else it is removed.
void restore_aside(FileIO& io, const std::string& dir);

}  // namespace protocol
}  // namespace checkpoint
}  // namespace fsdp
