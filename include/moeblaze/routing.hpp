// Routers and token rounding: from router logits to a token-major list of (token, expert,
// weight) assignments ("pairs"). The routing plan (routing_plan.hpp) is built from it.
//
// Pairs are held as a CSR over tokens, so that plain top-K (K pairs per token) and token
// rounding (a token may lose pairs or gain expert-choice pairs) share one representation:
//   pair_offsets (T+1,) int32   pairs of token t are [pair_offsets[t], pair_offsets[t+1])
//   pair_experts (P,)   int32   expert of each pair, ascending within a token for rounding output,
//                               rank order (best first) for top-K output
//   pair_weights (P,)   fp32    gate weight s_p
// For plain top-K, P = T*K and pair_offsets[t] = t*K.
#pragma once

#include <cstdint>

#include "moeblaze/config.hpp"
#include "moeblaze/memory.hpp"
#include "moeblaze/tensor.hpp"

namespace moeblaze {

// Non-owning view of a routing (all on one device).
struct RoutingView {
  int64_t T = 0;
  int64_t E = 0;
  int64_t P = 0;
  const int32_t* pair_offsets = nullptr;  // (T+1,)
  const int32_t* pair_experts = nullptr;  // (P,)
  const float* pair_weights = nullptr;    // (P,)
  Device device = Device::cpu;
};

// Owning routing, allocated through Buffer (accounted).
class Routing {
 public:
  Routing() = default;
  Routing(Device device, int64_t T, int64_t E, int64_t P);  // uninitialised contents
  // A routing over caller storage (offsets (T+1,), experts (P,), weights (P,) on `device`),
  // borrowed: not freed, not accounted (Buffer::borrow). The caller keeps it alive.
  static Routing borrow(Device device, int64_t T, int64_t E, int64_t P, int32_t* pair_offsets,
                        int32_t* pair_experts, float* pair_weights);
  int64_t T() const { return T_; }
  int64_t E() const { return E_; }
  int64_t P() const { return P_; }
  Device device() const { return offsets_.device(); }
  int32_t* pair_offsets() { return offsets_.as<int32_t>(); }
  int32_t* pair_experts() { return experts_.as<int32_t>(); }
  float* pair_weights() { return weights_.as<float>(); }
  const int32_t* pair_offsets() const { return offsets_.as<int32_t>(); }
  const int32_t* pair_experts() const { return experts_.as<int32_t>(); }
  const float* pair_weights() const { return weights_.as<float>(); }
  RoutingView view() const;
  size_t bytes() const { return offsets_.bytes() + experts_.bytes() + weights_.bytes(); }

 private:
  int64_t T_ = 0, E_ = 0, P_ = 0;
  Buffer offsets_, experts_, weights_;
};

// Checks a routing: offsets non-decreasing from 0 to P, experts in [0, E), no expert repeated
// within a token, weights finite. Throws InvalidArgument naming the first offending entry,
// e.g. "pair_experts: expert id 9 of token 3 is out of range [0, 8)". CPU views only.
void validate_routing(const RoutingView& r);

struct RouterLosses {
  double aux_loss = 0.0;  // switch load-balancing loss (0 unless aux_loss_coef > 0)
  double z_loss = 0.0;    // z-loss (0 unless z_loss_coef > 0)
};

// Router forward: logits (T, E) fp32 or bf16 → routing with P = T*K, pairs in rank order.
// bias (E,) fp32 is required for sigmoid_bias and must be empty otherwise.
// Rejects NaN/Inf logits, K outside [1, E]. T = 0 gives an empty routing.
// `out` is (re)allocated on the logits' device.
RouterLosses route(const RouterConfig& cfg, const TensorView& logits, const TensorView& bias,
                   Routing& out);

// Caller-supplied routing: ids (T, K) int32, weights (T, K) fp32 → routing (validated).
void routing_from_ids(const TensorView& ids, const TensorView& weights, int64_t num_experts,
                      Routing& out);

// Router backward: d logits (T, E) fp32 from d pair_weights (P,) fp32 (from layer backward),
// plus the gradients of the auxiliary losses when their coefficients are non-zero. Works for any
// routing whose pairs came from these logits (top-K or token-rounded): weights of a pair are
// recomputed from logits as the router defines them, so the gradient is exact.
// For RouterKind::supplied there are no logits: use the d pair_weights directly.
// d_logits may not overlap any input (InvalidArgument naming both).
void router_backward(const RouterConfig& cfg, const TensorView& logits, const TensorView& bias,
                     const RoutingView& routing, const TensorView& d_pair_weights,
                     const TensorView& d_logits);

// Token rounding: from router logits and their top-K routing to a rounded routing in which
// every expert's count is a multiple of cfg.m_tile (pairs ascending by expert within a token).
// Dropped pairs disappear; padded pairs take the expert's highest-scoring tokens that did not
// choose it. Weights are then recomputed by the router's own rule over each token's new pair
// set (softmax_topk: p_e, renormalised over the token's pairs if cfg.renormalize; topk_softmax:
// softmax over the token's pair logits; sigmoid_bias: s_e, likewise), so router_backward
// applies unchanged. A token may end with zero pairs (its output is then zero).
// Target count per expert (as SonicMoE's reference): NR-f rounds c/m_tile half-to-even (like
// torch.round); SR-f rounds up iff a counter-based draw of (seed, expert) in [0, m_tile) is below
// c mod m_tile (src/cpu/token_rounding.cpp: sr_draw); the target is then clamped to [0, T], so an
// expert whose rounded-up target exceeds T takes all T tokens. Scores: softmax probability
// (softmax_topk), logit (topk_softmax), sigmoid + bias (sigmoid_bias); ties → lower token id.
void token_round(const RouterConfig& router, const TokenRoundingConfig& cfg,
                 const TensorView& logits, const TensorView& bias, const RoutingView& topk,
                 Routing& out);

}  // namespace moeblaze
