#!/usr/bin/env python3
"""Markdown table of one `moeblaze bench layer` + `bench/torch_reference.py` run (layer.jsonl):
per config and implementation fwd/bwd/total ms, TFLOPS, kept and peak MiB, error, and against the
torch reference of the same run: speed (torch ms / ms) and kept bytes (kept / torch kept).

  python3 bench/layer_table.py layer.jsonl [--title TEXT] > layer.md
"""
import argparse
import json


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl")
    ap.add_argument("--title", default="", help="a paragraph under the heading (GPU, commit, how)")
    args = ap.parse_args()
    rows = [json.loads(l) for l in open(args.jsonl) if l.strip()]
    layer = [r for r in rows if r.get("bench") == "layer"]
    torch = {r["config"]: r for r in layer if r["impl"] == "torch"}
    print("# moeblaze bench layer + bench/torch_reference.py\n")
    if args.title:
        print(args.title + "\n")
    print("| config | impl | fwd ms | bwd ms | total ms | TFLOPS | × torch | kept MiB | kept / torch | "
          "peak MiB | err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    configs = list(dict.fromkeys(r["config"] for r in layer))
    for c in configs:
        t = torch.get(c)
        for r in (r for r in layer if r["config"] == c):
            speed = "%.2f" % (t["total_ms"] / r["total_ms"]) if t and r is not t else "-"
            kept = ("%.4f" % (r["kept_bytes"] / t["kept_bytes"])
                    if t and r is not t and r["impl"] != "dense-bound" else "-")
            err = r.get("max_rel_err")
            print("| %s | %s | %.3f | %.3f | %.3f | %.1f | %s | %.1f | %s | %.1f | %s |" % (
                c, r["impl"], r["fwd_ms"], r["bwd_ms"], r["total_ms"], r["total_tflops"], speed,
                r["kept_bytes"] / 2**20, kept, r["peak_bytes"] / 2**20,
                "-" if err is None else "%.1e" % err))


if __name__ == "__main__":
    main()
