#!/usr/bin/env bash
# The GPU session of issue 65 in one go: fsdp-train on the GPU at W=1 and W=2 (bf16, a ~1B GPT),
# a checkpoint resumed at the other world size, the export checked in Python, and PyTorch's own
# FSDP1 and FSDP2 on the same model, batches and GPU (bench/py_gpt_fsdp.py). Beside the FSDP run
# at W=1, what limits it: the compute-only step (the unwrapped model, no communication), the
# optimizer tensor by tensor, as foreach operations and fused, and a run in CUDA's sync debug mode
# (every host synchronisation in the step warns). Every figure lands in $OUT as JSON lines
# (fsdp-train's --metrics, py_gpt_fsdp.py's --out) beside the logs, and a summary table ends the
# run, with each rank's peak CUDA memory against the analytic bound.
#
#   scripts/gpu-train.sh          on the GPU machine, after `scripts/gpu-check.sh build` (or as
#                                 its `train` step, which sets the libraries' paths)
#   scripts/gpu-train.sh --dry    the same steps on the CPU at toy size (CI runs it in LibTorch
#                                 2.6's chroot, so that the script cannot rot between GPU visits)
#
# Time is the scarce thing on a lent GPU: each step runs under `timeout`, the whole under
# DEADLINE_S; a step that fails or would start past the deadline is reported as such
# ("gpu-train: [3/7] resume-w2: FAILED (exit 124)") and the rest still run where they can. The
# exit status is the number of failed steps.
#   BUILD_DIR   the build holding fsdp-run and examples/fsdp-train (default build-gpu; --dry: build)
#   OUT         where results go (default /tmp/gpu-train)
#   PY          Python with torch (default python3)
#   DEADLINE_S  seconds for everything (default 600)
#   PEAK_TFLOPS the GPU's dense bf16 peak for MFU (default: fsdp-train's table by the GPU's model,
#               and 989, H100/H200 SXM, for the Python side; --dry: 0.05)
#   MODEL       fsdp-train's model flags (default: --model xxl, 20 x 2048, 1.0B parameters)
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry" ] && DRY=1
OUT=${OUT:-/tmp/gpu-train}
PY=${PY:-python3}
DEADLINE_S=${DEADLINE_S:-600}
if ((DRY)); then
  BUILD_DIR=${BUILD_DIR:-build} DEVICE=cpu MP=none PEAK_TFLOPS=${PEAK_TFLOPS:-0.05} PY_PEAK=0.05
  MODEL=${MODEL:---layers 2 --dim 64 --heads 4} SEQ=32 BATCH=4 STEPS=4 WARMUP=1 HEADS=4 TOL=1e-4
else
  BUILD_DIR=${BUILD_DIR:-build-gpu} DEVICE=cuda MP=bf16 PEAK_TFLOPS=${PEAK_TFLOPS:-}
  PY_PEAK=${PEAK_TFLOPS:-989}
  MODEL=${MODEL:---model xxl} SEQ=1024 BATCH=8 STEPS=20 WARMUP=5 HEADS=16 TOL=1e-3
fi
mkdir -p "$OUT"
BUILD_DIR=$(cd "$BUILD_DIR" && pwd) || exit 1
RUN="$BUILD_DIR/fsdp-run" TRAIN="$BUILD_DIR/examples/fsdp-train"
export USE_LIBUV=${USE_LIBUV:-0}  # Debian's PyTorch has no libuv; the wheel's does not need it
start=$(date +%s) failed=0 i=0
# The acceptance's figures first (a deadline cuts the tail): the FSDP run and its compute-only
# yardstick, the resume at W=2, the export, the side by side; then what else limits the step.
STEPS_ALL=(env init train-w1 compute-only-w1 resume-w2 python-check side-by-side-w1 side-by-side-w2
  optimizer-fused-w1 optimizer-loop-w1 sync-debug-w1 summary)

# step NAME SECONDS COMMAND...: runs COMMAND in $OUT under a limit, logs to $OUT/NAME.log.
step() {
  local name=$1 limit=$2 left rc
  shift 2
  i=$((i + 1))
  left=$((DEADLINE_S - ($(date +%s) - start)))
  if ((left < 10)); then
    echo "gpu-train: [$i/${#STEPS_ALL[@]}] $name: NOT RUN (the deadline has passed)"
    failed=$((failed + 1))
    return 1
  fi
  ((limit > left)) && limit=$left
  (cd "$OUT" && timeout "$limit" "$@") >"$OUT/$name.log" 2>&1
  rc=$?
  if ((rc == 0)); then
    echo "gpu-train: [$i/${#STEPS_ALL[@]}] $name: ok ($(($(date +%s) - start)) s in)"
  else
    echo "gpu-train: [$i/${#STEPS_ALL[@]}] $name: FAILED (exit $rc$( ((rc == 124)) && echo ", out of time")); last lines:"
    tail -5 "$OUT/$name.log" | sed 's/^/    /'
    failed=$((failed + 1))
  fi
  return $rc
}

common="$MODEL --device $DEVICE --mixed-precision $MP --seq-len $SEQ --global-batch $BATCH"
common="$common --log-every 1${PEAK_TFLOPS:+ --peak-tflops $PEAK_TFLOPS}"
rm -rf "$OUT/ckpt" "$OUT"/*.jsonl

step env 60 bash -c "$PY -c 'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"gpu\", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)'; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi'; git -C '$(pwd)' rev-parse --short HEAD 2>/dev/null || echo 'commit: unknown (no git)'"
# The starting weights, for the Python side (same seed, so fsdp-train's own runs start there too).
step init 300 "$RUN" --nproc-per-node 1 "$TRAIN" $MODEL --seq-len "$SEQ" --steps 0 --export init.pt
step train-w1 300 "$RUN" --nproc-per-node 1 "$TRAIN" $common --steps "$STEPS" \
  --save-dir ckpt --metrics train-w1.jsonl
# The FSDP step's yardstick: the same training without FSDP or communication.
step compute-only-w1 300 "$RUN" --nproc-per-node 1 "$TRAIN" $common --steps "$STEPS" \
  --compute-only --metrics compute-only-w1.jsonl
step resume-w2 300 "$RUN" --nproc-per-node 2 "$TRAIN" $common --steps $((STEPS + 2)) \
  --save-dir ckpt --resume --metrics resume-w2.jsonl --export model.pt --eval-logits logits.pt
step python-check 120 "$PY" "$(pwd)/scripts/gpt_reference.py" --heads "$HEADS" --logits logits.pt \
  --tolerance "$TOL" model.pt
for w in 1 2; do
  step side-by-side-w$w 300 "$RUN" --nproc-per-node $w -- "$PY" "$(pwd)/bench/py_gpt_fsdp.py" \
    --init init.pt $MODEL --device "$DEVICE" --mixed-precision "$MP" --seq-len "$SEQ" \
    --global-batch "$BATCH" --steps "$STEPS" --warmup "$WARMUP" --peak-tflops "$PY_PEAK" \
    --out "python-w$w.jsonl"
done
# What else limits the FSDP step, each against train-w1: ATen's fused AdamW; LibTorch's AdamW
# tensor by tensor; and the host synchronisations in the step, one warning each.
step optimizer-fused-w1 300 "$RUN" --nproc-per-node 1 "$TRAIN" $common --steps $((STEPS / 2)) \
  --fused 1 --metrics optimizer-fused-w1.jsonl
step optimizer-loop-w1 300 "$RUN" --nproc-per-node 1 "$TRAIN" $common --steps $((STEPS / 2)) \
  --foreach 0 --metrics optimizer-loop-w1.jsonl
step sync-debug-w1 300 "$RUN" --nproc-per-node 1 "$TRAIN" $common --steps 3 --sync-debug warn
step summary 60 "$PY" - <<'EOF'
import json, os, re
def lines(p):
    return [json.loads(x) for x in open(p)] if os.path.exists(p) else []
def log(p):
    return open(p).read() if os.path.exists(p) else ""
def mean_tps(ls):
    return sum(x["tokens_per_s"] for x in ls) / len(ls) if ls else 0
# Ours: the mean over the lines after the first (start-up's compilation and allocation).
runs = [("FSDP", "train-w1"), ("compute only", "compute-only-w1"),
        ("FSDP, AdamW for-loop", "optimizer-loop-w1"), ("FSDP, AdamW fused", "optimizer-fused-w1"),
        ("FSDP (resumed)", "resume-w2")]
base = mean_tps(lines("compute-only-w1.jsonl")[1:])
print("run | tokens/s | TFLOP/s per rank | MFU | / compute only | peak CUDA MB per rank | rss MB")
for label, name in runs:
    ls = lines(name + ".jsonl")[1:]
    if not ls:
        print(f"fsdp-train {label} | no figures ({name}.log)")
        continue
    tps, last = mean_tps(ls), ls[-1]
    w, mfu = last["world_size"], last["mfu"]
    tflops = tps * last["flops_per_token"] / w / 1e12
    mfu_s = "%.1f%%" % (100 * tps * mfu / last["tokens_per_s"]) if mfu else "-"
    ratio = "%.3f" % (tps / base) if base and w == 1 else "-"
    print(f"fsdp-train {label} W={w} | {tps:.0f} | {tflops:.4g} | {mfu_s} | {ratio} | "
          f"{last.get('peak_cuda_mb_per_rank')} | {last['rss_mb_per_rank']}")
for w in (1, 2):
    for x in lines(f"python-w{w}.jsonl"):
        if "skipped" in x:
            print(f"{x['impl']} W={w} | skipped: {x['skipped']}")
            continue
        mem = x.get("peak_cuda_mb_per_rank", x.get("peak_rss_mb_per_rank"))
        print(f"{x['impl']} W={w} | {x['tokens_per_s']:.0f} | {x['tflops_per_rank']:.4g} | "
              f"{'%.1f%%' % (100 * x['mfu']) if x['mfu'] else '-'} | - | {mem} | -")
syncs = len(re.findall(r"synchroniz", log("sync-debug-w1.log"), re.I))
where = "" if "device: cuda" in log("sync-debug-w1.log") else " (the CPU: the mode does nothing)"
print(f"host synchronisations in 3 steps under --sync-debug warn: {syncs} warning lines{where}")
# The analytic bound of the FSDP step's peak CUDA memory per rank (FULL_SHARD, bf16 compute,
# float32 reduction, AdamW), in bytes: 16 N / W of state (the float32 shard and AdamW's two
# moments, and the float32 gradient shard, which zero_grad frees before forward on 2.x and backward
# builds again) + the bf16 gathered root and two blocks (the one computing and the one prefetched)
# + one block's bf16 gradient and its float32 copy for the reduction + what forward and backward
# add, over W: the compute-only run measures that (fwd_bwd_cuda_mb_per_rank, all W ranks' rows at
# W=1). It includes the whole model's bf16 gradients as backward makes them, which FSDP holds a
# block at a time, so the bound is high by at most 2 N / W.
text = log("train-w1.log")
n = re.search(r"the model has (\d+) parameters", text)
u = re.search(r"model: (\d+) FSDP units of (\d+) parameter elements in all \(padded\), (\d+) "
              r"bytes per gather of every unit, the root's (\d+)", text)
plain = lines("compute-only-w1.jsonl")
if n and u and plain and plain[-1].get("fwd_bwd_cuda_mb_per_rank"):
    N, units, elems, root = int(n[1]), int(u[1]), int(u[2]), int(u[4]) // 4
    block = (elems - root) / max(units - 1, 1)
    activations = plain[-1]["fwd_bwd_cuda_mb_per_rank"][0] * 2**20
    for name in ("train-w1", "resume-w2"):
        ls = lines(name + ".jsonl")
        if not ls or not ls[-1].get("peak_cuda_mb_per_rank"):
            continue
        w = ls[-1]["world_size"]
        bound = 16 * N / w + 2 * (root + 2 * block) + 6 * block + activations / w
        for r, mb in enumerate(ls[-1]["peak_cuda_mb_per_rank"]):
            print(f"{name} rank {r}: peak CUDA {mb} MB, bound {bound / 2**20:.0f} MB "
                  f"(forward and backward {activations / w / 2**20:.0f} MB): {mb * 2**20 / bound:.3f} of it")
else:
    print("no CUDA memory figures (the CPU, or a run missing): no bound to compare")
EOF
cat "$OUT/summary.log"
echo "gpu-train: $failed of ${#STEPS_ALL[@]} steps failed; results in $OUT"
exit "$failed"
