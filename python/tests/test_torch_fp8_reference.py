"""bench/torch_fp8_reference.py, the torch FP8 baseline (row-wise scales on
torch._scaled_grouped_mm), checked on the CPU through its float32 emulation of the scaled GEMM:
the scale rule, the layouts each GEMM hands the kernel, and the layer's error against float64."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import torch_fp8_reference as f8  # noqa: E402

E4M3_TOL = 0.1  # a few e4m3 roundings (3 mantissa bits) per output, as the library's fp8 tests


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def test_pow2_scale_rule(seed):
    amax = torch.rand(1000) * torch.exp2(torch.randint(-20, 20, (1000,)).float())
    s = f8.pow2_scale(amax)
    assert torch.all(torch.log2(s) == torch.round(torch.log2(s)))  # powers of two
    assert torch.all(amax * s <= f8.E4M3_MAX) and torch.all(amax * s > f8.E4M3_MAX / 2)
    q, inv = f8.quant_rows(torch.zeros(3, 32))
    assert torch.all(q.float() == 0) and torch.all(torch.isfinite(inv))


def test_group_column_scales_follow_the_groups(seed):
    x = torch.randn(40, 24) * torch.linspace(0.1, 50, 40).unsqueeze(1)  # row magnitudes differ
    offs = torch.tensor([16, 16, 32, 40], dtype=torch.int32)  # an empty group too
    q, inv = f8.quant_group_columns(x, offs)
    assert q.shape == (24, 40) and inv.shape == (4 * 24,)
    lo = 0
    for g, hi in enumerate(offs.tolist()):
        if hi > lo:
            want = f8.pow2_scale(x[lo:hi].abs().amax(0)).reciprocal()
            assert torch.equal(inv[g * 24:(g + 1) * 24], want)
            assert torch.equal(q[:, lo:hi].float() * want.unsqueeze(1),
                               f8.to_e4m3(x[lo:hi], want.reciprocal()).float().t()
                               * want.unsqueeze(1))
        lo = hi


def test_bf16_scaling_and_row_blocks_give_the_float32_paths_codes(seed):
    x = (torch.randn(64, 40) * torch.logspace(-30, 30, 64).unsqueeze(1)).to(torch.bfloat16)
    s = f8.pow2_scale(x.abs().amax(1)).unsqueeze(1)
    assert torch.equal(f8.to_e4m3(x, s).view(torch.uint8),
                       f8.to_e4m3(x.float(), s).view(torch.uint8))
    offs = torch.tensor([16, 16, 48, 64], dtype=torch.int32)  # group ends on 16-row blocks
    q1, s1 = f8.quant_group_columns(x, offs)
    q16, s16 = f8.quant_group_columns(x, offs, block=16)
    assert torch.equal(q1.view(torch.uint8), q16.view(torch.uint8)) and torch.equal(s1, s16)
    with pytest.raises(AssertionError, match="multiple of block"):
        f8.quant_group_columns(x[:40], offs, block=16)


def test_grouped_mm_and_its_gradients_match_float64(seed):
    G, K, N = 4, 64, 48
    counts = [16, 0, 32, 48]
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    a = torch.randn(sum(counts), K, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(G, N, K) / K ** 0.5).to(torch.bfloat16).requires_grad_()
    out = f8.fp8_grouped_mm(a, w.transpose(-2, -1), offs)
    dout = torch.randn_like(out)
    ga, gw = torch.autograd.grad(out, (a, w), dout)
    ref_out = torch.zeros(sum(counts), N, dtype=torch.float64)
    ref_ga = torch.zeros_like(a, dtype=torch.float64)
    ref_gw = torch.zeros_like(w, dtype=torch.float64)
    lo = 0
    for g, hi in enumerate(offs.tolist()):
        ad, wd, dd = a[lo:hi].double(), w[g].double(), dout[lo:hi].double()
        ref_out[lo:hi] = ad @ wd.t()
        ref_ga[lo:hi] = dd @ wd
        ref_gw[g] = dd.t() @ ad
        lo = hi
    assert out.dtype == ga.dtype == gw.dtype == torch.bfloat16
    assert rel(out, ref_out) <= E4M3_TOL
    assert rel(ga, ref_ga) <= E4M3_TOL
    assert rel(gw, ref_gw) <= E4M3_TOL
    assert torch.all(gw[1] == 0)  # the empty group's gradient is zero, not garbage


def test_layer_matches_float64(seed):
    T, d, n, E, K = 64, 64, 32, 4, 2
    x = torch.randn(T, d, dtype=torch.bfloat16, requires_grad=True)
    w1 = (torch.randn(E, 2 * n, d) / d ** 0.5).to(torch.bfloat16).requires_grad_()
    w2 = (torch.randn(E, d, n) / n ** 0.5).to(torch.bfloat16).requires_grad_()
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    wts = torch.rand(T, K, requires_grad=True)
    out = f8.fp8_layer(x, w1, w2, ids, wts, n, E, K)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, w1, w2), dout)

    xd, w1d, w2d = x.double(), w1.double(), w2.double()
    h = torch.einsum("td,tkrd->tkr", xd, w1d[ids])
    a = torch.nn.functional.silu(h[..., :n]) * h[..., n:]
    y = torch.einsum("tkn,tkdn->tkd", a, w2d[ids])
    ref = (wts.double().unsqueeze(-1) * y).sum(1)
    ref_grads = torch.autograd.grad(ref, (xd, w1d, w2d), dout.double())
    assert rel(out, ref) <= E4M3_TOL
    for name, g, r in zip(("dx", "dw1", "dw2"), grads, ref_grads):
        assert rel(g, r) <= E4M3_TOL, name
