"""bench/rescore_search.py without a GPU: it reads a search's candidate lines per shape and GEMM,
turns `bench kernels` rows into the search's kernel descriptions, and scores the rule's kernel
against the fastest candidate; a stand-in binary prints the rule's table, and one call is made per
activation (the grid's gpt-oss shapes run swiglu-oai)."""
import json
import os
import stat
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
sys.path.insert(0, BENCH)
import rescore_search  # noqa: E402

WS = "ws_gather cooperative 128x256x64 stages=4 cluster=1 raster=16"
WS_PP = "ws_gather ping_pong 128x128x64 stages=6 cluster=1 raster=16"
TMA_PP = "tma_grouped ping_pong 192x128x64 stages=auto cluster=2 order=n swizzle=2 bands=1"
VK_TS = "ws_varlen_k cooperative 128x256x64 stages=3 cluster=1 raster=16 store=tma"
CANDIDATES = f"""bench gemm: NVIDIA H200, driver 1, commit abc
bench gemm: kimi-k2 T=8192 d=7168 n=2048 E=384 K=8 S=65536
bench gemm: sampled rel errors up 0.001
  {WS}: 2.0 ms, 500 TFLOP/s
  {WS_PP}: 1.5 ms, 600 TFLOP/s
  down-auto: 1.9 ms, 520 TFLOP/s
  {WS}: 3.0 ms, 500 TFLOP/s
  dW2-auto: 3.0 ms, 500 TFLOP/s
bench gemm: gpt-oss-20b T=30000 d=2880 n=2880 E=32 K=4 S=120000
  {TMA_PP}: 1.0 ms, 700 TFLOP/s
  {VK_TS}: 1.1 ms, 650 TFLOP/s
  down-auto: 1.0 ms, 700 TFLOP/s
"""

FAKE_CLI = r'''#!/usr/bin/env python3
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps(args) + "\n")
print("SMs: 132")
print("config | S | GEMM | family | schedule | tile | stages | cluster | order | rule")
for name in args[args.index("--config") + 1].split(","):
    if name == "kimi-k2":
        print(f"{name} | 65536 | down_proj | ws_gather | cooperative | 128x256x64 | 4 | 1 | raster 16 | r1")
        print(f"{name} | 65536 | dw2_proj | ws_varlen_k | cooperative | 128x256x64 | 3 | 1 | raster 16, store by TMA | r2")
    else:
        print(f"{name} | 120000 | down_proj | tma_grouped | ping_pong | 192x128x64 | auto | 2 | n swizzle 2 bands 1 | r3")
'''


def test_candidates_parse_per_shape_and_gemm():
    shapes = rescore_search.parse_candidates(CANDIDATES.splitlines(True))
    assert list(shapes) == ["kimi-k2", "gpt-oss-20b"]
    assert shapes["kimi-k2"]["shape"] == (8192, 7168, 2048, 384, 8)
    assert shapes["kimi-k2"]["gemms"]["down_proj"] == {WS: 2.0, WS_PP: 1.5}
    assert shapes["kimi-k2"]["gemms"]["dw2_proj"] == {WS: 3.0}
    assert shapes["gpt-oss-20b"]["gemms"]["down_proj"] == {TMA_PP: 1.0, VK_TS: 1.1}


def test_kernel_rows_become_the_search_descriptions():
    row = dict(family="ws_varlen_k", schedule="cooperative", tile="128x256x64", stages="3",
               cluster="1", order="raster 16, store by TMA")
    assert rescore_search.describe(row) == VK_TS
    row = dict(family="tma_grouped", schedule="ping_pong", tile="192x128x64", stages="auto",
               cluster="2", order="n swizzle 2 bands 1")
    assert rescore_search.describe(row) == TMA_PP


def test_rescore_against_a_stand_in_binary(tmp_path):
    cand = tmp_path / "cand.txt"
    cand.write_text(CANDIDATES)
    cli = tmp_path / "moeblaze"
    cli.write_text(FAKE_CLI)
    cli.chmod(cli.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "calls.jsonl"
    md = tmp_path / "out.md"
    p = subprocess.run([sys.executable, os.path.join(BENCH, "rescore_search.py"), str(cand),
                        "--cli", str(cli), "--flops-per-byte", "217", "--md", str(md)],
                       env=dict(os.environ, FAKE_LOG=str(log)), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    acts = sorted(c[c.index("--activation") + 1] for c in calls)
    assert acts == ["swiglu", "swiglu-oai"]  # gpt-oss-20b is a swiglu-oai grid shape
    assert all(c[c.index("--flops-per-byte") + 1] == "217" for c in calls)
    text = md.read_text()
    # kimi-k2 down: the rule's ws cooperative 2.0 ms against ping-pong's 1.5; dw2: its TMA-store
    # kernel was not timed in the file; gpt-oss-20b down: the rule's kernel is the fastest.
    assert "| kimi-k2 | 8192 / 7168 / 2048 / 384 / 8 | down_proj | " + WS + " | 1.333 |" in text
    assert "| dw2_proj | " + VK_TS + " | not timed |" in text
    assert "| gpt-oss-20b | 30000 / 2880 / 2880 / 32 / 4 | down_proj | " + TMA_PP + " | 1.000 |" in text
    assert text.startswith("the rule of ") and "1 of 2 GEMMs within 3 %" in text
    assert "1 not scored" in text


def test_bad_arguments_are_named(tmp_path):
    cand = tmp_path / "cand.txt"
    cand.write_text(CANDIDATES)
    p = subprocess.run([sys.executable, os.path.join(BENCH, "rescore_search.py"), str(cand),
                        "--cli", str(tmp_path / "missing"), "--flops-per-byte", "217"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--cli" in p.stderr
