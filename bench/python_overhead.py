"""Host time per call of moeblaze's Python boundary, on the CPU at a tiny shape,
or on the GPU (--device cuda, bf16) at a layer's d, n, E, K with few tokens, so that the GPU keeps
up and the time is the host's: there "real" minus "stubbed" is the library's own host time.

Each entry is the median (and the minimum, steadier on a loaded machine) over --repeat batches
of the mean time per call in a batch of --inner calls, in microseconds. Two columns: "stubbed",
with every C call replaced by a function that returns 0 (the *_bytes queries stay real, so the
sizes are right; route's stub writes a valid top-K routing so that what runs after it sees one;
on the GPU route stays real), i.e. the Python / torch-dispatch time alone; and "real", with the
library. The "eager" rows are the bodies moe_experts / MoE call in eager mode (layer._ExpertsFn,
_RouteFn, ops.plan_from_ids); "via custom ops" is moe_experts as traced code runs it. The plain
moe_experts and MoE rows take the C++ fast path (experts and router) where that is built
(moeblaze.extension_status(), printed first), whose C calls stay real in the stubbed column too;
the "Python path" rows turn it off (moeblaze.use_extension(False)); "nr-f + losses" is an MoE
with token rounding and both router losses, its loss (out * d_out).sum() + losses.total.
Reference rows: torch's topk+softmax, the raw ctypes call of moeblaze_route, and no-op
torch.library custom ops with route's and the experts ops' schemas (the floor a custom op costs
before its body runs). --only NAME keeps the rows whose name contains NAME.

    PYTHONPATH=python MOEBLAZE_LIB=build-cpu/libmoeblaze_capi.so python bench/python_overhead.py
    python bench/python_overhead.py --device cuda --shape 256,1536,256,128,8   # on a GPU
"""
import argparse
import ctypes
import gc
import statistics
import time
from typing import Optional, Tuple

import torch
from torch import Tensor

import moeblaze
from moeblaze import _ext, _lib, ops

T, D, N, E, K = 8, 16, 8, 4, 2  # --shape replaces them
DEV, DTYPE = torch.device("cpu"), torch.float32  # --device cuda: bf16 on the GPU


class _Stub:
    """The library with its C calls replaced: all return 0, the *_bytes queries stay real."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        if name.endswith("_bytes"):
            return getattr(self._real, name)
        if name == "moeblaze_route":  # on the GPU it stays real: its ids must be valid there
            return _stub_route if DEV.type == "cpu" else self._real.moeblaze_route
        return lambda *a: 0


def _stub_route(cfg, logits, dtype, T_, E_, bias, dev, stream, out, flags):
    """A valid top-K routing (token t: experts 0..K-1, weight 0) for the torch ops and the fast
    path's real plan build after it."""
    r = out._obj  # the Routing struct passed by reference
    k = r.P // max(r.T, 1)
    (ctypes.c_int32 * (r.T + 1)).from_address(r.pair_offsets)[:] = range(0, r.P + 1, k or 1)
    if r.P:
        (ctypes.c_int32 * r.P).from_address(r.pair_experts)[:] = [p % k for p in range(r.P)]
        ctypes.memset(r.pair_weights, 0, 4 * r.P)
    return 0


# ---- no-op custom ops with the real ops' schemas: the dispatch floor -------------------------
@torch.library.custom_op("moeblaze_bench::route_noop", mutates_args=())
def route_noop(logits: Tensor, bias: Optional[Tensor], kind: int, top_k: int,
               renormalize: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    t, p = logits.shape[0], logits.shape[0] * top_k
    return (torch.empty(t + 1, dtype=torch.int32), torch.empty(p, dtype=torch.int32),
            torch.empty(p), torch.zeros(4, dtype=torch.int32))


@torch.library.custom_op("moeblaze_bench::experts_forward_noop", mutates_args=())
def experts_forward_noop(x: Tensor, w1: Tensor, w2: Tensor, pair_weights: Tensor,
                         expert_token_offsets: Tensor, expert_token_indices: Tensor,
                         slot_weights: Tensor, token_pair_offsets: Tensor,
                         token_expert_indices: Tensor, token_index_map: Tensor, activation: int,
                         recompute: bool, num_threads: int) -> Tuple[Tensor, Tensor]:
    return torch.empty_like(x), x.new_empty((0, w1.shape[1]))


@torch.library.custom_op("moeblaze_bench::experts_backward_noop", mutates_args=())
def experts_backward_noop(d_out: Tensor, x: Tensor, w1: Tensor, w2: Tensor, h: Tensor,
                          expert_token_offsets: Tensor, expert_token_indices: Tensor,
                          slot_weights: Tensor, token_pair_offsets: Tensor,
                          token_expert_indices: Tensor, token_index_map: Tensor, activation: int,
                          recompute: bool,
                          num_threads: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    return (torch.empty_like(x), torch.empty_like(w1), torch.empty_like(w2),
            torch.empty(expert_token_indices.shape[0], device=x.device))


def _noop_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3], output[1], *inputs[4:10])
    ctx.cfg = inputs[10:13]


def _noop_backward(ctx, g_out, g_h):
    x, w1, w2, h, *plan = ctx.saved_tensors
    return experts_backward_noop(g_out, x, w1, w2, h, *plan, *ctx.cfg)[:4] + (None,) * 9


experts_forward_noop.register_autograd(_noop_backward, setup_context=_noop_setup)


def timeit(fn, inner, repeat):
    """(median, min) over `repeat` batches of the mean µs per call of `inner` calls."""
    for _ in range(max(inner, 20)):
        fn()
    gc.collect()
    times = []
    for _ in range(repeat):
        if DEV.type == "cuda":
            torch.cuda.synchronize()  # each batch starts with an idle GPU; not timed
        t0 = time.perf_counter_ns()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter_ns() - t0) / inner / 1e3)
    return statistics.median(times), min(times)


def cases():
    """(name, fn) pairs; each fn is one call (or one forward+backward step)."""
    torch.manual_seed(0)
    logits = torch.randn(T, E, device=DEV)
    x = torch.randn(T, D, device=DEV, dtype=DTYPE)
    w1 = torch.randn(E, 2 * N, D, device=DEV, dtype=DTYPE) * D ** -0.5
    w2 = torch.randn(E, D, N, device=DEV, dtype=DTYPE) * N ** -0.5
    off, exp, pw, _ = ops.route(logits, None, 0, K, False)
    plan = ops.build_plan(off, exp, pw, E)[:6]
    out, h = ops.experts_forward(x, w1, w2, pw, *plan, 0, False, 0)
    d_out = torch.randn_like(out)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).to(DEV)
    ew = torch.rand(T, K, device=DEV)
    xg, w1g, w2g, ewg = (t.clone().requires_grad_() for t in (x, w1, w2, ew))
    moe = moeblaze.MoE(D, N, E, K, dtype=DTYPE).to(DEV)
    # Token rounding to multiples of 4 rows (128 on the GPU) and both router losses.
    moe_round = moeblaze.MoE(D, N, E, K, token_rounding="nr-f", m_tile=4 if DEV.type == "cpu"
                             else 128, aux_loss_coef=0.01, z_loss_coef=0.001, dtype=DTYPE).to(DEV)
    # The tiny LM's MoE: top-K and the switch loss (its step is one node, csrc/eager_layer.cpp).
    moe_aux = moeblaze.MoE(D, N, E, K, aux_loss_coef=0.01, dtype=DTYPE).to(DEV)
    params = (list(moe.parameters()) + list(moe_round.parameters()) +
              list(moe_aux.parameters()))
    pwg = pw.clone().requires_grad_()

    def moe_experts_step():
        y = moeblaze.moe_experts(xg, w1g, w2g, ids, ewg)
        y.backward(d_out)
        xg.grad = w1g.grad = w2g.grad = ewg.grad = None

    def moe_step():
        y, _ = moe(xg)
        y.backward(d_out)
        xg.grad = None
        for p in params:
            p.grad = None

    def loss_step(module):  # a step whose loss adds the router losses
        def call():
            y, losses = module(xg)
            (y * d_out).sum().add(losses.total).backward()
            xg.grad = None
            for p in params:
                p.grad = None
        return call

    moe_round_step, moe_aux_step = loss_step(moe_round), loss_step(moe_aux)

    def split_step(fn):  # MoE.forward's step as separate pieces (route node, experts node, ...)
        def call():
            moe_aux._layer_step = lambda x2: None
            try:
                return fn()
            finally:
                del moe_aux._layer_step
        return call

    def noop_step():  # the floor of moe_experts' three custom ops (plan, forward, backward)
        p = ops.build_plan(off, exp, pw, E)
        y, _ = experts_forward_noop(xg, w1g, w2g, pwg, *p[:6], 0, False, 0)
        y.backward(d_out)
        xg.grad = w1g.grad = w2g.grad = pwg.grad = None

    offsets_k = torch.arange(0, T * K + 1, K, dtype=torch.int32, device=DEV)

    def python_path(fn):  # with the C++ fast path off
        def call():
            with moeblaze.use_extension(False):
                return fn()
        return call

    def ops_step():  # moe_experts as traced code runs it: conversions and the custom ops
        w = ewg.to(torch.float32).reshape(-1)
        p = ops.build_plan(offsets_k, ids.to(torch.int32).reshape(-1), w.detach(), E)
        y, _ = ops.experts_forward(xg, w1g, w2g, w, *p[:6], 0, False, 0)
        y.backward(d_out)
        xg.grad = w1g.grad = w2g.grad = ewg.grad = None

    return [
        ("ops.route", lambda: ops.route(logits, None, 0, K, False)),
        ("eager route (_route_impl)", lambda: ops._route_impl(logits, None, 0, K, False)),
        ("eager plan_from_ids", lambda: ops.plan_from_ids(ids, ew, E)),
        ("eager experts forward",
         lambda: ops._experts_forward_impl(x, w1, w2, plan, 0, False, 0)),
        ("eager experts backward", lambda: ops._experts_backward_impl(
            d_out, x, w1, w2, h, plan, 0, False, 0, False, None, None)),
        ("ops.build_plan", lambda: ops.build_plan(off, exp, pw, E)),
        ("ops.experts_forward", lambda: ops.experts_forward(x, w1, w2, pw, *plan, 0, False, 0)),
        ("ops.experts_backward",
         lambda: ops.experts_backward(d_out, x, w1, w2, h, *plan, 0, False, 0)),
        ("eager plan_from_ids + experts forward",
         lambda: ops._experts_forward_impl(x, w1, w2, ops._plan_from_ids_built(ids, ew, E)[0],
                                           0, False, 0)),
        ("moe_experts forward", lambda: moeblaze.moe_experts(xg, w1g, w2g, ids, ewg)),
        ("moe_experts fwd+bwd", moe_experts_step),
        ("moe_experts forward, Python path", python_path(
            lambda: moeblaze.moe_experts(xg, w1g, w2g, ids, ewg))),
        ("moe_experts fwd+bwd, Python path", python_path(moe_experts_step)),
        ("moe_experts fwd+bwd via custom ops", ops_step),
        ("MoE fwd+bwd", moe_step),
        ("MoE fwd+bwd, Python path", python_path(moe_step)),
        ("MoE fwd+bwd, aux loss", moe_aux_step),
        ("MoE fwd+bwd, aux loss, split step", split_step(moe_aux_step)),
        ("MoE fwd+bwd, aux loss, Python path", python_path(moe_aux_step)),
        ("MoE fwd+bwd, nr-f + losses", moe_round_step),
        ("MoE fwd+bwd, nr-f + losses, Python path", python_path(moe_round_step)),
    ], [
        ("torch topk+softmax", lambda: torch.softmax(torch.topk(logits, K).values, -1)),
        ("torch x @ w1[0].T", lambda: x @ w1[0].T),
        ("no-op custom op, route's schema", lambda: route_noop(logits, None, 0, K, False)),
        ("no-op custom op, experts_forward's",
         lambda: experts_forward_noop(x, w1, w2, pw, *plan, 0, False, 0)),
        ("no-op custom op, experts_backward's",
         lambda: experts_backward_noop(d_out, x, w1, w2, h, *plan, 0, False, 0)),
        ("build_plan + no-op experts fwd+bwd", noop_step),
        ("raw ctypes moeblaze_route", _raw_route(logits)),
    ]


def _raw_route(logits):
    """One ctypes call of moeblaze_route with every argument built beforehand."""
    lib = _lib.lib()
    cfg = _lib.RouterCfg(0, K, 0)
    kw = {"device": DEV}
    bufs = (torch.empty(T + 1, dtype=torch.int32, **kw), torch.empty(T * K, dtype=torch.int32, **kw),
            torch.empty(T * K, **kw), torch.zeros(4, dtype=torch.int32, **kw))
    dev = _lib.device_code(logits)  # the C ABI's device code (0 cpu, 1 cuda), not an index
    stream = torch.cuda.current_stream().cuda_stream if DEV.type == "cuda" else None
    r = _lib.Routing(T, E, T * K, *(b.data_ptr() for b in bufs[:3]))
    args = (ctypes.byref(cfg), logits.data_ptr(), 0, T, E, None, dev, stream, ctypes.byref(r),
            bufs[3].data_ptr())
    fn = lib.moeblaze_route

    def call():
        fn(*args)
    call.bufs = bufs
    return call


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inner", type=int, default=100, help="calls per timed batch")
    ap.add_argument("--repeat", type=int, default=61, help="timed batches (median taken)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--device", default="cpu", help="cpu (fp32) or cuda (bf16)")
    ap.add_argument("--shape", default="", help="T,d,n,E,K (default 8,16,8,4,2)")
    ap.add_argument("--only", default="", help="only the rows whose name contains this")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    global T, D, N, E, K, DEV, DTYPE
    if args.shape:
        T, D, N, E, K = (int(v) for v in args.shape.split(","))
    DEV = torch.device(args.device)
    if DEV.type == "cuda":
        DTYPE = torch.bfloat16
    real_lib = ops.lib
    stub = _Stub(_lib.lib())
    ops_cases, ref_cases = cases()
    print(f"moeblaze Python boundary, {DEV.type}, T={T} d={D} n={N} E={E} K={K} {DTYPE}, torch "
          f"{torch.__version__}, {args.threads} thread(s); µs per call, median of "
          f"{args.repeat} x {args.inner}")
    _ext.get()  # builds the fast path now (once), not inside a timed batch
    print(f"moe_experts' C++ fast path: {moeblaze.extension_status()}")
    print(f"{'call (median / min)':40s} {'stubbed':>13s} {'real':>13s}")
    ops_cases = [c for c in ops_cases if args.only in c[0]]
    ref_cases = [c for c in ref_cases if args.only in c[0]]
    for name, fn in ops_cases:
        ops.lib = lambda: stub
        try:
            s = timeit(fn, args.inner, args.repeat)
        finally:
            ops.lib = real_lib
        r = timeit(fn, args.inner, args.repeat)
        print(f"{name:40s} {s[0]:6.1f} /{s[1]:5.1f} {r[0]:6.1f} /{r[1]:5.1f}")
    for name, fn in ref_cases:
        r = timeit(fn, args.inner, args.repeat)
        print(f"{name:40s} {'':13s} {r[0]:6.1f} /{r[1]:5.1f}")


if __name__ == "__main__":
    main()
