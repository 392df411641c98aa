// Internal, for tests: a hook called as each collective starts (issue 39: a rank killed or stopped
// inside every distributed operation). Null, the default, costs one atomic load per collective.
#pragma once

namespace fsdp {
namespace dist {
namespace detail {

/// Called with the collective's description ("all_gather_into_tensor on group 'default'
/// (rank 1 of 2)"), on the calling thread, just before the backend starts it.
using FaultHook = void (*)(const char* what);

void set_fault_hook(FaultHook hook);
FaultHook fault_hook();

}  // namespace detail
}  // namespace dist
}  // namespace fsdp
