// libFuzzer's entry point for one target, chosen at compile time (FSDP_FUZZ_TARGET, a string):
// the FSDP_FUZZ=ON build makes one binary per target from this file (tests/fuzz/CMakeLists.txt).
#include <cstdio>
#include <cstdlib>

#include "targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const fsdp::fuzz::Target* target = [] {
    const fsdp::fuzz::Target* t = fsdp::fuzz::find_target(FSDP_FUZZ_TARGET);
    if (!t) {
      std::fprintf(stderr, "no fuzz target named %s\n", FSDP_FUZZ_TARGET);
      std::abort();
    }
    return t;
  }();
  target->run(data, size);  // accepted or refused: both fine; anything else is a finding
  return 0;
}
