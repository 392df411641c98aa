#!/usr/bin/env bash
# The suite under AddressSanitizer, LeakSanitizer and UndefinedBehaviorSanitizer, and a bounded
# fuzzing run (issue 39; docs/reliability.md).
#
#   scripts/sanitize.sh [--all | --quick] [--fuzz-seconds N] [--build-only] [ctest arguments...]
#
# Builds build-asan/ with clang 16 and -fsanitize=address,undefined for everything of ours
# (LibTorch and Gloo stay as Debian built them; tests/sanitizers.supp lists what of theirs is
# suppressed, and why), runs the checkpoint, state-dict and distributed suites under it (--all:
# every suite), then each fuzz target for N seconds (default 20; 0 skips) from the same build.
# Any sanitizer report fails the test that caused it. .ci/run runs this after scripts/test.sh,
# which (FSDP_TEST_PREBUILD_SANITIZERS=1) runs it with --build-only while the 2.x tests run:
# --build-only builds the suites and the fuzz targets, then stops. --quick (what .ci/run passes)
# leaves out the suites that repeat paths the others cover at more world sizes or more ranks
# (see below): about 8 minutes instead of about 30 on the 2-core VM.
set -euo pipefail
cd "$(dirname "$0")/.."

all=0 quick=0 fuzz_seconds=20 build_only=0 ctest_args=()
while (($#)); do
  case "$1" in
    --all) all=1; shift ;;
    --quick) quick=1; shift ;;
    --fuzz-seconds) fuzz_seconds="$2"; shift 2 ;;
    --build-only) build_only=1; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) ctest_args+=("$1"); shift ;;
  esac
done

# The suites CI runs instrumented: everything that reads or writes checkpoints and state dicts,
# the collectives under them, and deferred initialisation (it maps memory by hand). --all adds
# the runtime, flat-parameter and program suites.
suites=(test_dist test_host_routes test_deferred_init test_state_dict test_state_dict_edges
        test_state_dict_utils test_state_dict_api
        test_optim_state_dict test_checkpoint_state_dict test_dcp_metadata
        test_dcp_checkpoint test_checkpoint_safety test_checkpoint_export test_async_save
        test_crash_points test_collective_failures test_fuzz_replay sanitizer_canary
        sanitizer_leak_probe)
targets=("${suites[@]}")
if ((all)); then targets=(all); fi

scripts/fuzz.sh --configure-only
build=build-asan
# As setup.sh: paths relative to the clone, so that CI's fresh clone (a new path every run) hits
# the compiler cache its previous runs filled. Without these every CI run compiled this tree cold.
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=true
export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
fuzz_targets=(fuzz_pickle fuzz_dcp_metadata fuzz_torch_archive fuzz_manifest fuzz_safetensors
              fuzz_load_pt fuzz_checkpoint fuzz_checkpoint_files fuzz_safetensors_files
              fuzz_assemble fuzz_fsdp_ckpt)
cmake --build "$build" -j "${JOBS:-2}" --target "${targets[@]}" "${fuzz_targets[@]}"
((build_only == 0)) || exit 0

label_regex=$(IFS='|'; echo "^(${suites[*]})\$")
# CrashPoints replays ~17,500 crash states through save, verify and load: 4.5 min instrumented,
# for the same library paths ErrorPoints runs in 50 s. CI leaves it to the plain builds; --all
# runs it (and test_sd_matrix).
# Also left to the plain builds: the sweeps that repeat the same code at more world sizes
# (the optimizers' full state dicts at W = 1-4, and the collectives beyond four ranks; each
# suite's other cases run here) and the state-dict matrix (test_sd_matrix, 65 s instrumented,
# whose paths the state-dict suites here cover).
excluded='CrashPoints|Optimizers/FullOsdWorld|BeyondFourRanks/.*'
# --quick (CI): instrumented, a suite runs 3-8 times slower than plain (the collectives at
# W = 1-4, WorldSizes/*, 200 s; OptimStateDict 131 s), and the whole selection took about 30
# minutes, a third of CI's time. CI keeps the suites whose code reads or builds bytes and shapes
# from outside (pickle, DCP metadata and items, safetensors and .pt exports, hostile checkpoints,
# the fuzz inputs), the I/O error paths (ErrorPoints), the state-dict core and the process-group
# suites (sub-groups, initialisation, failures, agreement, the sum kernel); it leaves
# out the sweeps of the same code over W = 1-4 and the multi-rank protocols (host routes,
# read-once loads, node-local saves, host copies, the collective-failure enumeration) that the
# plain builds run whole on both LibTorch versions. A run without --quick covers them all
# (docs/reliability.md records its last result).
if ((quick)); then
  excluded+='|WorldSizes/.*|HostRoutes|Worlds/StateDictWorld|OptimStateDict'
  excluded+='|Strategies/ShardedOsdRoundTrip|CheckpointStateDict|Worlds/GetStateDictWorld'
  excluded+='|StateDictApi/Worlds|ReadOnceLoad|NodeLocalSave|HostCopies|CollectiveFailures'
fi
filter=(-L "$label_regex" -E "^($excluded)\$")
# The enumerations that inject a fault at every I/O call or collective (ErrorPoints,
# CollectiveFailures) visit every distinct call and every 4th point besides
# (tests/helpers/point_sampler.h): the plain builds visit every point. --all runs everything whole, but
# for the node-local crash states, which every build samples (every 8th and each kind's first:
# all 8,300 take 4.4 minutes uninstrumented; FSDP_TEST_POINT_STRIDE=1 checks them all).
export FSDP_TEST_POINT_STRIDE=4
if ((all)); then filter=(); unset FSDP_TEST_POINT_STRIDE; fi
rm -rf "$build/test-results"
# halt_on_error: the first report ends the process, so its suite fails; detect_leaks: LeakSanitizer
# at exit of every process (the forked ranks included); the suppressions are for LibTorch's and
# Gloo's own never-freed singletons only.
export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:${ASAN_OPTIONS:-}"
export LSAN_OPTIONS="suppressions=$PWD/tests/sanitizers.supp:print_suppressions=0:${LSAN_OPTIONS:-}"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:${UBSAN_OPTIONS:-}"
(cd "$build" && ctest --output-on-failure --timeout 900 "${filter[@]}" "${ctest_args[@]}")

if ((fuzz_seconds > 0)); then
  scripts/fuzz.sh --seconds "$fuzz_seconds"
fi
