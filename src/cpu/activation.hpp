// Expert activations and their derivatives, in float, shared by the CPU layer (fused into the
// up-projection tile) and the materialized baseline (a separate pass).
//
// Every activation is built from one scalar function f:
//   gated   (swiglu, geglu, swiglu_oai):  h = [g; u] (2n),  a = f(g) * phi(u)
//           f = silu / gelu / g' sigmoid(1.702 g') with g' = min(g, 7); phi(u) = u, except
//           swiglu_oai's phi(u) = clamp(u, -7, 7) + 1 (gpt-oss)
//   plain   (relu, silu, gelu, relu2):  a = f(h)
// gelu is the exact erf form 0.5 x (1 + erf(x / sqrt 2)), not the tanh approximation: the GPU
// epilogue uses the same erf form, so CPU and GPU agree to rounding.
#pragma once

#include <cmath>
#include <cstdint>

#include "moeblaze/config.hpp"

namespace moeblaze::cpu {

// is_gated() of config.hpp, usable in `if constexpr`.
constexpr bool gated(Activation a) {
  return a == Activation::swiglu || a == Activation::geglu || a == Activation::swiglu_oai;
}

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// gpt-oss's clamped SwiGLU (swiglu_oai): sigmoid's scale and the clamp limit of g and u.
constexpr float kOaiAlpha = 1.702f;
constexpr float kOaiLimit = 7.0f;

// f and f' of each activation (for gated ones, f is the gate's function).
inline float act_fn(Activation act, float x) {
  switch (act) {
    case Activation::swiglu:
    case Activation::silu: return x * sigmoid(x);
    case Activation::geglu:
    case Activation::gelu: return 0.5f * x * (1.0f + std::erf(x * 0.70710678118654752f));
    case Activation::relu: return x > 0.0f ? x : 0.0f;
    case Activation::relu2: return x > 0.0f ? x * x : 0.0f;
    case Activation::swiglu_oai: {
      const float c = x > kOaiLimit ? kOaiLimit : x;  // not std::min: NaN stays NaN, as in torch
      return c * sigmoid(kOaiAlpha * c);
    }
  }
  return 0.0f;
}

inline float act_grad(Activation act, float x) {
  switch (act) {
    case Activation::swiglu:
    case Activation::silu: {
      const float s = sigmoid(x);
      return s * (1.0f + x * (1.0f - s));
    }
    case Activation::geglu:
    case Activation::gelu: {
      // Phi(x) + x phi(x)
      const float cdf = 0.5f * (1.0f + std::erf(x * 0.70710678118654752f));
      const float pdf = 0.39894228040143268f * std::exp(-0.5f * x * x);
      return cdf + x * pdf;
    }
    case Activation::relu: return x > 0.0f ? 1.0f : 0.0f;
    case Activation::relu2: return x > 0.0f ? 2.0f * x : 0.0f;
    case Activation::swiglu_oai: {
      // zero at g == limit too: no gradient at the clamp limits (the library's convention)
      if (!(x < kOaiLimit)) return 0.0f;
      const float s = sigmoid(kOaiAlpha * x);
      return s * (1.0f + kOaiAlpha * x * (1.0f - s));
    }
  }
  return 0.0f;
}

// The gated activations' up transform phi(u): the identity except for swiglu_oai.
inline float up_fn(Activation act, float u) {
  if (act != Activation::swiglu_oai) return u;
  return (u < -kOaiLimit ? -kOaiLimit : u > kOaiLimit ? kOaiLimit : u) + 1.0f;
}

// x * phi'(u) without a multiply: x inside the clamp, 0 outside and at u == +-limit (torch's
// scalar clamp passes no gradient at equality).
inline float up_grad_times(Activation act, float x, float u) {
  if (act != Activation::swiglu_oai) return x;
  return (u > -kOaiLimit && u < kOaiLimit) ? x : 0.0f;
}

// Forward of one row. h: (w1_rows,) = (2n,) gated, (n,) plain; a: (n,).
// The switch sits outside the loop so each loop body is one straight-line function.
template <Activation A>
inline void activation_row_t(const float* h, int64_t n, float* a) {
  if constexpr (gated(A)) {
    for (int64_t i = 0; i < n; ++i) a[i] = act_fn(A, h[i]) * up_fn(A, h[n + i]);
  } else {
    for (int64_t i = 0; i < n; ++i) a[i] = act_fn(A, h[i]);
  }
}

// Backward of one row: dh from da (the gradient of a) and h.
//   gated: dg = da * phi(u) * f'(g), du = da * f(g) * phi'(u);  plain: dh = da * f'(h)
// h, dh: (w1_rows,); da: (n,).
template <Activation A>
inline void activation_backward_row_t(const float* h, const float* da, int64_t n, float* dh) {
  if constexpr (gated(A)) {
    for (int64_t i = 0; i < n; ++i) {
      const float g = h[i], u = h[n + i];
      dh[i] = da[i] * up_fn(A, u) * act_grad(A, g);
      dh[n + i] = up_grad_times(A, da[i] * act_fn(A, g), u);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) dh[i] = da[i] * act_grad(A, h[i]);
  }
}

// Calls fn(std::integral_constant-like tag) with the activation as a compile-time constant, so
// per-row loops are specialised once per activation instead of switching per element.
template <Activation A>
struct ActivationTag {
  static constexpr Activation value = A;
};
template <typename Fn>
inline decltype(auto) dispatch_activation(Activation act, Fn&& fn) {
  switch (act) {
    case Activation::swiglu: return fn(ActivationTag<Activation::swiglu>{});
    case Activation::geglu: return fn(ActivationTag<Activation::geglu>{});
    case Activation::relu: return fn(ActivationTag<Activation::relu>{});
    case Activation::silu: return fn(ActivationTag<Activation::silu>{});
    case Activation::gelu: return fn(ActivationTag<Activation::gelu>{});
    case Activation::relu2: return fn(ActivationTag<Activation::relu2>{});
    case Activation::swiglu_oai: return fn(ActivationTag<Activation::swiglu_oai>{});
  }
  return fn(ActivationTag<Activation::swiglu>{});
}

// Run-time-activation versions of the row functions.
inline void activation_row(Activation act, const float* h, int64_t n, float* a) {
  dispatch_activation(act, [&](auto tag) { activation_row_t<decltype(tag)::value>(h, n, a); });
}
inline void activation_backward_row(Activation act, const float* h, const float* da, int64_t n,
                                    float* dh) {
  dispatch_activation(act, [&](auto tag) {
    activation_backward_row_t<decltype(tag)::value>(h, da, n, dh);
  });
}

}  // namespace moeblaze::cpu
