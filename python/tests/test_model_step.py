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
