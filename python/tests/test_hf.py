"""moeblaze inside the real Hugging Face transformers (v5): experts_implementation="moeblaze"
against transformers' eager experts on tiny random models built in code (no downloads), the
loaders on v5 blocks, and the variants moeblaze refuses. Skipped without transformers >= 5."""
import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tiny configs built here: nothing to download
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe", reason="transformers < 5: no experts "
                    "interface")

import moeblaze  # noqa: E402
from helpers import TOL, rel_err  # noqa: E402
from moeblaze.integrations import hf as mb_hf  # noqa: E402

mb_hf.register()

COMMON = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, initializer_range=0.1)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=40, moe_intermediate_size=24, num_experts=4,
                       num_experts_per_tok=2, shared_expert_intermediate_size=40,
                       norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=40, moe_intermediate_size=24, num_experts=4,
                       num_experts_per_tok=2, norm_topk_prob=True, head_dim=8)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(intermediate_size=24, num_experts=4, num_experts_per_tok=2, pad_token_id=0,
                   eos_token_id=None)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(intermediate_size=40, moe_intermediate_size=24, n_routed_experts=8,
                         num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                         first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=24,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                         num_key_value_heads=4)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}
# bf16: one layer, so that the two implementations' rounding cannot flip a later layer's routing.
LAYERS = {torch.float32: 2, torch.bfloat16: 1}


def build_cfg(family, layers, **extra):
    cfg_name, _, kw = FAMILIES[family]
    return getattr(transformers, cfg_name)(num_hidden_layers=layers, **{**COMMON, **kw, **extra})


def build(family, dtype, layers=2, clamps=True):
    model = getattr(transformers, FAMILIES[family][1])(build_cfg(family, layers))
    if family == "gpt_oss":  # its expert biases start at 0; gate_up's reach the clamps (|h| > 7)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("proj_bias"):
                    p.normal_(0, (4 if clamps else 1) if "gate_up" in name else 0.1)
    return model.to(dtype)


def pair(family, dtype, layers=None, clamps=None):
    """(moeblaze model, eager copy with the same weights). gpt-oss's clamps (at 7, where bf16's
    spacing is 1/32) are compared in fp32 only: rounded differently, a pair can fall either side."""
    clamps = dtype == torch.float32 if clamps is None else clamps
    model = build(family, dtype, layers or LAYERS[dtype], clamps)
    ref = copy.deepcopy(model)
    ref.set_experts_implementation("eager")
    model.set_experts_implementation("moeblaze")
    assert model.config._experts_implementation == "moeblaze"
    return model, ref


def batch(T=2, L=12):
    ids = torch.randint(0, COMMON["vocab_size"], (T, L))
    return ids, torch.randint(0, COMMON["vocab_size"], (T, L))


def step(model, ids, labels):
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_logits_and_grads_match_eager(seed, family, dtype):
    model, ref = pair(family, dtype)
    ids, labels = batch()
    logits, grads = step(model, ids, labels)
    ref_logits, ref_grads = step(ref, ids, labels)
    assert rel_err(logits, ref_logits) <= TOL[dtype]
    # Norm weights' gradients sum bf16 rounding over every token (measured up to 1.3e-2).
    tol = TOL[dtype] * (2 if dtype == torch.bfloat16 else 1)
    experts = [n for n in grads if "gate_up_proj" in n or "experts.down_proj" in n]
    assert experts and all(grads[n] is not None and grads[n].abs().sum() > 0 for n in experts)
    # A key bias's exact gradient is 0 (softmax is shift invariant): both sides hold only noise;
    # so do gpt-oss's attention sinks' in bf16, a sum over every token that cancels (eager's own
    # is up to 0.2 off an fp32 run), and its router bias's in bf16 (E = 4 sums that add to 0; the
    # router weight's gradient, the same logit gradients against x, is still compared).
    noise = ("k_proj.bias",) + (("self_attn.sinks", "mlp.router.bias")
                                if dtype == torch.bfloat16 else ())
    errs = {n: rel_err(g, ref_grads[n]) for n, g in grads.items()
            if g is not None and not n.endswith(noise)}
    bad = {n: e for n, e in errs.items() if not e <= tol}
    if bad and dtype == torch.bfloat16:
        # A gradient summed over every token that cancels (a router bias, like the norm weights)
        # carries bf16's rounding of the sum on both sides: such a one passes when its error
        # against the same step in fp32 is at most twice eager bf16's own.
        _, grads32 = step(copy.deepcopy(ref).float(), ids, labels)
        bad = {n: (e, rel_err(grads[n], grads32[n].to(dtype)),
                   rel_err(ref_grads[n], grads32[n].to(dtype)))
               for n, e in bad.items()}
        bad = {n: v for n, v in bad.items() if not v[1] <= 2 * v[2]}
    assert not bad, f"{family}: gradients above {tol} (and, in bf16, (err vs eager, vs fp32, " \
                    f"eager's vs fp32)): {bad}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_optimizer_step_matches_eager(seed, family):
    model, ref = pair(family, torch.float32)
    ids, labels = batch()
    for m in (model, ref):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        m(input_ids=ids, labels=labels).loss.backward()
        opt.step()
    with torch.no_grad():
        after, ref_after = model(input_ids=ids).logits, ref(input_ids=ids).logits
    assert rel_err(after, ref_after) <= TOL[torch.float32]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_save_pretrained_round_trip(seed, family, tmp_path):
    model, _ = pair(family, torch.float32)
    model.save_pretrained(tmp_path)
    cls = type(model)
    loaded = cls.from_pretrained(tmp_path, experts_implementation="moeblaze")
    assert loaded.config._experts_implementation == "moeblaze"
    ids, _ = batch()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def experts_pair(cls, make_cfg, std=None):
    """(moeblaze, eager) instances of a v5 experts class with the same random weights (std: per
    parameter name, 0.2 otherwise); one config each, since the module reads its config's choice."""
    made = []
    for impl in ("moeblaze", "eager"):
        cfg = make_cfg()
        cfg._experts_implementation = impl
        made.append(cls(cfg))
    with torch.no_grad():
        for name, p in made[0].named_parameters():
            p.normal_(0, (std or {}).get(name, 0.2))
    made[1].load_state_dict(made[0].state_dict())
    assert made[0].config._experts_implementation == "moeblaze"
    return made


def experts_errors(mb, ref, E, T=40, K=2):
    """Relative errors of moeblaze against eager: output, gradients of x, of the routing weights
    and of every parameter."""
    x, w = torch.randn(T, mb.gate_up_proj.shape[1 if mb.is_transposed else 2]), torch.rand(T, K)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    res = []
    for m in (mb, ref):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = m(xi, ids, wi)
        names, params = zip(*m.named_parameters())
        res.append((out, torch.autograd.grad(out, (xi, wi) + params, torch.ones_like(out))))
    (out, grads), (ref_out, ref_grads) = res
    errs = {n: rel_err(a, b) for n, a, b in zip(("x", "weights") + names, grads, ref_grads)}
    return {"out": rel_err(out, ref_out), **errs}, x, ids


def gpt_oss_experts(**kw):
    """(moeblaze, eager) GptOssExperts, biases included, gate_up's large enough for the clamps."""
    return experts_pair(transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts,
                        lambda: build_cfg("gpt_oss", 1, **kw), {"gate_up_proj_bias": 4})


def test_hf_gpt_oss_experts_match_eager(seed):
    """GptOssExperts alone: transposed, interleaved gate/up weights, biases, the clamped SwiGLU;
    output and the gradients of x, the routing weights and the four parameters."""
    mb, ref = gpt_oss_experts()
    errs, x, ids = experts_errors(mb, ref, E=4)
    assert set(errs) >= {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"}
    assert all(e <= TOL[torch.float32] for e in errs.values()), errs
    h = torch.einsum("td,tkdr->tkr", x, mb.gate_up_proj[ids]) + mb.gate_up_proj_bias[ids]
    assert (h[..., 0::2] > 7).any() and (h[..., 1::2].abs() > 7).any()  # the clamps are exercised


def test_hf_transposed_experts_aria(seed):
    """AriaExperts: transposed (E, d, 2n) / (E, n, d) weights without biases, SwiGLU."""
    mod = pytest.importorskip("transformers.models.aria.modeling_aria")
    mb, ref = experts_pair(mod.AriaExperts, lambda: transformers.AriaTextConfig(
        hidden_size=32, intermediate_size=24, moe_num_experts=6))
    if not hasattr(mb, "gate_up_proj"):  # transformers before the fused (E, d, 2n) Aria experts
        pytest.skip("this transformers' AriaExperts keeps per-expert fc1/fc2 modules")
    errs, _, _ = experts_errors(mb, ref, E=6)
    assert all(e <= TOL[torch.float32] for e in errs.values()), errs


def test_hf_gpt_oss_other_clamp_refused(seed):
    """swiglu_oai is alpha 1.702, limit 7: a config with other values is refused, not run."""
    mb, _ = gpt_oss_experts(swiglu_alpha=1.5)
    mb.alpha = 1.5  # some transformers releases fix the module's alpha instead of reading the config
    with pytest.raises(ValueError, match=r"GptOssExperts: it uses a clamped SwiGLU other than "
                                         r"swiglu_oai \(alpha 1.702, limit 7\)"):
        mb(torch.randn(3, 32), torch.tensor([[0, 1]] * 3), torch.rand(3, 2))


def test_hf_unsupported_backend_error_names_module(seed, monkeypatch):
    """On CUDA the backend refuses expert biases (UnsupportedError): the adapter passes
    that on with the module's name and the implementations that run it, not a fallback."""
    def refuse(*args, **kw):
        raise moeblaze.UnsupportedError("b1: expert biases run on the CPU backend only for now")
    monkeypatch.setattr(mb_hf, "moe_experts", refuse)
    mb, _ = gpt_oss_experts()
    with pytest.raises(moeblaze.UnsupportedError, match=r"cannot run GptOssExperts on cpu: b1: "
                                                        r"expert biases .*'grouped_mm' or 'eager'"):
        mb(torch.randn(3, 32), torch.zeros(3, 2, dtype=torch.long), torch.rand(3, 2))


def test_loaders_refuse_gpt_oss(seed):
    block = build("gpt_oss", torch.float32, 1).model.layers[0].mlp
    with pytest.raises(ValueError, match=r"do not load GptOssExperts's expert biases"):
        moeblaze.MoE.from_mixtral(block)


@pytest.mark.parametrize("family,loader", [("mixtral", "from_mixtral"),
                                           ("qwen2_moe", "from_qwen_moe"),
                                           ("qwen3_moe", "from_qwen_moe"),
                                           ("olmoe", "from_qwen_moe")])
def test_loaders_read_v5_blocks(seed, family, loader):
    block = build(family, torch.float32, 1).model.layers[0].mlp
    moe = getattr(moeblaze.MoE, loader)(block)
    assert (moe.shared_expert is not None) == (family == "qwen2_moe")
    x = torch.randn(3, 5, 32)
    with torch.no_grad():
        ref = block(x)
    ref = ref[0] if isinstance(ref, tuple) else ref
    assert rel_err(moe(x)[0], ref) <= TOL[torch.float32]


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "gpt_oss"])
def test_hf_autocast_bf16_with_fp32_weights(seed, family):
    """HF Trainer's bf16=True: fp32 parameters, torch.autocast(bf16); fp32 expert gradients."""
    model, ref = pair(family, torch.float32, LAYERS[torch.bfloat16], clamps=False)
    ids, labels = batch()
    seen = []  # (input, output) dtypes of the experts: transformers expects them equal
    hook = model.model.layers[0].mlp.experts.register_forward_hook(
        lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, grads = step(model, ids, labels)
        ref_logits, ref_grads = step(ref, ids, labels)
    hook.remove()
    assert seen and all(a == b for a, b in seen), seen
    assert rel_err(logits, ref_logits) <= TOL[torch.bfloat16]
    name = next(n for n in grads if "gate_up_proj" in n)
    assert grads[name].dtype == torch.float32
    assert rel_err(grads[name], ref_grads[name]) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("act,ok", [("relu2", True), ("relu", True), ("gelu_pytorch_tanh", False)])
def test_hf_plain_experts_nemotron_h(seed, act, ok):
    """NemotronH's non-gated experts (up_proj, down_proj): moeblaze's plain activations."""
    mod = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    made = []
    for impl in ("moeblaze", "eager"):
        cfg = transformers.NemotronHConfig(hidden_size=32, moe_intermediate_size=24,
                                           n_routed_experts=6, mlp_hidden_act=act)
        cfg._experts_implementation = impl
        made.append(mod.NemotronHExperts(cfg))
    mb, ref = made
    with torch.no_grad():
        for p in mb.parameters():
            p.normal_(0, 0.2)
    ref.load_state_dict(mb.state_dict())
    T, K = 30, 2
    x = torch.randn(T, 32)
    ids = torch.stack([torch.randperm(6)[:K] for _ in range(T)])
    w = torch.rand(T, K)
    if not ok:
        with pytest.raises(ValueError, match=r"activation GELUTanh \(plain experts: moeblaze "
                                             r"has relu"):
            mb(x, ids, w)
        return
    outs = [m(x, ids, w) for m in (mb, ref)]
    assert rel_err(outs[0], outs[1]) <= TOL[torch.float32]
    g = torch.randn_like(outs[0])
    grads = [torch.autograd.grad(o, m.up_proj, g)[0] for o, m in zip(outs, (mb, ref))]
    assert rel_err(grads[0], grads[1]) <= TOL[torch.float32]
