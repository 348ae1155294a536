"""Expert parallelism over a torch.distributed process group (docs/EXPERT_PARALLEL.md, "From
PyTorch").

The E experts are sharded over the W ranks of the group: rank r owns the contiguous block
[r * E/W, (r+1) * E/W) (E % W == 0 is required). Each rank routes its own tokens, sends every
token once to each rank that owns at least one of its experts (deduplicated: a token that chose
two experts of rank r travels to r once, with both (local expert, weight) pairs), the local
experts run there through moeblaze's ops over a CSR routing of the received rows, and the
weighted partial sums travel back and are combined on the source rank in ascending rank order,
in fp32 from 0, stored once in the dtype (no atomics: deterministic run to run).

    moe = moeblaze.ExpertParallelMoE(d, n, E, K, group=None)   # default group
    out, losses = moe(x)           # x: this rank's tokens; collective: every rank calls it
    (loss(out) + losses.total).backward()
    # gate.weight is replicated: all-reduce its gradient like any data-parallel parameter;
    # w1 / w2 hold this rank's experts only, and their gradients are complete on this rank.

Communication per forward: one all_to_all_single of a (W, 9) int64 tensor (counts, this rank's
verdict and what every rank must agree on: d, n, E/W, dtype, activation, requires-grad bits), one of the pairs (int32: local expert and weight bits),
one of the token rows, one of the partial results back. Backward: the reverse of the last
three (d_out rows out, dx partials back, d pair weights back).

Host synchronisation: ONE per forward, reading the exchanged counts back to size the buffers
and the splits (`.tolist()` right after the count exchange); backward reuses those sizes and
never synchronises. Everything else stays on the tensors' device, so the same code runs over
NCCL with CUDA tensors (tested with gloo on the CPU and with NCCL on 2 GPUs).
"""
import math

import torch
from torch import nn

from . import _lib, ops
from .layer import (MoE, _activation_code, _init_moe_module, experts_from_routing,
                    router_losses)

try:
    import torch.distributed as dist
except ImportError:  # pragma: no cover - torch built without distributed
    dist = None


def _group_info(group):
    if dist is None or not dist.is_available():
        raise RuntimeError("moeblaze: expert parallelism needs torch.distributed, which this "
                           "torch build does not have")
    if not dist.is_initialized():
        raise RuntimeError("moeblaze: expert parallelism needs an initialised process group "
                           "(torch.distributed.init_process_group)")
    return dist.get_rank(group), dist.get_world_size(group)


def ep_shard(num_experts, world_size, rank):
    """(first expert, number of experts) held by `rank`; ValueError unless E % W == 0."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"moeblaze: rank ({rank}) must be in [0, world_size = {world_size})")
    if num_experts < 1 or num_experts % world_size != 0:
        raise ValueError(f"moeblaze: num_experts E ({num_experts}) is not divisible by "
                         f"world_size ({world_size}) of the process group: every rank holds an "
                         "equal contiguous block of experts")
    e_local = num_experts // world_size
    return rank * e_local, e_local


def _a2a(inp, out_splits, in_splits, group):
    """all_to_all_single over dim 0 with host-side splits (no sync)."""
    out = inp.new_empty((sum(out_splits),) + tuple(inp.shape[1:]))
    dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=group)
    return out


class _Plan:
    """The dispatch of one forward (shared by its backward). Sent rows are ordered by destination
    rank, then token id ascending; a rank's received rows are ordered by source rank, then the
    source's token id (so an expert sees its tokens in global token order)."""

    def __init__(self, group, world, T, send_tok, table, tok_send, tok_recv, pair_send,
                 pair_recv):
        self.group, self.world, self.T = group, world, T
        self.send_tok = send_tok    # (N,) int64: token of each sent row
        self.table = table          # (W, T) int64: row of (rank r, token t) in the sent order, N if none
        self.tok_send, self.tok_recv = tok_send, tok_recv      # per-rank row counts (host)
        self.pair_send, self.pair_recv = pair_send, pair_recv  # per-rank pair counts (host)

    def combine(self, rows, dtype):
        """out_t = sum over ranks r ascending of rows[table[r, t]], fp32 from 0, stored once."""
        d = rows.shape[1]
        ext = torch.cat([rows.float(), rows.new_zeros((1, d), dtype=torch.float32)])
        acc = torch.zeros((self.T, d), dtype=torch.float32, device=rows.device)
        for r in range(self.world):
            acc += ext[self.table[r]]
        return acc.to(dtype)


class _Dispatch(torch.autograd.Function):
    """x (T, d) -> the rows this rank receives (R, d). Backward: the row gradients go back and
    are combined per token in rank order."""

    @staticmethod
    def forward(ctx, x, plan):
        ctx.plan, ctx.dtype = plan, x.dtype
        return _a2a(x[plan.send_tok], plan.tok_recv, plan.tok_send, plan.group)

    @staticmethod
    def backward(ctx, g):
        p = ctx.plan
        return p.combine(_a2a(g.to(ctx.dtype), p.tok_send, p.tok_recv, p.group), ctx.dtype), None


class _Combine(torch.autograd.Function):
    """Partial results of the received rows (R, d) -> out (T, d) on the source rank. Backward:
    d_out rows go to the ranks the tokens used."""

    @staticmethod
    def forward(ctx, y_recv, plan):
        ctx.plan, ctx.dtype = plan, y_recv.dtype
        return plan.combine(_a2a(y_recv, plan.tok_send, plan.tok_recv, plan.group), y_recv.dtype)

    @staticmethod
    def backward(ctx, g):
        p = ctx.plan
        return _a2a(g.to(ctx.dtype)[p.send_tok], p.tok_recv, p.tok_send, p.group), None


class _PairExchange(torch.autograd.Function):
    """Sorted pairs (weight, code = local expert * 2 + first-pair-of-its-row flag) -> received
    pairs, in one int32 message (the weight travels as its bits). Backward: the weights'
    gradients go back."""

    @staticmethod
    def forward(ctx, weights, codes, plan):
        ctx.plan = plan
        packed = torch.stack([codes, weights.detach().float().contiguous().view(torch.int32)], 1)
        got = _a2a(packed, plan.pair_recv, plan.pair_send, plan.group)
        codes_recv = got[:, 0].contiguous()
        ctx.mark_non_differentiable(codes_recv)
        return got[:, 1].contiguous().view(torch.float32), codes_recv

    @staticmethod
    def backward(ctx, gw, _gc):
        p = ctx.plan
        if gw is None:
            return None, None, None
        return _a2a(gw.float(), p.pair_send, p.pair_recv, p.group), None, None


_DTYPE_CODE = {torch.bfloat16: 1, torch.float32: 2, torch.float16: 3}


def ep_experts_from_routing(x, w1, w2, pair_offsets, pair_experts, pair_weights, num_experts,
                            group=None, activation="swiglu", recompute=False, num_threads=0,
                            _local_error=None):
    """Expert-parallel experts over this rank's routing (moeblaze's CSR form with GLOBAL expert
    ids: pair_offsets (T+1,) int32, pair_experts (P,) int32, pair_weights (P,) float32,
    differentiable). x (T, d) this rank's tokens; w1 (E/W, rows, d), w2 (E/W, d, n) this rank's
    experts. Collective: every rank of `group` calls it. Returns out (T, d); autograd reaches x,
    w1, w2 and pair_weights. _local_error (internal): an exception this rank met before the call
    (ExpertParallelMoE.forward's routing); it is agreed like a bad argument, then raised."""
    rank, W = _group_info(group)
    first_e, E_loc = ep_shard(num_experts, W, rank)
    act_code = _activation_code(activation)  # an unknown name raises on every rank alike
    # Local checks; the verdict travels with the counts so that a bad argument on one rank makes
    # every rank raise (none is left waiting in a later collective). Any exception here counts:
    # a rank that raised alone would leave the others blocked in the count exchange.
    err = None
    try:
        if _local_error is not None:
            raise _local_error
        if x.dim() != 2:
            raise ValueError(f"moeblaze: x must be (T, d), got {tuple(x.shape)}")
        T, d = x.shape
        n = w2.shape[2] if w2.dim() == 3 else -1
        rows = 2 * n if activation in _lib.GATED else n
        if tuple(w2.shape) != (E_loc, d, n) or tuple(w1.shape) != (E_loc, rows, d):
            raise ValueError(f"moeblaze: w1 must be (E/W, w1_rows, d) = ({E_loc}, {rows}, {d}) "
                             f"and w2 (E/W, d, n) = ({E_loc}, {d}, n) on rank {rank} (E = "
                             f"{num_experts}, W = {W}), got {tuple(w1.shape)} and "
                             f"{tuple(w2.shape)}")
        if pair_offsets.numel() != T + 1 or pair_weights.numel() != pair_experts.numel():
            raise ValueError(f"moeblaze: pair_offsets must be (T+1,) = ({T + 1},) and pair_weights "
                             f"match pair_experts, got {tuple(pair_offsets.shape)}, "
                             f"{tuple(pair_experts.shape)}, {tuple(pair_weights.shape)}")
        for name, t in (("w1", w1), ("w2", w2)):
            if t.dtype != x.dtype or t.device != x.device:
                raise ValueError(f"moeblaze: {name} is {t.dtype} on {t.device}, x is {x.dtype} "
                                 f"on {x.device} (rank {rank}): they must match")
        if x.dtype not in _DTYPE_CODE:
            raise ValueError(f"moeblaze: x dtype {x.dtype} is not bf16, fp16 or fp32")
        if x.device.type == "cpu" and pair_experts.numel() > 0:  # a free check on the CPU only
            lo, hi = int(pair_experts.min()), int(pair_experts.max())
            if lo < 0 or hi >= num_experts:
                raise ValueError(f"moeblaze: pair_experts has expert id {lo if lo < 0 else hi} "
                                 f"outside [0, num_experts = {num_experts})")
    except Exception as e:  # noqa: BLE001 - agreed with the other ranks, re-raised below
        err, T, d, n = e, 0, 0, 0
    # The exchange runs on the rank's own device: w1's (the module's) when x was the problem.
    dev = x.device if err is None else w1.device
    dtype_code = _DTYPE_CODE.get(x.dtype, 0)
    # Which gradients autograd will ask for decides which exchanges backward runs: the ranks must
    # agree on it, or one would wait in a backward collective the others never enter.
    grad_code = 0
    if err is None and torch.is_grad_enabled():
        grad_code = (int(x.requires_grad) | 2 * int(w1.requires_grad or w2.requires_grad)
                     | 4 * int(pair_weights.requires_grad))
    P = pair_experts.numel() if err is None else 0

    # ---- dispatch lists (on the device, no sync) -----------------------------------------
    if err is None:
        cnt = (pair_offsets[1:] - pair_offsets[:-1]).long()
        tok = torch.repeat_interleave(torch.arange(T, device=dev), cnt, output_size=P)
        e = pair_experts.long()
        dst = torch.div(e, E_loc, rounding_mode="floor")
        order = torch.argsort(dst * max(T, 1) + tok, stable=True)  # rank, token, pair order
        dst_s, tok_s = dst[order], tok[order]
        first = torch.ones(P, dtype=torch.bool, device=dev)
        if P > 1:
            first[1:] = (dst_s[1:] != dst_s[:-1]) | (tok_s[1:] != tok_s[:-1])
        tokens_to = torch.zeros(W, dtype=torch.int64, device=dev).scatter_add_(
            0, dst_s, first.long())
        pairs_to = torch.zeros(W, dtype=torch.int64, device=dev).scatter_add_(
            0, dst_s, torch.ones_like(dst_s))
    else:
        tokens_to = pairs_to = torch.zeros(W, dtype=torch.int64, device=dev)
    meta = torch.stack([tokens_to, pairs_to] + [torch.full_like(tokens_to, v) for v in
                        (0 if err is None else 1, d, n, E_loc, dtype_code, act_code,
                         grad_code)], 1)

    # ---- the count exchange and THE host sync of the forward ---------------------------------
    meta_recv = torch.empty_like(meta)
    dist.all_to_all_single(meta_recv, meta.contiguous(), group=group)
    host = torch.cat([meta, meta_recv]).tolist()  # host sync: sizes the buffers below
    sent, got = host[:W], host[W:]
    failed = [q for q in range(W) if got[q][2]]
    if err is not None:
        raise err
    if failed:
        raise ValueError(f"moeblaze: expert-parallel call failed on rank(s) {failed} (see their "
                         "error); nothing was exchanged")
    mine = [d, n, E_loc, dtype_code, act_code, grad_code]
    for q in range(W):
        if got[q][3:] != mine:
            raise ValueError(f"moeblaze: rank {q} has (d, n, E/W, dtype, activation, "
                             f"requires_grad bits) = "
                             f"{tuple(got[q][3:])} but rank {rank} has {tuple(mine)}: the ranks "
                             "must agree")
    tok_send = [r[0] for r in sent]
    plan_pairs_send = [r[1] for r in sent]
    tok_recv = [r[0] for r in got]
    pair_recv = [r[1] for r in got]
    N = sum(tok_send)

    # ---- rows to send (sizes now known on the host; still no sync) --------------------------
    slot = torch.cumsum(first.long(), 0) - 1  # sent row of each sorted pair
    send_tok = torch.zeros(N, dtype=torch.int64, device=dev).scatter_(0, slot, tok_s)
    send_dst = torch.zeros(N, dtype=torch.int64, device=dev).scatter_(0, slot, dst_s)
    table = torch.full((W, T), N, dtype=torch.int64, device=dev)
    table[send_dst, send_tok] = torch.arange(N, device=dev)
    plan = _Plan(group, W, T, send_tok, table, tok_send, tok_recv, plan_pairs_send, pair_recv)

    codes = ((e[order] - dst_s * E_loc) * 2 + first.long()).to(torch.int32)
    w_recv, codes_recv = _PairExchange.apply(pair_weights[order], codes, plan)
    x_recv = _Dispatch.apply(x, plan)

    # ---- local experts over the received rows (moeblaze's ops, their own autograd) ----------
    R = x_recv.shape[0]
    codes_recv = codes_recv.long()
    row = torch.cumsum(codes_recv & 1, 0) - 1
    per_row = torch.zeros(R, dtype=torch.int64, device=dev).scatter_add_(
        0, row, torch.ones_like(row))
    offsets = torch.zeros(R + 1, dtype=torch.int32, device=dev)
    offsets[1:] = torch.cumsum(per_row, 0)
    y_recv = experts_from_routing(x_recv, w1, w2, offsets, (codes_recv >> 1).to(torch.int32),
                                  w_recv, activation, recompute, num_threads)
    return _Combine.apply(y_recv, plan)


def ep_moe_experts(x, w1, w2, expert_ids, expert_weights, num_experts, group=None,
                   activation="swiglu", recompute=False):
    """ep_experts_from_routing with a (T, K) routing: expert_ids (global ids), expert_weights
    (differentiable)."""
    if expert_ids.dim() != 2 or expert_weights.shape != expert_ids.shape:
        raise ValueError(f"moeblaze: expert_ids and expert_weights must both be (T, K), got "
                         f"{tuple(expert_ids.shape)} and {tuple(expert_weights.shape)}")
    T, K = expert_ids.shape
    offsets = torch.arange(0, T * K + 1, max(K, 1), dtype=torch.int32, device=x.device) \
        if K > 0 else torch.zeros(T + 1, dtype=torch.int32, device=x.device)
    # No range check here (a rank raising alone would leave the others in a collective): a bad
    # id stays out of range when narrowed, and ep_experts_from_routing agrees on the error.
    err, ids = None, expert_ids
    try:
        ids = ops.expert_ids_int32(expert_ids, num_experts, check_range=False)
    except ValueError as e:
        err = e
    return ep_experts_from_routing(x, w1, w2, offsets, ids.reshape(-1),
                                   expert_weights.to(torch.float32).reshape(-1), num_experts,
                                   group, activation, recompute, _local_error=err)


class ExpertParallelMoE(nn.Module):
    """moeblaze.MoE with its experts sharded over a torch.distributed process group.

    Parameters: gate (nn.Linear d -> E, replicated: every rank must hold the same values, and its
    gradient covers this rank's tokens only, so all-reduce it as a data-parallel parameter), w1
    (E/W, rows, d) and w2 (E/W, d, n): this rank's experts [rank * E/W, (rank+1) * E/W), whose
    gradients are complete on this rank. Router losses are computed over this rank's tokens.
    No token rounding (the rounded pair count would need a global decision)."""

    token_rounding = None  # MoE.route reads it

    def __init__(self, hidden_size, intermediate_size, num_experts, top_k, activation="swiglu",
                 router="softmax_topk", renormalize=False, recompute=False, aux_loss_coef=0.0,
                 z_loss_coef=0.0, group=None, device=None, dtype=None):
        super().__init__()
        self.group = group
        self.rank, self.world_size = _group_info(group)
        self.expert_start, self.num_local_experts = ep_shard(num_experts, self.world_size,
                                                             self.rank)
        _init_moe_module(self, hidden_size, intermediate_size, num_experts, top_k, activation,
                         router, renormalize, recompute, aux_loss_coef, z_loss_coef,
                         self.num_local_experts, device, dtype)
        nn.init.uniform_(self.w1, -1 / math.sqrt(hidden_size), 1 / math.sqrt(hidden_size))
        nn.init.uniform_(self.w2, -1 / math.sqrt(intermediate_size),
                         1 / math.sqrt(intermediate_size))

    @classmethod
    def from_moe(cls, moe, group=None):
        """This rank's shard of a (replicated) moeblaze.MoE: its gate, expert_bias and experts
        [rank * E/W, (rank+1) * E/W)."""
        if moe.token_rounding is not None:
            raise ValueError("moeblaze: ExpertParallelMoE has no token rounding")
        if getattr(moe, "shared_expert", None) is not None:
            raise ValueError("moeblaze: ExpertParallelMoE has no shared expert (moe.shared_expert "
                             "must be None); keep the shared expert as a data-parallel module")
        w = moe.w1
        m = cls(moe.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k,
                moe.activation, moe.router, moe.renormalize, moe.recompute, moe.aux_loss_coef,
                moe.z_loss_coef, group, device=w.device, dtype=w.dtype)
        s, c = m.expert_start, m.num_local_experts
        with torch.no_grad():
            m.gate.weight.copy_(moe.gate.weight)
            m.w1.copy_(moe.w1[s:s + c])
            m.w2.copy_(moe.w2[s:s + c])
            if m.expert_bias is not None:
                m.expert_bias.copy_(moe.expert_bias)
        return m

    def extra_repr(self):
        return (f"d={self.hidden_size}, n={self.intermediate_size}, E={self.num_experts}, "
                f"K={self.top_k}, experts [{self.expert_start}, "
                f"{self.expert_start + self.num_local_experts}) of world_size "
                f"{self.world_size}, activation={self.activation}, router={self.router}")

    route = MoE.route  # logits in torch (fp32), moeblaze's ops.route
    _rounding_args = MoE._rounding_args  # route reads it (token_rounding is None here)

    def forward(self, x):
        shape = x.shape
        try:  # a failure here is agreed with the other ranks (none is left waiting)
            if shape[-1] != self.hidden_size:
                raise ValueError(f"moeblaze: x has last dimension {shape[-1]}, expected "
                                 f"hidden_size {self.hidden_size}")
            x2 = x.reshape(-1, self.hidden_size)
            logits, offsets, experts, weights = self.route(x2)
        except Exception as e:  # noqa: BLE001 - re-raised by ep_experts_from_routing
            ep_experts_from_routing(x, self.w1, self.w2, None, None, None, self.num_experts,
                                    self.group, self.activation, self.recompute, _local_error=e)
            raise  # not reached: the call above raises e on this rank
        out = ep_experts_from_routing(x2, self.w1, self.w2, offsets, experts, weights,
                                      self.num_experts, self.group, self.activation,
                                      self.recompute)
        losses = router_losses(logits, experts, self.num_experts, self.router, self.aux_loss_coef,
                               self.z_loss_coef)
        return out.reshape(shape), losses
