#!/usr/bin/env bash
# Builds moeblaze and runs every test. GPU tests (label `gpu`) report "skipped: no GPU" on a
# machine without one. Pass ctest options through, e.g. scripts/test.sh -L cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
cd build && ctest --output-on-failure -j "$(nproc)" "$@"
