// Seeded shape fuzz of the GPU layer: random (T, d, n, E, K, activation, mode, compute, routing
// skew with empty experts and tokens without pairs, expert biases) over the sizes the CUDA
// backend takes (T in [0, 40000] with odd T; d and n multiples of 64, also of 128 for FP8;
// E in [1, 512]; K up to 10), each step checked
//  - against the float64 reference (tests/cpu's reference_layer) and the CPU backend where the
//    step is small, or on a sample of tokens and expert columns in float64 where it is big, with
//    the GPU layer tests' tolerances (bf16: 1e-2; FP8: 0.1, relu's dH 0.25);
//  - bit for bit where the library promises bits: a second run of the same step, and the other
//    mode (keep_h against recompute);
//  - every output written (outputs start as NaN bytes; finite inputs give finite outputs);
// and random shapes the GPU path refuses (d or n off the 64 grid, fp32, FP8 off the 128 grid,
// swiglu_oai past its expert limit, a misaligned tensor) fail with Unsupported naming the rule,
// out untouched.
// MOEBLAZE_GPU_FUZZ_CASES (default 100: a short round in the GPU suite) sets the case count,
// MOEBLAZE_GPU_FUZZ_SEED the first case's seed (default: a fresh one, printed); case i uses seed
// + i, so a failure's printed seed with MOEBLAZE_GPU_FUZZ_CASES=1 replays that one case.
// scripts/gpu_check.sh --fuzz-long runs 2000 cases with the big sizes (MOEBLAZE_GPU_FUZZ_BIG=1).
// MOEBLAZE_GPU_FUZZ_NO_FP8=1 runs the drawn FP8 cases in bf16 (compute-sanitizer's initcheck run).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "common/layer_fixtures.hpp"
#include "common/test_util.hpp"
#include "core/parallel.hpp"
#include "gpu/gpu_layer_util.hpp"
#include "gpu/gpu_test_util.hpp"
#include "moeblaze/moeblaze.hpp"
#include "reference/reference_layer.hpp"

namespace moeblaze::test {
namespace {

// ---- the cases --------------------------------------------------------------------------------

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  return *end == '\0' ? int64_t(n) : fallback;
}

uint64_t first_seed() {
  const char* v = std::getenv("MOEBLAZE_GPU_FUZZ_SEED");
  if (v != nullptr && *v != '\0') return std::strtoull(v, nullptr, 10);
  return fresh_seed();
}

// What a refused case breaks (none: a case the GPU takes).
enum class Reject { none, d_grid, n_grid, fp32, fp8_grid, oai_experts, misaligned_x };
const char* reject_name(Reject r) {
  switch (r) {
    case Reject::none: return "none";
    case Reject::d_grid: return "d off the 64 grid";
    case Reject::n_grid: return "n off the 64 grid";
    case Reject::fp32: return "fp32 storage";
    case Reject::fp8_grid: return "fp8 off the 128 grid";
    case Reject::oai_experts: return "swiglu_oai past its expert limit";
    case Reject::misaligned_x: return "x not 16-byte aligned";
  }
  return "?";
}

struct FuzzCase {
  uint64_t seed = 0;
  LayerConfig cfg;
  LayerMode mode = LayerMode::keep_h;
  bool b1 = false, b2 = false, drop = false, check_plan = false;
  RoutingSpec spec;
  Reject reject = Reject::none;

  std::string describe() const {
    char buf[512];
    std::snprintf(buf, sizeof(buf),
                  "seed %" PRIu64 " (replay: MOEBLAZE_GPU_FUZZ_SEED=%" PRIu64
                  " MOEBLAZE_GPU_FUZZ_CASES=1): T=%lld d=%lld n=%lld E=%lld K=%lld %s %s %s %s "
                  "empty=%lld skew=%d drop=%d b1=%d b2=%d reject=%s",
                  seed, seed, (long long)cfg.T, (long long)cfg.d, (long long)cfg.n,
                  (long long)cfg.E, (long long)cfg.K, activation_name(cfg.activation),
                  dtype_name(cfg.dtype), compute_name(cfg.compute), layer_mode_name(mode),
                  (long long)spec.empty_experts, int(spec.skew), int(drop), int(b1), int(b2),
                  reject_name(reject));
    return buf;
  }
};

// Weights (E, w1_rows, d) and (E, d, n) stay below 2^24 elements and x (T, d) below 2^23 in the
// short round (T = 40000 with d <= 192): the host's inputs and float64 checks stay near a second
// a case. MOEBLAZE_GPU_FUZZ_BIG=1 (the long round) allows 2^26 and 2^25.
int64_t max_weight() { return int64_t(1) << (env_int("MOEBLAZE_GPU_FUZZ_BIG", 0) ? 26 : 24); }
int64_t max_tokens() { return int64_t(1) << (env_int("MOEBLAZE_GPU_FUZZ_BIG", 0) ? 25 : 23); }

FuzzCase draw_case(uint64_t seed) {
  std::mt19937_64 rng(seed);
  const auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  const auto log_pick = [&](int64_t lo, int64_t hi) {  // log-uniform: small sizes often
    const double u = std::uniform_real_distribution<double>(std::log(double(lo)),
                                                            std::log(double(hi) + 1.0))(rng);
    return std::clamp<int64_t>(int64_t(std::exp(u)), lo, hi);
  };
  FuzzCase c;
  c.seed = seed;
  LayerConfig& cfg = c.cfg;
  const int64_t size_class = pick(0, 99);
  cfg.T = size_class < 5    ? 0
          : size_class < 15 ? pick(1, 8)
          : size_class < 60 ? pick(9, 512)
          : size_class < 90 ? pick(513, 4096)
                            : pick(4097, 40000);
  if (cfg.T > 1 && pick(0, 1) == 1) cfg.T |= 1;  // odd T, half the time
  cfg.E = log_pick(1, 512);
  cfg.K = pick(1, std::min<int64_t>(10, cfg.E));
  cfg.activation = static_cast<Activation>(pick(0, 6));
  cfg.dtype = DType::bf16;
  cfg.d = 64 * log_pick(1, 32);
  cfg.n = 64 * log_pick(1, 32);
  c.mode = pick(0, 1) ? LayerMode::recompute : LayerMode::keep_h;
  const auto halve64 = [](int64_t v) { return std::max<int64_t>(64, v / 128 * 64); };
  while (cfg.E * std::max(cfg.w1_rows(), cfg.d) * std::max(cfg.d, cfg.n) > max_weight()) {
    if (cfg.E > std::max<int64_t>(cfg.K, 8)) cfg.E = std::max(cfg.K, cfg.E / 2);
    else if (cfg.d >= cfg.n && cfg.d > 64) cfg.d = halve64(cfg.d);
    else if (cfg.n > 64) cfg.n = halve64(cfg.n);
    else break;
  }
  while (cfg.T * cfg.d > max_tokens()) cfg.T /= 2;
  if (cfg.d % 128 == 0 && cfg.n % 128 == 0 && pick(0, 1) == 0)
    cfg.compute = pick(0, 2) ? Compute::fp8 : Compute::fp8_wgrad;
  c.b1 = pick(0, 3) == 0;
  c.b2 = pick(0, 3) == 0;
  c.spec = {cfg.T, cfg.E, cfg.K, pick(0, 2) == 0 ? pick(0, cfg.E - cfg.K) : 0, pick(0, 1) == 1};
  c.drop = pick(0, 3) == 0;
  c.check_plan = pick(0, 1) == 1;

  if (pick(0, 9) == 0) {  // a shape the GPU refuses, one rule broken, small T
    c.reject = static_cast<Reject>(pick(1, 6));
    cfg.T = std::clamp<int64_t>(cfg.T, 1, 64);  // x has bytes to misalign
    cfg.compute = Compute::storage;
    c.b1 = c.b2 = false;
    switch (c.reject) {
      case Reject::d_grid: cfg.d = std::min<int64_t>(cfg.d, 1024) + pick(1, 63); break;
      case Reject::n_grid: cfg.n = std::min<int64_t>(cfg.n, 1024) + pick(1, 63); break;
      case Reject::fp32: cfg.dtype = DType::f32; break;
      case Reject::fp8_grid:
        cfg.compute = Compute::fp8;
        (pick(0, 1) ? cfg.d : cfg.n) = 128 * pick(0, 4) + 64;  // on the 64 grid, off the 128
        break;
      case Reject::oai_experts:
        cfg.activation = Activation::swiglu_oai;
        cfg.E = pick(4097, 5000);
        cfg.K = std::min<int64_t>(cfg.K, 2);
        cfg.d = cfg.n = 64;
        break;
      default: break;  // misaligned_x
    }
    c.spec = {cfg.T, cfg.E, cfg.K, 0, false};
    c.drop = false;
  }
  c.spec.T = cfg.T;
  c.spec.E = cfg.E;
  c.spec.K = cfg.K;
  c.spec.empty_experts = std::min(c.spec.empty_experts, cfg.E - cfg.K);
  // MOEBLAZE_GPU_FUZZ_NO_FP8 after every draw: a seed names the same shape with it or without.
  if (env_int("MOEBLAZE_GPU_FUZZ_NO_FP8", 0) && c.reject == Reject::none && is_fp8(cfg.compute))
    cfg.compute = Compute::storage;
  return c;
}

// ---- one step on the GPU and on the CPU backend ------------------------------------------------

// A step's inputs and outputs on the host; b1 / b2 / db1 / db2 rank 0 where there is no bias.
struct StepTensors {
  LayerTensors t;
  HostTensor b1, b2, db1, db2;
  StepTensors(const LayerConfig& cfg, int64_t S) : t(cfg, S) {}
  LayerBiases biases() const { return {b1.shape.empty() ? TensorView() : b1.view(),
                                       b2.shape.empty() ? TensorView() : b2.view()}; }
  void poison() {  // 0xFF bytes: NaN in bf16 and fp32, so an unwritten element shows
    for (HostTensor* h : {&t.out, &t.dx, &t.dw1, &t.dw2, &t.d_pair_weights, &db1, &db2})
      std::fill(h->bytes.begin(), h->bytes.end(), 0xFF);
  }
};

void run_cpu(const LayerConfig& cfg, const RoutingPlan& plan, StepTensors& s, LayerMode mode) {
  LayerOptions opts;
  opts.mode = mode;
  SavedForBackward saved;
  LayerGrads g = s.t.grads();
  if (!s.db1.shape.empty()) g.db1 = s.db1.view();
  if (!s.db2.shape.empty()) g.db2 = s.db2.view();
  const LayerBiases b = s.biases();
  layer_forward(cfg, plan, s.t.x.view(), s.t.w1.view(), s.t.w2.view(), b, s.t.out.view(), saved,
                opts);
  layer_backward(cfg, plan, s.t.x.view(), s.t.w1.view(), s.t.w2.view(), b, s.t.d_out.view(),
                 saved, g, opts);
}

void run_gpu(const LayerConfig& cfg, const RoutingPlan& dev_plan, StepTensors& s, LayerMode mode,
             bool check_plan) {
  LayerOptions opts;
  opts.mode = mode;
  opts.check_plan = check_plan;
  DevTensor x(s.t.x), w1(s.t.w1), w2(s.t.w2), d_out(s.t.d_out), out(s.t.out), dx(s.t.dx),
      dw1(s.t.dw1), dw2(s.t.dw2), dpw(s.t.d_pair_weights), b1(s.b1), b2(s.b2), db1(s.db1),
      db2(s.db2);
  LayerBiases b;
  LayerGrads g;
  g.dx = dx.v, g.dw1 = dw1.v, g.dw2 = dw2.v, g.d_pair_weights = dpw.v;
  if (!s.b1.shape.empty()) b.b1 = b1.v, g.db1 = db1.v;
  if (!s.b2.shape.empty()) b.b2 = b2.v, g.db2 = db2.v;
  SavedForBackward saved;
  layer_forward(cfg, dev_plan, x.v, w1.v, w2.v, b, out.v, saved, opts);
  layer_backward(cfg, dev_plan, x.v, w1.v, w2.v, b, d_out.v, saved, g, opts);
  MOEBLAZE_CUDA_CHECK(cudaDeviceSynchronize());
  out.download_into(s.t.out);
  dx.download_into(s.t.dx);
  dw1.download_into(s.t.dw1);
  dw2.download_into(s.t.dw2);
  dpw.download_into(s.t.d_pair_weights);
  if (!s.db1.shape.empty()) db1.download_into(s.db1);
  if (!s.db2.shape.empty()) db2.download_into(s.db2);
}

bool same_bits(const StepTensors& a, const StepTensors& b) {
  return bitwise_equal(a.t.out, b.t.out) && bitwise_equal(a.t.dx, b.t.dx) &&
         bitwise_equal(a.t.dw1, b.t.dw1) && bitwise_equal(a.t.dw2, b.t.dw2) &&
         bitwise_equal(a.t.d_pair_weights, b.t.d_pair_weights) && bitwise_equal(a.db1, b.db1) &&
         bitwise_equal(a.db2, b.db2);
}

// The first non-finite element of any output ("" when all are finite).
std::string first_nonfinite(const StepTensors& s) {
  const struct {
    const char* name;
    const HostTensor* h;
  } outs[] = {{"out", &s.t.out}, {"dx", &s.t.dx}, {"dw1", &s.t.dw1}, {"dw2", &s.t.dw2},
              {"d_pair_weights", &s.t.d_pair_weights}, {"db1", &s.db1}, {"db2", &s.db2}};
  for (const auto& o : outs)
    for (int64_t i = 0; !o.h->bytes.empty() && i < o.h->numel(); ++i)
      if (!std::isfinite(o.h->at(i))) return std::string(o.name) + "[" + std::to_string(i) + "]";
  return "";
}

// ---- the float64 yardsticks ---------------------------------------------------------------------

struct Tolerances {
  double out, dh, dw2, dpw, vs_cpu;
};
Tolerances tolerances(const LayerConfig& cfg) {
  // tests/gpu/test_layer_gpu.cpp (bf16) and test_layer_fp8_gpu.cpp (FP8: e4m3's 3 mantissa bits;
  // relu's step derivative turns H's sign errors into whole dH errors).
  if (!is_fp8(cfg.compute)) {
    const double t = rel_tolerance(DType::bf16);
    return {t, t, t, t, t};
  }
  const bool kink = cfg.activation == Activation::relu || cfg.activation == Activation::relu2;
  return {0.1, kink ? 0.25 : 0.1, 0.1, 0.1, 0.05};
}

void expect_full(const FuzzCase& c, const HostRouting& routing, const RoutingPlan& host_plan,
                 const StepTensors& in, const StepTensors& gpu) {
  const LayerConfig& cfg = c.cfg;
  const Tolerances tol = tolerances(cfg);
  // FP8 against float64 only over enough elements for e4m3's error to average to its bound
  // (test_layer_fp8_gpu.cpp's steps have 64+ slots); below, the CPU emulation alone judges.
  const bool against_float64 = !is_fp8(cfg.compute) || host_plan.S() >= 64;
  const reference::LayerReference ref = reference::reference_layer(
      cfg, routing.view(), in.t.x.view(), in.t.w1.view(), in.t.w2.view(), in.t.d_out.view(),
      in.b1.shape.empty() ? TensorView() : in.b1.view(),
      in.b2.shape.empty() ? TensorView() : in.b2.view());
  if (against_float64) {
    expect_close("out", gpu.t.out, ref.out, tol.out);
    expect_close("dx", gpu.t.dx, ref.dx, tol.dh);
    expect_close("dw1", gpu.t.dw1, ref.dw1, tol.dh);
    expect_close("dw2", gpu.t.dw2, ref.dw2, tol.dw2);
    EXPECT_LE(scaled_error(gpu.t.d_pair_weights, ref.d_pair_weights, ref.d_pair_weights_abs),
              tol.dpw)
        << "d_pair_weights";
    if (c.b1) expect_close("db1", gpu.db1, ref.db1, tol.dh);
    if (c.b2) expect_close("db2", gpu.db2, ref.db2, tol.dw2);
  }

  // The CPU backend (for FP8, its emulation of the recipe) on the same inputs.
  StepTensors cpu = in;
  run_cpu(cfg, host_plan, cpu, c.mode);
  expect_close("out vs CPU", gpu.t.out, cpu.t.out.to_double(), tol.vs_cpu);
  expect_close("dx vs CPU", gpu.t.dx, cpu.t.dx.to_double(), tol.vs_cpu);
  expect_close("dw1 vs CPU", gpu.t.dw1, cpu.t.dw1.to_double(), tol.vs_cpu);
  expect_close("dw2 vs CPU", gpu.t.dw2, cpu.t.dw2.to_double(), tol.vs_cpu);
  if (c.b1) expect_close("db1 vs CPU", gpu.db1, cpu.db1.to_double(), tol.vs_cpu);
  if (c.b2) expect_close("db2 vs CPU", gpu.db2, cpu.db2.to_double(), tol.vs_cpu);
  EXPECT_LE(scaled_error(gpu.t.d_pair_weights, cpu.t.d_pair_weights.to_double(),
                         ref.d_pair_weights_abs),
            tol.vs_cpu)
      << "d_pair_weights vs CPU";
}

// Relative Frobenius error of paired samples (got, ref) with an optional scale per sample.
struct Sample {
  std::vector<double> got, ref, scale;
  void add(double g, double r, double s = NAN) {
    got.push_back(g);
    ref.push_back(r);
    scale.push_back(std::isnan(s) ? r : s);
  }
  double error() const {
    double num = 0, den = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      if (!std::isfinite(got[i])) return INFINITY;
      num += (got[i] - ref[i]) * (got[i] - ref[i]);
      den += scale[i] * scale[i];
    }
    if (den == 0) return num == 0 ? 0.0 : INFINITY;
    return std::sqrt(num / den);
  }
};

// A big step in float64 on a sample: whole rows of out and dx and the d pair weights of a few
// tokens, and a few columns j of dW2, rows j (and n + j) of dW1 and entries of db1 / db2 of a few
// experts that have slots (each over all its slots).
void expect_sampled(const FuzzCase& c, const HostRouting& r, const StepTensors& in,
                    const StepTensors& gpu) {
  const LayerConfig& cfg = c.cfg;
  const Tolerances tol = tolerances(cfg);
  const int64_t d = cfg.d, n = cfg.n, R = cfg.w1_rows(), T = cfg.T;
  const bool gated = is_gated(cfg.activation);
  const Activation act = cfg.activation;
  std::mt19937_64 rng(c.seed ^ 0x5eed);
  const auto x = [&](int64_t t, int64_t k) { return in.t.x.at(t * d + k); };
  const auto w1 = [&](int64_t e, int64_t j, int64_t k) { return in.t.w1.at((e * R + j) * d + k); };
  const auto w2 = [&](int64_t e, int64_t i, int64_t j) { return in.t.w2.at((e * d + i) * n + j); };
  const auto dout = [&](int64_t t, int64_t i) { return in.t.d_out.at(t * d + i); };
  const auto b1 = [&](int64_t e, int64_t j) { return c.b1 ? in.b1.at(e * R + j) : 0.0; };
  const auto b2 = [&](int64_t e, int64_t i) { return c.b2 ? in.b2.at(e * d + i) : 0.0; };
  const auto h_of = [&](int64_t e, int64_t t, int64_t j) {
    double acc = b1(e, j);
    for (int64_t k = 0; k < d; ++k) acc += w1(e, j, k) * x(t, k);
    return acc;
  };
  const auto a_of = [&](double g, double u) {
    return gated ? reference::activation_f(act, g) * reference::activation_up(act, u)
                 : reference::activation_f(act, g);
  };

  Sample out, dx, dpw, dw1, dw2, db1, db2;
  if (T > 0) {
    std::vector<int64_t> tokens{0, T - 1};
    for (int i = 0; i < 4; ++i) tokens.push_back(int64_t(rng() % uint64_t(T)));
    for (int64_t t : tokens) {
      std::vector<double> o(d, 0.0), g(d, 0.0);
      for (int32_t p = r.offsets[t]; p < r.offsets[t + 1]; ++p) {
        const int64_t e = r.experts[p];
        const double s = r.weights[p];
        std::vector<double> h(R), a(n), dap(n, 0.0);
        parallel_for(0, R, 16, [&](int64_t j) { h[j] = h_of(e, t, j); });
        for (int64_t j = 0; j < n; ++j) a[j] = a_of(h[j], gated ? h[n + j] : 0.0);
        double ds = 0, ds_abs = 0;
        for (int64_t i = 0; i < d; ++i) {
          double y = b2(e, i);
          for (int64_t j = 0; j < n; ++j) y += w2(e, i, j) * a[j];
          o[i] += s * y;
          ds += dout(t, i) * b2(e, i);
          ds_abs += std::fabs(dout(t, i) * b2(e, i));
          for (int64_t j = 0; j < n; ++j) dap[j] += w2(e, i, j) * dout(t, i);
        }
        std::vector<double> dh(R);
        for (int64_t j = 0; j < n; ++j) {
          ds += dap[j] * a[j];
          ds_abs += std::fabs(dap[j] * a[j]);
          const double da = s * dap[j];
          if (gated) {
            dh[j] = da * reference::activation_up(act, h[n + j]) *
                    reference::activation_df(act, h[j]);
            dh[n + j] = da * reference::activation_f(act, h[j]) *
                        reference::activation_dup(act, h[n + j]);
          } else {
            dh[j] = da * reference::activation_df(act, h[j]);
          }
        }
        parallel_for(0, d, 16, [&](int64_t k) {
          double acc = 0;
          for (int64_t j = 0; j < R; ++j) acc += dh[j] * w1(e, j, k);
          g[k] += acc;
        });
        dpw.add(gpu.t.d_pair_weights.at(p), ds, ds_abs);
      }
      for (int64_t i = 0; i < d; ++i) {
        out.add(gpu.t.out.at(t * d + i), o[i]);
        dx.add(gpu.t.dx.at(t * d + i), g[i]);
      }
    }
  }
  // Experts with slots: their slots (token, weight) from the routing.
  std::vector<std::vector<std::pair<int64_t, double>>> slots(cfg.E);
  for (int64_t t = 0; t < T; ++t)
    for (int32_t p = r.offsets[t]; p < r.offsets[t + 1]; ++p)
      slots[r.experts[p]].push_back({t, r.weights[p]});
  // FP8 against float64 only where e4m3's error averages out, as in the full check: experts with
  // 64+ slots (an FP8 step's smaller experts are judged by the full checks of small steps against
  // the CPU emulation). db1 on 16 columns of each expert: an rms over 6 sums of a few slots each
  // is too noisy for the bound; 64 under FP8 relu, whose step derivative turns e4m3's sign flips
  // of H into whole dH entries.
  const bool fp8 = is_fp8(cfg.compute);
  std::vector<int64_t> used;
  for (int64_t e = 0; e < cfg.E; ++e)
    if (!slots[e].empty() && (!fp8 || slots[e].size() >= 64)) used.push_back(e);
  std::shuffle(used.begin(), used.end(), rng);
  used.resize(std::min<size_t>(used.size(), 2));
  const int columns = !c.b1 ? 3 : fp8 && cfg.activation == Activation::relu ? 64 : 16;
  for (int64_t e : used) {
    for (int rep = 0; rep < columns; ++rep) {
      const int64_t j = int64_t(rng() % uint64_t(n));
      const int64_t ns = int64_t(slots[e].size());
      // Per slot: a_j, and dH's gate (and up) entries j.
      std::vector<double> aj(ns), dg(ns), du(ns);
      parallel_for(0, ns, 64, [&](int64_t q) {
        const auto [t, s] = slots[e][q];
        const double g = h_of(e, t, j), u = gated ? h_of(e, t, n + j) : 0.0;
        aj[q] = a_of(g, u);
        double dap = 0;
        for (int64_t i = 0; i < d; ++i) dap += w2(e, i, j) * dout(t, i);
        const double da = s * dap;
        if (gated) {
          dg[q] = da * reference::activation_up(act, u) * reference::activation_df(act, g);
          du[q] = da * reference::activation_f(act, g) * reference::activation_dup(act, u);
        } else {
          dg[q] = da * reference::activation_df(act, g);
        }
      });
      std::vector<double> c2(d, 0.0), r1(d, 0.0), r1u(d, 0.0);
      double sg = 0, su = 0;
      const bool weights = rep < 3;  // dW2's column and dW1's rows j: the first 3 columns
      for (int64_t q = 0; q < ns; ++q) {
        const auto [t, s] = slots[e][q];
        sg += dg[q];
        su += du[q];
        for (int64_t i = 0; weights && i < d; ++i) {
          c2[i] += s * dout(t, i) * aj[q];
          r1[i] += dg[q] * x(t, i);
          if (gated) r1u[i] += du[q] * x(t, i);
        }
      }
      for (int64_t i = 0; weights && i < d; ++i) {
        dw2.add(gpu.t.dw2.at((e * d + i) * n + j), c2[i]);
        dw1.add(gpu.t.dw1.at((e * R + j) * d + i), r1[i]);
        if (gated) dw1.add(gpu.t.dw1.at((e * R + n + j) * d + i), r1u[i]);
      }
      if (c.b1) {
        db1.add(gpu.db1.at(e * R + j), sg);
        if (gated) db1.add(gpu.db1.at(e * R + n + j), su);
      }
    }
    if (c.b2) {
      std::vector<double> acc(d, 0.0);
      for (const auto& [t, s] : slots[e])
        for (int64_t i = 0; i < d; ++i) acc[i] += s * dout(t, i);
      for (int64_t i = 0; i < d; ++i) db2.add(gpu.db2.at(e * d + i), acc[i]);
    }
  }
  // A replay (one case) prints every sampled error, to read how far a case is from its bound.
  if (env_int("MOEBLAZE_GPU_FUZZ_CASES", 100) == 1)
    std::printf("[gpu fuzz] sampled errors: out %.4g dx %.4g dpw %.4g dw1 %.4g dw2 %.4g db1 %.4g "
                "(%zu sums) db2 %.4g; bounds out %.3g dh %.3g dw2 %.3g dpw %.3g\n",
                out.error(), dx.error(), dpw.error(), dw1.error(), dw2.error(), db1.error(),
                db1.got.size(), db2.error(), tol.out, tol.dh, tol.dw2, tol.dpw);
  EXPECT_LE(out.error(), tol.out) << "out (sampled)";
  EXPECT_LE(dx.error(), tol.dh) << "dx (sampled)";
  EXPECT_LE(dpw.error(), tol.dpw) << "d_pair_weights (sampled)";
  EXPECT_LE(dw1.error(), tol.dh) << "dw1 (sampled)";
  EXPECT_LE(dw2.error(), tol.dw2) << "dw2 (sampled)";
  EXPECT_LE(db1.error(), tol.dh) << "db1 (sampled)";
  EXPECT_LE(db2.error(), tol.dw2) << "db2 (sampled)";
}

// ---- the two kinds of case ---------------------------------------------------------------------

// Host work of the full float64 reference, in multiply-adds; above it the sampled check runs.
constexpr double kFullCheckWork = 6e7;

void check_valid(const FuzzCase& c) {
  const LayerConfig& cfg = c.cfg;
  HostRouting routing = random_routing(c.spec, c.seed + 1);
  if (c.drop) {
    std::mt19937_64 rng(c.seed + 2);
    drop_some_tokens(routing, rng);
  }
  const RoutingPlan host_plan = make_plan(routing);
  const RoutingPlan dev_plan = device_plan(host_plan);
  const int64_t S = host_plan.S(), R = cfg.w1_rows();
  StepTensors in(cfg, S);
  in.t.randomize(c.seed + 3);
  if (c.b1) {
    in.b1 = HostTensor(cfg.dtype, {cfg.E, R});
    in.b1.fill_random(c.seed + 4, 0.5f);
    in.db1 = HostTensor(cfg.dtype, {cfg.E, R});
  }
  if (c.b2) {
    in.b2 = HostTensor(cfg.dtype, {cfg.E, cfg.d});
    in.b2.fill_random(c.seed + 5, 0.5f);
    in.db2 = HostTensor(cfg.dtype, {cfg.E, cfg.d});
  }
  in.poison();
  StepTensors a = in, b = in, other = in;
  ASSERT_NO_THROW(run_gpu(cfg, dev_plan, a, c.mode, c.check_plan));
  const std::string unwritten = first_nonfinite(a);
  EXPECT_EQ(unwritten, "") << "an output is not finite (unwritten or overflowed)";
  ASSERT_NO_THROW(run_gpu(cfg, dev_plan, b, c.mode, false));
  EXPECT_TRUE(same_bits(a, b)) << "two runs of the same step differ";
  const LayerMode other_mode =
      c.mode == LayerMode::keep_h ? LayerMode::recompute : LayerMode::keep_h;
  ASSERT_NO_THROW(run_gpu(cfg, dev_plan, other, other_mode, false));
  EXPECT_TRUE(same_bits(a, other)) << "keep_h and recompute differ";
  const double work = double(S) * double(cfg.d) * double(R + cfg.n);
  if (work <= kFullCheckWork)
    expect_full(c, routing, host_plan, in, a);
  else
    expect_sampled(c, routing, in, a);
}

// The rule's words in the message, per refusal.
std::string rule_of(const FuzzCase& c) {
  const LayerConfig& cfg = c.cfg;
  switch (c.reject) {
    case Reject::d_grid:
      return "d (" + std::to_string(cfg.d) + ") must be a multiple of 64 for the CUDA backend";
    case Reject::n_grid:
      return "n (" + std::to_string(cfg.n) + ") must be a multiple of 64 for the CUDA backend";
    case Reject::fp32: return "dtype fp32: the CUDA backend stores bf16";
    case Reject::fp8_grid:
      return cfg.d % 128 != 0
                 ? "compute fp8 on the GPU: d (" + std::to_string(cfg.d) +
                       ") must be a multiple of 128"
                 : "compute fp8 on the GPU: n (" + std::to_string(cfg.n) +
                       ") must be a multiple of 128";
    case Reject::oai_experts:
      return "runs on its own warp-specialised kernels only, which take E <= 4096 experts (got " +
             std::to_string(cfg.E) + ")";
    case Reject::misaligned_x: return "x: the CUDA backend needs 16-byte aligned data";
    case Reject::none: break;
  }
  return "";
}

void check_refused(const FuzzCase& c) {
  const LayerConfig& cfg = c.cfg;
  const HostRouting routing = random_routing(c.spec, c.seed + 1);
  const RoutingPlan dev_plan = device_plan(make_plan(routing));
  LayerTensors t(cfg, dev_plan.S());
  t.randomize(c.seed + 3);
  const DevTensor x(t.x, c.reject == Reject::misaligned_x ? 2 : 0), w1(t.w1), w2(t.w2);
  DevTensor out(t.out);
  out.mem.poison();
  const std::string rule = rule_of(c);
  SavedForBackward saved;
  LayerOptions opts;
  opts.mode = c.mode;
  try {
    layer_forward(cfg, dev_plan, x.v, w1.v, w2.v, out.v, saved, opts);
    ADD_FAILURE() << "accepted; expected Unsupported: " << rule;
  } catch (const Unsupported& e) {
    EXPECT_NE(std::string(e.what()).find(rule), std::string::npos)
        << "'" << e.what() << "' does not state '" << rule << "'";
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected Unsupported (" << rule << "), got: " << e.what();
  }
  EXPECT_FALSE(saved.valid());
  for (uint8_t v : out.mem.download<uint8_t>()) ASSERT_EQ(v, 0xFF) << "out was written";
}

TEST(GpuFuzz, RandomShapesMatchTheReferenceAndRefusalsNameTheRule) {
  MOEBLAZE_REQUIRE_GPU();
  const int64_t cases = std::max<int64_t>(1, env_int("MOEBLAZE_GPU_FUZZ_CASES", 100));
  const uint64_t seed0 = first_seed();
  std::printf("[gpu fuzz] %lld cases from seed %" PRIu64 "\n", (long long)cases, seed0);
  int64_t valid = 0, refused = 0, sampled = 0, fp8 = 0, failed = 0;
  for (int64_t i = 0; i < cases; ++i) {
    const FuzzCase c = draw_case(seed0 + uint64_t(i));
    SCOPED_TRACE(c.describe());
    const int before = ::testing::UnitTest::GetInstance()->current_test_info()->result()->total_part_count();
    if (c.reject == Reject::none) {
      check_valid(c);
      ++valid;
      fp8 += is_fp8(c.cfg.compute);
      const int64_t S = c.cfg.T * c.cfg.K;
      sampled += double(S) * double(c.cfg.d) * double(c.cfg.w1_rows() + c.cfg.n) > kFullCheckWork;
    } else {
      check_refused(c);
      ++refused;
    }
    if (::testing::UnitTest::GetInstance()->current_test_info()->result()->total_part_count() > before) {
      ++failed;
      std::printf("[gpu fuzz] FAILED %s\n", c.describe().c_str());
    }
  }
  std::printf("[gpu fuzz] %lld valid (%lld fp8, about %lld checked on a sample), %lld refused, "
              "%lld failed\n",
              (long long)valid, (long long)fp8, (long long)sampled, (long long)refused,
              (long long)failed);
}

}  // namespace
}  // namespace moeblaze::test
