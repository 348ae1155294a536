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


def test_the_baseline_column_prefers_the_in_process_c_abi_then_the_cpp_rows():
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
    routed, nrf = row("moeblaze-torch-routed", 12.0), row("moeblaze-torch-nrf", 11.4)
    assert peers.baseline_of(nrf, rows + [routed, nrf]) is routed
    assert peers.baseline_of(routed, rows + [routed, nrf]) is None
    assert "| 1.048 (moeblaze-capi) |" in peers.markdown(rows + [capi])
    fp8, cached = row("moeblaze-torch-fp8", 9.0), row("moeblaze-torch-fp8-cached", 8.0)
    assert peers.baseline_of(fp8, rows + [fp8, cached]) is torch_row
    assert peers.baseline_of(cached, rows + [fp8, cached]) is fp8
    assert peers.baseline_of(cached, rows + [cached]) is torch_row
    wgrad = row("moeblaze-torch-fp8-wgrad-cached", 7.0)
    assert peers.baseline_of(wgrad, rows + [fp8, cached, wgrad]) is cached
    assert peers.baseline_of(wgrad, rows + [wgrad]) is torch_row


def test_routed_steps_run_the_router_and_rounding_and_skip_the_error_column():
    cpu = torch.device("cpu")
    inp = peers.Inputs(256, 64, 32, 4, 2, seed=7, dev=cpu)
    routed = peers.impl_moeblaze_torch_routed(inp, None)
    plain = peers.as_step(inp, lambda: moeblaze.moe_experts(inp.x, inp.w1, inp.w2, inp.ids,
                                                            inp.weights, "swiglu"))
    # The router's softmax top-K is Inputs' routing: the same output up to the weights' rounding.
    a, b = routed(False).float(), plain(False).float()
    assert (a - b).norm() <= 1e-2 * b.norm()
    nrf = peers.impl_moeblaze_torch_routed(inp, "nr-f")
    out = nrf(True)
    assert out.shape == inp.x.shape and bool(torch.isfinite(out.float()).all())
    assert inp.x.grad is not None and inp.w1.grad is not None
    assert peers.measure_error(inp, nrf, None) == (None, "its own routing")
