// The dense upper bound of the MoE layer (docs/DESIGN.md's "dense-bound" baseline): every expert
// gets exactly m = S / E tokens, stored contiguously, so each GEMM of forward and backward is one
// cuBLAS strided-batched bf16 GEMM (fp32 compute) over the E experts. Same FLOPs as the layer
// (forward 2 GEMMs + activation, backward 4 GEMMs + activation backward), none of the routing,
// gather or aggregation: what any grouped GEMM could at best reach on this GPU.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <string>

#include "cuda/cuda_backend.hpp"
#include "cuda/activation.cuh"
#include "cuda/layer/layer_cuda.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda {
namespace {

using bf = __nv_bfloat16;
constexpr int kThreads = 256;

void check_cublas(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS)
    throw DeviceError(std::string(what) + " failed: cuBLAS status " + std::to_string(int(st)));
}

__global__ void act_kernel(const bf* __restrict__ h, bf* __restrict__ a, int64_t rows, int64_t n,
                           Activation act) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= rows * n) return;
  const int64_t r = i / n, j = i - r * n;
  if (dev_is_gated(act)) {
    const float g = __bfloat162float(h[r * 2 * n + j]), u = __bfloat162float(h[r * 2 * n + n + j]);
    a[i] = __float2bfloat16_rn(dev_act(act, g) * dev_up(act, u));
  } else {
    a[i] = __float2bfloat16_rn(dev_act(act, __bfloat162float(h[i])));
  }
}

__global__ void dact_kernel(const bf* __restrict__ h, const bf* __restrict__ da,
                            bf* __restrict__ dh, int64_t rows, int64_t n, Activation act) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= rows * n) return;
  const int64_t r = i / n, j = i - r * n;
  const float g_da = __bfloat162float(da[i]);
  if (dev_is_gated(act)) {
    const float g = __bfloat162float(h[r * 2 * n + j]), u = __bfloat162float(h[r * 2 * n + n + j]);
    dh[r * 2 * n + j] = __float2bfloat16_rn(g_da * dev_up(act, u) * dev_act_grad(act, g));
    dh[r * 2 * n + n + j] = __float2bfloat16_rn(dev_up_grad_times(act, g_da * dev_act(act, g), u));
  } else {
    dh[i] = __float2bfloat16_rn(g_da * dev_act_grad(act, __bfloat162float(h[i])));
  }
}

}  // namespace

struct DenseBound::Impl {
  LayerConfig cfg;
  int64_t m = 0;  // tokens per expert
  cudaStream_t stream = nullptr;
  cublasHandle_t handle = nullptr;
  // Inputs (E*m, d) x, dY; weights (E, R, d), (E, d, n); gradients of the weights.
  Buffer x, w1, w2, dy, dw1, dw2;
  // Intermediates: H (E*m, R), A (E*m, n), Y (E*m, d), dA (E*m, n), dH (E*m, R), dX (E*m, d).
  Buffer h, a, y, da, dh, dx;

  // Row-major, per expert e: C_e (M, N) = op(A_e) op(B_e), op(A) (M, K), op(B) (K, N); A_e stored
  // (M, K) or, if ta, (K, M); likewise B_e. Column-major cuBLAS computes Cᵀ = op(B)ᵀ op(A)ᵀ.
  void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const void* A, int64_t sA,
            const void* B, int64_t sB, void* C, int64_t sC) {
    const float alpha = 1.0f, beta = 0.0f;
    const int64_t lda = ta ? M : K, ldb = tb ? K : N;
    check_cublas(cublasGemmStridedBatchedEx(
                     handle, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                     int(N), int(M), int(K), &alpha, B, CUDA_R_16BF, int(ldb), sB, A, CUDA_R_16BF,
                     int(lda), sA, &beta, C, CUDA_R_16BF, int(N), sC, int(cfg.E),
                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "cublasGemmStridedBatchedEx");
  }
};

DenseBound::DenseBound(const LayerConfig& cfg, int64_t S, uint64_t seed, cudaStream_t stream)
    : impl_(new Impl) {
  Impl& s = *impl_;
  s.cfg = cfg;
  s.m = S / cfg.E;
  MOEBLAZE_REQUIRE(s.m >= 1, "dense bound: S (", S, ") gives no token per expert (E = ", cfg.E, ")");
  s.stream = stream;
  const int64_t rows = cfg.E * s.m, R = cfg.w1_rows(), d = cfg.d, n = cfg.n, E = cfg.E;
  auto alloc = [](Buffer& b, int64_t elems) { b = Buffer(Device::cuda, size_t(elems) * 2); };
  alloc(s.x, rows * d);
  alloc(s.dy, rows * d);
  alloc(s.w1, E * R * d);
  alloc(s.w2, E * d * n);
  alloc(s.dw1, E * R * d);
  alloc(s.dw2, E * d * n);
  alloc(s.h, rows * R);
  alloc(s.a, rows * n);
  alloc(s.y, rows * d);
  alloc(s.da, rows * n);
  alloc(s.dh, rows * R);
  alloc(s.dx, rows * d);
  fill_normal(s.x.data(), DType::bf16, rows * d, seed, 1.0f, stream);
  fill_normal(s.dy.data(), DType::bf16, rows * d, seed + 1, 1.0f, stream);
  fill_normal(s.w1.data(), DType::bf16, E * R * d, seed + 2, 1.0f / std::sqrt(float(d)), stream);
  fill_normal(s.w2.data(), DType::bf16, E * d * n, seed + 3, 1.0f / std::sqrt(float(n)), stream);
  check_cublas(cublasCreate(&s.handle), "cublasCreate");
  check_cublas(cublasSetStream(s.handle, stream), "cublasSetStream");
}

DenseBound::~DenseBound() {
  if (impl_->handle) cublasDestroy(impl_->handle);
  delete impl_;
}

int64_t DenseBound::tokens_per_expert() const { return impl_->m; }
size_t DenseBound::kept_bytes() const { return impl_->h.bytes() + impl_->a.bytes(); }
size_t DenseBound::transient_bytes() const {
  const Impl& s = *impl_;
  return s.h.bytes() + s.a.bytes() + s.y.bytes() + s.da.bytes() + s.dh.bytes() + s.dx.bytes();
}

void DenseBound::forward() {
  Impl& s = *impl_;
  const int64_t m = s.m, d = s.cfg.d, n = s.cfg.n, R = s.cfg.w1_rows();
  // H = X W1ᵀ; A = act(H); Y = A W2ᵀ
  s.gemm(false, true, m, R, d, s.x.data(), m * d, s.w1.data(), R * d, s.h.data(), m * R);
  const int64_t rows = s.cfg.E * m;
  act_kernel<<<unsigned((rows * n + kThreads - 1) / kThreads), kThreads, 0, s.stream>>>(
      s.h.as<bf>(), s.a.as<bf>(), rows, n, s.cfg.activation);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
  s.gemm(false, true, m, d, n, s.a.data(), m * n, s.w2.data(), d * n, s.y.data(), m * d);
}

void DenseBound::backward() {
  Impl& s = *impl_;
  const int64_t m = s.m, d = s.cfg.d, n = s.cfg.n, R = s.cfg.w1_rows();
  const int64_t rows = s.cfg.E * m;
  // dA = dY W2; dH = dact(dA; H); dW2 = dYᵀ A; dX = dH W1; dW1 = dHᵀ X
  s.gemm(false, false, m, n, d, s.dy.data(), m * d, s.w2.data(), d * n, s.da.data(), m * n);
  dact_kernel<<<unsigned((rows * n + kThreads - 1) / kThreads), kThreads, 0, s.stream>>>(
      s.h.as<bf>(), s.da.as<bf>(), s.dh.as<bf>(), rows, n, s.cfg.activation);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
  s.gemm(true, false, d, n, m, s.dy.data(), m * d, s.a.data(), m * n, s.dw2.data(), d * n);
  s.gemm(false, false, m, d, R, s.dh.data(), m * R, s.w1.data(), R * d, s.dx.data(), m * d);
  s.gemm(true, false, R, d, m, s.dh.data(), m * R, s.x.data(), m * d, s.dw1.data(), R * d);
}

}  // namespace moeblaze::cuda
