// Standalone FP8 quantizers (quantize.hpp): 1x128 tiles along rows and 128x128 blocks of stacked
// matrices, codes and scales bit-identical to src/core/fp8.cpp (rules: src/core/fp8.hpp; device
// steps: fp8_device.cuh).
//
// Work layout, both kernels: a thread owns a chunk of 16 consecutive elements of one row (one or
// two 16-byte loads of bf16, four of fp32; one 16-byte store of codes), eight threads cover the
// 128 columns of a group.
//   1x128    a tile is those eight threads (an aligned eighth of a warp): each reduces its chunk's
//            amax, three xor-shuffles give the tile's amax to all eight, each computes the scale
//            and converts its own chunk; the first writes the scale. 32 tiles per 256-thread CTA,
//            grid-stride over the (rows, ceil(cols/128)) tiles in row-major order.
//   128x128  one 256-thread CTA per block (flattened (batch, row block, column block), the scale
//            layout's order): 32 rows per pass, four passes, the 64 values kept in registers
//            between the reduction and the conversion; amax by warp shuffles, then the eight warps'
//            values through shared memory (every thread merges them in the same order).
// The amax is a max over integer bit patterns: exact and order-independent, so the result does
// not depend on the launch shape. Columns past `cols` (and rows past `rows`) are never read and
// count as 0 in the amax, which is the CPU's partial-group rule.
#include "cuda/fp8/quantize.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/cuda_backend.hpp"
#include "cuda/fp8/fp8_device.cuh"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda::fp8 {
namespace {

constexpr int kThreads = 256;
constexpr int kChunk = 16;                      // elements per thread
constexpr int kThreadsPerGroup = 128 / kChunk;  // 8 threads span one group's 128 columns
static_assert(kThreadsPerGroup * kChunk == kFp8Group, "a group row is 128 elements");
constexpr int kTilesPerCta = kThreads / kThreadsPerGroup;  // 1x128: 32 tiles per CTA
constexpr int kRowsPerPass = kThreads / kThreadsPerGroup;  // 128x128: 32 rows per pass
constexpr int kPasses = kFp8Group / kRowsPerPass;          // 4 passes of 32 rows

__device__ __forceinline__ float widen(uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }
__device__ __forceinline__ float widen(float f) { return f; }

__device__ __forceinline__ void unpack(const uint4& raw, uint16_t, float* f) {  // 8 bf16
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    f[2 * k] = __uint_as_float(w[k] << 16);             // low half: the first element
    f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
  }
}
__device__ __forceinline__ void unpack(const uint4& raw, float, float* f) {  // 4 fp32
  f[0] = __uint_as_float(raw.x);
  f[1] = __uint_as_float(raw.y);
  f[2] = __uint_as_float(raw.z);
  f[3] = __uint_as_float(raw.w);
}

// f = the n (0..16) elements at p widened to fp32, zeros after them; p is read only for i < n.
template <typename T>
__device__ __forceinline__ void load_chunk(const T* p, int n, bool vec, float (&f)[kChunk]) {
  if (vec && n == kChunk) {
    constexpr int kPerVec = 16 / int(sizeof(T));
#pragma unroll
    for (int v = 0; v < kChunk / kPerVec; ++v)
      unpack(__ldg(reinterpret_cast<const uint4*>(p) + v), T{}, f + v * kPerVec);
  } else {
#pragma unroll
    for (int i = 0; i < kChunk; ++i) f[i] = i < n ? widen(p[i]) : 0.0f;
  }
}

__device__ __forceinline__ uint32_t chunk_amax_bits(const float (&f)[kChunk]) {
  uint32_t a = 0;
#pragma unroll
  for (int i = 0; i < kChunk; ++i) a = amax_merge(a, abs_bits(f[i]));
  return a;
}

// Codes of the chunk's first n (1..16) elements under `scale`, at p.
__device__ __forceinline__ void store_chunk(uint8_t* p, int n, bool vec, const float (&f)[kChunk],
                                            float scale) {
  uint32_t w[4];
  if (is_nan_scale(scale)) {  // a NaN/Inf group: every code the NaN 0x7F (fp8.hpp)
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = 0x01010101u * kE4m3NaN;
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k)
      w[k] = uint32_t(codes2(f[4 * k], f[4 * k + 1], scale)) |
             (uint32_t(codes2(f[4 * k + 2], f[4 * k + 3], scale)) << 16);
  }
  if (vec && n == kChunk) {
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  } else {
#pragma unroll
    for (int i = 0; i < kChunk; ++i)
      if (i < n) p[i] = static_cast<uint8_t>(w[i / 4] >> (8 * (i % 4)));
  }
}

__device__ __forceinline__ int chunk_len(int64_t cols, int64_t c) {
  return static_cast<int>(cols - c < 0 ? 0 : (cols - c > kChunk ? kChunk : cols - c));
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    quantize_1x128_kernel(const T* __restrict__ x,     // (rows or more, ld) the input
                          const int32_t* __restrict__ gather,  // (rows,) source row, or null
                          int64_t rows, int64_t cols, int64_t ld,
                          uint8_t* __restrict__ q,     // (rows, cols) e4m3 codes
                          float* __restrict__ scales,  // (rows, kb) fp32 scales
                          bool vec_load, bool vec_store) {
  const int64_t kb = (cols + kFp8Group - 1) / kFp8Group, tiles = rows * kb;
  const int sub = threadIdx.x % kThreadsPerGroup;  // chunk of this thread within its tile
  // base is uniform over the CTA, so every lane of a warp runs each iteration (the shuffles).
  for (int64_t base = int64_t(blockIdx.x) * kTilesPerCta; base < tiles;
       base += int64_t(gridDim.x) * kTilesPerCta) {
    const int64_t tile = base + threadIdx.x / kThreadsPerGroup;
    int64_t r = 0, c = 0;
    int n = 0;
    if (tile < tiles) {
      r = tile / kb;
      c = (tile - r * kb) * kFp8Group + sub * kChunk;
      n = chunk_len(cols, c);
    }
    const int64_t src = gather != nullptr && n > 0 ? int64_t(__ldg(gather + r)) : r;
    float f[kChunk];
    load_chunk(n > 0 ? x + src * ld + c : x, n, vec_load, f);
    uint32_t a = chunk_amax_bits(f);
#pragma unroll
    for (int off = kThreadsPerGroup / 2; off > 0; off /= 2)
      a = amax_merge(a, __shfl_xor_sync(0xffffffffu, a, off));
    const float scale = scale_from_amax_bits(a);
    if (tile < tiles && sub == 0) scales[tile] = scale;  // (rows, kb) row-major: index = tile
    if (n > 0) store_chunk(q + r * cols + c, n, vec_store, f, scale);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    quantize_128x128_kernel(const T* __restrict__ x,     // batch matrices (rows, ld), cols used
                            int64_t batch_stride, int64_t rows, int64_t cols, int64_t ld,
                            uint8_t* __restrict__ q,     // (batch, rows, cols) e4m3 codes
                            float* __restrict__ scales,  // (batch, rb, cb) fp32 scales
                            int64_t rb, int64_t cb, bool vec_load, bool vec_store) {
  __shared__ uint32_t warp_amax[kThreads / 32];
  const int64_t blk = blockIdx.x, per_matrix = rb * cb;
  const int64_t b = blk / per_matrix, i = (blk % per_matrix) / cb, j = blk % cb;
  const T* xb = x + b * batch_stride;
  uint8_t* qb = q + b * rows * cols;
  const int sub = threadIdx.x % kThreadsPerGroup, rr = threadIdx.x / kThreadsPerGroup;
  const int64_t c = j * kFp8Group + sub * kChunk;
  const int n = chunk_len(cols, c);

  float f[kPasses][kChunk];
  uint32_t a = 0;
#pragma unroll
  for (int it = 0; it < kPasses; ++it) {
    const int64_t r = i * kFp8Group + rr + it * kRowsPerPass;
    const int nn = r < rows ? n : 0;
    load_chunk(nn > 0 ? xb + r * ld + c : xb, nn, vec_load, f[it]);
    a = amax_merge(a, chunk_amax_bits(f[it]));
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) a = amax_merge(a, __shfl_xor_sync(0xffffffffu, a, off));
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = a;
  __syncthreads();
  a = warp_amax[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) a = amax_merge(a, warp_amax[w]);
  const float scale = scale_from_amax_bits(a);
  if (threadIdx.x == 0) scales[blk] = scale;  // (batch, rb, cb) row-major: index = blk

#pragma unroll
  for (int it = 0; it < kPasses; ++it) {
    const int64_t r = i * kFp8Group + rr + it * kRowsPerPass;
    if (r < rows && n > 0) store_chunk(qb + r * cols + c, n, vec_store, f[it], scale);
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

void check_dims(const char* fn, int64_t rows, int64_t cols, int64_t ld) {
  MOEBLAZE_REQUIRE(rows >= 0 && cols >= 0, fn, ": rows (", rows, ") and cols (", cols,
                   ") must be >= 0");
  MOEBLAZE_REQUIRE(ld >= cols, fn, ": ld (", ld, ") must be >= cols (", cols, ")");
}

void check_ptrs(const char* fn, const void* x, const void* q, const void* scales) {
  MOEBLAZE_REQUIRE(x != nullptr && q != nullptr && scales != nullptr, fn,
                   ": x, q and scales must be non-null device pointers");
}

template <typename T>
void quantize_1x128_impl(const T* x, const int32_t* gather, int64_t rows, int64_t cols,
                         int64_t ld, uint8_t* q, float* scales, cudaStream_t stream) {
  const char* fn = gather ? "gather_quantize_1x128_async" : "quantize_1x128_async";
  check_dims(fn, rows, cols, ld);
  if (rows == 0 || cols == 0) return;
  check_ptrs(fn, x, q, scales);
  const int64_t tiles = rows * fp8_groups(cols);
  const bool vec_load = aligned16(x) && (ld * int64_t(sizeof(T))) % 16 == 0;
  const bool vec_store = aligned16(q) && cols % 16 == 0;
  const int64_t ctas = std::min<int64_t>((tiles + kTilesPerCta - 1) / kTilesPerCta, 1 << 22);
  quantize_1x128_kernel<<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(
      x, gather, rows, cols, ld, q, scales, vec_load, vec_store);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void quantize_128x128_impl(const T* x, int64_t batch, int64_t batch_stride, int64_t rows,
                           int64_t cols, int64_t ld, uint8_t* q, float* scales,
                           cudaStream_t stream) {
  constexpr const char* fn = "quantize_128x128_async";
  check_dims(fn, rows, cols, ld);
  MOEBLAZE_REQUIRE(batch >= 0, fn, ": batch (", batch, ") must be >= 0");
  if (batch == 0 || rows == 0 || cols == 0) return;
  MOEBLAZE_REQUIRE(batch == 1 || batch_stride >= (rows - 1) * ld + cols, fn, ": batch_stride (",
                   batch_stride, ") must be >= (rows - 1) * ld + cols (", (rows - 1) * ld + cols,
                   ") so that the matrices do not overlap");
  check_ptrs(fn, x, q, scales);
  const int64_t rb = fp8_groups(rows), cb = fp8_groups(cols), blocks = batch * rb * cb;
  MOEBLAZE_REQUIRE(blocks <= int64_t(0x7fffffff), fn, ": ", blocks,
                   " blocks exceed one grid (2^31 - 1 CTAs)");
  const bool vec_load = aligned16(x) && (ld * int64_t(sizeof(T))) % 16 == 0 &&
                        (batch == 1 || (batch_stride * int64_t(sizeof(T))) % 16 == 0);
  const bool vec_store = aligned16(q) && cols % 16 == 0;
  quantize_128x128_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      x, batch_stride, rows, cols, ld, q, scales, rb, cb, vec_load, vec_store);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

const uint16_t* bits(const bf16* x) { return reinterpret_cast<const uint16_t*>(x); }

}  // namespace

void quantize_1x128_async(const bf16* x, int64_t rows, int64_t cols, int64_t ld, uint8_t* q,
                          float* scales, cudaStream_t stream) {
  quantize_1x128_impl(bits(x), nullptr, rows, cols, ld, q, scales, stream);
}
void quantize_1x128_async(const float* x, int64_t rows, int64_t cols, int64_t ld, uint8_t* q,
                          float* scales, cudaStream_t stream) {
  quantize_1x128_impl(x, nullptr, rows, cols, ld, q, scales, stream);
}
void gather_quantize_1x128_async(const bf16* x, const int32_t* rows_of, int64_t rows,
                                 int64_t cols, int64_t ld, uint8_t* q, float* scales,
                                 cudaStream_t stream) {
  MOEBLAZE_REQUIRE(rows == 0 || rows_of != nullptr,
                   "gather_quantize_1x128_async: rows_of must be a device pointer");
  quantize_1x128_impl(bits(x), rows_of, rows, cols, ld, q, scales, stream);
}
void quantize_128x128_async(const bf16* x, int64_t batch, int64_t batch_stride, int64_t rows,
                            int64_t cols, int64_t ld, uint8_t* q, float* scales,
                            cudaStream_t stream) {
  quantize_128x128_impl(bits(x), batch, batch_stride, rows, cols, ld, q, scales, stream);
}
void quantize_128x128_async(const float* x, int64_t batch, int64_t batch_stride, int64_t rows,
                            int64_t cols, int64_t ld, uint8_t* q, float* scales,
                            cudaStream_t stream) {
  quantize_128x128_impl(x, batch, batch_stride, rows, cols, ld, q, scales, stream);
}

}  // namespace moeblaze::cuda::fp8
