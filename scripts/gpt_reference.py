#!/usr/bin/python3
"""fsdp-train's GPT defined again in plain PyTorch, to check its exports (issue 12).

    gpt_reference.py --heads 4 --logits logits.pt model.pt [model.safetensors ...]

Loads each export (a `.pt` through torch.load(weights_only=True); safetensors through the
`safetensors` package where installed, else a reader of the format's few rules below), builds
the model from the shapes it holds, and compares its logits on the input fsdp-train recorded
with --eval-logits against the logits the C++ model computed there. Prints the largest absolute
difference per file and exits 1 if any exceeds --tolerance (default 1e-5).
"""
import argparse
import json
import math
import struct
import sys

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, D = x.shape
        hd = D // self.heads
        q, k, v = self.qkv(x).split(D, dim=2)
        q, k, v = (t.view(B, T, self.heads, hd).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf"))
        y = torch.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, D))


class Mlp(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim)

    def forward(self, x):
        h = x + self.attn(self.ln1(x))
        return h + self.mlp(self.ln2(h))


class GPT(nn.Module):
    def __init__(self, vocab, seq_len, layers, dim, heads):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in the C++ model

    def forward(self, idx):
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


DTYPES = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32}


def read_safetensors(path):
    try:
        from safetensors.torch import load_file
        return load_file(path)
    except ImportError:
        pass
    # The format: an 8-byte little-endian header length, a JSON header of
    # {name: {dtype, shape, data_offsets: [begin, end]}}, then the data.
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        t = torch.frombuffer(bytearray(data[b:end]), dtype=DTYPES[e["dtype"]])
        out[name] = t.reshape(e["shape"])
    return out


def load_weights(path):
    if path.endswith(".pt"):
        return torch.load(path, weights_only=True)
    return read_safetensors(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("exports", nargs="+", help="fsdp-train --export files (.pt or safetensors)")
    ap.add_argument("--logits", required=True, help="fsdp-train --eval-logits file")
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--tolerance", type=float, default=1e-5)
    args = ap.parse_args()
    ref = torch.load(args.logits, weights_only=True)
    worst = 0.0
    for path in args.exports:
        sd = load_weights(path)
        layers = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
        vocab, dim = sd["tok.weight"].shape
        model = GPT(vocab, sd["pos.weight"].shape[0], layers, dim, args.heads)
        model.load_state_dict(sd)  # strict: every name and shape must match the C++ model's
        with torch.no_grad():
            logits = model(ref["input"])
        diff = (logits - ref["logits"]).abs().max().item()
        worst = max(worst, diff)
        print(f"{path}: {len(sd)} tensors, {layers} blocks, dim {dim}; "
              f"max |logits - C++ logits| = {diff:.3g}")
    if worst > args.tolerance:
        print(f"FAIL: {worst:.3g} > {args.tolerance:g}", file=sys.stderr)
        return 1
    print("OK: Python's model gives the C++ model's logits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
