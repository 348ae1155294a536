"""Activation checkpointing around moeblaze: torch.utils.checkpoint (reentrant and not) over a
block holding moeblaze.MoE, in the default mode and recompute=True, on the C++ fast path and the
Python path, and Hugging Face's activation (gradient) checkpointing on a tiny Qwen3-MoE with
experts_implementation="moeblaze". The library is deterministic and a checkpoint replays the
same forward, so outputs and gradients are bitwise those of the plain run (the Hugging Face
model on the GPU: within tolerance, its attention kernels promising no bits). Also counted: how
often the experts' forward runs under a checkpoint (docs/PYTORCH.md, Training at scale: with
recompute=True inside a checkpoint, H is computed three times)."""
import copy
import os

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import moeblaze
from helpers import TOL, rel_err, tiny_qwen3_moe

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _sizes(device):
    # The GPU backend: bf16, d and n multiples of 64.
    return (64, 64, torch.bfloat16) if device == "cuda" else (16, 12, torch.float32)


class Block(nn.Module):
    def __init__(self, d, n, recompute):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.moe = moeblaze.MoE(d, n, 4, 2, recompute=recompute, aux_loss_coef=0.01,
                                z_loss_coef=0.001)

    def forward(self, x):
        out, losses = self.moe(self.norm(x))
        return x + out, losses.total


def _run(block, x, d_out, ckpt):
    block.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    if ckpt is None:
        out, aux = block(x)
    else:
        out, aux = checkpoint(block, x, use_reentrant=ckpt)
    (torch.sum(out.float() * d_out) + aux).backward()
    return [out.detach(), x.grad] + [p.grad for p in block.parameters()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("extension", [True, False], ids=["fast-path", "python-path"])
@pytest.mark.parametrize("recompute", [False, True], ids=["keep-h", "recompute"])
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpoint_matches_plain_bitwise(seed, device, extension, recompute, use_reentrant):
    d, n, dtype = _sizes(device)
    block = Block(d, n, recompute).to(device, dtype)
    x = torch.randn(3, 10, d, device=device, dtype=dtype)
    d_out = torch.randn(3, 10, d, device=device)
    with moeblaze.use_extension(extension):
        plain = _run(block, x, d_out, None)
        ckpt = _run(block, x, d_out, use_reentrant)
        again = _run(block, x, d_out, use_reentrant)  # a second step: no state left by the first
    names = ["out", "dx"] + [nm for nm, _ in block.named_parameters()]
    for nm, a, b, c in zip(names, plain, ckpt, again):
        assert a is not None and torch.equal(a, b), f"{nm} differs under checkpoint"
        assert torch.equal(b, c), f"{nm} differs between two checkpointed steps"


@pytest.mark.parametrize("recompute", [False, True], ids=["keep-h", "recompute"])
def test_checkpoint_forward_count(monkeypatch, recompute):
    """Under a checkpoint the experts' forward runs twice (the step's, whose H is dropped, and the
    replay's before backward); with recompute=True the backward then computes H a third time
    (the library's recompute), so inside a checkpoint the default keep-H mode is the one to use."""
    calls = []
    impl = moeblaze.ops._experts_forward_impl

    def counting(*args, **kw):
        calls.append("forward")
        return impl(*args, **kw)
    bimpl = moeblaze.ops._experts_backward_impl

    def counting_backward(d_out, x, w1, w2, h, plan, activation, recompute_, *rest):
        calls.append("backward+recompute" if recompute_ else "backward")
        return bimpl(d_out, x, w1, w2, h, plan, activation, recompute_, *rest)
    monkeypatch.setattr(moeblaze.ops, "_experts_forward_impl", counting)
    monkeypatch.setattr(moeblaze.ops, "_experts_backward_impl", counting_backward)
    block = Block(16, 12, recompute)
    x = torch.randn(2, 5, 16)
    with moeblaze.use_extension(False):  # the Python path: its C calls are countable
        _run(block, x, torch.randn(2, 5, 16), False)
    last = "backward+recompute" if recompute else "backward"
    assert calls == ["forward", "forward", last], calls


# ---- Hugging Face gradient checkpointing ---------------------------------------------------
def _tiny_hf(d, n):
    pytest.importorskip("transformers")
    pytest.importorskip("transformers.integrations.moe", reason="transformers < 5: no experts "
                        "interface")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a tiny config built here: nothing to download
    return tiny_qwen3_moe(d, n)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_hf_gradient_checkpointing_matches_plain(seed, device, use_reentrant):
    d, n, dtype = _sizes(device)
    model = _tiny_hf(d, n).to(device, dtype).train()
    ref = copy.deepcopy(model)
    kw = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # gradient_checkpointing_enable, renamed
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    flags = [getattr(m, "gradient_checkpointing", False) for m in model.model.layers]
    assert all(flags) and not any(getattr(m, "gradient_checkpointing", False)
                                  for m in ref.model.layers)
    ids = torch.randint(0, 64, (2, 12), device=device)
    labels = torch.randint(0, 64, (2, 12), device=device)
    out = [m(input_ids=ids, labels=labels) for m in (model, ref)]
    for o in out:
        o.loss.backward()
    # Bitwise on the CPU; on the GPU within the layer's bf16 tolerance, since the model's other
    # CUDA kernels (attention's backward) make no promise of bits.
    def same(a, b):
        return torch.equal(a, b) if device == "cpu" else rel_err(a, b) <= TOL[dtype]
    assert same(out[0].loss, out[1].loss)
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None or grads[name].grad is None, name
        if p.grad is not None:
            assert same(p.grad, grads[name].grad), f"{name} differs under checkpointing"
    experts = [p.grad for nm, p in model.named_parameters() if "experts.gate_up_proj" in nm]
    assert experts and all(g.abs().sum() > 0 for g in experts)
