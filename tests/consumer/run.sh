#!/usr/bin/env bash
# Installs the fsdp-cpp built in BUILD_DIR into a scratch prefix, builds tests/consumer against it
# with find_package(fsdp), and runs it on 2 ranks with the installed fsdp-run.
#   run.sh BUILD_DIR WORK_DIR [CXX_COMPILER [FLAGS]]
# CXX_COMPILER and FLAGS: the package's own compiler and its -fsanitize= flags, which a program
# linking an instrumented build's library needs.
set -euo pipefail
build=$1
work=$2
compiler=${3:-}
flags=${4:-}
src=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work"
mkdir -p "$work"
step() {  # step LOG COMMAND...: runs it quietly, shows its log if it fails
  local log=$1
  shift
  "$@" > "$log" 2>&1 || { cat "$log"; echo "consumer: failed: $*"; exit 1; }
}
step "$work/install.log" cmake --install "$build" --prefix "$work/prefix"
step "$work/configure.log" cmake -S "$src" -B "$work/build" -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_BUILD_TYPE=Release ${compiler:+-DCMAKE_CXX_COMPILER="$compiler"} \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="$flags"
step "$work/build.log" cmake --build "$work/build" -j 2
cd "$work"
"$work/prefix/bin/fsdp-run" --nproc-per-node 2 "$work/build/consumer" "$work/ckpt" | tee run.log
for r in 0 1; do
  grep -q "^\[r$r\] consumer: rank $r of 2 ok" run.log || { echo "consumer: rank $r did not finish"; exit 1; }
done
