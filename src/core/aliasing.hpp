// The aliasing rule of every entry point that writes caller memory: an output shares no byte
// with an input or with another output. Kernels write some outputs before they have finished
// reading the inputs (backward writes dx before the weight-gradient phase reads x and d_out),
// so any overlap would give a wrong result; it is rejected instead.
#pragma once

#include <cstddef>
#include <vector>

#include "moeblaze/tensor.hpp"

namespace moeblaze {

// `bytes` of caller memory at `data` (any device: device addresses are compared the same way),
// named as in the entry point's signature. Empty ranges overlap nothing.
struct ByteRange {
  const void* data = nullptr;
  size_t bytes = 0;
  const char* name = "";
};
inline ByteRange byte_range(const TensorView& t, const char* name) {
  return {t.data, t.data ? t.bytes() : 0, name};
}

// Throws InvalidArgument "dx overlaps x in memory: ..." for the first output that overlaps an
// input or an earlier output.
void require_disjoint(const std::vector<ByteRange>& outputs, const std::vector<ByteRange>& inputs);

}  // namespace moeblaze
