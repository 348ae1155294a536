"""scripts/gpu_check.sh refuses a PART it does not know, by name, before it builds or runs
anything (a misspelt part used to run nothing and report nothing)."""
import os
import subprocess

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_unknown_part_is_refused_by_name(tmp_path):
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), str(tmp_path),
                        "peers", "peer-grid"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "unknown PART 'peer-grid'" in p.stderr and " peers-grid " in p.stderr
    assert os.listdir(tmp_path) == []  # nothing built, logged or run
