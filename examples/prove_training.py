#!/usr/bin/env python3
"""The training proofs, run end to end on one GPU (about 3-4 minutes on an H200):

 (a) the tiny MoE LM (4 layers, d=512, E=32, K=4, n=256) trained --steps steps with moeblaze and
     with the pure-PyTorch MoE, same init and batches: the loss curves must agree within bf16
     noise. Criteria, fixed before running: the final validation losses within 1 % of each other,
     and the 20-step moving averages of the training loss within 2 % at every step past the
     first 20;
 (b) tokens/s (median step time, steady state) and peak memory (PyTorch's allocator; moeblaze's
     own allocations too, expected 0 since every tensor it keeps comes from PyTorch) of both runs;
 (c) the largest micro-batch (sequences of --seq bytes, granularity 8) whose training step
     (forward, backward, AdamW) fits in --budget-gib of PyTorch-allocated memory, for each;
 (d) token rounding (NR-f, m_tile 128) vs plain top-K routing with moeblaze at E=128, K=8: final
     validation losses within 1 %, and the median step time of each.

    python examples/prove_training.py --out DIR [--steps 300] [--budget-gib 8] [--quick]

Writes DIR/training.json (every number, curves included), DIR/training.md (the table),
DIR/loss_curves.png (a) and DIR/nrf_curves.png (d) (matplotlib; without it the curves go to
loss_curves.json / nrf_curves.json); exits 1 if a criterion fails.
"""
import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_tiny_moe as tt  # noqa: E402


def run(extra, quiet=True):
    a = tt.parse_args(extra + (["--quiet"] if quiet else []))
    t0 = time.perf_counter()
    r = tt.train(a)
    r["wall_s"] = time.perf_counter() - t0
    cleanup()
    return r


def cleanup():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def moving_avg(xs, w=20):
    out, s = [], 0.0
    for i, x in enumerate(xs):
        s += x
        if i >= w:
            s -= xs[i - w]
        out.append(s / min(i + 1, w))
    return out


def step_peak(impl, batch, seq, device, extra=()):
    """Peak PyTorch-allocated bytes of one full training step (fresh model and optimizer) at
    `batch` sequences, or None when it runs out of memory."""
    a = tt.parse_args(["--impl", impl, "--batch", str(batch), "--seq", str(seq),
                                "--device", device, "--quiet", *extra])
    dev = torch.device(device)
    cleanup()
    torch.cuda.reset_peak_memory_stats(dev)
    try:
        model, opt = tt.build(a, dev)
        x = torch.randint(0, 256, (batch, seq), device=dev)
        ce, aux = tt.lm_loss(model, x, x)
        (ce + aux).backward()
        opt.step()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
    except torch.OutOfMemoryError:
        peak = None
    finally:
        model = opt = x = ce = aux = None  # noqa: F841
        cleanup()
    return peak


def largest_batch(impl, budget, seq, device, log, extra=()):
    """Doubling from 8 sequences until the step exceeds the budget, then bisection to 8."""
    probes = {}

    def fits(b):
        p = step_peak(impl, b, seq, device, extra)
        probes[b] = p
        log(f"    {impl}: batch {b:5d} -> peak "
            f"{'OOM' if p is None else '%.2f GiB' % (p / 2**30)}")
        return p is not None and p <= budget

    lo, hi = 0, 8
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 14:
            break
    while hi - lo > 8:
        mid = (lo + hi) // 2 // 8 * 8
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, {str(k): v for k, v in sorted(probes.items())}


def git_commit():
    if os.environ.get("MOEBLAZE_COMMIT"):
        return os.environ["MOEBLAZE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=os.path.dirname(os.path.abspath(__file__)),
                              check=True).stdout.strip()
    except Exception:
        return "unknown"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--nrf-steps", type=int, default=300)
    p.add_argument("--budget-gib", type=float, default=8.0)
    p.add_argument("--quick", action="store_true", help="fewer steps (a smoke run, not a proof)")
    p.add_argument("--parts", default="a,c,d", help="comma list of a (includes b), c, d")
    p.add_argument("--extra", default="", help="more train_tiny_moe flags for every run (e.g. a "
                   "small model for a CPU smoke test); they come last, so they override")
    args = p.parse_args()
    if args.quick:
        args.steps, args.nrf_steps = min(args.steps, 60), min(args.nrf_steps, 60)
    os.makedirs(args.out, exist_ok=True)
    parts = set(args.parts.split(","))
    t_start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)

    res = {"commit": git_commit(), "date": datetime.datetime.utcnow().isoformat() + "Z",
           "torch": torch.__version__, "steps": args.steps,
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"}
    ok = True
    common = ["--device", args.device, "--time-steps", "--val-every", "50"] + args.extra.split()

    if "a" in parts:
        log(f"(a) {args.steps} steps, moeblaze and torch, same init and data")
        runs = {impl: run(["--impl", impl, "--steps", str(args.steps)] + common)
                for impl in ("moeblaze", "torch")}
        mb, th = runs["moeblaze"], runs["torch"]
        sm_mb, sm_th = moving_avg(mb["train_loss"]), moving_avg(th["train_loss"])
        diffs = [abs(x - y) / y for x, y in zip(sm_mb[20:], sm_th[20:])]
        max_rel = max(diffs) if diffs else 0.0
        val_rel = abs(mb["final_val_loss"] - th["final_val_loss"]) / th["final_val_loss"]
        a_ok = val_rel <= 0.01 and max_rel <= 0.02
        ok &= a_ok
        res["a"] = {"runs": runs, "max_rel_diff_moving_avg20": max_rel,
                    "final_val_rel_diff": val_rel, "pass": a_ok}
        log(f"    final val loss moeblaze {mb['final_val_loss']:.4f} torch "
            f"{th['final_val_loss']:.4f} (rel diff {val_rel:.2%}); max rel diff of 20-step "
            f"averages {max_rel:.2%}: {'PASS' if a_ok else 'FAIL'}")
        for impl, r in runs.items():
            log(f"(b) {impl}: {r['tokens_per_s'] / 1e3:.1f}k tokens/s (median step "
                f"{r['median_step_s'] * 1e3:.1f} ms), peak torch "
                f"{r['peak_torch_bytes'] / 2**30:.2f} GiB, moeblaze-owned "
                f"{r['peak_moeblaze_bytes'] / 2**20:.1f} MiB")
        w = res["plot_a"] = tt.plot_curves(
            os.path.join(args.out, "loss_curves.png"),
            {"moeblaze train": (list(range(1, len(mb["train_loss"]) + 1)), mb["train_loss"]),
             "torch train": (list(range(1, len(th["train_loss"]) + 1)), th["train_loss"]),
             "moeblaze val": ([s for s, _ in mb["val_loss"]], [v for _, v in mb["val_loss"]]),
             "torch val": ([s for s, _ in th["val_loss"]], [v for _, v in th["val_loss"]])},
            "tiny MoE LM: moeblaze vs pure PyTorch (same init, same batches)")
        log(f"    curves written to {w}")

    if "c" in parts and args.device.startswith("cuda"):
        budget = int(args.budget_gib * 2**30)
        log(f"(c) largest micro-batch within {args.budget_gib:g} GiB (seq 256)")
        res["c"] = {"budget_bytes": budget}
        for impl in ("moeblaze", "torch"):
            b, probes = largest_batch(impl, budget, 256, args.device, log, args.extra.split())
            res["c"][impl] = {"largest_batch": b, "probes": probes}
            log(f"    {impl}: largest batch {b} sequences ({b * 256} tokens)")

    if "d" in parts:
        log(f"(d) NR-f token rounding vs top-K, moeblaze, E=128 K=8, {args.nrf_steps} steps")
        d_runs = {}
        for tr in ("none", "nr-f"):
            d_runs[tr] = run(["--impl", "moeblaze", "--E", "128", "--K", "8", "--token-rounding",
                              tr, "--steps", str(args.nrf_steps)] + common)
        top, nrf = d_runs["none"], d_runs["nr-f"]
        rel = abs(nrf["final_val_loss"] - top["final_val_loss"]) / top["final_val_loss"]
        d_ok = rel <= 0.01
        ok &= d_ok
        res["d"] = {"runs": d_runs, "final_val_rel_diff": rel, "pass": d_ok,
                    "step_time_ratio_nrf_over_topk": nrf["median_step_s"] / top["median_step_s"]}
        log(f"    val loss top-K {top['final_val_loss']:.4f} NR-f {nrf['final_val_loss']:.4f} "
            f"(rel diff {rel:.2%}): {'PASS' if d_ok else 'FAIL'}; median step top-K "
            f"{top['median_step_s'] * 1e3:.1f} ms, NR-f {nrf['median_step_s'] * 1e3:.1f} ms")
        res["plot_d"] = tt.plot_curves(
            os.path.join(args.out, "nrf_curves.png"),
            {"top-K train": (list(range(1, len(top["train_loss"]) + 1)), top["train_loss"]),
             "NR-f train": (list(range(1, len(nrf["train_loss"]) + 1)), nrf["train_loss"]),
             "top-K val": ([s for s, _ in top["val_loss"]], [v for _, v in top["val_loss"]]),
             "NR-f val": ([s for s, _ in nrf["val_loss"]], [v for _, v in nrf["val_loss"]])},
            "moeblaze E=128 K=8: NR-f token rounding vs top-K")

    res["wall_s"] = time.perf_counter() - t_start
    res["pass"] = ok
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(res, f)
    md = table(res)
    with open(os.path.join(args.out, "training.md"), "w") as f:
        f.write(md)
    print(md)
    log(f"done: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def table(res):
    L = [f"# Training proofs ({res['gpu']}, torch {res['torch']}, commit {res['commit']}, "
         f"{res['date'][:10]})", ""]
    if "a" in res:
        a = res["a"]
        L += [f"## (a, b) tiny MoE LM, {res['steps']} steps, moeblaze vs pure PyTorch", "",
              "| impl | final val loss | train loss (last 20 avg) | tokens/s | median step ms | "
              "peak torch GiB | peak moeblaze-owned MiB |", "|---|---|---|---|---|---|---|"]
        for impl, r in a["runs"].items():
            L.append(f"| {impl} | {r['final_val_loss']:.4f} | {r['final_train_loss_avg20']:.4f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['median_step_s'] * 1e3:.1f} | "
                     f"{r['peak_torch_bytes'] / 2**30:.2f} | "
                     f"{r['peak_moeblaze_bytes'] / 2**20:.1f} |")
        L += ["", f"Curves agree: final val loss rel diff {a['final_val_rel_diff']:.2%} (<= 1 %), "
              f"max rel diff of 20-step moving averages {a['max_rel_diff_moving_avg20']:.2%} "
              f"(<= 2 %): **{'PASS' if a['pass'] else 'FAIL'}**. Curves: "
              f"{os.path.basename(res['plot_a'])}.", ""]
    if "c" in res:
        c = res["c"]
        L += [f"## (c) largest micro-batch in {c['budget_bytes'] / 2**30:g} GiB (seq 256)", "",
              "| impl | largest batch (sequences) | tokens |", "|---|---|---|"]
        for impl in ("moeblaze", "torch"):
            b = c[impl]["largest_batch"]
            L.append(f"| {impl} | {b} | {b * 256:,} |")
        L.append("")
    if "d" in res:
        d = res["d"]
        L += ["## (d) NR-f token rounding vs top-K (moeblaze, E=128, K=8, m_tile 128)", "",
              "| routing | final val loss | median step ms | tokens/s |", "|---|---|---|---|"]
        for name, r in (("top-K", d["runs"]["none"]), ("NR-f", d["runs"]["nr-f"])):
            L.append(f"| {name} | {r['final_val_loss']:.4f} | {r['median_step_s'] * 1e3:.1f} | "
                     f"{r['tokens_per_s']:,.0f} |")
        L += ["", f"Val loss rel diff {d['final_val_rel_diff']:.2%} (<= 1 %): "
              f"**{'PASS' if d['pass'] else 'FAIL'}**; step time NR-f / top-K = "
              f"{d['step_time_ratio_nrf_over_topk']:.3f}. Curves: "
              f"{os.path.basename(res['plot_d'])}.", ""]
    L.append(f"Total wall time {res['wall_s']:.0f} s.")
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    sys.exit(main())
