// The token-chunk rule (token_chunks.hpp): host code only, testable without a GPU.
#include "cuda/layer/token_chunks.hpp"

#include <algorithm>

namespace moeblaze::cuda {

namespace {

TokenChunks pass_chunks(const LayerConfig& cfg, int64_t S, LayerMode mode,
                        const gemm::GemmKernel& gemm, std::optional<int> override) {
  if (S == 0) return TokenChunks::none(S, "nothing routed");
  if (gemm.family != gemm::KernelFamily::tma_grouped &&
      gemm.family != gemm::KernelFamily::ws_gather)
    return TokenChunks::none(S, "the GEMM is on the cp.async kernel, which takes no row ranges");
  int64_t count = 1;
  const char* rule = "override";
  if (override) {
    count = *override;
  } else if (mode != LayerMode::recompute) {
    return TokenChunks::none(S, "keep_h: speed first (chunk edges cost partial tiles)");
  } else if (cfg.d < 2 * cfg.n) {
    return TokenChunks::none(S, "d < 2n: chunks would save under a third of dX~'s bytes");
  } else {
    const int64_t by_width = (cfg.d + cfg.n - 1) / cfg.n;
    const int64_t by_size = S / (cfg.E * kChunkRowsPerExpertAtScale);
    const int64_t by_rows = S / (cfg.E * kChunkMinRowsPerExpert);
    count = std::max<int64_t>(1, std::min(std::max(by_width, by_size), by_rows));
    rule = count == by_rows && by_rows < std::max(by_width, by_size)
               ? "S / (512 E): at least 512 rows per expert per chunk"
           : by_size > by_width ? "S / (2048 E): the chunk buffer stops growing with T"
                                : "ceil(d / n): a chunk buffer no larger than A's (S, n)";
  }
  const int64_t rows = (S + count - 1) / count + cfg.E;
  if (count <= 1) return TokenChunks::none(S, rule);
  if (rows >= S) return TokenChunks::none(S, "a chunk would be as large as the step");
  return {count, rows, rule};
}

}  // namespace

LayerChunks choose_token_chunks(const LayerConfig& cfg, int64_t S, LayerMode mode,
                                const gemm::LayerKernels& kernels,
                                const gemm::KernelOverrides::TokenChunkOverride& override,
                                const ExpertRanges* ranges) {
  LayerChunks c{pass_chunks(cfg, S, mode, kernels.down, override.forward),
                pass_chunks(cfg, S, mode, kernels.dx, override.backward)};
  if (!override.forward && c.forward.count > 1) {
    // Elements: the forward's whole-step A and Y against what backward holds at its peak
    // anyway (H/dH, A' or the dX̃ chunk, the weight gradients dW1 and dW2). An upper bound
    // where dw1's bytes hold A' and the chunk (backward_dw1_reuse).
    const double w1_rows = double(cfg.w1_rows()), n = double(cfg.n), d = double(cfg.d);
    const double forward = double(S) * (n + d);
    const double weight_grads = double(cfg.E) * (w1_rows + n) * d;
    // In expert ranges: H/dH and A' or dX̃ of one range (R rows), dx's carry (T, d) 2-byte, ds
    // and the slot order (8 bytes per slot).
    const double R = ranges && ranges->on ? double(ranges->capacity_rows) : 0.0;
    const double backward =
        ranges && ranges->on
            ? R * w1_rows + R * std::max(n, d) + double(cfg.T) * d + 4.0 * double(S) +
                  weight_grads
            : double(S) * w1_rows + std::max(double(S) * n, double(c.backward.rows) * d) +
                  weight_grads;
    if (forward <= backward)
      c.forward = TokenChunks::none(S, "the forward's A and Y stay under backward's peak");
  }
  return c;
}

LayerChunks choose_token_chunks(const LayerConfig& cfg, int64_t S, LayerMode mode) {
  const gemm::KernelOverrides o = gemm::kernel_overrides();
  const gemm::LayerKernels k = gemm::choose_kernels({S, cfg.E, cfg.d, cfg.n}, o);
  const ExpertRanges ranges = choose_expert_ranges(cfg, S, mode, k, o.expert_ranges);
  return choose_token_chunks(cfg, S, mode, k, o.token_chunks, &ranges);
}

std::string describe(const TokenChunks& c) {
  if (c.count == 1) return "1 chunk (" + std::string(c.rule) + ")";
  return std::to_string(c.count) + " chunks of <= " + std::to_string(c.rows) + " rows (" +
         c.rule + ")";
}

}  // namespace moeblaze::cuda
