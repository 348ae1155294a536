#!/usr/bin/env python3
"""Where a kernel's warps stall, instruction by instruction, from Nsight Compute's source page.

On the GPU machine (the report needs the SourceCounters and WarpStateStats sections):
  ncu --section SourceCounters --section WarpStateStats -k regex:NAME --launch-skip S \
      --launch-count 1 -f -o /tmp/r BINARY ARGS...
  ncu -i /tmp/r.ncu-rep --page source --csv --print-source sass > src.csv
Then, anywhere (no ncu needed):
  python3 bench/ncu_source_top.py src.csv [--top 25]
prints the kernel's stall samples by reason, the instructions that hold the most samples (with
their two largest reasons and how often they ran), and the share of samples on the barrier
waits of the warp-specialised ring (SYNCS.PHASECHK ... TRYWAIT and the branch after it: a
consumer waiting for a full stage or the producer for an empty one).
"""
import argparse
import csv
import sys


def load(path):
    rows = list(csv.reader(open(path, newline="")))
    # Row 0 names the kernel, row 1 is the header, then one row per SASS instruction.
    kernel = rows[0][1] if rows and len(rows[0]) > 1 else "?"
    return kernel, rows[1], [r for r in rows[2:] if len(r) == len(rows[1])]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=25, help="instructions to list")
    a = ap.parse_args()
    kernel, hdr, data = load(a.csv)
    col = {h: i for i, h in enumerate(hdr)}
    samples = col.get("Warp Stall Sampling (All Samples)")
    if samples is None:
        sys.exit("no 'Warp Stall Sampling (All Samples)' column: profile with --section SourceCounters")
    src, execd = col["Source"], col.get("Instructions Executed")
    reasons = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
    num = lambda r, i: float(r[i] or 0)  # noqa: E731
    total = sum(num(r, samples) for r in data)
    print(f"kernel: {kernel}")
    print(f"{len(data)} instructions, {total:.0f} stall samples")
    by_reason = sorted(((hdr[i], sum(num(r, i) for r in data)) for i in reasons), key=lambda x: -x[1])
    print("by reason: " + ", ".join(f"{n[6:]} {v / total:.1%}" for n, v in by_reason[:8] if v > 0))
    # A TRYWAIT's samples land on the predicated branch right after it.
    wait = 0.0
    for k, r in enumerate(data):
        if "TRYWAIT" in r[src] and k + 1 < len(data):
            wait += num(r, samples) + num(data[k + 1], samples)
    print(f"on mbarrier waits (TRYWAIT and the branch after it): {wait / total:.1%}")
    print(f"\n{'samples':>8} {'share':>6} {'executed':>10}  instruction  [largest reasons]")
    for r in sorted(data, key=lambda r: -num(r, samples))[: a.top]:
        top2 = sorted(((hdr[i][6:], num(r, i)) for i in reasons), key=lambda x: -x[1])[:2]
        ex = r[execd] if execd is not None else ""
        why = ", ".join(f"{n} {v:.0f}" for n, v in top2 if v > 0)
        print(f"{num(r, samples):8.0f} {num(r, samples) / total:6.1%} {ex:>10}  "
              f"{r[src].strip()[:72]}  [{why}]")


if __name__ == "__main__":
    main()
