#!/usr/bin/env bash
# Packs SonicMoE, the peer the benchmarks compare against, into a folder that a GPU machine
# without network can install from: its wheel and those of the packages it imports, pinned to
# versions that work together, and an install.sh to source there.
#
#   scripts/pack_sonicmoe.sh .sonic             # here, with PyPI reachable (~4 min: xz)
#   SONICMOE_CARRY=.sonic scripts/gpu_check.sh OUT peers   # on the GPU machine (.sonic carried)
#   source .sonic/install.sh                    # or by hand: PYTHONPATH gets the packages
#
# The folder is ~56 MiB: the CuTe-DSL runtime wheel (~74 MB) is unpacked and stored as one
# tar.xz (~54 MB), so that it fits a 64 MiB transfer with the sources beside it. Pins: sonic-moe 0.1.2.post1 needs nvidia-cutlass-dsl 4.4.2, and
# quack-kernels 0.3.11 is the newest release that accepts that DSL. SonicMoE declares torch
# <= 2.9.1 but runs on torch 2.11; it tunes its backward kernels at every new shape (minutes),
# which gpu_check.sh caches in bench/cache/sonicmoe-autotune.tgz.
set -euo pipefail
dir=${1:?usage: scripts/pack_sonicmoe.sh DIR}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Wheels for the GPU machine's Python (CPython 3.12, x86_64 glibc), whatever this machine runs.
platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014; do
  platforms+=(--platform "${p}_x86_64")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" --dest "$work" \
  sonic-moe==0.1.2.post1 quack-kernels==0.3.11 nvidia-cutlass-dsl-libs-base==4.4.2 \
  apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5

dsl=$(ls "$work"/nvidia_cutlass_dsl_libs_base-*.whl)
mkdir "$work/dsl"
python3 -m zipfile -e "$dsl" "$work/dsl"
rm "$dsl"
tar -C "$work/dsl" -cf - . | xz -T0 -6 >"$dir/cutlass_dsl.tar.xz"
mv "$work"/*.whl "$dir/"

cat >"$dir/install.sh" <<'EOF'
# Source on the GPU machine: installs the packed SonicMoE into /tmp/sonicmoe-site once (it stays
# while the machine does) and puts it on PYTHONPATH.
_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
_site=/tmp/sonicmoe-site
if [ ! -d "$_site/sonicmoe" ]; then
  mkdir -p "$_site" && tar -xJf "$_here/cutlass_dsl.tar.xz" -C "$_site" &&
    python3 -m pip install --quiet --no-index --no-deps --no-compile --target "$_site" "$_here"/*.whl
fi
export PYTHONPATH=$_site:$_site/nvidia_cutlass_dsl/python_packages${PYTHONPATH:+:$PYTHONPATH}
unset _here _site
EOF
du -sh "$dir"
