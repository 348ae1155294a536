// Internal interface of the GPU routing-plan builders (src/cuda/routing/plan_build.cu,
// plan_sort_cub.cu); the public entry points are in cuda_backend.hpp.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/cuda_backend.hpp"

namespace moeblaze::cuda {

// How the atomic-free builder cuts the pairs into tiles (a function of P, E and the device).
struct PlanTiling {
  int warps = 8;            // warps per block; each owns 32*steps consecutive pairs of the tile
  int steps = 1;
  int64_t tile_pairs = 0;   // warps * 32 * steps
  int64_t tiles = 0;        // ceil(P / tile_pairs)
  size_t smem_count = 0;    // dynamic shared memory of the count kernel
  size_t smem_scatter = 0;  // ... and of the scatter kernel
};
PlanTiling plan_tiling(int64_t P, int64_t E, int tile_steps);

size_t atomic_free_workspace_bytes(int64_t T, int64_t E, int64_t P, const PlanBuildOptions& o);
void build_plan_atomic_free_async(const RoutingView& r, RoutingPlan& plan, void* workspace,
                                  size_t workspace_bytes, int32_t* d_flags, cudaStream_t stream,
                                  const PlanBuildOptions& o);

size_t sort_workspace_bytes(int64_t T, int64_t E, int64_t P);
void build_plan_sort_async(const RoutingView& r, RoutingPlan& plan, void* workspace,
                           size_t workspace_bytes, int32_t* d_flags, cudaStream_t stream);

}  // namespace moeblaze::cuda
