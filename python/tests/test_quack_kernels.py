"""bench/quack_kernels.py, which names SonicMoE's GEMMs (QuACK autotune cache entries) by
moeblaze's steps: a cache written here with the argument shapes SonicMoE passes at sm-default and
sm-30B-n512 (two configs whose down-proj and dX~ have the same sizes) must come out as the right
steps, configs, FLOPs and best times, from a folder and from a .tgz."""
import json
import os
import subprocess
import sys
import tarfile

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
sys.path.insert(0, BENCH)
import quack_kernels as qk  # noqa: E402


def size(*dims):
    return f"torch.Size([{', '.join(str(d) for d in dims)}])"


def entry(tensors, timings):
    """An autotune file's content: each tensor's size, stride signature and dtype in the key."""
    key = ["False"]
    for dims, stride in tensors:
        key += [size(*dims), stride, "torch.bfloat16"]
    return {"key": key, "configs_timings": timings}


def cfg(tm, tn, pp, cm, cn):
    return (f"config: GemmConfig(tile_m={tm}, tile_n={tn}, pingpong={pp}, "
            f"is_dynamic_persistent=False, cluster_m={cm}, cluster_n={cn}, swap_ab=False, "
            f"max_swizzle_size=8, device_capacity=9, use_tma_gather=False)")


S, d, E = 32768 * 8, 4096, 128  # sm-default and sm-30B-n512: T = 32768, K = 8, d = 4096, E = 128
CACHE = {
    # sm-default down-proj: a (S, n = 1024) x w2 seen as (E, n, d), K-contiguous
    "A/gemm_tuned.autotune.json": entry(
        [((S, 1024), "[2, 1]"), ((E, 1024, d), "[2, 1, 2]"), ((S, d), "[2, 1]")],
        [[cfg(192, 128, True, 1, 2), [3.262, 3.2, 3.3]], [cfg(128, 256, False, 2, 1), [3.6, 3.5, 3.7]]]),
    # sm-30B-n512 dX~: dh (S, 2n = 1024) x w1 (E, 2n, d), N-contiguous
    "B/gemm_tuned.autotune.json": entry(
        [((S, 1024), "[2, 1]"), ((E, 1024, d), "[2, 2, 1]"), ((S, d), "[2, 1]")],
        [[cfg(128, 128, True, 1, 2), [3.356, 3.3, 3.4]]]),
    # sm-default dH: dO (T, d) x w2 (E, d, n), preact (S, 2n)
    "C/gemm_dgated_tuned.autotune.json": entry(
        [((32768, d), "[2, 1]"), ((E, d, 1024), "[2, 2, 1]"), ((S, 2048), "[2, 1]")],
        [[cfg(128, 256, False, 2, 1), [4.156, 4.1, 4.2]]]),
    # sm-default dW1: x^T (d, T) gathered x dh (S, 2n) -> (E, d, 2n)
    "D/gemm_tuned.autotune.json": entry(
        [((d, 32768), "[1, 2]"), ((S, 2048), "[2, 1]"), ((E, d, 2048), "[2, 2, 1]")],
        [[cfg(256, 192, False, 2, 1), [6.878, 6.8, 6.9]]]),
}


@pytest.fixture
def cache_dir(tmp_path):
    for rel, content in CACHE.items():
        p = tmp_path / "cache" / rel
        p.parent.mkdir(parents=True)
        p.write_text(json.dumps(content))
    return tmp_path / "cache"


def rows_of(path, tmp_path):
    out = tmp_path / "rows.jsonl"
    subprocess.run([sys.executable, os.path.join(BENCH, "quack_kernels.py"), str(path),
                    "--json", str(out)], check=True, capture_output=True)
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_steps_configs_and_times_from_a_folder_and_a_tgz(cache_dir, tmp_path):
    tgz = tmp_path / "cache.tgz"
    with tarfile.open(tgz, "w:gz") as tar:
        tar.add(cache_dir, arcname=".")
    for source in (cache_dir, tgz):
        rows = {(r["config"], r["step"]): r for r in rows_of(source, tmp_path)}
        assert set(rows) == {("sm-default", "2 down-proj"), ("sm-30B-n512", "6 dX~"),
                             ("sm-default", "4 dH"), ("sm-default", "8 dW1")}
        down = rows[("sm-default", "2 down-proj")]
        assert down["ms"] == 3.262 and down["best"] == "192x128 pingpong c1x2"
        assert down["flops"] == 2.0 * S * 1024 * d
        assert rows[("sm-30B-n512", "6 dX~")]["ms"] == 3.356
        assert rows[("sm-default", "4 dH")]["flops"] == 2.0 * S * d * 1024
        assert rows[("sm-default", "8 dW1")]["flops"] == 2.0 * S * d * 2048


def test_a_gemm_no_named_config_has_is_reported_not_dropped():
    shapes = [((1000, 64), ()), ((3, 64, 128), (2, 1, 2))]
    kind, S_, N, K, E_, flops = qk.classify("gemm_tuned", shapes)
    assert (kind, S_, N, K, E_, flops) == ("2 down-proj", 1000, 128, 64, 3, 2.0 * 1000 * 64 * 128)
    assert qk.name_configs(kind, S_, N, K, E_) == [("(S 1000, d 128, 64, E 3)", "2 down-proj")]


def test_grid_shapes_are_named_and_compare_gives_ratios_to_the_best(tmp_path):
    # gpt-oss-120b's dW2 (T 16384, d = n = 2880, E 128, K 4): dO^T (d, T) gathered x a' (S, n)
    T, dd, n, EE, S_ = 16384, 2880, 2880, 128, 16384 * 4
    folder = tmp_path / "c" / "X"
    folder.mkdir(parents=True)
    (folder / "gemm_tuned.autotune.json").write_text(json.dumps(entry(
        [((dd, T), "[1, 2]"), ((S_, n), "[2, 1]"), ((EE, dd, n), "[2, 2, 1]")],
        [[cfg(256, 160, False, 2, 1), [2.0, 1.9, 2.1]], [cfg(128, 256, False, 2, 1), [2.25, 2.2, 2.3]]])))
    out, md = tmp_path / "rows.jsonl", tmp_path / "t.md"
    subprocess.run([sys.executable, os.path.join(BENCH, "quack_kernels.py"), str(tmp_path / "c"),
                    "--json", str(out), "--md", str(md),
                    "--compare", "128x256 coop c2x1,128x192 pingpong c2x1"],
                   check=True, capture_output=True)
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert (row["config"], row["step"], row["best"]) == ("gpt-oss-120b", "5 dW2", "256x160 coop c2x1")
    assert row["vs_best"] == {"128x256 coop c2x1": 2.25 / 2.0}  # 128x192 ping-pong was not tried
    assert "| 1.125 | — |" in md.read_text()


def test_ours_from_bench_gemm_rows_takes_the_rules_median(tmp_path):
    # An override sweep's rows: the automatic choice ("" spec) in three rounds, and an override
    # that must not count as moeblaze's time.
    rows = [{"bench": "gemm", "config": "olmoe", "gemm": "dW2-auto", "kernels": "", "ms": ms,
             "commit": "abc1234"} for ms in (1.3, 1.1, 1.2)]
    rows.append({"bench": "gemm", "config": "olmoe", "gemm": "dW2-auto",
                 "kernels": "dw2.schedule=pingpong", "ms": 0.5})
    rows.append({"bench": "gemm", "config": "olmoe", "gemm": "dW2-ws", "kernels": "", "ms": 0.7})
    path = tmp_path / "sweep.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ours = qk.read_ours([str(path)])
    assert ours == {("olmoe", "5 dW2"): {"ms": 1.2, "commit": "abc1234"}}
