// What fsdp-train counts as the work of one token, and how close a run comes to the device's
// peak (MFU, model FLOPs utilisation) — counted the way torchtitan counts it, so that figures can
// be set beside PyTorch's.
//
// Per token of a training step (forward + backward = 3 x the forward's multiply-adds x 2 FLOPs):
//
//   6 N  +  12 L D T
//
//   N     parameters that take part in a matrix multiply or are updated per token: every
//         parameter except the learned positions `pos` (a lookup). The byte embedding `tok` is
//         counted once, as the tied output head's [D, vocab] matmul; biases and LayerNorms are
//         counted like torchtitan does (they are < 0.2% of N at D >= 384).
//   12 L D T  attention's two matmuls (Q K^T and P V, 2 T D multiply-adds per token and layer in
//         the forward, x 3 for forward + backward, x 2 FLOPs). The causal mask is not discounted:
//         torchtitan counts the full T x T product too.
//
// Recomputation (--activation-checkpointing) is not counted: MFU is the model's useful work, so
// recomputing lowers it, as it should.
#pragma once

#include <cstdint>

#include "gpt.h"

namespace gpt {

/// Every parameter of the model (the tied head once), as gpt::GPT registers them.
inline int64_t parameter_count(const Config& c) {
  const int64_t D = c.dim;
  const int64_t block = 12 * D * D + 13 * D;  // qkv, proj, fc, proj with biases; ln1, ln2
  return c.layers * block + c.vocab * D + c.seq_len * D + 2 * D;
}

/// Training FLOPs per token at sequence length `seq_len` (the formula above).
inline int64_t flops_per_token(const Config& c, int64_t seq_len) {
  const int64_t matmul_params = parameter_count(c) - c.seq_len * c.dim;
  return 6 * matmul_params + 12 * c.layers * c.dim * seq_len;
}

/// MFU of `tokens_per_s` (over all `world` ranks) against `peak_tflops` per rank; 0 when the peak
/// is unknown.
inline double mfu(double tokens_per_s, int64_t flops_per_token, int world, double peak_tflops) {
  if (peak_tflops <= 0 || world <= 0) return 0;
  return tokens_per_s * static_cast<double>(flops_per_token) / world / (peak_tflops * 1e12);
}

}  // namespace gpt
