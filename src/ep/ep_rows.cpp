// Row movement for expert parallelism: CPU versions, and the dispatch to the CUDA kernels.
#include "ep/ep_rows.hpp"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "core/parallel.hpp"
#include "moeblaze/error.hpp"

#ifdef MOEBLAZE_WITH_CUDA
#include <cuda_runtime.h>

#include "cuda/cuda_backend.hpp"
#include "cuda/ep/ep_cuda.hpp"
#endif

namespace moeblaze::ep {
namespace {

#ifdef MOEBLAZE_WITH_CUDA
cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }
#endif

#ifndef MOEBLAZE_WITH_CUDA
[[noreturn]] void no_cuda() {
  throw Unsupported("expert parallelism: data on cuda, but moeblaze was built without CUDA");
}
#endif

// The CUDA/CPU dispatch of every helper below, written once: for data on cuda, runs the
// statement (the CUDA version) and returns; in a build without CUDA, refuses such data (the
// statement is not compiled). The CPU version follows the macro.
#ifdef MOEBLAZE_WITH_CUDA
#define EP_CUDA_OR_FALL_THROUGH(dev, ...) \
  if ((dev) == Device::cuda) {            \
    __VA_ARGS__;                          \
    return;                               \
  }
#else
#define EP_CUDA_OR_FALL_THROUGH(dev, ...) \
  if ((dev) == Device::cuda) no_cuda();
#endif

// Rows per parallel task: enough bytes per task to pay for scheduling it.
constexpr int64_t kRowsPerTask = 64;

template <typename S>
void combine_cpu(const S* rows, const int32_t* off, const int32_t* idx, int64_t T, int64_t d,
                 S* out) {
  // Columns in blocks, so that the accumulators stay on the stack; every element is summed
  // over its rows in ascending i whatever the blocking.
  constexpr int64_t kCols = 256;
  parallel_for(0, T, kRowsPerTask, [&](int64_t t) {
    float acc[kCols];
    for (int64_t c0 = 0; c0 < d; c0 += kCols) {
      const int64_t cols = std::min(kCols, d - c0);
      for (int64_t j = 0; j < cols; ++j) acc[j] = 0.0f;
      for (int32_t i = off[t]; i < off[t + 1]; ++i) {
        const S* r = rows + static_cast<int64_t>(idx[i]) * d + c0;
        for (int64_t j = 0; j < cols; ++j) acc[j] += static_cast<float>(r[j]);
      }
      S* o = out + t * d + c0;
      for (int64_t j = 0; j < cols; ++j) o[j] = S(acc[j]);
    }
  });
}

}  // namespace

void gather_rows(Device dev, const void* src, const int32_t* idx, int64_t count, size_t row_bytes,
                 void* dst, void* stream) {
  if (count <= 0 || row_bytes == 0) return;
  EP_CUDA_OR_FALL_THROUGH(
      dev, cuda::ep::gather_rows(src, idx, count, row_bytes, dst, as_stream(stream)));
  (void)stream;
  const char* s = static_cast<const char*>(src);
  char* o = static_cast<char*>(dst);
  parallel_for(0, count, kRowsPerTask, [&](int64_t i) {
    std::memcpy(o + static_cast<size_t>(i) * row_bytes,
                s + static_cast<size_t>(idx[i]) * row_bytes, row_bytes);
  });
}

void combine_rows(Device dev, const void* rows, const int32_t* off, const int32_t* idx, int64_t T,
                  int64_t d, DType dtype, void* out, void* stream) {
  if (T <= 0 || d <= 0) return;
  EP_CUDA_OR_FALL_THROUGH(
      dev, cuda::ep::combine_rows(rows, off, idx, T, d, dtype, out, as_stream(stream)));
  (void)stream;
  if (dtype == DType::bf16)
    combine_cpu(static_cast<const bf16*>(rows), off, idx, T, d, static_cast<bf16*>(out));
  else
    combine_cpu(static_cast<const float*>(rows), off, idx, T, d, static_cast<float*>(out));
}

void accumulate_f32(Device dev, const void* src, DType dtype, float* acc, int64_t count,
                    bool first, void* stream) {
  if (count <= 0) return;
  MOEBLAZE_REQUIRE(dtype == DType::bf16 || dtype == DType::f32, "accumulate_f32: dtype ",
                   dtype_name(dtype), " must be bf16 or fp32");
  EP_CUDA_OR_FALL_THROUGH(
      dev, cuda::ep::accumulate_f32(src, dtype, acc, count, first, as_stream(stream)));
  (void)stream;
  constexpr int64_t kElemsPerTask = 1 << 14;
  auto run = [&](auto* s) {
    parallel_for(0, (count + kElemsPerTask - 1) / kElemsPerTask, 1, [&](int64_t b) {
      const int64_t i1 = std::min(count, (b + 1) * kElemsPerTask);
      for (int64_t i = b * kElemsPerTask; i < i1; ++i)
        acc[i] = first ? static_cast<float>(s[i]) : acc[i] + static_cast<float>(s[i]);
    });
  };
  if (dtype == DType::bf16)
    run(static_cast<const bf16*>(src));
  else
    run(static_cast<const float*>(src));
}

void store_from_f32(Device dev, const float* acc, DType dtype, void* dst, int64_t count,
                    void* stream) {
  if (count <= 0) return;
  MOEBLAZE_REQUIRE(dtype == DType::bf16 || dtype == DType::f32, "store_from_f32: dtype ",
                   dtype_name(dtype), " must be bf16 or fp32");
  EP_CUDA_OR_FALL_THROUGH(dev,
                          cuda::ep::store_from_f32(acc, dtype, dst, count, as_stream(stream)));
  (void)stream;
  constexpr int64_t kElemsPerTask = 1 << 14;
  auto run = [&](auto* d) {
    using S = std::remove_pointer_t<decltype(d)>;
    parallel_for(0, (count + kElemsPerTask - 1) / kElemsPerTask, 1, [&](int64_t b) {
      const int64_t i1 = std::min(count, (b + 1) * kElemsPerTask);
      for (int64_t i = b * kElemsPerTask; i < i1; ++i) d[i] = S(acc[i]);
    });
  };
  if (dtype == DType::bf16)
    run(static_cast<bf16*>(dst));
  else
    run(static_cast<float*>(dst));
}

void copy_to_device(Device dev, void* dst, const void* host_src, size_t bytes, void* stream) {
  if (bytes == 0) return;
  // Pageable source: the call returns once the bytes are staged, so the source may be reused.
  EP_CUDA_OR_FALL_THROUGH(dev, MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(dst, host_src, bytes,
                                                                   cudaMemcpyHostToDevice,
                                                                   as_stream(stream))));
  (void)stream;
  std::memcpy(dst, host_src, bytes);
}

void copy_to_host(Device dev, void* host_dst, const void* src, size_t bytes, void* stream) {
  if (bytes == 0) return;
  EP_CUDA_OR_FALL_THROUGH(
      dev, MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost,
                                               as_stream(stream)));
      MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream))));
  (void)stream;
  std::memcpy(host_dst, src, bytes);
}

void synchronize(Device dev, void* stream) {
  if (dev != Device::cuda) return;
#ifdef MOEBLAZE_WITH_CUDA
  MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)));
#else
  (void)stream;
  no_cuda();
#endif
}

}  // namespace moeblaze::ep
