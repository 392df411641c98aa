// Internal: transparent huge pages for the unit-sized CPU buffers the library allocates anew on
// every step (the unsharded flat parameter, the flat gradient, the reduce-scatter's output and
// scratch, checkpoint staging).
//
// Why: glibc serves every block from 32 MiB up with a fresh mmap and returns it to the kernel on
// free (its dynamic mmap threshold stops growing at 32 MiB), so each such buffer is page-faulted
// in anew, one 4 KiB page at a time. Measured on the development machine (AMD EPYC, kernel 6.18,
// THP "madvise"): writing 256 MB of fresh memory takes 97 ms, of memory already faulted 6 ms, of
// fresh memory advised MADV_HUGEPAGE 17 ms. The faults made an unshard of 64-256 MB 0.65-0.82 of
// the raw all-gather's bandwidth. The buffers are written whole right after they are allocated
// (an all-gather, a gradient copy), so huge pages cost no memory that 4 KiB pages would not.
//
// Where THP is "always" this changes nothing, where it is "never" the kernel ignores the advice,
// and $FSDP_HUGE_PAGES=0 turns it off (for kernels whose direct compaction stalls the fault).
//
// The gain assumes the memory was freed recently, as a training step's buffers are. On a VM whose
// balloon reports free memory to the host (free page reporting), a 2 MiB block that stayed free
// for about 2 s faults on the host too: 600 MB advised took 305-859 ms to write there, against
// about 200 ms with 4 KiB pages, which that reporting did not slow (bench/bench_fresh_memory,
// docs/performance.md "Fresh memory"). That hits the rare, large FULL state dict buffers, not the
// step; the advice stays on by default, and $FSDP_HUGE_PAGES=0 is the choice on such a VM where the
// state dict matters more.
#pragma once

#include <cstddef>

namespace fsdp {
namespace detail {

// From here a block holds at least one whole aligned 2 MiB page. (Blocks under 32 MiB may come
// from glibc's heap once its threshold has grown, but its top is trimmed back to the kernel and
// grown again as units come and go, so they too are often fresh: a 32 MB reduce-scatter output
// ran at 0.63 of the raw all-to-all unadvised. PyTorch's own THP_MEM_ALLOC_ENABLE advises every
// block from 2 MiB.)
constexpr size_t kHugePageAdviceMinBytes = size_t{4} << 20;

// Advises MADV_HUGEPAGE for the whole 4 KiB pages of [data, data + nbytes), if nbytes is at least
// kHugePageAdviceMinBytes and the advice is enabled. Call it before the memory is first written.
// Never fails: advice the kernel refuses is simply not taken. Returns whether advice was given.
bool advise_huge_pages(const void* data, size_t nbytes);

// Whether advise_huge_pages gives advice in this process ($FSDP_HUGE_PAGES, read once).
bool huge_page_advice_enabled();

}  // namespace detail
}  // namespace fsdp
