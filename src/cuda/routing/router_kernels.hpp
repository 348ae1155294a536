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

// Aux and z losses of a routing (pair_experts, TK pairs) into d_losses (2,) double and/or one
// fp32 each at d_aux_f32, d_z_f32 (any may be nullptr); d_f (E,) fp32 receives the pair
// fractions count_e / TK when not nullptr (what router_backward_async takes).
size_t router_loss_workspace_bytes(int64_t T, int64_t E, int64_t TK);
void router_losses_async(const RouterConfig& cfg, const TensorView& logits,
                         const int32_t* pair_experts, int64_t TK, void* workspace,
                         double* d_losses, cudaStream_t stream, float* d_aux_f32 = nullptr,
                         float* d_z_f32 = nullptr, float* d_f = nullptr);

// Pairs per expert without atomics: counts (E,) int32 and, if f != nullptr, f_e = count / P.
size_t expert_counts_workspace_bytes(int64_t P, int64_t E);
void expert_counts_async(const int32_t* experts, int64_t P, int E, int32_t* partial_ws,
                         int32_t* counts, float* f, cudaStream_t stream);

// d_logits (T, E) fp32; f (E,) pair fractions when the aux loss is on. d_aux_grad, d_z_grad:
// one fp32 each on the device, the losses' upstream gradients multiplying aux_scale and z_scale
// (cpu::router_loss_scales; nullptr: 1).
void router_backward_async(const RouterConfig& cfg, const TensorView& logits, const float* bias,
                           const RoutingView& routing, const float* d_pair_weights,
                           float* d_logits, const float* f, float aux_scale, float z_scale,
                           int32_t* d_flags, cudaStream_t stream,
                           const float* d_aux_grad = nullptr, const float* d_z_grad = nullptr);

// Raises d_flags for a bad routing (src/cuda/routing/routing_validate.cu); no host sync.
void validate_routing_async(const RoutingView& r, int32_t* d_flags, cudaStream_t stream);

// Token rounding in two calls on the caller's stream over one caller workspace of
// token_round_workspace_bytes(T, E) (it refuses T*E >= 2^31), which must live from the first
// call to the end of the second:
//   token_round_count: validates topk and ranks the scores, returns the rounded pair count S
//     with the one host synchronisation; h_flags (2 * kRoutingFlagCount) receive topk's routing
//     flags, then the logits' (non-finite logits or bias). With a flag raised S is meaningless
//     and the caller throws (nothing read out of bounds on the way).
//   token_round_fill_async: the rounded routing into caller arrays (offsets (T+1,), experts and
//     weights (P,), P = the count's S); no sync.
size_t token_round_workspace_bytes(int64_t T, int64_t E);
int64_t token_round_count(const RouterConfig& router, const TokenRoundingConfig& cfg,
                          const TensorView& logits, const float* bias, const RoutingView& topk,
                          void* workspace, int32_t* h_flags, cudaStream_t stream);
void token_round_fill_async(const RouterConfig& router, const TensorView& logits,
                            const void* workspace, int32_t* pair_offsets, int32_t* pair_experts,
                            float* pair_weights, int64_t P, cudaStream_t stream);

}  // namespace moeblaze::cuda
