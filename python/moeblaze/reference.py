"""Pure-PyTorch MoE: the reference the tests and the training example compare moeblaze against.

- `torch_router`: the routers of routing.hpp written with torch ops (softmax_topk, topk_softmax,
  sigmoid_bias), differentiable through autograd.
- `torch_experts`: what a PyTorch user writes today: sort the (token, expert) pairs by expert,
  gather x into an (S, d) copy, two grouped GEMMs (torch._grouped_mm on a CUDA bf16 build that has
  it; otherwise one matmul per expert), the activation between them, weights applied, scatter-add
  back to tokens; forward and backward by autograd.
- `dense_reference`: the same math per pair in any dtype (the tests run it in float64).
"""
import torch
import torch.nn.functional as F

_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


def activation_fn(name, h, n):
    """a = act(h) for the activations of config.hpp (gelu is the exact erf form)."""
    if name == "swiglu":
        return F.silu(h[..., :n]) * h[..., n:]
    if name == "geglu":
        return F.gelu(h[..., :n]) * h[..., n:]
    if name == "relu":
        return F.relu(h)
    if name == "silu":
        return F.silu(h)
    if name == "gelu":
        return F.gelu(h)
    if name == "relu2":
        return F.relu(h).square()
    if name == "swiglu_oai":  # gpt-oss: alpha 1.702, limit 7 (transformers' GptOssExperts)
        g = h[..., :n].clamp(max=7.0)
        u = h[..., n:].clamp(min=-7.0, max=7.0)
        return (u + 1) * g * torch.sigmoid(1.702 * g)
    raise ValueError(f"moeblaze: activation {name!r} is not one of swiglu, geglu, relu, silu, "
                     "gelu, relu2, swiglu_oai")


def torch_router(logits, top_k, router="softmax_topk", renormalize=False, bias=None):
    """(expert ids (T, K) int64, weights (T, K) float32). Ties break to the lower expert id."""
    logits = logits.float()
    if router == "softmax_topk":
        p = torch.softmax(logits, dim=-1)
        w, ids = torch.topk(p, top_k, dim=-1)
        if renormalize:
            w = w / w.sum(-1, keepdim=True)
    elif router == "topk_softmax":
        v, ids = torch.topk(logits, top_k, dim=-1)
        w = torch.softmax(v, dim=-1)
    elif router == "sigmoid_bias":
        s = torch.sigmoid(logits)
        _, ids = torch.topk(s + bias, top_k, dim=-1)
        w = torch.gather(s, 1, ids)
        if renormalize:
            w = w / w.sum(-1, keepdim=True)
    else:
        raise ValueError(f"moeblaze: router {router!r} is not softmax_topk, topk_softmax or "
                         "sigmoid_bias")
    return ids, w


def dense_reference(x, w1, w2, ids, weights, activation="swiglu"):
    """out_t = sum_k weights[t,k] * W2_e act(W1_e x_t), e = ids[t,k], computed per pair in the
    inputs' dtype (cast them to float64 for a reference). Memory O(T*K*rows*d): small shapes."""
    n = w2.shape[2]
    h = torch.einsum("tkrd,td->tkr", w1[ids], x)
    a = activation_fn(activation, h, n)
    y = torch.einsum("tkdn,tkn->tkd", w2[ids], a)
    return (y * weights.unsqueeze(-1).to(y.dtype)).sum(1)


def torch_experts(x, w1, w2, ids, weights, activation="swiglu"):
    """Sort-and-gather MoE: x (T, d), w1 (E, rows, d), w2 (E, d, n), ids (T, K), weights (T, K)."""
    T, d = x.shape
    E, n = w2.shape[0], w2.shape[2]
    K = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // K
    counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    w_sorted = weights.reshape(-1)[order]
    xs = x[tok]  # (S, d) gathered copy
    use_grouped = (_HAS_GROUPED_MM and x.is_cuda and x.dtype == torch.bfloat16)
    if use_grouped:
        offs = torch.cumsum(counts, 0).to(torch.int32)
        h = torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs)
        a = activation_fn(activation, h, n)
        y = torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)
    else:
        # One matmul per expert (the counts are read on the host: a sync, as such code has).
        ys = []
        start = 0
        for e, c in enumerate(counts.tolist()):
            if c == 0:
                continue
            h = xs[start:start + c] @ w1[e].t()
            ys.append(activation_fn(activation, h, n) @ w2[e].t())
            start += c
        y = torch.cat(ys) if ys else xs.new_zeros(0, d)
    y = y * w_sorted.unsqueeze(-1).to(y.dtype)
    return torch.zeros_like(x).index_add(0, tok, y)
