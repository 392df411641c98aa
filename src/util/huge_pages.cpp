// See huge_pages.h. No LibTorch here: a small translation unit without the precompiled header.
#include "util/huge_pages.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace fsdp {
namespace detail {

bool huge_page_advice_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("FSDP_HUGE_PAGES");
    return !(v && (std::strcmp(v, "0") == 0 || std::strcmp(v, "false") == 0 ||
                   std::strcmp(v, "off") == 0));
  }();
  return enabled;
}

bool advise_huge_pages(const void* data, size_t nbytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (data == nullptr || nbytes < kHugePageAdviceMinBytes || !huge_page_advice_enabled()) {
    return false;
  }
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  // Only whole pages inside the block: rounding outwards would advise a neighbour's memory.
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + nbytes) & ~(page - 1);
  if (end <= begin) return false;
  return madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE) == 0;
#else
  (void)data;
  (void)nbytes;
  return false;
#endif
}

}  // namespace detail
}  // namespace fsdp
