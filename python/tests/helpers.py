"""Float64 references and dtype-derived tolerances shared by the tests."""
import torch

from moeblaze.reference import dense_reference

# Relative Frobenius error allowed against the float64 reference: fp32 storage and accumulation
# (errors ~1e-6 of the norm), bf16 storage with fp32 accumulation (8-bit mantissa: a few 2^-9);
# the same bounds `moeblaze run --check` uses.
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def rel_err(a, ref):
    a, ref = a.detach().double(), ref.detach().double()
    den = float(torch.linalg.norm(ref))
    return float(torch.linalg.norm(a - ref)) / max(den, 1e-30)


def routing_ids(moe, x2):
    """moeblaze's own (T, K) expert selection for tokens x2 (plain top-K only)."""
    with torch.no_grad():
        _, offsets, experts, _ = moe.route(x2)
    return experts.long().reshape(x2.shape[0], moe.top_k)


def reference_router_weights(logits, ids, router, renormalize, bias=None):
    """Float64 gate weights of a fixed selection (selection is piecewise constant, so gradients
    through it are those of the weights)."""
    logits = logits.double()
    if router == "softmax_topk":
        w = torch.gather(torch.softmax(logits, -1), 1, ids)
        return w / w.sum(-1, keepdim=True) if renormalize else w
    if router == "topk_softmax":
        return torch.softmax(torch.gather(logits, 1, ids), -1)
    s = torch.gather(torch.sigmoid(logits), 1, ids)
    return s / s.sum(-1, keepdim=True) if renormalize else s


def reference_moe(moe, x, d_out):
    """Float64 out and gradients (x, w1, w2, gate.weight) of moe on x with upstream d_out, over
    moeblaze's own expert selection."""
    x2 = x.detach().reshape(-1, moe.hidden_size)
    ids = routing_ids(moe, x2)
    xd = x2.double().requires_grad_()
    w1 = moe.w1.detach().double().requires_grad_()
    w2 = moe.w2.detach().double().requires_grad_()
    g = moe.gate.weight.detach().double().requires_grad_()
    logits = xd @ g.t()
    w = reference_router_weights(logits, ids, moe.router, moe.renormalize)
    out = dense_reference(xd, w1, w2, ids, w, moe.activation)
    out.backward(d_out.detach().reshape(out.shape).double())
    return out.reshape(x.shape), xd.grad.reshape(x.shape), w1.grad, w2.grad, g.grad


def check_against_reference(moe, x, dtype, extra_tol=1.0):
    x = x.detach().requires_grad_()
    out, _ = moe(x)
    d_out = torch.randn_like(out)
    out.backward(d_out)
    ref = reference_moe(moe, x, d_out)
    got = (out, x.grad, moe.w1.grad, moe.w2.grad, moe.gate.weight.grad)
    names = ("out", "dx", "dw1", "dw2", "d_gate")
    errs = {n: rel_err(a, r) for n, a, r in zip(names, got, ref)}
    tol = TOL[dtype] * extra_tol
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"relative errors above {tol:g}: {bad} (all: {errs})"
    return errs
