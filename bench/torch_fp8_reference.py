#!/usr/bin/env python3
"""The torch FP8 reference: bench/torch_reference.py's MoE layer with every grouped GEMM on
`torch._scaled_grouped_mm` and row-wise e4m3 scales, the recipe torchao's MoE training uses on
Hopper (written here from its description; torchao is not a dependency):

  forward    out = A · B_t[g]        A: one scale per row (over K); B_t[g]: one per column (over K)
  grad A     dO · B_t[g]ᵀ            dO: per row (over N); B_t[g]ᵀ: per column (over N)
  grad B_t   A_gᵀ · dO_g, per group  A and dO: one scale per (group, column) over the group's rows

Scales are powers of two (the largest with amax · s <= 448), codes e4m3 with saturation, fp32
accumulation with the fast-accumulation mode torchao uses; expert groups are padded to 16 rows
(moe_layer's pad_to). The quantization runs as plain torch ops (torchao fuses it in Triton), so
this reference's quantization costs more than torchao's: a generous baseline for moeblaze. bf16
operands are scaled in bf16 (exact for powers of two) and per-group column maxima reduce 16-row
block maxima, so no (M, C) float32 copy of an operand is made.
On a CPU (the tests) the scaled GEMM is emulated in float32 from the same codes and scales.

  fp8_layer(x, w1, w2, ids, weights, n, E, K)   the layer, autograd through it
  fp8_grouped_mm(a, b_t, offs)                  one grouped GEMM (torch._grouped_mm's arguments)
"""
import torch

from torch_reference import moe_layer

E4M3_MAX = 448.0
GROUP_ROWS = 16  # the FP8 grouped GEMM's row granularity per group


def pow2_scale(amax):
    """Quantization multiplier of a group with this amax: the largest power of two s with
    amax · s <= 448 (fp32; 1 / (tiny) for all-zero groups, whose codes are all zero anyway)."""
    amax = amax.float().clamp(min=2.0 ** -100)
    return torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))


def to_e4m3(x, s):
    """e4m3 codes of x · s (s: powers of two, broadcast against x). A bf16 x is scaled in bf16:
    x · 2^k is exact there, so the codes are the float32 path's without its (·) fp32 copy."""
    if x.dtype == torch.bfloat16:
        return (x * s.to(torch.bfloat16)).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (x.float() * s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quant_rows(x):
    """x (..., K) → (codes (..., K) e4m3, dequantization factors (...,) fp32): one scale per row
    over the last dimension."""
    s = pow2_scale(x.abs().amax(dim=-1))
    return to_e4m3(x, s.unsqueeze(-1)), s.reciprocal()


def quant_group_columns(x, offs, block=1):
    """x (M, C), groups of rows ending at offs (G,) → (codes of xᵀ (C, M) row-major, factors
    (G·C,) group-major): one scale per (group, column) over the group's rows. block: a row count
    that divides M and every group end (the layer's groups are padded to GROUP_ROWS), so that
    the per-group reductions run over (M / block, C) block maxima instead of (M, C) elements."""
    M, C = x.shape
    G = offs.numel()
    assert M % block == 0, f"quant_group_columns: M ({M}) is not a multiple of block ({block})"
    nb = M // block
    starts = torch.arange(nb, device=x.device) * block
    group = torch.bucketize(starts, offs.long(), right=True)  # (nb,) each block's group
    xb = x.view(nb, block, C)
    amax = torch.zeros(G + 1, C, device=x.device, dtype=torch.float32)
    amax.scatter_reduce_(0, group.unsqueeze(1).expand(nb, C), xb.abs().amax(1).float(), "amax")
    s = pow2_scale(amax)  # (G + 1, C): row G for rows past the last group (none when padded)
    q = to_e4m3(xb, s[group].unsqueeze(1)).view(M, C)
    return q.t().contiguous(), s[:G].reciprocal().reshape(-1)


def scaled_grouped_mm(qa, qb_t, sa, sb, offs):
    """torch._scaled_grouped_mm(qa, qb_t, sa, sb, offs) in bf16 on CUDA; on a CPU its float32
    emulation. 2D x 3D (qa (M, K), qb_t (G, K, N), sa (M,), sb (G, N), groups of rows) or 2D x 2D
    (qa (m, Ktot), qb_t (Ktot, n), sa (G·m,), sb (G·n,), groups along K → (G, m, n))."""
    if qa.is_cuda:
        return torch._scaled_grouped_mm(qa, qb_t, sa, sb, offs=offs, out_dtype=torch.bfloat16,
                                        use_fast_accum=True)
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if qb_t.dim() == 3:
        out = torch.zeros(qa.shape[0], qb_t.shape[2])
        a = qa.float() * sa.unsqueeze(1)
        for g, (lo, hi) in enumerate(zip(starts, ends)):
            out[lo:hi] = a[lo:hi] @ (qb_t[g].float() * sb[g].unsqueeze(0))
        return out.to(torch.bfloat16)
    m, n, G = qa.shape[0], qb_t.shape[1], len(ends)
    out = torch.zeros(G, m, n)
    for g, (lo, hi) in enumerate(zip(starts, ends)):
        a = qa[:, lo:hi].float() * sa[g * m:(g + 1) * m].unsqueeze(1)
        b = qb_t[lo:hi].float() * sb[g * n:(g + 1) * n].unsqueeze(0)
        out[g] = a @ b
    return out.to(torch.bfloat16)


class _Fp8GroupedMM(torch.autograd.Function):
    """out (M, N) = a_g · b_t[g] over the groups of rows ending at offs; a (M, K) bf16 row-major,
    b_t (G, K, N) bf16 column-major (the transpose of a contiguous (G, N, K) weight)."""

    @staticmethod
    def forward(ctx, a, b_t, offs):
        qa, sa = quant_rows(a)  # (M, K), (M,)
        qb, sb = quant_rows(b_t.transpose(-2, -1))  # (G, N, K) over K, (G, N)
        ctx.save_for_backward(a, b_t, offs)
        return scaled_grouped_mm(qa, qb.transpose(-2, -1), sa, sb, offs)

    @staticmethod
    def backward(ctx, grad_out):
        a, b_t, offs = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        qg, sg = quant_rows(grad_out)  # (M, N), (M,)
        qbt, sbt = quant_rows(b_t.contiguous())  # (G, K, N) over N, (G, K)
        grad_a = scaled_grouped_mm(qg, qbt.transpose(-2, -1), sg, sbt, offs)  # (M, K)
        # Group ends are multiples of GROUP_ROWS (the layer pads them; fp8_grouped_mm's contract).
        qaT, saT = quant_group_columns(a, offs, GROUP_ROWS)  # (K, M), (G·K,)
        qgT, sgT = quant_group_columns(grad_out, offs, GROUP_ROWS)  # (N, M), (G·N,)
        grad_b_t = scaled_grouped_mm(qaT, qgT.t(), saT, sgT, offs)  # (G, K, N)
        return grad_a, grad_b_t, None


def fp8_grouped_mm(a, b_t, offs):
    """torch._grouped_mm(a, b_t, offs=offs) in FP8; every group end (and a's rows) a multiple of
    GROUP_ROWS, as torch._scaled_grouped_mm wants."""
    return _Fp8GroupedMM.apply(a, b_t, offs)


def fp8_layer(x, w1, w2, topk_ids, topk_w, n, E, K):
    """bench/torch_reference.py's moe_layer with its grouped GEMMs in FP8 (groups padded to 16)."""
    return moe_layer(x, w1, w2, topk_ids, topk_w, n, E, K, pad_to=GROUP_ROWS,
                     grouped_mm=fp8_grouped_mm)
