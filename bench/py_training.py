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
import resource
import statistics
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS, FF, LAYERS, SEQ = 256, 128, 4, 512, 4, 32
SMALL_DIM, BLOCKS, LINEARS = 64, 48, 96
GLOBAL_BATCH = 8
MODEL_NAMES = {"transformer": "transformer4x128", "blocks": "blocks48x64",
               "params": "params96x64"}


class MlpBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(SMALL_DIM, 4 * SMALL_DIM)
        self.fc2 = nn.Linear(4 * SMALL_DIM, SMALL_DIM)

    def forward(self, x):
        return x + self.fc2(F.relu(self.fc1(x)))


class Transformer(nn.Module):
    """bench_training's models (FSDP_BENCH_MODEL there, --model here): token ids to logits."""

    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        dim = DIM if kind == "transformer" else SMALL_DIM
        self.tok = nn.Embedding(VOCAB, dim)
        if kind == "transformer":
            # LibTorch's TransformerEncoderLayer: post-norm, ReLU, sequence-first.
            self.layers = nn.ModuleList(
                nn.TransformerEncoderLayer(DIM, HEADS, dim_feedforward=FF, dropout=0.0)
                for _ in range(LAYERS))
        elif kind == "blocks":
            self.layers = nn.ModuleList(MlpBlock() for _ in range(BLOCKS))
        else:
            self.layers = nn.ModuleList(nn.Linear(SMALL_DIM, SMALL_DIM) for _ in range(LINEARS))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, idx):
        x = self.tok(idx)
        if self.kind == "transformer":
            x = x.transpose(0, 1)
            for layer in self.layers:
                x = layer(x)
            x = x.transpose(0, 1)
        elif self.kind == "blocks":
            for layer in self.layers:
                x = layer(x)
        else:
            for layer in self.layers:
                x = torch.tanh(layer(x))
        return self.head(x)


def wrap(model, case, device):
    if case == "local":
        # Each rank steps an unwrapped copy on its share of the batch, with no communication:
        # bench_training's compute_only, the step of the framework-free model on this side.
        return model.to(device)
    if case.startswith("DDP"):
        from torch.nn.parallel import DistributedDataParallel
        # "DDP bucket=<N>MB": the bucket size swept; "DDP": its defaults (25 MB buckets copied
        # into and out of). "DDP view": gradient_as_bucket_view=True, gradients living in the
        # buckets as our NO_SHARD's do; "DDP view static": static_graph=True besides, DDP's
        # fastest configuration for a graph that does not change between steps.
        extra = {}
        for word in case.split()[1:]:
            if word.startswith("bucket="):
                extra["bucket_cap_mb"] = float(word.split("=")[1].rstrip("MB"))
            elif word == "view":
                extra["gradient_as_bucket_view"] = True
            elif word == "static":
                extra["static_graph"] = True
            else:
                raise SystemExit(f"py_training.py: unknown DDP option '{word}' in '{case}'")
        return DistributedDataParallel(model.to(device),
                                       device_ids=[device] if device.type == "cuda" else None,
                                       **extra)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    policy = None
    if model.kind == "transformer":
        policy = ModuleWrapPolicy({nn.TransformerEncoderLayer})
    elif model.kind == "blocks":
        policy = ModuleWrapPolicy({MlpBlock})
    return FSDP(model, sharding_strategy=getattr(ShardingStrategy, case),
                auto_wrap_policy=policy, device_id=device)


def make_optimizer(params, kind):
    # As bench_training's FSDP_BENCH_OPTIM; PyTorch's defaults (foreach on a GPU) are kept.
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-3)
    return torch.optim.Adam(params, lr=1e-3)


def seconds_per_step(case, iters, world, device, kind, optim, phases=None):
    """The mean step over `iters` steps. With `phases` (a dict), each step's forward, backward
    and optimizer (zero_grad and step) are also timed apart, with the device synchronized
    between them, and appended to its lists, as bench_training's FSDP_BENCH_PHASES."""
    model = wrap(Transformer(kind), case, device)
    opt = make_optimizer(model.parameters(), optim)
    idx = torch.randint(VOCAB, (GLOBAL_BATCH // world, SEQ)).to(device)

    def sync():
        if device.type == "cuda":  # as bench_training does: each step timed to its end
            torch.cuda.synchronize()

    def step():
        opt.zero_grad()
        F.cross_entropy(model(idx).reshape(-1, VOCAB), idx.reshape(-1)).backward()
        opt.step()
        sync()

    def phased_step():
        t = time.perf_counter()
        opt.zero_grad()
        t, optim = time.perf_counter(), time.perf_counter() - t
        loss = F.cross_entropy(model(idx).reshape(-1, VOCAB), idx.reshape(-1))
        sync()
        t, fwd = time.perf_counter(), time.perf_counter() - t
        loss.backward()
        sync()
        t, bwd = time.perf_counter(), time.perf_counter() - t
        opt.step()
        sync()
        phases["forward"].append(fwd)
        phases["backward"].append(bwd)
        phases["optim"].append(optim + time.perf_counter() - t)

    for _ in range(2):
        step()
    dist.barrier()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = time.perf_counter()
    for _ in range(iters):
        phased_step() if phases is not None else step()
    elapsed = time.perf_counter() - t
    if phases is not None:
        phases["faults"] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / iters
    return elapsed / iters


def init_group(backend):
    """The default group from the launcher's variables. Under fsdp-run (as under torchrun) the
    launcher hosts the store and says so with TORCHELASTIC_USE_AGENT_STORE; PyTorch 2.x then
    connects with a libuv client whatever USE_LIBUV says, which Debian's PyTorch (built without
    libuv) refuses. So the client is made here, honouring USE_LIBUV where PyTorch has the choice."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return
    kw = {}
    if "use_libuv" in (dist.TCPStore.__init__.__doc__ or ""):
        kw["use_libuv"] = os.environ.get("USE_LIBUV", "1") == "1"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), False, timedelta(seconds=300), **kw)
    dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--cases", default="FULL_SHARD,SHARD_GRAD_OP,NO_SHARD,DDP",
                    help="comma-separated; also: local (no communication, as compute_only)")
    ap.add_argument("--model", default="transformer", choices=sorted(MODEL_NAMES))
    ap.add_argument("--ddp-buckets-mb", default="",
                    help="also DDP with these bucket_cap_mb values (e.g. 1,5,25,100)")
    ap.add_argument("--optim", default="adam", choices=["adam", "sgd"],
                    help="as bench_training's FSDP_BENCH_OPTIM")
    ap.add_argument("--phases", action="store_true",
                    help="also print each case's forward, backward and optimizer medians and "
                         "minor page faults per step (rank 0), as FSDP_BENCH_PHASES=1")
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
    init_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    cases = args.cases.split(",") + [
        f"DDP bucket={mb}MB" for mb in args.ddp_buckets_mb.split(",") if mb]
    samples = {c: [] for c in cases}
    phases = {c: {"forward": [], "backward": [], "optim": []} for c in cases}
    for r in range(args.rounds):
        for c in (cases if r % 2 == 0 else cases[::-1]):
            samples[c].append(seconds_per_step(c, args.iters, world, device, args.model,
                                               args.optim, phases[c] if args.phases else None))
    if rank == 0:
        for c in cases:
            print(f"python {c:18s} {statistics.median(samples[c]) * 1e3:8.1f} ms/step", flush=True)
        if args.phases:
            print(f"python {'(ms, medians)':18s} {'forward':>9s} {'backward':>9s} {'optim':>9s}"
                  f" {'faults':>9s}")
            for c in cases:
                p = phases[c]
                print(f"python {c:18s} " + " ".join(
                    f"{statistics.median(p[k]) * 1e3:9.2f}" for k in ("forward", "backward",
                                                                      "optim"))
                      + f" {p['faults']:9.0f}", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                for c in cases:
                    f.write(json.dumps({
                        "bench": "training_python", "case": c, "world": world, "unit": "s",
                        "tokens": GLOBAL_BATCH * SEQ, "model": MODEL_NAMES[args.model],
                        "optim": args.optim,
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
