// The CUDA backend's entry points (sm_90a). Compiled only when MOEBLAZE_WITH_CUDA is defined.
// The public API validates shapes/dtypes/devices, then dispatches here for Device::cuda.
// Nothing here synchronises with the host except where a function says so (error flags).
#pragma once

#include <cuda_runtime.h>

#include "moeblaze/config.hpp"
#include "moeblaze/layer.hpp"
#include "moeblaze/routing.hpp"
#include "moeblaze/routing_plan.hpp"

namespace moeblaze::cuda {

// Throws DeviceError with the call's text and CUDA's message if err != cudaSuccess.
void check(cudaError_t err, const char* what);
#define MOEBLAZE_CUDA_CHECK(call) ::moeblaze::cuda::check((call), #call)

// ---- aggregation (src/cuda/layer/aggregate.cu) ----
// out[t, :] = sum over pairs p of token t, in pair order, of w_p * rows[token_index_map[p], :]
// with w_p = slot_weights[token_index_map[p]] when slot_weights != nullptr, else 1.
// rows (S, d), out (T, d), both `dtype` (bf16 or fp32); fp32 accumulation; fixed order, no atomics.
void aggregate_rows(const RoutingPlanView& plan, const void* rows, const float* slot_weights,
                    void* out, int64_t d, DType dtype, cudaStream_t stream);

// d_pair_weights[p] = ds[token_index_map[p]]: the per-slot gate gradient back in pair order.
// ds (S,) fp32 grouped by expert, d_pair_weights (S,) fp32 token-major.
void gather_pair_grads(const RoutingPlanView& plan, const float* ds, float* d_pair_weights,
                       cudaStream_t stream);

// ---- layer (src/cuda/layer/layer_cuda.cu): keep_h and recompute modes, bf16 storage ----
// Arguments were validated by the public API; these check what only the GPU path needs (dtype
// bf16, dims the GEMM kernels take) and throw Unsupported naming the dimension.
void layer_forward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                   const TensorView& w1, const TensorView& w2, const TensorView& out,
                   SavedForBackward& saved, const LayerOptions& opts);
void layer_backward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                    const TensorView& w1, const TensorView& w2, const TensorView& d_out,
                    const SavedForBackward& saved, const LayerGrads& grads,
                    const LayerOptions& opts);
// The workspace one layer_forward / layer_backward call allocates (max of the two).
size_t layer_workspace_bytes(const LayerConfig& cfg, int64_t S, LayerMode mode);

// ---- materialized baseline on the GPU (src/baselines/materialized_cuda.cu) ----
void materialized_forward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                          const TensorView& w1, const TensorView& w2, const TensorView& out,
                          SavedForBackward& saved, const LayerOptions& opts);
void materialized_backward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                           const TensorView& w1, const TensorView& w2, const TensorView& d_out,
                           const SavedForBackward& saved, const LayerGrads& grads,
                           const LayerOptions& opts);

}  // namespace moeblaze::cuda
