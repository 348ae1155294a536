"""bench/step_kernels.py's CPU-side logic: its rules name the kernels of a profiled step (the names a
profile records, as in the "kernels" of bench/results/step-kernels-2026-12-05-5d8a446-h100.json)
by family, the first matching rule wins, the per-step sums and per-launch lists add up, the table marks an
absent kernel and a failed impl, and --help runs without a GPU."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
sys.path.insert(0, BENCH)
import step_kernels  # noqa: E402

# Demangled as torch.profiler reports them (the CUTLASS one mangled, as it came; its tail past
# the profile's 90 characters is written out the way the mangling spells cutlass::float_e4m3_t).
CUTLASS_FP8 = ("_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalINS1_17GroupProblemShapeIN4c"
               "ute5tupleIJiiiEEEEENS1_10collective13CollectiveMmaINS6_INS1_49MainloopSm90TmaGmma"
               "WarpSpecializedCooperativeFP8BlockScaledAccumEEENS_12float_e4m3_tEEEvNT_6ParamsE")
CUTLASS_BF16 = ("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::"
                "gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int,"
                " int> >, cutlass::bfloat16_t> > >(Params)")
NAMES = {
    CUTLASS_FP8: "CUTLASS FP8 grouped GEMM",
    CUTLASS_BF16: "CUTLASS grouped GEMM (not FP8)",
    "void moeblaze::cuda::gemm::sm90::ws::varlen_k_ws_kernel<true, 1>(moeblaze::cuda::gemm::sm9":
        "wgrad dW1 varlen-K (ws)",
    "void moeblaze::cuda::gemm::sm90::ws::varlen_k_ws_kernel<false, 1>(moeblaze::cuda::gemm::sm":
        "wgrad dW2 varlen-K (ws)",
    "void moeblaze::cuda::gemm::sm90::ws::gather_gemm_kernel<(cute::SM90::GMMA::Major)0, moeblaze"
    "::cuda::gemm::sm90::ws::GatherStoreEpilogue<moeblaze::cuda::gemm::sm90::ws::WsFrag>, ws::Coo"
    "perative, true>(Args, Params)": "down-proj (ws GEMM)",
    "void moeblaze::cuda::gemm::sm90::ws::gather_gemm_kernel<(cute::SM90::GMMA::Major)1, moeblaze"
    "::cuda::gemm::sm90::ws::GatherStoreEpilogue<moeblaze::cuda::gemm::sm90::ws::PingFrag>, ws::P"
    "ingPong, true>(Args, Params)": "dX (ws GEMM)",
    "void moeblaze::cuda::gemm::sm90::ws::gather_gemm_kernel<(cute::SM90::GMMA::Major)1, moeblaze"
    "::cuda::gemm::sm90::ws::GatherDhEpilogue<moeblaze::cuda::gemm::sm90::ws::WsFrag, 0, 1>, ws::"
    "Cooperative, false>(Args, Params)": "dH + dact (ws gather GEMM)",
    "void moeblaze::cuda::fp8::(anonymous namespace)::quantize_1x128_kernel<unsigned short>(uns":
        "quantize 1x128 (X, dO gathers)",
    "void moeblaze::cuda::fp8::(anonymous namespace)::quantize_128x128_kernel(unsigned short co":
        "weight quantize",
    "moeblaze::cuda::fp8::(anonymous namespace)::quantize_tokens_kernel(unsigned short const*, ":
        "quantize tokens (fp8-wgrad)",
    "void moeblaze::cuda::fp8::(anonymous namespace)::dact_quantize_kernel<(moeblaze::Activatio":
        "dact+quantize",
    "void moeblaze::cuda::fp8::(anonymous namespace)::act_quantize_kernel<(moeblaze::Activation":
        "act+quantize",
    "void moeblaze::cuda::(anonymous namespace)::aggregate_vec_kernel<__nv_bfloat16, true, 1, 4":
        "aggregate",
    "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat1":
        "torch elementwise (grad accumulation etc.)",
    "void moeblaze::cuda::(anonymous namespace)::plan_scatter_kernel<8>(int const*, float const":
        "plan/routing",
    "moeblaze::cuda::(anonymous namespace)::ascending_slots_kernel(int const*, int const*, long":
        "plan/routing",
    "void cub::CUB_300001_SM_900::detail::scan::DeviceScanKernel<cub::CUB_300001_SM_900::detail":
        "plan/routing",
    "void moeblaze::cuda::gemm::tma::build_fp8_group_args<moeblaze::cuda::gemm::tma::Fp8Grouped":
        "GEMM argument setup",
    "moeblaze::cuda::fp8::(anonymous namespace)::sum_rows_kernel(float const*, long, long, floa":
        "dS reduce",
    "Memset (Device)": "memset/memcpy",
    "Memcpy DtoD (Device -> Device)": "memset/memcpy",
}



def family_of(name):
    return step_kernels.classify(name)[0]

def test_rules_name_the_profiled_kernels():
    for name, family in NAMES.items():
        assert family_of(name) == family, name


def test_first_matching_rule_wins():
    # dact_quantize contains act_quantize: the rule listed first (dact) takes it.
    assert family_of("dact_quantize_kernel<swiglu>") == "dact+quantize"
    # A CUTLASS FP8 GEMM matches both CUTLASS rules; the FP8 one is first.
    assert family_of(CUTLASS_FP8) != family_of(CUTLASS_BF16)
    # reduce_ds_kernel sits in moeblaze::cuda::gemm:: but its own rule comes before that one.
    assert family_of("moeblaze::cuda::gemm::sm90::reduce_ds_kernel(float const*)") \
        == "dS reduce"
    # a moeblaze GEMM kernel no earlier rule takes is named by its kernel template's name
    assert family_of("void moeblaze::cuda::gemm::sm90::ws::new_gemm_kernel<1>(A)") \
        == "moeblaze GEMM new_gemm_kernel"
    # index_elementwise is torch indexing, not the elementwise row
    assert family_of("void at::native::index_elementwise_kernel<128, 4>(long)") \
        == "torch index/gather/scatter"
    other = "void some::unknown_kernel<" + "x" * 100 + ">"
    fam = family_of(other)
    assert fam.startswith("other: some::unknown_kernel<") and len(fam) == len("other: ") + 60
    # the order of RULES is the order they are tried
    rx, fam, _ = step_kernels.RULES[0]
    assert fam == "memset/memcpy"


def test_summarize_per_step_and_launch_order():
    fp8 = CUTLASS_FP8
    add = "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<float>>"
    # 2 steps, each: two GEMM launches and an add; given out of start order
    recs = [(fp8, 10, 3000.0), (fp8, 0, 1100.0), (add, 20, 100.0), (fp8, 50, 3000.0),
            (fp8, 40, 900.0), (add, 60, 100.0)]
    recs = [(n, s * 1000, d) for n, s, d in recs]
    s = step_kernels.summarize(recs, 2)
    fam = s["families"]["CUTLASS FP8 grouped GEMM"]
    assert fam["calls"] == 2 and abs(fam["ms"] - 4.0) < 1e-9
    assert abs(s["kernel_sum_ms"] - 4.1) < 1e-9
    la = s["launches"]["CUTLASS FP8 grouped GEMM"]
    assert la["ms"] == [1.1, 3.0, 0.9, 3.0]  # by start time
    assert la["launches_per_step"] == 2 and la["by_index_ms"] == [1.0, 3.0]
    assert "torch elementwise (grad accumulation etc.)" not in s["launches"]
    assert [k["family"] for k in s["kernels"]][0] == "CUTLASS FP8 grouped GEMM"
    assert s["kernels"][1]["calls"] == 1 and abs(s["kernels"][1]["ms"] - 0.1) < 1e-9
    # launches that do not split evenly over the steps: the list only
    s = step_kernels.summarize([(fp8, 0, 1000.0), (fp8, 1, 3000.0), (fp8, 2, 2000.0)], 2)
    assert "by_index_ms" not in s["launches"]["CUTLASS FP8 grouped GEMM"]

def test_table_marks_absent_and_failed_cells():
    a = step_kernels.summarize([("Memset (Device)", 0, 10.0), ("quantize_1x128_kernel", 1,
                                                              2000.0)], 1)
    a["wall_ms"] = 2.5
    b = step_kernels.summarize([("Memset (Device)", 0, 20.0)], 1)
    b["wall_ms"] = 0.05
    results = {"bf16": b, "fp8": a, "broken": {"failed": "failed: RuntimeError: a | b"}}
    t = step_kernels.markdown_table("olmoe", (16384, 2048, 1024, 64, 8),
                                    ["bf16", "fp8", "broken", "missing"], results)
    lines = t.splitlines()
    assert lines[0].startswith("### olmoe (T 16384, d 2048, n 1024, E 64, K 8)")
    assert lines[2] == "| kernel family | bf16 | fp8 | broken | missing |"
    assert lines[3] == "|---|---:|---:|---:|---:|"
    # largest family first; absent cells are "—"
    assert lines[4] == "| quantize 1x128 (X, dO gathers) | — | 2.000 | — | — |"
    assert lines[5] == "| memset/memcpy | 0.020 | 0.010 | — | — |"
    assert lines[6] == ("| **kernel sum** | 0.020 | 2.010 | failed: RuntimeError: a / b | — |")
    assert lines[7] == ("| **wall (CUDA events, median of --reps steps)** | 0.050 | 2.500 | "
                        "failed: RuntimeError: a / b | — |")


def test_help_runs_without_a_gpu():
    script = os.path.join(BENCH, "step_kernels.py")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    for flag in ("--config", "--impl", "--steps", "--warmup", "--reps", "--md", "--json"):
        assert flag in r.stdout
    assert "first match wins" in r.stdout


def test_no_cuda_is_a_clear_error():
    script = os.path.join(BENCH, "step_kernels.py")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, script, "--config", "olmoe", "--impl", "torch"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1 and "step_kernels: needs a CUDA device" in r.stderr


def test_device_records_keep_kernels_memcpys_and_memsets_only():
    from types import SimpleNamespace as NS
    from torch.autograd import DeviceType

    def ev(name, dev, act, t0, t1, total=None, annot=False):
        e = NS(name=name, device_type=dev, activity_type=act, is_user_annotation=annot,
               time_range=NS(start=t0, end=t1))
        if total is not None:
            e.device_time_total = total
        return e
    evs = [ev("aten::add", DeviceType.CPU, "cpu_op", 0, 50),
           ev("k", DeviceType.CUDA, "kernel", 10, 30, total=20),
           ev("Memset (Device)", DeviceType.CUDA, "gpu_memset", 40, 41, total=1),
           ev("step0", DeviceType.CUDA, "gpu_user_annotation", 0, 90, total=90),
           ev("async k", DeviceType.CUDA, "kernel", 50, 55, total=0),  # counted by its range
           ev("old", DeviceType.CUDA, None, 60, 70, total=10),
           ev("old annotation", DeviceType.CUDA, None, 0, 90, total=90, annot=True)]
    assert step_kernels.device_records(evs) == [("k", 10, 20), ("Memset (Device)", 40, 1),
                                                ("async k", 50, 5), ("old", 60, 10)]


def test_demangle_reads_mangled_names_and_keeps_the_rest():
    names = step_kernels.demangle(["_ZN3foo3barEv", "void moeblaze::x()"])
    assert names["void moeblaze::x()"] == "void moeblaze::x()"
    assert names["_ZN3foo3barEv"] in ("foo::bar()", "_ZN3foo3barEv")  # without c++filt: as is
