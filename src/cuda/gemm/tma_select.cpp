// Which kernel the layer's GEMMs run: the TMA path of down_proj / dx_proj (and how much scratch it
// needs) and the warp-specialised path of the gathered GEMMs.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/gemm/tma_paths.hpp"
#include "cuda/gemm/ws_paths.hpp"

namespace moeblaze::cuda::gemm {
namespace {
// -2: not read yet; -1: automatic; 0 / 1: forced by MOEBLAZE_GEMM_TMA.
std::atomic<int> g_forced{-2};

int forced() {
  int f = g_forced.load();
  if (f == -2) {
    const char* env = std::getenv("MOEBLAZE_GEMM_TMA");
    f = !env ? -1 : std::strcmp(env, "1") == 0 ? 1 : std::strcmp(env, "0") == 0 ? 0 : -1;
    g_forced.store(f);
  }
  return f;
}
}  // namespace

bool use_tma_gemm(int64_t S, int64_t E) {
  if (S <= 0 || E <= 0) return false;
  const int f = forced();
  if (f >= 0) return f == 1;
  return S >= E * kTmaMinRowsPerExpert;
}

bool use_ws_gather(int64_t E) {
  static const bool off = [] {
    const char* env = std::getenv("MOEBLAZE_GEMM_WS");
    return env && std::strcmp(env, "0") == 0;
  }();
  return !off && detail::ws_gather_supports(E);
}

size_t tma_gemm_scratch_bytes(int64_t E) {
  const int e = static_cast<int>(E);
  return std::max(detail::down_proj_tma_scratch_bytes(e), detail::dx_proj_tma_scratch_bytes(e));
}

size_t layer_gemm_scratch_bytes(int64_t S, int64_t E) {
  return use_tma_gemm(S, E) ? tma_gemm_scratch_bytes(E) : 0;
}

}  // namespace moeblaze::cuda::gemm
