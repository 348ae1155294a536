"""Kernel overrides side by side: `moeblaze bench gemm` (each GEMM alone) or `moeblaze bench layer`
(--bench layer: the keep_h step's fwd+bwd) under each MOEBLAZE_KERNELS spec, in alternating rounds
(spec order forwards, then backwards, so clock and temperature drift fall on all alike), one table
of each GEMM's (or the step's, and its forward and backward apart) median ms per spec and its
ratio to the first spec.

A spec is what MOEBLAZE_KERNELS takes (kernel_config.hpp; "" = the automatic choice); specs are
separated by ';' because a spec holds commas. Every row that bench prints is kept, with the
spec in force added as `kernels` (bench layer's rows carry it themselves).

    python3 bench/override_sweep.py --cli build/moeblaze --configs olmoe,sm-default \
        --only dX-tmapp,down-tmapp --specs ";tma.order=m;tma.swizzle=4" --rounds 2 \
        --out sweep.jsonl --md sweep.md
    python3 bench/override_sweep.py --bench layer --configs olmoe,sm-default --specs ";raster=8" \
        --rounds 4
    python3 bench/override_sweep.py --bench layer --impl moeblaze-fp8 --configs sm-default \
        --specs ";fp8.cluster=2" --rounds 2
    python3 bench/override_sweep.py --bench layer --configs kimi-k2 \
        --shapes "12288,2560,768,256,6;9000,4096,1024,96,4" --specs ";raster=8"

--shapes (bench layer only) adds shapes by T,d,n,E,K, one `bench layer --shape` call each, so
a rule can be checked away from the named configs.

A config or shape that a call leaves without rows (bench layer skips one too large for the GPU's
memory, or with a dimension a kernel cannot take, and says so on its stderr) is named under the
table ("no rows: ..."), with the bench's own line passed on to stderr.

--out gets each call's rows as soon as the call returns, so a sweep stopped by SIGTERM (`timeout`)
or by a failing call keeps what it measured; --md then gets the table of those rows with a line
saying how many calls of how many ran.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time


def run_once(cli, bench, configs, only, spec, reps, timeout, impl="moeblaze", shape=None):
    """The rows of one `bench gemm` / `bench layer` call under MOEBLAZE_KERNELS=spec (bench layer:
    of `--shape shape` instead of the configs when shape is given)."""
    env = dict(os.environ)
    env.pop("MOEBLAZE_KERNELS", None)
    if spec:
        env["MOEBLAZE_KERNELS"] = spec
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
        if bench == "gemm":
            cmd = [cli, "bench", "gemm", "--configs", configs, "--only", only, "--no-dense",
                   "--reps", str(reps), "--out", f.name]
        else:
            which = ["--shape", shape] if shape else ["--config", configs]
            cmd = [cli, "bench", "layer", *which, "--impl", impl,
                   "--no-aggregate", "--reps", str(reps), "--out", f.name]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} (MOEBLAZE_KERNELS={spec!r}) failed "
                               f"({p.returncode}):\n{p.stderr[-2000:]}")
        rows = [json.loads(line) for line in open(f.name) if line.strip()]
    # A config or shape the bench could not run (too large for the GPU's memory, a dimension a
    # kernel cannot take) leaves no row and a line on its stderr, not a failure: say so here.
    for line in p.stderr.splitlines():
        if ": skipped" in line or ": device error" in line:
            print(f"override_sweep: (MOEBLAZE_KERNELS={spec!r}) {line}", file=sys.stderr)
    for r in rows:
        r["kernels"] = spec
        if bench == "layer":  # the table's columns: the step's total under its impl's name
            r["gemm"], r["ms"] = r["impl"], r["total_ms"]
    return rows


def table(rows, specs):
    """Markdown: per (config, gemm), each spec's median ms and its ratio to specs[0]'s; bench layer
    rows also give their forward and backward alone ('<impl> fwd', '<impl> bwd'), which tell the
    GEMMs of one pass from the other's (an override of up moves fwd, of dH bwd)."""
    by = {}
    for r in rows:
        by.setdefault((r["config"], r["gemm"]), {}).setdefault(r["kernels"], []).append(r["ms"])
        for part in ("fwd", "bwd"):
            if r.get(f"{part}_ms") is not None and r["gemm"] == r.get("impl"):
                by.setdefault((r["config"], f"{r['gemm']} {part}"), {}).setdefault(
                    r["kernels"], []).append(r[f"{part}_ms"])
    head = "| config | gemm | " + " | ".join(f"`{s or 'auto'}` ms" for s in specs) + " |"
    lines = [head, "|---|---|" + "---:|" * len(specs)]
    for (config, gemm), per in by.items():
        base = statistics.median(per[specs[0]]) if specs[0] in per else None
        cells = []
        for s in specs:
            if s not in per:
                cells.append("—")
                continue
            m = statistics.median(per[s])
            ratio = f" ({m / base:.3f})" if base and s != specs[0] else ""
            cells.append(f"{m:.3f}{ratio}")
        lines.append(f"| {config} | {gemm} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cli", default="build/moeblaze", help="the moeblaze binary")
    ap.add_argument("--bench", default="gemm", choices=("gemm", "layer"), help="which benchmark")
    ap.add_argument("--configs", default="", help="named configs (comma list)")
    ap.add_argument("--shapes", default="",
                    help="bench layer: ';'-separated T,d,n,E,K shapes, timed after the configs")
    ap.add_argument("--only", default="", help="bench gemm --only (the GEMMs to time)")
    ap.add_argument("--impl", default="moeblaze",
                    help="bench layer --impl (comma list, e.g. moeblaze-fp8,moeblaze-fp8-wgrad)")
    ap.add_argument("--specs", required=True, help="';'-separated MOEBLAZE_KERNELS specs")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (>= 1)")
    ap.add_argument("--reps", type=int, default=20, help="bench gemm --reps (>= 20)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per bench gemm call")
    ap.add_argument("--out", help="append the rows (JSON lines) here")
    ap.add_argument("--md", help="write the table here")
    args = ap.parse_args()
    specs = [s.strip() for s in args.specs.split(";")]
    if args.rounds < 1 or len(specs) < 1:
        ap.error("--rounds must be >= 1 and --specs must name at least one spec")
    shapes = [x.strip() for x in args.shapes.split(";") if x.strip()]
    if not args.configs and not shapes:
        ap.error("give --configs, --shapes (bench layer) or both")
    if shapes and args.bench != "layer":
        ap.error("--shapes takes bench layer only")
    if args.bench == "gemm" and not args.only:
        ap.error("--bench gemm needs --only (the GEMMs to time)")
    rows = []
    missing = {}  # config or shape -> the specs under which it left no row
    calls = args.rounds * len(specs)
    done = 0
    out = open(args.out, "a") if args.out else None

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    t0 = time.time()
    try:
        for r in range(args.rounds):
            for spec in specs if r % 2 == 0 else specs[::-1]:
                print(f"override_sweep: [{done + 1}/{calls}] round {r + 1}, "
                      f"MOEBLAZE_KERNELS={spec!r} ({time.time() - t0:.0f} s)", file=sys.stderr)
                got = []
                if args.configs:
                    part = run_once(args.cli, args.bench, args.configs, args.only, spec,
                                    args.reps, args.timeout, args.impl)
                    have = {r["config"] for r in part}
                    for c in (c.strip() for c in args.configs.split(",")):
                        # 'all' and 'grid' name groups: their rows carry each member's name
                        if c and c not in ("all", "grid") and c not in have:
                            missing.setdefault(c, set()).add(spec)
                    got += part
                for shape in shapes:
                    part = run_once(args.cli, args.bench, "", "", spec, args.reps, args.timeout,
                                    args.impl, shape)
                    if not part:
                        missing.setdefault(shape, set()).add(spec)
                    got += part
                rows += got
                done += 1
                if out:
                    for row in got:
                        out.write(json.dumps(row) + "\n")
                    out.flush()
    finally:
        if out:
            out.close()
        text = table(rows, specs)
        for what, under in missing.items():
            text += (f"\nno rows: {what} under " + ", ".join(repr(s) for s in specs if s in under)
                     + " (the bench's own line is above, on stderr)\n")
        if done < calls:
            text += f"\npartial: {done} of {calls} calls ran\n"
            print(f"override_sweep: stopped after {done} of {calls} calls", file=sys.stderr)
        print(text)
        if args.md:
            with open(args.md, "w") as f:
                f.write(text)

if __name__ == "__main__":
    main()
