// Internal: reading the environment variables that launchers (fsdp-run, torchrun, mpirun, srun)
// and users set, one way everywhere: an empty variable counts as unset, and a malformed number is
// a ValueError naming the variable.
#pragma once

#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>

#include "fsdp/errors.h"
#include "util/message.h"

namespace fsdp {
namespace detail {

/// The value of `name`, or nullopt when it is unset or empty.
inline std::optional<std::string> get_env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

/// `name` as a whole decimal integer, or `fallback` when unset; throws ValueError when set to
/// anything else.
inline int env_int(const char* name, int fallback) {
  auto v = get_env(name);
  if (!v) return fallback;
  try {
    size_t used = 0;
    const int x = std::stoi(*v, &used);
    if (used != v->size()) throw std::invalid_argument("trailing characters");
    return x;
  } catch (const std::exception&) {
    throw ValueError(msg("environment variable ", name, "=", quote(*v), " is not an integer"));
  }
}

}  // namespace detail
}  // namespace fsdp
