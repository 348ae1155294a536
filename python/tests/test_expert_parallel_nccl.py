"""Expert parallelism over NCCL with CUDA tensors: W spawned processes (2, and 4 / 8 where that
many GPUs are visible), rank r on cuda:r, each holding E/W experts and its own tokens, against
(a) a float64 reference of the whole problem, (b) the single-process moeblaze.MoE on the
concatenated tokens (on the rank's own GPU: the same H200 model as cuda:0, so the same kernels
and bits) and (c) a second EP run (bitwise: determinism); a bad argument on one rank raises on
every rank. test_ep_nccl_timing prints (pytest -s) the EP forward+backward time per step next to
the single-GPU layer's over the same global tokens; nothing about the times is asserted.

Skips: "skipped: no GPU" (no CUDA device, or moeblaze built without CUDA), "skipped: needs >= W
GPUs" (fewer visible, or torch.distributed without NCCL). NVLink multicast stays off
(NCCL_NVLS_ENABLE=0 in every rank before init, helpers.run_ranks). Every spawned group is killed
after GROUP_TIMEOUT_S, or FAIL_GRACE_S after one of its ranks failed. Fresh random inputs every
run (seed printed on failure; MOEBLAZE_TEST_SEED replays one)."""
import time

import pytest
import torch

import moeblaze
from helpers import check_ep_rank, run_ranks

try:
    import torch.distributed as dist
    _HAVE_NCCL = dist.is_available() and dist.is_nccl_available()
except ImportError:  # pragma: no cover
    _HAVE_NCCL = False

pytestmark = pytest.mark.gpu

GROUP_TIMEOUT_S = 180
FAIL_GRACE_S = 20
BF16, FP32 = torch.bfloat16, torch.float32
WORLDS = (2, 4, 8)


def _skip_reason(world):
    """Why a W-rank NCCL group cannot run here (None: it can). Cheap: no CUDA context is made."""
    if not torch.cuda.is_available():
        return "skipped: no GPU"
    if not moeblaze.has_cuda():
        return "skipped: no GPU backend (moeblaze was built without CUDA)"
    if not _HAVE_NCCL:
        return f"skipped: needs >= {world} GPUs with NCCL (this torch has no NCCL backend)"
    count = torch.cuda.device_count()
    if count < world:
        return f"skipped: needs >= {world} GPUs ({count} visible)"
    return None


def _worlds():
    return [pytest.param(w, id=f"W{w}", marks=pytest.mark.skipif(
        _skip_reason(w) is not None, reason=_skip_reason(w) or "")) for w in WORLDS]


# ---------------------------------------------------------------------------------------------
# per-rank bodies (module level: picklable for spawn)
# ---------------------------------------------------------------------------------------------
# (activation, router, renormalize, recompute, E, K, d, n, tokens per rank); the CUDA kernels
# need d and n multiples of 64. Uneven token counts, a rank with none, recompute, both routers.
CONFIGS = {
    2: [("swiglu", "softmax_topk", False, False, 8, 2, 256, 128, [100, 37]),
        ("relu", "topk_softmax", False, True, 8, 2, 256, 128, [0, 77]),
        ("swiglu", "softmax_topk", True, True, 8, 2, 256, 128, [37, 100])],
    4: [("swiglu", "softmax_topk", False, False, 16, 2, 256, 128, [100, 37, 0, 64]),
        ("relu", "topk_softmax", False, True, 16, 2, 256, 128, [1, 50, 128, 9])],
    8: [("swiglu", "softmax_topk", False, False, 16, 2, 256, 128,
         [100, 37, 0, 64, 1, 50, 128, 9]),
        ("relu", "topk_softmax", True, True, 16, 2, 256, 128, [9, 0, 33, 64, 100, 2, 17, 40])],
}


def _check_configs(rank, world, seed, dtype):
    dev = torch.device("cuda", rank)
    assert torch.cuda.current_device() == rank
    for ci, (act, router, renorm, recompute, E, K, d, n, tpr) in enumerate(CONFIGS[world]):
        # The same global problem on every rank: drawn on the CPU from the same seed, then moved.
        torch.manual_seed(seed + ci)
        moe = moeblaze.MoE(d, n, E, K, activation=act, router=router, renormalize=renorm,
                           recompute=recompute, dtype=dtype)
        T = sum(tpr)
        x = torch.randn(T, d).to(dtype)
        d_out = torch.randn(T, d).to(dtype)
        moe, x, d_out = moe.to(dev), x.to(dev), d_out.to(dev)
        lo, hi = sum(tpr[:rank]), sum(tpr[:rank + 1])
        ep = moeblaze.ExpertParallelMoE.from_moe(moe)
        s, c = ep.expert_start, ep.num_local_experts
        assert (s, c) == (rank * E // world, E // world)
        assert ep.w1.device == dev and ep.gate.weight.device == dev and ep.w1.dtype == dtype
        what = f"config {ci} ({dtype}, {act}, {router}, recompute={recompute}, E={E}, K={K}, " \
               f"d={d}, n={n}, tokens {tpr}, W={world}) on rank {rank}"

        errs, errs1, bitwise = check_ep_rank(moe, ep, x, d_out, lo, hi, dtype, what)
        if rank == 0:
            fmt = lambda es: ", ".join(f"{k} {v:.1e}" for k, v in es.items())  # noqa: E731
            print(f"\nnccl W={world} config {ci} (rank 0): vs float64: {fmt(errs)}; vs "
                  f"single-process: {fmt(errs1)}; bitwise equal to single-process: {bitwise}",
                  flush=True)


def _check_errors(rank, world, seed):
    dev = torch.device("cuda", rank)
    d, n, E = 128, 64, 2 * world
    with pytest.raises(ValueError, match=rf"num_experts E \({E - 1}\) is not divisible by "
                                         rf"world_size \({world}\)"):
        moeblaze.ExpertParallelMoE(d, n, E - 1, 2, device=dev, dtype=BF16)
    torch.manual_seed(seed)
    ep = moeblaze.ExpertParallelMoE(d, n, E, 2, device=dev, dtype=BF16)
    x = torch.randn(16, d, device=dev, dtype=BF16)
    _, off, exp, wts = ep.route(x)

    # A wrong x width on rank 1 only: it names its rule, every other rank names rank 1, and no
    # rank is left waiting in a collective.
    x_bad = x[:, :d - 64] if rank == 1 else x
    expect = r"w1 must be \(E/W, w1_rows, d\)" if rank == 1 else r"failed on rank\(s\) \[1\]"
    with pytest.raises(ValueError, match=expect):
        moeblaze.ep_experts_from_routing(x_bad, ep.w1, ep.w2, off, exp, wts, E)

    # Rank 1 consistent with itself but with another d than the others: every rank raises.
    if rank == 1:
        args = (x[:, :d - 64].contiguous(), ep.w1[:, :, :d - 64], ep.w2[:, :d - 64, :])
    else:
        args = (x, ep.w1, ep.w2)
    with pytest.raises(ValueError, match=r"the ranks must agree"):
        moeblaze.ep_experts_from_routing(*args, off, exp, wts, E)

    # The group still works afterwards, forward and backward.
    xg = x.clone().requires_grad_()
    out = moeblaze.ep_experts_from_routing(xg, ep.w1, ep.w2, off, exp, wts, E)
    assert out.shape == x.shape and out.device == dev
    out.float().square().sum().backward()
    assert torch.isfinite(xg.grad.float()).all() and torch.isfinite(ep.w1.grad.float()).all()


def _correctness(rank, world, seed, dtype_name):
    dtype = getattr(torch, dtype_name)
    _check_configs(rank, world, seed, dtype)
    if dtype == BF16:
        _check_errors(rank, world, seed)


def _time_steps(step, reps, warmup=3):
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def _timing(rank, world, seed):
    dev = torch.device("cuda", rank)
    T, d, n, E, K, reps = 4096, 1024, 512, 8, 2, 10
    torch.manual_seed(seed)
    full = moeblaze.MoE(d, n, E, K, dtype=BF16).to(dev)
    x = torch.randn(world * T, d).to(BF16).to(dev)
    g = torch.randn(world * T, d).to(BF16).to(dev)
    ep = moeblaze.ExpertParallelMoE.from_moe(full)
    xr = x[rank * T:(rank + 1) * T].clone().requires_grad_()
    gr = g[rank * T:(rank + 1) * T].contiguous()

    def step(m, xx, gg):
        m.zero_grad(set_to_none=True)
        xx.grad = None
        out, _ = m(xx)
        out.backward(gg)

    ms = _time_steps(lambda: step(ep, xr, gr), reps)
    times = torch.tensor([ms, -ms], dtype=torch.float64, device=dev)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    if rank == 0:
        xa = x.clone().requires_grad_()
        ms1 = _time_steps(lambda: step(full, xa, g), reps)
        ep_max, ep_min = float(times[0]), -float(times[1])
        print(f"\nEP over NCCL, W={world}, bf16, d={d}, n={n}, E={E}, K={K}, {T} tokens per rank: "
              f"forward+backward {ep_max:.3f} ms/step (max over ranks; min {ep_min:.3f}); "
              f"single-GPU moeblaze.MoE over the same {world * T} tokens on cuda:0: "
              f"{ms1:.3f} ms/step; EP / single = {ep_max / ms1:.2f} ({reps} reps after 3 "
              "warm-up)", flush=True)
    dist.all_reduce(torch.zeros(1, device=dev))  # the others wait for rank 0's single-GPU run


def _cuda_rejects(dtype):
    """The UnsupportedError message if moeblaze's CUDA layer does not take dtype, else None."""
    try:
        m = moeblaze.MoE(64, 64, 2, 1, device="cuda", dtype=dtype)
        m(torch.randn(4, 64, device="cuda", dtype=dtype))[0].sum().item()
    except moeblaze.UnsupportedError as e:
        return str(e)
    return None


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("world", _worlds())
def test_expert_parallel_nccl(seed, world, dtype):
    if dtype != BF16:
        why = _cuda_rejects(dtype)
        if why is not None:
            pytest.skip(f"skipped: the CUDA backend does not take {dtype} ({why})")
    run_ranks(world, _correctness, seed, "nccl", GROUP_TIMEOUT_S, args=(str(dtype)[6:],),
              fail_grace_s=FAIL_GRACE_S)


@pytest.mark.parametrize("world", _worlds())
def test_ep_nccl_timing(seed, world):
    """Prints the per-step time (pytest -s); asserts nothing about it."""
    run_ranks(world, _timing, seed, "nccl", GROUP_TIMEOUT_S, fail_grace_s=FAIL_GRACE_S)
