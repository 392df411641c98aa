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
import sys
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


def wrap(model, case, device):
    if case == "DDP":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model.to(device),
                                       device_ids=[device] if device.type == "cuda" else None)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    return FSDP(model, sharding_strategy=getattr(ShardingStrategy, case),
                auto_wrap_policy=ModuleWrapPolicy({nn.TransformerEncoderLayer}),
                device_id=device)


def seconds_per_step(case, iters, world, device):
    model = wrap(Transformer(), case, device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    idx = torch.randint(VOCAB, (GLOBAL_BATCH // world, SEQ)).to(device)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(idx).reshape(-1, VOCAB), idx.reshape(-1)).backward()
        opt.step()
        if device.type == "cuda":  # as bench_training does: each step timed to its end
            torch.cuda.synchronize()

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
    ap.add_argument("--device", default="cpu",
                    help="cpu (Gloo) or cuda (NCCL; ranks may share one GPU)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")  # NO_SHARD's deprecation notice
    torch.set_num_threads(1)
    device = torch.device(args.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        # Ranks sharing one GPU: NCCL accepts them only as different hosts (as bench_ranks.h).
        os.environ.setdefault("NCCL_HOSTID", "py-bench-rank-" + os.environ["RANK"])
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    cases = args.cases.split(",")
    samples = {c: [] for c in cases}
    for r in range(args.rounds):
        for c in (cases if r % 2 == 0 else cases[::-1]):
            samples[c].append(seconds_per_step(c, args.iters, world, device))
    if rank == 0:
        for c in cases:
            print(f"python {c:14s} {statistics.median(samples[c]) * 1e3:8.1f} ms/step", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                for c in cases:
                    f.write(json.dumps({
                        "bench": "training_python", "case": c, "world": world, "unit": "s",
                        "tokens": GLOBAL_BATCH * SEQ, "model": "transformer4x128",
                        "pytorch": torch.__version__, "backend": backend,
                        "device": str(device),
                        "run": os.environ.get("FSDP_BENCH_TAG", ""),
                        "samples": samples[c], "median": statistics.median(samples[c])}) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    # Skip the interpreter's teardown, where PyTorch 2.6's Gloo group has aborted once in many
    # runs ("terminate called without an active exception") after all the work was done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
