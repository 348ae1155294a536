"""bench/layer_search.py without a GPU: the verdict per (GPU, shape, GEMM) from `bench layer
--search` rows (the automatic kernel's step over the fastest that ran, whether that held in every
round, the whole call's ratio), the summary line, and the alone search set beside it."""
import json
import os
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
sys.path.insert(0, BENCH)
import layer_search  # noqa: E402

WS = "ws_gather cooperative 128x256x64 stages=4 cluster=1 raster=16"
WS_PP = "ws_gather ping_pong 128x128x64 stages=6 cluster=1 raster=16"
TMA_PP = "tma_grouped ping_pong 192x128x64 stages=auto cluster=2 order=n swizzle=2 bands=1"
SHAPE = dict(T=8192, d=7168, n=2048, E=384, K=8, S=65536, gpu="NVIDIA H100 80GB HBM3")


def row(gemm, kernel, ms, call, rounds, auto=False, **extra):
    r = dict(SHAPE, bench="layer-search", config="kimi-k2", model="Kimi-K2", gemm=gemm,
             kernel=kernel, spec="" if auto else "x", auto=auto, ms=ms, call_ms=call,
             round_ms=rounds, max_rel_err=0.003)
    r.update(extra)
    return r


ROWS = [
    row("down_proj", TMA_PP, 2.0, 46.0, [2.0, 2.1], auto=True),
    row("dx_proj", TMA_PP, 4.0, 46.0, [4.0, 4.0], auto=True),
    row("down_proj", WS, 1.8, 45.5, [1.8, 1.9]),         # faster in every round
    row("down_proj", WS_PP, 2.5, 46.3, [2.5, 2.4]),
    row("dx_proj", WS, 3.95, 46.1, [3.9, 4.1]),          # faster pooled, not in every round
    {**row("dx_proj", WS_PP, None, None, None), "skipped": "unsupported"},
]


def test_verdicts_per_gemm():
    vs = {v["gemm"]: v for v in layer_search.verdicts(ROWS)}
    down, dx = vs["down_proj"], vs["dx_proj"]
    assert down["best"] == WS and abs(down["auto_over_best"] - 2.0 / 1.8) < 1e-12
    assert down["every_round"] is True
    assert abs(down["call_ratio"] - 46.0 / 45.5) < 1e-12
    assert down["timed"] == 3 and down["skipped"] == 0
    assert dx["best"] == WS and dx["every_round"] is False
    assert dx["timed"] == 2 and dx["skipped"] == 1


def test_the_automatic_kernel_as_the_fastest():
    rows = [row("up_proj", WS, 9.8, 46.0, [9.8], auto=True), row("up_proj", WS_PP, 10.5, 47, [10.5])]
    (v,) = layer_search.verdicts(rows)
    assert v["best"] == WS and v["auto_over_best"] == 1.0 and v["every_round"] is None
    assert v["call_ratio"] == 1.0


def test_summary_counts_the_target():
    (line,) = layer_search.summary(layer_search.verdicts(ROWS))
    assert "1 shapes, 2 GEMMs" in line
    assert "1 of 2 within 1.03" in line  # dx 4.0 / 3.95 = 1.013; down 1.111
    assert "worst 1.111 (down_proj at kimi-k2)" in line


def test_alone_beside_and_the_command(tmp_path, capsys):
    rows = tmp_path / "layer.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    alone = tmp_path / "alone.jsonl"
    alone.write_text(json.dumps(dict(SHAPE, bench="kernel-search", config="kimi-k2",
                                     gemm="down_proj", chosen=TMA_PP, best=WS_PP,
                                     choice_over_best=1.2)) + "\n")
    md = tmp_path / "out.md"
    assert layer_search.main([str(rows), "--alone", str(alone), "--md", str(md)]) == 0
    out = capsys.readouterr().out
    assert out == md.read_text()
    down = [l for l in out.splitlines() if "| down_proj |" in l][0]
    assert down.endswith(f"| 1.200 | {WS_PP} | no |")  # alone named another fastest
    dx = [l for l in out.splitlines() if "| dx_proj |" in l][0]
    assert dx.endswith("| - | - | - |")


def test_alone_rows_from_before_the_candidate_rows(tmp_path, capsys):
    """A kernel-search file before 34823b3: no choice_over_best (auto_over_best is the verdict)
    and `best` a bench row name, which cannot be compared with a kernel named field by field."""
    rows = tmp_path / "layer.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    alone = tmp_path / "alone.jsonl"
    alone.write_text(json.dumps(dict(SHAPE, bench="kernel-search", config="kimi-k2",
                                     gemm="down_proj", chosen=TMA_PP, best="down-ws",
                                     auto_over_best=1.1)) + "\n")
    assert layer_search.main([str(rows), "--alone", str(alone)]) == 0
    down = [l for l in capsys.readouterr().out.splitlines() if "| down_proj |" in l][0]
    assert down.endswith("| 1.100 | down-ws | - |")


def test_no_rows_is_an_error(tmp_path, capsys):
    empty = tmp_path / "e.jsonl"
    empty.write_text(json.dumps({"bench": "layer", "config": "x"}) + "\n")
    assert layer_search.main([str(empty)]) == 1
    assert "no 'layer-search' rows" in capsys.readouterr().err


def test_steps_mode_sets_each_gemm_alone_beside_its_step_in_the_call(tmp_path, capsys):
    gpu = "NVIDIA H100 80GB HBM3"
    steps = [{"bench": "layer-call-step", "config": "kimi-k2", "impl": "moeblaze", "step": s,
              "ms": ms, "gpu": gpu} for s, ms in (("1 up-proj", 9.9), ("2 down-proj", 4.0),
                                                   ("call", 46.5))]
    steps.append({"bench": "layer-call-step", "config": "kimi-k2", "impl": "moeblaze-recompute",
                  "step": "1 up-proj", "ms": 99.0, "gpu": gpu})  # another impl: not compared
    gemm = [{"bench": "gemm", "config": "kimi-k2", "gemm": g, "ms": ms, "gpu": gpu}
            for g, ms in (("up-auto", 16.2), ("up-auto", 15.5), ("up-auto", 16.3),
                          ("down-auto", 4.4), ("dW1-auto", 7.0))]
    s_path, g_path = tmp_path / "steps.jsonl", tmp_path / "gemm.jsonl"
    s_path.write_text("".join(json.dumps(r) + "\n" for r in steps))
    g_path.write_text("".join(json.dumps(r) + "\n" for r in gemm))
    assert layer_search.main(["--steps", str(s_path), "--alone", str(g_path)]) == 0
    out = capsys.readouterr().out
    assert f"| {gpu} | kimi-k2 | up | 16.200 | 9.900 | {16.2 / 9.9:.3f} |" in out  # medians
    assert f"| {gpu} | kimi-k2 | down | 4.400 | 4.000 | 1.100 |" in out
    assert "dW1" not in out  # no step row to set it beside
