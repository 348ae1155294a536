// Expert parallelism's send-buffer gather: dst row i = src row idx[i], a plain byte copy (the
// rows go on the wire unchanged, any dtype). One thread per (row, word); consecutive threads take
// consecutive words of a row, so loads and stores are coalesced. The widest word that divides
// the row (16, 4 or 2 bytes; rows are whole bf16/fp32 elements) is used; cudaMalloc'd bases are
// 256-byte aligned, so every row start is aligned to it.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/cuda_backend.hpp"
#include "cuda/ep/ep_cuda.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda::ep {
namespace {

constexpr int kThreads = 256;

template <typename Word>
__global__ void __launch_bounds__(kThreads)
    gather_rows_kernel(const Word* __restrict__ src, const int32_t* __restrict__ idx,  // (count,)
                       Word* __restrict__ dst, int64_t count, int64_t words_per_row) {
  const int64_t total = count * words_per_row;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * kThreads) {
    const int64_t row = i / words_per_row, w = i - row * words_per_row;
    dst[i] = src[int64_t(idx[row]) * words_per_row + w];
  }
}

template <typename Word>
void launch(const void* src, const int32_t* idx, int64_t count, size_t row_bytes, void* dst,
            cudaStream_t stream) {
  const int64_t words = static_cast<int64_t>(row_bytes / sizeof(Word));
  const int64_t total = count * words;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, int64_t(1) << 20);
  gather_rows_kernel<Word><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const Word*>(src), idx, static_cast<Word*>(dst), count, words);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void gather_rows(const void* src, const int32_t* idx, int64_t count, size_t row_bytes, void* dst,
                 cudaStream_t stream) {
  if (count <= 0 || row_bytes == 0) return;
  MOEBLAZE_REQUIRE(row_bytes % 2 == 0, "gather_rows: row_bytes (", row_bytes,
                   ") must be a multiple of 2");
  const bool aligned16 = reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  if (row_bytes % 16 == 0 && aligned16)
    launch<uint4>(src, idx, count, row_bytes, dst, stream);
  else if (row_bytes % 4 == 0 && reinterpret_cast<uintptr_t>(src) % 4 == 0 &&
           reinterpret_cast<uintptr_t>(dst) % 4 == 0)
    launch<uint32_t>(src, idx, count, row_bytes, dst, stream);
  else
    launch<uint16_t>(src, idx, count, row_bytes, dst, stream);
}

}  // namespace moeblaze::cuda::ep
