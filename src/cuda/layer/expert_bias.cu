// The expert biases' share of backward (b1 (E, w1_rows) and b2 (E, d); forward adds b1 in the
// up-projection's epilogue and b2 in the aggregation):
//   ds_r   += <dO_t, b2_e>                 (y_r = W2_e a_r + b2_e)     add_bias_dots
//   db1_e   = sum over the slots r of e of dH_r                          expert_column_sums
//   db2_e   = sum over the slots r of e of s_r dO_t                      expert_column_sums
// Fixed summation orders (no atomics), fp32 accumulation: deterministic, like every other kernel
// of the layer. Each is one pass over an (S, ·) operand the backward reads anyway.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_backend.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda {
namespace {

constexpr int kWarps = 8;  // per block, both kernels

// The expert owning slot r: the largest e with offsets[e] <= r (empty experts skipped).
__device__ __forceinline__ int slot_expert(const int32_t* __restrict__ offsets, int E, int64_t r) {
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= r) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// One warp per slot: lanes take column pairs 2 lane, 2 lane + 64, ... and a fixed butterfly adds
// the 32 lane sums. d_out (T, d), b2 (E, d) bf16 (d even); ds (S,) fp32.
__global__ void __launch_bounds__(32 * kWarps)
    bias_dots_kernel(const int32_t* __restrict__ offsets, const int32_t* __restrict__ tokens,
                     int E, int64_t S, const __nv_bfloat162* __restrict__ d_out,
                     const __nv_bfloat162* __restrict__ b2, float* __restrict__ ds, int64_t d) {
  const int64_t r = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (r >= S) return;
  const int lane = threadIdx.x % 32;
  const int64_t pairs = d / 2;
  const __nv_bfloat162* o = d_out + int64_t(tokens[r]) * pairs;
  const __nv_bfloat162* b = b2 + int64_t(slot_expert(offsets, E, r)) * pairs;
  float acc = 0.0f;
  for (int64_t c = lane; c < pairs; c += 32) {
    const float2 ov = __bfloat1622float2(o[c]), bv = __bfloat1622float2(b[c]);
    acc = fmaf(ov.x, bv.x, acc);
    acc = fmaf(ov.y, bv.y, acc);
  }
#pragma unroll
  for (int m = 16; m > 0; m /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, m);
  if (lane == 0) ds[r] += acc;
}

// Block (expert e = blockIdx.x, 64 columns from 64 blockIdx.y): lane l owns columns 2 l, 2 l + 1
// of the block, warp w the slots begin + w, begin + w + 8, ... in order; the 8 warp sums are then
// added in warp order. rows (*, cols), out (E, cols) bf16, cols even.
__global__ void __launch_bounds__(32 * kWarps)
    column_sums_kernel(const int32_t* __restrict__ offsets, const int32_t* __restrict__ tokens,
                       const float* __restrict__ weights, const __nv_bfloat162* __restrict__ rows,
                       __nv_bfloat162* __restrict__ out, int64_t cols) {
  __shared__ float2 part[kWarps][32];
  const int e = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t pairs = cols / 2;
  const int64_t c = int64_t(blockIdx.y) * 32 + lane;  // this lane's column pair
  float2 acc = make_float2(0.0f, 0.0f);
  if (c < pairs) {
    const int64_t end = offsets[e + 1];
#pragma unroll 4
    for (int64_t r = offsets[e] + warp; r < end; r += kWarps) {
      const int64_t row = tokens ? int64_t(tokens[r]) : r;
      const float w = weights ? weights[r] : 1.0f;
      const float2 v = __bfloat1622float2(rows[row * pairs + c]);
      acc.x = fmaf(w, v.x, acc.x);
      acc.y = fmaf(w, v.y, acc.y);
    }
  }
  part[warp][lane] = acc;
  __syncthreads();
  if (warp == 0 && c < pairs) {
    float2 s = part[0][lane];
#pragma unroll
    for (int k = 1; k < kWarps; ++k) {
      s.x += part[k][lane].x;
      s.y += part[k][lane].y;
    }
    out[int64_t(e) * pairs + c] = __floats2bfloat162_rn(s.x, s.y);
  }
}

}  // namespace

void add_bias_dots(const RoutingPlanView& plan, const void* d_out, const void* b2, float* ds,
                   int64_t d, cudaStream_t stream) {
  MOEBLAZE_REQUIRE(d >= 2 && d % 2 == 0, "add_bias_dots: d (", d, ") must be even");
  if (plan.S == 0) return;
  const int64_t blocks = (plan.S + kWarps - 1) / kWarps;
  MOEBLAZE_UNSUPPORTED_IF(blocks > int64_t(INT32_MAX), "add_bias_dots: S (", plan.S,
                          ") is too large for one launch");
  bias_dots_kernel<<<unsigned(blocks), 32 * kWarps, 0, stream>>>(
      plan.expert_token_offsets, plan.expert_token_indices, static_cast<int>(plan.E), plan.S,
      static_cast<const __nv_bfloat162*>(d_out), static_cast<const __nv_bfloat162*>(b2), ds, d);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

void expert_column_sums(const RoutingPlanView& plan, const void* rows, bool gathered,
                        bool weighted, void* out, int64_t cols, cudaStream_t stream) {
  MOEBLAZE_REQUIRE(cols >= 2 && cols % 2 == 0, "expert_column_sums: cols (", cols,
                   ") must be even");
  MOEBLAZE_UNSUPPORTED_IF(plan.E > int64_t(INT32_MAX) || cols / 64 + 1 > 65535,
                          "expert_column_sums: E (", plan.E, ") or cols (", cols,
                          ") is too large for one launch");
  if (plan.E == 0) return;
  const dim3 grid(unsigned(plan.E), unsigned((cols / 2 + 31) / 32));
  column_sums_kernel<<<grid, 32 * kWarps, 0, stream>>>(
      plan.expert_token_offsets, gathered ? plan.expert_token_indices : nullptr,
      weighted ? plan.slot_weights : nullptr, static_cast<const __nv_bfloat162*>(rows),
      static_cast<__nv_bfloat162*>(out), cols);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeblaze::cuda
