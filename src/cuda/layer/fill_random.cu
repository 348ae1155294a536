// Device-side N(0, stddev) fills for benchmark inputs: large configs (GBs of weights) would take
// the host far longer to draw than the GPU. Each element's value depends only on (seed, index):
// a counter-based hash (splitmix64) feeds Box–Muller, so a fill is reproducible and needs no state.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/cuda_backend.hpp"
#include "cuda/gemm/dispatch/kernel_config.hpp"  // current_device_props
#include "cuda/layer/layer_cuda.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda {
namespace {

__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

template <typename T>
__device__ __forceinline__ T cast_out(float v);
template <>
__device__ __forceinline__ float cast_out<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 cast_out<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

template <typename T>
__global__ void fill_normal_kernel(T* p, int64_t count, uint64_t seed, float stddev) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const uint64_t h = splitmix64(seed * 0x2545F4914F6CDD1Dull ^ uint64_t(i));
    const float u1 = (float((h >> 40) & 0xFFFFFF) + 1.0f) * (1.0f / 16777216.0f);  // (0, 1]
    const float u2 = float((h >> 8) & 0xFFFFFF) * (1.0f / 16777216.0f);
    float v = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2) * stddev;
    T out = cast_out<T>(v);
    // Never zero: a zero input hides unwritten outputs and indexing errors.
    if (float(out) == 0.0f) out = cast_out<T>(stddev * 1e-3f);
    p[i] = out;
  }
}

}  // namespace

void fill_normal(void* data, DType dtype, int64_t count, uint64_t seed, float stddev,
                 cudaStream_t stream) {
  MOEBLAZE_REQUIRE(dtype == DType::bf16 || dtype == DType::f32, "fill_normal: dtype (",
                   dtype_name(dtype), ") must be bf16 or fp32");
  if (count == 0) return;
  const int threads = 256;
  // Grid-stride, 32 blocks per SM at most: each value depends on its index only.
  const int64_t blocks = std::min<int64_t>((count + threads - 1) / threads,
                                          gemm::current_device_props().sms * 32);
  if (dtype == DType::bf16)
    fill_normal_kernel<<<unsigned(blocks), threads, 0, stream>>>(
        static_cast<__nv_bfloat16*>(data), count, seed, stddev);
  else
    fill_normal_kernel<<<unsigned(blocks), threads, 0, stream>>>(static_cast<float*>(data),
                                                                 count, seed, stddev);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeblaze::cuda
