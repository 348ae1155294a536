// `moeblaze bench routing`: the routing-plan build (atomic-free vs the CUB radix-sort baseline) and
// the router kernel on the GPU, by docs/DESIGN.md's protocol: CUDA events around the region,
// warm-up first, median of --reps (>= 20) repetitions, L2 flushed between repetitions (a 256 MiB
// write, more than 2x the H200's 60 MB L2).
//
// Inputs are generated on the device: "balanced" routings are the softmax→top-K router's output
// on N(0, 1) logits (near balanced), "skewed" ones put 80% of the pairs on 20% of the experts.
// Effective bandwidth counts the minimum bytes: for a plan build, reading the routing (ids,
// weights, offsets) and writing the plan's six arrays once (24·P + 8·(T+1) + 4·(E+1) bytes); for
// the router, reading the logits and writing the routing. It is set against the device-to-device
// copy bandwidth measured in the same run (bytes read + written). Every plan is checked equal to
// the sort baseline's before its row is printed. The `plan-check` row times the device check of
// a caller-filled plan (cuda::validate_plan_async) on the sort baseline's plan.
#include <CLI/CLI.hpp>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cmd_bench_util.hpp"
#include "commands.hpp"
#include "flags.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/routing/bench_data.hpp"
#include "moeblaze/moeblaze.hpp"
#include "table.hpp"

namespace moeblaze::tools {
namespace {


struct Flags {
  std::string T = "16K,128K,1M,2M,8M";
  std::string E = "8,64,256,512";
  std::string K = "1,2,4,8";
  std::string skew = "balanced,skewed";
  std::string router_dtype = "bf16,fp32";
  std::string router_kinds = "softmax-topk,topk-softmax";
  std::string tile_steps;  // extra atomic-free variants to time (tuning), e.g. "4,8,16,32"
  bool quick = false;
  bool json = false;
  bool no_router = false;
  int reps = 20;
  int warmup = 3;
  uint64_t seed = 20261129;
  std::string out;  // append JSON lines here
  std::string md;   // write the table as Markdown here
};

// "16K" = 16384, "1M" = 1048576, or a plain number.
std::vector<int64_t> parse_sizes(const std::string& s, const char* flag) {
  std::vector<int64_t> v;
  for (const std::string& tok : split_commas(s)) {
    char* end = nullptr;
    const long long n = std::strtoll(tok.c_str(), &end, 10);
    int64_t mul = 1;
    std::string suffix(end ? end : "");
    if (suffix == "K" || suffix == "k") mul = 1024;
    else if (suffix == "M" || suffix == "m") mul = 1024 * 1024;
    else MOEBLAZE_REQUIRE(suffix.empty(), flag, " entry '", tok, "' is not a number (K/M suffixes allowed)");
    MOEBLAZE_REQUIRE(end != tok.c_str() && n >= 1, flag, " entry '", tok, "' must be >= 1");
    v.push_back(int64_t(n) * mul);
  }
  MOEBLAZE_REQUIRE(!v.empty(), flag, " is empty");
  return v;
}

std::string size_label(int64_t n) {
  if (n % (1024 * 1024) == 0) return std::to_string(n / (1024 * 1024)) + "M";
  if (n % 1024 == 0) return std::to_string(n / 1024) + "K";
  return std::to_string(n);
}

struct Meta {
  std::string gpu, driver, commit, date;
};

struct Row {
  std::string impl, skew, dtype;
  int64_t T = 0, E = 0, K = 0;
  double us = 0, gbps = 0, pct_copy = 0, vs_sort = 0;
  size_t workspace = 0;
};

// A row of `bytes` moved in `us` microseconds, against the copy bandwidth.
Row make_row(std::string impl, std::string skew, int64_t T, int64_t E, int64_t K, double us,
             double bytes, double copy_gbps, size_t workspace) {
  Row row;
  row.impl = std::move(impl);
  row.skew = std::move(skew);
  row.T = T, row.E = E, row.K = K;
  row.us = us;
  row.gbps = bytes / (us * 1e3);
  row.pct_copy = 100.0 * row.gbps / copy_gbps;
  row.workspace = workspace;
  return row;
}

void emit_json(const Row& r, const Meta& m, double copy_gbps, std::ostream& os) {
  JsonLine j;
  j.add("bench", "routing").add("impl", r.impl).add("T", r.T).add("E", r.E).add("K", r.K)
      .add("skew", r.skew).add("us", r.us).add("gbps", r.gbps)
      .add("workspace_bytes", uint64_t(r.workspace));
  if (!r.dtype.empty()) j.add("logits_dtype", r.dtype);
  j.add("copy_gbps", copy_gbps).add("pct_of_copy", r.pct_copy);
  if (r.vs_sort > 0) j.add("speedup_vs_sort", r.vs_sort);
  j.add("gpu", m.gpu).add("driver", m.driver).add("commit", m.commit).add("date", m.date);
  os << j.str() << "\n";
}

// The plans of two builders must agree; checked on the host (outside the timed region).
void require_same_plan(const RoutingPlan& a, const RoutingPlan& b, const char* what) {
  auto same = [](const void* x, const void* y, size_t bytes) {
    if (bytes == 0) return true;
    std::vector<unsigned char> hx(bytes), hy(bytes);
    MOEBLAZE_CUDA_CHECK(cudaMemcpy(hx.data(), x, bytes, cudaMemcpyDeviceToHost));
    MOEBLAZE_CUDA_CHECK(cudaMemcpy(hy.data(), y, bytes, cudaMemcpyDeviceToHost));
    return std::memcmp(hx.data(), hy.data(), bytes) == 0;
  };
  const RoutingPlanView va = a.view(), vb = b.view();
  const size_t S = size_t(a.S()) * 4, E1 = size_t(a.E() + 1) * 4;
  if (!same(va.expert_token_offsets, vb.expert_token_offsets, E1) ||
      !same(va.expert_token_indices, vb.expert_token_indices, S) ||
      !same(va.token_index_map, vb.token_index_map, S) ||
      !same(va.slot_weights, vb.slot_weights, S))
    throw Error(std::string("bench routing: ") + what + ": plans differ from the sort baseline");
}

void run(const Flags& f) {
  MOEBLAZE_REQUIRE(f.reps >= 20, "--reps (", f.reps, ") must be >= 20 (median of >= 20 runs)");
  MOEBLAZE_REQUIRE(f.warmup >= 1, "--warmup (", f.warmup, ") must be >= 1");
  std::vector<int64_t> Ts = parse_sizes(f.T, "--T"), Es = parse_sizes(f.E, "--E"),
                       Ks = parse_sizes(f.K, "--K");
  std::vector<std::string> skews = split_commas(f.skew), dtypes = split_commas(f.router_dtype);
  std::vector<RouterKind> kinds;
  for (const std::string& k : split_commas(f.router_kinds)) {
    kinds.push_back(parse_router(k));
    MOEBLAZE_REQUIRE(kinds.back() != RouterKind::supplied && kinds.back() != RouterKind::sigmoid_bias,
                     "--router-kinds entry '", k, "' is not softmax-topk or topk-softmax");
  }
  for (const std::string& s : skews)
    MOEBLAZE_REQUIRE(s == "balanced" || s == "skewed", "--skew entry '", s,
                     "' is not balanced or skewed");
  for (const std::string& d : dtypes)
    MOEBLAZE_REQUIRE(d == "bf16" || d == "fp32", "--router-dtype entry '", d,
                     "' is not bf16 or fp32");
  std::vector<int> steps;
  for (int64_t s : parse_sizes(f.tile_steps.empty() ? "1" : f.tile_steps, "--tile-steps"))
    if (!f.tile_steps.empty()) {
      MOEBLAZE_REQUIRE(s <= 64, "--tile-steps entry ", s, " must be in [1, 64]");
      steps.push_back(int(s));
    }
  if (f.quick) {
    Ts = {128 * 1024, 1024 * 1024};
    Es = {8, 256};
    Ks = {1, 8};
  }
  for (int64_t E : Es)
    for (int64_t K : Ks) MOEBLAZE_REQUIRE(K <= E, "--K ", K, " exceeds --E ", E);

  int dev = 0;
  MOEBLAZE_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop;
  MOEBLAZE_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  Meta meta;
  meta.gpu = prop.name;
  meta.driver = driver_version();
  meta.commit = git_commit();
  meta.date = utc_date_iso();

  cudaStream_t stream = nullptr;
  Buffer flush(Device::cuda, kL2FlushBytes);
  GpuTimer timer(stream, flush.data());

  // The copy ceiling: cudaMemcpy D2D of 2 GiB, bytes read + written.
  double copy_gbps = 0;
  {
    const size_t bytes = size_t(2) << 30;
    Buffer a(Device::cuda, bytes), b(Device::cuda, bytes);
    cuda::fill_normal(a.data(), DType::f32, int64_t(bytes / 4), f.seed, stream);
    const double us = timer.median_us(f.warmup, f.reps, [&] {
      MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice, stream));
    });
    copy_gbps = 2.0 * double(bytes) / (us * 1e3);
  }
  std::cerr << "bench routing: " << meta.gpu << ", driver " << meta.driver << ", copy "
            << fixed(copy_gbps, 0) << " GB/s (read + write)\n";

  std::vector<Row> rows;
  std::ofstream out_file;
  if (!f.out.empty()) {
    out_file.open(f.out, std::ios::app);
    MOEBLAZE_REQUIRE(out_file.good(), "--out '", f.out, "' cannot be opened for appending");
  }
  auto push = [&](const Row& r) {
    rows.push_back(r);
    if (f.json) emit_json(r, meta, copy_gbps, std::cout);
    if (out_file.is_open()) emit_json(r, meta, copy_gbps, out_file);
  };

  for (int64_t T : Ts)
    for (int64_t E : Es) {
      // Logits for the router rows and the balanced routing: bf16 first (it feeds the routing).
      Buffer logits_bf16(Device::cuda, size_t(T * E) * 2);
      cuda::fill_normal(logits_bf16.data(), DType::bf16, T * E, f.seed + uint64_t(T * 31 + E), stream);
      const TensorView lg16(logits_bf16.data(), DType::bf16, Device::cuda, {T, E});
      Buffer logits_f32;
      if (!f.no_router && std::find(dtypes.begin(), dtypes.end(), "fp32") != dtypes.end()) {
        logits_f32 = Buffer(Device::cuda, size_t(T * E) * 4);
        cuda::fill_normal(logits_f32.data(), DType::f32, T * E, f.seed + uint64_t(T * 31 + E), stream);
      }
      for (int64_t K : Ks) {
        RouterConfig rc;
        rc.kind = RouterKind::softmax_topk;
        rc.top_k = int(K);
        Buffer rws(Device::cuda, cuda::route_workspace_bytes(rc, T, E));
        Buffer losses(Device::cuda, 2 * sizeof(double));
        Buffer flags(Device::cuda, sizeof(int32_t) * cuda::kRoutingFlagCount);
        MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(flags.data(), 0, flags.bytes(), stream));
        if (!f.no_router) {
          for (RouterKind kind : kinds)
            for (const std::string& dt : dtypes) {
              const TensorView lg =
                  dt == "fp32" ? TensorView(logits_f32.data(), DType::f32, Device::cuda, {T, E}) : lg16;
              RouterConfig kc = rc;
              kc.kind = kind;
              Routing r(Device::cuda, T, E, T * K);
              const double us = timer.median_us(f.warmup, f.reps, [&] {
                cuda::route_async(kc, lg, TensorView(), r, rws.data(), losses.as<double>(),
                                  flags.as<int32_t>(), stream);
              });
              const double bytes = double(T * E) * double(dtype_size(lg.dtype)) +
                                   8.0 * double(T * K) + 4.0 * double(T + 1);
              Row row = make_row(std::string("router-") + router_name(kind), "-", T, E, K, us,
                                 bytes, copy_gbps, rws.bytes());
              row.dtype = dt;
              push(row);
            }
        }
        for (const std::string& skew : skews) {
          Routing routing(Device::cuda, T, E, T * K);
          if (skew == "balanced")
            cuda::route_async(rc, lg16, TensorView(), routing, rws.data(), losses.as<double>(),
                              flags.as<int32_t>(), stream);
          else
            cuda::fill_skewed_topk(routing, int(K), 0.2, 0.8, f.seed + uint64_t(K), stream);
          int32_t h_flags[cuda::kRoutingFlagCount];
          MOEBLAZE_CUDA_CHECK(cudaMemcpy(h_flags, flags.data(), sizeof(h_flags), cudaMemcpyDeviceToHost));
          for (int i = 0; i < cuda::kRoutingFlagCount; ++i)
            if (h_flags[i]) throw Error("bench routing: generated routing raised a device flag");
          const RoutingView rv = routing.view();
          const int64_t P = T * K;
          const double min_bytes = 24.0 * double(P) + 8.0 * double(T + 1) + 4.0 * double(E + 1);

          RoutingPlan sort_plan(Device::cuda, T, E, P);
          double sort_us = 0;
          {
            Buffer ws(Device::cuda, cuda::plan_build_workspace_bytes(T, E, P, PlanBuilder::sort));
            sort_us = timer.median_us(f.warmup, f.reps, [&] {
              cuda::build_plan_async(rv, PlanBuilder::sort, sort_plan, ws.data(), ws.bytes(),
                                     flags.as<int32_t>(), stream);
            });
            push(make_row("sort", skew, T, E, K, sort_us, min_bytes, copy_gbps, ws.bytes()));
          }
          std::vector<int> variants{0};
          variants.insert(variants.end(), steps.begin(), steps.end());
          for (int v : variants) {
            cuda::PlanBuildOptions o;
            o.tile_steps = v;
            RoutingPlan plan(Device::cuda, T, E, P);
            Buffer ws(Device::cuda,
                      cuda::plan_build_workspace_bytes(T, E, P, PlanBuilder::atomic_free, o));
            const double us = timer.median_us(f.warmup, f.reps, [&] {
              cuda::build_plan_async(rv, PlanBuilder::atomic_free, plan, ws.data(), ws.bytes(),
                                     flags.as<int32_t>(), stream, o);
            });
            require_same_plan(plan, sort_plan, "atomic-free");
            Row row = make_row(v == 0 ? "moeblaze" : "moeblaze-steps" + std::to_string(v), skew, T,
                               E, K, us, min_bytes, copy_gbps, ws.bytes());
            row.vs_sort = sort_us / us;
            push(row);
          }
          // The device check of a caller-filled plan (cuda::validate_plan_async) over the built
          // plan: its cost beside the build's. Bytes: the six arrays once plus the slot reads.
          {
            Buffer ws(Device::cuda, cuda::plan_check_workspace_bytes(P));
            Buffer pflags(Device::cuda, sizeof(int32_t) * cuda::kPlanFlagCount);  // (5,) int32
            MOEBLAZE_CUDA_CHECK(cudaMemset(pflags.data(), 0, pflags.bytes()));
            const double us = timer.median_us(f.warmup, f.reps, [&] {
              cuda::validate_plan_async(sort_plan.view(), ws.data(), ws.bytes(),
                                        pflags.as<int32_t>(), stream);
            });
            int32_t h_pflags[cuda::kPlanFlagCount];
            MOEBLAZE_CUDA_CHECK(cudaMemcpy(h_pflags, pflags.data(), sizeof(h_pflags),
                                           cudaMemcpyDeviceToHost));
            if (h_pflags[cuda::kFlagBadPlan])
              throw Error("bench routing: the plan check flagged a library-built plan");
            const double check_bytes = 20.0 * double(P) + 4.0 * double(T + 1) +
                                       4.0 * double(E + 1) + double(ws.bytes());
            push(make_row("plan-check", skew, T, E, K, us, check_bytes, copy_gbps, ws.bytes()));
          }
          MOEBLAZE_CUDA_CHECK(cudaMemcpy(h_flags, flags.data(), sizeof(h_flags), cudaMemcpyDeviceToHost));
          for (int i = 0; i < cuda::kRoutingFlagCount; ++i)
            if (h_flags[i]) throw Error("bench routing: a plan build raised a device flag");
        }
      }
    }

  Table table({{"T"}, {"E"}, {"K"}, {"skew", Align::left}, {"impl", Align::left},
               {"logits", Align::left}, {"us"}, {"GB/s"}, {"% copy"}, {"x sort"}, {"workspace"}});
  for (const Row& r : rows)
    table.add_row({size_label(r.T), std::to_string(r.E), std::to_string(r.K), r.skew, r.impl,
                   r.dtype.empty() ? "-" : r.dtype, fixed(r.us, 1), fixed(r.gbps, 0),
                   fixed(r.pct_copy, 1), r.vs_sort > 0 ? fixed(r.vs_sort, 2) : "-",
                   human_bytes(r.workspace)});
  if (!f.md.empty()) {
    std::ofstream md(f.md);
    MOEBLAZE_REQUIRE(md.good(), "--md '", f.md, "' cannot be opened");
    md << "# moeblaze bench routing\n\n" << meta.gpu << ", driver " << meta.driver << ", commit "
       << meta.commit << ", " << meta.date << ". Copy ceiling (cudaMemcpy D2D, read + write): "
       << fixed(copy_gbps, 0) << " GB/s. Median of " << f.reps
       << " reps, L2 flushed between reps. GB/s counts minimum bytes (plan: read the routing, "
          "write the plan; router: read the logits, write the routing).\n\n";
    md << "| T | E | K | skew | impl | logits | us | GB/s | % copy | x sort | workspace |\n";
    md << "|---:|---:|---:|---|---|---|---:|---:|---:|---:|---:|\n";
    for (const Row& r : rows)
      md << "| " << size_label(r.T) << " | " << r.E << " | " << r.K << " | " << r.skew << " | "
         << r.impl << " | " << (r.dtype.empty() ? "-" : r.dtype) << " | " << fixed(r.us, 1)
         << " | " << fixed(r.gbps, 0) << " | " << fixed(r.pct_copy, 1) << " | "
         << (r.vs_sort > 0 ? fixed(r.vs_sort, 2) : "-") << " | " << human_bytes(r.workspace)
         << " |\n";
  }
  if (!f.json) {
    std::cout << "copy ceiling: " << fixed(copy_gbps, 0) << " GB/s on " << meta.gpu << "\n";
    table.print(std::cout);
  }
}

}  // namespace

void add_bench_routing_command(CLI::App& bench) {
  auto flags = std::make_shared<Flags>();
  CLI::App* sub = bench.add_subcommand(
      "routing", "routing-plan build (atomic-free vs CUB sort) and router kernel on the GPU");
  sub->add_option("--T", flags->T, "token counts, comma-separated (K/M suffixes)")
      ->capture_default_str();
  sub->add_option("--E", flags->E, "expert counts")->capture_default_str();
  sub->add_option("--K", flags->K, "experts per token")->capture_default_str();
  sub->add_option("--skew", flags->skew, "routings: balanced, skewed (80% of pairs on 20% of experts)")
      ->capture_default_str();
  sub->add_option("--router-dtype", flags->router_dtype, "logits dtypes of the router rows")
      ->capture_default_str();
  sub->add_option("--router-kinds", flags->router_kinds, "routers of the router rows")
      ->capture_default_str();
  sub->add_option("--tile-steps", flags->tile_steps,
                  "also time the atomic-free builder at these tile sizes (256*steps pairs)");
  sub->add_flag("--quick", flags->quick, "a small sweep: T 128K,1M; E 8,256; K 1,8");
  sub->add_flag("--no-router", flags->no_router, "skip the router rows");
  sub->add_flag("--json", flags->json, "JSON lines on stdout instead of the table");
  sub->add_option("--reps", flags->reps, "timed repetitions (median; >= 20)")->capture_default_str()
      ->check(integer_in(1, INT32_MAX));
  sub->add_option("--warmup", flags->warmup, "untimed warm-up runs")->capture_default_str()
      ->check(integer_in(0, INT32_MAX));
  sub->add_option("--seed", flags->seed, "input seed")->capture_default_str()
      ->check(unsigned_integer());
  sub->add_option("--out", flags->out, "also append the JSON lines to this file");
  sub->add_option("--md", flags->md, "also write the table as Markdown to this file");
  sub->callback([flags] { run(*flags); });
}

}  // namespace moeblaze::tools
