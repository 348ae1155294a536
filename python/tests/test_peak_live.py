"""bench/peak_live.py's replay of torch's allocator trace: the blocks live at the highest total,
with frees that complete later than they were requested and a block freed before the trace began
(not counted), as torch writes them."""
import os
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
sys.path.insert(0, BENCH)
import peak_live  # noqa: E402


def ev(action, addr, size):
    return {"action": action, "addr": addr, "size": size}


def test_live_at_peak_is_the_set_at_the_highest_total():
    trace = [
        ev("free_completed", 900, 4096),  # allocated before the trace: ignored
        ev("alloc", 1, 100),
        ev("alloc", 2, 300),
        ev("free_requested", 1, 100),  # not yet free: still counted
        ev("alloc", 3, 50),            # 450
        ev("free_completed", 1, 100),
        ev("alloc", 4, 120),           # 300 + 50 + 120 = 470: the peak
        ev("free_completed", 2, 300),
        ev("alloc", 5, 200),           # 370
    ]
    snapshot = {"device_traces": [trace]}
    best, at = peak_live.live_at_peak(snapshot, device=0)
    assert best == 470
    assert sorted(e["size"] for e in at.values()) == [50, 120, 300]


def test_live_at_peak_of_an_empty_trace():
    best, at = peak_live.live_at_peak({"device_traces": [[]]}, device=0)
    assert best == 0 and at == {}
