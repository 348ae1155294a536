// A float64 reference of the MoE layer, computed directly from docs/DESIGN.md's math: dense loops
// per routing pair, no routing plan, no tiling, no threads, its own activation formulas (not the
// backend's). It is the yardstick for the CPU and GPU layers and the `moeblaze` command's error
// column; its backward is checked against central finite differences of its own forward.
//
// The routing is given as pairs (CSR over tokens, routing.hpp's convention):
//   pair_offsets (T+1,) int32, pair_experts (P,) int32, pair_weights (P,) float64
// and for every pair p = (t, e, s):
//   h = W1_e x_t + b1_e;  a = act(h) (gated: f(g) * u);  y = W2_e a + b2_e;  o_t += s * y
//   backward from do_t:  da' = W2_eᵀ do_t;  d_pair_weights[p] = <da', a> + <do_t, b2_e>;  da = s da'
//                        dh = act'(h, da);  dx_t += W1_eᵀ dh;  dW1_e += dh x_tᵀ;
//                        dW2_e += s do_t aᵀ;  db1_e += dh;  db2_e += s do_t
// (the biases b1 (E, w1_rows), b2 (E, d) are optional: absent means zero).
#pragma once

#include <cstdint>
#include <vector>

#include "moeblaze/config.hpp"
#include "moeblaze/routing.hpp"
#include "moeblaze/tensor.hpp"

namespace moeblaze::reference {

struct LayerReference {
  std::vector<double> out;             // (T, d)
  std::vector<double> dx;              // (T, d)        empty when no d_out was given
  std::vector<double> dw1;             // (E, w1_rows, d)
  std::vector<double> dw2;             // (E, d, n)
  std::vector<double> db1;             // (E, w1_rows)  with dx, whether or not b1 was given
  std::vector<double> db2;             // (E, d)        likewise
  std::vector<double> d_pair_weights;  // (P,) token-major, like the routing
  // (P,) Σ_j |da'_j a_j| (+ Σ_i |do_i b2_i|): the scale of d_pair_weights' rounding error. Each d pair weight is one
  // dot product that may cancel, so its error is bounded relative to this sum of magnitudes
  // (the dot product's condition), not relative to its own value.
  std::vector<double> d_pair_weights_abs;
};

// float64 inputs, row-major: x (T, d), w1 (E, w1_rows, d), w2 (E, d, n), d_out (T, d) or null
// (forward only). Uses cfg.T, d, n, E, activation; cfg.dtype and cfg.K are ignored (P comes
// from pair_offsets[T]). Throws InvalidArgument on an expert id outside [0, E).
LayerReference reference_layer(const LayerConfig& cfg, const int32_t* pair_offsets,
                               const int32_t* pair_experts, const double* pair_weights,
                               const double* x, const double* w1, const double* w2,
                               const double* d_out, const double* b1 = nullptr,
                               const double* b2 = nullptr);

// The same from a routing and fp32/bf16/fp64 host tensors (widened exactly). d_out, b1 and b2
// may be default-constructed TensorViews (rank 0): forward only, no bias.
LayerReference reference_layer(const LayerConfig& cfg, const RoutingView& routing,
                               const TensorView& x, const TensorView& w1, const TensorView& w2,
                               const TensorView& d_out, const TensorView& b1 = {},
                               const TensorView& b2 = {});

// Loss used by finite-difference checks: L = Σ_t <d_out_t, o_t> (so dL/d(anything) is exactly
// what reference_layer's backward returns for that d_out).
double reference_loss(const LayerConfig& cfg, const int32_t* pair_offsets,
                      const int32_t* pair_experts, const double* pair_weights, const double* x,
                      const double* w1, const double* w2, const double* d_out,
                      const double* b1 = nullptr, const double* b2 = nullptr);

// The activation in float64 (f and f' of config.hpp's activations; gelu is the exact erf form).
// Gated ones: a = f(g) * up(u), dg = da * up(u) * f'(g), du = da * f(g) * dup(u).
double activation_f(Activation act, double v);
double activation_df(Activation act, double v);
double activation_up(Activation act, double u);   // u, except swiglu_oai: clamp(u, -7, 7) + 1
double activation_dup(Activation act, double u);  // 1, except swiglu_oai: 1 inside (-7, 7) else 0

}  // namespace moeblaze::reference
