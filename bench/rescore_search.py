#!/usr/bin/env python3
"""Re-score a past kernel search against the kernel rule of this build, without a GPU: a
prediction of how a rule change fares on timings already measured, before a GPU run measures it.

`moeblaze bench gemm --search` prints every legal candidate's time per GEMM and shape to stderr
(kept as bench/results/kernel-search-candidates-*.txt). For each shape in such a file this asks
`moeblaze bench kernels` (which needs no GPU) what the rule of the given binary picks for a GPU of
the search's SM count, L2 and FLOPs per DRAM byte, finds that kernel among the shape's candidate
lines, and reports its time over the fastest candidate's (*choice / best*), beside the choice the
search itself ran (its `-auto` row's kernel, when the file's jsonl twin is given).

What it cannot tell: a kernel the file never timed (reported as "not timed"); timings move between
runs by a few percent (a search's own twin rows read up to 1.06x apart), so a ratio within about
3 % of 1 is not a verdict. It predicts; a GPU run decides.

  python3 bench/rescore_search.py \\
      bench/results/kernel-search-candidates-2026-12-06-80183b5-h200.txt \\
      --cli build/moeblaze --flops-per-byte 217 [--sms 132] [--l2-mib 50] [--md out.md]
"""
import argparse
import math
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model_shapes  # noqa: E402

# bench gemm's GEMM labels in the candidates file (the "-auto" rows) -> bench kernels' names
GEMMS = {"up": "up_proj", "down": "down_proj", "dH": "dh_proj", "dW2": "dw2_proj", "dX": "dx_proj",
         "dW1": "dw1_proj"}
SHAPE_LINE = re.compile(r"bench gemm: (\S+) T=(\d+) d=(\d+) n=(\d+) E=(\d+) K=(\d+) S=(\d+)")
TIME_LINE = re.compile(r"^\s+(.+?): ([\d.]+) ms")


def parse_candidates(lines):
    """{shape name: {"shape": (T, d, n, E, K), "gemms": {gemm: {kernel description: ms}}}} from a
    search's progress output: each GEMM's candidate lines come before its "<gemm>-auto" line."""
    shapes, cur, pending = {}, None, {}
    for line in lines:
        m = SHAPE_LINE.search(line)
        if m:
            cur = shapes.setdefault(m[1], {"shape": tuple(int(m[i]) for i in range(2, 7)),
                                           "gemms": {}})
            pending = {}
            continue
        m = TIME_LINE.match(line)
        if not m or cur is None:
            continue
        name, ms = m[1], float(m[2])
        if name.endswith("-auto"):
            gemm = GEMMS.get(name[:-len("-auto")])
            if gemm and pending:
                cur["gemms"][gemm] = pending
            pending = {}
        elif " " in name:  # a candidate's description (family schedule tile ...), not a bench row
            pending[name] = ms
    return shapes


def describe(row):
    """The candidate description bench gemm prints, from one row of bench kernels' table:
    family, schedule, tile, stages, cluster and the order column ("raster 16, store by TMA" ->
    "raster=16 store=tma"; "n swizzle 2 bands 1" -> "order=n swizzle=2 bands=1")."""
    order = row["order"]
    extra = []
    if "store by TMA" in order:
        extra.append("store=tma")
        order = order.replace(", store by TMA", "")
    if "B by TMA" in order:
        extra.append("b_tma")
        order = order.replace(", B by TMA", "")
    m = re.fullmatch(r"raster (\d+)", order.strip())
    if m:
        order = f"raster={m[1]}"
    else:
        m = re.fullmatch(r"(\w+) swizzle (\d+) bands (\d+)", order.strip())
        if m:
            order = f"order={m[1]} swizzle={m[2]} bands={m[3]}"
    parts = [row["family"], row["schedule"], row["tile"], f"stages={row['stages']}",
             f"cluster={row['cluster']}", order] + extra
    return " ".join(p for p in parts if p)


def parse_kernels_table(text):
    """{(config, gemm): row} from bench kernels' first table (config | S | GEMM | family | ...)."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) < 10 or cells[2] not in GEMMS.values():
            continue
        out[(cells[0], cells[2])] = {"family": cells[3], "schedule": cells[4], "tile": cells[5],
                                     "stages": cells[6], "cluster": cells[7], "order": cells[8],
                                     "rule": cells[9]}
    return out


def rule_choices(cli, names, device_args):
    """{(config, gemm): row} of the binary's rule for every shape, one bench kernels call per
    activation (the grid's gpt-oss shapes run swiglu-oai)."""
    out = {}
    by_act = {}
    for n in names:
        by_act.setdefault(model_shapes.ACTIVATIONS.get(n, "swiglu"), []).append(n)
    for act, group in by_act.items():
        cmd = [cli, "bench", "kernels", "--config", ",".join(group), "--activation", act]
        cmd += device_args
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            raise SystemExit(f"rescore_search: {' '.join(cmd)} failed: {p.stderr.strip()[:400]}")
        out.update(parse_kernels_table(p.stdout))
    return out


def rescore(shapes, choices):
    """One row per (shape, GEMM): the rule's kernel, its ms over the fastest candidate's."""
    rows = []
    for name, s in shapes.items():
        for gemm, cands in s["gemms"].items():
            best = min(cands, key=cands.get)
            row = {"config": name, "shape": s["shape"], "gemm": gemm, "best": best,
                   "best_ms": cands[best]}
            choice = choices.get((name, gemm))
            if choice is None:
                row["status"] = "no rule row"
            else:
                want = describe(choice)
                row["choice"], row["rule"] = want, choice["rule"]
                if want in cands:
                    row["ratio"] = cands[want] / cands[best]
                else:
                    row["status"] = "not timed"
            rows.append(row)
    return rows


def summary(rows, label):
    scored = [r["ratio"] for r in rows if "ratio" in r]
    if not scored:
        return f"{label}: no GEMM scored"
    geo = math.exp(sum(math.log(x) for x in scored) / len(scored))
    within = sum(x <= 1.03 for x in scored)
    unscored = len(rows) - len(scored)
    return (f"{label}: {within} of {len(scored)} GEMMs within 3 % of the fastest candidate, "
            f"choice / best {geo:.3f} in geometric mean, worst {max(scored):.3f}"
            + (f"; {unscored} not scored (kernel not timed in the file)" if unscored else ""))


def markdown(rows, label):
    lines = [summary(rows, label), "",
             "| config | T / d / n / E / K | gemm | rule's kernel | choice / best | fastest |",
             "|---|---|---|---|---:|---|"]
    for r in sorted(rows, key=lambda r: -r.get("ratio", 0.0)):
        ratio = f"{r['ratio']:.3f}" if "ratio" in r else r.get("status", "")
        lines.append(f"| {r['config']} | {' / '.join(map(str, r['shape']))} | {r['gemm']} | "
                     f"{r.get('choice', '—')} | {ratio} | {r['best']} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("candidates", nargs="+", help="search progress output(s) (bench gemm --search "
                                                  "stderr)")
    ap.add_argument("--cli", default="build/moeblaze",
                    help="the moeblaze binary whose rule to score")
    ap.add_argument("--flops-per-byte", type=int, required=True,
                    help="the searched GPU's peak dense bf16 FLOP/s over DRAM bytes/s (H200 217, "
                         "H100 SXM 319)")
    ap.add_argument("--sms", type=int, default=132, help="the searched GPU's SM count")
    ap.add_argument("--l2-mib", type=int, default=50, help="the searched GPU's L2 in MiB")
    ap.add_argument("--gemm", default="", help="comma list of GEMMs to score (default: all six)")
    ap.add_argument("--md", default="", help="write the Markdown table here")
    args = ap.parse_args(argv)
    if not os.access(args.cli, os.X_OK):
        ap.error(f"--cli {args.cli}: not an executable (build the moeblaze target first)")
    lines = []
    for f in args.candidates:
        with open(f) as fh:
            lines += fh.readlines()
    shapes = parse_candidates(lines)
    if not shapes:
        ap.error("no 'bench gemm: NAME T=.. d=..' shape lines in the candidates file(s)")
    want = {g for g in args.gemm.split(",") if g}
    bad = want - set(GEMMS.values())
    if bad:
        ap.error(f"--gemm {','.join(sorted(bad))}: one of {', '.join(GEMMS.values())}")
    device = ["--flops-per-byte", str(args.flops_per_byte), "--sms", str(args.sms),
              "--l2-mib", str(args.l2_mib)]
    rows = rescore(shapes, rule_choices(args.cli, list(shapes), device))
    if want:
        rows = [r for r in rows if r["gemm"] in want]
    files = ", ".join(map(os.path.basename, args.candidates))
    label = (f"the rule of {args.cli} re-scored against {files} ({len(shapes)} shapes; a "
             "prediction from past timings, not a measurement)")
    md = markdown(rows, label)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
