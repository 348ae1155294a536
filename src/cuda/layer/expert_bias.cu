// The expert biases' share of backward (b1 (E, w1_rows) and b2 (E, d); forward adds b1 in the
// up-projection's epilogue and b2 in the aggregation):
//   ds_r   += <dO_t, b2_e>                 (y_r = W2_e a_r + b2_e)  \  bias2_backward: one
//   db2_e   = sum over the slots r of e of s_r dO_t                   /  pass over gathered dO
//   db1_e   = sum over the slots r of e of dH_r                          expert_column_sums
// Fixed summation orders (no atomics), fp32 accumulation: deterministic, like every other kernel
// of the layer.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_backend.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda {
namespace {

constexpr int kWarps = 8;  // per block, both kernels

// Block (expert e = blockIdx.x, columns [512 c, 512 c + 512) for c = blockIdx.y): lane l owns
// the 8-column groups l and l + 32 of the block, warp w the slots begin + w, begin + w + 8, ...
// in order. Per slot the warp adds s_r dO_t to its db2 accumulators and writes
// part[r, c] = <dO_t, b2_e> over the block's columns (a fixed butterfly over the lanes); the 8
// warps' db2 sums are then added in warp order. d_out (T, d), b2 and db2 (E, d) bf16, d a
// multiple of 8; part (S, ceil(d / 512)) fp32.
constexpr int kBias2Cols = 512;
__global__ void __launch_bounds__(32 * kWarps)
    bias2_kernel(const int32_t* __restrict__ offsets, const int32_t* __restrict__ tokens,
                 const float* __restrict__ weights, const __nv_bfloat16* __restrict__ d_out,
                 const __nv_bfloat16* __restrict__ b2, __nv_bfloat16* __restrict__ db2,
                 float* __restrict__ part, int64_t d) {
  __shared__ float sums[kWarps][kBias2Cols];
  const int e = blockIdx.x, c = blockIdx.y, chunks = gridDim.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int64_t col[2];
  bool ok[2];
  float bias[2][8], acc[2][8];
#pragma unroll
  for (int g = 0; g < 2; ++g) {
    col[g] = int64_t(c) * kBias2Cols + 8 * (lane + 32 * g);
    ok[g] = col[g] < d;
    const uint4 raw = ok[g] ? __ldg(reinterpret_cast<const uint4*>(b2 + int64_t(e) * d + col[g]))
                            : make_uint4(0, 0, 0, 0);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 v = __bfloat1622float2(h[k]);
      bias[g][2 * k] = v.x;
      bias[g][2 * k + 1] = v.y;
      acc[g][2 * k] = acc[g][2 * k + 1] = 0.0f;
    }
  }
  const int64_t end = offsets[e + 1];
  for (int64_t r = offsets[e] + warp; r < end; r += kWarps) {
    const __nv_bfloat16* row = d_out + int64_t(tokens[r]) * d;
    const float s = weights[r];
    float dot = 0.0f;
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      const uint4 raw =
          ok[g] ? __ldg(reinterpret_cast<const uint4*>(row + col[g])) : make_uint4(0, 0, 0, 0);
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 v = __bfloat1622float2(h[k]);
        dot = fmaf(v.x, bias[g][2 * k], dot);
        dot = fmaf(v.y, bias[g][2 * k + 1], dot);
        acc[g][2 * k] = fmaf(s, v.x, acc[g][2 * k]);
        acc[g][2 * k + 1] = fmaf(s, v.y, acc[g][2 * k + 1]);
      }
    }
#pragma unroll
    for (int m = 16; m > 0; m /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, m);
    if (lane == 0) part[r * chunks + c] = dot;
  }
#pragma unroll
  for (int g = 0; g < 2; ++g)
#pragma unroll
    for (int k = 0; k < 8; ++k) sums[warp][8 * (lane + 32 * g) + k] = acc[g][k];
  __syncthreads();
  for (int i = threadIdx.x; i < kBias2Cols / 2; i += blockDim.x) {  // a column pair per thread
    const int64_t at = int64_t(c) * kBias2Cols + 2 * i;
    if (at >= d) continue;
    float x = sums[0][2 * i], y = sums[0][2 * i + 1];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      x += sums[w][2 * i];
      y += sums[w][2 * i + 1];
    }
    *reinterpret_cast<__nv_bfloat162*>(db2 + int64_t(e) * d + at) = __floats2bfloat162_rn(x, y);
  }
}

// ds[r] += sum over c, in order, of part[r, c].
__global__ void add_parts_kernel(const float* __restrict__ part, int chunks, float* __restrict__ ds,
                                 int64_t S) {
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= S) return;
  float sum = 0.0f;
  for (int c = 0; c < chunks; ++c) sum += part[r * chunks + c];
  ds[r] += sum;
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

int64_t bias2_scratch_floats(int64_t S, int64_t d) {
  return S * ((d + kBias2Cols - 1) / kBias2Cols);
}

void bias2_backward(const RoutingPlanView& plan, const void* d_out, const void* b2, float* scratch,
                    float* ds, void* db2, int64_t d, cudaStream_t stream) {
  MOEBLAZE_REQUIRE(d >= 8 && d % 8 == 0, "bias2_backward: d (", d, ") must be a multiple of 8");
  if (plan.E == 0) return;
  const int64_t chunks = (d + kBias2Cols - 1) / kBias2Cols;
  MOEBLAZE_UNSUPPORTED_IF(plan.E > int64_t(INT32_MAX) || chunks > 65535,
                          "bias2_backward: E (", plan.E, ") or d (", d,
                          ") is too large for one launch");
  bias2_kernel<<<dim3(unsigned(plan.E), unsigned(chunks)), 32 * kWarps, 0, stream>>>(
      plan.expert_token_offsets, plan.expert_token_indices, plan.slot_weights,
      static_cast<const __nv_bfloat16*>(d_out), static_cast<const __nv_bfloat16*>(b2),
      static_cast<__nv_bfloat16*>(db2), scratch, d);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
  if (plan.S == 0) return;
  add_parts_kernel<<<unsigned((plan.S + 255) / 256), 256, 0, stream>>>(scratch, int(chunks), ds,
                                                                      plan.S);
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
