"""Mixed precision on the CPU and the GPU: bf16 compute under torch.autocast, fp32 master weights
with bf16 activations (fp32 weight gradients), float16 refused with the reason."""
import pytest
import torch

import moeblaze
from helpers import DEVICES, TOL, rel_err


def _dims(device):
    """(d, n) the backend takes: any on the CPU, multiples of 64 on the GPU."""
    return (32, 24) if device == "cpu" else (128, 64)


def _pair(seed, device="cpu", **kw):
    """A bf16 MoE and an fp32 copy holding the same (bf16-representable) values."""
    d, n = _dims(device)
    lo = moeblaze.MoE(d, n, 6, 2, dtype=torch.bfloat16, device=device, **kw)
    hi = moeblaze.MoE(d, n, 6, 2, dtype=torch.float32, device=device, **kw)
    hi.load_state_dict({k: v.float() for k, v in lo.state_dict().items()})
    return lo, hi


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_master_weights_bf16_compute_is_the_bf16_layer(seed, device):
    lo, hi = _pair(seed, device, shared_expert_size=16, shared_expert_gate=True)
    x = torch.randn(40, _dims(device)[0], dtype=torch.bfloat16, device=device)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_lo, _ = lo(xa)
    out_hi, _ = hi(xb)
    assert out_hi.dtype == torch.bfloat16 and torch.equal(out_hi, out_lo)
    g = torch.randn_like(out_lo)
    out_lo.backward(g)
    out_hi.backward(g)
    assert torch.equal(xa.grad, xb.grad)
    for (name, p_lo), p_hi in zip(lo.named_parameters(), hi.parameters()):
        assert p_hi.grad.dtype == torch.float32, name
        if name == "gate.weight":  # the router computes in fp32 in both: only the storage differs
            assert rel_err(p_lo.grad, p_hi.grad) <= TOL[torch.bfloat16], name
        else:
            assert torch.equal(p_hi.grad, p_lo.grad.float()), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("functional", [False, True])
def test_autocast_bf16_computes_and_returns_bf16(seed, functional, device):
    lo, hi = _pair(seed, device)
    # bf16-representable x: the fp32 reference below routes on the same values (no near-tie flips).
    x = torch.randn(40, _dims(device)[0], device=device).bfloat16().float().requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        if functional:
            ids = torch.stack([torch.randperm(6)[:2] for _ in range(40)]).to(device)
            wts = torch.rand(40, 2, device=device)
            out = moeblaze.moe_experts(x, hi.w1, hi.w2, ids, wts)
        else:
            out, _ = hi(x)
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    assert x.grad.dtype == torch.float32 and hi.w1.grad.dtype == torch.float32
    # Within bf16 rounding of the fp32 layer (the router reads the same fp32 x in both: float32
    # logits under autocast too); the GPU computes in bf16 only, so there the bf16 twin is the reference.
    if not functional:
        ref, _ = hi(x.detach()) if device == "cpu" else lo(x.detach().bfloat16())
        assert rel_err(out, ref) <= TOL[torch.bfloat16]
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = moeblaze.layer.router_logits(x, hi.gate.weight)
        assert logits.dtype == torch.float32


def test_float16_refused_with_reason(seed):
    moe = moeblaze.MoE(32, 24, 6, 2, dtype=torch.float32)
    with pytest.raises(ValueError, match="float16 is not supported.*bf16 or fp32 only"):
        with torch.autocast("cpu", dtype=torch.float16):
            moe(torch.randn(4, 32))
    with pytest.raises(ValueError, match="float16 is not supported"):
        moe.half()(torch.randn(4, 32, dtype=torch.float16))


def test_autocast_shared_expert_compiles_fullgraph(seed):
    moe = moeblaze.MoE(32, 16, 8, 2, shared_expert_size=24, shared_expert_gate=True)
    x = torch.randn(24, 32)
    compiled = torch.compile(moe, backend="aot_eager", fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_c, _ = compiled(x)
        out, _ = moe(x)
    assert out_c.dtype == torch.bfloat16 and torch.equal(out_c, out)
