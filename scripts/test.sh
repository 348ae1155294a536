#!/usr/bin/env bash
# Builds moeblaze and runs every test. GPU tests (ctest label `gpu`) skip themselves with
# "skipped: no GPU" on a machine without one; ctest lists them as skipped. Extra arguments go to
# ctest, e.g. scripts/test.sh -L cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
cd build
gpu_tests=$(ctest -N -L gpu 2>/dev/null | sed -n 's/^Total Tests: //p')
if [ "${gpu_tests:-0}" != "0" ] && ! nvidia-smi -L >/dev/null 2>&1; then
  echo "moeblaze: no GPU on this machine: the ${gpu_tests} GPU tests (label gpu) report: skipped: no GPU"
fi
ctest --output-on-failure -j "$(nproc)" "$@"
cd ..
# The wheel, packaging the library built above (no second compile), in a fresh venv; skipped
# with the python tests (MOEBLAZE_SKIP_PYTHON, which test_python.sh reports).
[ -n "${MOEBLAZE_SKIP_PYTHON:-}" ] ||
  MOEBLAZE_PREBUILT_LIB=build/libmoeblaze_capi.so bash scripts/wheel_smoke.sh
# The PyTorch front end (python/): installs torch if needed, then its pytest suite (last, so that
# its summary closes the run).
bash scripts/test_python.sh
