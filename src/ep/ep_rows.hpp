// Row movement for expert parallelism on the data's device: the gathers that build send buffers,
// the fixed-order combine of returned partial rows, and host <-> device copies. The CPU versions
// live in src/ep/ep_rows.cpp; for Device::cuda they call the kernels of src/cuda/ep/.
//
// Index arrays are host memory for Device::cpu and device memory for Device::cuda.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moeblaze/dtype.hpp"
#include "moeblaze/tensor.hpp"

namespace moeblaze::ep {

// dst (count, row_bytes) = src rows idx[0..count) — a byte copy, any dtype.
void gather_rows(Device dev, const void* src, const int32_t* idx, int64_t count, size_t row_bytes,
                 void* dst, void* stream);

// out[t, :] = sum over i in [off[t], off[t+1]), in ascending i, of rows[idx[i], :]; fp32
// accumulation starting from 0, stored in `dtype`. A token with no rows gets zeros.
//   rows (*, d) dtype, off (T+1,) int32, idx (off[T],) int32, out (T, d) dtype
void combine_rows(Device dev, const void* rows, const int32_t* off, const int32_t* idx, int64_t T,
                  int64_t d, DType dtype, void* out, void* stream);

// Sums of weight gradients over chunks (EpOptions::chunks > 1), in chunk order, no atomics:
//   accumulate_f32: acc[i] = float(src[i]) when `first`, else acc[i] += float(src[i])
//   store_from_f32: dst[i] = dtype(acc[i]) (bf16 round-to-nearest-even, as every other store)
//   src, dst (count,) dtype; acc (count,) fp32. Elementwise, so the result does not depend on
//   the thread count or the launch shape.
void accumulate_f32(Device dev, const void* src, DType dtype, float* acc, int64_t count,
                    bool first, void* stream);
void store_from_f32(Device dev, const float* acc, DType dtype, void* dst, int64_t count,
                    void* stream);

// Host -> dev (host memory may be reused on return) and dev -> host (complete on return).
// For Device::cpu both are memcpy.
void copy_to_device(Device dev, void* dst, const void* host_src, size_t bytes, void* stream);
void copy_to_host(Device dev, void* host_dst, const void* src, size_t bytes, void* stream);

// Waits for the work queued on `stream` (Device::cuda); nothing on the CPU.
void synchronize(Device dev, void* stream);

}  // namespace moeblaze::ep
