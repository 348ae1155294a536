#!/usr/bin/env bash
# The PyTorch front end's tests (python/tests, pytest), run by scripts/test.sh after ctest.
# Uses the python3 that already has torch, else a venv at build/pyenv with torch installed from
# PyPI (a few GB of wheels the first time; pip's cache makes later installs quick). The package
# is installed from build/libmoeblaze_capi.so (built by scripts/build.sh). GPU tests report
# "skipped: no GPU" without CUDA. If torch cannot be installed at all, the step says so loudly
# and is skipped (exit 0); every other failure fails. MOEBLAZE_SKIP_PYTHON=1 skips it.
# transformers >= 5 and accelerate are installed beside pytest for the Hugging Face tests.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
if [ -n "${MOEBLAZE_SKIP_PYTHON:-}" ]; then
  echo "moeblaze: python tests skipped (MOEBLAZE_SKIP_PYTHON is set)"
  exit 0
fi
lib="${MOEBLAZE_PYTHON_LIB:-$repo/build/libmoeblaze_capi.so}"  # override: another build
[ -f "$lib" ] || { echo "moeblaze: $lib is missing (run scripts/build.sh)"; exit 1; }

py=${PYTHON:-python3}  # override: a Python that has torch
if ! "$py" -c "import torch" 2>/dev/null; then
  py="$repo/build/pyenv/bin/python"
  if ! "$py" -c "import torch" 2>/dev/null; then
    echo "moeblaze: installing torch and pytest into build/pyenv (pip install torch) ..."
    t0=$(date +%s)
    python3 -m venv --system-site-packages "$repo/build/pyenv"
    if ! "$py" -m pip install -q --disable-pip-version-check torch pytest >"$repo/build/pyenv-install.log" 2>&1; then
      tail -5 "$repo/build/pyenv-install.log"
      echo "moeblaze: ============================================================"
      echo "moeblaze: python tests SKIPPED: 'pip install torch' failed (log: build/pyenv-install.log)"
      echo "moeblaze: ============================================================"
      exit 0
    fi
    echo "moeblaze: torch installed in $(( $(date +%s) - t0 )) s"
  fi
fi
"$py" -c "import pytest" 2>/dev/null || "$py" -m pip install -q --disable-pip-version-check pytest
# transformers (a test dependency: test_hf.py runs moeblaze inside it; v5 for its experts
# interface; about 20 s from PyPI, pure Python plus tokenizers' wheel). Without it those tests skip.
if ! "$py" -c "import sys, transformers; sys.exit(int(transformers.__version__.split('.')[0]) < 5)" \
    2>/dev/null; then
  t0=$(date +%s)
  mkdir -p "$repo/build"
  if "$py" -m pip install -q --disable-pip-version-check "transformers>=5.0" \
      >"$repo/build/transformers-install.log" 2>&1; then
    echo "moeblaze: transformers installed in $(( $(date +%s) - t0 )) s"
  else
    tail -3 "$repo/build/transformers-install.log"
    echo "moeblaze: 'pip install transformers' FAILED: the Hugging Face tests (test_hf.py) skip"
  fi
fi
# accelerate (a test dependency: transformers.Trainer needs it for test_trainer.py; pure Python).
# Without it that test skips.
if ! "$py" -c "import accelerate" 2>/dev/null; then
  t0=$(date +%s)
  mkdir -p "$repo/build"
  if "$py" -m pip install -q --disable-pip-version-check accelerate \
      >"$repo/build/accelerate-install.log" 2>&1; then
    echo "moeblaze: accelerate installed in $(( $(date +%s) - t0 )) s"
  else
    tail -3 "$repo/build/accelerate-install.log"
    echo "moeblaze: 'pip install accelerate' FAILED: the Trainer test (test_trainer.py) skips"
  fi
fi
echo "moeblaze: python tests with $("$py" -c 'import torch; print("torch", torch.__version__)')"
MOEBLAZE_PREBUILT_LIB="$lib" "$py" -m pip install -q --disable-pip-version-check \
  --no-build-isolation --no-deps --force-reinstall ./python >"$repo/build/python-install.log" 2>&1 || {
  tail -20 "$repo/build/python-install.log"; echo "moeblaze: pip install ./python FAILED"; exit 1; }
rm -rf python/build
# From outside the repository, so that the installed package is the one imported.
cd /tmp && "$py" -m pytest -q -rs -p no:cacheprovider "$repo/python/tests"
