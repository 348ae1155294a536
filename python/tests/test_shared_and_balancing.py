"""Shared experts (Qwen2-MoE gated, DeepSeek ungated) and DeepSeek-V3's auxiliary-loss-free
balancing (per-expert counts, update_expert_bias) on the CPU, and on the GPU (bf16, its sizes)."""
import pytest
import torch
import torch.nn.functional as F

import moeblaze
from helpers import DEVICES, TOL, check_against_reference, rel_err


def _kw(device):
    """(d, n) and the MoE arguments of a device: fp32 on the CPU, bf16 and multiples of 64 on
    the GPU."""
    if device == "cpu":
        return 32, 16, {}
    return 128, 64, {"device": "cuda", "dtype": torch.bfloat16}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gated", [False, True])
def test_shared_expert_adds_a_dense_swiglu(seed, gated, device):
    d, n, kw = _kw(device)
    moe = moeblaze.MoE(d, n, 6, 2, shared_expert_size=40, shared_expert_gate=gated, **kw)
    plain = moeblaze.MoE(d, n, 6, 2, **kw)
    plain.load_state_dict({k: v for k, v in moe.state_dict().items()
                           if not k.startswith("shared_expert.")})
    x = torch.randn(3, 7, d).to(moe.w1)
    s = moe.shared_expert
    dense = s.down_proj(F.silu(s.gate_proj(x)) * s.up_proj(x))
    if gated:
        dense = torch.sigmoid(s.gate(x)) * dense
    assert rel_err(moe(x)[0], plain(x)[0] + dense) <= TOL[x.dtype]
    if device == "cpu":  # TorchMoE adds the same shared expert; the routed part matches float64
        ref = moeblaze.TorchMoE(d, n, 6, 2, shared_expert_size=40, shared_expert_gate=gated)
        ref.load_state_dict(moe.state_dict())
        assert rel_err(ref(x)[0], moe(x)[0]) <= TOL[torch.float32]
        check_against_reference(plain, x, torch.float32)


def test_shared_expert_arguments_checked():
    with pytest.raises(ValueError, match="shared_expert_size"):
        moeblaze.MoE(32, 16, 6, 2, shared_expert_gate=True)


def test_expert_counts_of_the_last_forward(seed):
    moe = moeblaze.MoE(32, 16, 8, 3)
    x = torch.randn(50, 32)
    moe(x)
    c = moe.last_expert_counts
    ids = moeblaze.torch_router(moeblaze.layer.router_logits(x, moe.gate.weight), 3)[0]
    assert c.dtype == torch.int64 and int(c.sum()) == 150
    assert torch.equal(c, torch.bincount(ids.reshape(-1), minlength=8))


@pytest.mark.parametrize("device", DEVICES)
def test_update_expert_bias_balances(seed, device):
    E = 8
    d, n, kw = _kw(device)
    moe = moeblaze.MoE(d, n, E, 2, router="sigmoid_bias", renormalize=True, **kw)
    with torch.no_grad():
        moe.gate.weight[0] += 0.5  # expert 0 overloaded
    x = torch.randn(400, d).to(moe.w1)
    moe(x)
    first = moe.last_expert_counts.clone()
    assert first.device == x.device and int(first.sum()) == 400 * 2
    mean = first.float().mean()
    moe.update_expert_bias(0.01)
    assert torch.equal(moe.expert_bias, 0.01 * torch.sign(mean - first.float()))
    spread0 = int(first.max() - first.min())
    for _ in range(200):
        moe(x)
        moe.update_expert_bias(0.01)
    moe(x)
    c = moe.last_expert_counts
    assert int(c.max() - c.min()) < spread0 / 2, (first, c)
    explicit = torch.zeros(E, dtype=torch.int64, device=x.device)
    explicit[3] = 10
    before = moe.expert_bias.clone()
    moe.update_expert_bias(0.5, counts=explicit)
    assert float(moe.expert_bias[3] - before[3]) == -0.5


def test_update_expert_bias_needs_sigmoid_bias():
    moe = moeblaze.MoE(32, 16, 8, 2)
    with pytest.raises(ValueError, match="router='sigmoid_bias'"):
        moe.update_expert_bias(0.01)
    moe = moeblaze.MoE(32, 16, 8, 2, router="sigmoid_bias")
    with pytest.raises(ValueError, match=r"counts of shape \(8,\)"):
        moe.update_expert_bias(0.01)
