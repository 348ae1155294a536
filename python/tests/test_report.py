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
