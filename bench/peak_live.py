#!/usr/bin/env python3
"""Which allocations are live at the peak of one `moe_experts` forward+backward on the GPU.

bench/peers.py's moeblaze-torch step on its inputs (`Inputs`, `impl_moeblaze_torch`), with the C++
fast path and with the Python path: torch's allocator trace
(`torch.cuda.memory._record_memory_history`) replayed to the moment of the highest allocated
total, then every block live there, largest first. Peak = peers.py's (max_memory_allocated over
the step minus what was allocated before it; `out` held through backward).

  python3 bench/peak_live.py sm-7B-n256 [--recompute] [--seed N]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402


def live_at_peak(snapshot, device):
    """(peak bytes over the trace's start, {addr: event} live at that moment) on `device`; a
    block freed in the trace but allocated before it is not counted."""
    live, total, best, at = {}, 0, 0, {}
    for ev in snapshot["device_traces"][device]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            total += ev["size"]
            if total > best:
                best, at = total, dict(live)
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])["size"]
    return best, at


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config", help="a named config, an extra shape or T,d,n,E,K (as peers.py)")
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("peak_live: needs a CUDA GPU")
    inp = peers.Inputs(*peers.shape_of(args.config), args.seed, "cuda")
    for fast in (True, False):
        step = peers.impl_moeblaze_torch(inp, args.recompute, fast_path=fast)
        for _ in range(2):  # warm-up: workspaces, the extension's build
            step(True)
            inp.clear_grads()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=100000)
        out = step(True)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        replayed, at = live_at_peak(snapshot, torch.cuda.current_device())
        print(f"{args.config} {'fast path' if fast else 'Python path'}: peak {peak:,} B "
              f"(the trace's own: {replayed:,}); live there, largest first:")
        for ev in sorted(at.values(), key=lambda e: -e["size"]):
            print(f"  {ev['size']:>15,}")
        del out
        inp.clear_grads()


if __name__ == "__main__":
    main()
