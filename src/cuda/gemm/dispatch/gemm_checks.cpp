// Argument checks of the grouped GEMM entry points; host code only (no CUDA, no CuTe), so the
// rules are testable without a GPU.
#include "cuda/gemm/dispatch/gemm_checks.hpp"

#include <cstdint>

#include "cuda/gemm/dispatch/kernel_config.hpp"  // kWsMaxExperts
#include "cuda/gemm/grouped_gemm.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda::gemm {

void check_gemm_shape(int64_t d, int64_t n) {
  // 64: the K step of every kernel (d and n are reduction lengths somewhere in the pipeline) and
  // the half-tile of the gated epilogue (gate and up columns of one j share a 128-wide tile).
  MOEBLAZE_UNSUPPORTED_IF(d % 64 != 0, "d (", d, ") must be a multiple of 64 for the CUDA backend");
  MOEBLAZE_UNSUPPORTED_IF(n % 64 != 0, "n (", n, ") must be a multiple of 64 for the CUDA backend");
}

int64_t ds_partials_cols(int64_t n) { return (n + 127) / 128; }

namespace detail {

void check_plan(const char* fn, const RoutingPlanView& plan, bool gathers, bool weights) {
  MOEBLAZE_REQUIRE(plan.device == Device::cuda, fn, ": plan must be on cuda (got ",
                   device_name(plan.device), ")");
  MOEBLAZE_REQUIRE(plan.E >= 1, fn, ": plan.E (", plan.E, ") must be at least 1");
  MOEBLAZE_REQUIRE(plan.E < INT32_MAX, fn, ": plan.E (", plan.E, ") must be below 2^31 - 1");
  MOEBLAZE_REQUIRE(plan.S >= 0, fn, ": plan.S (", plan.S, ") must not be negative");
  MOEBLAZE_REQUIRE(plan.S <= INT32_MAX, fn, ": plan.S (", plan.S,
                   ") exceeds the int32 slot index range");
  MOEBLAZE_REQUIRE(plan.expert_token_offsets != nullptr, fn,
                   ": plan.expert_token_offsets must not be null");
  if (plan.S > 0 && gathers)
    MOEBLAZE_REQUIRE(plan.expert_token_indices != nullptr, fn,
                     ": plan.expert_token_indices must not be null");
  if (plan.S > 0 && weights)
    MOEBLAZE_REQUIRE(plan.slot_weights != nullptr, fn, ": plan.slot_weights must not be null");
}

void check_ptr(const char* fn, const void* p, const char* name, bool needed) {
  MOEBLAZE_REQUIRE(!needed || p != nullptr, fn, ": ", name, " must not be null");
}

void check_contiguous_a(const char* fn, const RoutingPlanView& plan, int64_t d, int64_t n,
                        const void* a, const char* a_name, const void* b, const char* b_name,
                        const void* out, const char* out_name) {
  check_plan(fn, plan, /*gathers=*/false, /*weights=*/false);
  check_dims(fn, d, n);
  check_ptr(fn, a, a_name, plan.S > 0);
  check_ptr(fn, b, b_name, plan.S > 0);
  check_ptr(fn, out, out_name, plan.S > 0);
}

void check_rows(const char* fn, const RoutingPlanView& plan, const ExpertRows& rows,
                bool can_run) {
  if (plan.S == 0) return;
  check_ptr(fn, rows.begin, "rows.begin");
  check_ptr(fn, rows.end, "rows.end");
  check_ptr(fn, rows.out, "rows.out");
  MOEBLAZE_UNSUPPORTED_IF(!can_run, fn, ": row ranges run on the TMA path, which needs a "
                          "scratch (tma_gemm_scratch_bytes), or on the warp-specialised kernel "
                          "(<gemm>.family=ws)");
}

void check_gpu_activation(const char* fn, Activation act, int64_t E) {
  MOEBLAZE_UNSUPPORTED_IF(act == Activation::swiglu_oai && E > kWsMaxExperts, fn,
                          ": activation ", activation_name(act), " runs on its own "
                          "warp-specialised kernels only, which take E <= ", kWsMaxExperts,
                          " experts (got ", E, ")");
}

void check_dims(const char* fn, int64_t d, int64_t n) {
  MOEBLAZE_REQUIRE(d > 0, fn, ": d (", d, ") must be positive");
  MOEBLAZE_REQUIRE(n > 0, fn, ": n (", n, ") must be positive");
  MOEBLAZE_REQUIRE(d < (int64_t(1) << 30), fn, ": d (", d, ") must be below 2^30");
  MOEBLAZE_REQUIRE(n < (int64_t(1) << 30), fn, ": n (", n, ") must be below 2^30");
  check_gemm_shape(d, n);
}

}  // namespace detail
}  // namespace moeblaze::cuda::gemm
