"""moeblaze.MoE and the functional form against float64 pure-torch references (CPU backend here;
the same checks on the GPU in test_gpu.py). Inputs are fresh random draws every run (seed
printed on failure)."""
import pytest
import torch

import moeblaze
from helpers import DEVICES, TOL, check_against_reference, rel_err
from moeblaze.reference import dense_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["swiglu", "geglu", "relu", "gelu", "relu2", "silu",
                                        "swiglu_oai"])
def test_moe_matches_float64(seed, dtype, activation):
    T, d, n, E, K = 37, 48, 40, 8, 3
    moe = moeblaze.MoE(d, n, E, K, activation=activation, dtype=dtype)
    x = torch.randn(T, d).to(dtype)
    check_against_reference(moe, x, dtype)


@pytest.mark.parametrize("router,renormalize", [("softmax_topk", False), ("softmax_topk", True),
                                                ("topk_softmax", False)])
@pytest.mark.parametrize("recompute", [False, True])
def test_routers_and_recompute(seed, router, renormalize, recompute):
    moe = moeblaze.MoE(32, 24, 6, 2, router=router, renormalize=renormalize,
                       recompute=recompute, dtype=torch.float32)
    x = torch.randn(2, 9, 32)  # any leading shape
    check_against_reference(moe, x, torch.float32)


def test_sigmoid_bias_router(seed):
    moe = moeblaze.MoE(32, 16, 8, 2, router="sigmoid_bias", renormalize=True, dtype=torch.float32)
    moe.expert_bias.copy_(torch.randn(8) * 0.1)
    x = torch.randn(20, 32, requires_grad=True)
    out, _ = moe(x)
    ref = moeblaze.TorchMoE(32, 16, 8, 2, router="sigmoid_bias", renormalize=True,
                            dtype=torch.float32)
    ref.load_state_dict(moe.state_dict())
    out_ref, _ = ref(x)
    assert rel_err(out, out_ref) < 1e-5
    g = torch.autograd.grad(out.square().sum(), [x, moe.gate.weight])
    g_ref = torch.autograd.grad(out_ref.square().sum(), [x, ref.gate.weight])
    for a, b in zip(g, g_ref):
        assert rel_err(a, b) < 1e-4


def test_keep_h_and_recompute_agree_bitwise(seed):
    a = moeblaze.MoE(64, 32, 8, 2, dtype=torch.bfloat16)
    b = moeblaze.MoE(64, 32, 8, 2, recompute=True, dtype=torch.bfloat16)
    b.load_state_dict(a.state_dict())
    x = torch.randn(50, 64, dtype=torch.bfloat16)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    oa, _ = a(xa)
    ob, _ = b(xb)
    assert torch.equal(oa, ob)
    g = torch.randn_like(oa)
    oa.backward(g)
    ob.backward(g)
    for p, q in [(xa.grad, xb.grad), (a.w1.grad, b.w1.grad), (a.w2.grad, b.w2.grad)]:
        assert torch.equal(p, q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_functional_supplied_routing(seed, dtype):
    T, d, n, E, K = 25, 32, 24, 6, 2
    x = torch.randn(T, d).to(dtype).requires_grad_()
    w1 = (torch.randn(E, 2 * n, d) / d ** 0.5).to(dtype).requires_grad_()
    w2 = (torch.randn(E, d, n) / n ** 0.5).to(dtype).requires_grad_()
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    wts = torch.rand(T, K, requires_grad=True)
    out = moeblaze.moe_experts(x, w1, w2, ids, wts)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, w1, w2, wts], g)
    ins = [t.detach().double().requires_grad_() for t in (x, w1, w2, wts)]
    ref = dense_reference(ins[0], ins[1], ins[2], ids, ins[3])
    ref_grads = torch.autograd.grad(ref, ins, g.double())
    assert rel_err(out, ref) <= TOL[dtype]
    for name, a, r in zip(("dx", "dw1", "dw2", "d_weights"), grads, ref_grads):
        assert rel_err(a, r) <= TOL[dtype], name


def test_empty_batch_and_unused_experts(seed):
    moe = moeblaze.MoE(16, 8, 32, 1, dtype=torch.float32)
    x = torch.randn(0, 16, requires_grad=True)
    out, _ = moe(x)
    assert out.shape == (0, 16)
    out.sum().backward()
    x = torch.randn(3, 16)  # 3 tokens, 32 experts: most experts get nothing
    check_against_reference(moe, x, torch.float32)


def test_aux_and_z_losses_match_torch(seed):
    kw = dict(aux_loss_coef=0.01, z_loss_coef=0.001, dtype=torch.float32)
    moe = moeblaze.MoE(32, 16, 8, 2, **kw)
    ref = moeblaze.TorchMoE(32, 16, 8, 2, **kw)
    ref.load_state_dict(moe.state_dict())
    x = torch.randn(40, 32)
    _, l1 = moe(x)
    _, l2 = ref(x)
    assert torch.allclose(l1.aux_loss, l2.aux_loss) and torch.allclose(l1.z_loss, l2.z_loss)
    assert l1.aux_loss > 0 and l1.z_loss > 0
    l1.total.backward()
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True])
def test_token_rounding_down_that_drops_every_pair(seed, device, bias):
    """Rounding down with fewer tokens per expert than the M tile drops every pair: S = 0 is a
    valid step (out zero, no bias added without a pair; zero weight gradients), not an error."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    moe = moeblaze.MoE(64, 64, 8, 2, token_rounding="down", m_tile=128, bias=bias,
                       device=device, dtype=dtype)
    if bias:
        with torch.no_grad():
            for p in (moe.b1, moe.b2):
                p.copy_(torch.randn_like(p))
    x = torch.randn(100, 64, device=device).to(dtype).requires_grad_()
    with torch.no_grad():
        offsets = moe.route(x)[1]
    assert int(offsets[-1]) == 0
    out, losses = moe(x)
    assert out.shape == x.shape and not out.any()
    (out.float().sum() + losses.total).backward()
    assert not moe.w1.grad.any() and not moe.w2.grad.any()
    if bias:
        assert not moe.b1.grad.any() and not moe.b2.grad.any()


def test_token_rounding_cpu(seed):
    E, K, m_tile = 8, 2, 16
    moe = moeblaze.MoE(32, 16, E, K, token_rounding="nr-f", m_tile=m_tile, dtype=torch.float32)
    x = torch.randn(200, 32, requires_grad=True)
    x2 = x.detach()
    with torch.no_grad():
        _, offsets, experts, weights = moe.route(x2)
    counts = torch.bincount(experts.long(), minlength=E)
    assert all(int(c) % m_tile == 0 for c in counts), counts
    # The rounded layer equals the dense reference over its own (ragged) routing.
    out, _ = moe(x)
    T = x.shape[0]
    ref = torch.zeros(T, 32, dtype=torch.float64)
    w1, w2 = moe.w1.detach().double(), moe.w2.detach().double()
    off = offsets.tolist()
    for t in range(T):
        for p in range(off[t], off[t + 1]):
            e = int(experts[p])
            ref[t] += float(weights[p]) * dense_reference(
                x2[t:t + 1].double(), w1, w2, torch.tensor([[e]]), torch.ones(1, 1,
                                                                              dtype=torch.float64))[0]
    assert rel_err(out, ref) < 1e-4
    out.square().sum().backward()  # router backward over the rounded routing
    assert torch.isfinite(moe.gate.weight.grad).all()


def test_memory_stats_cpu():
    s = moeblaze.memory_stats("cpu")
    assert set(s) == {"current", "peak"} and s["peak"] >= s["current"] >= 0
    moeblaze.reset_peak("cpu")
