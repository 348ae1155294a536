// Host side of the grouped GEMMs' CTA rasterization (sm90_gemm_core.cuh, raster_tile): the band
// height. Host-only, no CUDA headers.
#pragma once

#include <cstdint>

namespace moeblaze::cuda::gemm::sm90 {

// The band height in force: the `raster` kernel override (kernel_config.hpp) or
// kDefaultRasterGroup (16: a resident wave then touches fewer distinct A and B tiles than in the
// row-major order, G = 1, so more of them are L2 hits;
// docs/notes/gathered-gemms.md).
// The launchers take it as an argument and clamp it (clamp_raster_group).
int raster_group();

}  // namespace moeblaze::cuda::gemm::sm90
