"""moeblaze inside TorchTitan's MoE layer (torchtitan.models.common.moe.MoE, torchtitan 0.3).

    from moeblaze.integrations import torchtitan as mb_titan
    mb_titan.use_moeblaze(model)        # every TorchTitan MoE in the model runs moeblaze's experts

TorchTitan stays in charge of the routing and its bookkeeping: its TokenChoiceTopKRouter gives
the top-K scores and expert ids (softmax or sigmoid scores, the load-balancing expert_bias_E in
the selection only, node-limited groups, route_norm, route_scale), the layer's
tokens_per_expert_E buffer counts the tokens each expert got (in training, as TorchTitan's own
forward does, so its optimizer-step hook that updates expert_bias_E keeps working), and its
shared experts run as they are. moeblaze replaces the token reordering, the three grouped GEMMs
and the combine: one moeblaze.moe_experts call with the router's (T, K) ids and scores, whose
gradient flows back into the router.

Weight layout: TorchTitan's GroupedExperts holds w1_EFD and w3_EFD (E, hidden, dim) (gate and up
projections, out x in) and w2_EDF (E, dim, hidden); moeblaze's w1 is (E, 2 * hidden, dim) with
the gate rows first, so each call concatenates w1_EFD and w3_EFD (one copy of those weights per
call, whose gradient autograd splits back) and takes w2_EDF as it is. The parameters, their
names and the checkpoints stay TorchTitan's.

Numerics: TorchTitan's GroupedExperts computes in bf16 whatever x's dtype; moeblaze computes in
x's dtype (fp32 on the CPU backend; bf16 on the GPU, or under torch.autocast). Only the local
token dispatcher (no expert parallelism) is supported; a module whose dispatcher is another one
raises ValueError (moeblaze.ExpertParallelMoE is moeblaze's own expert parallelism).
"""
import types

import torch

from ..layer import moe_experts

_LOCAL_DISPATCHER = "LocalTokenDispatcher"


def is_titan_moe(module):
    """Whether module looks like TorchTitan 0.3's MoE: a router and routed_experts.inner_experts
    holding w1_EFD, w2_EDF and w3_EFD."""
    inner = getattr(getattr(module, "routed_experts", None), "inner_experts", None)
    return (hasattr(module, "router") and inner is not None
            and all(hasattr(inner, n) for n in ("w1_EFD", "w2_EDF", "w3_EFD")))


def moe_forward(moe, x_BLD):
    """TorchTitan's MoE.forward with moeblaze's experts: x_BLD (B, L, D) -> (B, L, D)."""
    dispatcher = getattr(moe.routed_experts, "token_dispatcher", None)
    if type(dispatcher).__name__ != _LOCAL_DISPATCHER:
        raise ValueError(f"moeblaze: the TorchTitan adapter runs the local token dispatcher only "
                         f"(no expert parallelism); this MoE has {type(dispatcher).__name__}")
    scores_BLK, ids_BLK, scores_BLE = moe.router(x_BLD, moe.expert_bias_E)
    if moe.training:  # TorchTitan's count: tokens per expert (a token once per chosen expert)
        with torch.no_grad():
            hit = torch.zeros_like(scores_BLE, dtype=torch.bool).scatter_(-1, ids_BLK, True)
            moe.tokens_per_expert_E.add_(hit.sum(dim=tuple(range(hit.dim() - 1))))
    inner = moe.routed_experts.inner_experts
    D, K = x_BLD.shape[-1], ids_BLK.shape[-1]
    w1 = torch.cat((inner.w1_EFD, inner.w3_EFD), dim=1)  # (E, 2F, D): gate rows, then up rows
    out = moe_experts(x_BLD.reshape(-1, D), w1, inner.w2_EDF, ids_BLK.reshape(-1, K),
                      scores_BLK.reshape(-1, K), "swiglu")
    out = out.to(x_BLD.dtype).reshape(x_BLD.shape)
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(x_BLD)
    return out


def use_moeblaze(model):
    """Makes every TorchTitan MoE in model (model itself included) run moe_forward; returns the
    modules changed (an instance attribute `forward`: `del m.forward` restores TorchTitan's).
    ValueError if there is none."""
    found = [m for m in model.modules() if is_titan_moe(m)]
    if not found:
        raise ValueError("moeblaze: no TorchTitan MoE found (a module with router and "
                         "routed_experts.inner_experts.w1_EFD / w2_EDF / w3_EFD, as in "
                         "torchtitan.models.common.moe.MoE)")
    for m in found:
        m.forward = types.MethodType(moe_forward, m)
    return found
