// `moeblaze bench kernels`: the kernel each grouped GEMM of the layer runs for a config
// (cuda::gemm::choose_kernels), field by field, with the rule that chose it. Needs a CUDA build,
// not a GPU: the choice is a host-side function of (S, E, d, n) and the kernel overrides
// (--kernels, else MOEBLAZE_KERNELS). A second table gives the layer's token chunks of Y and dX̃
// (cuda/layer/token_chunks.hpp), which follow from the same choice, and a third recompute's
// backward in expert ranges (cuda/layer/expert_ranges.hpp) at the config's T and from which T on.
#include <CLI/CLI.hpp>

#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "commands.hpp"
#include "configs.hpp"
#include "cuda/gemm/dispatch/kernel_config.hpp"
#include "cuda/layer/expert_ranges.hpp"
#include "cuda/layer/token_chunks.hpp"
#include "moeblaze/error.hpp"
#include "table.hpp"

namespace moeblaze::tools {
namespace {

struct KernelsFlags {
  std::string config = "all";
  std::string kernels;
  std::string activation = "swiglu";
};

void run_kernels(const KernelsFlags& f) {
  namespace gg = cuda::gemm;
  const std::vector<const NamedConfig*> configs = select_configs(f.config);
  const Activation act = parse_activation(f.activation);
  const gg::KernelOverrides o =
      f.kernels.empty() ? gg::kernel_overrides() : gg::parse_kernel_overrides(f.kernels);
  if (!o.spec.empty()) std::cout << "kernel overrides: " << o.spec << "\n";
  Table table({{"config", Align::left}, {"S"}, {"GEMM", Align::left}, {"family", Align::left},
               {"schedule", Align::left}, {"tile", Align::left}, {"stages"}, {"cluster"},
               {"order", Align::left}, {"rule", Align::left}});
  for (const NamedConfig* c : configs) {
    const int64_t S = c->T * c->K;  // softmax top-K, DESIGN's benchmark routing
    const gg::LayerKernels k = gg::choose_kernels({S, c->E, c->d, c->n, act}, o);
    for (int i = 0; i < gg::LayerKernels::kCount; ++i) {
      const gg::GemmKernel& g = k.at(i);
      const bool tma = g.family == gg::KernelFamily::tma_grouped;
      table.add_row({c->name, std::to_string(S), gg::LayerKernels::name(i),
                     gg::family_name(g.family), gg::schedule_name(g.schedule),
                     std::to_string(g.tile_m) + "x" + std::to_string(g.tile_n) + "x" +
                         std::to_string(g.tile_k),
                     g.stages ? std::to_string(g.stages) : "auto", std::to_string(g.cluster),
                     tma ? std::string(g.tma_along_n ? "n" : "m") + " swizzle " +
                               std::to_string(g.tma_swizzle) + " bands " +
                               std::to_string(g.tma_bands)
                         : "raster " + std::to_string(g.raster_group) +
                               (g.b_by_tma ? ", b by TMA" : ""),
                     g.rule});
    }
  }
  table.print(std::cout);

  Table chunks({{"config", Align::left}, {"S"}, {"mode", Align::left}, {"pass", Align::left},
                {"chunks"}, {"rows per chunk"}, {"rule", Align::left}});
  for (const NamedConfig* c : configs) {
    const int64_t S = c->T * c->K;
    const LayerConfig lc = layer_config(*c, act, DType::bf16);
    for (const LayerMode mode : {LayerMode::keep_h, LayerMode::recompute}) {
      const gg::LayerKernels k = gg::choose_kernels({S, c->E, c->d, c->n, act}, o);
      const cuda::ExpertRanges ranges =
          cuda::choose_expert_ranges(lc, S, mode, k, o.expert_ranges);
      const cuda::LayerChunks lch = cuda::choose_token_chunks(lc, S, mode, k, o.token_chunks,
                                                              &ranges);
      for (const auto& [pass, tc] : {std::pair{"forward (Y)", lch.forward},
                                     std::pair{"backward (dX~)", lch.backward}})
        chunks.add_row({c->name, std::to_string(S),
                        mode == LayerMode::keep_h ? "keep_h" : "recompute", pass,
                        std::to_string(tc.count), std::to_string(tc.rows), tc.rule});
    }
  }
  std::cout << "\n";
  chunks.print(std::cout);

  Table ranges({{"config", Align::left}, {"T"}, {"recompute backward", Align::left},
                {"ranges from T"}});
  for (const NamedConfig* c : configs) {
    const int64_t S = c->T * c->K;
    const LayerConfig lc = layer_config(*c, act, DType::bf16);
    const cuda::ExpertRanges here = cuda::choose_expert_ranges(
        lc, S, LayerMode::recompute, gg::choose_kernels({S, c->E, c->d, c->n, act}, o),
        o.expert_ranges);
    // The automatic rule's threshold in tokens (the override, where given, holds at every T).
    const int64_t per_token = cuda::whole_step_range_bytes(lc, c->K);
    const int64_t from = (cuda::kExpertRangesMinBytes + per_token - 1) / per_token;
    ranges.add_row({c->name, std::to_string(c->T), cuda::describe(here),
                    o.expert_ranges ? "override" : std::to_string(from)});
  }
  std::cout << "\n";
  ranges.print(std::cout);
}

}  // namespace

void add_bench_kernels_command(CLI::App& bench) {
  auto flags = std::make_shared<KernelsFlags>();
  CLI::App* sub = bench.add_subcommand(
      "kernels", "the kernel each grouped GEMM runs per config, field by field, and the rule "
                 "that chose it; needs no GPU");
  sub->add_option("--config", flags->config, "a named config, a comma list, or 'all'")
      ->capture_default_str();
  sub->add_option("--kernels", flags->kernels,
                  "kernel overrides, e.g. dw1.cluster=2,dh.schedule=pingpong (default: "
                  "MOEBLAZE_KERNELS)");
  sub->add_option("--activation", flags->activation,
                  "expert activation (swiglu-oai has its own up / dh kernels)")
      ->capture_default_str();
  sub->callback([flags] { run_kernels(*flags); });
}

}  // namespace moeblaze::tools
