#!/usr/bin/env bash
# Expert parallelism over NCCL on this machine's GPUs: builds moeblaze_gpu_tests (CUDA + NCCL)
# and runs the EpNccl tests (one process, one thread per GPU, ncclCommInitAll over 2, 4, 8 of the
# visible GPUs; each compared with the single-GPU layer). With fewer than 2 GPUs they report
# "skipped: needs >= 2 GPUs".
#
#   scripts/ep_nccl_check.sh [BUILD_DIR]      (default build-gpu, as scripts/gpu_check.sh)
#
# NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 here, and the test sets it as well.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
export NCCL_NVLS_ENABLE=0
BUILD=${1:-build-gpu}
cmake_args=(-DMOEBLAZE_CUDA=ON -DCMAKE_BUILD_TYPE=Release)
command -v ninja >/dev/null && cmake_args+=(-G Ninja)
if [ ! -f /usr/include/gtest/gtest.h ] && [ -d third_party/gpudeps ]; then
  deps=$(pwd)/third_party/gpudeps
  cmake_args+=(-DGTEST_ROOT="$deps" -DGTest_ROOT="$deps" -DCLI11_INCLUDE_DIR="$deps/include")
fi
cmake -S . -B "$BUILD" "${cmake_args[@]}" | grep -E "moeblaze:" || true
grep -q "MOEBLAZE_NCCL_LIBRARY:FILEPATH=.*nccl" "$BUILD/CMakeCache.txt" || {
  echo "ep_nccl_check: NCCL not found by CMake (nccl.h / libnccl): the NCCL transport is not built"
  exit 1
}
cmake --build "$BUILD" -j "${JOBS:-$(nproc)}" --target moeblaze_gpu_tests
nvidia-smi -L || true
# A rank that fails inside NCCL can leave the others waiting: bound the run.
timeout "${EP_TIMEOUT:-600}" "$BUILD/moeblaze_gpu_tests" --gtest_filter='EpNccl*'
