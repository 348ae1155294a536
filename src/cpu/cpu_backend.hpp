// The CPU backend's entry points. The public API (src/api/*_api.cpp) validates arguments,
// then dispatches here for Device::cpu (and to src/cuda/cuda_backend.hpp for Device::cuda).
// Functions here may assume shapes, dtypes and devices were checked; value checks that need a
// pass over the data (NaN logits, expert ids) happen here, before any output is written.
#pragma once

#include "moeblaze/config.hpp"
#include "moeblaze/layer.hpp"
#include "moeblaze/routing.hpp"
#include "moeblaze/routing_plan.hpp"

namespace moeblaze::cpu {

// ---- routers (src/cpu/router.cpp) ----
RouterLosses route(const RouterConfig& cfg, const TensorView& logits, const TensorView& bias,
                   Routing& out);
// loss_grads: (2,) host, the upstream gradients of the aux and z losses multiplying their
// terms (nullptr: 1 and 1).
void router_backward(const RouterConfig& cfg, const TensorView& logits, const TensorView& bias,
                     const RoutingView& routing, const TensorView& d_pair_weights,
                     const TensorView& d_logits, const float* loss_grads = nullptr);
// route()'s RouterLosses of any routing of these logits (pair_experts (P,) in [0, E), checked
// by the caller), bitwise; f (E,) receives the pair fractions count_e / P when not nullptr.
RouterLosses router_losses(const RouterConfig& cfg, const TensorView& logits,
                           const int32_t* pair_experts, int64_t P, float* f);
// The losses' backward scales over T tokens and E experts, shared by both backends' router
// backward (formed in double, rounded once): aux = aux_coef·E/T, z = 2·z_coef/T; 0 where T = 0.
struct RouterLossScales {
  float aux, z;
};
RouterLossScales router_loss_scales(const RouterConfig& cfg, int64_t T, int64_t E);

// ---- token rounding (src/cpu/token_rounding.cpp) ----
void token_round(const RouterConfig& router, const TokenRoundingConfig& cfg,
                 const TensorView& logits, const TensorView& bias, const RoutingView& topk,
                 Routing& out);

// ---- routing plan (src/cpu/routing_plan_build.cpp) ----
void build_plan_atomic_free(const RoutingView& routing, RoutingPlan& plan);
void build_plan_sort(const RoutingView& routing, RoutingPlan& plan);

// ---- layer (src/cpu/layer_forward.cpp, src/cpu/layer_backward.cpp) ----
void layer_forward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                   const TensorView& w1, const TensorView& w2, const LayerBiases& biases,
                   const TensorView& out, SavedForBackward& saved, const LayerOptions& opts);
void layer_backward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                    const TensorView& w1, const TensorView& w2, const LayerBiases& biases,
                    const TensorView& d_out, const SavedForBackward& saved,
                    const LayerGrads& grads, const LayerOptions& opts);

// ---- materialized baseline (src/baselines/materialized_cpu.cpp) ----
void materialized_forward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                          const TensorView& w1, const TensorView& w2, const TensorView& out,
                          SavedForBackward& saved, const LayerOptions& opts);
void materialized_backward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                           const TensorView& w1, const TensorView& w2, const TensorView& d_out,
                           const SavedForBackward& saved, const LayerGrads& grads,
                           const LayerOptions& opts);

}  // namespace moeblaze::cpu
