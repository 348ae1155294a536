"""bench/fsdp_overhead.py runs (tiny CPU shape, gloo at world size 1, in its own process) and
prints its table and a well-formed `fsdp-overhead` row. The GPU run is the benchmark itself."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "fsdp_overhead.py")
pytestmark = pytest.mark.skipif(not os.path.exists(SCRIPT),
                                reason="skipped: the repository's bench/ is not next to the tests")


def test_fsdp_overhead_tiny_runs():
    env = dict(os.environ, MASTER_PORT=str(29700 + os.getpid() % 200))
    r = subprocess.run([sys.executable, SCRIPT, "--tiny"], capture_output=True, text=True,
                       timeout=240, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "| fully_shard |" in r.stdout
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [row["experts"] for row in rows] == ["moeblaze", "torch"]  # --experts both
    for row in rows:
        assert row["bench"] == "fsdp-overhead" and row["gpu"] == "cpu"
        assert row["unsharded_ms"] > 0 and row["fully_shard_ms"] > 0
        assert row["ratio"] == pytest.approx(row["fully_shard_ms"] / row["unsharded_ms"])
