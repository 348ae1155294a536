// Device-side validation of a routing (the GPU counterpart of validate_routing): offsets
// non-decreasing from 0 to P, expert ids in [0, E) and not repeated within a token, weights
// finite. One thread per token; violations raise the flags (plain stores, see cuda_backend.hpp).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/cuda_backend.hpp"
#include "cuda/routing/routing_device.cuh"
#include "cuda/routing/router_kernels.hpp"

namespace moeblaze::cuda {
namespace {

using detail::raise_flag;

__global__ void validate_routing_kernel(const int32_t* __restrict__ offsets,  // (T+1,)
                                        const int32_t* __restrict__ experts,  // (P,)
                                        const float* __restrict__ weights,    // (P,) or null
                                        int64_t T, int64_t P, int E,
                                        int32_t* __restrict__ flags) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t <= T; t += stride) {
    const int32_t o = offsets[t];
    if ((t == 0 && o != 0) || (t == T && o != P)) raise_flag(flags, kFlagBadOffsets);
    if (t == T) continue;
    const int32_t o1 = offsets[t + 1];
    if (o1 < o) {
      raise_flag(flags, kFlagBadOffsets);
      continue;
    }
    // Clamp to [0, P) so that broken offsets (flagged) never read out of bounds.
    const int32_t b = max(0, min(o, int32_t(P))), end = max(b, min(o1, int32_t(P)));
    for (int32_t p = b; p < end; ++p) {
      const int32_t e = experts[p];
      if (e < 0 || e >= E) raise_flag(flags, kFlagExpertOutOfRange);
      for (int32_t q = b; q < p; ++q)
        if (experts[q] == e) raise_flag(flags, kFlagExpertRepeated);
      if (weights != nullptr && !isfinite(weights[p])) raise_flag(flags, kFlagNonFinite);
    }
  }
}

}  // namespace

void validate_routing_async(const RoutingView& r, int32_t* d_flags, cudaStream_t stream) {
  const int threads = 256;
  const int grid = int(std::max<int64_t>(1, std::min<int64_t>((r.T + threads) / threads, 8192)));
  validate_routing_kernel<<<grid, threads, 0, stream>>>(r.pair_offsets, r.pair_experts,
                                                        r.pair_weights, r.T, r.P, int(r.E),
                                                        d_flags);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeblaze::cuda
