#!/usr/bin/env bash
# The long mode of the seeded fuzz suite (tests/cpu/test_fuzz.cpp): N rounds over the fixed
# seeds (round r uses seed + r * 1000003), each round a few seconds. CI runs one round.
#   scripts/fuzz.sh            # 200 rounds in build-cpu (CPU-only Release build)
#   scripts/fuzz.sh 1000       # 1000 rounds
#   BUILD=build-asan scripts/fuzz.sh 20   # under ASan + UBSan (build it with scripts/sanitize.sh)
# Prints the counts of each test: inputs tried, clean errors, crashes, silent wrong.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-200}
build=${BUILD:-build-cpu}
if [ ! -x "$build/moeblaze_tests" ]; then
  bash scripts/setup.sh
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEBLAZE_CUDA=OFF
fi
cmake --build "$build" -j"${JOBS:-2}" --target moeblaze_tests
MOEBLAZE_FUZZ_ITERS=$rounds "$build/moeblaze_tests" --gtest_filter='Fuzz.*'
