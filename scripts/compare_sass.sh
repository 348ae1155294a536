#!/usr/bin/env bash
# Compares the device code of two builds of the library, object by object, for changes that
# should not change it (moves, include edits): scripts/compare_sass.sh BEFORE_BUILD AFTER_BUILD
# Each *.cu.o of BEFORE is paired with the *.cu.o of AFTER of the same file name (.cu names are
# unique in src/), so a moved file is still compared. For each pair it prints whether
# `cuobjdump -sass` is identical once two things that follow from the source path alone are
# masked: the fatbin's `identifier =` line (the source path) and the per-file hash nvcc puts
# into internal-linkage names (_GLOBAL__N__<hash>_, _INTERNAL_<hash>_). Line info is not part of
# -sass output. Exits 1 when any pair differs or is missing.
# cuobjdump and nvdisasm come from the CUDA toolkit, or from PyPI (nvidia-cuda-cuobjdump,
# nvidia-cuda-nvdisasm): set CUOBJDUMP and NVDISASM_PATH when they are not on PATH.
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 BEFORE_BUILD AFTER_BUILD" >&2; exit 2; }
before=$1 after=$2
CUOBJDUMP=${CUOBJDUMP:-$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)}
[ -n "${NVDISASM_PATH:-}" ] && export PATH="$NVDISASM_PATH:$PATH"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

sass() {  # the object's SASS with path-derived text masked
  "$CUOBJDUMP" -sass "$1" | grep -v '^identifier = ' |
    sed 's/_GLOBAL__N__[0-9a-f]\{8\}_/_GLOBAL__N__HASH_/g; s/_INTERNAL_[0-9a-f]\{8\}_/_INTERNAL_HASH_/g'
}

status=0
while IFS= read -r b; do
  name=$(basename "$b")
  mapfile -t matches < <(find "$after" -name "$name" -path '*CMakeFiles*')
  if [ ${#matches[@]} -ne 1 ]; then
    echo "${b#"$before"/} | ${#matches[@]} objects named $name in $after"
    status=1
    continue
  fi
  a=${matches[0]}
  sass "$b" > "$tmp/b"
  sass "$a" > "$tmp/a"
  kernels=$(grep -c 'Function :' "$tmp/b" || true)
  insns=$(grep -c '/\*[0-9a-f]\{4,\}\*/' "$tmp/b" || true)
  if cmp -s "$tmp/b" "$tmp/a"; then
    verdict="SASS identical ($kernels kernels, $insns instructions)"
  else
    verdict="SASS DIFFERS ($(diff "$tmp/b" "$tmp/a" | grep -c '^[<>]') lines)"
    status=1
  fi
  echo "${b#"$before"/} -> ${a#"$after"/} | $verdict"
done < <(find "$before" -name '*.cu.o' -path '*CMakeFiles*' | sort)
exit $status
