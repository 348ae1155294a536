// Host-side TMA descriptors of the sm_90a GEMMs' weight operands (the device side of the copy is
// TmaKMajorLoader in sm90_gemm_core.cuh, and the warp-specialised producers'
// SM90_TMA_LOAD_2D issue). Used by kernels/sm90_varlen_m.cuh, sm90_ws_gather.cuh and
// sm90_ws_varlen_k.cuh.
#pragma once

#include <cuda.h>  // CUtensorMap

#include <cutlass/cuda_host_adapter.hpp>  // cuTensorMapEncodeTiled through the runtime

#include "cuda/cuda_backend.hpp"                   // MOEBLAZE_CUDA_CHECK
#include "cuda/gemm/pipeline/sm90_gemm_core.cuh"  // kBK
#include "moeblaze/error.hpp"

namespace moeblaze::cuda::gemm::sm90 {

// The driver API (cuTensorMapEncodeTiled) needs a current context, and the runtime binds the
// device's primary context to a thread only at that thread's first call that needs one: a thread
// whose first CUDA work is a TMA encode (PyTorch's autograd thread, with caller-given
// workspaces) would get CUDA_ERROR_INVALID_CONTEXT. cudaSetDevice binds it at once.
inline void bind_current_context() {
  int dev = 0;
  MOEBLAZE_CUDA_CHECK(cudaGetDevice(&dev));
  MOEBLAZE_CUDA_CHECK(cudaSetDevice(dev));
}

// The TMA descriptor of a K-major weight stack b (rows, K) bf16, row stride K: boxes of 64 rows
// x 64 K elements (one 128-byte swizzle row each), the layout TmaKMajorLoader expects.
inline CUtensorMap make_tma_kmajor(const void* b, int64_t rows, int64_t K) {
  bind_current_context();
  CUtensorMap m{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(K), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(K) * 2};  // bytes between rows
  const cuuint32_t box[2] = {kBK, 64};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = cutlass::call_cuTensorMapEncodeTiled(
      &m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(b), dims, strides, box,
      elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw DeviceError(::moeblaze::detail::concat("cuTensorMapEncodeTiled failed (", int(r), ") for a (",
                                     rows, ", ", K, ") bf16 weight operand"));
  return m;
}

// The TMA descriptor of a stack of E row-major bf16 matrices (E, rows, cols), for storing 64 x 64
// boxes (64 rows of 64 columns, one 128-byte swizzle row each) from shared memory; a box past
// rows or cols is clipped by the TMA unit.
inline CUtensorMap make_tma_store_3d(void* out, int64_t E, int64_t rows, int64_t cols) {
  bind_current_context();
  CUtensorMap m{};
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(E)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(cols) * 2,
                                 static_cast<cuuint64_t>(cols) * rows * 2};  // bytes
  const cuuint32_t box[3] = {64, 64, 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = cutlass::call_cuTensorMapEncodeTiled(
      &m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, out, dims, strides, box, elem_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw DeviceError(::moeblaze::detail::concat("cuTensorMapEncodeTiled failed (", int(r),
                                                 ") for a (", E, ", ", rows, ", ", cols,
                                                 ") bf16 output"));
  return m;
}

}  // namespace moeblaze::cuda::gemm::sm90
