// Benchmark inputs generated on the device (the benchmark's largest shapes have 4G logits and
// 64M pairs; generating them on the host would dominate the run): N(0, 1) logits from a
// counter-based hash, and a skewed top-K routing in which a fraction of the experts receives
// most of the pairs. Deterministic for a seed; never zeros.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/cuda_backend.hpp"
#include "cuda/gemm/dispatch/kernel_config.hpp"  // current_device_props
#include "cuda/routing/bench_data.hpp"

namespace moeblaze::cuda {
namespace {

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform in (0, 1]: never 0, so log() below is finite.
__device__ __forceinline__ float uniform01(uint64_t h) {
  return (float((h >> 40) & 0xFFFFFF) + 1.0f) * (1.0f / 16777216.0f);
}

template <typename OutT>
__device__ __forceinline__ OutT to_out(float v);
template <>
__device__ __forceinline__ float to_out<float>(float v) { return v; }
template <>
__device__ __forceinline__ uint16_t to_out<uint16_t>(float v) {
  // Round to nearest even, as the host's bf16 does (values are finite here).
  const uint32_t u = __float_as_uint(v);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

template <typename OutT>
__global__ void normal_kernel(OutT* __restrict__ out, int64_t n, uint64_t seed) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint64_t h1 = mix64(seed ^ mix64(uint64_t(i))), h2 = mix64(h1);
    // Box-Muller; a value that would round to exactly 0 is nudged (tests never see zeros).
    float v = sqrtf(-2.0f * logf(uniform01(h1))) * cospif(2.0f * uniform01(h2));
    if (v == 0.0f) v = 1e-3f;
    out[i] = to_out<OutT>(v);
  }
}

// Thread per token: K distinct experts; each pick is from the hot experts [0, hot) with
// probability hot_share, else uniform over the others, retried until new to the token.
__global__ void skewed_topk_kernel(int64_t T, int E, int K, int hot, float hot_share,
                                   uint64_t seed, int32_t* __restrict__ offsets,
                                   int32_t* __restrict__ experts, float* __restrict__ weights) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t == 0) offsets[0] = 0;
  if (t >= T) return;
  int32_t* ids = experts + t * K;
  for (int k = 0; k < K; ++k) {
    int e = -1;
    for (uint64_t attempt = 0; e < 0; ++attempt) {
      const uint64_t h = mix64(seed ^ mix64((uint64_t(t) * 64 + uint64_t(k)) * 1024 + attempt));
      int c;
      if (attempt < 64) {
        const bool pick_hot = hot >= E || uniform01(h) <= hot_share;
        c = pick_hot ? int((h & 0xFFFFFFFFull) % uint64_t(hot))
                     : hot + int((h & 0xFFFFFFFFull) % uint64_t(E - hot));
      } else {
        c = int((attempt - 64) % uint64_t(E));  // a deterministic sweep: always terminates
      }
      bool fresh = true;
      for (int j = 0; j < k; ++j) fresh &= ids[j] != c;
      if (fresh) e = c;
    }
    ids[k] = e;
    weights[t * K + k] = uniform01(mix64(seed + uint64_t(t * K + k)));
  }
  offsets[t + 1] = int32_t((t + 1) * K);
}

}  // namespace

void fill_normal(void* dst, DType dtype, int64_t n, uint64_t seed, cudaStream_t stream) {
  // Grid-stride: 32 blocks per SM at most (the values depend on the index only, not the grid).
  const int grid = int(std::min<int64_t>(gemm::current_device_props().sms * 32,
                                         std::max<int64_t>(1, (n + 255) / 256)));
  if (dtype == DType::bf16)
    normal_kernel<uint16_t><<<grid, 256, 0, stream>>>(static_cast<uint16_t*>(dst), n, seed);
  else
    normal_kernel<float><<<grid, 256, 0, stream>>>(static_cast<float*>(dst), n, seed);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

void fill_skewed_topk(Routing& r, int K, double hot_fraction, double hot_share, uint64_t seed,
                      cudaStream_t stream) {
  const int E = int(r.E());
  const int hot = std::max(1, std::min(E, int(hot_fraction * E + 0.5)));
  const int64_t T = r.T();
  skewed_topk_kernel<<<int(std::max<int64_t>(1, (T + 255) / 256)), 256, 0, stream>>>(
      T, E, K, hot, float(hot_share), seed, r.pair_offsets(), r.pair_experts(), r.pair_weights());
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeblaze::cuda
