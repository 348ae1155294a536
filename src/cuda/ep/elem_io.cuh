// Element reads and writes of the expert-parallel row kernels, for either dtype the layer stores
// (bf16, fp32): read as fp32, store rounded to nearest. Shared by combine_rows.cu and
// accumulate_f32.cu.
#pragma once

#include <cuda_bf16.h>

namespace moeblaze::cuda::ep {

__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }

}  // namespace moeblaze::cuda::ep
