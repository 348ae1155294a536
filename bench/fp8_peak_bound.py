#!/usr/bin/env python3
"""How low the FP8 step's peak can go, by arithmetic: the bytes a keep_h forward + backward must
hold at its end whatever the kernels do, for bf16 and for FP8 compute with the weights' e4m3 codes
resident, beside the peaks measured through PyTorch.

A step through PyTorch ends holding its outputs and gradients: out and dx (T, d) bf16, dW1
(E, w1_rows, d) and dW2 (E, d, n) bf16, the pair weights' gradient (S,) fp32; and, until backward
has read it, the kept H: (S, w1_rows) bf16, or e4m3 codes plus 1x128 fp32 scales
(LayerConfig::kept_h_bytes). Where backward's temporaries fit in dW1's bytes before dW1 is
written, the bf16 layer's measured peak is that sum: within 0.3 % at sm-default and olmoe (H100,
5d8a446); at sm-7B-n256 (dX̃'s (S, d) is 3x dW1) and mb-conf4 (n = 4d) they do not fit, and it
measured 1.9x and 1.35x the sum. FP8 compute also needs the weights as codes while its GEMMs run: one orientation
of W1 and W2 is E (w1_rows d + d n) bytes plus 128x128 fp32 scales; the weight cache keeps a
second, transposed one for dX̃ and dH (WGMMA reads e4m3 operands K-major only).

Counted in the peak, resident codes cost more than FP8's kept H saves wherever
    E (w1_rows d + d n) > S w1_rows, i.e. rows per expert (S / E) < d (1 + n / w1_rows):
1.5 d for gated activations. At sm-default (2048 rows an expert, d = 4096) one orientation of codes
is 3x the bytes H saves. So "FP8's peak at most bf16's, the weight cache counted" cannot hold at
such shapes with the codes resident through the step, whatever the kernels and the transients:
only codes that stand in for the bf16 weights (not beside them), or codes made per group of
experts just before their GEMM into a bounded buffer, can meet it (docs/notes/fp8.md, "The peak
target, by arithmetic").

    python3 bench/fp8_peak_bound.py [--config sm-default,olmoe,...] [--measured rows.jsonl]
                                    [--md out.md]
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from named_configs import CONFIGS  # noqa: E402
from model_shapes import SHAPES as GRID_SHAPES  # noqa: E402

MIB = 1 << 20
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MEASURED = os.path.join(RESULTS, "peers-torch-fp8-2026-12-05-5d8a446-h100.jsonl")
# FP8's issue names these four, and two wide grid shapes (d >= 5120).
DEFAULT_CONFIGS = "sm-default,olmoe,sm-7B-n256,mb-conf4,deepseek-v3,glm-4.5,mixtral-8x22b"


def shape_of(name):
    """(T, d, n, E, K) of a named config or a public-model grid shape."""
    return CONFIGS[name] if name in CONFIGS else GRID_SHAPES[name]


def kept_h(S, rows, fp8):
    """LayerConfig::kept_h_bytes: (S, rows) bf16, or e4m3 codes (16-aligned) then 1x128 scales."""
    if not fp8:
        return S * rows * 2
    return (S * rows + 15) // 16 * 16 + S * math.ceil(rows / 128) * 4


def weight_codes(E, d, n, rows):
    """One orientation of W1 (E, rows, d) and W2 (E, d, n) as e4m3 codes with 128x128 scales."""
    codes = E * (rows * d + d * n)
    scales = E * (math.ceil(rows / 128) * math.ceil(d / 128) +
                  math.ceil(d / 128) * math.ceil(n / 128)) * 4
    return codes + scales


def bounds(T, d, n, E, K, gated=True):
    """The step's end-of-backward bytes: outputs, bf16 and FP8 kept H, one orientation of codes."""
    S, rows = T * K, (2 * n if gated else n)
    outputs = 2 * T * d * 2 + E * rows * d * 2 + E * d * n * 2 + S * 4
    h16, h8 = kept_h(S, rows, False), kept_h(S, rows, True)
    codes = weight_codes(E, d, n, rows)
    return {"S": S, "rows_per_expert": S / E, "outputs": outputs, "h_bf16": h16, "h_fp8": h8,
            "codes": codes, "bf16": outputs + h16, "fp8_codes_resident": outputs + h8 + codes,
            "codes_over_h_saving": codes / (h16 - h8),
            "break_even_rows": d * (1 + n / rows)}


def measured_peaks(path):
    """{(config, impl): peak_bytes} of a peers run (bench/peers.py rows)."""
    out = {}
    if not path or not os.path.exists(path):
        return out, None
    gpu = None
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                if r.get("peak_bytes") is not None:
                    out[(r["config"], r["impl"])] = r["peak_bytes"]
                    gpu = gpu or (r.get("gpu"), r.get("commit"), r.get("date"))
    return out, gpu


def table(configs, measured):
    head = ["config", "T / d / n / E / K", "rows per expert", "bf16 bound MiB",
            "bf16 measured MiB", "FP8 bound, codes resident MiB", "÷ bf16's peak",
            "codes ÷ H saved", "FP8 measured (cache not counted) MiB",
            "+ cache's two orientations MiB", "÷ bf16 measured"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for c in configs:
        T, d, n, E, K = shape_of(c)
        b = bounds(T, d, n, E, K)
        m16 = measured.get((c, "moeblaze-torch"))
        m8 = measured.get((c, "moeblaze-torch-fp8-cached"))
        with_cache = m8 + 2 * b["codes"] if m8 is not None else None
        cell = lambda v: "-" if v is None else f"{v / MIB:,.0f}"  # noqa: E731
        lines.append("| " + " | ".join([
            c, f"{T} / {d} / {n} / {E} / {K}", f"{b['rows_per_expert']:.0f}",
            cell(b["bf16"]), cell(m16), cell(b["fp8_codes_resident"]),
            f"{b['fp8_codes_resident'] / (m16 or b['bf16']):.2f}",
            f"{b['codes_over_h_saving']:.2f}",
            cell(m8), cell(with_cache),
            "-" if with_cache is None or m16 is None else f"{with_cache / m16:.2f}"]) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=DEFAULT_CONFIGS, help="comma list of named configs")
    ap.add_argument("--measured", default=MEASURED,
                    help="bench/peers.py rows with moeblaze-torch and moeblaze-torch-fp8-cached")
    ap.add_argument("--md", default="", help="write the table here as Markdown")
    args = ap.parse_args(argv)
    configs = [c.strip() for c in args.config.split(",") if c.strip()]
    for c in configs:
        if c not in CONFIGS and c not in GRID_SHAPES:
            ap.error(f"config '{c}' is neither a named config ({', '.join(CONFIGS)}) nor a "
                     "grid shape (bench/model_shapes.py)")
    measured, gpu = measured_peaks(args.measured)
    text = table(configs, measured) + "\n"
    if gpu:
        text += (f"\nMeasured: {os.path.basename(args.measured)} ({gpu[0]}, {gpu[1]}, {gpu[2]}); "
                 "bounds: host arithmetic (gated activation, keep_h). ÷ bf16's peak: the FP8 "
                 "bound over bf16's measured peak where there is one, else over its bound.\n")
    print(text, end="")
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
