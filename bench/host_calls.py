#!/usr/bin/env python3
"""Where the host time of one forward+backward goes: the CUDA runtime and driver calls that
torch.profiler (CUPTI) records during bench/peers.py's steps, summed by name per step.

  python3 bench/host_calls.py sm-7B-n256 [--impl moeblaze-capi,moeblaze-torch] [--steps 5]

Per impl: the host span of a step (first to last call of it, profiler on), then every runtime /
driver call name with its count and microseconds per step, largest first. The profiler's own
cost inflates every number alike; compare the rows of one table, not with an unprofiled run."""
import argparse
import collections
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402


def host_calls(step, inp, steps):
    """({call name: (count, µs)} per step, host µs per step) over `steps` profiled steps."""
    with tempfile.TemporaryDirectory() as tmp:
        evs, spans = peers.profiled_steps(step, inp, steps, os.path.join(tmp, "trace.json"))
    calls = collections.defaultdict(lambda: [0, 0.0])
    for e in evs:
        if e.get("ph") != "X" or e.get("cat") not in ("cuda_runtime", "cuda_driver"):
            continue
        if any(s0 <= e["ts"] <= s1 for s0, s1 in spans):
            c = calls[e["name"]]
            c[0] += 1
            c[1] += e["dur"]
    n = max(len(spans), 1)
    host = sum(s1 - s0 for s0, s1 in spans) / n
    return {k: (v[0] / n, v[1] / n) for k, v in calls.items()}, host


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config", help="a named config, an extra shape or T,d,n,E,K (as peers.py)")
    ap.add_argument("--impl", default="moeblaze-capi,moeblaze-torch")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("host_calls: needs a CUDA GPU")
    inp = peers.Inputs(*peers.shape_of(args.config), args.seed, "cuda")
    for impl in args.impl.split(","):
        if impl not in ("moeblaze-capi", "moeblaze-torch"):
            sys.exit(f"host_calls: --impl {impl}: choose moeblaze-capi or moeblaze-torch")
        make = peers.impl_moeblaze_capi if impl == "moeblaze-capi" else peers.impl_moeblaze_torch
        step = make(inp, False)
        for _ in range(3):  # warm-up: workspaces, the extension's build
            step(True)
            inp.clear_grads()
        calls, host = host_calls(step, inp, args.steps)
        total = sum(us for _, us in calls.values())
        print(f"\n{args.config} {impl}: host span {host:.0f} µs per step, of it {total:.0f} µs "
              f"in {sum(c for c, _ in calls.values()):.0f} runtime/driver calls "
              f"(mean of {args.steps} profiled steps)\n")
        print("| call | per step | µs per step | µs per call |")
        print("|---|---:|---:|---:|")
        for name, (count, us) in sorted(calls.items(), key=lambda kv: -kv[1][1]):
            print(f"| {name} | {count:.1f} | {us:.1f} | {us / max(count, 1e-9):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
