#pragma once
// The AVX2 build of XXH3-64 (xxh3_avx2.cpp, compiled with -mavx2 where the compiler targets
// x86-64; FSDP_XXH3_AVX2 says whether it was). Call only where the CPU has AVX2: xxh3.cpp decides.
#include <cstddef>
#include <cstdint>

namespace fsdp {
namespace checkpoint {
namespace files {
namespace xxh3_avx2 {

uint64_t hash(const void* data, size_t n);
// `state`: an XXH3_state_t reset by xxh3.cpp's build (both include the same xxhash.h, and the
// state's layout does not depend on the instruction set).
void update(void* state, const void* data, size_t n);

}  // namespace xxh3_avx2
}  // namespace files
}  // namespace checkpoint
}  // namespace fsdp
