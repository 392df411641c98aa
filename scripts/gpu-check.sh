#!/usr/bin/env bash
# Builds fsdp-cpp against the LibTorch inside a GPU machine's Python torch wheel (CUDA, NCCL) and
# runs the CUDA tests over NCCL and Gloo, then chosen suites over NCCL. CI has no GPU: this is run
# by hand on a machine that has one (docs/portability.md records the results).
#
#   scripts/gpu-check.sh [deps|build|cuda|buckets|nccl-suites|nccl-timeouts|gloo-suite|bench|
#                         bench-training|train]...
#   (train: scripts/gpu-train.sh, fsdp-train and PyTorch's FSDP side by side, output in $OUT/train)
#                                                                       (default: build cuda)
#
# Such a machine may have no package registry: first run `scripts/gpu-check.sh deps` on a Debian
# machine (this one), which downloads the .deb files of our build dependencies into .gpudeps/
# (ignored by git; the device tool carries it with `carry: [".gpudeps"]`). On the GPU machine
# they are unpacked under /tmp, never into the system.
#   OUT        where logs go (default: /tmp/gpu-check)
#   BUILD_DIR  build directory (default: build-gpu)
#   JOBS       parallel compile jobs (default: the number of cores)
#   TARGETS    what `build` builds (default: everything)
#   SUITE_TIMEOUT  seconds one test program may run (default: 300)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
BUILD_DIR=${BUILD_DIR:-build-gpu}
JOBS=${JOBS:-$(nproc)}
DEPS=/tmp/fsdp-gpu-deps
mkdir -p "$OUT"
steps=("$@")
((${#steps[@]})) || steps=(build cuda)

PY=$(command -v python3)
if [ ! -d "$DEPS/usr" ] && compgen -G ".gpudeps/*.deb" >/dev/null; then
  for f in .gpudeps/*.deb; do dpkg -x "$f" "$DEPS"; done
fi
export LD_LIBRARY_PATH="$DEPS/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# NCCL between ranks sharing one GPU goes over sockets on loopback (see tests/helpers/multi_rank.cpp).
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo} NCCL_IB_DISABLE=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN}

do_build() {
  local torch_prefix nccl_inc flags=""
  torch_prefix=$($PY -c 'import torch; print(torch.utils.cmake_prefix_path)')
  nccl_inc=$($PY -c 'import nvidia.nccl as n, os; print(os.path.join(list(n.__path__)[0], "include"))' 2>/dev/null)
  [ -n "$nccl_inc" ] && flags="-isystem $nccl_inc"
  # The wheel may lack gloo's headers: then Debian 12's are used (this built and passed the Gloo
  # tests against LibTorch 2.11; not an ABI guarantee).
  if [ ! -f "$($PY -c 'import torch, os; print(os.path.dirname(torch.__file__))')/include/gloo/algorithm.h" ]; then
    flags="$flags -isystem $DEPS/usr/include"
  fi
  {
    $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    g++ --version | head -1
    cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCMAKE_PREFIX_PATH="$torch_prefix;$DEPS/usr" -DCMAKE_CXX_FLAGS="$flags" \
      -DCMAKE_INCLUDE_PATH="$DEPS/usr/include" -DCMAKE_LIBRARY_PATH="$DEPS/usr/lib/x86_64-linux-gnu" &&
      cmake --build "$BUILD_DIR" -j "$JOBS" ${TARGETS:+--target $TARGETS}
  } 2>&1 | tee "$OUT/build.log" | grep -E "torch |NVIDIA|H100|H200|g\+\+|fsdp:|error|Error|FAILED" | head -60
  return "${PIPESTATUS[0]}"
}

# Runs one test binary with a time limit, logging to $OUT/<name>.log; prints its summary.
run_suite() {
  local name=$1 log=$2
  shift 2
  timeout "${SUITE_TIMEOUT:-300}" "$BUILD_DIR/tests/$name" "$@" >"$OUT/$log.log" 2>&1
  local rc=$?
  echo "== $log: exit $rc: $(grep -E '^\[  PASSED  \]|^\[  FAILED  \] [0-9]+ test|^\[  SKIPPED \] [0-9]+' "$OUT/$log.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \] [A-Za-z]' "$OUT/$log.log" | sort -u | head -20
  return $rc
}

TIMEOUT_TESTS="*TimesOut*:*DeadPeer*:*Dying*:*FailedUnshard*:*FailedReduction*"

for step in "${steps[@]}"; do
  case $step in
    deps)
      gd=$(git rev-parse --git-common-dir) && mkdir -p .gpudeps "$gd/info"
      grep -qx '/.gpudeps/' "$gd/info/exclude" 2>/dev/null || echo '/.gpudeps/' >>"$gd/info/exclude"
      (cd .gpudeps && apt-get download libgtest-dev libgmock-dev nlohmann-json3-dev libxxhash-dev \
        libcli11-dev libisal-dev libisal2 libbenchmark-dev libbenchmark1debian libgloo-dev)
      ;;
    build) do_build || exit 1 ;;
    cuda)
      FSDP_TEST_CUDA=1 FSDP_TEST_BACKEND=nccl run_suite test_cuda cuda-nccl
      FSDP_TEST_CUDA=1 FSDP_TEST_BACKEND=gloo run_suite test_cuda cuda-gloo
      ;;
    nccl-suites)
      # The CPU suites with the default group over NCCL: every CPU tensor the library hands to a
      # collective (flags, sizes, names, pieces, the model itself) is staged through the GPU.
      # The tests of timeouts and dead peers are left to nccl-timeouts: NCCL handles those in
      # its own way (docs/dist.md).
      for t in test_dist test_flat_param test_fsdp_runtime test_runtime_edges \
               test_state_dict test_state_dict_edges test_optim_state_dict test_state_dict_utils \
               test_dcp_checkpoint test_checkpoint_state_dict; do
        FSDP_TEST_BACKEND=nccl run_suite "$t" "nccl-$t" --gtest_filter="-$TIMEOUT_TESTS" &
      done
      wait
      ;;
    nccl-timeouts)
      # With TORCH_NCCL_BLOCKING_WAIT=1 a timed-out NCCL collective throws from wait(), which
      # fsdp::dist turns into a DistError like Gloo's.
      TORCH_NCCL_BLOCKING_WAIT=1 FSDP_TEST_BACKEND=nccl run_suite test_dist nccl-timeouts-dist \
        --gtest_filter="$TIMEOUT_TESTS" &
      TORCH_NCCL_BLOCKING_WAIT=1 FSDP_TEST_BACKEND=nccl run_suite test_flat_param \
        nccl-timeouts-flat --gtest_filter="$TIMEOUT_TESTS" &
      TORCH_NCCL_BLOCKING_WAIT=1 FSDP_TEST_BACKEND=nccl run_suite test_fsdp_runtime \
        nccl-timeouts-runtime --gtest_filter="$TIMEOUT_TESTS" &
      wait
      ;;
    buckets)
      # NO_SHARD's gradient buckets over NCCL (CPU tensors staged through the GPU) and Gloo.
      FSDP_TEST_BACKEND=nccl run_suite test_grad_buckets buckets-nccl
      FSDP_TEST_BACKEND=gloo run_suite test_grad_buckets buckets-gloo
      ;;
    train)
      OUT="$OUT/train" BUILD_DIR="$BUILD_DIR" PY="$PY" scripts/gpu-train.sh
      ;;
    bench|bench-training)
      # bench_collectives (bench only) and bench_training on the GPU (NCCL, both ranks on one
      # GPU), and PyTorch's own FSDP and DDP on the same GPU as the peers. bench_training runs
      # the transformer, then the many-small-units and many-small-parameters models with the
      # bucket size swept on both sides (BUCKETS, default 1,5,25,100; set but empty: no sweep).
      # MODELS narrows the models, FSDP_BENCH_OPTIM picks the optimizer on both sides (adam, sgd),
      # CASES and PY_CASES the cases ("local" in Python: the unwrapped model with no
      # communication, the peer of compute_only).
      export FSDP_BENCH_DEVICE=cuda FSDP_BENCH_OUT="$OUT/gpu-measurements.jsonl" FSDP_BENCH_TAG=gpu
      rounds=${FSDP_BENCH_ROUNDS:-3} buckets=${BUCKETS-1,5,25,100}
      optim=${FSDP_BENCH_OPTIM:-adam}
      py_cases=${PY_CASES:-local,FULL_SHARD,SHARD_GRAD_OP,NO_SHARD,DDP}
      small="single_process,compute_only,FULL_SHARD,SHARD_GRAD_OP,NO_SHARD,NO_SHARD per_unit"
      if [ "$step" = bench ]; then
        FSDP_BENCH_ROUNDS=$rounds timeout 200 "$BUILD_DIR/bench/bench_collectives" \
          2>&1 | grep -v "^\[W\|^NCCL version\|Warning" | tee "$OUT/bench-collectives.log" | tail -9
      fi
      for model in ${MODELS:-transformer blocks params}; do
        cases=${CASES:-$([ $model = transformer ] || echo "$small")}
        sweep=$([ $model = transformer ] || echo "$buckets")
        FSDP_BENCH_MODEL=$model FSDP_BENCH_CASES="$cases" FSDP_BENCH_BUCKETS_MB=$sweep \
          FSDP_BENCH_ROUNDS=$rounds timeout 200 "$BUILD_DIR/bench/bench_training" 2>&1 |
          grep -v "^\[W\|^NCCL version\|Warning" | tee -a "$OUT/bench-training.log" | tail -16
        (unset FSDP_BENCH_OUT; timeout 200 $PY -m torch.distributed.run --nproc-per-node 2 \
          bench/py_training.py --device cuda --rounds "$rounds" --model $model \
          --optim "$optim" --cases "$py_cases" --ddp-buckets-mb "$sweep" \
          --out "$OUT/gpu-measurements.jsonl") 2>&1 |
          grep "^python" | tee -a "$OUT/bench-python.log"
      done
      ;;
    gloo-suite)
      (cd "$BUILD_DIR" && timeout 540 ctest -j "$JOBS" --timeout 300 >"$OUT/ctest-gloo.log" 2>&1)
      tail -15 "$OUT/ctest-gloo.log"
      ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  # The logs so far in one file (the device tool returns few files).
  tar -czf /tmp/gpu-check-logs.tgz -C "$OUT" --exclude logs.tgz . 2>/dev/null &&
    mv /tmp/gpu-check-logs.tgz "$OUT/logs.tgz"
done
