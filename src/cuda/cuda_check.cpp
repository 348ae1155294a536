// CUDA error reporting for the CUDA backend (MOEBLAZE_CUDA_CHECK in cuda_backend.hpp).
#include <cuda_runtime.h>

#include "cuda/cuda_backend.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda {

void check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  // Clear the (non-sticky) error so the next check does not report it again.
  (void)cudaGetLastError();
  throw DeviceError(detail::concat(what, " failed: ", cudaGetErrorName(err), ": ",
                                   cudaGetErrorString(err)));
}

}  // namespace moeblaze::cuda
