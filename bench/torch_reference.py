#!/usr/bin/env python3
"""The `torch` baseline of docs/DESIGN.md's layer benchmark: an MoE layer the way a PyTorch user
writes it today — sort the (token, expert) pairs by expert, gather X into an (S, d) copy, two
`torch._grouped_mm` calls with SwiGLU between them, router weights applied to the expert outputs,
scatter-add back to tokens — forward and backward through autograd.

Prints one JSON line per config with docs/DESIGN.md's layer-row fields (bench, config, impl="torch",
T, d, n, E, K, activation, routing, fwd_ms, bwd_ms, total_ms, fwd_tflops, bwd_tflops, total_tflops,
kept_bytes, peak_bytes, max_rel_err, gpu, commit, date) and a Markdown table on stderr.

  kept_bytes  : bytes of the tensors autograd saved for backward (saved_tensors_hooks), counting
                each storage once and leaving out the layer's inputs (x, w1, w2, router weights),
                which are referenced, not copied.
  peak_bytes  : torch.cuda.max_memory_allocated over forward+backward minus the bytes allocated
                before the step, minus the step's outputs (out, dx, dw1, dw2, d weights) which the
                caller owns in the moeblaze rows.
  max_rel_err : relative Frobenius error of out and dx against a float64 recomputation on a
                random subsample of tokens (per-token quantities; the weight gradients would need
                the whole layer in float64).

Protocol: CUDA events, warm-up, median of --reps (>= 20), L2 flushed between repetitions by
writing a 256 MiB buffer, backward = median(forward+backward) - median(forward). Inputs are
N(0, 1) (weights scaled by 1/sqrt(fan_in)); routing is softmax of N(0, 1) logits, top-K, seeded.

Usage: python3 bench/torch_reference.py [--config NAME|all] [--reps 20] [--out FILE.jsonl]
"""
import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

# docs/DESIGN.md's named configs and the extra shapes (T, d, n, E, K): bench/named_configs.py,
# which needs no torch.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from named_configs import CONFIGS, EXTRA_SHAPES  # noqa: E402,F401


def moe_layer(x, w1, w2, topk_ids, topk_w, n, E, K, pad_to=0, grouped_mm=None):
    """What a PyTorch user writes: sort, gather, grouped GEMM, SwiGLU, grouped GEMM, weight,
    scatter-add. x (T, d) bf16, w1 (E, 2n, d), w2 (E, d, n), topk_ids (T, K) int64, topk_w (T, K)
    fp32 (requires grad). pad_to > 0 pads each expert's rows to a multiple (older _grouped_mm
    builds need 16-row groups in backward). grouped_mm(a, b_t, offs): the grouped GEMM
    (torch._grouped_mm; bench/torch_fp8_reference.py passes its FP8 one)."""
    mm = grouped_mm or (lambda a, b_t, offs: torch._grouped_mm(a, b_t, offs=offs))
    T = x.shape[0]
    flat = topk_ids.reshape(-1)  # (T*K,)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    tok = order // K  # (S,) token of each sorted pair
    counts = torch.bincount(flat, minlength=E)
    w_sorted = topk_w.reshape(-1)[order]  # (S,) fp32
    if pad_to:
        padded = (counts + pad_to - 1) // pad_to * pad_to
        starts = torch.cumsum(padded, 0) - padded
        rank = torch.arange(flat.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[flat[order]]
        dest = starts[flat[order]] + rank
        total = int(padded.sum())
        xs = x.new_zeros(total, x.shape[1])
        xs = xs.index_copy(0, dest, x[tok])
        offs = torch.cumsum(padded, 0).to(torch.int32)
    else:
        xs = x[tok]  # (S, d) gathered copy
        offs = torch.cumsum(counts, 0).to(torch.int32)
    h = mm(xs, w1.transpose(-2, -1), offs)  # (S, 2n)
    g, u = h[:, :n], h[:, n:]
    a = F.silu(g) * u  # (S, n)
    y = mm(a, w2.transpose(-2, -1), offs)  # (S, d)
    if pad_to:
        y = y[dest]
    y = y * w_sorted.unsqueeze(-1).to(y.dtype)
    return torch.zeros_like(x).index_add_(0, tok, y)  # (T, d) scatter-add


def reference_rows(x, w1, w2, topk_ids, topk_w, dout, n, tokens):
    """float64 out and dx of the sampled tokens."""
    outs, dxs = [], []
    for t in tokens.tolist():
        xt = x[t].double()
        o = torch.zeros_like(xt)
        dx = torch.zeros_like(xt)
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            s = float(topk_w[t, k])
            W1 = w1[e].double()
            W2 = w2[e].double()
            h = W1 @ xt
            g, u = h[:n], h[n:]
            sg = torch.sigmoid(g)
            a = g * sg * u
            o += s * (W2 @ a)
            da = s * (W2.t() @ dout[t].double())
            dg = da * u * sg * (1 + g * (1 - sg))
            du = da * g * sg
            dx += W1.t() @ torch.cat([dg, du])
        outs.append(o)
        dxs.append(dx)
    return torch.stack(outs), torch.stack(dxs)


def saved_storage_counter(inputs):
    """({storage ptr: bytes}, a saved_tensors_hooks pack function filling it): the storages
    autograd saves, each counted once, the given inputs' storages left out."""
    input_ptrs = {t.untyped_storage().data_ptr() for t in inputs}
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in input_ptrs:
            saved[st.data_ptr()] = st.nbytes()
        return t
    return saved, pack


def rel_err(a, ref):
    return float(torch.linalg.norm(a.double() - ref) / max(float(torch.linalg.norm(ref)), 1e-30))


def median(v):
    v = sorted(v)
    m = len(v) // 2
    return v[m] if len(v) % 2 else 0.5 * (v[m - 1] + v[m])


def step_timer(device):
    """run(fn): fn's time in ms, by CUDA events on "cuda" (device type), else the wall clock."""
    if device == "cuda":
        def run(fn):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b)
    else:
        def run(fn):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
    return run


def git_commit():
    if os.environ.get("MOEBLAZE_COMMIT"):
        return os.environ["MOEBLAZE_COMMIT"]
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        c = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                           text=True, check=True).stdout.strip()
        return c or "unknown"
    except Exception:
        return os.environ.get("MOEBLAZE_COMMIT", "unknown")


def driver_version():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True).stdout.strip().splitlines()[0]
    except Exception:
        return "unknown"


def run_config(name, reps, seed, dev, flush):
    T, d, n, E, K = CONFIGS[name]
    gen = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(T, d, device=dev, generator=gen).to(torch.bfloat16).requires_grad_()
    w1 = (torch.randn(E, 2 * n, d, device=dev, generator=gen) / math.sqrt(d)).to(torch.bfloat16).requires_grad_()
    w2 = (torch.randn(E, d, n, device=dev, generator=gen) / math.sqrt(n)).to(torch.bfloat16).requires_grad_()
    logits = torch.randn(T, E, device=dev, generator=gen)
    probs = torch.softmax(logits, dim=-1)
    topk_w, topk_ids = torch.topk(probs, K, dim=-1)  # ties to the lower id, as moeblaze's router
    topk_w = topk_w.detach().requires_grad_()
    dout = torch.randn(T, d, device=dev, generator=gen).to(torch.bfloat16)
    inputs = [x, w1, w2, topk_w]

    pad_to = 0
    try:
        out = moe_layer(x, w1, w2, topk_ids, topk_w, n, E, K)
        out.backward(dout)
    except RuntimeError as err:  # older builds: groups must be 16-row aligned
        print(f"torch_reference: {name}: unpadded _grouped_mm failed ({err}); padding groups to 16",
              file=sys.stderr)
        pad_to = 16
    for t in inputs:
        t.grad = None
    torch.cuda.synchronize()

    def step(backward):
        out = moe_layer(x, w1, w2, topk_ids, topk_w, n, E, K, pad_to)
        if backward:
            out.backward(dout)
        return out

    # Memory: saved tensors (one count per storage, inputs excluded) and the peak.
    saved, pack = saved_storage_counter(inputs)

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step(False)
    kept_bytes = sum(saved.values())
    out.backward(dout)
    torch.cuda.synchronize()
    output_bytes = out.numel() * 2 + sum(t.grad.numel() * t.grad.element_size() for t in inputs)
    peak_bytes = torch.cuda.max_memory_allocated() - base - output_bytes

    # Error on a token subsample against float64.
    sample = torch.randperm(T, device=dev, generator=gen)[: min(T, 32)]
    ref_o, ref_dx = reference_rows(x.detach(), w1.detach(), w2.detach(), topk_ids, topk_w.detach(),
                                   dout, n, sample)
    err = max(rel_err(out.detach()[sample], ref_o), rel_err(x.grad[sample], ref_dx))
    del out
    for t in inputs:
        t.grad = None

    def timed(backward):
        times = []
        for i in range(reps + 3):
            flush.fill_(float(i))  # evict L2 (not timed)
            for t in inputs:
                t.grad = None
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            o = step(backward)
            stop.record()
            torch.cuda.synchronize()
            del o
            if i >= 3:
                times.append(start.elapsed_time(stop))
        return median(times)

    fwd = timed(False)
    total = timed(True)
    bwd = total - fwd
    S = T * K
    f_fwd = 6.0 * S * n * d
    f_bwd = 12.0 * S * n * d
    return {
        "bench": "layer", "config": name, "impl": "torch", "T": T, "d": d, "n": n, "E": E, "K": K,
        "activation": "swiglu", "routing": "softmax-topk",
        "fwd_ms": fwd, "bwd_ms": bwd, "total_ms": total,
        "fwd_tflops": f_fwd / fwd / 1e9, "bwd_tflops": f_bwd / bwd / 1e9 if bwd > 0 else None,
        "total_tflops": (f_fwd + f_bwd) / total / 1e9,
        "kept_bytes": int(kept_bytes), "peak_bytes": int(peak_bytes), "max_rel_err": err,
        "grouped_mm_pad": pad_to,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="all", help="a named config or 'all' (cpu-default excluded)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default="", help="append JSON lines here too")
    args = ap.parse_args()
    if args.reps < 20:
        ap.error("--reps must be >= 20 (the benchmark protocol)")
    if not torch.cuda.is_available():
        print("torch_reference: skipped: no GPU", file=sys.stderr)
        return 0
    if not hasattr(torch, "_grouped_mm"):
        print("torch_reference: torch._grouped_mm is missing in torch " + torch.__version__, file=sys.stderr)
        return 1
    names = [c for c in CONFIGS if c != "cpu-default"] if args.config == "all" else args.config.split(",")
    for c in names:
        if c not in CONFIGS:
            ap.error(f"unknown config '{c}'; one of: {', '.join(CONFIGS)}")
    dev = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)  # >= 2x the 60 MB L2
    meta = {"gpu": torch.cuda.get_device_name(0), "driver": driver_version(), "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "torch": torch.__version__}
    rows = []
    for c in names:
        try:
            row = run_config(c, args.reps, args.seed, dev, flush)
        except torch.OutOfMemoryError as err:
            print(f"torch_reference: {c}: out of memory ({err})", file=sys.stderr)
            torch.cuda.empty_cache()
            continue
        row.update(meta)
        rows.append(row)
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
        torch.cuda.empty_cache()
    print("| config | impl | fwd ms | bwd ms | total ms | total TFLOPS | kept MiB | peak MiB | max rel err |",
          file=sys.stderr)
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|", file=sys.stderr)
    for r in rows:
        print(f"| {r['config']} | torch | {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | {r['total_ms']:.3f} | "
              f"{r['total_tflops']:.1f} | {r['kept_bytes'] / 2**20:.1f} | {r['peak_bytes'] / 2**20:.1f} | "
              f"{r['max_rel_err']:.2e} |", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
