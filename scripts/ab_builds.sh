#!/usr/bin/env bash
# A/B of two builds on one GPU, alternating rounds (clocks drift; compare the ratio of
# neighbouring runs, not two runs minutes apart):
#   A = BASE, a git revision of this checkout's .git, built into BASE_DIR (default /tmp/ba);
#   B = the working tree, built into BUILD_DIR (default /tmp/bg; gpu_check.sh may have built it).
#
#   scripts/ab_builds.sh OUT BASE ROUNDS -- ARGS...
#     runs `moeblaze ARGS... --out OUT/ab.jsonl` ROUNDS times per build, A B, B A, A B, ...,
#     with MOEBLAZE_COMMIT = A_LABEL (default: BASE's short sha) or B_LABEL (default: tree), so
#     each JSON row names its build. The console output of every run goes to OUT/ab.log.
#
# Where the tree was copied with a .git that is not its own, pass B_LABEL=<the tree's sha>
# (`git rev-parse` there names the wrong commit).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/ab_builds.sh OUT BASE ROUNDS -- ARGS...}
BASE=${2:?base revision}
ROUNDS=${3:?rounds}
shift 3
[ "${1:-}" = "--" ] && shift
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PATH="$PATH:/usr/local/cuda/bin"
A_DIR=${BASE_DIR:-/tmp/ba}
B_DIR=${BUILD_DIR:-/tmp/bg}
A_LABEL=${A_LABEL:-$(git rev-parse --short=7 "$BASE")}
B_LABEL=${B_LABEL:-tree}
JOBS=${JOBS:-$(nproc)}
cmake_args=(-DMOEBLAZE_CUDA=ON -DCMAKE_BUILD_TYPE=Release)
command -v ninja >/dev/null && cmake_args+=(-G Ninja)

# The base's sources, with the tree's third_party/ (CUTLASS) beside them.
build() {  # SRC DIR LOG
  local t0
  t0=$(date +%s)
  cmake -S "$1" -B "$2" "${cmake_args[@]}" >"$OUT/$3" 2>&1 &&
    cmake --build "$2" -j "$JOBS" --target moeblaze_cli >>"$OUT/$3" 2>&1 || {
      grep -E "error" "$OUT/$3" | head -20; echo "ab_builds: build of $1 FAILED"; exit 1; }
  echo "ab_builds: built $1 in $(( $(date +%s) - t0 )) s"
}
src_a=/tmp/ab-base-src
rm -rf "$src_a" && mkdir -p "$src_a"
git archive "$BASE" | tar x -C "$src_a"
[ -d third_party ] && { rm -rf "$src_a/third_party"; ln -s "$(pwd)/third_party" "$src_a/third_party"; }
build "$src_a" "$A_DIR" ab-build-a.log
[ -x "$B_DIR/moeblaze" ] || build "$(pwd)" "$B_DIR" ab-build-b.log

run() {  # LABEL DIR
  echo "== $1 ($2): moeblaze $*" >>"$OUT/ab.log"
  MOEBLAZE_COMMIT=$1 "$2/moeblaze" "${ARGS[@]}" --out "$OUT/ab.jsonl" >>"$OUT/ab.log" 2>&1 ||
    { echo "ab_builds: $1 FAILED (ab.log)"; exit 1; }
}
ARGS=("$@")
for ((r = 0; r < ROUNDS; ++r)); do
  if ((r % 2 == 0)); then run "$A_LABEL" "$A_DIR"; run "$B_LABEL" "$B_DIR"
  else run "$B_LABEL" "$B_DIR"; run "$A_LABEL" "$A_DIR"; fi
  echo "ab_builds: round $((r + 1)) of $ROUNDS done"
done
