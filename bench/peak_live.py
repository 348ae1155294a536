#!/usr/bin/env python3
"""Which allocations are live at the peak of one `moe_experts` forward+backward on the GPU.

The step as bench/peers.py measures it (bf16 x, w1, w2; (T, K) int64 ids and fp32 weights from a
softmax top-K; `out` held through backward), with the C++ fast path and with the Python path:
torch's allocator trace (`torch.cuda.memory._record_memory_history`) replayed to the moment of
the highest allocated total, then every block live there, largest first. Peak = peers.py's
(max_memory_allocated over the step minus what was allocated before it).

  python3 bench/peak_live.py sm-7B-n256 [--recompute]
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_reference import CONFIGS, EXTRA_SHAPES  # noqa: E402


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
    ap.add_argument("config", help="a named config or extra shape of bench/torch_reference.py")
    ap.add_argument("--recompute", action="store_true")
    args = ap.parse_args()
    shapes = {**CONFIGS, **EXTRA_SHAPES}
    if args.config not in shapes:
        ap.error(f"unknown config '{args.config}' (one of {', '.join(shapes)})")
    if not torch.cuda.is_available():
        sys.exit("peak_live: needs a CUDA GPU")
    import moeblaze
    T, d, n, E, K = shapes[args.config]
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev)
    g.manual_seed(1)
    x = torch.randn(T, d, device=dev, generator=g, dtype=bf).requires_grad_()        # (T, d)
    w1 = (torch.randn(E, 2 * n, d, device=dev, generator=g, dtype=bf) / math.sqrt(d)).requires_grad_()
    w2 = (torch.randn(E, d, n, device=dev, generator=g, dtype=bf) / math.sqrt(n)).requires_grad_()
    w, ids = torch.topk(torch.softmax(torch.randn(T, E, device=dev, generator=g), -1), K, -1)
    w = w.detach().requires_grad_()                                                  # (T, K) fp32
    dout = torch.randn(T, d, device=dev, generator=g, dtype=bf)                      # (T, d)
    leaves = (x, w1, w2, w)

    def step(fast):
        with moeblaze.use_extension(fast):
            out = moeblaze.moe_experts(x, w1, w2, ids, w, "swiglu", recompute=args.recompute)
        out.backward(dout)
        return out

    for fast in (True, False):
        for _ in range(2):  # warm-up: workspaces, the extension's build
            step(fast)
            for t in leaves:
                t.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=100000)
        out = step(fast)
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
        for t in leaves:
            t.grad = None


if __name__ == "__main__":
    main()
