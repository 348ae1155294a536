"""Trust on the GPU through the PyTorch front end (marker `gpu`: "skipped: no GPU" without one).

- Out of memory: with PyTorch's allocator capped (torch.cuda.set_per_process_memory_fraction), a
  step whose workspace or H does not fit raises torch's OutOfMemoryError, writes no parameter
  gradient, holds nothing afterwards (allocated bytes back to the baseline) and the next, smaller
  step gives the bits it gives uncapped.
- Streams: a step under `with torch.cuda.stream(s)` whose x comes from a deliberately slow
  producer (torch.cuda._sleep before the copy), on s itself or on another stream s waits for,
  gives the bits of the same step on the default stream.
- Concurrency: two host threads, each running steps of its own shape on its own stream, and two
  layers interleaved on one stream, give the bits of each step alone.
- Non-finite values (policy: tests/cpu/test_nonfinite.cpp's header): a NaN or inf in x, w1 or w2
  reaches the same elements of out and of every gradient as in float64 torch (swiglu, gelu,
  silu); relu maps a NaN pre-activation to 0 where torch.relu keeps NaN.
"""
import gc
import threading

import pytest
import torch

import moeblaze

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def _moe(d, n, E, K, **kw):
    return moeblaze.MoE(d, n, E, K, device="cuda", dtype=BF16, **kw)


def _step(moe, x, g):
    """out and the gradients of x and every parameter, for upstream gradient g."""
    x = x.detach().requires_grad_()
    out, _ = moe(x)
    params = [p for p in moe.parameters() if p.requires_grad]
    return [out.detach()] + list(torch.autograd.grad(out, [x] + params, g))


def _same_bits(a, b):
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


# ---- out of memory ---------------------------------------------------------------------------------


@pytest.mark.parametrize("recompute", [False, True])
def test_out_of_memory_raises_holds_nothing_and_the_next_step_works(seed, recompute):
    moe = _moe(1024, 512, 16, 4, recompute=recompute)
    big = torch.randn(16384, 1024, device="cuda", dtype=BF16)
    small = torch.randn(97, 1024, device="cuda", dtype=BF16)
    g_big, g_small = torch.randn_like(big), torch.randn_like(small)
    small_bits = _step(moe, small, g_small)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory
    # Room for about 64 MiB above what the allocator holds now: the big step needs far more (H
    # alone is 16384 * 4 * 1024 * 2 bytes = 128 MiB).
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (64 << 20)) / total)
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError, match="out of memory") as info:
            _step(moe, big, g_big)
        assert all(p.grad is None for p in moe.parameters()), "a gradient was written"
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    del info  # its traceback's frames hold the failed step's tensors
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == baseline, "the failed step left tensors behind"
    assert _same_bits(_step(moe, small, g_small), small_bits)


def test_out_of_memory_in_backward_writes_no_gradient(seed):
    """Forward fits; backward's workspace does not: no gradient, nothing held after the graph
    is dropped, and a fresh step afterwards gives the uncapped step's bits."""
    moe = _moe(1024, 512, 16, 4)
    x = torch.randn(16384, 1024, device="cuda", dtype=BF16)
    g = torch.randn_like(x)
    # One full step first: the module keeps the last step's expert ids (last_expert_counts), so
    # the baseline is what any finished step leaves behind.
    _step(moe, x, g)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    xs = x.clone().requires_grad_()
    out, losses = moe(xs)  # losses hold the router's graph (and xs) as out does
    torch.cuda.synchronize()
    # Forward's freed blocks out of the cache first: left there, they give backward room under
    # the cap.
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (16 << 20)) / total)
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError, match="out of memory") as info:
            out.backward(g)
        assert xs.grad is None and all(p.grad is None for p in moe.parameters())
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    del info, out, losses, xs
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == baseline, "the failed backward left tensors behind"
    assert _same_bits(_step(moe, x, g), _step(moe, x, g))


# ---- streams ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("producer_stream", ["same", "other"])
@pytest.mark.parametrize("recompute", [False, True])
def test_step_on_a_side_stream_waits_for_a_slow_producer(seed, producer_stream, recompute):
    moe = _moe(256, 128, 16, 4, recompute=recompute)
    x_src = torch.randn(2048, 256, device="cuda", dtype=BF16)
    g = torch.randn_like(x_src)
    eager = _step(moe, x_src, g)
    x = torch.zeros_like(x_src)  # a step that races the producer reads zeros
    s = torch.cuda.Stream()
    producer = s if producer_stream == "same" else torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    producer.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(producer):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles before x is written
        x.copy_(x_src)
    if producer is not s:
        s.wait_stream(producer)
    with torch.cuda.stream(s):
        got = _step(moe, x, g)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert _same_bits(got, eager)


def test_functional_step_captured_on_a_side_stream_replays_the_eager_bits(seed):
    T, d, n, E, K = 512, 256, 128, 8, 2
    x = torch.randn(T, d, device="cuda", dtype=BF16)
    w1 = (torch.randn(E, 2 * n, d, device="cuda") / d ** 0.5).to(BF16)
    w2 = (torch.randn(E, d, n, device="cuda") / n ** 0.5).to(BF16)
    ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)])
    wts = torch.rand(T, K, device="cuda")
    g = torch.randn(T, d, device="cuda", dtype=BF16)

    def step():
        # Fresh leaves each step: a leaf's gradient node keeps the stream it was made on, and one
        # made by the eager step on the default stream and still alive makes the captured
        # backward wait on the legacy stream (cudaErrorStreamCaptureImplicit; torch's RNG is then
        # left mid-capture for every later test). Inside the capture the copies are captured too.
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, wts)]
        out = moeblaze.moe_experts(leaves[0], leaves[1], leaves[2], ids, leaves[3])
        return (out,) + torch.autograd.grad(out, leaves, g)

    eager = [t.detach().clone() for t in step()]  # no autograd graph kept alive
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up on the side stream, as graph capture wants
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    assert _same_bits(list(static), eager)


# ---- concurrency -----------------------------------------------------------------------------------


def test_two_threads_on_their_own_streams_give_the_bits_of_each_step_alone(seed):
    cases = [(_moe(512, 256, 32, 4), torch.randn(3001, 512, device="cuda", dtype=BF16)),
             (_moe(256, 512, 8, 2, recompute=True, activation="gelu"),
              torch.randn(777, 256, device="cuda", dtype=BF16))]
    grads = [torch.randn_like(x) for _, x in cases]
    alone = [_step(m, x, g) for (m, x), g in zip(cases, grads)]
    torch.cuda.synchronize()
    results, errors = [[], []], []

    def worker(i):
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.default_stream())
            with torch.cuda.stream(stream):
                for _ in range(4):
                    results[i].append(_step(cases[i][0], cases[i][1], grads[i]))
            stream.synchronize()
        except Exception as e:  # reported below, in the test's thread
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(2):
        assert len(results[i]) == 4
        assert all(_same_bits(r, alone[i]) for r in results[i]), f"thread {i}"


def test_two_layers_interleaved_on_one_stream_give_the_bits_of_each_alone(seed):
    a, b = _moe(256, 256, 16, 2), _moe(384, 128, 64, 8, activation="relu", recompute=True)
    xa = torch.randn(2049, 256, device="cuda", dtype=BF16)
    xb = torch.randn(513, 384, device="cuda", dtype=BF16)
    ga, gb = torch.randn_like(xa), torch.randn_like(xb)
    alone_a, alone_b = _step(a, xa, ga), _step(b, xb, gb)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        xa_, xb_ = xa.clone().requires_grad_(), xb.clone().requires_grad_()
        out_a, _ = a(xa_)
        out_b, _ = b(xb_)
        pa = [p for p in a.parameters() if p.requires_grad]
        pb = [p for p in b.parameters() if p.requires_grad]
        grads_a = torch.autograd.grad(out_a, [xa_] + pa, ga)
        grads_b = torch.autograd.grad(out_b, [xb_] + pb, gb)
    torch.cuda.synchronize()
    assert _same_bits([out_a.detach()] + list(grads_a), alone_a)
    assert _same_bits([out_b.detach()] + list(grads_b), alone_b)


# ---- non-finite values -----------------------------------------------------------------------------


def _functional_inputs(T, d, n, E, K, gated):
    x = torch.randn(T, d, device="cuda").to(BF16)
    w1 = (torch.randn(E, (2 if gated else 1) * n, d, device="cuda") / d ** 0.5).to(BF16)
    w2 = (torch.randn(E, d, n, device="cuda") / n ** 0.5).to(BF16)
    ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)])
    wts = torch.rand(T, K, device="cuda")
    return x, w1, w2, ids, wts


def _with_grads(fn, tensors, g):
    ins = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*ins)
    return [out] + list(torch.autograd.grad(out, ins, g))


@pytest.mark.parametrize("activation", ["swiglu", "gelu", "silu"])
@pytest.mark.parametrize("where", ["x", "w1", "w2"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_inputs_reach_the_elements_float64_torch_gives(seed, activation, where, value):
    T, d, n, E, K = 200, 128, 128, 8, 2
    gated = activation in ("swiglu", "geglu")
    x, w1, w2, ids, wts = _functional_inputs(T, d, n, E, K, gated)
    target = {"x": x, "w1": w1, "w2": w2}[where].view(-1)
    target[torch.randint(target.numel(), ()).item()] = value
    g = torch.randn(T, d, device="cuda").to(BF16)

    def ours(x_, w1_, w2_, wts_):
        return moeblaze.moe_experts(x_, w1_, w2_, ids, wts_, activation=activation)

    def torch64(x_, w1_, w2_, wts_):
        return moeblaze.dense_reference(x_.double(), w1_.double(), w2_.double(), ids,
                                        wts_.double(), activation=activation)

    got = _with_grads(ours, [x, w1, w2, wts], g)
    ref = _with_grads(torch64, [x, w1, w2, wts], g.double())
    for name, a, r in zip(("out", "dx", "dw1", "dw2", "d_weights"), got, ref):
        assert torch.equal(torch.isfinite(a), torch.isfinite(r)), (
            name, int((~torch.isfinite(a)).sum()), int((~torch.isfinite(r)).sum()))


def test_relu_maps_a_nan_pre_activation_to_zero_unlike_torch(seed):
    T, d, n, E, K = 64, 128, 128, 4, 2
    x, w1, w2, ids, wts = _functional_inputs(T, d, n, E, K, gated=False)
    x[5, 7] = float("nan")
    out = moeblaze.moe_experts(x, w1, w2, ids, wts, activation="relu")
    ref = moeblaze.dense_reference(x.double(), w1.double(), w2.double(), ids, wts.double(),
                                   activation="relu")
    assert torch.isnan(ref[5]).all()  # torch.relu(NaN) is NaN
    assert torch.equal(out[5], torch.zeros_like(out[5]))  # moeblaze: x > 0 ? x : 0
    rows = torch.arange(T, device="cuda") != 5
    assert torch.isfinite(out[rows]).all()
