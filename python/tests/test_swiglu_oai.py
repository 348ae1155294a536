"""activation="swiglu_oai" (gpt-oss's clamped SwiGLU) against a plain-torch float64 copy of
transformers' GptOssExperts formula, forward and gradients, on the CPU backend. The library takes
fp32 and bf16 (no float64); the reference runs in float64."""
import pytest
import torch

import moeblaze
from helpers import TOL, rel_err

ALPHA, LIMIT = 1.702, 7.0


def oai_experts(x, w1, w2, ids, wts):
    """GptOssExperts' activation on moeblaze's de-interleaved w1 (gate rows first), no biases."""
    n = w2.shape[2]
    h = torch.einsum("tkrd,td->tkr", w1[ids], x)
    # The clamps as selects, so the gradient at exactly +-LIMIT is 0 on every torch version
    # (torch.clamp's own gradient there changed: 2.11 passes it, 2.15 does not).
    g, u = h[..., :n], h[..., n:]
    gate = torch.where(g < LIMIT, g, torch.full_like(g, LIMIT))
    up = torch.where(u.abs() < LIMIT, u, torch.sign(u) * LIMIT)
    a = (up + 1) * (gate * torch.sigmoid(gate * ALPHA))
    y = torch.einsum("tkdn,tkn->tkd", w2[ids], a)
    return (y * wts.unsqueeze(-1).to(y.dtype)).sum(1)


def check(x, w1, w2, ids, wts, dtype):
    ins = [t.to(dtype).requires_grad_() for t in (x, w1, w2)] + [wts.clone().requires_grad_()]
    out = moeblaze.moe_experts(*ins[:3], ids, ins[3], activation="swiglu_oai")
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, ins, g)
    ref_ins = [t.detach().double().requires_grad_() for t in ins]
    ref = oai_experts(ref_ins[0], ref_ins[1], ref_ins[2], ids, ref_ins[3])
    ref_grads = torch.autograd.grad(ref, ref_ins, g.double())
    assert rel_err(out, ref) <= TOL[dtype], "out"
    for name, a, r in zip(("dx", "dw1", "dw2", "d_weights"), grads, ref_grads):
        assert rel_err(a, r) <= TOL[dtype], name


def routing(T, E, K):
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    return ids, torch.rand(T, K) + 0.05


@pytest.mark.parametrize("dtype,w1_scale", [(torch.float32, 1.0), (torch.bfloat16, 1.0),
                                            (torch.float32, 8.0)])
def test_moe_experts_matches_torch(seed, dtype, w1_scale):
    """w1_scale 8 puts h ~ N(0, 64): about 40 % of g and u past the clamps (fp32 only: in bf16 an
    h within bf16 rounding of a limit may take the other side of the kink)."""
    T, d, n, E, K = 30, 40, 24, 6, 2
    ids, wts = routing(T, E, K)
    while True:  # redraw h within fp32 rounding of a kink (g = 7, u = +-7): a draw tests them
        x = torch.randn(T, d)
        w1 = torch.randn(E, 2 * n, d) * (w1_scale / d ** 0.5)
        h = torch.einsum("tkrd,td->tkr", w1[ids].double(), x.double())
        up_dist = torch.minimum((h[..., n:] - LIMIT).abs(), (h[..., n:] + LIMIT).abs())
        dist = torch.cat([(h[..., :n] - LIMIT).abs(), up_dist], -1)
        if float(dist.min()) > 1e-4:
            break
    if w1_scale > 1:
        assert int((h[..., :n] > LIMIT).sum()) > 100 and int((h[..., n:].abs() > LIMIT).sum()) > 100
    w2 = torch.randn(E, d, n) / n ** 0.5
    check(x, w1, w2, ids, wts, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamp_boundaries_follow_torch(seed, dtype):
    """h exactly at the limits: one-hot tokens make h[t] a column of w1, exact in fp32 and bf16,
    so g and u hit 7 and -7 exactly; moeblaze passes no gradient there (torch 2.15's clamp)."""
    T, d, n, E, K = 16, 16, 32, 3, 2
    x = torch.eye(T, d)
    values = torch.tensor([-9.0, -7.0, -6.5, -1.0, 0.0, 0.5, 6.5, 7.0, 7.5, 12.0])
    w1 = values[torch.randint(len(values), (E, 2 * n, d))]
    w2 = torch.randn(E, d, n) / n ** 0.5
    ids, wts = routing(T, E, K)
    check(x, w1, w2, ids, wts, dtype)


def test_module_accepts_swiglu_oai(seed):
    moe = moeblaze.MoE(32, 16, 4, 2, activation="swiglu_oai", dtype=torch.float32)
    assert moe.w1.shape == (4, 32, 32)  # gated: 2n rows
    out, _ = moe(torch.randn(5, 32))
    assert out.shape == (5, 32)


@pytest.mark.skipif(not (torch.cuda.is_available() and moeblaze.has_cuda()), reason="no GPU")
def test_gpu_swiglu_oai_with_biases_matches_cpu_backend(seed):
    """gpt-oss's experts on the GPU (swiglu_oai kernels, b1 in the up epilogue, b2 in the
    aggregation) against the CPU backend in fp32 on the same bf16 values: out and every gradient."""
    T, d, n, E, K = 256, 128, 128, 8, 2
    x = torch.randn(T, d).bfloat16()
    w1 = (torch.randn(E, 2 * n, d) / d ** 0.5).bfloat16()
    w2 = (torch.randn(E, d, n) / n ** 0.5).bfloat16()
    b1 = (0.5 * torch.randn(E, 2 * n)).bfloat16()
    b2 = (0.5 * torch.randn(E, d)).bfloat16()
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = torch.rand(T, K) + 0.05
    d_out = torch.randn(T, d)
    results = []
    for dev, dt in (("cuda", torch.bfloat16), ("cpu", torch.float32)):
        leaves = [t.to(dev, dt if t.is_floating_point() and t is not w else t.dtype)
                  .requires_grad_() for t in (x, w1, w2, w, b1, b2)]
        out = moeblaze.moe_experts(leaves[0], leaves[1], leaves[2], ids.to(dev), leaves[3],
                                   activation="swiglu_oai", b1=leaves[4], b2=leaves[5])
        grads = torch.autograd.grad(out, leaves, d_out.to(dev, out.dtype))
        results.append([out.float().cpu()] + [g.float().cpu() for g in grads])
    names = ["out", "dx", "dw1", "dw2", "d_expert_weights", "db1", "db2"]
    for name, g, c in zip(names, *results):
        assert rel_err(g, c) < TOL[torch.bfloat16], f"{name}: {rel_err(g, c)}"
