"""moeblaze.integrations.torchtitan: TorchTitan's MoE layer with moeblaze's experts, against
(a) a re-statement of TorchTitan 0.3's MoE math in this file (its router, grouped SwiGLU experts,
combine and the tokens_per_expert_E / expert_bias_E bookkeeping; same parameter names and
layout: torchtitan/models/common/moe.py), always; and (b) TorchTitan's own module on the same
weights and tokens where `torchtitan.models.common.moe` imports (pip install torchtitan; it also
needs the spmd_types and tyro packages), skipped otherwise."""
import copy
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moeblaze
from helpers import TOL, rel_err
from moeblaze.integrations import torchtitan as mb_titan

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


# ---- the re-statement ------------------------------------------------------------------------
class LocalTokenDispatcher:
    """Stands for TorchTitan's local (no expert parallelism) dispatcher: the adapter checks its
    name."""


class TitanRouter(nn.Module):
    def __init__(self, dim, E, K, score_func, route_norm, route_scale):
        super().__init__()
        self.gate = nn.Linear(dim, E, bias=False)
        self.top_k, self.score_func = K, score_func
        self.route_norm, self.route_scale = route_norm, route_scale

    def forward(self, x_BLD, expert_bias_E=None):
        scores = F.linear(x_BLD.float(), self.gate.weight.float())  # TorchTitan: fp32 gate
        scores = torch.sigmoid(scores) if self.score_func == "sigmoid" else scores.softmax(-1)
        choice = scores if expert_bias_E is None else scores + expert_bias_E
        _, ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)
        top = scores.gather(-1, ids)  # the bias selects only; the weights are the scores
        if self.route_norm:
            top = top / (top.sum(-1, keepdim=True) + 1e-20)
        return top * self.route_scale, ids, scores


class TitanGroupedExperts(nn.Module):
    def __init__(self, dim, hidden, E, compute_dtype):
        super().__init__()
        self.w1_EFD = nn.Parameter(torch.empty(E, hidden, dim))
        self.w2_EDF = nn.Parameter(torch.empty(E, dim, hidden))
        self.w3_EFD = nn.Parameter(torch.empty(E, hidden, dim))
        self.compute_dtype = compute_dtype  # TorchTitan: bf16; None: x's dtype

    def forward(self, x_RD, counts_E):
        dt = self.compute_dtype or x_RD.dtype
        outs, start = [], 0
        for e, c in enumerate(counts_E.tolist()):
            xe = x_RD[start:start + c].to(dt)
            h = F.silu(xe @ self.w1_EFD[e].to(dt).t()) * (xe @ self.w3_EFD[e].to(dt).t())
            outs.append(h @ self.w2_EDF[e].to(dt).t())
            start += c
        return torch.cat(outs).type_as(x_RD)


class TitanRoutedExperts(nn.Module):
    def __init__(self, dim, hidden, E, K, compute_dtype):
        super().__init__()
        self.inner_experts = TitanGroupedExperts(dim, hidden, E, compute_dtype)
        self.token_dispatcher = LocalTokenDispatcher()
        self.top_k = K

    def forward(self, x_BLD, scores_BLK, ids_BLK, counts_E):
        B, L, D = x_BLD.shape
        x = x_BLD.reshape(-1, D)
        order = torch.argsort(ids_BLK.reshape(-1), stable=True)  # pairs sorted by expert
        scores = scores_BLK.reshape(-1)[order]
        tok = order // self.top_k
        y = self.inner_experts(x[tok], counts_E)
        y = (y.float() * scores.reshape(-1, 1)).to(y.dtype)  # the combine: scores in fp32
        out = torch.zeros_like(x).index_add_(0, tok, y)
        return out.reshape(B, L, D)


class TitanStyleMoE(nn.Module):
    """TorchTitan 0.3's MoE (torchtitan/models/common/moe.py) restated: same attribute names and
    shapes, the same forward math (bf16 grouped experts by default) and buffers."""

    def __init__(self, dim=16, hidden=12, E=4, K=2, score_func="sigmoid", route_norm=True,
                 route_scale=1.0, load_balance_coeff=1e-3, compute_dtype=torch.bfloat16):
        super().__init__()
        self.routed_experts = TitanRoutedExperts(dim, hidden, E, K, compute_dtype)
        self.router = TitanRouter(dim, E, K, score_func, route_norm, route_scale)
        self.shared_experts = None
        self.load_balance_coeff = load_balance_coeff
        self.register_buffer("expert_bias_E", torch.zeros(E) if load_balance_coeff else None)
        self.register_buffer("tokens_per_expert_E", torch.zeros(E), persistent=False)

    def forward(self, x_BLD):
        scores_BLK, ids_BLK, scores_BLE = self.router(x_BLD, self.expert_bias_E)
        counts = torch.zeros_like(scores_BLE, dtype=torch.bool).scatter_(-1, ids_BLK, True)
        counts = counts.sum(dim=(0, 1))
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert_E.add_(counts)
        return self.routed_experts(x_BLD, scores_BLK, ids_BLK, counts)


def titan_bias_update(moe):
    """TorchTitan's optimizer-step pre-hook for auxiliary-loss-free balancing, restated:
    expert_bias_E += coeff * sign(mean(tokens) - tokens), then the count restarts."""
    with torch.no_grad():
        tpe = moe.tokens_per_expert_E
        moe.expert_bias_E.add_(moe.load_balance_coeff * torch.sign(tpe.mean() - tpe))
        tpe.zero_()


def _init(moe, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def _step(moe, x, d_out):
    moe.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = moe(x)
    out.backward(d_out)
    grads = {n: p.grad for n, p in moe.named_parameters()}
    return out.detach(), x.grad, grads


def _compare(a, b, tol, what):
    out, dx, g = a
    ref_out, ref_dx, ref_g = b
    errs = {"out": rel_err(out, ref_out), "dx": rel_err(dx, ref_dx)}
    errs.update({n: rel_err(g[n], ref_g[n]) for n in ref_g})
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"{what}: relative errors above {tol}: {bad} (all: {errs})"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("score_func,route_norm,route_scale",
                         [("sigmoid", True, 1.0), ("softmax", False, 2.5)])
def test_adapter_matches_restated_torchtitan(seed, device, score_func, route_norm, route_scale):
    # The GPU computes in bf16 with d, n multiples of 64; the CPU in fp32 (against the
    # re-statement computing in fp32 too: the layer's fp32 tolerance).
    dim, hidden = (64, 64) if device == "cuda" else (16, 12)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ref = TitanStyleMoE(dim, hidden, 4, 2, score_func, route_norm, route_scale,
                        compute_dtype=None)
    _init(ref, seed)
    with torch.no_grad():  # a non-zero balancing bias, so that it takes part in the selection
        ref.expert_bias_E.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    ref = ref.to(device, dtype).train()
    ref.expert_bias_E.data = ref.expert_bias_E.float()  # the buffer stays fp32, as TorchTitan's
    moe = copy.deepcopy(ref)
    assert mb_titan.use_moeblaze(moe) == [moe]
    x = torch.randn(3, 7, dim, device=device, dtype=dtype)
    d_out = torch.randn_like(x)
    got, want = _step(moe, x, d_out), _step(ref, x, d_out)
    _compare(got, want, TOL[dtype], f"{score_func} on {device}")
    assert torch.equal(moe.tokens_per_expert_E, ref.tokens_per_expert_E)
    assert float(moe.tokens_per_expert_E.sum()) == 3 * 7 * 2
    # The load-balancing update (TorchTitan's optimizer hook) reads the adapter's count the same.
    titan_bias_update(moe)
    titan_bias_update(ref)
    assert torch.equal(moe.expert_bias_E, ref.expert_bias_E)
    # Evaluation does not count.
    moe.eval()
    with torch.no_grad():
        moe(x)
    assert float(moe.tokens_per_expert_E.sum()) == 0
    del moe.forward  # TorchTitan's own forward back
    assert torch.equal(moe(x), ref.eval()(x))


def test_adapter_against_bf16_grouped_experts(seed):
    """TorchTitan's experts compute in bf16: the fp32 adapter lies within bf16's tolerance."""
    ref = TitanStyleMoE()  # bf16 experts, as TorchTitan's
    _init(ref, seed)
    moe = copy.deepcopy(ref)
    mb_titan.use_moeblaze(moe)
    x = torch.randn(2, 9, 16)
    d_out = torch.randn_like(x)
    _compare(_step(moe, x, d_out), _step(ref, x, d_out), TOL[torch.bfloat16], "bf16 experts")


def test_adapter_refusals():
    with pytest.raises(ValueError, match="no TorchTitan MoE found"):
        mb_titan.use_moeblaze(nn.Linear(2, 2))
    moe = TitanStyleMoE()
    _init(moe, 0)
    mb_titan.use_moeblaze(moe)
    moe.routed_experts.token_dispatcher = types.SimpleNamespace()
    with pytest.raises(ValueError, match="local token dispatcher only"):
        moe(torch.randn(1, 3, 16))


# ---- TorchTitan's own module -----------------------------------------------------------------
def _titan_moe(dim, hidden, E, K, score_func, route_norm):
    titan = pytest.importorskip(
        "torchtitan.models.common.moe",
        reason="torchtitan (0.3: torchtitan.models.common.moe) is not importable here")
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher as Dispatcher
    cfg = titan.MoE.Config(
        num_experts=E,
        routed_experts=titan.RoutedExperts.Config(
            inner_experts=titan.GroupedExperts.Config(dim=dim, hidden_dim=hidden, num_experts=E),
            token_dispatcher=Dispatcher.Config(num_experts=E, top_k=K)),
        router=titan.TokenChoiceTopKRouter.Config(
            num_experts=E, gate=Linear.Config(in_features=dim, out_features=E), top_k=K,
            score_func=score_func, route_norm=route_norm),
        load_balance_coeff=1e-3)
    return cfg.build()


@pytest.mark.filterwarnings("ignore:In CPU autocast")  # TorchTitan's fp32 autocast on the CPU
@pytest.mark.parametrize("score_func,route_norm", [("sigmoid", True), ("softmax", False)])
def test_adapter_matches_torchtitan(seed, score_func, route_norm):
    titan = _titan_moe(16, 16, 4, 2, score_func, route_norm)  # _grouped_mm: 16-byte strides
    _init(titan, seed)
    with torch.no_grad():
        titan.expert_bias_E.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    titan.train()
    moe = copy.deepcopy(titan)
    assert mb_titan.use_moeblaze(moe) == [moe]
    x = torch.randn(2, 9, 16)
    d_out = torch.randn_like(x)
    # TorchTitan's grouped experts compute in bf16, moeblaze's here in fp32: bf16's tolerance.
    _compare(_step(moe, x, d_out), _step(titan, x, d_out), TOL[torch.bfloat16], score_func)
    assert torch.equal(moe.tokens_per_expert_E, titan.tokens_per_expert_E)
    # The restatement above agrees with TorchTitan's module on the same weights (bf16 experts).
    ref = TitanStyleMoE(16, 16, 4, 2, score_func, route_norm)
    ref.load_state_dict(titan.state_dict())
    ref.train()
    _compare(_step(ref, x, d_out), _step(titan, x, d_out), TOL[torch.bfloat16], "restatement")
