// FP8 operands of the weight-gradient GEMMs (docs/FP8.md): dW1 = dHᵀ X and dW2 = dOᵀ A' reduce over
// the tokens of each expert, so their FP8 operands are quantized along the TOKEN axis — 128x1
// tiles, 128 consecutive slots of one column sharing a scale — and stored K-major (the expert's
// tokens contiguous, as FP8 WGMMA reads both operands), each expert's block padded to whole
// 128-token groups so that no group straddles two experts. Codes and scales are bit-identical to
// src/core/fp8.hpp's rules applied to each column's (up to) 128 values (quantize_1x128 of the
// transposed segment); the device steps are src/cuda/fp8/fp8_device.cuh. Internal to the CUDA
// backend, like quantize.hpp.
//
// Conventions:
//   * Device pointers; the expert offsets are the plan's expert_token_offsets (E+1,), int32,
//     non-decreasing from 0 (the plan's are validated), S = expert_token_offsets[E].
//   * Padded layout: expert e's P_e = max(128, roundup(K_e, 128)) slots start at poff[e]. An
//     empty expert still gets one group (all zero codes, scale 1): CUTLASS's grouped GEMM leaves
//     a K = 0 problem's accumulators unset, while a zero group makes its dW exactly 0.
//   * Asynchronous on `stream`: no host synchronisation (the padded sizes stay on the device; the
//     host sizes its buffers with padded_tokens_bound), no allocation, no atomics (capturable in
//     a CUDA graph). Arguments are checked before the launch (InvalidArgument / Unsupported,
//     nothing written); the launch error is checked (DeviceError).
//   * Every group is reduced and written by fixed threads in a fixed order: the output does not
//     depend on the launch shape.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moeblaze/dtype.hpp"

namespace moeblaze::cuda::fp8 {

// Each expert's token segment padded for the FP8 weight-gradient GEMMs: P_e = max(128,
// roundup(K_e, 128)), K_e = expert_token_offsets[e+1] - expert_token_offsets[e]; an empty expert
// gets one all-zero group (CUTLASS leaves a K = 0 tile's accumulators unset).
// poff (E+1,) int32: poff[0] = 0, poff[e+1] = poff[e] + P_e. One CTA, no host sync. E >= 1
// (InvalidArgument otherwise); S + 128 E must fit in int32 (the caller's: S is not known here).
void padded_token_offsets_async(const int32_t* expert_token_offsets, int64_t E, int32_t* poff,
                                cudaStream_t stream);

// Bound on poff[E] known on the host without a sync: S + 128 * E (each P_e <= K_e + 128).
inline int64_t padded_tokens_bound(int64_t S, int64_t E) { return S + 128 * E; }

// src (rows, C) bf16 row-major with row stride ld (elements); the row of slot s is rows_of[s]
// when rows_of is given (X, dO gathered through the plan's expert_token_indices), else s (dH, A'
// stored by slot). For every expert e, column c < C, group g < P_e/128 and i < 128 (slot
// s = off[e] + 128 g + i, off = expert_token_offsets):
//   q [C * poff[e] + c * P_e + 128 g + i]     = e4m3 code of src[row(s), c] under the group's
//                                                scale, 0x00 when s >= off[e+1] (padding, also
//                                                in a NaN-scale group, whose real codes are 0x7F)
//   sc[C * poff[e] / 128 + c * (P_e/128) + g] = fp8_scale(amax of the group's (up to) 128 values)
// i.e. expert e's block is a (C, P_e) K-major code matrix and its (C, P_e/128) K-major scales;
// q holds C * poff[E] bytes, sc C * poff[E] / 128 floats (size them C * padded_tokens_bound(S, E)
// and C * padded_tokens_bound(S, E) / 128). A group with no real slot (padding only, or an empty
// expert) has amax 0 -> scale 1.0f, codes 0.
// C a multiple of 128 (Unsupported otherwise), E >= 1, S >= off[E] (the plan's S), ld >= C,
// q 16-byte aligned (InvalidArgument otherwise); S + 128 E fits in int32; C == 0 writes nothing.
// src is not read past the real slots' rows (it may be null when S == 0); 16-byte loads when
// src and ld * 2 are 16-byte aligned, scalar loads otherwise (same bytes). Launch: one 256-thread
// CTA per (128-token group, 128-column block), padded_tokens_bound(S, E) / 128 (rounded up)
// groups; CTAs past poff[E] exit.
void quantize_tokens_128x1_async(const bf16* src, int64_t ld, const int32_t* rows_of,
                                 const int32_t* expert_token_offsets, const int32_t* poff,
                                 int64_t E, int64_t S, int64_t C, uint8_t* q, float* sc,
                                 cudaStream_t stream);

}  // namespace moeblaze::cuda::fp8
