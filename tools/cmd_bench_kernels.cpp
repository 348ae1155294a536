// `moeblaze bench kernels`: the kernel each grouped GEMM of the layer runs for a config
// (cuda::gemm::choose_kernels), field by field, with the rule that chose it. Needs a CUDA build,
// not a GPU: the choice is a host-side function of (S, E, d, n) and the kernel overrides
// (--kernels, else MOEBLAZE_KERNELS). A second table gives the layer's token chunks of Y and dX̃
// (cuda/layer/token_chunks.hpp), which follow from the same choice, and a third recompute's
// backward in expert ranges (cuda/layer/expert_ranges.hpp) at the config's T and from which T on.
// A fourth gives FP8 backward's memory plan (cuda::fp8_backward_plan). With --rounding, a fifth
// table counts the rows each GEMM multiplies, its tiles' padding included, under the benchmark's
// top-K routing and under token rounding of it: the GPU work rounding can save, whatever else it
// costs.
#include <CLI/CLI.hpp>

#include <cmath>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "commands.hpp"
#include "cmd_bench_util.hpp"
#include "configs.hpp"
#include "flags.hpp"
#include "cuda/gemm/dispatch/kernel_config.hpp"
#include "cuda/layer/expert_ranges.hpp"
#include "cuda/layer/layer_cuda.hpp"
#include "cuda/layer/token_chunks.hpp"
#include "moeblaze/error.hpp"
#include "table.hpp"

namespace moeblaze::tools {
namespace {

struct KernelsFlags {
  std::string config = "all";
  std::string kernels;
  std::string activation = "swiglu";
  std::string rounding;  // comma list of token roundings for the padding table ("" = no table)
  int m_tile = 128;
  uint64_t seed = 1234;
  int64_t sms = 0;  // the GPU's SM count the rules take (0: this machine's GPU, else kFallbackSms)
  int64_t l2_mib = 0;  // its L2 in MiB (0: this machine's GPU's, else kFallbackL2Bytes)
  int64_t flops_per_byte = 0;  // its FLOPs per DRAM byte (0: this machine's GPU's, else the fallback)
  bool candidates = false;  // the table of every GEMM's legal candidates (kernel_candidates)
};

// The shape the rules take: S slots of an (E, d, n) layer, on the GPU that --sms and --l2-mib
// describe (0: the current GPU's, or the fallbacks where none is visible).
cuda::gemm::KernelShape shape_for(const KernelsFlags& f, int64_t S, int64_t E, int64_t d,
                                  int64_t n, Activation act) {
  return {S, E, d, n, act, f.sms, f.l2_mib << 20, f.flops_per_byte};
}

// Per config and GEMM, every legal candidate (cuda::gemm::kernel_candidates): the spec that
// selects it, the kernel, and a mark on the automatic choice.
void candidates_table(const KernelsFlags& f, const std::vector<const NamedConfig*>& configs,
                      Activation act) {
  namespace gg = cuda::gemm;
  Table t({{"config", Align::left}, {"GEMM", Align::left}, {"candidate", Align::left},
           {"spec", Align::left}, {"auto", Align::left}});
  for (const NamedConfig* c : configs) {
    const gg::KernelShape shape = shape_for(f, c->T * c->K, c->E, c->d, c->n, act);
    const gg::LayerKernels chosen = gg::choose_kernels(shape, gg::KernelOverrides{});
    for (int i = 0; i < gg::LayerKernels::kCount; ++i)
      for (const gg::KernelCandidate& k : gg::kernel_candidates(i, shape))
        t.add_row({c->name, gg::LayerKernels::name(i), gg::describe(k.kernel), k.spec,
                   k.kernel == chosen.at(i) ? "*" : ""});
  }
  std::cout << "\nEvery GEMM's legal candidates (* the automatic choice, no overrides)\n";
  t.print(std::cout);
}

// FP8 backward's transients per config and recipe (cuda::fp8_backward_plan, weights cached): the
// bytes placed in dW2, dx and dW1 before they are written, and what stays in the workspace. The
// GEMMs' scratch (device-dependent, a few MiB) is left out.
void fp8_memory_table(const std::vector<const NamedConfig*>& configs, Activation act) {
  Table t({{"config", Align::left}, {"compute", Align::left}, {"mode", Align::left},
           {"in dw2 MiB"}, {"in dx MiB"}, {"in dw1 MiB"}, {"workspace MiB"},
           {"in the workspace", Align::left}});
  const auto mib = [](size_t b) { return fixed(double(b) / double(1 << 20), 1); };
  for (const NamedConfig* c : configs) {
    if (c->d % 128 != 0 || c->n % 128 != 0) continue;  // the GPU's FP8 path refuses these
    for (const Compute compute : {Compute::fp8, Compute::fp8_wgrad})
      for (const LayerMode mode : {LayerMode::keep_h, LayerMode::recompute}) {
        LayerConfig lc = layer_config(*c, act, DType::bf16);
        lc.compute = compute;
        const MemoryPlan p = cuda::fp8_backward_plan(lc, c->T * c->K, mode, false, 0);
        std::vector<size_t> in(p.arenas.size(), 0);
        std::string names;
        for (size_t i = 0; i < p.buffers.size(); ++i) {
          if (p.at[i].arena < 0) continue;
          in[size_t(p.at[i].arena)] += p.buffers[i].bytes;
          if (size_t(p.at[i].arena) + 1 == p.arenas.size())
            names += std::string(names.empty() ? "" : " ") + p.buffers[i].name;
        }
        t.add_row({c->name, compute_name(compute),
                   mode == LayerMode::keep_h ? "keep_h" : "recompute", mib(in[0]), mib(in[1]),
                   mib(in[2]), mib(p.workspace_bytes), names});
      }
  }
  std::cout << "\nFP8 backward's transients (weights cached; bytes summed per place, the "
               "workspace's after reuse; GEMM scratch not counted)\n";
  t.print(std::cout);
}

// One GEMM's multiply-adds over a routing (rows: (E,) slots per expert): the useful ones, and
// what its tiles compute, with M, N and K each padded to the kernel's tile (a tma_grouped 2-CTA
// cluster pairs CTAs along M on the 256-wide tile, along N on the 128-wide ones; ws_varlen_k's
// along M). The GEMMs in LayerKernels order, as M x N x K per expert: up rows x w1_rows x d,
// down rows x d x n, dH rows x n x d, dW2 d x n x rows, dX~ rows x d x w1_rows, dW1
// d x w1_rows x rows (the varlen-K kernels' 128-wide side is the gathered d).
struct TileWork {
  double useful = 0, covered = 0;
};
TileWork tile_work(const cuda::gemm::GemmKernel& g, int gemm, const LayerConfig& c,
                   const std::vector<int64_t>& rows) {
  namespace gg = cuda::gemm;
  const auto up_to = [](int64_t v, int64_t step) { return (v + step - 1) / step * step; };
  const bool pair = g.cluster == 2 && (g.family == gg::KernelFamily::tma_grouped ||
                                       g.family == gg::KernelFamily::ws_varlen_k);
  const bool pair_along_m = g.family == gg::KernelFamily::ws_varlen_k || g.tile_n == 256;
  const int64_t gm = g.tile_m * (pair && pair_along_m ? 2 : 1);
  const int64_t gn = g.tile_n * (pair && !pair_along_m ? 2 : 1);
  const int64_t gk = g.tile_k;
  const int64_t R = c.w1_rows(), d = c.d, n = c.n;
  TileWork w;
  for (const int64_t r : rows) {
    if (r == 0) continue;  // no tile of an empty expert multiplies anything
    int64_t m = r, nn = 0, k = 0;
    switch (gemm) {
      case gg::LayerKernels::kUp: nn = R, k = d; break;
      case gg::LayerKernels::kDown: nn = d, k = n; break;
      case gg::LayerKernels::kDh: nn = n, k = d; break;
      case gg::LayerKernels::kDw2: m = d, nn = n, k = r; break;
      case gg::LayerKernels::kDx: nn = d, k = R; break;
      default: m = d, nn = R, k = r; break;  // dW1
    }
    w.useful += double(m) * double(nn) * double(k);
    w.covered += double(up_to(m, gm)) * double(up_to(nn, gn)) * double(up_to(k, gk));
  }
  return w;
}

// --rounding's modes and --m-tile, checked before any table is printed.
void check_padding_flags(const KernelsFlags& f) {
  for (const std::string& r : split_commas(f.rounding))
    parse_rounding(r);  // InvalidArgument listing the valid modes
  MOEBLAZE_REQUIRE(f.m_tile >= 1 && f.m_tile <= 4096, "--m-tile ", f.m_tile,
                   " is outside [1, 4096]");
}

// Table 4: for each config and routing (top-K, then each rounding), with the kernels chosen at
// that routing's S, each GEMM's waste (multiply-adds its tiles compute beyond the useful ones, in
// % of them), and the six GEMMs' tile work against top-K's: the most a rounding can shorten a
// step whose GEMMs run at one rate; last, the useful share of the tiles' work, the most of the
// dense bound (bench layer's dense-bound row) a step reaches at the tiles' rate.
void padding_table(const KernelsFlags& f, const std::vector<const NamedConfig*>& configs,
                   Activation act, const cuda::gemm::KernelOverrides& o) {
  namespace gg = cuda::gemm;
  std::vector<std::string> roundings{"topk"};
  for (const std::string& r : split_commas(f.rounding)) roundings.push_back(r);
  std::vector<Column> cols{{"config", Align::left}, {"routing", Align::left}, {"S"}};
  for (int i = 0; i < gg::LayerKernels::kCount; ++i)
    cols.push_back({std::string(gg::LayerKernels::name(i)) + " waste %"});
  cols.push_back({"tile work vs top-K"});
  cols.push_back({"top-K / this"});
  cols.push_back({"of dense bound at most"});
  Table table(cols);
  for (const NamedConfig* nc : configs) {
    const LayerConfig c = layer_config(*nc, act, DType::bf16);
    double topk_work = 0;
    for (const std::string& r : roundings) {
      const Routing routing = benchmark_routing(c, f.seed, r, f.m_tile);  // as bench layer's
      std::vector<int64_t> rows(size_t(c.E), 0);  // (E,) pairs routed to each expert
      for (int64_t p = 0; p < routing.P(); ++p) ++rows[size_t(routing.pair_experts()[p])];
      const int64_t S = routing.P();
      const gg::LayerKernels k = gg::choose_kernels(shape_for(f, S, c.E, c.d, c.n, act), o);
      std::vector<std::string> row{nc->name,
                                   r == "topk" ? r : r + " m" + std::to_string(f.m_tile),
                                   std::to_string(S)};
      double work = 0, useful = 0;
      for (int i = 0; i < gg::LayerKernels::kCount; ++i) {
        const TileWork t = tile_work(k.at(i), i, c, rows);
        row.push_back(fixed(t.covered > 0 ? 100.0 * (1.0 - t.useful / t.covered) : 0.0, 1));
        work += t.covered;
        useful += t.useful;
      }
      if (r == "topk") topk_work = work;
      row.push_back(fixed(work / topk_work, 4));
      row.push_back(fixed(topk_work / work, 4));
      // The dense bound runs the useful multiply-adds as one unpadded GEMM per step: at the same
      // rate per tile, the tiles' share of useful work is the most of it this routing reaches.
      row.push_back(fixed(work > 0 ? 100.0 * useful / work : 100.0, 1) + " %");
      table.add_row(row);
    }
  }
  std::cout << "\ntile work (waste: multiply-adds each GEMM's tiles compute beyond the useful "
               "ones, M, N and K padded to its tiles; "
            << f.m_tile << "-row token rounding; softmax top-K of N(0, 1) logits, seed " << f.seed
            << ")\n";
  table.print(std::cout);
}

void run_kernels(const KernelsFlags& f) {
  namespace gg = cuda::gemm;
  const std::vector<const NamedConfig*> configs = select_configs(f.config);
  const Activation act = parse_activation(f.activation);
  check_padding_flags(f);
  const gg::KernelOverrides o =
      f.kernels.empty() ? gg::kernel_overrides() : gg::parse_kernel_overrides(f.kernels);
  if (!o.spec.empty()) std::cout << "kernel overrides: " << o.spec << "\n";
  // What the rules read of the device (the TMA path's bands, down/dx's weight-bound rule):
  // --sms, --l2-mib and --flops-per-byte, else this machine's GPU's.
  const gg::DeviceProps dev = gg::current_device_props();
  const std::string from = dev.device >= 0 ? " (device " + std::to_string(dev.device) + ")"
                                           : " (no GPU visible: the H100 SXM's)";
  const int64_t fpb = f.flops_per_byte > 0 ? f.flops_per_byte : dev.flops_per_byte;
  std::cout << "SMs: " << (f.sms > 0 ? f.sms : dev.sms) << (f.sms > 0 ? " (--sms)" : from)
            << "; L2: " << (f.l2_mib > 0 ? f.l2_mib : dev.l2_bytes >> 20) << " MiB"
            << (f.l2_mib > 0 ? " (--l2-mib)" : from) << "; FLOPs per DRAM byte: " << fpb
            << (f.flops_per_byte > 0 ? " (--flops-per-byte)" : from)
            << " (down/dx on the 192-row tile from 128 to " << gg::weight_bound_max_rows(fpb)
            << " rows an expert)\n";
  Table table({{"config", Align::left}, {"S"}, {"GEMM", Align::left}, {"family", Align::left},
               {"schedule", Align::left}, {"tile", Align::left}, {"stages"}, {"cluster"},
               {"order", Align::left}, {"rule", Align::left}});
  for (const NamedConfig* c : configs) {
    const int64_t S = c->T * c->K;  // softmax top-K, docs/DESIGN.md's benchmark routing
    const gg::LayerKernels k = gg::choose_kernels(shape_for(f, S, c->E, c->d, c->n, act), o);
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
                               (g.b_by_tma ? ", b by TMA" : "") +
                               (g.store_by_tma ? ", store by TMA" : ""),
                     g.rule});
    }
  }
  table.print(std::cout);
  std::cout << "launches: programmatic dependent launch " << (gg::choose_pdl(o) ? "on" : "off")
            << " (" << gg::pdl_rule(o) << ")\n";
  const gg::Fp8Kernel f8 = gg::choose_fp8_kernel(o);
  std::cout << "compute fp8: every FP8 grouped GEMM on " << gg::describe(f8) << " (" << f8.rule
            << ")\n";

  Table chunks({{"config", Align::left}, {"S"}, {"mode", Align::left}, {"pass", Align::left},
                {"chunks"}, {"rows per chunk"}, {"rule", Align::left}});
  for (const NamedConfig* c : configs) {
    const int64_t S = c->T * c->K;
    const LayerConfig lc = layer_config(*c, act, DType::bf16);
    const gg::LayerKernels k = gg::choose_kernels(shape_for(f, S, c->E, c->d, c->n, act), o);
    for (const LayerMode mode : {LayerMode::keep_h, LayerMode::recompute}) {
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
        lc, S, LayerMode::recompute, gg::choose_kernels(shape_for(f, S, c->E, c->d, c->n, act), o),
        o.expert_ranges);
    // The automatic rule's threshold in tokens (the override, where given, holds at every T).
    const int64_t per_token = cuda::whole_step_range_bytes(lc, c->K);
    const int64_t from = (cuda::kExpertRangesMinBytes + per_token - 1) / per_token;
    ranges.add_row({c->name, std::to_string(c->T), cuda::describe(here),
                    o.expert_ranges ? "override" : std::to_string(from)});
  }
  std::cout << "\n";
  ranges.print(std::cout);
  fp8_memory_table(configs, act);
  if (!f.rounding.empty()) padding_table(f, configs, act, o);
  if (f.candidates) candidates_table(f, configs, act);
}

}  // namespace

void add_bench_kernels_command(CLI::App& bench) {
  auto flags = std::make_shared<KernelsFlags>();
  CLI::App* sub = bench.add_subcommand(
      "kernels", "the kernel each grouped GEMM runs per config, field by field, and the rule "
                 "that chose it; needs no GPU");
  sub->add_option("--config", flags->config,
                  "a named config, a comma list, 'all' or 'grid' (the public-model grid)")
      ->capture_default_str();
  sub->add_option("--kernels", flags->kernels,
                  "kernel overrides, e.g. dw1.cluster=2,dh.schedule=pingpong (default: "
                  "MOEBLAZE_KERNELS)");
  sub->add_option("--activation", flags->activation,
                  "expert activation (swiglu-oai has its own up / dh kernels)")
      ->capture_default_str();
  sub->add_option("--rounding", flags->rounding,
                  "add the tile-padding table for top-K and these token roundings (comma list "
                  "of nr-f, sr-f, up, down)");
  sub->add_option("--m-tile", flags->m_tile, "token rounding's tile")->capture_default_str();
  sub->add_option("--seed", flags->seed, "the logits' seed (as bench layer's)")
      ->capture_default_str();
  sub->add_option("--sms", flags->sms,
                  "choose for a GPU of this many SMs (default: this machine's GPU; 132, the "
                  "H200's, where none is visible)")
      ->check(integer_in(1, 4096));
  sub->add_option("--l2-mib", flags->l2_mib,
                  "choose for a GPU of this much L2 in MiB (default: this machine's GPU's; 50, "
                  "the H100 SXM's, where none is visible)")
      ->check(integer_in(1, 1 << 20));
  sub->add_option("--flops-per-byte", flags->flops_per_byte,
                  "choose for a GPU of this peak dense bf16 FLOP/s over DRAM bytes/s (default: "
                  "this machine's GPU's; 319, the H100 SXM's, where none is visible; the H200's "
                  "is 217)")
      ->check(integer_in(1, 1 << 20));
  sub->add_flag("--candidates", flags->candidates,
               "add the table of every GEMM's legal candidates (what bench gemm --search ranks)");
  sub->callback([flags] { run_kernels(*flags); });
}

}  // namespace moeblaze::tools
