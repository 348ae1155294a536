// MOEBLAZE_GEMM_RASTER_GROUP: the CTA rasterization of the grouped GEMMs (sm90_gemm_core.cuh,
// raster_tile), read once per process so a benchmark can time two orders from the same binary.
#include <cerrno>
#include <cstdlib>
#include <string>

#include "cuda/gemm/raster.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda::gemm::sm90 {
namespace {

int parse_raster_group() {
  const char* env = std::getenv("MOEBLAZE_GEMM_RASTER_GROUP");
  if (env == nullptr || *env == '\0') return kDefaultRasterGroup;
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(env, &end, 10);
  MOEBLAZE_REQUIRE(errno == 0 && end != env && *end == '\0' && v >= 1 && v <= 65536,
                   "MOEBLAZE_GEMM_RASTER_GROUP (\"", std::string(env),
                   "\") must be an integer in [1, 65536]");
  return static_cast<int>(v);
}

}  // namespace

int raster_group() {
  static const int group = parse_raster_group();
  return group;
}

}  // namespace moeblaze::cuda::gemm::sm90
