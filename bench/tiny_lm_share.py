"""How much of the tiny LM's training step (examples/train_tiny_moe.py, its CUDA preset) is the
MoE layer's, so how much faster any MoE implementation could make the step (the target was
"≥ 1.3× torch's step"):

    python3 bench/tiny_lm_share.py [--rounds 5] [--steps 20] [--json OUT.json] [-- EXAMPLE FLAGS]

Three models in one process, the same init and batches: the MoE layers by moeblaze, by the
pure-PyTorch TorchMoE, and by nothing ("none": each block's MoE returns zeros, so its forward,
backward and optimizer work are gone; attention, norms, embedding, head, clip and AdamW stay).
Rounds alternate the three (each round: a few warm-up steps, then --steps synchronised steps per
model); the table gives the median step over all rounds, and the host time spent issuing the MoE
modules' forwards (router, aux loss and experts; no sync inside, so it is the time to issue them)
per timed step. The ceiling is torch / none: no MoE
layer, however fast, makes the step faster than that. --impls may add "moeblaze-split": moeblaze
with MoE.forward's step as separate autograd pieces (router layer, route node, experts node,
losses in torch) instead of one node, for an A/B in one process."""
import argparse
import json
import os
import statistics
import sys
import time
import types

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import train_tiny_moe as t  # noqa: E402


class NoMoE(nn.Module):
    """A block's MoE replaced by zeros and a zero loss: the step without any MoE work."""

    def forward(self, x):
        return torch.zeros_like(x), types.SimpleNamespace(total=x.new_zeros((), dtype=torch.float32))


def host_timed(forward, host, impl, timing):
    """forward, adding its host time (no sync: the time to issue it) to host[impl] while timing."""

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = forward(*args, **kwargs)
        if timing[0]:
            host[impl] += time.perf_counter() - t0
        return out
    return timed


def build(impl, extra):
    base = {"none": "torch", "moeblaze-split": "moeblaze"}.get(impl, impl)
    a = t.parse_args(["--impl", base, "--quiet"] + extra)
    model, opt = t.build(a, torch.device(a.device))
    if impl == "moeblaze-split":  # MoE.forward without its one-node step (csrc/eager_layer.cpp)
        for b in model.blocks:
            b.moe._layer_step = lambda x2: None
    if impl == "none":
        for b in model.blocks:
            b.moe = NoMoE()
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    return a, model, opt


IMPLS = ("torch", "moeblaze", "moeblaze-split", "none")


def gpu_name(dev):
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per model and round")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps per model and round")
    ap.add_argument("--impls", default="torch,moeblaze,none")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("extra", nargs="*", help="flags for train_tiny_moe.py's parser (after --)")
    args = ap.parse_args(argv)
    impls = args.impls.split(",")
    bad = [i for i in impls if i not in IMPLS]
    if bad:
        ap.error(f"--impls: unknown {bad}; choose from {', '.join(IMPLS)}")
    train_data, _ = t.load_corpus()
    runs = {}
    host = {i: 0.0 for i in impls}  # seconds of host time in the MoE modules' forward, timed steps
    timing = [False]
    for impl in impls:
        a, model, opt = build(impl, args.extra)
        for b in model.blocks:
            b.moe.forward = host_timed(b.moe.forward, host, impl, timing)
        # each impl its own batch stream from the same seed: identical batches, step for step
        it = t.batches(train_data, a.batch, a.seq, torch.Generator().manual_seed(a.data_seed),
                       a.device)
        runs[impl] = (a, model, opt, it)
    times = {i: [] for i in impls}
    dev = torch.device(runs[impls[0]][0].device)

    def step(impl):
        _, model, opt, it = runs[impl]
        x, y = next(it)
        ce, _ = t.train_step(model, opt, x, y)
        return float(ce.detach())  # the example's one host read per step

    total = args.rounds * len(impls)
    for r in range(args.rounds):
        for k, impl in enumerate(impls if r % 2 == 0 else reversed(impls)):
            for _ in range(args.warmup):
                step(impl)
            t.sync(dev)
            timing[0] = True
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step(impl)
                t.sync(dev)
                times[impl].append((time.perf_counter() - t0) * 1e3)
            timing[0] = False
            print(f"tiny_lm_share: round {r + 1}/{args.rounds} {impl}: "
                  f"{statistics.median(times[impl][-args.steps:]):.2f} ms "
                  f"({r * len(impls) + k + 1}/{total})", file=sys.stderr, flush=True)
    med = {i: statistics.median(v) for i, v in times.items()}
    a = runs[impls[0]][0]
    print(f"\ntiny LM (layers {a.layers}, d {a.d}, E {a.E}, K {a.K}, n {a.n}, batch "
          f"{a.batch}x{a.seq}), median step of {args.rounds} x {args.steps}, "
          f"{gpu_name(dev)}\n")
    n_steps = args.rounds * args.steps
    fwd_host = {i: 1e3 * host[i] / n_steps for i in impls}
    print("| impl | step ms | × torch's step | MoE layers' ms (step − none) | "
          "MoE forwards' host ms per step |")
    print("|---|---:|---:|---:|---:|")
    for i in impls:
        moe = f"{med[i] - med['none']:.2f}" if "none" in med and i != "none" else "—"
        ratio = f"{med['torch'] / med[i]:.3f}" if "torch" in med else "—"
        print(f"| {i} | {med[i]:.2f} | {ratio} | {moe} | {fwd_host[i]:.2f} |")
    if "torch" in med and "none" in med:
        print(f"\nceiling (torch / none): {med['torch'] / med['none']:.3f}× — no MoE layer makes "
              f"this step faster than that")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "tiny-lm-share", "median_ms": med, "times_ms": times,
                       "moe_forward_host_ms_per_step": fwd_host,
                       "rounds": args.rounds, "steps": args.steps, "extra": args.extra,
                       "gpu": gpu_name(dev),
                       "commit": os.environ.get("MOEBLAZE_COMMIT")}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
