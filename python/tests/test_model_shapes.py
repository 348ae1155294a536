"""The public-model grid is well formed, and its two copies agree: bench/model_shapes.py (what
bench/peers.py reads) and tools/configs.cpp's model_grid() (what `moeblaze bench layer --config
grid` reads). With a `moeblaze` binary (MOEBLAZE_CLI, build/moeblaze or PATH), `moeblaze run
--config list` must print every grid row. CPU only, no library calls."""
import importlib.util
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_grid():
    spec = importlib.util.spec_from_file_location("model_shapes",
                                                  os.path.join(ROOT, "bench", "model_shapes.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cpp_grid():
    """(name, T, d, n, E, K, model, activation) of each row of model_grid() in configs.cpp."""
    with open(os.path.join(ROOT, "tools", "configs.cpp")) as f:
        src = f.read()
    body = src[src.index("model_grid() {"):]
    body = body[:body.index("return grid;")]
    body = re.sub(r"//[^\n]*", "", body)  # comments name numbers too
    row = re.compile(r'\{\s*"([^"]+)",\s*(\d+),\s*(\d+),\s*(\d+),\s*(\d+),\s*(\d+),\s*"[^"]*",'
                     r'\s*"([^"]+)"(?:,\s*"([^"]+)")?\s*\}')
    return [(m[0], *map(int, m[1:6]), m[6], m[7] or "swiglu") for m in row.findall(body)]


def test_grid_is_well_formed():
    grid = load_grid().GRID
    assert len(grid) >= 24
    names = [r[0] for r in grid]
    assert len(set(names)) == len(names), "grid names must be unique"
    for name, T, d, n, E, K, model, act in grid:
        assert model, name
        assert 1 <= K <= E, name
        assert 8192 <= T <= 32768, name  # a realistic per-GPU batch
        assert d % 64 == 0 and n % 64 == 0, name  # the CUDA backend's shape rule
        assert act in ("swiglu", "swiglu-oai"), name
    assert sum(r[1] % 128 != 0 for r in grid) >= 2, "two T off the 128-row tiles at least"
    models = {r[6] for r in grid}
    for m in ("Mixtral-8x7B", "Mixtral-8x22B", "DBRX", "DeepSeek-V2-Lite", "DeepSeek-V2",
              "DeepSeek-V3", "Qwen1.5-MoE-A2.7B", "Qwen2-57B-A14B", "Qwen3-30B-A3B",
              "Qwen3-235B-A22B", "Qwen3-Next-80B-A3B", "OLMoE-1B-7B", "GLM-4.5", "GLM-4.5-Air",
              "gpt-oss-20b", "gpt-oss-120b", "Kimi-K2", "Llama-4-Scout", "Llama-4-Maverick",
              "Phi-3.5-MoE"):
        assert m in models, m


def test_grid_does_not_shadow_the_named_configs():
    import sys
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        from torch_reference import CONFIGS, EXTRA_SHAPES
    finally:
        sys.path.pop(0)
    for name in load_grid().SHAPES:
        assert name not in CONFIGS and name not in EXTRA_SHAPES and name != "grid", name


def test_cpp_and_python_grids_agree():
    assert cpp_grid() == [tuple(r) for r in load_grid().GRID]


def find_cli():
    """MOEBLAZE_CLI, else the repository's build/moeblaze, else `moeblaze` on PATH."""
    built = os.path.join(ROOT, "build", "moeblaze")
    return (os.environ.get("MOEBLAZE_CLI") or (built if os.access(built, os.X_OK) else None)
            or shutil.which("moeblaze"))


@pytest.mark.skipif(not find_cli(), reason="skipped: no moeblaze CLI (set MOEBLAZE_CLI)")
def test_cli_lists_the_grid():
    cli = find_cli()
    out = subprocess.run([cli, "run", "--config", "list"], capture_output=True, text=True,
                         check=True).stdout
    listed = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) == 9:  # the grid table: name T d n E K S activation model
            listed[cells[0]] = cells
    for name, T, d, n, E, K, model, act in load_grid().GRID:
        assert name in listed, name
        assert listed[name][1:6] == [str(T), str(d), str(n), str(E), str(K)], name
        assert listed[name][7:] == [act, model], name
