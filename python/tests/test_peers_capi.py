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


def test_the_c_path_column_prefers_the_in_process_c_abi_then_the_cpp_rows():
    def row(impl, ms, bench="peers"):
        return {"bench": bench, "config": "c", "impl": impl, "total_ms": ms, "fwd_ms": ms / 3,
                "bwd_ms": ms * 2 / 3, "total_tflops": 1.0, "kept_bytes": 0, "peak_bytes": 0}
    torch_row, rec = row("moeblaze-torch", 11.0), row("moeblaze-torch-recompute", 13.0)
    cpp, cpp_rec = row("moeblaze", 10.0, "layer"), row("moeblaze-recompute", 12.0, "layer")
    capi = row("moeblaze-capi", 10.5)
    rows = [torch_row, rec, cpp, cpp_rec]
    assert peers.baseline_of(torch_row, rows) is cpp
    assert peers.baseline_of(rec, rows) is cpp_rec
    assert peers.baseline_of(torch_row, rows + [capi]) is capi
    assert peers.baseline_of(rec, rows + [capi]) is cpp_rec  # capi's keep_h is not recompute's
    assert peers.baseline_of(cpp, rows) is None and peers.baseline_of(capi, rows) is None
    assert "| 1.048 (moeblaze-capi) |" in peers.markdown(rows + [capi])
