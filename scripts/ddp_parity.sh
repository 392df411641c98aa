#!/usr/bin/env bash
# NO_SHARD against PyTorch's DistributedDataParallel, the way issue 42's acceptance asks for it:
# the same model, batch and optimizer on the same LibTorch, in rounds interleaved in one run, and
# the median of each round's ratio (our step / DDP's step). On this shared machine the same binary
# moves by up to 8% between rounds, so a ratio of two medians taken minutes apart says little; a
# ratio inside one round, where both sides saw the same machine, says more, and its median over
# many rounds more still. The order inside a round alternates (ours first, then DDP first), so a
# drift across the run weighs on both sides alike. DDP runs in three configurations side by side,
# each paired with the same round of ours: its defaults ("DDP"), gradient_as_bucket_view=True
# ("DDP view": gradients live in the buckets, as ours do) and that with static_graph=True
# ("DDP view static").
#
#   scripts/ddp_parity.sh [--rounds N] [--iters N] [--models LIST] [--torch host|2|both] [--out DIR]
#
#   --rounds N     rounds per model and LibTorch (default 9)
#   --iters N      timed steps per case and round (default 20)
#   --models LIST  comma-separated bench_training models (default transformer,blocks,params)
#   --torch WHICH  host: LibTorch 1.13 against Debian's python3-torch; 2: LibTorch 2.6 in the
#                  trixie chroot (scripts/torch2-env.sh) against its PyTorch; both (default)
#   --out DIR      results folder (default: bench-results/ddp-parity-<UTC time>)
#
# Needs the host build (build/) and, for --torch 2, build-trixie/ (scripts/setup.sh makes both).
# Writes DIR/measurements.jsonl (every sample, tagged parity-<torch>-r<round>), DIR/run.log (the
# programs' output) and DIR/summary.md, and prints the table. Exit status 0 when every run ran, whether or not the ratio is under 1.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=9 ITERS=20 MODELS=transformer,blocks,params WHICH=both OUT=""
DDP_CASES="DDP,DDP view,DDP view static"
while (($#)); do
  case "$1" in
    --rounds) ROUNDS="$2"; shift 2 ;;
    --iters) ITERS="$2"; shift 2 ;;
    --models) MODELS="$2"; shift 2 ;;
    --torch) WHICH="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "ddp_parity.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$WHICH" in host) TORCHES="host" ;; 2) TORCHES="2" ;; both) TORCHES="host 2" ;;
  *) echo "ddp_parity.sh: --torch takes host, 2 or both, not '$WHICH'" >&2; exit 2 ;;
esac
OUT=${OUT:-bench-results/ddp-parity-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
# The chroot sees the source tree as /src, so its results must be written inside the tree.
case "$OUT" in "$PWD"/*) REL_OUT=${OUT#"$PWD"/} ;; *) REL_OUT="" ;; esac
MEAS="$OUT/measurements.jsonl"
: >"$MEAS"

for t in $TORCHES; do
  if [ "$t" = host ]; then
    [ -x build/bench/bench_training ] || { echo "ddp_parity.sh: no build/bench/bench_training (run scripts/setup.sh)" >&2; exit 1; }
    /usr/bin/python3 -c 'import torch.distributed' 2>/dev/null ||
      { echo "ddp_parity.sh: the host's python3 has no torch (apt-get install python3-torch)" >&2; exit 1; }
  else
    [ -n "$REL_OUT" ] || { echo "ddp_parity.sh: --out must lie inside the source tree for --torch 2" >&2; exit 1; }
    [ -x build-trixie/bench/bench_training ] ||
      { echo "ddp_parity.sh: no build-trixie/bench/bench_training (scripts/torch2-env.sh -- env BUILD_DIR=build-trixie scripts/setup.sh)" >&2; exit 1; }
  fi
done

# ours T TAG MODEL / ddp T TAG MODEL: one round of one side on LibTorch T.
ours() {
  local env=(FSDP_BENCH_TAG="$2" FSDP_BENCH_MODEL="$3" FSDP_BENCH_CASES=NO_SHARD FSDP_BENCH_WORLD=2
    FSDP_BENCH_ROUNDS=1 FSDP_BENCH_ITERS="$ITERS")
  if [ "$1" = host ]; then
    env "${env[@]}" FSDP_BENCH_OUT="$MEAS" build/bench/bench_training >>"$OUT/run.log" 2>&1
  else
    scripts/torch2-env.sh -- env "${env[@]}" FSDP_BENCH_OUT="/src/$REL_OUT/measurements.jsonl" \
      build-trixie/bench/bench_training >>"$OUT/run.log" 2>&1
  fi
}
ddp() {
  if [ "$1" = host ]; then
    FSDP_BENCH_TAG="$2" build/fsdp-run --nproc-per-node 2 -- /usr/bin/python3 bench/py_training.py \
      --model "$3" --cases "$DDP_CASES" --iters "$ITERS" --out "$MEAS" >>"$OUT/run.log" 2>&1
  else
    scripts/torch2-env.sh -- env FSDP_BENCH_TAG="$2" build-trixie/fsdp-run --nproc-per-node 2 -- \
      python3 bench/py_training.py --model "$3" --cases "$DDP_CASES" --iters "$ITERS" \
      --out "/src/$REL_OUT/measurements.jsonl" >>"$OUT/run.log" 2>&1
  fi
}

trap 'echo "ddp_parity.sh: a run failed; its output is in $OUT/run.log" >&2' ERR
start=$(date +%s)
for ((r = 1; r <= ROUNDS; r++)); do
  for t in $TORCHES; do
    for model in ${MODELS//,/ }; do
      tag="parity-$t-r$r"
      echo "== round $r of $ROUNDS, LibTorch $t, $model"
      if ((r % 2)); then ours "$t" "$tag" "$model"; ddp "$t" "$tag" "$model"
      else ddp "$t" "$tag" "$model"; ours "$t" "$tag" "$model"; fi
    done
  done
done

/usr/bin/python3 scripts/parity_report.py "$MEAS" "$OUT/summary.md" "$(( $(date +%s) - start ))"
