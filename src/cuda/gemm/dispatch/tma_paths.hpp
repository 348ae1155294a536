// The TMA path of the contiguous-A grouped GEMMs (down_proj, dx_proj): CUTLASS's pointer-array
// kernel in the variants of kTmaVariants (kernel_config.hpp), one instantiation per file so the
// heavy builds (~80 s of nvcc each) run in parallel:
//   variant                              down_proj                  dx_proj
//   0 128x256 cooperative, cluster 2     down_proj_tma.cu           dx_proj_tma.cu
//   1 128x256 cooperative, cluster 1     down_proj_tma_c1.cu        dx_proj_tma_c1.cu
//   2 256x128 cooperative, cluster 2     down_proj_tma_256x128.cu   dx_proj_tma_256x128.cu
//   3 192x128 ping-pong, cluster 2       down_proj_tma_pp.cu        dx_proj_tma_pp.cu
// Called by down_proj / dx_proj after their argument checks when given a scratch. Host-only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/gemm/dispatch/kernel_config.hpp"
#include "cuda/gemm/grouped_gemm.hpp"

namespace moeblaze::cuda::gemm::detail {

// The persistent scheduler's tile order on the TMA path: within an expert N first or M first,
// with a swizzle; across experts the CTAs in `bands` bands (pipeline/sm90_band_scheduler.cuh).
// tma_tile_order(): the tma.order / tma.swizzle / tma.bands kernel overrides (kernel_config.hpp),
// else GemmKernel's defaults (N first, swizzle 2, one band); a launch takes its chosen kernel's.
struct TmaTileOrder {
  bool along_n;
  int swizzle;
  int bands;
};
TmaTileOrder tma_tile_order();

// One launch: D[rows.out[e] + i, :] = A[rows.begin[e] + i, :] · B_e, B_e at b + e * b_stride.
struct TmaCall {
  const char* fn;    // the entry point, for errors
  ExpertRows rows;
  int E;
  const void* a;     // (S, K) bf16, leading dimension lda
  int64_t lda;
  const void* b;     // (E, ...) bf16: b_stride elements per expert, leading dimension ldb
  int64_t b_stride, ldb;
  void* d;           // (rows, N) bf16, leading dimension ldd
  int64_t ldd;
  int N, K;
  GemmScratch scratch;
  TmaTileOrder order;
  cudaStream_t stream;
};

// Variant V's scratch bytes for E experts and its launch, defined in its file (table above).
template <int V> size_t down_tma_scratch_bytes(int E, TmaTileOrder order);
template <int V> void down_tma_run(const TmaCall& call);
template <int V> size_t dx_tma_scratch_bytes(int E, TmaTileOrder order);
template <int V> void dx_tma_run(const TmaCall& call);
#define MOEBLAZE_TMA_VARIANT(V)                                    \
  template <> size_t down_tma_scratch_bytes<V>(int, TmaTileOrder); \
  template <> void down_tma_run<V>(const TmaCall&);                \
  template <> size_t dx_tma_scratch_bytes<V>(int, TmaTileOrder);   \
  template <> void dx_tma_run<V>(const TmaCall&);
MOEBLAZE_TMA_VARIANT(0)
MOEBLAZE_TMA_VARIANT(1)
MOEBLAZE_TMA_VARIANT(2)
MOEBLAZE_TMA_VARIANT(3)
#undef MOEBLAZE_TMA_VARIANT
static_assert(kTmaVariantCount == 4, "one MOEBLAZE_TMA_VARIANT line and two files per variant");

// Scratch bytes for E experts on the current device: the largest of the variants'.
size_t down_proj_tma_scratch_bytes(int E);
size_t dx_proj_tma_scratch_bytes(int E);

// y (rows, d) = per expert a (S, n) · w2_eᵀ over `rows`, w2 (E, d, n), on the variant of the
// chosen kernel k (choose_kernels(...).down; tma_grouped).
void down_proj_tma(const RoutingPlanView& plan, const ExpertRows& rows, const bf16* a,
                   const bf16* w2, bf16* y, int64_t d, int64_t n, const GemmKernel& k,
                   GemmScratch scratch, cudaStream_t stream);
// dx_slots (rows, d) = per expert dh (S, w1_rows) · w1_e over `rows`, w1 (E, w1_rows, d); k as
// above (choose_kernels(...).dx).
void dx_proj_tma(const RoutingPlanView& plan, const ExpertRows& rows, const bf16* dh,
                 const bf16* w1, bf16* dx_slots, int64_t d, int64_t w1_rows, const GemmKernel& k,
                 GemmScratch scratch, cudaStream_t stream);

}  // namespace moeblaze::cuda::gemm::detail
