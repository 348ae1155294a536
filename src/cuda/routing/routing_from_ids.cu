// A fixed-K routing from the ids and weights a framework holds ((T, K) int32/int64 ids, (T, K)
// fp32/bf16 weights), in one pass, so a front end needs no conversion launches of its own.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/cuda_backend.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda {
namespace {

template <typename Id, typename W>
__global__ void routing_from_ids_kernel(const Id* __restrict__ ids,      // (T, K)
                                        const W* __restrict__ weights,   // (T, K)
                                        int64_t T, int64_t K, int64_t E,
                                        int32_t* __restrict__ offsets,   // (T+1,)
                                        int32_t* __restrict__ experts,   // (P,) P = T*K
                                        float* __restrict__ out_weights) {  // (P,)
  const int64_t P = T * K, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i <= P; i += stride) {
    if (i < P) {
      const int64_t e = static_cast<int64_t>(ids[i]);
      // E stands for every bad id: 2^32 + 1 must not become expert 1 (the plan build flags E).
      experts[i] = (e < 0 || e >= E) ? static_cast<int32_t>(E) : static_cast<int32_t>(e);
      out_weights[i] = static_cast<float>(weights[i]);
    }
    if (i % K == 0) offsets[i / K] = static_cast<int32_t>(i);
  }
}

template <typename Id>
void launch(const void* ids, const void* weights, DType weights_dtype, int64_t T, int64_t K,
            int64_t E, const FixedKRouting& out, cudaStream_t stream) {
  const int threads = 256;
  const int64_t P = T * K;
  const int grid = int(std::max<int64_t>(1, std::min<int64_t>((P + threads) / threads, 4096)));
  const Id* id = static_cast<const Id*>(ids);
  if (weights_dtype == DType::bf16)
    routing_from_ids_kernel<<<grid, threads, 0, stream>>>(
        id, static_cast<const __nv_bfloat16*>(weights), T, K, E, out.pair_offsets,
        out.pair_experts, out.pair_weights);
  else
    routing_from_ids_kernel<<<grid, threads, 0, stream>>>(
        id, static_cast<const float*>(weights), T, K, E, out.pair_offsets, out.pair_experts,
        out.pair_weights);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void routing_from_ids_async(const void* ids, bool ids_int64, const void* weights,
                            DType weights_dtype, int64_t T, int64_t K, int64_t E,
                            const FixedKRouting& out, cudaStream_t stream) {
  MOEBLAZE_REQUIRE(K >= 1, "K (", K, ") must be >= 1");
  if (ids_int64)
    launch<int64_t>(ids, weights, weights_dtype, T, K, E, out, stream);
  else
    launch<int32_t>(ids, weights, weights_dtype, T, K, E, out, stream);
}

}  // namespace moeblaze::cuda
