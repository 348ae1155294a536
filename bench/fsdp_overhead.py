#!/usr/bin/env python3
"""What FSDP2 costs a model of moeblaze.MoE blocks at world size 1: the same model's training step
(forward, backward, SGD step) unsharded and under torch.distributed.fsdp.fully_shard, timed in
alternated rounds in one process, the same weights and batch. At world size 1 the all-gathers
and reduce-scatters move nothing between GPUs, so the ratio is FSDP2's own bookkeeping around
moeblaze's ops (unshard / reshard, hooks, the gradient reduction's copies).

  python3 bench/fsdp_overhead.py                     # on the GPU: d 2048, n 768, E 128, K 8
  python3 bench/fsdp_overhead.py --tiny              # CPU, a tiny shape (what the test runs)

A third model keeps the blocks' weights unsharded from forward to backward
(`reshard_after_forward=False`: one unshard per step, not two), and the step is set beside the
time of copying every weight once (`torch._foreach_copy_`, the same bytes): FSDP2 copies the
weights into its unsharded parameters at each unshard, even at world size 1, and the gradients
into and out of its reduce-scatter buffers, so the overhead in units of that copy says how much of
it is bytes FSDP2 moves.

The same three models are built a second time with PyTorch's own experts in place of
moeblaze.MoE (`--experts torch`, and `both`, the default): a router, top-K softmax and
bench/torch_reference.py's sort / gather / `torch._grouped_mm` layer, the same weight shapes. FSDP2
copies the same bytes around either, so set side by side the two say how much of the overhead
is FSDP2's own and how much, if any, comes from moeblaze.

Prints a table and one JSON line per experts kind (`bench: "fsdp-overhead"`, `experts`, and
docs/DESIGN.md's common fields).
"""
import argparse
import datetime
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import moeblaze

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_reference import git_commit, moe_layer, step_timer  # noqa: E402


def loop_grouped_mm(a, b_t, offs):
    """torch._grouped_mm's result by one matmul per group: for the CPU, where it has none."""
    starts = [0] + offs.tolist()[:-1]
    return torch.cat([a[s:e] @ b_t[g] for g, (s, e) in enumerate(zip(starts, offs.tolist()))])


class TorchExperts(nn.Module):
    """PyTorch's own MoE: a router, top-K softmax (renormalized), and torch_reference's sort /
    gather / grouped GEMM / SwiGLU layer; moeblaze.MoE's weight shapes (w1 (E, 2n, d), w2 (E, d,
    n)). The router's auxiliary loss is left out (a few elementwise ops)."""

    def __init__(self, d, n, E, K, device, dtype):
        super().__init__()
        self.n, self.E, self.K = n, E, K
        self.router = nn.Linear(d, E, bias=False, device=device, dtype=dtype)
        self.w1 = nn.Parameter(torch.randn(E, 2 * n, d, device=device, dtype=dtype) / d ** 0.5)
        self.w2 = nn.Parameter(torch.randn(E, d, n, device=device, dtype=dtype) / n ** 0.5)
        self.mm = None if device == "cuda" else loop_grouped_mm

    def forward(self, x):
        probs = torch.softmax(self.router(x).float(), dim=-1)
        w, ids = probs.topk(self.K, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        out = moe_layer(x, self.w1, self.w2, ids, w, self.n, self.E, self.K, grouped_mm=self.mm)
        return out, x.new_zeros(())


class Block(nn.Module):
    def __init__(self, d, n, E, K, device, dtype, experts):
        super().__init__()
        self.norm = nn.LayerNorm(d, device=device, dtype=dtype)
        self.experts = experts
        if experts == "torch":
            self.moe = TorchExperts(d, n, E, K, device, dtype)
        else:
            self.moe = moeblaze.MoE(d, n, E, K, renormalize=True, aux_loss_coef=0.01,
                                    device=device, dtype=dtype)

    def forward(self, x):
        out, losses = self.moe(self.norm(x))
        return x + out, (losses if self.experts == "torch" else losses.total)


class Net(nn.Module):
    def __init__(self, layers, d, n, E, K, device, dtype, experts="moeblaze"):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, n, E, K, device, dtype, experts)
                                    for _ in range(layers))

    def forward(self, x):
        aux = 0
        for b in self.blocks:
            x, a = b(x)
            aux = aux + a
        return x, aux


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--n", type=int, default=768)
    ap.add_argument("--E", type=int, default=128)
    ap.add_argument("--K", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20, help="timed steps per implementation and round")
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds")
    ap.add_argument("--experts", choices=["moeblaze", "torch", "both"], default="both",
                    help="the blocks' experts: moeblaze.MoE, PyTorch's own (torch._grouped_mm), "
                         "or each in turn (one row each)")
    ap.add_argument("--tiny", action="store_true", help="a tiny CPU shape (tests)")
    ap.add_argument("--out", help="append the JSON lines to this file")
    a = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and moeblaze.has_cuda() and not a.tiny else "cpu"
    if a.tiny:
        a.tokens, a.d, a.n, a.E, a.K, a.layers, a.reps, a.rounds = 64, 16, 12, 4, 2, 2, 3, 2
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    backend = "nccl" if device == "cuda" else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        kinds = ["moeblaze", "torch"] if a.experts == "both" else [a.experts]
        rows = [measure(a, experts, device, dtype) for experts in kinds]
        if a.out:
            with open(a.out, "a") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
        return rows
    finally:
        dist.destroy_process_group()


def measure(a, experts, device, dtype):
    """One experts kind: the unsharded model and its two fully_shard copies, timed in
    alternated rounds beside a copy of every weight; prints the table, returns the row."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    plain = Net(a.layers, a.d, a.n, a.E, a.K, device, dtype, experts)
    # The mesh on the run's device: fully_shard's default is CUDA's wherever CUDA is present.
    mesh = init_device_mesh(device, (1,))
    models = {"unsharded": plain}
    for name, reshard in (("fully_shard", True), ("fully_shard_keep", False)):
        m = Net(a.layers, a.d, a.n, a.E, a.K, device, dtype, experts)
        m.load_state_dict(plain.state_dict())
        for b in m.blocks:
            fully_shard(b, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(m, mesh=mesh, reshard_after_forward=reshard)
        models[name] = m
    x = torch.randn(a.tokens, a.d, device=device, dtype=dtype)
    target = torch.randn(a.tokens, a.d, device=device, dtype=dtype)
    opts = {m: torch.optim.SGD(m.parameters(), lr=1e-4) for m in models.values()}
    weights = [p.detach() for p in plain.parameters()]
    copies = [torch.empty_like(w) for w in weights]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)

    def step(model):
        def run():
            out, aux = model(x)
            (F.mse_loss(out.float(), target.float()) + aux).backward()
            opts[model].step()
            opts[model].zero_grad(set_to_none=True)
        return run

    timer = step_timer(device)
    times = {name: [] for name in models}
    times["weight_copy"] = []
    copy = lambda: torch._foreach_copy_(copies, weights)  # noqa: E731
    for m in models.values():  # warm-up: the fast path's compile, FSDP's lazy init
        for _ in range(2):
            step(m)()
    for r in range(a.rounds):
        order = [(name, step(m)) for name, m in models.items()] + [("weight_copy", copy)]
        for name, fn in (order if r % 2 == 0 else order[::-1]):
            times[name] += [timer(fn) for _ in range(a.reps)]
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["fully_shard"] / med["unsharded"]
    overhead_copies = (med["fully_shard"] - med["unsharded"]) / med["weight_copy"]
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    what = "moeblaze.MoE" if experts == "moeblaze" else "PyTorch's own experts (torch._grouped_mm)"
    print(f"FSDP2 at world size 1, {a.layers} blocks of {what} (T {a.tokens}, d {a.d}, n {a.n}, "
          f"E {a.E}, K {a.K}, {str(dtype).split('.')[-1]}), {gpu}; median of "
          f"{a.reps * a.rounds} steps in {a.rounds} alternated rounds")
    print("| model | step ms | × unsharded | overhead ms | overhead in weight copies |\n"
          "|---|---:|---:|---:|---:|")
    for k in models:
        print(f"| {k} | {med[k]:.3f} | {med[k] / med['unsharded']:.3f} | "
              f"{med[k] - med['unsharded']:.3f} | "
              f"{(med[k] - med['unsharded']) / med['weight_copy']:.2f} |")
    print(f"one copy of the {weight_bytes / 2**20:.0f} MiB of weights: "
          f"{med['weight_copy']:.3f} ms")
    row = {"bench": "fsdp-overhead", "experts": experts, "T": a.tokens, "d": a.d, "n": a.n,
           "E": a.E, "K": a.K, "layers": a.layers, "dtype": str(dtype).split(".")[-1],
           "unsharded_ms": med["unsharded"], "fully_shard_ms": med["fully_shard"],
           "ratio": ratio, "fully_shard_keep_ms": med["fully_shard_keep"],
           "keep_ratio": med["fully_shard_keep"] / med["unsharded"],
           "weight_bytes": weight_bytes, "weight_copy_ms": med["weight_copy"],
           "overhead_in_weight_copies": overhead_copies,
           "reps": a.reps, "rounds": a.rounds, "torch": torch.__version__, "gpu": gpu,
           "commit": git_commit(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    print(json.dumps(row))
    return row


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
