// Standalone FP8 quantizers on the GPU (docs/FP8.md): e4m3 codes and fp32 scales bit-identical to
// src/core/fp8.hpp's quantize_1x128 / quantize_128x128 (the rules are stated there; the device
// steps are src/cuda/fp8/fp8_device.cuh). Internal to the CUDA backend, like ep/ep_cuda.hpp: the
// layer's FP8 path and the GPU tests include it; nothing public dispatches here yet.
//
// Conventions:
//   * x, q, scales are device memory; x row-major with row stride ld (elements) >= cols; q
//     (codes, one byte each, the bits of moeblaze::e4m3) is dense (rows, cols); scales dense.
//   * bf16 is moeblaze::bf16 (the bits of __nv_bfloat16); fp32 inputs are taken too.
//   * 16-byte loads where x and ld*sizeof(T) are 16-byte aligned, 16-byte code stores where q is
//     16-byte aligned and cols % 16 == 0; any other pointer/shape takes the scalar path with the
//     same bytes.
//   * Asynchronous on `stream`: no host synchronisation, no allocation, no atomics (capturable in
//     a CUDA graph). Arguments are checked before the launch (InvalidArgument, nothing written);
//     the launch error is checked (DeviceError). rows == 0 or cols == 0 (or batch == 0) launches
//     nothing.
//   * Every group is reduced and written by the threads that own it in a fixed order, so the
//     output does not depend on the launch shape.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moeblaze/dtype.hpp"

namespace moeblaze::cuda::fp8 {

// 1x128 tiles along rows (activations, gradients): q (rows, cols), scales (rows, ceil(cols/128)).
// Eight threads per tile, 16 consecutive elements each.
void quantize_1x128_async(const bf16* x, int64_t rows, int64_t cols, int64_t ld, uint8_t* q,
                          float* scales, cudaStream_t stream);
void quantize_1x128_async(const float* x, int64_t rows, int64_t cols, int64_t ld, uint8_t* q,
                          float* scales, cudaStream_t stream);
// The same with a row gather: row r of q and scales is the quantization of x's row rows_of[r]
// (the layer's X and dO in slot order, through the plan's expert_token_indices); the indices
// are the caller's to keep in range (the plan's are validated).
void gather_quantize_1x128_async(const bf16* x, const int32_t* rows_of, int64_t rows,
                                 int64_t cols, int64_t ld, uint8_t* q, float* scales,
                                 cudaStream_t stream);

// 128x128 blocks of `batch` stacked matrices (weights: W1 (E, w1_rows, d), W2 (E, d, n)), each
// quantized on its own: matrix b is x + b * batch_stride (elements; batch_stride >=
// (rows - 1) * ld + cols), codes q + b * rows * cols (dense (batch, rows, cols)), scales
// (batch, ceil(rows/128), ceil(cols/128)). One 256-thread CTA per block.
void quantize_128x128_async(const bf16* x, int64_t batch, int64_t batch_stride, int64_t rows,
                            int64_t cols, int64_t ld, uint8_t* q, float* scales,
                            cudaStream_t stream);
void quantize_128x128_async(const float* x, int64_t batch, int64_t batch_stride, int64_t rows,
                            int64_t cols, int64_t ld, uint8_t* q, float* scales,
                            cudaStream_t stream);

// The 128x128-block quantization of each stacked matrix's transpose, from its own (transpose.cu):
// codes (batch, rows, cols) -> qt (batch, cols, rows), scales (batch, rows/128, cols/128) -> st
// (batch, cols/128, rows/128). A block's scale is its amax / 448 either way round, so this is
// bit for bit quantize_128x128 of the transposed matrix: FP8 WGMMA reads its operands K-major,
// and a weight used both ways (W1 in the up-projection and in dX̃) needs both. rows and cols
// multiples of 128 (InvalidArgument otherwise, nothing written); q, qt 16-byte aligned.
void transpose_blocks_async(const uint8_t* q, const float* scales, int64_t batch, int64_t rows,
                            int64_t cols, uint8_t* qt, float* scales_t, cudaStream_t stream);

}  // namespace moeblaze::cuda::fp8
