// Device-side steps of the FP8 quantization rules of src/core/fp8.hpp, shared by the
// standalone quantizers (quantize.cu) and, later, the GEMM producers / epilogues that fuse
// quantization. Each step reproduces the CPU core bit for bit:
//   widen     bf16 -> fp32 by a 16-bit shift (exact), fp32 as is;
//   amax      an unsigned max over the bit patterns of |x|: for non-negative floats the integer
//             order is the float order, and NaN patterns (> 0x7F800000) sort above Inf, so a NaN
//             anywhere makes the result a NaN pattern (fmaxf would drop it);
//   scale     fp8_scale(amax): NaN (0x7FC00000) for NaN/Inf amax, 1 for 0, else
//             max(amax, kFp8MinAmax) / 448 by div.rn.f32;
//   codes     cvt.rn.satfinite.e4m3x2.f32 of x / scale (div.rn.f32); a NaN scale gives 0x7F.
// The divisions are inline PTX div.rn.f32, not __fdiv_rn or '/': nvcc lowers __fdiv_rn to
// div.rn.ftz.f32 under -ftz=true or --use_fast_math (checked with nvcc 13.0 -ptx), which would
// flush the subnormal inputs of floor-scaled groups to zero. Inline PTX is passed to ptxas as
// written, so these steps do not depend on the compile flags. The conversion is cuda_fp8.hpp's
// __nv_cvt_float2_to_fp8x2 (inline PTX cvt.rn.satfinite.e4m3x2.f32 on sm_89+, no .ftz form).
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/fp8.hpp"

namespace moeblaze::cuda::fp8 {

// IEEE fp32 division, round to nearest even, subnormals kept (never fast-math'd).
__device__ __forceinline__ float div_rn(float a, float b) {
  float q;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(q) : "f"(a), "f"(b));
  return q;
}

// Bit pattern of |x| for the NaN-keeping amax (see the header comment).
__device__ __forceinline__ uint32_t abs_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }

// NaN-keeping max of two |x| bit patterns.
__device__ __forceinline__ uint32_t amax_merge(uint32_t a, uint32_t b) { return a > b ? a : b; }

// fp8_scale of the amax whose bit pattern is amax_bits (a max of abs_bits values).
__device__ __forceinline__ float scale_from_amax_bits(uint32_t amax_bits) {
  if (amax_bits >= 0x7f800000u) return __uint_as_float(kFp8NaNScaleBits);  // NaN or Inf
  if (amax_bits == 0u) return 1.0f;
  const uint32_t floor_bits = __float_as_uint(kFp8MinAmax);  // integer max: no float compare
  return div_rn(__uint_as_float(amax_bits > floor_bits ? amax_bits : floor_bits), kE4m3Max);
}

__device__ __forceinline__ bool is_nan_scale(float scale) {
  return (__float_as_uint(scale) & 0x7fffffffu) > 0x7f800000u;
}

// Codes of (x0, x1) under one finite scale: x0 in the low byte (cvt's b operand).
__device__ __forceinline__ uint16_t codes2(float x0, float x1, float scale) {
  return __nv_cvt_float2_to_fp8x2(make_float2(div_rn(x0, scale), div_rn(x1, scale)),
                                  __NV_SATFINITE, __NV_E4M3);
}

// The conversion alone, e4m3::from_float: cvt.rn.satfinite, with NaN inputs of either sign
// mapped to the canonical 0x7F explicitly (the PTX ISA only says "NaN").
__device__ __forceinline__ uint8_t e4m3_from_float(float x) {
  if ((__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u) return kE4m3NaN;
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

// e4m3::to_float: exact (every e4m3 value is a half value); 0x7F / 0xFF give NaN.
__device__ __forceinline__ float e4m3_to_float(uint8_t b) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3)));
}

}  // namespace moeblaze::cuda::fp8
