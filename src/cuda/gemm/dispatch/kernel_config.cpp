// choose_kernels: the measured rules (docs/notes/) as one function of the shape, then the
// overrides; and the one place that reads the environment (MOEBLAZE_KERNELS).
#include "cuda/gemm/dispatch/kernel_config.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "moeblaze/error.hpp"

namespace moeblaze::cuda::gemm {
namespace {

constexpr const char* kNames[LayerKernels::kCount] = {"up_proj",  "down_proj", "dh_proj",
                                                      "dw2_proj", "dx_proj",   "dw1_proj"};
constexpr const char* kShort[LayerKernels::kCount] = {"up", "down", "dh", "dw2", "dx", "dw1"};
constexpr int kUp = LayerKernels::kUp, kDown = LayerKernels::kDown, kDh = LayerKernels::kDh,
              kDw2 = LayerKernels::kDw2, kDx = LayerKernels::kDx, kDw1 = LayerKernels::kDw1;

GemmKernel two_cta(const char* rule) {
  GemmKernel k;
  k.rule = rule;
  return k;
}
GemmKernel ws_gather(KernelSchedule s, const char* rule) {
  GemmKernel k;
  k.family = KernelFamily::ws_gather;
  k.schedule = s;
  k.tile_n = s == KernelSchedule::cooperative ? 256 : 128;
  k.stages = s == KernelSchedule::cooperative ? kWsCooperativeStages : kWsPingPongStages;
  k.rule = rule;
  return k;
}
GemmKernel ws_varlen_k(int cluster, const char* rule) {
  GemmKernel k;
  k.family = KernelFamily::ws_varlen_k;
  k.schedule = KernelSchedule::cooperative;
  k.tile_n = 256;
  k.stages = kWsVarlenKStages;
  k.cluster = cluster;
  k.rule = rule;
  return k;
}
// ws_varlen_k's epilogue by TMA store or not, with the ring depth each one builds.
void set_store_by_tma(GemmKernel& k, bool by_tma) {
  k.store_by_tma = by_tma;
  k.stages = by_tma ? kWsVarlenKTmaStoreStages : kWsVarlenKStages;
}
// kTmaVariants[v] (0: 128x256 cooperative on clusters of 2, the overrides' starting point).
GemmKernel tma_grouped(const char* rule, int v = 0) {
  GemmKernel k;
  k.family = KernelFamily::tma_grouped;
  k.schedule = kTmaVariants[v].schedule;
  k.tile_m = kTmaVariants[v].tile_m;
  k.tile_n = kTmaVariants[v].tile_n;
  k.stages = 0;
  k.cluster = kTmaVariants[v].cluster;
  k.raster_group = 0;
  k.rule = rule;
  return k;
}

}  // namespace

int tma_bands_rule(int64_t S, int64_t E, int64_t N, int64_t K, int tile_m, int tile_n,
                   int64_t sms, int64_t l2_bytes) {
  if (E <= 1 || S <= 0 || N <= 0 || K <= 0 || tile_m <= 0 || tile_n <= 0 || sms <= 0 ||
      l2_bytes <= 0)
    return 1;
  const int64_t rows = (S + E - 1) / E;  // per expert, on average
  const int64_t tiles = ((rows + tile_m - 1) / tile_m) * ((N + tile_n - 1) / tile_n);
  // Only where a CTA would meet a new expert at nearly every tile (fewer tiles per expert than SMs)
  // of a short mainloop (K <= 512); elsewhere bands cost L2 reuse of the weights for little
  // (docs/notes/tma-bands.md).
  if (tiles >= sms || K > kBandMaxK) return 1;
  const int64_t w_bytes = 2 * N * K;  // the expert's bf16 weight, N x K
  int64_t b = (kBandRunTiles * sms + tiles - 1) / tiles;
  b = std::min({b, E, int64_t(kMaxTmaBands), band_weight_bytes(l2_bytes) / w_bytes});
  return static_cast<int>(std::max<int64_t>(b, 1));
}

namespace {

// The automatic choice (each rule measured on the H200; docs/ARCHITECTURE.md, "Kernel choice").
LayerKernels automatic(const KernelShape& s) {
  LayerKernels k;
  const bool ws = s.E >= 1 && s.E <= kWsMaxExperts;
  const bool tma = s.E > 0 && s.S >= s.E * kTmaMinRowsPerExpert;
  k.up = ws ? ws_gather(KernelSchedule::cooperative,
                        "E <= 4096: cooperative leads or is within 2 % of ping-pong at every d")
            : two_cta("E > 4096: beyond the gather kernel's expert table");
  if (!ws) k.up.b_by_tma = true;
  if (!ws)
    k.dh = two_cta("E > 4096: beyond the gather kernel's expert table");
  else if (s.act == Activation::swiglu && s.E <= kWsDhSwigluCoopMaxExperts)
    k.dh = ws_gather(KernelSchedule::cooperative,
                     "swiglu: its own kernels (no activation switch, no spill), cooperative, "
                     "H staged in shared memory");
  else if (s.act == Activation::swiglu)
    k.dh = ws_gather(KernelSchedule::ping_pong,
                     "swiglu, E > 2000: its ping-pong kernel (the cooperative one's staged H "
                     "leaves the expert table too little shared memory)");
  else if (s.d < kWsDhMinD)
    k.dh = two_cta("d < 2048: the gather kernels' dH epilogue is not amortised");
  else if (s.d < kWsDhCoopMinD)
    k.dh = ws_gather(KernelSchedule::ping_pong, "2048 <= d < 4096: ping-pong ahead");
  else
    k.dh = ws_gather(KernelSchedule::cooperative, "d >= 4096: cooperative ahead");
  if (s.act == Activation::swiglu_oai && ws) {
    k.up = k.dh = ws_gather(KernelSchedule::cooperative,
                            "swiglu_oai: its own cooperative kernels (the shared epilogues' "
                            "activation switch leaves it out)");
  }
  // Weight-bound, an expert's rows in two 128-row tiles: the cooperative gather kernels on
  // clusters of 2 read each weight tile once (kGatherPairMinRows, gather_pair_max_rows); the
  // up-projection only while the second tile holds few rows (kGatherPairUpMaxRows).
  const bool two_tiles =
      ws && s.E > 0 && s.d >= kGatherPairMinD && s.S >= s.E * kGatherPairMinRows;
  const bool pair = two_tiles && s.S <= s.E * gather_pair_max_rows(s.flops_per_byte);
  if (pair && s.S <= s.E * kGatherPairUpMaxRows && s.act != Activation::swiglu_oai) {
    k.up.cluster = 2;
    k.up.rule = "d >= 4096, 118 E <= S <= min(150, FLOPs per DRAM byte - 1) E rows (weight-"
                "bound, an expert's second 128-row tile nearly empty): cooperative on clusters "
                "of 2, the weight multicast";
  }
  // dH's pair also wherever one expert's W2 outgrows the L2 (dh_expert_outgrows_l2).
  const bool big_expert = two_tiles && dh_expert_outgrows_l2(s.n, s.d, s.l2_bytes);
  if ((pair || big_expert) && s.act == Activation::swiglu &&
      k.dh.family == KernelFamily::ws_gather && k.dh.schedule == KernelSchedule::cooperative) {
    k.dh.cluster = 2;
    k.dh.rule = pair ? "swiglu, d >= 4096, 118 E <= S <= min(240, FLOPs per DRAM byte - 1) E rows "
                       "(weight-bound, two 128-row tiles an expert): its cooperative kernel on "
                       "clusters of 2, the weight multicast"
                     : "swiglu, d >= 4096, S >= 118 E rows, one expert's W2 (n x d) at least the "
                       "L2: its cooperative kernel on clusters of 2, the weight streamed once a pair";
  }
  // On the TMA path, 192x128 ping-pong (one warpgroup's epilogue under the other's mainloop):
  // ahead of 128x256 cooperative in the layer at the four TMA-path configs measured.
  // Below 128 rows an expert one 128-row tile holds all of an expert's rows: the TMA path's
  // single-CTA 128x256 tile (docs/notes/weight-bound-down-dx.md).
  k.down = tma ? tma_grouped("S >= 128 E rows: the TMA path, 192x128 ping-pong", kTmaPingPong)
           : ws && s.S > 0
               ? tma_grouped("S < 128 E rows: one 128-row tile an expert, 128x256 on single CTAs",
                             kTmaSingle)
               : two_cta("E > 4096 or S = 0: the 2-CTA kernel");
  k.dx = k.down;
  // Both GEMMs write N = d columns; down reduces over n, dX̃ over w1_rows.
  const int64_t w1_rows = is_gated(s.act) ? 2 * s.n : s.n;
  if (tma && ws && s.S < s.E * kWsContiguousMaxRowsPerExpert) {
    if (s.S <= s.E * weight_bound_max_rows(s.flops_per_byte)) {
      // Weight-bound, and an expert's rows fit one 192-row tile (weight_bound_max_rows): that
      // tile reads the weights once where the ws kernel's 128-row tiles read them twice.
      k.down = k.dx = tma_grouped(
          "128 E <= S <= 178 E rows (weight-bound, one 192-row tile an expert): 192x128 "
          "ping-pong", kTmaPingPong);
    } else {
      // The ws kernel (one TMA descriptor per operand) leads here (the 2026-12-02 note);
      // cooperative for both, as measured in the layer on the grid.
      k.down = ws_gather(KernelSchedule::cooperative,
                         "178 E < S < 1024 E rows: the ws kernel, A by TMA, cooperative");
      k.dx = k.down;
    }
  } else if (tma) {
    // The TMA path only: below 128 rows an expert the single-CTA tile stays
    // (docs/notes/weight-bound-down-dx.md).
    // A long reduction amortises the epilogue that ping-pong hides; the wider tile and the
    // cluster's multicast then feed the tensor cores with less traffic.
    if (w1_rows >= kTmaWideMinReduction && s.d >= kTmaWideMinD)
      k.dx = tma_grouped(
          "dX̃, reduction >= 3072 and d >= 2560: 128x256 cooperative, clusters of 2", kTmaWide);
    if (s.n >= kTmaWideMinReduction && s.d >= kTmaWideMinD)
      k.down = tma_grouped(
          "down-proj, reduction n >= 3072 and d >= 2560: 128x256 cooperative, clusters of 2",
          kTmaWide);
  }
  // Bands on the TMA path.
  if (k.down.family == KernelFamily::tma_grouped)
    k.down.tma_bands =
        tma_bands_rule(s.S, s.E, s.d, s.n, k.down.tile_m, k.down.tile_n, s.sms, s.l2_bytes);
  if (k.dx.family == KernelFamily::tma_grouped)
    k.dx.tma_bands =
        tma_bands_rule(s.S, s.E, s.d, w1_rows, k.dx.tile_m, k.dx.tile_n, s.sms, s.l2_bytes);
  if (!ws) {
    k.dw2 = k.dw1 = two_cta("E > 4096: the 2-CTA varlen-K kernel, as measured");
  } else {
    const bool few_rows = s.S < s.E * kVarlenKTmaStoreMaxRowsPerExpert;
    k.dw2 = few_rows ? ws_varlen_k(1, "S < 4096 E rows: warp-specialised varlen-K, the tile "
                                      "leaves by TMA store under the next tile's MMAs")
                     : ws_varlen_k(1, "S >= 4096 E rows: warp-specialised varlen-K, plain "
                                      "stores (the epilogue is a small share of the tile)");
    k.dw1 = s.S >= s.E * kDw1ClusterMinRowsPerExpert
                ? ws_varlen_k(2, "S >= 4096 E rows: 2-CTA clusters share dh by TMA multicast")
                : ws_varlen_k(1, "S < 4096 E rows: one CTA a tile (clusters measured no gain), "
                                 "the tile leaves by TMA store under the next tile's MMAs");
    for (GemmKernel* w : {&k.dw2, &k.dw1})
      if (few_rows && w->cluster == 1) set_store_by_tma(*w, true);
  }
  return k;
}

// A tma_grouped kernel's schedule / cluster / tile overrides: k with the given fields where that
// kernel is built, else the first built variant with them (kTmaVariants' order), else
// Unsupported listing the built ones.
void apply_tma(const char* name, const GemmOverride& o, GemmKernel& k) {
  GemmKernel c = k;
  if (o.tile_m) c.tile_m = *o.tile_m, c.tile_n = *o.tile_n;
  if (o.schedule) c.schedule = *o.schedule;
  if (o.cluster) c.cluster = *o.cluster;
  if (tma_variant(c) >= 0) {
    k = c;
    k.rule = "override";
    return;
  }
  for (const TmaVariant& v : kTmaVariants) {
    if ((o.tile_m && (*o.tile_m != v.tile_m || *o.tile_n != v.tile_n)) ||
        (o.schedule && *o.schedule != v.schedule) || (o.cluster && *o.cluster != v.cluster))
      continue;
    k.tile_m = v.tile_m;
    k.tile_n = v.tile_n;
    k.schedule = v.schedule;
    k.cluster = v.cluster;
    k.rule = "override";
    return;
  }
  std::string built;
  for (const TmaVariant& v : kTmaVariants)
    built += detail::concat(built.empty() ? "" : ", ", v.tile_m, "x", v.tile_n, " ",
                            schedule_name(v.schedule), " cluster ", v.cluster);
  MOEBLAZE_UNSUPPORTED_IF(true, "kernel override of ", name, " on tma_grouped: no built kernel "
                          "has ", o.tile_m ? detail::concat("tile ", *o.tile_m, "x", *o.tile_n, " ") : "",
                          o.schedule ? detail::concat("schedule ", schedule_name(*o.schedule), " ") : "",
                          o.cluster ? detail::concat("cluster ", *o.cluster, " ") : "",
                          "(built: ", built, ")");
}

// Applies GEMM g's override to its chosen kernel k (g in LayerKernels order).
void apply(int g, const GemmOverride& o, const KernelShape& s, GemmKernel& k) {
  const char* name = kNames[g];
  const bool gathered = g == kUp || g == kDh || g == kDw2 || g == kDw1;
  const bool varlen_k = g == kDw2 || g == kDw1;
  if (o.family) {
    const KernelFamily f = *o.family;
    MOEBLAZE_UNSUPPORTED_IF(f == KernelFamily::tma_grouped && gathered, "kernel override ", name,
                            ".family=tma: a gathered operand cannot come by TMA");
    // down / dx on ws: the gather kernel with A by TMA instead of the gather (kTmaA).
    if (f == KernelFamily::two_cta) {
      k = two_cta("override");
      k.b_by_tma = g == kUp;
    } else if (f == KernelFamily::tma_grouped) {
      k = tma_grouped("override");
    } else if (varlen_k) {
      k = ws_varlen_k(1, "override");
    } else {
      MOEBLAZE_UNSUPPORTED_IF(s.E > kWsMaxExperts, "kernel override ", name,
                              ".family=ws: the warp-specialised gather kernel takes E <= 4096 "
                              "experts (got ", s.E, ")");
      k = ws_gather(KernelSchedule::cooperative, "override");
    }
  }
  if (k.family == KernelFamily::tma_grouped && (o.schedule || o.cluster || o.tile_m)) {
    apply_tma(name, o, k);
    return;
  }
  MOEBLAZE_UNSUPPORTED_IF(o.tile_m.has_value(), "kernel override ", name,
                          ".tile: only down_proj and dx_proj on tma_grouped have a tile choice; ",
                          name, " runs ", family_name(k.family));
  if (o.schedule) {
    MOEBLAZE_UNSUPPORTED_IF(k.family != KernelFamily::ws_gather, "kernel override ", name,
                            ".schedule: only the ws_gather family (up_proj, dh_proj; down_proj "
                            "and dx_proj with <gemm>.family=ws or tma) has schedules; ", name,
                            " runs ", family_name(k.family));
    k = ws_gather(*o.schedule, "override");
  }
  if (o.cluster) {
    const bool dw1_ws = g == kDw1 && k.family == KernelFamily::ws_varlen_k;
    // dH's swiglu kernel and the up-projection's, cooperative, share the weight's stages
    // between two CTAs (dh_proj_swiglu_mc.cu, up_proj_mc.cu; docs/notes/dh-epilogue.md,
    // "Clusters of 2").
    const bool dh_ws = g == kDh && k.family == KernelFamily::ws_gather &&
                       k.schedule == KernelSchedule::cooperative;
    const bool up_ws = g == kUp && k.family == KernelFamily::ws_gather &&
                       k.schedule == KernelSchedule::cooperative;
    MOEBLAZE_UNSUPPORTED_IF(!dw1_ws && !dh_ws && !up_ws && k.family != KernelFamily::tma_grouped,
                            "kernel override ", name, ".cluster: only dw1_proj on ws_varlen_k, "
                            "up_proj and dh_proj on ws_gather cooperative and down_proj / dx_proj "
                            "on tma_grouped run on clusters");
    MOEBLAZE_UNSUPPORTED_IF(up_ws && *o.cluster != 1 && s.act == Activation::swiglu_oai,
                            "kernel override ", name, ".cluster=", *o.cluster, ": swiglu_oai's "
                            "up-projection runs on single CTAs");
    MOEBLAZE_UNSUPPORTED_IF(dh_ws && *o.cluster != 1 &&
                                (s.act != Activation::swiglu || s.E > kWsDhSwigluCoopMaxExperts),
                            "kernel override ", name, ".cluster=", *o.cluster, ": dH on clusters "
                            "is built for swiglu with E <= ", kWsDhSwigluCoopMaxExperts);
    k.cluster = *o.cluster;
    if (k.cluster != 1 && k.store_by_tma)  // the TMA-store epilogue is one CTA a tile's
      set_store_by_tma(k, false);
    k.rule = "override";
  }
  if (o.b_by_tma) {
    MOEBLAZE_UNSUPPORTED_IF(g != kUp || k.family != KernelFamily::two_cta,
                            "kernel override ", name, ".b_tma: only up_proj on two_cta has it");
    k.b_by_tma = *o.b_by_tma;
    k.rule = "override";
  }
  if (o.store_tma) {
    MOEBLAZE_UNSUPPORTED_IF(!varlen_k || k.family != KernelFamily::ws_varlen_k, "kernel override ",
                            name, ".store_tma: only dw2_proj and dw1_proj on ws_varlen_k have it; ",
                            name, " runs ", family_name(k.family));
    MOEBLAZE_UNSUPPORTED_IF(*o.store_tma && k.cluster != 1, "kernel override ", name,
                            ".store_tma=1: the TMA-store epilogue is built for one CTA a tile (",
                            name, " runs on clusters of ", k.cluster, ")");
    set_store_by_tma(k, *o.store_tma);
    k.rule = "override";
  }
}

int parse_int(const std::string& item, const std::string& v, long lo, long hi) {
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v.c_str(), &end, 10);
  MOEBLAZE_REQUIRE(!v.empty() && errno == 0 && *end == '\0' && x >= lo && x <= hi,
                   "kernel override '", item, "': the value must be an integer in [", lo, ", ",
                   hi, "]");
  return static_cast<int>(x);
}

std::mutex g_mutex;
bool g_set = false;            // set_kernel_overrides was called
bool g_env_read = false;       // MOEBLAZE_KERNELS was parsed into g_env
KernelOverrides g_overrides;   // set_kernel_overrides' value
KernelOverrides g_env;         // MOEBLAZE_KERNELS
std::atomic<int> g_pdl{-1};    // pdl_launches() of the overrides in force; -1: not yet read

}  // namespace

const char* LayerKernels::name(int i) { return kNames[i]; }
const GemmKernel& LayerKernels::at(int i) const {
  const GemmKernel* all[kCount] = {&up, &down, &dh, &dw2, &dx, &dw1};
  return *all[i];
}
GemmKernel& LayerKernels::at(int i) {
  return const_cast<GemmKernel&>(static_cast<const LayerKernels&>(*this).at(i));
}
bool LayerKernels::operator==(const LayerKernels& o) const {
  for (int i = 0; i < kCount; ++i)
    if (at(i) != o.at(i)) return false;
  return true;
}

int tma_variant(const GemmKernel& k) {
  for (int i = 0; i < kTmaVariantCount; ++i) {
    const TmaVariant& v = kTmaVariants[i];
    if (k.tile_m == v.tile_m && k.tile_n == v.tile_n && k.schedule == v.schedule &&
        k.cluster == v.cluster)
      return i;
  }
  return -1;
}

const char* family_name(KernelFamily f) {
  switch (f) {
    case KernelFamily::two_cta: return "two_cta";
    case KernelFamily::ws_gather: return "ws_gather";
    case KernelFamily::ws_varlen_k: return "ws_varlen_k";
    case KernelFamily::tma_grouped: return "tma_grouped";
  }
  return "?";
}

const char* schedule_name(KernelSchedule s) {
  switch (s) {
    case KernelSchedule::all_threads: return "all_threads";
    case KernelSchedule::cooperative: return "cooperative";
    case KernelSchedule::ping_pong: return "ping_pong";
  }
  return "?";
}

std::string describe(const GemmKernel& k) {
  std::string s = detail::concat(family_name(k.family), " ", schedule_name(k.schedule), " ",
                                 k.tile_m, "x", k.tile_n, "x", k.tile_k, " stages=",
                                 k.stages ? std::to_string(k.stages) : "auto",
                                 " cluster=", k.cluster);
  if (k.family == KernelFamily::tma_grouped)
    s += detail::concat(" order=", k.tma_along_n ? "n" : "m", " swizzle=", k.tma_swizzle,
                        " bands=", k.tma_bands);
  else
    s += detail::concat(" raster=", k.raster_group);
  if (k.family == KernelFamily::two_cta && k.b_by_tma) s += " b_tma";
  if (k.store_by_tma) s += " store=tma";
  return s;
}

int fp8_variant(const Fp8Kernel& k) {
  for (int v = 0; v < int(sizeof(kFp8Kernels) / sizeof(kFp8Kernels[0])); ++v)
    if (kFp8Kernels[v] == k) return v;
  return -1;
}

Fp8Kernel choose_fp8_kernel(const KernelOverrides& o) {
  Fp8Kernel k = kFp8Default;
  if (!o.fp8.schedule && !o.fp8.cluster) return k;
  if (o.fp8.schedule) k.schedule = *o.fp8.schedule;
  if (o.fp8.cluster) k.cluster = *o.fp8.cluster;
  // A schedule given alone keeps the default's cluster where that is built, else takes the
  // first built cluster with it (ping-pong: single CTAs).
  if (o.fp8.schedule && !o.fp8.cluster && fp8_variant(k) < 0)
    for (const Fp8Kernel& b : kFp8Kernels)
      if (b.schedule == k.schedule) {
        k.cluster = b.cluster;
        break;
      }
  k.rule = "override";
  MOEBLAZE_UNSUPPORTED_IF(fp8_variant(k) < 0, "fp8: ", schedule_name(k.schedule),
                          " on clusters of ", k.cluster,
                          " is not built (cooperative on 1 or 2 CTAs, ping_pong on 1)");
  return k;
}

Fp8Kernel choose_fp8_kernel() { return choose_fp8_kernel(kernel_overrides()); }

std::string describe(const Fp8Kernel& k) {
  const bool pp = k.schedule == KernelSchedule::ping_pong;
  return detail::concat("fp8 ", schedule_name(k.schedule), " ", pp ? 64 : 128, "x128x128 cluster=",
                        k.cluster);
}

KernelOverrides parse_kernel_overrides(const std::string& spec) {
  KernelOverrides o;
  o.spec = spec;
  // Split by hand, not through a stringstream: this runs inside other programs (Python) on the
  // first GEMM launch, where a second C++ runtime's locale is best not relied on.
  for (size_t at = 0; at <= spec.size();) {
    const size_t comma = std::min(spec.find(',', at), spec.size());
    const std::string item = spec.substr(at, comma - at);
    at = comma + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    MOEBLAZE_REQUIRE(eq != std::string::npos && eq > 0, "kernel override '", item,
                     "': expected key=value");
    const std::string key = item.substr(0, eq), v = item.substr(eq + 1);
    if (key == "raster") {
      o.raster_group = parse_int(item, v, 1, 65536);
      continue;
    }
    if (key == "tma.order") {
      MOEBLAZE_REQUIRE(v == "m" || v == "n", "kernel override '", item, "': m or n");
      o.tma_along_n = v == "n";
      continue;
    }
    if (key == "tma.swizzle") {
      const int z = parse_int(item, v, 1, 8);
      MOEBLAZE_REQUIRE(z == 1 || z == 2 || z == 4 || z == 8, "kernel override '", item,
                       "': 1, 2, 4 or 8");
      o.tma_swizzle = z;
      continue;
    }
    if (key == "tma.bands") {
      o.tma_bands = parse_int(item, v, 1, 64);
      continue;
    }
    if (key == "chunks" || key == "chunks.fwd" || key == "chunks.bwd") {
      const int c = parse_int(item, v, 1, 1024);
      if (key != "chunks.bwd") o.token_chunks.forward = c;
      if (key != "chunks.fwd") o.token_chunks.backward = c;
      continue;
    }
    if (key == "ranges") {
      o.expert_ranges = parse_int(item, v, 1, 1024);
      continue;
    }
    if (key == "pdl") {
      o.pdl = parse_int(item, v, 0, 1) == 1;
      continue;
    }
    if (key == "fp8.schedule") {
      MOEBLAZE_REQUIRE(v == "cooperative" || v == "pingpong", "kernel override '", item,
                       "': cooperative or pingpong");
      o.fp8.schedule = v == "pingpong" ? KernelSchedule::ping_pong : KernelSchedule::cooperative;
      continue;
    }
    if (key == "fp8.cluster") {
      o.fp8.cluster = parse_int(item, v, 1, 2);
      continue;
    }
    if (key == "impl") {
      MOEBLAZE_REQUIRE(v == "sm90" || v == "naive", "kernel override '", item,
                       "': sm90 or naive");
      o.naive = v == "naive";
      continue;
    }
    const size_t dot = key.find('.');
    int g = -1;
    for (int i = 0; i < LayerKernels::kCount && dot != std::string::npos; ++i)
      if (key.compare(0, dot, kShort[i]) == 0 && dot == std::string(kShort[i]).size()) g = i;
    MOEBLAZE_REQUIRE(g >= 0, "kernel override '", item, "': unknown key '", key,
                     "' (<gemm>.family|schedule|cluster|b_tma|tile with <gemm> one of up, down, dh, "
                     "dw2, dx, dw1; raster; tma.order; tma.swizzle; tma.bands; chunks[.fwd|.bwd]; "
                     "ranges; pdl; fp8.schedule; fp8.cluster; impl)");
    const std::string field = key.substr(dot + 1);
    GemmOverride& go = o.gemm[g];
    if (field == "family") {
      MOEBLAZE_REQUIRE(v == "two_cta" || v == "ws" || v == "tma", "kernel override '", item,
                       "': two_cta, ws or tma");
      go.family = v == "two_cta" ? KernelFamily::two_cta
                  : v == "tma"   ? KernelFamily::tma_grouped
                  : (g == kDw2 || g == kDw1) ? KernelFamily::ws_varlen_k
                                             : KernelFamily::ws_gather;
    } else if (field == "schedule") {
      MOEBLAZE_REQUIRE(v == "cooperative" || v == "pingpong", "kernel override '", item,
                       "': cooperative or pingpong");
      go.schedule = v == "pingpong" ? KernelSchedule::ping_pong : KernelSchedule::cooperative;
    } else if (field == "cluster") {
      const int c = parse_int(item, v, 1, 2);
      go.cluster = c;
    } else if (field == "b_tma") {
      go.b_by_tma = parse_int(item, v, 0, 1) == 1;
    } else if (field == "store_tma") {
      go.store_tma = parse_int(item, v, 0, 1) == 1;
    } else if (field == "tile") {
      const size_t x = v.find('x');
      MOEBLAZE_REQUIRE(x != std::string::npos, "kernel override '", item,
                       "': the tile must be MxN (e.g. 256x128)");
      go.tile_m = parse_int(item, v.substr(0, x), 1, 1024);
      go.tile_n = parse_int(item, v.substr(x + 1), 1, 1024);
    } else {
      MOEBLAZE_REQUIRE(false, "kernel override '", item, "': unknown field '", field,
                       "' (family, schedule, cluster, b_tma, tile, store_tma)");
    }
  }
  return o;
}

namespace {
bool names_gemm(const GemmOverride& g) {
  return g.family || g.schedule || g.cluster || g.b_by_tma || g.tile_m || g.tile_n || g.store_tma;
}
template <class T>
void take_set(std::optional<T>& to, const std::optional<T>& from) {
  if (from) to = from;
}
}  // namespace

KernelOverrides layer_kernel_overrides(const KernelOverrides& base, const KernelOverrides& over) {
  KernelOverrides o = base;
  // The spec says what is in force: base's items but those of the GEMMs `over` names, then over's.
  std::string kept;
  for (size_t at = 0; at <= base.spec.size();) {
    const size_t comma = std::min(base.spec.find(',', at), base.spec.size());
    const std::string item = base.spec.substr(at, comma - at);
    at = comma + 1;
    bool dropped = false;
    for (int g = 0; g < LayerKernels::kCount; ++g)
      dropped = dropped ||
                (names_gemm(over.gemm[g]) && item.rfind(std::string(kShort[g]) + ".", 0) == 0);
    if (!item.empty() && !dropped) kept += (kept.empty() ? "" : ",") + item;
  }
  for (int g = 0; g < LayerKernels::kCount; ++g)
    if (names_gemm(over.gemm[g])) o.gemm[g] = over.gemm[g];
  take_set(o.raster_group, over.raster_group);
  take_set(o.tma_along_n, over.tma_along_n);
  take_set(o.tma_swizzle, over.tma_swizzle);
  take_set(o.tma_bands, over.tma_bands);
  take_set(o.token_chunks.forward, over.token_chunks.forward);
  take_set(o.token_chunks.backward, over.token_chunks.backward);
  take_set(o.expert_ranges, over.expert_ranges);
  take_set(o.pdl, over.pdl);
  take_set(o.fp8.schedule, over.fp8.schedule);
  take_set(o.fp8.cluster, over.fp8.cluster);
  o.naive = base.naive || over.naive;
  o.spec = kept.empty() ? over.spec : over.spec.empty() ? kept : kept + "," + over.spec;
  return o;
}

KernelOverrides kernel_overrides() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_set) return g_overrides;
  if (!g_env_read) {
    const char* env = std::getenv("MOEBLAZE_KERNELS");
    try {
      g_env = parse_kernel_overrides(env ? env : "");
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(std::string("MOEBLAZE_KERNELS: ") + e.what());
    }
    g_env_read = true;
  }
  return g_env;
}

void set_kernel_overrides(const KernelOverrides& o) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_overrides = o;
  g_set = true;
  g_pdl = -1;
}

void clear_kernel_overrides() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_set = false;
  g_pdl = -1;
}

bool choose_pdl(const KernelOverrides& o) { return o.pdl.value_or(kPdlDefault); }

const char* pdl_rule(const KernelOverrides& o) {
  return o.pdl.has_value() ? "override pdl" : "default: off until a GPU A/B measures it";
}

bool pdl_launches() {
  int v = g_pdl.load(std::memory_order_relaxed);
  if (v < 0) {
    v = choose_pdl(kernel_overrides()) ? 1 : 0;
    g_pdl.store(v, std::memory_order_relaxed);
  }
  return v == 1;
}

LayerKernels choose_kernels(const KernelShape& given, const KernelOverrides& o) {
  KernelShape shape = given;
  if (shape.sms <= 0 || shape.l2_bytes <= 0 || shape.flops_per_byte <= 0) {
    const DeviceProps dev = current_device_props();
    if (shape.sms <= 0) shape.sms = dev.sms;
    if (shape.l2_bytes <= 0) shape.l2_bytes = dev.l2_bytes;
    if (shape.flops_per_byte <= 0) shape.flops_per_byte = dev.flops_per_byte;
  }
  LayerKernels k = automatic(shape);
  k.sms = shape.sms;
  k.l2_bytes = shape.l2_bytes;
  k.flops_per_byte = shape.flops_per_byte;
  for (int i = 0; i < LayerKernels::kCount; ++i) apply(i, o.gemm[i], shape, k.at(i));
  if (shape.act == Activation::swiglu_oai)
    for (const int g : {kUp, kDh}) {
      const GemmKernel& c = k.at(g);
      MOEBLAZE_UNSUPPORTED_IF(
          c.family != KernelFamily::ws_gather || c.schedule != KernelSchedule::cooperative,
          kNames[g], ": swiglu_oai runs on its own ws_gather cooperative kernel only, which "
          "takes E <= ", kWsMaxExperts, " and no other family or schedule override (the choice "
          "here: ", family_name(c.family), " ", schedule_name(c.schedule), ")");
    }
  for (int i = 0; i < LayerKernels::kCount; ++i) {
    GemmKernel& g = k.at(i);
    if (g.family == KernelFamily::tma_grouped) {
      if (o.tma_along_n) g.tma_along_n = *o.tma_along_n;
      if (o.tma_swizzle) g.tma_swizzle = *o.tma_swizzle;
      if (o.tma_bands) g.tma_bands = *o.tma_bands;
    } else if (o.raster_group) {
      g.raster_group = *o.raster_group;
    }
  }
  return k;
}

LayerKernels choose_kernels(const KernelShape& shape) {
  return choose_kernels(shape, kernel_overrides());
}

std::vector<KernelCandidate> kernel_candidates(int gemm, const KernelShape& shape) {
  MOEBLAZE_REQUIRE(gemm >= 0 && gemm < LayerKernels::kCount, "kernel_candidates: gemm (", gemm,
                   ") must be a LayerKernels index in [0, ", LayerKernels::kCount, ")");
  const std::string g = kShort[gemm];
  const auto ws = [&](const char* schedule) {
    return g + ".family=ws," + g + ".schedule=" + schedule;
  };
  std::vector<std::string> specs;
  switch (gemm) {
    case kUp:
      specs = {ws("cooperative"), ws("cooperative") + "," + g + ".cluster=2", ws("pingpong"),
               g + ".family=two_cta," + g + ".b_tma=1", g + ".family=two_cta," + g + ".b_tma=0"};
      break;
    case kDh:
      specs = {ws("cooperative"), ws("cooperative") + "," + g + ".cluster=2", ws("pingpong"),
               g + ".family=two_cta"};
      break;
    case kDw2:
      specs = {g + ".family=ws", g + ".family=ws," + g + ".store_tma=1", g + ".family=two_cta"};
      break;
    case kDw1:
      specs = {g + ".family=ws," + g + ".cluster=1", g + ".family=ws," + g + ".cluster=2",
               g + ".family=ws," + g + ".cluster=1," + g + ".store_tma=1",
               g + ".family=two_cta"};
      break;
    default: {  // down, dx: the TMA path's built tiles, the ws kernel's schedules, two_cta
      // Where the rule already picks the TMA path, a tile override keeps its bands.
      const bool on_tma = choose_kernels(shape, KernelOverrides{}).at(gemm).family ==
                          KernelFamily::tma_grouped;
      for (const TmaVariant& v : kTmaVariants)
        specs.push_back((on_tma ? "" : g + ".family=tma,") + g + ".tile=" +
                        std::to_string(v.tile_m) + "x" + std::to_string(v.tile_n) + "," + g +
                        ".cluster=" + std::to_string(v.cluster));
      specs.push_back(ws("cooperative"));
      specs.push_back(ws("pingpong"));
      specs.push_back(g + ".family=two_cta");
    }
  }
  std::vector<KernelCandidate> out;
  for (const std::string& spec : specs) {
    GemmKernel k;
    try {
      k = choose_kernels(shape, parse_kernel_overrides(spec)).at(gemm);
    } catch (const Unsupported&) {
      continue;  // not a kernel this shape can run (E > 4096 on ws, swiglu_oai's own kernels)
    }
    const bool seen = std::any_of(out.begin(), out.end(),
                                  [&](const KernelCandidate& c) { return c.kernel == k; });
    if (!seen) out.push_back({spec, k});
  }
  return out;
}

LayerKernels contiguous_kernels(int64_t S, int64_t E, const KernelOverrides& overrides) {
  KernelOverrides o = overrides;
  for (int i = 0; i < LayerKernels::kCount; ++i)
    if (i != kDown && i != kDx) o.gemm[i] = {};
  return choose_kernels({S, E, 64, 64}, o);
}

}  // namespace moeblaze::cuda::gemm
