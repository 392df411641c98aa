// XXH3-64 built for AVX2 (this file alone gets -mavx2; see CMakeLists.txt). It includes only C
// headers and xxhash.h, whose functions XXH_INLINE_ALL makes static, so no inline function built
// for AVX2 can be merged into code that runs on a CPU without it.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "checkpoint/storage/xxh3_avx2.h"

#if !defined(__AVX2__)
#error "xxh3_avx2.cpp must be compiled with -mavx2"
#endif

namespace fsdp {
namespace checkpoint {
namespace files {
namespace xxh3_avx2 {

uint64_t hash(const void* data, size_t n) { return XXH3_64bits(data, n); }

void update(void* state, const void* data, size_t n) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state), data, n);
}

}  // namespace xxh3_avx2
}  // namespace files
}  // namespace checkpoint
}  // namespace fsdp
