"""Expert parallelism over torch.distributed (gloo, CPU): 2 and 4 spawned processes, each holding
E/W experts and its own tokens, against (a) a float64 reference of the whole problem on one
process, (b) the single-process moeblaze.MoE, and (c) a second EP run (bitwise: determinism).
Fresh random inputs every run (seed printed on failure; MOEBLAZE_TEST_SEED replays one)."""
import os
import tempfile
import time
import traceback

import pytest
import torch

import moeblaze

try:
    import torch.distributed as dist
    import torch.multiprocessing as mp
    _HAVE_GLOO = dist.is_available() and dist.is_gloo_available()
except ImportError:  # pragma: no cover
    _HAVE_GLOO = False

pytestmark = pytest.mark.skipif(not _HAVE_GLOO, reason="skipped: torch.distributed with the "
                                "gloo backend is not available in this torch build")

JOIN_TIMEOUT_S = 120


def _run_ranks(world, fn, seed):
    """Spawns `world` processes running fn(rank, world, seed), a gloo group over a FileStore in a
    fresh temporary folder (no port to collide on). Fails with each failed rank's traceback;
    kills stragglers after JOIN_TIMEOUT_S."""
    with tempfile.TemporaryDirectory(prefix="moeblaze-ep-") as tmp:
        ctx = mp.get_context("spawn")
        errq = ctx.SimpleQueue()
        procs = [ctx.Process(target=_entry, args=(r, world, fn, seed, tmp, errq), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
            procs[r].join(5)
        errors = []
        while not errq.empty():
            errors.append(errq.get())
        errors.sort()
        msg = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in errors)
        assert not hung, f"ranks {hung} still running after {JOIN_TIMEOUT_S} s (seed {seed}){msg}"
        codes = [p.exitcode for p in procs]
        assert not errors and all(c == 0 for c in codes), \
            f"world {world}, seed {seed} (replay: MOEBLAZE_TEST_SEED={seed}), exit codes " \
            f"{codes}:{msg}"


def _entry(rank, world, fn, seed, tmp, errq):
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(os.path.join(tmp, "store"), world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        try:
            fn(rank, world, seed)
        finally:
            dist.destroy_process_group()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise SystemExit(1)


# ---------------------------------------------------------------------------------------------
# per-rank bodies (module level: picklable for spawn)
# ---------------------------------------------------------------------------------------------
def _rel(a, ref):
    a, ref = a.detach().double(), ref.detach().double()
    return float(torch.linalg.norm(a - ref)) / max(float(torch.linalg.norm(ref)), 1e-30)


def _float64_reference(moe, x, ids, d_out):
    """Float64 out and gradients (x, w1, w2, gate) of the whole problem over a fixed selection."""
    from moeblaze.reference import dense_reference
    logits_ids = ids
    xd = x.detach().double().requires_grad_()
    w1 = moe.w1.detach().double().requires_grad_()
    w2 = moe.w2.detach().double().requires_grad_()
    g = moe.gate.weight.detach().double().requires_grad_()
    logits = xd @ g.t()
    if moe.router == "softmax_topk":
        w = torch.gather(torch.softmax(logits, -1), 1, logits_ids)
        if moe.renormalize:
            w = w / w.sum(-1, keepdim=True)
    else:  # topk_softmax
        w = torch.softmax(torch.gather(logits, 1, logits_ids), -1)
    out = dense_reference(xd, w1, w2, logits_ids, w, moe.activation)
    out.backward(d_out.double())
    return out, xd.grad, w1.grad, w2.grad, g.grad


def _ep_step(ep, x_r, d_out_r):
    ep.zero_grad(set_to_none=True)
    x = x_r.detach().clone().requires_grad_()
    out, _ = ep(x)
    out.backward(d_out_r)
    return [t.detach().clone() for t in (out, x.grad, ep.w1.grad, ep.w2.grad,
                                          ep.gate.weight.grad)]


CONFIGS = {
    # world: list of (dtype, activation, router, renormalize, recompute, E, K, d, n, tokens per rank)
    2: [(torch.float32, "swiglu", "softmax_topk", False, False, 4, 3, 16, 12, [9, 5]),
        (torch.float32, "relu", "topk_softmax", False, True, 6, 2, 8, 10, [4, 7]),
        (torch.bfloat16, "swiglu", "softmax_topk", True, False, 4, 2, 16, 8, [6, 6])],
    4: [(torch.float32, "swiglu", "softmax_topk", True, False, 8, 3, 16, 12, [6, 0, 5, 3]),
        (torch.float32, "geglu", "topk_softmax", False, False, 4, 4, 8, 8, [3, 4, 1, 5])],
}
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _check_configs(world, seed, group=None):
    rank = dist.get_rank(group)
    for ci, (dtype, act, router, renorm, recompute, E, K, d, n, tpr) in enumerate(CONFIGS[world]):
        torch.manual_seed(seed + ci)  # the same global problem on every rank
        moe = moeblaze.MoE(d, n, E, K, activation=act, router=router, renormalize=renorm,
                           recompute=recompute, dtype=dtype)
        T = sum(tpr)
        x = torch.randn(T, d).to(dtype)
        d_out = torch.randn(T, d).to(dtype)
        lo, hi = sum(tpr[:rank]), sum(tpr[:rank + 1])
        ep = moeblaze.ExpertParallelMoE.from_moe(moe, group)
        s, c = ep.expert_start, ep.num_local_experts
        assert (s, c) == (rank * E // world, E // world)
        what = f"config {ci} ({dtype}, {act}, {router}, E={E}, K={K}, W={world}) on rank {rank}"

        got = _ep_step(ep, x[lo:hi], d_out[lo:hi])
        again = _ep_step(ep, x[lo:hi], d_out[lo:hi])
        names = ("out", "dx", "dw1", "dw2", "d_gate (this rank's tokens)")
        for nm, a, b in zip(names, got, again):
            assert torch.equal(a, b), f"{what}: {nm} differs between two identical EP runs"
        g_gate = got[4].clone()
        dist.all_reduce(g_gate, group=group)  # the replicated router's gradient over all tokens

        # The selection EP used (this rank's route) must be the global one (ties: vanishingly rare).
        with torch.no_grad():
            _, _, ids_all, _ = moe.route(x)
            _, _, ids_r, _ = ep.route(x[lo:hi])
        ids_all = ids_all.long().reshape(T, K)
        assert torch.equal(ids_r.long().reshape(-1, K), ids_all[lo:hi]), \
            f"{what}: routing differs from the single-process routing (a near-tie?)"

        ref = _float64_reference(moe, x, ids_all, d_out)
        mine = (got[0], got[1], got[2], got[3], g_gate)
        refs = (ref[0][lo:hi], ref[1][lo:hi], ref[2][s:s + c], ref[3][s:s + c], ref[4])
        errs = {nm: _rel(a, r) for nm, a, r in zip(names, mine, refs) if r.numel()}
        bad = {nm: e for nm, e in errs.items() if not e <= TOL[dtype]}
        assert not bad, f"{what}: relative errors vs float64 above {TOL[dtype]}: {bad} ({errs})"

        # The single-process moeblaze layer on the whole problem.
        xs = x.detach().clone().requires_grad_()
        out1, _ = moe(xs)
        out1.backward(d_out)
        single = (out1[lo:hi], xs.grad[lo:hi], moe.w1.grad[s:s + c], moe.w2.grad[s:s + c],
                  moe.gate.weight.grad)
        tol1 = 1e-6 if dtype == torch.float32 else 8e-3
        errs1 = {nm: _rel(a, r) for nm, a, r in zip(names, mine, single) if r.numel()}
        bad1 = {nm: e for nm, e in errs1.items() if not e <= tol1}
        assert not bad1, f"{what}: relative differences vs single-process MoE above {tol1}: " \
                         f"{bad1} ({errs1})"


def _check_errors(rank, world, seed):
    with pytest.raises(ValueError, match=r"num_experts E \(6\) is not divisible by world_size "
                                         r"\(4\)"):
        moeblaze.ExpertParallelMoE(8, 8, 6, 2)
    # A bad argument on one rank makes every rank raise, and nobody hangs.
    torch.manual_seed(seed)
    ep = moeblaze.ExpertParallelMoE(8, 8, 4, 2)
    x = torch.randn(3, 8)
    w1 = ep.w1 if rank != 1 else ep.w1[:, :-1]
    logits, off, exp, wts = ep.route(x)
    if rank == 1:
        with pytest.raises(ValueError, match=r"w1 must be \(E/W, w1_rows, d\)"):
            moeblaze.ep_experts_from_routing(x, w1, ep.w2, off, exp, wts, 4)
    else:
        with pytest.raises(ValueError, match=r"failed on rank\(s\) \[1\]"):
            moeblaze.ep_experts_from_routing(x, w1, ep.w2, off, exp, wts, 4)
    # The group still works afterwards.
    out = moeblaze.ep_experts_from_routing(x, ep.w1, ep.w2, off, exp, wts, 4)
    assert out.shape == x.shape


def _two_and_four_ranks(rank, world, seed):
    # One spawn (process start-up and torch's first calls dominate the time): ranks 0 and 1 run
    # the 2-rank configurations in a subgroup (exercising `group`), then all four ranks.
    pair = dist.new_group([0, 1])
    if rank < 2:
        _check_configs(2, seed, pair)
    dist.barrier()
    _check_configs(4, seed)
    _check_errors(rank, world, seed)


def test_ep_shard_rejects_indivisible():
    with pytest.raises(ValueError, match=r"num_experts E \(6\) is not divisible by world_size"):
        moeblaze.ep_shard(6, 4, 0)
    assert moeblaze.ep_shard(8, 4, 3) == (6, 2)


def test_expert_parallel_gloo_2_and_4_ranks(seed):
    _run_ranks(4, _two_and_four_ranks, seed)
