// Host side of the grouped GEMMs' CTA rasterization (sm90_gemm_core.cuh, raster_tile): the band
// height. Host-only, no CUDA headers.
#pragma once

#include <cstdint>

namespace moeblaze::cuda::gemm::sm90 {

// The band height in force: the `raster` kernel override (kernel_config.hpp) or
// kDefaultRasterGroup (16: a resident wave then touches fewer distinct A and B tiles than in the
// row-major order, G = 1, so more of them are L2 hits;
// docs/experiments/2026-11-29-cta-rasterization.md).
int raster_group();

// raster_group() clamped to [1, m_tiles], so that group * n_tiles <= m_tiles * n_tiles fits the
// grid's int range.
inline int raster_group_for(int64_t m_tiles) {
  const int64_t g = raster_group();
  return static_cast<int>(g < m_tiles ? g : (m_tiles > 0 ? m_tiles : 1));
}

}  // namespace moeblaze::cuda::gemm::sm90
