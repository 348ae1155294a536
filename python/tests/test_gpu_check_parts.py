"""scripts/gpu_check.sh refuses a PART it does not know, by name, before it builds or runs
anything (a misspelt part used to run nothing and report nothing), and builds what each part
runs."""
import os
import subprocess

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_unknown_part_is_refused_by_name(tmp_path):
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), str(tmp_path),
                        "peers", "peer-grid"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "unknown PART 'peer-grid'" in p.stderr and " peers-grid " in p.stderr
    assert os.listdir(tmp_path) == []  # nothing built, logged or run


def test_sweep_without_its_specs_is_refused_before_anything_runs(tmp_path):
    script = os.path.join(ROOT, "scripts", "gpu_check.sh")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEP_")}
    p = subprocess.run(["bash", script, str(tmp_path), "sweep"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert p.returncode == 2 and "sweep needs SWEEP_SPECS" in p.stderr, p.stderr
    p = subprocess.run(["bash", script, str(tmp_path), "sweep"], capture_output=True, text=True,
                       timeout=60, env=dict(env, SWEEP_SPECS=";raster=8", SWEEP_BENCH="fwd"))
    assert p.returncode == 2 and "SWEEP_BENCH must be gemm or layer (got 'fwd')" in p.stderr
    assert os.listdir(tmp_path) == []


def test_sweep_runs_the_override_sweep_on_a_prebuilt_binary(tmp_path):
    # A stand-in for the moeblaze binary (bench layer: one row per config, slower under raster=8).
    build = tmp_path / "build"
    build.mkdir()
    cli = build / "moeblaze"
    cli.write_text(r'''#!/usr/bin/env python3
import json, os, sys
args = sys.argv[1:]
out = args[args.index("--out") + 1]
ms = 2.0 if "raster=8" in os.environ.get("MOEBLAZE_KERNELS", "") else 1.0
with open(out, "w") as f:
    for n in args[args.index("--config") + 1].split(","):
        f.write(json.dumps({"config": n, "impl": "moeblaze", "total_ms": ms}) + "\n")
''')
    cli.chmod(0o755)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEP_")}
    env.update(PREBUILT="1", BUILD_DIR=str(build), SWEEP_SPECS=";raster=8", SWEEP_BENCH="layer",
               SWEEP_CONFIGS="a,b", SWEEP_ROUNDS="2")
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), str(out), "sweep"],
                       capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "sweep: 8 rows" in p.stdout
    assert "| a | moeblaze | 1.000 | 2.000 (2.000) |" in (out / "sweep.md").read_text()


def test_parts_that_install_the_package_build_its_library(tmp_path):
    # A stand-in cmake on PATH records what it is asked to build and fails the build, so the check
    # stops right after choosing its targets.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "cmake.log"
    fake = bin_dir / "cmake"
    fake.write_text(f"""#!/usr/bin/env bash
echo "$*" >> {log}
[ "$1" = --build ] && exit 1
exit 0
""")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", BUILD_DIR=str(tmp_path / "b"))
    env.pop("PREBUILT", None)
    for part, capi in (("peers-grid", True), ("step-grid", True), ("model-step", True),
                       ("peers", True), ("gemm", False)):
        log.write_text("")
        p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"),
                            str(tmp_path / ("out-" + part)), part],
                           capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
        assert p.returncode == 1 and "build FAILED" in p.stdout, p.stdout + p.stderr
        built = [line for line in log.read_text().splitlines() if line.startswith("--build")]
        assert len(built) == 1 and "moeblaze_cli" in built[0], built
        assert ("moeblaze_capi" in built[0]) == capi, (part, built)
