#!/usr/bin/python3
"""A model bigger than a rank's share, trained sharded: every rank's peak resident memory against
the model's own bytes and against the analytic bound, and the first steps' losses against a
single-process run (issue 63's acceptance, measured, never asserted by a timed test).

Runs fsdp-train (the trainer a newcomer runs) under fsdp-run, once per world size, for a few steps
with --log-every 1 and --metrics; the reference is the same command at W=1. Each line of
--metrics carries every rank's peak RSS so far (getrusage's ru_maxrss: the whole process, from
start-up on), so the last line is each rank's peak over the run, and its peak since start-up
ended (VmHWM, reset then): the steps' own peak, which --init eager's start-up would hide.

    bench/big_model.py --build build --model xl --world-sizes 4,6 --steps 3

The analytic bound of one rank (float32, FULL_SHARD, what docs/performance.md calls the bound):

    base            the process before any model (LibTorch's code and Gloo: --model tiny at W=1)
  + (2 + k) P / W   the sharded parameters, their gradients, and k optimizer states (SGD: k=1
                    with momentum, 0 without; Adam/AdamW: 2)
  + 3 U             one unit unsharded, the next one prefetched, and one unsharded gradient
  + A               activations kept for backward: per block and token 16 D floats (the
                    LayerNorms' inputs and outputs, q/k/v, the attention's output, the MLP's two
                    4D tensors) plus H T for the attention probabilities, times B T tokens per
                    rank, times the layers

Exit status: 1 if a run failed, 2 if a rank's peak exceeded the model's bytes or a loss left the
bound (the cross-world-size tolerance of tests/tools/test_fsdp_train.cpp: 1e-4 relative).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

PRESETS = {"tiny": (2, 64, 4), "small": (6, 384, 6), "medium": (12, 768, 12),
           "large": (24, 1024, 16), "xl": (24, 1536, 16), "xxl": (20, 2048, 16)}
LOSS_RTOL = 1e-4


def params_of(layers, dim, seq_len, vocab=256):
    block = 12 * dim * dim + 13 * dim  # qkv, proj, fc, proj and two LayerNorms, with biases
    return layers * block + vocab * dim + seq_len * dim + 2 * dim, block


def run(args, world, extra, workdir):
    metrics = os.path.join(workdir, f"w{world}.jsonl")
    cmd = [os.path.join(args.build, "fsdp-run"), "--nproc-per-node", str(world),
           os.path.join(args.build, "examples", "fsdp-train"), "--model", args.model,
           "--steps", str(args.steps), "--log-every", "1", "--metrics", metrics,
           "--optimizer", args.optimizer, "--momentum", str(args.momentum),
           "--global-batch", str(args.global_batch), "--seq-len", str(args.seq_len),
           "--init", args.init] + extra
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True)
    secs = time.monotonic() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"big_model: W={world} failed (exit {proc.returncode}): {' '.join(cmd)}")
    startup = re.search(r"peak rss MB by rank:((?: [0-9.]+)+)", proc.stdout)
    lines = [json.loads(x) for x in open(metrics) if x.strip()]
    return {"startup": [float(x) for x in startup.group(1).split()] if startup else [],
            "peak": lines[-1]["rss_mb_per_rank"], "loss": [x["loss"] for x in lines],
            "train": lines[-1].get("train_rss_mb_per_rank", []),
            "secs": secs}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--model", default="xl", choices=sorted(PRESETS))
    ap.add_argument("--world-sizes", default="4")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "adamw"])
    ap.add_argument("--momentum", type=float, default=0.0)
    ap.add_argument("--global-batch", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--init", default="deferred", choices=["deferred", "eager"])
    ap.add_argument("--no-reference", action="store_true", help="skip the W=1 run")
    args = ap.parse_args()
    args.build = os.path.abspath(args.build)
    layers, dim, heads = PRESETS[args.model]
    n_params, block = params_of(layers, dim, args.seq_len)
    mb = 1 << 20
    model_mb = 4 * n_params / mb
    k = {"sgd": 1 if args.momentum else 0, "adam": 2, "adamw": 2}[args.optimizer]
    T = args.seq_len
    print(f"big_model: --model {args.model} ({n_params / 1e6:.0f}M parameters, {model_mb:.0f} MB "
          f"in float32), {args.optimizer} (k={k} states), global batch {args.global_batch} x {T}, "
          f"--init {args.init}, {args.steps} steps")
    failed = False
    with tempfile.TemporaryDirectory(prefix="fsdp-big-model-") as d:
        base = max(run(argparse.Namespace(**{**vars(args), "model": "tiny", "steps": 1}), 1, [],
                       d)["peak"])
        ref = None if args.no_reference else run(args, 1, [], d)
        for w in [int(x) for x in args.world_sizes.split(",")]:
            r = run(args, w, [], d)
            rows = args.global_batch // w
            acts = 4 * rows * T * (16 * dim + heads * T) * layers / mb
            bound = base + (2 + k) * model_mb / w + 3 * 4 * block / mb + acts
            print(f"W={w} ({r['secs']:.0f} s): peak rss MB by rank, start-up "
                  f"{' '.join(f'{x:.0f}' for x in r['startup'])}; the steps "
                  f"{' '.join(f'{x:.0f}' for x in r['train'])}; over the run "
                  f"{' '.join(f'{x:.0f}' for x in r['peak'])}")
            if r["train"]:
                print(f"  the steps against the analytic bound: max {max(r['train']) / bound:.3f}")
            print(f"  against the model's {model_mb:.0f} MB: max "
                  f"{max(r['peak']) / model_mb:.3f}; against the analytic bound {bound:.0f} MB "
                  f"(base {base:.0f} + state {(2 + k) * model_mb / w:.0f} + 3 units "
                  f"{3 * 4 * block / mb:.0f} + activations {acts:.0f}): max "
                  f"{max(r['peak']) / bound:.3f}")
            if max(r["peak"]) > model_mb:
                print("  FAIL: a rank's peak exceeds the model's bytes")
                failed = True
            if ref:
                diffs = [abs(a - b) / abs(b) for a, b in zip(r["loss"], ref["loss"])]
                print(f"  losses {' '.join(f'{x:.6f}' for x in r['loss'])}; W=1 "
                      f"{' '.join(f'{x:.6f}' for x in ref['loss'])}; max relative difference "
                      f"{max(diffs):.2e} (bound {LOSS_RTOL:g})")
                if max(diffs) > LOSS_RTOL or len(r["loss"]) != len(ref["loss"]):
                    print("  FAIL: the losses differ from W=1's")
                    failed = True
        if ref:
            print(f"W=1 ({ref['secs']:.0f} s): peak rss MB {ref['peak'][0]:.0f} (the whole model, "
                  f"its gradients and optimizer state in one process)")
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
