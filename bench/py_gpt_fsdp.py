"""fsdp-train's GPT trained by PyTorch's own FSDP1 (FullyShardedDataParallel) and FSDP2
(fully_shard), on the same batches, optimizer and starting weights, for the side-by-side figures
of issue 65: tokens/s, MFU counted as fsdp-train counts it (examples/fsdp_train/flops.h) and peak
memory. Launched once per rank, by fsdp-run or torchrun:

    fsdp-train --steps 0 --seq-len 32 --export init.pt            # the starting weights
    USE_LIBUV=0 fsdp-run --nproc-per-node 2 -- python3 bench/py_gpt_fsdp.py --init init.pt --seq-len 32 \\
        --steps 20 --warmup 5 --out py.jsonl

Batches are fsdp-train's: step s draws its B starts with torch.randint from a generator seeded
seed * 1000003 + s, and rank r of W takes rows [r B / W, (r + 1) B / W). The optimizer is
fsdp-train's AdamW (betas 0.9/0.95, weight decay 0.1, foreach). With --init the losses are those
fsdp-train logs, within float rounding (tests/tools/test_fsdp_train.cpp checks it on the CPU).
Rank 0 appends one JSON line per implementation to --out.
"""
import argparse
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
from gpt_reference import GPT, Block  # noqa: E402  the same model, the same canonical names
from py_training import init_group  # noqa: E402  the store client fsdp-run's store needs

PRESETS = {"tiny": (2, 64, 4), "small": (6, 384, 6), "medium": (12, 768, 12),
           "large": (24, 1024, 16), "xl": (24, 1536, 16), "xxl": (20, 2048, 16)}
VOCAB = 256


def flops_per_token(layers, dim, seq_len):
    """examples/fsdp_train/flops.h: 6 N + 12 L D T, N every parameter but the positions."""
    n = layers * (12 * dim * dim + 13 * dim) + VOCAB * dim + 2 * dim
    return 6 * n + 12 * layers * dim * seq_len


def batch(corpus, args, step, lo, hi):
    g = torch.Generator().manual_seed((args.seed * 1000003 + step) % (1 << 64))
    starts = torch.randint(corpus.numel() - args.seq_len, (args.global_batch,), generator=g)
    x = torch.stack([corpus[s:s + args.seq_len] for s in starts[lo:hi].tolist()])
    y = torch.stack([corpus[s + 1:s + 1 + args.seq_len] for s in starts[lo:hi].tolist()])
    return x, y


def wrap(impl, model, args, device):
    bf16 = args.mixed_precision == "bf16"
    if impl == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), mixed_precision=mp,
                    use_orig_params=True, device_id=device)  # a CPU device too (2.x)
    from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy  # 2.6 and later
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kw = {"mesh": mesh}
    if bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    for b in model.blocks:
        fully_shard(b, **kw)
    return fully_shard(model, **kw)


def unsupported(impl, device):
    """Why `impl` cannot run here, or None. FSDP2 of PyTorch 2.6 records events on its streams,
    which the CPU's stream cannot (AttributeError mid-forward): it needs an accelerator."""
    if impl == "fsdp2":
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401  (2.6 and later)
        except ImportError:
            return f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard"
        if device.type == "cpu" and not hasattr(torch.cpu.current_stream(), "record_event"):
            return f"FSDP2 of torch {torch.__version__} needs an accelerator (no CPU stream events)"
    return None


def run(impl, corpus, args, device, rank, world):
    torch.manual_seed(args.seed)
    model = GPT(VOCAB, args.seq_len, args.layers, args.dim, args.heads)
    if args.init:
        # strict: every name of fsdp-train's export is the reference model's (head.weight is
        # tok.weight, tied in both)
        model.load_state_dict(torch.load(args.init, weights_only=True))
    model = wrap(impl, model.to(device), args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            foreach=True)
    rows = args.global_batch // world
    losses, t0 = [], None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(1, args.steps + 1):
        if step == args.warmup + 1:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
        x, y = (t.to(device) for t in batch(corpus, args, step, rank * rows, (rank + 1) * rows))
        opt.zero_grad()
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB).float(), y.reshape(-1))
        loss.backward()
        opt.step()
        if args.log_losses:
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            losses.append(avg.item() / world)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    timed = args.steps - args.warmup
    secs = time.perf_counter() - t0 if t0 is not None and timed > 0 else 0.0
    tps = timed * args.global_batch * args.seq_len / secs if secs > 0 else 0.0
    fpt = flops_per_token(args.layers, args.dim, args.seq_len)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    peaks = torch.zeros(world, dtype=torch.float64, device=device)
    peaks[rank] = peak
    dist.all_reduce(peaks)
    return {"impl": impl, "torch": torch.__version__, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "world_size": world, "layers": args.layers, "dim": args.dim, "heads": args.heads,
            "seq_len": args.seq_len, "global_batch": args.global_batch,
            "mixed_precision": args.mixed_precision, "steps": args.steps, "warmup": args.warmup,
            "losses": losses, "tokens_per_s": tps, "flops_per_token": fpt,
            "tflops_per_rank": tps * fpt / world / 1e12,
            "mfu": tps * fpt / world / (args.peak_tflops * 1e12) if args.peak_tflops > 0 else None,
            ("peak_cuda_mb_per_rank" if device.type == "cuda" else "peak_rss_mb_per_rank"):
                [round(p, 1) for p in peaks.tolist()]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl", default="fsdp1,fsdp2", help="comma list of fsdp1, fsdp2")
    ap.add_argument("--model", choices=sorted(PRESETS), help="fsdp-train's presets")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=12)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of tokens/s")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--mixed-precision", choices=["none", "bf16"], default="none")
    ap.add_argument("--init", help="fsdp-train --steps 0 --export FILE.pt: the same start")
    ap.add_argument("--data", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--peak-tflops", type=float, default=0.0)
    ap.add_argument("--no-losses", dest="log_losses", action="store_false",
                    help="skip the per-step loss all_reduce (a host sync) when timing on a GPU")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.model:
        args.layers, args.dim, args.heads = PRESETS[args.model]
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        if int(os.environ.get("LOCAL_WORLD_SIZE", world)) > torch.cuda.device_count():
            # Ranks sharing a GPU: NCCL accepts them only as different hosts (as bench_ranks.h).
            os.environ.setdefault("NCCL_HOSTID", "py-gpt-rank-" + str(rank))
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by W={world}")
    init_group("nccl" if cuda else "gloo")
    with open(args.data, "rb") as f:
        corpus = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
    for impl in args.impl.split(","):
        why = unsupported(impl, device)
        if why:  # every rank reaches the same verdict alone
            if rank == 0:
                with open(args.out, "a") as f:
                    f.write(json.dumps({"impl": impl, "skipped": why}) + "\n")
                print(f"{impl}: skipped: {why}", flush=True)
            continue
        result = run(impl, corpus, args, device, rank, world)
        if rank == 0:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")
            print(f"{impl}: {result['tokens_per_s']:.0f} tok/s, "
                  f"{result['tflops_per_rank']:.4g} TFLOP/s per rank, losses {result['losses']}",
                  flush=True)
    dist.barrier()  # no rank tears its group down while a peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
