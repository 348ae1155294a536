#!/usr/bin/env python3
"""Where the GPU time of one forward + backward step of the expert layer goes, kernel family by
kernel family, for several implementations side by side at the same inputs: which kernel limits
the FP8 step against the bf16 step (docs/FP8.md). Prints Markdown tables.

Per config the inputs are built once, as bench/peers.py builds them (its Inputs, the same seed:
the peer table's inputs), and every implementation is one of peers' (its IMPLS). Per implementation:
--warmup steps, then torch.profiler (CUDA activity) over --steps steps (gradients cleared before
each, one synchronize at the end); each CUDA kernel, memcpy and memset is summed over its device
time and divided by --steps; then the step's wall time with peers' own timing (CUDA events, L2
flushed before each repetition, median of --reps), so that the gap between the kernels' sum and
the wall time (the GPU idle inside a step) shows beside them.

Kernel names are grouped into families by an ordered list of (regex, family) rules, the first
match wins (RULES below; a name no rule takes is its own family, "other: " and its first 60
characters). Families whose name does not tell which GEMM a launch is (the CUTLASS grouped GEMMs
run several) keep each launch's time in launch order in the JSON, and the JSON keeps every
kernel's own sum too (name cut to 120 characters), so the grouping loses nothing.

  python3 bench/step_kernels.py --config sm-default,olmoe,sm-7B-n256,mb-conf4 \\
      --impl moeblaze-torch,moeblaze-torch-fp8-cached,moeblaze-torch-fp8-wgrad-cached \\
      --steps 3 --md OUT.md --json OUT.json

An implementation that fails (or that peers skips) is reported in its column and the others go
on. Needs a CUDA device; PYTHONPATH=python (and MOEBLAZE_LIB where the library is not found by
itself) for the moeblaze implementations, as for bench/peers.py.
"""
import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402

DEFAULT_CONFIGS = "sm-default,olmoe,sm-7B-n256,mb-conf4"
DEFAULT_IMPLS = "moeblaze-torch,moeblaze-torch-fp8-cached,moeblaze-torch-fp8-wgrad-cached"

# (regex, family, per_launch): first match wins, searched in the demangled name (the raw one
# where it cannot be demangled). A family may use the match's groups (\1). per_launch: the
# family's name cannot tell which GEMM a launch is, so the JSON keeps each launch in order.
# gather_gemm_kernel's first template argument is B's major mode: (cute::SM90::GMMA::Major)0 is
# K-major (the down-projection, w2 (d, n)), 1 MN-major (dX, w1 read N-major): ws_gather_gemms.cuh.
# varlen_k_ws_kernel<true, .> is dW1 (computed transposed), <false, .> dW2.
RULES = [
    (r"^(Memset|Memcpy)|\b(memset|memcpy)", "memset/memcpy", False),
    (r"GemmUniversal.*float_e4m3|float_e4m3.*GemmUniversal", "CUTLASS FP8 grouped GEMM", True),
    (r"GemmUniversal|cutlass::device_kernel|cutlass13device_kernel",
     "CUTLASS grouped GEMM (not FP8)", True),
    (r"varlen_k_ws_kernel(<true|ILb1E)", "wgrad dW1 varlen-K (ws)", False),
    (r"varlen_k_ws_kernel(<false|ILb0E)", "wgrad dW2 varlen-K (ws)", False),
    (r"varlen_k_ws_kernel", "wgrad varlen-K (ws)", False),
    (r"varlen_k_kernel", "wgrad varlen-K (non-ws)", True),
    (r"gather_gemm_kernel.*GatherActEpilogue", "up-proj + act (ws gather GEMM)", False),
    (r"gather_gemm_kernel.*GatherDhEpilogue", "dH + dact (ws gather GEMM)", False),
    (r"gather_gemm_kernel<\(cute::SM90::GMMA::Major\)0.*GatherStoreEpilogue",
     "down-proj (ws GEMM)", False),
    (r"gather_gemm_kernel<\(cute::SM90::GMMA::Major\)1.*GatherStoreEpilogue", "dX (ws GEMM)",
     False),
    (r"gather_gemm_kernel", "ws gather GEMM (other)", True),
    (r"varlen_m_kernel.*DhEpilogue", "dH (varlen-M GEMM)", False),
    (r"varlen_m_kernel.*ActEpilogue", "up-proj + act (varlen-M GEMM)", False),
    (r"varlen_m_kernel", "down-proj / dX (varlen-M GEMM)", True),
    (r"build_\w*args", "GEMM argument setup", False),
    (r"reduce_ds_kernel|sum_rows_kernel", "dS reduce", False),
    (r"moeblaze::cuda::gemm::(?:\w+::)*(\w+)", r"moeblaze GEMM \1", True),
    (r"dact_quantize", "dact+quantize", False),
    (r"act_quantize", "act+quantize", False),
    (r"quantize_1x128", "quantize 1x128 (X, dO gathers)", False),
    (r"quantize_128x128", "weight quantize", False),
    (r"quantize_tokens|padded_offsets_kernel", "quantize tokens (fp8-wgrad)", False),
    (r"transpose_codes|transpose_scales", "fp8 transpose", False),
    (r"aggregate", "aggregate", False),
    (r"gather_pair_grads", "router-weight grads (gather_pair_grads)", False),
    (r"plan_count|plan_scatter|plan_\w*kernel|routing_from_ids|ascending_slots|sort_prepare|"
     r"sort_finish|rebase_kernel|accumulate_range|chunk_\w*kernel|cub::|\bcub\d|DeviceScan|"
     r"DeviceRadixSort|DeviceSegmentedSort|radixSort|RadixSort|bitonicSort|sort_kernel",
     "plan/routing", False),
    (r"index_elementwise|indexSelect|index_select|scatter_gather|index_put|indexing_backward|"
     r"scatter_add|\bscatter|\bgather", "torch index/gather/scatter", False),
    (r"elementwise", "torch elementwise (grad accumulation etc.)", False),
    (r"reduce_kernel|Reduce", "torch reduce", False),
]
_COMPILED = [(re.compile(rx), fam, per) for rx, fam, per in RULES]


def classify(name):
    """(family, per_launch) of a kernel's (demangled) name: the first rule that matches."""
    for rx, fam, per in _COMPILED:
        m = rx.search(name)
        if m:
            return (m.expand(fam) if "\\" in fam else fam), per
    return "other: " + re.sub(r"^void ", "", name)[:60], False


def demangle(names):
    """{name: demangled} for the names that look mangled (_Z...), through c++filt where it is
    installed; names it cannot read stay as they are."""
    mangled = sorted({n for n in names if n.startswith("_Z")})
    out = {n: n for n in names}
    if not mangled:
        return out
    try:
        p = subprocess.run(["c++filt"], input="\n".join(mangled) + "\n", capture_output=True,
                           text=True, timeout=60, check=True)
        lines = p.stdout.split("\n")
        if len(lines) >= len(mangled):
            out.update(zip(mangled, lines[:len(mangled)]))
    except Exception:
        pass
    return out


def summarize(records, steps, names=None):
    """records: (name, start_us, dur_us) of every device kernel / memcpy / memset over `steps`
    steps. names: {raw name: demangled} (default: as they are). Returns {"families": {family:
    {"ms", "calls"}} per step, "kernels": [{"name", "family", "ms", "calls"}] per step (largest
    first), "launches": {family: {...}} for the per-launch families, "kernel_sum_ms"}."""
    names = names or {}
    fams, kernels, launches = {}, {}, {}
    for name, start, dur in sorted(records, key=lambda r: r[1]):
        full = names.get(name, name)
        fam, per = classify(full)
        f = fams.setdefault(fam, {"ms": 0.0, "calls": 0})
        f["ms"] += dur / 1e3
        f["calls"] += 1
        k = kernels.setdefault(full, {"name": full[:120], "family": fam, "ms": 0.0, "calls": 0})
        k["ms"] += dur / 1e3
        k["calls"] += 1
        if per:
            launches.setdefault(fam, []).append((dur / 1e3, full[:120]))
    for f in fams.values():
        f["ms"] /= steps
        f["calls"] /= steps
    for k in kernels.values():
        k["ms"] /= steps
        k["calls"] /= steps
    per_launch = {}
    for fam, ls in launches.items():
        entry = {"launches_per_step": len(ls) / steps, "ms": [round(ms, 4) for ms, _ in ls]}
        if len(ls) % steps == 0:  # the steps launch alike: launch i of each step side by side
            k = len(ls) // steps
            entry["by_index_ms"] = [round(sum(ls[s * k + i][0] for s in range(steps)) / steps, 4)
                                    for i in range(k)]
            entry["by_index_kernel"] = [ls[i][1] for i in range(k)]
        per_launch[fam] = entry
    return {"families": fams,
            "kernels": sorted(kernels.values(), key=lambda k: -k["ms"]),
            "launches": per_launch,
            "kernel_sum_ms": sum(f["ms"] for f in fams.values())}


def fmt_ms(v):
    return "—" if v is None else f"{v:.3f}"


def markdown_table(config, shape, impls, results):
    """One config's table: a row per family (largest first, by its largest time over the impls),
    a column per impl (ms per step, "—" where the impl has no such kernel), then the kernels' sum
    and the wall time. results: {impl: summarize(...) plus "wall_ms", or {"failed": why}}."""
    T, d, n, E, K = shape
    ok = {i: r for i, r in results.items() if "failed" not in r}
    fams = {}
    for r in ok.values():
        for fam, f in r["families"].items():
            fams[fam] = max(fams.get(fam, 0.0), f["ms"])
    order = sorted(fams, key=lambda f: (-fams[f], f))
    lines = [f"### {config} (T {T}, d {d}, n {n}, E {E}, K {K}): ms per forward+backward step",
             "",
             "| kernel family | " + " | ".join(impls) + " |",
             "|---|" + "---:|" * len(impls)]

    def cell(impl, value_of):
        r = results.get(impl)
        if r is None:
            return "—"
        if "failed" in r:
            return r["failed"].replace("|", "/")
        return fmt_ms(value_of(r))

    for fam in order:
        vals = []
        for i in impls:
            r = ok.get(i)
            vals.append(fmt_ms(r["families"][fam]["ms"]) if r and fam in r["families"] else "—")
        lines.append(f"| {fam} | " + " | ".join(vals) + " |")
    lines.append("| **kernel sum** | " + " | ".join(
        cell(i, lambda r: r["kernel_sum_ms"]) for i in impls) + " |")
    lines.append("| **wall (CUDA events, median of --reps steps)** | " + " | ".join(
        cell(i, lambda r: r.get("wall_ms")) for i in impls) + " |")
    return "\n".join(lines) + "\n"


def header_lines(meta):
    lines = ["# Kernel families of one forward+backward step (bench/step_kernels.py)", ""]
    lines.append(f"- GPU: {meta['gpu']}")
    if meta.get("driver") and meta["driver"] != "unknown":
        lines.append(f"- driver: {meta['driver']}")
    lines += [f"- torch: {meta['torch']}", f"- commit: {meta['commit']}",
              f"- date: {meta['date']}", f"- command: `{meta['command']}`",
              f"- {meta['steps']} profiled steps after {meta['warmup']} warm-up steps; wall: "
              f"median of {meta['reps']} repetitions, L2 flushed before each", ""]
    return "\n".join(lines) + "\n"


# ---- on the GPU ----------------------------------------------------------------------------
def event_us(e):
    """A device event's time in µs: device_time_total where torch has it, else cuda_time_total;
    its time range where that reads 0 (an event torch counts as async)."""
    t = getattr(e, "device_time_total", None)
    if t is None:
        t = getattr(e, "cuda_time_total", 0)
    if not t:
        t = e.time_range.end - e.time_range.start
    return t


def device_records(events):
    """(name, start_us, dur_us) of the CUDA kernels, memcpys and memsets among profiler events
    (no CPU op, no GPU user annotation)."""
    from torch.autograd import DeviceType
    out = []
    for e in events:
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        act = getattr(e, "activity_type", None)
        if act is not None and act not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        if act is None and getattr(e, "is_user_annotation", False):
            continue
        out.append((e.name, e.time_range.start, event_us(e)))
    return out


def profile_kernels(inp, step, steps):
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            inp.clear_grads()
            out = step(True)
            del out
        torch.cuda.synchronize()
    inp.clear_grads()
    return device_records(prof.events())


def run_impl(inp, impl, args, flush, say):
    step = None
    try:
        step = peers.IMPLS[impl](inp)
        say("warm-up (a peer's first call may compile)")
        for _ in range(args.warmup):
            inp.clear_grads()
            out = step(True)
            del out
        torch.cuda.synchronize()
        say(f"profiling {args.steps} steps")
        records = profile_kernels(inp, step, args.steps)
        res = summarize(records, args.steps, demangle({r[0] for r in records}))
        say(f"wall time, {args.reps} repetitions")
        res["wall_ms"], res["host_issue_ms"] = peers.time_step(inp, step, True, args.warmup,
                                                               args.reps, flush)
        return res
    except peers.Skip as why:
        return {"failed": f"skipped: {why}"[:120]}
    except torch.OutOfMemoryError:
        return {"failed": "failed: out of memory"}
    except Exception as err:
        print(f"step_kernels: {impl}: failed: {type(err).__name__}: {err}", file=sys.stderr)
        first = (str(err).strip().splitlines() or [""])[0][:80]
        return {"failed": f"failed: {type(err).__name__}" + (f": {first}" if first else "")}
    finally:
        inp.clear_grads()
        del step
        torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Rules (first match wins):\n" + "\n".join(
            f"  {fam:42s} {rx}" for rx, fam, _ in RULES))
    ap.add_argument("--config", default=DEFAULT_CONFIGS,
                    help="comma list of peers' named configs, extra shapes or T,d,n,E,K (';' "
                         f"between custom shapes); default {DEFAULT_CONFIGS}")
    ap.add_argument("--impl", default=DEFAULT_IMPLS,
                    help=f"comma list of bench/peers.py's impls ({', '.join(peers.IMPLS)}); "
                         f"default {DEFAULT_IMPLS}")
    ap.add_argument("--steps", type=int, default=3,
                    help="forward+backward steps under the profiler; times are per step "
                         "(default 3)")
    ap.add_argument("--warmup", type=int, default=3,
                    help="steps before the profile, and before the wall timing (default 3)")
    ap.add_argument("--reps", type=int, default=20,
                    help="timed repetitions of the wall row, median (default 20)")
    ap.add_argument("--seed", type=int, default=1234, help="the inputs' seed (peers' default)")
    ap.add_argument("--md", default="", help="write the header and the tables here")
    ap.add_argument("--json", default="",
                    help="write everything here: per config and impl the families, every kernel "
                         "(ms and calls per step) and the per-launch times of the families that "
                         "run several GEMMs")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.reps < 1 or args.warmup < 0:
        ap.error("--steps and --reps must be >= 1, --warmup >= 0")
    impls = [i for i in args.impl.split(",") if i]
    for i in impls:
        if i not in peers.IMPLS:
            ap.error(f"unknown impl '{i}'; one of {', '.join(peers.IMPLS)}")
    names = [c for c in (args.config.split(";") if ";" in args.config else
                         args.config.split(",")) if c]
    shapes = {c: peers.shape_of(c) for c in names}
    if not torch.cuda.is_available():
        sys.exit("step_kernels: needs a CUDA device")
    dev = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)  # >= 2x the 60 MB L2, as peers
    meta = {"gpu": torch.cuda.get_device_name(0), "driver": peers.driver_version(),
            "torch": torch.__version__, "commit": peers.git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": " ".join(shlex.quote(a) for a in
                                ["python3", sys.argv[0]] + (sys.argv[1:] if argv is None
                                                            else list(argv))),
            "steps": args.steps, "warmup": args.warmup, "reps": args.reps, "seed": args.seed}
    head = header_lines(meta)
    print(head, flush=True)
    text, out = head, {"meta": meta, "configs": []}
    total, done = len(names) * len(impls), 0
    for c in names:
        T, d, n, E, K = shapes[c]
        results = {}
        try:
            inp = peers.Inputs(T, d, n, E, K, args.seed, dev)
        except torch.OutOfMemoryError:
            inp = None
        for impl in impls:
            done += 1

            def say(what, impl=impl, i=done):
                print(f"step_kernels: [{i}/{total}] {c} {impl}: {what}", file=sys.stderr,
                      flush=True)
            if inp is None:
                results[impl] = {"failed": "failed: inputs out of memory"}
                say(results[impl]["failed"])
                continue
            results[impl] = run_impl(inp, impl, args, flush, say)
            r = results[impl]
            say(r["failed"] if "failed" in r else
                f"kernels {r['kernel_sum_ms']:.3f} ms, wall {r['wall_ms']:.3f} ms per step")
        del inp
        torch.cuda.empty_cache()
        table = markdown_table(c, shapes[c], impls, results)
        print(table, flush=True)
        text += table + "\n"
        out["configs"].append({"config": c, "T": T, "d": d, "n": n, "E": E, "K": K,
                               "impls": results})
        # written after each config: a run cut short keeps what it measured
        if args.md:
            with open(args.md, "w") as f:
                f.write(text)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
