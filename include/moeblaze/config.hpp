// Layer and router configuration (docs/DESIGN.md's notation: T tokens, d hidden, n expert
// intermediate size, E experts, K experts per token).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "moeblaze/dtype.hpp"

namespace moeblaze {

// Expert activation. Gated ones (swiglu, geglu, swiglu_oai) use w1 of shape (E, 2n, d): rows
// [0, n) are the gate g, rows [n, 2n) the up projection u, and a = act(g) * u. Non-gated ones use
// w1 (E, n, d) and a = act(h). swiglu_oai is gpt-oss's clamped SwiGLU:
// a = (clamp(u, -7, 7) + 1) * g' sigmoid(1.702 g'), g' = min(g, 7).
enum class Activation : uint8_t { swiglu, geglu, relu, silu, gelu, relu2, swiglu_oai };

inline bool is_gated(Activation a) {
  return a == Activation::swiglu || a == Activation::geglu || a == Activation::swiglu_oai;
}
const char* activation_name(Activation a);
Activation parse_activation(const std::string& s);  // throws InvalidArgument listing the choices

// How tokens pick experts.
//  softmax_topk : p = softmax(logits); keep the K largest p; weights p (or p / sum if renormalize)
//  topk_softmax : keep the K largest logits; weights = softmax over those K logits
//  sigmoid_bias : s = sigmoid(logits); select by s + bias (bias does not enter the weights and
//                 gets no gradient: auxiliary-loss-free balancing); weights s (or s / sum)
//  supplied     : the caller gives expert ids and weights; the router is bypassed and
//                 d(weights) is returned as is
// Ties in the selection break to the lower expert id.
enum class RouterKind : uint8_t { softmax_topk, topk_softmax, sigmoid_bias, supplied };
const char* router_name(RouterKind r);
RouterKind parse_router(const std::string& s);

struct RouterConfig {
  RouterKind kind = RouterKind::softmax_topk;
  int top_k = 2;
  bool renormalize = false;      // softmax_topk / sigmoid_bias: weights divided by their sum
  float aux_loss_coef = 0.0f;    // switch load-balancing loss  coef * E * sum_e f_e * P_e
  float z_loss_coef = 0.0f;      // router z-loss  coef * mean_t logsumexp(logits_t)^2
};

// Token rounding (SonicMoE §5): after top-K, each expert's token count is rounded to a multiple
// of m_tile, dropping its lowest-score token-choice tokens or padding with its highest-score
// expert-choice tokens. The deviation from top-K is at most one tile per expert.
enum class RoundingMode : uint8_t {
  nearest_freq,     // NR-f (default): round the count to the nearest multiple of m_tile
  stochastic_freq,  // SR-f: round up with probability (count mod m_tile) / m_tile, seeded
  up,               // UP: always round up (pad)
  down,             // DOWN: always round down (drop)
};
const char* rounding_name(RoundingMode m);
RoundingMode parse_rounding(const std::string& s);  // "nr-f", "sr-f", "up", "down"

struct TokenRoundingConfig {
  int m_tile = 128;
  RoundingMode mode = RoundingMode::nearest_freq;
  uint64_t seed = 0;  // SR-f only
};

// The precision of the expert GEMMs. storage: operands in the storage dtype, fp32 accumulation.
// fp8: e4m3 operands with DeepSeek-V3's fine-grained scales for the four data GEMMs (X and W1
// in the up-projection, A and W2 in the down-projection, dO and W2 for dA, dH and W1 for dX~):
// 1x128 tiles along K for activations and gradients, 128x128 blocks for weights, fp32
// accumulation; H kept for backward in e4m3 with its 1x128 scales (half the bytes); the weight
// gradients stay in bf16. fp8_wgrad: fp8 and the two weight-gradient GEMMs too (dO and A' for
// dW2, dH and X for dW1), each operand in 128x1 tiles along an expert's tokens (a third of the
// step's FLOPs; an experiment until measured on the GPU). bf16 storage only. Rules:
// src/core/fp8.hpp; recipe: docs/FP8.md.
enum class Compute : uint8_t { storage, fp8, fp8_wgrad };
const char* compute_name(Compute c);
Compute parse_compute(const std::string& s);  // "storage" / "bf16" / "fp32", "fp8", "fp8-wgrad"
inline bool is_fp8(Compute c) { return c != Compute::storage; }  // either FP8 recipe

struct LayerConfig {
  int64_t T = 0;  // tokens
  int64_t d = 0;  // hidden size
  int64_t n = 0;  // expert intermediate size
  int64_t E = 0;  // experts
  int64_t K = 0;  // experts per token (top-K); plans from token rounding may deviate per token
  Activation activation = Activation::swiglu;
  DType dtype = DType::bf16;  // storage dtype of x, w1, w2, out and all gradients
  Compute compute = Compute::storage;

  int64_t w1_rows() const { return is_gated(activation) ? 2 * n : n; }  // rows of w1 per expert
  // Bytes of H kept for backward (keep_h) for S slots: (S, w1_rows) in the storage dtype, or
  // with fp8 compute (S, w1_rows) e4m3 codes then, from the next 16-byte boundary, (S,
  // ceil(w1_rows/128)) fp32 scales.
  size_t kept_h_bytes(int64_t S) const;
  size_t kept_h_scales_offset(int64_t S) const;  // fp8: where the scales start; else the size
  // Throws InvalidArgument naming the field, e.g. "top_k K (9) exceeds num_experts E (8)".
  // Rules: activation and dtype (fp32 / bf16) in range; T >= 0; d, n in [1, 2^31); 1 <= K <= E;
  // T*K < 2^31; the bytes of x, w1 and w2 within int64 (no size derived from them can wrap);
  // compute in range, fp8 with bf16 storage only.
  void validate() const;
};

// FLOPs by docs/DESIGN.md's count for S assignments (router excluded).
inline double forward_flops(const LayerConfig& c, int64_t S) {
  return (is_gated(c.activation) ? 6.0 : 4.0) * double(S) * double(c.n) * double(c.d);
}
inline double backward_flops(const LayerConfig& c, int64_t S) { return 2.0 * forward_flops(c, S); }

}  // namespace moeblaze
