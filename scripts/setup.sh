#!/usr/bin/env bash
# Installs what fsdp-cpp needs on Debian 12 (idempotent), then configures and builds it.
# Used by scripts/test.sh and scripts/demo.sh; safe to run on its own.
#   BUILD_DIR  build directory (default: build)
#   JOBS       parallel compile jobs (default: 2; a LibTorch TU needs ~1 GiB of RAM)
#   FSDP_BUILD_TARGETS  build only these targets (default: everything; demo.sh builds its three)
#   FSDP_EXTRA_PACKAGES  more Debian packages to install with ours, in the same apt-get run
#   FSDP_RELWITHDEBINFO_FLAGS  compiler flags of a new build directory (default: -O2 -g1 -DNDEBUG)
# --packages-only: install the packages, then stop (test.sh, before it makes the chroot beside
# the build: two apt-get runs at once would fight over dpkg's lock).
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(cmake g++ make ccache libtorch-dev libgloo-dev libgtest-dev libbenchmark-dev
          nlohmann-json3-dev libxxhash-dev libcli11-dev libisal-dev)
# The formatting check (scripts/check_format.sh) pins Debian 12's clang-format 14; other releases
# have none by that name, and skip the check.
if apt-cache show clang-format-14 > /dev/null 2>&1; then PACKAGES+=(clang-format-14); fi
# shellcheck disable=SC2206  # a space-separated list on purpose
PACKAGES+=(${FSDP_EXTRA_PACKAGES:-})
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
[ "${1:-}" != "--packages-only" ] || exit 0

# ccache: hit across clones (CI builds a fresh clone each time) and with the precompiled header.
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=true
export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime

BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-2}
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  # -g1 (line tables: backtraces with file:line) instead of -g: LibTorch's templates make full
  # debug info about 3.5 GB per build directory, and CI builds two of them in a fresh clone on a
  # disk shared with other work (a full disk once failed the install test). Pass your own
  # CMAKE_CXX_FLAGS_RELWITHDEBINFO, or configure without this script, for full debug info.
  cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="${FSDP_RELWITHDEBINFO_FLAGS:--O2 -g1 -DNDEBUG}"
fi
if [ -n "${FSDP_BUILD_TARGETS:-}" ]; then
  # shellcheck disable=SC2086
  cmake --build "$BUILD_DIR" -j "$JOBS" --target ${FSDP_BUILD_TARGETS}
else
  cmake --build "$BUILD_DIR" -j "$JOBS"
fi
