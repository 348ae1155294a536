#!/usr/bin/env bash
# CI smoke test of the wheel: builds it CPU-only with PyPA build, checks its tag is
# py3-none-manylinux_2_28_x86_64 and its library against that policy (scripts/check_wheel_abi.py),
# installs it into a fresh venv (torch from PyPI first), runs the installed library on glibc 2.31
# (scripts/check_old_glibc.sh) and a MoE forward+backward against moeblaze.TorchMoE, plus the
# README's PyTorch example when that is self-contained (imports moeblaze). Run by scripts/test.sh
# after ctest.
#   MOEBLAZE_PREBUILT_LIB=build/libmoeblaze_capi.so  package this library (no compile); otherwise
#                              CMake builds it CPU-only from the sdist, with 2 jobs.
# Its venv, wheel and logs are left in build/wheel-smoke (recreated each run).
# If the venv cannot get torch and build from PyPI (no network), the step says so loudly and is
# skipped (exit 0), as scripts/test_python.sh does; every other failure fails.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
t0=$(date +%s)
# Fresh each run, kept afterwards for its logs (the venv, torch with its CUDA wheels, is ~5 GB).
work="$repo/build/wheel-smoke"
rm -rf "$work"
mkdir -p "$work"
venv="$work/venv"
py="$venv/bin/python"

python3 -m venv "$venv"
echo "moeblaze: wheel smoke: installing torch and build into a fresh venv (pip install torch) ..."
if ! "$py" -m pip install -q --disable-pip-version-check torch build >"$work/torch.log" 2>&1; then
  tail -5 "$work/torch.log"
  echo "moeblaze: ============================================================"
  echo "moeblaze: wheel smoke test SKIPPED: 'pip install torch build' failed in a fresh venv"
  echo "moeblaze: (log: build/wheel-smoke/torch.log)"
  echo "moeblaze: ============================================================"
  exit 0
fi
echo "moeblaze: torch installed in $(( $(date +%s) - t0 )) s"

# The sdist, then the wheel built from it (PyPA build's default); CPU-only, 2 jobs (CI's cores).
if [ -n "${MOEBLAZE_PREBUILT_LIB:-}" ]; then
  MOEBLAZE_PREBUILT_LIB=$(realpath "$MOEBLAZE_PREBUILT_LIB")  # the build runs in another folder
  export MOEBLAZE_PREBUILT_LIB
  echo "moeblaze: packaging the prebuilt $MOEBLAZE_PREBUILT_LIB"
fi
MOEBLAZE_CUDA=OFF MOEBLAZE_JOBS=2 "$py" -m build --outdir "$work/dist" ./python >"$work/build.log" 2>&1 || {
  tail -30 "$work/build.log"; echo "moeblaze: python -m build ./python FAILED"; exit 1; }
rm -rf python/build python/moeblaze.egg-info
wheel=$(ls "$work"/dist/*.whl)
name=$(basename "$wheel")
echo "moeblaze: built $name"
# manylinux_2_28 as PyTorch's wheels (python/setup.py says how the tag is reached), and the
# library inside must keep to that policy's libraries and symbol versions.
case "$name" in
  moeblaze-*-py3-none-manylinux_2_28_x86_64.whl) ;;
  *) echo "moeblaze: wheel tag is not py3-none-manylinux_2_28_x86_64: $name"; exit 1 ;;
esac
python3 scripts/check_wheel_abi.py "$wheel" || {
  echo "moeblaze: $name needs more than manylinux_2_28 allows (above)"; exit 1; }

"$py" -m pip install -q --disable-pip-version-check "$wheel" >"$work/install.log" 2>&1 || {
  tail -20 "$work/install.log"; echo "moeblaze: pip install $name FAILED"; exit 1; }

# The installed library run in a glibc 2.31 userland (Debian bullseye under chroot): it must load
# there and work, with torch's CUDA runtime where it needs one. Skipped, saying so, without root
# or a Debian mirror.
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
libpath="$site/torch/lib"
for dir in "$site"/nvidia/*/lib; do libpath="$libpath:$dir"; done
MOEBLAZE_OLD_OPTIONAL=1 MOEBLAZE_OLD_LIBPATH="$libpath" \
  bash scripts/check_old_glibc.sh "$site/moeblaze/libmoeblaze_capi.so"

# The README's PyTorch example (the first python block under "For PyTorch trainers"), run only
# when it is self-contained, i.e. imports moeblaze and so can run as written.
awk '/^## For PyTorch trainers/ {s = 1; next} s && /^## / {exit} s && /^```python$/ {b = 1; next}
     b && /^```$/ {exit} b {print}' README.md >"$work/readme_example.py"

# From outside the repository, without MOEBLAZE_LIB, so the wheel's package and library load.
cd "$work" && env -u MOEBLAZE_LIB "$py" - "$work/readme_example.py" <<'EOF'
import importlib.metadata, os, re, runpy, sys
import torch
import moeblaze

site = os.path.dirname(os.path.dirname(moeblaze.__file__))
assert moeblaze.library_path().startswith(site), moeblaze.library_path()
assert any(r.split(";")[0].strip() == "torch" for r in importlib.metadata.requires("moeblaze"))
print(f"moeblaze: smoke with torch {torch.__version__}, library {moeblaze.library_path()}")

torch.manual_seed(0)
moe = moeblaze.MoE(64, 32, 8, 2, dtype=torch.float32)
ref = moeblaze.TorchMoE(64, 32, 8, 2, dtype=torch.float32)
ref.load_state_dict(moe.state_dict())
x = torch.randn(2, 24, 64, requires_grad=True)
out, losses = moe(x)
out_ref, losses_ref = ref(x)
params = [x, moe.gate.weight, moe.w1, moe.w2]
params_ref = [x, ref.gate.weight, ref.w1, ref.w2]
g = torch.autograd.grad((out.square().sum() + losses.total), params)
g_ref = torch.autograd.grad((out_ref.square().sum() + losses_ref.total), params_ref)
err = lambda a, b: float((a - b).detach().norm() / b.detach().norm())
errs = [err(out, out_ref)] + [err(a, b) for a, b in zip(g, g_ref)]
print("moeblaze: forward+backward vs TorchMoE, relative errors (out, dx, d gate, dw1, dw2):",
      " ".join(f"{e:.1e}" for e in errs))
assert max(errs) < 1e-4, errs

# moe_experts from the wheel: the C++ fast path compiles from the package's csrc/ and capi.h
# (where a C++ compiler is present) and gives the Python path's bits.
ids = torch.stack([torch.randperm(8)[:2] for _ in range(24)])
ys = []
for use in (True, False):
    with moeblaze.use_extension(use):
        ys.append(moeblaze.moe_experts(x[0].detach(), moe.w1.detach(), moe.w2.detach(), ids,
                                       torch.rand(24, 2, generator=torch.Generator().manual_seed(1))))
print(f"moeblaze: moe_experts' C++ fast path: {moeblaze.extension_status()}")
assert torch.equal(ys[0], ys[1])
import shutil
if shutil.which(os.environ.get("CXX", "c++")):  # a compiler here: the wheel must have what it needs
    assert moeblaze.extension_status().startswith("loaded"), moeblaze.extension_status()

example = open(sys.argv[1]).read()
if re.search(r"^(import|from) .*\bmoeblaze\b", example, re.M):
    runpy.run_path(sys.argv[1], run_name="__main__")
    print("moeblaze: the README's PyTorch example ran")
else:
    print("moeblaze: the README's PyTorch example does not import moeblaze (not self-contained): "
          "not run")
EOF
echo "moeblaze: wheel smoke test passed ($name) in $(( $(date +%s) - t0 )) s"
