// A deliberately simple CUDA grouped GEMM with the same entry points and contracts as
// src/cuda/gemm/grouped_gemm.hpp: one thread per output element, fp32 accumulation in a plain
// loop, the slot's expert found by binary search in expert_token_offsets. Slow by design; it
// exists as an independent oracle for the real kernels and to run the layer where they cannot.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moeblaze/config.hpp"
#include "moeblaze/dtype.hpp"
#include "moeblaze/routing_plan.hpp"

namespace moeblaze::cuda::naive {

void up_proj(const RoutingPlanView& plan, const bf16* x, const bf16* w1, bf16* h, bf16* a,
             int64_t d, int64_t n, Activation act, cudaStream_t stream, const bf16* b1);
void down_proj(const RoutingPlanView& plan, const bf16* a, const bf16* w2, bf16* y, int64_t d,
               int64_t n, cudaStream_t stream);
void dh_proj(const RoutingPlanView& plan, const bf16* d_out, const bf16* w2, const bf16* h,
             float* ds_partials, bf16* dh, bf16* a_scaled, int64_t d, int64_t n, Activation act,
             cudaStream_t stream);
void reduce_ds(const float* ds_partials, float* ds, int64_t S, int64_t n, cudaStream_t stream);
void dw2_proj(const RoutingPlanView& plan, const bf16* d_out, const bf16* a_scaled, bf16* dw2,
              int64_t d, int64_t n, cudaStream_t stream);
void dx_proj(const RoutingPlanView& plan, const bf16* dh, const bf16* w1, bf16* dx_slots,
             int64_t d, int64_t n, Activation act, cudaStream_t stream);
void dw1_proj(const RoutingPlanView& plan, const bf16* dh, const bf16* x, bf16* dw1, int64_t d,
              int64_t n, Activation act, cudaStream_t stream);
// Same partial-column count as the real dH kernel (one per 128-wide tile of n).
int64_t ds_partials_cols(int64_t n);

}  // namespace moeblaze::cuda::naive
