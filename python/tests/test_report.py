"""docs/PERFORMANCE.md is what bench/report.py makes of bench/results/: the check regenerates the
page in memory (standard library only, no matplotlib) and fails on any difference."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
REPORT = os.path.join(ROOT, "bench", "report.py")


@pytest.mark.skipif(not os.path.isfile(REPORT) or
                    not os.path.isdir(os.path.join(ROOT, "bench", "results")),
                    reason="the repository's bench/ is not beside these tests (installed copy)")
def test_performance_page_matches_the_result_files():
    got = subprocess.run([sys.executable, REPORT, "--check"], capture_output=True, text=True,
                         timeout=120)
    assert got.returncode == 0, (
        "docs/PERFORMANCE.md differs from bench/results/; regenerate it with "
        "`python3 bench/report.py`\n" + got.stdout[-4000:] + got.stderr[-2000:])


@pytest.mark.skipif(not os.path.isfile(REPORT), reason="the repository's bench/ is not here")
def test_search_section_reads_the_choice_rows_and_the_rounds(monkeypatch):
    """A rounds-based search file (34823b3 on): the verdict is choice_ms / best_ms, not the *-auto
    row's; auto / choice is the noise column; a miss says whether it held in every round."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("report", REPORT)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    base = {"bench": "kernel-search", "config": "s", "T": 4096, "d": 2048, "n": 512, "E": 32,
            "K": 4, "S": 16384, "gpu": "NVIDIA H100 80GB HBM3", "commit": "abc1234", "rounds": 5,
            "chosen": "chosen kernel", "best": "fastest kernel"}
    rows = [dict(base, gemm="up_proj", auto_ms=1.0, best_ms=1.0, auto_over_best=1.0,
                 choice_ms=1.02, choice_over_best=1.02, choice_over_best_round_lo=0.99,
                 choice_over_best_round_hi=1.04),
            dict(base, gemm="down_proj", auto_ms=1.5, best_ms=1.0, auto_over_best=1.5,
                 choice_ms=1.2, choice_over_best=1.2, choice_over_best_round_lo=1.1,
                 choice_over_best_round_hi=1.3),
            dict(base, gemm="dx_proj", auto_ms=1.1, best_ms=1.0, auto_over_best=1.1,
                 choice_ms=1.08, choice_over_best=1.08, choice_over_best_round_lo=0.97,
                 choice_over_best_round_hi=1.15)]
    monkeypatch.setattr(report, "SEARCH", ["kernel-search-2026-12-07-abc1234-h100.jsonl"])
    monkeypatch.setattr(report, "LAYER_SEARCH", [])  # the in-call section has a test of its own
    monkeypatch.setattr(report, "jsonl", lambda name: rows)
    out = report.search_section()
    geo = (1.02 * 1.2 * 1.08) ** (1 / 3)
    assert f"| {geo:.3f} | 1.200 | 1 of 3 |" in out  # choice / best, not auto / best (1.5)
    assert "0.980–1.250" in out  # auto / choice over the three GEMMs
    assert "| down_proj | chosen kernel | fastest kernel | 1.200 | yes |" in out
    assert "| dx_proj | chosen kernel | fastest kernel | 1.080 | no |" in out


@pytest.mark.skipif(not os.path.isfile(REPORT), reason="the repository's bench/ is not here")
def test_layer_search_section_reads_the_call_rows_beside_the_alone_search(monkeypatch):
    """`bench layer --search` rows: one line per run (auto / best inside the call), and each
    GEMM off by more than 3 % with the whole call's ratio and the alone search's verdict."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("report", REPORT)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    gpu = "NVIDIA H100 80GB HBM3"
    base = {"bench": "layer-search", "config": "s", "model": "Some-MoE", "T": 4096, "d": 2048,
            "n": 512, "E": 32, "K": 4, "S": 16384, "gpu": gpu, "commit": "abc1234",
            "max_rel_err": 0.003, "rounds": 3, "reps": 9}
    call = [dict(base, gemm="down_proj", kernel="A", auto=True, ms=1.2, call_ms=10.0,
                 round_ms=[1.2, 1.2]),
            dict(base, gemm="down_proj", kernel="B", auto=False, ms=1.0, call_ms=9.8,
                 round_ms=[1.0, 1.1]),
            dict(base, gemm="dx_proj", kernel="C", auto=True, ms=2.0, call_ms=10.0,
                 round_ms=[2.0, 2.0]),
            dict(base, gemm="dx_proj", kernel="D", auto=False, ms=2.02, call_ms=10.1,
                 round_ms=[2.0, 2.1])]
    alone = [{"bench": "kernel-search", "gpu": gpu, "config": "s", "gemm": "down_proj",
              "choice_over_best": 1.0, "chosen": "A", "best": "A"}]
    files = {"layer-search-2026-12-08-abc1234-h100.jsonl": call,
             "kernel-search-2026-12-08-abc1234-h100.jsonl": alone}
    monkeypatch.setattr(report, "LAYER_SEARCH", ["layer-search-2026-12-08-abc1234-h100.jsonl"])
    monkeypatch.setattr(report, "SEARCH", ["kernel-search-2026-12-08-abc1234-h100.jsonl"])
    monkeypatch.setattr(report, "jsonl", lambda name: files[name])
    out = report.layer_search_section()
    geo = (1.2 / 1.0 * 1.0) ** 0.5
    assert f"| NVIDIA H100 | abc1234 | 1 | 2 | {geo:.3f} | 1.200 | 1 of 2 | 3 x 9 |" in out
    assert ("| NVIDIA H100 | Some-MoE | 4096 / 2048 / 512 / 32 / 4 | down_proj | A | B | 1.200 | yes | "
            "1.020 | 1.000 |") in out
    assert "| dx_proj |" not in out  # the automatic kernel is the fastest there


@pytest.mark.skipif(not os.path.isfile(REPORT), reason="the repository's bench/ is not here")
def test_model_step_section_and_readme_table(monkeypatch):
    """model-step rows: moeblaze's step over SonicMoE's and grouped_mm's per model (a skipped
    impl shows as —), and README.md's table replaced between its marks, nothing else."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("report", REPORT)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    base = {"bench": "model-step", "layers": 2, "tokens": 16384, "gpu": "NVIDIA H100 80GB HBM3",
            "commit": "abc1234", "date": "2026-12-07T00:00:00+00:00", "loss": 10.0}

    def row(model, impl, ms, peak, first, err):
        return dict(base, model=model, impl=impl, step_ms=ms, peak_bytes=peak, first_step_s=first,
                    grad_max_rel_err=err)
    rows = [row("Qwen3-30B-A3B", "grouped_mm", 160.0, 18 << 30, 2.0, 0.0),
            row("Qwen3-30B-A3B", "sonicmoe", 120.0, 13 << 30, 300.0, 0.004),
            row("Qwen3-30B-A3B", "moeblaze", 108.0, 12 << 30, 1.5, 0.003),
            row("OLMoE-1B-7B", "grouped_mm", 50.0, 6 << 30, 1.0, 0.0),
            dict(base, model="OLMoE-1B-7B", impl="sonicmoe", skipped="not installed: x"),
            row("OLMoE-1B-7B", "moeblaze", 30.0, 4 << 30, 1.0, 0.002)]
    name = "model-step-2026-12-07-abc1234-h100.jsonl"
    monkeypatch.setattr(report, "MODEL_STEP", name)
    monkeypatch.setattr(report, "jsonl", lambda n: rows)
    out = report.model_step_section()
    assert "0.900× SonicMoE's" in out.replace("\n", " ") and "over 1 model and" in out
    assert "0.600–0.675×" in out  # grouped_mm: 108 / 160 and 30 / 50
    assert ("| Qwen3-30B-A3B | 160.00 | 120.00 | 108.00 | 0.900 | 0.675 | 18.00 / 13.00 / 12.00 "
            "| 2.00 / 300.00 / 1.50 | 3.0e-03 |") in out
    assert "| OLMoE-1B-7B | 50.00 | — | 30.00 | — | 0.600 |" in out
    begin, end = report.MODEL_STEP_MARKS
    readme = f"# x\n\nbefore\n\n{begin}\nold table\n{end}\n\nafter\n"
    got = report.readme_with_model_step(readme)
    assert got.startswith("# x\n\nbefore\n\n" + begin) and got.endswith(end + "\n\nafter\n")
    assert "old table" not in got and "| Qwen3-30B-A3B | 160.00 |" in got
    assert "(bench/results/" + name + ")" in got and "../bench/results/" not in got
    assert report.readme_with_model_step(got) == got
    assert report.readme_with_model_step("# no marks\n") == "# no marks\n"


@pytest.mark.skipif(not os.path.isfile(REPORT), reason="the repository's bench/ is not here")
def test_rules_section_uses_the_kernel_rules_thresholds():
    """The rules section splits its rows by the C++ rule's thresholds: its copy of them must be
    the constants kernel_config.hpp defines."""
    import importlib.util
    import re
    spec = importlib.util.spec_from_file_location("report", REPORT)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    hpp = os.path.join(ROOT, "src", "cuda", "gemm", "dispatch", "kernel_config.hpp")
    text = open(hpp).read()
    for name, value in report.RULE_CONSTANTS.items():
        m = re.search(r"constexpr int64_t " + name + r" = (\d+);", text)
        assert m, f"{name} is not defined in kernel_config.hpp"
        assert int(m.group(1)) == value, f"{name}: report.py says {value}, the code {m.group(1)}"


@pytest.mark.skipif(not os.path.isfile(REPORT), reason="the repository's bench/ is not here")
def test_sonic_grid_section_reads_every_run_and_keeps_a_shapes_last(monkeypatch):
    """Two runs' sonicmoe-grid files: a shape in both comes from the later file (its three
    implementations from one run, so the ratios stay within one run), each row names its GPU."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("report", REPORT)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)

    def rows(config, gpu, mb, commit):
        base = {"bench": "peers", "config": config, "model": config.upper(), "T": 8192, "d": 1024,
                "n": 512, "E": 32, "K": 4, "gpu": gpu, "commit": commit,
                "date": "2026-12-07T00:00:00Z", "peak_bytes": 1 << 30, "max_rel_err": 0.0035}
        return [dict(base, impl="moeblaze-torch", total_ms=mb, bwd_ms=mb / 2),
                dict(base, impl="sonicmoe", total_ms=10.0, bwd_ms=5.0),
                dict(base, impl="torch", total_ms=20.0, bwd_ms=10.0)]
    files = {"old.jsonl": rows("a", "NVIDIA H100 80GB HBM3", 9.0, "aaaaaaa") +
                          rows("b", "NVIDIA H100 80GB HBM3", 9.5, "aaaaaaa"),
             "new.jsonl": rows("a", "NVIDIA H200", 8.0, "bbbbbbb")}
    monkeypatch.setattr(report, "SONIC_GRIDS", ["old.jsonl", "new.jsonl"])
    monkeypatch.setattr(report, "jsonl", lambda name: files[name])
    out = report.sonic_grid_section()
    assert "| A | 8192 / 1024 / 512 / 32 / 4 | H200 | 8.000 | 10.000 | 0.800 | 0.800 |" in out
    assert "| B | 8192 / 1024 / 512 / 32 / 4 | H100 | 9.500 | 10.000 | 0.950 | 0.950 |" in out
    assert "| A | 8192 / 1024 / 512 / 32 / 4 | H100 |" not in out
    assert "`old.jsonl`" in out and "`new.jsonl`" in out


def _cli():
    """MOEBLAZE_CLI, else the repository's build/moeblaze (the rule's own answer needs no GPU)."""
    built = os.path.join(ROOT, "build", "moeblaze")
    return os.environ.get("MOEBLAZE_CLI") or (built if os.access(built, os.X_OK) else None)


@pytest.mark.skipif(not os.path.isfile(REPORT) or not _cli(),
                    reason="needs the repository's bench/ and a moeblaze CLI (set MOEBLAZE_CLI)")
def test_pair_rule_copy_agrees_with_the_kernel_rule():
    """report.py labels each pair-table row with its own copy of the up-projection's and dH's
    cluster-of-2 window (gather_pair_rule). It must say what the C++ rule picks: asked here of
    `moeblaze bench kernels` for shapes on both sides of every edge of the window (rows per expert
    117-241, d on both sides of 4096) on the H100's and the H200's FLOPs per DRAM byte, and, for
    dH, on both sides of an expert's W2 filling the L2 (n = 6400 at d = 4096: 50 MiB)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("report", REPORT)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    E, K = 64, 8
    shapes = [(r * E // K, d, n) for r in (117, 118, 150, 151, 160, 216, 217, 240, 241, 512)
              for d in (2048, 4096) for n in (512, 6336, 6400)]
    names = [f"T{T}-d{d}-n{n}-E{E}-K{K}" for T, d, n in shapes]
    for fpb in (319, 217):
        out = subprocess.run([_cli(), "bench", "kernels", "--config", ",".join(names),
                              "--flops-per-byte", str(fpb), "--l2-mib", "50"],
                             capture_output=True, text=True, timeout=120, check=True).stdout
        cluster = {}
        for line in out.splitlines():
            cells = [c.strip() for c in line.split("|")]
            if len(cells) == 10 and cells[2] in ("up_proj", "dh_proj"):
                cluster[(cells[0], cells[2])] = cells[7] == "2"
        for (T, d, n), name in zip(shapes, names):
            row = {"S": T * K, "E": E, "d": d, "n": n}
            want = (cluster[(name, "up_proj")], cluster[(name, "dh_proj")])
            assert report.gather_pair_rule(row, fpb) == want, (name, fpb, want)
