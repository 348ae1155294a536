// Host side of the gathered GEMMs' launch switches read from the kernel overrides: the CTA
// rasterization's band height (sm90_gemm_core.cuh, raster_tile) and half tiles. Host-only, no
// CUDA headers.
#pragma once

#include <cstdint>

namespace moeblaze::cuda::gemm::sm90 {

// The band height in force: the `raster` kernel override (kernel_config.hpp) or
// kDefaultRasterGroup (16: a resident wave then touches fewer distinct A and B tiles than in the
// row-major order, G = 1, so more of them are L2 hits;
// docs/notes/gathered-gemms.md).
// The launchers take it as an argument and clamp it (clamp_raster_group).
int raster_group();

// The `half_tiles` kernel override (default off): in the ws_gather kernel's cooperative schedule,
// a consumer warpgroup whose 64 rows of a tile all lie past its expert's end skips its MMAs, and
// with A by TMA those rows are not loaded. A tile's valid rows come out bitwise the same; only
// experts' last tiles with at most 64 rows do less work (docs/notes/gathered-gemms.md, "Open").
bool half_tiles();

}  // namespace moeblaze::cuda::gemm::sm90
