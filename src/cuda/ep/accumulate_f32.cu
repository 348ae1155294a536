// Expert parallelism with chunks (EpOptions::chunks > 1): each chunk's local layer_backward gives
// dW1/dW2 of the local experts over that chunk's tokens only; the full gradient is their sum over
// chunks, taken in chunk order in fp32 and stored once in the dtype (the CPU's src/ep/ep_rows.cpp
// the same, operation for operation). Two elementwise kernels of that one sum: accumulate
// (acc = or += float(src)) and the final store. One thread per element, no atomics, so the bits
// do not depend on the launch shape.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/cuda_backend.hpp"
#include "cuda/ep/ep_cuda.hpp"
#include "cuda/ep/elem_io.cuh"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda::ep {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    accumulate_kernel(const T* __restrict__ src,  // (count,) one chunk's gradient
                      float* __restrict__ acc,    // (count,) fp32 sum of the chunks so far
                      int64_t count, bool first) {
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * kThreads)
    acc[i] = first ? to_f(src[i]) : acc[i] + to_f(src[i]);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    store_kernel(const float* __restrict__ acc,  // (count,) fp32 sum over all chunks
                 T* __restrict__ dst,            // (count,) the gradient in its dtype
                 int64_t count) {
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * kThreads)
    store(dst + i, acc[i]);
}

unsigned blocks_for(int64_t count) {
  return static_cast<unsigned>(
      std::min<int64_t>((count + kThreads - 1) / kThreads, int64_t(1) << 20));
}

void check_dtype(DType dtype, const char* fn) {
  MOEBLAZE_REQUIRE(dtype == DType::bf16 || dtype == DType::f32, fn, ": dtype ", dtype_name(dtype),
                   " must be bf16 or fp32");
}

}  // namespace

void accumulate_f32(const void* src, DType dtype, float* acc, int64_t count, bool first,
                    cudaStream_t stream) {
  if (count <= 0) return;
  check_dtype(dtype, "accumulate_f32");
  if (dtype == DType::bf16)
    accumulate_kernel<<<blocks_for(count), kThreads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(src), acc, count, first);
  else
    accumulate_kernel<<<blocks_for(count), kThreads, 0, stream>>>(static_cast<const float*>(src),
                                                                  acc, count, first);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

void store_from_f32(const float* acc, DType dtype, void* dst, int64_t count, cudaStream_t stream) {
  if (count <= 0) return;
  check_dtype(dtype, "store_from_f32");
  if (dtype == DType::bf16)
    store_kernel<<<blocks_for(count), kThreads, 0, stream>>>(acc, static_cast<__nv_bfloat16*>(dst),
                                                             count);
  else
    store_kernel<<<blocks_for(count), kThreads, 0, stream>>>(acc, static_cast<float*>(dst), count);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeblaze::cuda::ep
