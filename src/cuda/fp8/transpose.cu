// transpose_blocks_async (quantize.hpp): quantized weights turned the other way round. Codes move
// through shared memory in 64 x 64-byte tiles: 256 threads load the tile's 64 rows as four
// 16-byte chunks each (coalesced), then each writes 16 bytes of one transposed row (a column of
// the tile). Scales are a tiny (rows/128, cols/128) transpose per matrix, one thread each. Pure
// data movement: the output is the input's bytes, whatever the launch shape.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_backend.hpp"
#include "cuda/fp8/quantize.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda::fp8 {
namespace {

constexpr int kTile = 64;       // bytes per tile side
constexpr int kThreads = 256;   // 64 rows x 4 chunks of 16 bytes

// Grid: (cols / 64, rows / 64, batch). q (batch, rows, cols) -> qt (batch, cols, rows).
__global__ void __launch_bounds__(kThreads) transpose_codes_kernel(
    const uint8_t* __restrict__ q, int64_t rows, int64_t cols, uint8_t* __restrict__ qt) {
  __shared__ uint8_t tile[kTile][kTile + 16];  // + 16: rows start on different banks
  const int64_t b = blockIdx.z, r0 = int64_t(blockIdx.y) * kTile, c0 = int64_t(blockIdx.x) * kTile;
  const uint8_t* src = q + b * rows * cols;
  uint8_t* dst = qt + b * rows * cols;
  const int r = threadIdx.x / 4, chunk = threadIdx.x % 4;
  *reinterpret_cast<uint4*>(&tile[r][chunk * 16]) =
      *reinterpret_cast<const uint4*>(src + (r0 + r) * cols + c0 + chunk * 16);
  __syncthreads();
  // Thread (c, chunk) writes transposed row c0 + c, bytes r0 + 16 chunk .. + 16.
  const int c = threadIdx.x / 4;
  alignas(16) uint8_t out[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) out[i] = tile[chunk * 16 + i][c];
  *reinterpret_cast<uint4*>(dst + (c0 + c) * rows + r0 + chunk * 16) =
      *reinterpret_cast<const uint4*>(out);
}

// One thread per scale: s (batch, rb, cb) -> st (batch, cb, rb).
__global__ void transpose_scales_kernel(const float* __restrict__ s, int64_t batch, int64_t rb,
                                        int64_t cb, float* __restrict__ st) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= batch * rb * cb) return;
  const int64_t b = i / (rb * cb), r = (i / cb) % rb, c = i % cb;
  st[(b * cb + c) * rb + r] = s[i];
}

}  // namespace

void transpose_blocks_async(const uint8_t* q, const float* scales, int64_t batch, int64_t rows,
                            int64_t cols, uint8_t* qt, float* scales_t, cudaStream_t stream) {
  const char* fn = "fp8::transpose_blocks_async";
  MOEBLAZE_REQUIRE(batch >= 0, fn, ": batch (", batch, ") must be >= 0");
  MOEBLAZE_REQUIRE(rows >= 0 && rows % 128 == 0 && cols >= 0 && cols % 128 == 0, fn, ": rows (",
                   rows, ") and cols (", cols, ") must be multiples of 128 (whole scale blocks)");
  MOEBLAZE_REQUIRE(rows / kTile <= 65535 && batch <= 65535, fn, ": rows / 64 (", rows / kTile,
                   ") and batch (", batch, ") must be at most 65535 (grid limits)");
  if (batch == 0 || rows == 0 || cols == 0) return;
  MOEBLAZE_REQUIRE(q && scales && qt && scales_t, fn, ": q, scales, qt and scales_t must be given");
  MOEBLAZE_REQUIRE(reinterpret_cast<uintptr_t>(q) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(qt) % 16 == 0,
                   fn, ": q and qt must be 16-byte aligned");
  const dim3 grid(unsigned(cols / kTile), unsigned(rows / kTile), unsigned(batch));
  transpose_codes_kernel<<<grid, kThreads, 0, stream>>>(q, rows, cols, qt);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
  const int64_t n = batch * (rows / 128) * (cols / 128);
  transpose_scales_kernel<<<unsigned((n + 255) / 256), 256, 0, stream>>>(
      scales, batch, rows / 128, cols / 128, scales_t);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeblaze::cuda::fp8
