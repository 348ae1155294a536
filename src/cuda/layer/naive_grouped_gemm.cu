// The naive grouped GEMM (see naive_grouped_gemm.hpp): correctness only, no tiling.
#include "cuda/layer/naive_grouped_gemm.hpp"

#include <cuda_bf16.h>

#include "cuda/cuda_backend.hpp"
#include "cuda/activation.cuh"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda::naive {
namespace {

constexpr int kThreads = 128;  // also the ds tile width: one block = one 128-column tile of a row

using bf = __nv_bfloat16;
__device__ __forceinline__ float ld(const bf16* p, int64_t i) {
  return __bfloat162float(reinterpret_cast<const bf*>(p)[i]);
}
__device__ __forceinline__ void st(bf16* p, int64_t i, float v) {
  reinterpret_cast<bf*>(p)[i] = __float2bfloat16_rn(v);
}

// Expert owning slot r: the e with off[e] <= r < off[e+1] (largest such e: empty experts skipped).
__device__ __forceinline__ int expert_of(const int32_t* off, int E, int64_t r) {
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (off[mid] <= r) lo = mid; else hi = mid - 1;
  }
  return lo;
}

unsigned blocks_for(int64_t work) { return unsigned((work + kThreads - 1) / kThreads); }

// grid (S, ceil(n/128)): thread = (slot r, column j of n). Slots on x: y is limited to 65535.
__global__ void up_kernel(RoutingPlanView p, const bf16* x, const bf16* w1, const bf16* b1,
                          bf16* h, bf16* a, int64_t d, int64_t n, Activation act) {
  const int64_t r = blockIdx.x;
  const int64_t j = int64_t(blockIdx.y) * kThreads + threadIdx.x;
  if (j >= n) return;
  const int e = expert_of(p.expert_token_offsets, int(p.E), r);
  const int64_t t = p.expert_token_indices[r];
  const bool gated = dev_is_gated(act);
  const int64_t rows = gated ? 2 * n : n;
  const bf16* xr = x + t * d;
  const bf16* wg = w1 + (int64_t(e) * rows + j) * d;
  float g = 0.0f, u = 0.0f;
  for (int64_t k = 0; k < d; ++k) g += ld(xr, k) * ld(wg, k);
  if (gated) {
    const bf16* wu = w1 + (int64_t(e) * rows + n + j) * d;
    for (int64_t k = 0; k < d; ++k) u += ld(xr, k) * ld(wu, k);
  }
  if (b1) {
    g += ld(b1, int64_t(e) * rows + j);
    if (gated) u += ld(b1, int64_t(e) * rows + n + j);
  }
  if (h) {
    st(h, r * rows + j, g);
    if (gated) st(h, r * rows + n + j, u);
  }
  if (a) st(a, r * n + j, gated ? dev_act(act, g) * dev_up(act, u) : dev_act(act, g));
}

// grid (S, ceil(d/128))
__global__ void down_kernel(RoutingPlanView p, const bf16* a, const bf16* w2, bf16* y, int64_t d,
                            int64_t n) {
  const int64_t r = blockIdx.x;
  const int64_t i = int64_t(blockIdx.y) * kThreads + threadIdx.x;
  if (i >= d) return;
  const int e = expert_of(p.expert_token_offsets, int(p.E), r);
  const bf16* wr = w2 + (int64_t(e) * d + i) * n;
  float acc = 0.0f;
  for (int64_t k = 0; k < n; ++k) acc += ld(a, r * n + k) * ld(wr, k);
  st(y, r * d + i, acc);
}

// grid (S, ceil(n/128)): one block = one 128-column ds tile of one slot.
__global__ void dh_kernel(RoutingPlanView p, const bf16* dout, const bf16* w2, const bf16* h,
                          float* ds_partials, bf16* dh, bf16* a_scaled, int64_t d, int64_t n,
                          Activation act, int64_t cols) {
  __shared__ float prod[kThreads];
  const int64_t r = blockIdx.x;
  const int64_t c = int64_t(blockIdx.y) * kThreads + threadIdx.x;
  const int e = expert_of(p.expert_token_offsets, int(p.E), r);
  const int64_t t = p.expert_token_indices[r];
  const bool gated = dev_is_gated(act);
  const int64_t rows = gated ? 2 * n : n;
  float pr = 0.0f;
  if (c < n) {
    float dap = 0.0f;  // da'[c] = sum_i dO[t, i] W2_e[i, c]
    for (int64_t i = 0; i < d; ++i) dap += ld(dout, t * d + i) * ld(w2, (int64_t(e) * d + i) * n + c);
    const float s = p.slot_weights[r];
    const float da = s * dap;
    if (gated) {
      const float g = ld(h, r * rows + c), u = ld(h, r * rows + n + c);
      const float fa = dev_act(act, g);
      const float pu = dev_up(act, u);
      const float av = fa * pu;
      pr = dap * av;
      st(dh, r * rows + c, da * pu * dev_act_grad(act, g));
      st(dh, r * rows + n + c, dev_up_grad_times(act, da * fa, u));
      st(a_scaled, r * n + c, s * av);
    } else {
      const float hv = ld(h, r * rows + c);
      const float av = dev_act(act, hv);
      pr = dap * av;
      st(dh, r * rows + c, da * dev_act_grad(act, hv));
      st(a_scaled, r * n + c, s * av);
    }
  }
  prod[threadIdx.x] = pr;
  __syncthreads();
  if (threadIdx.x == 0) {
    float acc = 0.0f;
    for (int k = 0; k < kThreads; ++k) acc += prod[k];  // fixed order
    ds_partials[r * cols + blockIdx.y] = acc;
  }
}

__global__ void reduce_ds_kernel(const float* part, float* ds, int64_t S, int64_t cols) {
  const int64_t r = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (r >= S) return;
  float acc = 0.0f;
  for (int64_t j = 0; j < cols; ++j) acc += part[r * cols + j];
  ds[r] = acc;
}

// grid (ceil(n/128), d, E): dw2[e, i, c] = sum_r dO[tok(r), i] * a_scaled[r, c]
__global__ void dw2_kernel(RoutingPlanView p, const bf16* dout, const bf16* as, bf16* dw2,
                           int64_t d, int64_t n) {
  const int64_t c = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t i = blockIdx.y;
  const int64_t e = blockIdx.z;
  if (c >= n) return;
  float acc = 0.0f;
  for (int64_t r = p.expert_token_offsets[e]; r < p.expert_token_offsets[e + 1]; ++r)
    acc += ld(dout, int64_t(p.expert_token_indices[r]) * d + i) * ld(as, r * n + c);
  st(dw2, (e * d + i) * n + c, acc);
}

// grid (S, ceil(d/128)): dx_slots[r, i] = sum_k dh[r, k] W1_e[k, i]
__global__ void dx_kernel(RoutingPlanView p, const bf16* dh, const bf16* w1, bf16* dxs, int64_t d,
                          int64_t rows) {
  const int64_t r = blockIdx.x;
  const int64_t i = int64_t(blockIdx.y) * kThreads + threadIdx.x;
  if (i >= d) return;
  const int e = expert_of(p.expert_token_offsets, int(p.E), r);
  float acc = 0.0f;
  for (int64_t k = 0; k < rows; ++k) acc += ld(dh, r * rows + k) * ld(w1, (int64_t(e) * rows + k) * d + i);
  st(dxs, r * d + i, acc);
}

// grid (ceil(d/128), rows, E): dw1[e, k, i] = sum_r dh[r, k] x[tok(r), i]
__global__ void dw1_kernel(RoutingPlanView p, const bf16* dh, const bf16* x, bf16* dw1, int64_t d,
                           int64_t rows) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t k = blockIdx.y;
  const int64_t e = blockIdx.z;
  if (i >= d) return;
  float acc = 0.0f;
  for (int64_t r = p.expert_token_offsets[e]; r < p.expert_token_offsets[e + 1]; ++r)
    acc += ld(dh, r * rows + k) * ld(x, int64_t(p.expert_token_indices[r]) * d + i);
  st(dw1, (e * rows + k) * d + i, acc);
}

void require_grid(int64_t S, int64_t y_dim) {
  MOEBLAZE_UNSUPPORTED_IF(S > 65535 * 1024LL || y_dim > 65535, "naive grouped GEMM: grid too large");
}

}  // namespace

int64_t ds_partials_cols(int64_t n) { return (n + kThreads - 1) / kThreads; }

void up_proj(const RoutingPlanView& p, const bf16* x, const bf16* w1, bf16* h, bf16* a, int64_t d,
             int64_t n, Activation act, cudaStream_t stream, const bf16* b1) {
  MOEBLAZE_REQUIRE(h || a, "up_proj: h and a are both null");
  if (p.S == 0) return;
  up_kernel<<<dim3(unsigned(p.S), blocks_for(n)), kThreads, 0, stream>>>(p, x, w1, b1, h, a, d, n,
                                                                        act);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

void down_proj(const RoutingPlanView& p, const bf16* a, const bf16* w2, bf16* y, int64_t d,
               int64_t n, cudaStream_t stream) {
  if (p.S == 0) return;
  down_kernel<<<dim3(unsigned(p.S), blocks_for(d)), kThreads, 0, stream>>>(p, a, w2, y, d, n);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

void dh_proj(const RoutingPlanView& p, const bf16* d_out, const bf16* w2, const bf16* h,
             float* ds_partials, bf16* dh, bf16* a_scaled, int64_t d, int64_t n, Activation act,
             cudaStream_t stream) {
  if (p.S == 0) return;
  dh_kernel<<<dim3(unsigned(p.S), blocks_for(n)), kThreads, 0, stream>>>(
      p, d_out, w2, h, ds_partials, dh, a_scaled, d, n, act, ds_partials_cols(n));
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

void reduce_ds(const float* ds_partials, float* ds, int64_t S, int64_t n, cudaStream_t stream) {
  if (S == 0) return;
  reduce_ds_kernel<<<blocks_for(S), kThreads, 0, stream>>>(ds_partials, ds, S, ds_partials_cols(n));
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

void dw2_proj(const RoutingPlanView& p, const bf16* d_out, const bf16* a_scaled, bf16* dw2,
              int64_t d, int64_t n, cudaStream_t stream) {
  require_grid(0, d);
  dw2_kernel<<<dim3(blocks_for(n), unsigned(d), unsigned(p.E)), kThreads, 0, stream>>>(
      p, d_out, a_scaled, dw2, d, n);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

void dx_proj(const RoutingPlanView& p, const bf16* dh, const bf16* w1, bf16* dx_slots, int64_t d,
             int64_t n, Activation act, cudaStream_t stream) {
  if (p.S == 0) return;
  dx_kernel<<<dim3(unsigned(p.S), blocks_for(d)), kThreads, 0, stream>>>(
      p, dh, w1, dx_slots, d, is_gated(act) ? 2 * n : n);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

void dw1_proj(const RoutingPlanView& p, const bf16* dh, const bf16* x, bf16* dw1, int64_t d,
              int64_t n, Activation act, cudaStream_t stream) {
  const int64_t rows = is_gated(act) ? 2 * n : n;
  require_grid(0, rows);
  dw1_kernel<<<dim3(blocks_for(d), unsigned(rows), unsigned(p.E)), kThreads, 0, stream>>>(
      p, dh, x, dw1, d, rows);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeblaze::cuda::naive
