#!/usr/bin/env bash
# CPU-only ASan + UBSan build of the library, the C ABI, the CLI and the CPU tests in
# build-asan, then the CPU tests (ctest -L cpu) under it. Any sanitizer report fails the test
# that triggered it (UBSan does not recover; ASan aborts). CI runs it (.ci/run); by hand:
#   scripts/sanitize.sh            # JOBS=2 by default; extra arguments go to ctest
#   JOBS=8 scripts/sanitize.sh -R Fuzz
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh  # compiler, CMake, Ninja, GoogleTest, CLI11 on a fresh machine
jobs=${JOBS:-2}
san="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
start=$(date +%s)
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOEBLAZE_CUDA=OFF \
  -DCMAKE_CXX_FLAGS="$san" -DCMAKE_EXE_LINKER_FLAGS="$san" -DCMAKE_SHARED_LINKER_FLAGS="$san"
cmake --build build-asan -j"$jobs"
built=$(date +%s)
# detect_leaks: the library must not leak either (libgomp's thread pool is not reported).
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:strict_string_checks=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
status=0
(cd build-asan && ctest -L cpu -j"$jobs" --output-on-failure "$@") || status=$?
end=$(date +%s)
echo "sanitize: build $((built - start)) s, tests $((end - built)) s, total $((end - start)) s," \
     "ctest exit status $status"
exit $status
