// Which kernel the layer's GEMMs run: the TMA path of down_proj / dx_proj (and how much scratch it
// needs) and the warp-specialised path of the gathered GEMMs; describe_kernels prints the choice.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/gemm/tma_paths.hpp"
#include "cuda/gemm/ws_paths.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda::gemm {
namespace {
// -2: not read yet; -1: automatic; 0 / 1: forced by MOEBLAZE_GEMM_TMA.
std::atomic<int> g_forced{-2};

// An A/B switch that forces a kernel choice: 1 / 0 when the environment variable `name` is "1" /
// "0", -1 (automatic) otherwise.
int env_forced(const char* name) {
  const char* env = std::getenv(name);
  return !env ? -1 : std::strcmp(env, "1") == 0 ? 1 : std::strcmp(env, "0") == 0 ? 0 : -1;
}

int forced() {
  int f = g_forced.load();
  if (f == -2) {
    f = env_forced("MOEBLAZE_GEMM_TMA");
    g_forced.store(f);
  }
  return f;
}

// Whether the environment variable `name` is "0" (the A/B switches that turn a kernel off).
bool env_is_zero(const char* name) {
  const char* env = std::getenv(name);
  return env && std::strcmp(env, "0") == 0;
}
}  // namespace

bool use_tma_gemm(int64_t S, int64_t E) {
  if (S <= 0 || E <= 0) return false;
  const int f = forced();
  if (f >= 0) return f == 1;
  return S >= E * kTmaMinRowsPerExpert;
}

bool use_ws_gather(int64_t E) {
  static const bool off = env_is_zero("MOEBLAZE_GEMM_WS");
  return !off && detail::ws_gather_supports(E);
}

bool use_ws_dh(int64_t E, int64_t d) { return use_ws_gather(E) && d >= kWsDhMinD; }

namespace {
bool ping_pong_on() {
  static const bool off = env_is_zero("MOEBLAZE_GEMM_PP");
  return !off;
}
}  // namespace

namespace detail {
GatherPath resolve_gather_path(const char* fn, GatherKernel kernel, int64_t E,
                               GatherPath automatic_path, bool has_ping_pong) {
  MOEBLAZE_UNSUPPORTED_IF(kernel == GatherKernel::ping_pong && !has_ping_pong, fn,
                          ": GatherKernel::ping_pong is implemented for up_proj and dh_proj only");
  MOEBLAZE_UNSUPPORTED_IF(
      (kernel == GatherKernel::warp_specialized || kernel == GatherKernel::ping_pong) &&
          !ws_gather_supports(E),
      fn, ": the warp-specialised kernel takes E <= 4096 experts (got ", E, ")");
  switch (kernel) {
    case GatherKernel::two_cta: return GatherPath::two_cta;
    case GatherKernel::warp_specialized: return GatherPath::cooperative;
    case GatherKernel::ping_pong: return GatherPath::ping_pong;
    case GatherKernel::automatic: break;
  }
  return automatic_path;
}

GatherPath up_proj_auto_path(int64_t E) {
  // Cooperative at every d measured (bench/NOTES.md).
  return use_ws_gather(E) ? GatherPath::cooperative : GatherPath::two_cta;
}

GatherPath dh_proj_auto_path(int64_t E, int64_t d) {
  if (!use_ws_dh(E, d)) return GatherPath::two_cta;
  return ping_pong_on() && d < kWsDhCoopMinD ? GatherPath::ping_pong : GatherPath::cooperative;
}

bool dw1_uses_clusters(int64_t S, int64_t E) {
  const int f = env_forced("MOEBLAZE_GEMM_MC");  // at every launch (the tests flip it)
  if (f >= 0) return f == 1;
  return E > 0 && S >= E * kDw1ClusterMinRowsPerExpert;
}
}  // namespace detail

std::vector<KernelChoice> describe_kernels(int64_t S, int64_t E, int64_t d) {
  using detail::GatherPath;
  const bool ws = use_ws_gather(E), tma = use_tma_gemm(S, E);
  const GatherPath up = detail::up_proj_auto_path(E), dh = detail::dh_proj_auto_path(E, d);
  const std::string ws_m =
      "warp-specialised gather (sm90_ws_gather.cuh): persistent, 128x256x64 tiles shared by two "
      "consumer warpgroups (cooperative), 4 stages, A rows by cp.async, weights by TMA";
  const std::string pp_m =
      "warp-specialised gather (sm90_ws_gather.cuh), ping-pong: persistent, 128x128x64 tiles, "
      "one per consumer warpgroup (epilogue under the other's mainloop), 6 stages, A rows by "
      "cp.async, weights by TMA";
  const std::string two_cta =
      "2-CTA (sm90_varlen_m.cuh): 128x128x64 tiles, 3 stages, cp.async by all threads";
  const std::string tma_path =
      "CUTLASS TMA pointer-array (sm90_tma_grouped.cuh): persistent, 128x256x64 tiles, "
      "cluster 2x1";
  const std::string ws_k =
      "warp-specialised varlen-K (sm90_ws_varlen_k.cuh): persistent, 128x256x64 tiles, 4 "
      "stages, gathered rows by cp.async, slot rows by TMA";
  const std::string dw1_clusters =
      detail::dw1_uses_clusters(S, E)
          ? ", 2-CTA clusters sharing dh by TMA multicast [S >= " +
                std::to_string(detail::kDw1ClusterMinRowsPerExpert) + " E, or MOEBLAZE_GEMM_MC=1]"
          : "";
  const std::string two_cta_k = "2-CTA varlen-K (dw_proj.cu): 128x128x64 tiles, 3 stages";
  const std::string why_ws = ws ? "" : (detail::ws_gather_supports(E) ? " [MOEBLAZE_GEMM_WS=0]"
                                                                      : " [E > 4096]");
  const std::string min_rows = std::to_string(kTmaMinRowsPerExpert);
  const std::string why_tma = tma ? " [S >= " + min_rows + " E]"
                                  : " [S < " + min_rows + " E, or MOEBLAZE_GEMM_TMA=0]";
  const std::string pp_off = ping_pong_on() ? "" : ", MOEBLAZE_GEMM_PP=0";
  std::string up_s, dh_s;
  if (up == GatherPath::two_cta)
    up_s = two_cta + ", w1 by TMA unless MOEBLAZE_GEMM_TMA_B=0" + why_ws;
  else
    up_s = ws_m;
  if (dh == GatherPath::two_cta)
    dh_s = two_cta + (ws ? " [d < 2048: the gather kernels' epilogue is not amortised]" : why_ws);
  else if (dh == GatherPath::ping_pong)
    dh_s = pp_m + " [2048 <= d < 4096]";
  else
    dh_s = ws_m + (d >= kWsDhCoopMinD ? " [d >= 4096]" : " [d >= 2048" + pp_off + "]");
  return {
      {"up_proj", up_s},
      {"down_proj", (tma ? tma_path : two_cta) + why_tma},
      {"dh_proj", dh_s},
      {"dw2_proj", (ws ? ws_k : two_cta_k) + why_ws},
      {"dx_proj", (tma ? tma_path : two_cta) + why_tma},
      {"dw1_proj", (ws ? ws_k + ", computed transposed" + dw1_clusters : two_cta_k) + why_ws},
  };
}

size_t tma_gemm_scratch_bytes(int64_t E) {
  const int e = static_cast<int>(E);
  return std::max(detail::down_proj_tma_scratch_bytes(e), detail::dx_proj_tma_scratch_bytes(e));
}

size_t layer_gemm_scratch_bytes(int64_t S, int64_t E) {
  return use_tma_gemm(S, E) ? tma_gemm_scratch_bytes(E) : 0;
}

}  // namespace moeblaze::cuda::gemm
