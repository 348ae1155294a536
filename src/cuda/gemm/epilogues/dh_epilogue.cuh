// The dH epilogue's arithmetic, shared by its kernels (dh_proj.cu: 2-CTA; ws_gather_gemms.cuh:
// warp-specialised, both schedules). They differ in how a thread reaches its accumulators and H
// values and in how many ds partials a tile writes, not in what one column pair computes.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/activation.cuh"
#include "cuda/gemm/pipeline/sm90_gemm_core.cuh"  // pack_bf16x2
#include "moeblaze/config.hpp"
#include "moeblaze/dtype.hpp"
#include "moeblaze/routing_plan.hpp"

namespace moeblaze::cuda::gemm::sm90 {

struct DhParams {
  const __nv_bfloat16* h;     // (S, w1_rows)
  const float* slot_weights;  // (S,)
  float* ds_partials;         // (S, ds_cols), ds_cols = ceil(n / 128)
  int ds_cols;
  __nv_bfloat16* dh;          // (S, w1_rows)
  __nv_bfloat16* a_scaled;    // (S, n)
  int n;
  Activation act;
  bool gated;
};

// dh_proj's arguments as the epilogue reads them; ds_cols from the host (ds_partials_cols(n)).
inline DhParams make_dh_params(const RoutingPlanView& plan, const bf16* h, float* ds_partials,
                               int64_t ds_cols, bf16* dh, bf16* a_scaled, int64_t n,
                               Activation act) {
  return DhParams{reinterpret_cast<const __nv_bfloat16*>(h),
                  plan.slot_weights,
                  ds_partials,
                  static_cast<int>(ds_cols),
                  reinterpret_cast<__nv_bfloat16*>(dh),
                  reinterpret_cast<__nv_bfloat16*>(a_scaled),
                  static_cast<int>(n),
                  act,
                  is_gated(act)};
}

// SiLU and its derivative at x from one fast sigmoid (cuda/activation.cuh's dev_sigmoid_fast,
// the up-projection's), for the swiglu-only dH kernels.
__device__ __forceinline__ void dev_silu_and_grad_fast(float x, float& f, float& fg) {
  const float sg = dev_sigmoid_fast(x);
  f = x * sg;
  fg = sg * (1.0f + x * (1.0f - sg));
}

// Columns j, j + 1 of one slot's row: da' = (dap0, dap1) from the accumulators, H = g (and u for
// gated activations, entering as phi(u): cuda/activation.cuh) as stored, s the slot weight.
// Gives the words of dh[j, j+1] (dg), of dh[n + j, n + j + 1] (du, gated only) and of
// a_scaled[j, j+1] (as); adds da'_j a_j then da'_{j+1} a_{j+1} to part (a fixed order; each
// kernel fixes the order of the pairs). kFast (swiglu only): the fast sigmoid, for the kernels
// compiled for swiglu alone (in the shared activation switch its shorter code raised spills).
template <Activation A, bool kFast = false>
__device__ __forceinline__ void dh_pair_words(float dap0, float dap1, float s, __nv_bfloat162 g2,
                                              __nv_bfloat162 u2, uint32_t& dg, uint32_t& du,
                                              uint32_t& as, float& part) {
  constexpr bool kGated = dev_is_gated(A);
  const float da0 = s * dap0, da1 = s * dap1;
  const float2 g = __bfloat1622float2(g2);
  if constexpr (kGated && kFast && A == Activation::swiglu) {
    const float2 u = __bfloat1622float2(u2);
    float f0, f1, fg0, fg1;
    dev_silu_and_grad_fast(g.x, f0, fg0);
    dev_silu_and_grad_fast(g.y, f1, fg1);
    const float a0 = f0 * u.x, a1 = f1 * u.y;
    part += dap0 * a0;
    part += dap1 * a1;
    dg = pack_bf16x2(da0 * u.x * fg0, da1 * u.y * fg1);
    du = pack_bf16x2(da0 * f0, da1 * f1);
    as = pack_bf16x2(s * a0, s * a1);
  } else if constexpr (kGated) {
    const float2 u = __bfloat1622float2(u2);
    const float f0 = dev_act(A, g.x), f1 = dev_act(A, g.y);
    const float p0 = dev_up(A, u.x), p1 = dev_up(A, u.y);  // u.x, u.y except for swiglu_oai
    const float a0 = f0 * p0, a1 = f1 * p1;
    part += dap0 * a0;
    part += dap1 * a1;
    dg = pack_bf16x2(da0 * p0 * dev_act_grad(A, g.x), da1 * p1 * dev_act_grad(A, g.y));
    du = pack_bf16x2(dev_up_grad_times(A, da0 * f0, u.x), dev_up_grad_times(A, da1 * f1, u.y));
    as = pack_bf16x2(s * a0, s * a1);
  } else {
    (void)u2;
    const float a0 = dev_act(A, g.x), a1 = dev_act(A, g.y);
    part += dap0 * a0;
    part += dap1 * a1;
    dg = pack_bf16x2(da0 * dev_act_grad(A, g.x), da1 * dev_act_grad(A, g.y));
    du = 0;
    as = pack_bf16x2(s * a0, s * a1);
  }
}

}  // namespace moeblaze::cuda::gemm::sm90
