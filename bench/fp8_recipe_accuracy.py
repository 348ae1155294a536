"""Per-tensor error of FP8 recipes for the MoE layer against float64, in torch: which GEMMs get
e4m3 operands decides the FP8 recipe (docs/FP8.md). Prints a table.

Variants (all with bf16 inputs and weights, fp32 math on the dequantized operands):
  bf16       no quantization (the storage path's operands)
  fp8-data   the library's recipe: X, A, dO, dH in 1x128 tiles along K, W1, W2 in 128x128
             blocks, H kept quantized (1x128 along w1_rows); weight gradients on bf16 operands
  fp8-all    fp8-data, and the weight-gradient GEMMs' operands (dO, A' for dW2; dH, X for dW1)
             quantized in 128x1 tiles along their K, the expert's tokens
  fp8-data-pow2  (with --pow2-scales) fp8-data with each scale rounded up to a power of two, so
             x / scale is exact and a quantizer needs no division (docs/notes/fp8.md, "Tried and
             not kept")
The quantization follows src/core/fp8.hpp's rule (scale = max(amax, 448 * 2^-126) / 448, codes
= e4m3(x / scale)), with torch's float8_e4m3fn cast (round to nearest even; |x / scale| <= 448
so nothing saturates). The library's own fp8 paths (compute_dtype="fp8" and "fp8-wgrad") are
printed beside fp8-data and fp8-all as a check of the emulation.

--device cuda measures the library's GPU paths instead, since the GPU, not the CPU emulation, is
what trains: compute_dtype None ("library bf16", the storage path), "fp8" and "fp8-wgrad" of
moe_experts on the GPU, at a shape the GPU FP8 path takes (d and n multiples of 128; default
4096,1024,1024,32,4, seconds on an H200), each against a float64 reference computed on the GPU one
expert at a time (moeblaze.reference.torch_experts: dense_reference's memory grows with T*K*d*n),
then each fp8 recipe's error over the library bf16 path's (the target was <= 4x, which no e4m3
recipe meets: docs/FP8.md). The emulated variants run there too, on the GPU in fp32 (no TF32),
unless --no-emulation. A variant that raises is printed as an error row and makes the exit status 1.

    PYTHONPATH=python python bench/fp8_recipe_accuracy.py [--shape T,d,n,E,K] [--seeds 3]
    PYTHONPATH=python python bench/fp8_recipe_accuracy.py --device cuda [--md table.md]
"""
import argparse
import datetime
import os
import shlex
import sys
import time

import torch

import moeblaze
from moeblaze.reference import activation_fn, dense_reference, torch_experts

G = 128
FLOOR = 448.0 * 2.0 ** -126
DEFAULT_SHAPE = {"cpu": "512,256,256,8,2", "cuda": "4096,1024,1024,32,4"}
EMULATED = ("bf16", "fp8-data", "fp8-all")
LIBRARY = {"library bf16": None, "library fp8": "fp8", "library fp8-wgrad": "fp8-wgrad"}
TENSORS = ("out", "dx", "dw1", "dw2")


def _fq_groups(x, dims, pow2=False):
    """Fake-quantize x (fp32) with one scale per group spanning `dims` (already shaped so);
    pow2: the scale rounded up to a power of two."""
    amax = x.abs().amax(dim=dims, keepdim=True)
    scale = torch.clamp(amax, min=FLOOR) / 448.0
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    scale = torch.where(amax == 0, torch.ones_like(amax), scale)
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


def fq_rows(x, pow2=False):
    """1x128 tiles along the last dimension (partial at the edge)."""
    r, c = x.shape
    pad = (-c) % G
    xp = torch.nn.functional.pad(x, (0, pad)).reshape(r, -1, G)
    return _fq_groups(xp, (2,), pow2).reshape(r, -1)[:, :c]


def fq_cols(x):
    """128x1 tiles along the first dimension (the tokens of a weight-gradient GEMM's K)."""
    return fq_rows(x.t().contiguous()).t()


def fq_blocks(w, pow2=False):
    """128x128 blocks."""
    r, c = w.shape
    pr, pc = (-r) % G, (-c) % G
    wp = torch.nn.functional.pad(w, (0, pc, 0, pr)).reshape((r + pr) // G, G, (c + pc) // G, G)
    return _fq_groups(wp, (1, 3), pow2).reshape(r + pr, c + pc)[:r, :c]


def layer(x, w1, w2, ids, wts, d_out, activation, variant):
    """out, dx, dw1, dw2 of the variant, fp32 math on (fake-quantized) operands, on x's device."""
    T, d = x.shape
    E, R, _ = w1.shape
    n = w2.shape[2]
    dev = x.device
    q = variant != "bf16"
    p2 = variant == "fp8-data-pow2"
    fr = (lambda t: fq_rows(t, p2)) if q else (lambda t: t)
    fb = (lambda t: fq_blocks(t, p2)) if q else (lambda t: t)
    fc = fq_cols if variant == "fp8-all" else (lambda t: t)
    x32, do32 = x.float(), d_out.float()
    out = torch.zeros(T, d, device=dev)
    dx = torch.zeros(T, d, device=dev)
    dw1 = torch.zeros(E, R, d, device=dev)
    dw2 = torch.zeros(E, d, n, device=dev)
    xq, doq = fr(x32), fr(do32)
    for e in range(E):
        tok, k = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        s = wts[tok, k].float()[:, None]
        w1e, w2e = w1[e].float(), w2[e].float()
        w1q, w2q = fb(w1e), fb(w2e)
        h = xq[tok] @ w1q.t()
        a = activation_fn(activation, h, n)
        if not q:
            a = a.to(torch.bfloat16).float()
        y = (fr(a) @ w2q.t()).to(torch.bfloat16).float()
        out.index_add_(0, tok, s * y)
        hk = fr(h) if q else h.to(torch.bfloat16).float()  # H as backward reads it
        hk.requires_grad_(True)
        ak = activation_fn(activation, hk, n)
        da_prime = doq[tok] @ w2q  # (m, n)
        (dh,) = torch.autograd.grad(ak, hk, s * da_prime)
        dh_store = dh.to(torch.bfloat16).float()
        dx.index_add_(0, tok, (fr(dh) if q else dh_store) @ w1q)
        a_scaled = (s * ak.detach()).to(torch.bfloat16).float()
        dw2[e] = fc(do32[tok]).t() @ fc(a_scaled)
        dw1[e] = fc(dh_store).t() @ fc(x32[tok])
    return out, dx, dw1, dw2


def rel(a, r):
    return float((a.double() - r).norm() / r.norm())


def make_inputs(T, d, n, E, K, activation, seed, device="cpu"):
    """x, w1, w2 (bf16), ids (T, K) int64, wts (T, K) fp32, d_out (bf16): drawn on the CPU from
    `seed` (the same numbers on every device), then moved to `device`."""
    rows = 2 * n if activation in ("swiglu", "geglu", "swiglu_oai") else n
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(E, rows, d, generator=g) / d ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, d, n, generator=g) / n ** 0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    wts = torch.rand(T, K, generator=g)
    d_out = torch.randn(T, d, generator=g).to(torch.bfloat16)
    return tuple(t.to(device) for t in (x, w1, w2, ids, wts, d_out))


def reference(x, w1, w2, ids, wts, d_out, activation, per_expert=False):
    """float64 out, dx, dw1, dw2 on x's device: dense_reference (every pair's weights gathered:
    small shapes only) or, per_expert, torch_experts (one expert's tokens at a time)."""
    ins = [t.double().requires_grad_() for t in (x, w1, w2)]
    fn = torch_experts if per_expert else dense_reference
    ref = fn(ins[0], ins[1], ins[2], ids, wts.double(), activation)
    return (ref.detach(),) + torch.autograd.grad(ref, ins, d_out.double())


def library(x, w1, w2, ids, wts, d_out, activation, compute_dtype):
    """out, dx, dw1, dw2 of moeblaze.moe_experts with compute_dtype, on x's device."""
    xl, w1l, w2l = (t.clone().requires_grad_() for t in (x, w1, w2))
    o = moeblaze.moe_experts(xl, w1l, w2l, ids, wts, activation, compute_dtype=compute_dtype)
    return (o.detach(),) + torch.autograd.grad(o, [xl, w1l, w2l], d_out.to(o.dtype))


def variants(device, emulation=True, pow2=False):
    """The rows, in print order: the CPU's (unchanged since the script began) or the GPU's;
    pow2 adds fp8-data-pow2 after the emulated ones."""
    emulated = list(EMULATED) + (["fp8-data-pow2"] if pow2 else [])
    if device == "cpu":
        return emulated + ["library fp8", "library fp8-wgrad"]
    return list(LIBRARY) + (emulated if emulation else [])


def ratios(worst, base="library bf16"):
    """{variant: [error / base's error per tensor]} for the library's fp8 rows whose errors and
    base's are numbers (worst: {variant: [errors] or an error message})."""
    b = worst.get(base)
    if not isinstance(b, list):
        return {}
    return {v: [e / be if be > 0 else float("inf") for e, be in zip(errs, b)]
            for v, errs in worst.items()
            if v.startswith("library fp8") and isinstance(errs, list)}


def measure(T, d, n, E, K, activation, seeds, device, names, log=None):
    """{variant: worst [out, dx, dw1, dw2] error over the seeds, or the message of what it
    raised}, in the order of `names`."""
    worst = {}
    per_expert = device != "cpu"
    for seed in range(seeds):
        t0 = time.perf_counter()
        x, w1, w2, ids, wts, d_out = make_inputs(T, d, n, E, K, activation, seed, device)
        refs = reference(x, w1, w2, ids, wts, d_out, activation, per_expert)
        for v in names:
            if isinstance(worst.get(v), str):
                continue  # it failed on an earlier seed
            try:
                if v in LIBRARY:
                    outs = library(x, w1, w2, ids, wts, d_out, activation, LIBRARY[v])
                else:
                    outs = layer(x, w1, w2, ids, wts, d_out, activation, v)
                errs = [rel(a, r) for a, r in zip(outs, refs)]
            except Exception as ex:  # noqa: BLE001 - one row's failure is reported, not fatal
                worst[v] = f"error: {type(ex).__name__}: {ex}".replace("\n", " ")
                continue
            worst[v] = [max(p, q) for p, q in zip(worst.get(v, [0] * 4), errs)]
        del x, w1, w2, ids, wts, d_out, refs
        if log:
            log(f"{activation} seed {seed}: {time.perf_counter() - t0:.1f} s")
    return worst


def device_name(device):
    if device == "cpu":
        return f"CPU ({os.cpu_count()} logical cores)"
    return torch.cuda.get_device_name(torch.device(device))


def markdown(results, args, shape, device):
    """The table as markdown, with the run's header lines."""
    T, d, n, E, K = shape
    L = [f"# FP8 recipe accuracy (bench/fp8_recipe_accuracy.py), T={T} d={d} n={n} E={E} K={K}",
         "",
         f"- device: {device_name(device)} (--device {device})",
         f"- torch: {torch.__version__}; library: {moeblaze.library_path()}",
         f"- commit (MOEBLAZE_COMMIT): {os.environ.get('MOEBLAZE_COMMIT', 'unset')}",
         f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
         f"- command: `{shlex.join(['python'] + sys.argv)}`",
         "",
         f"Relative Frobenius error against float64, worst of {args.seeds} seeds.",
         "", "| activation | variant | " + " | ".join(TENSORS) + " |",
         "|---|---|" + "---:|" * len(TENSORS)]
    for act, worst in results.items():
        for v, errs in worst.items():
            cells = ([f"{e:.4f}" for e in errs] if isinstance(errs, list)
                     else [errs] + [""] * (len(TENSORS) - 1))
            L.append(f"| {act} | {v} | " + " | ".join(cells) + " |")
    rat = {act: ratios(w) for act, w in results.items()}
    if any(rat.values()):
        L += ["", "Each fp8 recipe's error over the library bf16 path's (the target: "
              "<= 4x; docs/FP8.md says why no e4m3 recipe meets it):", "",
              "| activation | recipe | " + " | ".join(TENSORS) + " |",
              "|---|---|" + "---:|" * len(TENSORS)]
        for act, r in rat.items():
            for v, xs in r.items():
                L.append(f"| {act} | {v.replace('library ', '')} / bf16 | " +
                         " | ".join(f"{x:.1f}x" for x in xs) + " |")
    return "\n".join(L) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu (the emulation and the library's CPU "
                    "paths) or cuda (the library's GPU paths; see the docstring)")
    ap.add_argument("--shape", help="T,d,n,E,K (default %s on the CPU, %s on CUDA)"
                    % (DEFAULT_SHAPE["cpu"], DEFAULT_SHAPE["cuda"]))
    ap.add_argument("--activations", default="swiglu,gelu,relu")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--no-emulation", action="store_true",
                    help="with --device cuda: the library's rows only")
    ap.add_argument("--pow2-scales", action="store_true",
                    help="also the fp8-data-pow2 row: fp8-data with power-of-two scales")
    ap.add_argument("--md", help="also write the table as markdown here, with header lines")
    args = ap.parse_args()
    kind = torch.device(args.device).type
    if kind not in DEFAULT_SHAPE:
        ap.error(f"--device {args.device}: cpu or cuda")
    if kind == "cuda":
        if not torch.cuda.is_available() or not moeblaze.has_cuda():
            ap.error("--device cuda needs a GPU and a moeblaze built with CUDA (torch sees a GPU: "
                     f"{torch.cuda.is_available()}; moeblaze.has_cuda(): {moeblaze.has_cuda()})")
        torch.backends.cuda.matmul.allow_tf32 = False  # the emulation's fp32 GEMMs stay fp32
        torch.backends.cudnn.allow_tf32 = False
    T, d, n, E, K = shape = tuple(int(v) for v in (args.shape or DEFAULT_SHAPE[kind]).split(","))
    if kind == "cuda" and (d % G or n % G):
        ap.error(f"--device cuda: d ({d}) and n ({n}) must be multiples of {G} (the GPU FP8 path)")
    names = variants(kind, not args.no_emulation, args.pow2_scales)
    t_start = time.perf_counter()

    def log(msg):
        if kind != "cpu":
            print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", file=sys.stderr, flush=True)

    on = "" if kind == "cpu" else f", {device_name(args.device)}"
    print(f"fp8 recipe accuracy, T={T} d={d} n={n} E={E} K={K}, relative Frobenius error vs "
          f"float64, worst of {args.seeds} seeds{on}", flush=True)
    print(f"{'activation':<10} {'variant':<18} {'out':>8} {'dx':>8} {'dw1':>8} {'dw2':>8}",
          flush=True)
    results = {}
    for act in args.activations.split(","):
        worst = results[act] = measure(T, d, n, E, K, act, args.seeds, args.device, names, log)
        for v, errs in worst.items():
            if isinstance(errs, list):
                print(f"{act:<10} {v:<18} " + " ".join(f"{e:8.4f}" for e in errs), flush=True)
            else:
                print(f"{act:<10} {v:<18} {errs}", flush=True)
        for v, xs in ratios(worst).items():
            print(f"{act:<10} {v.replace('library ', '') + ' / bf16':<18} " +
                  " ".join(f"{x:7.1f}x" for x in xs), flush=True)
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown(results, args, shape, args.device))
        print(f"wrote {args.md}", file=sys.stderr)
    failed = [f"{a} {v}" for a, w in results.items() for v, e in w.items() if isinstance(e, str)]
    if failed:
        print(f"fp8_recipe_accuracy: {len(failed)} row(s) raised: {', '.join(failed)}",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
