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
// b2 (E, d) bf16 or null: each pair adds w_p * b2[e_p, :] too (the expert biases; bf16, weighted,
// d % 8 == 0 and 16-byte aligned rows only).
void aggregate_rows(const RoutingPlanView& plan, const void* rows, const float* slot_weights,
                    void* out, int64_t d, DType dtype, cudaStream_t stream,
                    const void* b2 = nullptr);

// d_pair_weights[p] = ds[token_index_map[p]]: the per-slot gate gradient back in pair order.
// ds (S,) fp32 grouped by expert, d_pair_weights (S,) fp32 token-major.
void gather_pair_grads(const RoutingPlanView& plan, const float* ds, float* d_pair_weights,
                       cudaStream_t stream);

// ---- layer (src/cuda/layer/layer_cuda.cu): keep_h and recompute modes, bf16 storage ----
// Arguments were validated by the public API; these check what only the GPU path needs (dtype
// bf16, dims the GEMM kernels take) and throw Unsupported naming the dimension.
// ---- expert biases (src/cuda/layer/expert_bias.cu) ----
// b2's share of backward in one pass over the gathered d_out: for every slot r (t_r its token,
// e_r its expert) ds[r] += <d_out[t_r, :], b2[e_r, :]> (y_r = W2 a_r + b2_e), and
// db2[e, :] = sum over e's slots of s_r d_out[t_r, :]; fixed summation orders. d_out (T, d),
// b2 and db2 (E, d) bf16, d a multiple of 8; ds (S,) fp32; scratch: bias2_scratch_floats(S, d)
// fp32, free for the call.
int64_t bias2_scratch_floats(int64_t S, int64_t d);
void bias2_backward(const RoutingPlanView& plan, const void* d_out, const void* b2, float* scratch,
                    float* ds, void* db2, int64_t d, cudaStream_t stream);
// out[e, c] = sum over the slots r of expert e, in a fixed order, of w_r * rows[i_r, c], fp32
// accumulation, stored bf16: w_r = slot_weights[r] when `weighted`, else 1; i_r = the slot's token
// (expert_token_indices[r]) when `gathered`, else r. rows (*, cols) bf16, out (E, cols) bf16;
// cols even. db1 = (dH, not gathered, unweighted).
void expert_column_sums(const RoutingPlanView& plan, const void* rows, bool gathered,
                        bool weighted, void* out, int64_t cols, cudaStream_t stream);
// biases: each optional (validated by the API: (E, w1_rows) / (E, d) bf16 on cuda).
void layer_forward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                   const TensorView& w1, const TensorView& w2, const LayerBiases& biases,
                   const TensorView& out, SavedForBackward& saved, const LayerOptions& opts);
void layer_backward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                    const TensorView& w1, const TensorView& w2, const LayerBiases& biases,
                    const TensorView& d_out, const SavedForBackward& saved,
                    const LayerGrads& grads, const LayerOptions& opts);
// One pass's workspace (forward, or backward with LayerOptions::dh_over_h as given; compute fp8
// without room for the weights' codes when the call passes LayerOptions::fp8_weights).
size_t layer_workspace_bytes(const LayerConfig& cfg, int64_t S, LayerMode mode, bool forward,
                             bool dh_over_h, bool fp8_weights_cached = false);

// ---- materialized baseline on the GPU (src/baselines/materialized_cuda.cu) ----
void materialized_forward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                          const TensorView& w1, const TensorView& w2, const TensorView& out,
                          SavedForBackward& saved, const LayerOptions& opts);
void materialized_backward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                           const TensorView& w1, const TensorView& w2, const TensorView& d_out,
                           const SavedForBackward& saved, const LayerGrads& grads,
                           const LayerOptions& opts);

}  // namespace moeblaze::cuda

// ---- routing plan (src/cuda/routing/plan_build.cu, plan_sort_cub.cu, routing_api_cuda.cpp) ----
namespace moeblaze::cuda {

// Device-side bad-input flags: (kRoutingFlagCount,) int32 in device memory. A kernel that sees a
// violation stores 1 into that entry with a plain store (every writer stores the same value: a
// benign race, no atomic read-modify-write); kernels never clear them. The checked entry points
// clear them, run, read them back once (one small device→host copy at the API boundary) and
// throw InvalidArgument with the CPU validator's message. The *_async entry points leave them on
// the device: that path is graph-capturable, and the caller checks the flags when it chooses.
enum RoutingFlag : int {
  kFlagExpertOutOfRange = 0,  // an expert id outside [0, E)
  kFlagExpertRepeated = 1,    // an expert twice within one token
  kFlagNonFinite = 2,         // a NaN/Inf logit or pair weight
  kFlagBadOffsets = 3,        // pair_offsets not non-decreasing from 0 to P
  kRoutingFlagCount = 4,      // the routing checks write entries [0, 4) only
  kFlagBadPlan = 4,           // a plan breaking a validate_routing_plan rule (plan_validate.cu)
  kPlanFlagCount = 5          // arrays the plan check writes: 5 int32, the routing's 4 first
};

struct PlanBuildOptions {
  // atomic-free builder: pairs per tile = 256 * tile_steps (1..64); 0 picks it from (P, E).
  // Only the benchmark sets it (to sweep tile sizes); the plan is the same for every value.
  int tile_steps = 0;
};

// Device bytes build_plan_async needs as workspace for this shape (O(P) for sort,
// O(E * tiles) for atomic_free; never a (T, E) array).
size_t plan_build_workspace_bytes(int64_t T, int64_t E, int64_t P, PlanBuilder builder,
                                  const PlanBuildOptions& opts = {});

// Builds `plan` (allocated on the GPU with (T, E, S = P)) from a GPU routing on `stream`.
// No host synchronisation, no allocation, no atomics: capturable in a CUDA graph. Bad input
// raises d_flags (kRoutingFlagCount int32 on the device, may be nullptr); every write stays in
// bounds, and a pair with an out-of-range or repeated expert id is left out of the token view
// (token_index_map -1), so the layer's aggregations give its token NaN instead of a plausible row.
void build_plan_async(const RoutingView& routing, PlanBuilder builder, RoutingPlan& plan,
                      void* workspace, size_t workspace_bytes, int32_t* d_flags,
                      cudaStream_t stream, const PlanBuildOptions& opts = {});

// Throws InvalidArgument naming the first bad entry (the CPU validator's message, run on a host
// copy of the routing) when any of h_flags (host copy of the device flags) is raised.
void throw_if_routing_flags(const int32_t* h_flags, const RoutingView& routing);
// The same for token_round_count's 2 * kRoutingFlagCount flags (token_rounding.cu): topk's with
// the CPU validator's message, then the logits' with the CPU token rounding's.
void throw_if_token_round_flags(const int32_t* h_flags, const RouterConfig& router,
                                const TokenRoundingConfig& cfg, const TensorView& logits,
                                const TensorView& bias, const RoutingView& topk);

// ---- a fixed-K routing from framework ids (src/cuda/routing/routing_from_ids.cu) ----
// Device arrays of a routing with K pairs per token (P = T*K).
struct FixedKRouting {
  int32_t* pair_offsets;  // (T+1,) t*K
  int32_t* pair_experts;  // (P,)
  float* pair_weights;    // (P,)
};
// ids (T, K) int32 or int64 (ids_int64) and weights (T, K) fp32 or bf16, row-major, into `out`
// on `stream`, one kernel, no host sync. An id outside [0, E) becomes E, so a wide one never
// narrows into a valid id: the plan build then raises kFlagExpertOutOfRange. K >= 1.
void routing_from_ids_async(const void* ids, bool ids_int64, const void* weights,
                            DType weights_dtype, int64_t T, int64_t K, int64_t E,
                            const FixedKRouting& out, cudaStream_t stream);

// ---- plan check (src/cuda/routing/plan_validate.cu): validate_routing_plan's rules on the GPU.
// For plans the library did not build (caller-filled device arrays); O(E + T + S log(E + T))
// work (a binary search finds each slot's expert and each pair's token).
// Workspace: (ceil(S/32),) uint32, a bitmask of slots already mapped by a pair.
size_t plan_check_workspace_bytes(int64_t S);
// Header checked on the host (sizes, pointers); contents on `stream` with no host sync (graph-
// capturable): a broken rule raises d_flags[kFlagBadPlan] (d_flags: kPlanFlagCount int32, may be
// nullptr). Bad contents never make it read out of bounds.
void validate_plan_async(const RoutingPlanView& plan, void* workspace, size_t workspace_bytes,
                         int32_t* d_flags, cudaStream_t stream);
// Throws InvalidArgument with the CPU validator's message (run on a host copy of the plan) when
// h_flags[kFlagBadPlan] (host copy of kPlanFlagCount flags) is raised.
void throw_if_plan_flags(const int32_t* h_flags, const RoutingPlanView& plan);
// The opt-in synchronous check: validate_plan_async on `stream` with its own workspace, one
// host sync to read the flag, then throw_if_plan_flags.
void validate_plan(const RoutingPlanView& plan, cudaStream_t stream);

// The public build_routing_plan for a GPU routing: builds into fresh buffers on the default
// stream, reads the flags (the one host sync), throws on bad input, then moves the result into
// `plan`, so `plan` is untouched on error.
void build_routing_plan(const RoutingView& routing, PlanBuilder builder, RoutingPlan& plan);

}  // namespace moeblaze::cuda

// ---- routers and token rounding (src/cuda/routing/router_*.cu, token_rounding.cu) ----
// Weights and selection reproduce the CPU backend bit for bit (same fp32 operation order, an
// exp equal to the CPU's expf); ids are bit-identical, weights equal (tested within 1 ulp).
namespace moeblaze::cuda {

// Router forward without host synchronisation (graph-capturable): `out` allocated on the GPU with
// (T, E, P = T*K); workspace of route_workspace_bytes; d_losses (2,) double on the device
// receives {aux_loss, z_loss} (0 when the coefficient is 0); non-finite logits or bias raise
// d_flags[kFlagNonFinite].
size_t route_workspace_bytes(const RouterConfig& cfg, int64_t T, int64_t E);
void route_async(const RouterConfig& cfg, const TensorView& logits, const TensorView& bias,
                 Routing& out, void* workspace, double* d_losses, int32_t* d_flags,
                 cudaStream_t stream);

// The public API's GPU paths (arguments already checked by src/api/routing_api.cpp). Each runs
// on the default stream and synchronises once at the end to read its flags (and the losses);
// token rounding reads its flags with its pair count (token_round_count) and syncs at the end
// too. Bad values throw InvalidArgument with the CPU's message and leave the outputs untouched.
RouterLosses route(const RouterConfig& cfg, const TensorView& logits, const TensorView& bias,
                   Routing& out);
void router_backward(const RouterConfig& cfg, const TensorView& logits, const TensorView& bias,
                     const RoutingView& routing, const TensorView& d_pair_weights,
                     const TensorView& d_logits);
void token_round(const RouterConfig& router, const TokenRoundingConfig& cfg,
                 const TensorView& logits, const TensorView& bias, const RoutingView& topk,
                 Routing& out);

}  // namespace moeblaze::cuda
