// The expert-range rule and split (expert_ranges.hpp): host code only, testable without a GPU.
#include "cuda/layer/expert_ranges.hpp"

#include <algorithm>

#include "moeblaze/error.hpp"

namespace moeblaze::cuda {

ExpertRanges choose_expert_ranges(const LayerConfig& cfg, int64_t S, LayerMode mode,
                                  const gemm::LayerKernels& kernels, std::optional<int> override) {
  if (mode != LayerMode::recompute)
    return ExpertRanges::off("keep_h: backward reads the saved whole-step H");
  if (S == 0) return ExpertRanges::off("nothing routed");
  if (kernels.dx.family != gemm::KernelFamily::tma_grouped &&
      kernels.dx.family != gemm::KernelFamily::ws_gather)
    return ExpertRanges::off("dX~ is on the cp.async kernel, which takes no row ranges");
  if (cfg.E > gemm::kWsDhSwigluCoopMaxExperts)
    return ExpertRanges::off("E > 2000: dH's kernel would differ between a range and the step");
  const int64_t capacity = std::min(cfg.T, S);
  if (capacity >= S) return ExpertRanges::off("one range would hold the whole step (S <= T)");
  if (override) {
    if (*override <= 1) return ExpertRanges::off("override");
    const int64_t target = std::min(capacity, (S + *override - 1) / *override);
    return {true, target, capacity, "override"};
  }
  if (whole_step_range_bytes(cfg, S) < kExpertRangesMinBytes)
    return ExpertRanges::off("whole-step H/dH and A' under 8 GiB");
  return {true, capacity, capacity, "whole-step H/dH and A' >= 8 GiB: ranges of <= T rows"};
}

ExpertRanges choose_expert_ranges(const LayerConfig& cfg, int64_t S, LayerMode mode) {
  const gemm::KernelOverrides o = gemm::kernel_overrides();
  return choose_expert_ranges(cfg, S, mode,
                              gemm::choose_kernels({S, cfg.E, cfg.d, cfg.n, cfg.activation}, o),
                              o.expert_ranges);
}

std::string describe(const ExpertRanges& r) {
  if (!r.on) return "whole step (" + std::string(r.rule) + ")";
  return "expert ranges of <= " + std::to_string(r.target_rows) + " rows (buffers of " +
         std::to_string(r.capacity_rows) + " rows: " + r.rule + ")";
}

std::vector<ExpertRange> split_expert_ranges(const std::vector<int32_t>& offsets,
                                             const ExpertRanges& r) {
  MOEBLAZE_REQUIRE(offsets.size() >= 2, "split_expert_ranges: offsets need E + 1 >= 2 values");
  MOEBLAZE_REQUIRE(r.on && r.target_rows >= 1 && r.target_rows <= r.capacity_rows,
                   "split_expert_ranges: ranges must be on with 1 <= target_rows (",
                   r.target_rows, ") <= capacity_rows (", r.capacity_rows, ")");
  const int64_t E = int64_t(offsets.size()) - 1;
  std::vector<ExpertRange> out;
  ExpertRange open{0, 0, offsets[0], offsets[0]};
  for (int64_t e = 0; e < E; ++e) {
    const int64_t count = int64_t(offsets[e + 1]) - offsets[e];
    MOEBLAZE_REQUIRE(count >= 0, "split_expert_ranges: offsets must not decrease (expert ", e,
                     ")");
    MOEBLAZE_REQUIRE(count <= r.capacity_rows, "plan: expert ", e, " has ", count,
                     " slots, more than the expert-range buffers' ", r.capacity_rows,
                     " rows (min(T, S)); an expert holds a token at most once");
    if (open.e1 > open.e0 && open.hi - open.lo + count > r.target_rows && open.hi > open.lo) {
      out.push_back(open);
      open = {e, e, offsets[e], offsets[e]};
    }
    open.e1 = e + 1;
    open.hi = offsets[e + 1];
  }
  out.push_back(open);
  return out;
}

}  // namespace moeblaze::cuda
