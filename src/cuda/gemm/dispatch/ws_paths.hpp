// The warp-specialised persistent path of the gathered grouped GEMMs (sm90_ws_gather.cuh): one
// instantiation per .cu file. Called by the public entry points (grouped_gemm.hpp) after their
// argument checks. Host-only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/gemm/dispatch/kernel_config.hpp"

namespace moeblaze::cuda::gemm::detail {

// Whether the warp-specialised kernels take E experts (their per-CTA expert table lives in
// shared memory: E <= 4096).
bool ws_gather_supports(int64_t E);

// The kernel a gathered GEMM runs: the caller's GatherKernel with `automatic` resolved to the
// chosen kernel (choose_kernels). Unsupported (naming fn and the rule) when a warp-specialised
// kernel is asked for with E > 4096, or ping_pong where the GEMM has no such schedule.
enum class GatherPath { two_cta, cooperative, ping_pong };
GatherPath gather_path(const GemmKernel& k);
GatherPath resolve_gather_path(const char* fn, GatherKernel kernel, int64_t E,
                               const GemmKernel& chosen, bool has_ping_pong);

// up_proj on the warp-specialised path (cooperative); same contract as up_proj (b1 or null).
void up_proj_ws(const RoutingPlanView& plan, const bf16* x, const bf16* w1, const bf16* b1, bf16* h,
                bf16* a, int64_t d, int64_t n, Activation act, cudaStream_t stream);

// up_proj, cooperative, on clusters of 2 sharing w1's stages (up.cluster=2); same contract.
void up_proj_mc(const RoutingPlanView& plan, const bf16* x, const bf16* w1, const bf16* b1, bf16* h,
                bf16* a, int64_t d, int64_t n, Activation act, cudaStream_t stream);

// up_proj on the warp-specialised kernel's ping-pong schedule; same contract as up_proj.
void up_proj_pp(const RoutingPlanView& plan, const bf16* x, const bf16* w1, const bf16* b1, bf16* h,
                bf16* a, int64_t d, int64_t n, Activation act, cudaStream_t stream);

// up_proj / dh_proj for swiglu_oai: its own cooperative kernels (the shared epilogues' activation
// switch leaves it out); same contracts with act = swiglu_oai.
void up_proj_oai(const RoutingPlanView& plan, const bf16* x, const bf16* w1, const bf16* b1,
                 bf16* h, bf16* a, int64_t d, int64_t n, cudaStream_t stream);
void dh_proj_oai(const RoutingPlanView& plan, const bf16* d_out, const bf16* w2, const bf16* h,
                 float* ds_partials, bf16* dh, bf16* a_scaled, int64_t d, int64_t n,
                 cudaStream_t stream);

// dh_proj for swiglu on its own kernels, cooperative (_ws) or ping-pong (_pp); same contract as
// dh_proj with act = swiglu.
void dh_proj_swiglu_ws(const RoutingPlanView& plan, const bf16* d_out, const bf16* w2,
                       const bf16* h, float* ds_partials, bf16* dh, bf16* a_scaled, int64_t d,
                       int64_t n, cudaStream_t stream);
void dh_proj_swiglu_pp(const RoutingPlanView& plan, const bf16* d_out, const bf16* w2,
                       const bf16* h, float* ds_partials, bf16* dh, bf16* a_scaled, int64_t d,
                       int64_t n, cudaStream_t stream);
// dh_proj for swiglu, cooperative, on clusters of 2 sharing w2's stages (dh.cluster=2).
void dh_proj_swiglu_mc(const RoutingPlanView& plan, const bf16* d_out, const bf16* w2,
                       const bf16* h, float* ds_partials, bf16* dh, bf16* a_scaled, int64_t d,
                       int64_t n, cudaStream_t stream);

// dh_proj on the ping-pong schedule; same contract as dh_proj.
void dh_proj_pp(const RoutingPlanView& plan, const bf16* d_out, const bf16* w2, const bf16* h,
                float* ds_partials, bf16* dh, bf16* a_scaled, int64_t d, int64_t n,
                Activation act, cudaStream_t stream);

// dh_proj on the warp-specialised path (cooperative); same contract as dh_proj.
void dh_proj_ws(const RoutingPlanView& plan, const bf16* d_out, const bf16* w2, const bf16* h,
                float* ds_partials, bf16* dh, bf16* a_scaled, int64_t d, int64_t n,
                Activation act, cudaStream_t stream);

// down_proj / dx_proj (and their row-range forms) on the warp-specialised kernel with A by TMA
// (the `down.family=ws`, `dx.family=ws` choices), cooperative (_ws) or ping-pong (_pp), over
// `rows` (ExpertRows::whole(plan) for the whole step); same contracts as down_proj_rows and
// dx_proj_rows (w1_rows = 2n for gated activations, else n).
void down_proj_ws(const RoutingPlanView& plan, const ExpertRows& rows, const bf16* a,
                  const bf16* w2, bf16* y, int64_t d, int64_t n, cudaStream_t stream);
void down_proj_pp(const RoutingPlanView& plan, const ExpertRows& rows, const bf16* a,
                  const bf16* w2, bf16* y, int64_t d, int64_t n, cudaStream_t stream);
void dx_proj_ws(const RoutingPlanView& plan, const ExpertRows& rows, const bf16* dh,
                const bf16* w1, bf16* dx_slots, int64_t d, int64_t w1_rows, cudaStream_t stream);
void dx_proj_pp(const RoutingPlanView& plan, const ExpertRows& rows, const bf16* dh,
                const bf16* w1, bf16* dx_slots, int64_t d, int64_t w1_rows, cudaStream_t stream);

// dw2_proj / dw1_proj on the warp-specialised varlen-K kernel; same contracts (w1_rows = 2n for
// gated activations, else n). dw1_proj_ws runs the 2-CTA-cluster variant (dw1_proj_ws_cluster,
// its own file) for cluster = 2 (the chosen GemmKernel's cluster).
// store_by_tma (the chosen GemmKernel's): the TMA-store epilogue's instantiations
// (dw2_proj_ws_ts, dw1_proj_ws_ts, their own files; one CTA a tile).
void dw2_proj_ws(const RoutingPlanView& plan, const bf16* d_out, const bf16* a_scaled, bf16* dw2,
                 int64_t d, int64_t n, bool store_by_tma, cudaStream_t stream);
void dw1_proj_ws(const RoutingPlanView& plan, const bf16* dh, const bf16* x, bf16* dw1,
                 int64_t d, int64_t w1_rows, int cluster, bool store_by_tma, cudaStream_t stream);
void dw2_proj_ws_ts(const RoutingPlanView& plan, const bf16* d_out, const bf16* a_scaled,
                    bf16* dw2, int64_t d, int64_t n, cudaStream_t stream);
void dw1_proj_ws_ts(const RoutingPlanView& plan, const bf16* dh, const bf16* x, bf16* dw1,
                    int64_t d, int64_t w1_rows, cudaStream_t stream);
void dw1_proj_ws_cluster(const RoutingPlanView& plan, const bf16* dh, const bf16* x, bf16* dw1,
                         int64_t d, int64_t w1_rows, cudaStream_t stream);


}  // namespace moeblaze::cuda::gemm::detail
