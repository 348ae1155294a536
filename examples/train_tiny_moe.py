#!/usr/bin/env python3
"""Train a small decoder-only MoE language model on the byte-level KJV corpus shipped in
examples/data (no network at run time), with moeblaze's MoE layer or a pure-PyTorch one.

    python examples/train_tiny_moe.py                  # GPU preset: 4 layers, d=512, E=32, K=4
    python examples/train_tiny_moe.py --impl torch     # the same model, pure PyTorch MoE
    python examples/train_tiny_moe.py --device cpu     # CPU preset: a few minutes on a CPU
    python examples/train_tiny_moe.py --device cpu --steps 20   # any flag overrides the preset

Presets (PRESETS below; the device picks one, the run's first line prints it): "cuda" is the
model of the training proofs (4 layers, d=512, E=32, K=4, n=256, bf16, 16 x 256 bytes per
step, 300 steps): about a minute on an H200, hours on a CPU. "cpu" is a smaller model (4
layers, d=256, E=16, K=2, n=256, fp32, 8 x 128 bytes per step, 300 steps): measured at about
4k tokens/s on two idle cores of this project's CPU machines, so about 2 minutes (13 minutes
measured while other jobs shared them: the bar's ETA tells); the validation loss falls
from 5.5 (ln 256) to 2.32.

Model: byte embedding (256) -> layers x [RMSNorm -> causal attention (SDPA) -> RMSNorm -> MoE]
-> RMSNorm -> tied output head. Parameters in --dtype (bf16 by default, no fp32 master copy:
the same for both implementations), AdamW, cosine schedule with warm-up, switch aux loss.
Both implementations build identical parameters from --seed and see identical batches.
Progress: a tqdm bar with ETA when tqdm is installed, else one plain line per --log-every
steps (ETA included), with loss, tokens/s and peak memory (PyTorch's allocator and moeblaze's
own). --json writes the run's numbers (curve included); --plot PATH.png draws the loss curves
with matplotlib, or, without matplotlib, writes them as PATH.json and says so.
"""
import argparse
import gzip
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import moeblaze

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "kjv.txt.gz")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Flags left unset take the preset of the device type (see the docstring for the run times).
PRESET_NOTES = {"cuda": "the training proofs' model; hours on a CPU",
                "cpu": "sized for a CPU: about 2 minutes on two idle cores"}
PRESETS = {
    "cuda": dict(dtype="bf16", layers=4, d=512, heads=8, E=32, K=4, n=256, seq=256, batch=16,
                 steps=300, warmup=30, val_every=100, log_every=25),
    "cpu": dict(dtype="fp32", layers=4, d=256, heads=4, E=16, K=2, n=256, seq=128, batch=8,
                steps=300, warmup=30, val_every=100, log_every=10),
}


def load_corpus(path=DATA, val_fraction=0.05):
    with gzip.open(path, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
    cut = int(len(data) * (1 - val_fraction))
    return data[:cut], data[cut:]


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6, **kw):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d, **kw))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype) * \
            self.weight


class Block(nn.Module):
    def __init__(self, a, **kw):
        super().__init__()
        self.heads = a.heads
        self.norm1 = RMSNorm(a.d, **kw)
        self.qkv = nn.Linear(a.d, 3 * a.d, bias=False, **kw)
        self.proj = nn.Linear(a.d, a.d, bias=False, **kw)
        self.norm2 = RMSNorm(a.d, **kw)
        cls = moeblaze.MoE if a.impl == "moeblaze" else moeblaze.TorchMoE
        extra = {}
        if a.impl == "moeblaze":
            extra = dict(token_rounding=None if a.token_rounding == "none" else a.token_rounding,
                         m_tile=a.m_tile, recompute=a.recompute,
                         compute_dtype=None if a.compute == "bf16" else a.compute,
                         fp8_weight_cache=a.compute != "bf16")  # codes kept between steps
        self.moe = cls(a.d, a.n, a.E, a.K, activation="swiglu", aux_loss_coef=a.aux_loss_coef,
                       **extra, **kw)

    def forward(self, x):
        B, L, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, L, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(B, L, d))
        y, losses = self.moe(self.norm2(x))
        return x + y, losses.total


class TinyMoELM(nn.Module):
    def __init__(self, a, **kw):
        super().__init__()
        self.embed = nn.Embedding(256, a.d, **kw)
        self.pos = nn.Parameter(torch.zeros(a.seq, a.d, **kw))
        self.blocks = nn.ModuleList([Block(a, **kw) for _ in range(a.layers)])
        self.norm = RMSNorm(a.d, **kw)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx):
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        aux = x.new_zeros((), dtype=torch.float32)
        for b in self.blocks:
            x, l = b(x)
            aux = aux + l
        logits = F.linear(self.norm(x), self.embed.weight)  # tied head
        return logits, aux


def batches(data, batch, seq, gen, device):
    """An endless stream of (input, target) byte windows at seeded random offsets."""
    while True:
        ix = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        chunk = torch.stack([data[i:i + seq + 1] for i in ix.tolist()]).to(device, torch.long)
        yield chunk[:, :-1], chunk[:, 1:]


def lm_loss(model, x, y):
    logits, aux = model(x)
    ce = F.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1))
    return ce, aux


def train_step(model, opt, x, y):
    """One optimizer step: forward, backward, gradients clipped to norm 1, AdamW; (ce, aux)."""
    ce, aux = lm_loss(model, x, y)
    opt.zero_grad(set_to_none=True)
    (ce + aux).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return ce, aux


@torch.no_grad()
def evaluate(model, val, a, device):
    gen = torch.Generator().manual_seed(12345)  # the same validation windows every time
    it = batches(val, a.batch, a.seq, gen, device)
    tot = 0.0
    for _ in range(a.val_batches):
        x, y = next(it)
        tot += float(lm_loss(model, x, y)[0])
    return tot / a.val_batches


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(device):
    """(PyTorch allocator peak bytes, moeblaze-owned peak bytes) since the last reset."""
    torch_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    mb = moeblaze.memory_stats("cuda" if device.type == "cuda" else "cpu")["peak"]
    return torch_peak, mb


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    moeblaze.reset_peak("cuda" if device.type == "cuda" else "cpu")


class Progress:
    """tqdm's bar (ETA, rate) when tqdm is installed, else plain lines with an ETA."""

    def __init__(self, total, quiet):
        self.total, self.quiet, self.t0, self.done = total, quiet, time.perf_counter(), 0
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        self.bar = tqdm(total=total, unit="step", dynamic_ncols=True) if tqdm and not quiet \
            else None

    def update(self, step, msg):
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.update(step - self.done)
            self.bar.set_postfix_str(msg, refresh=True)
        else:
            el = time.perf_counter() - self.t0
            eta = el / max(step, 1) * (self.total - step)
            print(f"step {step:>5}/{self.total}  {msg}  elapsed {el:5.0f} s  ETA {eta:5.0f} s",
                  flush=True)
        self.done = step

    def write(self, msg):
        if not self.quiet:
            (self.bar.write if self.bar is not None else print)(msg)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def plot_curves(path, series, title, xlabel="step", ylabel="loss"):
    """series {name: (xs, ys)} as a PNG at path with matplotlib (axis values, labels, legend);
    without matplotlib the series go to path's .json twin instead. Returns the path written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        out = os.path.splitext(path)[0] + ".json"
        with open(out, "w") as f:
            json.dump({"title": title, "xlabel": xlabel, "ylabel": ylabel, "series": series}, f)
        print(f"plot: matplotlib is not installed (pip install matplotlib): wrote the curves to "
              f"{out} instead of {path}", flush=True)
        return out
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=100)
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, label=name, linewidth=1.2, marker="o" if len(xs) < 20 else None)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def build(a, device):
    torch.manual_seed(a.seed)
    model = TinyMoELM(a, device=device, dtype=DTYPES[a.dtype])
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    return model, opt


def train(a):
    device = torch.device(a.device)
    train_data, val_data = load_corpus()
    model, opt = build(a, device)
    nparams = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(a.data_seed)
    it = batches(train_data, a.batch, a.seq, gen, device)
    tokens_per_step = a.batch * a.seq
    lr_at = lambda s: a.lr * min(1.0, (s + 1) / a.warmup) * (  # noqa: E731
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s / max(a.steps, 1), 1.0))))
    if not a.quiet:
        print(f"train_tiny_moe: preset={a.preset} ({PRESET_NOTES[a.preset]}; flags override)",
              flush=True)
        print(f"train_tiny_moe: impl={a.impl} device={device} dtype={a.dtype} "
              f"layers={a.layers} steps={a.steps} "
              f"d={a.d} E={a.E} K={a.K} n={a.n} token_rounding={a.token_rounding} "
              f"recompute={a.recompute} compute={a.compute} params={nparams / 1e6:.1f}M "
              f"batch={a.batch}x{a.seq} "
              f"corpus={len(train_data) / 1e6:.2f}M+{len(val_data) / 1e6:.2f}M bytes", flush=True)
    curve, val_curve, step_times = [], [], []
    reset_peak(device)
    bar = Progress(a.steps, a.quiet)
    t_log, tok_log = time.perf_counter(), 0
    tok_s = 0.0
    for step in range(a.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x, y = next(it)
        t0 = time.perf_counter()
        ce, _ = train_step(model, opt, x, y)
        if a.time_steps:
            sync(device)
            step_times.append(time.perf_counter() - t0)
        loss = float(ce.detach())  # one host read per step (the curve); also keeps the timing honest
        curve.append(loss)
        tok_log += tokens_per_step
        if not math.isfinite(loss):
            print(f"train_tiny_moe: loss is {loss} at step {step}", file=sys.stderr)
            break
        last = step + 1 == a.steps
        if (step + 1) % a.log_every == 0 or last:
            sync(device)
            now = time.perf_counter()
            tok_s = tok_log / (now - t_log)
            t_log, tok_log = now, 0
            tp, mp = peak_memory(device)
            torch_mem = f"torch {tp / 2**20:.1f} MiB  " if device.type == "cuda" else ""
            bar.update(step + 1, f"loss {loss:.4f}  {tok_s / 1e3:.1f}k tok/s  peak "
                       f"{torch_mem}moeblaze {mp / 2**20:.1f} MiB")
        if a.val_every and ((step + 1) % a.val_every == 0 or last):
            v = evaluate(model, val_data, a, device)
            val_curve.append((step + 1, v))
            bar.write(f"  step {step + 1}: val loss {v:.4f}")
    bar.close()
    sync(device)
    torch_peak, mb_peak = peak_memory(device)
    # tokens/s over the steady state: steps after the first 10 % (warm-up, allocator growth).
    result = {
        "impl": a.impl, "device": str(device), "dtype": a.dtype, "layers": a.layers, "d": a.d,
        "E": a.E, "K": a.K, "n": a.n, "batch": a.batch, "seq": a.seq, "steps": len(curve),
        "token_rounding": a.token_rounding, "recompute": a.recompute, "compute": a.compute,
        "params": nparams,
        "train_loss": curve, "val_loss": val_curve,
        "final_train_loss_avg20": sum(curve[-20:]) / max(len(curve[-20:]), 1),
        "final_val_loss": val_curve[-1][1] if val_curve else None,
        "tokens_per_s_last_interval": tok_s,
        "peak_torch_bytes": torch_peak, "peak_moeblaze_bytes": mb_peak,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    if step_times:
        warm = step_times[max(len(step_times) // 10, 1):] or step_times
        med = sorted(warm)[len(warm) // 2]
        result["median_step_s"] = med
        result["tokens_per_s"] = tokens_per_step / med
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f)
    if a.plot:
        series = {f"{a.impl} train": (list(range(1, len(curve) + 1)), curve)}
        if val_curve:
            series[f"{a.impl} val"] = ([s for s, _ in val_curve], [v for _, v in val_curve])
        result["plot"] = plot_curves(a.plot, series, f"tiny MoE LM ({a.impl}, {a.preset} preset)")
    if not a.quiet:
        torch_mem = f"peak torch {torch_peak / 2**20:.1f} MiB, " if device.type == "cuda" else ""
        print(f"train_tiny_moe: done: final val loss {result['final_val_loss']:.4f}, {torch_mem}"
              f"peak moeblaze {mb_peak / 2**20:.1f} MiB"
              f"{', curves in ' + result['plot'] if a.plot else ''}", flush=True)
    return result


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--impl", choices=["moeblaze", "torch"], default="moeblaze")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda or cpu; picks the preset of the flags left unset")
    p.add_argument("--dtype", choices=list(DTYPES))
    for name in ("layers", "d", "heads", "E", "K", "n", "seq"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--batch", type=int, help="sequences per step")
    p.add_argument("--steps", type=int)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int)
    p.add_argument("--aux-loss-coef", type=float, default=0.01)
    p.add_argument("--token-rounding", choices=["none", "nr-f", "sr-f", "up", "down"],
                   default="none")
    p.add_argument("--m-tile", type=int, default=128)
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--compute", choices=["bf16", "fp8", "fp8-wgrad"], default="bf16",
                   help="the experts' GEMMs: in the storage dtype, or fp8 (e4m3 operands, "
                        "docs/FP8.md; needs --dtype bf16; the GPU needs d and n multiples of "
                        "128; the weights' codes kept between optimizer steps); fp8-wgrad: "
                        "the weight gradients' GEMMs in fp8 too")
    p.add_argument("--seed", type=int, default=0, help="parameter init")
    p.add_argument("--data-seed", type=int, default=1, help="batch order")
    p.add_argument("--val-every", type=int)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--log-every", type=int)
    p.add_argument("--time-steps", action="store_true",
                   help="synchronise after every step and record its time (median reported)")
    p.add_argument("--json", help="write the run's numbers here")
    p.add_argument("--plot", help="write the loss curves PNG here (matplotlib; else PATH.json)")
    p.add_argument("--quiet", action="store_true")
    return p


def parse_args(argv=None):
    """The parsed flags, the unset ones taken from the device type's preset."""
    a = parser().parse_args(argv)
    a.preset = "cuda" if torch.device(a.device).type == "cuda" else "cpu"
    for k, v in PRESETS[a.preset].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


if __name__ == "__main__":
    args = parse_args()
    if args.impl == "torch" and (args.token_rounding != "none" or args.recompute or
                                 args.compute != "bf16"):
        parser().error("--token-rounding, --recompute and --compute fp8 are moeblaze features "
                       "(--impl moeblaze)")
    if args.compute != "bf16" and args.dtype != "bf16":
        parser().error(f"--compute {args.compute} needs --dtype bf16 (FP8 operands are quantized "
                       "from bf16)")
    train(args)
