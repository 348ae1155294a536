"""moeblaze.MoE (nn.Module), its pure-PyTorch twin TorchMoE, and the functional forms.

Weights follow docs/DESIGN.md's stacked nn.Linear layout (out x in):
  gate.weight (E, d)            the router: logits = x @ gate.weight^T, computed in float32
  w1          (E, 2n, d)        gated activations: rows [0, n) gate, [n, 2n) up; (E, n, d) else
  w2          (E, d, n)
  b1, b2      (E, 2n or n), (E, d)  optional expert biases (MoE(bias=True); gpt-oss)
forward(x) returns (out, RouterLosses(aux_loss, z_loss)); add losses.total to the training loss.
"""
from typing import NamedTuple

import contextlib
import ctypes
import math
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _ext, _lib, ops
from .reference import torch_experts, torch_router


class RouterLosses(NamedTuple):
    aux_loss: Tensor  # switch load balancing: coef * E * sum_e f_e * P_e (0 if coef is 0)
    z_loss: Tensor    # coef * mean_t logsumexp(logits_t)^2 (0 if coef is 0)

    @property
    def total(self):
        return self.aux_loss + self.z_loss


class Fp8WeightCache:
    """W1 and W2's e4m3 codes kept between calls with compute_dtype="fp8" (docs/FP8.md; the C
    ABI's moeblaze_fp8_weight_cache_*). On CUDA the first call given the cache quantizes the
    weights into it (a host sync, once per shape; not inside a CUDA graph capture), and later
    calls reuse the codes until weights_changed(), which the caller calls after every in-place
    update of the weights (an optimizer step, a checkpoint load): the library cannot see one.
    Calls with other weight tensors (pointers or shapes) requantize by themselves. Holds about
    the bf16 weights' bytes of device memory, freed by close() or when collected: keep it alive
    until the backward of every call given it has run (a dead cache there is refused by name)
    and while a CUDA graph captured with it may replay. The CPU backend quantizes in every call
    and leaves it empty. A copy (copy, deepcopy, pickle) is a new, empty
    cache. MoE(compute_dtype="fp8", fp8_weight_cache=True) keeps one and tells it itself."""

    def __init__(self):
        handle = ctypes.c_void_p()
        _lib.check(_lib.lib().moeblaze_fp8_weight_cache_create(ctypes.byref(handle)))
        self._handle = handle.value

    @property
    def handle(self):
        """The C ABI handle (an int), checked alive by every call that takes it."""
        if not self._handle:
            raise ValueError("moeblaze: this Fp8WeightCache was closed")
        return self._handle

    def weights_changed(self):
        """The weights were updated in place: the next call requantizes them."""
        _lib.check(_lib.lib().moeblaze_fp8_weight_cache_weights_changed(self.handle))

    def _stats(self):
        nbytes, count = ctypes.c_uint64(), ctypes.c_int64()
        _lib.check(_lib.lib().moeblaze_fp8_weight_cache_stats(self.handle, ctypes.byref(nbytes),
                                                              ctypes.byref(count)))
        return nbytes.value, count.value

    @property
    def bytes(self):
        """Device bytes the codes hold."""
        return self._stats()[0]

    @property
    def quantizations(self):
        """How many calls (re)quantized the weights into the cache."""
        return self._stats()[1]

    def close(self):
        """Frees the codes (after the device's queued work); the cache is unusable after."""
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            _lib.check(_lib.lib().moeblaze_fp8_weight_cache_destroy(handle))

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter exit: the library may be gone before the object
            pass

    def __reduce__(self):
        return (Fp8WeightCache, ())

    def __repr__(self):
        return f"Fp8WeightCache({'closed' if not self._handle else hex(self._handle)})"


def _fp8_handle(fp8_weights, compute):
    """The C ABI handle of an fp8_weights argument (0: none), checked against compute."""
    if fp8_weights is None:
        return 0
    if not isinstance(fp8_weights, Fp8WeightCache):
        raise ValueError(f"moeblaze: fp8_weights must be a moeblaze.Fp8WeightCache or None, got "
                         f"{type(fp8_weights).__name__}")
    if compute == _lib.COMPUTES["storage"]:
        raise ValueError("moeblaze: fp8_weights is given, but compute_dtype is not 'fp8' or "
                         "'fp8-wgrad': the cache holds FP8 weight codes")
    return fp8_weights.handle


def _activation_code(activation):
    if activation not in _lib.ACTIVATIONS:
        raise ValueError(f"moeblaze: activation {activation!r} is not one of "
                         f"{', '.join(_lib.ACTIVATIONS)}")
    return _lib.ACTIVATIONS[activation]


def _router_code(router):
    r = router.replace("-", "_")
    if r not in _lib.ROUTERS:
        raise ValueError(f"moeblaze: router {router!r} is not one of softmax_topk, topk_softmax, "
                         "sigmoid_bias")
    return _lib.ROUTERS[r]


# ATen runs an op on fewer elements than its GRAIN_SIZE (32768) on one thread: losses computed in
# row blocks below it round the same way, forward and backward, whatever the thread count.
_SERIAL_NUMEL = 32768


def expert_counts(pair_experts, num_experts):
    """Pairs routed to each expert, (num_experts,) int64 on pair_experts' device (scatter_add, not
    bincount: no host sync)."""
    e = pair_experts.reshape(-1).long()
    return torch.zeros(num_experts, dtype=torch.int64, device=e.device).scatter_add_(
        0, e, torch.ones_like(e))


_NO_CONTEXT = contextlib.nullcontext()


def router_logits(x2, gate_weight):
    """Router logits in float32, also under autocast (the selection must not see bf16 logits)."""
    dev = x2.device.type
    # Autocast's context manager costs µs: entered only when autocast is on.
    with torch.autocast(dev, enabled=False) if torch.is_autocast_enabled(dev) else _NO_CONTEXT:
        return F.linear(x2.float(), gate_weight.float())


def router_losses(logits, pair_experts, num_experts, router="softmax_topk", aux_loss_coef=0.0,
                  z_loss_coef=0.0):
    """The auxiliary losses of routing.hpp, in torch, for the Python path and TorchMoE (MoE's
    one-node step computes them with the library's kernels, moeblaze_router_losses, which agree
    to fp32 rounding). Autograd handles their gradients, whatever they are scaled by.
    f_e = (pairs routed to e) / P, P_e = mean_t q_t,e with q = softmax(logits)
    (normalised sigmoid for sigmoid_bias). No host sync. Deterministic on the CPU: the same bits,
    values and gradients, for every thread count (row blocks that ATen runs serially, summed in a
    fixed order; a single torch op over all T rows splits its work, and its roundings, by thread
    count). The router's linear layer itself is an MKL GEMM: bitwise stable across thread counts
    only when E and d are multiples of the SIMD width (16 floats on AVX-512)."""
    zero = logits.new_zeros((), dtype=torch.float32)
    aux = z = zero
    logits = logits.float()
    T, E = logits.shape
    if T == 0 or (aux_loss_coef <= 0 and z_loss_coef <= 0):
        return RouterLosses(aux, z)
    rows = T if logits.is_cuda else max(1, (_SERIAL_NUMEL - 1) // max(E, 1))
    q_sum = lse2_sum = 0
    for blk in logits.split(rows):  # in order: the sums below are a fixed sequence of additions
        if aux_loss_coef > 0:
            if router.replace("-", "_") == "sigmoid_bias":
                s = torch.sigmoid(blk)
                q = s / s.sum(-1, keepdim=True)
            else:
                q = torch.softmax(blk, dim=-1)
            q_sum = q_sum + q.sum(0)
        if z_loss_coef > 0:
            lse2_sum = lse2_sum + torch.logsumexp(blk, dim=-1).square().sum()
    if aux_loss_coef > 0:
        # Integer counts: exact, so the same in any order. f_e = c_e / P and 1 / T go into one
        # scalar: the fewest ops.
        counts = expert_counts(pair_experts, num_experts).float()
        scale = aux_loss_coef * num_experts / (T * max(pair_experts.numel(), 1))
        aux = (counts * q_sum).sum() * scale
    if z_loss_coef > 0:
        z = z_loss_coef * (lse2_sum / T)
    return RouterLosses(aux, z)


def _check_flags_enabled(validate, device):
    if validate is None:
        return False  # CPU ops validate in the call; CUDA checks stay on the device (no sync)
    return bool(validate) and device.type == "cuda"


def _compute_operands(x, w1, w2, b1=None, b2=None):
    """x, w1, w2 (and the optional biases b1, b2) in the dtype the kernels compute in: autocast's
    when it is on for x's device (bf16 only), else x's; fp32 weights and biases beside bf16 x are
    cast down (fp32 master weights: autograd casts their gradients back to fp32). The kernels
    store bf16 or fp32 only, so fp16 is refused."""
    dev = x.device.type
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    if dt == torch.float16 or torch.float16 in (x.dtype, w1.dtype, w2.dtype):
        raise ValueError("moeblaze: float16 is not supported (x, w1, w2 and the autocast dtype "
                         "must be bfloat16 or float32): the kernels store bf16 or fp32 only; "
                         "use torch.autocast(..., dtype=torch.bfloat16) or bf16 tensors")
    if dt == torch.float32 and x.device.type == "cuda":
        raise _lib.UnsupportedError("moeblaze: x is float32 on CUDA outside autocast: the GPU kernels "
                               "compute in bf16; pass bf16 x (fp32 weights are cast: master "
                               "weights) or run under torch.autocast('cuda', dtype=torch.bfloat16)"
                               "; the CPU backend computes in fp32")
    if dt == torch.bfloat16:
        x, w1, w2 = (t.to(dt) if t.dtype == torch.float32 else t for t in (x, w1, w2))
    b1, b2 = (b.to(x.dtype) if b is not None and b.dtype == torch.float32 else b
              for b in (b1, b2))
    return x, w1, w2, b1, b2


def experts_from_routing(x, w1, w2, pair_offsets, pair_experts, pair_weights, activation="swiglu",
                         recompute=False, num_threads=0, validate=None, b1=None, b2=None,
                         compute_dtype=None, fp8_weights=None):
    """The experts over a routing in moeblaze's CSR form (pair_offsets (T+1,) int32, pair_experts
    (P,) int32, pair_weights (P,) float32, differentiable). validate=True on CUDA reads the plan
    builder's device-side flags back (a host sync) and raises ValueError naming a bad entry.
    bf16 compute (and a bf16 result) under torch.autocast(dtype=torch.bfloat16) or when x is bf16
    and w1 / w2 are fp32 (their gradients come back in fp32); float16 raises ValueError.
    b1 (E, w1_rows) / b2 (E, d): optional expert biases, cast like w1 / w2 (CPU and CUDA).
    compute_dtype="fp8": the expert GEMMs on e4m3 operands with fine-grained scales and H kept
    in e4m3 (bf16 storage only; the GPU needs d and n multiples of 128, the CPU emulates it);
    "fp8-wgrad": the weight gradients' GEMMs in e4m3 too (128x1 tiles along the tokens).
    fp8_weights: with "fp8" or "fp8-wgrad", an Fp8WeightCache holding w1 and w2's codes between calls (the
    caller tells it when the weights change)."""
    # Replicated DTensors become their full tensors, sharded ones are refused by name.
    x, w1, w2, b1, b2 = _full_tensors(("x", "w1", "w2", "b1", "b2"), x, w1, w2, b1, b2)
    x, w1, w2, b1, b2 = _compute_operands(x, w1, w2, b1, b2)
    E = w2.shape[0]
    act, compute = _activation_code(activation), _compute_code(compute_dtype)
    cache = _fp8_handle(fp8_weights, compute)
    if _eager(x, w1, w2, pair_offsets, pair_experts, pair_weights, b1, b2):
        ext = (_ext.get() if num_threads == 0 and not _check_flags_enabled(validate, x.device)
               else None)
        if ext is not None:  # the same C calls with the host work in C++ (_ext.py)
            out = _fast_path_result(ext.experts_from_routing(
                x, w1, w2, pair_weights, pair_offsets, pair_experts, pair_weights.detach(), act,
                _w1_rows_of(act, w2), bool(recompute), b1, b2, compute, cache))
            if out is not None:
                return out
        plan, flags = ops._build_plan_built(pair_offsets, pair_experts, pair_weights.detach(), E)
        if _check_flags_enabled(validate, x.device):
            ops.check_flags(flags, (pair_offsets, pair_experts, pair_weights.detach()), E)
        return _ExpertsFn.apply(x, w1, w2, pair_weights, b1, b2, plan,
                                (act, bool(recompute), int(num_threads), compute, cache))
    plan = ops.build_plan(pair_offsets, pair_experts, pair_weights.detach(), E)
    if _check_flags_enabled(validate, x.device):
        ops.check_flags(plan[6], (pair_offsets, pair_experts, pair_weights.detach()), E)
    out, _h = ops.experts_forward(x, w1, w2, pair_weights, *plan[:6], act, bool(recompute),
                                  int(num_threads), b1, b2, compute, cache)
    return out


def _w1_rows_of(act, w2):
    """w1's rows for activation code act and w2 (E, d, n); 0 for a w2 of another rank, which the
    fast path then declines (the Python path names the error)."""
    return ops._w1_rows(act, w2.shape[2] if w2.dim() == 3 else 0)


def _fast_path_result(r):
    """The C++ fast path's answer: its output, None (not its case: the Python path runs), or a C
    call's error code, raised here with the library's message as the Python path would."""
    if type(r) is int:
        _lib.check(r)
    return r


def _compute_code(compute_dtype):
    """LayerCfg.compute of a compute_dtype argument: None / "bf16" / "storage" compute in the
    storage dtype, "fp8" on e4m3 operands (the four data GEMMs), "fp8-wgrad" the weight
    gradients' two GEMMs too."""
    if compute_dtype in (None, "bf16", "storage"):
        return 0
    if compute_dtype in ("fp8", "fp8-wgrad"):
        return _lib.COMPUTES[compute_dtype]
    raise ValueError(f"moeblaze: compute_dtype {compute_dtype!r} is not None, 'bf16', 'fp8' or "
                     "'fp8-wgrad'")


def _dtensor_rule(name, t):
    """ValueError for a DTensor argument that is not taken as it is: the kernels take whole
    weights."""
    how = "replicated" if all(p.is_replicate() for p in t.placements) else "sharded"
    return ValueError(
        f"moeblaze: {name} is a DTensor {how} over {t.device_mesh} (placements "
        f"{tuple(t.placements)}); moeblaze needs the full expert weights: call it inside FSDP's "
        "forward (fully_shard unshards the parameters there) or pass .full_tensor()")


def _full_tensors(names, *tensors):
    """The tensors with each DTensor replaced by its full tensor when every placement is
    Replicate (differentiable), else ValueError naming it: fully_shard hands forward plain
    unsharded tensors, so a DTensor here was called outside that (docs/PYTORCH.md, Training at
    scale). Plain tensors pass untouched (one type test each)."""
    if all(t is None or type(t) in ops._PLAIN for t in tensors):
        return tensors
    from torch.distributed.tensor import DTensor, Replicate
    out = []
    for name, t in zip(names, tensors):
        if isinstance(t, DTensor):
            if not all(isinstance(p, Replicate) for p in t.placements):
                raise _dtensor_rule(name, t)
            t = t.full_tensor()
        out.append(t)
    return tuple(out)


def _eager(*tensors):
    """Whether a call runs on real tensors in plain eager mode (no torch.compile / export / fake
    tensors / functorch transform): then _ExpertsFn calls the C library directly; traced code
    goes through the custom ops, which torch.compile understands."""
    return (all(t is None or type(t) in ops._PLAIN for t in tensors) and not ops._tracing()
            and not torch._C._are_functorch_transforms_active()
            and torch._guards.TracingContext.try_get() is None)


class _ExpertsFn(torch.autograd.Function):
    """The experts' forward and backward in eager mode: the custom ops' own bodies
    (ops._experts_forward_impl, ops._experts_backward_impl with dH over h) without the custom
    ops' dispatch and autograd wrapping, which cost about twice the library's own host time per
    step (bench/python_overhead.py). Same C calls, same bits. pair_weights (any shape, S
    entries, any float dtype) only receives d_pair_weights; the kernels read the plan's."""

    @staticmethod
    def forward(ctx, x, w1, w2, pair_weights, b1, b2, plan, cfg):
        act, recompute, num_threads, compute, cache = cfg
        out, h = ops._experts_forward_impl(x, w1, w2, plan, act, recompute, num_threads, b1, b2,
                                           None, compute, cache)
        if x.is_cuda and type(plan) is ops.BuiltPlan:  # backward there never reads it
            plan = ops.without_token_experts(plan)
        ctx.save_for_backward(x, w1, w2, h, b1, b2, *plan)
        ctx.cfg, ctx.plan_struct = cfg, getattr(plan, "struct", None)
        ctx.pw = (pair_weights.shape, pair_weights.dtype)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_out):
        x, w1, w2, h, b1, b2, *plan = ctx.saved_tensors
        if ctx.plan_struct is not None:  # the arrays the plan build filled: not checked again
            plan = ops.BuiltPlan(plan, ctx.plan_struct)
        act, recompute, num_threads, compute, cache = ctx.cfg
        dx, dw1, dw2, dpw, db1, db2 = ops._experts_backward_impl(
            g_out, x, w1, w2, h, plan, act, recompute, num_threads, True, b1, b2, compute, cache)
        if ops._writes_dh_over_h(x, recompute, True):  # a second backward must fail, not read dH
            torch.autograd.graph.increment_version(h)
        shape, dtype = ctx.pw
        dpw = dpw.view(shape) if dtype is torch.float32 else dpw.view(shape).to(dtype)
        return (dx, dw1, dw2, dpw, db1 if b1 is not None else None,
                db2 if b2 is not None else None, None, None)


class _RoundFn(torch.autograd.Function):
    """Token rounding in eager mode: moeblaze::token_round's body and its backward
    (router_backward over the rounded pairs) without the custom op's dispatch and autograd
    wrapping (as _ExpertsFn). Outputs (offsets, experts, weights); only the weights carry a
    gradient, into the logits: every rounded weight is recomputed from them."""

    @staticmethod
    def forward(ctx, logits, bias, offsets, experts, weights, cfg):
        kind, top_k, renormalize, m_tile, mode, seed = cfg
        out = ops._token_round_impl(logits, bias, offsets, experts, weights, kind, top_k,
                                    renormalize, m_tile, mode, seed)
        ctx.save_for_backward(logits, bias, *out)
        ctx.cfg = (kind, top_k, renormalize)
        ctx.mark_non_differentiable(out[0], out[1])
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_offsets, g_experts, g_weights):
        if g_weights is None:
            return (None,) * 6
        logits, bias, offsets, experts, weights = ctx.saved_tensors
        d_logits = ops._router_backward_impl(logits, bias, offsets, experts, weights, g_weights,
                                             *ctx.cfg)
        return (d_logits.to(logits.dtype),) + (None,) * 5


class _RouteFn(torch.autograd.Function):
    """The router in eager mode: moeblaze::route's and router_backward's bodies without the
    custom ops' dispatch (as _ExpertsFn). Outputs (offsets, experts, weights, flags); only the
    weights carry a gradient, into the logits (never into the selection bias)."""

    @staticmethod
    def forward(ctx, logits, bias, cfg):
        offsets, experts, weights, flags = ops._route_impl(logits, bias, *cfg)
        ctx.save_for_backward(logits, bias, offsets, experts, weights)
        ctx.cfg = cfg
        ctx.mark_non_differentiable(offsets, experts, flags)
        ctx.set_materialize_grads(False)
        return offsets, experts, weights, flags

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_offsets, g_experts, g_weights, g_flags):
        if g_weights is None:
            return None, None, None
        logits, bias, offsets, experts, weights = ctx.saved_tensors
        d_logits = ops._router_backward_impl(logits, bias, offsets, experts, weights, g_weights,
                                             *ctx.cfg)
        return d_logits.to(logits.dtype), None, None


_OFFSETS_CACHE = {}


def _fixed_k_offsets(T, K, like):
    """pair_offsets (T+1,) int32 of a routing with K pairs per token: 0, K, 2K, ... on `like`'s
    device. Cached per (T, K, device) for real tensors outside tracing, since training calls it
    with the same shape every step (fake, functional and meta tensors get a fresh one)."""
    device = like.device

    def make():
        if K == 0:
            return torch.zeros(T + 1, dtype=torch.int32, device=device)
        return torch.arange(0, T * K + 1, K, dtype=torch.int32, device=device)
    # ops._tracing() and TracingContext: what torch._guards.detect_fake_mode() looks at, cheaper.
    if (type(like) is not torch.Tensor or like.is_meta or T * K >= 2**31 or ops._tracing()
            or torch._guards.TracingContext.try_get() is not None):
        return make()
    key = (T, K, device)
    t = _OFFSETS_CACHE.get(key)
    if t is None:
        if len(_OFFSETS_CACHE) >= 16:
            _OFFSETS_CACHE.clear()
        t = _OFFSETS_CACHE[key] = make()
    return t


_MOE_EXPERTS_NAMES = ("x", "w1", "w2", "expert_ids", "expert_weights")


def moe_experts(x, w1, w2, expert_ids, expert_weights, activation="swiglu", recompute=False,
                validate=None, b1=None, b2=None, compute_dtype=None, fp8_weights=None):
    """Functional MoE with caller-supplied routing: expert_ids (T, K) integer, expert_weights
    (T, K) (gradients flow to them). x (T, d), w1 (E, rows, d), w2 (E, d, n), one dtype, one
    device. On the CPU a bad id (outside [0, E), of any integer dtype) raises ValueError naming
    it; on CUDA pass validate=True to check (a host sync), otherwise a bad id (out of range or
    repeated) makes its token's output row and gradients NaN, never a plausible row and never
    an out-of-bounds access (and is never narrowed into a valid one). b1 (E, w1_rows) and
    b2 (E, d), optional, each alone or both: expert biases, h = W1_e x + b1_e and
    y = W2_e a + b2_e (gpt-oss), with gradients, on the CPU and the GPU. compute_dtype and
    fp8_weights: as experts_from_routing's ("fp8": e4m3 operands, docs/FP8.md)."""
    if expert_ids.dim() != 2 or expert_weights.shape != expert_ids.shape:
        raise ValueError(f"moeblaze: expert_ids and expert_weights must both be (T, K), got "
                         f"{tuple(expert_ids.shape)} and {tuple(expert_weights.shape)}")
    T, K = expert_ids.shape
    if x.dim() != 2 or x.shape[0] != T:
        raise ValueError(f"moeblaze: x must be (T, d) with T = {T} (rows of expert_ids), got "
                         f"{tuple(x.shape)}")
    if w2.dim() != 3:
        raise ValueError(f"moeblaze: w2 must be (E, d, n), got {tuple(w2.shape)}")
    ops._one_device(_MOE_EXPERTS_NAMES + ("b1", "b2"), x, w1, w2, expert_ids, expert_weights, b1,
                    b2)
    if (K > 0 and expert_ids.dtype in _lib.ID_DTYPES and not (validate and x.is_cuda)
            and _eager(x, w1, w2, expert_ids, expert_weights, b1, b2)):
        return _moe_experts_eager(x, w1, w2, expert_ids, expert_weights, activation, recompute,
                                  b1, b2, compute_dtype, fp8_weights)
    # Not the eager path's types: replicated DTensors become their full tensors, sharded ones are
    # refused by name.
    x, w1, w2, expert_weights, b1, b2 = _full_tensors(
        ("x", "w1", "w2", "expert_weights", "b1", "b2"), x, w1, w2, expert_weights, b1, b2)
    offsets = _fixed_k_offsets(T, K, x)
    check_range = x.device.type == "cpu" or bool(validate)  # on CUDA a host sync: opt-in
    experts = ops.expert_ids_int32(expert_ids, w2.shape[0], check_range).reshape(-1)
    weights = expert_weights.to(torch.float32).reshape(-1)
    return experts_from_routing(x, w1, w2, offsets, experts, weights, activation, recompute,
                                validate=validate, b1=b1, b2=b2, compute_dtype=compute_dtype,
                                fp8_weights=fp8_weights)


def _moe_experts_eager(x, w1, w2, expert_ids, expert_weights, activation, recompute, b1, b2,
                       compute_dtype, fp8_weights):
    """moe_experts in eager mode: the plan straight from the (T, K) ids and weights in one C call
    (ops.plan_from_ids), then _ExpertsFn; d_pair_weights comes back in expert_weights' shape and
    dtype."""
    x, w1, w2, b1, b2 = _compute_operands(x, w1, w2, b1, b2)
    w = expert_weights.detach()
    if w.dtype not in _lib.DTYPES:
        w = w.to(torch.float32)
    act, compute = _activation_code(activation), _compute_code(compute_dtype)
    cache = _fp8_handle(fp8_weights, compute)
    ext = _ext.get()
    if ext is not None:  # the same C calls with the host work in C++ (_ext.py)
        out = _fast_path_result(ext.experts_from_ids(
            x, w1, w2, expert_weights, expert_ids, w, act, _w1_rows_of(act, w2),
            bool(recompute), b1, b2, compute, cache))
        if out is not None:
            return out
    plan, _flags = ops._plan_from_ids_built(expert_ids, w, w2.shape[0])
    return _ExpertsFn.apply(x, w1, w2, expert_weights, b1, b2, plan,
                            (act, bool(recompute), 0, compute, cache))


def _init_moe_module(m, hidden_size, intermediate_size, num_experts, top_k, activation, router,
                     renormalize, recompute, aux_loss_coef, z_loss_coef, weight_experts, device,
                     dtype):
    """The attributes, router and parameters MoE and ExpertParallelMoE share: gate (E, d) over all
    num_experts, w1 (weight_experts, rows, d) and w2 (weight_experts, d, n) for the experts the
    module holds (all of them, or one rank's shard), uninitialised; expert_bias for sigmoid_bias."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"moeblaze: top_k ({top_k}) must be in [1, num_experts = "
                         f"{num_experts}]")
    m.hidden_size, m.intermediate_size = hidden_size, intermediate_size
    m.num_experts, m.top_k = num_experts, top_k
    m.activation, m._act = activation, _activation_code(activation)
    m.router, m._kind = router.replace("-", "_"), _router_code(router)
    m.renormalize, m.recompute = bool(renormalize), bool(recompute)
    m.aux_loss_coef, m.z_loss_coef = float(aux_loss_coef), float(z_loss_coef)
    kw = {"device": device, "dtype": dtype}
    rows = 2 * intermediate_size if activation in _lib.GATED else intermediate_size
    m.gate = nn.Linear(hidden_size, num_experts, bias=False, **kw)
    m.w1 = nn.Parameter(torch.empty(weight_experts, rows, hidden_size, **kw))
    m.w2 = nn.Parameter(torch.empty(weight_experts, hidden_size, intermediate_size, **kw))
    if m.router == "sigmoid_bias":
        m.register_buffer("expert_bias", torch.zeros(num_experts, device=device,
                                                     dtype=torch.float32))
    else:
        m.expert_bias = None
    m.last_flags = None  # device-side check flags of the last forward (see MoE.check())


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP that every token goes through beside the routed experts, in plain torch:
    down_proj(silu(gate_proj(x)) * up_proj(x)), times sigmoid(gate(x)) when gated (Qwen2-MoE's
    shared_expert_gate; DeepSeek's shared experts are ungated). Linear names follow transformers'
    MLPs. The weights are cast to x's dtype, like the routed experts' (fp32 master weights)."""

    def __init__(self, hidden_size, intermediate_size, gated=False, device=None, dtype=None):
        super().__init__()
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)
        self.gate = nn.Linear(hidden_size, 1, **kw) if gated else None

    def forward(self, x):
        def lin(m, t):
            return F.linear(t, m.weight.to(t.dtype))
        y = lin(self.down_proj, F.silu(lin(self.gate_proj, x)) * lin(self.up_proj, x))
        return y if self.gate is None else torch.sigmoid(lin(self.gate, x)) * y


class MoE(nn.Module):
    """A Mixture-of-Experts layer run by moeblaze (CPU backend or the Hopper GPU backend).

    router: softmax_topk (default), topk_softmax or sigmoid_bias (expert_bias buffer, selection
    only). token_rounding: None, or "nr-f" / "sr-f" / "up" / "down" (SonicMoE's tile-aware
    rounding to multiples of m_tile; needs a host sync per call on CUDA, so not CUDA-graph
    capturable). recompute=True keeps only the routing plan for backward (H is recomputed).
    shared_expert_size > 0 adds a SharedExpert of that intermediate size beside the routed
    experts (shared_expert_gate=True: Qwen2-MoE's sigmoid gate). last_expert_counts: the
    per-expert pair counts of the last forward (on the device); update_expert_bias applies
    DeepSeek-V3's auxiliary-loss-free balancing to the sigmoid_bias router. bias=True adds
    expert biases b1 (E, w1_rows) and b2 (E, d), zeros-initialised (gpt-oss).
    compute_dtype="fp8": the expert GEMMs on e4m3 operands with DeepSeek-V3's fine-grained
    scales, H kept in e4m3 (bf16 storage; the GPU needs d and n multiples of 128, the CPU
    emulates it: docs/FP8.md); "fp8-wgrad" takes the weight gradients' GEMMs to e4m3 too.
    fp8_weight_cache=True (with either): w1 and w2's codes kept in an
    Fp8WeightCache between eager calls (about the bf16 weights' bytes) and requantized when the
    parameters change: another tensor, or an in-place update torch counts (optimizer steps,
    load_state_dict); after a write it cannot see (through .data) call fp8_weights_changed()."""

    def __init__(self, hidden_size, intermediate_size, num_experts, top_k, activation="swiglu",
                 router="softmax_topk", renormalize=False, token_rounding=None, m_tile=128,
                 recompute=False, aux_loss_coef=0.0, z_loss_coef=0.0, device=None, dtype=None,
                 shared_expert_size=0, shared_expert_gate=False, bias=False, compute_dtype=None,
                 fp8_weight_cache=False):
        super().__init__()
        compute = _compute_code(compute_dtype)  # a bad value fails here, not at the first forward
        self.compute_dtype = compute_dtype
        if fp8_weight_cache and compute == _lib.COMPUTES["storage"]:
            raise ValueError("moeblaze: fp8_weight_cache=True needs compute_dtype='fp8' or "
                             "'fp8-wgrad' (the cache holds FP8 weight codes)")
        self.fp8_weight_cache = Fp8WeightCache() if fp8_weight_cache else None
        self._fp8_seen = None  # (data_ptr, _version) of w1 and w2 when the cache was last told
        _init_moe_module(self, hidden_size, intermediate_size, num_experts, top_k, activation,
                         router, renormalize, recompute, aux_loss_coef, z_loss_coef,
                         num_experts, device, dtype)
        if bias:
            kw = {"device": device, "dtype": dtype}
            self.b1 = nn.Parameter(torch.zeros(num_experts, self.w1.shape[1], **kw))
            self.b2 = nn.Parameter(torch.zeros(num_experts, hidden_size, **kw))
        else:
            self.b1 = self.b2 = None
        if shared_expert_size < 0 or (shared_expert_gate and not shared_expert_size):
            raise ValueError(f"moeblaze: shared_expert_size ({shared_expert_size}) must be >= 0, "
                             "and > 0 when shared_expert_gate is set")
        self.shared_expert = SharedExpert(hidden_size, shared_expert_size, shared_expert_gate,
                                          device, dtype) if shared_expert_size else None
        self._last_experts, self._counts = None, None  # see last_expert_counts
        if token_rounding is not None and token_rounding not in _lib.ROUNDINGS:
            raise ValueError(f"moeblaze: token_rounding {token_rounding!r} is not None, nr-f, "
                             "sr-f, up or down")
        self.token_rounding, self.m_tile, self.rounding_seed = token_rounding, int(m_tile), 0
        self.reset_parameters()

    def reset_parameters(self):
        # nn.Linear's default init per expert: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        nn.init.uniform_(self.w1, -1 / math.sqrt(self.hidden_size), 1 / math.sqrt(self.hidden_size))
        nn.init.uniform_(self.w2, -1 / math.sqrt(self.intermediate_size),
                         1 / math.sqrt(self.intermediate_size))
        self.gate.reset_parameters()
        if self.b1 is not None:
            nn.init.zeros_(self.b1)
            nn.init.zeros_(self.b2)
        if self.shared_expert is not None:
            for m in self.shared_expert.children():
                m.reset_parameters()

    def extra_repr(self):
        return (f"d={self.hidden_size}, n={self.intermediate_size}, E={self.num_experts}, "
                f"K={self.top_k}, activation={self.activation}, router={self.router}, "
                f"token_rounding={self.token_rounding}, recompute={self.recompute}")

    def _rounding_args(self):
        """(mode, m_tile, seed) of the C++ fast path's token rounding; mode None: none."""
        if self.token_rounding is None:
            return None, 0, 0
        return _lib.ROUNDINGS[self.token_rounding], self.m_tile, self.rounding_seed

    def _fp8_cache(self):
        """The weight cache for an eager forward (None without one), told first when w1 or w2 is
        another tensor or torch counted an in-place update of it since the last forward."""
        cache = self.fp8_weight_cache
        if cache is None:
            return None
        seen = (self.w1.data_ptr(), self.w1._version, self.w2.data_ptr(), self.w2._version)
        if seen != self._fp8_seen:
            if self._fp8_seen is not None:
                cache.weights_changed()
            self._fp8_seen = seen
        return cache

    def fp8_weights_changed(self):
        """Tell the FP8 weight cache that w1 / w2 changed in a way torch does not count (writes
        through .data); a no-op without one."""
        if self.fp8_weight_cache is not None:
            self.fp8_weight_cache.weights_changed()

    def route(self, x2):
        """(logits fp32 (T, E), pair_offsets, pair_experts, pair_weights) for tokens x2 (T, d)."""
        logits = router_logits(x2, self.gate.weight)
        bias = self.expert_bias
        eager = _eager(logits, bias)
        ext = _ext.get() if eager else None
        if ext is not None:  # the same C calls with the host work in C++ (_ext.py)
            r = _fast_path_result(ext.route(logits, bias, self._kind, self.top_k,
                                            self.renormalize, *self._rounding_args()))
            if r is not None:
                offsets, experts, weights, self.last_flags = r
                return logits, offsets, experts, weights
        if eager:
            offsets, experts, weights, flags = _RouteFn.apply(
                logits, bias, (self._kind, self.top_k, self.renormalize))
        else:
            offsets, experts, weights, flags = ops.route(logits, bias, self._kind, self.top_k,
                                                         self.renormalize)
        self.last_flags = flags
        if self.token_rounding is not None:
            cfg = (self._kind, self.top_k, self.renormalize, self.m_tile,
                   _lib.ROUNDINGS[self.token_rounding], self.rounding_seed)
            if eager:
                offsets, experts, weights = _RoundFn.apply(logits, bias, offsets, experts,
                                                           weights, cfg)
            else:
                offsets, experts, weights = ops.token_round(logits, bias, offsets, experts,
                                                            weights, *cfg)
        return logits, offsets, experts, weights

    def forward(self, x):
        shape = x.shape
        if shape[-1] != self.hidden_size:
            raise ValueError(f"moeblaze: x has last dimension {shape[-1]}, expected hidden_size "
                             f"{self.hidden_size}")
        x2 = x.reshape(-1, self.hidden_size)
        r = self._layer_step(x2)
        if r is not None:
            out, aux, z, experts, self.last_flags = r
            return self._finish(x2, out, None, experts, shape, RouterLosses(aux, z))
        self._refuse_dtensors()  # here, not before the fast step, which takes plain tensors only
        logits, offsets, experts, weights = self.route(x2)
        cache = self._fp8_cache() if _eager(x2, self.w1, self.w2) else None
        out = experts_from_routing(x2, self.w1, self.w2, offsets, experts, weights,
                                   self.activation, self.recompute, b1=self.b1, b2=self.b2,
                                   compute_dtype=self.compute_dtype, fp8_weights=cache)
        return self._finish(x2, out, logits, experts, shape)

    def _refuse_dtensors(self):
        """ValueError naming a DTensor parameter: fully_shard's forward hands the module plain
        unsharded tensors, so one here means the module was called outside it (one type test
        per parameter)."""
        ps = (self.w1, self.w2, self.gate.weight, self.b1, self.b2)
        if all(p is None or type(p) in ops._PLAIN for p in ps):
            return
        from torch.distributed.tensor import DTensor
        for name, p in zip(("w1", "w2", "gate.weight", "b1", "b2"), ps):
            if isinstance(p, DTensor):
                raise _dtensor_rule(f"MoE.{name}", p)

    def _layer_step(self, x2):
        """The whole step (router layer, route, token rounding, experts, losses) as one C++
        autograd node (csrc/eager_layer.cpp: the same C calls, no torch ops for the losses, far
        less host work) for eager tensors outside autocast; None where it does not apply, and the
        Python path runs."""
        w1, w2, gw = self.w1, self.w2, self.gate.weight
        if (not _eager(x2, w1, w2, gw, self.expert_bias, self.b1, self.b2)
                or torch.is_autocast_enabled(x2.device.type)):
            return None
        ext = _ext.get()
        if ext is None:
            return None
        act = _activation_code(self.activation)
        cache = self._fp8_cache()
        return _fast_path_result(ext.moe_layer(
            x2, gw, self.expert_bias, w1, w2, self.b1, self.b2, self._kind, self.top_k,
            self.renormalize, *self._rounding_args(), act, _w1_rows_of(act, w2),
            bool(self.recompute), _compute_code(self.compute_dtype),
            cache.handle if cache is not None else 0, float(self.aux_loss_coef),
            float(self.z_loss_coef)))

    @property
    def last_expert_counts(self):
        """(num_experts,) int64 pair counts of the last forward, on its device (None before one):
        counted when first read, from the routing the forward kept, so a forward whose counts
        nobody reads launches nothing for them."""
        if self._counts is None and self._last_experts is not None:
            self._counts = expert_counts(self._last_experts, self.num_experts)
        return self._counts

    def _finish(self, x2, out, logits, experts, shape, losses=None):
        """The shared expert's output added, the expert counts kept, the router losses (computed
        from the logits unless given)."""
        if self.shared_expert is not None:
            out = out + self.shared_expert(x2)
        self._last_experts, self._counts = experts.detach(), None
        if losses is None:
            losses = router_losses(logits, experts, self.num_experts, self.router,
                                   self.aux_loss_coef, self.z_loss_coef)
        return out.reshape(shape), losses

    @torch.no_grad()
    def update_expert_bias(self, rate, counts=None):
        """DeepSeek-V3's auxiliary-loss-free balancing: expert_bias += rate * sign(mean(c) - c),
        c = the per-expert counts of the last forward (or `counts`, e.g. summed over
        micro-batches or all-reduced over ranks). Call after the optimizer step; no host sync."""
        if self.expert_bias is None:
            raise ValueError(f"moeblaze: update_expert_bias needs router='sigmoid_bias' (the only "
                             f"router with an expert_bias); this MoE has router={self.router!r}")
        c = self.last_expert_counts if counts is None else counts
        if c is None or tuple(c.shape) != (self.num_experts,):
            raise ValueError(f"moeblaze: update_expert_bias needs counts of shape "
                             f"({self.num_experts},), or a forward before it; got "
                             f"{None if c is None else tuple(c.shape)}")
        c = c.to(self.expert_bias.device, torch.float32)
        self.expert_bias.add_(float(rate) * torch.sign(c.mean() - c))

    def check(self):
        """Raises ValueError if the last forward's device-side router check saw NaN/Inf logits
        (CUDA; a host sync)."""
        if self.last_flags is not None:
            ops.check_flags(self.last_flags)

    # ---- interop --------------------------------------------------------------------------
    @torch.no_grad()
    def load_experts(self, gate_weight, up_weights=None, down_weights=None, gate_proj=None,
                     gate_up_weights=None):
        """Loads weights given in the per-expert nn.Linear layout (out x in):
        gate_weight (E, d) router; per expert either gate_proj[e] (n, d) and up_weights[e] (n, d)
        (Mixtral w1/w3, Qwen gate_proj/up_proj) or fused gate_up_weights[e] (2n, d) (gate rows
        first); down_weights[e] (d, n) (Mixtral w2, Qwen down_proj). Lists or stacked tensors."""
        E, n, d = self.num_experts, self.intermediate_size, self.hidden_size

        def stack(ws, shape, name):
            t = torch.stack(list(ws)) if not torch.is_tensor(ws) else ws
            if tuple(t.shape) != (E,) + shape:
                raise ValueError(f"moeblaze: {name} must be {(E,) + shape}, got {tuple(t.shape)}")
            return t

        if tuple(gate_weight.shape) != (E, d):
            raise ValueError(f"moeblaze: gate_weight must be {(E, d)}, got "
                             f"{tuple(gate_weight.shape)}")
        self.gate.weight.copy_(gate_weight)
        if gate_up_weights is not None:
            w1 = stack(gate_up_weights, tuple(self.w1.shape[1:]), "gate_up_weights")
        elif self.activation in _lib.GATED:
            if gate_proj is None or up_weights is None:
                raise ValueError("moeblaze: a gated activation needs gate_proj and up_weights "
                                 "(or gate_up_weights)")
            w1 = torch.cat([stack(gate_proj, (n, d), "gate_proj"),
                            stack(up_weights, (n, d), "up_weights")], dim=1)
        else:
            w1 = stack(up_weights, (n, d), "up_weights")
        self.w1.copy_(w1)
        self.w2.copy_(stack(down_weights, (d, n), "down_weights"))
        return self

    @classmethod
    def from_mixtral(cls, block, **kw):
        """From a Hugging Face MixtralSparseMoeBlock (transformers v5's fused experts or 4.x's
        per-expert w1/w3/w2): softmax -> top-K -> renormalised weights, SwiGLU. See
        moeblaze.integrations.hf."""
        from .integrations.hf import moe_from_mixtral
        return moe_from_mixtral(cls, block, **kw)

    @classmethod
    def from_qwen_moe(cls, block, **kw):
        """From a Hugging Face Qwen2-MoE / Qwen3-MoE / OLMoE sparse block (v5 fused experts or
        4.x's gate_proj / up_proj / down_proj), renormalised when norm_topk_prob. See
        moeblaze.integrations.hf."""
        from .integrations.hf import moe_from_qwen_moe
        return moe_from_qwen_moe(cls, block, **kw)


class TorchMoE(MoE):
    """The same layer (same parameters, same router semantics) in pure PyTorch: torch router,
    sort-and-gather experts (reference.torch_experts). For comparisons; token rounding and
    recompute are moeblaze features and are rejected here."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        if self.token_rounding is not None or self.recompute:
            raise ValueError("moeblaze: TorchMoE has no token rounding and no recompute mode")
        if self.b1 is not None:
            raise ValueError("moeblaze: TorchMoE has no expert biases (bias=True)")

    def forward(self, x):
        shape = x.shape
        x2 = x.reshape(-1, self.hidden_size)
        logits = router_logits(x2, self.gate.weight)
        ids, w = torch_router(logits, self.top_k, self.router, self.renormalize, self.expert_bias)
        out = torch_experts(x2, self.w1, self.w2, ids, w, self.activation)
        return self._finish(x2, out, logits, ids, shape)
