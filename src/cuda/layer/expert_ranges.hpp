// Recompute mode's backward in expert ranges: the step's (S, ·) transients (H recomputed, dH over
// it, A', dX̃) bounded by a range of experts' rows instead of all S slots, so that the largest T
// on one GPU is set by the inputs, outputs and weights rather than by S·n temporaries.
//
// The experts are walked in ranges [e0, e1) of whole experts. A range's slots [off[e0], off[e1])
// are one contiguous row range (slots are grouped by expert), and per range the backward runs
// every step of the whole step over a sub-plan (the range's experts, rebased offsets):
//   up_proj → H_r, dh_proj → dH_r over H_r, A'_r and ds, dw2_proj → dW2[e0, e1),
//   dx_proj_rows → dX̃_r, added into dx's fp32 carry, dw1_proj → dW1[e0, e1).
// A range holds whole experts, so dW1 and dW2 are each one reduction per expert (no accumulation
// across ranges), and the GEMMs run with the whole step's kernel choice (the `kernels` argument
// of grouped_gemm.hpp), so every row of H, dH, A' and dX̃ and every expert's weight gradient has
// the whole step's bits. dx: each token sums its dX̃ rows in ascending slot order (= ascending
// expert) in fp32 and rounds once, in the whole step (the layer's dx aggregation order) as
// across ranges (the fp32 dx carries the partial sum from one range to the next), so dx has the
// whole step's bits too. LayerGpu.ExpertRangesGiveTheWholeStepsBits checks all of it.
//
// Cost: one host sync per backward (the ranges are cut from the expert counts), one launch of
// each GEMM per range, and the fp32 carry (T, d) read and written once per range.
//
// Capacity: an expert has at most T slots (a token routes to an expert at most once), so range
// buffers of min(T, S) rows hold any expert; the ranges close at `target_rows` (capacity by
// default), and an expert with more slots than the target is a range of its own.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cuda/gemm/dispatch/kernel_config.hpp"
#include "moeblaze/config.hpp"
#include "moeblaze/dtype.hpp"
#include "moeblaze/layer.hpp"
#include "moeblaze/routing_plan.hpp"

namespace moeblaze::cuda {

// The backward's expert ranges, as a value (printed by `moeblaze bench kernels`, its fields
// checked in tests). The ranges themselves depend on the expert counts: split_expert_ranges.
struct ExpertRanges {
  bool on = false;
  int64_t target_rows = 0;    // a range closes before the expert that would take it past this
  int64_t capacity_rows = 0;  // rows of the range buffers: min(T, S), at least any expert's slots
  const char* rule = "";      // why (printed; not part of the value)
  static ExpertRanges off(const char* rule) { return {false, 0, 0, rule}; }
};

// Whole-step H/dH and A' bytes, S·(w1_rows + n)·2, from which the automatic rule runs the
// backward in expert ranges: below it a step's transients fit beside its inputs on any GPU the
// layer targets, and the ranges' host sync and fp32 dx traffic would only cost time.
constexpr int64_t kExpertRangesMinBytes = int64_t(8) << 30;
// The bytes the automatic rule weighs against it: S·(w1_rows + n)·2.
inline int64_t whole_step_range_bytes(const LayerConfig& cfg, int64_t S) {
  return S * (cfg.w1_rows() + cfg.n) * 2;
}

// The rule for S slots over cfg's experts in `mode`, given the kernels chosen for the shape and
// the `ranges` kernel override (KernelOverrides::expert_ranges). Total and deterministic.
// Off: keep_h (its H is the saved whole-step H); S == 0; dX̃ on the cp.async kernel (which takes
// no row ranges); E > kWsDhSwigluCoopMaxExperts (dH's kernel would differ between the whole step
// and a range of fewer experts); min(T, S) == S (a range could hold the whole step).
// Automatic: on from kExpertRangesMinBytes, target = capacity (about S / T = K ranges).
// Override N > 1: on, target = min(ceil(S / N), capacity); N = 1: off.
ExpertRanges choose_expert_ranges(const LayerConfig& cfg, int64_t S, LayerMode mode,
                                  const gemm::LayerKernels& kernels, std::optional<int> override);
// With choose_kernels for the shape and the overrides in force.
ExpertRanges choose_expert_ranges(const LayerConfig& cfg, int64_t S, LayerMode mode);
// e.g. "expert ranges of <= 65536 rows (capacity 65536: whole-step H/dH and A' >= 8 GiB)".
std::string describe(const ExpertRanges& r);

struct ExpertRange {
  int64_t e0 = 0, e1 = 0;  // experts [e0, e1)
  int64_t lo = 0, hi = 0;  // slots [off[e0], off[e1])
};
// The ranges of a plan's expert offsets (E + 1 values, host copy), greedily: experts are added to
// the open range while its slots stay <= r.target_rows; an expert that would take it past closes
// it, and starts the next. Covers [0, E) in order; empty experts join the open range. Throws
// InvalidArgument when an expert has more slots than r.capacity_rows (a plan whose expert holds a
// token twice: the range buffers could not hold it).
std::vector<ExpertRange> split_expert_ranges(const std::vector<int32_t>& offsets,
                                             const ExpertRanges& r);

// ---- device helpers (expert_ranges.cu) ------------------------------------------------------

// slots[j] for j in [pair_offsets[t], pair_offsets[t+1]): token t's slots in ascending order (its
// pairs' token_index_map values, sorted). The order in which the layer sums a token's dX̃ rows.
// slots (S,) int32.
void ascending_token_slots(const RoutingPlanView& plan, int32_t* slots, cudaStream_t stream);

// out[i] = offsets[e0 + i] - offsets[e0] for i in [0, count]: a range's rebased offsets.
void rebase_offsets(const int32_t* offsets, int64_t e0, int64_t count, int32_t* out,
                    cudaStream_t stream);

// For every token t and column: acc = (first ? 0 : carry[t]) + rows[s - lo] for each of its
// slots s in [lo, hi), in ascending order (`slots` from ascending_token_slots); then dx[t] =
// bf16(acc) when last, else carry[t] = acc. The fp32 carry is held in halves: its high 16 bits
// in dx's own (T, d) bytes, its low 16 bits in carry_lo (T, d). rows (hi - lo, d) bf16 (a
// range's dX̃); dx (T, d) bf16; d a multiple of 8, rows/dx/carry_lo 16-byte aligned.
void accumulate_range(const RoutingPlanView& plan, const int32_t* slots, int64_t lo, int64_t hi,
                      const bf16* rows, uint16_t* carry_lo, bf16* dx, int64_t d, bool first,
                      bool last, cudaStream_t stream);

}  // namespace moeblaze::cuda
