#!/usr/bin/env bash
# The test command (what CI runs through .ci/run): builds and runs the whole suite twice,
#   1. against the host's LibTorch (Debian 12: 1.13.1) in build/, and
#   2. against LibTorch 2.6 inside the Debian trixie chroot of scripts/torch2-env.sh, in
#      build-trixie/ (created on first use, then reused from /var/cache/fsdp-cpp). That build also
#      runs the Python FSDP oracle test (PyTorch 2.6's own FSDP as the reference).
# Each installs what it needs. Multi-rank tests fork real processes talking Gloo over loopback;
# they run one at a time. ctest runs one entry per GoogleTest suite (cmake/FsdpTestSuites.cmake);
# the summary adds up the cases from their JSON reports. Extra arguments go to both ctest runs.
#
#   FSDP_TEST_TORCH2=0   skip the LibTorch 2.x run (e.g. on a machine that cannot chroot)
#   FSDP_TORCH2_RELEASE  chroot release for the second run (default trixie; sid = 2.14)
#   FSDP_TORCH2_POINT_STRIDE  the second run's sampling of crash and error points (default 8;
#                        1 visits every point, as the first run does)
#   FSDP_TEST_REQUIRE=1  fail the run when an entry that this machine is meant to run skips
#                        (.ci/run sets it): the emulated hosts on the host build, the PyTorch
#                        oracles in the chroot. Otherwise a skip is reported, never counted as a
#                        pass.
#   FSDP_TEST_PREBUILD_SANITIZERS=1  also build scripts/sanitize.sh's tree (build-asan/) while
#                        the 2.x tests run, so that sanitize.sh afterwards only tests (.ci/run)
#
# Two cores, three builds: each build after the first compiles while the tests before it run
# (the 2.x build during the host's tests, the sanitizer build during the 2.x tests), at the
# lowest CPU and I/O priority (nice 19, ionice idle), so a test that wants the CPU gets it: the
# tests time collectives and failures, and must not wait behind a compiler. Each stage's
# elapsed time is printed ("== test.sh +MM:SS ...").
set -euo pipefail
cd "$(dirname "$0")/.."

summary=()
failed=0
start_s=$SECONDS
# stage WHAT: a time-stamped line for the CI log (elapsed since test.sh started).
stage() { printf '== test.sh +%02d:%02d %s\n' $(((SECONDS - start_s) / 60)) $(((SECONDS - start_s) % 60)) "$*"; }
# background CMD...: runs CMD at the lowest CPU and I/O priority (see the header).
background() { ionice -c 3 nice -n 19 "$@"; }

# record LABEL CTEST_LOG RESULTS_DIR [REQUIRED_REGEX]: parses ctest's closing lines into
# "LABEL: P passed, F failed, S skipped" (ctest counts a skipped entry as neither failed nor passed
# in its own summary line, and lists it under "did not run"), with the cases behind them. With
# FSDP_TEST_REQUIRE=1, a skipped entry whose name matches REQUIRED_REGEX fails the run.
record() {
  local label="$1" log="$2" required="${4:-}" line total nfail skipped names
  line=$(grep -E "tests passed, [0-9]+ tests failed out of [0-9]+" "$log" | tail -1 || true)
  if [ -z "$line" ]; then
    summary+=("$label: no test result (build or set-up failed)")
    failed=1
    return
  fi
  total=$(sed -E 's/.*out of ([0-9]+).*/\1/' <<<"$line")
  nfail=$(sed -E 's/.*tests passed, ([0-9]+) tests failed.*/\1/' <<<"$line")
  names=$(skipped_entries "$log")
  skipped=$(grep -c . <<<"$names" || true)
  summary+=("$label: $((total - nfail - skipped)) passed, $nfail failed, $skipped skipped$(case_counts "$3")")
  if ((skipped)); then summary+=("  skipped: $(tr '\n' ' ' <<<"$names")"); fi
  ((nfail == 0)) || failed=1
  if [ "${FSDP_TEST_REQUIRE:-0}" = 1 ] && [ -n "$required" ] && grep -Eq "$required" <<<"$names"; then
    summary+=("  FAILED: $(grep -E "$required" <<<"$names" | tr '\n' ' ')skipped, but this run is meant to run them (FSDP_TEST_REQUIRE=1)")
    failed=1
  fi
}

# skipped_entries CTEST_LOG: the names of the entries ctest lists as "(Skipped)", one a line.
skipped_entries() {
  sed -n '/The following tests did not run:/,/^$/p' "$1" |
    sed -nE 's/^[[:space:]]*[0-9]+ - (.*) \(Skipped\)$/\1/p'
}

# case_counts RESULTS_DIR: ctest runs one entry per GoogleTest suite (cmake/FsdpTestSuites.cmake);
# each writes a JSON report there. Prints " (N cases: P passed, S skipped, F failed)".
case_counts() {
  local dir="$1" run skipped failed_cases
  compgen -G "$dir/*.json" > /dev/null || return 0
  run=$(cat "$dir"/*.json | grep -c '"status": "RUN"' || true)
  skipped=$(cat "$dir"/*.json | grep -c '"result": "SKIPPED"' || true)
  failed_cases=$(cat "$dir"/*.json | grep -c '"failures": \[' || true)
  echo " ($run cases: $((run - skipped - failed_cases)) passed, $skipped skipped, $failed_cases failed)"
}

# A full disk shows up late and far from its cause (a failed install test, a truncated object):
# say so first. Two build directories and the install test take about 4 GB.
free_gb=$(df -Pk . | awk 'NR == 2 { print int($4 / 1048576) }')
if [ -n "$free_gb" ] && ((free_gb < 6)); then
  echo "test.sh: warning: only ${free_gb} GB free on $(df -P . | awk 'NR == 2 { print $6 }');" \
    "a full run needs about 4 GB (build/, build-trixie/, the install test)" >&2
fi

# 0. The LibTorch 2.x chroot: created on first use (about 5 minutes, mostly download and
# unpacking), so on a fresh machine it is made while the host build compiles, and waited for
# before any test runs (the tests time collectives and must not share the CPU with dpkg).
# Afterwards this only checks that the chroot is there.
torch2=${FSDP_TEST_TORCH2:-1}
release=${FSDP_TORCH2_RELEASE:-trixie}
chroot_pid="" chroot_log=$(mktemp)
./scripts/setup.sh --packages-only
if [ "$torch2" != "0" ]; then
  scripts/torch2-env.sh --release "$release" -- true >"$chroot_log" 2>&1 &
  chroot_pid=$!
  # If the host build fails, the chroot still finishes (it is cached for the next run).
  trap 'wait' EXIT
fi

# 1. Host LibTorch.
stage "host build"
./scripts/setup.sh
stage "host build done"
chroot_ok=1
if [ -n "$chroot_pid" ]; then
  wait "$chroot_pid" || chroot_ok=0
  cat "$chroot_log"
fi
# The 2.x build compiles while the host's tests run (see the header).
t2_build_pid="" t2_build_log=$(mktemp)
if [ "$torch2" != "0" ] && ((chroot_ok)); then
  background scripts/torch2-env.sh --release "$release" -- /bin/bash -c \
    'BUILD_DIR=build-'"$release"' FSDP_RELWITHDEBINFO_FLAGS="'"${FSDP_RELWITHDEBINFO_FLAGS:-}"'" \
     ./scripts/setup.sh' >"$t2_build_log" 2>&1 &
  t2_build_pid=$!
fi
stage "host tests"
host_log=$(mktemp)
rm -rf "${BUILD_DIR:-build}/test-results"
(cd "${BUILD_DIR:-build}" && ctest --output-on-failure --timeout 300 "$@") 2>&1 | tee "$host_log" || true
host_version=$(grep -oE 'LibTorch [0-9.]+' "${BUILD_DIR:-build}/fsdp_torch_version.txt" 2>/dev/null ||
  echo "LibTorch (host)")
# The emulated hosts need root and network namespaces, which the host has (CI runs as root).
record "$host_version (host)" "$host_log" "${BUILD_DIR:-build}/test-results" '^emulated_hosts_'

# 2. LibTorch 2.x in a Debian chroot. The enumerations of crash and error points (CrashPoints,
# ErrorPoints, CollectiveFailures) exercise our file and collective code, which does not change
# with LibTorch's version: the host run visits every point, this one the first point of every
# distinct call and every 16th besides (tests/helpers/point_sampler.h; FSDP_TORCH2_POINT_STRIDE=1:
# all). (Every 4th until 2026-12-02, every 8th until 2026-12-03: CI has to fit 45 minutes on a
# fresh machine.) For the same reason the multi-node suites (FsdpRunNodes, FsdpTrainNodes: two
# launchers on loopback, their agents' protocol and the failures of whole nodes, our own code) run
# on the host only; the 2.x run keeps the single-node launcher and trainer suites, which exercise
# LibTorch's TCPStore, Gloo and checkpoints there. FSDP_TORCH2_EXCLUDE='' runs them too.
sanitize_pid="" sanitize_log=$(mktemp)
if [ "$torch2" != "0" ]; then
  t2_log=$(mktemp)
  t2_build_ok=0
  if [ -n "$t2_build_pid" ]; then
    stage "host tests done; waiting for the $release build"
    wait "$t2_build_pid" && t2_build_ok=1
    cat "$t2_build_log"
    stage "$release build done"
  fi
  # The sanitizer build compiles while the 2.x tests run.
  if [ "${FSDP_TEST_PREBUILD_SANITIZERS:-0}" = 1 ]; then
    background scripts/sanitize.sh --build-only >"$sanitize_log" 2>&1 &
    sanitize_pid=$!
  fi
  if ((t2_build_ok)); then
    stage "$release tests"
    scripts/torch2-env.sh --release "$release" -- /bin/bash -c \
      'cd build-'"$release"' &&
       rm -rf test-results && exclude=$1 && shift &&
       FSDP_TEST_POINT_STRIDE=$0 ctest --output-on-failure --timeout 600 ${exclude:+-E "$exclude"} "$@"' \
      "${FSDP_TORCH2_POINT_STRIDE:-16}" "${FSDP_TORCH2_EXCLUDE-^(FsdpRunNodes|FsdpTrainNodes)\$}" "$@" \
      2>&1 | tee "$t2_log" || true
    t2_version=$(grep -oE 'LibTorch [0-9.]+' "build-$release/fsdp_torch_version.txt" 2>/dev/null ||
      echo "LibTorch 2.x")
    # The chroot has PyTorch 2.x: its oracles must run there.
    record "$t2_version ($release chroot)" "$t2_log" "build-$release/test-results" '^oracle_'
  elif ((chroot_ok)); then
    summary+=("LibTorch 2.x ($release chroot): the build failed (its output is above)")
    failed=1
  else
    summary+=("LibTorch 2.x ($release chroot): could not create the chroot")
    failed=1
  fi
fi
if [ -n "$sanitize_pid" ]; then
  stage "tests done; waiting for the sanitizer build"
  wait "$sanitize_pid" || echo "test.sh: the sanitizer build failed (scripts/sanitize.sh reports it)"
  cat "$sanitize_log"
fi
stage "done"

echo
echo "== fsdp-cpp test summary =="
for s in "${summary[@]}"; do echo "$s"; done
total_passed=0 total_failed=0 total_skipped=0 total_cases=0
for s in "${summary[@]}"; do
  if [[ $s =~ ([0-9]+)\ passed,\ ([0-9]+)\ failed,\ ([0-9]+)\ skipped ]]; then
    total_passed=$((total_passed + BASH_REMATCH[1]))
    total_failed=$((total_failed + BASH_REMATCH[2]))
    total_skipped=$((total_skipped + BASH_REMATCH[3]))
  fi
  if [[ $s =~ \(([0-9]+)\ cases ]]; then total_cases=$((total_cases + BASH_REMATCH[1])); fi
done
echo "all: $total_passed passed, $total_failed failed, $total_skipped skipped (ctest entries: one" \
  "per GoogleTest suite, $total_cases cases in all)"
exit "$failed"
