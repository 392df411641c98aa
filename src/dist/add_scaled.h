// Internal: the last addition of a reduce-scatter's sum together with its division, in one pass.
//
// Why: FSDP divides every reduced gradient shard (PyTorch's predivide and postdivide factors, or
// AVG's W), and ATen's div_ is a pass of its own over the shard after the sum's last add_: at
// 256 MB, W=2, 3.8 ms for the division beside 6.2 ms for the add (docs/performance.md). Here the
// add and the scaling share one read and one write of each element.
//
// Plain C++ on raw pointers, without LibTorch, compiled at -O3 (vectorized; on x86-64 an AVX2 and
// a baseline build, chosen at load time) with contraction off so that every operation is rounded
// on its own, as ATen's separate add_ and div_ round them. Single-threaded: the caller splits the
// range over ATen's intra-op threads (add_then_divide in pairwise.cpp).
// Callers pass the reciprocals of powers of two only: multiplying by 2^-k rounds exactly as
// dividing by 2^k does (the same real value, rounded once), so the result is bit-identical to
// add_ followed by one div_ per divisor.
#pragma once

#include <cstdint>

namespace fsdp {
namespace dist {
namespace detail {

// acc[i] = (acc[i] + src[i]) * s1 * s2, for i in [0, n), each operation rounded in turn.
void add_then_scale(float* acc, const float* src, int64_t n, float s1, float s2);
void add_then_scale(double* acc, const double* src, int64_t n, double s1, double s2);

}  // namespace detail
}  // namespace dist
}  // namespace fsdp
