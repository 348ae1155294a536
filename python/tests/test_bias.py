"""Expert biases b1 / b2 (gpt-oss): moe_experts against a plain-torch float64 formula (output and
every gradient), MoE(bias=True) training, and the changed custom ops under opcheck and
torch.compile, on the CPU; on a GPU the same float64 check of the CUDA backend's biases."""
import pytest
import torch
import torch.nn.functional as F

import moeblaze
from helpers import TOL, rel_err


def _torch_biased(x, w1, w2, ids, w, b1, b2, activation):
    """sum_k w_k (W2_e act(W1_e x + b1_e) + b2_e), per token, in plain torch."""
    n = w2.shape[2]
    h = torch.einsum("tkrd,td->tkr", w1[ids], x)
    if b1 is not None:
        h = h + b1[ids]
    if activation == "swiglu":
        a = F.silu(h[..., :n]) * h[..., n:]
    else:  # gelu
        a = F.gelu(h)
    y = torch.einsum("tkdn,tkn->tkd", w2[ids], a)
    if b2 is not None:
        y = y + b2[ids]
    return (w.unsqueeze(-1) * y).sum(1)


def _inputs(T, d, n, E, K, activation, dtype, which):
    rows = 2 * n if activation == "swiglu" else n
    x = torch.randn(T, d, dtype=dtype)
    w1 = (torch.randn(E, rows, d) / d ** 0.5).to(dtype)
    w2 = (torch.randn(E, d, n) / n ** 0.5).to(dtype)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = torch.rand(T, K) + 0.05
    b1 = (0.5 * torch.randn(E, rows)).to(dtype) if "b1" in which else None
    b2 = (0.5 * torch.randn(E, d)).to(dtype) if "b2" in which else None
    return x, w1, w2, ids, w, b1, b2


@pytest.mark.parametrize("which", ["b1", "b2", "b1b2"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recompute", [False, True])
def test_moe_experts_with_biases_matches_float64(seed, which, activation, dtype, recompute):
    _check_biased_against_float64(*_inputs(40, 24, 16, 6, 2, activation, dtype, which),
                                  activation, recompute)


@pytest.mark.skipif(not (torch.cuda.is_available() and moeblaze.has_cuda()), reason="no GPU")
@pytest.mark.parametrize("which", ["b1", "b2", "b1b2"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("recompute", [False, True])
def test_moe_experts_with_biases_on_gpu_matches_float64(seed, which, activation, recompute):
    inputs = _inputs(300, 128, 128, 8, 2, activation, torch.bfloat16, which)
    _check_biased_against_float64(*(t.cuda() if t is not None else None for t in inputs),
                                  activation, recompute)


def _check_biased_against_float64(x, w1, w2, ids, w, b1, b2, activation, recompute):
    """moe_experts' output and every gradient against _torch_biased in float64."""
    dtype = x.dtype
    leaves = [t for t in (x, w1, w2, w, b1, b2) if t is not None]
    for t in leaves:
        t.requires_grad_()
    out = moeblaze.moe_experts(x, w1, w2, ids, w, activation, recompute=recompute, b1=b1, b2=b2)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, d_out)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    it = iter(ref_leaves)
    rx, rw1, rw2, rw = next(it), next(it), next(it), next(it)
    rb1 = next(it) if b1 is not None else None
    rb2 = next(it) if b2 is not None else None
    ref = _torch_biased(rx, rw1, rw2, ids, rw, rb1, rb2, activation)
    ref_grads = torch.autograd.grad(ref, ref_leaves, d_out.double())
    tol = TOL[dtype]
    assert rel_err(out, ref) < tol
    names = ["x", "w1", "w2", "expert_weights"] + (["b1"] if b1 is not None else []) + \
        (["b2"] if b2 is not None else [])
    for name, g, r, t in zip(names, grads, ref_grads, leaves):
        assert g.dtype == t.dtype and g.shape == t.shape, name
        assert rel_err(g, r) < tol, f"{name}: {rel_err(g, r)}"


def test_moe_with_bias_trains_one_step(seed):
    moe = moeblaze.MoE(32, 16, 6, 2, bias=True, dtype=torch.float32)
    plain = moeblaze.MoE(32, 16, 6, 2, dtype=torch.float32)
    plain.load_state_dict({k: v for k, v in moe.state_dict().items() if k not in ("b1", "b2")})
    assert moe.b1.shape == (6, 32) and moe.b2.shape == (6, 32)
    assert not moe.b1.any() and not moe.b2.any()
    x = torch.randn(20, 32)
    out, _ = moe(x)
    # Zero biases: the unbiased layer's output.
    assert torch.allclose(out, plain(x)[0], rtol=1e-6, atol=1e-6)
    # The experts (w1, w2, b1, b2) only, at a small rate: a router step can change which experts
    # a token picks and make the loss jump.
    experts = [p for name, p in moe.named_parameters() if not name.startswith("gate")]
    opt = torch.optim.SGD(experts, lr=0.02)
    out.square().sum().backward()
    assert moe.b1.grad is not None and moe.b2.grad is not None
    assert moe.b1.grad.abs().sum() > 0 and moe.b2.grad.abs().sum() > 0
    opt.step()
    assert moe.b1.any() and moe.b2.any()
    out2, _ = moe(x)
    assert out2.square().sum() < out.square().sum()


def test_moe_with_bias_compiles(seed):
    moe = moeblaze.MoE(32, 16, 6, 2, bias=True, dtype=torch.float32)
    with torch.no_grad():
        moe.b1.normal_()
        moe.b2.normal_()
    x = torch.randn(24, 32, requires_grad=True)
    params = [x, moe.w1, moe.w2, moe.b1, moe.b2, moe.gate.weight]
    out, _ = moe(x)
    g = torch.autograd.grad(out.square().sum(), params)
    compiled = torch.compile(moe, backend="aot_eager", fullgraph=True)
    out_c, _ = compiled(x)
    g_c = torch.autograd.grad(out_c.square().sum(), params)
    assert torch.equal(out, out_c)
    for a, b in zip(g, g_c):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recompute", [False, True])
def test_opcheck_experts_with_biases(recompute):
    logits = torch.randn(12, 6)
    off, exp, w, _ = moeblaze.ops.route(logits, None, 0, 2, False)
    plan = moeblaze.ops.build_plan(off, exp, w, 6)[:6]
    x = torch.randn(12, 16, requires_grad=True)
    w1 = torch.randn(6, 16, 16, requires_grad=True)
    w2 = torch.randn(6, 16, 8, requires_grad=True)
    b1 = torch.randn(6, 16, requires_grad=True)
    b2 = torch.randn(6, 16, requires_grad=True)
    for biases in ((b1, b2), (b1, None), (None, b2)):
        torch.library.opcheck(moeblaze.ops.experts_forward,
                              (x, w1, w2, w.clone().requires_grad_(), *plan, 0, recompute, 0,
                               *biases))
    h = moeblaze.ops.experts_forward(x, w1, w2, w, *plan, 0, recompute, 0, b1, b2)[1].detach()
    d_out = torch.randn(12, 16)
    for op in (moeblaze.ops.experts_backward, moeblaze.ops.experts_backward_dh_over_h):
        torch.library.opcheck(op, (d_out, x.detach(), w1.detach(), w2.detach(), h.clone(), *plan,
                                   0, recompute, 0, b1.detach(), b2.detach()))


def test_bias_errors_name_the_argument():
    x, w1, w2, ids, w, b1, b2 = _inputs(8, 16, 8, 4, 2, "swiglu", torch.float32, "b1b2")
    with pytest.raises(ValueError, match="b1 must have shape"):
        moeblaze.moe_experts(x, w1, w2, ids, w, b1=b1[:, :8])
    with pytest.raises(ValueError, match="b2 must have dtype"):
        moeblaze.moe_experts(x, w1, w2, ids, w, b2=b2.double())
    with pytest.raises(ValueError, match="TorchMoE has no expert biases"):
        moeblaze.TorchMoE(16, 8, 4, 2, bias=True)
