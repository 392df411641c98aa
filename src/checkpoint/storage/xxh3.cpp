// XXH3-64 for checkpoint manifests: the portable build of header-only xxHash (SSE2 on x86-64),
// and, where the CPU has it, the AVX2 build in xxh3_avx2.cpp, twice as fast (measured 17.8 against
// 35.8 GB/s over 64 MB on the development machine). Every byte a save writes and a load reads is
// hashed, so this is a pass over the checkpoint. Both builds compute the same function: XXH3's
// result does not depend on the vector width, which the tests check.
//
// Only xxhash.h is included here (no LibTorch, no precompiled header): this file and its AVX2
// twin share nothing but the state's layout.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cstdio>
#include <stdexcept>

#include "checkpoint/storage/files.h"
#include "checkpoint/storage/xxh3_avx2.h"

namespace fsdp {
namespace checkpoint {
namespace files {
namespace {

std::string hex16(XXH64_hash_t h) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

bool cpu_has_avx2() {
#if FSDP_XXH3_AVX2 && (defined(__GNUC__) || defined(__clang__))
  return __builtin_cpu_supports("avx2");
#else
  return false;
#endif
}

// BEST is AVX2 where the CPU has it; asking for AVX2 where it is not there is a programming error.
Xxh3Build resolve(Xxh3Build build) {
  if (build == Xxh3Build::BEST)
    return xxh3_avx2_available() ? Xxh3Build::AVX2 : Xxh3Build::PORTABLE;
  if (build == Xxh3Build::AVX2 && !xxh3_avx2_available())
    throw std::logic_error("xxh3: the AVX2 build was asked for, and this build or CPU lacks it");
  return build;
}

}  // namespace

bool xxh3_avx2_available() {
  static const bool yes = cpu_has_avx2();
  return yes;
}

std::string xxh3_hex(const void* data, size_t n, Xxh3Build build) {
  const bool avx2 = resolve(build) == Xxh3Build::AVX2;
#if FSDP_XXH3_AVX2
  if (avx2) return hex16(xxh3_avx2::hash(data, n));
#endif
  (void)avx2;
  return hex16(XXH3_64bits(data, n));
}

struct Xxh3Stream::State {
  XXH3_state_t s;
};

Xxh3Stream::Xxh3Stream(Xxh3Build build)
    : state_(std::make_unique<State>()), avx2_(resolve(build) == Xxh3Build::AVX2) {
  XXH3_64bits_reset(&state_->s);
}
Xxh3Stream::~Xxh3Stream() = default;

void Xxh3Stream::update(const void* data, size_t n) {
#if FSDP_XXH3_AVX2
  if (avx2_) {
    xxh3_avx2::update(&state_->s, data, n);
    return;
  }
#endif
  XXH3_64bits_update(&state_->s, data, n);
}

// The digest only finishes the last stripes from the state's buffer; either build's is the same.
std::string Xxh3Stream::hex() const { return hex16(XXH3_64bits_digest(&state_->s)); }

}  // namespace files
}  // namespace checkpoint
}  // namespace fsdp
