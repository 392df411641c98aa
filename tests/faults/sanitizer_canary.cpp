// Planted bugs for the sanitizer build (FSDP_SANITIZE): ctest expects each sanitizer's report
// from its mode, so a build whose sanitizers stopped working (flags lost, a runtime that does not
// load, LeakSanitizer off) fails instead of passing everything silently.
#include <climits>
#include <cstdio>
#include <cstring>
#include <string>

namespace {
volatile int sink;
int* volatile holder;  // volatile: the compiler may not drop the allocation it holds
volatile int index_past_end = 8;
}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "leak") {
    holder = new int[64];
    holder = nullptr;  // the only pointer to it is gone
    return 0;
  }
  if (mode == "overflow") {
    char* p = new char[8];
    std::memset(p, 0, 8);
    sink = p[index_past_end];  // one past the end
    delete[] p;
    return 0;
  }
  if (mode == "ub") {
    int big = INT_MAX - (argc > 99 ? 1 : 0);
    sink = big + 1;  // signed overflow
    return 0;
  }
  std::fprintf(stderr, "usage: sanitizer_canary leak|overflow|ub\n");
  return 2;
}
