// Benchmark inputs generated on the GPU (src/cuda/routing/bench_data.cu), for
// `moeblaze bench routing`: deterministic for a seed, never zeros.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moeblaze/dtype.hpp"
#include "moeblaze/routing.hpp"

namespace moeblaze::cuda {

// n values N(0, 1) in dtype (fp32 or bf16) into device memory.
void fill_normal(void* dst, DType dtype, int64_t n, uint64_t seed, cudaStream_t stream);

// A top-K routing (r allocated on the GPU with P = T*K) in which the first
// round(hot_fraction * E) experts receive about hot_share of the pairs (docs/DESIGN.md's skewed
// benchmark routing: 0.2 and 0.8). Weights uniform in (0, 1].
void fill_skewed_topk(Routing& r, int K, double hot_fraction, double hot_share, uint64_t seed,
                      cudaStream_t stream);

}  // namespace moeblaze::cuda
