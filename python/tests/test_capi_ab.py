"""bench/capi_ab.py runs (tiny CPU shape, the loaded library twice, each round in its own
processes) and prints its table and one well-formed `capi-ab` row per library. The GPU run, the
wheel's build against a build without MOEBLAZE_CAPI_MANYLINUX, is the benchmark itself."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
from moeblaze import _lib  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "capi_ab.py")
pytestmark = pytest.mark.skipif(not os.path.exists(SCRIPT),
                                reason="skipped: the repository's bench/ is not next to the tests")


def test_capi_ab_tiny_runs():
    lib = _lib.library_path()
    r = subprocess.run([sys.executable, SCRIPT, lib, lib, "--tiny", "--rounds", "2"],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "| library | median ms |" in r.stdout
    rows = [json.loads(line) for line in r.stdout.strip().splitlines()[-2:]]
    assert [row["bench"] for row in rows] == ["capi-ab", "capi-ab"]
    assert all(row["lib"] == lib and row["gpu"] == "cpu" and row["ms"] > 0 for row in rows)
    assert all(len(row["round_ms"]) == 2 for row in rows) and rows[0]["ratio"] == 1.0


def test_capi_ab_refuses_a_missing_library(tmp_path):
    r = subprocess.run([sys.executable, SCRIPT, _lib.library_path(), str(tmp_path / "none.so"),
                        "--tiny"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "is not a file" in r.stderr
