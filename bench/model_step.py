#!/usr/bin/env python3
"""One training step of a whole Hugging Face transformers (v5) MoE model per experts
implementation: `grouped_mm` (transformers' own), `sonicmoe` (transformers' SonicMoE integration)
and `moeblaze` (moeblaze.integrations.hf). Models are built in code from the public configs' expert
shapes (d, n, E, K, shared experts, router) with few layers, a small vocabulary and random weights:
nothing is downloaded.

Families (the public model each one's expert shape comes from; bench/model_shapes.py has the
same numbers):
  qwen3_moe    Qwen3-30B-A3B      softmax top-8 of 128, renormalized
  mixtral      Mixtral-8x7B       softmax top-2 of 8
  olmoe        OLMoE-1B-7B        softmax top-8 of 64
  deepseek_v3  DeepSeek-V3        sigmoid router with group-limited top-8 of 256, one shared expert
  gpt_oss      gpt-oss-20b        expert biases, clamped SwiGLU (moeblaze's swiglu_oai)

Rows (JSON lines, `bench: "model-step"`): model, family, impl, layers, tokens (= batch * seq),
batch, seq, d, n, E, K, vocab, dtype, attn (the attention implementation), step_ms (median over --reps of one forward + backward of the
whole model, after --warmup), first_step_s (the first step after the model is built: compile,
autotune and workspace setup included), peak_bytes (torch.cuda.max_memory_allocated over one
step minus what was allocated before it; null on the CPU), loss, loss_rel_err and grad_max_rel_err
(against grouped_mm on the same weights and tokens; grad_worst names the parameter; large
parameters compared on a fixed sample of 2^22 entries), fp64_loss_rel_err and fp64_grad_max_rel_err
(the family's tiny variant, run by this impl in float32 on this device against transformers' eager
experts in float64 on the CPU), gpu, commit, date, torch, transformers. An impl that cannot run
says why in `skipped` ("not installed: ..." where its package is missing) and the others go on.
transformers' `sonicmoe` loads the hub kernel kernels-community/sonic-moe through the `kernels`
package. On a GPU without network (no hub cache), --sonicmoe-source package (or auto, the
default, where the hub kernel does not load) puts PyPI's sonic-moe package, the one bench/peers.py
imports, in the hub kernel's place: both export `enums.ActivationType` and
`moe_general_routing_inputs` with the same arguments, and transformers' own glue (routing
flatten, weight permutes, activation map) runs unchanged. The rows name what ran in
`sonicmoe_source`; where neither loads they say "not installed".

  python3 bench/model_step.py --family qwen3_moe,deepseek_v3 [--impl grouped_mm,moeblaze]
                              [--layers 2] [--batch 4] [--seq 4096] [--out rows.jsonl]
                              [--md table.md]
  python3 bench/model_step.py --tiny --family olmoe   # CPU-sized models (the tests' mode)
  python3 bench/model_step.py --family qwen3_moe --compile   # the whole model under torch.compile
  python3 bench/model_step.py --family qwen3_moe --kernels 3  # + where the step's GPU time goes

--kernels N profiles N more steps per impl after the timed ones (torch.profiler, CUDA kernels,
memcpys and memsets) and sums each kernel family's device time per step (MODEL_RULES below, then
bench/step_kernels.py's rules for the expert layer's kernels): the rows carry `kernel_families`
({family: ms per step}, the largest first) and `kernel_sum_ms`, and the Markdown gets one table per
model, a column per impl. It tells how much of the step the experts take, hence how far a faster
expert layer can move the whole step.
"""
import argparse
import contextlib
import copy
import datetime
import json
import os
import re
import sys
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs are built here: nothing to download

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_reference import driver_version, git_commit, median, step_timer  # noqa: E402

IMPLS = ("grouped_mm", "sonicmoe", "moeblaze")
# Per family: the public model, transformers' config and causal-LM classes, the real config's
# keys (expert shape, router, shared experts, attention), its tiny variant's overrides, and the
# default layer count at full size (DeepSeek-V3's 256 experts of 7168 x 2048 take 22.5 GB of
# bf16 weights per layer, and as much again in gradients).
FAMILIES = {
    "qwen3_moe": dict(
        model="Qwen3-30B-A3B", config="Qwen3MoeConfig", cls="Qwen3MoeForCausalLM", layers=2,
        real=dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                  num_experts_per_tok=8, norm_topk_prob=True, intermediate_size=6144,
                  num_attention_heads=32, num_key_value_heads=4, head_dim=128),
        tiny=dict(hidden_size=32, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                  intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8)),
    "mixtral": dict(
        model="Mixtral-8x7B", config="MixtralConfig", cls="MixtralForCausalLM", layers=2,
        real=dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                  num_experts_per_tok=2, num_attention_heads=32, num_key_value_heads=8),
        tiny=dict(hidden_size=32, intermediate_size=24, num_local_experts=4,
                  num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2)),
    "olmoe": dict(
        model="OLMoE-1B-7B", config="OlmoeConfig", cls="OlmoeForCausalLM", layers=2,
        real=dict(hidden_size=2048, intermediate_size=1024, num_experts=64,
                  num_experts_per_tok=8, num_attention_heads=16, num_key_value_heads=16,
                  pad_token_id=0, eos_token_id=None),
        tiny=dict(hidden_size=32, intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                  num_attention_heads=4, num_key_value_heads=4, pad_token_id=0,
                  eos_token_id=None)),
    "deepseek_v3": dict(
        model="DeepSeek-V3", config="DeepseekV3Config", cls="DeepseekV3ForCausalLM", layers=1,
        real=dict(hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=256,
                  num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4,
                  first_k_dense_replace=0, intermediate_size=18432, num_attention_heads=128,
                  num_key_value_heads=128, kv_lora_rank=512, q_lora_rank=1536,
                  qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128),
        tiny=dict(hidden_size=32, moe_intermediate_size=24, n_routed_experts=8,
                  num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                  first_k_dense_replace=0, intermediate_size=40, num_attention_heads=4, num_key_value_heads=4,
                  kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
                  v_head_dim=8)),
    # transformers' gpt-oss attention has no SDPA path: eager keeps (batch, 64, seq, seq) scores,
    # hence 2 sequences by default (--attn flex_attention takes more).
    "gpt_oss": dict(
        model="gpt-oss-20b", config="GptOssConfig", cls="GptOssForCausalLM", layers=2, batch=2,
        real=dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                  num_experts_per_tok=4, num_attention_heads=64, num_key_value_heads=8,
                  head_dim=64),
        tiny=dict(hidden_size=32, intermediate_size=24, num_local_experts=4,
                  num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8)),
}
# (d, n, E, K) keys of each family's config
SHAPE_KEYS = {
    "qwen3_moe": ("hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok"),
    "mixtral": ("hidden_size", "intermediate_size", "num_local_experts", "num_experts_per_tok"),
    "olmoe": ("hidden_size", "intermediate_size", "num_experts", "num_experts_per_tok"),
    "deepseek_v3": ("hidden_size", "moe_intermediate_size", "n_routed_experts",
                    "num_experts_per_tok"),
    "gpt_oss": ("hidden_size", "intermediate_size", "num_local_experts", "num_experts_per_tok"),
}
SAMPLE = 1 << 22  # gradient entries compared per parameter, at most

# Whole-model kernel families for --kernels, tried before step_kernels.RULES (first match wins):
# the parts of a decoder layer that are not the routed experts. cuBLAS's dense GEMMs (attention
# projections, router, shared experts, LM head) are named nvjet_* or sm90_xmma_* on Hopper.
MODEL_RULES = [
    (r"flash|fmha|sdpa|[Aa]ttention|attn", "attention"),
    (r"nvjet|xmma_gemm|gemmSN|gemv|cublas|Kernel2<cutlass_80|cutlass3x_sm90",
     "cuBLAS GEMM (dense layers)"),
    (r"cross_entropy|log_softmax|LogSoftMax|nll_loss", "loss"),
    (r"quack|sonic", "SonicMoE / QuACK kernels"),
]
KERNEL_FAMILIES_KEPT = 24  # families per row, the largest; the rest summed as "(rest)"


class Skip(Exception):
    """An impl that cannot run here (not installed, or refuses the model)."""


def make_config(family, tiny, layers, vocab, seq, attn=""):
    import transformers
    f = FAMILIES[family]
    kw = dict(f["tiny"] if tiny else f["real"])
    kw.update(num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=max(seq, 64),
              initializer_range=0.1 if tiny else 0.02)
    if family == "gpt_oss":
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    cfg = getattr(transformers, f["config"])(**kw)
    if attn:  # else the model's own default (sdpa where it has one)
        cfg._attn_implementation = attn
    return cfg


def build(family, cfg, dtype, dev, seed, impl):
    """The model on `dev` in `dtype`, weights from `seed` (the same for every impl), experts run by
    `impl` ("eager" too)."""
    import transformers
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype.is_floating_point else old)
    try:
        with torch.device(dev):
            model = getattr(transformers, FAMILIES[family]["cls"])(copy.deepcopy(cfg))
    finally:
        torch.set_default_dtype(old)
    if family == "gpt_oss":  # its expert biases start at 0: give them values, some past the clamp
        gen = torch.Generator(device="cpu").manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("proj_bias"):
                    std = 4.0 if "gate_up" in name else 0.1
                    p.copy_((torch.randn(p.shape, generator=gen) * std).to(p))
    # Every family keeps its experts as transformers' fused experts module (gate_up_proj): what the
    # experts implementations run. None would time dense layers only.
    if not any(name.endswith("gate_up_proj") for name, _ in model.named_parameters()):
        raise RuntimeError(f"{family}: the model built has no experts module (dense layers only)")
    model.train()
    set_impl(model, impl)
    return model


# --sonicmoe-source, and what the sonicmoe rows ran on (use_sonicmoe's description).
SONICMOE = {"source": "auto", "used": None}


def use_sonicmoe(choice):
    """Make transformers' `sonicmoe` experts runnable: its hub kernel where that loads (`hub`, or
    `auto`), else (`package`, or `auto`) PyPI's sonic-moe package in the hub kernel's place.
    Returns what it runs on; raises Skip where neither is there."""
    import transformers.integrations.sonicmoe as sm
    hub = None
    if choice in ("auto", "hub"):
        try:
            sm.is_sonicmoe_loadable(raise_error=True)
            return "hub kernel kernels-community/sonic-moe"
        except Exception as err:
            hub = f"{type(err).__name__}: {err}"
            if choice == "hub":
                raise Skip(f"not installed: sonicmoe's hub kernel ({hub})")
    try:
        import importlib.metadata
        import inspect
        from sonicmoe.enums import ActivationType
        from sonicmoe.functional import moe_general_routing_inputs
        version = importlib.metadata.version("sonic-moe")
        params = inspect.signature(moe_general_routing_inputs).parameters
        stream_arg = "stream_id" if "stream_id" in params else "_stream_id"
        sm.SonicMoE, sm._SONICMOE  # noqa: B018 (the loader's cache, which the stand-in fills)
    except Exception as err:
        raise Skip(f"not installed: sonicmoe (hub kernel: {hub}; sonic-moe package: "
                   f"{type(err).__name__}: {err})")

    def routed(*args, stream_id=None, **kwargs):
        # transformers passes stream_id=None (the hub kernel's default); the package launches
        # on the stream it is given.
        if stream_id is None:
            stream_id = torch.cuda.current_stream().cuda_stream
        return moe_general_routing_inputs(*args, **{stream_arg: stream_id}, **kwargs)

    sm._SONICMOE = sm.SonicMoE(activation_type_enum=ActivationType,
                               moe_general_routing_inputs=routed)
    return f"sonic-moe {version} package in place of the hub kernel"


def set_impl(model, impl):
    if impl == "moeblaze":
        try:
            import moeblaze
            import moeblaze.integrations.hf as mb_hf
            mb_hf.register()
        except Exception as err:  # ImportError, or the library not found
            raise Skip(f"not installed: moeblaze ({type(err).__name__}: {err})")
        # Its C++ fast path is compiled once per install (minutes, cached): before any timed
        # first step, which is to count what a new shape costs, not a new install.
        moeblaze._ext.get()
    if impl == "sonicmoe":
        SONICMOE["used"] = None
        try:
            SONICMOE["used"] = use_sonicmoe(SONICMOE["source"])
        except Skip:
            raise
        except Exception as err:
            raise Skip(f"not installed: sonicmoe ({type(err).__name__}: {err})")
    try:
        model.set_experts_implementation(impl)
    except (ImportError, ModuleNotFoundError) as err:
        raise Skip(f"not installed: {impl} ({err})")
    except ValueError as err:
        raise Skip(f"unsupported: {err}")


def batch_of(vocab, batch, seq, seed, dev):
    gen = torch.Generator().manual_seed(seed + 2)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    return ids.to(dev), labels.to(dev)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def train_step(model, ids, labels):
    """Forward + backward of the whole model; the loss (a tensor)."""
    for p in model.parameters():
        p.grad = None
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach()


def sampled_grads(model):
    """{name: the gradient on the CPU in float64, a fixed sample of at most SAMPLE entries}."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.detach().reshape(-1)
        if g.numel() > SAMPLE:
            # integer positions: a float32 linspace rounds numel - 1 up past the end above 2^24
            idx = torch.arange(SAMPLE, device=g.device) * (g.numel() - 1) // (SAMPLE - 1)
            g = g[idx]
        out[name] = g.double().cpu()
    return out


def rel(a, ref):
    return float(torch.linalg.norm(a - ref)) / max(float(torch.linalg.norm(ref)), 1e-30)


def compare(grads, ref):
    """(largest relative error over the parameters both have, the parameter)."""
    worst, at = 0.0, None
    for name, g in ref.items():
        if name in grads:
            e = rel(grads[name], g)
            if not e <= worst:  # NaN counts as worst
                worst, at = e, name
    return worst, at


def fp64_check(family, impl, dev, seed):
    """The family's tiny variant: `impl` in float32 on `dev` against transformers' eager experts
    in float64 on the CPU, same weights and tokens: (loss rel err, worst gradient rel err)."""
    cfg = make_config(family, True, 2, 64, 16)
    ids, labels = batch_of(64, 2, 16, seed, torch.device("cpu"))
    ref = build(family, cfg, torch.float64, torch.device("cpu"), seed, "eager")
    ref_loss = train_step(ref, ids, labels)
    ref_grads = sampled_grads(ref)
    model = build(family, cfg, torch.float32, dev, seed, impl)
    model.load_state_dict({k: v.to(torch.float32) for k, v in ref.state_dict().items()})
    loss = train_step(model, ids.to(dev), labels.to(dev))
    worst, _ = compare(sampled_grads(model), ref_grads)
    return rel(loss.double().cpu(), ref_loss), worst


def run_impl(family, impl, args, dev, dtype, meta, ref):
    """One impl's row; `ref` holds grouped_mm's loss and gradients (filled by the grouped_mm row)."""
    f = FAMILIES[family]
    layers = args.layers or (2 if args.tiny else f["layers"])
    batch = args.batch or (2 if args.tiny else f.get("batch", 4))
    cfg = make_config(family, args.tiny, layers, args.vocab, args.seq, args.attn)
    d, n, E, K = (getattr(cfg, k) for k in SHAPE_KEYS[family])
    row = {"bench": "model-step", "model": f["model"], "family": family, "impl": impl,
           "layers": layers, "tokens": batch * args.seq, "batch": batch,
           "seq": args.seq, "d": d, "n": n, "E": E, "K": K, "vocab": args.vocab,
           "dtype": str(dtype).replace("torch.", ""), "tiny": bool(args.tiny)}
    row.update(meta)
    if impl == "moeblaze":
        try:
            import moeblaze
            row["extension"] = moeblaze.extension_status()  # read again after the steps
        except ImportError:
            pass
    ids, labels = batch_of(args.vocab, batch, args.seq, args.seed, dev)
    model = None
    try:
        model = build(family, cfg, dtype, dev, args.seed, impl)
        row["attn"] = model.config._attn_implementation
        if impl == "sonicmoe":
            row["sonicmoe_source"] = SONICMOE["used"]
        step_model = model
        if args.compile:  # the whole model; its first step below includes the compile
            from torch._dynamo.utils import counters
            torch._dynamo.reset()
            counters.clear()
            step_model = torch.compile(model, backend=args.compile)
            row["compile"] = args.compile
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
        sync(dev)
        t0 = time.perf_counter()
        loss = train_step(step_model, ids, labels)
        sync(dev)
        row["first_step_s"] = time.perf_counter() - t0
        if args.compile:  # anywhere in the model, as dynamo counted them
            row["graph_breaks"] = sum(counters["graph_break"].values())
        row["peak_bytes"] = (torch.cuda.max_memory_allocated(dev) - before
                             if dev.type == "cuda" else None)
        row["loss"] = float(loss)
        grads = sampled_grads(model)
        if impl == "grouped_mm":
            ref["loss"], ref["grads"] = float(loss), grads
        if "grads" in ref:
            row["loss_rel_err"] = abs(float(loss) - ref["loss"]) / max(abs(ref["loss"]), 1e-30)
            row["grad_max_rel_err"], row["grad_worst"] = compare(grads, ref["grads"])
        else:
            row["loss_rel_err"] = row["grad_max_rel_err"] = row["grad_worst"] = None
        del grads
        times = []
        timer = step_timer(dev.type)
        for i in range(args.warmup + args.reps):
            sync(dev)
            ms = timer(lambda: train_step(step_model, ids, labels))
            if i >= args.warmup:
                times.append(ms)
        row["step_ms"] = median(times)
        if impl == "moeblaze" and "extension" in row:  # what the steps ran: "loaded: ..." etc.
            row["extension"] = moeblaze.extension_status()
        row["reps"], row["warmup"] = args.reps, args.warmup
        if args.kernels:
            row["kernel_families"], row["kernel_sum_ms"] = profile_step_kernels(
                step_model, ids, labels, args.kernels, dev)
            row["kernel_steps"] = args.kernels
    except Skip as why:
        row["skipped"] = str(why)
    except torch.OutOfMemoryError:
        row["skipped"] = "out of memory"
    except (ImportError, OSError) as err:  # e.g. SonicMoE's kernel, loaded at the first call
        row["skipped"] = f"not installed: {impl} ({type(err).__name__}: {str(err)[:300]})"
    except Exception as err:  # an impl that breaks on this model is reported, not fatal
        row["skipped"] = f"failed: {type(err).__name__}: {str(err)[:300]}"
        traceback.print_exc()
    finally:
        del model
        # not after a failure: a device-side assert would raise again here and hide its traceback
        if dev.type == "cuda" and not row.get("skipped", "").startswith("failed:"):
            torch.cuda.empty_cache()
    if "skipped" not in row and not args.no_fp64:
        try:
            row["fp64_loss_rel_err"], row["fp64_grad_max_rel_err"] = fp64_check(
                family, impl, dev, args.seed)
        except Exception as err:  # e.g. an impl that runs in bf16 only
            row["fp64_loss_rel_err"] = row["fp64_grad_max_rel_err"] = None
            row["fp64_skipped"] = f"{type(err).__name__}: {str(err)[:200]}"
    return row


def classify_kernel(name):
    """The family of a kernel of a whole-model step: MODEL_RULES, then step_kernels' rules."""
    import step_kernels
    for rx, fam in MODEL_RULES:
        if re.search(rx, name):
            return fam
    return step_kernels.classify(name)[0]


def kernel_families(records, steps, names=None):
    """records: (name, start_us, dur_us) of the device kernels, memcpys and memsets of `steps`
    steps; names: {raw: demangled}. ({family: ms per step}, largest first, at most
    KERNEL_FAMILIES_KEPT and "(rest)"; the sum of every record per step in ms)."""
    names = names or {}
    fams = {}
    for name, _, dur in records:
        fam = classify_kernel(names.get(name, name))
        fams[fam] = fams.get(fam, 0.0) + dur / 1e3 / steps
    order = sorted(fams.items(), key=lambda kv: (-kv[1], kv[0]))
    kept = dict(order[:KERNEL_FAMILIES_KEPT])
    rest = sum(ms for _, ms in order[KERNEL_FAMILIES_KEPT:])
    if rest:
        kept["(rest)"] = rest
    return {f: round(ms, 4) for f, ms in kept.items()}, round(sum(fams.values()), 4)


def profile_step_kernels(step_model, ids, labels, steps, dev):
    """(kernel_families, kernel_sum_ms) over `steps` profiled training steps."""
    import step_kernels
    from torch.profiler import ProfilerActivity, profile
    sync(dev)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            train_step(step_model, ids, labels)
        sync(dev)
    records = step_kernels.device_records(prof.events())
    return kernel_families(records, steps, step_kernels.demangle({r[0] for r in records}))


def kernel_table(rows):
    """One Markdown table per model: kernel family by impl, ms per step (rows with
    kernel_families only; "" where none has them)."""
    out = []
    models = list(dict.fromkeys(r["model"] for r in rows if r.get("kernel_families")))
    for model in models:
        rs = [r for r in rows if r["model"] == model and r.get("kernel_families")]
        fams = {}
        for r in rs:
            for f, ms in r["kernel_families"].items():
                fams[f] = max(fams.get(f, 0.0), ms)
        order = sorted(fams, key=lambda f: (f == "(rest)", -fams[f], f))
        out += [f"### {model}: GPU time per step by kernel family, ms", "",
                "| kernel family | " + " | ".join(r["impl"] for r in rs) + " |",
                "|---|" + "---:|" * len(rs)]
        for f in order:
            cells = [format(r["kernel_families"][f], ".3f") if f in r["kernel_families"] else "—"
                     for r in rs]
            out.append(f"| {f} | " + " | ".join(cells) + " |")
        out.append("| **kernel sum** | " + " | ".join(
            format(r["kernel_sum_ms"], ".3f") for r in rs) + " |")
        out.append("| **step (wall)** | " + " | ".join(
            format(r["step_ms"], ".3f") for r in rs) + " |")
        out.append("")
    return "\n".join(out)


def emit(row, path):
    line = json.dumps(row)
    print(line, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def table(rows):
    def num(v, fmt):
        return "—" if v is None else format(v, fmt)

    lines = ["| model | impl | layers | tokens | step ms | first step s | peak GiB | loss | "
             "loss rel err | grad rel err | fp64 grad rel err |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['model']} | {r['impl']} | {r['layers']} | {r['tokens']} | "
                         f"skipped: {r['skipped'][:80]} | | | | | | |")
            continue
        peak = None if r["peak_bytes"] is None else r["peak_bytes"] / 2**30
        lines.append(
            f"| {r['model']} | {r['impl']} | {r['layers']} | {r['tokens']} | "
            f"{r['step_ms']:.2f} | {r['first_step_s']:.2f} | {num(peak, '.2f')} | "
            f"{r['loss']:.4f} | {num(r['loss_rel_err'], '.1e')} | "
            f"{num(r['grad_max_rel_err'], '.1e')} | {num(r.get('fp64_grad_max_rel_err'), '.1e')} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default=",".join(FAMILIES),
                    help=f"comma list of {', '.join(FAMILIES)}")
    ap.add_argument("--impl", default=",".join(IMPLS), help=f"comma list of {', '.join(IMPLS)}")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU-sized models (d 32, a few experts), float32, a short batch")
    ap.add_argument("--layers", type=int, default=0,
                    help="decoder layers (default: 2; 1 for deepseek_v3 at full size)")
    ap.add_argument("--batch", type=int, default=0,
                    help="sequences per step (default 4, gpt_oss 2; tiny 2)")
    ap.add_argument("--attn", default="",
                    help="attention implementation (default: the model's own; e.g. sdpa, eager, "
                         "flex_attention)")
    ap.add_argument("--seq", type=int, default=0, help="tokens per sequence (default 4096; tiny 16)")
    ap.add_argument("--vocab", type=int, default=0, help="vocabulary (default 4096; tiny 64)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="parameters' dtype (default: bfloat16; float32 with --tiny)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda where present)")
    ap.add_argument("--reps", type=int, default=0, help="timed steps (default 20; tiny 3)")
    ap.add_argument("--warmup", type=int, default=-1, help="untimed steps first (default 3; tiny 1)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--no-fp64", action="store_true", help="skip the tiny float64 check")
    ap.add_argument("--moeblaze-python", action="store_true",
                    help="moeblaze's Python path only (its C++ fast path off: no compile)")
    ap.add_argument("--sonicmoe-source", choices=("auto", "hub", "package"), default="auto",
                    help="what transformers' sonicmoe runs on: its hub kernel, PyPI's sonic-moe "
                         "package in its place, or the hub kernel where it loads, else the "
                         "package")
    ap.add_argument("--compile", nargs="?", const="inductor", default="",
                    help="torch.compile the whole model (backend: inductor, or the one given, "
                         "e.g. aot_eager); rows say which in `compile` and count dynamo's "
                         "graph breaks in `graph_breaks`")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="profile N more steps per impl and report the GPU time per kernel "
                         "family (CUDA only)")
    ap.add_argument("--out", default="", help="append the JSON lines here")
    ap.add_argument("--md", default="", help="write the Markdown table here")
    args = ap.parse_args(argv)
    SONICMOE["source"] = args.sonicmoe_source
    families = [f for f in args.family.split(",") if f]
    impls = [i for i in args.impl.split(",") if i]
    for f in families:
        if f not in FAMILIES:
            ap.error(f"unknown family '{f}'; one of {', '.join(FAMILIES)}")
    for i in impls:
        if i not in IMPLS:
            ap.error(f"unknown impl '{i}'; one of {', '.join(IMPLS)}")
    args.seq = args.seq or (16 if args.tiny else 4096)
    args.vocab = args.vocab or (64 if args.tiny else 4096)
    args.reps = args.reps or (3 if args.tiny else 20)
    args.warmup = args.warmup if args.warmup >= 0 else (1 if args.tiny else 3)
    if min(args.seq, args.vocab, args.reps) < 1 or args.layers < 0 or args.batch < 0:
        ap.error("--batch, --seq, --vocab and --reps must be >= 1, --layers >= 0")
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.kernels < 0 or (args.kernels and dev.type != "cuda"):
        ap.error(f"--kernels {args.kernels}: a count of profiled steps >= 0, and only on a CUDA "
                 f"device (this run's is {dev.type})")
    dtype = getattr(torch, args.dtype or ("float32" if args.tiny else "bfloat16"))
    try:
        import transformers
        from transformers.integrations.moe import ExpertsInterface  # noqa: F401
    except ImportError as err:
        print(f"model_step: skipped: transformers >= 5 is needed ({err})", file=sys.stderr)
        return 0
    meta = {"gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "driver": driver_version() if dev.type == "cuda" else None,
            "commit": git_commit(), "torch": torch.__version__,
            "transformers": transformers.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    with contextlib.ExitStack() as scope:
        if args.moeblaze_python and "moeblaze" in impls:
            try:
                import moeblaze
                # as a context: the caller's setting comes back (main() runs inside pytest too)
                scope.enter_context(moeblaze.use_extension(False))
            except ImportError:
                pass  # its rows say "not installed"
        rows = run_all(families, impls, args, dev, dtype, meta)
    md = table(rows)
    if args.kernels:
        md += "\n" + kernel_table(rows)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    print(md, file=sys.stderr)
    return 0


def run_all(families, impls, args, dev, dtype, meta):
    if dev.type == "cuda":  # the CUDA context and cuBLAS start before any timed first step
        torch.ones(64, 64, device=dev) @ torch.ones(64, 64, device=dev)
        sync(dev)
    rows = []
    for family in families:
        ref = {}
        # grouped_mm first: the others' loss and gradients are compared with its.
        for impl in sorted(impls, key=lambda i: i != "grouped_mm"):
            print(f"model_step: {family} {impl} ...", file=sys.stderr, flush=True)
            row = run_impl(family, impl, args, dev, dtype, meta, ref)
            rows.append(row)
            emit(row, args.out)
    return rows


if __name__ == "__main__":
    sys.exit(main())
