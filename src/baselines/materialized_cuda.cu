// The materialized MoE pipeline on the GPU (docs/DESIGN.md's "materialized" baseline), the way most
// frameworks run it: the tokens are copied into an (S, d) buffer Xs grouped by expert, the
// GEMMs read contiguous operands, the activation is a separate pass, and autograd-style saving
// keeps Xs, H, act(g), A and Y for backward; the gate-weight gradient is <dO, Y>. It runs the
// project's own grouped GEMMs (over an identity slot → row map), so a comparison with the
// moeblaze layer isolates dispatch and memory, not GEMM quality.
//
// forward   Xs = x[indices]                                      kept (S, d)
//           H  = Xs W1ᵀ          (up-proj, no fused activation)  kept (S, w1_rows)
//           act(g), A = act(g)·u (separate pass)                 kept (S, n) each (act(g) gated only)
//           Y  = A W2ᵀ                                           kept (S, d)
//           out_t = Σ s_p Y[slot]
// backward  dY = s · dO[indices], ds = <dO[t], Y>   (one pass)   workspace (S, d)
//           dA = dY W2                                           workspace (S, n)
//           dH = dact(dA; H, act(g))  (separate pass)            workspace (S, w1_rows)
//           dW2 = Σ dYᵀ A,  dXs = dH W1 (over dY's bytes),  dx_t = Σ dXs[slot],  dW1 = Σ dHᵀ Xs
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/saved_access.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/activation.cuh"
#include "cuda/layer/layer_cuda.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda {

using Saved = moeblaze::detail::SavedAccess;

namespace {

constexpr int kThreads = 256;
using bf = __nv_bfloat16;

unsigned blocks_for(int64_t work) { return unsigned((work + kThreads - 1) / kThreads); }

__global__ void iota_kernel(int32_t* v, int64_t S) {  // (S,) the identity slot → row map
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i < S) v[i] = int32_t(i);
}

// dst[r, :] = src[idx[r], :], 16-byte chunks; d % 8 == 0 (the GEMM shape rule guarantees it).
__global__ void gather_rows_kernel(const int32_t* __restrict__ idx, const uint4* __restrict__ src,
                                   uint4* __restrict__ dst, int64_t S, int64_t chunks) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= S * chunks) return;
  const int64_t r = i / chunks, c = i - r * chunks;
  dst[i] = src[int64_t(idx[r]) * chunks + c];
}

// Unfused activation: reads H (bf16, as stored), writes act(g) (gated) and A.
__global__ void activation_kernel(const bf* __restrict__ h, bf* __restrict__ act_g,
                                  bf* __restrict__ a, int64_t S, int64_t n, Activation act) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= S * n) return;
  const int64_t r = i / n, j = i - r * n;
  if (dev_is_gated(act)) {
    const float g = __bfloat162float(h[r * 2 * n + j]);
    const float u = __bfloat162float(h[r * 2 * n + n + j]);
    const bf fg = __float2bfloat16_rn(dev_act(act, g));
    act_g[i] = fg;
    a[i] = __float2bfloat16_rn(__bfloat162float(fg) * dev_up(act, u));
  } else {
    a[i] = __float2bfloat16_rn(dev_act(act, __bfloat162float(h[i])));
  }
}

// One warp per slot: ds[r] = <dO[idx[r]], Y[r]> (fp32, fixed lane order then fixed shuffle tree)
// and dY[r] = s_r dO[idx[r]].
__global__ void dy_ds_kernel(const int32_t* __restrict__ idx, const float* __restrict__ w,
                             const bf* __restrict__ dout, const bf* __restrict__ y,
                             bf* __restrict__ dy, float* __restrict__ ds, int64_t S, int64_t d) {
  const int64_t r = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (r >= S) return;
  const bf* src = dout + int64_t(idx[r]) * d;
  const float s = w[r];
  float acc = 0.0f;
  for (int64_t c = lane; c < d; c += 32) {
    const float g = __bfloat162float(src[c]);
    acc += g * __bfloat162float(y[r * d + c]);
    dy[r * d + c] = __float2bfloat16_rn(s * g);
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) ds[r] = acc;
}

// Unfused activation backward from the saved H and act(g).
__global__ void activation_backward_kernel(const bf* __restrict__ h, const bf* __restrict__ act_g,
                                           const bf* __restrict__ da, bf* __restrict__ dh,
                                           int64_t S, int64_t n, Activation act) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= S * n) return;
  const int64_t r = i / n, j = i - r * n;
  const float g_da = __bfloat162float(da[i]);
  if (dev_is_gated(act)) {
    const float g = __bfloat162float(h[r * 2 * n + j]);
    const float u = __bfloat162float(h[r * 2 * n + n + j]);
    dh[r * 2 * n + j] = __float2bfloat16_rn(g_da * dev_up(act, u) * dev_act_grad(act, g));
    dh[r * 2 * n + n + j] =
        __float2bfloat16_rn(dev_up_grad_times(act, g_da * __bfloat162float(act_g[i]), u));
  } else {
    dh[i] = __float2bfloat16_rn(g_da * dev_act_grad(act, __bfloat162float(h[i])));
  }
}

void check_launch() { MOEBLAZE_CUDA_CHECK(cudaGetLastError()); }

// The plan as the GEMMs see it for contiguous operands: slot r reads row r.
RoutingPlanView identity_view(const RoutingPlan& plan, const int32_t* iota) {
  RoutingPlanView v = plan.view();
  v.T = plan.S();
  v.expert_token_indices = iota;
  return v;
}

struct MatBackwardWs {
  int32_t* iota = nullptr;     // (S,)
  float* ds = nullptr;         // (S,) fp32 by slot
  bf16* da = nullptr;          // (S, n)
  bf16* dh = nullptr;          // (S, w1_rows)
  bf16* dy = nullptr;          // (S, d), then dXs over the same bytes (dY dead after dW2)
  size_t bytes = 0;
};
MatBackwardWs backward_ws(const LayerConfig& cfg, int64_t S, void* base) {
  Carver c(base);
  MatBackwardWs w;
  w.iota = c.take<int32_t>(S);
  w.ds = c.take<float>(S);
  w.da = c.take<bf16>(S * cfg.n);
  w.dh = c.take<bf16>(S * cfg.w1_rows());
  w.dy = c.take<bf16>(S * cfg.d);
  w.bytes = c.high_water();
  return w;
}

}  // namespace

size_t materialized_workspace_bytes(const LayerConfig& cfg, int64_t S) {
  return backward_ws(cfg, S, nullptr).bytes;  // forward's (the identity map alone) is smaller
}

void materialized_forward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                          const TensorView& w1, const TensorView& w2, const TensorView& out,
                          SavedForBackward& saved, const LayerOptions& opts) {
  check_gpu_layer_args(cfg, plan, {&x, &w1, &w2, &out}, {"x", "w1", "w2", "out"});
  const GemmOps& g = gemm_ops();
  const cudaStream_t stream = stream_of(opts);
  const int64_t S = plan.S(), d = cfg.d, n = cfg.n, R = cfg.w1_rows();
  const bool gated = is_gated(cfg.activation);

  SavedForBackward next;
  Buffer& xs = Saved::xs(next);
  Buffer& h = Saved::h(next);
  Buffer& act_g = Saved::act_g(next);
  Buffer& a = Saved::a(next);
  Buffer& y = Saved::y(next);
  xs = Buffer(Device::cuda, size_t(S * d) * 2, opts.stream);                   // (S, d)
  h = Buffer(Device::cuda, size_t(S * R) * 2, opts.stream);                    // (S, w1_rows)
  if (gated) act_g = Buffer(Device::cuda, size_t(S * n) * 2, opts.stream);     // (S, n)
  a = Buffer(Device::cuda, size_t(S * n) * 2, opts.stream);                    // (S, n)
  y = Buffer(Device::cuda, size_t(S * d) * 2, opts.stream);                    // (S, d)

  if (cfg.T > 0) {
    Buffer ws(Device::cuda, size_t(S) * sizeof(int32_t), opts.stream);  // (S,) identity map
    if (S > 0) {
      int32_t* iota = ws.as<int32_t>();
      iota_kernel<<<blocks_for(S), kThreads, 0, stream>>>(iota, S);
      check_launch();
      gather_rows_kernel<<<blocks_for(S * (d / 8)), kThreads, 0, stream>>>(
          plan.view().expert_token_indices, x.as<uint4>(), xs.as<uint4>(), S, d / 8);
      check_launch();
      const RoutingPlanView iv = identity_view(plan, iota);
      g.up_proj(iv, xs.as<bf16>(), w1.as<bf16>(), h.as<bf16>(), nullptr, d, n, cfg.activation,
                stream, /*b1=*/nullptr);
      activation_kernel<<<blocks_for(S * n), kThreads, 0, stream>>>(
          h.as<bf>(), act_g.as<bf>(), a.as<bf>(), S, n, cfg.activation);
      check_launch();
      g.down_proj(iv, a.as<bf16>(), w2.as<bf16>(), y.as<bf16>(), d, n, stream, {});
    }
    aggregate_rows(plan.view(), y.data(), plan.view().slot_weights, out.data, d, DType::bf16,
                   stream);
  }
  Saved::mark_filled(next, LayerMode::materialized, S);
  saved = std::move(next);
}

void materialized_backward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                           const TensorView& w1, const TensorView& w2, const TensorView& d_out,
                           const SavedForBackward& saved, const LayerGrads& grads,
                           const LayerOptions& opts) {
  check_gpu_layer_args(cfg, plan, {&x, &w1, &w2, &d_out, &grads.dx, &grads.dw1, &grads.dw2},
                       {"x", "w1", "w2", "d_out", "dx", "dw1", "dw2"});
  require_device(grads.d_pair_weights, "d_pair_weights", Device::cuda);
  MOEBLAZE_REQUIRE(saved.valid() && saved.mode() == LayerMode::materialized,
                   "saved: not filled by a materialized layer_forward");
  MOEBLAZE_REQUIRE(Saved::S(saved) == plan.S(), "saved holds S = ", Saved::S(saved),
                   " assignments, the plan has ", plan.S());
  const GemmOps& g = gemm_ops();
  const cudaStream_t stream = stream_of(opts);
  const int64_t S = plan.S(), d = cfg.d, n = cfg.n;
  if (S == 0) {
    if (cfg.T > 0) MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(grads.dx.data, 0, grads.dx.bytes(), stream));
    MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(grads.dw1.data, 0, grads.dw1.bytes(), stream));
    MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(grads.dw2.data, 0, grads.dw2.bytes(), stream));
    return;
  }
  Buffer ws(Device::cuda, backward_ws(cfg, S, nullptr).bytes, opts.stream);
  const MatBackwardWs w = backward_ws(cfg, S, ws.data());
  const RoutingPlanView pv = plan.view();
  iota_kernel<<<blocks_for(S), kThreads, 0, stream>>>(w.iota, S);
  check_launch();
  const RoutingPlanView iv = identity_view(plan, w.iota);

  dy_ds_kernel<<<blocks_for(S * 32), kThreads, 0, stream>>>(
      pv.expert_token_indices, pv.slot_weights, d_out.as<bf>(),
      Saved::y(saved).as<bf>(),
      reinterpret_cast<bf*>(w.dy), w.ds, S, d);
  check_launch();
  // dA = dY W2_e: the dX̃ GEMM (contiguous A, N-major B) with W2 (E, d, n) in W1's place, i.e.
  // a plain activation whose "w1_rows" is d and whose "d" is n.
  g.dx_proj(iv, w.dy, w2.as<bf16>(), w.da, n, d, Activation::relu, stream, {});
  activation_backward_kernel<<<blocks_for(S * n), kThreads, 0, stream>>>(
      Saved::h(saved).as<bf>(), Saved::act_g(saved).as<bf>(), reinterpret_cast<const bf*>(w.da),
      reinterpret_cast<bf*>(w.dh), S, n, cfg.activation);
  check_launch();
  g.dw2_proj(iv, w.dy, Saved::a(saved).as<bf16>(), grads.dw2.as<bf16>(), d, n, stream);
  bf16* dxs = w.dy;  // (S, d) dXs over dY's bytes
  g.dx_proj(iv, w.dh, w1.as<bf16>(), dxs, d, n, cfg.activation, stream, {});
  aggregate_rows(pv, dxs, nullptr, grads.dx.data, d, DType::bf16, stream);
  g.dw1_proj(iv, w.dh, Saved::xs(saved).as<bf16>(), grads.dw1.as<bf16>(), d, n, cfg.activation,
             stream);
  gather_pair_grads(pv, w.ds, grads.d_pair_weights.as<float>(), stream);
}

}  // namespace moeblaze::cuda
