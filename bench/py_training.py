"""The peers of bench_training: PyTorch's own Python FSDP (each sharding strategy) and
DistributedDataParallel training the same model, with the same batch, optimizer and one thread
per rank, over Gloo. Launched once per rank by fsdp-run (RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT), as scripts/bench.sh does:

    fsdp-run --nproc-per-node 2 -- python3 bench/py_training.py --out results.jsonl

Rank 0 appends one JSON line per case, with the seconds per step of every round, in the format of
bench_ranks.h's emit(). Keep the model in step with bench/bench_training.cpp.
"""
import argparse
import json
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS, FF, LAYERS, SEQ = 256, 128, 4, 512, 4, 32
GLOBAL_BATCH = 8


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(VOCAB, DIM)
        # LibTorch's TransformerEncoderLayer: post-norm, ReLU, sequence-first.
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(DIM, HEADS, dim_feedforward=FF, dropout=0.0)
            for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        x = self.tok(idx).transpose(0, 1)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.transpose(0, 1))


def wrap(model, case):
    if case == "DDP":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    return FSDP(model, sharding_strategy=getattr(ShardingStrategy, case),
                auto_wrap_policy=ModuleWrapPolicy({nn.TransformerEncoderLayer}),
                device_id=torch.device("cpu"))


def seconds_per_step(case, iters, world):
    model = wrap(Transformer(), case)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    idx = torch.randint(VOCAB, (GLOBAL_BATCH // world, SEQ))

    def step():
        opt.zero_grad()
        F.cross_entropy(model(idx).reshape(-1, VOCAB), idx.reshape(-1)).backward()
        opt.step()

    for _ in range(2):
        step()
    dist.barrier()
    t = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - t) / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--cases", default="FULL_SHARD,SHARD_GRAD_OP,NO_SHARD,DDP")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")  # NO_SHARD's deprecation notice
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cases = args.cases.split(",")
    samples = {c: [] for c in cases}
    for r in range(args.rounds):
        for c in (cases if r % 2 == 0 else cases[::-1]):
            samples[c].append(seconds_per_step(c, args.iters, world))
    if rank == 0:
        for c in cases:
            print(f"python {c:14s} {statistics.median(samples[c]) * 1e3:8.1f} ms/step", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                for c in cases:
                    f.write(json.dumps({
                        "bench": "training_python", "case": c, "world": world, "unit": "s",
                        "tokens": GLOBAL_BATCH * SEQ, "model": "transformer4x128",
                        "pytorch": torch.__version__, "backend": "gloo",
                        "run": os.environ.get("FSDP_BENCH_TAG", ""),
                        "samples": samples[c], "median": statistics.median(samples[c])}) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
