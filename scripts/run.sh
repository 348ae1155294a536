#!/usr/bin/env bash
# Builds moeblaze and runs the main job: `moeblaze run` on its embedded default config
# (cpu-default: forward+backward of one MoE layer on the CPU backend, with the memory table).
# Arguments go to `moeblaze run`, e.g. scripts/run.sh --config sm-7B-n256 --json
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh >/dev/null
exec ./build/moeblaze run "$@"
