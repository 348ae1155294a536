// The FP8 layer's passes between its GEMMs (docs/FP8.md; act_quantize.cu): the activation and its
// backward on one slot row at a time, with the 1x128 quantization of what the next FP8 GEMM
// reads (and of the kept H). Codes and scales follow src/core/fp8.hpp's rules (the device steps
// of fp8_device.cuh); the activation formulas are src/cuda/activation.cuh's, so the CPU
// emulation (src/cpu/layer_forward.cpp, layer_backward.cpp) computes the same values up to
// rounding.
//
// Conventions: R = w1_rows (2n gated, n otherwise); n a multiple of 128, so every 1x128 group of
// a row lies in one half (gate or up) of H and dH; device pointers, H and dA' rows 8-byte
// aligned (16-byte aligned bases); each warp takes a few (slot row, 128 columns of a) tasks;
// fixed summation orders (the outputs do not depend on the launch shape); asynchronous on
// `stream`, no allocation, no host sync; arguments checked before the launch (InvalidArgument /
// Unsupported, nothing written); S == 0 launches nothing.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moeblaze/config.hpp"
#include "moeblaze/dtype.hpp"

namespace moeblaze::cuda::fp8 {

// Forward, between the up- and the down-projection, per slot s of expert e(s):
//   h   = H[s] + b1[e(s)]                  fp32; H (S, R) bf16, b1 (E, R) bf16 or null (e(s) from
//                                          expert_offsets (E+1,), read only when b1 is given)
//   a   = act(h)                           (n,) fp32
//   a_q (S, n) codes, a_s (S, n/128)       a in 1x128 tiles (null: not written; recompute's
//                                          backward needs H alone)
//   h_q (S, R) codes, h_s (S, R/128)       h in 1x128 tiles: the kept H (null: not written)
void act_quantize_async(const bf16* h, int64_t S, int64_t n, Activation act, const bf16* b1,
                        const int32_t* expert_offsets, int64_t E, uint8_t* a_q, float* a_s,
                        uint8_t* h_q, float* h_s, cudaStream_t stream);

// Backward, between dA' = dO W2 and dX~ = dH W1, per slot s with weight w = slot_weights[s]:
//   h         = h_q[s] · h_s[s]            the dequantized kept (or recomputed) H, (R,)
//   a         = act(h)
//   ds[s]     = Σ_j dA'[s, j] a_j          fp32, (S,): per 128 columns into ds_partials
//                                          (S, n/128), then summed in column order
//   a_scaled  = w a                        (S, n) bf16: dW2's operand
//   dh        = act'(h, w dA'[s])          fp32 -> dh (S, R) bf16 (dW1's operand and db1's) and
//   dh_q (S, R) codes, dh_s (S, R/128)     its 1x128 tiles from the fp32 values (dX~'s operand)
void dact_quantize_async(const uint8_t* h_q, const float* h_s, const bf16* da,
                         const float* slot_weights, int64_t S, int64_t n, Activation act,
                         bf16* a_scaled, float* ds_partials, float* ds, bf16* dh, uint8_t* dh_q,
                         float* dh_s, cudaStream_t stream);

}  // namespace moeblaze::cuda::fp8
