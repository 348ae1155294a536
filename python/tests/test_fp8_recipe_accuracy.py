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


def test_pow2_scales_are_powers_of_two_and_only_on_request():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 300, generator=g) * torch.tensor([[1e-3], [1.0], [700.0]])
    x[0, 5:] = 0  # one partial group nonzero, the rest all zero (scale 1)
    exact, p2 = fa.fq_rows(x), fa.fq_rows(x, pow2=True)
    for r in range(3):
        for c0 in range(0, 300, 128):
            grp, q = x[r, c0:c0 + 128], p2[r, c0:c0 + 128]
            amax = float(grp.abs().max())
            if amax == 0:
                assert torch.equal(q, grp)
                continue
            scale = 2.0 ** torch.ceil(torch.log2(torch.tensor(max(amax, fa.FLOOR) / 448.0)))
            # every value dequantizes to an e4m3 value times the group's power-of-two scale
            codes = q / scale
            assert torch.equal(codes.to(torch.float8_e4m3fn).float(), codes)
            assert float(codes.abs().max()) <= 448.0
    assert not torch.equal(exact, p2)  # a different rule, not the same bits renamed
    assert "fp8-data-pow2" not in fa.variants("cpu")
    assert fa.variants("cpu", pow2=True)[:4] == ["bf16", "fp8-data", "fp8-all", "fp8-data-pow2"]
    ins = fa.make_inputs(*SHAPE, "swiglu", 0)
    errs = [fa.rel(a, r) for a, r in zip(fa.layer(*ins, "swiglu", "fp8-data-pow2"),
                                         fa.reference(*ins, "swiglu"))]
    assert all(0.03 < e < 0.1 for e in errs)
