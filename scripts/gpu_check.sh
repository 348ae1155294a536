#!/usr/bin/env bash
# The one full GPU check: configure with CUDA, build, run the tests (CPU and `gpu`-labelled),
# then the GPU benchmarks, writing logs and JSON lines into the output folder and printing a
# short table last.
#
#   scripts/gpu_check.sh OUT [PART ...]
#     PART: all (default) | tests | gpu-tests | gpu-gtests | routing-tests | routing | layer | gemm
#           | ep | python | peers | sanitize | fuzz-long | sanitize-fuzz | search | layer-search | peers-grid
#           | model-step | sweep
#       tests          ctest, every test (CPU and GPU)          → OUT/ctest.log
#       gpu-tests      (not in `all`) the quick GPU check: moeblaze_gpu_tests (GTEST_FILTER picks
#                      some) and the CUDA pytests (python/tests -k "gpu or cuda")
#                                                               → OUT/gpu_tests.log, gpu_pytest.log
#       gpu-gtests     (not in `all`) gpu-tests' gtests alone, no package install and pytests
#       routing-tests  only the GPU routing tests (gtest filter) → OUT/routing_tests.log
#       routing        moeblaze bench routing                   → OUT/routing.jsonl, routing.md
#       layer          moeblaze bench layer + bench/torch_reference.py → OUT/layer.jsonl
#       gemm           moeblaze bench gemm: the six grouped GEMMs alone → OUT/gemm.jsonl, gemm.md
#       ep             expert parallelism over NCCL: the EpNccl GPU tests → OUT/ep_tests.log, and
#                      moeblaze bench ep (tokens/s and exchange share at 1, 2, 4, 8 GPUs, weak and
#                      strong scaling) → OUT/ep.jsonl, ep.md; EP_BENCH_ARGS adds flags (e.g.
#                      "--config olmoe --gpus 1,2"). Each under a timeout (300 s, 400 s): a rank
#                      blocked in NCCL must not hold the check.
#       python         the PyTorch package: pip install (no network) with libmoeblaze_capi.so from
#                      BUILD_DIR, its pytest suite (GPU tests included), the training proofs
#                      (examples/prove_training.py, ~4 min) → OUT/python.log, training.json,
#                      training.md, loss_curves.png, nrf_curves.png (loss_curves.json,
#                      nrf_curves.json where matplotlib is missing). PROVE_ARGS adds flags
#                      (e.g. "--quick" or "--parts a"); PYTEST_ARGS likewise (e.g. "-k gpu").
#                      pytest comes from BUILD_DIR/wheels or third_party/gpudeps/wheels when
#                      the machine's Python lacks it (pip download pytest -d DIR/wheels).
#                      PYTHON_ALLOW_CPU=1 accepts a CPU-only library (to try the part without a GPU).
#       peers          bench/peers.py: moeblaze through PyTorch, SonicMoE (SONICMOE_CARRY, or
#                      SONICMOE_SITE=/tmp/sonicmoe-site where an earlier run on the same
#                      machine ran `source .sonic/install.sh`, so SonicMoE's 54 MiB need not be
#                      copied again with the tree; recompressing its cutlass_dsl.tar.xz with
#                      `xz -9e` (52 MB) keeps that copy small beside the tree and
#                      .device/third_party.tar.xz, building on the GPU machine), torch, and
#                      the C++ path, same inputs → OUT/peers.jsonl, peers.md; PEERS_ARGS adds flags.
#                      SonicMoE's autotune results (its first call at a shape otherwise searches
#                      for minutes) are restored from bench/cache/sonicmoe-autotune.tgz and
#                      written back, with this run's additions, to OUT/sonicmoe-autotune.tgz
#                      (commit that file over the old one; PEERS_TIMEOUT=S stops peers.py after S
#                      seconds so the file is still written when autotuning outlasts the call).
#       sanitize       compute-sanitizer (not in `all`: ~5 min): --tool memcheck over the small-shape
#                      GPU tests (SANITIZE_FILTER below; no EP/NCCL, no big grids: sanitized
#                      kernels run 10-100x slower), then over moeblaze bench layer --shape
#                      512,256,128,16,4 --reps 20 --impl moeblaze,moeblaze-recompute, then
#                      --tool racecheck over LayerGpu.AggregateRowsMatchesHostInFixedOrder; each
#                      under a timeout (300, 240, 180 s) → OUT/sanitize.log, and one summary line
#                      with each run's "ERROR SUMMARY" count. SANITIZE_FILTER replaces the filter.
#       fuzz-long      (not in `all`) the GPU shape fuzz's long round: GpuFuzz.* with
#                      MOEBLAZE_GPU_FUZZ_CASES=${FUZZ_CASES:-2000} and the big sizes
#                      (MOEBLAZE_GPU_FUZZ_BIG=1), under a timeout of ${FUZZ_TIMEOUT:-3600} s
#                      → OUT/fuzz_long.log; FUZZ_SEED fixes the first case's seed (default: a
#                      fresh one, printed in the log; a failing case prints its own replay line);
#                      FUZZ_JOBS=J runs the cases in J processes at once (the host reference
#                      is the slow part: one core each).
#       search         (not in `all`) moeblaze bench gemm --search over the public-model grid and
#                      17 random shapes (SEARCH_CONFIGS replaces them): each GEMM's automatic
#                      kernel against the fastest legal candidate → OUT/search.log (the table),
#                      search.jsonl ("kernel-search" rows), search_progress.log. About 20 s a grid
#                      shape on an H100 (3137ddf, one pass a kernel): split the
#                      42 shapes over calls with SEARCH_SLICE=i/k (every k-th shape from the
#                      i-th, so each part mixes big and small ones) or SEARCH_CONFIGS, to stay
#                      within 10 minutes each
#       layer-search   (not in `all`) moeblaze bench layer --search over the same shapes
#                      (LAYER_SEARCH_CONFIGS, else SEARCH_CONFIGS, replaces them; SEARCH_SLICE splits
#                      them): every legal kernel of each GEMM timed inside the real keep_h call
#                      against the automatic choice → OUT/layer_search.log (the table),
#                      layer_search.jsonl ("layer-search" rows), layer_search_progress.log
#       sanitize-fuzz  (not in `all`) compute-sanitizer over the fuzz's short round: memcheck,
#                      racecheck and initcheck over GpuFuzz.* (MOEBLAZE_GPU_FUZZ_CASES=
#                      ${SANITIZE_FUZZ_CASES:-25}: sanitized kernels run 10-100x slower; 100 is the
#                      suite's short round) from seed ${FUZZ_SEED:-1}, the same cases for each tool,
#                      then synccheck over the GEMM tests whose kernels synchronise warpgroups
#                      through named and ordered barriers (the TMA grouped GEMMs, the
#                      warp-specialised ping-pong schedule, the 2-CTA weight gradients;
#                      SYNCCHECK_FILTER replaces the filter), and initcheck over two TMA writes
#                      alone (TmaDescriptorCopy.*: a descriptor copy and a tile store, which
#                      must pass with every report inside those two test kernels: the tool
#                      counts TMA writes as unwritten); so the initcheck fuzz run stores no
#                      output by TMA (down / dx on the ws kernels, FP8 cases in bf16);
#                      each under ${SANITIZE_FUZZ_TIMEOUT:-1200} s (an H100 at 21b5cd3: 254 s
#                      for 25 cases, the three fuzz tools at once)
#                      → OUT/sanitize_fuzz.log (sanitize's format: one summary line of error counts).
#                      SANITIZE_TOOLS picks some of "memcheck racecheck initcheck synccheck" (all
#                      four by default; initcheck is by far the slowest).
#       sweep          (not in `all`) bench/override_sweep.py: kernel overrides side by side in
#                      alternated rounds, SWEEP_SPECS (required; ';'-separated MOEBLAZE_KERNELS
#                      specs, "" first for the automatic choice) over SWEEP_CONFIGS and, for
#                      SWEEP_BENCH=layer, SWEEP_SHAPES; SWEEP_BENCH=gemm (default) times
#                      SWEEP_ONLY's GEMMs (default: every GEMM's automatic choice);
#                      SWEEP_ROUNDS (default 2), stopped after SWEEP_TIMEOUT s (default 480)
#                      with what it measured kept → OUT/sweep.jsonl, sweep.md, sweep.log
#       peers-grid     (not in `all`) bench/peers.py over the public-model grid shapes that no
#                      committed bench/results/sonicmoe-grid-*.jsonl holds yet (PEERS_GRID names
#                      others), smallest layer first: moeblaze through PyTorch, SonicMoE and
#                      torch, alternated, 10 repetitions → OUT/peers_grid.jsonl, peers_grid.log.
#                      SonicMoE as for peers; its first shape compiles every candidate config
#                      (minutes), later ones take about a minute each, so PEERS_TIMEOUT=S stops
#                      it in time for the autotune file to be written; commit the rows as a new
#                      sonicmoe-grid file (and its name in bench/report.py's SONIC_GRIDS) and
#                      the set grows from run to run.
#       step-grid      (not in `all`) bench/step_kernels.py at the grid shapes where SonicMoE has
#                      rows (bench/results/sonicmoe-grid-*.jsonl; STEP_GRID names others): one
#                      profiled step's kernels of moeblaze through PyTorch and of SonicMoE on the
#                      same inputs, each GEMM's time inside the step → OUT/step_grid.md,
#                      step_grid.json, step_grid.log (STEP_GRID_TIMEOUT=S stops it). SonicMoE as
#                      for peers.
#       model-step     (not in `all`) bench/model_step.py: whole Hugging Face models (Qwen3-MoE,
#                      Mixtral, OLMoE, DeepSeek-V3, gpt-oss), one training step per experts
#                      implementation (grouped_mm, sonicmoe, moeblaze) → OUT/model_step.jsonl,
#                      model_step.md, model_step.log. SonicMoE as for peers (SONICMOE_CARRY or
#                      SONICMOE_SITE; its package stands in for transformers' hub kernel, and its
#                      autotune file is written back the same way); MODEL_STEP_ARGS adds flags
#                      (e.g. "--family qwen3_moe,olmoe"), MODEL_STEP_TIMEOUT=S stops it after S s.
#   scripts/gpu_check.sh --pack-deps
#     copies GoogleTest and CLI11 (headers, static libs) from this machine into
#     third_party/gpudeps, for a GPU machine that has a CUDA toolkit but no such packages; the
#     check uses them when the machine lacks its own. Copy third_party/ to the GPU machine, or
#     (where the copy must stay small, beside SonicMoE's 58 MB) the 0.9 MB
#     .device/third_party.tar.xz this also writes (CUTLASS's headers only): the check unpacks it
#     where third_party/ is missing.
#
# Every run logs the SM clock, power and temperature every 500 ms (nvidia-smi) → OUT/gpu_clocks.csv,
# summarised in one line of the summary.
#
# Environment: PACK=1 (leave only gpu_check.tgz, summary.txt, the *.md / *.png tables and SonicMoE's
# autotune file in OUT),
# ROUTING_BENCH_ARGS (extra flags for bench routing, e.g. "--quick"),
# MOEBLAZE_COMMIT (commit recorded in result rows; set it when the tree was copied with a .git
# that is not the tree's own — a copy that kept an older HEAD — else
# `git describe --dirty` marks such a tree "<stale HEAD>-dirty"), BUILD_DIR
# (default build-gpu), JOBS (default nproc), PREBUILT=1 (use the binaries already in BUILD_DIR,
# e.g. built on a CPU machine with nvcc and carried over: skips configure and build, and runs
# the test binaries directly instead of through ctest, whose files hold the build machine's
# paths; saves device time).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--pack-deps" ]; then
  dst=third_party/gpudeps
  rm -rf "$dst" && mkdir -p "$dst/include" "$dst/lib"
  cp -r /usr/include/gtest /usr/include/CLI "$dst/include/"
  [ -d /usr/include/gmock ] && cp -r /usr/include/gmock "$dst/include/"
  cp /usr/lib/x86_64-linux-gnu/libgtest.a /usr/lib/x86_64-linux-gnu/libgtest_main.a "$dst/lib/"
  # pytest (pure-Python wheels) for the python part, where the GPU machine's Python lacks it.
  python3 -m pip download -q -d "$dst/wheels" pytest >/dev/null 2>&1 ||
    echo "gpu_check: could not download the pytest wheels (the python part needs pytest there)"
  echo "gpu_check: packed $(du -sh "$dst" | cut -f1) into $dst"
  # CUTLASS's headers alone (the project's H200 image has GoogleTest, CLI11 and pytest): 0.9 MB.
  mkdir -p .device
  tar cf - -C third_party cutlass/cutlass_library/source/include | xz -T0 -9e \
    >.device/third_party.tar.xz
  echo "gpu_check: and $(du -sh .device/third_party.tar.xz | cut -f1) into .device/third_party.tar.xz"
  exit 0
fi
if [ ! -d third_party/cutlass ] && [ -f .device/third_party.tar.xz ]; then
  mkdir -p third_party && tar xJf .device/third_party.tar.xz -C third_party
fi

OUT=${1:?usage: scripts/gpu_check.sh OUT [all|tests|routing-tests|routing|layer|sanitize ...]}
shift
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(all)
known_parts=" all tests gpu-tests gpu-gtests routing-tests routing layer gemm ep python peers sanitize \
fuzz-long sanitize-fuzz search layer-search peers-grid step-grid model-step sweep "
for p in "${parts[@]}"; do
  case "$known_parts" in
    *" $p "*) ;;
    *) echo "gpu_check: unknown PART '$p'; one of:$known_parts" >&2; exit 2 ;;
  esac
done
want() {
  local p
  for p in "${parts[@]}"; do [ "$p" = all ] || [ "$p" = "$1" ] && return 0; done
  return 1
}
# A part that `all` leaves out (it must be named).
want_named() {
  local p
  for p in "${parts[@]}"; do [ "$p" = "$1" ] && return 0; done
  return 1
}
# sweep without its specs, or with a bench it does not know, would build and then time nothing.
if want_named sweep; then
  [ -n "${SWEEP_SPECS:-}" ] || {
    echo "gpu_check: sweep needs SWEEP_SPECS (';'-separated MOEBLAZE_KERNELS specs)" >&2; exit 2; }
  case "${SWEEP_BENCH:-gemm}" in
    gemm|layer) ;;
    *) echo "gpu_check: SWEEP_BENCH must be gemm or layer (got '${SWEEP_BENCH}')" >&2; exit 2 ;;
  esac
fi

export PATH="$PATH:/usr/local/cuda/bin"
# The binaries link NCCL (expert parallelism). Where NCCL ships only inside PyTorch's wheels (the
# project's H200 image), point the loader at it; CUDA's own lib folders first.
nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)
export LD_LIBRARY_PATH="/usr/local/cuda/lib:/usr/local/cuda/lib64${nccl_dir:+:$nccl_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# NVLink multicast stays off on shared multi-GPU hosts (the device README says why).
export NCCL_NVLS_ENABLE=0
BUILD=${BUILD_DIR:-build-gpu}
JOBS=${JOBS:-$(nproc)}
export MOEBLAZE_COMMIT=${MOEBLAZE_COMMIT:-$(git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown)}
summary=()

# ---- configure (packed deps only where the machine has none of its own) ----
cmake_args=(-DMOEBLAZE_CUDA=ON -DCMAKE_BUILD_TYPE=Release)
command -v ninja >/dev/null && cmake_args+=(-G Ninja)
if [ ! -f /usr/include/gtest/gtest.h ] && [ -d third_party/gpudeps ]; then
  deps=$(pwd)/third_party/gpudeps
  cmake_args+=(-DGTEST_ROOT="$deps" -DGTest_ROOT="$deps" -DCLI11_INCLUDE_DIR="$deps/include")
fi
start=$(date +%s)
if [ -z "${PREBUILT:-}" ]; then
  cmake -S . -B "$BUILD" "${cmake_args[@]}" >"$OUT/configure.log" 2>&1 || {
    tail -30 "$OUT/configure.log"; echo "gpu_check: configure FAILED"; exit 1; }

  # ---- build only what the requested parts need ----
  targets=(moeblaze_cli)
  if want tests; then targets+=(moeblaze_tests moeblaze_gpu_tests); fi
  if want_named gpu-tests; then targets+=(moeblaze_gpu_tests moeblaze_capi); fi
  if want_named gpu-gtests; then targets+=(moeblaze_gpu_tests); fi
  if want routing-tests; then targets+=(moeblaze_gpu_tests); fi
  if want ep; then targets+=(moeblaze_gpu_tests); fi
  if want_named sanitize; then targets+=(moeblaze_gpu_tests); fi
  if want_named fuzz-long || want_named sanitize-fuzz; then targets+=(moeblaze_gpu_tests); fi
  # every part that installs the PyTorch package (install_python) links this library
  if want python || want peers || want_named peers-grid || want_named step-grid ||
      want_named model-step; then
    targets+=(moeblaze_capi)
  fi
  cmake --build "$BUILD" -j "$JOBS" --target "${targets[@]}" >"$OUT/build.log" 2>&1 || {
    # a failed build may print no "error" line: grep's status must not end the script here
    { grep -E "error|Error" "$OUT/build.log" || tail -20 "$OUT/build.log"; } | head -40
    echo "gpu_check: build FAILED"; exit 1; }
  summary+=("build: ok in $(( $(date +%s) - start )) s (${targets[*]})")
else
  # Only the binaries the requested parts run (a carried build folder stays small).
  need=()
  if want tests; then need+=(moeblaze_tests moeblaze_gpu_tests); fi
  if want routing-tests || want ep || want_named sanitize || want_named gpu-tests ||
      want_named gpu-gtests || want_named fuzz-long || want_named sanitize-fuzz; then
    need+=(moeblaze_gpu_tests)
  fi
  if want routing || want layer || want gemm || want ep || want_named sanitize ||
      want_named search || want_named layer-search || want_named sweep; then need+=(moeblaze); fi
  for b in "${need[@]}"; do
    [ -x "$BUILD/$b" ] || { echo "gpu_check: PREBUILT set but $BUILD/$b is missing"; exit 1; }
  done
  summary+=("build: prebuilt binaries in $BUILD")
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv \
  >"$OUT/gpu.txt" 2>/dev/null || printf 'gpu\nnone visible (nvidia-smi failed)\n' >"$OUT/gpu.txt"
# The SM clock, power and temperature every 500 ms over the whole check (OUT/gpu_clocks.csv, one
# summary line): the clock under the power limit depends on the work and its operands, so
# timings from different calls compare only beside the clocks they ran at.
clock_pid=
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits \
    -lms 500 >"$OUT/gpu_clocks.csv" 2>/dev/null &
  clock_pid=$!
  trap 'kill "$clock_pid" 2>/dev/null || true' EXIT
fi

status=0
# ---- tests ----
if want tests; then
  t0=$(date +%s)
  if [ -n "${PREBUILT:-}" ]; then
    for b in moeblaze_tests moeblaze_gpu_tests; do
      if "$BUILD/$b" >"$OUT/$b.log" 2>&1; then
        summary+=("$b: $(grep -E '^\[  PASSED  \]|^\[  SKIPPED \]' "$OUT/$b.log" | tr '\n' ' ')[$(( $(date +%s) - t0 )) s]")
      else
        status=1
        grep -E "^\[  FAILED  \]|Failure" "$OUT/$b.log" | head -30 || true
        summary+=("$b: FAILED (see $b.log)")
      fi
    done
  elif (cd "$BUILD" && ctest --output-on-failure --timeout 900 -j 4) >"$OUT/ctest.log" 2>&1; then
    summary+=("ctest: $(grep -E 'tests passed' "$OUT/ctest.log" | tail -1) [$(( $(date +%s) - t0 )) s]")
  else
    status=1
    summary+=("ctest: FAILED: $(grep -E 'tests passed|tests failed' "$OUT/ctest.log" | tail -1)")
    grep -E "\(Failed\)|\(SEGFAULT\)|\(Timeout\)|Exception" "$OUT/ctest.log" | head -20 || true
  fi
fi
# One run of the GPU gtests: LABEL FILTER LOG SECONDS (empty FILTER: all of them).
run_gpu_gtests() {
  local label=$1 filter=$2 log=$3 secs=$4 t0
  t0=$(date +%s)
  # GoogleTest reads GTEST_FILTER from the environment too, where an empty one runs no test.
  if env -u GTEST_FILTER timeout "$secs" "$BUILD/moeblaze_gpu_tests" ${filter:+--gtest_filter="$filter"} \
      >"$OUT/$log" 2>&1; then
    summary+=("$label: $(grep -E '^\[  PASSED  \]' "$OUT/$log") [$(( $(date +%s) - t0 )) s]")
  else
    status=1
    grep -E "^\[  FAILED  \]|Failure|what\(\)" "$OUT/$log" | head -30 || true
    summary+=("$label: FAILED (see $log)")
  fi
}
if want routing-tests && ! want tests; then
  run_gpu_gtests "routing tests" 'RoutingPlanGpu*:RouterGpu*:TokenRoundingGpu*' routing_tests.log 600
fi
# ---- gpu-tests: the GPU gtests alone, then (after the package install below) the CUDA pytests ----
if want_named gpu-tests || want_named gpu-gtests; then
  run_gpu_gtests "gpu gtests" "${GTEST_FILTER:-}" gpu_tests.log 600
fi

# ---- benchmarks ----
if want routing; then
  t0=$(date +%s)
  rm -f "$OUT/routing.jsonl"
  # shellcheck disable=SC2086
  if "$BUILD/moeblaze" bench routing --out "$OUT/routing.jsonl" --md "$OUT/routing.md" \
      ${ROUTING_BENCH_ARGS:-} >"$OUT/routing_bench.log" 2>&1; then
    summary+=("bench routing: $(wc -l <"$OUT/routing.jsonl") rows [$(( $(date +%s) - t0 )) s]")
  else
    status=1
    tail -20 "$OUT/routing_bench.log"
    summary+=("bench routing: FAILED (see routing_bench.log)")
  fi
fi

# ---- layer: moeblaze bench layer (moeblaze, recompute, materialized, dense-bound; the eight
# steps alone; aggregation vs copy) and the torch._grouped_mm baseline → OUT/layer.jsonl ----
# LAYER_CONFIGS (default all) picks the configs of both; LAYER_BENCH_ARGS adds flags.
if want layer; then
  t0=$(date +%s)
  rm -f "$OUT/layer.jsonl"
  # shellcheck disable=SC2086
  if "$BUILD/moeblaze" bench layer --config "${LAYER_CONFIGS:-all}" --breakdown \
      --out "$OUT/layer.jsonl" ${LAYER_BENCH_ARGS:-} >"$OUT/layer_bench.log" 2>&1; then
    summary+=("bench layer: $(grep -c '"bench": "layer"' "$OUT/layer.jsonl" || true) rows [$(( $(date +%s) - t0 )) s]")
  else
    status=1
    tail -20 "$OUT/layer_bench.log"
    summary+=("bench layer: FAILED (see layer_bench.log)")
  fi
  t0=$(date +%s)
  if command -v python3 >/dev/null && python3 -c "import torch" 2>/dev/null; then
    if PYTHONUNBUFFERED=1 python3 bench/torch_reference.py --config "${LAYER_CONFIGS:-all}" \
        --out "$OUT/layer.jsonl" >"$OUT/torch_bench.log" 2>&1; then
      summary+=("torch reference: ok [$(( $(date +%s) - t0 )) s]")
    else
      status=1
      tail -10 "$OUT/torch_bench.log"
      summary+=("torch reference: FAILED (see torch_bench.log)")
    fi
  else
    summary+=("torch reference: skipped (no torch)")
  fi
fi

# ---- gemm: moeblaze bench gemm (the six grouped GEMMs alone, cuBLAS same-FLOP column);
# GEMM_BENCH_ARGS adds flags (e.g. "--configs gemm-big") ----
if want gemm; then
  t0=$(date +%s)
  rm -f "$OUT/gemm.jsonl"
  # shellcheck disable=SC2086
  if "$BUILD/moeblaze" bench gemm --out "$OUT/gemm.jsonl" --md "$OUT/gemm.md" \
      ${GEMM_BENCH_ARGS:-} >"$OUT/gemm_bench.log" 2>&1; then
    summary+=("bench gemm: $(wc -l <"$OUT/gemm.jsonl") rows [$(( $(date +%s) - t0 )) s]")
  else
    status=1
    tail -20 "$OUT/gemm_bench.log"
    summary+=("bench gemm: FAILED (see gemm_bench.log)")
  fi
fi

# ---- ep: expert parallelism over NCCL, one process and one thread per GPU: the EpNccl tests
# (2, 4, 8 of the visible GPUs; they skip below 2) and moeblaze bench ep (against one GPU) ----
if want ep; then
  t0=$(date +%s)
  if timeout 300 "$BUILD/moeblaze_gpu_tests" --gtest_filter='EpNccl*' >"$OUT/ep_tests.log" 2>&1; then
    summary+=("ep tests: $(grep -E '^\[  PASSED  \]|^\[  SKIPPED \] [0-9]+ test' "$OUT/ep_tests.log" | tr '\n' ' ')[$(( $(date +%s) - t0 )) s]")
  else
    rc=$?
    status=1
    grep -E "Failure|FAILED|error|what\(\)" "$OUT/ep_tests.log" | head -30 || true
    if [ $rc -eq 124 ]; then summary+=("ep tests: TIMED OUT after 300 s (see ep_tests.log)")
    else summary+=("ep tests: FAILED (see ep_tests.log)"); fi
  fi
  t0=$(date +%s)
  rm -f "$OUT/ep.jsonl"
  # shellcheck disable=SC2086
  if timeout 400 "$BUILD/moeblaze" bench ep --json --md "$OUT/ep.md" ${EP_BENCH_ARGS:-} \
      >"$OUT/ep.jsonl" 2>"$OUT/ep_bench.log"; then
    summary+=("bench ep: $(grep -c '"bench": "ep"' "$OUT/ep.jsonl" || true) rows [$(( $(date +%s) - t0 )) s]")
  else
    rc=$?
    status=1
    tail -20 "$OUT/ep_bench.log"
    if [ $rc -eq 124 ]; then summary+=("bench ep: TIMED OUT after 400 s (see ep_bench.log)")
    else summary+=("bench ep: FAILED (see ep_bench.log)"); fi
  fi
fi

# ---- search: moeblaze bench gemm --search, every bf16 candidate of each GEMM against the
# automatic choice (not in `all`). SEARCH_CONFIGS replaces the shapes: by default the
# public-model grid and 17 shapes drawn once at random (seed 20261205: d and n multiples of 64 in
# [512, 7168] and [192, 4096], E from 8 to 512, K up to 10, T in [4096, 16384], half of them
# multiples of 128; 8 n and 9 T not multiples of 128) ----
SEARCH_RANDOM='T4352-d576-n3136-E96-K10,T5832-d3712-n1984-E256-K3,T10624-d2624-n768-E160-K1,T5632-d3904-n1536-E40-K6,T12715-d2048-n3584-E60-K6,T15104-d5184-n960-E384-K9,T13916-d1216-n2112-E96-K2,T12711-d4608-n3200-E64-K10,T5120-d6720-n2240-E128-K4,T6272-d4480-n1856-E8-K4,T10112-d6656-n3392-E16-K10,T12800-d2432-n3008-E128-K3,T7694-d1280-n2496-E512-K3,T4133-d3840-n1024-E256-K1,T5376-d2752-n1472-E64-K5,T14331-d6912-n2240-E16-K4,T10624-d1792-n3136-E32-K7'
if want_named search; then
  t0=$(date +%s)
  rc=0
  "$BUILD/moeblaze" bench gemm --search --no-dense --reps 20 --warmup 2 \
    --configs "${SEARCH_CONFIGS:-grid,$SEARCH_RANDOM}" --slice "${SEARCH_SLICE:-1/1}" \
    --out "$OUT/search.jsonl" \
    >"$OUT/search.log" 2>"$OUT/search_progress.log" || rc=$?
  line=$(grep -E '^choice / best over|^auto / choice' "$OUT/search.log" | paste -sd ';' - || true)
  if [ $rc -eq 0 ]; then summary+=("kernel search: ${line:-no summary} [$(( $(date +%s) - t0 )) s]")
  else status=1; tail -5 "$OUT/search_progress.log"; summary+=("kernel search: FAILED rc $rc (search_progress.log)"); fi
fi

# ---- layer-search: the same candidates timed inside the real layer call (bench layer --search;
# docs/notes/gathered-gemms.md, "Each GEMM inside the layer call"; not in `all`) ----
if want_named layer-search; then
  t0=$(date +%s)
  rc=0
  "$BUILD/moeblaze" bench layer --search --reps 20 --warmup 1 \
    --config "${LAYER_SEARCH_CONFIGS:-${SEARCH_CONFIGS:-grid,$SEARCH_RANDOM}}" \
    --slice "${SEARCH_SLICE:-1/1}" --out "$OUT/layer_search.jsonl" \
    >"$OUT/layer_search.log" 2>"$OUT/layer_search_progress.log" || rc=$?
  if [ $rc -eq 0 ]; then
    summary+=("layer search: $(grep -c '"bench": "layer-search"' "$OUT/layer_search.jsonl" || true) rows [$(( $(date +%s) - t0 )) s]")
  else status=1; tail -5 "$OUT/layer_search_progress.log"; summary+=("layer search: FAILED rc $rc (layer_search_progress.log)"); fi
fi

# ---- sweep: kernel overrides side by side (bench/override_sweep.py), alternated rounds ----
if want_named sweep; then
  t0=$(date +%s)
  rc=0
  sweep_args=(--cli "$BUILD/moeblaze" --bench "${SWEEP_BENCH:-gemm}" --specs "$SWEEP_SPECS"
              --rounds "${SWEEP_ROUNDS:-2}" --out "$OUT/sweep.jsonl" --md "$OUT/sweep.md")
  [ -n "${SWEEP_CONFIGS:-}" ] && sweep_args+=(--configs "$SWEEP_CONFIGS")
  [ -n "${SWEEP_SHAPES:-}" ] && sweep_args+=(--shapes "$SWEEP_SHAPES")
  [ "${SWEEP_BENCH:-gemm}" = gemm ] &&
    sweep_args+=(--only "${SWEEP_ONLY:-up-auto,down-auto,dH-auto,dW2-auto,dX-auto,dW1-auto}")
  rm -f "$OUT/sweep.jsonl"
  timeout "${SWEEP_TIMEOUT:-480}" python3 bench/override_sweep.py "${sweep_args[@]}" \
    >"$OUT/sweep.log" 2>&1 || rc=$?
  if [ $rc -eq 0 ]; then summary+=("sweep: $(wc -l <"$OUT/sweep.jsonl") rows [$(( $(date +%s) - t0 )) s]")
  else status=1; tail -5 "$OUT/sweep.log"; summary+=("sweep: FAILED or stopped rc $rc, $( [ -f "$OUT/sweep.jsonl" ] && wc -l <"$OUT/sweep.jsonl" || echo 0) rows kept (sweep.log)"); fi
fi

# ---- sanitize: compute-sanitizer memcheck over small GPU tests and one layer bench, racecheck
# over one small kernel test; every run appends to OUT/sanitize.log ----
SANITIZE_FILTER=${SANITIZE_FILTER:-'PlanValidateGpu.*:RoutingPlanGpu.EdgeCases:RoutingPlanGpu.BadRoutingRaisesFlagsAndClearErrors:RouterGpu.EmptyBatch:RouterGpu.ExactTiesBreakToTheLowerExpertId:RouterGpu.NonFiniteLogitsAreRejectedWithTheCpuMessage:TokenRoundingGpu.TiesAndSmallBatches:LayerGpu.EmptyTokensAndEmptyPlan:LayerGpu.AggregateRowsMatchesHostInFixedOrder:LayerGpu.DPairWeightsGatherIsExact:LayerGpu.RejectsWhatTheGpuPathCannotTakeAndLeavesOutputsUntouched:GroupedGemmEdge.*:GroupedGemmChecks.InvalidArgumentsLeaveOutputsUntouched'}
# One sanitized run: NAME SECONDS TOOL CMD...; appends "NAME: <errors> errors" (or why not).
# Its output goes to $sanitize_log (OUT/sanitize.log; sanitize-fuzz's OUT/sanitize_fuzz.log).
sanitize_log="$OUT/sanitize.log"
sanitize_run() {
  local name=$1 secs=$2 tool=$3 rc=0 from
  shift 3
  from=$(( $(wc -l <"$sanitize_log") + 1 ))  # this run's lines only
  echo "==== $name: compute-sanitizer --tool $tool $* ====" >>"$sanitize_log"
  timeout "$secs" compute-sanitizer --tool "$tool" --error-exitcode 99 "$@" \
    >>"$sanitize_log" 2>&1 || rc=$?
  local errs
  # memcheck, initcheck, synccheck: "ERROR SUMMARY: N errors" (not the "N errors were not
  # printed" line after it); racecheck: "RACECHECK SUMMARY: H hazards displayed (N errors, W
  # warnings)".
  errs=$(tail -n +"$from" "$sanitize_log" |
         grep -E '^========= (ERROR SUMMARY: [0-9]+ errors?$|RACECHECK SUMMARY: .*\([0-9]+ error)' |
         tail -1 | sed -E 's/.*ERROR SUMMARY: ([0-9]+) error.*/\1/; s/.*\(([0-9]+) error.*/\1/' || true)
  if [ $rc -eq 124 ]; then sanitize_parts+=("$name TIMED OUT after $secs s"); status=1
  elif [ $rc -eq 99 ]; then sanitize_parts+=("$name ${errs:-?} errors"); status=1
  elif [ $rc -ne 0 ]; then sanitize_parts+=("$name FAILED rc $rc (${errs:-?} errors)"); status=1
  else sanitize_parts+=("$name ${errs:-?} errors"); fi
  echo "==== $name: rc $rc ====" >>"$sanitize_log"
}
if want_named sanitize; then
  t0=$(date +%s)
  : >"$OUT/sanitize.log"
  sanitize_parts=()
  if ! command -v compute-sanitizer >/dev/null; then
    status=1
    summary+=("sanitize: FAILED: compute-sanitizer not found (PATH has /usr/local/cuda/bin)")
  else
    sanitize_run "memcheck tests" 300 memcheck "$BUILD/moeblaze_gpu_tests" \
      --gtest_filter="$SANITIZE_FILTER"
    sanitize_run "memcheck bench layer" 240 memcheck "$BUILD/moeblaze" bench layer \
      --shape 512,256,128,16,4 --reps 20 --impl moeblaze,moeblaze-recompute
    sanitize_run "racecheck aggregate" 180 racecheck "$BUILD/moeblaze_gpu_tests" \
      --gtest_filter='LayerGpu.AggregateRowsMatchesHostInFixedOrder'
    summary+=("sanitize: $(IFS=';'; echo "${sanitize_parts[*]}") [$(( $(date +%s) - t0 )) s] (sanitize.log)")
  fi
fi

# ---- fuzz-long: the GPU shape fuzz's long round (tests/gpu/test_fuzz_gpu.cpp) ----
if want_named fuzz-long; then
  t0=$(date +%s)
  rc=0
  # FUZZ_JOBS processes share the cases (case i has seed first + i, so job j runs the cases
  # from first + j * per): the float64 reference is host work, one core each; their logs are
  # appended to OUT/fuzz_long.log one after the other.
  jobs=${FUZZ_JOBS:-1} cases=${FUZZ_CASES:-2000}
  first=${FUZZ_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}
  per=$(( (cases + jobs - 1) / jobs ))
  pids=()
  for (( j = 0; j < jobs; ++j )); do
    n=$(( cases - j * per < per ? cases - j * per : per ))
    (( n > 0 )) || break
    env -u GTEST_FILTER OMP_NUM_THREADS=1 MOEBLAZE_GPU_FUZZ_CASES=$n MOEBLAZE_GPU_FUZZ_BIG=1 \
      MOEBLAZE_GPU_FUZZ_SEED=$(( first + j * per )) \
      timeout "${FUZZ_TIMEOUT:-3600}" "$BUILD/moeblaze_gpu_tests" --gtest_filter='GpuFuzz.*' \
      >"$OUT/fuzz_long.$j.log" 2>&1 &
    pids+=($!)
  done
  : >"$OUT/fuzz_long.log"
  valid=0 refused=0 failed=0
  for j in "${!pids[@]}"; do
    wait "${pids[$j]}" || { r=$?; [ $rc -ne 0 ] || rc=$r; }  # the first failure's code
    cat "$OUT/fuzz_long.$j.log" >>"$OUT/fuzz_long.log" && rm -f "$OUT/fuzz_long.$j.log"
  done
  while read -r v r f; do
    valid=$(( valid + v )); refused=$(( refused + r )); failed=$(( failed + f ))
  done < <(sed -nE 's/^\[gpu fuzz\] ([0-9]+) valid.*, ([0-9]+) refused, ([0-9]+) failed.*/\1 \2 \3/p' \
           "$OUT/fuzz_long.log")
  counts="$(( valid + refused )) cases from seed $first in $jobs jobs: $valid valid, $refused refused, $failed failed"
  grep -qE '^\[gpu fuzz\] [0-9]+ valid' "$OUT/fuzz_long.log" || counts=""
  if [ $rc -eq 0 ]; then
    summary+=("fuzz long: ${counts:-?} [$(( $(date +%s) - t0 )) s]")
  else
    status=1
    grep -E '^\[gpu fuzz\] FAILED' "$OUT/fuzz_long.log" | head -20 || true
    if [ $rc -eq 124 ]; then summary+=("fuzz long: TIMED OUT after ${FUZZ_TIMEOUT:-3600} s (see fuzz_long.log)")
    else summary+=("fuzz long: FAILED: ${counts:-no count line} (see fuzz_long.log)"); fi
  fi
fi

# ---- sanitize-fuzz: memcheck, racecheck, initcheck over the fuzz's short round; synccheck
# over the GEMM tests of the kernels with named / ordered barriers ----
SYNCCHECK_FILTER=${SYNCCHECK_FILTER:-'Cases/GroupedGemm.*/E4_d320_n192_T250_rand_swiglu:Cases/GroupedGemm.*/E8_d1536_n128_T260_rand_relu2'}
if want_named sanitize-fuzz; then
  t0=$(date +%s)
  sanitize_log="$OUT/sanitize_fuzz.log"
  : >"$sanitize_log"
  sanitize_parts=()
  if ! command -v compute-sanitizer >/dev/null; then
    status=1
    summary+=("sanitize fuzz: FAILED: compute-sanitizer not found (PATH has /usr/local/cuda/bin)")
  else
    secs=${SANITIZE_FUZZ_TIMEOUT:-1200}
    # The same cases for every tool: a fixed first seed.
    export MOEBLAZE_GPU_FUZZ_CASES=${SANITIZE_FUZZ_CASES:-25} MOEBLAZE_GPU_FUZZ_SEED=${FUZZ_SEED:-1}
    # The fuzz tools at once, each in a subshell with its own log (a sanitized process keeps
    # one core busy); the logs are joined in this order afterwards.
    picked=" ${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck} "
    tools=()
    for tool in memcheck racecheck initcheck; do
      [[ "$picked" == *" $tool "* ]] && tools+=("$tool")
    done
    pids=()
    for tool in "${tools[@]}"; do
      (
        sanitize_log="$OUT/sanitize_fuzz.$tool.log" && : >"$sanitize_log"
        sanitize_parts=() && status=0
        # initcheck counts TMA writes as unwritten: no output by TMA in its run (the FP8 GEMMs
        # store by TMA whatever the override; docs/notes/gathered-gemms.md).
        [ "$tool" = initcheck ] && export MOEBLAZE_GPU_FUZZ_NO_FP8=1 \
          MOEBLAZE_KERNELS=down.family=ws,dx.family=ws
        sanitize_run "$tool fuzz" "$secs" "$tool" "$BUILD/moeblaze_gpu_tests" \
          --gtest_filter='GpuFuzz.*'
        echo "${sanitize_parts[0]}" >"$OUT/sanitize_fuzz.$tool.part"
        exit $status
      ) &
      pids+=($!)
    done
    for i in "${!pids[@]}"; do wait "${pids[$i]}" || status=1; done
    for tool in "${tools[@]}"; do
      cat "$OUT/sanitize_fuzz.$tool.log" >>"$sanitize_log"
      sanitize_parts+=("$(cat "$OUT/sanitize_fuzz.$tool.part")")
      rm -f "$OUT/sanitize_fuzz.$tool.log" "$OUT/sanitize_fuzz.$tool.part"
    done
    unset MOEBLAZE_GPU_FUZZ_CASES MOEBLAZE_GPU_FUZZ_SEED
    # The two TMA writes alone, into never-written memory, each test checking every byte
    # (tests/gpu/test_tma_descriptor_copy.cu): reports here are the tool's model of those copies.
    # Expected: both tests pass and the tool reports the TMA-written bytes, inside the two test
    # kernels only; a report anywhere else, or a failed test, fails the run.
    if [[ "$picked" == *" initcheck "* ]]; then
      from=$(( $(wc -l <"$sanitize_log") + 1 )) rc=0
      echo "==== initcheck TMA copies: compute-sanitizer --tool initcheck --print-limit 100000" \
        "$BUILD/moeblaze_gpu_tests --gtest_filter=TmaDescriptorCopy.* ====" >>"$sanitize_log"
      timeout 120 compute-sanitizer --tool initcheck --print-limit 100000 \
        "$BUILD/moeblaze_gpu_tests" --gtest_filter='TmaDescriptorCopy.*' >>"$sanitize_log" 2>&1 || rc=$?
      reports=$(tail -n +"$from" "$sanitize_log" | grep -c '^========= Uninitialized' || true)
      elsewhere=$(tail -n +"$from" "$sanitize_log" | grep '^=========  *Device Frame:' |
                  grep -vc 'copy_descriptor_kernel\|load_rows_kernel' || true)
      echo "==== initcheck TMA copies: rc $rc, $reports reports, $elsewhere outside the test kernels ====" \
        >>"$sanitize_log"
      if [ "$rc" -ne 0 ] || [ "$elsewhere" -ne 0 ]; then
        status=1
        sanitize_parts+=("initcheck TMA copies FAILED (rc $rc, $elsewhere of $reports reports outside the test kernels)")
      else
        sanitize_parts+=("initcheck TMA copies: tests passed, $reports reports, all at the TMA-written bytes (the tool's model)")
      fi
    fi
    [[ "$picked" == *" synccheck "* ]] &&
      sanitize_run "synccheck barriers" "$secs" synccheck "$BUILD/moeblaze_gpu_tests" \
        --gtest_filter="$SYNCCHECK_FILTER"
    summary+=("sanitize fuzz: $(IFS=';'; echo "${sanitize_parts[*]}") [$(( $(date +%s) - t0 )) s] (sanitize_fuzz.log)")
  fi
fi

# ---- the PyTorch front end installed without network from the libmoeblaze_capi.so of BUILD_DIR
# (parts python and peers); once per run ----
python_installed=""
install_python() {
  [ -n "$python_installed" ] && return "$python_installed"
  local t0 repo capi pip_rc=0
  t0=$(date +%s)
  repo=$(pwd)
  capi="$repo/$BUILD/libmoeblaze_capi.so"
  [[ "$BUILD" = /* ]] && capi="$BUILD/libmoeblaze_capi.so"
  {
    echo "== python: $(python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1)"
    for wheels in "$BUILD/wheels" third_party/gpudeps/wheels; do
      if ! python3 -c "import pytest" 2>/dev/null && [ -d "$wheels" ]; then
        echo "== pytest from $wheels"
        python3 -m pip install -q --no-index --find-links "$wheels" pytest
      fi
    done
    echo "== pip install (MOEBLAZE_PREBUILT_LIB=$capi)"
    [ -f "$capi" ] || echo "gpu_check: $capi is missing"
    MOEBLAZE_PREBUILT_LIB="$capi" python3 -m pip install --no-build-isolation --no-deps \
      --force-reinstall ./python
  } >>"$OUT/python.log" 2>&1 || pip_rc=$?
  if [ $pip_rc -ne 0 ] || ! (cd /tmp && python3 -c "import os, moeblaze; assert moeblaze.has_cuda() or os.environ.get('PYTHON_ALLOW_CPU'), 'built without CUDA'") >>"$OUT/python.log" 2>&1; then
    status=1
    tail -20 "$OUT/python.log"
    summary+=("python: pip install FAILED (see python.log)")
    python_installed=1
  else
    summary+=("python: pip install ok [$(( $(date +%s) - t0 )) s]")
    python_installed=0
  fi
  return "$python_installed"
}

# ---- gpu-tests, second half: the CUDA pytests of every file, from outside the repository ----
if want_named gpu-tests && install_python; then
  t0=$(date +%s)
  rc=0
  tests_dir=$(pwd)/python/tests
  (cd /tmp && timeout 600 python3 -X faulthandler -m pytest -q -rs -p no:cacheprovider \
    -k "gpu or cuda" "$tests_dir") >"$OUT/gpu_pytest.log" 2>&1 || rc=$?
  if [ $rc -eq 0 ]; then
    summary+=("gpu pytests: $(tail -1 "$OUT/gpu_pytest.log") [$(( $(date +%s) - t0 )) s]")
  else
    status=1
    grep -E "^FAILED|^ERROR|Fatal Python error" "$OUT/gpu_pytest.log" | head -20 || true
    summary+=("gpu pytests: FAILED rc $rc (see gpu_pytest.log)")
  fi
fi

# ---- python: the package's pytest suite, then the training proofs ----
if want python && install_python; then
  repo=$(pwd)
  t0=$(date +%s)
  echo "== pytest, one process per test file (a crash in one file does not hide the others)" \
    >>"$OUT/python.log"
  failed_files=()
  for f in "$repo"/python/tests/test_*.py; do
    echo "== $(basename "$f")" >>"$OUT/python.log"
    # Run from outside the repository so that the installed package is the one imported.
    # shellcheck disable=SC2086
    rc=0
    (cd /tmp && timeout 600 python3 -X faulthandler -m pytest -q -rs -p no:cacheprovider "$f" \
      ${PYTEST_ARGS:-}) >>"$OUT/python.log" 2>&1 || rc=$?
    # 5: pytest collected nothing (e.g. a -k filter); not a failure.
    if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then failed_files+=("$(basename "$f") (rc $rc)"); fi
  done
  if [ ${#failed_files[@]} -eq 0 ]; then
    summary+=("pytest: every file passed [$(( $(date +%s) - t0 )) s]")
  else
    status=1
    grep -E "^FAILED|^ERROR|Fatal Python error" "$OUT/python.log" | head -20 || true
    summary+=("pytest: FAILED in ${failed_files[*]} (see python.log)")
  fi
  if [ -n "${SKIP_PROOFS:-}" ]; then
    summary+=("training proofs: skipped (SKIP_PROOFS is set)")
  else
    t0=$(date +%s)
    echo "== prove_training" >>"$OUT/python.log"
    # shellcheck disable=SC2086
    if PYTHONUNBUFFERED=1 python3 examples/prove_training.py --out "$OUT" ${PROVE_ARGS:-} \
        >>"$OUT/python.log" 2>&1; then
      summary+=("training proofs: PASS [$(( $(date +%s) - t0 )) s] (training.md)")
    else
      status=1
      tail -15 "$OUT/python.log"
      summary+=("training proofs: FAILED or a criterion failed (see python.log, training.md)")
    fi
  fi
fi

# ---- peers: bench/peers.py, moeblaze through PyTorch side by side with SonicMoE (when
# SONICMOE_CARRY names a folder with SonicMoE's wheels and its install.sh), ScatterMoE and
# torch, plus the C++ path's rows; PEERS_ARGS adds flags (e.g. "--config olmoe --profile DIR") ----
# SonicMoE from SONICMOE_CARRY or SONICMOE_SITE (see peers above), once per check, and its
# autotuner's cache restored from bench/cache/sonicmoe-autotune.tgz; logs into OUT/$1.
sonicmoe_ready=
setup_sonicmoe() {
  [ -n "$sonicmoe_ready" ] && return 0
  sonicmoe_ready=1
  [ -n "${SONICMOE_CARRY:-}${SONICMOE_SITE:-}" ] || return 0
  if [ -n "${SONICMOE_CARRY:-}" ]; then
    # shellcheck disable=SC1091
    source "$SONICMOE_CARRY/install.sh" >>"$OUT/$1" 2>&1 || echo "gpu_check: SonicMoE install failed" >>"$OUT/$1"
  else  # installed by an earlier run on this machine (install.sh's folder): nothing to copy
    [ -d "$SONICMOE_SITE/sonicmoe" ] || echo "gpu_check: no SonicMoE in $SONICMOE_SITE" >>"$OUT/$1"
    export PYTHONPATH="$SONICMOE_SITE:$SONICMOE_SITE/nvidia_cutlass_dsl/python_packages${PYTHONPATH:+:$PYTHONPATH}"
  fi
  # Its autotuner's results and compiled kernels in one folder; the results saved at the end.
  export QUACK_CACHE_DIR=/tmp/quack-cache QUACK_CACHE_AUTOTUNING=1
  export QUACK_COMPILE_WORKERS=${QUACK_COMPILE_WORKERS:-$(nproc)}
  mkdir -p "$QUACK_CACHE_DIR"
  [ -f bench/cache/sonicmoe-autotune.tgz ] &&
    tar xzf bench/cache/sonicmoe-autotune.tgz -C "$QUACK_CACHE_DIR"
  return 0
}

# A Python benchmark part: `python3 SCRIPT ARGS...` under a timeout of SECS (0: none), output
# appended to OUT/LOG; on failure the log's tail and a FAILED summary line (status 1).
#   run_python_part NAME LOG SECS SCRIPT ARGS...
run_python_part() {
  local name=$1 log=$2 secs=$3
  shift 3
  PYTHONUNBUFFERED=1 timeout "$secs" python3 "$@" >>"$OUT/$log" 2>&1 && return 0
  status=1
  tail -20 "$OUT/$log"
  summary+=("$name: FAILED (see $log)")
  return 1
}

if want peers && install_python; then
  t0=$(date +%s)
  setup_sonicmoe peers.log
  cli="$BUILD/moeblaze"
  # PEERS_TIMEOUT (seconds, default none): stop peers.py in time for the autotune results below
  # to be packed even when SonicMoE's first call at a shape outlasts the run's time limit.
  # shellcheck disable=SC2086
  if run_python_part "bench peers" peers.log "${PEERS_TIMEOUT:-0}" bench/peers.py --cli "$cli" \
      --out "$OUT/peers.jsonl" --md "$OUT/peers.md" ${PEERS_ARGS:-}; then
    rows=$(grep -c '"bench": "peers"' "$OUT/peers.jsonl" || true)
    summary+=("bench peers: $rows rows [$(( $(date +%s) - t0 )) s]")
  fi
fi

# ---- peers-grid: grid shapes through PyTorch beside SonicMoE and torch, the missing ones first ----
if want_named peers-grid && install_python; then
  t0=$(date +%s)
  setup_sonicmoe peers_grid.log
  grid_names=${PEERS_GRID:-$(python3 - <<'PY'
import glob, json, sys
sys.path.insert(0, "bench")
import model_shapes
done = {json.loads(line).get("config") for f in glob.glob("bench/results/sonicmoe-grid-*.jsonl")
        for line in open(f) if line.strip()}
todo = sorted((g for g in model_shapes.GRID if g[0] not in done),
              key=lambda g: g[1] * g[5] * g[2] * g[3])  # T * K * d * n: the layer's work
print(",".join(g[0] for g in todo))
PY
)}
  if [ -z "$grid_names" ]; then
    summary+=("bench peers-grid: every grid shape already has rows (PEERS_GRID names others)")
  elif run_python_part "bench peers-grid" peers_grid.log "${PEERS_TIMEOUT:-0}" bench/peers.py \
      --config "$grid_names" --impl moeblaze-torch,sonicmoe,torch --alternate --reps 10 \
      --warmup 2 --out "$OUT/peers_grid.jsonl"; then
    rows=$(grep -c '"bench": "peers"' "$OUT/peers_grid.jsonl" || true)
    summary+=("bench peers-grid: $rows rows [$(( $(date +%s) - t0 )) s]")
  elif [ -s "$OUT/peers_grid.jsonl" ]; then  # stopped by PEERS_TIMEOUT: the shapes done are kept
    summary+=("bench peers-grid: stopped; $(grep -c '"bench": "peers"' "$OUT/peers_grid.jsonl" || true) rows kept")
  fi
fi

# ---- step-grid: each GEMM inside one step, moeblaze and SonicMoE, at the grid shapes both ran ----
if want_named step-grid && install_python; then
  t0=$(date +%s)
  setup_sonicmoe step_grid.log
  step_names=${STEP_GRID:-$(python3 - <<'PY'
import glob, json
names = []
for f in sorted(glob.glob("bench/results/sonicmoe-grid-*.jsonl")):
    for line in open(f):
        r = json.loads(line) if line.strip() else {}
        if r.get("impl") == "sonicmoe" and r.get("total_ms") and r["config"] not in names:
            names.append(r["config"])
print(",".join(names))
PY
)}
  if [ -z "$step_names" ]; then
    summary+=("bench step-grid: no grid shape has SonicMoE rows (STEP_GRID names shapes)")
  elif run_python_part "bench step-grid" step_grid.log "${STEP_GRID_TIMEOUT:-0}" \
      bench/step_kernels.py --config "$step_names" --impl moeblaze-torch,sonicmoe --steps 3 \
      --md "$OUT/step_grid.md" --json "$OUT/step_grid.json"; then
    summary+=("bench step-grid: $(echo "$step_names" | tr ',' '\n' | grep -c .) shapes [$(( $(date +%s) - t0 )) s]")
  fi
fi

# ---- model-step: whole Hugging Face models, one training step per experts implementation ----
if want_named model-step && install_python; then
  t0=$(date +%s)
  setup_sonicmoe model_step.log
  # shellcheck disable=SC2086
  if run_python_part "model step" model_step.log "${MODEL_STEP_TIMEOUT:-0}" bench/model_step.py \
      --out "$OUT/model_step.jsonl" --md "$OUT/model_step.md" ${MODEL_STEP_ARGS:-}; then
    # grep -c exits 1 on no match (still printing 0): || true, or set -e ends the check here
    timed=$(grep -c '"step_ms"' "$OUT/model_step.jsonl" || true)
    skipped=$(grep -c '"skipped"' "$OUT/model_step.jsonl" || true)
    summary+=("model step: $timed timed rows, $skipped skipped [$(( $(date +%s) - t0 )) s]")
  fi
fi
if [ -n "${QUACK_CACHE_DIR:-}" ]; then  # SonicMoE's autotune results, this run's added
  if (cd "$QUACK_CACHE_DIR" && find . -name '*.autotune.json' -print0 |
        tar czf "$OUT/sonicmoe-autotune.tgz" --null -T -) 2>/dev/null; then
    tuned=$(tar tzf "$OUT/sonicmoe-autotune.tgz" | grep -c json || true)
    summary+=("sonicmoe autotune results: $tuned in sonicmoe-autotune.tgz")
  fi
fi

# ---- short table last ----
echo
if [ -n "$clock_pid" ]; then
  kill "$clock_pid" 2>/dev/null || true
  wait "$clock_pid" 2>/dev/null || true
  clock_pid=
  # Columns: timestamp, SM MHz, W, deg C. Medians and extremes over the samples.
  clocks=$(python3 - "$OUT/gpu_clocks.csv" 2>/dev/null <<'EOF' || true
import statistics, sys
rows = []
for line in open(sys.argv[1]):
    f = [x.strip() for x in line.split(",")]
    try:
        rows.append((float(f[1]), float(f[2]), float(f[3])))
    except (IndexError, ValueError):
        pass  # a header, or "[N/A]"
if rows:
    c, p, t = zip(*rows)
    print("SM clock median %d MHz (min %d), power median %.0f W (max %.0f), max %d C, %d samples"
          % (statistics.median(c), min(c), statistics.median(p), max(p), max(t), len(rows)))
EOF
)
  if [ -n "$clocks" ]; then summary+=("clocks: $clocks (gpu_clocks.csv)"); fi
fi
echo "== gpu_check summary ($(head -2 "$OUT/gpu.txt" 2>/dev/null | tail -1)) =="
printf '%s\n' "${summary[@]}"
if want routing && [ -s "$OUT/routing.jsonl" ] && command -v python3 >/dev/null; then
  python3 - "$OUT/routing.jsonl" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
if rows:
    print("copy ceiling %.0f GB/s" % rows[0]["copy_gbps"])
plan = [r for r in rows if r["impl"] == "moeblaze"]
router = [r for r in rows if r["impl"].startswith("router")]
def label(n):
    return "%dM" % (n >> 20) if n % (1 << 20) == 0 else "%dK" % (n >> 10) if n % 1024 == 0 else str(n)
print("plan build (atomic-free), worst over K and skew per (T, E): us range, min %copy, min x sort")
print("%6s %4s %18s %8s %8s" % ("T", "E", "us", "%copy", "x sort"))
for T in sorted({r["T"] for r in plan}):
    for E in sorted({r["E"] for r in plan}):
        g = [r for r in plan if r["T"] == T and r["E"] == E]
        if not g: continue
        print("%6s %4d %8.1f-%-9.1f %8.1f %8.2f" % (label(T), E, min(r["us"] for r in g),
              max(r["us"] for r in g), min(r["pct_of_copy"] for r in g),
              min(r.get("speedup_vs_sort", 0) for r in g)))
sk = {}
for r in plan:
    sk.setdefault((r["T"], r["E"], r["K"]), {})[r["skew"]] = r["us"]
ratios = [v["skewed"] / v["balanced"] for v in sk.values() if "skewed" in v and "balanced" in v]
if ratios:
    print("skewed / balanced time: max %.2f, median %.2f" % (max(ratios), sorted(ratios)[len(ratios) // 2]))
if router:
    print("router, %copy reading logits, min-max over K, T >= 1M:")
    for impl in sorted({r["impl"] for r in router}):
        for dt in sorted({r.get("logits_dtype", "") for r in router}):
            for E in sorted({r["E"] for r in router}):
                g = [r for r in router if r["T"] >= 1 << 20 and r["E"] == E and
                     r["impl"] == impl and r.get("logits_dtype") == dt]
                if g:
                    print("  %-19s %s E %4d: %5.1f-%5.1f %% copy" % (impl, dt, E,
                          min(r["pct_of_copy"] for r in g), max(r["pct_of_copy"] for r in g)))
EOF
fi
if want layer && [ -s "$OUT/layer.jsonl" ] && command -v python3 >/dev/null; then
  python3 - "$OUT/layer.jsonl" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
layer = [r for r in rows if r.get("bench") == "layer"]
print("layer fwd+bwd (total ms, TFLOPS, kept MiB, peak MiB, max rel err):")
print("%-13s %-19s %9s %7s %9s %9s %9s" % ("config", "impl", "total ms", "TFLOPS", "kept", "peak", "err"))
for r in layer:
    err = r.get("max_rel_err")
    print("%-13s %-19s %9.3f %7.1f %9.1f %9.1f %9s" % (r["config"], r["impl"], r["total_ms"],
          r["total_tflops"], r["kept_bytes"] / 2**20, r["peak_bytes"] / 2**20,
          "-" if err is None else "%.1e" % err))
agg = [r for r in rows if r.get("bench") == "aggregate"]
if agg:
    print("aggregate: %.1f-%.1f %% of copy" % (min(r["pct_of_copy"] for r in agg),
                                              max(r["pct_of_copy"] for r in agg)))
EOF
fi
if want gemm && [ -s "$OUT/gemm.jsonl" ] && command -v python3 >/dev/null; then
  python3 - "$OUT/gemm.jsonl" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("grouped GEMMs, TFLOP/s (x cuBLAS same-FLOP):")
for c in dict.fromkeys(r["config"] for r in rows):
    print("  %-12s " % c + "  ".join("%s %.0f (%.2f)" % (r["gemm"], r["tflops"],
          r["tflops"] / r["dense_same_flop_tflops"] if r.get("dense_same_flop_tflops") else float("nan"))
          for r in rows if r["config"] == c))
EOF
fi
if want ep && [ -s "$OUT/ep.jsonl" ] && command -v python3 >/dev/null; then
  python3 - "$OUT/ep.jsonl" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("expert parallelism, forward+backward (step = max over ranks; speed-up = tokens/s vs W=1):")
print("%-12s %-7s %2s %9s %9s %9s %8s %9s" % ("config", "scaling", "W", "tokens", "step ms",
      "tokens/s", "speed-up", "exchange"))
for r in rows:
    sp, ex = r.get("speedup"), r.get("exchange_share")
    print("%-12s %-7s %2d %9d %9.2f %8.2fM %8s %9s" % (r["config"], r["scaling"], r["W"],
          r["T_global"], r["step_ms"], r["tokens_per_s"] / 1e6,
          "-" if sp is None else "%.2fx" % sp, "-" if ex is None else "%.1f %%" % (100 * ex)))
EOF
fi
if want python && [ -s "$OUT/training.md" ]; then
  cat "$OUT/training.md"
fi
if want peers && [ -s "$OUT/peers.md" ]; then
  cat "$OUT/peers.md"
fi
if want_named sweep && [ -s "$OUT/sweep.md" ]; then
  cat "$OUT/sweep.md"
fi
# ---- PACK=1: everything in OUT into one archive beside the summary and the Markdown tables (for
# a GPU machine from which only a few files can be copied back); SonicMoE's
# autotune file stays beside them, whole (it is committed as it is) ----
if [ -n "${PACK:-}" ]; then
  printf '%s\n' "${summary[@]}" >"$OUT/summary.txt"
  (cd "$OUT" && tar czf /tmp/gpu_check_pack.tgz --exclude='*.tgz' . && mv /tmp/gpu_check_pack.tgz gpu_check.tgz &&
     find . -maxdepth 1 -type f ! -name gpu_check.tgz ! -name summary.txt ! -name '*.md' ! -name '*.png' \
       ! -name sonicmoe-autotune.tgz -delete)
fi

exit $status
