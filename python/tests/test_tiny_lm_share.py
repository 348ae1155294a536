"""bench/tiny_lm_share.py on the CPU at a toy size: the three models step, the "none" model has no
MoE parameters left, and the table's ceiling is torch's step over none's (the numbers it prints
are what it timed)."""
import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")
BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
sys.path.insert(0, BENCH)
import tiny_lm_share  # noqa: E402

TOY = ["--device", "cpu", "--layers", "1", "--d", "32", "--heads", "2", "--E", "4", "--K", "2",
       "--n", "32", "--seq", "16", "--batch", "2"]


def test_none_drops_every_moe_parameter():
    _, model, _ = tiny_lm_share.build("none", TOY)
    assert not any("moe" in name for name, _ in model.named_parameters())
    _, with_moe, _ = tiny_lm_share.build("torch", TOY)
    assert any("moe" in name for name, _ in with_moe.named_parameters())


def test_table_and_json_from_the_timed_steps(tmp_path, capsys):
    out = tmp_path / "share.json"
    assert tiny_lm_share.main(["--rounds", "2", "--steps", "2", "--warmup", "1", "--json",
                               str(out), "--"] + TOY) == 0
    r = json.loads(out.read_text())
    assert set(r["times_ms"]) == {"torch", "moeblaze", "none"}
    assert all(len(v) == 4 for v in r["times_ms"].values())  # 2 rounds x 2 steps
    text = capsys.readouterr().out
    ceiling = r["median_ms"]["torch"] / r["median_ms"]["none"]
    assert f"ceiling (torch / none): {ceiling:.3f}" in text
    host = r["moe_forward_host_ms_per_step"]
    assert host["none"] > 0 and host["torch"] > 0 and host["moeblaze"] > 0
