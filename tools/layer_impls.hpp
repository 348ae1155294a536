// The layer implementations the CLI runs by name (`moeblaze run --impl`, `moeblaze bench layer
// --impl`): docs/DESIGN.md's `impl` names, each a layer mode and the precision of its GEMMs.
#pragma once

#include <string>

#include "moeblaze/moeblaze.hpp"

namespace moeblaze::tools {

// What one --impl name runs. FP8 compute adds "-fp8" to a moeblaze name.
struct Impl {
  LayerMode mode;
  Compute compute;
  const char* name;  // the --impl name, the table's row, the JSON row's "impl"
  const char* help;  // --impl's help text
};

// The one place that maps names to (mode, compute) and back.
inline constexpr Impl kImpls[] = {
    {LayerMode::keep_h, Compute::storage, "moeblaze",
     "keeps H and the plan; atomic-free plan build"},
    {LayerMode::recompute, Compute::storage, "moeblaze-recompute",
     "keeps only the plan; recomputes H in backward"},
    {LayerMode::materialized, Compute::storage, "materialized",
     "baseline: sort-based plan, copies x to (S, d), keeps every intermediate"},
    {LayerMode::keep_h, Compute::fp8, "moeblaze-fp8",
     "moeblaze with FP8 compute: e4m3 operands with 1x128 / 128x128 scales for the four data "
     "GEMMs, H kept as e4m3 codes + scales, weight gradients in bf16; bf16 storage only"},
    {LayerMode::recompute, Compute::fp8, "moeblaze-recompute-fp8",
     "moeblaze-recompute with FP8 compute"},
    {LayerMode::keep_h, Compute::fp8_wgrad, "moeblaze-fp8-wgrad",
     "moeblaze-fp8 with the weight gradients in FP8 too (128x1 tiles along each expert's "
     "tokens): all six GEMMs on e4m3 operands"},
};

// "moeblaze, moeblaze-recompute, ..."
std::string impl_names();

// The Impl named s; InvalidArgument naming the valid names otherwise.
const Impl& parse_impl(const std::string& s);

// Error bound of `run --check` and `bench layer --check`: bf16 storage rounds every stored value (x, w, H, out, gradients) to
// 8 significant bits, ~2^-9 relative each, compounded over a few roundings; fp32 storage leaves
// only fp32 accumulation error over sums of length d, n or S/E. FP8 compute: e4m3's 3-bit
// mantissa gives ~0.036 per quantized operand, out and dx pass two quantized GEMMs in series;
// 0.1 bounds them with margin (kFp8Tol of tests/cpu/test_layer_fp8.cpp, which says why) and stays
// far below a broken path (a wrong scale or a missed operand is O(1)). Not for relu: e4m3 operands
// flip the sign of H entries near zero and relu's step derivative turns each flip into a whole
// dH error (dx, dw1 0.16 at cpu-default; docs/notes/fp8.md).
double check_tolerance(const Impl& impl, DType dtype);

}  // namespace moeblaze::tools
