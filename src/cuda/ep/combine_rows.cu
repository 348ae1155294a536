// Expert parallelism's combine on the source rank: out_t = sum of t's returned partial rows
// (one per destination rank that held any of t's experts), in ascending rank order, fp32 from
// 0, stored once in the dtype — the CPU's src/ep/ep_rows.cpp, operation for operation, so both
// devices give the same bits. A gather-and-sum: each output element belongs to one thread, no
// atomics. One thread per (token, column); consecutive threads take consecutive columns.
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
    combine_rows_kernel(const T* __restrict__ rows,     // (N, d) returned partials
                        const int32_t* __restrict__ off,  // (T+1,) rows of token t: [off[t], off[t+1])
                        const int32_t* __restrict__ idx,  // (N,) row of each, ascending rank
                        T* __restrict__ out, int64_t num_tokens, int64_t d) {
  const int64_t total = num_tokens * d;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * kThreads) {
    const int64_t t = i / d, j = i - t * d;
    float acc = 0.0f;
    for (int32_t k = off[t]; k < off[t + 1]; ++k) acc += to_f(rows[int64_t(idx[k]) * d + j]);
    store(out + i, acc);
  }
}

template <typename T>
void launch(const void* rows, const int32_t* off, const int32_t* idx, int64_t T_, int64_t d,
            void* out, cudaStream_t stream) {
  const int64_t total = T_ * d;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, int64_t(1) << 20);
  combine_rows_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const T*>(rows), off, idx, static_cast<T*>(out), T_, d);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void combine_rows(const void* rows, const int32_t* off, const int32_t* idx, int64_t T, int64_t d,
                  DType dtype, void* out, cudaStream_t stream) {
  if (T <= 0 || d <= 0) return;
  MOEBLAZE_REQUIRE(dtype == DType::bf16 || dtype == DType::f32, "combine_rows: dtype ",
                   dtype_name(dtype), " must be bf16 or fp32");
  if (dtype == DType::bf16)
    launch<__nv_bfloat16>(rows, off, idx, T, d, out, stream);
  else
    launch<float>(rows, off, idx, T, d, out, stream);
}

}  // namespace moeblaze::cuda::ep
