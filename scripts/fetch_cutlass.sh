#!/usr/bin/env bash
# Installs the CUTLASS/CuTe 4.2 headers (PyPI nvidia-cutlass==4.2.0.0) into the git-ignored
# third_party/cutlass, where CMakeLists.txt's MOEBLAZE_CUTLASS_DIR looks by default. Called by
# scripts/setup.sh and by python/setup.py (a wheel built from source with nvcc). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f third_party/cutlass/cutlass_library/source/include/cutlass/version.h ]; then
  echo "moeblaze: installing CUTLASS 4.2 headers (PyPI nvidia-cutlass==4.2.0.0) into third_party/cutlass"
  "${PYTHON:-python3}" -m pip install -q --disable-pip-version-check --no-deps \
    --target third_party/cutlass nvidia-cutlass==4.2.0.0
fi
