// CUDA kernels of expert parallelism (src/ep/ep_rows.hpp dispatches here for Device::cuda).
// Index arrays are device memory. Nothing here synchronises with the host.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "moeblaze/dtype.hpp"

namespace moeblaze::cuda::ep {

// src/cuda/ep/gather_rows.cu: dst (count, row_bytes) = src rows idx[0..count), a byte copy.
void gather_rows(const void* src, const int32_t* idx, int64_t count, size_t row_bytes, void* dst,
                 cudaStream_t stream);

// src/cuda/ep/combine_rows.cu: out[t, :] = sum over i in [off[t], off[t+1]), ascending, of
// rows[idx[i], :]; fp32 from 0, stored in dtype (bf16 round-to-nearest-even, as the CPU).
void combine_rows(const void* rows, const int32_t* off, const int32_t* idx, int64_t T, int64_t d,
                  DType dtype, void* out, cudaStream_t stream);

// src/cuda/ep/accumulate_f32.cu: acc[i] = (first ? 0 : acc[i]) + float(src[i]) and
// dst[i] = dtype(acc[i]); src, dst (count,) dtype, acc (count,) fp32. Elementwise, no atomics.
void accumulate_f32(const void* src, DType dtype, float* acc, int64_t count, bool first,
                    cudaStream_t stream);
void store_from_f32(const float* acc, DType dtype, void* dst, int64_t count, cudaStream_t stream);

}  // namespace moeblaze::cuda::ep
