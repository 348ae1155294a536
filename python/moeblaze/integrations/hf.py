"""moeblaze inside Hugging Face transformers (v5; 4.x blocks for the loaders).

    import moeblaze.integrations.hf as mb_hf
    mb_hf.register()                     # once per process
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moeblaze")
    # or, on a model already built: model.set_experts_implementation("moeblaze")

transformers v5 keeps a block's experts as one module with fused tensors (`gate_up_proj`
(E, 2n, d), gate rows first, and `down_proj` (E, d, n): moeblaze's own w1 / w2 layout) and calls
`forward(hidden_states (T, d), top_k_index (T, K), top_k_weights (T, K))` through its
ExpertsInterface; the model's own router stays in charge of the selection. `register()` adds
`experts_forward` under the name "moeblaze". Supported: gated SwiGLU (silu) or GeGLU (exact
gelu) (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, ...), plain `up_proj` experts with
relu, relu2, silu or gelu (NemotronH), transposed (E, d, 2n) weights (Aria), and gpt-oss's
experts: transposed, interleaved gate/up columns, biases and the clamped SwiGLU (moeblaze's
swiglu_oai, on the CPU and the GPU).
Anything else (a post-expert norm, another gating function, transformers' expert parallelism)
raises ValueError naming what is not supported.

`moe_from_block(block)` builds a moeblaze.MoE from a Mixtral- or Qwen-MoE-style sparse block
(v5's fused experts or 4.x's per-expert modules); MoE.from_mixtral / from_qwen_moe call it. No
loader for gpt-oss: MoE's router has no logits bias (gpt-oss's router.bias).
"""
import torch

from .._lib import UnsupportedError
from ..layer import moe_experts
from ..reference import activation_fn

NAME = "moeblaze"

# transformers' activation modules (act_fn, by class name) -> moeblaze's non-gated activation
# (GELUActivation is the exact erf form, as moeblaze's gelu); gated experts use act(gate) * up.
_ACTS = {"SiLUActivation": "silu", "SiLU": "silu", "GELUActivation": "gelu", "ReLU": "relu",
         "ReLUSquaredActivation": "relu2"}
_GATED = {"silu": "swiglu", "gelu": "geglu"}


def register(name=NAME):
    """Makes experts_implementation=name ("moeblaze") available to every transformers v5 model
    whose experts use transformers' experts interface. Returns the name."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as e:
        raise ImportError("moeblaze: register() needs transformers >= 5 (its ExpertsInterface); "
                          f"import failed: {e}") from e
    ExpertsInterface.register(name, experts_forward)
    return name


# Flags of transformers' experts modules whose value `bad` moeblaze cannot run, and what it means.
_UNSUPPORTED = (
    ("has_post_expert_norm", True, "a post-expert norm"),
    ("_is_expert_parallel", True, "transformers' expert parallelism (use "
                                  "moeblaze.ExpertParallelMoE)"),
)


def _is_swiglu_oai(experts):
    """Whether the module's own _apply_gate computes moeblaze's swiglu_oai (alpha 1.702, limit 7)
    in the gate/up layout its is_concatenated flag declares: tried in float64 across the clamps."""
    n, gen = 32, torch.Generator().manual_seed(0)
    h = torch.rand(16, 2 * n, generator=gen, dtype=torch.float64) * 24 - 12  # gate cols, up cols
    want = activation_fn("swiglu_oai", h, n)
    if not getattr(experts, "is_concatenated", True):
        h = torch.stack((h[:, :n], h[:, n:]), -1).reshape(16, 2 * n)
    try:
        with torch.no_grad():
            got = experts._apply_gate(h)
    except Exception:  # a gate that cannot take this probe is not one moeblaze knows
        return False
    return got.shape == want.shape and bool(torch.allclose(got, want, rtol=1e-6, atol=1e-9))


def _activation(experts):
    """moeblaze's activation for an experts module, or ValueError listing what moeblaze lacks."""
    cls = type(experts)
    missing = [what for attr, bad, what in _UNSUPPORTED
               if bool(getattr(experts, attr, not bad)) == bad]
    act_fn = getattr(experts, "act_fn", None)
    gated = getattr(experts, "has_gate", True)
    if getattr(cls, "_apply_gate", None) is not None and \
            getattr(cls._apply_gate, "__name__", "") != "_default_apply_gate":
        act = "swiglu_oai" if gated and _is_swiglu_oai(experts) else None
        if act is None:
            what = ("a clamped SwiGLU other than swiglu_oai (alpha 1.702, limit 7)"
                    if hasattr(experts, "limit") else "a custom gating function")
            missing.append(f"{what} ({cls.__name__}._apply_gate)")
    else:
        if gated and not getattr(experts, "is_concatenated", True):
            missing.append("interleaved gate/up rows with transformers' default (chunked) gate")
        act = _ACTS.get(type(act_fn).__name__)
        if type(act_fn).__name__ == "GELU" and getattr(act_fn, "approximate", "") == "none":
            act = "gelu"
        act = _GATED.get(act) if gated else act
    if not missing and act is None:
        kinds = "silu or exact gelu" if gated else "relu, relu2, silu or exact gelu"
        missing.append(f"the activation {type(act_fn).__name__} ({'gated' if gated else 'plain'} "
                       f"experts: moeblaze has {kinds})")
    if missing:
        raise ValueError(f"moeblaze: experts_implementation='moeblaze' cannot run {cls.__name__}: "
                         f"it uses {'; '.join(missing)}, which moeblaze does not implement; use "
                         "experts_implementation='grouped_mm' or 'eager' for this model")
    return act


def _weights(experts):
    """(w1 (E, rows, d), w2 (E, d, n), b1 or None, b2 or None) in moeblaze's layout: v5's default
    layout as it is; transposed or interleaved weights (gpt-oss) cost one permuted copy of
    gate_up_proj and down_proj per call (kept for the backward), their gradients flowing back
    through the permutation to the module's own parameters."""
    gated = getattr(experts, "has_gate", True)
    w1 = experts.gate_up_proj if gated else experts.up_proj
    w2, b1, b2 = experts.down_proj, None, None
    if getattr(experts, "has_bias", False):
        b1 = experts.gate_up_proj_bias if gated else experts.up_proj_bias
        b2 = experts.down_proj_bias
    if getattr(experts, "is_transposed", False):  # (E, d, rows) and (E, n, d)
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2).contiguous()
    if gated and not getattr(experts, "is_concatenated", True):  # gate j, up j alternate
        w1 = torch.cat((w1[:, 0::2], w1[:, 1::2]), 1)
        b1 = None if b1 is None else torch.cat((b1[:, 0::2], b1[:, 1::2]), 1)
    return w1.contiguous(), w2, b1, b2


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' experts forward, run by moeblaze: hidden_states (T, d), top_k_index (T, K),
    top_k_weights (T, K) (gradients flow to them, hence to the model's router)."""
    act = self.__dict__.get("_moeblaze_activation")
    if act is None:  # the checks read the module's flags once, not per call
        act = self.__dict__["_moeblaze_activation"] = _activation(self)
    w1, w2, b1, b2 = _weights(self)
    try:
        out = moe_experts(hidden_states, w1, w2, top_k_index, top_k_weights, act, b1=b1, b2=b2)
    except UnsupportedError as e:  # a shape or variant the backend cannot take (named in e)
        raise UnsupportedError(f"moeblaze: experts_implementation='moeblaze' cannot run "
                               f"{type(self).__name__} on {hidden_states.device}: {e}; use "
                               "experts_implementation='grouped_mm' or 'eager' there") from e
    return out.to(hidden_states.dtype)  # transformers' contract, also under autocast (bf16 out)


# ---- loaders: a Hugging Face sparse block -> moeblaze.MoE --------------------------------------
def _router(block):
    """(gate weight (E, d), top_k, norm_topk_prob or None): v5 keeps top_k and norm_topk_prob on
    the router (block.gate), 4.x on the block."""
    gate = block.gate
    top_k = getattr(gate, "top_k", None) or getattr(block, "top_k", None) or \
        getattr(block, "num_experts_per_tok", None)
    if top_k is None:
        raise ValueError(f"moeblaze: {type(block).__name__} has no top_k (looked at block.gate."
                         "top_k, block.top_k and block.num_experts_per_tok)")
    norm = getattr(gate, "norm_topk_prob", getattr(block, "norm_topk_prob", None))
    return gate.weight, int(top_k), norm


def _expert_weights(block, gate_name, up_name, down_name):
    """(activation, w1 (E, 2n, d), w2 (E, d, n)) of the block's experts: v5's fused tensors in
    moeblaze's layout (see _weights), 4.x's per-expert nn.Linear modules stacked."""
    experts = block.experts
    if hasattr(experts, "gate_up_proj"):
        act, (w1, w2, b1, b2) = _activation(experts), _weights(experts)
        if b1 is not None or b2 is not None:
            raise ValueError(f"moeblaze: the loaders do not load {type(experts).__name__}'s expert "
                             "biases (nor a router bias); run the model with "
                             "experts_implementation='moeblaze' instead")
        return act, w1, w2
    w1 = torch.cat([torch.stack([getattr(x, gate_name).weight for x in experts]),
                    torch.stack([getattr(x, up_name).weight for x in experts])], dim=1)
    return "swiglu", w1, torch.stack([getattr(x, down_name).weight for x in experts])


def _build(cls, block, names, renormalize, kw):
    activation, w1, w2 = _expert_weights(block, *names)  # first: gpt-oss's block has no .gate
    gate_weight, top_k, norm = _router(block)
    E, d = gate_weight.shape
    if renormalize is None:
        renormalize = bool(norm)
    shared = getattr(block, "shared_expert", None)
    shared_gate = getattr(block, "shared_expert_gate", None)
    if shared is not None:
        kw = {"shared_expert_size": shared.gate_proj.weight.shape[0],
              "shared_expert_gate": shared_gate is not None, **kw}
    m = cls(d, w2.shape[2], E, top_k, activation=activation, router="softmax_topk",
            renormalize=renormalize, device=gate_weight.device, dtype=w1.dtype, **kw)
    m.load_experts(gate_weight, gate_up_weights=w1, down_weights=w2)
    if shared is not None:
        with torch.no_grad():
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(m.shared_expert, name).weight.copy_(getattr(shared, name).weight)
            if shared_gate is not None:
                m.shared_expert.gate.weight.copy_(shared_gate.weight)
    return m


def moe_from_mixtral(cls, block, **kw):
    """cls (moeblaze.MoE or a subclass) from a MixtralSparseMoeBlock: softmax -> top-K ->
    renormalised weights; v5 (block.experts.gate_up_proj / down_proj) or 4.x (block.experts[e]
    .w1 gate, .w3 up, .w2 down)."""
    return _build(cls, block, ("w1", "w3", "w2"), True, kw)


def moe_from_qwen_moe(cls, block, **kw):
    """cls from a Qwen2-MoE / Qwen3-MoE (or OLMoE) sparse block: softmax -> top-K, renormalised
    when norm_topk_prob; v5 fused experts or 4.x block.experts[e].gate_proj / up_proj /
    down_proj; Qwen2-MoE's shared_expert (and its sigmoid shared_expert_gate) become the
    module's SharedExpert."""
    return _build(cls, block, ("gate_proj", "up_proj", "down_proj"), None, kw)
