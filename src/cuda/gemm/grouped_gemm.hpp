// Grouped GEMMs of the MoE pipeline on sm_90a (WGMMA), one per GEMM of docs/DESIGN.md's eight-step
// pipeline, each reading its per-expert row ranges ON THE DEVICE from the routing plan
// (expert_token_offsets), so nothing here synchronises with the host and a whole step can be
// captured in a CUDA graph. Grids are sized from host-known bounds (S, E, d, n); tiles beyond the
// real work exit at once.
//
// Conventions shared by every function below:
//   * Operands and outputs are bf16 (moeblaze::bf16 = the device's __nv_bfloat16 bits), row-major,
//     16-byte aligned; accumulation is fp32 (WGMMA); slot_weights / ds are fp32.
//   * `plan` is a RoutingPlanView on Device::cuda; only plan.E, plan.S, expert_token_offsets
//     (E+1,), expert_token_indices (S,) (slot -> token) and, for dH, slot_weights (S,) are read.
//     Slots of expert e are [off[e], off[e+1]); rows of the varlen-M outputs are slots.
//   * Shapes: d, n are the layer's hidden and expert-intermediate sizes; w1_rows = 2n for gated
//     activations (rows [0,n) gate, [n,2n) up), n otherwise (config.hpp, is_gated()).
//   * Every function validates its arguments before launching anything and throws
//     InvalidArgument (null pointer, non-CUDA plan, non-positive size) or Unsupported (a dim the
//     kernels do not take; see check_gemm_shape) with a message naming the argument and the rule.
//     Outputs are untouched on a throw.
//   * No atomics; every output is bitwise identical run to run (fixed decomposition and order).
//   * Asynchronous on `stream`; the launch error is checked (DeviceError) before return.
//   * S = 0 is valid: varlen-M functions do nothing, varlen-K ones write zero weight gradients.
//
// Stability: this header is coded against by the layer (src/cuda/layer/). Changes are additive
// only and listed here:
//   * down_proj / dx_proj take an optional GemmScratch (default: none, the cp.async kernel);
//     tma_gemm_scratch_bytes and layer_gemm_scratch_bytes size it.
//   * up_proj, dh_proj, dw2_proj and dw1_proj take an optional GatherKernel (default: automatic).
//   * GatherKernel::ping_pong.
//   * ExpertRows, down_proj_rows, dx_proj_rows (token chunks).
//   * The automatic choice is kernel_config.hpp's choose_kernels (a value; replaces use_tma_gemm,
//     use_ws_gather, use_ws_dh, describe_kernels and the MOEBLAZE_GEMM_* switches).
//   * up_proj, dh_proj, dw2_proj, dw1_proj and dx_proj_rows take an optional `kernels`: the
//     choice made for another shape (null: choose_kernels for the plan's). The layer's expert
//     ranges (cuda/layer/expert_ranges.hpp) run the whole step's kernels over a sub-plan, so
//     every row and every expert's sum gets the whole step's bits.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/gemm/dispatch/kernel_config.hpp"
#include "moeblaze/config.hpp"
#include "moeblaze/dtype.hpp"
#include "moeblaze/routing_plan.hpp"

namespace moeblaze::cuda::gemm {

// Throws Unsupported unless the kernels take (d, n): both must be positive multiples of 64
// (the K-tile and the gated epilogue's gate/up half-tile), e.g.
// "d (100) must be a multiple of 64 for the CUDA backend".
void check_gemm_shape(int64_t d, int64_t n);

// Columns of the dH kernel's ds partials buffer: one per 128-wide tile of n (ceil(n / 128)).
int64_t ds_partials_cols(int64_t n);

// ---- the TMA path of the contiguous-A GEMMs (down_proj, dx_proj) ----------------------------
// Their A operand is contiguous per expert, so both operands can come by TMA: CUTLASS's Hopper
// pointer-array grouped GEMM (sm90_tma_grouped.cuh: warp-specialised, 128 x 256 tiles, clusters
// of 2, persistent). It needs a little device scratch for its per-expert argument arrays and TMA
// descriptors, which the caller provides (the layer carves it from its workspace).
struct GemmScratch {
  void* data = nullptr;  // 256-byte aligned; nullptr: run the cp.async kernel instead
  size_t bytes = 0;
};
// choose_kernels(...).down / .dx say whether they run on the TMA path (for S >= 128 E, where it
// is the faster path; docs/notes/plan-build.md, the TMA threshold).
// Scratch bytes the TMA path needs for E experts on the current device (the argument arrays,
// ≈ 100 B per expert, and CUTLASS's per-SM TMA descriptors).
size_t tma_gemm_scratch_bytes(int64_t E);
// What the layer reserves for down_proj / dx_proj: tma_gemm_scratch_bytes(E) when either runs on
// the TMA path for S slots over E experts, else 0 (and it passes no scratch).
size_t layer_gemm_scratch_bytes(int64_t S, int64_t E);

// Which rows of A a contiguous-A GEMM (down_proj, dx_proj) multiplies and where it writes them:
// expert e's A rows [begin[e], end[e]) go to D rows [out[e], out[e] + end[e] - begin[e]).
// Device arrays (E,) int32. The whole step is begin = out = off, end = off + 1; one token chunk
// (cuda/layer/token_chunks.hpp) reads its rows in place and writes them packed into a
// chunk-sized D.
struct ExpertRows {
  const int32_t* begin = nullptr;
  const int32_t* end = nullptr;
  const int32_t* out = nullptr;
  static ExpertRows whole(const RoutingPlanView& plan) {
    return {plan.expert_token_offsets, plan.expert_token_offsets + 1, plan.expert_token_offsets};
  }
};

// ---- the kernels of the gathered GEMMs ------------------------------------------------------
// Two implementations compute the same contract (bitwise different: different tile shapes):
//   two_cta: sm90_varlen_m.cuh / dw_proj.cu, 128 x 128 tiles, every thread loads and
//            multiplies, two CTAs per SM (one CTA's loads and epilogue overlap the other's MMAs);
//   warp_specialized: persistent, 128 x 256 tiles, a producer warpgroup feeding two consumer
//            warpgroups through mbarriers: sm90_ws_gather.cuh for up_proj / dh_proj (cp.async
//            gather + TMA weights; takes E <= 4096), sm90_ws_varlen_k.cuh for dw2_proj /
//            dw1_proj (cp.async gather + TMA for the slot-ordered operand; any E).
//   ping_pong: up_proj / dh_proj only: the same warp-specialised kernel with 128 x 128 tiles,
//            one per consumer warpgroup, so one warpgroup's epilogue runs under the other's
//            mainloop (E <= 4096); dw2_proj / dw1_proj refuse it (Unsupported).
// automatic: the kernel choose_kernels picks for the shape (kernel_config.hpp: the measured rules
// and the MOEBLAZE_KERNELS / set_kernel_overrides hook); any other value forces that kernel.
enum class GatherKernel { automatic, two_cta, warp_specialized, ping_pong };

// ---- forward -------------------------------------------------------------------------------

// (1) up-projection, A operand gathered: for each slot r of expert e, token t = indices[r],
//   h[r, :] = W1_e x[t, :] (+ b1_e)     (w1_rows,)   fp32 accumulate, stored bf16
//   a[r, :] = act(g) * u  (gated)  or  act(h)  (plain)   (n,), computed from the fp32
//   accumulators (not from the bf16-rounded h).
// x (T, d); w1 (E, w1_rows, d); h (S, w1_rows); a (S, n); b1 (E, w1_rows) 16-byte aligned, or
// null: the expert biases, added in the epilogue before the activation.
// Either h or a may be nullptr (not both) to skip that store: recompute mode's backward needs h
// only, inference needs a only. kernel = warp_specialized with E > 4096 throws Unsupported.
void up_proj(const RoutingPlanView& plan, const bf16* x, const bf16* w1, bf16* h, bf16* a,
             int64_t d, int64_t n, Activation act, cudaStream_t stream,
             GatherKernel kernel = GatherKernel::automatic, const bf16* b1 = nullptr,
             const LayerKernels* kernels = nullptr);

// (2) down-projection, A operand contiguous: y[r, :] = W2_e a[r, :].
// a (S, n); w2 (E, d, n); y (S, d). A non-empty scratch (tma_gemm_scratch_bytes(E)) selects the
// TMA path; it is in use until the GEMM has run on `stream`.
void down_proj(const RoutingPlanView& plan, const bf16* a, const bf16* w2, bf16* y, int64_t d,
               int64_t n, cudaStream_t stream, GemmScratch scratch = {});

// down_proj over the rows `rows` names (one token chunk): y_rows[rows.out[e] + i, :] =
// W2_e a[rows.begin[e] + i, :]. On the TMA path (scratch required: Unsupported without) or, where
// the chosen kernel is ws_gather, the warp-specialised kernel; the cp.async kernel takes its row
// ranges from expert_token_offsets only. y_rows holds at least
// max over e of rows.out[e] + rows.end[e] - rows.begin[e] rows of d; a as for down_proj.
void down_proj_rows(const RoutingPlanView& plan, const ExpertRows& rows, const bf16* a,
                    const bf16* w2, bf16* y_rows, int64_t d, int64_t n, cudaStream_t stream,
                    GemmScratch scratch);

// ---- backward ------------------------------------------------------------------------------

// (4) dH, A operand gathered from d_out, W2_e read N-major. For slot r of expert e, t = token:
//   da'[r, :] = W2_eᵀ d_out[t, :]                       (n,)  fp32, never stored
//   a         = act(g) * u  /  act(h), recomputed in fp32 from the stored bf16 h
//   ds_partials[r, j] = sum over columns c of tile j (128 wide) of da'[r, c] * a[r, c]
//   da = s_r da'  (s_r = plan.slot_weights[r])
//   dh[r, :] = gated: [da * u * act'(g); da * act(g)]   plain: da * act'(h)   (w1_rows,)
//   a_scaled[r, :] = s_r * a                                                   (n,)
// d_out (T, d); w2 (E, d, n); h (S, w1_rows); ds_partials (S, ds_partials_cols(n)) fp32;
// dh (S, w1_rows); a_scaled (S, n) (A' of docs/DESIGN.md, the second operand of dW2).
// The per-slot gate gradient is ds[r] = sum_j ds_partials[r, j]: call reduce_ds next.
// kernel as for up_proj.
void dh_proj(const RoutingPlanView& plan, const bf16* d_out, const bf16* w2, const bf16* h,
             float* ds_partials, bf16* dh, bf16* a_scaled, int64_t d, int64_t n, Activation act,
             cudaStream_t stream, GatherKernel kernel = GatherKernel::automatic,
             const LayerKernels* kernels = nullptr);

// ds[r] = sum over j = 0, 1, ... in order of ds_partials[r, j] (fixed order, fp32).
// ds_partials (S, ds_partials_cols(n)) fp32; ds (S,) fp32 grouped by expert (slot order).
void reduce_ds(const float* ds_partials, float* ds, int64_t S, int64_t n, cudaStream_t stream);

// (5) dW2, varlen-K (the reduction runs over the expert's slots):
//   dw2[e] = sum over slots r of e of d_out[token(r), :]ᵀ ⊗ a_scaled[r, :]    (d, n)
// d_out (T, d) gathered; a_scaled (S, n); dw2 (E, d, n). An expert with no slot gets zeros.
// kernel: see GatherKernel above.
void dw2_proj(const RoutingPlanView& plan, const bf16* d_out, const bf16* a_scaled, bf16* dw2,
              int64_t d, int64_t n, cudaStream_t stream,
              GatherKernel kernel = GatherKernel::automatic,
              const LayerKernels* kernels = nullptr);

// (6) dX̃, A operand contiguous, W1_e read N-major: dx_slots[r, :] = W1_eᵀ dh[r, :]   (d,)
// dh (S, w1_rows); w1 (E, w1_rows, d); dx_slots (S, d). Summed per token by aggregate_rows.
// scratch as for down_proj.
void dx_proj(const RoutingPlanView& plan, const bf16* dh, const bf16* w1, bf16* dx_slots,
             int64_t d, int64_t n, Activation act, cudaStream_t stream, GemmScratch scratch = {});

// dx_proj over the rows `rows` names (one token chunk), as down_proj_rows: dx_rows[rows.out[e] +
// i, :] = W1_eᵀ dh[rows.begin[e] + i, :]; TMA path only (scratch required).
void dx_proj_rows(const RoutingPlanView& plan, const ExpertRows& rows, const bf16* dh,
                  const bf16* w1, bf16* dx_rows, int64_t d, int64_t n, Activation act,
                  cudaStream_t stream, GemmScratch scratch,
                  const LayerKernels* kernels = nullptr);

// (8) dW1, varlen-K: dw1[e] = sum over slots r of e of dh[r, :]ᵀ ⊗ x[token(r), :]  (w1_rows, d)
// dh (S, w1_rows); x (T, d) gathered; dw1 (E, w1_rows, d). An expert with no slot gets zeros.
// kernel as for dw2_proj.
void dw1_proj(const RoutingPlanView& plan, const bf16* dh, const bf16* x, bf16* dw1, int64_t d,
              int64_t n, Activation act, cudaStream_t stream,
              GatherKernel kernel = GatherKernel::automatic,
              const LayerKernels* kernels = nullptr);

}  // namespace moeblaze::cuda::gemm
