"""bench/override_sweep.py without a GPU: a stand-in for the moeblaze binary records each call and
writes bench layer rows, and the sweep alternates the specs' order, times --shapes one `--shape`
call each after the configs, sets MOEBLAZE_KERNELS per spec, and tables each shape's median ratio."""
import json
import os
import signal
import stat
import subprocess
import sys
import time

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")

FAKE_CLI = r'''#!/usr/bin/env python3
import json, os, sys
args = sys.argv[1:]
out = args[args.index("--out") + 1]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps({"args": args, "kernels": os.environ.get("MOEBLAZE_KERNELS", "")}) + "\n")
names = ([args[args.index("--shape") + 1]] if "--shape" in args
         else args[args.index("--config") + 1].split(","))
ms = 2.0 if "raster=8" in os.environ.get("MOEBLAZE_KERNELS", "") else 1.0
with open(out, "w") as f:
    for n in names:
        name = "T" + n.replace(",", "-") if "," in n else n
        f.write(json.dumps({"config": name, "impl": "moeblaze", "total_ms": ms, "fwd_ms": ms / 4,
                            "bwd_ms": 3 * ms / 4}) + "\n")
'''


def test_shapes_run_one_call_each_after_the_configs(tmp_path):
    cli = tmp_path / "moeblaze"
    cli.write_text(FAKE_CLI)
    cli.chmod(cli.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "calls.jsonl"
    env = dict(os.environ, FAKE_LOG=str(log))
    p = subprocess.run([sys.executable, os.path.join(BENCH, "override_sweep.py"), "--cli", str(cli),
                        "--bench", "layer", "--configs", "a,b", "--shapes", "8,64,32,4,2; 9,64,32,4,2",
                        "--specs", ";raster=8", "--rounds", "2", "--out", str(tmp_path / "r.jsonl")],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    calls = [json.loads(line) for line in open(log)]
    # Round 1 runs the specs forwards, round 2 backwards; per spec the configs, then each shape.
    assert [c["kernels"] for c in calls] == [""] * 3 + ["raster=8"] * 6 + [""] * 3
    assert [c["args"][2:4] for c in calls[:3]] == [["--config", "a,b"], ["--shape", "8,64,32,4,2"],
                                                   ["--shape", "9,64,32,4,2"]]
    rows = [json.loads(line) for line in open(tmp_path / "r.jsonl")]
    assert len(rows) == 16 and {r["kernels"] for r in rows} == {"", "raster=8"}
    for name in ("a", "b", "T8-64-32-4-2", "T9-64-32-4-2"):
        assert f"| {name} | moeblaze | 1.000 | 2.000 (2.000) |" in p.stdout
        # the step's forward and backward apart, under the same specs
        assert f"| {name} | moeblaze fwd | 0.250 | 0.500 (2.000) |" in p.stdout
        assert f"| {name} | moeblaze bwd | 0.750 | 1.500 (2.000) |" in p.stdout


def test_shapes_need_bench_layer_and_something_to_run(tmp_path):
    sweep = os.path.join(BENCH, "override_sweep.py")
    for extra, message in ((["--bench", "gemm", "--only", "up", "--shapes", "8,64,32,4,2"],
                            "--shapes takes bench layer only"),
                           (["--bench", "layer"], "give --configs, --shapes")):
        p = subprocess.run([sys.executable, sweep, "--specs", ";x", *extra], capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 2 and message in p.stderr, p.stderr


def test_a_stopped_sweep_keeps_the_calls_that_ran(tmp_path):
    cli = tmp_path / "moeblaze"
    # the stand-in above, but a call under the spec "slow" hangs after logging itself
    hang = 'import time\nif os.environ.get("MOEBLAZE_KERNELS") == "slow":\n    time.sleep(60)\n'
    cli.write_text(FAKE_CLI.replace("names = (", hang + "names = (", 1))
    cli.chmod(cli.stat().st_mode | stat.S_IEXEC)
    log, out, md = tmp_path / "calls.jsonl", tmp_path / "r.jsonl", tmp_path / "r.md"
    env = dict(os.environ, FAKE_LOG=str(log))
    p = subprocess.Popen([sys.executable, os.path.join(BENCH, "override_sweep.py"), "--cli",
                          str(cli), "--bench", "layer", "--configs", "a,b", "--specs", ";slow",
                          "--rounds", "2", "--out", str(out), "--md", str(md)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 2):
        time.sleep(0.1)
    assert len(log.read_text().splitlines()) == 2  # the second call, "slow", has started
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, stderr
    rows = [json.loads(line) for line in open(out)]
    assert [(r["config"], r["kernels"]) for r in rows] == [("a", ""), ("b", "")]
    text = md.read_text()
    assert "| a | moeblaze | 1.000 | — |" in text and "partial: 1 of 4 calls ran" in text
    assert "stopped after 1 of 4 calls" in stderr


def test_a_shape_the_bench_skips_is_named_not_dropped(tmp_path):
    cli = tmp_path / "moeblaze"
    # the stand-in above, but the shape 7,... gets no row and a device-error line, as a shape too
    # large for the GPU's memory does
    skip = ('if "--shape" in args and args[args.index("--shape") + 1].startswith("7,"):\n'
            '    print("bench layer: T7: device error: out of memory", file=sys.stderr)\n'
            '    open(out, "w").close()\n'
            '    sys.exit(0)\n')
    cli.write_text(FAKE_CLI.replace("names = (", skip + "names = (", 1))
    cli.chmod(cli.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, FAKE_LOG=str(tmp_path / "calls.jsonl"))
    p = subprocess.run([sys.executable, os.path.join(BENCH, "override_sweep.py"), "--cli", str(cli),
                        "--bench", "layer", "--configs", "a", "--shapes", "8,64,32,4,2;7,64,32,4,2",
                        "--specs", ";raster=8", "--rounds", "1"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "device error: out of memory" in p.stderr
    assert "no rows: 7,64,32,4,2 under '', 'raster=8'" in p.stdout
    assert "no rows: 8," not in p.stdout and "no rows: a " not in p.stdout
    assert "| T8-64-32-4-2 | moeblaze | 1.000 | 2.000 (2.000) |" in p.stdout


def test_a_group_of_configs_is_not_named_as_missing(tmp_path):
    cli = tmp_path / "moeblaze"
    # the stand-in above, but 'grid' expands to two members' rows, as bench layer does
    cli.write_text(FAKE_CLI.replace('else args[args.index("--config") + 1].split(","))',
                                    'else [x for c in args[args.index("--config") + 1].split(",")'
                                    ' for x in (["g1", "g2"] if c == "grid" else [c])])', 1))
    cli.chmod(cli.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, FAKE_LOG=str(tmp_path / "calls.jsonl"))
    p = subprocess.run([sys.executable, os.path.join(BENCH, "override_sweep.py"), "--cli", str(cli),
                        "--bench", "layer", "--configs", "grid,a", "--specs", ";raster=8",
                        "--rounds", "1"], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "| g1 | moeblaze | 1.000 | 2.000 (2.000) |" in p.stdout
    assert "no rows" not in p.stdout
