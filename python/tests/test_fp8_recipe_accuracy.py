"""bench/fp8_recipe_accuracy.py's pieces on the CPU at a toy size: the per-expert float64
reference its --device cuda uses is dense_reference's to rounding, the GPU's rows (library bf16,
fp8, fp8-wgrad) measure and divide as printed, and --md writes the table with its header lines."""
import os
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import fp8_recipe_accuracy as fa  # noqa: E402

SHAPE = (96, 128, 128, 4, 2)  # T, d, n, E, K


@pytest.mark.parametrize("act", ["swiglu", "relu"])
def test_per_expert_reference_is_the_dense_one(act):
    ins = fa.make_inputs(*SHAPE, act, 0)
    for a, b in zip(fa.reference(*ins, act), fa.reference(*ins, act, per_expert=True)):
        assert float((a - b).norm() / b.norm()) < 1e-12


def test_gpu_rows_and_ratios_on_the_cpu():
    names = fa.variants("cuda", emulation=False)
    assert names == ["library bf16", "library fp8", "library fp8-wgrad"]
    w = fa.measure(*SHAPE, "swiglu", 1, "cpu", names)
    assert list(w) == names and all(len(e) == 4 for e in w.values())
    assert all(e < 0.01 for e in w["library bf16"])
    assert all(0.03 < e < 0.1 for v in ("library fp8", "library fp8-wgrad") for e in w[v])
    r = fa.ratios(w)
    assert set(r) == {"library fp8", "library fp8-wgrad"}
    assert r["library fp8"][2] == pytest.approx(w["library fp8"][2] / w["library bf16"][2])
    # fp8-wgrad moves only the weight gradients
    assert w["library fp8"][:2] == w["library fp8-wgrad"][:2]
    assert fa.ratios({"library fp8": "error: boom", "library bf16": [1.0] * 4}) == {}


def test_a_raising_row_is_reported_not_fatal(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("no\nGPU")
    monkeypatch.setattr(fa, "library", boom)
    w = fa.measure(*SHAPE, "swiglu", 2, "cpu", ["bf16", "library fp8"])
    assert isinstance(w["bf16"], list) and w["library fp8"] == "error: RuntimeError: no GPU"


def test_md_table_and_exit_status(tmp_path, monkeypatch, capsys):
    md = tmp_path / "acc.md"
    monkeypatch.setenv("MOEBLAZE_COMMIT", "abc1234")
    monkeypatch.setattr(sys, "argv", ["fp8_recipe_accuracy.py", "--shape", "64,128,128,2,1",
                                      "--seeds", "1", "--activations", "gelu", "--md", str(md)])
    assert fa.main() == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("fp8 recipe accuracy, T=64 d=128 n=128 E=2 K=1")
    assert [line.split()[1] for line in out[2:]] == ["bf16", "fp8-data", "fp8-all", "library",
                                                    "library"]
    text = md.read_text()
    for s in ("- device: CPU", "- torch: ", "MOEBLAZE_COMMIT): abc1234", "- date: ",
              "- command: `python fp8_recipe_accuracy.py --shape 64,128,128,2,1",
              "| gelu | fp8-all | "):
        assert s in text, s
