// Host side of the grouped GEMMs' CTA rasterization (sm90_gemm_core.cuh, raster_tile): the band
// height, read once per process from MOEBLAZE_GEMM_RASTER_GROUP so that one binary can time
// several orders. Host-only, no CUDA headers.
#pragma once

#include <cstdint>

namespace moeblaze::cuda::gemm::sm90 {

// Band height used when MOEBLAZE_GEMM_RASTER_GROUP is unset. 16 measured on the H200
// (bench/NOTES.md, "CTA rasterization"), against 1 (the row-major tile order): mb-conf4
// up-proj 25.8 -> 20.7 ms, dW2 12.8 -> 11.6 ms, layer total 106.9 -> 101.1 ms.
constexpr int kDefaultRasterGroup = 16;

// MOEBLAZE_GEMM_RASTER_GROUP (an integer in [1, 65536]) or kDefaultRasterGroup; throws
// InvalidArgument naming the variable when it is set to anything else. Read on the first call.
int raster_group();

// raster_group() clamped to [1, m_tiles], so that group * n_tiles <= m_tiles * n_tiles fits the
// grid's int range.
inline int raster_group_for(int64_t m_tiles) {
  const int64_t g = raster_group();
  return static_cast<int>(g < m_tiles ? g : (m_tiles > 0 ? m_tiles : 1));
}

}  // namespace moeblaze::cuda::gemm::sm90
