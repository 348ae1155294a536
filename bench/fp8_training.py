#!/usr/bin/env python3
"""The tiny MoE LM (examples/train_tiny_moe.py) trained with the experts in bf16, fp8 and
fp8-wgrad, same init and batches, one run after the other in this process: the FP8 recipe's loss
criterion ("the tiny LM's loss after the example's default steps within 1 % of the bf16 run's,
curves plotted together"), checked in one command because loss, not per-tensor error, is what
says whether an FP8 recipe trains.

    python bench/fp8_training.py --out DIR                       # GPU preset, 300 steps
    python bench/fp8_training.py --out DIR --device cpu --steps 6 --extra "--val-every 3"

Every run takes the example's preset for the device, --dtype bf16 (fp8 needs bf16 storage; the
CPU preset's fp32 would make the bf16 row another model), --time-steps, --steps when given, then
--extra (the example's flags, last, so they override; --compute is this script's). Writes
DIR/training-fp8.md (validation loss at each validation point, the training loss's mean over the
last 20 steps, median step ms and tokens/s, each fp8 recipe's final validation loss over bf16's),
DIR/training-fp8.json (every number, curves and each run's flags included) and
DIR/training-fp8.png (train and validation curves of all runs on one figure; skipped, and said so,
without matplotlib). The table goes to stdout, the runs' progress to stderr. Exit status 1 when
an fp8 recipe's final validation loss is not within 1 % of bf16's, or a run fails (each says
why); the other runs still run and the files are still written.
"""
import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import shlex
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import train_tiny_moe as tt  # noqa: E402
from prove_training import moving_avg  # noqa: E402  (the 20-step mean of the training proofs)

COMPUTES = ("bf16", "fp8", "fp8-wgrad")
TOLERANCE = 0.01  # the FP8 recipe's loss criterion: final val loss within 1 % of the bf16 run's


def log(msg):
    print(f"fp8_training: {msg}", file=sys.stderr, flush=True)


def cleanup():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_argv(compute, device, steps, extra):
    """The train_tiny_moe flags of one run."""
    argv = ["--device", device, "--compute", compute, "--dtype", "bf16", "--time-steps"]
    if steps is not None:
        argv += ["--steps", str(steps)]
    return argv + list(extra)


def check_args(a):
    """Why the example would refuse these flags (its __main__'s checks), or None."""
    if a.impl != "moeblaze":
        return "--impl must be moeblaze (compute fp8 is a moeblaze feature)"
    if a.compute != "bf16" and a.dtype != "bf16":
        return f"--compute {a.compute} needs --dtype bf16 (FP8 operands are quantized from bf16)"
    return None


def compare(runs, tol=TOLERANCE):
    """({compute: final val loss / bf16's} for the fp8 recipes that have one, [failure reasons]).
    runs: {compute: train()'s result, or {"error": message}}."""
    ratios, why = {}, []
    for c, r in runs.items():
        if "error" in r:
            why.append(f"{c}: the run failed: {r['error']}")
    base = runs.get("bf16")
    if base is None or "error" in base:
        return ratios, why
    for c, r in runs.items():
        if c == "bf16" or "error" in r:
            continue
        if r["steps"] != base["steps"]:
            why.append(f"{c}: stopped after {r['steps']} of {base['steps']} steps (a non-finite "
                       "loss)")
            continue
        v, b = r["final_val_loss"], base["final_val_loss"]
        if v is None or b is None:
            why.append(f"{c}: no validation loss to compare (--val-every 0?)")
            continue
        ratios[c] = v / b
        if not (math.isfinite(v) and abs(v / b - 1) <= tol):
            why.append(f"{c}: final val loss {v:.4f} is {v / b:.4f}x bf16's {b:.4f}, not within "
                       f"{tol * 100:g} %")
    return ratios, why


def device_name(device):
    d = torch.device(device)
    if d.type == "cuda":
        return torch.cuda.get_device_name(d)
    return f"CPU ({os.cpu_count()} logical cores)"


def table(res):
    """The markdown report: header lines, one row per run, the ratios and the verdict."""
    ok_runs = {c: r for c, r in res["runs"].items() if "error" not in r}
    cfg = res["config"]
    L = ["# Tiny MoE LM with the experts in " + ", ".join(res["runs"]) +
         " (bench/fp8_training.py)", "",
         f"- device: {res['device_name']} (--device {res['device']})",
         f"- torch: {res['torch']}",
         f"- commit (MOEBLAZE_COMMIT): {res['commit']}",
         f"- date: {res['date']}",
         f"- command: `{res['command']}`", ""]
    if cfg:
        L += [f"examples/train_tiny_moe.py, {cfg['preset']} preset and flags: {cfg['layers']} "
              f"layers, d {cfg['d']}, E {cfg['E']}, K {cfg['K']}, n {cfg['n']}, {cfg['dtype']} "
              f"parameters, batch {cfg['batch']}x{cfg['seq']}, {cfg['steps']} steps, val every "
              f"{cfg['val_every']} ({cfg['val_batches']} batches), seed {cfg['seed']}, data seed "
              f"{cfg['data_seed']}; the runs one after another in one process. Curves: "
              f"{os.path.basename(res['plot']) if res['plot'] else 'not drawn'}; numbers: "
              "training-fp8.json.", ""]
    val_steps = sorted({s for r in ok_runs.values() for s, _ in r["val_loss"]})
    timed = any("median_step_s" in r for r in ok_runs.values())
    head = ["compute"] + [f"val loss @{s}" for s in val_steps] + ["train loss, last 20 steps"]
    head += ["median step ms", "tokens/s"] if timed else []
    head += ["final val / bf16"]
    L += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c, r in res["runs"].items():
        if "error" in r:
            L.append(f"| {c} | failed: {r['error']} |" + " |" * (len(head) - 2))
            continue
        vals = dict((s, v) for s, v in r["val_loss"])
        row = [c] + [f"{vals[s]:.4f}" if s in vals else "" for s in val_steps]
        row.append(f"{r['final_train_loss_avg20']:.4f}")
        if timed:
            row += ([f"{r['median_step_s'] * 1e3:.1f}", f"{r['tokens_per_s']:.0f}"]
                    if "median_step_s" in r else ["", ""])
        ratio = res["ratios"].get(c)
        row.append("1" if c == "bf16" else f"{ratio:.4f}" if ratio is not None else "")
        L.append("| " + " | ".join(row) + " |")
    L.append("")
    for c, ratio in res["ratios"].items():
        within = abs(ratio - 1) <= TOLERANCE
        L.append(f"Final val loss {c} / bf16: {ratio:.4f} "
                 f"({'within' if within else 'NOT within'} {TOLERANCE * 100:g} %).")
    if "bf16" not in ok_runs:
        L.append("No bf16 run finished: nothing to compare the fp8 recipes with.")
    L += ["", f"The FP8 recipe's loss criterion (each fp8 recipe's final val loss within "
          f"{TOLERANCE * 100:g} % of bf16's): **{'PASS' if res['pass'] else 'FAIL'}**" +
          ("" if res["pass"] else " (" + "; ".join(res["failures"]) + ")") + ".",
          f"Total wall time {res['wall_s']:.0f} s."]
    return "\n".join(L) + "\n"


def plot(path, runs, title):
    """Train (raw, faint; 20-step mean, solid) and val (markers) curves of every run on one
    figure. Returns the path, or None without matplotlib (said on stderr)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"matplotlib is not installed (pip install matplotlib): {path} not drawn")
        return None
    fig, ax = plt.subplots(figsize=(9, 5.4), dpi=110)
    for i, (c, r) in enumerate(runs.items()):
        if "error" in r:
            continue
        col = f"C{i}"
        xs = list(range(1, len(r["train_loss"]) + 1))
        ax.plot(xs, r["train_loss"], color=col, linewidth=0.6, alpha=0.3)
        ax.plot(xs, moving_avg(r["train_loss"]), color=col, linewidth=1.4,
                label=f"{c} train (20-step mean)")
        if r["val_loss"]:
            ax.plot([s for s, _ in r["val_loss"]], [v for _, v in r["val_loss"]], color=col,
                    linestyle="--", marker="o", linewidth=1.2, label=f"{c} val")
    ax.set(xlabel="step", ylabel="loss (nats per byte)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--computes", default=",".join(COMPUTES),
                   help="comma list of bf16, fp8, fp8-wgrad (run in this order)")
    p.add_argument("--steps", type=int, help="default: the example's preset (300)")
    p.add_argument("--extra", default="", help="more train_tiny_moe flags for every run (last, "
                   "so they override), e.g. \"--val-every 3 --d 128\"; one flag alone: "
                   "--extra=--recompute")
    p.add_argument("--out", required=True, help="folder for training-fp8.{md,json,png}")
    args = p.parse_args(argv)
    computes = [c for c in args.computes.split(",") if c]
    bad = [c for c in computes if c not in COMPUTES]
    if bad or not computes or len(set(computes)) != len(computes):
        p.error(f"--computes {args.computes}: a comma list of distinct {', '.join(COMPUTES)}")
    extra = shlex.split(args.extra)
    if "--compute" in extra or any(e.startswith("--compute=") for e in extra):
        p.error("--extra must not set --compute (use --computes)")
    # Every run's flags parsed (and refused) before the first one trains.
    parsed = {}
    for c in computes:
        try:
            a = tt.parse_args(run_argv(c, args.device, args.steps, extra))
        except SystemExit:
            p.error(f"train_tiny_moe refused the flags of the {c} run (its message above): "
                    f"{shlex.join(run_argv(c, args.device, args.steps, extra))}")
        why = check_args(a)
        if why:
            p.error(f"the {c} run: {why}")
        parsed[c] = a
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    runs = {}
    for i, c in enumerate(computes):
        a = parsed[c]
        log(f"run {i + 1}/{len(computes)}: --compute {c} ({a.preset} preset, {a.steps} steps): "
            f"train_tiny_moe {shlex.join(run_argv(c, args.device, args.steps, extra))}")
        t0 = time.perf_counter()
        try:
            with contextlib.redirect_stdout(sys.stderr):  # the example's progress, on stderr
                r = tt.train(a)
            r["wall_s"] = time.perf_counter() - t0
            r["argv"] = run_argv(c, args.device, args.steps, extra)
            runs[c] = r
            log(f"{c}: final val loss {r['final_val_loss']}, train loss (last 20) "
                f"{r['final_train_loss_avg20']:.4f}" +
                (f", median step {r['median_step_s'] * 1e3:.1f} ms, "
                 f"{r['tokens_per_s']:.0f} tokens/s" if "median_step_s" in r else "") +
                f", {r['wall_s']:.0f} s")
        except Exception as ex:  # noqa: BLE001 - the other runs and the report still happen
            traceback.print_exc(file=sys.stderr)
            runs[c] = {"compute": c, "error": f"{type(ex).__name__}: {ex}".replace("\n", " "),
                       "argv": run_argv(c, args.device, args.steps, extra)}
            log(f"{c}: FAILED: {runs[c]['error']}")
        cleanup()
    ratios, failures = compare(runs)
    first = parsed[computes[0]]
    res = {
        "device": args.device, "device_name": device_name(args.device),
        "torch": torch.__version__, "commit": os.environ.get("MOEBLAZE_COMMIT", "unset"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python"] + sys.argv if argv is None
                              else ["python", "bench/fp8_training.py"] + list(argv)),
        "config": {k: getattr(first, k) for k in (
            "preset", "layers", "d", "heads", "E", "K", "n", "seq", "batch", "steps", "dtype",
            "lr", "warmup", "val_every", "val_batches", "seed", "data_seed", "token_rounding",
            "recompute", "m_tile", "aux_loss_coef")},
        "tolerance": TOLERANCE, "runs": runs, "ratios": ratios, "failures": failures,
        "pass": not failures, "wall_s": time.perf_counter() - t_start,
    }
    res["plot"] = plot(os.path.join(args.out, "training-fp8.png"), runs,
                       f"tiny MoE LM, experts in {', '.join(computes)} "
                       f"({first.preset} preset, {res['device_name']})")
    with open(os.path.join(args.out, "training-fp8.json"), "w") as f:
        json.dump(res, f)
    md = table(res)
    with open(os.path.join(args.out, "training-fp8.md"), "w") as f:
        f.write(md)
    print(md, flush=True)
    for why in failures:
        log(f"FAIL: {why}")
    log(f"wrote {', '.join(os.path.join(args.out, 'training-fp8.' + e) for e in ('md', 'json'))}"
        + (f", {res['plot']}" if res["plot"] else "") +
        f"; {'PASS' if res['pass'] else 'FAIL'}")
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
