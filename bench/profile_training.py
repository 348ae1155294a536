"""torch.profiler over training steps of examples/train_tiny_moe.py (moeblaze on CUDA), one table
per token-rounding mode: where a step's CPU and GPU time go (e.g. NR-f vs top-K).

    python3 bench/profile_training.py OUT_DIR [--modes none,nr-f] [--E 128 --K 8]

Writes OUT_DIR/prof-<mode>.txt: the median of 20 synchronised steps after 10 warm-up steps, then
the profiler's tables over 5 steps (sorted by CUDA and by CPU time)."""
import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import train_tiny_moe as t  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--modes", default="none,nr-f")
    ap.add_argument("--E", default="128")
    ap.add_argument("--K", default="8")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("profile_training: skipped: no GPU", file=sys.stderr)
        return 0
    os.makedirs(args.out, exist_ok=True)
    train_data, _ = t.load_corpus()
    for mode in args.modes.split(","):
        a = t.parse_args(["--impl", "moeblaze", "--E", args.E, "--K", args.K,
                          "--token-rounding", mode, "--quiet"])
        model, opt = t.build(a, torch.device("cuda"))
        it = t.batches(train_data, a.batch, a.seq, torch.Generator().manual_seed(1), "cuda")

        def step():
            x, y = next(it)
            ce, aux = t.lm_loss(model, x, y)
            opt.zero_grad(set_to_none=True)
            (ce + aux).backward()
            opt.step()
            return float(ce.detach())  # the example's one host read per step

        for _ in range(10):
            step()
        torch.cuda.synchronize()
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        times.sort()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        with open(os.path.join(args.out, f"prof-{mode}.txt"), "w") as f:
            f.write(f"routing {mode}: median step {1e3 * times[10]:.2f} ms (20 steps, after 10 "
                    f"warm-up); profile over 5 steps\n")
            f.write(p.key_averages().table(sort_by="cuda_time_total", row_limit=30) + "\n")
            f.write(p.key_averages().table(sort_by="cpu_time_total", row_limit=25) + "\n")
        print(f"{mode}: median step {1e3 * times[10]:.2f} ms", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
