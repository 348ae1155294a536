"""FSDP2 (torch.distributed.fsdp.fully_shard) over models whose MoE blocks run moeblaze: a small
net of moeblaze.MoE blocks and a tiny Hugging Face Qwen3-MoE with experts_implementation=
"moeblaze", with and without MixedPrecisionPolicy(bf16 params, fp32 reduce), resharding after
forward or not. Two ranks (gloo on the CPU; nccl on the GPU, one rank per GPU), each stepping on
its half of the batch, against the unsharded model stepping on both halves in one process: the
gradients (gathered from their shards), the weights after an SGD step and the loss agree within
the expert-parallel tests' single-process tolerances. Also: what fully_shard hands the module's
forward (plain unsharded tensors), and the DTensor rules (replicated: taken as the full tensor;
sharded: a ValueError naming the argument)."""
import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moeblaze
from helpers import TOL_SINGLE, rel_err, run_ranks, tiny_qwen3_moe

try:
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    _HAVE_FSDP = dist.is_available() and dist.is_gloo_available()
except ImportError:  # pragma: no cover
    _HAVE_FSDP = False

pytestmark = pytest.mark.skipif(not _HAVE_FSDP, reason="skipped: torch.distributed with gloo and "
                                "FSDP2 (fully_shard) are not available in this torch build")

JOIN_TIMEOUT_S = 180
# (mixed precision, reshard_after_forward); the GPU computes in bf16 only (fp32 x is refused there).
CONFIGS = {"cpu": [(None, True), (None, False), ("bf16", True), ("bf16", False)],
           "cuda": [("bf16", True), ("bf16", False)]}
# The GPU backend's sizes: d and n multiples of 64.
SIZES = {"cpu": dict(d=16, n=12, E=4, K=2, B=3, L=6), "cuda": dict(d=64, n=64, E=4, K=2, B=2, L=8)}


class Block(nn.Module):
    def __init__(self, d, n, E, K):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.moe = moeblaze.MoE(d, n, E, K, renormalize=True, aux_loss_coef=0.01)

    def forward(self, x):
        out, losses = self.moe(self.norm(x))
        return x + out, losses.total


class Net(nn.Module):
    """Two residual moeblaze.MoE blocks and a linear head."""

    def __init__(self, d, n, E, K):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, n, E, K) for _ in range(2))
        self.head = nn.Linear(d, d)

    def forward(self, x):
        aux = 0
        for b in self.blocks:
            x, a = b(x)
            aux = aux + a
        return self.head(x), aux


def _make(kind, device, s):
    if kind == "moe":
        return Net(s["d"], s["n"], s["E"], s["K"]).to(device), Net.forward
    from moeblaze.integrations import hf as mb_hf
    mb_hf.register()
    return tiny_qwen3_moe(s["d"], s["n"], s["E"], s["K"]).to(device), None


def _loss(kind, model, batch):
    if kind == "moe":
        x, target = batch
        out, aux = model(x)
        return F.mse_loss(out.float(), target) + aux
    ids, labels = batch
    return model(input_ids=ids, labels=labels).loss


def _batch(kind, device, s, gen):
    B, L, d = 2 * s["B"], s["L"], s["d"]
    if kind == "moe":
        return (torch.randn(B, L, d, generator=gen).to(device),
                torch.randn(B, L, d, generator=gen).to(device))
    return (torch.randint(0, 64, (B, L), generator=gen).to(device),
            torch.randint(0, 64, (B, L), generator=gen).to(device))


def _half(batch, rank, world):
    return tuple(t.chunk(world)[rank] for t in batch)


def _units(kind, model):
    """The modules fully_shard wraps before the root: the blocks / decoder layers."""
    return list(model.blocks) if kind == "moe" else list(model.model.layers)


def _moe_modules(kind, model):
    if kind == "moe":
        return [b.moe for b in model.blocks]
    return [layer.mlp.experts for layer in model.model.layers]


def _reference(kind, model, batch, world, mp):
    """The unsharded model: each rank's half stepped in one process, gradients averaged (what
    FSDP's reduce-scatter computes); with bf16 mixed precision the forward and backward run on
    bf16 copies of the parameters (buffers stay as they are, as under FSDP) and the gradients are
    averaged in fp32. Returns (mean loss, {name: grad fp32}, model after SGD)."""
    ref = copy.deepcopy(model)
    grads, losses = {}, []
    for r in range(world):
        run = copy.deepcopy(ref)
        if mp:
            for p in run.parameters():
                p.data = p.data.to(torch.bfloat16)
        part = _half(batch, r, world)
        if mp and kind == "moe":
            part = (part[0].to(torch.bfloat16), part[1])
        loss = _loss(kind, run, part)
        loss.backward()
        losses.append(loss.detach().float())
        for n, p in run.named_parameters():
            g = p.grad.float() / world
            grads[n] = g if n not in grads else grads[n] + g
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for n, p in ref.named_parameters():
        p.grad = grads[n].to(p.dtype)
    opt.step()
    return sum(losses) / world, grads, ref


def _check_config(kind, device, rank, world, seed, mp, reshard):
    from torch.distributed.tensor import DTensor
    s = SIZES[device]
    torch.manual_seed(seed)  # the same initial weights on every rank
    model, _ = _make(kind, device, s)
    gen = torch.Generator().manual_seed(seed + 1)
    batch = _batch(kind, device, s, gen)
    what = f"{kind} on {device}, mp={mp}, reshard_after_forward={reshard}"
    ref_loss, ref_grads, ref = _reference(kind, model, batch, world, mp)

    sharded = copy.deepcopy(model)
    # The mesh on the test's own device: fully_shard's default mesh is CUDA's wherever CUDA is
    # present, which would move the CPU case's parameters to the GPU.
    from torch.distributed.device_mesh import init_device_mesh
    kw = {"reshard_after_forward": reshard, "mesh": init_device_mesh(device, (world,))}
    if mp:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    for unit in _units(kind, sharded):
        fully_shard(unit, **kw)
    fully_shard(sharded, **kw)
    assert all(isinstance(p, DTensor) for p in sharded.parameters()), what

    # What fully_shard hands forward: plain (unsharded) tensors, in the compute dtype.
    seen = []
    hooks = [m.register_forward_pre_hook(
        lambda mod, args: seen.append(
            (type(mod.w1 if kind == "moe" else mod.gate_up_proj),
             (mod.w1 if kind == "moe" else mod.gate_up_proj).dtype)))
        for m in _moe_modules(kind, sharded)]
    loss = _loss(kind, sharded, _half(batch, rank, world))
    loss.backward()
    for h in hooks:
        h.remove()
    want_dt = torch.bfloat16 if mp else torch.float32
    assert seen and all(t is nn.Parameter and dt == want_dt for t, dt in seen), f"{what}: {seen}"

    got_loss = loss.detach().float().reshape(1)
    dist.all_reduce(got_loss)
    assert rel_err(got_loss / world, ref_loss) <= TOL_SINGLE[want_dt], what
    tol = TOL_SINGLE[want_dt]
    errs = {}
    for n, p in sharded.named_parameters():
        assert isinstance(p.grad, DTensor), f"{what}: {n}'s gradient is not a DTensor"
        errs[n] = rel_err(p.grad.full_tensor(), ref_grads[n])
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"{what}: gradients above {tol}: {bad}"

    opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
    opt.step()
    ref_params = dict(ref.named_parameters())
    werrs = {n: rel_err(p.full_tensor(), ref_params[n]) for n, p in sharded.named_parameters()}
    bad = {n: e for n, e in werrs.items() if not e <= TOL_SINGLE[torch.float32]}
    assert not bad, f"{what}: weights after the step differ: {bad}"


def _check_dtensor_rules(device, rank, world, seed):
    """A module called outside FSDP's forward sees its sharded DTensor parameters: refused by
    name; the functional form takes a replicated DTensor as its full tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    s = SIZES[device]
    torch.manual_seed(seed)
    net = Net(s["d"], s["n"], s["E"], s["K"]).to(device)
    mesh = init_device_mesh(device, (world,))
    for b in net.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(net, mesh=mesh)
    x = torch.randn(5, s["d"], device=device)
    if device == "cuda":
        x = x.bfloat16()
    # blocks[0] is an FSDP unit; its moe is not: called directly, its parameters stay sharded.
    with pytest.raises(ValueError, match=r"MoE\.w1 is a DTensor sharded over .*full expert "
                                         r"weights: call it inside FSDP's forward"):
        net.blocks[0].moe(x)

    E, d, n, K = s["E"], s["d"], s["n"], s["K"]
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    w1 = torch.randn(E, 2 * n, d, device=device, dtype=dt)
    w2 = torch.randn(E, d, n, device=device, dtype=dt)
    ids = torch.stack([torch.randperm(E, device=device)[:K] for _ in range(x.shape[0])])
    wts = torch.rand(x.shape[0], K, device=device)
    with pytest.raises(ValueError, match=r"w1 is a DTensor sharded over .*\(Shard\(dim=0\),\).*"
                                         r"pass \.full_tensor\(\)"):
        moeblaze.moe_experts(x, distribute_tensor(w1, mesh, [Shard(0)]), w2, ids, wts)
    plain1 = w1.clone().requires_grad_()
    want = moeblaze.moe_experts(x, plain1, w2, ids, wts)
    want.sum().backward()
    rep = distribute_tensor(w1, mesh, [Replicate()]).requires_grad_()
    got = moeblaze.moe_experts(x, rep, w2, ids, wts)
    assert type(got) is torch.Tensor and torch.equal(got, want)
    got.sum().backward()
    assert torch.equal(rep.grad.full_tensor(), plain1.grad)


def _fsdp_ranks(rank, world, seed, device, kind):
    if device == "cuda":
        torch.cuda.manual_seed_all(seed)
    if kind == "moe":
        _check_dtensor_rules(device, rank, world, seed)
    for mp, reshard in CONFIGS[device]:
        _check_config(kind, device, rank, world, seed, mp, reshard)


def _gpu_world():
    return min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 1


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_fsdp2_moe_net(seed, device):
    world, backend = (2, "gloo") if device == "cpu" else (_gpu_world(), "nccl")
    run_ranks(world, _fsdp_ranks, seed, backend, JOIN_TIMEOUT_S, args=(device, "moe"),
              fail_grace_s=20)


@pytest.mark.parametrize("device", DEVICES)
def test_fsdp2_hf_qwen3_moe(seed, device):
    pytest.importorskip("transformers.integrations.moe", reason="transformers < 5: no experts "
                        "interface")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a tiny config built here: nothing to download
    world, backend = (2, "gloo") if device == "cpu" else (_gpu_world(), "nccl")
    run_ranks(world, _fsdp_ranks, seed, backend, JOIN_TIMEOUT_S, args=(device, "hf"),
              fail_grace_s=20)
