"""bench/peers.py's moeblaze-capi step (the eager path's C calls without autograd, on tensors
allocated once) against moe_experts through autograd: the same bits, on the CPU."""
import os
import sys

import pytest
import torch

import moeblaze

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import peers  # noqa: E402


@pytest.mark.parametrize("recompute", [False, True])
def test_capi_step_gives_the_eager_paths_bits(recompute):
    cpu = torch.device("cpu")
    inp = peers.Inputs(96, 64, 32, 8, 2, seed=5, dev=cpu)
    eager = peers.as_step(inp, lambda: moeblaze.moe_experts(inp.x, inp.w1, inp.w2, inp.ids,
                                                            inp.weights, "swiglu",
                                                            recompute=recompute))
    out = eager(True).detach().clone()
    grads = [t.grad.clone() for t in inp.leaves]
    inp.clear_grads()
    capi = peers.impl_moeblaze_capi(inp, recompute)
    for _ in range(2):  # the buffers are reused: the second call gives the same bits
        assert torch.equal(capi(True), out)
        for name, t, g in zip(("dx", "dw1", "dw2", "d_weights"), inp.leaves, grads):
            assert t.grad.dtype == g.dtype and torch.equal(t.grad, g), name
        inp.clear_grads()
    assert capi(False) is capi.out and inp.x.grad is None  # forward alone writes no gradient
    assert capi.kept_bytes == (0 if recompute else 96 * 2 * 2 * 32 * 2)
