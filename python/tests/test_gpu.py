"""GPU tests (marker `gpu`): they report "skipped: no GPU" on a machine without CUDA. The Hopper
backend takes bf16 and d, n multiples of 64."""
import pytest
import torch

import moeblaze
from helpers import TOL, check_against_reference, rel_err

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def _moe(**kw):
    args = dict(device="cuda", dtype=BF16)
    args.update(kw)
    d, n, E, K = args.pop("d", 128), args.pop("n", 128), args.pop("E", 8), args.pop("K", 2)
    return moeblaze.MoE(d, n, E, K, **args)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("shape", [(300, 128, 128, 8, 2), (1000, 256, 64, 32, 4),
                                   (7, 64, 192, 4, 4)])
def test_gpu_matches_float64(seed, shape, recompute):
    T, d, n, E, K = shape
    moe = _moe(d=d, n=n, E=E, K=K, recompute=recompute)
    x = torch.randn(T, d, device="cuda").to(BF16)
    check_against_reference(moe, x, BF16)


def test_gpu_matches_torch_reference_module(seed):
    moe = _moe(d=256, n=128, E=16, K=4)
    ref = moeblaze.TorchMoE(256, 128, 16, 4, device="cuda", dtype=BF16)
    ref.load_state_dict(moe.state_dict())
    x = torch.randn(512, 256, device="cuda", dtype=BF16)
    assert rel_err(moe(x)[0], ref(x)[0]) < TOL[BF16]


def _supplied_routing_inputs(T, d, n, E, K):
    """x, w1, w2 (bf16, requiring grad), ids (T, K) distinct per row and weights (T, K) fp32."""
    x = torch.randn(T, d, device="cuda", dtype=BF16, requires_grad=True)
    w1 = (torch.randn(E, 2 * n, d, device="cuda") / d ** 0.5).to(BF16).requires_grad_()
    w2 = (torch.randn(E, d, n, device="cuda") / n ** 0.5).to(BF16).requires_grad_()
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).cuda()
    wts = torch.rand(T, K, device="cuda", requires_grad=True)
    return x, w1, w2, ids, wts


def _check_grads_against_float64(out, x, w1, w2, ids, wts):
    """out and its gradients (x, w1, w2, the routing weights) against dense_reference in float64."""
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, w1, w2, wts], g)
    ins = [t.detach().double().requires_grad_() for t in (x, w1, w2, wts)]
    ref = moeblaze.dense_reference(ins[0], ins[1], ins[2], ids, ins[3])
    ref_grads = torch.autograd.grad(ref, ins, g.double())
    assert rel_err(out, ref) <= TOL[BF16]
    for name, a, r in zip(("dx", "dw1", "dw2", "d_weights"), grads, ref_grads):
        assert rel_err(a, r) <= TOL[BF16], name


def test_gpu_functional_supplied_routing(seed):
    x, w1, w2, ids, wts = _supplied_routing_inputs(200, 128, 64, 8, 2)
    out = moeblaze.moe_experts(x, w1, w2, ids, wts, validate=True)
    _check_grads_against_float64(out, x, w1, w2, ids, wts)


@pytest.mark.parametrize("recompute", [False, True])
def test_gpu_eager_path_keeps_h_and_the_plan_less_token_expert_indices(seed, recompute):
    """Between forward and backward the eager path holds H (keep_h) and the plan without
    token_expert_indices, which a CUDA backward never reads; the gradients stay right."""
    T, d, n, E, K = 1024, 256, 128, 16, 4
    S = T * K
    x, w1, w2, ids, wts = _supplied_routing_inputs(T, d, n, E, K)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = moeblaze.moe_experts(x, w1, w2, ids, wts, recompute=recompute)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
    h_bytes = 0 if recompute else S * 2 * n * 2
    plan_bytes = (E + 1 + T + 1 + 3 * S) * 4  # token_expert_indices (S * 4 more) let go
    assert h_bytes + plan_bytes <= held <= h_bytes + plan_bytes + 2048, (held, h_bytes, plan_bytes)
    _check_grads_against_float64(out, x, w1, w2, ids, wts)


def test_gpu_bad_ids_raise_with_validate():
    x = torch.randn(4, 64, device="cuda", dtype=BF16)
    w1 = torch.randn(4, 128, 64, device="cuda", dtype=BF16)
    w2 = torch.randn(4, 64, 64, device="cuda", dtype=BF16)
    ids = torch.tensor([[0, 1], [2, 3], [1, 7], [0, 2]], device="cuda")
    with pytest.raises(ValueError, match=r"expert id 7 of token 2 is out of range \[0, 4\)"):
        moeblaze.moe_experts(x, w1, w2, ids, torch.rand(4, 2, device="cuda"), validate=True)


@pytest.mark.parametrize("bad", ["out of range", "negative", "repeated"])
def test_gpu_bad_ids_without_validate_give_their_token_nan(bad):
    # No host sync by default: the plan builder leaves the bad pair out of the token view and the
    # aggregations give that token NaN (output, dx, its pair-weight gradients) instead of a row
    # silently short of a pair or counted twice; the other tokens are computed as usual.
    T, d, n, E, K, t = 64, 128, 128, 8, 2, 5
    x, w1, w2, ids, wts = _supplied_routing_inputs(T, d, n, E, K)
    bad_ids = ids.clone()
    bad_ids[t, 1] = {"out of range": E + 3, "negative": -2, "repeated": int(ids[t, 0])}[bad]
    out = moeblaze.moe_experts(x, w1, w2, bad_ids, wts)
    out.backward(torch.ones_like(out))
    others = torch.arange(T, device="cuda") != t
    assert torch.isnan(out[t]).all() and torch.isfinite(out[others]).all()
    assert torch.isnan(x.grad[t]).all() and torch.isfinite(x.grad[others]).all()
    assert torch.isnan(wts.grad[t, 1]) and torch.isfinite(wts.grad[others]).all()
    with torch.no_grad():  # the other tokens as with valid ids
        ref = moeblaze.moe_experts(x, w1, w2, ids, wts)
    assert rel_err(out[others], ref[others]) <= TOL[BF16]


def test_gpu_rejects_shapes_it_cannot_run():
    moe = _moe(d=96, n=64)
    with pytest.raises(moeblaze.UnsupportedError, match=r"d \(96\) must be a multiple of 64"):
        moe(torch.randn(8, 96, device="cuda", dtype=BF16))
    moe = _moe(d=64, n=64, dtype=torch.float32)
    with pytest.raises(moeblaze.UnsupportedError, match=r"float32 on CUDA outside autocast.*bf16"):
        moe(torch.randn(8, 64, device="cuda"))


def test_gpu_nan_logits_flagged():
    # No host sync in the router: the device-side check raises a flag, read by check_flags.
    # (Only the router runs here: a layer over a NaN routing computes garbage.)
    logits = torch.randn(16, 8, device="cuda")
    logits[3, 5] = float("nan")
    flags = moeblaze.ops.route(logits, None, 0, 2, False)[3]
    with pytest.raises(ValueError, match=r"NaN or Inf logit"):
        moeblaze.ops.check_flags(flags)
    moeblaze.ops.check_flags(moeblaze.ops.route(logits.nan_to_num(), None, 0, 2, False)[3])


def test_gpu_token_rounding(seed):
    E, K, m_tile = 16, 4, 64
    moe = _moe(d=128, n=128, E=E, K=K, token_rounding="nr-f", m_tile=m_tile)
    x = torch.randn(1024, 128, device="cuda", dtype=BF16, requires_grad=True)
    with torch.no_grad():
        _, offsets, experts, weights = moe.route(x.detach())
    counts = torch.zeros(E, dtype=torch.long, device="cuda").scatter_add_(
        0, experts.long(), torch.ones_like(experts, dtype=torch.long))
    assert bool((counts % m_tile == 0).all()), counts
    out, _ = moe(x)
    out.float().square().sum().backward()
    assert torch.isfinite(x.grad.float()).all() and torch.isfinite(moe.gate.weight.grad.float()).all()


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_gpu_token_round_ops_match_cpu_on_a_side_stream(seed, mode):
    # The CUDA op's two calls (count with its one sync, then fill) on a non-default stream, the
    # workspace from torch's allocator: the CPU's ids and weights, and no moeblaze allocation.
    T, E, K = 1500, 24, 3
    logits = torch.randn(T, E)
    off, exp, w, _ = moeblaze.ops.route(logits, None, 0, K, False)
    want = moeblaze.ops.token_round(logits, None, off, exp, w, 0, K, False, 16, mode, seed)
    moeblaze.reset_peak("cuda")
    before = moeblaze.memory_stats("cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        got = moeblaze.ops.token_round(logits.cuda(), None, off.cuda(), exp.cuda(), w.cuda(), 0,
                                       K, False, 16, mode, seed)
    side.synchronize()
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    torch.testing.assert_close(got[2].cpu(), want[2], rtol=2**-22, atol=0)
    assert moeblaze.memory_stats("cuda")["peak"] == before["current"]


def test_gpu_token_round_bad_topk_names_the_entry():
    T, E, K = 64, 8, 2
    logits = torch.randn(T, E, device="cuda")
    off, exp, w, _ = moeblaze.ops.route(logits, None, 0, K, False)
    exp = exp.clone()
    exp[2 * 10 + 1] = 99
    with pytest.raises(ValueError, match=r"expert id 99 of token 10"):
        moeblaze.ops.token_round(logits, None, off, exp, w, 0, K, False, 4, 0, 0)


def test_gpu_everything_lives_in_torch_memory():
    moeblaze.reset_peak("cuda")
    before = moeblaze.memory_stats("cuda")
    moe = _moe(d=256, n=128, E=16, K=4)
    x = torch.randn(2048, 256, device="cuda", dtype=BF16, requires_grad=True)
    out, _ = moe(x)
    out.float().sum().backward()
    torch.cuda.synchronize()
    after = moeblaze.memory_stats("cuda")
    # H, the plan and every workspace came from PyTorch's allocator: moeblaze allocated nothing.
    assert after["peak"] == before["current"] == after["current"], (before, after)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("losses", [False, True])
def test_cuda_graph_capture(seed, recompute, losses):
    """Forward + backward (router included; with losses, the switch and z losses through the C
    ABI with their gradients) captured in one CUDA graph, replayed on new inputs, equals eager
    execution: no host sync, no allocation outside PyTorch's graph pool."""
    coefs = dict(aux_loss_coef=0.01, z_loss_coef=0.001) if losses else {}
    moe = _moe(d=256, n=128, E=16, K=4, recompute=recompute, **coefs)
    params = [moe.w1, moe.w2, moe.gate.weight]
    static_x = torch.randn(1024, 256, device="cuda", dtype=BF16, requires_grad=True)
    static_g = torch.randn(1024, 256, device="cuda", dtype=BF16)

    def step():
        out, router_losses = moe(static_x)
        roots, grads = [out], [static_g]
        if losses:
            roots.append(router_losses.total)
            grads.append(torch.ones((), device="cuda"))
        return (out,) + torch.autograd.grad(roots, [static_x] + params, grads)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    new_x = torch.randn(1024, 256, device="cuda", dtype=BF16)
    new_g = torch.randn(1024, 256, device="cuda", dtype=BF16)
    with torch.no_grad():
        static_x.copy_(new_x)
        static_g.copy_(new_g)
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        static_x.copy_(new_x)
        static_g.copy_(new_g)
    eager = step()
    for name, a, b in zip(("out", "dx", "dw1", "dw2", "d_gate"), static_out, eager):
        assert rel_err(a, b) < 1e-3, name
    print("graph replay bitwise equal to eager:", all(torch.equal(a, b)
                                                      for a, b in zip(static_out, eager)))


def test_gpu_torch_compile_inductor(seed):
    moe = _moe(d=128, n=128, E=8, K=2)
    x = torch.randn(256, 128, device="cuda", dtype=BF16, requires_grad=True)
    compiled = torch.compile(moe, fullgraph=True)
    out_c, _ = compiled(x)
    out, _ = moe(x)
    assert rel_err(out_c, out) < 1e-2
    (gx,) = torch.autograd.grad(out_c.float().square().sum(), x)
    assert torch.isfinite(gx.float()).all()


def _functional_inputs(T=256, d=128, n=64, E=8, K=2):
    x = torch.randn(T, d, device="cuda", dtype=BF16, requires_grad=True)
    w1 = (torch.randn(E, 2 * n, d, device="cuda") / d ** 0.5).to(BF16).requires_grad_()
    w2 = (torch.randn(E, d, n, device="cuda") / n ** 0.5).to(BF16).requires_grad_()
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).cuda()
    wts = torch.rand(T, K, device="cuda", requires_grad=True)
    return x, w1, w2, ids, wts


def test_gpu_backward_writes_dh_over_h_and_a_second_backward_fails_loudly(seed):
    # keep_h backward writes dH over the saved H (less memory); the same graph cannot be run
    # backward twice, and autograd says so instead of reading dH as H.
    x, w1, w2, ids, wts = _functional_inputs()
    out = moeblaze.moe_experts(x, w1, w2, ids, wts)
    g = torch.randn_like(out)
    first = torch.autograd.grad(out, [x, w1, w2, wts], g, retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        torch.autograd.grad(out, [x, w1, w2, wts], g)
    # The gradients equal recompute mode's, which never touches a caller's H.
    again = torch.autograd.grad(moeblaze.moe_experts(x, w1, w2, ids, wts, recompute=True),
                                [x, w1, w2, wts], g)
    for name, a, b in zip(("dx", "dw1", "dw2", "d_weights"), first, again):
        assert torch.equal(a, b), name


def test_gpu_no_zero_filled_gradient_for_h(seed):
    # h is an output only to be saved: backward must not materialise an (S, 2n) zero gradient.
    x, w1, w2, ids, wts = _functional_inputs(T=2048, d=256, n=512, E=8, K=2)
    out = moeblaze.moe_experts(x, w1, w2, ids, wts)
    g = torch.randn_like(out)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out.backward(g)
    names = [e.name for e in prof.events()]
    assert "aten::zeros" not in names and "aten::zero_" not in names, sorted(set(names))



@pytest.mark.parametrize("rounding", [None, "nr-f"])
def test_moe_step_is_deterministic(seed, rounding):
    """MoE.forward's one-node step (router, rounding, experts, both losses) twice on the same
    inputs: out, the losses and every gradient bit for bit."""
    moe = _moe(d=256, n=128, E=16, K=4, token_rounding=rounding, m_tile=128,
               aux_loss_coef=0.01, z_loss_coef=0.001)
    x = torch.randn(2048, 256, device="cuda", dtype=BF16)
    g = torch.randn(2048, 256, device="cuda", dtype=BF16)
    runs = []
    for _ in range(2):
        xs = x.clone().requires_grad_()
        out, losses = moe(xs)
        ((out * g).sum() + 3.0 * losses.aux_loss + 0.5 * losses.z_loss).backward()
        runs.append([out.detach(), torch.stack(losses).detach(), xs.grad] +
                    [p.grad.clone() for p in moe.parameters()])
        moe.zero_grad(set_to_none=True)
    for a, b in zip(*runs):
        assert torch.equal(a, b)
