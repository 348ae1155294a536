"""bench/fp8_training.py on the CPU at a toy size: the three runs train from the same init, the
report's three files appear with the header lines, and the 1 % verdict (and the exit status)
follows the final validation losses; a failed run is reported, not fatal."""
import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import fp8_training as ft  # noqa: E402

TOY = ("--layers 1 --d 128 --heads 2 --E 4 --K 2 --n 128 --seq 16 --batch 2 --val-batches 1 "
       "--val-every 2 --log-every 2")


def _run(steps=4, val=5.0):
    return {"steps": steps, "final_val_loss": val, "val_loss": [[steps, val]]}


def test_compare_the_1_percent_rule():
    ratios, why = ft.compare({"bf16": _run(), "fp8": _run(val=5.04), "fp8-wgrad": _run(val=5.06)})
    assert ratios == pytest.approx({"fp8": 1.008, "fp8-wgrad": 1.012})
    assert len(why) == 1 and why[0].startswith("fp8-wgrad: final val loss 5.0600")
    _, why = ft.compare({"bf16": _run(), "fp8": _run(steps=2), "fp8-wgrad": {"error": "boom"}})
    assert sorted(w.split(":")[0] for w in why) == ["fp8", "fp8-wgrad"]
    assert ft.compare({"fp8": _run()}) == ({}, [])  # nothing to compare with


def test_three_runs_write_the_report(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MOEBLAZE_COMMIT", "abc1234")
    assert ft.main(["--device", "cpu", "--steps", "4", "--extra", TOY, "--out",
                    str(tmp_path)]) == 0
    md = (tmp_path / "training-fp8.md").read_text()
    assert md in capsys.readouterr().out
    for s in ("- device: CPU", "- torch: ", "MOEBLAZE_COMMIT): abc1234", "- date: ",
              "- command: `python bench/fp8_training.py --device cpu --steps 4", "| fp8-wgrad | ",
              "val loss @2 | val loss @4 |", "Final val loss fp8 / bf16: ", "**PASS**"):
        assert s in md, s
    r = json.loads((tmp_path / "training-fp8.json").read_text())
    assert list(r["runs"]) == ["bf16", "fp8", "fp8-wgrad"] and r["pass"]
    assert all(len(x["train_loss"]) == 4 and "median_step_s" in x for x in r["runs"].values())
    assert r["config"]["dtype"] == "bf16" and r["config"]["d"] == 128
    # same init and batches: the first step's loss (forward only, before any update) is close
    first = [x["train_loss"][0] for x in r["runs"].values()]
    assert max(first) - min(first) < 0.01
    if r["plot"]:
        assert (tmp_path / "training-fp8.png").stat().st_size > 0


def test_a_failed_run_is_reported_and_fails_the_exit_status(tmp_path, monkeypatch):
    train = ft.tt.train

    def flaky(a):
        if a.compute == "fp8":
            raise RuntimeError("no FP8 here")
        return train(a)
    monkeypatch.setattr(ft.tt, "train", flaky)
    assert ft.main(["--device", "cpu", "--steps", "2", "--computes", "bf16,fp8", "--extra", TOY,
                    "--out", str(tmp_path)]) == 1
    md = (tmp_path / "training-fp8.md").read_text()
    assert "| fp8 | failed: RuntimeError: no FP8 here |" in md and "**FAIL**" in md


def test_bad_flags_are_refused_before_training(tmp_path):
    for argv in (["--computes", "fp16"], ["--extra", "--compute fp8"],
                 ["--extra", "--dtype fp32"], ["--extra=--no-such-flag"]):
        with pytest.raises(SystemExit):
            ft.main(["--device", "cpu", "--out", str(tmp_path)] + argv)
