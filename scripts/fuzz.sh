#!/usr/bin/env bash
# Coverage-guided fuzzing of fsdp-cpp's readers (issue 39; tests/fuzz/targets.h lists them).
#
#   scripts/fuzz.sh [--seconds N] [--runs N] [--keep DIR] [--configure-only] [TARGET...]
#   scripts/fuzz.sh --coverage [TARGET...]
#
# Builds build-asan/ with clang 16, libFuzzer, AddressSanitizer and UndefinedBehaviorSanitizer
# (installing Debian's clang-16 and libfuzzer-16-dev if missing; LibTorch stays uninstrumented;
# scripts/sanitize.sh runs the test suite from the same build directory),
# then runs each TARGET (default: all) for N seconds (default 60) or N executions, starting from
# tests/fuzz/corpus/<target>/ and the target's dictionary. The limits that make an input a finding:
# over 1 s (-timeout), a single allocation over 1 GiB (-malloc_limit_mb) or 2 GiB resident
# (-rss_limit_mb), a crash, a sanitizer report, an escaped foreign exception. Findings are written
# to build-asan/findings/; the corpus grown by the run stays in build-asan/corpus/<target>/ (or
# --keep DIR) for the next run. Prints executions and findings per target; exits 1 on a finding.
# --coverage replays the seeds and the grown corpora through a build with clang's source-based
# coverage (build-fuzz-cov/) and prints llvm-cov's line coverage of each reader's files.
#   FUZZ_JOBS      parallel compile jobs (default 2)
#   FUZZ_PARALLEL  campaigns run at once (default: the number of cores)
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=60 runs="" targets=() keep="" configure_only=0 coverage=0
while (($#)); do
  case "$1" in
    --coverage) coverage=1; shift ;;
    --configure-only) configure_only=1; shift ;;
    --seconds) seconds="$2"; shift 2 ;;
    --runs) runs="$2"; shift 2 ;;
    --keep) keep="$2"; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
all=(pickle dcp_metadata torch_archive manifest safetensors load_pt checkpoint checkpoint_files
     safetensors_files assemble fsdp_ckpt)
((${#targets[@]})) || targets=("${all[@]}")

need=() packages=(clang-16 libfuzzer-16-dev libclang-rt-16-dev)
# --coverage merges and reports with llvm-profdata-16 and llvm-cov-16, which come with llvm-16.
((coverage == 0)) || packages+=(llvm-16)
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if ((${#need[@]})); then
  echo "fuzz.sh: installing ${need[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=true
export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
# Line coverage of the readers by what the campaigns found (and the seeds): no sanitizers, so
# that the counts are the code's own.
if ((coverage)); then
  cov=build-fuzz-cov
  if [ ! -f "$cov/CMakeCache.txt" ]; then
    cmake -S . -B "$cov" -DCMAKE_CXX_COMPILER=clang++-16 -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DFSDP_FUZZ=ON \
      -DCMAKE_CXX_FLAGS="-fprofile-instr-generate -fcoverage-mapping" \
      -DCMAKE_EXE_LINKER_FLAGS="-fprofile-instr-generate" \
      -DFSDP_BUILD_TESTS=OFF -DFSDP_BUILD_BENCHMARKS=OFF -DFSDP_BUILD_EXAMPLES=OFF > /dev/null
  fi
  cmake --build "$cov" -j "${FUZZ_JOBS:-2}" --target "${targets[@]/#/fuzz_}"
  rm -rf "$cov/prof"; mkdir -p "$cov/prof"
  objects=()
  for t in "${targets[@]}"; do
    dirs=("tests/fuzz/corpus/$t")
    [ ! -d "build-asan/corpus/$t" ] || dirs+=("build-asan/corpus/$t")
    LLVM_PROFILE_FILE="$cov/prof/$t.profraw" "$cov/tests/fuzz/fuzz_$t" -runs=0 "${dirs[@]}" \
      > "$cov/prof/$t.log" 2>&1
    objects+=(-object "$cov/tests/fuzz/fuzz_$t")
  done
  llvm-profdata-16 merge -sparse -o "$cov/prof/all.profdata" "$cov"/prof/*.profraw
  readers=(src/checkpoint/formats/pickle.cpp src/checkpoint/dcp/metadata.cpp
           src/checkpoint/formats/torch_archive.cpp src/checkpoint/dcp/manifest.cpp
           src/checkpoint/exchange/import.cpp src/checkpoint/load/load.cpp
           src/checkpoint/load/verify.cpp src/checkpoint/dcp/items.cpp
           src/checkpoint/storage/files.cpp src/checkpoint/formats/json_text.h
           src/checkpoint/formats/tensor_formats.h src/checkpoint/save/node_local.cpp
           src/checkpoint/exchange/export.cpp tools/ckpt_commands.cpp)
  llvm-cov-16 report "${objects[@]:1}" -instr-profile="$cov/prof/all.profdata" "${readers[@]}"
  exit 0
fi

build=build-asan
if [ ! -f "$build/CMakeCache.txt" ]; then
  # -O1 as libFuzzer's documentation recommends: fast enough, and reports stay readable. The
  # tests are configured too (scripts/sanitize.sh builds them here); only what is asked is built.
  # Each folder of the library is one unity TU here (FSDP_UNITY_BATCH_SIZE): CI's build with
  # clang proves that no two sources of a folder clash, whatever the batches of the default build.
  cmake -S . -B "$build" -DCMAKE_CXX_COMPILER=clang++-16 -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DFSDP_FUZZ=ON -DFSDP_SANITIZE=address,undefined \
    -DFSDP_BUILD_BENCHMARKS=OFF -DFSDP_UNITY_BATCH_SIZE=1000 > /dev/null
fi
((configure_only == 0)) || exit 0
cmake --build "$build" -j "${FUZZ_JOBS:-2}" --target "${targets[@]/#/fuzz_}"

dict_of() {
  case "$1" in
    pickle|dcp_metadata) echo pickle ;;
    torch_archive|load_pt) echo torch ;;
    checkpoint|checkpoint_files|assemble|fsdp_ckpt) echo checkpoint ;;
    manifest|safetensors|safetensors_files) echo json ;;
  esac
}
mkdir -p "$build/findings" "$build/dict"
cat tests/fuzz/dict/pickle.dict tests/fuzz/dict/zip.dict > "$build/dict/torch.dict"
# A checkpoint input holds a manifest besides the pickles and archives: all three dictionaries.
cat "$build/dict/torch.dict" tests/fuzz/dict/json.dict > "$build/dict/checkpoint.dict"
cp tests/fuzz/dict/pickle.dict tests/fuzz/dict/json.dict "$build/dict/"

# LeakSanitizer on: a leak in our code is a finding. ASan's allocator may return null instead of
# aborting on a huge request, as the real one would throw; libFuzzer's own malloc limit catches it.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
# One campaign per core at a time (FUZZ_PARALLEL): each target is single-threaded and runs for
# its own wall-clock --seconds, so on CI's two cores eleven 10-second campaigns take 60 s instead
# of 110 s, each with the executions it would have alone. The table is printed in the targets'
# order once all have ended.
parallel="${FUZZ_PARALLEL:-$(nproc)}"
((parallel >= 1)) || parallel=1
campaign() {
  local t="$1" work="${keep:-$build/corpus}/$1"
  mkdir -p "$work"
  local limit=(-max_total_time="$seconds")
  [ -z "$runs" ] || limit=(-runs="$runs")
  # Inputs up to 1 MiB: without it libFuzzer stops at the largest seed (4 KiB to 64 KiB), and the
  # hostile class that needs length, nesting hundreds of thousands deep, stays out of reach.
  # libFuzzer's -len_control still starts short and lengthens inputs as coverage stalls.
  limit+=(-max_len=1048576)
  # The kept findings and the hostile files of the tests (tests/fuzz/regressions/) seed it too.
  local seeds=("tests/fuzz/corpus/$t")
  [ ! -d "tests/fuzz/regressions/$t" ] || seeds+=("tests/fuzz/regressions/$t")
  local rc=0
  "$build/tests/fuzz/fuzz_$t" "${limit[@]}" -timeout=1 -malloc_limit_mb=1024 -rss_limit_mb=2048 \
    -dict="$build/dict/$(dict_of "$t").dict" -artifact_prefix="$build/findings/$t-" \
    -print_final_stats=1 -close_fd_mask=1 "$work" "${seeds[@]}" \
    > "$build/findings/$t.log" 2>&1 || rc=$?
  echo "$rc" > "$build/findings/$t.rc"
}
running=0
for t in "${targets[@]}"; do
  if ((running >= parallel)); then wait -n || true; running=$((running - 1)); fi
  campaign "$t" &
  running=$((running + 1))
done
wait
failed=0 total_execs=0 total_found=0
printf '%-14s %12s %10s %8s %s\n' target executions exec/s findings corpus
for t in "${targets[@]}"; do
  log="$build/findings/$t.log"
  rc=$(cat "$build/findings/$t.rc" 2>/dev/null || echo 1)
  execs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$' || echo 0)
  rate=$(grep -oE 'stat::average_exec_per_sec: *[0-9]+' "$log" | grep -oE '[0-9]+$' || echo 0)
  found=$(find "$build/findings" -maxdepth 1 -name "$t-*" -type f | wc -l)
  printf '%-14s %12s %10s %8s %s\n' "$t" "$execs" "$rate" "$found" \
    "$(find "${keep:-$build/corpus}/$t" -type f | wc -l)"
  total_execs=$((total_execs + execs)) total_found=$((total_found + found))
  if ((rc != 0 || found != 0)); then
    failed=1
    echo "fuzz.sh: $t found something (exit $rc); see $log and $build/findings/$t-*" >&2
    grep -E "ERROR|SUMMARY|runtime error|fuzz target" "$log" | head -5 >&2 || true
  fi
done
echo "fuzz.sh: ${#targets[@]} targets, $total_execs executions, $total_found findings"
exit "$failed"
