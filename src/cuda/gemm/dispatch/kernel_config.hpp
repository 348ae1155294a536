// Which kernel each of the layer's six grouped GEMMs runs, as a value: LayerKernels, made by one
// function of the shape (choose_kernels), printed field by field (`moeblaze bench kernels`),
// compared field by field in tests, and overridden through one hook (KernelOverrides in code, or
// the MOEBLAZE_KERNELS environment variable, parsed once). The launchers of grouped_gemm.hpp read
// their choice from here; nothing else reads the environment. Host-only: no CUDA headers, no GPU.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moeblaze/config.hpp"  // Activation

namespace moeblaze::cuda::gemm {

// Kernel families (one file or header each, src/cuda/gemm/):
enum class KernelFamily : uint8_t {
  two_cta,      // sm90_varlen_m.cuh, dw_proj.cu: every thread loads and multiplies, 2 CTAs per SM
  ws_gather,    // sm90_ws_gather.cuh: persistent, producer warpgroup (cp.async gather, weights by
                //   TMA) feeding consumer warpgroups; up_proj and dh_proj, E <= kWsMaxExperts
                //   (down_proj and dx_proj by override: A by TMA, no gather table)
  ws_varlen_k,  // sm90_ws_varlen_k.cuh: persistent varlen-K (dW2, dW1), any E
  tma_grouped,  // sm90_tma_grouped.cuh: CUTLASS pointer-array grouped GEMM, both operands by TMA
                //   (down_proj, dx_proj: A contiguous per expert)
};
// How the consumers share the work of a persistent kernel (all_threads: not warp-specialised).
enum class KernelSchedule : uint8_t { all_threads, cooperative, ping_pong };

// Constants of the kernels (static_assert-ed against their device headers where those live).
constexpr int kTwoCtaStages = 3;
constexpr int kWsCooperativeStages = 4;
constexpr int kWsPingPongStages = 6;
constexpr int kWsVarlenKStages = 4;
constexpr int kWsVarlenKTmaStoreStages = 3;  // with the epilogue's 64 KiB staging tile
constexpr int64_t kWsMaxExperts = 4096;  // the gather kernel's per-CTA expert table
constexpr int kDefaultRasterGroup = 16;   // CTA rasterization band (raster_tile)

// The measured thresholds of the automatic rules (docs/notes/, docs/ARCHITECTURE.md):
constexpr int64_t kTmaMinRowsPerExpert = 128;  // below: down/dx on 128-row TMA tiles
constexpr int64_t kWsContiguousMaxRowsPerExpert = 1024;  // below: down/dx on the ws kernel
// ... except where an expert's rows fit one 192-row tile and its GEMM is weight-bound: down or dX̃
// does r FLOPs per byte of an expert's weights (r: its rows, S / E), and below the device's FLOPs
// per DRAM byte (DeviceProps::flops_per_byte) the weights' stream limits it. One 192-row tile
// reads them once where the ws kernel's 128-row tiles read them twice. "Fit": r + sqrt(r) <= 192,
// room for the spread of a balanced routing's per-expert rows (about sqrt(r)); above that both
// tiles need two M tiles and the 128-row one wastes fewer MMAs (docs/notes/weight-bound-down-dx.md).
// The most rows an expert of tile_m rows holds in one tile by that measure: 178 for 192.
constexpr int64_t one_tile_rows(int64_t tile_m) {
  int64_t r = tile_m;
  while (r > 0 && (tile_m - r) * (tile_m - r) < r) --r;
  return r;
}
// The most rows an expert (S / E) for which down/dX̃ take the 192-row tile on a device of this
// many FLOPs per DRAM byte (from kTmaMinRowsPerExpert up): 178 on Hopper, less where memory is
// fast enough that the GEMM stops being weight-bound first.
constexpr int64_t kWeightBoundTileRows = 192;  // kTmaVariants[kTmaPingPong].tile_m
constexpr int64_t weight_bound_max_rows(int64_t flops_per_byte) {
  return flops_per_byte - 1 < one_tile_rows(kWeightBoundTileRows)
             ? flops_per_byte - 1
             : one_tile_rows(kWeightBoundTileRows);
}
static_assert(one_tile_rows(192) == 178 && one_tile_rows(128) == 117, "r + sqrt(r) <= tile rows");
// up-projection and dH on clusters of 2: the same weight-bound measure for the gathered GEMMs'
// 128-row tiles. Where an expert's rows need two of them (r > one_tile_rows(128)) and fit two
// (r <= one_tile_rows(256)), a cluster of 2 takes both and reads the expert's weight tiles once by
// multicast where two single CTAs read them twice; that pays only where the weights' stream
// limits the GEMM (r below the device's FLOPs per DRAM byte), and only where the reduction is long
// (d >= 4096, measured): at shorter ones two single CTAs already share the weight tile through L2
// and the pair's lockstep only costs (docs/notes/dh-epilogue.md, "Clusters of 2").
constexpr int64_t kGatherPairMinRows = one_tile_rows(128) + 1;  // 118
constexpr int64_t kGatherPairMinD = 4096;
// The up-projection's pair only while an expert's second tile holds few rows: a fuller one hides
// the single CTAs' second weight read and the pair lost (measured in the layer; same note).
constexpr int64_t kGatherPairUpMaxRows = 150;
constexpr int64_t gather_pair_max_rows(int64_t flops_per_byte) {
  return flops_per_byte - 1 < one_tile_rows(256) ? flops_per_byte - 1 : one_tile_rows(256);
}
// dH's pair from two tiles up where one expert's W2 (n x d bf16) fills the L2: single CTAs then
// re-stream it from DRAM per m-tile (docs/notes/dh-epilogue.md, "Clusters of 2 inside the call").
constexpr bool dh_expert_outgrows_l2(int64_t n, int64_t d, int64_t l2_bytes) {
  return l2_bytes > 0 && n * d * 2 >= l2_bytes;
}
static_assert(one_tile_rows(256) == 240, "r + sqrt(r) <= 256");
// Dense bf16 tensor-core FLOPs per SM per clock on Hopper (989 TFLOP/s = 132 SMs x 1.83 GHz x 4096).
constexpr int64_t kHopperBf16FlopsPerSmClock = 4096;
// The device's peak dense bf16 FLOP/s over its DRAM bytes/s, from its SMs, SM clock (kHz), memory
// clock (kHz; two transfers a clock) and bus width (bits); 0 if any is unknown.
constexpr int64_t flops_per_dram_byte(int64_t sms, int64_t clock_khz, int64_t mem_clock_khz,
                                      int64_t bus_bits) {
  return sms <= 0 || clock_khz <= 0 || mem_clock_khz <= 0 || bus_bits <= 0
             ? 0
             : sms * clock_khz * kHopperBf16FlopsPerSmClock * 8 / (2 * mem_clock_khz * bus_bits);
}
// dH of the activations that share the switch kernel (not swiglu's, not swiglu_oai's):
constexpr int64_t kWsDhMinD = 2048;      // on a gather kernel from here
constexpr int64_t kWsDhCoopMinD = 4096;  // cooperative (not ping-pong) from here
constexpr int64_t kWsDhSwigluCoopMaxExperts = 2000;  // the staged-H kernel's table room
constexpr int64_t kDw1ClusterMinRowsPerExpert = 4096;  // dW1 on 2-CTA clusters from here
// dW2 and dW1 leave by the TMA-store epilogue below this many rows per expert, where the tile's
// fixed epilogue cost is a large share of its short reduction (0.3-9 % faster in the layer at
// 171-2048 rows, level at 3750-4096: docs/notes/varlen-k-weight-gradients.md, "TMA-store epilogue").
constexpr int64_t kVarlenKTmaStoreMaxRowsPerExpert = 4096;
// The contiguous-A GEMMs on the TMA path (from 1024 rows an expert): 128x256 cooperative on 2-CTA
// clusters (kTmaWide) where the GEMM reduces over at least this many rows (dX̃: w1's, 2n when
// gated; down-proj: n) and writes at least this many columns (d), the smallest of each that won
// in the layer on the model grid for dX̃ (docs/notes/gathered-gemms.md, "Two rules in the
// layer"); 192x128 ping-pong below. down-proj shares the bounds: the same GEMM with W2 for W1
// (docs/notes/gathered-gemms.md, "down-proj on the wide tile").
constexpr int64_t kTmaWideMinReduction = 3072;
constexpr int64_t kTmaWideMinD = 2560;
// tma_grouped's bands (tma_bands_rule), where an expert has fewer tiles than the GPU has SMs
// (KernelShape::sms, read from the device) and the GEMM reduces over at most kBandMaxK: enough
// that a CTA takes about kBandRunTiles tiles of an expert in a row, few enough that the weights of
// the experts the bands are in at once fit in band_weight_bytes(L2) of the device's L2 (KernelShape::
// l2_bytes), at most one band per expert.
constexpr int64_t kBandRunTiles = 8;
constexpr int64_t kBandMaxK = 512;
// 24 MiB, as measured on the H100 and H200 (50 MiB of L2 or more): at most that, and 12/25 of a
// smaller L2 (docs/notes/tma-bands.md).
constexpr int64_t kBandWeightBytes = int64_t(24) << 20;
constexpr int64_t band_weight_bytes(int64_t l2_bytes) {
  return std::min(kBandWeightBytes, l2_bytes * 12 / 25);
}
constexpr int kMaxTmaBands = 64;

struct GemmKernel {
  KernelFamily family = KernelFamily::two_cta;
  KernelSchedule schedule = KernelSchedule::all_threads;
  int tile_m = 128, tile_n = 128, tile_k = 64;
  int stages = kTwoCtaStages;  // shared-memory ring depth (0: CUTLASS's automatic count)
  int cluster = 1;             // CTAs per cluster sharing an operand by TMA multicast
  int raster_group = kDefaultRasterGroup;  // varlen kernels' CTA band height
  bool b_by_tma = false;       // two_cta up_proj: w1 by TMA (else cp.async)
  bool tma_along_n = true;     // tma_grouped: tile order walks N first ...
  int tma_swizzle = 2;         // ... with this swizzle; across experts, the CTAs in
  int tma_bands = 1;           // this many bands (tma_bands_rule)
  bool store_by_tma = false;   // ws_varlen_k: the epilogue leaves by TMA store, 3 ring stages
  const char* rule = "";       // why this kernel (printed; not part of the value)

  bool operator==(const GemmKernel& o) const {
    return family == o.family && schedule == o.schedule && tile_m == o.tile_m &&
           tile_n == o.tile_n && tile_k == o.tile_k && stages == o.stages &&
           cluster == o.cluster && raster_group == o.raster_group && b_by_tma == o.b_by_tma &&
           tma_along_n == o.tma_along_n && tma_swizzle == o.tma_swizzle &&
           tma_bands == o.tma_bands && store_by_tma == o.store_by_tma;
  }
  bool operator!=(const GemmKernel& o) const { return !(*this == o); }
};

// The TMA path's built kernels (tma_grouped's tile, schedule and cluster), one instantiation each
// per GEMM (dispatch/tma_paths.hpp). A cluster of 2 multicasts the weight panel on the 256-wide
// tile (CTAs along M) and the activation panel on the 128-wide tiles (CTAs along N).
struct TmaVariant {
  int tile_m, tile_n;
  KernelSchedule schedule;
  int cluster;
};
inline constexpr TmaVariant kTmaVariants[] = {
    {128, 256, KernelSchedule::cooperative, 2},
    {128, 256, KernelSchedule::cooperative, 1},
    {256, 128, KernelSchedule::cooperative, 2},
    {192, 128, KernelSchedule::ping_pong, 2},
};
constexpr int kTmaVariantCount = int(sizeof(kTmaVariants) / sizeof(kTmaVariants[0]));
constexpr int kTmaWide = 0;      // kTmaVariants' 128x256 cooperative on clusters of 2
constexpr int kTmaSingle = 1;    // kTmaVariants' 128x256 cooperative on single CTAs
constexpr int kTmaPingPong = 3;  // kTmaVariants' 192x128 ping-pong
static_assert(kTmaVariants[kTmaSingle].tile_m == 128 && kTmaVariants[kTmaSingle].cluster == 1,
              "kTmaSingle names the 128-row tile on single CTAs");
static_assert(kTmaVariants[kTmaPingPong].tile_m == kWeightBoundTileRows,
              "the weight-bound rule's tile is the 192-row ping-pong one");
static_assert(kTmaVariants[kTmaWide].tile_m == 128 && kTmaVariants[kTmaWide].tile_n == 256 &&
              kTmaVariants[kTmaWide].cluster == 2, "kTmaWide names the 128x256 tile on clusters of 2");
// The index in kTmaVariants of a tma_grouped kernel's tile, schedule and cluster; -1 if not built.
int tma_variant(const GemmKernel& k);

// The six GEMMs in pipeline order (docs/DESIGN.md's steps 1, 2, 4, 5, 6, 8).
struct LayerKernels {
  GemmKernel up, down, dh, dw2, dx, dw1;
  int64_t sms = 0;       // the SM count the choice was made for (printed; not part of the value)
  int64_t l2_bytes = 0;  // the L2 size it was made for (the same)
  int64_t flops_per_byte = 0;  // the device's FLOPs per DRAM byte it was made for (the same)
  enum : int { kUp, kDown, kDh, kDw2, kDx, kDw1 };  // at()'s index of each
  static constexpr int kCount = 6;
  static const char* name(int i);  // "up_proj", "down_proj", "dh_proj", "dw2_proj", ...
  const GemmKernel& at(int i) const;
  GemmKernel& at(int i);
  bool operator==(const LayerKernels& o) const;
};

// The FP8 layer's grouped GEMMs (fp8_grouped_gemm.hpp: CUTLASS's blockwise-scaled pointer-array
// kernel, 128-deep K steps), as a value. Built: cooperative 128x128 tiles on single CTAs or on
// pairs along N that share the A panel by TMA multicast (cluster 2: each CTA then loads half the
// A tiles it multiplies), and ping-pong 64x128 on single CTAs.
struct Fp8Kernel {
  KernelSchedule schedule = KernelSchedule::cooperative;
  int cluster = 1;       // CTAs per cluster along N
  const char* rule = "";  // why this kernel (printed; not part of the value)
  bool operator==(const Fp8Kernel& o) const {
    return schedule == o.schedule && cluster == o.cluster;
  }
  bool operator!=(const Fp8Kernel& o) const { return !(*this == o); }
};
inline constexpr Fp8Kernel kFp8Kernels[] = {
    {KernelSchedule::cooperative, 1},
    {KernelSchedule::cooperative, 2},
    {KernelSchedule::ping_pong, 1},
};
// The index in kFp8Kernels of k's schedule and cluster; -1 if that combination is not built.
int fp8_variant(const Fp8Kernel& k);
// CTA pairs: the FP8 step measured faster than on single CTAs, ping-pong slower (2026-12-05 notes).
inline constexpr Fp8Kernel kFp8Default = {KernelSchedule::cooperative, 2,
                                          "default: cooperative on CTA pairs sharing A"};

// The shape the choice depends on: S slots over E experts, hidden d, expert width n.
struct KernelShape {
  int64_t S = 0, E = 0, d = 0, n = 0;
  // up/dh run their activation's own kernels for swiglu (dh) and swiglu_oai (up, dh); the other
  // activations share kernels with an activation switch.
  Activation act = Activation::swiglu;
  // The SMs and L2 bytes of the GPU the kernels run on (the TMA path's bands); 0: the current
  // device's (current_device_props()). Host tests and `bench kernels --sms / --l2-mib` pass them
  // to choose for a GPU that is not here.
  int64_t sms = 0;
  int64_t l2_bytes = 0;
  // Its peak dense bf16 FLOPs per DRAM byte (flops_per_dram_byte; down/dx's weight-bound rule);
  // 0: the current device's.
  int64_t flops_per_byte = 0;
};

// What the rules take where no GPU is visible (a build machine's `bench kernels`): the H100
// SXM's (the H200 has as many SMs), the GPUs the rules were measured on.
constexpr int64_t kFallbackSms = 132;
constexpr int64_t kFallbackL2Bytes = int64_t(50) << 20;
// 132 SMs at 1980 MHz over HBM3 at 2619 MHz on 5120 bits: 319.
constexpr int64_t kFallbackFlopsPerByte = flops_per_dram_byte(132, 1980000, 2619000, 5120);
static_assert(kFallbackFlopsPerByte == 319, "the H100 SXM's FLOPs per DRAM byte");

// The current CUDA device's multiprocessor count, L2 size and FLOPs per DRAM byte
// (cudaDevAttrMultiProcessorCount, cudaDevAttrL2CacheSize; ClockRate, MemoryClockRate and
// GlobalMemoryBusWidth), read once per device; device -1 and the fallbacks where no GPU is
// visible. The one CUDA runtime call of the choice (device_props.cpp): everything else here is
// host arithmetic.
struct DeviceProps {
  int64_t sms;
  int64_t l2_bytes;
  int device;
  int64_t flops_per_byte = kFallbackFlopsPerByte;
};
DeviceProps current_device_props();

// The bands for a tma_grouped GEMM with tile_m x tile_n tiles over S rows in E experts, N output
// columns and a reduction over K (its weight per expert is N x K; pipeline/sm90_band_scheduler.cuh)
// on a GPU of `sms` SMs (>= 1) and `l2_bytes` of L2, in [1, 64].
int tma_bands_rule(int64_t S, int64_t E, int64_t N, int64_t K, int tile_m, int tile_n,
                   int64_t sms, int64_t l2_bytes);

// Overrides of the automatic choice. Spec (MOEBLAZE_KERNELS, or parse_kernel_overrides):
// comma-separated key=value items, e.g. "dw1.cluster=2,dh.schedule=pingpong,down.family=two_cta".
//   <gemm>.family    two_cta | ws | tma     (<gemm>: up down dh dw2 dx dw1; ws = the family's
//                                            warp-specialised kernel: ws_gather or ws_varlen_k)
//   <gemm>.schedule  cooperative | pingpong (up, dh, down, dx on ws; down, dx on tma)
//   dw1.cluster      1 | 2                   (dw1 on ws)
//   down.cluster, dx.cluster  1 | 2          (on tma: single CTAs, or pairs sharing a tile by
//                                            multicast, the automatic choice)
//   down.tile, dx.tile  MxN                  (on tma: 128x256, 256x128, 192x128)
//   On tma, the fields not given stay as chosen where that kernel is built, else come from the
//   first of kTmaVariants with the given ones (dx.tile=256x128: cooperative on clusters of 2);
//   a combination not built is refused.
//   up.b_tma         0 | 1                   (up on two_cta)
//   dw2.store_tma, dw1.store_tma  0 | 1     (on ws, one CTA a tile: the epilogue by TMA store,
//                                            not waited for before the next tile; 3 ring stages)
//   raster           1..65536                (every varlen kernel's band height)
//   tma.order        m | n,  tma.swizzle 1 | 2 | 4 | 8   (down, dx on tma)
//   tma.bands        1..64                   (down, dx on tma: the CTAs' bands across experts)
//   chunks           1..1024                 (token chunks of the layer's Y and dX̃; 1: none;
//                                            cuda/layer/token_chunks.hpp)
//   chunks.fwd, chunks.bwd  1..1024          (the same for Y or dX̃ alone)
//   ranges           1..1024                 (recompute's backward in expert ranges of about
//                                            S / ranges slots each; 1: the whole step;
//                                            cuda/layer/expert_ranges.hpp)
//   impl             sm90 | naive            (the layer's GEMMs on the naive oracle: tests)
//   pdl              0 | 1                   (the layer's own kernels by programmatic dependent
//                                            launch: pdl_launches)
//   fp8.schedule     cooperative | pingpong  (every FP8 grouped GEMM: Fp8Kernel; alone, on the
//                                            default's cluster where built: pingpong on 1 CTA)
//   fp8.cluster      1 | 2                   (cooperative only)
struct GemmOverride {
  std::optional<KernelFamily> family;
  std::optional<KernelSchedule> schedule;
  std::optional<int> cluster;
  std::optional<bool> b_by_tma;
  std::optional<int> tile_m, tile_n;  // tma_grouped's tile
  std::optional<bool> store_tma;      // ws_varlen_k's epilogue by TMA store
};
struct KernelOverrides {
  GemmOverride gemm[LayerKernels::kCount];  // in LayerKernels order
  std::optional<int> raster_group;
  std::optional<bool> tma_along_n;
  std::optional<int> tma_swizzle;
  std::optional<int> tma_bands;
  struct TokenChunkOverride {
    std::optional<int> forward, backward;  // Y's, dX̃'s
  } token_chunks;
  std::optional<int> expert_ranges;  // ranges' count (1: none)
  std::optional<bool> pdl;           // programmatic dependent launch (pdl_launches)
  struct Fp8Override {
    std::optional<KernelSchedule> schedule;
    std::optional<int> cluster;
  } fp8;
  bool naive = false;
  std::string spec;  // the text it was parsed from ("" = none)
};

// Parses a spec; throws InvalidArgument naming the item and the rule.
KernelOverrides parse_kernel_overrides(const std::string& spec);
// `over` on top of `base`: a GEMM that `over` names takes `over`'s fields for it alone (base's
// for that GEMM are dropped, so they cannot combine into a kernel neither asked for); every other
// GEMM and the global keys keep base's unless `over` sets them. A benchmark row's own spec over
// --kernels, so that the row runs the kernel its name says.
KernelOverrides layer_kernel_overrides(const KernelOverrides& base, const KernelOverrides& over);
// The overrides in force: those set by set_kernel_overrides, else MOEBLAZE_KERNELS (read and
// parsed on first use; a bad value throws InvalidArgument naming the variable).
KernelOverrides kernel_overrides();
// Process-wide, for tests and benchmarks (every path is reachable without setenv).
void set_kernel_overrides(const KernelOverrides& o);
void clear_kernel_overrides();  // back to MOEBLAZE_KERNELS / none

// The kernels for a shape, overrides applied, for shape.sms SMs (0: the current device's).
// Total and deterministic for every shape with S >= 0, E >= 1, d, n >= 1. Throws Unsupported where an override asks for what a kernel cannot
// take (e.g. ws_gather with E > kWsMaxExperts, ping_pong on a varlen-K GEMM).
LayerKernels choose_kernels(const KernelShape& shape, const KernelOverrides& overrides);
LayerKernels choose_kernels(const KernelShape& shape);  // with kernel_overrides()
// One legal kernel of a GEMM at a shape: the override spec that selects it (MOEBLAZE_KERNELS /
// --kernels syntax, e.g. "dx.tile=128x256,dx.cluster=1") and the kernel that spec gives there.
struct KernelCandidate {
  std::string spec;
  GemmKernel kernel;
};
// Every built kernel that can run GEMM `gemm` (a LayerKernels index) at `shape`, each once (by
// value), in a fixed order: the kernel families, their schedules, the TMA path's built tiles and
// dW1's clusters, less what an override would refuse there (E > 4096 for the ws kernels,
// swiglu_oai's own kernels). The automatic choice is among them. The set a search ranks
// (`moeblaze bench kernels --candidates` prints it).
std::vector<KernelCandidate> kernel_candidates(int gemm, const KernelShape& shape);

// down's and dx's choice (.down, .dx) for S slots over E experts, where d and n are not at hand:
// their rule reads S and E only; the other GEMMs get placeholder dimensions and none of their
// overrides (which may apply only at the real d, e.g. a dh schedule).
LayerKernels contiguous_kernels(int64_t S, int64_t E, const KernelOverrides& overrides);

// Whether the layer's own kernels (the warp-specialised GEMMs, the aggregation, ds and dx-order
// passes: src/cuda/pdl.cuh) are launched by programmatic dependent launch, so that each one's
// launch and prologue overlap the end of the kernel before it: the override pdl, else
// kPdlDefault. Read per launch from a cached value (set_kernel_overrides / clear_kernel_overrides
// renew it).
constexpr bool kPdlDefault = false;  // off: 0.5-2 % slower in the layer (2026-12-05 A/B)
bool choose_pdl(const KernelOverrides& o);       // o.pdl, else kPdlDefault
const char* pdl_rule(const KernelOverrides& o);  // why (printed by bench kernels)
bool pdl_launches();                             // choose_pdl(kernel_overrides()), cached

// The FP8 GEMMs' kernel: kFp8Default, overrides applied. Throws Unsupported for a combination
// not built (ping-pong on a cluster of 2).
Fp8Kernel choose_fp8_kernel(const KernelOverrides& o);
Fp8Kernel choose_fp8_kernel();  // with kernel_overrides()

// Field by field, e.g. "ws_gather cooperative 128x256x64 stages=4 cluster=1 raster=16".
std::string describe(const GemmKernel& k);
std::string describe(const Fp8Kernel& k);  // e.g. "fp8 cooperative 128x128x128 cluster=2"
const char* family_name(KernelFamily f);
const char* schedule_name(KernelSchedule s);

}  // namespace moeblaze::cuda::gemm
