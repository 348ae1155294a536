"""bench/model_step.py in its tiny CPU mode for two families: DeepSeek-V3 (shared expert, sigmoid
router) and gpt-oss (expert biases, clamped SwiGLU). Every impl gives a row with the model-step
fields; moeblaze's loss and gradients match grouped_mm's and the float64 reference's at fp32's
bound; SonicMoE, which needs a GPU, says "not installed" instead of failing. moeblaze's C++ fast
path is left off (--moeblaze-python) so that a first run does not compile it."""
import importlib.util
import json
import math
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe", reason="transformers < 5: no experts "
                    "interface")

from helpers import TOL  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIELDS = ("model", "impl", "layers", "tokens", "d", "n", "E", "K", "step_ms", "first_step_s",
          "peak_bytes", "loss", "gpu", "commit", "date")


def load_model_step():
    spec = importlib.util.spec_from_file_location("model_step",
                                                  os.path.join(ROOT, "bench", "model_step.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_model_step_tiny_cpu(tmp_path):
    import moeblaze
    out = tmp_path / "rows.jsonl"
    ms = load_model_step()
    before = moeblaze.extension_status()
    assert ms.main(["--tiny", "--device", "cpu", "--family", "deepseek_v3,gpt_oss",
                    "--reps", "1", "--warmup", "0", "--moeblaze-python", "--out", str(out)]) == 0
    assert moeblaze.extension_status() == before  # --moeblaze-python leaves the setting as found
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["family"], r["impl"]) for r in rows] == [
        (f, i) for f in ("deepseek_v3", "gpt_oss") for i in ("grouped_mm", "sonicmoe", "moeblaze")]
    for r in rows:
        assert r["bench"] == "model-step" and r["gpu"] == "cpu"
        if r["impl"] == "sonicmoe":  # needs CUDA: reported, not raised
            assert r["skipped"].startswith("not installed"), r["skipped"]
            continue
        assert "skipped" not in r, r.get("skipped")
        for k in FIELDS:
            assert k in r, k
        assert r["step_ms"] > 0 and r["first_step_s"] > 0 and math.isfinite(r["loss"])
        assert r["model"] == {"deepseek_v3": "DeepSeek-V3", "gpt_oss": "gpt-oss-20b"}[r["family"]]
        tol = TOL[torch.float32]
        assert r["loss_rel_err"] <= tol and r["grad_max_rel_err"] <= tol, r
        assert r["fp64_loss_rel_err"] <= tol and r["fp64_grad_max_rel_err"] <= tol, r


def test_sonicmoe_package_stands_in_for_the_hub_kernel(monkeypatch):
    """--sonicmoe-source package: transformers' sonicmoe experts call the sonic-moe package's
    moe_general_routing_inputs (a fake here: the real one needs a Hopper GPU) with every argument
    as transformers passed it, the stream given through; `hub` without the hub kernel says
    "not installed"."""
    import sys
    import types
    sm = pytest.importorskip("transformers.integrations.sonicmoe")
    if not hasattr(sm, "SonicMoE"):
        pytest.skip("this transformers' sonicmoe integration has no SonicMoE bundle")
    calls = []

    class ActivationType:
        SWIGLU = "swiglu"

    def moe_general_routing_inputs(x, router_scores, token_indices, expert_indices, w1, b1, w2,
                                   b2, E, stream_id, activation_type,
                                   is_inference_mode_enabled=False, concat_layout=False):
        calls.append(dict(E=E, stream_id=stream_id, activation_type=activation_type,
                          concat_layout=concat_layout))
        return x + 1, None

    pkg = types.ModuleType("sonicmoe")
    enums = types.ModuleType("sonicmoe.enums")
    enums.ActivationType = ActivationType
    functional = types.ModuleType("sonicmoe.functional")
    functional.moe_general_routing_inputs = moe_general_routing_inputs
    for name, mod in (("sonicmoe", pkg), ("sonicmoe.enums", enums),
                      ("sonicmoe.functional", functional)):
        monkeypatch.setitem(sys.modules, name, mod)
    import importlib.metadata
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda d: "0.0-test" if d == "sonic-moe" else real_version(d))
    monkeypatch.setattr(sm, "_SONICMOE", None)
    ms = load_model_step()
    assert ms.use_sonicmoe("package") == "sonic-moe 0.0-test package in place of the hub kernel"
    bundle = sm.load_sonicmoe_kernel()
    assert bundle.activation_type_enum is ActivationType
    x = torch.zeros(3, 2)
    out, _ = bundle.moe_general_routing_inputs(x, None, None, None, None, None, None, None, E=4,
                                               activation_type="swiglu", concat_layout=True,
                                               is_inference_mode_enabled=False, stream_id=7)
    assert torch.equal(out, x + 1)
    assert calls == [dict(E=4, stream_id=7, activation_type="swiglu", concat_layout=True)]
    if not torch.cuda.is_available():
        with pytest.raises(ms.Skip, match="not installed"):
            ms.use_sonicmoe("hub")


def test_model_step_whole_model_compiled_cpu(tmp_path):
    """--compile: the whole model under torch.compile (aot_eager on the CPU: dynamo's graphs
    and autograd's, no code generation), moeblaze's experts included: no graph break anywhere in
    the model, and the loss and gradients of grouped_mm's compiled run."""
    out = tmp_path / "rows.jsonl"
    ms = load_model_step()
    assert ms.main(["--tiny", "--device", "cpu", "--family", "olmoe", "--impl",
                    "grouped_mm,moeblaze", "--reps", "1", "--warmup", "0", "--moeblaze-python",
                    "--no-fp64", "--compile", "aot_eager", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["impl"] for r in rows] == ["grouped_mm", "moeblaze"]
    for r in rows:
        assert "skipped" not in r, r.get("skipped")
        assert r["compile"] == "aot_eager" and r["graph_breaks"] == 0, r
    tol = TOL[torch.float32]
    assert rows[1]["loss_rel_err"] <= tol and rows[1]["grad_max_rel_err"] <= tol, rows[1]


def test_sampled_grads_reach_the_last_entry_of_a_large_parameter():
    # 2^24 + 4 entries: a float32 linspace to numel - 1 rounds its end up to numel (out of range)
    ms = load_model_step()
    p = torch.nn.Parameter(torch.zeros((1 << 24) + 4))
    p.grad = torch.zeros_like(p)
    p.grad[-1] = 1.0
    model = torch.nn.Module()
    model.w = p
    g = ms.sampled_grads(model)["w"]
    assert g.numel() == ms.SAMPLE and g[0] == 0 and g[-1] == 1.0


def test_kernel_families_name_the_parts_of_a_whole_model_step():
    """--kernels' families: the model's own parts first (attention, cuBLAS, loss), then the
    expert layer's kernels as bench/step_kernels.py names them; per-step sums, the largest kept
    and the rest summed, and the table's columns per impl."""
    model_step = load_model_step()
    names = {
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4> >(P)":
            "attention",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3_64x64x128":
            "attention",
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT": "cuBLAS GEMM (dense layers)",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1":
            "cuBLAS GEMM (dense layers)",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
        "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)":
            "loss",
        "void moeblaze::cuda::gemm::sm90::ws::varlen_k_ws_kernel<true, 1>(moeblaze::cuda::gemm::sm9":
            "wgrad dW1 varlen-K (ws)",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int)":
            "torch elementwise (grad accumulation etc.)",
    }
    for name, fam in names.items():
        assert model_step.classify_kernel(name) == fam, name
    # 3 steps: each kernel's time per step; one family per distinct kernel here
    recs = [(n, i, 1000.0 * (i + 1)) for i, n in enumerate(names)] * 3
    fams, total = model_step.kernel_families(recs, 3)
    assert total == pytest.approx(sum(1.0 * (i + 1) for i in range(len(names))))
    assert fams["loss"] == pytest.approx(5.0) and fams["attention"] == pytest.approx(3.0)
    assert list(fams)[0] == "torch elementwise (grad accumulation etc.)"  # the largest first
    kept = model_step.KERNEL_FAMILIES_KEPT
    many = [(f"other_kernel_{i}", 0, 1000.0) for i in range(kept + 3)]
    fams, total = model_step.kernel_families(many, 1)
    assert len(fams) == kept + 1 and fams["(rest)"] == pytest.approx(3.0) and total == kept + 3
    rows = [dict(model="M", impl=i, kernel_families={"attention": 2.0, "x": ms},
                 kernel_sum_ms=2.0 + ms, step_ms=3.0 + ms) for i, ms in (("a", 1.0), ("b", 4.0))]
    rows[1]["kernel_families"].pop("attention")
    md = model_step.kernel_table(rows)
    assert "| kernel family | a | b |" in md and "| x | 1.000 | 4.000 |" in md
    assert "| attention | 2.000 | — |" in md and "| **step (wall)** | 4.000 | 7.000 |" in md


def test_kernels_is_refused_off_cuda():
    model_step = load_model_step()
    with pytest.raises(SystemExit):
        model_step.main(["--tiny", "--device", "cpu", "--kernels", "2", "--family", "olmoe"])
