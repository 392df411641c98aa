// Internal: a reduce-scatter's additions and its division, several in one pass.
//
// Why: the sum of a reduce-scatter was one add_ per rank's piece, each a pass that reads the
// running sum and the piece and writes the sum back (at W=4 three passes over the output chunk,
// nine chunks of memory traffic), and FSDP's division of every reduced gradient shard (PyTorch's
// predivide and postdivide factors, or AVG's W) was a div_ pass of its own after the last add_
// (at 256 MB, W=2, 3.8 ms beside 6.2 ms for the add; docs/performance.md). Here the pieces that
// have arrived are added, and the scaling applied, while each element is in a register: one read
// of every operand and one write of the sum (five chunks at W=4).
//
// Plain C++ on raw pointers, without LibTorch, compiled at -O3 (vectorized; on x86-64 an AVX2 and
// a baseline build, chosen at load time) with contraction off so that every operation is rounded
// on its own, as ATen's separate add_ and div_ round them: the additions happen in the same order,
// each rounded to T, so the result is bit-identical to add_ of each source in turn. Single-
// threaded: the caller splits the range over ATen's intra-op threads (sum_then_divide in
// pairwise.cpp). Callers pass the reciprocals of powers of two only (or 1): multiplying by 2^-k
// rounds exactly as dividing by 2^k does (the same real value, rounded once), so the result is
// bit-identical to one div_ per divisor.
#pragma once

#include <cstdint>

namespace fsdp {
namespace dist {
namespace detail {

// acc[i] = ((((acc[i] + srcs[0][i]) + srcs[1][i]) + ...) * s1) * s2 for i in [0, n), each
// operation rounded in turn; k >= 0 sources, none overlapping acc.
void sum_then_scale(float* acc, const float* const* srcs, int k, int64_t n, float s1, float s2);
void sum_then_scale(double* acc, const double* const* srcs, int k, int64_t n, double s1, double s2);

}  // namespace detail
}  // namespace dist
}  // namespace fsdp
