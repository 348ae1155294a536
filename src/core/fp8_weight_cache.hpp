// Fp8WeightCache's state (include/moeblaze/layer.hpp): the codes the CUDA backend's FP8 path
// (src/cuda/layer/layer_fp8.cu) keeps between calls, and what they were made from.
#pragma once

#include <cstdint>

#include "moeblaze/layer.hpp"
#include "moeblaze/memory.hpp"

namespace moeblaze {

struct Fp8WeightCache::State {
  Buffer codes;  // W1, W1ᵀ, W2, W2ᵀ codes and scales (layer_fp8.cu lays them out)
  // The weights and shape the codes were made from; valid = false: requantize at the next call.
  const void* w1 = nullptr;
  const void* w2 = nullptr;
  int64_t E = 0, w1_rows = 0, d = 0, n = 0;
  bool valid = false;
  int64_t quantizations = 0;
};

}  // namespace moeblaze
