// The varlen kernels' CTA band height and the gather kernel's half tiles: kernel_config.hpp's
// overrides or their defaults.
#include "cuda/gemm/dispatch/raster.hpp"

#include "cuda/gemm/dispatch/kernel_config.hpp"

namespace moeblaze::cuda::gemm::sm90 {

int raster_group() { return kernel_overrides().raster_group.value_or(kDefaultRasterGroup); }

bool half_tiles() { return kernel_overrides().half_tiles.value_or(false); }

}  // namespace moeblaze::cuda::gemm::sm90
