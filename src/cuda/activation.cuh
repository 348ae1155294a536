// Expert activations on the device, the same formulas as the CPU backend (src/cpu/activation.hpp)
// (gated: a = f(g) * phi(u), phi the identity except for swiglu_oai):
// gelu is the exact erf form, silu uses 1 / (1 + exp(-x)), so CPU and GPU agree to rounding
// (dev_act_fast, the up-projection's, to within 2 ulp of float before the bf16 rounding).
// The one device copy of the formulas: used by the grouped GEMMs' fused epilogues
// (src/cuda/gemm), the naive grouped GEMM (test oracle) and the baselines' unfused passes.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "moeblaze/config.hpp"

namespace moeblaze::cuda {

// Calls f(std::integral_constant<Activation, A>{}) with A = act: the fused epilogues compile one
// straight-line body per activation and branch once per tile instead of once per element.
template <class F>
__device__ __forceinline__ void dispatch_activation(Activation act, F&& f) {
  using A = Activation;
  switch (act) {
    case A::swiglu: return f(std::integral_constant<A, A::swiglu>{});
    case A::geglu: return f(std::integral_constant<A, A::geglu>{});
    case A::relu: return f(std::integral_constant<A, A::relu>{});
    case A::silu: return f(std::integral_constant<A, A::silu>{});
    case A::gelu: return f(std::integral_constant<A, A::gelu>{});
    case A::relu2: return f(std::integral_constant<A, A::relu2>{});
    // swiglu_oai: not here. A case in this shared switch raised the other activations' register
    // use and spills in the fused kernels; it has kernels of its own (up_proj_oai.cu,
    // dh_proj_oai.cu), which the entry points pick for it.
    case A::swiglu_oai: return;
  }
}

// constexpr: the epilogues' kGated is dev_is_gated(A).
__host__ __device__ constexpr bool dev_is_gated(Activation a) {
  return a == Activation::swiglu || a == Activation::geglu || a == Activation::swiglu_oai;
}

// gpt-oss's clamped SwiGLU (swiglu_oai): sigmoid's scale and the clamp limit of g and u.
constexpr float kOaiAlpha = 1.702f;
constexpr float kOaiLimit = 7.0f;

// min(g, limit) as a select, not fminf: NaN stays NaN, as in torch.clamp.
__device__ __forceinline__ float dev_oai_gate(float x) { return x > kOaiLimit ? kOaiLimit : x; }

__device__ __forceinline__ float dev_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// The same with the hardware's exp2 and reciprocal (MUFU) instead of expf and an IEEE division:
// a few instructions instead of ~25 and a slow-path branch, within 2 ulp of float (far below
// bf16's rounding). x -> -inf: exp -> inf, 1 / inf -> 0; x -> +inf: 1. For the up-projection's
// epilogue (dev_act_fast), which measured instruction-bound and 2-25 % faster with it, and the
// dH kernels compiled for swiglu alone (dh_epilogue.cuh's kFast); dH's shared activation switch
// keeps dev_sigmoid: there the shorter code raised spills (docs/notes/dh-epilogue.md).
__device__ __forceinline__ float dev_sigmoid_fast(float x) {
  return __fdividef(1.0f, 1.0f + __expf(-x));
}

// f of the activation (for gated ones, the gate's function).
__device__ __forceinline__ float dev_act(Activation act, float x) {
  switch (act) {
    case Activation::swiglu:
    case Activation::silu: return x * dev_sigmoid(x);
    case Activation::geglu:
    case Activation::gelu: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    case Activation::relu: return x > 0.0f ? x : 0.0f;
    case Activation::relu2: return x > 0.0f ? x * x : 0.0f;
    case Activation::swiglu_oai: {
      const float c = dev_oai_gate(x);
      return c * dev_sigmoid(kOaiAlpha * c);
    }
  }
  return 0.0f;
}

// dev_act with dev_sigmoid_fast for silu / swiglu / swiglu_oai (the up-projection's epilogue).
__device__ __forceinline__ float dev_act_fast(Activation act, float x) {
  if (act == Activation::swiglu || act == Activation::silu) return x * dev_sigmoid_fast(x);
  if (act == Activation::swiglu_oai) {
    const float c = dev_oai_gate(x);
    return c * dev_sigmoid_fast(kOaiAlpha * c);
  }
  return dev_act(act, x);
}

// f'.
__device__ __forceinline__ float dev_act_grad(Activation act, float x) {
  switch (act) {
    case Activation::swiglu:
    case Activation::silu: {
      const float s = dev_sigmoid(x);
      return s * (1.0f + x * (1.0f - s));
    }
    case Activation::geglu:
    case Activation::gelu: {
      const float cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752f));
      const float pdf = 0.39894228040143268f * expf(-0.5f * x * x);
      return cdf + x * pdf;
    }
    case Activation::relu: return x > 0.0f ? 1.0f : 0.0f;
    case Activation::relu2: return x > 0.0f ? 2.0f * x : 0.0f;
    case Activation::swiglu_oai: {
      // zero at g == limit too: no gradient at the clamp limits (the library's convention)
      if (!(x < kOaiLimit)) return 0.0f;
      const float s = dev_sigmoid(kOaiAlpha * x);
      return s * (1.0f + kOaiAlpha * x * (1.0f - s));
    }
  }
  return 0.0f;
}

// The gated activations' up transform phi(u): the identity except for swiglu_oai, so with a
// compile-time act the other activations' code is what it was without it.
__device__ __forceinline__ float dev_up(Activation act, float u) {
  if (act != Activation::swiglu_oai) return u;
  return (u < -kOaiLimit ? -kOaiLimit : u > kOaiLimit ? kOaiLimit : u) + 1.0f;
}

// x * phi'(u) without a multiply: x inside the clamp, 0 outside and at u == +-limit (torch's
// scalar clamp passes no gradient at equality).
__device__ __forceinline__ float dev_up_grad_times(Activation act, float x, float u) {
  if (act != Activation::swiglu_oai) return x;
  return (u > -kOaiLimit && u < kOaiLimit) ? x : 0.0f;
}

}  // namespace moeblaze::cuda
