#!/usr/bin/env bash
# The benchmark suite: every headline figure a ratio against a baseline measured in the same run
# (the raw c10d collective, raw disk I/O, one process, LibTorch's and Python's serializers, Python
# FSDP and DDP, the analytic minimum of bytes across hosts). See docs/performance.md for what each
# part measures and the targets.
#
#   scripts/bench.sh [--quick] [--out DIR] [--no-torch2]
#
#   --quick      smaller sizes and fewer rounds: under 10 minutes on 2 cores
#   --out DIR    results folder (default: bench-results/<UTC time>)
#   --no-torch2  skip the LibTorch 2.6 part (the trixie chroot of scripts/torch2-env.sh), which
#                holds the comparison with Python FSDP and DDP
#
# Writes into the results folder:
#   records.json        the headline records {name, value, unit, baseline_name, baseline_value,
#                       ratio, target, meets_target}; ratio = value / baseline_value
#   summary.md          the table printed at the end
#   measurements.jsonl  every measurement with all its samples (what the records are made from)
#   machine.json        where and with what it ran
#   *.png               plots (python3-matplotlib)
#   logs/               each program's output
# Exit status 0 when every part ran, whether or not every target was met (the table says); 1 if a
# part failed (the others still run and are reported).
set -euo pipefail
cd "$(dirname "$0")/.."

QUICK=0 OUT="" TORCH2=1
while (($#)); do
  case "$1" in
    --quick) QUICK=1; shift ;;
    --out) OUT="$2"; shift 2 ;;
    --out=*) OUT="${1#*=}"; shift ;;
    --no-torch2) TORCH2=0; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "bench.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-bench-results/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT/logs"
OUT=$(cd "$OUT" && pwd)
case "$OUT" in "$PWD"/*) REL_OUT=${OUT#"$PWD"/} ;; *) REL_OUT="" ;; esac
MEAS="$OUT/measurements.jsonl"
: >"$MEAS"
start=$(date +%s)

# Python and matplotlib for the report (host), then the host build with its bench programs.
if ! /usr/bin/python3 -c 'import matplotlib' 2>/dev/null; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq || true
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends python3-matplotlib ||
    echo "bench.sh: python3-matplotlib could not be installed; the report will have no plots" >&2
fi
./scripts/setup.sh
B=build/bench

# A part that fails (a crash, memory) is reported and the suite goes on: the report covers what
# ran, the failures are listed at the end and make the exit status 1.
FAILED=()
# run LOG ENV... PROGRAM ARGS...: one program on the host, its output shown and kept.
run() {
  local log="$OUT/logs/$1"; shift
  echo "== $*" | tee -a "$log"
  env FSDP_BENCH_OUT="$MEAS" FSDP_BENCH_TAG=host "$@" 2>&1 | tee -a "$log" ||
    FAILED+=("$* (logs/$(basename "$log"))")
}
# in_torch2 LOG CMD...: one command in the LibTorch 2.6 chroot.
in_torch2() {
  local log="$OUT/logs/$1"; shift
  scripts/torch2-env.sh -- "$@" 2>&1 | tee -a "$log" || FAILED+=("LibTorch 2.6: $* (logs/$(basename "$log"))")
}

if ((QUICK)); then
  COLL_WORLDS="2 4" COLL_SIZES="1,16,64" COLL_ROUNDS=3
  CKPT_WORLDS="2" CKPT_ROUNDS=3
  TRAIN_ROUNDS=3 TRAIN_ITERS=5
  SCALE_SIZES="1000000,8000000,32000000" SCALE_FIXED=8000000 SCALE_WORLDS="1 4" SCALE_ROUNDS=2
  PEER_ROUNDS=2 FRESH_ROUNDS=3
else
  COLL_WORLDS="2 3 4" COLL_SIZES="1,4,16,64,256" COLL_ROUNDS=5
  CKPT_WORLDS="2 4" CKPT_ROUNDS=5
  TRAIN_ROUNDS=5 TRAIN_ITERS=10
  SCALE_SIZES="1000000,8000000,50000000,200000000" SCALE_FIXED=50000000 SCALE_WORLDS="1 3 4"
  SCALE_ROUNDS=5
  PEER_ROUNDS=3 FRESH_ROUNDS=5
fi

# The small models' cases (bench_training's FSDP_BENCH_CASES) and bucket sizes swept.
SMALL_CASES="single_process,compute_only,FULL_SHARD,SHARD_GRAD_OP,NO_SHARD,NO_SHARD per_unit"
BUCKETS=$( ((QUICK)) && echo "1,25" || echo "1,5,25,100")

echo "== fsdp-cpp benchmark suite ($( ((QUICK)) && echo quick || echo full)) -> $OUT"

# 0. The machine's cost of writing fresh memory, right after freeing some and after a pause
# (what every figure that allocates its result pays; docs/performance.md, "Fresh memory").
run machine.log FSDP_BENCH_ROUNDS=$FRESH_ROUNDS $B/bench_fresh_memory
# 1. Collectives (LibTorch of the host).
for w in $COLL_WORLDS; do
  run collectives.log FSDP_BENCH_WORLD=$w FSDP_BENCH_SIZES_MB=$COLL_SIZES \
    FSDP_BENCH_ROUNDS=$COLL_ROUNDS $B/bench_collectives
done
# The same at W=2 with glibc keeping freed memory for reuse instead of returning it to the kernel
# (large blocks are otherwise mmapped and page-faulted anew on every unshard); see
# docs/performance.md.
run collectives.log FSDP_BENCH_TAG=host-heap MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 \
  FSDP_BENCH_WORLD=2 FSDP_BENCH_SIZES_MB=$COLL_SIZES FSDP_BENCH_ROUNDS=$COLL_ROUNDS $B/bench_collectives
# 2. Training against one process (the peers follow in the LibTorch 2.6 part).
run training.log FSDP_BENCH_WORLD=2 FSDP_BENCH_ROUNDS=$TRAIN_ROUNDS FSDP_BENCH_ITERS=$TRAIN_ITERS \
  $B/bench_training
# 2b. NO_SHARD's gradient buckets where per-unit collectives cost: many small units and many
# small parameters under one unit. Where the host's Python has torch (Debian's python3-torch,
# 1.13: DDP only, its FSDP lacks the wrap policy used), DDP with the same bucket sizes runs in
# alternating rounds on the same LibTorch; the 2.6 part below has every peer.
host_ddp=0
/usr/bin/python3 -c 'import torch.distributed' 2>/dev/null && host_ddp=1
for ((r = 0; r < (host_ddp ? TRAIN_ROUNDS : 1); r++)); do
  for model in transformer blocks params; do
    cases=$([ $model = transformer ] && echo "NO_SHARD,NO_SHARD per_unit" || echo "$SMALL_CASES")
    sweep=$([ $model = transformer ] || echo "$BUCKETS")
    run training.log FSDP_BENCH_MODEL=$model FSDP_BENCH_CASES="$cases" FSDP_BENCH_BUCKETS_MB=$sweep \
      FSDP_BENCH_WORLD=2 FSDP_BENCH_ROUNDS=$((host_ddp ? 1 : TRAIN_ROUNDS)) \
      FSDP_BENCH_ITERS=$TRAIN_ITERS $B/bench_training
    ((host_ddp)) || continue
    run training.log build/fsdp-run --nproc-per-node 2 -- /usr/bin/python3 bench/py_training.py \
      --iters "$TRAIN_ITERS" --cases DDP --model $model --ddp-buckets-mb "$sweep" --out "$MEAS"
  done
done
# 3 and 5. Memory and scaling: sizes at W=2 (NO_SHARD too), then W=1..4 at one size.
run scaling.log FSDP_BENCH_WORLD=2 FSDP_BENCH_PARAMS=$SCALE_SIZES FSDP_BENCH_NO_SHARD=1 \
  FSDP_BENCH_ROUNDS=$SCALE_ROUNDS $B/bench_scaling
for w in $SCALE_WORLDS; do
  run scaling.log FSDP_BENCH_WORLD=$w FSDP_BENCH_PARAMS=$SCALE_FIXED FSDP_BENCH_NO_SHARD=1 \
    FSDP_BENCH_ROUNDS=$SCALE_ROUNDS $B/bench_scaling
done
# 4. Checkpoints.
for w in $CKPT_WORLDS; do
  run checkpoint.log FSDP_BENCH_WORLD=$w FSDP_BENCH_ROUNDS=$CKPT_ROUNDS $B/bench_checkpoint
done
# 4b. Activation checkpointing: activations kept and step time, with and without, W=1-4 (its
# table is in activation.log; docs/performance.md).
for w in 1 2 3 4; do
  run activation.log FSDP_BENCH_WORLD=$w FSDP_BENCH_ROUNDS=$CKPT_ROUNDS \
    $B/bench_activation_checkpointing
done

# 6. Bytes across the host boundary per step, each strategy on 2 emulated hosts x 2 ranks, against
# the analytic minimum (scripts/host_traffic.py; network namespaces need root and iproute2).
traffic_rc=0
/usr/bin/python3 scripts/host_traffic.py --fsdp-run build/fsdp-run \
  --fsdp-train build/examples/fsdp-train --out "$MEAS" 2>&1 | tee -a "$OUT/logs/host_traffic.log" ||
  traffic_rc=${PIPESTATUS[0]}
case $traffic_rc in
  0) ;;
  77) echo "bench.sh: host traffic skipped (no network namespaces here)" >&2 ;;
  *) FAILED+=("scripts/host_traffic.py (logs/host_traffic.log)") ;;
esac

# LibTorch 2.6 (trixie chroot): the same training step against Python FSDP and DDP, the same
# kernels on both sides, rounds alternating between the two; and the collectives with Gloo's
# native flat all-gather and reduce-scatter.
torch2_note=""
if ((TORCH2)) && [ -n "$REL_OUT" ] && scripts/torch2-env.sh -- true; then
  if scripts/torch2-env.sh -- env BUILD_DIR=build-trixie ./scripts/setup.sh >"$OUT/logs/torch2-build.log" 2>&1; then
    M2="/src/$REL_OUT/measurements.jsonl"
    for ((r = 0; r < PEER_ROUNDS; r++)); do
      echo "== LibTorch 2.6 training, round $((r + 1)) of $PEER_ROUNDS" | tee -a "$OUT/logs/peers.log"
      in_torch2 peers.log env FSDP_BENCH_OUT="$M2" FSDP_BENCH_TAG=torch2 FSDP_BENCH_WORLD=2 \
        FSDP_BENCH_ROUNDS=1 FSDP_BENCH_ITERS=$TRAIN_ITERS build-trixie/bench/bench_training
      in_torch2 peers.log env FSDP_BENCH_TAG=torch2 build-trixie/fsdp-run --nproc-per-node 2 -- \
        python3 bench/py_training.py --iters "$TRAIN_ITERS" --out "$M2"
      for model in blocks params; do
        in_torch2 peers.log env FSDP_BENCH_OUT="$M2" FSDP_BENCH_TAG=torch2 FSDP_BENCH_WORLD=2 \
          FSDP_BENCH_MODEL=$model FSDP_BENCH_CASES="$SMALL_CASES" FSDP_BENCH_BUCKETS_MB=$BUCKETS \
          FSDP_BENCH_ROUNDS=1 FSDP_BENCH_ITERS=$TRAIN_ITERS build-trixie/bench/bench_training
        in_torch2 peers.log env FSDP_BENCH_TAG=torch2 build-trixie/fsdp-run --nproc-per-node 2 -- \
          python3 bench/py_training.py --iters "$TRAIN_ITERS" --out "$M2" --model $model \
          --ddp-buckets-mb "$BUCKETS"
      done
    done
    # The checkpoint part again, for its peers on 2.6: LibTorch 2.6's torch::save and the
    # chroot's Python torch.save / torch.load (the host's python3 has no torch).
    for w in $CKPT_WORLDS; do
      in_torch2 checkpoint-2.6.log env FSDP_BENCH_OUT="$M2" FSDP_BENCH_TAG=torch2 FSDP_BENCH_WORLD=$w \
        FSDP_BENCH_ROUNDS=$CKPT_ROUNDS build-trixie/bench/bench_checkpoint
    done
    for w in $COLL_WORLDS; do
      in_torch2 collectives-2.6.log env FSDP_BENCH_OUT="$M2" FSDP_BENCH_TAG=torch2 FSDP_BENCH_WORLD=$w \
        FSDP_BENCH_SIZES_MB=$COLL_SIZES FSDP_BENCH_ROUNDS=$COLL_ROUNDS build-trixie/bench/bench_collectives
    done
  else
    torch2_note="LibTorch 2.6 build failed (logs/torch2-build.log)"
  fi
else
  torch2_note="LibTorch 2.6 part skipped (--no-torch2, no chroot, or results outside the tree)"
fi
[ -z "$torch2_note" ] || echo "bench.sh: $torch2_note" >&2

# Where it ran.
/usr/bin/python3 - "$OUT/machine.json" "$QUICK" "$(( $(date +%s) - start ))" "$torch2_note" <<'EOF'
import glob, json, os, platform, re, subprocess, sys
path, quick, secs, note = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4]
def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()
    except Exception:
        return ""
cpu = sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2").strip()
mem = sh("awk '/MemTotal/ {printf \"%.1f GiB\", $2/1048576}' /proc/meminfo")
# How fresh memory behaves here (docs/performance.md, "Fresh memory"): the transparent huge page
# mode, and whether a virtio balloon reports freed memory to the hypervisor (feature bit 5,
# VIRTIO_BALLOON_F_REPORTING), after which touching that memory again costs a fault on the host.
thp = re.search(r"\[(\w+)\]", sh("cat /sys/kernel/mm/transparent_hugepage/enabled"))
reporting = False
for dev in glob.glob("/sys/bus/virtio/devices/*"):
    try:
        if open(dev + "/device").read().strip() == "0x0005":
            reporting |= open(dev + "/features").read()[5:6] == "1"
    except OSError:
        pass
json.dump({"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "memory": mem,
           "kernel": platform.release(), "os": sh(". /etc/os-release && echo $PRETTY_NAME"),
           "commit": sh("git rev-parse --short HEAD") + (" (dirty)" if sh("git status --porcelain") else ""),
           "command": "scripts/bench.sh" + (" --quick" if quick else ""),
           "thp": thp.group(1) if thp else "unknown", "free_page_reporting": reporting,
           "seconds": secs, "note": note}, open(path, "w"), indent=2)
EOF
/usr/bin/python3 scripts/bench_report.py "$OUT" || FAILED+=("the report (scripts/bench_report.py)")
echo "bench.sh: finished in $(( $(date +%s) - start )) s; results in $OUT"
if ((${#FAILED[@]})); then
  echo "bench.sh: these parts failed; their figures are missing from the records:" >&2
  for f in "${FAILED[@]}"; do echo "  $f" >&2; done
  exit 1
fi
