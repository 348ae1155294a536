// Argument checks shared by the grouped GEMM entry points (grouped_gemm.hpp). Host-only.
#pragma once

#include <cstdint>

#include "moeblaze/config.hpp"  // Activation
#include "moeblaze/routing_plan.hpp"

namespace moeblaze::cuda::gemm {
struct ExpertRows;
}

namespace moeblaze::cuda::gemm::detail {

// InvalidArgument unless the plan lives on the GPU, E >= 1, S >= 0 and S fits int32, and the
// arrays the kernels read are present: expert_token_offsets always, expert_token_indices when
// `gathers` and S > 0, slot_weights when `weights` and S > 0. `fn` prefixes the message.
void check_plan(const char* fn, const RoutingPlanView& plan, bool gathers, bool weights);

// InvalidArgument "fn: name must not be null" when p is null and `needed` (an empty operand of
// an S = 0 call may be null).
void check_ptr(const char* fn, const void* p, const char* name, bool needed = true);

// The contiguous-A GEMMs' (down_proj, dx_proj and their _rows forms) common checks: check_plan
// (no gather, no weights), check_dims, and the operands a, b and the output present when S > 0.
void check_contiguous_a(const char* fn, const RoutingPlanView& plan, int64_t d, int64_t n,
                        const void* a, const char* a_name, const void* b, const char* b_name,
                        const void* out, const char* out_name);

// For the row-range GEMMs (down_proj_rows, dx_proj_rows) when the plan has slots: InvalidArgument
// naming the missing array unless rows.begin, rows.end and rows.out are all set; Unsupported
// unless can_run (row ranges run on the TMA path, given a scratch, or the warp-specialised one).
void check_rows(const char* fn, const RoutingPlanView& plan, const ExpertRows& rows,
                bool can_run);

// InvalidArgument unless d, n are positive and below 2^30, then check_gemm_shape (Unsupported).
void check_dims(const char* fn, int64_t d, int64_t n);
// Whether the fused GPU epilogues take `act` with E experts: every activation, swiglu_oai on
// its own warp-specialised kernels only (E <= kWsMaxExperts); Unsupported naming the rule.
void check_gpu_activation(const char* fn, Activation act, int64_t E);

}  // namespace moeblaze::cuda::gemm::detail
