"""moeblaze's operators as torch.library custom ops (schemas, fake kernels for torch.compile,
autograd), each a thin call into the C ABI.

Everything an op keeps for backward (H, the routing, the routing plan) is a tensor it returns,
allocated by PyTorch's allocator; workspaces are PyTorch tensors too on CUDA (the CPU backend
allocates its own, counted by moeblaze.memory_stats("cpu")). CUDA ops run on PyTorch's current
stream and never synchronise with the host, except token_round (its pair count sizes its
outputs: one sync). Device-side input checks raise a `flags` tensor (4 int32) instead of an
error; see check_flags. A plan filled by the caller (not build_plan) is checked by
validate_plan (on CUDA: the device check and one host sync); the CUDA experts ops do not
read-check plan contents.

Ops (namespace moeblaze):
  route(logits, bias, kind, top_k, renormalize) -> (pair_offsets, pair_experts, pair_weights, flags)
  router_backward(logits, bias, pair_offsets, pair_experts, pair_weights, d_pair_weights, kind,
                  top_k, renormalize) -> d_logits
  token_round(logits, bias, pair_offsets, pair_experts, pair_weights, kind, top_k, renormalize,
              m_tile, mode, seed) -> (pair_offsets, pair_experts, pair_weights)   [host sync]
  build_plan(pair_offsets, pair_experts, pair_weights, num_experts)
      -> (expert_token_offsets, expert_token_indices, slot_weights, token_pair_offsets,
          token_expert_indices, token_index_map, flags)
  experts_forward(x, w1, w2, pair_weights, *plan, activation, recompute, num_threads,
                  b1=None, b2=None, compute=0, fp8_cache=0) -> (out, h)
                  [compute 1: fp8, 2: fp8-wgrad; h then uint8; fp8_cache: an Fp8WeightCache's handle or 0]
  experts_backward(d_out, x, w1, w2, h, *plan, activation, recompute, num_threads, b1=None,
                   b2=None, compute=0, fp8_cache=0) -> (dx, dw1, dw2, d_pair_weights, db1, db2)
                   [db: (0,) without b]
  experts_backward_dh_over_h(...)  the same; on CUDA keep_h writes dH over h (mutates h)
route, token_round and experts_forward have autograd formulas (router_backward /
experts_backward); pair_weights is an input of experts_forward only so that its gradient
(d_pair_weights) reaches the router: the kernels read the plan's slot_weights, built from it.
"""
import ctypes
import functools
from typing import Optional, Tuple

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

from . import _lib
from ._lib import check, device_code, lib, ptr, stream_of

_I32, _F32 = torch.int32, torch.float32


def _run(t, fn, *args):
    """check(fn(*args)), a C call, with t's CUDA device current (nothing to switch on the CPU)."""
    if t.is_cuda:
        prev = torch.cuda._exchange_device(t.get_device())  # what torch.cuda.device does, inline
        try:
            rc = fn(*args)
        finally:
            torch.cuda._maybe_exchange_device(prev)
    else:
        rc = fn(*args)
    check(rc)


# ---------------------------------------------------------------------------------------------
# argument checks, shared by every op: the C ABI takes raw pointers and trusts what it is told,
# so each tensor's dtype, shape, device and layout, and each integer's range, is fixed here.
# A message is formatted only once its check has failed (`if not ok: _fail(f"...")`).
# ---------------------------------------------------------------------------------------------
MAX_THREADS = 1024
_INT32_MAX = (1 << 31) - 1
_GATED_CODES = frozenset(_lib.ACTIVATIONS[a] for a in _lib.GATED)
# Exact tensor types that are never fake: they take the fast paths; any other type (FakeTensor,
# functional wrappers, user subclasses) goes through the full checks.
_PLAIN = (Tensor, torch.nn.Parameter)


def _fail(msg):
    raise ValueError("moeblaze: " + msg)


def _require(cond, msg):
    """For a constant msg; a formatted one is built after the test fails (see _fail)."""
    if not cond:
        _fail(msg)


def _float_code(t, name):
    code = _lib.DTYPES.get(t.dtype)
    if code is None:
        _fail(f"{name} has dtype {t.dtype}; expected torch.float32 or torch.bfloat16")
    return code


def _int(name, v, lo, hi):
    """v as a Python int in [lo, hi]: ctypes would silently wrap a larger one (2**32 + 1 -> 1)."""
    if type(v) is not int or not lo <= v <= hi:  # else an exact int in range: nothing to check
        if not isinstance(v, int) or isinstance(v, bool):
            _fail(f"{name} must be an int, got {type(v).__name__}")
        if not lo <= v <= hi:
            _fail(f"{name} ({v}) must be in [{lo}, {hi}]")
    return v


def _code(name, v, table):
    """v, one of the enum codes of table (a dict name -> code of _lib)."""
    if type(v) is not int or v not in table.values():  # type first: True == 1
        if isinstance(v, bool) or not isinstance(v, int) or v not in table.values():
            _fail(f"{name} ({v!r}) must be one of the codes {sorted(table.values())} "
                  f"({', '.join(table)})")
    return v


def _tracing():
    """Under torch.compile or a FakeTensorMode: fake tensors are what is expected there."""
    return (torch.compiler.is_compiling() or
            torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None)


def _storage_device(name, t):
    """t's device, where a real kernel can read t's data: not meta, not fake."""
    if type(t) not in _PLAIN or not (t.is_cpu or t.is_cuda):
        fake = isinstance(t, FakeTensor)
        if fake or t.device.type not in ("cpu", "cuda"):
            _fail(f"{name} is a {'fake' if fake else t.device.type} tensor on {t.device}: "
                  "moeblaze's kernels need data on cpu or cuda")
    return t.device


def _one_device(names, *tensors):
    """The device every given tensor (None: absent) is on, names[i] naming tensors[i], else
    ValueError naming the first that differs; meta tensors, and fake tensors mixed with real ones,
    are refused. The fake kernels call it too: a meta input routes the whole op to its fake
    kernel, whose uninitialised outputs must not pass for results (torch.compile traces with fake
    tensors, never meta)."""
    dev = None
    for name, t in zip(names, tensors):
        if t is None:
            continue
        plain = type(t) in _PLAIN
        if t.is_meta if plain else t.device.type == "meta":
            _fail(f"{name} is on meta: moeblaze's ops compute values, so every tensor must be on "
                  "cpu or cuda (torch.compile traces with fake tensors)")
        fake = not plain and isinstance(t, FakeTensor)
        if fake and not _tracing():
            _fail(f"{name} is a fake tensor outside tracing (no FakeTensorMode active): it has no "
                  "values to compute with")
        if dev is None:
            dev, first_fake, first = t.device, fake, name
        elif t.device != dev:
            _fail(f"{name} is on {t.device} but {first} is on {dev}: every tensor of a call must "
                  "be on one device")
        elif fake != first_fake:
            _fail(f"{name} and {first} mix a fake tensor with a real one: fake tensors only trace "
                  "(torch.compile), all together")
    return dev


def _arg(name, t, dtype, shape, device):
    """t checked for a C call and made contiguous (the C side reads dense arrays): exactly this
    dtype, this shape (None: any extent), on `device`, real data. The result must stay
    referenced until the C call returns (its pointer is all C gets)."""
    if type(t) not in _PLAIN or t.dtype is not dtype or t.shape != shape or t.device != device:
        _check_arg(name, t, dtype, shape, device)  # raises, unless the fast test was too narrow
    return t.contiguous()


def _check_arg(name, t, dtype, shape, device):
    _storage_device(name, t)
    if t.dtype != dtype:
        _fail(f"{name} must have dtype {dtype}, got {t.dtype}")
    if t.dim() != len(shape) or not all(s is None or s == n for s, n in zip(shape, t.shape)):
        _fail(f"{name} must have shape ({', '.join('*' if s is None else str(s) for s in shape)}"
              f"{',' if len(shape) == 1 else ''}), got {tuple(t.shape)}")
    if t.device != device:
        _fail(f"{name} is on {t.device} but the call's other tensors are on {device}")


def _struct(cls, tensors, *sizes):
    """A ctypes struct of sizes and the tensors' pointers; it keeps the tensors alive with it."""
    s = cls(*sizes, *[ptr(t) for t in tensors])
    s._keep = tensors  # contiguous copies made by _arg live as long as the struct C reads
    return s


def _routing_struct(T, E, offsets, experts, weights, device):
    offsets = _arg("pair_offsets", offsets, _I32, (T + 1,), device)
    # Any extent P: a 1-D tensor is held to its own shape, any other fails the rule (*,).
    experts = _arg("pair_experts", experts, _I32, experts.shape if experts.dim() == 1 else (None,),
                   device)
    P = experts.numel()
    weights = _arg("pair_weights", weights, _F32, (P,), device)
    return _struct(_lib.Routing, (offsets, experts, weights), T, E, P)


_ROUTING_NAMES = ("pair_offsets", "pair_experts", "pair_weights")
_PLAN_NAMES = ("expert_token_offsets", "expert_token_indices", "slot_weights",
               "token_pair_offsets", "token_expert_indices", "token_index_map")


class BuiltPlan(tuple):
    """The six arrays of a plan a library call just filled, with their ctypes struct (.struct):
    the eager paths hand it from the plan build to forward and backward, which then skip
    re-checking arrays the library made itself (the plan stays internal to those paths)."""

    def __new__(cls, arrays, struct):
        p = super().__new__(cls, arrays)
        p.struct = struct
        return p


def without_token_experts(plan):
    """A BuiltPlan whose token_expert_indices is None (its struct's pointer NULL) and no longer
    referenced: what an eager CUDA forward keeps for backward, which never reads that array
    (S int32 fewer bytes held through the step). The C library refuses it wherever it is read."""
    s = type(plan.struct).from_buffer_copy(plan.struct)
    s.token_expert_indices = None
    s._keep = tuple(t for t in plan.struct._keep if t is not plan[4])
    return BuiltPlan(plan[:4] + (None,) + plan[5:], s)


def _plan_struct(T, E, plan, device):
    if type(plan) is BuiltPlan and plan.struct.T == T and plan.struct.E == E:
        return plan.struct  # made by _build_plan_built / _plan_from_ids_built: shapes are right
    eto, eti, sw, tpo, tei, tim = plan
    S = eti.numel()
    arrays = (_arg("expert_token_offsets", eto, _I32, (E + 1,), device),
              _arg("expert_token_indices", eti, _I32, (S,), device),
              _arg("slot_weights", sw, _F32, (S,), device),
              _arg("token_pair_offsets", tpo, _I32, (T + 1,), device),
              _arg("token_expert_indices", tei, _I32, (S,), device),
              _arg("token_index_map", tim, _I32, (S,), device))
    return _struct(_lib.Plan, arrays, T, E, S)


def _router_args(logits, bias, kind, top_k):
    """(logits, bias, T, E, device, dtype code): logits (T, E) float32/bf16 and bias (E,) float32
    or None, contiguous, on one device."""
    dev = _storage_device("logits", logits)
    if logits.dim() != 2:
        _fail(f"logits must be (T, E), got shape {tuple(logits.shape)}")
    dt = _float_code(logits, "logits")
    T, E = logits.shape
    _code("kind", kind, _lib.ROUTERS)
    _int("top_k", top_k, 1, max(E, 1))
    if T * top_k > _INT32_MAX:
        _fail(f"T*top_k ({T * top_k}) exceeds the int32 index range of a routing")
    if bias is not None:
        bias = _arg("bias", bias, _F32, (E,), dev)
    return logits.contiguous(), bias, T, E, dev, dt


def expert_ids_int32(ids, num_experts, check_range, name="expert_ids"):
    """Expert ids of any integer dtype as int32, never narrowed into a different valid id.
    check_range=True compares them with [0, num_experts) here (ValueError naming the first bad
    one; a host sync on CUDA, free on the CPU; skipped while tracing). Either way, ids of a
    dtype wider than int32 that are out of range become num_experts before narrowing, so that
    they stay out of range (2**32 would wrap to expert 0) for the plan builder's own checks (the
    CPU's error, CUDA's device flags)."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        _fail(f"{name} must have an integer dtype, got {ids.dtype} (ids are never rounded)")
    if check_range and not _tracing() and ids.numel() > 0:  # tracing: no values to check
        lo, hi = torch.aminmax(ids)  # one reduction; the bad entry is searched for only if any
        if int(lo) < 0 or int(hi) >= num_experts:
            bad = ((ids < 0) | (ids >= num_experts)).nonzero()
            where = tuple(int(i) for i in bad[0])
            raise ValueError(f"moeblaze: {name}[{', '.join(map(str, where))}]: expert id "
                             f"{int(ids[where])} of token {where[0]} is out of range "
                             f"[0, {num_experts})")
        return ids.to(_I32)  # every id in range: none to keep out of range
    if torch.iinfo(ids.dtype).max > _INT32_MAX:  # int64, uint32, ...: a bad id stays bad
        ids = ids.masked_fill((ids < 0) | (ids >= num_experts), num_experts)
    return ids.to(_I32)


# ---------------------------------------------------------------------------------------------
# router
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("moeblaze::route", mutates_args=())
def route(logits: Tensor, bias: Optional[Tensor], kind: int, top_k: int,
          renormalize: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    return _route_impl(logits, bias, kind, top_k, renormalize)


def _route_impl(logits, bias, kind, top_k, renormalize):
    """The body of moeblaze::route, callable without the op's dispatch (eager paths)."""
    logits, bias, T, E, dev, dt = _router_args(logits, bias, kind, top_k)
    P = T * top_k
    offsets = torch.empty(T + 1, dtype=_I32, device=dev)
    experts = torch.empty(P, dtype=_I32, device=dev)
    weights = torch.empty(P, dtype=_F32, device=dev)
    flags = torch.zeros(4, dtype=_I32, device=dev)
    cfg = _lib.RouterCfg(kind, top_k, int(renormalize))
    out = _struct(_lib.Routing, (offsets, experts, weights), T, E, P)  # fresh: nothing to check
    _run(logits, lib().moeblaze_route, ctypes.byref(cfg), ptr(logits), dt, T, E, ptr(bias),
         device_code(logits), stream_of(logits), ctypes.byref(out), flags.data_ptr())
    return offsets, experts, weights, flags


@route.register_fake
def _(logits, bias, kind, top_k, renormalize):
    _one_device(("logits", "bias"), logits, bias)
    T = logits.shape[0]
    P = T * top_k
    return (logits.new_empty(T + 1, dtype=_I32), logits.new_empty(P, dtype=_I32),
            logits.new_empty(P, dtype=torch.float32), logits.new_empty(4, dtype=_I32))


@torch.library.custom_op("moeblaze::router_backward", mutates_args=())
def router_backward(logits: Tensor, bias: Optional[Tensor], pair_offsets: Tensor,
                    pair_experts: Tensor, pair_weights: Tensor, d_pair_weights: Tensor, kind: int,
                    top_k: int, renormalize: bool) -> Tensor:
    return _router_backward_impl(logits, bias, pair_offsets, pair_experts, pair_weights,
                                 d_pair_weights, kind, top_k, renormalize)


def _router_backward_impl(logits, bias, pair_offsets, pair_experts, pair_weights, d_pair_weights,
                          kind, top_k, renormalize):
    """The body of moeblaze::router_backward, callable without the op's dispatch."""
    logits, bias, T, E, dev, dt = _router_args(logits, bias, kind, top_k)
    r = _routing_struct(T, E, pair_offsets, pair_experts, pair_weights, dev)
    # An upstream gradient: any float dtype autograd hands over, read as float32.
    if not d_pair_weights.is_floating_point():
        _fail(f"d_pair_weights must be floating point, got {d_pair_weights.dtype}")
    d_pair_weights = _arg("d_pair_weights", d_pair_weights.to(_F32), _F32, (r.P,), dev)
    d_logits = torch.empty(T, E, dtype=_F32, device=dev)
    flags = torch.zeros(4, dtype=_I32, device=dev)
    cfg = _lib.RouterCfg(kind, top_k, int(renormalize))
    _run(logits, lib().moeblaze_router_backward, ctypes.byref(cfg), ptr(logits), dt, T, E,
         ptr(bias), device_code(logits), stream_of(logits), ctypes.byref(r), ptr(d_pair_weights),
         ptr(d_logits), flags.data_ptr())
    return d_logits


@router_backward.register_fake
def _(logits, bias, pair_offsets, pair_experts, pair_weights, d_pair_weights, kind, top_k,
      renormalize):
    _one_device(("logits", "bias", "pair_offsets", "pair_experts", "pair_weights",
                 "d_pair_weights"), logits, bias, pair_offsets, pair_experts, pair_weights,
                d_pair_weights)
    return logits.new_empty(logits.shape, dtype=torch.float32)


def _route_setup(ctx, inputs, output):
    logits, bias, kind, top_k, renormalize = inputs
    offsets, experts, weights, _ = output
    ctx.save_for_backward(logits, bias, offsets, experts, weights)
    ctx.cfg = (kind, top_k, renormalize)


def _route_backward(ctx, g_offsets, g_experts, g_weights, g_flags):
    logits, bias, offsets, experts, weights = ctx.saved_tensors
    if g_weights is None:
        return None, None, None, None, None
    d_logits = router_backward(logits, bias, offsets, experts, weights, g_weights, *ctx.cfg)
    return d_logits.to(logits.dtype), None, None, None, None


route.register_autograd(_route_backward, setup_context=_route_setup)


# ---------------------------------------------------------------------------------------------
# token rounding (SonicMoE): the rounded pair count is data-dependent
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("moeblaze::token_round", mutates_args=())
def token_round(logits: Tensor, bias: Optional[Tensor], pair_offsets: Tensor, pair_experts: Tensor,
                pair_weights: Tensor, kind: int, top_k: int, renormalize: bool, m_tile: int,
                mode: int, seed: int) -> Tuple[Tensor, Tensor, Tensor]:
    return _token_round_impl(logits, bias, pair_offsets, pair_experts, pair_weights, kind, top_k,
                             renormalize, m_tile, mode, seed)


def _token_round_impl(logits, bias, pair_offsets, pair_experts, pair_weights, kind, top_k,
                      renormalize, m_tile, mode, seed):
    """The body of moeblaze::token_round, callable without the op's dispatch (eager paths)."""
    logits, bias, T, E, dev, dt = _router_args(logits, bias, kind, top_k)
    _int("m_tile", m_tile, 1, _INT32_MAX)
    _code("mode", mode, _lib.ROUNDINGS)
    _int("seed", seed, 0, (1 << 63) - 1)  # the schema's int is int64: larger never gets here
    cfg = _lib.RouterCfg(kind, top_k, int(renormalize))
    topk = _routing_struct(T, E, pair_offsets, pair_experts, pair_weights, dev)
    P = ctypes.c_int64()
    if logits.is_cuda:
        # Two calls on the current stream, the workspace from torch's allocator: one host sync.
        nbytes = _round_workspace_bytes(T, E, device_code(logits))
        ws = _workspace(nbytes, dev)
        _run(logits, lib().moeblaze_token_round_count, ctypes.byref(cfg), m_tile, mode, seed,
             ptr(logits), dt, T, E, ptr(bias), device_code(logits), stream_of(logits),
             ctypes.byref(topk), ptr(ws), nbytes, ctypes.byref(P))
    else:
        handle = ctypes.c_void_p()
        _run(logits, lib().moeblaze_token_round, ctypes.byref(cfg), m_tile, mode, seed,
             ptr(logits), dt, T, E, ptr(bias), device_code(logits), stream_of(logits),
             ctypes.byref(topk), ctypes.byref(handle), ctypes.byref(P))
    offsets = torch.empty(T + 1, dtype=_I32, device=dev)
    experts = torch.empty(P.value, dtype=_I32, device=dev)
    weights = torch.empty(P.value, dtype=_F32, device=dev)
    out = _struct(_lib.Routing, (offsets, experts, weights), T, E, P.value)
    if logits.is_cuda:
        _run(logits, lib().moeblaze_token_round_fill, ctypes.byref(cfg), ptr(logits), dt, T, E,
             device_code(logits), stream_of(logits), ptr(ws), nbytes, ctypes.byref(out))
    else:
        _run(logits, lib().moeblaze_routing_take, handle, ctypes.byref(out), stream_of(logits))
    return offsets, experts, weights


@functools.lru_cache(maxsize=256)
def _round_workspace_bytes(T, E, dcode):
    """The two-call token rounding's workspace bytes, asked once per (T, E)."""
    nbytes = ctypes.c_uint64()
    check(lib().moeblaze_token_round_workspace_bytes(T, E, dcode, ctypes.byref(nbytes)))
    return nbytes.value


@token_round.register_fake
def _(logits, bias, pair_offsets, pair_experts, pair_weights, kind, top_k, renormalize, m_tile,
      mode, seed):
    _one_device(("logits", "bias", "pair_offsets", "pair_experts", "pair_weights"), logits, bias,
                pair_offsets, pair_experts, pair_weights)
    P = torch.library.get_ctx().new_dynamic_size()
    T = logits.shape[0]
    return (logits.new_empty(T + 1, dtype=_I32), logits.new_empty(P, dtype=_I32),
            logits.new_empty(P, dtype=torch.float32))


def _round_setup(ctx, inputs, output):
    logits, bias = inputs[0], inputs[1]
    ctx.save_for_backward(logits, bias, *output)
    ctx.cfg = (inputs[5], inputs[6], inputs[7])


def _round_backward(ctx, g_offsets, g_experts, g_weights):
    logits, bias, offsets, experts, weights = ctx.saved_tensors
    if g_weights is None:
        return (None,) * 11
    d_logits = router_backward(logits, bias, offsets, experts, weights, g_weights, *ctx.cfg)
    # The top-K routing only selected the pairs; every weight is recomputed from the logits.
    return (d_logits.to(logits.dtype),) + (None,) * 10


token_round.register_autograd(_round_backward, setup_context=_round_setup)


# ---------------------------------------------------------------------------------------------
# routing plan
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("moeblaze::build_plan", mutates_args=())
def build_plan(pair_offsets: Tensor, pair_experts: Tensor, pair_weights: Tensor,
               num_experts: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _build_plan_impl(pair_offsets, pair_experts, pair_weights, num_experts)


def _build_plan_impl(pair_offsets, pair_experts, pair_weights, num_experts):
    """The body of moeblaze::build_plan: the six arrays and flags."""
    plan, flags = _build_plan_built(pair_offsets, pair_experts, pair_weights, num_experts)
    return (*plan, flags)


def _build_plan_built(pair_offsets, pair_experts, pair_weights, num_experts):
    """(BuiltPlan, flags) of a routing, without the op's dispatch (eager paths)."""
    dev = _storage_device("pair_offsets", pair_offsets)
    if pair_offsets.dim() != 1 or pair_offsets.numel() < 1:
        _fail(f"pair_offsets must be (T+1,) with T >= 0, got shape {tuple(pair_offsets.shape)}")
    T, E = pair_offsets.numel() - 1, _int("num_experts", num_experts, 1, _INT32_MAX)
    r = _routing_struct(T, E, pair_offsets, pair_experts, pair_weights, dev)
    S = r.P
    eto = torch.empty(E + 1, dtype=_I32, device=dev)
    eti = torch.empty(S, dtype=_I32, device=dev)
    sw = torch.empty(S, dtype=_F32, device=dev)
    tpo = torch.empty(T + 1, dtype=_I32, device=dev)
    tei = torch.empty(S, dtype=_I32, device=dev)
    tim = torch.empty(S, dtype=_I32, device=dev)
    flags = torch.zeros(4, dtype=_I32, device=dev)
    dcode = device_code(pair_offsets)
    ws_bytes = _plan_workspace_bytes(T, E, S, dcode)
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device=dev) if ws_bytes else None
    plan = _struct(_lib.Plan, (eto, eti, sw, tpo, tei, tim), T, E, S)  # fresh: nothing to check
    _run(pair_offsets, lib().moeblaze_build_plan, ctypes.byref(r), dcode, stream_of(pair_offsets),
         ctypes.byref(plan), ptr(ws), ws_bytes, flags.data_ptr())
    return BuiltPlan((eto, eti, sw, tpo, tei, tim), plan), flags


def plan_from_ids(expert_ids: Tensor, expert_weights: Tensor, num_experts: int):
    """The plan (six arrays, as build_plan's) and flags (4,) of a fixed-K routing given as
    expert_ids (T, K) int32/int64 and expert_weights (T, K) fp32/bf16 on one device: what
    converting them and calling build_plan gives, bit for bit, in one C call (no torch kernels).
    An eager-mode helper, not an op: traced code converts and calls build_plan. The CPU raises
    ValueError naming a bad id as expert_ids[t, k]; CUDA raises the flags (check_flags)."""
    plan, flags = _plan_from_ids_built(expert_ids, expert_weights, num_experts)
    return (*plan, flags)


def _plan_from_ids_built(expert_ids, expert_weights, num_experts):
    """plan_from_ids as (BuiltPlan, flags)."""
    T, K = expert_ids.shape
    E = num_experts
    dev = expert_ids.device
    icode = _lib.ID_DTYPES.get(expert_ids.dtype)
    wcode = _lib.DTYPES.get(expert_weights.dtype)
    if icode is None or wcode is None or expert_weights.device != dev:
        _fail(f"plan_from_ids takes int32/int64 ids and fp32/bf16 weights on one device, got "
              f"{expert_ids.dtype} on {dev} and {expert_weights.dtype} on "
              f"{expert_weights.device}")
    ids, w = expert_ids.contiguous(), expert_weights.contiguous()
    S = T * K
    dcode = device_code(ids)
    # One int32 allocation holds four int32 arrays and the fp32 slot weights (same width);
    # token_expert_indices has its own, so a CUDA backward can let it go (without_token_experts).
    buf = torch.empty(E + 1 + T + 1 + 3 * S, dtype=_I32, device=dev)
    # split_with_sizes: Tensor.split's Python wrapper is host time before the step's first kernel.
    eto, tpo, eti, sw, tim = buf.split_with_sizes([E + 1, T + 1, S, S, S])
    tei = torch.empty(S, dtype=_I32, device=dev)
    sw = sw.view(_F32)
    # CUDA's C call zeroes the flags; the CPU raises instead of flagging.
    flags = torch.empty(4, dtype=_I32, device=dev) if dcode else torch.zeros(4, dtype=_I32)
    ws_bytes = _ids_workspace_bytes(T, K, E, dcode)
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device=dev) if ws_bytes else None
    plan = _struct(_lib.Plan, (eto, eti, sw, tpo, tei, tim), T, E, S)
    _run(ids, lib().moeblaze_plan_from_ids, ptr(ids), icode, ptr(w), wcode, T, K, E, dcode,
         stream_of(ids), ctypes.byref(plan), ptr(ws), ws_bytes, flags.data_ptr())
    return BuiltPlan((eto, eti, sw, tpo, tei, tim), plan), flags


@functools.lru_cache(maxsize=256)
def _ids_workspace_bytes(T, K, E, dcode):
    n = ctypes.c_uint64()
    check(lib().moeblaze_plan_from_ids_workspace_bytes(T, K, E, dcode, ctypes.byref(n)))
    return n.value


@functools.lru_cache(maxsize=256)
def _plan_workspace_bytes(T, E, S, dcode):
    """build_plan's workspace size: a function of the sizes alone, so asked once per shape."""
    n = ctypes.c_uint64()
    check(lib().moeblaze_plan_workspace_bytes(T, E, S, dcode, ctypes.byref(n)))
    return n.value


@build_plan.register_fake
def _(pair_offsets, pair_experts, pair_weights, num_experts):
    _one_device(_ROUTING_NAMES, pair_offsets, pair_experts, pair_weights)
    T, S = pair_offsets.shape[0] - 1, pair_experts.shape[0]
    e = pair_offsets.new_empty
    return (e(num_experts + 1, dtype=_I32), e(S, dtype=_I32), e(S, dtype=torch.float32),
            e(T + 1, dtype=_I32), e(S, dtype=_I32), e(S, dtype=_I32), e(4, dtype=_I32))


# ---------------------------------------------------------------------------------------------
# the experts (docs/DESIGN.md's eight steps)
# ---------------------------------------------------------------------------------------------
# LayerCfg.mode codes (capi.h): keep_h, recompute, keep_h with dH written over h in backward.
_MODE_KEEP_H, _MODE_RECOMPUTE, _MODE_DH_OVER_H = 0, 1, 2


def _experts_args(x, w1, w2, plan, activation, num_threads, mode, backward, compute=0,
                  fp8_cache=0):
    """(config, workspace bytes, device, x, w1, w2, plan struct) of an experts call, checked, the
    tensors contiguous."""
    dev = _storage_device("x", x)
    if x.dim() != 2:
        _fail(f"x must be (T, d), got shape {tuple(x.shape)}")
    if w1.dim() != 3 or w2.dim() != 3:
        _fail(f"w1 must be (E, w1_rows, d) and w2 (E, d, n), got {tuple(w1.shape)} and "
              f"{tuple(w2.shape)}")
    T, d = x.shape
    E, wd, n = w2.shape
    dt = _float_code(x, "x")
    _code("activation", activation, _lib.ACTIVATIONS)
    _int("num_threads", num_threads, 0, MAX_THREADS)
    _code("compute", compute, _lib.COMPUTES)
    _int("fp8_cache", fp8_cache, 0, (1 << 64) - 1)  # a handle; the C call checks it is alive
    if fp8_cache and compute == _lib.COMPUTES["storage"]:
        _fail(f"fp8_cache (an Fp8WeightCache's handle) is given, but compute is {compute}: the "
              "cache serves compute 1 and 2 (fp8, fp8-wgrad) only")
    if w1.dtype != x.dtype:
        _fail(f"w1 has dtype {w1.dtype} but x has {x.dtype}")
    if w2.dtype != x.dtype:
        _fail(f"w2 has dtype {w2.dtype} but x has {x.dtype}")
    # The C ABI takes raw pointers: every shape is checked here, where the shapes are known.
    rows = _w1_rows(activation, n)
    if w1.shape != (E, rows, d):
        _fail(f"w1 must be (E, w1_rows, d) = ({E}, {rows}, {d}) for activation code {activation} "
              f"(E and n from w2 {tuple(w2.shape)}, d from x), got {tuple(w1.shape)}")
    if wd != d:
        _fail(f"w2 must be (E, d, n) with d = {d} (from x), got {tuple(w2.shape)}")
    x = x.contiguous()
    w1 = _arg("w1", w1, x.dtype, (E, rows, d), dev)
    w2 = _arg("w2", w2, x.dtype, (E, d, n), dev)
    p = _plan_struct(T, E, plan, dev)
    cfg, ws_bytes = _layer_cfg(T, d, n, E, p.S, activation, dt, mode, num_threads, backward,
                               x.is_cuda, compute, fp8_cache)
    return cfg, ws_bytes, dev, x, w1, w2, p


@functools.lru_cache(maxsize=256)
def _layer_cfg(T, d, n, E, S, activation, dt, mode, num_threads, backward, cuda, compute=0,
               fp8_cache=0):
    """(LayerCfg, workspace bytes of the pass) of an experts call: functions of the sizes alone
    (and of MOEBLAZE_KERNELS, which the library reads once per process; the C ABI cannot change
    the kernel choice), so built once per shape (C only reads the struct). The workspace is
    PyTorch's on CUDA, sized per pass (backward needs far less than forward when dH goes over h);
    the CPU backend allocates its own (0 here). fp8_cache: an Fp8WeightCache's handle (its
    workspace holds no weight codes) or 0; the C call checks that it is alive."""
    # K only enters the C++ config's checks (1 <= K <= E): token rounding varies it per token.
    K = min(max(S // T if T > 0 else 1, 1), max(E, 1))
    cfg = _lib.LayerCfg(T, d, n, E, K, activation, dt, mode, num_threads, compute,
                        fp8_cache or None)
    if not cuda:
        return cfg, 0
    nbytes = ctypes.c_uint64()
    check(lib().moeblaze_layer_pass_workspace_bytes(ctypes.byref(cfg), S, 1, int(backward),
                                                    ctypes.byref(nbytes)))
    return cfg, nbytes.value


@functools.lru_cache(maxsize=256)
def _kept_h_bytes(T, d, n, E, activation, compute, S):
    """Bytes of the kept H of a bf16 call (e4m3 codes, then fp32 scales with fp8 compute), as the
    library lays it out: asked once per shape (K does not enter it)."""
    nbytes = ctypes.c_uint64()
    cfg = _lib.LayerCfg(T, d, n, E, 1, activation, _lib.DTYPES[torch.bfloat16], 0, 0, compute)
    check(lib().moeblaze_layer_kept_h_bytes(ctypes.byref(cfg), S, ctypes.byref(nbytes)))
    return nbytes.value


def _h_shape(cfg, S, activation):
    """(shape, dtype) of the kept H: (S, w1_rows) in x's dtype, or fp8 compute's bytes."""
    if cfg.compute == 0:
        return (S, _w1_rows(activation, cfg.n)), None
    return (_kept_h_bytes(cfg.T, cfg.d, cfg.n, cfg.E, activation, cfg.compute, S),), torch.uint8


def _workspace(nbytes, dev):
    return torch.empty(nbytes, dtype=torch.uint8, device=dev) if nbytes else None


def _w1_rows(activation, n):
    return 2 * n if activation in _GATED_CODES else n


@torch.library.custom_op("moeblaze::experts_forward", mutates_args=())
def experts_forward(x: Tensor, w1: Tensor, w2: Tensor, pair_weights: Tensor,
                    expert_token_offsets: Tensor, expert_token_indices: Tensor,
                    slot_weights: Tensor, token_pair_offsets: Tensor, token_expert_indices: Tensor,
                    token_index_map: Tensor, activation: int, recompute: bool,
                    num_threads: int, b1: Optional[Tensor] = None,
                    b2: Optional[Tensor] = None, compute: int = 0,
                    fp8_cache: int = 0) -> Tuple[Tensor, Tensor]:
    plan = (expert_token_offsets, expert_token_indices, slot_weights, token_pair_offsets,
            token_expert_indices, token_index_map)
    return _experts_forward_impl(x, w1, w2, plan, activation, recompute, num_threads, b1, b2,
                                pair_weights, compute, fp8_cache)


def _experts_forward_impl(x, w1, w2, plan, activation, recompute, num_threads, b1=None, b2=None,
                         pair_weights=None, compute=0, fp8_cache=0):
    """The body of moeblaze::experts_forward, callable without the op's dispatch (eager paths):
    (out, h); pair_weights, if given, is only checked (the kernels read slot_weights)."""
    mode = _MODE_RECOMPUTE if recompute else _MODE_KEEP_H
    cfg, ws_bytes, dev, x, w1, w2, p = _experts_args(x, w1, w2, plan, activation, num_threads,
                                                     mode, False, compute, fp8_cache)
    b1, b2 = _biases(b1, b2, x, cfg, activation, dev)
    S = p.S
    if pair_weights is not None:  # not read by the kernels: it only carries d_pair_weights back
        _arg("pair_weights", pair_weights, _F32, (S,), dev)
    out = torch.empty_like(x)
    shape, hdt = _h_shape(cfg, 0 if recompute else S, activation)
    h = x.new_empty(shape, dtype=hdt)  # recompute: empty
    ws = _workspace(ws_bytes, dev)
    _run(x, lib().moeblaze_layer_forward_biased, ctypes.byref(cfg), ctypes.byref(p),
         device_code(x), stream_of(x), ptr(x), ptr(w1), ptr(w2), ptr(b1), ptr(b2), ptr(out),
         ptr(h), ptr(ws), ws_bytes)
    return out, h


def _biases(b1, b2, x, cfg, activation, dev):
    """The optional expert biases b1 (E, w1_rows) and b2 (E, d), checked, contiguous (None
    stays None)."""
    rows = _w1_rows(activation, cfg.n)
    if b1 is not None:
        b1 = _arg("b1", b1, x.dtype, (cfg.E, rows), dev)
    if b2 is not None:
        b2 = _arg("b2", b2, x.dtype, (cfg.E, cfg.d), dev)
    return b1, b2


@experts_forward.register_fake
def _(x, w1, w2, pair_weights, eto, eti, sw, tpo, tei, tim, activation, recompute, num_threads,
      b1=None, b2=None, compute=0, fp8_cache=0):
    _one_device(("x", "w1", "w2", "pair_weights") + _PLAN_NAMES + ("b1", "b2"), x, w1, w2,
                pair_weights, eto, eti, sw, tpo, tei, tim, b1, b2)
    S = eti.shape[0]
    rows = _w1_rows(activation, w2.shape[2])
    if compute == 0:
        return torch.empty_like(x), x.new_empty((0, rows) if recompute else (S, rows))
    nbytes = 0 if recompute else _fp8_kept_h_bytes(S, rows)
    return torch.empty_like(x), x.new_empty(nbytes, dtype=torch.uint8)


def _fp8_kept_h_bytes(S, rows):
    """LayerConfig::kept_h_bytes with fp8 compute as a formula: S is symbolic under dynamic
    shapes, where the C call (and its cache) cannot take it; a test holds it to the library's."""
    codes = (S * rows + 15) // 16 * 16  # e4m3 codes, then the scales 16-byte aligned
    return codes + S * ((rows + 127) // 128) * 4  # fp32 scales, one per 128 columns of a row


def _writes_dh_over_h(x, recompute, dh_over_h):
    """Whether a backward asked for dh_over_h writes dH over the saved h: keep_h on CUDA only."""
    return dh_over_h and not recompute and x.is_cuda


def _experts_backward_impl(d_out, x, w1, w2, h, plan, activation, recompute, num_threads,
                           dh_over_h, b1, b2, compute=0, fp8_cache=0):
    # The mode enters the cached config, so it is chosen first.
    mode = (_MODE_RECOMPUTE if recompute else
            _MODE_DH_OVER_H if _writes_dh_over_h(x, recompute, dh_over_h) else _MODE_KEEP_H)
    cfg, ws_bytes, dev, x, w1, w2, p = _experts_args(x, w1, w2, plan, activation, num_threads,
                                                     mode, True, compute, fp8_cache)
    b1, b2 = _biases(b1, b2, x, cfg, activation, dev)
    S = p.S
    # An upstream gradient: any float dtype autograd hands over, read in x's dtype.
    if not d_out.is_floating_point():
        _fail(f"d_out must be floating point, got {d_out.dtype}")
    d_out = _arg("d_out", d_out.to(x.dtype), x.dtype, x.shape, dev)
    if not recompute:
        shape, hdt = _h_shape(cfg, S, activation)
        h = _arg("h", h, hdt or x.dtype, shape, dev)
    dx, dw1, dw2 = torch.empty_like(x), torch.empty_like(w1), torch.empty_like(w2)
    dpw = torch.empty(S, dtype=_F32, device=dev)
    # A bias's gradient, or an empty (0,) tensor standing for none (an op's outputs are tensors).
    db1 = torch.empty_like(b1) if b1 is not None else x.new_empty(0)
    db2 = torch.empty_like(b2) if b2 is not None else x.new_empty(0)
    ws = _workspace(ws_bytes, dev)
    _run(x, lib().moeblaze_layer_backward_biased, ctypes.byref(cfg), ctypes.byref(p),
         device_code(x), stream_of(x), ptr(x), ptr(w1), ptr(w2), ptr(b1), ptr(b2), ptr(d_out),
         None if recompute else ptr(h), ptr(dx), ptr(dw1), ptr(dw2), ptr(dpw),
         ptr(db1) if b1 is not None else None, ptr(db2) if b2 is not None else None, ptr(ws),
         ws_bytes)
    return dx, dw1, dw2, dpw, db1, db2


@torch.library.custom_op("moeblaze::experts_backward", mutates_args=())
def experts_backward(d_out: Tensor, x: Tensor, w1: Tensor, w2: Tensor, h: Tensor,
                     expert_token_offsets: Tensor, expert_token_indices: Tensor,
                     slot_weights: Tensor, token_pair_offsets: Tensor,
                     token_expert_indices: Tensor, token_index_map: Tensor, activation: int,
                     recompute: bool, num_threads: int, b1: Optional[Tensor] = None,
                     b2: Optional[Tensor] = None, compute: int = 0, fp8_cache: int = 0
                     ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dw1, dw2, d_pair_weights, db1, db2); db1 / db2 are empty (0,) without their bias."""
    plan = (expert_token_offsets, expert_token_indices, slot_weights, token_pair_offsets,
            token_expert_indices, token_index_map)
    return _experts_backward_impl(d_out, x, w1, w2, h, plan, activation, recompute, num_threads,
                                  False, b1, b2, compute, fp8_cache)


# The same, but on CUDA keep_h writes dH over h (S * w1_rows * 2 bytes less workspace). Declared
# as mutating h, so a second backward through the same saved h fails autograd's version check
# instead of reading dH as H. Used in eager mode only (see _experts_backward).
@torch.library.custom_op("moeblaze::experts_backward_dh_over_h", mutates_args=("h",))
def experts_backward_dh_over_h(d_out: Tensor, x: Tensor, w1: Tensor, w2: Tensor, h: Tensor,
                               expert_token_offsets: Tensor, expert_token_indices: Tensor,
                               slot_weights: Tensor, token_pair_offsets: Tensor,
                               token_expert_indices: Tensor, token_index_map: Tensor,
                               activation: int, recompute: bool, num_threads: int,
                               b1: Optional[Tensor] = None, b2: Optional[Tensor] = None,
                               compute: int = 0, fp8_cache: int = 0
                               ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    plan = (expert_token_offsets, expert_token_indices, slot_weights, token_pair_offsets,
            token_expert_indices, token_index_map)
    return _experts_backward_impl(d_out, x, w1, w2, h, plan, activation, recompute, num_threads,
                                  True, b1, b2, compute, fp8_cache)


@experts_backward.register_fake
def _experts_backward_fake(d_out, x, w1, w2, h, eto, eti, sw, tpo, tei, tim, activation,
                           recompute, num_threads, b1=None, b2=None, compute=0, fp8_cache=0):
    _one_device(("d_out", "x", "w1", "w2", "h") + _PLAN_NAMES + ("b1", "b2"), d_out, x, w1, w2, h,
                eto, eti, sw, tpo, tei, tim, b1, b2)
    return (torch.empty_like(x), torch.empty_like(w1), torch.empty_like(w2),
            x.new_empty(eti.shape[0], dtype=torch.float32),
            torch.empty_like(b1) if b1 is not None else x.new_empty(0),
            torch.empty_like(b2) if b2 is not None else x.new_empty(0))


experts_backward_dh_over_h.register_fake(_experts_backward_fake)


def _experts_setup(ctx, inputs, output):
    # h is an output only so that it can be saved; no gradient ever flows into it, and a
    # materialised zero gradient for it would cost an (S, w1_rows) allocation and fill per step.
    ctx.set_materialize_grads(False)
    x, w1, w2, _pw = inputs[:4]
    plan = inputs[4:10]
    b1, b2 = (inputs[13] if len(inputs) > 13 else None), (inputs[14] if len(inputs) > 14 else None)
    ctx.has_bias = (b1 is not None, b2 is not None)
    ctx.save_for_backward(x, w1, w2, output[1], b1, b2, *plan)
    ctx.cfg = inputs[10:13]
    ctx.compute = inputs[15] if len(inputs) > 15 else 0
    ctx.fp8_cache = inputs[16] if len(inputs) > 16 else 0


def _experts_backward(ctx, g_out, g_h):
    x, w1, w2, h, b1, b2, *plan = ctx.saved_tensors
    if g_out is None:
        return (None,) * 17
    # Eager: dH over the saved H (it is dead after this). Traced (torch.compile, export): the
    # non-mutating op, since a mutated saved activation is not something the partitioner takes.
    eager = type(h) is torch.Tensor and not torch.compiler.is_compiling()
    op = experts_backward_dh_over_h if eager else experts_backward
    dx, dw1, dw2, dpw, db1, db2 = op(g_out, x, w1, w2, h, *plan, *ctx.cfg, b1, b2, ctx.compute,
                                     ctx.fp8_cache)
    return ((dx, dw1, dw2, dpw) + (None,) * 9 + (db1 if ctx.has_bias[0] else None,
                                                 db2 if ctx.has_bias[1] else None, None, None))


experts_forward.register_autograd(_experts_backward, setup_context=_experts_setup)


# ---------------------------------------------------------------------------------------------
# device-side checks
# ---------------------------------------------------------------------------------------------
def validate_plan(expert_token_offsets: Tensor, expert_token_indices: Tensor,
                  slot_weights: Tensor, token_pair_offsets: Tensor, token_expert_indices: Tensor,
                  token_index_map: Tensor):
    """Raises ValueError naming the first bad entry and the broken rule when a routing plan you
    filled yourself (not build_plan's) is not valid: offsets monotone from 0 to S, every index in
    range, token_index_map a permutation under which the two views agree, slot weights finite.
    On CUDA it runs the device check on the current stream and reads its flag back (a host
    sync); the CUDA experts ops do not check plan contents themselves (a bad plan reads out of
    bounds), so call it on such a plan before them. The CPU ops always check such plans."""
    plan = (expert_token_offsets, expert_token_indices, slot_weights, token_pair_offsets,
            token_expert_indices, token_index_map)
    dev = _one_device(_PLAN_NAMES, *plan)
    _storage_device("expert_token_offsets", expert_token_offsets)
    _require(expert_token_offsets.dim() == 1 and token_pair_offsets.dim() == 1,
             "expert_token_offsets and token_pair_offsets must be 1-D (E+1,) and (T+1,)")
    E, T = expert_token_offsets.numel() - 1, token_pair_offsets.numel() - 1
    _require(E >= 1 and T >= 0, f"expert_token_offsets must have E+1 >= 2 entries and "
             f"token_pair_offsets T+1 >= 1, got {E + 1} and {T + 1}")
    p = _plan_struct(T, E, plan, dev)
    check(lib().moeblaze_validate_plan_sync(ctypes.byref(p), device_code(expert_token_offsets),
                                            stream_of(expert_token_offsets)))


def check_flags(flags: Tensor, routing: Optional[Tuple[Tensor, Tensor, Tensor]] = None,
                num_experts: int = 0):
    """Raises ValueError when a CUDA op raised its device-side flags: with the validator's message
    naming the first bad entry when `routing` (pair_offsets, pair_experts, pair_weights) is given,
    else saying that the router saw a NaN/Inf logit. Reads the flags back (a host sync): call it
    outside CUDA graphs, e.g. once in a while in a training loop, or in tests."""
    host = flags.detach().to("cpu", torch.int32).contiguous()
    if not bool(host.any()):
        return
    r = None
    dev = 0
    if routing is not None:
        offsets, experts, weights = routing
        r = _routing_struct(offsets.numel() - 1, num_experts, offsets, experts, weights,
                            _storage_device("pair_offsets", offsets))
        dev = device_code(offsets)
    check(lib().moeblaze_routing_flags_error(host.data_ptr(),
                                             ctypes.byref(r) if r is not None else None, dev))
