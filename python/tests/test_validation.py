"""Trust under bad input, the Python half: one regression test per defect. Every bad
argument fails with a ValueError naming the argument and the rule, before any C call, and leaves
the inputs untouched; what the checks make contiguous gives the contiguous result."""
import re

import pytest
import torch

import moeblaze
from moeblaze import ops
from moeblaze.layer import router_losses

T, D, N, E, K = 6, 16, 8, 4, 2


def _layer_inputs():
    x = torch.randn(T, D)
    w1, w2 = torch.randn(E, 2 * N, D), torch.randn(E, D, N)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    return x, w1, w2, ids, torch.rand(T, K)


def _plan_call():
    """(x, w1, w2, pair_weights, plan) of a valid ops.experts_forward call."""
    x, w1, w2, _, _ = _layer_inputs()
    off, exp, pw, _ = ops.route(torch.randn(T, E), None, 0, K, False)
    return x, w1, w2, pw, list(ops.build_plan(off, exp, pw, E)[:6])


def _strided(t):
    """The same values as t in a non-contiguous view."""
    s = torch.stack([t, torch.zeros_like(t)], -1)[..., 0]
    assert not s.is_contiguous() or t.numel() <= 1
    return s


# ---- item 1 (Python part) and item 6: plan and routing tensors --------------------------------
@pytest.mark.parametrize("index,cast,name", [
    (1, torch.int64, "expert_token_indices"), (0, torch.int64, "expert_token_offsets"),
    (2, torch.float64, "slot_weights"), (5, torch.int64, "token_index_map")])
def test_plan_array_dtype_named(index, cast, name):
    x, w1, w2, pw, plan = _plan_call()
    plan[index] = plan[index].to(cast)
    with pytest.raises(ValueError, match=rf"{name} must have dtype torch\.(int32|float32), "
                                         rf"got {cast}"):
        ops.experts_forward(x, w1, w2, pw, *plan, 0, False, 0)


def test_plan_array_shape_named():
    x, w1, w2, pw, plan = _plan_call()
    plan[3] = plan[3].reshape(-1, 1)
    with pytest.raises(ValueError, match=r"token_pair_offsets must have shape \(7,\)"):
        ops.experts_forward(x, w1, w2, pw, *plan, 0, False, 0)
    plan = _plan_call()[4]
    plan[2] = plan[2][:-1]
    with pytest.raises(ValueError, match=r"slot_weights must have shape \(12,\), got \(11,\)"):
        ops.experts_forward(x, w1, w2, pw, *plan, 0, False, 0)


def test_strided_plan_and_routing_made_contiguous(seed):
    x, w1, w2, pw, plan = _plan_call()
    want = ops.experts_forward(x, w1, w2, pw, *plan, 0, False, 0)[0]
    got = ops.experts_forward(x, w1, w2, pw, *[_strided(t) for t in plan], 0, False, 0)[0]
    assert torch.equal(want, got)
    logits = torch.randn(T, E)
    off, exp, w, _ = ops.route(logits, None, 0, K, False)
    g = torch.randn_like(w)
    want = ops.router_backward(logits, None, off, exp, w, g, 0, K, False)
    got = ops.router_backward(logits, None, _strided(off), _strided(exp), _strided(w),
                              _strided(g), 0, K, False)
    assert torch.equal(want, got)
    want = ops.token_round(logits, None, off, exp, w, 0, K, False, 4, 0, 0)
    got = ops.token_round(logits, None, _strided(off), _strided(exp), _strided(w), 0, K, False,
                          4, 0, 0)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


_CORRUPTIONS = [  # (array index, entry, value, words of the error)
    (1, 3, 10**6, "plan.expert_token_indices[3] (1000000) must be in [0, T = 6)"),
    (0, 1, -1, "plan.expert_token_offsets must be non-decreasing"),
    (4, 0, E, f"plan.token_expert_indices[0] ({E}) must be in [0, E = {E})"),
    (5, 0, -7, "plan.token_index_map[0] (-7) must be in [0, S = 12)"),
]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("index,entry,value,words", _CORRUPTIONS)
def test_validate_plan_names_the_rule(device, index, entry, value, words):
    if device == "cuda" and not (torch.cuda.is_available() and moeblaze.has_cuda()):
        pytest.skip("no CUDA device or moeblaze built without CUDA")
    plan = [t.to(device) for t in _plan_call()[4]]
    ops.validate_plan(*plan)  # the library's plan passes
    plan[index] = plan[index].clone()
    plan[index][entry] = value
    with pytest.raises(ValueError, match=re.escape(words)):
        ops.validate_plan(*plan)


def test_routing_dtype_named():
    logits = torch.randn(T, E)
    off, exp, w, _ = ops.route(logits, None, 0, K, False)
    with pytest.raises(ValueError, match=r"pair_experts must have dtype torch\.int32"):
        ops.router_backward(logits, None, off, exp.long(), w, w, 0, K, False)
    with pytest.raises(ValueError, match=r"pair_weights must have dtype torch\.float32"):
        ops.build_plan(off, exp, w.double(), E)
    with pytest.raises(ValueError, match=r"pair_offsets must have dtype torch\.int32"):
        ops.token_round(logits, None, off.long(), exp, w, 0, K, False, 4, 0, 0)


def test_inputs_untouched_on_error():
    x, w1, w2, pw, plan = _plan_call()
    before = [t.clone() for t in (x, w1, w2, pw, *plan)]
    plan[1] = plan[1].long()
    with pytest.raises(ValueError):
        ops.experts_forward(x, w1, w2, pw, *plan, 0, False, 0)
    plan[1] = plan[1].int()
    assert all(torch.equal(a, b) for a, b in zip(before, (x, w1, w2, pw, *plan)))


# ---- item 2: meta and fake tensors never reach a kernel ----------------------------------------
@pytest.mark.parametrize("which", ["x", "w1", "w2", "ids", "weights", "all"])
def test_meta_tensors_raise(which):
    args = dict(zip(("x", "w1", "w2", "ids", "weights"), _layer_inputs()))
    for k in args:
        if which in (k, "all"):
            args[k] = args[k].to("meta")
    with pytest.raises(ValueError, match=r"is on meta"):
        moeblaze.moe_experts(*args.values())


def test_meta_plan_array_and_logits_raise():
    x, w1, w2, pw, plan = _plan_call()
    plan[4] = plan[4].to("meta")
    with pytest.raises(ValueError, match=r"token_expert_indices is on meta"):
        ops.experts_forward(x, w1, w2, pw, *plan, 0, False, 0)
    with pytest.raises(ValueError, match=r"logits is on meta"):
        ops.route(torch.randn(T, E, device="meta"), None, 0, K, False)


def test_fake_tensors_outside_tracing_raise():
    from torch._subclasses.fake_tensor import FakeTensorMode
    real = _layer_inputs()
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in real]
        out = moeblaze.moe_experts(*fake)  # inside the mode: shapes only, no kernel
        assert out.shape == (T, D)
    with pytest.raises(ValueError, match=r"fake tensor outside tracing"):
        moeblaze.moe_experts(*fake)
    with pytest.raises(ValueError, match=r"fake tensor"):
        moeblaze.moe_experts(*real[:3], fake[3], real[4])


def test_compile_fullgraph_still_traces(seed):
    x, w1, w2, ids, w = _layer_inputs()
    x.requires_grad_()
    want = moeblaze.moe_experts(x, w1, w2, ids, w)
    fn = torch.compile(moeblaze.moe_experts, backend="aot_eager", fullgraph=True)
    got = fn(x, w1, w2, ids, w)
    assert torch.equal(want, got)
    (g,) = torch.autograd.grad(got.sum(), x)
    assert torch.equal(g, torch.autograd.grad(want.sum(), x)[0])


# ---- item 3: router bias ---------------------------------------------------------------------
@pytest.mark.parametrize("bias,rule", [
    (torch.zeros(1), r"bias must have shape \(4,\), got \(1,\)"),
    (torch.zeros(1, E), r"bias must have shape \(4,\), got \(1, 4\)"),
    (torch.zeros(E, dtype=torch.float64), r"bias must have dtype torch\.float32"),
    (torch.zeros(E, device="meta"), r"bias is on meta")])
def test_router_bias_checked(bias, rule):
    logits = torch.randn(T, E)
    with pytest.raises(ValueError, match=rule):
        ops.route(logits, bias, 2, K, False)
    off, exp, w, _ = ops.route(logits, torch.zeros(E), 2, K, False)
    with pytest.raises(ValueError, match=rule):
        ops.router_backward(logits, bias, off, exp, w, w, 2, K, False)
    with pytest.raises(ValueError, match=rule):
        ops.token_round(logits, bias, off, exp, w, 2, K, False, 4, 0, 0)


# ---- item 5 and item 9's Python part: ids never narrowed, integers bounded ----------------------
def test_float_ids_rejected():
    x, w1, w2, ids, w = _layer_inputs()
    with pytest.raises(ValueError, match=r"expert_ids must have an integer dtype, got "
                                         r"torch\.float32"):
        moeblaze.moe_experts(x, w1, w2, ids.float() + 0.7, w)


@pytest.mark.parametrize("bad", [2 ** 32, 2 ** 32 + 1, -1, E, -(2 ** 40)])
def test_wide_ids_not_narrowed(bad):
    x, w1, w2, ids, w = _layer_inputs()
    ids[3, 1] = bad
    with pytest.raises(ValueError, match=rf"expert_ids\[3, 1\]: expert id {bad} of token 3 is "
                                         rf"out of range \[0, 4\)"):
        moeblaze.moe_experts(x, w1, w2, ids, w)
    # Without the range check (CUDA without validate=True) a bad id stays out of range.
    narrowed = ops.expert_ids_int32(ids, E, check_range=False)
    assert int(narrowed[3, 1]) not in range(E)


@pytest.mark.parametrize("threads", [-1, 1025, 2 ** 31, 2 ** 32 + 1])
def test_num_threads_bounded(threads):
    x, w1, w2, pw, plan = _plan_call()
    with pytest.raises(ValueError, match=rf"num_threads \({threads}\) must be in \[0, 1024\]"):
        ops.experts_forward(x, w1, w2, pw, *plan, 0, False, threads)


@pytest.mark.parametrize("call,rule", [
    (lambda L: ops.route(L, None, 7, K, False), r"kind \(7\) must be one of"),
    (lambda L: ops.route(L, None, 0, 2 ** 32 + 1, False), r"top_k \(4294967297\) must be in"),
    # Checked before anything is allocated (the expanded logits are never copied).
    (lambda L: ops.route(torch.zeros(1, 4096).expand(2 ** 20, 4096), None, 0, 4096, False),
     r"T\*top_k \(4294967296\) exceeds the int32 index range"),
    (lambda L: ops.token_round(L, None, *ops.route(L, None, 0, K, False)[:3], 0, K, False, 4, 9,
                               0), r"mode \(9\) must be one of"),
    (lambda L: ops.token_round(L, None, *ops.route(L, None, 0, K, False)[:3], 0, K, False, 4, 0,
                               -1), r"seed \(-1\) must be in")])
def test_int_arguments_do_not_wrap(call, rule):
    with pytest.raises(ValueError, match=rule):
        call(torch.randn(T, E))


def test_activation_code_range():
    x, w1, w2, pw, plan = _plan_call()
    with pytest.raises(ValueError, match=r"activation \(7\) must be one of the codes"):
        ops.experts_forward(x, w1, w2[:, :, :N], pw, *plan, 7, False, 0)


# ---- item 10: the auxiliary losses are the same bits for every thread count --------------------
def _with_threads(n, fn):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("rows,experts,router", [(3001, 32, "sigmoid_bias"),
                                                 (9999, 16, "sigmoid_bias"),
                                                 (40001, 8, "softmax_topk")])
def test_router_losses_thread_count_invariant(rows, experts, router):
    # Inputs on which the old single-op losses rounded differently on 1 and 2 threads: sigmoid's
    # backward (the gradient of the first two) and the mean over T (z_loss of the third).
    gen = torch.Generator().manual_seed(rows + experts)
    logits = torch.randn(rows, experts, generator=gen) * 3
    ids = torch.randint(0, experts, (2 * rows,), generator=gen, dtype=torch.int32)

    def run():
        lg = logits.clone().requires_grad_()
        losses = router_losses(lg, ids, experts, router, 0.01, 0.001)
        losses.total.backward()
        return losses.aux_loss.detach(), losses.z_loss.detach(), lg.grad

    for a, b in zip(_with_threads(1, run), _with_threads(2, run)):
        assert torch.equal(a, b)


def test_moe_grads_thread_count_invariant_with_losses():
    # The old losses gave a different gradient on 1 and 2 threads here (seed 0). Compared: what
    # moeblaze computes (the logits' gradient, the losses), not x.grad, which also passes through
    # the gate's GEMM in torch, whose CPU kernels may split the sum by thread count (16 threads
    # on an AVX-512 machine did).
    def run():
        torch.manual_seed(0)
        moe = moeblaze.MoE(16, 16, 16, 2, router="sigmoid_bias", aux_loss_coef=0.01,
                           z_loss_coef=0.001, dtype=torch.float32)
        # The Python path, whose logits can be kept; the one-node step (csrc/eager_layer.cpp)
        # gives its bits (test_extension.py's test_moe_layer_node_gives_the_python_paths_bits).
        moe._layer_step = lambda x2: None
        with torch.no_grad():
            moe.gate.weight.mul_(3)
        logits, real = [], moeblaze.layer.router_logits

        def kept_logits(x2, w):
            out = real(x2, w)
            out.retain_grad()
            logits.append(out)
            return out
        x = torch.randn(9999, 16, requires_grad=True)
        moeblaze.layer.router_logits = kept_logits
        try:
            out, losses = moe(x)
        finally:
            moeblaze.layer.router_logits = real
        (0 * out.sum() + losses.total).backward()
        assert len(logits) == 1 and logits[0].grad is not None
        return logits[0].grad, losses.aux_loss.detach(), losses.z_loss.detach()

    for a, b in zip(_with_threads(1, run), _with_threads(2, run)):
        assert torch.equal(a, b)
