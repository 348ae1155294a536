// `moeblaze bench gemm`: the six grouped GEMMs of the CUDA pipeline (src/cuda/gemm/), each alone,
// by DESIGN's protocol: CUDA events around one launch, warm-up first, median of --reps (>= 20)
// repetitions, L2 flushed between repetitions (a 256 MiB write, more than 2x the H200's 60 MB L2).
// Inputs are random N(0, 1) bf16 (weights scaled by 1/sqrt(fan-in)), never zeros; the routing is
// near balanced (each token picks K distinct experts uniformly).
//
// Each row also times one dense cuBLAS bf16 GEMM with the same FLOPs (M = S, same N and K; for
// the varlen-K weight gradients K = S) on the same card, the ceiling a grouped GEMM can approach,
// and checks a few sampled output rows of the grouped GEMM against a float64 host computation
// (max_rel_err) so that no broken kernel is timed.
//
// FLOPs: up 2·S·w1_rows·d, down 2·S·d·n, dH 2·S·d·n, dW2 2·S·d·n, dX 2·S·w1_rows·d,
// dW1 2·S·w1_rows·d (their sum is DESIGN's 6·S·n·d forward + 12·S·n·d backward for gated).
#ifdef MOEBLAZE_WITH_CUDA

#include <CLI/CLI.hpp>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cmd_bench_util.hpp"
#include "commands.hpp"
#include "configs.hpp"
#include "flags.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "moeblaze/moeblaze.hpp"
#include "table.hpp"

namespace moeblaze::tools {
namespace {

constexpr double kDenseCeilingTflops = 760.0;  // measured cuBLAS 8192^3 bf16 on the H200

struct Shape {
  std::string name;
  int64_t T, d, n, E, K;
};

struct Flags {
  std::string configs = "gemm-big,olmoe,sm-7B-n256";
  std::string activation = "swiglu";
  int reps = 20;
  int warmup = 3;
  uint64_t seed = 20261129;
  bool no_dense = false;
  std::string only;  // comma list of kernel names to time (all when empty)
  std::string out;  // append JSON lines here
  std::string md;   // write the table as Markdown here
};

// "gemm-big" is the GEMM issue's shape (S = 65536 slots, E = 16, d = 2048, n = 1024); the others
// are DESIGN's named configs.
Shape find_shape(const std::string& name) {
  if (name == "gemm-big") return {name, 16384, 2048, 1024, 16, 4};
  const NamedConfig& c = require_config(name);
  return {name, c.T, c.d, c.n, c.E, c.K};
}

// Host-drawn N(0, stddev) bf16, in parallel chunks with per-chunk seeds (reproducible).
std::vector<bf16> random_bf16(size_t count, uint64_t seed, float stddev) {
  std::vector<bf16> v(count);
  constexpr size_t kChunk = size_t(1) << 20;
  const int64_t chunks = int64_t((count + kChunk - 1) / kChunk);
#pragma omp parallel for schedule(dynamic)
  for (int64_t c = 0; c < chunks; ++c) {
    std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + uint64_t(c));
    std::normal_distribution<float> dist(0.0f, stddev);
    const size_t end = std::min(count, size_t(c + 1) * kChunk);
    for (size_t i = size_t(c) * kChunk; i < end; ++i) {
      float x;
      do x = dist(rng); while (x == 0.0f);
      v[i] = bf16(x);
    }
  }
  return v;
}

struct Dev {
  void* p = nullptr;
  size_t bytes = 0;
  explicit Dev(size_t b) : bytes(b) { MOEBLAZE_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(b, 16))); }
  template <typename T>
  Dev(const std::vector<T>& v) : Dev(v.size() * sizeof(T)) {
    MOEBLAZE_CUDA_CHECK(cudaMemcpy(p, v.data(), bytes, cudaMemcpyHostToDevice));
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(p); }
  template <typename T>
  std::vector<T> get() const {
    std::vector<T> v(bytes / sizeof(T));
    MOEBLAZE_CUDA_CHECK(cudaMemcpy(v.data(), p, bytes, cudaMemcpyDeviceToHost));
    return v;
  }
};

void cublas_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw DeviceError(std::string(what) + " failed: cuBLAS status " + std::to_string(int(s)));
}

struct Row {
  std::string config, kernel;
  int64_t T, S, E, K, d, n;
  double ms, tflops, dense_ms, dense_tflops, max_rel_err;
};

void run(const Flags& f) {
  MOEBLAZE_REQUIRE(f.reps >= 20, "--reps (", f.reps, ") must be at least 20");
  MOEBLAZE_REQUIRE(f.warmup >= 1, "--warmup (", f.warmup, ") must be at least 1");
  const Activation act = parse_activation(f.activation);
  std::vector<Shape> shapes;
  for (const auto& name : split_commas(f.configs)) shapes.push_back(find_shape(name));
  MOEBLAZE_REQUIRE(!shapes.empty(), "--configs is empty");
  for (const auto& s : shapes) cuda::gemm::check_gemm_shape(s.d, s.n);

  int dev = 0;
  MOEBLAZE_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  MOEBLAZE_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  const std::string gpu = prop.name, driver = driver_version();
  const char* env_commit = std::getenv("MOEBLAZE_COMMIT");
  const std::string commit = env_commit && *env_commit ? env_commit : git_commit();
  const std::string date = utc_date_iso();
  std::cerr << "bench gemm: " << gpu << ", driver " << driver << ", commit " << commit << "\n";

  cudaStream_t stream = nullptr;
  Dev flush(kL2FlushBytes);
  GpuTimer timer(stream, flush.p);
  cublasHandle_t blas = nullptr;
  if (!f.no_dense) {
    cublas_check(cublasCreate(&blas), "cublasCreate");
    cublas_check(cublasSetStream(blas, stream), "cublasSetStream");
  }

  std::vector<Row> rows;
  for (const Shape& sh : shapes) {
    const int64_t T = sh.T, d = sh.d, n = sh.n, E = sh.E, K = sh.K, S = T * K;
    const int64_t R = is_gated(act) ? 2 * n : n;
    std::cerr << "bench gemm: " << sh.name << " T=" << T << " d=" << d << " n=" << n
              << " E=" << E << " K=" << K << " S=" << S << "\n";
    // Near-balanced routing: K distinct uniform experts per token; slots grouped by expert,
    // ascending token inside an expert.
    std::mt19937_64 rng(f.seed);
    std::vector<std::vector<int32_t>> by_expert(E);
    std::vector<int32_t> pick(E);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < E; ++e) pick[e] = int32_t(e);
      for (int64_t k = 0; k < K; ++k) {
        const int64_t j = k + int64_t(rng() % uint64_t(E - k));
        std::swap(pick[k], pick[j]);
        by_expert[pick[k]].push_back(int32_t(t));
      }
    }
    std::vector<int32_t> offsets(E + 1, 0), tokens, expert_of;
    tokens.reserve(S);
    for (int64_t e = 0; e < E; ++e) {
      for (int32_t t : by_expert[e]) {
        tokens.push_back(t);
        expert_of.push_back(int32_t(e));
      }
      offsets[e + 1] = int32_t(tokens.size());
    }
    std::vector<float> weights(S);
    std::uniform_real_distribution<float> wd(0.05f, 1.0f);
    for (auto& w : weights) w = wd(rng);

    const auto hx = random_bf16(size_t(T * d), f.seed + 1, 1.0f);
    const auto hw1 = random_bf16(size_t(E * R * d), f.seed + 2, 1.0f / std::sqrt(float(d)));
    const auto hw2 = random_bf16(size_t(E * d * n), f.seed + 3, 1.0f / std::sqrt(float(n)));
    const auto hdo = random_bf16(size_t(T * d), f.seed + 4, 1.0f);
    Dev off(offsets), tok(tokens), wts(weights), x(hx), w1(hw1), w2(hw2), dO(hdo);
    Dev h(size_t(S * R) * 2), a(size_t(S * n) * 2), y(size_t(S * d) * 2);
    Dev parts(size_t(S * cuda::gemm::ds_partials_cols(n)) * 4), dh(size_t(S * R) * 2),
        as(size_t(S * n) * 2), dx(size_t(S * d) * 2), dw1(size_t(E * R * d) * 2),
        dw2(size_t(E * d * n) * 2);
    RoutingPlanView plan;
    plan.T = T;
    plan.E = E;
    plan.S = S;
    plan.expert_token_offsets = off.as<int32_t>();
    plan.expert_token_indices = tok.as<int32_t>();
    plan.slot_weights = wts.as<float>();
    plan.device = Device::cuda;
    auto B = [](const Dev& b) { return b.as<const bf16>(); };
    auto M = [](const Dev& b) { return b.as<bf16>(); };

    struct Kernel {
      const char* name;
      const char* writes;  // the output buffer (the sampled check's key)
      double flops;
      std::function<void()> launch;
      int64_t dense_m, dense_n, dense_k;
    };
    namespace gg = cuda::gemm;
    Dev scratch_buf(gg::tma_gemm_scratch_bytes(E));
    const gg::GemmScratch tma_scratch{scratch_buf.as<char>(), gg::tma_gemm_scratch_bytes(E)};
    const std::vector<Kernel> kernels = {
        {"up", "h", 2.0 * S * R * d,
         [&] {
           gg::up_proj(plan, B(x), B(w1), M(h), M(a), d, n, act, stream,
                       gg::GatherKernel::two_cta);
         },
         S, R, d},
        // The warp-specialised persistent kernel of the gathered GEMMs, same outputs.
        {"up-ws", "h", 2.0 * S * R * d,
         [&] {
           gg::up_proj(plan, B(x), B(w1), M(h), M(a), d, n, act, stream,
                       gg::GatherKernel::warp_specialized);
         },
         S, R, d},
        {"up-pp", "h", 2.0 * S * R * d,
         [&] {
           gg::up_proj(plan, B(x), B(w1), M(h), M(a), d, n, act, stream,
                       gg::GatherKernel::ping_pong);
         },
         S, R, d},
        {"down", "y", 2.0 * S * d * n,
         [&] { gg::down_proj(plan, B(a), B(w2), M(y), d, n, stream); }, S, d, n},
        {"dH", "dh", 2.0 * S * d * n,
         [&] {
           gg::dh_proj(plan, B(dO), B(w2), B(h), parts.as<float>(), M(dh), M(as), d, n, act,
                       stream, gg::GatherKernel::two_cta);
         },
         S, n, d},
        {"dH-ws", "dh", 2.0 * S * d * n,
         [&] {
           gg::dh_proj(plan, B(dO), B(w2), B(h), parts.as<float>(), M(dh), M(as), d, n, act,
                       stream, gg::GatherKernel::warp_specialized);
         },
         S, n, d},
        {"dH-pp", "dh", 2.0 * S * d * n,
         [&] {
           gg::dh_proj(plan, B(dO), B(w2), B(h), parts.as<float>(), M(dh), M(as), d, n, act,
                       stream, gg::GatherKernel::ping_pong);
         },
         S, n, d},
        {"dW2", "dw2", 2.0 * S * d * n,
         [&] { gg::dw2_proj(plan, B(dO), B(as), M(dw2), d, n, stream, gg::GatherKernel::two_cta); },
         d, n, S},
        {"dW2-ws", "dw2", 2.0 * S * d * n,
         [&] {
           gg::dw2_proj(plan, B(dO), B(as), M(dw2), d, n, stream,
                        gg::GatherKernel::warp_specialized);
         },
         d, n, S},
        {"dX", "dx", 2.0 * S * R * d,
         [&] { gg::dx_proj(plan, B(dh), B(w1), M(dx), d, n, act, stream); }, S, d, R},
        // The TMA path of the two contiguous-A GEMMs (CUTLASS pointer-array), same outputs.
        {"down-tma", "y", 2.0 * S * d * n,
         [&] { gg::down_proj(plan, B(a), B(w2), M(y), d, n, stream, tma_scratch); }, S, d, n},
        {"dX-tma", "dx", 2.0 * S * R * d,
         [&] { gg::dx_proj(plan, B(dh), B(w1), M(dx), d, n, act, stream, tma_scratch); }, S, d,
         R},
        {"dW1", "dw1", 2.0 * S * R * d,
         [&] {
           gg::dw1_proj(plan, B(dh), B(x), M(dw1), d, n, act, stream, gg::GatherKernel::two_cta);
         },
         R, d, S},
        {"dW1-ws", "dw1", 2.0 * S * R * d,
         [&] {
           gg::dw1_proj(plan, B(dh), B(x), M(dw1), d, n, act, stream,
                        gg::GatherKernel::warp_specialized);
         },
         R, d, S},
    };

    // Dense same-FLOP operands: (max(M,N) x K) random bf16 for both sides.
    int64_t dense_elems = 0;
    for (const auto& k : kernels)
      dense_elems = std::max(dense_elems, std::max(k.dense_m, k.dense_n) * k.dense_k);
    std::unique_ptr<Dev> dA, dB, dC;
    if (!f.no_dense) {
      dA = std::make_unique<Dev>(random_bf16(size_t(dense_elems), f.seed + 5, 1.0f));
      dB = std::make_unique<Dev>(random_bf16(size_t(dense_elems), f.seed + 6, 0.02f));
      int64_t c_elems = 0;
      for (const auto& k : kernels) c_elems = std::max(c_elems, k.dense_m * k.dense_n);
      dC = std::make_unique<Dev>(size_t(c_elems) * 2);
    }

    // Run the chain once (each kernel's inputs are the previous ones' outputs where the pipeline
    // says so), then check sampled rows against float64.
    for (const auto& k : kernels) k.launch();
    MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(stream));
    const auto gh = h.get<bf16>(), gy = y.get<bf16>(), ga = a.get<bf16>(), gdx = dx.get<bf16>();
    const auto gdh = dh.get<bf16>(), gas = as.get<bf16>(), gdw2 = dw2.get<bf16>();
    auto f32 = [](bf16 v) { return double(float(v)); };
    std::vector<int64_t> sample;
    for (int i = 0; i < 8; ++i) sample.push_back(int64_t(rng() % uint64_t(S)));
    auto rel = [](double num, double den) { return std::sqrt(num / std::max(den, 1e-300)); };
    double e_up = 0, e_down = 0, e_dx = 0, e_dw2 = 0;
    {
      double nu = 0, du = 0, nd = 0, dd = 0, nx = 0, dxx = 0;
      for (int64_t r : sample) {
        const int64_t e = expert_of[r], t = tokens[r];
        for (int64_t o = 0; o < R; ++o) {  // h = W1_e x_t
          double acc = 0;
          for (int64_t k = 0; k < d; ++k) acc += f32(hx[t * d + k]) * f32(hw1[(e * R + o) * d + k]);
          nu += (f32(gh[r * R + o]) - acc) * (f32(gh[r * R + o]) - acc);
          du += acc * acc;
        }
        for (int64_t o = 0; o < d; ++o) {  // y = W2_e a (a as the kernel stored it)
          double acc = 0;
          for (int64_t k = 0; k < n; ++k) acc += f32(ga[r * n + k]) * f32(hw2[(e * d + o) * n + k]);
          nd += (f32(gy[r * d + o]) - acc) * (f32(gy[r * d + o]) - acc);
          dd += acc * acc;
        }
        for (int64_t o = 0; o < d; ++o) {  // dx = W1_eᵀ dh
          double acc = 0;
          for (int64_t k = 0; k < R; ++k) acc += f32(gdh[r * R + k]) * f32(hw1[(e * R + k) * d + o]);
          nx += (f32(gdx[r * d + o]) - acc) * (f32(gdx[r * d + o]) - acc);
          dxx += acc * acc;
        }
      }
      e_up = rel(nu, du);
      e_down = rel(nd, dd);
      e_dx = rel(nx, dxx);
      // dW2: a few entries of expert 0's (d, n) gradient.
      double nw = 0, dw = 0;
      for (int i = 0; i < 16; ++i) {
        const int64_t e = int64_t(rng() % uint64_t(E)), row = int64_t(rng() % uint64_t(d)),
                      col = int64_t(rng() % uint64_t(n));
        double acc = 0;
        for (int32_t r = offsets[e]; r < offsets[e + 1]; ++r)
          acc += f32(hdo[int64_t(tokens[r]) * d + row]) * f32(gas[int64_t(r) * n + col]);
        const double g = f32(gdw2[(e * d + row) * n + col]);
        nw += (g - acc) * (g - acc);
        dw += acc * acc;
      }
      e_dw2 = rel(nw, dw);
    }
    // The sampled check sees each output as its last writer in the chain left it, so the error
    // is that kernel's; the other variants writing the same output (up vs up-ws, dH vs dH-ws,
    // down vs down-tma, dX vs dX-tma) show "-" here and are checked by the GPU tests
    // (GroupedGemm, every kernel against float64).
    const std::pair<const char*, double> checked[] = {
        {"h", e_up}, {"y", e_down}, {"dw2", e_dw2}, {"dx", e_dx}};
    std::vector<double> errs(kernels.size(), NAN);
    for (const auto& [out, e] : checked)
      for (size_t i = kernels.size(); i-- > 0;)
        if (std::string(kernels[i].writes) == out) {
          errs[i] = e;
          break;
        }
    std::cerr << "bench gemm: sampled rel errors up " << e_up << " down " << e_down << " dW2 "
              << e_dw2 << " dX " << e_dx << "\n";
    for (double e : errs)
      if (std::isfinite(e) && e > 2e-2)
        throw DeviceError("bench gemm: a grouped GEMM's sampled error " + std::to_string(e) +
                          " exceeds 2e-2; not timing a broken kernel");

    const auto only = split_commas(f.only);
    for (size_t i = 0; i < kernels.size(); ++i) {
      const auto& k = kernels[i];
      if (!only.empty() && std::find(only.begin(), only.end(), std::string(k.name)) == only.end())
        continue;
      Row row{sh.name, k.name, T, S, E, K, d, n, 0, 0, NAN, NAN, errs[i]};
      row.ms = timer.median_ms(f.warmup, f.reps, k.launch);
      row.tflops = k.flops / (row.ms * 1e-3) / 1e12;
      if (!f.no_dense) {
        const float alpha = 1.0f, beta = 0.0f;
        const int m = int(k.dense_m), nn = int(k.dense_n), kk = int(k.dense_k);
        row.dense_ms = timer.median_ms(f.warmup, f.reps, [&] {
          cublas_check(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, nn, m, kk, &alpha, dB->p,
                                    CUDA_R_16BF, kk, dA->p, CUDA_R_16BF, kk, &beta, dC->p,
                                    CUDA_R_16BF, nn, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                       "cublasGemmEx");
        });
        row.dense_tflops = 2.0 * m * nn * double(kk) / (row.dense_ms * 1e-3) / 1e12;
      }
      rows.push_back(row);
      std::cerr << "  " << k.name << ": " << row.ms << " ms, " << row.tflops << " TFLOP/s\n";
    }
  }
  if (blas) cublasDestroy(blas);

  Table table({{"config", Align::left}, {"gemm", Align::left}, {"S"}, {"E"}, {"d"}, {"n"},
               {"ms"}, {"TFLOP/s"}, {"% 760"}, {"cuBLAS same-FLOP TFLOP/s"}, {"x cuBLAS"},
               {"sampled rel err"}});
  for (const auto& r : rows)
    table.add_row({r.config, r.kernel, std::to_string(r.S), std::to_string(r.E),
                   std::to_string(r.d), std::to_string(r.n), fixed(r.ms, 3), fixed(r.tflops, 1),
                   fixed(100.0 * r.tflops / kDenseCeilingTflops, 1), fixed(r.dense_tflops, 1),
                   fixed(r.tflops / r.dense_tflops, 2), scientific(r.max_rel_err, 1)});
  table.print(std::cout);
  if (!f.out.empty()) {
    std::ofstream os(f.out, std::ios::app);
    for (const auto& r : rows) {
      JsonLine j;
      j.add("bench", "gemm").add("config", r.config).add("impl", "moeblaze").add("gemm", r.kernel);
      j.add("activation", activation_name(act)).add("T", r.T).add("S", r.S).add("E", r.E);
      j.add("K", r.K).add("d", r.d).add("n", r.n).add("ms", r.ms).add("tflops", r.tflops);
      j.add("pct_of_dense_ceiling", 100.0 * r.tflops / kDenseCeilingTflops);
      j.add("dense_same_flop_ms", r.dense_ms).add("dense_same_flop_tflops", r.dense_tflops);
      j.add("max_rel_err", r.max_rel_err);
      j.add("gpu", gpu).add("driver", driver).add("commit", commit).add("date", date);
      os << j.str() << "\n";
    }
  }
  if (!f.md.empty()) {
    std::ofstream md(f.md);
    md << "# moeblaze bench gemm\n\n" << gpu << ", driver " << driver << ", commit " << commit
       << ", " << date << ". Activation " << activation_name(act) << "; median of " << f.reps
       << " reps, L2 flushed; % of the measured 760 TFLOP/s dense bf16 ceiling; cuBLAS column: "
          "one dense bf16 GEMM of the same FLOPs timed the same way.\n\n";
    md << "| config | gemm | S | E | d | n | ms | TFLOP/s | % 760 | cuBLAS TFLOP/s | x cuBLAS |\n";
    md << "|---|---|---|---|---|---|---|---|---|---|---|\n";
    for (const auto& r : rows)
      md << "| " << r.config << " | " << r.kernel << " | " << r.S << " | " << r.E << " | " << r.d
         << " | " << r.n << " | " << fixed(r.ms, 3) << " | " << fixed(r.tflops, 1) << " | "
         << fixed(100.0 * r.tflops / kDenseCeilingTflops, 1) << " | " << fixed(r.dense_tflops, 1)
         << " | " << fixed(r.tflops / r.dense_tflops, 2) << " |\n";
  }
}

}  // namespace

void add_bench_gemm_command(CLI::App& bench) {
  auto flags = std::make_shared<Flags>();
  CLI::App* sub = bench.add_subcommand("gemm", "the grouped GEMM kernels alone on the GPU");
  sub->add_option("--configs", flags->configs,
                  "comma list: gemm-big (S=65536, E=16, d=2048, n=1024) or named configs");
  sub->add_option("--activation", flags->activation, "swiglu, geglu, relu, silu, gelu, relu2");
  sub->add_option("--reps", flags->reps, "timed repetitions (>= 20)")
      ->check(integer_in(1, INT32_MAX));
  sub->add_option("--warmup", flags->warmup, "untimed repetitions first")
      ->check(integer_in(0, INT32_MAX));
  sub->add_option("--seed", flags->seed, "input seed")
      ->check(unsigned_integer());
  sub->add_flag("--no-dense", flags->no_dense, "skip the cuBLAS same-FLOP comparison");
  sub->add_option("--only", flags->only,
                  "time only these kernels (comma list of up, up-ws, up-pp, down, dH, dH-ws, dH-pp, dW2, dW2-ws, dX, "
                  "down-tma, dX-tma, dW1, dW1-ws); all of them still run once for the correctness check");
  sub->add_option("--out", flags->out, "append JSON lines to this file");
  sub->add_option("--md", flags->md, "write the table as Markdown to this file");
  sub->callback([flags] { run(*flags); });
}

}  // namespace moeblaze::tools

#endif  // MOEBLAZE_WITH_CUDA
