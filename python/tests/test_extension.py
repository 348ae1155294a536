"""moe_experts' C++ fast path (moeblaze/_ext.py, csrc/eager_experts.cpp) against the Python path
(layer._ExpertsFn), which makes the same C calls: the same bits forward and backward, the same
errors, and the fast path really taken where a compiler can build it."""
import os
import shutil

import pytest
import torch

import moeblaze
from moeblaze import _ext

from helpers import DEVICES

BF16 = torch.bfloat16


@pytest.fixture
def fast_path():
    """The fast path on (the default) for the test, whatever an earlier test left."""
    moeblaze.use_extension(True)
    yield
    moeblaze.use_extension(True)


def _has_compiler():
    return shutil.which(os.environ.get("CXX", "c++")) is not None and _ext._include_dir()


def _fn_name(fn):
    """An autograd node's name; its class's where name() refuses (torch 2.11 on a Python
    Function's node)."""
    try:
        return fn.name()
    except RuntimeError:
        return type(fn).__name__


def _node(out):
    return _fn_name(out.grad_fn)


def _inputs(T, d, n, E, K, dtype, device, rows, id_dtype, w_dtype):
    x = torch.randn(T, d, device=device).to(dtype)
    w1 = (torch.randn(E, rows, d, device=device) / d ** 0.5).to(dtype)
    w2 = (torch.randn(E, d, n, device=device) / n ** 0.5).to(dtype)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).to(device, id_dtype)
    wts = torch.rand(T, K, device=device).to(w_dtype)
    return x, w1, w2, ids, wts


def _step(use, x, w1, w2, ids, wts, activation, recompute, g):
    """(out, node name, grads) of one forward+backward with the fast path on or off."""
    moeblaze.use_extension(use)
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, wts)]
    out = moeblaze.moe_experts(leaves[0], leaves[1], leaves[2], ids, leaves[3], activation,
                               recompute=recompute)
    name = _node(out)
    out.backward(g)
    return out.detach(), name, [t.grad for t in leaves]


def test_fast_path_is_built_where_a_compiler_is(fast_path):
    if not _has_compiler():
        pytest.skip("no C++ compiler or capi.h here: moe_experts keeps the Python path")
    assert _ext.get() is not None, moeblaze.extension_status()
    assert moeblaze.extension_status().startswith("loaded: "), moeblaze.extension_status()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation,recompute,K,id_dtype,w_dtype", [
    ("swiglu", False, 3, torch.int64, torch.float32),
    ("swiglu", True, 3, torch.int32, BF16),
    ("relu", False, 1, torch.int64, torch.float32),
    ("geglu", False, 2, torch.int32, torch.float64),
])
def test_fast_path_gives_the_python_paths_bits(fast_path, seed, device, activation, recompute, K,
                                               id_dtype, w_dtype):
    if not _has_compiler():
        pytest.skip("no C++ compiler here: the fast path is not built")
    dtypes = [BF16] if device == "cuda" else [torch.float32, BF16]
    for dtype in dtypes:
        T, d, n, E = 45, 64, 64, 6
        rows = 2 * n if activation in ("swiglu", "geglu") else n
        x, w1, w2, ids, wts = _inputs(T, d, n, E, K, dtype, device, rows, id_dtype, w_dtype)
        g = torch.randn(T, d, device=device).to(dtype)
        fast = _step(True, x, w1, w2, ids, wts, activation, recompute, g)
        slow = _step(False, x, w1, w2, ids, wts, activation, recompute, g)
        assert "EagerExperts" in fast[1] and "EagerExperts" not in slow[1], (fast[1], slow[1])
        assert torch.equal(fast[0], slow[0])
        for name, a, b in zip(("dx", "dw1", "dw2", "d_weights"), fast[2], slow[2]):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a, b), name


def test_fast_path_takes_strided_inputs(fast_path, seed):
    """Non-contiguous x, w1 and ids: copied dense, as the Python path does."""
    if not _has_compiler():
        pytest.skip("no C++ compiler here: the fast path is not built")
    T, d, n, E, K = 30, 32, 16, 5, 2
    x = torch.randn(d, T).t()
    w1 = torch.randn(E, d, 2 * n).transpose(1, 2) / d ** 0.5
    w2 = torch.randn(E, d, n) / n ** 0.5
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).t().contiguous().t()
    wts = torch.rand(T, K)
    outs = []
    for use in (True, False):
        moeblaze.use_extension(use)
        outs.append(moeblaze.moe_experts(x, w1, w2, ids, wts))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("case", ["id out of range", "K above E", "w1 rows", "x dtype"])
def test_fast_path_raises_the_python_paths_errors(fast_path, case):
    T, d, n, E, K = 8, 16, 8, 4, 2
    x, w1, w2 = torch.randn(T, d), torch.randn(E, 2 * n, d), torch.randn(E, d, n)
    ids, wts = torch.stack([torch.randperm(E)[:K] for _ in range(T)]), torch.rand(T, K)
    if case == "id out of range":
        ids[5, 1] = E
    elif case == "K above E":
        ids, wts = torch.zeros(T, E + 1, dtype=torch.long), torch.rand(T, E + 1)
    elif case == "w1 rows":
        w1 = torch.randn(E, n, d)
    else:
        x = x.double()
    errors = []
    for use in (True, False):
        moeblaze.use_extension(use)
        with pytest.raises((ValueError, TypeError, RuntimeError)) as info:
            moeblaze.moe_experts(x, w1, w2, ids, wts)
        errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1]


def test_use_extension_false_takes_the_python_path(fast_path):
    moeblaze.use_extension(False)
    assert moeblaze.extension_status() == "disabled"
    x, w1, w2 = torch.randn(4, 8, requires_grad=True), torch.randn(2, 16, 8), torch.randn(2, 8, 8)
    out = moeblaze.moe_experts(x, w1, w2, torch.tensor([[0], [1], [1], [0]]), torch.rand(4, 1))
    assert "EagerExperts" not in _node(out)


def test_fast_path_gradients_are_once_differentiable(fast_path):
    """create_graph=True gives gradients; differentiating through them raises, as the Python
    path's @once_differentiable backward does."""
    if not _has_compiler():
        pytest.skip("no C++ compiler here: the fast path is not built")
    x = torch.randn(6, 8, requires_grad=True)
    w1, w2 = torch.randn(3, 16, 8, requires_grad=True), torch.randn(3, 8, 8, requires_grad=True)
    out = moeblaze.moe_experts(x, w1, w2, torch.tensor([[0], [1], [2], [0], [1], [2]]),
                               torch.rand(6, 1))
    (gx,) = torch.autograd.grad(out.square().sum(), [x], create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.sum().backward()


@pytest.mark.gpu
def test_fast_path_second_backward_fails_after_dh_over_h(fast_path, seed):
    """On CUDA backward writes dH over the kept H: a retained graph's second backward must fail
    on H's version, never read dH as H."""
    if not torch.cuda.is_available() or not moeblaze.has_cuda():
        pytest.skip("needs a CUDA build and a GPU")
    if not _has_compiler():
        pytest.skip("no C++ compiler here: the fast path is not built")
    T, d, n, E, K = 64, 64, 64, 4, 2
    x, w1, w2, ids, wts = _inputs(T, d, n, E, K, BF16, "cuda", 2 * n, torch.int64, torch.float32)
    x.requires_grad_()
    out = moeblaze.moe_experts(x, w1, w2, ids, wts)
    assert "EagerExperts" in _node(out)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rounding,recompute", [(None, False), ("nr-f", False), (None, True)])
def test_moe_module_fast_path_gives_the_python_paths_bits(fast_path, seed, device, rounding,
                                                          recompute):
    """MoE routes, then experts_from_routing over the CSR routing (token rounding: a varying
    number of pairs per token): the fast path's plan from that routing, same bits."""
    if not _has_compiler():
        pytest.skip("no C++ compiler here: the fast path is not built")
    dtype = BF16 if device == "cuda" else torch.float32
    # n = 64: the GPU's multiple; token rounding on the GPU rounds to its 128-row M tile.
    moe = moeblaze.MoE(64, 64, 8, 2, token_rounding=rounding,
                       m_tile=128 if device == "cuda" else 16, recompute=recompute,
                       aux_loss_coef=0.01, device=device, dtype=dtype)
    moe._layer_step = lambda x2: None  # the split step: the one node has its own tests below
    x = torch.randn(3, 40, 64, device=device).to(dtype)
    g = torch.randn(3, 40, 64, device=device).to(dtype)
    results = []
    for use in (True, False):
        moeblaze.use_extension(use)
        xs = x.clone().requires_grad_()
        out, losses = moe(xs)
        (out * g).sum().add(losses.total).backward()
        params = [xs] + [p for p in moe.parameters()]
        results.append((out.detach(), [p.grad.clone() for p in params]))
        moe.zero_grad(set_to_none=True)
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_experts_from_routing_takes_the_fast_path(fast_path, seed, device):
    if not _has_compiler():
        pytest.skip("no C++ compiler here: the fast path is not built")
    dtype = BF16 if device == "cuda" else torch.float32
    T, d, n, E, K = 20, 64, 64, 4, 2
    x, w1, w2, ids, _ = _inputs(T, d, n, E, K, dtype, device, 2 * n, torch.int32, torch.float32)
    offsets = torch.arange(0, T * K + 1, K, dtype=torch.int32, device=device)
    pw = torch.rand(T * K, device=device, requires_grad=True)
    names = []
    for use in (True, False):
        moeblaze.use_extension(use)
        out = moeblaze.experts_from_routing(x, w1, w2, offsets, ids.reshape(-1), pw)
        names.append(_node(out))
    assert "EagerExperts" in names[0] and "EagerExperts" not in names[1], names


def test_experts_from_routing_fast_path_raises_the_python_paths_errors(fast_path):
    T, d, n, E, K = 8, 16, 8, 4, 2
    x, w1, w2 = torch.randn(T, d), torch.randn(E, 2 * n, d), torch.randn(E, d, n)
    offsets = torch.arange(0, T * K + 1, K, dtype=torch.int32)
    experts = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).int().reshape(-1)
    experts[7] = E
    errors = []
    for use in (True, False):
        moeblaze.use_extension(use)
        with pytest.raises(ValueError) as info:
            moeblaze.experts_from_routing(x, w1, w2, offsets, experts, torch.rand(T * K))
        errors.append(str(info.value))
    assert errors[0] == errors[1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("which", ["b1", "b2", "both"])
def test_fast_path_with_biases_gives_the_python_paths_bits(fast_path, seed, device, which):
    """gpt-oss's expert biases through the fast path: out and every gradient (db1, db2 too)."""
    if not _has_compiler():
        pytest.skip("no C++ compiler here: the fast path is not built")
    dtype = BF16 if device == "cuda" else torch.float32
    T, d, n, E, K = 33, 64, 64, 4, 2
    x, w1, w2, ids, wts = _inputs(T, d, n, E, K, dtype, device, 2 * n, torch.int64, torch.float32)
    b1 = (torch.randn(E, 2 * n, device=device) / 4).to(dtype) if which != "b2" else None
    b2 = (torch.randn(E, d, device=device) / 4).to(dtype) if which != "b1" else None
    g = torch.randn(T, d, device=device).to(dtype)
    results = []
    for use in (True, False):
        moeblaze.use_extension(use)
        leaves = [t.clone().requires_grad_() if t is not None else None
                  for t in (x, w1, w2, wts, b1, b2)]
        out = moeblaze.moe_experts(*leaves[:3], ids, leaves[3], b1=leaves[4], b2=leaves[5])
        out.backward(g)
        results.append((_node(out), out.detach(),
                        [t.grad for t in leaves if t is not None]))
    assert "EagerExperts" in results[0][0] and "EagerExperts" not in results[1][0]
    assert torch.equal(results[0][1], results[1][1])
    for a, b in zip(results[0][2], results[1][2]):
        assert torch.equal(a, b)


# ---- MoE's router (csrc/eager_router.cpp) against layer._RouteFn / _RoundFn ----------------------
ROUTERS = ["softmax_topk", "topk_softmax", "sigmoid_bias"]


def _moe(router, renormalize, rounding, recompute, dtype, bias=False, **kw):
    """An MoE with random weights, biases and expert_bias (sigmoid_bias): every input fresh."""
    moe = moeblaze.MoE(32, 16, 8, 2, router=router, renormalize=renormalize,
                       token_rounding=rounding, m_tile=8, recompute=recompute, aux_loss_coef=0.01,
                       z_loss_coef=0.001, dtype=dtype, bias=bias, **kw)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) / 4)
        if moe.expert_bias is not None:
            moe.expert_bias.copy_(torch.randn(8) / 2)
    return moe


def _moe_step(use, moe, x, g):
    """(route node name, out, losses, last_flags, grads of x and every parameter) of one
    forward+backward of moe with the fast path on or off."""
    moeblaze.use_extension(use)
    moe._layer_step = lambda x2: None  # the split step: the one node has its own tests below
    xs = x.clone().requires_grad_()
    name = _fn_name(moe.route(xs.reshape(-1, x.shape[-1]))[3].grad_fn)
    out, losses = moe(xs)
    (out.float() * g).sum().add(losses.total).backward()
    grads = [xs.grad] + [p.grad for p in moe.parameters()]
    moe.zero_grad(set_to_none=True)
    del moe._layer_step
    return name, out.detach(), torch.stack(losses).detach(), moe.last_flags, grads


def _assert_same_step(fast, slow, rounding, moe, expert_bias, what):
    """_moe_step's results with the fast path (fast) and without (slow): the C++ route node on
    one side only, and out, losses, flags and every gradient bit for bit; expert_bias untouched."""
    node = "EagerRound" if rounding else "EagerRoute"
    assert node in fast[0] and "Eager" not in slow[0], (fast[0], slow[0])
    for name, a, b in zip(("out", "losses", "flags"), fast[1:4], slow[1:4]):
        assert a.dtype == b.dtype and torch.equal(a, b), (name, what)
    assert len(fast[4]) == len(slow[4])
    for a, b in zip(fast[4], slow[4]):
        assert a.dtype == b.dtype and torch.equal(a, b), what
    if expert_bias is not None:
        assert torch.equal(moe.expert_bias, expert_bias) and moe.expert_bias.grad is None


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("rounding", [None, "nr-f", "sr-f", "up", "down"])
def test_moe_router_fast_path_gives_the_python_paths_bits(fast_path, seed, router, renormalize,
                                                          rounding):
    """Route (and token rounding) in C++: out, the losses, the flags and every gradient (x, the
    gate, w1, w2, the biases) bit for bit; expert_bias untouched; fp32 and bf16, recompute."""
    if not _has_compiler():
        pytest.skip("no C++ compiler here: the fast path is not built")
    for dtype, recompute, bias in [(torch.float32, False, True), (torch.float32, True, False),
                                   (BF16, False, False), (BF16, True, True)]:
        moe = _moe(router, renormalize, rounding, recompute, dtype, bias)
        expert_bias = None if moe.expert_bias is None else moe.expert_bias.clone()
        x = torch.randn(3, 20, 32).to(dtype)
        g = torch.randn(3, 20, 32)
        fast, slow = _moe_step(True, moe, x, g), _moe_step(False, moe, x, g)
        _assert_same_step(fast, slow, rounding, moe, expert_bias, (dtype, recompute))


@pytest.mark.gpu
@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("rounding", [None, "nr-f", "sr-f", "up", "down"])
def test_moe_router_fast_path_on_the_gpu_gives_the_python_paths_bits(fast_path, seed, router,
                                                                     rounding):
    """The same on CUDA (the rounding's count + fill calls there), at the GPU backend's sizes
    (d, n multiples of 64, bf16, the 128-row M tile): out, losses, flags, every gradient."""
    if not _has_compiler():
        pytest.skip("no C++ compiler here: the fast path is not built")
    for renormalize, recompute, bias in [(False, False, True), (True, True, False)]:
        moe = moeblaze.MoE(64, 64, 8, 2, router=router, renormalize=renormalize,
                           token_rounding=rounding, m_tile=128, recompute=recompute,
                           aux_loss_coef=0.01, z_loss_coef=0.001, bias=bias, device="cuda",
                           dtype=BF16)
        with torch.no_grad():
            for p in moe.parameters():
                p.copy_(torch.randn_like(p) / 4)
            if moe.expert_bias is not None:
                moe.expert_bias.copy_(torch.randn(8, device="cuda") / 2)
        expert_bias = None if moe.expert_bias is None else moe.expert_bias.clone()
        x = torch.randn(3, 100, 64, device="cuda").to(BF16)
        g = torch.randn(3, 100, 64, device="cuda")
        fast, slow = _moe_step(True, moe, x, g), _moe_step(False, moe, x, g)
        _assert_same_step(fast, slow, rounding, moe, expert_bias, (renormalize, recompute))


def test_moe_router_fast_path_without_grad(fast_path, seed):
    """Under no_grad (inference) the same routing and output, no autograd node."""
    if not _has_compiler():
        pytest.skip("no C++ compiler here: the fast path is not built")
    moe = _moe("sigmoid_bias", True, "nr-f", False, torch.float32)
    x = torch.randn(40, 32)
    results = []
    for use in (True, False):
        moeblaze.use_extension(use)
        with torch.no_grad():
            routed = moe.route(x)
            out, _ = moe(x)
        assert routed[3].grad_fn is None and out.grad_fn is None
        results.append(routed + (out,))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["nan logits", "m_tile 0", "top_k above E", "seed negative",
                                  "seed bool", "expert_bias float64", "expert_bias shape",
                                  "renormalize int"])
def test_moe_router_fast_path_raises_the_python_paths_errors(fast_path, case):
    rounding = "nr-f" if case.startswith(("m_tile", "seed")) else None
    router = "sigmoid_bias" if case.startswith("expert_bias") else "softmax_topk"
    moe = _moe(router, False, rounding, False, torch.float32)
    x = torch.randn(12, 32)
    if case == "nan logits":
        x[5, 3] = float("nan")
    elif case == "m_tile 0":
        moe.m_tile = 0
    elif case == "top_k above E":
        moe.top_k = 9
    elif case == "seed negative":
        moe.rounding_seed = -1
    elif case == "seed bool":
        moe.rounding_seed = True
    elif case == "expert_bias float64":
        moe.expert_bias = moe.expert_bias.double()
    elif case == "expert_bias shape":
        moe.expert_bias = torch.zeros(7)
    else:
        moe.renormalize = 1
    errors = []
    for use in (True, False):
        moeblaze.use_extension(use)
        try:
            moe(x.clone().requires_grad_())
            errors.append(None)
        except (ValueError, TypeError, RuntimeError) as err:
            errors.append((type(err), str(err)))
    assert errors[0] == errors[1]
    assert (errors[0] is None) == (case == "renormalize int"), errors[0]


@pytest.mark.parametrize("rounding", [None, "sr-f"])
@pytest.mark.parametrize("square", [False, True])
def test_moe_router_fast_path_create_graph_as_python(fast_path, seed, rounding, square):
    """create_graph=True through the router's backward as through the Python path's
    @once_differentiable one: gradients that need a graph carry one that raises when
    differentiated; gradients of a loss linear in the weights carry none."""
    if not _has_compiler():
        pytest.skip("no C++ compiler here: the fast path is not built")
    moe = _moe("topk_softmax", False, rounding, False, torch.float32)
    x = torch.randn(30, 32)
    c = torch.randn(1)
    results = []
    for use in (True, False):
        moeblaze.use_extension(use)
        weights = moe.route(x)[3]
        loss = (weights.square() if square else weights * c).sum()
        (gw,) = torch.autograd.grad(loss, [moe.gate.weight], create_graph=True)
        try:
            gw.sum().backward()
            err = None
        except RuntimeError as e:
            err = str(e)
        results.append((gw.detach(), gw.requires_grad, err))
        moe.zero_grad(set_to_none=True)
    assert torch.equal(results[0][0], results[1][0])
    assert results[0][1:] == results[1][1:]
    assert (results[0][2] is not None and "once_differentiable" in results[0][2]) == square


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recompute", [False, True])
def test_fast_path_with_fp8_compute_gives_the_python_paths_bits(fast_path, seed, device,
                                                                 recompute):
    """compute_dtype="fp8" (bf16 storage; d and n multiples of 128 for the GPU): moe_experts and
    the MoE module through the fast path, with its kept H as e4m3 codes and scales, give the
    Python path's out and gradients bit for bit."""
    if not _has_compiler():
        pytest.skip("no C++ compiler here: the fast path is not built")
    T, d, n, E, K = 45, 128, 128, 4, 2
    x, w1, w2, ids, wts = _inputs(T, d, n, E, K, BF16, device, 2 * n, torch.int64, torch.float32)
    g = torch.randn(T, d, device=device).to(BF16)
    results = []
    for use in (True, False):
        moeblaze.use_extension(use)
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, wts)]
        out = moeblaze.moe_experts(leaves[0], leaves[1], leaves[2], ids, leaves[3],
                                   recompute=recompute, compute_dtype="fp8")
        name = _node(out)
        out.backward(g)
        results.append((name, out.detach(), [t.grad for t in leaves]))
    assert "EagerExperts" in results[0][0] and "EagerExperts" not in results[1][0]
    assert torch.equal(results[0][1], results[1][1])
    for name, a, b in zip(("dx", "dw1", "dw2", "d_weights"), results[0][2], results[1][2]):
        assert torch.equal(a, b), name
    # The module: its router, then experts_from_routing over the CSR routing.
    moe = moeblaze.MoE(d, n, E, K, recompute=recompute, compute_dtype="fp8", device=device,
                       dtype=BF16)
    xm = torch.randn(2, 20, d, device=device).to(BF16)
    mod = []
    for use in (True, False):
        moeblaze.use_extension(use)
        xs = xm.clone().requires_grad_()
        out, _ = moe(xs)
        out.float().square().mean().backward()
        mod.append((out.detach(), [xs.grad] + [p.grad.clone() for p in moe.parameters()]))
        moe.zero_grad(set_to_none=True)
    assert torch.equal(mod[0][0], mod[1][0])
    for a, b in zip(mod[0][1], mod[1][1]):
        assert torch.equal(a, b)


# ---- MoE's whole step as one node (csrc/eager_layer.cpp) against the Python path ---------------
def _made_by(out):
    """The name of the node that made out, under the views MoE.forward reshapes it with."""
    fn = out.grad_fn
    while fn is not None and _fn_name(fn).startswith(("ViewBackward", "UnsafeViewBackward")):
        fn = fn.next_functions[0][0]
    return _fn_name(fn) if fn is not None else ""


def _layer_step(use, moe, x, g, aux_scale, z_scale, out_used=True):
    """(out's node, out, losses, flags, grads of x and every parameter) of one step whose loss is
    (out * g).sum() * out_used + aux_scale * aux + z_scale * z, with the fast path on or off."""
    moeblaze.use_extension(use)
    xs = x.clone().requires_grad_()
    out, losses = moe(xs)
    name = _made_by(out)
    loss = losses.aux_loss * aux_scale + losses.z_loss * z_scale
    if out_used:
        loss = loss + (out.float() * g).sum()
    loss.backward()
    grads = [xs.grad] + [p.grad for p in moe.parameters()]
    moe.zero_grad(set_to_none=True)
    return name, out.detach(), torch.stack(losses).detach(), moe.last_flags, grads


def _close(a, b, what):
    """a and b within their dtype's rounding: the losses' two implementations (the library's
    kernels, torch's ops) round differently, and so does everything through the logits."""
    assert a.dtype == b.dtype, what
    rtol = {torch.float32: 1e-5, BF16: 2 ** -7}[a.dtype]
    scale = float(b.abs().max()) if b.numel() else 0.0
    torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{what}: {m}")


def _assert_same_layer_step(fast, slow, moe, what):
    """The node's step against the Python path's: out, the flags and the experts' weight and
    bias gradients bit for bit (the same C calls); the losses (the library's kernels against
    torch's ops) and the gradients that pass through the logits (x's, the gate's) within their
    dtype's rounding."""
    assert "EagerLayer" in fast[0] and "EagerLayer" not in slow[0], (fast[0], slow[0], what)
    for name, a, b in zip(("out", "flags"), (fast[1], fast[3]), (slow[1], slow[3])):
        assert a.dtype == b.dtype and torch.equal(a, b), (name, what)
    _close(fast[2], slow[2], ("losses", what))
    names = ["x"] + [n for n, _ in moe.named_parameters()]
    assert len(fast[4]) == len(slow[4]) == len(names)
    for name, a, b in zip(names, fast[4], slow[4]):
        assert (a is None) == (b is None), (name, what)
        if a is None:
            continue
        if name in ("x", "gate.weight"):
            _close(a, b, (name, what))
        else:
            assert a.dtype == b.dtype and torch.equal(a, b), (name, what)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("rounding", [None, "nr-f", "sr-f"])
def test_moe_layer_node_gives_the_python_paths_bits(fast_path, seed, device, router, rounding):
    """MoE.forward as one node against the Python path (_assert_same_layer_step), top-K and
    token-rounded, for upstream loss gradients other than 1, a step whose out is unused (only
    the losses' gradients flow), fp32 master weights beside bf16 x, and on the CPU E = 1024 (the
    Python path's row blocks)."""
    if not _has_compiler():
        pytest.skip("no C++ compiler here: the fast path is not built")
    d, n = 64, 64
    cases = [(8, 2, BF16, BF16, False, (0.5, 3.0, True)),
             (8, 2, BF16, torch.float32, True, (2.0, 0.0, True)),
             (8, 3, BF16, BF16, False, (1.0, 1.0, False))]
    if device == "cpu":
        cases += [(8, 2, torch.float32, torch.float32, True, (1.5, 0.25, True)),
                  (1024, 4, torch.float32, torch.float32, False, (1.0, 2.0, True))]
    for E, K, x_dtype, w_dtype, recompute, (aux_scale, z_scale, out_used) in cases:
        what = (E, K, x_dtype, w_dtype, recompute, aux_scale, z_scale, out_used)
        moe = moeblaze.MoE(d, n, E, K, router=router, recompute=recompute, aux_loss_coef=0.01,
                           z_loss_coef=0.001, bias=True, device=device, dtype=w_dtype,
                           token_rounding=rounding, m_tile=128 if device == "cuda" else 8)
        with torch.no_grad():
            for p in moe.parameters():
                p.copy_(torch.randn_like(p) / 4)
            if moe.expert_bias is not None:
                moe.expert_bias.copy_(torch.randn(E, device=device) / 2)
        x = torch.randn(3, 23, d, device=device).to(x_dtype)
        g = torch.randn(3, 23, d, device=device)
        fast = _layer_step(True, moe, x, g, aux_scale, z_scale, out_used)
        slow = _layer_step(False, moe, x, g, aux_scale, z_scale, out_used)
        _assert_same_layer_step(fast, slow, moe, what)


def test_moe_layer_node_applies_where_it_should(fast_path, seed):
    """The node runs for plain eager calls (also under no_grad, with a shared expert, with zero
    loss coefficients and with token rounding); autocast takes the Python path, which gives the
    same result there."""
    if not _has_compiler():
        pytest.skip("no C++ compiler here: the fast path is not built")
    x = torch.randn(40, 32)
    plain = moeblaze.MoE(32, 16, 8, 2)
    out, losses = plain(x.clone().requires_grad_())
    assert "EagerLayer" in _made_by(out)
    assert float(losses.aux_loss) == 0.0 and not losses.aux_loss.requires_grad
    with torch.no_grad():
        out, _ = plain(x)
    assert out.grad_fn is None
    shared = moeblaze.MoE(32, 16, 8, 2, shared_expert_size=24, aux_loss_coef=0.01)
    out, _ = shared(x.clone().requires_grad_())
    add = out.grad_fn.next_functions[0][0]  # out + the shared expert's, reshaped
    assert "EagerLayer" in _fn_name(add.next_functions[0][0])
    rounded = moeblaze.MoE(32, 16, 8, 2, token_rounding="nr-f", m_tile=8)
    out, _ = rounded(x.clone().requires_grad_())
    assert "EagerLayer" in _made_by(out)
    results = []
    for use in (True, False):
        moeblaze.use_extension(use)
        with torch.autocast("cpu", dtype=BF16):
            out, losses = shared(x.clone().requires_grad_())
        assert "EagerLayer" not in _fn_name(out.grad_fn.next_functions[0][0].next_functions[0][0])
        results.append(out.detach())
    assert torch.equal(results[0], results[1])
