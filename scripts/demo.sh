#!/usr/bin/env bash
# The main job (until the example trainer exists): a 2-rank demo that shards a model, unshards it,
# trains it one step, and checks the result against a single process. Ranks are launched the way
# torchrun would: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
#   NPROC  number of ranks (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
"$(dirname "$0")/setup.sh"
BIN="${BUILD_DIR:-build}/examples/shard_demo"
NPROC=${NPROC:-2}
# A free port for rank 0's TCPStore.
PORT=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null || echo 29511)
pids=()
for ((r = 0; r < NPROC; r++)); do
  RANK=$r WORLD_SIZE=$NPROC LOCAL_RANK=$r LOCAL_WORLD_SIZE=$NPROC MASTER_ADDR=127.0.0.1 \
    MASTER_PORT=$PORT "$BIN" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit $status
