#!/usr/bin/env python3
"""The side-by-side MoE layer benchmark (docs/DESIGN.md's "peers" rows): moeblaze through PyTorch,
the public peers (SonicMoE, ScatterMoE) and the torch `_grouped_mm` reference, every one handed the
same bf16 inputs, weights and top-K routing, forward + backward of the expert layer; `torch-fp8` is
that reference on `torch._scaled_grouped_mm` with row-wise FP8 scales (the FP8 baseline,
bench/torch_fp8_reference.py).

Rows (JSON lines, `bench: "peers"`, the layer-row fields of docs/DESIGN.md):
  fwd_ms / bwd_ms / total_ms  CUDA events around the call, L2 flushed before each repetition,
                              median of --reps after --warmup; bwd = median(total) - median(fwd)
  peak_bytes                  torch.cuda.max_memory_allocated over one forward+backward minus what
                              was allocated before it: the output, the gradients of x, w1, w2 and
                              the router weights, and every temporary count; inputs and weights not
  kept_bytes                  storages autograd saved for backward (saved_tensors_hooks), inputs
                              and weights excluded
  max_rel_err                 largest relative Frobenius error against float64 over out and dx (a
                              token sample), d weights (same sample) and dw1, dw2 (two experts)
  model                       the public model of a grid shape (`--config grid`,
                              bench/model_shapes.py); every grid shape is timed with SwiGLU
`moeblaze` / `moeblaze-recompute` rows come from the C++ path (`moeblaze bench layer`, the same
shape; its plan is built before the timing) when --cli names the binary.
`moeblaze-torch-python` is moe_experts with its C++ fast path turned off (the Python path's
host work: the same C calls). `moeblaze-torch-fp8` / `moeblaze-torch-fp8-cached`: compute_dtype
"fp8" (docs/FP8.md), the weights quantized in every call / kept in an Fp8WeightCache (their error
column is FP8's, ~20x bf16's); `moeblaze-torch-fp8-wgrad-cached`: "fp8-wgrad", cached.
`moeblaze-torch-routed` / `moeblaze-torch-nrf` route from the logits with moeblaze's router (and
NR-f token rounding to 128-row tiles) before the experts: the top-K and rounded steps, router
included, side by side (no error column: the rounded routing is not the shared one).
`moeblaze-capi` / `moeblaze-capi-recompute` make the eager path's C calls (plan from the ids,
forward, backward with dH over H) from this process on tensors allocated once, without autograd:
with --alternate (every impl's repetitions interleaved, round by round, so that clock and
temperature drift fall on all alike) their time against moeblaze-torch's is what the PyTorch
path itself costs.

Peers are optional imports: one that is missing or fails is reported as skipped, never an error.
SonicMoE: the PyPI package `sonic-moe` (on a machine without network, install it from wheels brought
along); its first call at a new shape compiles and autotunes its GEMMs for minutes
(docs/notes/sonicmoe-and-quack.md). With QUACK_CACHE_AUTOTUNING=1 and QUACK_CACHE_DIR set, QuACK
keeps the compiled kernels and each search's timings there: carry that folder between machines to
skip the search, and read its GEMMs one by one with bench/quack_kernels.py.

  python3 bench/peers.py --config sm-7B-n256,olmoe [--impl ...] [--cli build/moeblaze]
                         [--out rows.jsonl] [--md table.md] [--profile FILE]
  python3 bench/peers.py --config grid --impl moeblaze-torch,torch,sonicmoe --cli build/moeblaze
                         # the public-model grid (bench/model_shapes.py), rows with "model"
  python3 bench/peers.py --config sm-default --memory-timeline FILE.png   # bytes live over a step
  python3 bench/peers.py --config sm-default,dsv2-d5120 --max-tokens      # largest T per impl

--max-tokens writes docs/DESIGN.md's `bench: "max-tokens"` rows: the largest T (a multiple of 1024,
found by doubling then bisecting to within 1/16) whose inputs, weights and one forward+backward fit
on the GPU. --fits-at T1,T2,... instead probes those T only (`bench: "fits"` rows with fits true or
false): a bracket for a peer whose every new T costs a search of its own (SonicMoE autotunes).
With --peer-gemms default, SonicMoE's GEMMs take QuACK's default tile config instead of its
autotuner's (what `quack.gemm(..., tuned=False)` runs): a probe then costs seconds, not a search
of minutes per T, and reads the same bytes (tiles do not change what is allocated); its rows say
`"peer_gemms": "default"`. A --memory-timeline takes it too (bytes, no timing: its curve's
label says so). Timed rows refuse it.
"""
import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_reference import (CONFIGS, EXTRA_SHAPES, driver_version, git_commit,  # noqa: E402
                             median, moe_layer, reference_rows, rel_err, saved_storage_counter)
from model_shapes import MODELS as GRID_MODELS, SHAPES as GRID_SHAPES  # noqa: E402

DEFAULT_CONFIGS = "sm-7B-n256,sm-30B-n512,sm-default,olmoe"
ALL_IMPLS = "moeblaze-torch,moeblaze-torch-recompute,sonicmoe,scattermoe,torch,torch-fp8"


class Skip(Exception):
    """A peer that cannot run here (not installed, or refuses the shape)."""


def shape_of(name):
    if name in CONFIGS:
        return CONFIGS[name]
    if name in EXTRA_SHAPES:
        return EXTRA_SHAPES[name]
    if name in GRID_SHAPES:
        return GRID_SHAPES[name]
    try:
        T, d, n, E, K = (int(v) for v in name.split(","))
    except ValueError:
        raise SystemExit(f"peers: unknown config '{name}': a named config "
                         f"({', '.join(list(CONFIGS) + list(EXTRA_SHAPES))}), 'grid' or one of "
                         f"its shapes ({', '.join(GRID_SHAPES)}), or T,d,n,E,K")
    return T, d, n, E, K


class Inputs:
    """One config's inputs, shared by every implementation: x (T, d), w1 (E, 2n, d), w2 (E, d, n)
    bf16 leaves; ids (T, K) int64 and weights (T, K) fp32 (a leaf) from softmax of N(0, 1) logits,
    top-K; dout (T, d) bf16."""

    def __init__(self, T, d, n, E, K, seed, dev):
        gen = torch.Generator(device=dev).manual_seed(seed)
        self.T, self.d, self.n, self.E, self.K = T, d, n, E, K
        bf = torch.bfloat16  # drawn in bf16: no fp32 temporaries (--max-tokens sizes to the GPU)
        self.x = torch.randn(T, d, device=dev, generator=gen, dtype=bf).requires_grad_()
        self.w1 = torch.randn(E, 2 * n, d, device=dev, generator=gen, dtype=bf).div_(math.sqrt(d))
        self.w1.requires_grad_()
        self.w2 = torch.randn(E, d, n, device=dev, generator=gen, dtype=bf).div_(math.sqrt(n))
        self.w2.requires_grad_()
        logits = torch.randn(T, E, device=dev, generator=gen)
        self.logits = logits  # (T, E) fp32: the routed impls route from it
        w, ids = torch.topk(torch.softmax(logits, dim=-1), K, dim=-1)
        self.ids = ids  # (T, K) int64
        self.weights = w.detach().requires_grad_()  # (T, K) fp32
        self.dout = torch.randn(T, d, device=dev, generator=gen, dtype=bf)
        self.leaves = [self.x, self.w1, self.w2, self.weights]

    def clear_grads(self):
        for t in self.leaves:
            t.grad = None


# ---- the implementations: each returns step(backward) -> out -------------------------------
def as_step(inp, forward):
    """step(backward) -> out: the forward, then (if asked) its backward from inp.dout."""
    def step(backward):
        out = forward()
        if backward:
            out.backward(inp.dout)
        return out
    return step


def impl_moeblaze_torch(inp, recompute, fast_path=True, fp8=None, recipe="fp8"):
    """moe_experts as users call it; fast_path=False (`moeblaze-torch-python`): with its C++ fast
    path turned off (moeblaze.use_extension(False)) for the step, the Python path's time.
    fp8 "every-call" (`moeblaze-torch-fp8`): compute_dtype="fp8", the weights quantized in every
    call; "cached" (`moeblaze-torch-fp8-cached`): with an Fp8WeightCache, which the first step
    fills and the rest reuse (the weights do not change between repetitions). recipe "fp8-wgrad"
    (`moeblaze-torch-fp8-wgrad-cached`): the weight gradients' GEMMs in FP8 too."""
    try:
        import moeblaze
    except ImportError as err:
        raise Skip(f"moeblaze is not importable ({err})")
    if not moeblaze.has_cuda():
        raise Skip("moeblaze was built without the CUDA backend")
    kw = {}
    if fp8 is not None:
        if inp.d % 128 or inp.n % 128:
            raise Skip(f"compute fp8 on the GPU needs d and n multiples of 128 (d {inp.d}, "
                       f"n {inp.n})")
        kw["compute_dtype"] = recipe
        if fp8 == "cached":
            kw["fp8_weights"] = moeblaze.Fp8WeightCache()

    def forward():
        with moeblaze.use_extension(fast_path):
            return moeblaze.moe_experts(inp.x, inp.w1, inp.w2, inp.ids, inp.weights, "swiglu",
                                        recompute=recompute, **kw)
    return as_step(inp, forward)


class CapiStep:
    """moeblaze through its C ABI from Python, without autograd: the eager path's three C calls
    (plan from the ids, layer forward, layer backward writing dH over H) on outputs, H and
    workspaces allocated once. step(backward) -> out, and the leaves' .grad are the gradients,
    as after out.backward(dout). no_autograd tells measure_memory to time the whole step."""

    no_autograd = True

    def __init__(self, inp, recompute):
        import ctypes
        from moeblaze import _lib, ops
        self.ctypes, self.lib, self.ops, self.inp = ctypes, _lib, ops, inp
        self.recompute = recompute
        self.act = _lib.ACTIVATIONS["swiglu"]
        x = inp.x.detach()
        plan, _ = ops._plan_from_ids_built(inp.ids, inp.weights.detach(), inp.E)
        fwd_mode = ops._MODE_RECOMPUTE if recompute else ops._MODE_KEEP_H
        bwd_mode = (ops._MODE_RECOMPUTE if recompute else  # dH over H where the eager path does
                    ops._MODE_DH_OVER_H if ops._writes_dh_over_h(x, False, True) else
                    ops._MODE_KEEP_H)
        self.cfg_f, ws_f, *_ = ops._experts_args(x, inp.w1.detach(), inp.w2.detach(), plan,
                                                 self.act, 0, fwd_mode, False)
        self.cfg_b, ws_b, *_ = ops._experts_args(x, inp.w1.detach(), inp.w2.detach(), plan,
                                                 self.act, 0, bwd_mode, True)
        S = plan.struct.S
        self.out = torch.empty_like(x)
        self.h = x.new_empty((0, 2 * inp.n) if recompute else (S, 2 * inp.n))
        self.ws_f = ops._workspace(ws_f, x.device)
        self.ws_b = ops._workspace(ws_b, x.device)
        self.ws_f_bytes, self.ws_b_bytes = ws_f, ws_b
        self.dx, self.dw1, self.dw2 = (torch.empty_like(t.detach())
                                       for t in (inp.x, inp.w1, inp.w2))
        self.dpw = torch.empty(S, dtype=torch.float32, device=x.device)
        self.kept_bytes = self.h.numel() * self.h.element_size()

    def __call__(self, backward):
        inp, ops, lib, byref = self.inp, self.ops, self.lib.lib(), self.ctypes.byref
        x, w1, w2 = inp.x.detach(), inp.w1.detach(), inp.w2.detach()
        plan, _ = ops._plan_from_ids_built(inp.ids, inp.weights.detach(), inp.E)
        dev, stream, ptr = self.lib.device_code(x), self.lib.stream_of(x), self.lib.ptr
        h = None if self.recompute else ptr(self.h)
        ops._run(x, lib.moeblaze_layer_forward_biased, byref(self.cfg_f), byref(plan.struct),
                 dev, stream, ptr(x), ptr(w1), ptr(w2), None, None, ptr(self.out), h,
                 ptr(self.ws_f), self.ws_f_bytes)
        if backward:
            bplan = ops.without_token_experts(plan) if x.is_cuda else plan
            ops._run(x, lib.moeblaze_layer_backward_biased, byref(self.cfg_b),
                     byref(bplan.struct), dev, stream, ptr(x), ptr(w1), ptr(w2), None, None,
                     ptr(inp.dout), h, ptr(self.dx), ptr(self.dw1), ptr(self.dw2),
                     ptr(self.dpw), None, None, ptr(self.ws_b), self.ws_b_bytes)
            inp.x.grad, inp.w1.grad, inp.w2.grad = self.dx, self.dw1, self.dw2
            inp.weights.grad = self.dpw.view(inp.weights.shape)
        return self.out


def impl_moeblaze_capi(inp, recompute):
    try:
        import moeblaze  # noqa: F401
    except ImportError as err:
        raise Skip(f"moeblaze is not importable ({err})")
    return CapiStep(inp, recompute)


def impl_moeblaze_torch_routed(inp, rounding):
    """moeblaze's router (softmax top-K of inp.logits, as Inputs draws the routing), then, with
    `rounding` ("nr-f" ...), token rounding to multiples of 128 rows per expert, then the experts
    through PyTorch: the two routings' steps side by side (what token rounding saves in a whole
    step). Their routing is their own (the rounded one differs), so no error against inp's
    routing."""
    try:
        import moeblaze
        from moeblaze import _lib, ops
    except ImportError as err:
        raise Skip(f"moeblaze is not importable ({err})")
    kind = _lib.ROUTERS["softmax_topk"]

    def forward():
        offsets, experts, weights, _ = ops.route(inp.logits, None, kind, inp.K, False)
        if rounding:
            offsets, experts, weights = ops.token_round(inp.logits, None, offsets, experts,
                                                        weights, kind, inp.K, False, 128,
                                                        _lib.ROUNDINGS[rounding], 0)
        return moeblaze.experts_from_routing(inp.x, inp.w1, inp.w2, offsets, experts, weights,
                                             "swiglu")
    step = as_step(inp, forward)
    step.own_routing = True
    return step


PEER_GEMMS = "tuned"  # --peer-gemms: how SonicMoE's QuACK GEMMs pick their tile configs


def quack_default_gemms():
    """Every autotuned QuACK GEMM (a `config` parameter) called with config=None from now on:
    QuACK's default tile config, what its `gemm(..., tuned=False)` runs, instead of a search of
    minutes at each new shape. Tiles change a GEMM's speed, not what it allocates, so a memory
    probe (--max-tokens, --fits-at) reads the same bytes without the searches."""
    import inspect
    import quack.autotuner as qa
    if getattr(qa.Autotuner, "_moeblaze_default_gemms", False):
        return
    tuned_call = qa.Autotuner.__call__
    takes_config = {}

    def call(self, *args, **kwargs):
        fn = self.fn
        if fn not in takes_config:
            takes_config[fn] = "config" in inspect.signature(fn).parameters
        if takes_config[fn] and "config" not in kwargs:
            return fn(*args, config=None, **kwargs)
        return tuned_call(self, *args, **kwargs)

    qa.Autotuner.__call__ = call
    qa.Autotuner._moeblaze_default_gemms = True


def peer_gemms_field(impl):
    """{"peer_gemms": "default"} on a SonicMoE row probed with QuACK's default tiles, else {}."""
    return {"peer_gemms": PEER_GEMMS} if impl == "sonicmoe" and PEER_GEMMS != "tuned" else {}


def impl_sonicmoe(inp):
    try:
        from sonicmoe.enums import ActivationType
        from sonicmoe.functional import moe_general_routing_inputs
        if PEER_GEMMS == "default":
            quack_default_gemms()
    except Exception as err:  # ImportError, or a CuTe-DSL / torch version mismatch
        raise Skip(f"sonicmoe is not importable ({type(err).__name__}: {err})")
    T, K, E = inp.T, inp.K, inp.E
    # Its layouts (SonicMoE's own): w1 (2n, d, E) gate rows first, w2 (d, n, E); pairs in
    # token order with their token index.
    token_indices = torch.arange(T, device=inp.x.device, dtype=torch.int32).repeat_interleave(K)
    expert_indices = inp.ids.reshape(-1).to(torch.int32)

    return as_step(inp, lambda: moe_general_routing_inputs(
        inp.x, inp.weights.reshape(-1), token_indices, expert_indices, inp.w1.permute(1, 2, 0),
        None, inp.w2.permute(1, 2, 0), None, E, torch.cuda.current_stream().cuda_stream,
        ActivationType.SWIGLU, False, concat_layout=True)[0])


def impl_scattermoe(inp):
    try:
        from scattermoe.mlp import GLUMLP  # noqa: F401
    except Exception as err:
        raise Skip(f"scattermoe is not importable ({type(err).__name__}: {err})")
    raise Skip("scattermoe's GLUMLP owns its weights in another layout; adapter not written")


def impl_torch(inp):
    return as_step(inp, lambda: moe_layer(inp.x, inp.w1, inp.w2, inp.ids, inp.weights, inp.n,
                                          inp.E, inp.K))


def impl_torch_fp8(inp):
    """The FP8 baseline: the torch layer on torch._scaled_grouped_mm, row-wise FP8 scales."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        raise Skip(f"torch {torch.__version__} has no _scaled_grouped_mm")
    if torch.cuda.get_device_capability(inp.x.device) != (9, 0):
        raise Skip("torch's row-wise FP8 grouped GEMM runs on sm_90 (Hopper) only")
    from torch_fp8_reference import fp8_layer
    return as_step(inp, lambda: fp8_layer(inp.x, inp.w1, inp.w2, inp.ids, inp.weights, inp.n,
                                          inp.E, inp.K))


IMPLS = {
    "moeblaze-torch": lambda inp: impl_moeblaze_torch(inp, False),
    "moeblaze-torch-recompute": lambda inp: impl_moeblaze_torch(inp, True),
    "moeblaze-torch-python": lambda inp: impl_moeblaze_torch(inp, False, fast_path=False),
    "moeblaze-torch-fp8": lambda inp: impl_moeblaze_torch(inp, False, fp8="every-call"),
    "moeblaze-torch-fp8-cached": lambda inp: impl_moeblaze_torch(inp, False, fp8="cached"),
    "moeblaze-torch-fp8-wgrad-cached": lambda inp: impl_moeblaze_torch(inp, False, fp8="cached",
                                                                       recipe="fp8-wgrad"),
    "moeblaze-torch-routed": lambda inp: impl_moeblaze_torch_routed(inp, None),
    "moeblaze-torch-nrf": lambda inp: impl_moeblaze_torch_routed(inp, "nr-f"),
    "moeblaze-capi": lambda inp: impl_moeblaze_capi(inp, False),
    "moeblaze-capi-recompute": lambda inp: impl_moeblaze_capi(inp, True),
    "sonicmoe": impl_sonicmoe,
    "scattermoe": impl_scattermoe,
    "torch": impl_torch,
    "torch-fp8": impl_torch_fp8,
}


# ---- measurement ---------------------------------------------------------------------------
def reference_expert_grads(inp, experts):
    """float64 dw1[e], dw2[e] of the given experts (only the tokens routed to e enter them)."""
    out = []
    n = inp.n
    for e in experts:
        tok, k = (inp.ids == e).nonzero(as_tuple=True)
        xe = inp.x.detach()[tok].double()  # (m, d)
        s = inp.weights.detach()[tok, k].double().unsqueeze(1)  # (m, 1)
        W1, W2 = inp.w1.detach()[e].double(), inp.w2.detach()[e].double()
        h = xe @ W1.t()
        g, u = h[:, :n], h[:, n:]
        sg = torch.sigmoid(g)
        a = g * sg * u
        dy = inp.dout[tok].double()  # (m, d)
        dw2 = (s * dy).t() @ a
        da = s * (dy @ W2)
        dh = torch.cat([da * u * sg * (1 + g * (1 - sg)), da * g * sg], dim=1)
        out.append((dh.t() @ xe, dw2))
    return out


def measure_error(inp, step, gen):
    if getattr(step, "own_routing", False):
        return None, "its own routing"
    inp.clear_grads()
    out = step(True)
    torch.cuda.synchronize()
    sample = torch.randperm(inp.T, device=inp.x.device, generator=gen)[: min(inp.T, 16)]
    ref_o, ref_dx = reference_rows(inp.x.detach(), inp.w1.detach(), inp.w2.detach(), inp.ids,
                                   inp.weights.detach(), inp.dout, inp.n, sample)
    errs = {"out": rel_err(out.detach()[sample], ref_o),
            "dx": rel_err(inp.x.grad[sample], ref_dx)}
    counts = torch.bincount(inp.ids.reshape(-1), minlength=inp.E)
    experts = [int(counts.argmax()), int(counts.argmin())]
    for e, (dw1, dw2) in zip(experts, reference_expert_grads(inp, experts)):
        errs[f"dw1[{e}]"] = rel_err(inp.w1.grad[e], dw1)
        errs[f"dw2[{e}]"] = rel_err(inp.w2.grad[e], dw2)
    # d weights: d s_{t,k} = <dout_t, y_{t,k}>, y from float64 on the same sample.
    dref = []
    for t in sample.tolist():
        row = []
        for k in range(inp.K):
            e = int(inp.ids[t, k])
            h = inp.w1.detach()[e].double() @ inp.x.detach()[t].double()
            g, u = h[: inp.n], h[inp.n:]
            y = inp.w2.detach()[e].double() @ (g * torch.sigmoid(g) * u)
            row.append(float(inp.dout[t].double() @ y))
        dref.append(row)
    errs["d_weights"] = rel_err(inp.weights.grad[sample],
                                torch.tensor(dref, dtype=torch.float64, device=inp.x.device))
    del out
    inp.clear_grads()
    worst = max(errs, key=errs.get)
    if any(math.isnan(v) for v in errs.values()):
        worst = next(k for k, v in errs.items() if math.isnan(v))
        return float("nan"), worst
    return errs[worst], worst


def measure_memory(inp, step):
    inp.clear_grads()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    if getattr(step, "no_autograd", False):  # its outputs were allocated before `base`
        step(True)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        inp.clear_grads()
        return step.kept_bytes, peak
    saved, pack = saved_storage_counter(inp.leaves)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step(False)
    out.backward(inp.dout)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    inp.clear_grads()
    return sum(saved.values()), peak


def time_once(inp, step, backward, i, flush):
    """(GPU ms between events, host ms to issue) of one repetition i."""
    flush.fill_(float(i & 127))  # evicts L2; not timed
    inp.clear_grads()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    out = step(backward)
    t1 = time.perf_counter()
    stop.record()
    torch.cuda.synchronize()
    del out
    return start.elapsed_time(stop), (t1 - t0) * 1e3


def time_step(inp, step, backward, warmup, reps, flush):
    """(median GPU ms between events, median host ms to issue the step): where the second nears
    the first, the step is bound by the host's issuing, not by the GPU."""
    return time_steps([(inp, step)], backward, warmup, reps, flush)[0]


def time_steps(pairs, backward, warmup, reps, flush):
    """time_step of each (inp, step), their repetitions interleaved: repetition i of every step,
    then i + 1 (--alternate: drift in clocks and temperature falls on all of them alike)."""
    times = [([], []) for _ in pairs]
    for i in range(warmup + reps):
        for (inp, step), (t, issue) in zip(pairs, times):
            ms, host = time_once(inp, step, backward, i, flush)
            if i >= warmup:
                t.append(ms)
                issue.append(host)
    for inp, _ in pairs:
        inp.clear_grads()
    return [(median(t), median(issue)) for t, issue in times]


def profile_step(name, impl, step, inp, path):
    """Where the GPU time of one step goes: torch.profiler's kernel table over 3 steps, appended
    to `path`."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            inp.clear_grads()
            out = step(True)
            del out
        torch.cuda.synchronize()
    inp.clear_grads()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    with open(path, "a") as f:
        f.write(f"== {name} {impl}: 3 forward+backward steps\n{table}\n")
    print(f"peers: {name} {impl}: profile of 3 steps appended to {path}", file=sys.stderr)


def profiled_steps(step, inp, steps, path):
    """torch.profiler over `steps` forward+backward steps, each in a record_function "step<i>" and
    synchronised apart; the Chrome trace written to `path`. Returns (its events, the steps' host
    spans (start, end) in µs, ascending)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            inp.clear_grads()
            with torch.profiler.record_function(f"step{i}"):
                out = step(True)
            del out
            torch.cuda.synchronize()  # steps apart: each step's events are its own
    inp.clear_grads()
    prof.export_chrome_trace(path)
    with open(path) as f:
        evs = json.load(f).get("traceEvents", [])
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in evs
                   if e.get("ph") == "X" and str(e.get("name", "")).startswith("step")
                   and e.get("cat") == "user_annotation")
    return evs, spans


def trace_step(name, impl, step, inp, folder):
    """Where one step's GPU sits idle: a torch.profiler trace of 3 steps (kept as a gzipped Chrome
    trace in `folder`) and, per step, the wall span from its first to its last kernel, the kernels'
    busy time, the idle time between them and the largest gaps with the kernel after each, printed
    and appended to folder/gaps.txt. Idle inside a step is GPU time the host did not feed."""
    import gzip
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"trace-{name}-{impl}.json")
    evs, steps = profiled_steps(step, inp, 3, path)
    with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
        g.write(f.read())
    os.remove(path)
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in evs
                     if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    lines = [f"== {name} {impl}: per step, µs"]
    for i, (s0, s1) in enumerate(steps):
        ks = [k for k in kernels if k[0] >= s0]
        ks = [k for k in ks if k[0] <= s1 + 100000]  # the GPU may finish after the host's span
        nxt = steps[i + 1][0] if i + 1 < len(steps) else float("inf")
        ks = [k for k in ks if k[0] < nxt]
        if not ks:
            continue
        busy, gaps, end = 0.0, [], ks[0][0]
        for k0, k1, kname in ks:
            if k0 > end:
                gaps.append((k0 - end, k0 - ks[0][0], kname))
            busy += max(0.0, k1 - max(k0, end))
            end = max(end, k1)
        span = end - ks[0][0]
        lines.append(f"step {i}: host {s1 - s0:.0f} (first kernel {ks[0][0] - s0:.0f} after the "
                     f"step began), GPU span {span:.0f}, busy {busy:.0f}, idle {span - busy:.0f} "
                     f"in {len(gaps)} gaps, {len(ks)} kernels")
        for g, at, kname in sorted(gaps, reverse=True)[:6]:
            lines.append(f"    gap {g:7.1f} at +{at:7.0f} before {kname[:90]}")
    text = "\n".join(lines) + "\n"
    print(text, file=sys.stderr)
    with open(os.path.join(folder, "gaps.txt"), "a") as f:
        f.write(text)


def cpp_rows(cli, name, shape, reps):
    """moeblaze's C++ path on the same shape (`moeblaze bench layer`), rows as it prints them."""
    # SwiGLU as the rows beside them (a grid config's own activation may differ); --check: its
    # sampled float64 error within `run --check`'s bound, else a nonzero exit reported below.
    args = [cli, "bench", "layer", "--impl", "moeblaze,moeblaze-recompute,dense-bound", "--json",
            "--no-aggregate", "--reps", str(max(reps, 20)),  # its protocol's minimum
            "--activation", "swiglu", "--check"]
    named = name in CONFIGS or name in GRID_SHAPES
    args += ["--config", name] if named else ["--shape", ",".join(map(str, shape))]
    try:
        p = subprocess.run(args, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as err:
        print(f"peers: {name}: C++ path skipped ({err})", file=sys.stderr)
        return []
    rows = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
    if p.returncode != 0 or not rows:
        print(f"peers: {name}: C++ path failed (rc {p.returncode}): {p.stderr[-800:]}",
              file=sys.stderr)
    for r in rows:
        r["config"] = name
    return rows


def emit(row, path):
    """Prints a row and appends it to `path` at once (a run cut short keeps what it measured)."""
    line = json.dumps(row)
    print(line, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def run_config(name, impls, args, dev, flush, meta):
    T, d, n, E, K = shape_of(name)
    S = T * K
    flops_fwd, flops_bwd = 6.0 * S * n * d, 12.0 * S * n * d
    rows, ready = [], []  # ready: (impl, inp, step, err, worst, kept, peak) awaiting --alternate

    model = {"model": GRID_MODELS[name]} if name in GRID_MODELS else {}  # grid rows carry it

    def skipped(impl, why):
        print(f"peers: {name} {impl}: skipped: {why}", file=sys.stderr)
        rows.append({"bench": "peers", "config": name, **model, "impl": impl, "skipped": why})
        emit(rows[-1], args.out)

    def finish(impl, err, worst, kept, peak, fwd, total, issue):
        bwd = total - fwd
        row = {"bench": "peers", "config": name, **model, "impl": impl, "T": T, "d": d, "n": n,
               "E": E, "K": K, "activation": "swiglu", "routing": "softmax-topk", "fwd_ms": fwd,
               "bwd_ms": bwd, "total_ms": total, "fwd_tflops": flops_fwd / fwd / 1e9,
               "bwd_tflops": flops_bwd / bwd / 1e9 if bwd > 0 else None,
               "total_tflops": (flops_fwd + flops_bwd) / total / 1e9, "kept_bytes": int(kept),
               "peak_bytes": int(peak), "max_rel_err": err, "max_rel_err_of": worst,
               "host_issue_ms": issue, "alternated": bool(args.alternate)}
        row.update(meta)
        rows.append(row)
        emit(row, args.out)

    for impl in impls:
        inp, step = Inputs(T, d, n, E, K, args.seed, dev), None
        gen = torch.Generator(device=dev).manual_seed(args.seed + 1)
        keep = False
        try:
            step = IMPLS[impl](inp)
            print(f"peers: {name} {impl}: first call (peers may compile or autotune) ...",
                  file=sys.stderr, flush=True)
            err, worst = measure_error(inp, step, gen)
            kept, peak = measure_memory(inp, step)
            if args.profile:
                profile_step(name, impl, step, inp, args.profile)
            if args.trace:
                try:
                    trace_step(name, impl, step, inp, args.trace)
                except Exception as why:  # a diagnostic: the row stands without it
                    print(f"peers: {name} {impl}: trace failed: {type(why).__name__}: {why}",
                          file=sys.stderr)
            if args.alternate:
                ready.append((impl, inp, step, err, worst, kept, peak))
                keep = True
                continue
            fwd, _ = time_step(inp, step, False, args.warmup, args.reps, flush)
            total, issue = time_step(inp, step, True, args.warmup, args.reps, flush)
        except Skip as why:
            skipped(impl, str(why))
            continue
        except torch.OutOfMemoryError:
            skipped(impl, "out of memory")
            continue
        except Exception as err:  # a peer that breaks at this shape is reported, not fatal
            print(f"peers: {name} {impl}: failed: {type(err).__name__}: {err}", file=sys.stderr)
            rows.append({"bench": "peers", "config": name, **model, "impl": impl,
                         "skipped": f"failed: {type(err).__name__}: {str(err)[:300]}"})
            emit(rows[-1], args.out)
            continue
        finally:
            if not keep:
                del inp, step  # the step's closure holds the inputs
                torch.cuda.empty_cache()
        finish(impl, err, worst, kept, peak, fwd, total, issue)
    if ready:
        pairs = [(inp, step) for _, inp, step, *_ in ready]
        print(f"peers: {name}: timing {', '.join(r[0] for r in ready)} alternately",
              file=sys.stderr, flush=True)
        fwds = time_steps(pairs, False, args.warmup, args.reps, flush)
        totals = time_steps(pairs, True, args.warmup, args.reps, flush)
        for (impl, _, _, err, worst, kept, peak), (fwd, _), (total, issue) in zip(ready, fwds,
                                                                                   totals):
            finish(impl, err, worst, kept, peak, fwd, total, issue)
        del pairs, ready
        torch.cuda.empty_cache()
    if args.cli:
        for r in cpp_rows(args.cli, name, (T, d, n, E, K), args.reps):
            rows.append(r)
            emit(r, args.out)
    return rows


def trace_curve(events, top=40):
    """From torch's allocator trace (`_snapshot()["device_traces"]` events, each with action, addr,
    size and optionally time_us and frames): the bytes live after each alloc / free as
    [(ms from the first event, bytes)], and the blocks live at the peak, largest first (at most
    `top`), each {"bytes", "where"}: the innermost frame outside torch, so that two
    implementations' peaks can be told apart block by block."""
    live, blocks, points, best, at_peak = 0, {}, [(0.0, 0)], 0, []
    # Event time where the trace records it (torch >= 2.1), else the event's index.
    when = [e.get("time_us", i * 1e3) for i, e in enumerate(events)]
    for e, t in zip(events, when):
        if e["action"] == "alloc":
            live += e["size"]
            blocks[e["addr"]] = e
        elif e["action"] == "free_completed":
            live -= e["size"]
            blocks.pop(e["addr"], None)
        else:
            continue
        points.append(((t - when[0]) / 1e3, live))
        if live > best:
            best, at_peak = live, list(blocks.values())
    at_peak.sort(key=lambda e: -e["size"])
    return points, [{"bytes": e["size"], "where": _where(e)} for e in at_peak[:top]]


def _where(event):
    """The innermost stack frame of an allocation that is not torch's own ("?" without frames)."""
    for f in event.get("frames") or []:
        name = f.get("filename", "")
        if "/torch/" not in name and not name.startswith("<"):
            return f"{os.path.basename(name)}:{f.get('line', '?')} {f.get('name', '')}"
    return "?"


def memory_timeline(names, impls, args, dev, path):
    """Bytes allocated over one forward+backward per implementation (torch's allocator trace), one
    panel per config, written as a PNG (matplotlib) and the sampled curves as JSON beside it."""
    curves = {}
    for name in names:
        T, d, n, E, K = shape_of(name)
        for impl in impls:
            inp, step = Inputs(T, d, n, E, K, args.seed, dev), None
            try:
                step = IMPLS[impl](inp)
                step(True)  # warm-up (and peers' compilation) outside the trace
                inp.clear_grads()
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.memory._record_memory_history(max_entries=200000)
                out = step(True)
                torch.cuda.synchronize()
                snap = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                del out
                events = [e for trace in snap["device_traces"] for e in trace]
                points, at_peak = trace_curve(events)
                tiles = " (QuACK default tiles)" if peer_gemms_field(impl) else ""
                curves[f"{name} {impl}{tiles}"] = {"base_bytes": base, "ms_bytes": points,
                                            "live_at_peak": at_peak}
                print(f"peers: {name} {impl}: timeline of {len(points)} events, peak "
                      f"{max(b for _, b in points) / 2**20:.0f} MiB above the inputs",
                      file=sys.stderr)
            except Skip as why:
                print(f"peers: {name} {impl}: timeline skipped: {why}", file=sys.stderr)
            except Exception as err:
                torch.cuda.memory._record_memory_history(enabled=None)
                print(f"peers: {name} {impl}: timeline failed: {type(err).__name__}: {err}",
                      file=sys.stderr)
            finally:
                del inp, step
                torch.cuda.empty_cache()
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump(curves, f)
    plot_timeline(curves, path)


def plot_timeline(curves, path):
    """One panel per config of {"<config> <impl>": {"ms_bytes": [(ms, bytes), ...]}} as a PNG."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as err:  # missing, or broken (seen on the device image: ft2font)
        print(f"peers: matplotlib unusable ({type(err).__name__}): the timeline is in "
              f"{os.path.splitext(path)[0]}.json only (render it with --plot-json)",
              file=sys.stderr)
        return
    names = list(dict.fromkeys(key.split(" ")[0] for key in curves))
    fig, axes = plt.subplots(1, len(names), figsize=(6.5 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        for key, c in curves.items():
            if key.startswith(name + " "):
                ms, b = zip(*c["ms_bytes"])
                ax.step(ms, [v / 2**30 for v in b], where="post", label=key[len(name) + 1:])
        ax.set_title(f"{name}: one forward + backward")
        ax.set_xlabel("host time of the allocator events (ms from the first)")
        ax.set_ylabel("GiB allocated above inputs and weights")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"peers: memory timeline -> {path}", file=sys.stderr)


def fits(name, impl, T, args, dev):
    """Whether a forward+backward at T tokens (config `name`'s d, n, E, K) runs on the GPU."""
    _, d, n, E, K = shape_of(name)
    inp = step = out = None
    try:
        inp = Inputs(T, d, n, E, K, args.seed, dev)
        step = IMPLS[impl](inp)
        out = step(True)
        torch.cuda.synchronize()
        return True
    except torch.OutOfMemoryError:
        return False
    except RuntimeError as err:  # an allocator failure surfaced through a library's own error
        if "out of memory" in str(err).lower() or "cudaErrorMemoryAllocation" in str(err):
            return False
        raise
    finally:
        del inp, step, out
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def probe(name, impl, T, args, dev):
    """fits(), printed in one line: a search cut short by a timeout still says where it was."""
    t0 = time.perf_counter()
    ok = fits(name, impl, T, args, dev)
    print(f"peers: {name} {impl}: T = {T}: {'fits' if ok else 'out of memory'} "
          f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    return ok


def max_tokens(names, impls, args, dev, meta):
    rows = []
    for name in names:
        T0, d, n, E, K = shape_of(name)
        for impl in impls:
            def probe_at(T):
                return probe(name, impl, T, args, dev)
            try:
                lo, hi = 0, max(1024, T0 // 1024 * 1024)
                while probe_at(hi):  # doubling
                    lo, hi = hi, hi * 2
                    if hi > (1 << 24):
                        break
                while hi - lo > 1024 and hi > lo * 17 // 16:  # bisection, multiples of 1024
                    mid = (lo + hi) // 2 // 1024 * 1024
                    if probe_at(mid):
                        lo = mid
                    else:
                        hi = mid
            except Skip as why:
                print(f"peers: {name} {impl}: max-tokens skipped: {why}", file=sys.stderr)
                continue
            row = {"bench": "max-tokens", "config": name, "impl": impl, "d": d, "n": n, "E": E,
                   "K": K, "max_T": lo}
            row.update(meta)
            row.update(peer_gemms_field(impl))
            rows.append(row)
            emit(row, args.out)
    return rows


def baseline_of(r, rows):
    """The row another row's time is read against, or None: moeblaze-torch (-recompute) against
    the in-process C ABI of the same mode when measured (moeblaze-capi), else the C++ path's
    rows; moeblaze-torch-nrf against moeblaze-torch-routed (top-K, router included); the FP8
    rows against moeblaze-torch (bf16), the cached one against the uncached first, fp8-wgrad's
    against fp8's (cached both)."""
    impl = r.get("impl", "")
    by = {(x["config"], x["impl"], x.get("bench")): x for x in rows if "total_ms" in x}
    if r.get("bench") != "peers":
        return None
    if impl == "moeblaze-torch-nrf":
        return by.get((r["config"], "moeblaze-torch-routed", "peers"))
    if impl in ("moeblaze-torch-fp8", "moeblaze-torch-fp8-cached",
                "moeblaze-torch-fp8-wgrad-cached"):
        first = ("moeblaze-torch-fp8-cached" if "wgrad" in impl else
                 "moeblaze-torch-fp8" if impl.endswith("-cached") else "moeblaze-torch")
        return (by.get((r["config"], first, "peers")) or
                by.get((r["config"], "moeblaze-torch", "peers")))
    if impl not in ("moeblaze-torch", "moeblaze-torch-recompute"):
        return None
    mode = "-recompute" if impl.endswith("-recompute") else ""
    return (by.get((r["config"], "moeblaze-capi" + mode, "peers")) or
            by.get((r["config"], "moeblaze" + mode, "layer")))


def markdown(rows):
    lines = ["| config | impl | fwd ms | bwd ms | total ms | host issue ms | TFLOPS | peak MiB | "
             "kept MiB | max rel err | × sonicmoe (total) | bwd × sonicmoe | of dense bound | "
             "× its baseline |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    sonic = {r["config"]: r for r in rows if r.get("impl") == "sonicmoe" and "total_ms" in r}
    dense = {r["config"]: r for r in rows if r.get("impl") == "dense-bound" and "total_ms" in r}
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['config']} | {r['impl']} | skipped: {r['skipped']} ||||||||||||")
            continue
        s = sonic.get(r["config"])
        ratio = f"{r['total_ms'] / s['total_ms']:.3f}" if s else "—"
        bratio = f"{r['bwd_ms'] / s['bwd_ms']:.3f}" if s and s["bwd_ms"] > 0 else "—"
        peak = f"{r['peak_bytes'] / 2**20:.0f}" if r.get("bench") == "peers" else "—"
        issue = f"{r['host_issue_ms']:.2f}" if "host_issue_ms" in r else "—"
        db = dense.get(r["config"])
        of_dense = f"{100 * db['total_ms'] / r['total_ms']:.0f} %" if db else "—"
        err = "—" if r.get("max_rel_err") is None else f"{r['max_rel_err']:.1e}"
        base = baseline_of(r, rows)
        vs_c = (f"{r['total_ms'] / base['total_ms']:.3f} ({base['impl']}"
                f"{' C++' if base.get('bench') == 'layer' else ''})") if base else "—"
        lines.append(
            f"| {r['config']} | {r['impl']}{' (C++)' if r.get('bench') == 'layer' else ''} | "
            f"{r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | {r['total_ms']:.3f} | {issue} | "
            f"{r['total_tflops']:.0f} | {peak} | {r['kept_bytes'] / 2**20:.1f} | "
            f"{err} | {ratio} | {bratio} | {of_dense} | {vs_c} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=DEFAULT_CONFIGS,
                    help="comma list of named configs, extra shapes, 'grid' (the public-model "
                         "grid of bench/model_shapes.py) or its names, or T,d,n,E,K (';' between "
                         "custom shapes)")
    ap.add_argument("--impl", default=ALL_IMPLS, help=f"comma list of {ALL_IMPLS}")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--alternate", action="store_true",
                    help="interleave the impls' timed repetitions (all impls' inputs held at once)")
    ap.add_argument("--cli", default="", help="the moeblaze binary: add the C++ path's rows")
    ap.add_argument("--out", default="", help="append the JSON lines here")
    ap.add_argument("--md", default="", help="write the Markdown table here")
    ap.add_argument("--profile", default="", help="append torch.profiler tables of each step here")
    ap.add_argument("--trace", default="",
                    help="folder: a profiler trace of 3 steps per impl and the GPU's idle gaps")
    ap.add_argument("--memory-timeline", default="",
                    help="plot bytes allocated over one step per impl to this PNG (no timing)")
    ap.add_argument("--plot-json", default="",
                    help="render a --memory-timeline JSON to the PNG --memory-timeline names")
    ap.add_argument("--max-tokens", action="store_true",
                    help="find the largest T whose forward+backward fits, per impl (no timing)")
    ap.add_argument("--fits-at", default="",
                    help="comma list of T: whether a forward+backward fits at each, per impl")
    ap.add_argument("--peer-gemms", choices=("tuned", "default"), default="tuned",
                    help="SonicMoE's GEMM tiles: its autotuner's pick (minutes of search at each "
                         "new shape), or QuACK's default config (memory probes only: the rows "
                         "then carry peer_gemms, and timed rows are refused)")
    args = ap.parse_args()
    try:
        fits_at = [int(t) for t in args.fits_at.split(",") if t]
    except ValueError:
        ap.error(f"--fits-at '{args.fits_at}': expected a comma list of token counts")
    global PEER_GEMMS
    PEER_GEMMS = args.peer_gemms
    if PEER_GEMMS == "default" and not (fits_at or args.max_tokens or args.memory_timeline):
        ap.error("--peer-gemms default: only with --max-tokens, --fits-at or --memory-timeline "
                 "(untuned tiles would time SonicMoE below its own speed)")
    if any(t < 1 for t in fits_at):
        ap.error("--fits-at: every T must be >= 1")
    if args.reps < 1 or args.warmup < 0:
        ap.error("--reps must be >= 1 and --warmup >= 0")
    impls = [i for i in args.impl.split(",") if i]
    for i in impls:
        if i not in IMPLS:
            ap.error(f"unknown impl '{i}'; one of {', '.join(IMPLS)}")
    names = [c for c in (args.config.split(";") if ";" in args.config else
                         args.config.split(",")) if c]
    # "grid": every shape of the public-model grid (bench/model_shapes.py), in its order.
    names = [g for c in names for g in (list(GRID_SHAPES) if c == "grid" else [c])]
    for c in names:
        shape_of(c)
    if args.plot_json:
        with open(args.plot_json) as f:
            plot_timeline(json.load(f), args.memory_timeline or
                          os.path.splitext(args.plot_json)[0] + ".png")
        return 0
    if not torch.cuda.is_available():
        print("peers: skipped: no GPU", file=sys.stderr)
        return 0
    dev = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)  # >= 2x the 60 MB L2
    meta = {"gpu": torch.cuda.get_device_name(0), "driver": driver_version(),
            "commit": git_commit(), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    if args.memory_timeline:
        memory_timeline(names, impls, args, dev, args.memory_timeline)
        return 0
    if fits_at:
        for name in names:
            _, d, n, E, K = shape_of(name)
            for impl in impls:
                for T in fits_at:
                    try:
                        ok = probe(name, impl, T, args, dev)
                    except Skip as why:
                        print(f"peers: {name} {impl}: skipped: {why}", file=sys.stderr)
                        break
                    row = {"bench": "fits", "config": name, "impl": impl, "d": d, "n": n, "E": E,
                           "K": K, "T": T, "fits": ok}
                    row.update(meta)
                    row.update(peer_gemms_field(impl))
                    emit(row, args.out)
        return 0
    if args.max_tokens:
        rows = max_tokens(names, impls, args, dev, meta)
        print("| config | impl | largest T |\n|---|---|---:|", file=sys.stderr)
        for r in rows:
            print(f"| {r['config']} | {r['impl']} | {r['max_T']} |", file=sys.stderr)
        return 0
    rows = []
    for c in names:
        rows += run_config(c, impls, args, dev, flush, meta)
    table = markdown(rows)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table)
    print(table, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
