"""Expert parallelism over torch.distributed (gloo, CPU): 2 and 4 spawned processes, each holding
E/W experts and its own tokens, against (a) a float64 reference of the whole problem on one
process, (b) the single-process moeblaze.MoE, and (c) a second EP run (bitwise: determinism).
Fresh random inputs every run (seed printed on failure; MOEBLAZE_TEST_SEED replays one)."""
import pytest
import torch

import moeblaze
from helpers import check_ep_rank, run_ranks

try:
    import torch.distributed as dist
    _HAVE_GLOO = dist.is_available() and dist.is_gloo_available()
except ImportError:  # pragma: no cover
    _HAVE_GLOO = False

pytestmark = pytest.mark.skipif(not _HAVE_GLOO, reason="skipped: torch.distributed with the "
                                "gloo backend is not available in this torch build")

JOIN_TIMEOUT_S = 120


# ---------------------------------------------------------------------------------------------
# per-rank bodies (module level: picklable for spawn)
# ---------------------------------------------------------------------------------------------
CONFIGS = {
    # world: list of (dtype, activation, router, renormalize, recompute, E, K, d, n, tokens per rank)
    2: [(torch.float32, "swiglu", "softmax_topk", False, False, 4, 3, 16, 12, [9, 5]),
        (torch.float32, "relu", "topk_softmax", False, True, 6, 2, 8, 10, [4, 7]),
        (torch.bfloat16, "swiglu", "softmax_topk", True, False, 4, 2, 16, 8, [6, 6])],
    4: [(torch.float32, "swiglu", "softmax_topk", True, False, 8, 3, 16, 12, [6, 0, 5, 3]),
        (torch.float32, "geglu", "topk_softmax", False, False, 4, 4, 8, 8, [3, 4, 1, 5])],
}


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
        check_ep_rank(moe, ep, x, d_out, lo, hi, dtype, what, group)


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
    # The module: a failure before the exchange (here x's width on rank 1, found before routing)
    # is agreed too, instead of leaving the other ranks in the count exchange.
    xm = torch.randn(3, 7 if rank == 1 else 8)
    if rank == 1:
        with pytest.raises(ValueError, match=r"x has last dimension 7, expected hidden_size 8"):
            ep(xm)
    else:
        with pytest.raises(ValueError, match=r"failed on rank\(s\) \[1\]"):
            ep(xm)
    # A dtype that differs between ranks is caught by the agreement, on every rank.
    xd = torch.randn(3, 8, dtype=torch.float64 if rank == 2 else torch.float32)
    wd = (ep.w1, ep.w2) if rank != 2 else (ep.w1.double(), ep.w2.double())
    with pytest.raises(ValueError, match=r"dtype|must agree|failed on rank"):
        moeblaze.ep_experts_from_routing(xd, *wd, off, exp, wts, 4)
    # Ranks that differ in which gradients they need would run different backward exchanges:
    # refused on every rank before anything moves.
    xg = torch.randn(3, 8, requires_grad=(rank == 3))
    with pytest.raises(ValueError, match=r"must agree"):
        moeblaze.ep_experts_from_routing(xg, ep.w1, ep.w2, off, exp, wts.detach(), 4)
    out = ep(torch.randn(3, 8))[0]
    assert out.shape == (3, 8)


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
    run_ranks(4, _two_and_four_ranks, seed, "gloo", JOIN_TIMEOUT_S)
