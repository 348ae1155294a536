#!/usr/bin/env python3
"""SonicMoE's GEMMs one by one, from QuACK's autotune cache, beside moeblaze's per-step breakdown.

SonicMoE (through quack-kernels) autotunes every GEMM of its layer at each new shape and, with
QUACK_CACHE_AUTOTUNING=1, writes each search to `<cache>/<hash>/<gemm>.autotune.json`: the call's
tensor shapes and the time of every config tried (triton.testing.do_bench, L2 cleared before each
repetition, quantiles 0.5 / 0.2 / 0.8). That is a per-kernel timing of the peer measured on the
device, which the layer-level peer rows cannot give. This program reads such a cache (a folder or
a .tgz such as bench/cache/sonicmoe-autotune.tgz), names each GEMM by moeblaze's step names
(up-proj, down-proj, dH, dW2, dX~, dW1) by matching its shapes to a named config, and prints per GEMM the
best config, its median ms and TFLOP/s, and, given moeblaze's `layer-step` rows (`moeblaze bench
layer --breakdown --json`), moeblaze's ms for the same step and the ratio.

  python3 bench/quack_kernels.py bench/cache/sonicmoe-autotune.tgz \
      --ours bench/results/layer-breakdown-2026-12-04-bdfbe09.jsonl
  python3 bench/quack_kernels.py bench/cache/sonicmoe-autotune.tgz \
      --ours bench/results/tma-store-stages-ab-2026-12-07-91d0a74-h100.jsonl  # bench gemm rows
  python3 bench/quack_kernels.py CACHE --json out.jsonl --md out.md --all-configs
  python3 bench/quack_kernels.py bench/cache/sonicmoe-autotune.tgz \
      --compare "128x256 coop c2x1,128x192 pingpong c2x1"

Shapes are named from the named configs and the public-model grid (bench/model_shapes.py).
--compare puts SonicMoE's own time for the given configs beside its best, as ratios to the best:
one implementation, one timing method, so the ratio isolates the tile and schedule (for instance
the 128 x 256 cooperative tile moeblaze's kernels use against the one the search picked).
"""
import argparse
import io
import json
import os
import re
import sys
import tarfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_reference import CONFIGS, EXTRA_SHAPES  # noqa: E402  (imports torch)
import model_shapes  # noqa: E402


def load_cache(path):
    """(gemm function name, parsed json) for every *.autotune.json under a folder or in a .tgz."""
    out = []
    if os.path.isdir(path):
        for root, _, files in os.walk(path):
            for f in sorted(files):
                if f.endswith(".autotune.json"):
                    with open(os.path.join(root, f)) as fh:
                        out.append((f.split(".")[0], json.load(fh)))
    else:
        with tarfile.open(path) as tar:
            for m in tar.getmembers():
                if m.name.endswith(".autotune.json"):
                    data = tar.extractfile(m).read()
                    out.append((os.path.basename(m.name).split(".")[0],
                                json.load(io.BytesIO(data))))
    return out


def shapes_of(key):
    """[(shape, stride signature)] of the call's tensors: QuACK's key lists each tensor's
    torch.Size and then its stride signature (e.g. "[2, 1, 2]": which dimension is contiguous)."""
    out = []
    for i, k in enumerate(key):
        if k.startswith("torch.Size"):
            stride = key[i + 1] if i + 1 < len(key) else ""
            out.append((tuple(int(v) for v in re.findall(r"\d+", k)),
                        tuple(int(v) for v in re.findall(r"\d+", stride))))
    return out


def classify(fn, shapes):
    """(kind, S, d, x, E, flops) of one GEMM call from its tensors (QuACK's argument order);
    x is n for up-proj and dH, K for a varlen-M GEMM, N for a varlen-K GEMM."""
    t = [sh for sh, _ in shapes]
    if fn == "gemm_gated_tuned":  # x (T, d), w1 (E, d, 2n), preact out (S, 2n)
        (_, d), (E, _, n2), (S, _) = t[0], t[1], t[2]
        return "1 up-proj", S, d, n2 // 2, E, 2.0 * S * d * n2
    if fn == "gemm_dgated_tuned":  # dO (T, d), w2 (E, d, n), preact (S, 2n)
        (_, d), (E, _, n), (S, _) = t[0], t[1], t[2]
        return "4 dH", S, d, n, E, 2.0 * S * d * n
    if fn != "gemm_tuned":
        return None
    if len(t[1]) == 3:  # varlen-M: A (S, K) contiguous, B (E, K, N), out (S, N)
        (S, K), (E, _, N) = t[0], t[1]
        # B K-contiguous (stride signature 1 in the middle) is w2 seen as (E, n, d): down-proj;
        # N-contiguous is w1 (E, 2n, d): dX~.
        kind = "2 down-proj" if shapes[1][1][1:2] == (1,) else "6 dX~"
        return kind, S, N, K, E, 2.0 * S * K * N
    # varlen-K: A (M, T) gathered along the tokens, B (S, N), out (E, M, N)
    (M, _), (S, N) = t[0], t[1]
    E = t[2][0] if len(t) > 2 and len(t[2]) == 3 else 0
    return "varlen-k", S, M, N, E, 2.0 * S * M * N


def name_configs(kind, S, d, x, E):
    """Every (named config, moeblaze step) whose GEMM has these sizes (two configs can share
    one: sm-default's down-proj is sm-30B-n512's dX~ in shape)."""
    out = []
    named = list(CONFIGS.items()) + list(EXTRA_SHAPES.items()) + list(model_shapes.SHAPES.items())
    for name, (T, cd, cn, cE, cK) in named:
        if T * cK != S or cd != d or (E and cE != E):
            continue
        if kind in ("1 up-proj", "4 dH") and cn == x:
            out.append((name, kind))
        elif kind == "2 down-proj" and x == cn:
            out.append((name, kind))
        elif kind == "6 dX~" and x == 2 * cn:
            out.append((name, kind))
        elif kind == "varlen-k" and x in (cn, 2 * cn):
            out.append((name, "5 dW2" if x == cn else "8 dW1"))
    return out or [(f"(S {S}, d {d}, {x}, E {E})", kind)]  # no named shape: its sizes


def short(cfg):
    c = re.sub(r"config: GemmConfig\(|\)", "", cfg)
    f = dict(kv.split("=") for kv in c.split(", "))
    sched = "pingpong" if f.get("pingpong") == "True" else "coop"
    return f"{f['tile_m']}x{f['tile_n']} {sched} c{f['cluster_m']}x{f['cluster_n']}"


# `moeblaze bench gemm` rows of each GEMM's automatic choice, by moeblaze's step names.
GEMM_STEPS = {"up-auto": "1 up-proj", "down-auto": "2 down-proj", "dH-auto": "4 dH",
              "dW2-auto": "5 dW2", "dX-auto": "6 dX~", "dW1-auto": "8 dW1"}


def read_ours(paths):
    """{(config, step): {"ms", "commit"}} from `layer-step` rows (bench layer --breakdown) and from
    `bench gemm` rows of the automatic choices without kernel overrides (an override sweep's
    baseline spec): the median over a key's rows (a sweep's rounds)."""
    times = {}
    for path in paths:
        for line in open(path):
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if r.get("bench") == "layer-step":
                key = (r["config"], r["step"])
            elif r.get("bench") == "gemm" and r.get("gemm") in GEMM_STEPS and not r.get("kernels"):
                key = (r["config"], GEMM_STEPS[r["gemm"]])
            else:
                continue
            times.setdefault(key, []).append((r["ms"], r.get("commit")))
    return {k: {"ms": sorted(v)[len(v) // 2][0], "commit": v[-1][1]} for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cache", help="QuACK cache folder or .tgz of it")
    ap.add_argument("--ours", action="append", default=[],
                    help="jsonl with moeblaze `layer-step` rows (bench layer --breakdown --json)")
    ap.add_argument("--json", help="write one row per GEMM here")
    ap.add_argument("--md", help="write the Markdown table here")
    ap.add_argument("--all-configs", action="store_true",
                    help="also print every config's median ms per GEMM")
    ap.add_argument("--compare", default="",
                    help="comma list of configs as printed (e.g. '128x256 coop c2x1'): each one's "
                         "SonicMoE time over SonicMoE's best, a column per config")
    args = ap.parse_args()
    compare = [c.strip() for c in args.compare.split(",") if c.strip()]

    ours = read_ours(args.ours)
    rows = []
    for fn, data in load_cache(args.cache):
        shapes = shapes_of(data["key"])
        c = classify(fn, shapes)
        if c is None:
            continue
        kind, S, d, x, E, flops = c
        timed = [(cfg, sorted(t)[len(t) // 2]) for cfg, t in data["configs_timings"]]
        best_cfg, best_ms = min(timed, key=lambda ct: ct[1])
        for config, step in name_configs(kind, S, d, x, E):
            row = {"bench": "peer-gemm", "impl": "sonicmoe", "config": config, "step": step,
                   "S": S, "flops": flops, "ms": best_ms, "tflops": flops / best_ms / 1e9,
                   "best": short(best_cfg), "configs_tried": len(timed)}
            mine = ours.get((config, step))
            if mine:
                row["moeblaze_ms"] = mine["ms"]
                row["moeblaze_commit"] = mine.get("commit")
            if args.all_configs or compare:
                row["all"] = {short(cfg): ms for cfg, ms in timed}
            rows.append(row)
    rows.sort(key=lambda r: (r["config"], r["step"]))

    lines = ["| config | step | SonicMoE best config | SonicMoE ms | TFLOP/s | moeblaze ms | "
             "moeblaze TFLOP/s | moeblaze ÷ SonicMoE |" + "".join(f" {c} ÷ best |" for c in compare),
             "|---|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(compare)]
    for r in rows:
        m = r.get("moeblaze_ms")
        if compare:  # "—": the search did not try that config at this shape
            r["vs_best"] = {c: r["all"][c] / r["ms"] for c in compare if c in r["all"]}
        lines.append(f"| {r['config']} | {r['step']} | {r['best']} | {r['ms']:.3f} | "
                     f"{r['tflops']:.0f} | " + (f"{m:.3f} | {r['flops'] / m / 1e9:.0f} | "
                                                f"{m / r['ms']:.2f} |" if m else "— | — | — |")
                     + "".join(f" {r['vs_best'][c]:.3f} |" if c in r["vs_best"] else " — |"
                               for c in compare))
    print("\n".join(lines))
    if args.all_configs:
        for r in rows:
            print(f"\n{r['config']} {r['step']}:")
            for cfg, ms in sorted(r["all"].items(), key=lambda kv: kv[1]):
                print(f"  {cfg:28s} {ms:.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    if args.md:
        with open(args.md, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
