// state_dict/load_keys.h: the message a strict load gives for missing and unexpected keys.
#pragma once

#include <string>

#include "fsdp/state_value.h"

namespace fsdp::detail {

/// PyTorch's strict-load message: "Error(s) in loading state_dict: Missing key(s) in state_dict:
/// "a", "b". Unexpected key(s) in state_dict: "c"."; empty if there are no such keys.
std::string load_keys_error(const LoadResult& r);

}  // namespace fsdp::detail
