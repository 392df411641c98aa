#!/usr/bin/env bash
# The main job: what a newcomer runs first. On a fresh Debian 12 machine it installs what it
# needs, builds, and then, with the launcher (fsdp-run) and the example trainer (fsdp-train):
#   1. trains a small byte-level GPT on 2 ranks (FULL_SHARD) for about a minute, saving a
#      checkpoint every 100 steps, and stops;
#   2. resumes that checkpoint on 3 ranks (SHARD_GRAD_OP, use_orig_params) and finishes;
#   3. exports the weights as safetensors and as a .pt, verifies the last checkpoint, checks that
#      Python's own model computes the same logits from the export, and plots the loss curve;
# then prints where everything is and the Python lines that load the weights. Exits non-zero if
# any stage fails.
#   OUT        where to put checkpoints, exports and metrics (default /tmp/fsdp-demo; emptied)
#   STEPS1     steps of stage 1 (default 600), STEPS2 last step of stage 2 (default 800)
set -euo pipefail
cd "$(dirname "$0")/.."
# Only what the demo runs is built (the tests and benchmarks are scripts/test.sh's business), in a
# unity build (CMakeLists.txt) and without debug information unless the build directory exists
# already: a fresh build is most of what a newcomer waits for. The Python checks' packages,
# Debian's python3-torch (the logits check; the host's LibTorch already brings most of it) and
# python3-matplotlib (the loss curve), are installed while the library compiles: the build's own
# packages first, then the Python ones in the background (dpkg takes one apt-get at a time), the
# build needing none of them.
./scripts/setup.sh --packages-only
py_log=$(mktemp /tmp/fsdp-demo-packages.XXXXXX)
FSDP_EXTRA_PACKAGES="python3-torch python3-matplotlib ${FSDP_EXTRA_PACKAGES:-}" \
  ./scripts/setup.sh --packages-only > "$py_log" 2>&1 &
py_packages=$!
FSDP_BUILD_TARGETS="fsdp-run fsdp-ckpt fsdp-train" \
  FSDP_RELWITHDEBINFO_FLAGS="${FSDP_RELWITHDEBINFO_FLAGS:--O2 -g0 -DNDEBUG}" ./scripts/setup.sh
if ! wait "$py_packages"; then
  cat "$py_log" >&2
  echo "demo: installing the Python checks' packages failed (above)" >&2
  exit 1
fi
rm -f "$py_log"
BUILD=$(cd "${BUILD_DIR:-build}" && pwd)
RUN="$BUILD/fsdp-run"
TRAIN="$BUILD/examples/fsdp-train"
CKPT="$BUILD/fsdp-ckpt"
OUT=${OUT:-/tmp/fsdp-demo}
STEPS1=${STEPS1:-600}
STEPS2=${STEPS2:-800}
PY=/usr/bin/python3
rm -rf "$OUT"
mkdir -p "$OUT"

echo "== 1. train on 2 ranks (FULL_SHARD) to step $STEPS1, checkpoint every 100 steps"
"$RUN" --nproc-per-node 2 "$TRAIN" --steps "$STEPS1" --save-dir "$OUT/ckpt" --save-every 100 \
  --log-every 50 --metrics "$OUT/metrics.jsonl"

echo "== 2. resume on 3 ranks (SHARD_GRAD_OP, use_orig_params) and finish at step $STEPS2"
"$RUN" --nproc-per-node 3 "$TRAIN" --steps "$STEPS2" --save-dir "$OUT/ckpt" --save-every 100 \
  --resume --sharding shard_grad_op --use-orig-params 1 --log-every 50 \
  --metrics "$OUT/metrics.jsonl" --export "$OUT/model.safetensors" \
  --eval-logits "$OUT/logits.pt"

echo "== 3. export a .pt too (a resume past the last step only loads and exports), verify, check"
"$RUN" --nproc-per-node 1 "$TRAIN" --steps "$STEPS2" --save-dir "$OUT/ckpt" --resume \
  --export "$OUT/model.pt"
"$CKPT" verify "$OUT/ckpt/step_$STEPS2"
# Python's own model (PyTorch, not fsdp-cpp) computes the logits from each export: the check the
# README promises. It fails the demo if it cannot run.
"$PY" scripts/gpt_reference.py --heads 4 --logits "$OUT/logits.pt" "$OUT/model.pt" \
  "$OUT/model.safetensors"
"$PY" scripts/plot_metrics.py "$OUT/metrics.jsonl" -o "$OUT/loss.png"

cat <<EOF

== done
checkpoints:  $OUT/ckpt/step_* (DCP layout; 'latest' names the newest)
weights:      $OUT/model.safetensors and $OUT/model.pt
metrics:      $OUT/metrics.jsonl$( [ -f "$OUT/loss.png" ] && echo " (loss curve: $OUT/loss.png)")

Load the weights in Python:
  import torch, sys; sys.path.insert(0, "$PWD/scripts")
  from gpt_reference import GPT
  sd = torch.load("$OUT/model.pt", weights_only=True)
  # or: from safetensors.torch import load_file; sd = load_file("$OUT/model.safetensors")
  model = GPT(vocab=256, seq_len=64, layers=2, dim=64, heads=4)
  model.load_state_dict(sd)
EOF
