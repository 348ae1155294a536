// FP8 compute on the CPU (LayerConfig::compute == fp8): the GEMM operands of the recipe as
// fp32 arrays of their dequantized values, so that the ordinary fp32 GEMM kernels compute
// Σ_k (qa_k sa)(qb_k sb): the GPU's Σ_kb sa sb Σ_{k in kb} qa_k qb_k up to fp32 summation order.
// Quantization follows src/core/fp8.hpp's rules exactly (same scales, same codes); the values
// are fake-quantized (quantized, then dequantized in place) instead of stored as codes, except
// H, which is kept as codes and scales (quantize_1x128) for backward.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/fp8.hpp"
#include "cpu/gemm_kernels.hpp"
#include "moeblaze/dtype.hpp"

namespace moeblaze::cpu::fp8 {

// One row of cols values, fake-quantized in 1x128 tiles along it, in place.
inline void fake_quant_row(float* row, int64_t cols) {
  for (int64_t c = 0; c < cols; c += kFp8Group)
    fake_quantize_group(row, cols, 0, 1, c, std::min(cols, c + kFp8Group));
}

// A (rows, cols) storage-dtype matrix as fp32 fake-quantized 1x128 tiles along its rows
// (activations, dO): dst (rows, cols) fp32.
inline void fake_quant_rows(const void* src, DType dt, int64_t rows, int64_t cols, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    gemm::load_row(static_cast<const char*>(src) + r * cols * int64_t(dtype_size(dt)), dt, cols,
                   dst + r * cols);
    fake_quant_row(dst + r * cols, cols);
  }
}

// Rows [r0, r0 + 128) (fewer at the bottom) of a (rows, cols) weight matrix as fp32
// fake-quantized 128x128 blocks: dst (rows, cols) fp32, that row band written.
inline void fake_quant_block_rows(const void* src, DType dt, int64_t rows, int64_t cols,
                                  int64_t r0, float* dst) {
  const int64_t rb = std::min(kFp8Group, rows - r0);
  for (int64_t r = r0; r < r0 + rb; ++r)
    gemm::load_row(static_cast<const char*>(src) + r * cols * int64_t(dtype_size(dt)), dt, cols,
                   dst + r * cols);
  for (int64_t c0 = 0; c0 < cols; c0 += kFp8Group)
    fake_quantize_group(dst, cols, r0, r0 + rb, c0, std::min(cols, c0 + kFp8Group));
}

// Compute fp8_wgrad: a weight-gradient operand, rows [s0, s0 + cnt) of dst (S, cols) fp32 (one
// expert's slots), fake-quantized in 128x1 tiles along the slots: each column's values of slots
// s0 + 128 g .. s0 + 128 g + 127 (fewer at the expert's end) share one scale. The GPU pads each
// expert's slots to a multiple of 128 with zeros, which changes no group's amax.
inline void fake_quant_token_tiles(float* dst, int64_t cols, int64_t s0, int64_t cnt) {
  for (int64_t g = s0; g < s0 + cnt; g += kFp8Group)
    for (int64_t c = 0; c < cols; ++c)
      fake_quantize_group(dst, cols, g, std::min(s0 + cnt, g + kFp8Group), c, c + 1);
}

}  // namespace moeblaze::cpu::fp8
