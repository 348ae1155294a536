"""compute_dtype="fp8" through the PyTorch front end (CPU emulation of the FP8 recipe, docs/FP8.md):
within the e4m3 bound of the float64 reference, eager and traced paths bitwise equal, H kept as
e4m3 codes and scales (about half bf16's bytes), and clear errors where it cannot run."""
import pytest
import torch

import moeblaze
from moeblaze import ops
from moeblaze.layer import _activation_code
from moeblaze.reference import dense_reference

from helpers import DEVICES, rel_err

BF16 = torch.bfloat16
# tests/cpu/test_layer_fp8.cpp's bound: e4m3's 3 mantissa bits, two quantized GEMMs in series.
FP8_TOL = 0.1
# A pair weight's gradient is one dot product <dA', a> that may cancel, so its error relative to
# itself exceeds its operands' (max 0.095 over 150 seeds at these shapes; the C++ test measures it
# against the sum of magnitudes instead).
FP8_DW_TOL = 0.2


def _tol(name):
    return FP8_DW_TOL if name == "d_weights" else FP8_TOL


def _inputs(T=61, d=160, n=96, E=5, K=2):
    x = torch.randn(T, d).to(BF16).requires_grad_()
    w1 = (torch.randn(E, 2 * n, d) / d ** 0.5).to(BF16).requires_grad_()
    w2 = (torch.randn(E, d, n) / n ** 0.5).to(BF16).requires_grad_()
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    wts = torch.rand(T, K, requires_grad=True)
    return x, w1, w2, ids, wts


def test_fp8_kept_h_formula_of_the_fake_is_the_librarys():
    # The fake kernel sizes H by a formula (S is symbolic under dynamic shapes); it must be
    # LayerConfig::kept_h_bytes, which the real call asks the library for.
    for act in ("swiglu", "relu"):
        code = _activation_code(act)
        for n in (64, 96, 128, 200, 1024):
            rows = ops._w1_rows(code, n)
            for S in (0, 1, 3, 17, 122, 4096):
                assert ops._fp8_kept_h_bytes(S, rows) == ops._kept_h_bytes(
                    max(S, 1), 128, n, 4, code, 1, S), (act, n, S)


def test_fp8_compiles_with_dynamic_shapes(seed):
    # Two token counts through one compiled function: the second compile has a symbolic T.
    f = torch.compile(lambda *a: moeblaze.moe_experts(*a, compute_dtype="fp8"),
                      backend="aot_eager", fullgraph=True, dynamic=True)
    for T in (61, 90):
        x, w1, w2, ids, wts = _inputs(T=T)
        out = f(x, w1, w2, ids, wts)
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, [x, w1, w2, wts], g)
        ref = moeblaze.moe_experts(x, w1, w2, ids, wts, compute_dtype="fp8")
        assert torch.equal(out, ref)
        for a, r in zip(grads, torch.autograd.grad(ref, [x, w1, w2, wts], g)):
            assert torch.equal(a, r)


@pytest.mark.parametrize("recompute", [False, True])
def test_fp8_matches_float64_within_the_e4m3_bound(seed, recompute):
    x, w1, w2, ids, wts = _inputs()
    out = moeblaze.moe_experts(x, w1, w2, ids, wts, recompute=recompute, compute_dtype="fp8")
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, w1, w2, wts], g)
    ins = [t.detach().double().requires_grad_() for t in (x, w1, w2, wts)]
    ref = dense_reference(ins[0], ins[1], ins[2], ids, ins[3])
    ref_grads = torch.autograd.grad(ref, ins, g.double())
    assert rel_err(out, ref) <= FP8_TOL
    for name, a, r in zip(("dx", "dw1", "dw2", "d_weights"), grads, ref_grads):
        assert rel_err(a, r) <= _tol(name), name
    # The fp8 path, not the bf16 one: an order of magnitude further from float64.
    plain = moeblaze.moe_experts(x, w1, w2, ids, wts, recompute=recompute)
    assert rel_err(out, ref) > 3 * rel_err(plain, ref)


def test_fp8_wgrad_moves_only_the_weight_gradients_and_stays_in_the_bound(seed):
    """compute_dtype="fp8-wgrad": the fp8 recipe with dW1, dW2 on e4m3 operands too."""
    x, w1, w2, ids, wts = _inputs()
    g = torch.randn(x.shape[0], x.shape[1]).to(BF16)
    res = {}
    for c in ("fp8", "fp8-wgrad"):
        out = moeblaze.moe_experts(x, w1, w2, ids, wts, compute_dtype=c)
        res[c] = [out, *torch.autograd.grad(out, [x, w1, w2, wts], g)]
    for name, a, b in zip(("out", "dx", "d_weights"), *(
            [r[i] for i in (0, 1, 4)] for r in (res["fp8-wgrad"], res["fp8"]))):
        assert torch.equal(a, b), name
    ins = [t.detach().double().requires_grad_() for t in (x, w1, w2, wts)]
    ref = dense_reference(ins[0], ins[1], ins[2], ids, ins[3])
    ref_grads = torch.autograd.grad(ref, ins, g.double())
    for i, name in ((2, "dw1"), (3, "dw2")):
        assert rel_err(res["fp8-wgrad"][i], ref_grads[i - 1]) <= FP8_TOL, name
        # Quantized: about one e4m3 rounding per operand away from fp8's bf16 weight gradients.
        assert 0.005 < rel_err(res["fp8-wgrad"][i], res["fp8"][i].double()) < 0.1, name


def test_fp8_eager_and_traced_paths_agree_bitwise_and_keep_half_the_bytes(seed):
    x, w1, w2, ids, wts = _inputs()
    T, K = ids.shape
    out = moeblaze.moe_experts(x, w1, w2, ids, wts, compute_dtype="fp8")
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, w1, w2, wts], g)
    offsets = torch.arange(0, T * K + 1, K, dtype=torch.int32)
    pw = wts.reshape(-1)
    plan = ops.build_plan(offsets, ids.to(torch.int32).reshape(-1), pw.detach(), 5)
    ref, h = ops.experts_forward(x, w1, w2, pw, *plan[:6], _activation_code("swiglu"), False, 0,
                                 None, None, 1)
    ref_grads = torch.autograd.grad(ref, [x, w1, w2, wts], g)
    assert torch.equal(out, ref)
    for name, a, r in zip(("dx", "dw1", "dw2", "d_weights"), grads, ref_grads):
        assert torch.equal(a, r), name
    S, R = T * K, w1.shape[1]
    assert h.dtype == torch.uint8 and h.numel() == (S * R + 15) // 16 * 16 + S * 2 * 4
    assert h.numel() <= 0.55 * S * R * 2


def test_fp8_module_trains_and_errors_are_clear(seed):
    moe = moeblaze.MoE(128, 64, 4, 2, dtype=BF16, compute_dtype="fp8")
    x = torch.randn(33, 128, dtype=BF16, requires_grad=True)
    out, _ = moe(x)
    out.float().square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad.float()).all()
               for p in (moe.w1, moe.w2, moe.gate.weight))
    with pytest.raises(ValueError, match="compute_dtype 'fp4'"):
        moeblaze.MoE(128, 64, 4, 2, compute_dtype="fp4")
    fp32 = moeblaze.MoE(128, 64, 4, 2, dtype=torch.float32, compute_dtype="fp8")
    with pytest.raises(ValueError, match="compute fp8 needs bf16 storage"):
        fp32(torch.randn(8, 128))


# The GPU path against the CPU emulation of the same recipe: their GEMMs sum in other orders and
# the GPU rounds H and dA' to bf16 before the activation passes, so an e4m3 code here and there
# lands one step apart; the two stay well inside the e4m3 bound of each other.
FP8_GPU_VS_CPU_TOL = 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("compute", ["fp8", "fp8-wgrad"])
@pytest.mark.parametrize("recompute", [False, True])
def test_fp8_on_the_gpu_matches_the_cpu_emulation_and_float64(seed, recompute, compute):
    x, w1, w2, ids, wts = _inputs(T=300, d=256, n=128, E=6, K=2)
    g = torch.randn(x.shape[0], x.shape[1]).to(BF16)
    res = {}
    for dev in ("cpu", "cuda"):
        ins = [t.detach().to(dev).requires_grad_() for t in (x, w1, w2, wts)]
        out = moeblaze.moe_experts(ins[0], ins[1], ins[2], ids.to(dev), ins[3],
                                   recompute=recompute, compute_dtype=compute)
        res[dev] = [out, *torch.autograd.grad(out, ins, g.to(dev))]
    ref_ins = [t.detach().double().requires_grad_() for t in (x, w1, w2, wts)]
    ref = dense_reference(ref_ins[0], ref_ins[1], ref_ins[2], ids, ref_ins[3])
    refs = [ref, *torch.autograd.grad(ref, ref_ins, g.double())]
    for name, a, c, r in zip(("out", "dx", "dw1", "dw2", "d_weights"), res["cuda"], res["cpu"],
                             refs):
        assert rel_err(a.cpu(), c) <= FP8_GPU_VS_CPU_TOL * (2 if name == "d_weights" else 1), name
        assert rel_err(a.cpu(), r) <= _tol(name), name


@pytest.mark.gpu
def test_fp8_on_the_gpu_refuses_dims_that_are_not_multiples_of_128(seed):
    x, w1, w2, ids, wts = (t.detach().cuda() for t in _inputs(T=64, d=192, n=128, E=4, K=2))
    with pytest.raises(moeblaze.UnsupportedError, match=r"compute fp8 on the GPU: d \(192\)"):
        moeblaze.moe_experts(x, w1, w2, ids, wts, compute_dtype="fp8")


def test_fp8_with_expert_biases_tracks_the_bf16_path(seed):
    # Biases enter in fp32 around the quantized GEMMs (b1 before H is quantized, b2 into Y): the
    # fp8 results stay within the e4m3 bound of the storage path's, gradients included.
    x, w1, w2, ids, wts = _inputs()
    E, rows, d = w1.shape
    b1 = (torch.randn(E, rows) / 4).to(BF16).requires_grad_()
    b2 = (torch.randn(E, d) / 4).to(BF16).requires_grad_()
    params = [x, w1, w2, wts, b1, b2]
    g = torch.randn(x.shape[0], d)
    res = {}
    for c in ("bf16", "fp8"):
        out = moeblaze.moe_experts(x, w1, w2, ids, wts, b1=b1, b2=b2, compute_dtype=c)
        res[c] = (out, *torch.autograd.grad(out, params, g.to(out.dtype)))
    for name, a, r in zip(("out", "dx", "dw1", "dw2", "d_weights", "db1", "db2"), res["fp8"],
                          res["bf16"]):
        assert rel_err(a, r) <= _tol(name), name


def test_fp8_weight_cache_object_life_and_argument_errors(seed):
    cache = moeblaze.Fp8WeightCache()
    assert cache.bytes == 0 and cache.quantizations == 0
    cache.weights_changed()
    copy = __import__("copy").deepcopy(cache)  # a new, empty cache: never the same handle
    assert copy.handle != cache.handle
    x, w1, w2, ids, wts = _inputs()
    with pytest.raises(ValueError, match="fp8_weights is given, but compute_dtype is not 'fp8'"):
        moeblaze.moe_experts(x, w1, w2, ids, wts, fp8_weights=cache)
    with pytest.raises(ValueError, match="fp8_weights must be a moeblaze.Fp8WeightCache"):
        moeblaze.moe_experts(x, w1, w2, ids, wts, compute_dtype="fp8", fp8_weights=1234)
    with pytest.raises(ValueError, match="fp8_weight_cache=True needs compute_dtype='fp8'"):
        moeblaze.MoE(128, 64, 4, 2, dtype=BF16, fp8_weight_cache=True)
    cache.close()
    cache.close()  # a second close is a no-op
    with pytest.raises(ValueError, match="was closed"):
        cache.weights_changed()
    with pytest.raises(ValueError, match="was closed"):
        moeblaze.moe_experts(x, w1, w2, ids, wts, compute_dtype="fp8", fp8_weights=cache)
    # A handle the library did not make (or destroyed) is refused by the C ABI, not dereferenced.
    stale = moeblaze.Fp8WeightCache()
    moeblaze.ops.lib().moeblaze_fp8_weight_cache_destroy(stale.handle)
    with pytest.raises(ValueError, match="cfg.fp8_weights is not a live FP8 weight cache"):
        moeblaze.moe_experts(x, w1, w2, ids, wts, compute_dtype="fp8", fp8_weights=stale)
    stale._handle = None  # already destroyed above


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_weight_cache_gives_the_uncached_bits_in_every_path(seed, device):
    # moe_experts (eager and traced), experts_from_routing and MoE (one-node step and Python
    # path): the cache changes no bit; on CUDA it quantizes once per weight version, on the CPU
    # (which quantizes every call) never.
    shape = dict(T=61, d=160, n=96, E=5, K=2) if device == "cpu" else dict(T=300, d=256, n=128,
                                                                          E=6, K=2)
    x, w1, w2, ids, wts = (t.detach().to(device).requires_grad_(t.requires_grad)
                           for t in _inputs(**shape))
    g = torch.randn(x.shape, device=device).to(BF16)

    def step(**kw):
        out = moeblaze.moe_experts(x, w1, w2, ids, wts, compute_dtype="fp8", **kw)
        return [out, *torch.autograd.grad(out, [x, w1, w2, wts], g)]

    plain = step()
    cache = moeblaze.Fp8WeightCache()
    for _ in range(2):
        for a, b in zip(step(fp8_weights=cache), plain):
            assert torch.equal(a, b)
    assert cache.quantizations == (1 if device == "cuda" else 0)
    with moeblaze.use_extension(False):  # the Python path's C calls
        for a, b in zip(step(fp8_weights=cache), plain):
            assert torch.equal(a, b)
    compiled = torch.compile(lambda *a: moeblaze.moe_experts(
        *a, compute_dtype="fp8", fp8_weights=cache), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, w1, w2, ids, wts), plain[0])
    assert cache.quantizations == (1 if device == "cuda" else 0)
    with torch.no_grad():
        w1.mul_(0.5)  # an in-place update: the caller tells the cache
    cache.weights_changed()
    halved = step(fp8_weights=cache)
    assert torch.equal(halved[0], step()[0])
    assert cache.quantizations == (2 if device == "cuda" else 0)
    if device == "cpu":
        assert cache.bytes == 0
    else:  # W1, W2 and their transposes as one-byte codes, beside their scales
        assert cache.bytes >= 2 * (w1.numel() + w2.numel())


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_module_cache_follows_the_parameters_versions(seed, device):
    # MoE(fp8_weight_cache=True): its forward tells the cache when w1 / w2 moved (an optimizer
    # step bumps their version counters), so the cached step tracks the uncached one through
    # training; a write through .data needs fp8_weights_changed().
    d, n = (128, 64) if device == "cpu" else (256, 128)
    torch.manual_seed(seed)
    kw = dict(dtype=BF16, device=device, compute_dtype="fp8", aux_loss_coef=0.01)
    cached = moeblaze.MoE(d, n, 4, 2, fp8_weight_cache=True, **kw)
    plain = moeblaze.MoE(d, n, 4, 2, **kw)
    plain.load_state_dict(cached.state_dict())
    told = []
    real = cached.fp8_weight_cache.weights_changed
    cached.fp8_weight_cache.weights_changed = lambda: (told.append(1), real())[1]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (cached, plain)]
    x = torch.randn(40, d, dtype=BF16, device=device)
    for it in range(3):
        outs = []
        for m, opt in zip((cached, plain), opts):
            opt.zero_grad()
            out, losses = m(x)
            (out.float().square().mean() + losses.total).backward()
            opt.step()
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), it
        assert len(told) == it  # told before every forward after an optimizer step
    for path in (False, True):  # the Python path: the same bookkeeping
        with moeblaze.use_extension(path):
            with torch.no_grad():
                for m in (cached, plain):
                    m.w2.data.mul_(0.5)  # a write torch does not count
            cached.fp8_weights_changed()
            assert torch.equal(cached(x)[0], plain(x)[0])
    # Forwards after new weights: the first, two after steps, two after the .data writes (one
    # of them also after the last step: told twice, requantized once).
    assert len(told) == 5
    assert cached.fp8_weight_cache.quantizations == (5 if device == "cuda" else 0)


def test_fp8_cache_argument_of_the_custom_ops_is_checked(seed):
    x, w1, w2, ids, wts = _inputs()
    T, K = ids.shape
    offsets = torch.arange(0, T * K + 1, K, dtype=torch.int32)
    pw = wts.reshape(-1).detach()
    plan = ops.build_plan(offsets, ids.to(torch.int32).reshape(-1), pw, 5)
    act = _activation_code("swiglu")
    with pytest.raises(ValueError, match=r"fp8_cache \(an Fp8WeightCache's handle\) is given, "
                                         r"but compute is 0"):
        ops.experts_forward(x, w1, w2, pw, *plan[:6], act, False, 0, None, None, 0, 1234)
    with pytest.raises(ValueError, match=r"fp8_cache \(-1\) must be in"):
        ops.experts_forward(x, w1, w2, pw, *plan[:6], act, False, 0, None, None, 1, -1)
    with pytest.raises(ValueError, match="cfg.fp8_weights is not a live FP8 weight cache"):
        ops.experts_forward(x, w1, w2, pw, *plan[:6], act, False, 0, None, None, 1, 4096)


def test_fp8_cache_closed_before_backward_is_refused_by_name(seed):
    # A cache closed between forward and backward: the backward's C call refuses its handle by
    # name (the C++ fast path's autograd node raises it as RuntimeError, the Python path's as
    # ValueError), never a use of freed codes.
    x, w1, w2, ids, wts = _inputs()
    for path in (True, False):
        cache = moeblaze.Fp8WeightCache()
        with moeblaze.use_extension(path):
            out = moeblaze.moe_experts(x, w1, w2, ids, wts, compute_dtype="fp8", fp8_weights=cache)
        cache.close()
        with pytest.raises((ValueError, RuntimeError),
                           match="cfg.fp8_weights is not a live FP8 weight cache"):
            out.float().sum().backward()
