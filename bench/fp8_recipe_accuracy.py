"""Per-tensor error of FP8 recipes for the MoE layer against float64, on the CPU, in torch: which
GEMMs get e4m3 operands decides issue 20's design (docs/FP8.md). Prints a table.

Variants (all with bf16 inputs and weights, fp32 math on the dequantized operands):
  bf16       no quantization (the storage path's operands)
  fp8-data   the library's recipe: X, A, dO, dH in 1x128 tiles along K, W1, W2 in 128x128
             blocks, H kept quantized (1x128 along w1_rows); weight gradients on bf16 operands
  fp8-all    fp8-data, and the weight-gradient GEMMs' operands (dO, A' for dW2; dH, X for dW1)
             quantized in 128x1 tiles along their K, the expert's tokens
The quantization follows src/core/fp8.hpp's rule (scale = max(amax, 448 * 2^-126) / 448, codes
= e4m3(x / scale)), with torch's float8_e4m3fn cast (round to nearest even; |x / scale| <= 448
so nothing saturates). The library's own fp8 paths (compute_dtype="fp8" and "fp8-wgrad") are
printed beside fp8-data and fp8-all as a check of the emulation.

    PYTHONPATH=python python bench/fp8_recipe_accuracy.py [--shape T,d,n,E,K] [--seeds 3]
"""
import argparse

import torch

import moeblaze
from moeblaze.reference import activation_fn, dense_reference

G = 128
FLOOR = 448.0 * 2.0 ** -126


def _fq_groups(x, dims):
    """Fake-quantize x (fp32) with one scale per group spanning `dims` (already shaped so)."""
    amax = x.abs().amax(dim=dims, keepdim=True)
    scale = torch.where(amax == 0, torch.ones_like(amax),
                        torch.clamp(amax, min=FLOOR) / 448.0)
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


def fq_rows(x):
    """1x128 tiles along the last dimension (partial at the edge)."""
    r, c = x.shape
    pad = (-c) % G
    xp = torch.nn.functional.pad(x, (0, pad)).reshape(r, -1, G)
    return _fq_groups(xp, (2,)).reshape(r, -1)[:, :c]


def fq_cols(x):
    """128x1 tiles along the first dimension (the tokens of a weight-gradient GEMM's K)."""
    return fq_rows(x.t().contiguous()).t()


def fq_blocks(w):
    """128x128 blocks."""
    r, c = w.shape
    pr, pc = (-r) % G, (-c) % G
    wp = torch.nn.functional.pad(w, (0, pc, 0, pr)).reshape((r + pr) // G, G, (c + pc) // G, G)
    return _fq_groups(wp, (1, 3)).reshape(r + pr, c + pc)[:r, :c]


def layer(x, w1, w2, ids, wts, d_out, activation, variant):
    """out, dx, dw1, dw2 of the variant, fp32 math on (fake-quantized) operands."""
    T, d = x.shape
    E, R, _ = w1.shape
    n = w2.shape[2]
    q = variant != "bf16"
    fr = fq_rows if q else (lambda t: t)
    fb = fq_blocks if q else (lambda t: t)
    fc = fq_cols if variant == "fp8-all" else (lambda t: t)
    x32, do32 = x.float(), d_out.float()
    out = torch.zeros(T, d)
    dx = torch.zeros(T, d)
    dw1 = torch.zeros(E, R, d)
    dw2 = torch.zeros(E, d, n)
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="512,256,256,8,2", help="T,d,n,E,K")
    ap.add_argument("--activations", default="swiglu,gelu,relu")
    ap.add_argument("--seeds", type=int, default=2)
    args = ap.parse_args()
    T, d, n, E, K = (int(v) for v in args.shape.split(","))
    print(f"fp8 recipe accuracy, T={T} d={d} n={n} E={E} K={K}, relative Frobenius error vs "
          f"float64, worst of {args.seeds} seeds")
    print(f"{'activation':<10} {'variant':<18} {'out':>8} {'dx':>8} {'dw1':>8} {'dw2':>8}")
    for act in args.activations.split(","):
        rows = 2 * n if act in ("swiglu", "geglu", "swiglu_oai") else n
        worst = {}
        for seed in range(args.seeds):
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(T, d, generator=g).to(torch.bfloat16)
            w1 = (torch.randn(E, rows, d, generator=g) / d ** 0.5).to(torch.bfloat16)
            w2 = (torch.randn(E, d, n, generator=g) / n ** 0.5).to(torch.bfloat16)
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
            wts = torch.rand(T, K, generator=g)
            d_out = torch.randn(T, d, generator=g).to(torch.bfloat16)
            ins = [t.double().requires_grad_() for t in (x, w1, w2)]
            ref = dense_reference(ins[0], ins[1], ins[2], ids, wts.double(), act)
            refs = (ref.detach(),) + torch.autograd.grad(ref, ins, d_out.double())
            res = {v: layer(x, w1, w2, ids, wts, d_out, act, v)
                   for v in ("bf16", "fp8-data", "fp8-all")}
            for c in ("fp8", "fp8-wgrad"):
                xl, w1l, w2l = (t.clone().requires_grad_() for t in (x, w1, w2))
                o = moeblaze.moe_experts(xl, w1l, w2l, ids, wts, act, compute_dtype=c)
                res["library " + c] = (o.detach(),) + torch.autograd.grad(
                    o, [xl, w1l, w2l], d_out.to(o.dtype))
            for v, outs in res.items():
                errs = [rel(a, r) for a, r in zip(outs, refs)]
                worst[v] = [max(p, q) for p, q in zip(worst.get(v, [0] * 4), errs)]
        for v, errs in worst.items():
            print(f"{act:<10} {v:<18} " + " ".join(f"{e:8.4f}" for e in errs))


if __name__ == "__main__":
    main()
