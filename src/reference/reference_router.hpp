// A float64 reference of every router: selection, pair weights, auxiliary losses and the
// backward pass to d logits. Written plainly (explicit Jacobians, no fused formulas, no threads)
// so that it can be read against the definitions in config.hpp / routing.hpp and trusted as the
// yardstick for the CPU and GPU routers and for end-to-end gradient checks through router + layer.
//
// Conventions shared by every function:
//   logits          (T, E) float64, row-major (widen fp32/bf16 logits exactly with a cast)
//   bias            (E,) float64, required for RouterKind::sigmoid_bias, ignored (may be null)
//                   otherwise
//   pair_offsets    (T+1,) int32 CSR over tokens, pair_experts (P,) int32 with P = offsets[T];
//                   any pair set (top-K or token-rounded) in any order within a token
//   RouterKind::supplied has no logits and is rejected (throws InvalidArgument).
//
// Definitions (cfg.kind):
//   softmax_topk : selection score p = softmax(logits); weight p_e, or p_e / sum_{pairs} p
//                  when cfg.renormalize
//   topk_softmax : selection score = the logit; weight = softmax over the token's pair logits
//   sigmoid_bias : selection score s + bias with s = sigmoid(logit); weight s_e, or
//                  s_e / sum_{pairs} s when cfg.renormalize (bias never enters a weight)
//   Ties in a selection break to the lower expert id (and, across tokens, to the lower token id).
//   aux loss (cfg.aux_loss_coef > 0): coef * E * sum_e f_e * P_e with f_e = (#pairs on e) / P and
//                  P_e = mean_t q_{t,e}; q = softmax(logits) for the softmax routers and the
//                  normalised sigmoid s / sum_e s for sigmoid_bias. f_e is a count (piecewise
//                  constant), so the gradient flows through P_e only.
//   z loss (cfg.z_loss_coef > 0): coef * mean_t logsumexp(logits_t)^2 (every router kind).
#pragma once

#include <cstdint>
#include <vector>

#include "moeblaze/config.hpp"
#include "moeblaze/routing.hpp"

namespace moeblaze::reference {

// The score each router ranks experts by (see above). (T*E) row-major.
std::vector<double> router_scores(const RouterConfig& cfg, const double* logits,
                                  const double* bias, int64_t T, int64_t E);

// Top-K selection: (T*K) int32, K = cfg.top_k, each token's experts in rank order (best first,
// equal scores → lower expert id first).
std::vector<int32_t> router_topk(const RouterConfig& cfg, const double* logits,
                                 const double* bias, int64_t T, int64_t E);

// Gate weight of every given pair, by the router's rule over each token's pair set. (P,)
std::vector<double> router_pair_weights(const RouterConfig& cfg, const double* logits,
                                        const double* bias, int64_t T, int64_t E,
                                        const int32_t* pair_offsets, const int32_t* pair_experts);

// Auxiliary losses of a routing (0 where the coefficient is 0). f_e is counted over the given pairs.
RouterLosses router_losses(const RouterConfig& cfg, const double* logits, int64_t T, int64_t E,
                           const int32_t* pair_offsets, const int32_t* pair_experts);

// d logits (T*E) of  L = sum_p d_pair_weights[p] * w_p + aux_loss + z_loss  for FIXED pairs: the
// gradient through the pair weights plus that of each auxiliary loss whose coefficient is > 0
// (the losses count as added to the training loss with weight 1).
std::vector<double> router_backward(const RouterConfig& cfg, const double* logits,
                                    const double* bias, int64_t T, int64_t E,
                                    const int32_t* pair_offsets, const int32_t* pair_experts,
                                    const double* d_pair_weights);

}  // namespace moeblaze::reference
