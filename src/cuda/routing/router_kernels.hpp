// Internal interface of the GPU router, loss and token-rounding kernels
// (src/cuda/routing/router_*.cu, token_rounding.cu). Arguments are checked by the callers
// (routing_api_cuda.cpp); nothing here synchronises with the host.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/cuda_backend.hpp"

namespace moeblaze::cuda {

// Top-K routing of logits (T, E) into `out` (P = T*K, on the GPU). bias (E,) or nullptr.
void router_topk_async(const RouterConfig& cfg, const TensorView& logits, const float* bias,
                       Routing& out, int32_t* d_flags, cudaStream_t stream);

// Aux and z losses of a top-K routing (pair_experts, TK pairs) into d_losses (2,) double.
size_t router_loss_workspace_bytes(int64_t T, int64_t E, int64_t TK);
void router_losses_async(const RouterConfig& cfg, const TensorView& logits,
                         const int32_t* pair_experts, int64_t TK, void* workspace,
                         double* d_losses, cudaStream_t stream);

// Pairs per expert without atomics: counts (E,) int32 and, if f != nullptr, f_e = count / P.
size_t expert_counts_workspace_bytes(int64_t P, int64_t E);
void expert_counts_async(const int32_t* experts, int64_t P, int E, int32_t* partial_ws,
                         int32_t* counts, float* f, cudaStream_t stream);

// d_logits (T, E) fp32; f (E,) pair fractions when the aux loss is on.
void router_backward_async(const RouterConfig& cfg, const TensorView& logits, const float* bias,
                           const RoutingView& routing, const float* d_pair_weights,
                           float* d_logits, const float* f, float aux_scale, float z_scale,
                           int32_t* d_flags, cudaStream_t stream);

// Raises d_flags for a bad routing (src/cuda/routing/routing_validate.cu); no host sync.
void validate_routing_async(const RoutingView& r, int32_t* d_flags, cudaStream_t stream);

// Token rounding with the one host read it needs (the rounded pair count S sizes `out`).
// d_flags are raised for non-finite logits/bias; the caller checks them.
void token_round_sync(const RouterConfig& router, const TokenRoundingConfig& cfg,
                      const TensorView& logits, const float* bias, const RoutingView& topk,
                      Routing& out, int32_t* d_flags, cudaStream_t stream);

}  // namespace moeblaze::cuda
