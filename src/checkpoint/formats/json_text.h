// Internal: what a JSON text read from a file (a manifest, a safetensors header) must be checked
// for before nlohmann's parser sees it. That parser takes a NUL byte for the end of its input, so
// "{...}\0garbage" parses as "{...}". JSON has no raw NUL anywhere (a string escapes it as
// \u0000), so a text holding one is not JSON: Python's json module and the safetensors reference
// reader reject it, and so do we, rather than approve a file they cannot read.
#pragma once

#include <string>

#include "util/message.h"

namespace fsdp {
namespace checkpoint {

/// Why `text` is not JSON whatever nlohmann's parser says ("a NUL byte at offset 17"), or "".
inline std::string json_text_problem(const std::string& text) {
  const size_t nul = text.find('\0');
  return nul == std::string::npos ? std::string() : detail::msg("a NUL byte at offset ", nul);
}

}  // namespace checkpoint
}  // namespace fsdp
