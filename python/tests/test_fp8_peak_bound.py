"""bench/fp8_peak_bound.py without a GPU: the end-of-step bytes of a keep_h forward + backward by
arithmetic (bf16, and FP8 with one orientation of the weights' codes resident), checked against
hand-counted sm-default bytes and the measured peaks it reads."""
import json
import os
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
sys.path.insert(0, BENCH)
import fp8_peak_bound as pb  # noqa: E402

MIB = 1 << 20


def test_sm_default_by_hand():
    b = pb.bounds(32768, 4096, 1024, 128, 8)
    S = 32768 * 8
    # out + dx (T, d) bf16, dW1 (E, 2n, d) + dW2 (E, d, n) bf16, d_pair_weights (S,) fp32
    assert b["outputs"] == 2 * 32768 * 4096 * 2 + 128 * 2048 * 4096 * 2 + 128 * 4096 * 1024 * 2 + S * 4
    assert b["h_bf16"] == S * 2048 * 2 == 1024 * MIB
    assert b["h_fp8"] == S * 2048 + S * 16 * 4  # codes, then 1x128 scales
    assert b["codes"] == 128 * (2048 * 4096 + 4096 * 1024) + 128 * (16 * 32 + 32 * 8) * 4
    assert abs(b["bf16"] / MIB - 4609) < 1  # the measured bf16 peak was 4614 MiB (H100)
    assert b["fp8_codes_resident"] > b["bf16"]


def test_break_even_rows_per_expert():
    # codes equal the bytes FP8's H saves where S / E = d (1 + n / w1_rows) = 1.5 d when gated
    d, n, E, K = 2048, 512, 16, 4
    b = pb.bounds(int(1.5 * d) * E // K, d, n, E, K)
    assert b["break_even_rows"] == 1.5 * d
    assert 1.0 < b["codes_over_h_saving"] < 1.05  # the fp32 scales tip it a few %
    assert pb.bounds(6 * d * E // K, d, n, E, K)["codes_over_h_saving"] < 0.3


def test_table_reads_the_measured_peaks(tmp_path):
    rows = tmp_path / "peers.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in [
        {"config": "olmoe", "impl": "moeblaze-torch", "peak_bytes": 1411 * MIB, "gpu": "G",
         "commit": "c", "date": "d"},
        {"config": "olmoe", "impl": "moeblaze-torch-fp8-cached", "peak_bytes": 1939 * MIB}]))
    measured, gpu = pb.measured_peaks(str(rows))
    assert gpu == ("G", "c", "d")
    line = [l for l in pb.table(["olmoe", "deepseek-v3"], measured).splitlines()
            if l.startswith("| olmoe")][0]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[4] == "1,411" and cells[8] == "1,939"
    codes = pb.bounds(16384, 2048, 1024, 64, 8)["codes"]
    assert cells[9] == f"{(1939 * MIB + 2 * codes) / MIB:,.0f}"


def test_unknown_config_is_refused(capsys):
    try:
        pb.main(["--config", "no-such"])
    except SystemExit as e:
        assert e.code == 2
    assert "neither a named config" in capsys.readouterr().err
