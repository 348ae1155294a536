#!/usr/bin/env python3
"""Two builds of libmoeblaze_capi.so side by side through PyTorch: a moeblaze.MoE training step
(forward, backward of a loss on its output) timed under each library in alternating rounds (A B,
then B A, ...), each library in a fresh process per round (a process loads one library). Made for
the wheel's build (MOEBLAZE_CAPI_MANYLINUX, the default on Linux x86_64 with GCC) against a build
without it: their device code is the same, so the question is whether the linking changes a
step's time beyond the run-to-run spread.

  cmake -S . -B build-gpu -DMOEBLAZE_CUDA=ON -DMOEBLAZE_CAPI_AB_TWIN=ON
  cmake --build build-gpu --target moeblaze_capi moeblaze_capi_plain
  python3 bench/capi_ab.py build-gpu/libmoeblaze_capi.so build-gpu/libmoeblaze_capi_plain.so

(moeblaze_capi_plain: the same objects linked as without MOEBLAZE_CAPI_MANYLINUX, so the second
library costs one link, not a second build.)
  python3 bench/capi_ab.py LIB LIB --tiny          # CPU, a tiny shape (what the test runs)

Prints a table (each library's median ms over every round, its ratio to the first library's, and
each round's median: the spread) and one JSON line per library (`bench: "capi-ab"`, the layer
shape, `lib`, `ms`, `round_ms`, `ratio`, and docs/DESIGN.md's trailer).
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_reference import git_commit, step_timer  # noqa: E402


def worker(a):
    """One process: the step under the library MOEBLAZE_LIB names, --reps timed steps."""
    import torch

    import moeblaze
    device = "cuda" if torch.cuda.is_available() and moeblaze.has_cuda() and not a.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    moe = moeblaze.MoE(a.d, a.n, a.E, a.K, device=device, dtype=dtype)
    x = torch.randn(a.tokens, a.d, device=device, dtype=dtype, requires_grad=True)

    def step():
        out, _ = moe(x)
        out.float().square().mean().backward()

    for _ in range(a.warmup):
        step()
    timer = step_timer(device)
    times = [timer(step) for _ in range(a.reps)]
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(json.dumps({"ms": times, "gpu": gpu, "torch": torch.__version__}))


def run_round(lib, a):
    env = dict(os.environ, MOEBLAZE_LIB=os.path.abspath(lib))
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--tokens", str(a.tokens),
           "--d", str(a.d), "--n", str(a.n), "--E", str(a.E), "--K", str(a.K),
           "--reps", str(a.reps), "--warmup", str(a.warmup)] + (["--tiny"] if a.tiny else [])
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    if p.returncode != 0:
        raise RuntimeError(f"capi_ab: the step under {lib} failed ({p.returncode}):\n"
                           f"{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("libs", nargs="*", help="two (or more) libmoeblaze_capi.so paths")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--n", type=int, default=768)
    ap.add_argument("--E", type=int, default=128)
    ap.add_argument("--K", type=int, default=8)
    ap.add_argument("--reps", type=int, default=30, help="timed steps per process")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4, help="alternated rounds")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per process")
    ap.add_argument("--tiny", action="store_true", help="a tiny CPU shape (tests)")
    ap.add_argument("--out", help="append the JSON lines to this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.tiny:
        a.tokens, a.d, a.n, a.E, a.K, a.reps, a.warmup = 64, 16, 12, 4, 2, 3, 1
    if a.worker:
        return worker(a) or 0
    if len(a.libs) < 2:
        ap.error("give at least two libraries")
    for lib in a.libs:
        if not os.path.isfile(lib):
            ap.error(f"libs: {lib} is not a file")
    k = len(a.libs)
    rounds = [[] for _ in range(k)]   # per library (by position: a library may come twice)
    samples = [[] for _ in range(k)]
    info = {}
    for r in range(a.rounds):
        for i in (range(k) if r % 2 == 0 else reversed(range(k))):
            got = run_round(a.libs[i], a)
            samples[i] += got["ms"]
            rounds[i].append(statistics.median(got["ms"]))
            info = got
            print(f"round {r + 1}/{a.rounds}: {a.libs[i]}: {rounds[i][-1]:.3f} ms",
                  file=sys.stderr)
    med = [statistics.median(x) for x in samples]
    print(f"moeblaze.MoE step (T {a.tokens}, d {a.d}, n {a.n}, E {a.E}, K {a.K}) under each "
          f"library, {info['gpu']}; {a.rounds} alternated rounds of {a.reps} steps")
    print("| library | median ms | × first | each round's median ms |\n|---|---:|---:|---|")
    for i, lib in enumerate(a.libs):
        print(f"| {lib} | {med[i]:.3f} | {med[i] / med[0]:.3f} | "
              f"{', '.join(f'{x:.3f}' for x in rounds[i])} |")
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rows = [{"bench": "capi-ab", "T": a.tokens, "d": a.d, "n": a.n, "E": a.E, "K": a.K,
             "lib": lib, "ms": med[i], "round_ms": rounds[i], "ratio": med[i] / med[0],
             "reps": a.reps, "rounds": a.rounds, "torch": info["torch"], "gpu": info["gpu"],
             "commit": git_commit(), "date": date} for i, lib in enumerate(a.libs)]
    for row in rows:
        print(json.dumps(row))
    if a.out:
        with open(a.out, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
