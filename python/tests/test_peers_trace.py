"""bench/peers.py's reading of torch's allocator trace (trace_curve): the bytes live over a step
and the blocks live at its peak, on a made-up trace (no GPU needed)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import peers  # noqa: E402


def _ev(action, addr, size, t, where=None):
    frames = [{"filename": "/x/site-packages/torch/cuda/memory.py", "line": 1, "name": "alloc"}]
    if where:
        frames.append({"filename": f"/work/{where[0]}", "line": where[1], "name": where[2]})
    return {"action": action, "addr": addr, "size": size, "time_us": t, "frames": frames}


def test_trace_curve_follows_allocs_and_frees_and_lists_the_blocks_at_the_peak():
    events = [
        _ev("alloc", 0x100, 1000, 10, ("layer.py", 7, "forward")),
        _ev("alloc", 0x200, 300, 20, ("ops.py", 9, "plan")),
        _ev("free_requested", 0x200, 300, 25),  # not yet free: only free_completed counts
        _ev("free_completed", 0x200, 300, 30),
        _ev("alloc", 0x300, 500, 40),  # no frame outside torch
        _ev("alloc", 0x400, 50, 50, ("ops.py", 11, "flags")),
        _ev("free_completed", 0x100, 1000, 60),
    ]
    points, at_peak = peers.trace_curve(events)
    assert [b for _, b in points] == [0, 1000, 1300, 1000, 1500, 1550, 550]
    assert points[1][0] == 0.0 and points[-1][0] == (60 - 10) / 1e3
    assert at_peak == [{"bytes": 1000, "where": "layer.py:7 forward"},
                       {"bytes": 500, "where": "?"},
                       {"bytes": 50, "where": "ops.py:11 flags"}]


def test_trace_curve_of_no_events_is_flat():
    assert peers.trace_curve([]) == ([(0.0, 0)], [])


def test_quack_default_gemms_passes_config_none_to_tuned_gemms_only(monkeypatch):
    """--peer-gemms default: an autotuned function taking `config` is called with config=None
    (QuACK's `tuned=False`), without the search; any other autotuned function still searches. A
    stand-in quack.autotuner module: the real one needs the CuTe DSL."""
    import types
    calls = []

    class Autotuner:
        def __init__(self, fn):
            self.fn = fn

        def __call__(self, *args, **kwargs):
            calls.append(("search", self.fn.__name__))
            return self.fn(*args, **kwargs)

    def gemm_tuned(a, b, config=None, alpha=1.0):
        return ("gemm", a, b, config, alpha)

    def rms_tuned(x, eps=1e-6, config="x"):
        return ("rms", x, config)

    def plain(x, block=64):
        return ("plain", x, block)

    quack = types.ModuleType("quack")
    autotuner = types.ModuleType("quack.autotuner")
    autotuner.Autotuner = Autotuner
    quack.autotuner = autotuner
    monkeypatch.setitem(sys.modules, "quack", quack)
    monkeypatch.setitem(sys.modules, "quack.autotuner", autotuner)
    peers.quack_default_gemms()
    peers.quack_default_gemms()  # a second call leaves the first wrapper alone
    assert Autotuner(gemm_tuned)(1, 2, alpha=3.0) == ("gemm", 1, 2, None, 3.0)
    assert Autotuner(rms_tuned)(5) == ("rms", 5, None)
    assert calls == []
    assert Autotuner(plain)(7) == ("plain", 7, 64)  # no `config` parameter: it searches as before
    # An explicit config is the caller's choice: the autotuner's own path, untouched.
    assert Autotuner(gemm_tuned)(1, 2, config="mine") == ("gemm", 1, 2, "mine", 1.0)
    assert calls == [("search", "plain"), ("search", "gemm_tuned")]


def test_peer_gemms_default_is_refused_for_timed_rows_and_taken_for_bytes(tmp_path):
    import subprocess
    script = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "peers.py")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the arguments only: no step on a GPU

    def run(*extra):
        return subprocess.run([sys.executable, script, "--config", "olmoe", "--peer-gemms",
                               "default", *extra], capture_output=True, text=True, timeout=120,
                              env=env)
    timed = run()
    assert timed.returncode == 2 and "--peer-gemms default: only with" in timed.stderr
    for extra in (["--memory-timeline", str(tmp_path / "t.png")], ["--fits-at", "1024"]):
        r = run(*extra)
        assert "--peer-gemms default: only with" not in r.stderr, extra
