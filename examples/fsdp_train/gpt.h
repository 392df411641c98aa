// A small GPT-style decoder for fsdp-train (issue 12), written only against LibTorch and
// fsdp-cpp's public API, as a user's model would be.
//
// Byte-level: the vocabulary is the 256 byte values, so any text file is a corpus and there is
// no tokenizer to ship. tok (embedding, tied with the output head) + pos (learned positions),
// then `layers` pre-LayerNorm transformer blocks (causal multi-head self-attention, a GELU MLP of
// 4 * dim, residual connections, no dropout), a final LayerNorm and the head. Each block is its
// own FSDP unit (fsdp::forward marks where it runs); the root unit holds the rest.
//
// Canonical parameter names (what checkpoints and exports are keyed by; scripts/gpt_reference.py
// defines the same model in Python under the same names):
//   tok.weight [256, D]   pos.weight [T, D]
//   blocks.<i>.ln1.{weight,bias}  blocks.<i>.attn.qkv.{weight,bias} [3D, D]
//   blocks.<i>.attn.proj.{weight,bias}  blocks.<i>.ln2.{weight,bias}
//   blocks.<i>.mlp.fc.{weight,bias} [4D, D]  blocks.<i>.mlp.proj.{weight,bias} [D, 4D]
//   ln_f.{weight,bias}    head.weight (the same tensor as tok.weight)
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <cstdint>

#include "fsdp/fsdp.h"

namespace gpt {

struct Config {
  int64_t vocab = 256;
  int64_t seq_len = 64;
  int64_t layers = 2;
  int64_t dim = 64;
  int64_t heads = 4;
  /// Attention through LibTorch's fused kernel (fsdp::compat::causal_fused_attention, 2.x) instead
  /// of the math below: the same result within rounding, without the T x T probabilities.
  bool fused_attention = false;
};

struct AttentionImpl : torch::nn::Module {
  int64_t heads;
  bool fused;
  torch::nn::Linear qkv{nullptr}, proj{nullptr};
  AttentionImpl(int64_t dim, int64_t heads_, bool fused_ = false) : heads(heads_), fused(fused_) {
    qkv = register_module("qkv", torch::nn::Linear(dim, 3 * dim));
    proj = register_module("proj", torch::nn::Linear(dim, dim));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t B = x.size(0), T = x.size(1), D = x.size(2), hd = D / heads;
    auto parts = qkv(x).split(D, 2);
    auto split_heads = [&](const torch::Tensor& t) {
      return t.view({B, T, heads, hd}).transpose(1, 2);  // [B, H, T, hd]
    };
    auto q = split_heads(parts[0]), k = split_heads(parts[1]), v = split_heads(parts[2]);
    if (fused) {
      auto y = fsdp::compat::causal_fused_attention(q, k, v);  // [B, H, T, hd]
      return proj(y.transpose(1, 2).contiguous().view({B, T, D}));
    }
    auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
    auto mask = torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool)).triu(1);
    att = att.masked_fill(mask.to(att.device()), -std::numeric_limits<float>::infinity());
    auto y = torch::matmul(torch::softmax(att, -1), v);  // [B, H, T, hd]
    return proj(y.transpose(1, 2).contiguous().view({B, T, D}));
  }
};
TORCH_MODULE(Attention);

struct MlpImpl : torch::nn::Module {
  torch::nn::Linear fc{nullptr}, proj{nullptr};
  explicit MlpImpl(int64_t dim) {
    fc = register_module("fc", torch::nn::Linear(dim, 4 * dim));
    proj = register_module("proj", torch::nn::Linear(4 * dim, dim));
  }
  torch::Tensor forward(const torch::Tensor& x) { return proj(torch::gelu(fc(x))); }
};
TORCH_MODULE(Mlp);

struct BlockImpl : torch::nn::Module {
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  Attention attn{nullptr};
  Mlp mlp{nullptr};
  BlockImpl(int64_t dim, int64_t heads, bool fused_attention = false) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    attn = register_module("attn", Attention(dim, heads, fused_attention));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    mlp = register_module("mlp", Mlp(dim));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = x + attn(ln1(x));
    return h + mlp(ln2(h));
  }
};
TORCH_MODULE(Block);

// The output projection: its weight is the embedding's tensor, registered here too.
struct TiedHeadImpl : torch::nn::Module {
  torch::Tensor weight;
  explicit TiedHeadImpl(const torch::Tensor& w) { weight = register_parameter("weight", w); }
  torch::Tensor forward(const torch::Tensor& x) { return torch::matmul(x, weight.t()); }
};
TORCH_MODULE(TiedHead);

struct GPTImpl : torch::nn::Module {
  Config cfg;
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  TiedHead head{nullptr};

  /// Initial values follow `seed` (LibTorch's default initialisers), the same in every process.
  GPTImpl(const Config& c, uint64_t seed) : cfg(c) {
    torch::manual_seed(seed);
    tok = register_module("tok", torch::nn::Embedding(c.vocab, c.dim));
    pos = register_module("pos", torch::nn::Embedding(c.seq_len, c.dim));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.layers; ++i)
      blocks->push_back(Block(c.dim, c.heads, c.fused_attention));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    head = register_module("head", TiedHead(tok->weight));
    // GPT-2's initialisation: N(0, 0.02) weights, zero biases, LayerNorms at identity. LibTorch's
    // N(0, 1) embedding, tied to the head, would start with logits of size ~sqrt(dim).
    torch::NoGradGuard no_grad;
    for (auto& p : named_parameters()) {
      const std::string& name = p.key();
      const bool norm = name.find("ln") != std::string::npos;
      if (name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0) {
        p.value().zero_();
      } else if (!norm) {
        p.value().normal_(0.0, 0.02);
      }
    }
  }

  /// idx: [B, T] byte values (T <= seq_len) -> logits [B, T, vocab].
  torch::Tensor forward(const torch::Tensor& idx) {
    const int64_t T = idx.size(1);
    auto x = tok(idx) + pos(torch::arange(T, idx.options()));
    for (size_t i = 0; i < blocks->size(); ++i) {
      auto b = blocks->ptr<BlockImpl>(i);
      x = fsdp::forward(b, x);  // a unit of its own when wrapped
    }
    return head(ln_f(x));
  }
};
TORCH_MODULE(GPT);

}  // namespace gpt
