"""The eager path of moe_experts / experts_from_routing (one C call from (T, K) ids to the plan,
then the experts without the custom ops' dispatch) against the custom ops that torch.compile
traces: the same C calls, so the same bits, for every input form the eager path takes."""
import pytest
import torch

import moeblaze
from moeblaze import ops
from moeblaze.layer import _activation_code

BF16 = torch.bfloat16


def _inputs(T, d, n, E, K, dtype, device, id_dtype=torch.int64, w_dtype=torch.float32,
            bias=False):
    x = torch.randn(T, d, device=device).to(dtype).requires_grad_()
    w1 = (torch.randn(E, 2 * n, d, device=device) / d ** 0.5).to(dtype).requires_grad_()
    w2 = (torch.randn(E, d, n, device=device) / n ** 0.5).to(dtype).requires_grad_()
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)] or [torch.empty(0, K).long()])
    ids = ids.reshape(T, K).to(device, id_dtype)
    wts = torch.rand(T, K, device=device).to(w_dtype).requires_grad_()
    b = ([(torch.randn(E, 2 * n, device=device) / 4).to(dtype).requires_grad_(),
          (torch.randn(E, d, device=device) / 4).to(dtype).requires_grad_()]
         if bias else [None, None])
    return x, w1, w2, ids, wts, b


def _through_ops(x, w1, w2, ids, wts, b1, b2, activation):
    """moe_experts as traced code runs it: torch conversions, moeblaze::build_plan and
    moeblaze::experts_forward (whose registered autograd runs moeblaze::experts_backward)."""
    T, K = ids.shape
    offsets = torch.arange(0, T * K + 1, K, dtype=torch.int32, device=x.device)
    pw = wts.to(torch.float32).reshape(-1)
    plan = ops.build_plan(offsets, ids.to(torch.int32).reshape(-1), pw.detach(), w2.shape[0])
    out, _ = ops.experts_forward(x, w1, w2, pw, *plan[:6], _activation_code(activation), False, 0,
                                 b1, b2)
    return out


def _same_bits(device, dtype, id_dtype, w_dtype, bias=False, activation="swiglu"):
    T, d, n, E, K = 37, 64, 64, 6, 3
    x, w1, w2, ids, wts, (b1, b2) = _inputs(T, d, n, E, K, dtype, device, id_dtype, w_dtype, bias)
    params = [t for t in (x, w1, w2, wts, b1, b2) if t is not None]
    out = moeblaze.moe_experts(x, w1, w2, ids, wts, activation, b1=b1, b2=b2)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, params, g)
    ref = _through_ops(x, w1, w2, ids, wts, b1, b2, activation)
    ref_grads = torch.autograd.grad(ref, params, g)
    assert torch.equal(out, ref)
    for name, a, r in zip(("dx", "dw1", "dw2", "d_weights", "db1", "db2"), grads, ref_grads):
        assert a.dtype == r.dtype and a.shape == r.shape, name
        assert torch.equal(a, r), name


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("w_dtype", [torch.float32, BF16, torch.float64])
def test_eager_matches_the_ops_bitwise_cpu(seed, dtype, id_dtype, w_dtype):
    _same_bits("cpu", dtype, id_dtype, w_dtype)


def test_eager_matches_the_ops_bitwise_with_biases_cpu(seed):
    _same_bits("cpu", torch.float32, torch.int64, torch.float32, bias=True,
               activation="swiglu_oai")


@pytest.mark.parametrize("bad", [-1, 6, 2 ** 32 + 1])
def test_eager_bad_id_names_the_entry_cpu(seed, bad):
    x, w1, w2, ids, wts, _ = _inputs(5, 16, 8, 6, 2, torch.float32, "cpu")
    ids[3, 1] = bad
    with pytest.raises(ValueError, match=rf"expert_ids\[3, 1\]: expert id {bad} of token 3 is "
                                         r"out of range \[0, 6\)"):
        moeblaze.moe_experts(x, w1, w2, ids, wts)


def test_eager_repeated_id_and_top_k_above_e_cpu(seed):
    x, w1, w2, ids, wts, _ = _inputs(5, 16, 8, 6, 2, torch.float32, "cpu")
    ids[2] = torch.tensor([4, 4])
    with pytest.raises(ValueError, match="repeat"):
        moeblaze.moe_experts(x, w1, w2, ids, wts)
    x, w1, w2, ids, wts, _ = _inputs(5, 16, 8, 2, 2, torch.float32, "cpu")
    ids = torch.zeros(5, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"K \(3\) must be in \[1, E = 2\]"):
        moeblaze.moe_experts(x, w1, w2, ids, torch.rand(5, 3))


def test_eager_empty_batch_cpu(seed):
    x, w1, w2, ids, wts, _ = _inputs(0, 16, 8, 4, 2, torch.float32, "cpu")
    out = moeblaze.moe_experts(x, w1, w2, ids, wts)
    assert out.shape == (0, 16)
    out.sum().backward()
    assert x.grad.shape == (0, 16) and torch.equal(w1.grad, torch.zeros_like(w1))


def test_plan_from_ids_equals_build_plan_cpu(seed):
    T, E, K = 50, 9, 4
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    wts = torch.rand(T, K).to(BF16)
    a = ops.plan_from_ids(ids, wts, E)
    offsets = torch.arange(0, T * K + 1, K, dtype=torch.int32)
    b = ops.build_plan(offsets, ids.to(torch.int32).reshape(-1),
                       wts.to(torch.float32).reshape(-1), E)
    for name, p, q in zip(ops._PLAN_NAMES + ("flags",), a, b):
        assert torch.equal(p, q), name


@pytest.mark.gpu
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("w_dtype", [torch.float32, BF16])
def test_eager_matches_the_ops_bitwise_gpu(seed, id_dtype, w_dtype):
    _same_bits("cuda", BF16, id_dtype, w_dtype)


@pytest.mark.gpu
def test_plan_from_ids_flags_a_wide_bad_id_gpu(seed):
    T, E, K = 64, 8, 2
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).cuda()
    wts = torch.rand(T, K, device="cuda")
    plan = ops.plan_from_ids(ids, wts, E)
    assert not plan[6].any()
    ids[7, 0] = 2 ** 32 + 1  # would narrow to expert 1
    plan = ops.plan_from_ids(ids, wts, E)
    assert plan[6].tolist() == [1, 0, 0, 0]
    ids[7, 0] = ids[7, 1]
    plan = ops.plan_from_ids(ids, wts, E)
    assert plan[6].tolist() == [0, 1, 0, 0]


def test_plan_from_ids_c_abi_rejects_bad_arguments_untouched():
    import ctypes
    from moeblaze._lib import Plan, lib
    T, K, E = 4, 2, 3
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2]], dtype=torch.int64)
    w = torch.rand(T, K)
    arrays = [torch.full((n,), -7, dtype=torch.int32) for n in (E + 1, T * K, T * K, T + 1,
                                                                  T * K, T * K)]
    plan = Plan(T, E, T * K, *[a.data_ptr() for a in arrays])

    def call(ids_dtype=1, k=K, e=E, wdt=0, p=plan):
        rc = lib().moeblaze_plan_from_ids(ids.data_ptr(), ids_dtype, w.data_ptr(), wdt, T, k, e, 0,
                                          None, ctypes.byref(p), None, 0, None)
        return rc, lib().moeblaze_last_error().decode()

    for kwargs, needle in [(dict(ids_dtype=7), "ids_dtype (7) must be 0 (int32) or 1 (int64)"),
                           (dict(k=0), "K (0) must be in [1, E = 3]"),
                           (dict(k=4), "K (4) must be in [1, E = 3]"),
                           (dict(wdt=5), "expert_weights"),
                           (dict(e=4), "plan has (T, E, S) = (4, 3, 8), the ids give")]:
        rc, msg = call(**kwargs)
        assert rc == 1 and needle in msg, (kwargs, msg)
        assert all(bool((a == -7).all()) for a in arrays), kwargs  # outputs untouched
    assert call()[0] == 0


def _module_matches_the_ops(moe, x, routing):
    """moe(x) in eager mode against the ops traced code runs: moeblaze::route, then
    routing(logits, offsets, experts, weights) (e.g. moeblaze::token_round), build_plan and
    experts_forward with their registered autograd. Output and gradients bit for bit."""
    E = moe.num_experts
    params = [x, moe.gate.weight, moe.w1, moe.w2]
    out, _ = moe(x)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, params, g)
    logits = moeblaze.layer.router_logits(x, moe.gate.weight)
    offsets, experts, weights, _ = ops.route(logits, moe.expert_bias, moe._kind, moe.top_k,
                                             moe.renormalize)
    offsets, experts, weights = routing(logits, offsets, experts, weights)
    plan = ops.build_plan(offsets, experts, weights.detach(), E)
    ref, _ = ops.experts_forward(x, moe.w1, moe.w2, weights, *plan[:6], moe._act, False, 0)
    ref_grads = torch.autograd.grad(ref, params, g)
    assert torch.equal(out, ref)
    for name, a, r in zip(("dx", "d_gate", "dw1", "dw2"), grads, ref_grads):
        assert torch.equal(a, r), name
    assert moe.gate.weight.grad is None and grads[1].abs().sum() > 0


@pytest.mark.parametrize("router", ["softmax_topk", "sigmoid_bias"])
def test_moe_module_eager_matches_the_ops_bitwise_cpu(seed, router):
    moe = moeblaze.MoE(32, 16, 6, 2, router=router, dtype=torch.float32)
    if moe.expert_bias is not None:
        moe.expert_bias.copy_(torch.randn(6) / 10)
    _module_matches_the_ops(moe, torch.randn(29, 32, requires_grad=True),
                            lambda logits, *routing: routing)


@pytest.mark.parametrize("mode", ["nr-f", "up"])
def test_moe_module_eager_token_rounding_matches_the_ops_bitwise_cpu(seed, mode):
    # The module's eager rounding (_RoundFn) against moeblaze::token_round and its registered
    # autograd: the same routing, output and gradients, the gate's through the rounded weights.
    K, m_tile = 2, 8
    moe = moeblaze.MoE(32, 16, 6, K, token_rounding=mode, m_tile=m_tile, dtype=torch.float32)
    _module_matches_the_ops(
        moe, torch.randn(45, 32, requires_grad=True),
        lambda logits, *routing: ops.token_round(logits, None, *routing, moe._kind, K,
                                                 moe.renormalize, m_tile,
                                                 moeblaze._lib.ROUNDINGS[mode], 0))


@pytest.mark.parametrize("entry", ["plan_from_ids", "build_plan"])
def test_plan_builds_reject_outputs_overlapping_inputs_untouched(entry):
    import ctypes
    from moeblaze._lib import Plan, Routing, lib
    T, K, E = 4, 2, 3
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2]], dtype=torch.int32)
    w = torch.rand(T, K)
    offsets = torch.arange(0, T * K + 1, K, dtype=torch.int32)
    arrays = [torch.full((n,), -7, dtype=torch.int32) for n in (E + 1, T * K, T * K, T + 1,
                                                                  T * K, T * K)]
    # token_index_map (the last array) laid over the ids: a build would overwrite its input.
    ptrs = [a.data_ptr() for a in arrays[:5]] + [ids.data_ptr()]
    plan = Plan(T, E, T * K, *ptrs)
    if entry == "plan_from_ids":
        rc = lib().moeblaze_plan_from_ids(ids.data_ptr(), 0, w.data_ptr(), 0, T, K, E, 0, None,
                                          ctypes.byref(plan), None, 0, None)
        name = "expert_ids"
    else:
        r = Routing(T, E, T * K, offsets.data_ptr(), ids.data_ptr(), w.data_ptr())
        rc = lib().moeblaze_build_plan(ctypes.byref(r), 0, None, ctypes.byref(plan), None, 0, None)
        name = "routing.pair_experts"
    msg = lib().moeblaze_last_error().decode()
    assert rc == 1 and "plan.token_index_map overlaps " + name in msg, msg
    assert all(bool((a == -7).all()) for a in arrays[:5])
    assert ids.tolist() == [[0, 1], [1, 2], [2, 0], [0, 2]]
