// `moeblaze bench gemm`: the six grouped GEMMs of the CUDA pipeline (src/cuda/gemm/), each alone,
// by docs/DESIGN.md's protocol: CUDA events around one launch, warm-up first, median of
// --reps (>= 20) repetitions, L2 flushed between repetitions (a 256 MiB write, more than 2x the
// H200's 60 MB L2).
// Inputs are random N(0, 1) bf16 (weights scaled by 1/sqrt(fan-in)), never zeros; the routing is
// near balanced (each token picks K distinct experts uniformly). The GEMMs' other inputs (h, a,
// dh, a′) are what the chain computed (--operands chain), or, with --operands random, refilled
// with N(0, 1) before each timed row, so that every kernel reads operands of one distribution
// (the tensor cores' power, and with it the clock, depends on the operands' bits: two GEMMs of
// one shape compare fairly only on like data; down-fp8 keeps the codes it quantized first).
//
// Each row also times one dense cuBLAS bf16 GEMM with the same FLOPs (M = S, same N and K; for
// the varlen-K weight gradients K = S) on the same card, the ceiling a grouped GEMM can approach,
// and checks a few sampled output rows of the grouped GEMM against a float64 host computation
// (max_rel_err) so that no broken kernel is timed.
//
// FLOPs: up 2·S·w1_rows·d, down 2·S·d·n, dH 2·S·d·n, dW2 2·S·d·n, dX 2·S·w1_rows·d,
// dW1 2·S·w1_rows·d (their sum is docs/DESIGN.md's 6·S·n·d forward + 12·S·n·d backward for gated).
// down-fp8 (docs/FP8.md; where d and n are multiples of 128): the down-projection on e4m3 operands
// with DeepSeek-V3's scales (cuda/gemm/fp8_grouped_gemm.hpp), its operands quantized once before
// the timing (the layer will quantize A in the up-projection's epilogue and cache W2's codes);
// its output is checked by the GPU tests, not here. dW2-fp8 / dW1-fp8 (compute fp8-wgrad): the
// weight gradients on e4m3 operands in 128x1 tiles along each expert's tokens
// (gemm::fp8::varlen_k), dO, A', dH and x quantized and transposed once before the timing (the
// layer runs those passes in every step: `bench layer` times them); checked by the GPU tests too.
// The -fp8-pp rows run the same on the ping-pong schedule (64 x 128 tiles), the -fp8-c2 rows on
// CTA pairs sharing A by multicast (gemm::kFp8Kernels).
//
// The *-auto rows run each GEMM on the kernel the layer would choose (choose_kernels), called as
// the layer calls it. --search times every legal bf16 candidate of each GEMM (kernel_candidates)
// beside it, in rounds (time_search), and prints, per shape and GEMM, the choice against the
// fastest candidate: how far the rules are from the best kernel this run could find
// (docs/notes/gathered-gemms.md, "The kernel choice against a search").
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
#include "cuda/fp8/quantize.hpp"
#include "cuda/fp8/quantize_tokens.hpp"
#include "cuda/gemm/fp8_grouped_gemm.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/layer/layer_cuda.hpp"  // fill_normal
#include "moeblaze/moeblaze.hpp"
#include "table.hpp"

namespace moeblaze::tools {
namespace {

constexpr double kDenseCeilingTflops = 760.0;  // measured cuBLAS 8192^3 bf16 on the H200

struct Shape {
  std::string name;
  int64_t T, d, n, E, K;
  std::string model;  // the public model of a grid shape ("" otherwise)
};

struct Flags {
  std::string configs = "gemm-big,olmoe,sm-7B-n256";
  std::string activation = "swiglu";
  int reps = 20;
  int warmup = 3;
  uint64_t seed = 20261129;
  bool no_dense = false;
  std::string only;  // comma list of kernel names to time (all when empty)
  std::string operands = "chain";  // chain | random: the intermediates the GEMMs read (above)
  std::string kernels;  // kernel overrides under every kernel's own (e.g. tma.bands=4)
  std::string out;  // append JSON lines here
  std::string md;   // write the table as Markdown here
  bool search = false;  // every bf16 candidate per GEMM against the automatic choice (below)
  std::string slice;    // "i/k": every k-th of --configs' shapes from the i-th (split runs)
};

// "gemm-big" is bench gemm's own shape (S = 65536 slots, E = 16, d = 2048, n = 1024);
// "T<T>-d<d>-n<n>-E<E>-K<K>" any shape (the name `bench layer --shape` gives its rows); the others
// are docs/DESIGN.md's named configs.
// "grid" and "all" stand for their lists (select_configs).
std::vector<Shape> find_shapes(const std::string& spec) {
  std::vector<Shape> shapes;
  for (const std::string& name : split_commas(spec)) {
    if (name == "gemm-big") {
      shapes.push_back({name, 16384, 2048, 1024, 16, 4, ""});
      continue;
    }
    for (const NamedConfig* c : select_configs(name))
      shapes.push_back({c->name, c->T, c->d, c->n, c->E, c->K, c->model ? c->model : ""});
  }
  return shapes;
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
  // count elements from element `first` (a row, an expert's weights), or with `stride` > 1 every
  // stride-th one (a column).
  template <typename T>
  std::vector<T> get(int64_t first, int64_t count, int64_t stride = 1) const {
    const int64_t end = count ? first + (count - 1) * stride + 1 : first;
    MOEBLAZE_REQUIRE(first >= 0 && count >= 0 && stride >= 1 && size_t(end) * sizeof(T) <= bytes,
                     "bench gemm: a slice past its buffer");
    std::vector<T> v(static_cast<size_t>(count));
    if (count && stride == 1)  // one run (a 2D copy of 2-byte rows would crawl)
      MOEBLAZE_CUDA_CHECK(cudaMemcpy(v.data(), as<const T>() + first, size_t(count) * sizeof(T),
                                     cudaMemcpyDeviceToHost));
    else if (count)
      MOEBLAZE_CUDA_CHECK(cudaMemcpy2D(v.data(), sizeof(T), as<const T>() + first,
                                       size_t(stride) * sizeof(T), sizeof(T), size_t(count),
                                       cudaMemcpyDeviceToHost));
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
  std::string writes, model;  // the kernel's output (its GEMM) and the shape's public model
  std::vector<double> round_ms;  // --search: the median of each round's repetitions
};

// What every row and output file names: the card, its driver, the commit and the date.
struct RunInfo {
  std::string gpu, driver, commit, date;
};

RunInfo describe_run() {
  int dev = 0;
  MOEBLAZE_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  MOEBLAZE_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  RunInfo info;
  info.gpu = prop.name;
  info.driver = driver_version();
  info.commit = git_commit();
  info.date = utc_date_iso();
  return info;
}

// Near-balanced routing: K distinct uniform experts per token; slots grouped by expert,
// ascending token inside an expert. Draws from rng (the sampled check goes on drawing from it).
struct BalancedRouting {
  std::vector<int32_t> offsets;    // (E+1,) slots of expert e: [offsets[e], offsets[e+1])
  std::vector<int32_t> tokens;     // (S,) token of each slot
  std::vector<int32_t> expert_of;  // (S,) expert of each slot
  std::vector<float> weights;      // (S,) in [0.05, 1)
};

BalancedRouting near_balanced_routing(int64_t T, int64_t E, int64_t K, std::mt19937_64& rng) {
  const int64_t S = T * K;
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
  BalancedRouting r;
  r.offsets.assign(E + 1, 0);
  r.tokens.reserve(S);
  for (int64_t e = 0; e < E; ++e) {
    for (int32_t t : by_expert[e]) {
      r.tokens.push_back(t);
      r.expert_of.push_back(int32_t(e));
    }
    r.offsets[e + 1] = int32_t(r.tokens.size());
  }
  r.weights.resize(S);
  std::uniform_real_distribution<float> wd(0.05f, 1.0f);
  for (auto& w : r.weights) w = wd(rng);
  return r;
}

// One shape's inputs, drawn on the device (host copies of x and dO kept for the check; the
// weights are read back per expert where the check needs them), and every GEMM's output.
struct ShapeData {
  int64_t T, d, n, E, K, S, R;  // R = w1_rows
  Dev off, tok, wts, x, w1, w2, dO;  // x, dO (T, d); w1 (E, R, d); w2 (E, d, n) bf16
  std::vector<bf16> hx, hdo;        // x and dO on the host
  Dev h, a, y, parts, dh, as, dx, dw1, dw2;
  RoutingPlanView plan;
  // down-fp8's operands and output: A (S, n) and W2 (E, d, n) as codes and scales, Y (S, d).
  struct Fp8Down {
    Dev qa, sa, qw, sw, y, scratch;
    bool quantized = false;  // A is quantized at the first launch, after up-proj wrote it
    Fp8Down(int64_t S, int64_t d, int64_t n, int64_t E)
        : qa(size_t(S * n)), sa(size_t(S * (n / 128)) * 4), qw(size_t(E * d * n)),
          sw(size_t(E * (d / 128) * (n / 128)) * 4), y(size_t(S * d) * 2),
          scratch(cuda::gemm::fp8::contiguous_scratch_bytes(E)) {}
  };
  std::unique_ptr<Fp8Down> fp8;  // null where d or n is not a multiple of 128
  // dW2-fp8 / dW1-fp8's operands, P = padded_tokens_bound(S, E) padded slots: dO (d, P), A'
  // (n, P), dH (R, P), x (d, P) codes and their (·, P/128) scales; poff (E+1,); dW1, dW2.
  struct Fp8Wgrad {
    int64_t P;
    Dev poff, qdo, sdo, qa, sa, qdh, sdh, qx, sx, dw1, dw2, scratch;
    bool quantized = false;  // at the first launch, after the chain wrote A' and dH
    Fp8Wgrad(int64_t S, int64_t d, int64_t n, int64_t E, int64_t R)
        : P(cuda::fp8::padded_tokens_bound(S, E)), poff(size_t(E + 1) * 4), qdo(size_t(d * P)),
          sdo(size_t(d * (P / 128)) * 4), qa(size_t(n * P)), sa(size_t(n * (P / 128)) * 4),
          qdh(size_t(R * P)), sdh(size_t(R * (P / 128)) * 4), qx(size_t(d * P)),
          sx(size_t(d * (P / 128)) * 4), dw1(size_t(E * R * d) * 2), dw2(size_t(E * d * n) * 2),
          scratch(cuda::gemm::fp8::varlen_k_scratch_bytes(E)) {}
  };
  std::unique_ptr<Fp8Wgrad> fp8w;  // null where d or n is not a multiple of 128

  // with_fp8: the FP8 rows' operands too, where d and n are multiples of 128 (they take as
  // many bytes again as the bf16 weights and their gradients).
  ShapeData(const Shape& sh, Activation act, uint64_t seed, const BalancedRouting& rt,
            bool with_fp8)
      : T(sh.T), d(sh.d), n(sh.n), E(sh.E), K(sh.K), S(sh.T * sh.K),
        R(is_gated(act) ? 2 * sh.n : sh.n), off(rt.offsets), tok(rt.tokens), wts(rt.weights),
        x(size_t(T * d) * 2), w1(size_t(E * R * d) * 2), w2(size_t(E * d * n) * 2),
        dO(size_t(T * d) * 2),
        h(size_t(S * R) * 2), a(size_t(S * n) * 2), y(size_t(S * d) * 2),
        parts(size_t(S * cuda::gemm::ds_partials_cols(n)) * 4), dh(size_t(S * R) * 2),
        as(size_t(S * n) * 2), dx(size_t(S * d) * 2), dw1(size_t(E * R * d) * 2),
        dw2(size_t(E * d * n) * 2) {
    // N(0, 1) inputs, weights N(0, 1/fan-in), never zeros: drawn on the device, since the host
    // would take seconds for the largest grid shapes' billions of weights.
    cuda::fill_normal(x.p, DType::bf16, T * d, seed + 1, 1.0f, nullptr);
    cuda::fill_normal(w1.p, DType::bf16, E * R * d, seed + 2, 1.0f / std::sqrt(float(d)), nullptr);
    cuda::fill_normal(w2.p, DType::bf16, E * d * n, seed + 3, 1.0f / std::sqrt(float(n)), nullptr);
    cuda::fill_normal(dO.p, DType::bf16, T * d, seed + 4, 1.0f, nullptr);
    hx = x.get<bf16>();
    hdo = dO.get<bf16>();
    if (with_fp8 && d % 128 == 0 && n % 128 == 0) {
      fp8 = std::make_unique<Fp8Down>(S, d, n, E);
      fp8w = std::make_unique<Fp8Wgrad>(S, d, n, E, R);
    }
    plan.T = T;
    plan.E = E;
    plan.S = S;
    plan.expert_token_offsets = off.as<int32_t>();
    plan.expert_token_indices = tok.as<int32_t>();
    plan.slot_weights = wts.as<float>();
    plan.device = Device::cuda;
  }
};

struct Kernel {
  std::string name;  // a row's name: up-ws, dX-tma128 ..., or the search's candidate labels
  const char* writes;  // the output buffer (the sampled check's key)
  double flops;
  std::function<void()> launch;
  int64_t dense_m, dense_n, dense_k;
  std::function<void()> before = [] {};  // untimed, before every launch (the check's too)
  std::string tag;  // the --kernels variant it runs under, where several are compared
};

// Every kernel variant of the six GEMMs on one shape, in pipeline order: each one's inputs are
// the previous ones' outputs where the pipeline says so. The gathered GEMMs (up, dH, dW2, dW1)
// run on each of their kernels (two_cta, then the warp-specialised persistent ones), the
// contiguous-A ones (down, dX) on the cp.async kernel, the TMA path (CUTLASS pointer-array) and
// the warp-specialised kernel (both schedules); variants of one GEMM write the same output.
//
// search: instead, each GEMM's legal candidates (cuda::gemm::kernel_candidates, the set the rule
// chooses from), each called as the layer calls it under the override spec that selects it and
// named by the kernel it runs (gemm::describe), then the GEMM's *-auto row.
std::vector<Kernel> shape_kernels(ShapeData& s, Activation act, cudaStream_t stream,
                                  const cuda::gemm::GemmScratch& tma_scratch,
                                  const std::string& extra, bool search) {
  namespace gg = cuda::gemm;
  using GK = gg::GatherKernel;
  const int64_t S = s.S, R = s.R, d = s.d, n = s.n;
  const double up_flops = 2.0 * S * R * d, down_flops = 2.0 * S * d * n;
  auto B = [](const Dev& b) { return b.as<const bf16>(); };
  auto M = [](const Dev& b) { return b.as<bf16>(); };
  auto up = [&](const std::string& name, GK g) -> Kernel {
    return {name, "h", up_flops,
            [&s, act, stream, B, M, g] {
              gg::up_proj(s.plan, B(s.x), B(s.w1), M(s.h), M(s.a), s.d, s.n, act, stream, g);
            },
            S, R, d};
  };
  auto dh = [&](const std::string& name, GK g) -> Kernel {
    return {name, "dh", down_flops,
            [&s, act, stream, B, M, g] {
              gg::dh_proj(s.plan, B(s.dO), B(s.w2), B(s.h), s.parts.as<float>(), M(s.dh),
                          M(s.as), s.d, s.n, act, stream, g);
            },
            S, n, d};
  };
  // dH written over H, as the layer's backward runs it: dh holds a copy of H (before(), untimed)
  // and the kernel reads H from it and writes dH into it.
  auto dh_over_h = [&](const std::string& name, GK g) -> Kernel {
    Kernel k{name, "dh", down_flops,
             [&s, act, stream, B, M, g] {
               gg::dh_proj(s.plan, B(s.dO), B(s.w2), B(s.dh), s.parts.as<float>(), M(s.dh),
                           M(s.as), s.d, s.n, act, stream, g);
             },
             S, n, d};
    k.before = [&s, stream] {
      MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(s.dh.p, s.h.p, s.h.bytes, cudaMemcpyDeviceToDevice,
                                          stream));
    };
    return k;
  };
  auto dw2 = [&](const std::string& name, GK g) -> Kernel {
    return {name, "dw2", down_flops,
            [&s, stream, B, M, g] {
              gg::dw2_proj(s.plan, B(s.dO), B(s.as), M(s.dw2), s.d, s.n, stream, g);
            },
            d, n, S};
  };
  auto dw1 = [&](const std::string& name, GK g) -> Kernel {
    return {name, "dw1", up_flops,
            [&s, act, stream, B, M, g] {
              gg::dw1_proj(s.plan, B(s.dh), B(s.x), M(s.dw1), s.d, s.n, act, stream, g);
            },
            R, d, S};
  };
  // scratch: the TMA path's (data == nullptr: the cp.async kernel).
  auto down = [&](const std::string& name, gg::GemmScratch scratch) -> Kernel {
    return {name, "y", down_flops,
            [&s, stream, B, M, scratch] {
              gg::down_proj(s.plan, B(s.a), B(s.w2), M(s.y), s.d, s.n, stream, scratch);
            },
            S, d, n};
  };
  auto dx = [&](const std::string& name, gg::GemmScratch scratch) -> Kernel {
    return {name, "dx", up_flops,
            [&s, act, stream, B, M, scratch] {
              gg::dx_proj(s.plan, B(s.dh), B(s.w1), M(s.dx), s.d, s.n, act, stream, scratch);
            },
            S, d, R};
  };
  // A kernel under a kernel-choice override set around its launch (the entry points read the
  // choice, not an argument): the TMA path's other tiles (family=tma: also where the rule picks
  // another family), the contiguous-A GEMMs on the
  // warp-specialised kernel (down/dx.family=ws, + schedule), dW1 on 2-CTA clusters.
  // `extra` (--kernels) comes first, under every kernel's own overrides: a GEMM the row's spec
  // names runs the row's kernel whatever `extra` says about that GEMM (layer_kernel_overrides).
  auto with_overrides = [&extra](const char* spec, Kernel k) -> Kernel {
    const gg::KernelOverrides o = gg::layer_kernel_overrides(gg::parse_kernel_overrides(extra),
                                                             gg::parse_kernel_overrides(spec));
    k.launch = [o, inner = k.launch] {
      gg::set_kernel_overrides(o);
      inner();
      gg::clear_kernel_overrides();
    };
    return k;
  };
  const auto scratch_for = [&tma_scratch](const gg::GemmKernel& k) {
    return k.family == gg::KernelFamily::tma_grouped ? tma_scratch : gg::GemmScratch{};
  };
  // One GEMM (a LayerKernels index) called as the layer calls it: the gathered ones on the
  // automatic kernel (which reads the overrides), dH over H, the TMA scratch only where `k` is
  // the TMA path.
  const auto as_layer = [&](int gemm, const std::string& name, const gg::GemmKernel& k) -> Kernel {
    using LK = gg::LayerKernels;
    switch (gemm) {
      case LK::kUp: return up(name, GK::automatic);
      case LK::kDown: return down(name, scratch_for(k));
      case LK::kDh: return dh_over_h(name, GK::automatic);
      case LK::kDw2: return dw2(name, GK::automatic);
      case LK::kDx: return dx(name, scratch_for(k));
      default: return dw1(name, GK::automatic);
    }
  };
  // The automatic choice of each GEMM (choose_kernels under the --kernels overrides).
  const gg::LayerKernels chosen = gg::choose_kernels({S, s.E, d, n, act},
                                                     gg::parse_kernel_overrides(extra));
  static const char* const kAutoNames[] = {"up-auto", "down-auto", "dH-auto",
                                           "dW2-auto", "dX-auto", "dW1-auto"};
  if (search) {
    // In LayerKernels order, which is the pipeline's: each GEMM reads what the ones before wrote.
    std::vector<Kernel> all;
    const gg::KernelShape shape{S, s.E, d, n, act};
    for (int g = 0; g < gg::LayerKernels::kCount; ++g) {
      for (const gg::KernelCandidate& c : gg::kernel_candidates(g, shape))
        all.push_back(
            with_overrides(c.spec.c_str(), as_layer(g, gg::describe(c.kernel), c.kernel)));
      // Last among its GEMM's rows: the output's last writer, so the sampled check is its.
      all.push_back(as_layer(g, kAutoNames[g], chosen.at(g)));
    }
    if (!extra.empty())
      for (Kernel& k : all) k = with_overrides("", std::move(k));  // the set inside wins
    return all;
  }
  // down-fp8: W2 quantized here, A at the first launch (the chain's up-proj has written it).
  // The rows' names on each built FP8 kernel (kFp8Kernels' order: "", "-c2", "-pp").
  const auto fp8_name = [](int gemm, const gg::Fp8Kernel& k) -> const char* {
    static const char* const names[3][3] = {{"down-fp8", "down-fp8-c2", "down-fp8-pp"},
                                            {"dW2-fp8", "dW2-fp8-c2", "dW2-fp8-pp"},
                                            {"dW1-fp8", "dW1-fp8-c2", "dW1-fp8-pp"}};
    return names[gemm][gg::fp8_variant(k)];
  };
  auto down_fp8 = [&](gg::Fp8Kernel sched) -> Kernel {
    ShapeData::Fp8Down& q = *s.fp8;
    cuda::fp8::quantize_128x128_async(B(s.w2), s.E, s.d * s.n, s.d, s.n, s.n,
                                      q.qw.as<uint8_t>(), q.sw.as<float>(), stream);
    return {fp8_name(0, sched), "y-fp8", down_flops,
            [&s, &q, stream, B, sched] {
              if (!q.quantized) {
                cuda::fp8::quantize_1x128_async(B(s.a), s.S, s.n, s.n, q.qa.as<uint8_t>(),
                                                q.sa.as<float>(), stream);
                q.quantized = true;
              }
              gg::fp8::contiguous(gg::ExpertRows::whole(s.plan), s.E, q.qa.as<uint8_t>(),
                                  q.sa.as<float>(), q.qw.as<uint8_t>(), q.sw.as<float>(),
                                  q.y.as<bf16>(), s.d, s.n, q.scratch.p, q.scratch.bytes,
                                  stream, sched);
            },
            S, d, n};
  };
  // dW2-fp8 / dW1-fp8: the four operands quantized at the first launch (the warm-up).
  auto wgrad_fp8 = [&](bool w1, gg::Fp8Kernel sched) -> Kernel {
    ShapeData::Fp8Wgrad& q = *s.fp8w;
    auto quantize = [&s, &q, stream, B] {
      if (q.quantized) return;
      namespace f8 = cuda::fp8;
      const int32_t* off = s.plan.expert_token_offsets;
      const int32_t* tok = s.plan.expert_token_indices;
      f8::padded_token_offsets_async(off, s.E, q.poff.as<int32_t>(), stream);
      const int32_t* poff = q.poff.as<int32_t>();
      f8::quantize_tokens_128x1_async(B(s.dO), s.d, tok, off, poff, s.E, s.S, s.d,
                                      q.qdo.as<uint8_t>(), q.sdo.as<float>(), stream);
      f8::quantize_tokens_128x1_async(B(s.as), s.n, nullptr, off, poff, s.E, s.S, s.n,
                                      q.qa.as<uint8_t>(), q.sa.as<float>(), stream);
      f8::quantize_tokens_128x1_async(B(s.dh), s.R, nullptr, off, poff, s.E, s.S, s.R,
                                      q.qdh.as<uint8_t>(), q.sdh.as<float>(), stream);
      f8::quantize_tokens_128x1_async(B(s.x), s.d, tok, off, poff, s.E, s.S, s.d,
                                      q.qx.as<uint8_t>(), q.sx.as<float>(), stream);
      q.quantized = true;
    };
    if (w1)
      return {fp8_name(2, sched), "dw1-fp8", up_flops,
              [&s, &q, stream, quantize, sched] {
                quantize();
                gg::fp8::varlen_k(q.poff.as<int32_t>(), s.E, s.R, s.d, q.qdh.as<uint8_t>(),
                                  q.sdh.as<float>(), q.qx.as<uint8_t>(), q.sx.as<float>(),
                                  q.dw1.as<bf16>(), q.scratch.p, q.scratch.bytes, stream,
                                  sched);
              },
              R, d, S};
    return {fp8_name(1, sched), "dw2-fp8", down_flops,
            [&s, &q, stream, quantize, sched] {
              quantize();
              gg::fp8::varlen_k(q.poff.as<int32_t>(), s.E, s.d, s.n, q.qdo.as<uint8_t>(),
                                q.sdo.as<float>(), q.qa.as<uint8_t>(), q.sa.as<float>(),
                                q.dw2.as<bf16>(), q.scratch.p, q.scratch.bytes, stream, sched);
            },
            d, n, S};
  };
  std::vector<Kernel> all = {up("up", GK::two_cta),
          up("up-ws", GK::warp_specialized),
          up("up-pp", GK::ping_pong),
          // clusters of 2 sharing w1's stages (up.cluster=2), as the layer calls it
          with_overrides("up.family=ws,up.cluster=2", up("up-mc", GK::automatic)),
          down("down", {}),
          dh("dH", GK::two_cta),
          dh("dH-ws", GK::warp_specialized),
          dh("dH-pp", GK::ping_pong),
          dh_over_h("dH-ws-ip", GK::warp_specialized),
          // clusters of 2 sharing w2's stages (dh.cluster=2), as the layer calls it
          with_overrides("dh.family=ws,dh.cluster=2", dh_over_h("dH-mc", GK::automatic)),
          dw2("dW2", GK::two_cta),
          // the plain-store epilogue, whatever the rule picks (dW2-ts: the TMA-store one)
          with_overrides("dw2.family=ws", dw2("dW2-ws", GK::warp_specialized)),
          dx("dX", {}),
          down("down-tma", tma_scratch),
          dx("dX-tma", tma_scratch),
          with_overrides("down.family=ws", down("down-ws", {})),
          with_overrides("down.family=ws,down.schedule=pingpong", down("down-pp", {})),
          with_overrides("dx.family=ws", dx("dX-ws", {})),
          with_overrides("dx.family=ws,dx.schedule=pingpong", dx("dX-pp", {})),
          dw1("dW1", GK::two_cta),
          // one CTA per tile, whatever the rule picks (dW1-mc: 2-CTA clusters)
          with_overrides("dw1.family=ws,dw1.cluster=1", dw1("dW1-ws", GK::warp_specialized)),
          // the 2-CTA cluster variant at every shape (the rule takes it only at >= 4096 rows
          // per expert), to time against dW1-ws
          with_overrides("dw1.family=ws,dw1.cluster=2",
                         dw1("dW1-mc", GK::warp_specialized)),
          // one CTA per tile with the TMA-store epilogue (dw2/dw1.store_tma=1), to time against
          // dW2-ws and dW1-ws
          with_overrides("dw2.family=ws,dw2.store_tma=1", dw2("dW2-ts", GK::warp_specialized)),
          with_overrides("dw1.family=ws,dw1.cluster=1,dw1.store_tma=1",
                         dw1("dW1-ts", GK::warp_specialized))};
  // The TMA path's built kernels (kTmaVariants) for down and dX, each forced (family=tma: also
  // where the rule picks another family), after dX-tma.
  struct TmaRow {
    const char *down, *dx, *spec;  // spec: after "<gemm>.family=tma,<gemm>."
  };
  static const TmaRow kTmaRows[] = {{"down-tma256", "dX-tma256", "tile=256x128"},
                                    {"down-tmapp", "dX-tmapp", "tile=192x128"},
                                    {"down-tma128", "dX-tma128", "tile=128x256,#.cluster=2"},
                                    {"down-tma128c1", "dX-tma128c1", "tile=128x256,#.cluster=1"}};
  const auto tma_spec = [](const std::string& gemm, std::string spec) {
    for (size_t at; (at = spec.find('#')) != std::string::npos;) spec.replace(at, 1, gemm);
    return gemm + ".family=tma," + gemm + "." + spec;
  };
  std::vector<Kernel> tma_rows;
  for (const TmaRow& r : kTmaRows)
    tma_rows.push_back(with_overrides(tma_spec("down", r.spec).c_str(), down(r.down, tma_scratch)));
  for (const TmaRow& r : kTmaRows)
    tma_rows.push_back(with_overrides(tma_spec("dx", r.spec).c_str(), dx(r.dx, tma_scratch)));
  const auto after = std::find_if(all.begin(), all.end(),
                                  [](const Kernel& k) { return std::string(k.name) == "dX-tma"; });
  all.insert(after + 1, tma_rows.begin(), tma_rows.end());
  // Each GEMM's automatic choice, called as the layer calls it. Last in the chain, each is its
  // output's last writer, so the sampled check is the layer's kernel.
  for (int g = 0; g < gg::LayerKernels::kCount; ++g)
    all.push_back(as_layer(g, kAutoNames[g], chosen.at(g)));
  if (s.fp8) {  // after the up-projections, in kFp8Kernels' order
    int at = 3;
    for (const gg::Fp8Kernel& k : gg::kFp8Kernels) all.insert(all.begin() + at++, down_fp8(k));
  }
  if (s.fp8w) {  // last: the chain has written A' and dH
    for (const gg::Fp8Kernel& sched : gg::kFp8Kernels) {
      all.push_back(wgrad_fp8(false, sched));
      all.push_back(wgrad_fp8(true, sched));
    }
  }
  // swiglu_oai's up-projection and dH have one kernel each (ws cooperative): the others refuse it.
  if (act == Activation::swiglu_oai)
    all.erase(std::remove_if(all.begin(), all.end(),
                             [](const Kernel& k) {
                               const std::string nm = k.name;
                               return nm == "up" || nm == "up-pp" || nm == "dH" || nm == "dH-pp";
                             }),
              all.end());
  // The cluster rows where their kernel does not run (swiglu_oai's up-projection, dH but for
  // swiglu with E <= 2000): the override's refusal, not a failed bench.
  const auto refused = [&](const char* spec) {
    try {
      gg::choose_kernels({S, s.E, d, n, act}, gg::parse_kernel_overrides(spec));
      return false;
    } catch (const Unsupported&) {
      return true;
    }
  };
  const bool no_up_mc = refused("up.family=ws,up.cluster=2");
  const bool no_dh_mc = refused("dh.family=ws,dh.cluster=2");
  all.erase(std::remove_if(all.begin(), all.end(),
                           [&](const Kernel& k) {
                             return (no_up_mc && k.name == "up-mc") ||
                                    (no_dh_mc && k.name == "dH-mc");
                           }),
            all.end());
  if (!extra.empty())
    for (Kernel& k : all) k = with_overrides("", std::move(k));  // the set inside wins
  return all;
}

// Dense same-FLOP operands for cuBLAS: (max(M,N) x K) random bf16 for both sides, and C.
struct DenseOperands {
  std::unique_ptr<Dev> A, B, C;
};

DenseOperands dense_operands(const std::vector<Kernel>& kernels, uint64_t seed) {
  int64_t dense_elems = 0;
  for (const auto& k : kernels)
    dense_elems = std::max(dense_elems, std::max(k.dense_m, k.dense_n) * k.dense_k);
  DenseOperands o;
  o.A = std::make_unique<Dev>(random_bf16(size_t(dense_elems), seed + 5, 1.0f));
  o.B = std::make_unique<Dev>(random_bf16(size_t(dense_elems), seed + 6, 0.02f));
  int64_t c_elems = 0;
  for (const auto& k : kernels) c_elems = std::max(c_elems, k.dense_m * k.dense_n);
  o.C = std::make_unique<Dev>(size_t(c_elems) * 2);
  return o;
}

// Relative errors of sampled outputs against float64 host computations, after the chain ran
// once: 8 sampled slots of h (up), y (down) and dx (dX), and 16 entries of dW2.
struct SampledErrors {
  double up = 0, down = 0, dx = 0, dw2 = 0;
};

SampledErrors check_samples(const ShapeData& s, const BalancedRouting& rt, std::mt19937_64& rng) {
  const int64_t S = s.S, R = s.R, d = s.d, n = s.n, E = s.E;
  const auto& hx = s.hx;
  const auto& hdo = s.hdo;
  const auto& tokens = rt.tokens;
  const auto& offsets = rt.offsets;
  auto f32 = [](bf16 v) { return double(float(v)); };
  std::vector<int64_t> sample;
  for (int i = 0; i < 8; ++i) sample.push_back(int64_t(rng() % uint64_t(S)));
  auto rel = [](double num, double den) { return std::sqrt(num / std::max(den, 1e-300)); };
  SampledErrors err;
  double nu = 0, du = 0, nd = 0, dd = 0, nx = 0, dxx = 0;
  for (int64_t r : sample) {  // each sampled slot's rows, and its expert's weights, read back
    const int64_t e = rt.expert_of[r], t = tokens[r];
    const auto w1 = s.w1.get<bf16>(e * R * d, R * d);  // (R, d)
    const auto w2 = s.w2.get<bf16>(e * d * n, d * n);  // (d, n)
    const auto gh = s.h.get<bf16>(r * R, R), gdh = s.dh.get<bf16>(r * R, R);
    const auto gy = s.y.get<bf16>(r * d, d), gdx = s.dx.get<bf16>(r * d, d);
    const auto ga = s.a.get<bf16>(r * n, n);
    for (int64_t o = 0; o < R; ++o) {  // h = W1_e x_t
      double acc = 0;
      for (int64_t k = 0; k < d; ++k) acc += f32(hx[t * d + k]) * f32(w1[o * d + k]);
      nu += (f32(gh[o]) - acc) * (f32(gh[o]) - acc);
      du += acc * acc;
    }
    for (int64_t o = 0; o < d; ++o) {  // y = W2_e a (a as the kernel stored it)
      double acc = 0;
      for (int64_t k = 0; k < n; ++k) acc += f32(ga[k]) * f32(w2[o * n + k]);
      nd += (f32(gy[o]) - acc) * (f32(gy[o]) - acc);
      dd += acc * acc;
    }
    for (int64_t o = 0; o < d; ++o) {  // dx = W1_eᵀ dh
      double acc = 0;
      for (int64_t k = 0; k < R; ++k) acc += f32(gdh[k]) * f32(w1[k * d + o]);
      nx += (f32(gdx[o]) - acc) * (f32(gdx[o]) - acc);
      dxx += acc * acc;
    }
  }
  err.up = rel(nu, du);
  err.down = rel(nd, dd);
  err.dx = rel(nx, dxx);
  // dW2: a few entries, each over its expert's slots (a′'s column read back).
  double nw = 0, dw = 0;
  for (int i = 0; i < 16; ++i) {
    const int64_t e = int64_t(rng() % uint64_t(E)), row = int64_t(rng() % uint64_t(d)),
                  col = int64_t(rng() % uint64_t(n));
    const int64_t first = offsets[e], count = offsets[e + 1] - offsets[e];
    const auto gas = s.as.get<bf16>(first * n + col, count, n);  // a′[first.., col]
    double acc = 0;
    for (int64_t j = 0; j < count; ++j)
      acc += f32(hdo[int64_t(tokens[first + j]) * d + row]) * f32(gas[j]);
    const double g = f32(s.dw2.get<bf16>((e * d + row) * n + col, 1)[0]);
    nw += (g - acc) * (g - acc);
    dw += acc * acc;
  }
  err.dw2 = rel(nw, dw);
  return err;
}

// Each kernel's sampled error, or NaN. The sampled check sees each output as its last writer in
// the chain left it, so the error is that kernel's; the other variants writing the same output
// (up vs up-ws, dH vs dH-ws, down vs down-tma / -ws, dX vs dX-tma / -ws) show "-" here and are
// checked by the GPU tests (GroupedGemm, every kernel against float64). Throws when a checked
// error is above 2e-2: no broken kernel is timed.
std::vector<double> kernel_errors(const std::vector<Kernel>& kernels, const SampledErrors& e) {
  const std::pair<const char*, double> checked[] = {
      {"h", e.up}, {"y", e.down}, {"dw2", e.dw2}, {"dx", e.dx}};
  std::vector<double> errs(kernels.size(), NAN);
  for (const auto& [out, err] : checked)
    for (size_t i = kernels.size(); i-- > 0;)
      if (std::string(kernels[i].writes) == out) {
        errs[i] = err;
        break;
      }
  std::cerr << "bench gemm: sampled rel errors up " << e.up << " down " << e.down << " dW2 "
            << e.dw2 << " dX " << e.dx << "\n";
  for (double err : errs)
    if (std::isfinite(err) && err > 2e-2)
      throw DeviceError("bench gemm: a grouped GEMM's sampled error " + std::to_string(err) +
                        " exceeds 2e-2; not timing a broken kernel");
  return errs;
}

// Times the kernels --only names (all when empty), each beside its dense same-FLOP cuBLAS GEMM
// unless --no-dense; appends one row per kernel. refill() runs, untimed, before each row.
void time_kernels(const Flags& f, const Shape& sh, const ShapeData& s,
                  const std::vector<Kernel>& kernels, const std::vector<double>& errs,
                  GpuTimer& timer, cublasHandle_t blas, const DenseOperands& dense,
                  const std::function<void()>& refill, std::vector<Row>& rows) {
  const auto only = split_commas(f.only);
  for (size_t i = 0; i < kernels.size(); ++i) {
    const auto& k = kernels[i];
    if (!only.empty() && std::find(only.begin(), only.end(), std::string(k.name)) == only.end())
      continue;
    if (f.search && std::string(k.writes).find("fp8") != std::string::npos) continue;
    const std::string name = k.tag.empty() ? k.name : std::string(k.name) + " [" + k.tag + "]";
    Row row{sh.name, name, s.T, s.S, s.E, s.K, s.d, s.n, 0, 0, NAN, NAN, errs[i], k.writes,
            sh.model};
    refill();
    row.ms = timer.median_ms(f.warmup, f.reps, k.before, k.launch);
    row.tflops = k.flops / (row.ms * 1e-3) / 1e12;
    if (!f.no_dense) {
      const float alpha = 1.0f, beta = 0.0f;
      const int m = int(k.dense_m), nn = int(k.dense_n), kk = int(k.dense_k);
      row.dense_ms = timer.median_ms(f.warmup, f.reps, [&] {
        cublas_check(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, nn, m, kk, &alpha, dense.B->p,
                                  CUDA_R_16BF, kk, dense.A->p, CUDA_R_16BF, kk, &beta,
                                  dense.C->p, CUDA_R_16BF, nn, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT),
                     "cublasGemmEx");
      });
      row.dense_tflops = 2.0 * m * nn * double(kk) / (row.dense_ms * 1e-3) / 1e12;
    }
    rows.push_back(row);
    std::cerr << "  " << name << ": " << row.ms << " ms, " << row.tflops << " TFLOP/s\n";
  }
}

// --search's timing: the candidates of one GEMM (the rows writing one output) timed together in
// kSearchRounds rounds of rotated order, a candidate's ms the median of all its repetitions, so
// that the clock's drift over a shape falls on every candidate alike
// (docs/notes/gathered-gemms.md).
constexpr int kSearchRounds = 5;

void time_search(const Flags& f, const Shape& sh, const ShapeData& s,
                 const std::vector<Kernel>& kernels, const std::vector<double>& errs,
                 GpuTimer& timer, std::vector<Row>& rows) {
  std::vector<std::string> outputs;  // in pipeline order
  for (const Kernel& k : kernels)
    if (std::string(k.writes).find("fp8") == std::string::npos &&
        std::find(outputs.begin(), outputs.end(), k.writes) == outputs.end())
      outputs.push_back(k.writes);
  const int per_round = std::max(1, (f.reps + kSearchRounds - 1) / kSearchRounds);
  for (const std::string& out : outputs) {
    std::vector<size_t> group;
    for (size_t i = 0; i < kernels.size(); ++i)
      if (kernels[i].writes == out) group.push_back(i);
    std::vector<std::vector<double>> samples(group.size()), rounds(group.size());
    for (int round = 0; round < kSearchRounds; ++round)
      for (size_t step = 0; step < group.size(); ++step) {
        const size_t g = (step + size_t(round)) % group.size();
        const Kernel& k = kernels[group[g]];
        const std::vector<double> t =
            timer.samples_ms(round == 0 ? f.warmup : 1, per_round, k.before, k.launch);
        samples[g].insert(samples[g].end(), t.begin(), t.end());
        rounds[g].push_back(median(t));
      }
    for (size_t g = 0; g < group.size(); ++g) {
      const Kernel& k = kernels[group[g]];
      Row row{sh.name, k.name, s.T, s.S, s.E, s.K, s.d, s.n, 0, 0, NAN, NAN, errs[group[g]],
              k.writes, sh.model};
      row.ms = median(samples[g]);
      row.tflops = k.flops / (row.ms * 1e-3) / 1e12;
      row.round_ms = rounds[g];
      rows.push_back(row);
      std::cerr << "  " << k.name << ": " << row.ms << " ms, " << row.tflops << " TFLOP/s\n";
    }
  }
}

// The overrides every kernel is timed under: --kernels, else MOEBLAZE_KERNELS as the library
// parsed it (the kernels timed under their own overrides, down-tmapp's down.tile=192x128 ...,
// replace the variable's with theirs, so they get it under their own instead).
std::string kernel_specs(const Flags& f) {
  return !f.kernels.empty() ? f.kernels : cuda::gemm::kernel_overrides().spec;
}

// Whether any FP8 row is asked for (--only empty without --search, or naming one).
bool wants_fp8(const Flags& f) {
  if (f.search) return false;
  if (f.only.empty()) return true;
  for (const std::string& k : split_commas(f.only))
    if (k.find("fp8") != std::string::npos) return true;
  return false;
}

// One shape: routing, inputs, the chain once and its sampled check, then the timed rows.
void bench_shape(const Flags& f, const Shape& sh, Activation act, cudaStream_t stream,
                 GpuTimer& timer, cublasHandle_t blas, std::vector<Row>& rows) {
  const int64_t T = sh.T, E = sh.E, K = sh.K;
  std::cerr << "bench gemm: " << sh.name << " T=" << T << " d=" << sh.d << " n=" << sh.n
            << " E=" << E << " K=" << K << " S=" << T * K << "\n";
  std::mt19937_64 rng(f.seed);
  const BalancedRouting rt = near_balanced_routing(T, E, K, rng);
  ShapeData s(sh, act, f.seed, rt, wants_fp8(f));
  namespace gg = cuda::gemm;
  Dev scratch_buf(gg::tma_gemm_scratch_bytes(E));
  const gg::GemmScratch tma_scratch{scratch_buf.as<char>(), gg::tma_gemm_scratch_bytes(E)};
  // --kernels "A;B": every kernel under A, then under B, side by side (one after the other).
  const std::string all_specs = kernel_specs(f);
  std::vector<std::string> specs;
  for (size_t at = 0; at <= all_specs.size();) {
    const size_t semi = std::min(all_specs.find(';', at), all_specs.size());
    specs.push_back(all_specs.substr(at, semi - at));
    at = semi + 1;
  }
  std::vector<std::vector<Kernel>> per_spec;
  for (const std::string& spec : specs) {
    per_spec.push_back(shape_kernels(s, act, stream, tma_scratch, spec, f.search));
    if (specs.size() > 1)
      for (Kernel& k : per_spec.back()) k.tag = spec;
  }
  std::vector<Kernel> kernels;
  for (size_t j = 0; j < per_spec[0].size(); ++j)
    for (auto& list : per_spec) kernels.push_back(std::move(list[j]));
  DenseOperands dense;
  if (!f.no_dense && !f.search) dense = dense_operands(kernels, f.seed);

  for (const auto& k : kernels) {
    k.before();
    k.launch();
  }
  MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const std::vector<double> errs = kernel_errors(kernels, check_samples(s, rt, rng));
  // --operands random: before each timed row (the rows before it overwrote some of them).
  const std::function<void()> refill = [&] {
    if (f.operands != "random") return;
    // h (S, w1_rows), a (S, n), dh (S, w1_rows), a′ (S, n) bf16: N(0, 1) like x and dO.
    const std::pair<Dev*, uint64_t> bufs[] = {{&s.h, 11}, {&s.a, 12}, {&s.dh, 13}, {&s.as, 14}};
    for (const auto& [buf, salt] : bufs)
      cuda::fill_normal(buf->p, DType::bf16, int64_t(buf->bytes / 2), f.seed + salt, 1.0f, stream);
    MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(stream));
  };
  if (f.search) {
    refill();
    time_search(f, sh, s, kernels, errs, timer, rows);
  } else {
    time_kernels(f, sh, s, kernels, errs, timer, blas, dense, refill, rows);
  }
}

void print_table(const std::vector<Row>& rows) {
  Table table({{"config", Align::left}, {"gemm", Align::left}, {"S"}, {"E"}, {"d"}, {"n"},
               {"ms"}, {"TFLOP/s"}, {"% 760"}, {"cuBLAS same-FLOP TFLOP/s"}, {"x cuBLAS"},
               {"sampled rel err"}});
  for (const auto& r : rows)
    table.add_row({r.config, r.kernel, std::to_string(r.S), std::to_string(r.E),
                   std::to_string(r.d), std::to_string(r.n), fixed(r.ms, 3), fixed(r.tflops, 1),
                   fixed(100.0 * r.tflops / kDenseCeilingTflops, 1), fixed(r.dense_tflops, 1),
                   fixed(r.tflops / r.dense_tflops, 2), scientific(r.max_rel_err, 1)});
  table.print(std::cout);
}

void append_jsonl(const std::string& path, const std::vector<Row>& rows, Activation act,
                  const std::string& operands, const std::string& kernels, const RunInfo& info) {
  std::ofstream os(path, std::ios::app);
  for (const auto& r : rows) {
    JsonLine j;
    j.add("bench", "gemm").add("config", r.config).add("impl", "moeblaze").add("gemm", r.kernel);
    if (!r.model.empty()) j.add("model", r.model);
    j.add("activation", activation_name(act)).add("T", r.T).add("S", r.S).add("E", r.E);
    j.add("K", r.K).add("d", r.d).add("n", r.n).add("ms", r.ms).add("tflops", r.tflops);
    j.add("pct_of_dense_ceiling", 100.0 * r.tflops / kDenseCeilingTflops);
    j.add("dense_same_flop_ms", r.dense_ms).add("dense_same_flop_tflops", r.dense_tflops);
    j.add("max_rel_err", r.max_rel_err).add("operands", operands).add("kernels", kernels);
    j.add("gpu", info.gpu).add("driver", info.driver).add("commit", info.commit);
    j.add("date", info.date);
    os << j.str() << "\n";
  }
}

void write_markdown(const std::string& path, const std::vector<Row>& rows, Activation act,
                    int reps, const std::string& operands, const RunInfo& info) {
  std::ofstream md(path);
  md << "# moeblaze bench gemm\n\n" << info.gpu << ", driver " << info.driver << ", commit "
     << info.commit << ", " << info.date << ". Activation " << activation_name(act)
     << "; intermediates: " << operands << "; median of " << reps
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

// --search: per shape and GEMM, the automatic choice's time against the fastest of the GEMM's
// legal candidates (kernel_candidates), timed in the same rounds. The chosen kernel is one of
// the candidates too (its twin row): choice_ms / best_ms is the verdict, from rows timed alike;
// auto_ms beside choice_ms (the same kernel, called once more) shows the run's noise.
struct SearchRow {
  std::string config, gemm, chosen, best;
  double auto_ms, best_ms, choice_ms;  // choice_ms: NaN where no candidate is the choice
  // choice / best round by round (each round's medians): lo > 1.03 is a miss in every round.
  double round_lo = NAN, round_hi = NAN;
};

// One shape's search rows from its timed rows; with --out, their JSON lines (bench
// "kernel-search") are appended at once, so a run cut short keeps the shapes it finished.
std::vector<SearchRow> search_rows(const Flags& f, const Shape& sh, const std::vector<Row>& rows,
                                   Activation act, const RunInfo& info) {
  namespace gg = cuda::gemm;
  // The GEMMs by their output, in LayerKernels order.
  const std::pair<const char*, int> gemms[] = {
      {"h", gg::LayerKernels::kUp},   {"y", gg::LayerKernels::kDown},
      {"dh", gg::LayerKernels::kDh},  {"dw2", gg::LayerKernels::kDw2},
      {"dx", gg::LayerKernels::kDx},  {"dw1", gg::LayerKernels::kDw1}};
  const int64_t S = sh.T * sh.K;
  const gg::LayerKernels chosen = gg::choose_kernels(
      {S, sh.E, sh.d, sh.n, act}, gg::parse_kernel_overrides(kernel_specs(f)));
  std::ofstream os;
  if (!f.out.empty()) os.open(f.out, std::ios::app);
  std::vector<SearchRow> out;
  for (const auto& [writes, index] : gemms) {
    const Row* automatic = nullptr;
    const Row* best = nullptr;
    for (const Row& r : rows) {
      if (r.config != sh.name || r.writes != writes) continue;
      const bool is_auto =
          r.kernel.size() > 5 && r.kernel.compare(r.kernel.size() - 5, 5, "-auto") == 0;
      if (is_auto) automatic = &r;
      else if (!best || r.ms < best->ms) best = &r;
    }
    if (!automatic || !best) continue;
    const std::string choice = gg::describe(chosen.at(index));
    const Row* own = nullptr;  // the choice's own candidate row
    for (const Row& r : rows)
      if (r.config == sh.name && r.writes == writes && r.kernel == choice) own = &r;
    out.push_back({sh.name, gg::LayerKernels::name(index), choice, best->kernel, automatic->ms,
                   best->ms, own ? own->ms : NAN});
    SearchRow& x = out.back();
    if (own && own->round_ms.size() == best->round_ms.size())
      for (size_t i = 0; i < own->round_ms.size(); ++i) {
        const double q = own->round_ms[i] / best->round_ms[i];
        x.round_lo = std::isfinite(x.round_lo) ? std::min(x.round_lo, q) : q;
        x.round_hi = std::isfinite(x.round_hi) ? std::max(x.round_hi, q) : q;
      }
    if (os) {
      JsonLine j;
      j.add("bench", "kernel-search").add("config", sh.name);
      if (!sh.model.empty()) j.add("model", sh.model);
      j.add("gemm", x.gemm).add("activation", activation_name(act));
      j.add("T", sh.T).add("S", S).add("E", sh.E).add("K", sh.K).add("d", sh.d).add("n", sh.n);
      j.add("chosen", x.chosen).add("auto_ms", x.auto_ms).add("best", x.best);
      j.add("best_ms", x.best_ms).add("auto_over_best", x.auto_ms / x.best_ms);
      if (std::isfinite(x.choice_ms))
        j.add("choice_ms", x.choice_ms).add("choice_over_best", x.choice_ms / x.best_ms);
      if (std::isfinite(x.round_lo))
        j.add("choice_over_best_round_lo", x.round_lo).add("choice_over_best_round_hi", x.round_hi);
      // Every candidate's time (the rule's next revision reads them, not only the fastest).
      JsonLine candidates;
      for (const Row& r : rows)
        if (r.config == sh.name && r.writes == writes && &r != automatic)
          candidates.add(r.kernel, r.ms);
      j.add("candidate_ms", candidates);
      j.add("reps", f.reps).add("rounds", kSearchRounds).add("operands", f.operands);
      j.add("kernels", kernel_specs(f));
      j.add("gpu", info.gpu).add("driver", info.driver).add("commit", info.commit);
      j.add("date", info.date);
      os << j.str() << "\n";
    }
  }
  return out;
}

// The search's table and summary lines: geomean and worst of choice / best, how many GEMMs are
// within 3 % of the fastest candidate.
void print_search(const std::vector<SearchRow>& rows, int reps, const RunInfo& info) {
  Table t({{"config", Align::left}, {"gemm", Align::left}, {"chosen", Align::left},
           {"choice ms"}, {"auto ms"}, {"best", Align::left}, {"best ms"}, {"choice / best"},
           {"by round"}});
  double log_sum = 0, worst = 0, twin_lo = INFINITY, twin_hi = 0;
  int within = 0, every_round = 0;
  for (const SearchRow& r : rows) {
    // The choice's candidate row where there is one, else its *-auto row.
    const double choice = std::isfinite(r.choice_ms) ? r.choice_ms : r.auto_ms;
    const double ratio = choice / r.best_ms;
    log_sum += std::log(ratio);
    worst = std::max(worst, ratio);
    within += ratio <= 1.03;
    every_round += r.round_lo > 1.03;  // false for NaN
    if (std::isfinite(r.choice_ms)) {
      twin_lo = std::min(twin_lo, r.auto_ms / r.choice_ms);
      twin_hi = std::max(twin_hi, r.auto_ms / r.choice_ms);
    }
    t.add_row({r.config, r.gemm, r.chosen, fixed(r.choice_ms, 3), fixed(r.auto_ms, 3), r.best,
               fixed(r.best_ms, 3), fixed(ratio, 3),
               fixed(r.round_lo, 3) + " to " + fixed(r.round_hi, 3)});
  }
  std::cout << "\nKernel search (" << info.gpu << "): the automatic choice against the fastest "
            << "legal candidate of each GEMM, median of " << reps << " reps each in "
            << kSearchRounds << " rotated rounds\n";
  t.print(std::cout);
  if (rows.empty()) return;
  std::cout << "choice / best over " << rows.size() << " GEMMs: geomean "
            << fixed(std::exp(log_sum / double(rows.size())), 3) << ", worst " << fixed(worst, 3)
            << ", " << within << " within 3 %, " << every_round
            << " more than 3 % slower in every round\n";
  if (twin_hi > 0)  // the same kernel timed twice (as the choice's candidate and as *-auto)
    std::cout << "auto / choice (the same kernel twice, the run's noise): " << fixed(twin_lo, 3)
              << " to " << fixed(twin_hi, 3) << "\n";
}

void run(const Flags& f) {
  MOEBLAZE_REQUIRE(f.reps >= 20, "--reps (", f.reps, ") must be at least 20");
  MOEBLAZE_REQUIRE(f.warmup >= 1, "--warmup (", f.warmup, ") must be at least 1");
  const Activation act = parse_activation(f.activation);
  std::vector<Shape> shapes = find_shapes(f.configs);
  MOEBLAZE_REQUIRE(!shapes.empty(), "--configs is empty");
  if (!f.slice.empty()) {
    const std::vector<Shape> part = parse_slice(f.slice).of(shapes);
    MOEBLAZE_REQUIRE(!part.empty(), "--slice ", f.slice, " leaves none of the ", shapes.size(),
                     " shapes");
    shapes = part;
  }
  MOEBLAZE_REQUIRE(!f.search || kernel_specs(f).find(';') == std::string::npos,
                   "--search compares the candidates under one set of overrides: --kernels "
                   "(or MOEBLAZE_KERNELS) must not list variants with ';'");
  for (const auto& s : shapes) cuda::gemm::check_gemm_shape(s.d, s.n);

  const RunInfo info = describe_run();
  std::cerr << "bench gemm: " << info.gpu << ", driver " << info.driver << ", commit "
            << info.commit << "\n";
  cudaStream_t stream = nullptr;
  Dev flush(kL2FlushBytes);
  GpuTimer timer(stream, flush.p);
  cublasHandle_t blas = nullptr;
  if (!f.no_dense && !f.search) {
    cublas_check(cublasCreate(&blas), "cublasCreate");
    cublas_check(cublasSetStream(blas, stream), "cublasSetStream");
  }
  std::vector<Row> rows;
  std::vector<std::string> skipped;
  std::vector<SearchRow> searched;
  for (const Shape& sh : shapes) {
    try {
      bench_shape(f, sh, act, stream, timer, blas, rows);
      if (f.search) {
        const std::vector<SearchRow> found = search_rows(f, sh, rows, act, info);
        searched.insert(searched.end(), found.begin(), found.end());
      }
    } catch (const DeviceError& e) {  // out of device memory: the next shapes still run
      if (std::string(e.what()).find("out of memory") == std::string::npos) throw;
      std::cerr << "bench gemm: " << sh.name << " skipped: " << e.what() << "\n";
      (void)cudaGetLastError();
      skipped.push_back(sh.name);
    }
  }
  if (blas) cublasDestroy(blas);

  print_table(rows);
  for (const std::string& name : skipped)
    std::cout << "skipped (out of device memory): " << name << "\n";
  if (f.search) {
    print_search(searched, f.reps, info);
  } else if (!f.out.empty()) {
    append_jsonl(f.out, rows, act, f.operands, kernel_specs(f), info);
  }
  if (!f.md.empty()) write_markdown(f.md, rows, act, f.reps, f.operands, info);
}

}  // namespace

void add_bench_gemm_command(CLI::App& bench) {
  auto flags = std::make_shared<Flags>();
  CLI::App* sub = bench.add_subcommand("gemm", "the grouped GEMM kernels alone on the GPU");
  sub->add_option("--configs", flags->configs,
                  "comma list: gemm-big (S=65536, E=16, d=2048, n=1024), named configs, grid "
                  "shapes, 'all', 'grid', or shapes as T<T>-d<d>-n<n>-E<E>-K<K>");
  sub->add_option("--activation", flags->activation,
                  "swiglu, geglu, relu, silu, gelu, relu2");
  sub->add_option("--reps", flags->reps, "timed repetitions (>= 20)")
      ->check(integer_in(1, INT32_MAX));
  sub->add_option("--warmup", flags->warmup, "untimed repetitions first")
      ->check(integer_in(0, INT32_MAX));
  sub->add_option("--seed", flags->seed, "input seed")
      ->check(unsigned_integer());
  sub->add_flag("--no-dense", flags->no_dense, "skip the cuBLAS same-FLOP comparison");
  sub->add_option("--only", flags->only,
                  "time only these kernels (comma list of up, up-ws, up-pp, up-mc, down, dH, dH-ws, dH-ws-ip, "
                  "dH-mc, dH-pp, dW2, dW2-ws, dX, down-tma, dX-tma, down-tma256, down-tmapp, "
                  "down-tma128, down-tma128c1, dX-tma256, dX-tmapp, dX-tma128, dX-tma128c1, down-ws, down-pp, "
                  "dX-ws, dX-pp, "
                  "dW1, dW1-ws, dW1-mc, dW2-ts, dW1-ts, up-auto, down-auto, dH-auto, dW2-auto, dX-auto, "
                  "dW1-auto, down-fp8, down-fp8-c2, down-fp8-pp, dW2-fp8, dW2-fp8-c2, "
                  "dW2-fp8-pp, dW1-fp8, dW1-fp8-c2, dW1-fp8-pp); all of them still run once "
                  "for the correctness check");
  sub->add_option("--operands", flags->operands,
                  "what the GEMMs read as h, a, dh and a': chain (what the chain computed) or "
                  "random (N(0, 1), like x and dO, refilled after the correctness check)")
      ->check(CLI::IsMember({"chain", "random"}));
  sub->add_option("--kernels", flags->kernels,
                  "kernel overrides for every kernel timed, under each kernel's own (e.g. "
                  "tma.bands=4; syntax as MOEBLAZE_KERNELS); ';' separates variants, each "
                  "kernel timed under each in turn (\"tma.bands=1;tma.bands=4\")");
  sub->add_flag("--search", flags->search,
               "time every legal bf16 candidate of each GEMM (the set the automatic choice is "
               "made from, each named by its kernel) and the automatic choice (the *-auto rows) "
               "together, in 5 rounds of rotated order, and print the choice against the "
               "fastest candidate per GEMM (--out: one \"kernel-search\" JSON line per GEMM; "
               "no cuBLAS column, --only ignored)");
  sub->add_option("--slice", flags->slice,
                  "i/k: only every k-th of the --configs shapes, from the i-th (a long search "
                  "split over k runs, each with big and small shapes)");
  sub->add_option("--out", flags->out, "append JSON lines to this file");
  sub->add_option("--md", flags->md, "write the table as Markdown to this file");
  sub->callback([flags] { run(*flags); });
}

}  // namespace moeblaze::tools

#endif  // MOEBLAZE_WITH_CUDA
