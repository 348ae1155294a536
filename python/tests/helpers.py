"""Float64 references and dtype-derived tolerances shared by the tests, and the process-group
harness of the expert-parallel tests (run_ranks)."""
import os
import sys
import tempfile
import time
import traceback

import pytest

import torch

from moeblaze.reference import dense_reference

# Relative Frobenius error allowed against the float64 reference: fp32 storage and accumulation
# (errors ~1e-6 of the norm), bf16 storage with fp32 accumulation (8-bit mantissa: a few 2^-9);
# the same bounds `moeblaze run --check` uses.
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def rel_err(a, ref):
    a, ref = a.detach().double(), ref.detach().double()
    den = float(torch.linalg.norm(ref))
    return float(torch.linalg.norm(a - ref)) / max(den, 1e-30)


def routing_ids(moe, x2):
    """moeblaze's own (T, K) expert selection for tokens x2 (plain top-K only)."""
    with torch.no_grad():
        _, offsets, experts, _ = moe.route(x2)
    return experts.long().reshape(x2.shape[0], moe.top_k)


def reference_router_weights(logits, ids, router, renormalize, bias=None):
    """Float64 gate weights of a fixed selection (selection is piecewise constant, so gradients
    through it are those of the weights)."""
    logits = logits.double()
    if router == "softmax_topk":
        w = torch.gather(torch.softmax(logits, -1), 1, ids)
        return w / w.sum(-1, keepdim=True) if renormalize else w
    if router == "topk_softmax":
        return torch.softmax(torch.gather(logits, 1, ids), -1)
    s = torch.gather(torch.sigmoid(logits), 1, ids)
    return s / s.sum(-1, keepdim=True) if renormalize else s


def reference_moe(moe, x, d_out):
    """Float64 out and gradients (x, w1, w2, gate.weight) of moe on x with upstream d_out, over
    moeblaze's own expert selection."""
    x2 = x.detach().reshape(-1, moe.hidden_size)
    ids = routing_ids(moe, x2)
    xd = x2.double().requires_grad_()
    w1 = moe.w1.detach().double().requires_grad_()
    w2 = moe.w2.detach().double().requires_grad_()
    g = moe.gate.weight.detach().double().requires_grad_()
    logits = xd @ g.t()
    w = reference_router_weights(logits, ids, moe.router, moe.renormalize)
    out = dense_reference(xd, w1, w2, ids, w, moe.activation)
    out.backward(d_out.detach().reshape(out.shape).double())
    return out.reshape(x.shape), xd.grad.reshape(x.shape), w1.grad, w2.grad, g.grad


def check_against_reference(moe, x, dtype, extra_tol=1.0):
    x = x.detach().requires_grad_()
    out, _ = moe(x)
    d_out = torch.randn_like(out)
    out.backward(d_out)
    ref = reference_moe(moe, x, d_out)
    got = (out, x.grad, moe.w1.grad, moe.w2.grad, moe.gate.weight.grad)
    names = ("out", "dx", "dw1", "dw2", "d_gate")
    errs = {n: rel_err(a, r) for n, a, r in zip(names, got, ref)}
    tol = TOL[dtype] * extra_tol
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"relative errors above {tol:g}: {bad} (all: {errs})"
    return errs


# Expert parallelism against the single-process moeblaze layer on the whole problem: fp32 differs
# only in summation grouping (per-rank partials), bf16 also in the rounding of each partial.
TOL_SINGLE = {torch.float32: 1e-6, torch.bfloat16: 8e-3}
EP_NAMES = ("out", "dx", "dw1", "dw2", "d_gate")


def ep_step(ep, x_r, d_out_r):
    """One EP forward+backward on this rank's tokens: out, dx, dw1, dw2 and gate.weight's grad."""
    ep.zero_grad(set_to_none=True)
    x = x_r.detach().clone().requires_grad_()
    out, _ = ep(x)
    out.backward(d_out_r)
    return [t.detach().clone() for t in (out, x.grad, ep.w1.grad, ep.w2.grad,
                                          ep.gate.weight.grad)]


def check_ep_rank(moe, ep, x, d_out, lo, hi, dtype, what, group=None):
    """Collective: checks this rank's EP results (tokens [lo, hi) of x, experts of ep's shard of
    moe) against a second EP run (bitwise), a float64 reference of the whole problem (TOL) and the
    single-process moe (TOL_SINGLE). Returns (errors vs float64, vs single-process, the results
    bitwise equal to the single-process ones)."""
    import torch.distributed as dist
    s, c = ep.expert_start, ep.num_local_experts
    got = ep_step(ep, x[lo:hi], d_out[lo:hi])
    again = ep_step(ep, x[lo:hi], d_out[lo:hi])
    for nm, a, b in zip(EP_NAMES, got, again):
        assert a.device == x.device, f"{what}: {nm} is on {a.device}"
        assert torch.equal(a, b), f"{what}: {nm} differs between two identical EP runs"
    assert all(t.dtype == dtype for t in got[:3]), f"{what}: out/dx/dw1 not in {dtype}"
    # The replicated router's gradient over all tokens (all-reduced in fp32: one rounding).
    g_gate = got[4].float()
    dist.all_reduce(g_gate, group=group)

    # The selection EP used (this rank's route) must be the global one (ties: vanishingly rare).
    ids_all = routing_ids(moe, x)
    assert torch.equal(routing_ids(ep, x[lo:hi]), ids_all[lo:hi]), \
        f"{what}: routing differs from the single-process routing (a near-tie?)"

    mine = (got[0], got[1], got[2], got[3], g_gate)
    ref = reference_moe(moe, x, d_out)  # float64 on x's device, over moe.route's selection
    refs = (ref[0][lo:hi], ref[1][lo:hi], ref[2][s:s + c], ref[3][s:s + c], ref[4])
    errs = {nm: rel_err(a, r) for nm, a, r in zip(EP_NAMES, mine, refs) if r.numel()}
    bad = {nm: e for nm, e in errs.items() if not e <= TOL[dtype]}
    assert not bad, f"{what}: relative errors vs float64 above {TOL[dtype]}: {bad} ({errs})"

    xs = x.detach().clone().requires_grad_()
    out1, _ = moe(xs)
    out1.backward(d_out)
    single = (out1[lo:hi], xs.grad[lo:hi], moe.w1.grad[s:s + c], moe.w2.grad[s:s + c],
              moe.gate.weight.grad)
    errs1 = {nm: rel_err(a, r) for nm, a, r in zip(EP_NAMES, mine, single) if r.numel()}
    tol1 = TOL_SINGLE[dtype]
    bad1 = {nm: e for nm, e in errs1.items() if not e <= tol1}
    assert not bad1, f"{what}: relative differences vs single-process MoE above {tol1}: " \
                     f"{bad1} ({errs1})"
    bitwise = [nm for nm, a, r in zip(EP_NAMES[:4], mine, single) if torch.equal(a, r)]
    return errs, errs1, bitwise


def run_ranks(world, fn, seed, backend="gloo", timeout_s=120, args=(), fail_grace_s=None):
    """Spawns `world` processes running fn(rank, world, seed, *args) in a torch.distributed group
    of `backend` over a FileStore in a fresh temporary folder (no port to collide on). gloo: one
    CPU thread per rank. nccl: rank r on cuda:r (set before init) with NCCL_NVLS_ENABLE=0 (NVLink
    multicast stays off on shared hosts). Fails with each failed rank's traceback; kills the ranks
    still running after timeout_s, or fail_grace_s after a rank failed (when given: a rank left in
    a collective by a failed peer would otherwise wait for the whole timeout)."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(prefix="moeblaze-ep-") as tmp:
        ctx = mp.get_context("spawn")
        errq = ctx.SimpleQueue()
        procs = [ctx.Process(target=_rank_entry,
                             args=(r, world, fn, seed, tuple(args), backend, tmp, errq),
                             daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        failed_at = None
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if now >= deadline:
                break
            if fail_grace_s is not None and failed_at is None and (
                    not errq.empty() or any(p.exitcode not in (None, 0) for p in procs)):
                failed_at = now
            if failed_at is not None and now >= failed_at + fail_grace_s:
                break
            alive = next((p for p in procs if p.is_alive()), None)  # all may end meanwhile
            if alive is not None:
                alive.join(0.2)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
            procs[r].join(5)
        errors = []
        while not errq.empty():
            errors.append(errq.get())
        errors.sort()
        msg = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in errors)
        why = (f"after {timeout_s} s" if failed_at is None else
               f"{fail_grace_s} s after the first failure (killed: blocked in a collective?)")
        assert not hung, f"ranks {hung} still running {why} (seed {seed}){msg}"
        codes = [p.exitcode for p in procs]
        assert not errors and all(c == 0 for c in codes), \
            f"world {world}, seed {seed} (replay: MOEBLAZE_TEST_SEED={seed}), exit codes " \
            f"{codes}:{msg}"


def _rank_entry(rank, world, fn, seed, args, backend, tmp, errq):
    try:
        import torch.distributed as dist
        kw = {}
        if backend == "nccl":
            from datetime import timedelta
            os.environ["NCCL_NVLS_ENABLE"] = "0"  # before NCCL initialises: never NVLink multicast
            torch.cuda.set_device(rank)
            # A collective that waits longer than this is reported by NCCL's watchdog (the group
            # is killed by run_ranks at its own timeout anyway).
            kw["timeout"] = timedelta(seconds=60)
        else:
            torch.set_num_threads(1)
        store = dist.FileStore(os.path.join(tmp, "store"), world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, **kw)
        try:
            fn(rank, world, seed, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise SystemExit(1)
    # The rank's work is done and checked: leave without the interpreter's teardown, where a
    # backend's still-joinable worker thread can abort the process (gloo: "terminate called
    # without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# Tests that run on both backends take `device` from DEVICES; the cuda case carries the `gpu`
# marker (skipped without a GPU) and the GPU backend's sizes (d, n multiples of 64, bf16).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def tiny_qwen3_moe(d, n, E=4, K=2, layers=2, vocab=64):
    """A tiny Hugging Face Qwen3-MoE built from its config (random init, nothing downloaded) whose
    experts run moeblaze. Needs transformers >= 5 (the caller skips without it)."""
    import transformers
    from moeblaze.integrations import hf as mb_hf
    mb_hf.register()
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=d, intermediate_size=2 * d, moe_intermediate_size=n,
        num_experts=E, num_experts_per_tok=K, norm_topk_prob=True, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=d // 4, max_position_embeddings=64,
        initializer_range=0.1)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    model.set_experts_implementation("moeblaze")
    return model
