// Programmatic dependent launch (PDL, sm_90): a kernel launched by launch_kernel while
// pdl_launches() holds may be scheduled before the kernel ahead of it in the stream has finished,
// so that its launch and its CTAs' start overlap that kernel's last tiles. Each kernel launched
// so calls pdl_wait() before its first global memory access (it returns once every kernel ahead
// of it has completed and its writes are visible; without a programmatic launch it returns at
// once), then pdl_launch_dependents() (the kernel behind it may be scheduled once every CTA of
// this one has said so: all of them are resident by then, so it takes no SM this one still
// needs). Kernels that do not call pdl_wait (CUTLASS's pointer-array GEMMs, cuBLAS, torch's)
// are launched plainly and order as usual.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "cuda/cuda_backend.hpp"
#include "cuda/gemm/dispatch/kernel_config.hpp"  // pdl_launches

namespace moeblaze::cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Launches `kernel` (which calls pdl_wait first) on `stream`, by programmatic dependent launch
// when pdl_launches(); `cluster` > 1 launches clusters of that many CTAs along x.
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, int cluster, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (cluster > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = unsigned(cluster);
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  if (gemm::pdl_launches()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  MOEBLAZE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// Clusters of `cluster` CTAs (along x) of `kernel` with `smem` bytes of dynamic shared memory each
// that can be resident at once: the GPCs decide, not SMs / cluster. A persistent kernel on
// clusters launches this many, or fewer where it has fewer tiles.
template <typename... Params>
int resident_clusters(void (*kernel)(Params...), dim3 block, size_t smem, int cluster) {
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.gridDim = dim3(unsigned(cluster) * 64);
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int n = 0;
  MOEBLAZE_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, kernel, &cfg));
  return n;
}

}  // namespace moeblaze::cuda
