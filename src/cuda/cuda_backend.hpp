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

}  // namespace moeblaze::cuda
