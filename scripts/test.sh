#!/usr/bin/env bash
# The test command: installs dependencies if missing, builds, and runs the whole test suite.
# Multi-rank tests fork real processes talking Gloo over loopback; they run one at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
"$(dirname "$0")/setup.sh"
cd "${BUILD_DIR:-build}"
ctest --output-on-failure --timeout 300 "$@"
