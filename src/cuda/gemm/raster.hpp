// Host side of the grouped GEMMs' CTA rasterization (sm90_gemm_core.cuh, raster_tile): the band
// height. Host-only, no CUDA headers.
#pragma once

#include <cstdint>

namespace moeblaze::cuda::gemm::sm90 {

// The band height in force: the `raster` kernel override (kernel_config.hpp) or
// kDefaultRasterGroup (16, measured on the H200 against 1, the row-major tile order: mb-conf4
// up-proj 25.8 -> 20.7 ms, dW2 12.8 -> 11.6 ms).
int raster_group();

// raster_group() clamped to [1, m_tiles], so that group * n_tiles <= m_tiles * n_tiles fits the
// grid's int range.
inline int raster_group_for(int64_t m_tiles) {
  const int64_t g = raster_group();
  return static_cast<int>(g < m_tiles ? g : (m_tiles > 0 ? m_tiles : 1));
}

}  // namespace moeblaze::cuda::gemm::sm90
