// `moeblaze bench kernels`: which kernel each grouped GEMM of the layer runs for a config, with its
// tiles, pipeline and the rule that chose it (cuda::gemm::describe_kernels) — the tile
// configuration printed on request. Needs a CUDA build, not a GPU: the choices are host-side
// functions of (S, E, d, n) and the MOEBLAZE_GEMM_* environment overrides.
#include <CLI/CLI.hpp>

#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "commands.hpp"
#include "configs.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "moeblaze/error.hpp"
#include "table.hpp"

namespace moeblaze::tools {
namespace {

struct KernelsFlags {
  std::string config = "all";
};

void run_kernels(const KernelsFlags& f) {
  const std::vector<const NamedConfig*> configs = select_configs(f.config);
  Table table({{"config", Align::left}, {"S"}, {"GEMM", Align::left}, {"kernel", Align::left}});
  for (const NamedConfig* c : configs) {
    const int64_t S = c->T * c->K;  // softmax top-K, DESIGN's benchmark routing
    for (const auto& k : cuda::gemm::describe_kernels(S, c->E, c->d))
      table.add_row({c->name, std::to_string(S), k.gemm, k.kernel});
  }
  table.print(std::cout);
}

}  // namespace

void add_bench_kernels_command(CLI::App& bench) {
  auto flags = std::make_shared<KernelsFlags>();
  CLI::App* sub = bench.add_subcommand(
      "kernels", "the kernel each grouped GEMM runs per config (tiles, pipeline, the rule that "
                 "chose it); needs no GPU");
  sub->add_option("--config", flags->config, "a named config, a comma list, or 'all'")
      ->capture_default_str();
  sub->callback([flags] { run_kernels(*flags); });
}

}  // namespace moeblaze::tools
