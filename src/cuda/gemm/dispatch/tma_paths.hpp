// The TMA path of the contiguous-A grouped GEMMs (down_proj, dx_proj): one CUTLASS instantiation
// per .cu file (down_proj_tma.cu, dx_proj_tma.cu) so the two heavy builds run in parallel.
// Called by down_proj / dx_proj after their argument checks when given a scratch. Host-only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/gemm/grouped_gemm.hpp"

namespace moeblaze::cuda::gemm::detail {

// The persistent scheduler's tile order in force on the TMA path: the tma.order / tma.swizzle
// kernel overrides (kernel_config.hpp), else GemmKernel's defaults (N first, swizzle 2).
struct TmaTileOrder {
  bool along_n;
  int swizzle;
};
TmaTileOrder tma_tile_order();

// Scratch bytes each instantiation needs for E experts on the current device (the larger of its
// cluster-2 and cluster-1 builds).
size_t down_proj_tma_scratch_bytes(int E);
size_t dx_proj_tma_scratch_bytes(int E);

// The same GEMMs on single-CTA clusters (no multicast of the weight tile; 128-row edges instead
// of 256 where an expert's range ends): the `<gemm>.cluster=1` kernel override, one
// instantiation per file (down_proj_tma_c1.cu, dx_proj_tma_c1.cu). Called by the two below.
size_t down_proj_tma_c1_scratch_bytes(int E);
size_t dx_proj_tma_c1_scratch_bytes(int E);
void down_proj_tma_c1(const ExpertRows& rows, int E, const bf16* a, const bf16* w2, bf16* y,
                      int64_t d, int64_t n, GemmScratch scratch, cudaStream_t stream);
void dx_proj_tma_c1(const ExpertRows& rows, int E, const bf16* dh, const bf16* w1,
                    bf16* dx_slots, int64_t d, int64_t w1_rows, GemmScratch scratch,
                    cudaStream_t stream);

// y (rows, d) = per expert a (S, n) · w2_eᵀ over `rows`, w2 (E, d, n), on clusters of `cluster`
// CTAs (1 or 2: the chosen kernel's, choose_kernels(...).down.cluster).
void down_proj_tma(const RoutingPlanView& plan, const ExpertRows& rows, const bf16* a,
                   const bf16* w2, bf16* y, int64_t d, int64_t n, int cluster,
                   GemmScratch scratch, cudaStream_t stream);
// dx_slots (rows, d) = per expert dh (S, w1_rows) · w1_e over `rows`, w1 (E, w1_rows, d); cluster
// as above (choose_kernels(...).dx.cluster).
void dx_proj_tma(const RoutingPlanView& plan, const ExpertRows& rows, const bf16* dh,
                 const bf16* w1, bf16* dx_slots, int64_t d, int64_t w1_rows, int cluster,
                 GemmScratch scratch, cudaStream_t stream);

}  // namespace moeblaze::cuda::gemm::detail
