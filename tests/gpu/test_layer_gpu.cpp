// The MoE layer on the GPU (src/cuda/layer/, src/baselines/materialized_cuda.cu) against the
// CPU backend and a float64 reference, on a subsampled grid of shapes, activations, modes and
// routings (uneven, empty experts, token-rounded CSR plans with S != T*K). Also: aggregation,
// bitwise determinism, kept-for-backward and peak bytes, and inputs the GPU path rejects.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "common/plan_fixtures.hpp"
#include "common/test_util.hpp"
#include "core/parallel.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/gemm/dispatch/kernel_config.hpp"
#include "cuda/layer/layer_cuda.hpp"
#include "cuda/layer/step_marks.hpp"
#include "cuda/layer/token_chunks.hpp"
#include "gpu/gpu_test_util.hpp"
#include "moeblaze/moeblaze.hpp"
#include "reference/reference_layer.hpp"

namespace moeblaze::test {
namespace {

// ---- routings ---------------------------------------------------------------------------------

enum class RouteKind { balanced, skewed, rounded };
const char* route_name(RouteKind k) {
  return k == RouteKind::balanced ? "balanced" : k == RouteKind::skewed ? "skewed" : "rounded";
}

struct HostRouting {
  int64_t T = 0, E = 0;
  std::vector<int32_t> offsets, experts;
  std::vector<float> weights;
  RoutingView view() const {
    RoutingView v;
    v.T = T;
    v.E = E;
    v.P = int64_t(experts.size());
    v.pair_offsets = offsets.data();
    v.pair_experts = experts.data();
    v.pair_weights = weights.data();
    v.device = Device::cpu;
    return v;
  }
};

// balanced: K distinct uniform experts per token. skewed: 20 % of the experts draw 80 % of the
// picks and every 4th expert (from the cold ones) is never picked (empty experts). rounded: a
// general CSR as token rounding leaves it: 0 .. K+2 pairs per token (some tokens lose all),
// experts ascending within a token, so S != T*K.
HostRouting make_routing(int64_t T, int64_t E, int64_t K, RouteKind kind, uint64_t seed) {
  std::mt19937_64 rng(seed);
  HostRouting r;
  r.T = T;
  r.E = E;
  std::vector<double> prob(E, 1.0);
  if (kind == RouteKind::skewed) {
    const int64_t hot = std::max<int64_t>(1, E / 5);
    for (int64_t e = 0; e < E; ++e) prob[e] = e < hot ? 0.8 / hot : 0.2 / std::max<int64_t>(1, E - hot);
    int64_t allowed = E;
    for (int64_t e = hot; e < E; e += 4)
      if (allowed > K) { prob[e] = 0.0; --allowed; }
  }
  std::uniform_real_distribution<float> wdist(0.05f, 1.0f);
  r.offsets.push_back(0);
  for (int64_t t = 0; t < T; ++t) {
    int64_t count = K;
    if (kind == RouteKind::rounded)
      count = std::uniform_int_distribution<int64_t>(0, std::min<int64_t>(E, K + 2))(rng);
    std::vector<double> p = prob;
    std::vector<int32_t> picked;
    for (int64_t k = 0; k < count; ++k) {
      std::discrete_distribution<int> pick(p.begin(), p.end());
      const int e = pick(rng);
      picked.push_back(e);
      p[e] = 0.0;  // distinct experts within a token
    }
    if (kind == RouteKind::rounded) std::sort(picked.begin(), picked.end());
    for (int32_t e : picked) {
      r.experts.push_back(e);
      r.weights.push_back(wdist(rng));
    }
    r.offsets.push_back(int32_t(r.experts.size()));
  }
  return r;
}

// Host plan (CPU builder) and its copy on the device.
struct Plans {
  RoutingPlan host, dev;
};
void copy_array(void* dst, const void* src, size_t bytes) {
  if (bytes) MOEBLAZE_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}
void make_plans(const HostRouting& r, Plans& p) {
  build_routing_plan(r.view(), PlanBuilder::atomic_free, p.host);
  const int64_t T = p.host.T(), E = p.host.E(), S = p.host.S();
  p.dev = RoutingPlan(Device::cuda, T, E, S);
  copy_array(p.dev.expert_token_offsets(), p.host.expert_token_offsets(), 4 * (E + 1));
  copy_array(p.dev.expert_token_indices(), p.host.expert_token_indices(), 4 * S);
  copy_array(p.dev.slot_weights(), p.host.slot_weights(), 4 * S);
  copy_array(p.dev.token_pair_offsets(), p.host.token_pair_offsets(), 4 * (T + 1));
  copy_array(p.dev.token_expert_indices(), p.host.token_expert_indices(), 4 * S);
  copy_array(p.dev.token_index_map(), p.host.token_index_map(), 4 * S);
}

// ---- float64 reference ------------------------------------------------------------------------

struct Ref {
  std::vector<double> out, dx, dw1, dw2, dpw;
  // (P,) sum_j |da'_j a_j|: the scale of each d pair weight's own rounding error. A d pair
  // weight is one dot product that can cancel (T = 1, K = 1: a single scalar), so it is measured
  // against this scale, not against its own value (as the CPU tests do).
  std::vector<double> dpw_abs;
};

// Straight from docs/DESIGN.md's math, per slot, in double, on the bf16 input values.
Ref reference(const LayerConfig& c, const RoutingPlan& plan, const std::vector<bf16>& x,
              const std::vector<bf16>& w1, const std::vector<bf16>& w2,
              const std::vector<bf16>& dout) {
  const int64_t T = c.T, d = c.d, n = c.n, E = c.E, R = c.w1_rows(), S = plan.S();
  const bool gated = is_gated(c.activation);
  const int32_t* off = plan.view().expert_token_offsets;
  const int32_t* tok = plan.view().expert_token_indices;
  const float* sw = plan.view().slot_weights;
  std::vector<int32_t> expert(S);
  for (int64_t e = 0; e < E; ++e)
    for (int32_t r = off[e]; r < off[e + 1]; ++r) expert[r] = int32_t(e);
  std::vector<double> y(S * d), dxs(S * d), as(S * n), dh(S * R), ds(S), ds_abs(S);
  parallel_for(0, S, 16, [&](int64_t r) {
    const int64_t e = expert[r], t = tok[r];
    const double s = sw[r];
    std::vector<double> h(R), a(n), dap(n);
    for (int64_t j = 0; j < R; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < d; ++k) acc += double(float(w1[(e * R + j) * d + k])) * double(float(x[t * d + k]));
      h[j] = acc;
    }
    for (int64_t j = 0; j < n; ++j)
      a[j] = gated ? reference::activation_f(c.activation, h[j]) *
                         reference::activation_up(c.activation, h[n + j])
                   : reference::activation_f(c.activation, h[j]);
    for (int64_t i = 0; i < d; ++i) {
      double acc = 0;
      for (int64_t j = 0; j < n; ++j) acc += double(float(w2[(e * d + i) * n + j])) * a[j];
      y[r * d + i] = acc;
    }
    std::fill(dap.begin(), dap.end(), 0.0);
    for (int64_t i = 0; i < d; ++i) {
      const double g = float(dout[t * d + i]);
      for (int64_t j = 0; j < n; ++j) dap[j] += double(float(w2[(e * d + i) * n + j])) * g;
    }
    double dsum = 0, dabs = 0;
    for (int64_t j = 0; j < n; ++j) {
      dsum += dap[j] * a[j];
      dabs += std::fabs(dap[j] * a[j]);
      as[r * n + j] = s * a[j];
      const double da = s * dap[j];
      if (gated) {
        dh[r * R + j] = da * reference::activation_up(c.activation, h[n + j]) *
                        reference::activation_df(c.activation, h[j]);
        dh[r * R + n + j] = da * reference::activation_f(c.activation, h[j]) *
                            reference::activation_dup(c.activation, h[n + j]);
      } else {
        dh[r * R + j] = da * reference::activation_df(c.activation, h[j]);
      }
    }
    ds[r] = dsum;
    ds_abs[r] = dabs;
    for (int64_t i = 0; i < d; ++i) {
      double acc = 0;
      for (int64_t j = 0; j < R; ++j) acc += dh[r * R + j] * double(float(w1[(e * R + j) * d + i]));
      dxs[r * d + i] = acc;
    }
  });
  Ref ref;
  ref.out.assign(T * d, 0.0);
  ref.dx.assign(T * d, 0.0);
  ref.dpw.assign(S, 0.0);
  ref.dpw_abs.assign(S, 0.0);
  const int32_t* tpo = plan.view().token_pair_offsets;
  const int32_t* tim = plan.view().token_index_map;
  for (int64_t t = 0; t < T; ++t)
    for (int32_t p = tpo[t]; p < tpo[t + 1]; ++p) {
      const int64_t r = tim[p];
      ref.dpw[p] = ds[r];
      ref.dpw_abs[p] = ds_abs[r];
      for (int64_t i = 0; i < d; ++i) {
        ref.out[t * d + i] += sw[r] * y[r * d + i];
        ref.dx[t * d + i] += dxs[r * d + i];
      }
    }
  ref.dw2.assign(E * d * n, 0.0);
  ref.dw1.assign(E * R * d, 0.0);
  parallel_for(0, E * d, 8, [&](int64_t ei) {
    const int64_t e = ei / d, i = ei % d;
    for (int32_t r = off[e]; r < off[e + 1]; ++r) {
      const double g = float(dout[int64_t(tok[r]) * d + i]);
      for (int64_t j = 0; j < n; ++j) ref.dw2[ei * n + j] += g * as[r * n + j];
    }
  });
  parallel_for(0, E * R, 8, [&](int64_t ek) {
    const int64_t e = ek / R, k = ek % R;
    for (int32_t r = off[e]; r < off[e + 1]; ++r) {
      const double g = dh[r * R + k];
      for (int64_t i = 0; i < d; ++i) ref.dw1[ek * d + i] += g * double(float(x[int64_t(tok[r]) * d + i]));
    }
  });
  return ref;
}

// ---- one GPU (and CPU backend) run of a case --------------------------------------------------

struct Case {
  int64_t T, d, n, E, K;
  Activation act;
  LayerMode mode;
  RouteKind route;
};
std::string describe(const Case& c) {
  return "T=" + std::to_string(c.T) + " d=" + std::to_string(c.d) + " n=" + std::to_string(c.n) +
         " E=" + std::to_string(c.E) + " K=" + std::to_string(c.K) + " " +
         activation_name(c.act) + " " + layer_mode_name(c.mode) + " " + route_name(c.route);
}

struct Inputs {
  LayerConfig cfg;
  HostRouting routing;
  Plans plans;
  std::vector<bf16> x, w1, w2, dout;
};
Inputs make_inputs(const Case& c, uint64_t seed) {
  Inputs in;
  in.cfg.T = c.T;
  in.cfg.d = c.d;
  in.cfg.n = c.n;
  in.cfg.E = c.E;
  in.cfg.K = c.K;
  in.cfg.activation = c.act;
  in.cfg.dtype = DType::bf16;
  in.routing = make_routing(c.T, c.E, c.K, c.route, seed);
  make_plans(in.routing, in.plans);
  const int64_t R = in.cfg.w1_rows();
  // Weights scaled by 1/sqrt(fan-in) so every intermediate stays O(1).
  in.x = to_bf16(random_normal(c.T * c.d, seed + 1));
  in.w1 = to_bf16(random_normal(c.E * R * c.d, seed + 2, float(1.0 / std::sqrt(double(c.d)))));
  in.w2 = to_bf16(random_normal(c.E * c.d * c.n, seed + 3, float(1.0 / std::sqrt(double(c.n)))));
  in.dout = to_bf16(random_normal(c.T * c.d, seed + 4));
  return in;
}

struct GpuResult {
  std::vector<bf16> out, dx, dw1, dw2;
  std::vector<float> dpw;
  size_t kept_bytes = 0;       // bytes still held on the device after forward (SavedForBackward)
  size_t saved_bytes = 0;      // saved.bytes()
  size_t fwd_peak = 0, bwd_peak = 0;
};

// Runs fn on a new thread that has made no CUDA call yet (so no context is current on it), and
// rethrows what it threw.
template <class Fn>
void on_fresh_thread(Fn fn) {
  std::exception_ptr err;
  std::thread t([&] {
    try {
      fn();
    } catch (...) {
      err = std::current_exception();
    }
  });
  t.join();
  if (err) std::rethrow_exception(err);
}

// The device plan's arrays borrowed without token_expert_indices (null), as a caller that frees
// it after forward hands them to backward.
RoutingPlan without_token_experts(const RoutingPlan& p) {
  const RoutingPlanView v = p.view();
  const auto m = [](const int32_t* a) { return const_cast<int32_t*>(a); };
  return RoutingPlan::borrow(Device::cuda, v.T, v.E, v.S, m(v.expert_token_offsets),
                             m(v.expert_token_indices), const_cast<float*>(v.slot_weights),
                             m(v.token_pair_offsets), nullptr, m(v.token_index_map));
}

// fresh_threads: forward and backward each run on a new thread with caller-given H and
// workspaces, so that the library's own calls are the thread's first CUDA calls (PyTorch's
// autograd thread calls backward like that). drop_tei: backward gets the plan without
// token_expert_indices. graph: the step captured in a CUDA graph (caller memory), replayed.
GpuResult run_gpu(const Inputs& in, LayerMode mode, bool dh_over_h = false,
                  bool fresh_threads = false, bool drop_tei = false, bool graph = false) {
  const LayerConfig& c = in.cfg;
  const RoutingPlan no_tei = without_token_experts(in.plans.dev);
  const RoutingPlan& bwd_plan = drop_tei ? no_tei : in.plans.dev;
  const int64_t S = in.plans.dev.S(), R = c.w1_rows();
  DevMem x(in.x.size() * 2), w1(in.w1.size() * 2), w2(in.w2.size() * 2), dout(in.dout.size() * 2);
  x.upload(in.x);
  w1.upload(in.w1);
  w2.upload(in.w2);
  dout.upload(in.dout);
  DevMem out(c.T * c.d * 2), dx(c.T * c.d * 2), dw1(c.E * R * c.d * 2), dw2(c.E * c.d * c.n * 2),
      dpw(S * 4);
  out.poison();
  dx.poison();
  dw1.poison();
  dw2.poison();
  dpw.poison();
  const TensorView xv(x.p, DType::bf16, Device::cuda, {c.T, c.d});
  const TensorView w1v(w1.p, DType::bf16, Device::cuda, {c.E, R, c.d});
  const TensorView w2v(w2.p, DType::bf16, Device::cuda, {c.E, c.d, c.n});
  const TensorView outv(out.p, DType::bf16, Device::cuda, {c.T, c.d});
  const TensorView doutv(dout.p, DType::bf16, Device::cuda, {c.T, c.d});
  LayerGrads g;
  g.dx = TensorView(dx.p, DType::bf16, Device::cuda, {c.T, c.d});
  g.dw1 = TensorView(dw1.p, DType::bf16, Device::cuda, {c.E, R, c.d});
  g.dw2 = TensorView(dw2.p, DType::bf16, Device::cuda, {c.E, c.d, c.n});
  g.d_pair_weights = TensorView(dpw.p, DType::f32, Device::cuda, {S});
  LayerOptions opts;
  opts.mode = mode;
  opts.dh_over_h = dh_over_h;

  GpuResult res;
  SavedForBackward saved;
  if (graph) {
    // On caller memory, captured in a CUDA graph on a non-blocking stream, replayed twice
    // (forward writes H again before each backward writes dH over it).
    const size_t fwd_ws = layer_workspace_bytes(c, S, mode, Device::cuda, LayerPass::forward, false);
    const size_t bwd_ws =
        layer_workspace_bytes(c, S, mode, Device::cuda, LayerPass::backward, dh_over_h);
    DevMem h(mode == LayerMode::keep_h ? size_t(S * R) * 2 : 0), fws(fwd_ws), bws(bwd_ws);
    cudaStream_t s = nullptr;
    MOEBLAZE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    LayerOptions f = opts, b = opts;
    f.stream = b.stream = s;
    f.workspace = fws.p, f.workspace_bytes = fwd_ws, f.h_storage = h.p;
    b.workspace = bws.p, b.workspace_bytes = bwd_ws;
    cudaGraph_t cg = nullptr;
    MOEBLAZE_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    layer_forward(c, in.plans.dev, xv, w1v, w2v, outv, saved, f);
    layer_backward(c, bwd_plan, xv, w1v, w2v, doutv, saved, g, b);
    MOEBLAZE_CUDA_CHECK(cudaStreamEndCapture(s, &cg));
    cudaGraphExec_t exec = nullptr;
    MOEBLAZE_CUDA_CHECK(cudaGraphInstantiate(&exec, cg, 0));
    for (int replay = 0; replay < 2; ++replay) MOEBLAZE_CUDA_CHECK(cudaGraphLaunch(exec, s));
    MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(s));
    MOEBLAZE_CUDA_CHECK(cudaGraphExecDestroy(exec));
    MOEBLAZE_CUDA_CHECK(cudaGraphDestroy(cg));
    MOEBLAZE_CUDA_CHECK(cudaStreamDestroy(s));
  } else if (fresh_threads) {
    const size_t fwd_ws = layer_workspace_bytes(c, S, mode, Device::cuda, LayerPass::forward, false);
    const size_t bwd_ws =
        layer_workspace_bytes(c, S, mode, Device::cuda, LayerPass::backward, dh_over_h);
    DevMem h(mode == LayerMode::keep_h ? size_t(S * R) * 2 : 0), fws(fwd_ws), bws(bwd_ws);
    MOEBLAZE_CUDA_CHECK(cudaDeviceSynchronize());
    LayerOptions f = opts, b = opts;
    f.workspace = fws.p, f.workspace_bytes = fwd_ws, f.h_storage = h.p;
    b.workspace = bws.p, b.workspace_bytes = bwd_ws;
    on_fresh_thread([&] { layer_forward(c, in.plans.dev, xv, w1v, w2v, outv, saved, f); });
    MOEBLAZE_CUDA_CHECK(cudaDeviceSynchronize());
    on_fresh_thread([&] { layer_backward(c, bwd_plan, xv, w1v, w2v, doutv, saved, g, b); });
    MOEBLAZE_CUDA_CHECK(cudaDeviceSynchronize());
  } else {
    const size_t before = memory_stats(Device::cuda).current;
    {
      PeakScope peak(Device::cuda);
      layer_forward(c, in.plans.dev, xv, w1v, w2v, outv, saved, opts);
      MOEBLAZE_CUDA_CHECK(cudaDeviceSynchronize());
      res.fwd_peak = peak.peak_above_start();
    }
    res.kept_bytes = memory_stats(Device::cuda).current - before;
    res.saved_bytes = saved.bytes();
    {
      PeakScope peak(Device::cuda);
      layer_backward(c, bwd_plan, xv, w1v, w2v, doutv, saved, g, opts);
      MOEBLAZE_CUDA_CHECK(cudaDeviceSynchronize());
      res.bwd_peak = peak.peak_above_start();
    }
  }
  res.out = out.download<bf16>();
  res.dx = dx.download<bf16>();
  res.dw1 = dw1.download<bf16>();
  res.dw2 = dw2.download<bf16>();
  res.dpw = dpw.download<float>();
  return res;
}

struct CpuResult {
  std::vector<bf16> out, dx, dw1, dw2;
  std::vector<float> dpw;
};
CpuResult run_cpu(const Inputs& in, LayerMode mode) {
  const LayerConfig& c = in.cfg;
  const int64_t S = in.plans.host.S(), R = c.w1_rows();
  CpuResult r;
  r.out.resize(c.T * c.d);
  r.dx.resize(c.T * c.d);
  r.dw1.resize(c.E * R * c.d);
  r.dw2.resize(c.E * c.d * c.n);
  r.dpw.resize(S);
  LayerGrads g;
  g.dx = host_view(r.dx.data(), {c.T, c.d});
  g.dw1 = host_view(r.dw1.data(), {c.E, R, c.d});
  g.dw2 = host_view(r.dw2.data(), {c.E, c.d, c.n});
  g.d_pair_weights = host_view(r.dpw.data(), {S});
  LayerOptions opts;
  opts.mode = mode;
  SavedForBackward saved;
  layer_forward(c, in.plans.host, host_view(in.x.data(), {c.T, c.d}),
                host_view(in.w1.data(), {c.E, R, c.d}), host_view(in.w2.data(), {c.E, c.d, c.n}),
                host_view(r.out.data(), {c.T, c.d}), saved, opts);
  layer_backward(c, in.plans.host, host_view(in.x.data(), {c.T, c.d}),
                 host_view(in.w1.data(), {c.E, R, c.d}), host_view(in.w2.data(), {c.E, c.d, c.n}),
                 host_view(in.dout.data(), {c.T, c.d}), saved, g, opts);
  return r;
}

template <typename A>
double rel_err_vs(const std::vector<A>& a, const std::vector<double>& ref) {
  EXPECT_EQ(a.size(), ref.size());
  return rel_frobenius(a.data(), ref.data(), std::min(a.size(), ref.size()));
}
template <typename A, typename B>
double rel_err_vs_cpu(const std::vector<A>& a, const std::vector<B>& b) {
  std::vector<double> ref(b.size());
  for (size_t i = 0; i < b.size(); ++i) ref[i] = double(float(b[i]));
  return rel_err_vs(a, ref);
}

// ||a - b||_F / ||scale||_F: the d pair weights' error against their dot products' error scale.
template <typename A, typename B>
double scaled_err(const std::vector<A>& a, const std::vector<B>& b, const std::vector<double>& scale) {
  EXPECT_EQ(a.size(), b.size());
  EXPECT_EQ(a.size(), scale.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < std::min({a.size(), b.size(), scale.size()}); ++i) {
    const double x = double(float(a[i])), r = double(b[i]);
    if (std::isnan(x)) return INFINITY;
    num += (x - r) * (x - r);
    den += scale[i] * scale[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

template <typename T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// The kernel overrides a test sets, cleared when it ends (passed or failed).
struct ClearOverridesAtExit {
  ~ClearOverridesAtExit() { cuda::gemm::clear_kernel_overrides(); }
};

// ---- the grid ---------------------------------------------------------------------------------

class LayerGpuGrid : public ::testing::TestWithParam<Case> {};

// Every output of two runs, bit for bit (GpuResult, or BiasedResult's unbiased outputs).
template <class Result>
void expect_same_bits(const Result& a, const Result& b) {
  EXPECT_TRUE(bitwise_equal(a.out, b.out)) << "out";
  EXPECT_TRUE(bitwise_equal(a.dx, b.dx)) << "dx";
  EXPECT_TRUE(bitwise_equal(a.dw1, b.dw1)) << "dw1";
  EXPECT_TRUE(bitwise_equal(a.dw2, b.dw2)) << "dw2";
  EXPECT_TRUE(bitwise_equal(a.dpw, b.dpw)) << "d_pair_weights";
}

TEST_P(LayerGpuGrid, MatchesCpuBackendAndFloat64Reference) {
  MOEBLAZE_REQUIRE_GPU();
  const Case c = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " " + describe(c));
  const Inputs in = make_inputs(c, seed);
  const int64_t S = in.plans.dev.S();
  const GpuResult gpu = run_gpu(in, c.mode);
  const Ref ref = reference(in.cfg, in.plans.host, in.x, in.w1, in.w2, in.dout);
  const double tol = rel_tolerance(DType::bf16);
  EXPECT_LE(rel_err_vs(gpu.out, ref.out), tol) << "out";
  EXPECT_LE(rel_err_vs(gpu.dx, ref.dx), tol) << "dx";
  EXPECT_LE(rel_err_vs(gpu.dw1, ref.dw1), tol) << "dw1";
  EXPECT_LE(rel_err_vs(gpu.dw2, ref.dw2), tol) << "dw2";
  EXPECT_LE(scaled_err(gpu.dpw, ref.dpw, ref.dpw_abs), tol) << "d_pair_weights";

  // The CPU backend stores the same bf16 intermediates: the two backends agree at least as
  // closely as each agrees with float64.
  const CpuResult cpu = run_cpu(in, c.mode);
  EXPECT_LE(rel_err_vs_cpu(gpu.out, cpu.out), tol) << "out vs CPU backend";
  EXPECT_LE(rel_err_vs_cpu(gpu.dx, cpu.dx), tol) << "dx vs CPU backend";
  EXPECT_LE(rel_err_vs_cpu(gpu.dw1, cpu.dw1), tol) << "dw1 vs CPU backend";
  EXPECT_LE(rel_err_vs_cpu(gpu.dw2, cpu.dw2), tol) << "dw2 vs CPU backend";
  EXPECT_LE(scaled_err(gpu.dpw, cpu.dpw, ref.dpw_abs), tol) << "d_pair_weights vs CPU backend";

  // Memory: keep_h keeps exactly H (S, w1_rows) bf16; recompute keeps nothing but the plan
  // (which the caller owns). The forward's transients are A and Y; backward's its workspace.
  const LayerConfig& cfg = in.cfg;
  const size_t h_bytes = size_t(S * cfg.w1_rows()) * 2;
  const size_t expect_saved = c.mode == LayerMode::keep_h ? h_bytes : 0;
  EXPECT_EQ(gpu.saved_bytes, expect_saved);
  EXPECT_EQ(gpu.kept_bytes, expect_saved) << "forward left other device memory behind";
  // + the TMA GEMM path's scratch (argument arrays and TMA descriptors, ~70 KiB) where the layer
  // takes that path (gemm::layer_gemm_scratch_bytes; 0 for small S / E).
  const size_t scratch = (cuda::gemm::layer_gemm_scratch_bytes(S, cfg.E) + 255) / 256 * 256;
  const double fwd_bound =
      1.05 * double(h_bytes + size_t(S * cfg.n) * 2 + size_t(S * cfg.d) * 2 + in.plans.dev.bytes()) +
      double(scratch);
  EXPECT_LE(double(gpu.fwd_peak), fwd_bound) << "forward peak";
  // Backward bound: dH (S, w1_rows) (over the recomputed H in recompute mode) + the larger of
  // {A' (S, n), ds partials and ds (fp32)} and dX̃ (S, d), whose bytes they share (not their
  // sum), each piece rounded up to 256 bytes.
  // A', ds, dX̃ and the TMA scratch take no workspace where dw1's bytes hold them
  // (backward_dw1_reuse).
  const cuda::Dw1Reuse reuse = cuda::backward_dw1_reuse(
      cfg, S, cuda::gemm::ds_partials_cols(cfg.n), cuda::layer_chunks(cfg, S, c.mode).backward);
  const size_t ds_bytes = size_t(S) * 4 * ((cfg.n + 127) / 128 + 1);
  const size_t shared =
      reuse.shared ? 0 : std::max(size_t(S * cfg.n) * 2 + ds_bytes, size_t(S * cfg.d) * 2);
  const size_t bwd_scratch = reuse.scratch ? 0 : scratch;
  const size_t dx_order = size_t(S) * 4;  // each token's slots ascending (the dx sum's order)
  EXPECT_LE(gpu.bwd_peak, h_bytes + shared + 7 * 256 + bwd_scratch + dx_order) << "backward peak";
  EXPECT_LE(gpu.bwd_peak, layer_workspace_bytes(cfg, S, c.mode, Device::cuda));
}

// A subsample of T ∈ {1, 7, 1000, 8192} × d, n ∈ {128, 256, 768, 1536} × E ∈ {1, 8, 64, 128} ×
// K ∈ {1, 2, 8}, with every activation, both modes and all three routings appearing.
INSTANTIATE_TEST_SUITE_P(
    Grid, LayerGpuGrid,
    ::testing::Values(
        Case{1, 128, 128, 1, 1, Activation::swiglu, LayerMode::keep_h, RouteKind::balanced},
        Case{7, 256, 128, 8, 2, Activation::geglu, LayerMode::recompute, RouteKind::balanced},
        Case{1000, 768, 256, 64, 8, Activation::swiglu, LayerMode::keep_h, RouteKind::skewed},
        Case{1000, 128, 1536, 8, 2, Activation::relu, LayerMode::keep_h, RouteKind::skewed},
        Case{1000, 256, 256, 64, 2, Activation::silu, LayerMode::recompute, RouteKind::rounded},
        Case{1000, 1536, 768, 8, 1, Activation::gelu, LayerMode::keep_h, RouteKind::balanced},
        Case{1000, 256, 128, 128, 8, Activation::relu2, LayerMode::keep_h, RouteKind::rounded},
        Case{8192, 128, 128, 128, 8, Activation::swiglu, LayerMode::keep_h, RouteKind::skewed},
        Case{8192, 256, 256, 8, 2, Activation::swiglu, LayerMode::recompute, RouteKind::rounded},
        Case{1000, 256, 192, 8, 2, Activation::swiglu_oai, LayerMode::keep_h, RouteKind::skewed},
        Case{1000, 512, 256, 16, 4, Activation::swiglu_oai, LayerMode::recompute,
             RouteKind::balanced}),
    [](const ::testing::TestParamInfo<Case>& info) {
      const Case& c = info.param;
      std::string act = activation_name(c.act);
      std::replace(act.begin(), act.end(), '-', '_');  // gtest names: letters, digits, '_' only
      return std::string(route_name(c.route)) + "_T" + std::to_string(c.T) + "_d" +
             std::to_string(c.d) + "_n" + std::to_string(c.n) + "_E" + std::to_string(c.E) +
             "_K" + std::to_string(c.K) + "_" + act +
             (c.mode == LayerMode::recompute ? "_recompute" : "");
    });

// ---- determinism, materialized baseline, naive GEMM cross-check -------------------------------

// The stream-ordered pool keeps freed memory cached on EVERY visible device: with a flag once per
// process, every GPU but the first paid a cudaMalloc per layer call (found by bench ep on 2 H200s).
TEST(LayerGpu, MemoryPoolKeptCachedOnEveryDevice) {
  MOEBLAZE_REQUIRE_GPU();
  int count = 0, current = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
  for (int dev = 0; dev < count; ++dev) {
    ASSERT_EQ(cudaSetDevice(dev), cudaSuccess);
    { Buffer b(Device::cuda, 1024, nullptr); }  // the first moeblaze allocation on `dev`
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    cudaMemPool_t pool;
    ASSERT_EQ(cudaDeviceGetDefaultMemPool(&pool, dev), cudaSuccess);
    uint64_t threshold = 0;
    ASSERT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold),
              cudaSuccess);
    EXPECT_EQ(threshold, UINT64_MAX) << "device " << dev << " of " << count;
  }
  ASSERT_EQ(cudaSetDevice(current), cudaSuccess);
}

TEST(LayerGpu, BitwiseDeterministicAcrossRuns) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (LayerMode mode : {LayerMode::keep_h, LayerMode::recompute, LayerMode::materialized}) {
    SCOPED_TRACE(layer_mode_name(mode));
    const Inputs in = make_inputs({2048, 256, 512, 16, 4, Activation::swiglu, mode, RouteKind::skewed}, seed);
    const GpuResult a = run_gpu(in, mode);
    const GpuResult b = run_gpu(in, mode);
    expect_same_bits(a, b);
  }
}

// A thread whose first CUDA calls are the library's (PyTorch's autograd thread with
// caller-given workspaces) gets the same bits as the calling thread: there backward's first CUDA
// call can be a TMA descriptor encode, which needs the context the library binds itself.
TEST(LayerGpu, FreshThreadWithCallerMemoryGivesTheSameBits) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const int64_t d : {512, 2048, 4096})  // each dH kernel (see the next test)
  for (const bool dh_over_h : {false, true}) {
    SCOPED_TRACE("d " + std::to_string(d) + (dh_over_h ? " dH over H" : " dH in the workspace"));
    const Inputs in = make_inputs({256, d, 256, 16, 4, Activation::swiglu, LayerMode::keep_h,
                                   RouteKind::skewed}, seed);
    const GpuResult a = run_gpu(in, LayerMode::keep_h, dh_over_h);
    const GpuResult b = run_gpu(in, LayerMode::keep_h, dh_over_h, true);
    expect_same_bits(a, b);
  }
}

// A CUDA backward never reads token_expert_indices: without it (null) both modes give the same
// bits, on the TMA path (S >= 128 E, its scratch in dw1's bytes) and below it, with or without
// token chunks; the materialized baseline and opts.check_plan, which read it, refuse it by name.
TEST(LayerGpu, BackwardWithoutTokenExpertIndicesGivesTheSameBits) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const int64_t T : {96, 2048})
  for (LayerMode mode : {LayerMode::keep_h, LayerMode::recompute}) {
    SCOPED_TRACE("T " + std::to_string(T) + " " + layer_mode_name(mode));
    const Inputs in = make_inputs({T, 256, 128, 8, 2, Activation::swiglu, mode,
                                   RouteKind::skewed}, seed);
    expect_same_bits(run_gpu(in, mode), run_gpu(in, mode, false, false, true));
  }
  const Inputs in = make_inputs({64, 128, 128, 4, 2, Activation::swiglu, LayerMode::keep_h,
                                 RouteKind::balanced}, seed);
  const RoutingPlan no_tei = without_token_experts(in.plans.dev);
  const LayerConfig& c = in.cfg;
  DevMem x(c.T * c.d * 2), w1(c.E * c.w1_rows() * c.d * 2), w2(c.E * c.d * c.n * 2),
      out(c.T * c.d * 2);
  const TensorView xv(x.p, DType::bf16, Device::cuda, {c.T, c.d});
  const TensorView w1v(w1.p, DType::bf16, Device::cuda, {c.E, c.w1_rows(), c.d});
  const TensorView w2v(w2.p, DType::bf16, Device::cuda, {c.E, c.d, c.n});
  const TensorView outv(out.p, DType::bf16, Device::cuda, {c.T, c.d});
  SavedForBackward saved;
  LayerOptions materialized, checked;
  materialized.mode = LayerMode::materialized;
  checked.check_plan = true;
  test::expect_invalid(
      [&] { layer_backward(c, no_tei, xv, w1v, w2v, outv, saved, {}, materialized); },
      "plan.token_expert_indices has no data (null pointer): the materialized");
  test::expect_invalid([&] { layer_backward(c, no_tei, xv, w1v, w2v, outv, saved, {}, checked); },
                       "plan.token_expert_indices has no data (null pointer): opts.check_plan");
  SavedForBackward fwd;
  test::expect_invalid([&] { layer_forward(c, no_tei, xv, w1v, w2v, outv, fwd, {}); },
                       "plan.token_expert_indices has no data (null pointer)");
}

// The dw1 placement rule and the region's bytes, on the host (no GPU needed): where the region
// fits (olmoe's and sm-default's dX̃ is exactly dw1's size; recompute's chunk at olmoe and
// sm-30B-n512) and where it does not (sm-7B-n256: dX̃ 3x dw1; its recompute chunk by E rows).
TEST(LayerGpu, Dw1ReuseRuleAndRegionBytes) {
  const cuda::Dw1Reuse a = cuda::dw1_reuse_rule(512, 0, 512);
  EXPECT_TRUE(a.shared && !a.scratch);
  const cuda::Dw1Reuse b = cuda::dw1_reuse_rule(512, 100, 1024);
  EXPECT_TRUE(b.shared && b.scratch && b.scratch_at == 512);
  const cuda::Dw1Reuse c = cuda::dw1_reuse_rule(512, 300, 1024);  // 512 + 256 + 300 > 1024
  EXPECT_TRUE(c.shared && !c.scratch);
  const cuda::Dw1Reuse d = cuda::dw1_reuse_rule(2048, 100, 1024);
  EXPECT_TRUE(!d.shared && !d.order && d.scratch && d.scratch_at == 0);
  // dx_order goes to dw1's start only where the region does not, the scratch after it.
  const cuda::Dw1Reuse e = cuda::dw1_reuse_rule(2048, 100, 1024, 256);
  EXPECT_TRUE(!e.shared && e.order && e.scratch && e.scratch_at == 256);
  const cuda::Dw1Reuse f = cuda::dw1_reuse_rule(512, 100, 1024, 256);
  EXPECT_TRUE(f.shared && !f.order && f.scratch && f.scratch_at == 512);
  const cuda::Dw1Reuse g = cuda::dw1_reuse_rule(2048, 100, 512, 256);  // 256 + 256 + 100 > 512
  EXPECT_TRUE(!g.shared && g.order && !g.scratch);
  const cuda::Dw1Reuse h = cuda::dw1_reuse_rule(2048, 0, 128, 256);
  EXPECT_TRUE(!h.shared && !h.order && !h.scratch);
  struct Named {
    const char* name;
    int64_t T, d, n, E, K;
    LayerMode mode;
    bool fits;
  };
  for (const Named& x : {Named{"olmoe", 16384, 2048, 1024, 64, 8, LayerMode::keep_h, true},
                         Named{"olmoe", 16384, 2048, 1024, 64, 8, LayerMode::recompute, true},
                         Named{"sm-default", 32768, 4096, 1024, 128, 8, LayerMode::keep_h, true},
                         Named{"sm-30B-n512", 32768, 4096, 512, 128, 8, LayerMode::keep_h, false},
                         Named{"sm-30B-n512", 32768, 4096, 512, 128, 8, LayerMode::recompute,
                               true},
                         Named{"sm-7B-n256", 24576, 1536, 256, 128, 8, LayerMode::keep_h, false},
                         Named{"sm-7B-n256", 24576, 1536, 256, 128, 8, LayerMode::recompute,
                               false},
                         Named{"sm-7B-n1024", 24576, 1536, 1024, 32, 2, LayerMode::keep_h,
                               true}}) {
    SCOPED_TRACE(std::string(x.name) + " " + layer_mode_name(x.mode));
    LayerConfig cfg;
    cfg.T = x.T, cfg.d = x.d, cfg.n = x.n, cfg.E = x.E, cfg.K = x.K;
    cfg.activation = Activation::swiglu;
    cfg.dtype = DType::bf16;
    const int64_t S = x.T * x.K;
    const int64_t cols = cuda::gemm::ds_partials_cols(x.n);
    const cuda::TokenChunks chunks = cuda::layer_chunks(cfg, S, x.mode).backward;
    const auto r256 = [](int64_t b) { return size_t((b + 255) / 256 * 256); };
    const size_t region = std::max(r256(S * x.n * 2) + r256(S * cols * 4) + r256(S * 4),
                                   r256(chunks.rows * x.d * 2));
    const size_t shared = cuda::backward_shared_bytes(cfg, S, cols, chunks);
    EXPECT_EQ(shared, region);
    const size_t dw1 = size_t(x.E * 2 * x.n * x.d) * 2;
    EXPECT_EQ(cuda::dw1_reuse_rule(shared, 0, dw1).shared, x.fits) << shared << " vs " << dw1;
    // Where the region does not fit, dx_order (S int32) does: S·4 bytes off the peak.
    EXPECT_EQ(cuda::dw1_reuse_rule(shared, 0, dw1, r256(S * 4)).order, !x.fits);
  }
}

// A carved backward workspace whose region goes to dw1 refuses a null dw1 (its A', ds partials
// and ds would be null: `bench layer --breakdown` once passed none and dH failed on a null
// pointer); counting bytes (no base) needs no dw1. Host only: the carve touches no memory.
TEST(LayerGpu, BackwardWorkspaceWithTheRegionInDw1NeedsDw1) {
  LayerConfig cfg;
  cfg.T = 1024, cfg.d = 512, cfg.n = 128, cfg.E = 8, cfg.K = 2;  // S = 2 n E: the region fits
  cfg.activation = Activation::swiglu;
  cfg.dtype = DType::bf16;
  const int64_t S = cfg.T * cfg.K;
  const int64_t cols = cuda::gemm::ds_partials_cols(cfg.n);
  const cuda::TokenChunks chunks = cuda::layer_chunks(cfg, S, LayerMode::keep_h).backward;
  ASSERT_TRUE(cuda::backward_dw1_reuse(cfg, S, cols, chunks).shared);
  const size_t bytes =
      cuda::backward_workspace(cfg, S, LayerMode::keep_h, cols, chunks, nullptr).bytes;
  std::vector<unsigned char> ws(bytes + 256), dw1(size_t(cfg.E * 2 * cfg.n * cfg.d) * 2 + 256);
  test::expect_invalid([&] {
    (void)cuda::backward_workspace(cfg, S, LayerMode::keep_h, cols, chunks, ws.data());
  }, "backward_workspace: dw1 must not be null when the ds region is placed in it");
  const cuda::BackwardWorkspace w = cuda::backward_workspace(cfg, S, LayerMode::keep_h, cols,
                                                             chunks, ws.data(), false, dw1.data());
  EXPECT_NE(w.ds_partials, nullptr);
  EXPECT_NE(w.a_scaled, nullptr);
  EXPECT_NE(w.ds, nullptr);
}

// A', ds, dX̃ (or dx_order where they do not fit) and the TMA scratch in dw1's bytes
// (backward_dw1_reuse) give the bits of the same pieces in the workspace, in both modes, with and
// without token chunks, and backward's workspace shrinks by their bytes.
TEST(LayerGpu, BackwardPiecesInDw1GiveTheWorkspacesBits) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  struct Restore {
    ~Restore() { cuda::set_backward_dw1_reuse(true); }  // the library's default
  } restore;
  // (T, d, n, E, K): on the TMA path with dX̃ exactly dw1's size (S = 2 n E), the scratch then in
  // the workspace; the region too large for dw1 (S > 2 n E: both runs alike); the ws kernel
  // (896 rows an expert: no scratch); 8 token chunks in recompute with the region in dw1 (keep_h:
  // too large).
  for (const auto& [T, d, n, E, K] : {std::array<int64_t, 5>{1024, 512, 128, 8, 2},
                                      std::array<int64_t, 5>{4096, 256, 128, 8, 4},
                                      std::array<int64_t, 5>{3584, 256, 448, 8, 2},
                                      std::array<int64_t, 5>{15360, 4096, 512, 4, 2}})
  for (LayerMode mode : {LayerMode::keep_h, LayerMode::recompute}) {
    SCOPED_TRACE("T " + std::to_string(T) + " d " + std::to_string(d) + " n " +
                 std::to_string(n) + " E " + std::to_string(E) + " K " + std::to_string(K) +
                 " " + layer_mode_name(mode));
    const Inputs in = make_inputs({T, d, n, E, K, Activation::swiglu, mode, RouteKind::skewed},
                                  seed);
    const int64_t S = in.plans.dev.S();
    cuda::set_backward_dw1_reuse(true);
    const cuda::Dw1Reuse reuse = cuda::backward_dw1_reuse(
        in.cfg, S, cuda::gemm::ds_partials_cols(n), cuda::layer_chunks(in.cfg, S, mode).backward);
    const size_t with = layer_workspace_bytes(in.cfg, S, mode, Device::cuda, LayerPass::backward);
    const GpuResult a = run_gpu(in, mode);
    cuda::set_backward_dw1_reuse(false);
    const size_t without =
        layer_workspace_bytes(in.cfg, S, mode, Device::cuda, LayerPass::backward);
    const GpuResult b = run_gpu(in, mode);
    expect_same_bits(a, b);
    // Workspace accounting: with the region in dw1 its bytes leave the workspace, else dx_order's
    // do; the scratch is in dw1 wherever it fits (after either, or from dw1's start without).
    const cuda::TokenChunks chunks = cuda::layer_chunks(in.cfg, S, mode).backward;
    const size_t region = cuda::backward_shared_bytes(in.cfg, S, cuda::gemm::ds_partials_cols(n),
                                                      chunks);
    const size_t scratch_raw = cuda::gemm::layer_gemm_scratch_bytes(S, E);
    const size_t scratch = (scratch_raw + 255) / 256 * 256;
    const bool scratch_off = cuda::dw1_reuse_rule(SIZE_MAX, scratch_raw,
                                                  size_t(E * 2 * n * d) * 2).scratch;
    if (reuse.shared)
      EXPECT_EQ(without + (reuse.scratch ? 0 : scratch), with + region + (scratch_off ? 0 : scratch))
          << "the region left the workspace";
    else  // dx_order alone left the workspace (for dw1's first bytes)
      EXPECT_EQ(with + (reuse.order ? (size_t(S) * 4 + 255) / 256 * 256 : 0), without);
    EXPECT_EQ(reuse.order, !reuse.shared) << "dx_order goes to dw1 wherever the region does not";
    if (T == 1024) EXPECT_TRUE(reuse.shared && !reuse.scratch) << "S = 2 n E: dX̃ fills dw1";
    if (T == 15360 && mode == LayerMode::recompute)
      EXPECT_TRUE(reuse.shared && cuda::layer_chunks(in.cfg, S, mode).backward.count == 8);
  }
}

// dH written over the saved H (LayerOptions::dh_over_h) must give the same bits as dH in the
// workspace, on each dH kernel (2-CTA below d = 2048, ping-pong at 2048, cooperative at 4096) and
// on the naive oracle, and backward must need S * w1_rows * 2 fewer bytes.
TEST(LayerGpu, DhOverSavedHIsBitwiseEqualAndSmaller) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const int64_t d : {512, 2048, 4096}) {
    for (const cuda::GemmImpl impl : {cuda::GemmImpl::sm90, cuda::GemmImpl::naive}) {
      if (impl == cuda::GemmImpl::naive && d > 512) continue;  // the oracle is slow
      SCOPED_TRACE("d " + std::to_string(d) + (impl == cuda::GemmImpl::naive ? " naive" : " sm90"));
      const Inputs in = make_inputs({700, d, 192, 8, 2, Activation::swiglu, LayerMode::keep_h,
                                     RouteKind::skewed}, seed);
      cuda::set_gemm_impl(impl);
      const GpuResult a = run_gpu(in, LayerMode::keep_h, false);
      const GpuResult b = run_gpu(in, LayerMode::keep_h, true);
      cuda::set_gemm_impl(cuda::GemmImpl::sm90);
      expect_same_bits(a, b);  // forward is the same code either way: out too
      const size_t h_bytes = size_t(in.plans.dev.S() * in.cfg.w1_rows()) * 2;
      EXPECT_LE(b.bwd_peak + h_bytes, a.bwd_peak + 256) << "backward peak with dH over H";
      EXPECT_EQ(layer_workspace_bytes(in.cfg, in.plans.dev.S(), LayerMode::keep_h, Device::cuda,
                                      LayerPass::backward, true) + h_bytes,
                layer_workspace_bytes(in.cfg, in.plans.dev.S(), LayerMode::keep_h, Device::cuda,
                                      LayerPass::backward, false));
    }
  }
}

// Token chunks of Y and dX̃ (cuda/layer/token_chunks.hpp) give the whole step's bits, for any
// chunk count, in both modes, on balanced, skewed (empty experts) and rounded (0 .. K+2 pairs
// per token) plans, with smaller forward and backward workspaces.
TEST(LayerGpu, TokenChunksGiveTheWholeStepsBits) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const ClearOverridesAtExit restore;
  for (const RouteKind route : {RouteKind::balanced, RouteKind::skewed, RouteKind::rounded})
    for (const LayerMode mode : {LayerMode::keep_h, LayerMode::recompute}) {
      // S >= 128 E: down_proj and dx_proj on the TMA path (forced: the rule puts fewer than
      // 1024 rows per expert on the ws kernel, tried below), both take row ranges.
      const Inputs in = make_inputs({1500, 512, 128, 8, 3, Activation::swiglu, mode, route}, seed);
      const int64_t S = in.plans.dev.S();
      SCOPED_TRACE(std::string(route_name(route)) + " " + layer_mode_name(mode) + " S " +
                   std::to_string(S));
      const std::string tma = "down.family=tma,dx.family=tma,";
      cuda::gemm::set_kernel_overrides(cuda::gemm::parse_kernel_overrides(tma + "chunks=1"));
      ASSERT_EQ(cuda::layer_chunks(in.cfg, S, mode).backward.count, 1);
      const size_t whole_fwd = layer_workspace_bytes(in.cfg, S, mode, Device::cuda,
                                                     LayerPass::forward, false);
      const size_t whole_bwd = layer_workspace_bytes(in.cfg, S, mode, Device::cuda,
                                                     LayerPass::backward, false);
      const GpuResult whole = run_gpu(in, mode);
      for (const int count : {2, 3, 7, 16}) {
        SCOPED_TRACE("chunks " + std::to_string(count));
        cuda::gemm::set_kernel_overrides(
            cuda::gemm::parse_kernel_overrides(tma + "chunks=" + std::to_string(count)));
        const cuda::LayerChunks ch = cuda::layer_chunks(in.cfg, S, mode);
        ASSERT_EQ(ch.forward.count, count) << cuda::describe(ch.forward);
        ASSERT_EQ(ch.backward.count, count) << cuda::describe(ch.backward);
        expect_same_bits(whole, run_gpu(in, mode));
        expect_same_bits(whole, run_gpu(in, mode, false, /*fresh_threads=*/true));
        // The TMA GEMMs on single-CTA clusters: the same tiles, so the same bits.
        cuda::gemm::set_kernel_overrides(cuda::gemm::parse_kernel_overrides(
            tma + "chunks=" + std::to_string(count) + ",down.cluster=1,dx.cluster=1"));
        expect_same_bits(whole, run_gpu(in, mode));
        // The same GEMMs on the warp-specialised kernel (A by TMA, any row range), both
        // schedules: each gives its own whole step's bits in chunks.
        if (count == 2 || count == 7)
          for (const char* ws : {"down.family=ws,dx.family=ws",
                                 "down.family=ws,dx.family=ws,down.schedule=pingpong,"
                                 "dx.schedule=pingpong"}) {
            SCOPED_TRACE(ws);
            cuda::gemm::set_kernel_overrides(
                cuda::gemm::parse_kernel_overrides(std::string(ws) + ",chunks=1"));
            const GpuResult whole_ws = run_gpu(in, mode);
            cuda::gemm::set_kernel_overrides(cuda::gemm::parse_kernel_overrides(
                std::string(ws) + ",chunks=" + std::to_string(count)));
            ASSERT_EQ(cuda::layer_chunks(in.cfg, S, mode).backward.count, count);
            expect_same_bits(whole_ws, run_gpu(in, mode));
          }
        cuda::gemm::set_kernel_overrides(
            cuda::gemm::parse_kernel_overrides(tma + "chunks=" + std::to_string(count)));
        EXPECT_LT(layer_workspace_bytes(in.cfg, S, mode, Device::cuda, LayerPass::forward, false),
                  whole_fwd);
        EXPECT_LT(layer_workspace_bytes(in.cfg, S, mode, Device::cuda, LayerPass::backward, false),
                  whole_bwd);
      }
    }
}

// The step marks (cuda/layer/step_marks.hpp) that `bench layer --steps / --search` times each
// step by: with a recorder installed the layer names every step once, in pipeline order (a
// chunked GEMM and its aggregation once per token chunk; recompute's second up-projection before
// dH), and the step's bits are those of an unmarked call; uninstalled, nothing is called.
TEST(LayerGpu, StepMarksNameEveryStepInOrderAndChangeNoBits) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const ClearOverridesAtExit restore;
  struct Names final : cuda::StepMarks {
    std::vector<std::string> seen;
    void mark(cudaStream_t, const char* step) override { seen.push_back(step); }
  };
  namespace st = cuda::step;
  for (const LayerMode mode : {LayerMode::keep_h, LayerMode::recompute})
    for (const int chunks : {1, 3}) {
      SCOPED_TRACE(std::string(layer_mode_name(mode)) + " chunks " + std::to_string(chunks));
      // S >= 128 E: down_proj and dx_proj on the TMA path, which takes token chunks.
      const Inputs in = make_inputs({1500, 512, 128, 8, 3, Activation::swiglu, mode,
                                     RouteKind::skewed}, seed);
      cuda::gemm::set_kernel_overrides(cuda::gemm::parse_kernel_overrides(
          "down.family=tma,dx.family=tma,chunks=" + std::to_string(chunks)));
      const GpuResult plain = run_gpu(in, mode);
      Names names;
      cuda::set_step_marks(&names);
      const GpuResult marked = run_gpu(in, mode);
      cuda::set_step_marks(nullptr);
      expect_same_bits(plain, marked);
      std::vector<std::string> want = {st::kUpProj};
      for (int c = 0; c < chunks; ++c) want.insert(want.end(), {st::kDownProj, st::kAggregate});
      if (mode == LayerMode::recompute) want.push_back(st::kUpProjAgain);
      want.insert(want.end(), {st::kDh, st::kDsReduce, st::kDw2, st::kPairGrads});
      for (int c = 0; c < chunks; ++c) want.insert(want.end(), {st::kDx, st::kDxAggregate});
      want.push_back(st::kDw1);
      EXPECT_EQ(names.seen, want);
      const size_t seen = names.seen.size();
      run_gpu(in, mode);  // uninstalled: not called
      EXPECT_EQ(names.seen.size(), seen);
    }
}

// Programmatic dependent launch (src/cuda/pdl.cuh, override pdl=1): every kernel it launches
// waits for the one before it before touching memory, so the step's bits are those of plain
// launches, run after run (a missed wait shows as a flaky difference here), with the aggregation
// in token chunks, with the TMA GEMMs (launched plainly) between its kernels, with dW1 on 2-CTA
// clusters, in recompute's expert ranges, and captured in a CUDA graph.
TEST(LayerGpu, ProgrammaticDependentLaunchGivesTheSameBits) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const ClearOverridesAtExit restore;
  struct Shape {
    Case c;
    const char* kernels;  // overrides besides pdl
  };
  const Shape shapes[] = {
      // 562 rows per expert: down and dx on the ws kernel; three token chunks.
      {{1500, 512, 128, 8, 3, Activation::swiglu, LayerMode::keep_h, RouteKind::skewed},
       "chunks=3"},
      // down and dx on the TMA path between PDL kernels; dW1 on 2-CTA clusters.
      {{4096, 256, 128, 4, 2, Activation::swiglu, LayerMode::keep_h, RouteKind::balanced},
       "down.family=tma,dx.family=tma,dw1.cluster=2"},
      {{1500, 512, 128, 8, 3, Activation::geglu, LayerMode::recompute, RouteKind::rounded},
       "ranges=3"},
      {{700, 256, 192, 6, 2, Activation::relu, LayerMode::keep_h, RouteKind::skewed}, ""},
  };
  for (const Shape& sh : shapes) {
    const Inputs in = make_inputs(sh.c, seed);
    SCOPED_TRACE(describe(sh.c) + " " + sh.kernels);
    const std::string base = sh.kernels;
    const auto with = [&](const char* pdl) {
      cuda::gemm::set_kernel_overrides(
          cuda::gemm::parse_kernel_overrides(base + (base.empty() ? "" : ",") + pdl));
    };
    with("pdl=0");
    ASSERT_FALSE(cuda::gemm::pdl_launches());
    const GpuResult plain = run_gpu(in, sh.c.mode);
    const GpuResult plain_dh = run_gpu(in, sh.c.mode, /*dh_over_h=*/true);
    with("pdl=1");
    ASSERT_TRUE(cuda::gemm::pdl_launches());
    for (int run = 0; run < 3; ++run) {
      SCOPED_TRACE("run " + std::to_string(run));
      expect_same_bits(plain, run_gpu(in, sh.c.mode));
      expect_same_bits(plain_dh, run_gpu(in, sh.c.mode, /*dh_over_h=*/true));
    }
    if (sh.c.mode == LayerMode::keep_h)  // (recompute's ranges refuse a capture by name)
      expect_same_bits(plain_dh, run_gpu(in, sh.c.mode, true, false, false, /*graph=*/true));
  }
  cuda::gemm::clear_kernel_overrides();
  EXPECT_EQ(cuda::gemm::pdl_launches(), cuda::gemm::kPdlDefault);
}

// The chunk maps against the host's reading of the same definition, bit for bit: bounds, per-
// expert ranges, packed bases and every pair's row (below the chunk buffer's rows).
TEST(LayerGpu, TokenChunkMapsMatchTheirDefinition) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const RouteKind route : {RouteKind::balanced, RouteKind::skewed, RouteKind::rounded})
    for (const int64_t count : {2, 5, 64}) {
      SCOPED_TRACE(std::string(route_name(route)) + " chunks " + std::to_string(count));
      const HostRouting r = make_routing(900, 12, 3, route, seed + count);
      Plans p;
      make_plans(r, p);
      const int64_t T = p.host.T(), E = p.host.E(), S = p.host.S(), C = count;
      const cuda::TokenChunks ch{C, (S + C - 1) / C + E, "test"};
      DevMem bounds(4 * (C + 1)), lo(4 * (C + 1) * E), base(4 * C * E), rows(4 * S);
      cuda::build_chunk_maps(p.dev.view(), ch,
                             {bounds.as<int32_t>(), lo.as<int32_t>(), base.as<int32_t>(),
                              rows.as<int32_t>()},
                             nullptr);
      MOEBLAZE_CUDA_CHECK(cudaDeviceSynchronize());
      const int32_t* po = p.host.token_pair_offsets();
      const int32_t* off = p.host.expert_token_offsets();
      const int32_t* tok = p.host.expert_token_indices();
      const int32_t* tim = p.host.token_index_map();
      const int64_t B = (S + C - 1) / C;
      std::vector<int32_t> t_c(C + 1), lo_h((C + 1) * E), base_h(C * E), rows_h(S);
      for (int64_t c = 0; c <= C; ++c) {
        int64_t t = 0;
        while (t < T && po[t] < c * B) ++t;
        t_c[c] = int32_t(c == C ? T : t);
        for (int64_t e = 0; e < E; ++e) {
          int64_t s = off[e];
          while (s < off[e + 1] && tok[s] < t_c[c]) ++s;
          lo_h[c * E + e] = int32_t(s);
        }
      }
      for (int64_t c = 0; c < C; ++c) {
        int32_t sum = 0;
        for (int64_t e = 0; e < E; ++e) {
          base_h[c * E + e] = sum;
          sum += lo_h[(c + 1) * E + e] - lo_h[c * E + e];
        }
        EXPECT_LT(sum, ch.rows) << "chunk " << c << " overflows its buffer";
      }
      for (int64_t t = 0; t < T; ++t) {
        int64_t c = 0;
        while (t_c[c + 1] <= t) ++c;
        for (int64_t q = po[t]; q < po[t + 1]; ++q) {
          const int64_t slot = tim[q];
          int64_t e = 0;
          while (off[e + 1] <= slot) ++e;
          rows_h[q] = int32_t(base_h[c * E + e] + slot - lo_h[c * E + e]);
          ASSERT_LT(rows_h[q], ch.rows);
        }
      }
      EXPECT_EQ(bounds.download<int32_t>(), t_c);
      EXPECT_EQ(lo.download<int32_t>(), lo_h);
      EXPECT_EQ(base.download<int32_t>(), base_h);
      EXPECT_EQ(rows.download<int32_t>(), rows_h);
    }
}

TEST(LayerGpu, MaterializedBaselineMatchesReferenceAndKeepsItsTensors) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (Activation act : {Activation::swiglu, Activation::gelu}) {
    SCOPED_TRACE(activation_name(act));
    const Inputs in = make_inputs({1000, 256, 384, 16, 4, act, LayerMode::materialized, RouteKind::rounded}, seed);
    const GpuResult gpu = run_gpu(in, LayerMode::materialized);
    const Ref ref = reference(in.cfg, in.plans.host, in.x, in.w1, in.w2, in.dout);
    const double tol = rel_tolerance(DType::bf16);
    EXPECT_LE(rel_err_vs(gpu.out, ref.out), tol) << "out";
    EXPECT_LE(rel_err_vs(gpu.dx, ref.dx), tol) << "dx";
    EXPECT_LE(rel_err_vs(gpu.dw1, ref.dw1), tol) << "dw1";
    EXPECT_LE(rel_err_vs(gpu.dw2, ref.dw2), tol) << "dw2";
    EXPECT_LE(scaled_err(gpu.dpw, ref.dpw, ref.dpw_abs), tol) << "d_pair_weights";
    const int64_t S = in.plans.dev.S();
    const LayerConfig& c = in.cfg;
    const size_t expect = 2 * size_t(S) *
                          (c.d + c.w1_rows() + (is_gated(act) ? c.n : 0) + c.n + c.d);
    EXPECT_EQ(gpu.saved_bytes, expect) << "Xs, H, act(g), A, Y";
    EXPECT_EQ(gpu.kept_bytes, expect);
  }
}

TEST(LayerGpu, Sm90GemmsAgreeWithNaiveOracle) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Inputs in = make_inputs({3000, 512, 256, 32, 4, Activation::swiglu, LayerMode::keep_h, RouteKind::skewed}, seed);
  cuda::set_gemm_impl(cuda::GemmImpl::naive);
  const GpuResult naive = run_gpu(in, LayerMode::keep_h);
  cuda::set_gemm_impl(cuda::GemmImpl::sm90);
  const GpuResult fast = run_gpu(in, LayerMode::keep_h);
  const double tol = rel_tolerance(DType::bf16);
  EXPECT_LE(rel_err_vs_cpu(fast.out, naive.out), tol) << "out";
  EXPECT_LE(rel_err_vs_cpu(fast.dx, naive.dx), tol) << "dx";
  EXPECT_LE(rel_err_vs_cpu(fast.dw1, naive.dw1), tol) << "dw1";
  EXPECT_LE(rel_err_vs_cpu(fast.dw2, naive.dw2), tol) << "dw2";
  EXPECT_LE(rel_err_vs_cpu(fast.dpw, naive.dpw), tol) << "d_pair_weights";
}

TEST(LayerGpu, EmptyTokensAndEmptyPlan) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  // T = 0: nothing to do, nothing kept.
  {
    const Inputs in = make_inputs({0, 128, 128, 4, 2, Activation::swiglu, LayerMode::keep_h, RouteKind::balanced}, seed);
    const GpuResult r = run_gpu(in, LayerMode::keep_h);
    EXPECT_EQ(r.saved_bytes, 0u);
    EXPECT_TRUE(r.out.empty());
  }
  // T > 0 but every token dropped (S = 0): out, dx and the weight gradients are zeros.
  {
    Inputs in = make_inputs({5, 128, 128, 4, 2, Activation::swiglu, LayerMode::keep_h, RouteKind::balanced}, seed);
    HostRouting empty;
    empty.T = 5;
    empty.E = 4;
    empty.offsets.assign(6, 0);
    in.routing = empty;
    in.plans = Plans();
    make_plans(in.routing, in.plans);
    const GpuResult r = run_gpu(in, LayerMode::keep_h);
    for (const auto* v : {&r.out, &r.dx, &r.dw1, &r.dw2})
      for (bf16 b : *v) ASSERT_EQ(b.bits, 0u);
  }
}

// ---- aggregation ------------------------------------------------------------------------------

TEST(LayerGpu, AggregateRowsMatchesHostInFixedOrder) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  // K = 1, 4, 8: the three vector layouts (S <= 2T, 2T < S <= 6T, S > 6T; aggregate.cu).
  for (int64_t K : {int64_t(1), int64_t(4), int64_t(8)})
  for (DType dt : {DType::bf16, DType::f32}) {
    for (int64_t d : {int64_t(512), int64_t(100), int64_t(37)}) {  // vector and scalar paths
      for (bool weighted : {true, false}) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + " d=" + std::to_string(d) + " K=" +
                     std::to_string(K) + (weighted ? " weighted" : " unweighted"));
        Inputs in;
        in.routing = make_routing(300, 16, K, RouteKind::rounded, seed);
        make_plans(in.routing, in.plans);
        const int64_t S = in.plans.host.S(), T = 300;
        const std::vector<float> rows = random_normal(S * d, seed + 7);
        const size_t es = dtype_size(dt);
        std::vector<uint8_t> raw(S * d * es);
        for (int64_t i = 0; i < S * d; ++i) {
          if (dt == DType::bf16) reinterpret_cast<bf16*>(raw.data())[i] = bf16(rows[i]);
          else reinterpret_cast<float*>(raw.data())[i] = rows[i];
        }
        DevMem drows(raw.size()), dout(T * d * es);
        drows.upload(raw);
        dout.poison();
        const RoutingPlanView pv = in.plans.dev.view();
        cuda::aggregate_rows(pv, drows.p, weighted ? pv.slot_weights : nullptr, dout.p, d, dt, nullptr);
        const std::vector<uint8_t> got = dout.download<uint8_t>();
        // Host: the same fp32 order (pairs in order, fma for the weighted sum).
        const RoutingPlanView hv = in.plans.host.view();
        std::vector<double> ref(T * d);
        double max_ulp_err = 0;
        for (int64_t t = 0; t < T; ++t)
          for (int64_t i = 0; i < d; ++i) {
            float acc = 0;
            for (int32_t p = hv.token_pair_offsets[t]; p < hv.token_pair_offsets[t + 1]; ++p) {
              const int64_t r = hv.token_index_map[p];
              const float v = dt == DType::bf16 ? float(reinterpret_cast<const bf16*>(raw.data())[r * d + i])
                                                : reinterpret_cast<const float*>(raw.data())[r * d + i];
              acc = weighted ? std::fma(hv.slot_weights[r], v, acc) : acc + v;
            }
            const float g = dt == DType::bf16 ? float(reinterpret_cast<const bf16*>(got.data())[t * d + i])
                                              : reinterpret_cast<const float*>(got.data())[t * d + i];
            const float want = dt == DType::bf16 ? round_to_bf16(acc) : acc;
            ASSERT_FALSE(std::isnan(g)) << "unwritten element t=" << t << " i=" << i;
            max_ulp_err = std::max(max_ulp_err, double(std::fabs(g - want)));
          }
        EXPECT_EQ(max_ulp_err, 0.0) << "GPU and host summed in a different order";
      }
    }
  }
}

TEST(LayerGpu, DPairWeightsGatherIsExact) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Plans plans;
  make_plans(make_routing(500, 32, 4, RouteKind::rounded, seed), plans);
  const int64_t S = plans.host.S();
  const std::vector<float> ds = random_normal(S, seed + 1);
  DevMem dds(S * 4), dpw(S * 4);
  dds.upload(ds);
  dpw.poison();
  cuda::gather_pair_grads(plans.dev.view(), static_cast<const float*>(dds.p), static_cast<float*>(dpw.p), nullptr);
  const std::vector<float> got = dpw.download<float>();
  for (int64_t p = 0; p < S; ++p)
    ASSERT_EQ(got[p], ds[plans.host.view().token_index_map[p]]) << "pair " << p;
}

// ---- inputs the GPU path rejects --------------------------------------------------------------

TEST(LayerGpu, RejectsWhatTheGpuPathCannotTakeAndLeavesOutputsUntouched) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  struct Bad {
    int64_t d, n;
    DType dtype;
    const char* expect;
    Activation act = Activation::swiglu;
    int64_t E = 4;
  };
  for (const Bad& b : {Bad{100, 128, DType::bf16, "d (100)"}, Bad{128, 96, DType::bf16, "n (96)"},
                       Bad{128, 128, DType::f32, "dtype fp32: the CUDA backend stores bf16"},
                       Bad{128, 128, DType::bf16,
                           "swiglu-oai runs on its own warp-specialised kernels only, which take "
                           "E <= 4096 experts (got 5000)",
                           Activation::swiglu_oai, 5000}}) {
    SCOPED_TRACE(b.expect);
    LayerConfig c;
    c.T = 16;
    c.d = b.d;
    c.n = b.n;
    c.E = b.E;
    c.K = 2;
    c.dtype = b.dtype;
    c.activation = b.act;
    Plans plans;
    make_plans(make_routing(c.T, c.E, c.K, RouteKind::balanced, seed), plans);
    const size_t es = dtype_size(b.dtype);
    DevMem x(c.T * c.d * es), w1(c.E * c.w1_rows() * c.d * es), w2(c.E * c.d * c.n * es),
        out(c.T * c.d * es);
    x.upload(random_normal(c.T * c.d * es / 4, seed));
    out.poison();
    SavedForBackward saved;
    LayerOptions opts;
    try {
      layer_forward(c, plans.dev, TensorView(x.p, b.dtype, Device::cuda, {c.T, c.d}),
                    TensorView(w1.p, b.dtype, Device::cuda, {c.E, c.w1_rows(), c.d}),
                    TensorView(w2.p, b.dtype, Device::cuda, {c.E, c.d, c.n}),
                    TensorView(out.p, b.dtype, Device::cuda, {c.T, c.d}), saved, opts);
      ADD_FAILURE() << "no error thrown";
    } catch (const Unsupported& e) {
      EXPECT_NE(std::string(e.what()).find(b.expect), std::string::npos) << e.what();
    }
    EXPECT_FALSE(saved.valid());
    for (uint8_t v : out.download<uint8_t>()) ASSERT_EQ(v, 0xFF) << "out was written";
  }
}

// ---- expert biases ------------------------------------------------------------------------------

// The outputs of one biased step (db1 / db2 empty where that bias is absent).
struct BiasedResult {
  std::vector<bf16> out, dx, dw1, dw2, db1, db2;
  std::vector<float> dpw;
};
// which: 1 = b1, 2 = b2, 3 = both. The GPU run when `gpu`, else the CPU backend (the reference
// tests/cpu/test_layer_bias.cpp checks against float64).
BiasedResult run_biased(const Inputs& in, LayerMode mode, int which, const std::vector<bf16>& b1h,
                        const std::vector<bf16>& b2h, bool gpu) {
  const LayerConfig& c = in.cfg;
  const int64_t S = in.plans.dev.S(), R = c.w1_rows();
  BiasedResult r;
  r.out.resize(c.T * c.d);
  r.dx.resize(c.T * c.d);
  r.dw1.resize(c.E * R * c.d);
  r.dw2.resize(c.E * c.d * c.n);
  r.dpw.resize(S);
  if (which & 1) r.db1.resize(c.E * R);
  if (which & 2) r.db2.resize(c.E * c.d);
  LayerOptions opts;
  opts.mode = mode;
  SavedForBackward saved;
  if (!gpu) {
    const LayerBiases b{(which & 1) ? host_view(b1h.data(), {c.E, R}) : TensorView(),
                        (which & 2) ? host_view(b2h.data(), {c.E, c.d}) : TensorView()};
    LayerGrads g;
    g.dx = host_view(r.dx.data(), {c.T, c.d});
    g.dw1 = host_view(r.dw1.data(), {c.E, R, c.d});
    g.dw2 = host_view(r.dw2.data(), {c.E, c.d, c.n});
    g.d_pair_weights = host_view(r.dpw.data(), {S});
    if (which & 1) g.db1 = host_view(r.db1.data(), {c.E, R});
    if (which & 2) g.db2 = host_view(r.db2.data(), {c.E, c.d});
    const TensorView x = host_view(in.x.data(), {c.T, c.d}),
                     w1 = host_view(in.w1.data(), {c.E, R, c.d}),
                     w2 = host_view(in.w2.data(), {c.E, c.d, c.n});
    layer_forward(c, in.plans.host, x, w1, w2, b, host_view(r.out.data(), {c.T, c.d}), saved,
                  opts);
    layer_backward(c, in.plans.host, x, w1, w2, b, host_view(in.dout.data(), {c.T, c.d}), saved,
                   g, opts);
    return r;
  }
  DevMem x(in.x), w1(in.w1), w2(in.w2), dout(in.dout), b1(b1h), b2(b2h);
  DevMem out(r.out.size() * 2), dx(r.dx.size() * 2), dw1(r.dw1.size() * 2),
      dw2(r.dw2.size() * 2), dpw(S * 4), db1(r.db1.size() * 2), db2(r.db2.size() * 2);
  for (DevMem* m : {&out, &dx, &dw1, &dw2, &dpw, &db1, &db2}) m->poison();
  const auto v = [](const DevMem& m, DType dt, std::initializer_list<int64_t> dims) {
    return TensorView(m.p, dt, Device::cuda, dims);
  };
  const LayerBiases b{(which & 1) ? v(b1, DType::bf16, {c.E, R}) : TensorView(),
                      (which & 2) ? v(b2, DType::bf16, {c.E, c.d}) : TensorView()};
  LayerGrads g{v(dx, DType::bf16, {c.T, c.d}), v(dw1, DType::bf16, {c.E, R, c.d}),
               v(dw2, DType::bf16, {c.E, c.d, c.n}), v(dpw, DType::f32, {S})};
  if (which & 1) g.db1 = v(db1, DType::bf16, {c.E, R});
  if (which & 2) g.db2 = v(db2, DType::bf16, {c.E, c.d});
  const TensorView tx = v(x, DType::bf16, {c.T, c.d}), tw1 = v(w1, DType::bf16, {c.E, R, c.d}),
                   tw2 = v(w2, DType::bf16, {c.E, c.d, c.n});
  layer_forward(c, in.plans.dev, tx, tw1, tw2, b, v(out, DType::bf16, {c.T, c.d}), saved, opts);
  layer_backward(c, in.plans.dev, tx, tw1, tw2, b, v(dout, DType::bf16, {c.T, c.d}), saved, g,
                 opts);
  r.out = out.download<bf16>();
  r.dx = dx.download<bf16>();
  r.dw1 = dw1.download<bf16>();
  r.dw2 = dw2.download<bf16>();
  r.dpw = dpw.download<float>();
  if (which & 1) r.db1 = db1.download<bf16>();
  if (which & 2) r.db2 = db2.download<bf16>();
  return r;
}

// Expert biases on the GPU (b1 in the up-projection's epilogue on every up kernel, b2 in the
// aggregation, whole and in token chunks; ds, db1, db2 in backward) against the CPU backend's
// biased step, every output; zero biases give the unbiased step's bits; two runs agree bitwise.
TEST(LayerGpu, ExpertBiasesMatchCpuBackend) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const ClearOverridesAtExit restore;
  struct BiasCase {
    Case c;
    const char* kernels;  // kernel overrides ("" = the rules)
  };
  const BiasCase cases[] = {
      {{1000, 256, 192, 8, 2, Activation::swiglu_oai, LayerMode::keep_h, RouteKind::skewed}, ""},
      {{700, 512, 256, 16, 4, Activation::swiglu_oai, LayerMode::recompute, RouteKind::rounded},
       ""},
      {{1000, 256, 128, 8, 2, Activation::swiglu, LayerMode::keep_h, RouteKind::skewed},
       "up.family=two_cta"},
      {{1000, 256, 256, 8, 2, Activation::swiglu, LayerMode::recompute, RouteKind::balanced},
       "up.family=ws,up.schedule=pingpong"},
      {{1000, 128, 256, 8, 2, Activation::gelu, LayerMode::keep_h, RouteKind::balanced},
       "up.family=ws"},
      {{1500, 512, 128, 8, 3, Activation::swiglu, LayerMode::recompute, RouteKind::rounded},
       "chunks=3"},
      {{1500, 512, 128, 8, 3, Activation::relu2, LayerMode::keep_h, RouteKind::balanced},
       "chunks=2,down.family=ws"},
  };
  const double tol = rel_tolerance(DType::bf16);
  for (const BiasCase& bc : cases) {
    SCOPED_TRACE(describe(bc.c) + " kernels '" + bc.kernels + "'");
    cuda::gemm::set_kernel_overrides(cuda::gemm::parse_kernel_overrides(bc.kernels));
    const Inputs in = make_inputs(bc.c, seed);
    const int64_t R = in.cfg.w1_rows();
    const std::vector<bf16> b1 = to_bf16(random_normal(in.cfg.E * R, seed + 5, 0.5f));
    const std::vector<bf16> b2 = to_bf16(random_normal(in.cfg.E * in.cfg.d, seed + 6, 0.5f));
    for (int which : {1, 2, 3}) {
      SCOPED_TRACE("biases " + std::to_string(which));
      const BiasedResult gpu = run_biased(in, bc.c.mode, which, b1, b2, true);
      const BiasedResult cpu = run_biased(in, bc.c.mode, which, b1, b2, false);
      EXPECT_LE(rel_err_vs_cpu(gpu.out, cpu.out), tol) << "out";
      EXPECT_LE(rel_err_vs_cpu(gpu.dx, cpu.dx), tol) << "dx";
      EXPECT_LE(rel_err_vs_cpu(gpu.dw1, cpu.dw1), tol) << "dw1";
      EXPECT_LE(rel_err_vs_cpu(gpu.dw2, cpu.dw2), tol) << "dw2";
      EXPECT_LE(rel_err_vs_cpu(gpu.dpw, cpu.dpw), tol) << "d_pair_weights";
      if (which & 1) EXPECT_LE(rel_err_vs_cpu(gpu.db1, cpu.db1), tol) << "db1";
      if (which & 2) EXPECT_LE(rel_err_vs_cpu(gpu.db2, cpu.db2), tol) << "db2";
      const BiasedResult again = run_biased(in, bc.c.mode, which, b1, b2, true);
      EXPECT_TRUE(bitwise_equal(gpu.out, again.out) && bitwise_equal(gpu.dx, again.dx) &&
                  bitwise_equal(gpu.dw1, again.dw1) && bitwise_equal(gpu.dw2, again.dw2) &&
                  bitwise_equal(gpu.dpw, again.dpw) && bitwise_equal(gpu.db1, again.db1) &&
                  bitwise_equal(gpu.db2, again.db2))
          << "two runs differ";
    }
    // Zero biases add exact zeros: the unbiased step's bits.
    const std::vector<bf16> z1(in.cfg.E * R, bf16(0.0f)), z2(in.cfg.E * in.cfg.d, bf16(0.0f));
    const BiasedResult zero = run_biased(in, bc.c.mode, 3, z1, z2, true);
    const GpuResult plain = run_gpu(in, bc.c.mode);
    EXPECT_TRUE(bitwise_equal(zero.out, plain.out)) << "out, zero biases";
    EXPECT_TRUE(bitwise_equal(zero.dx, plain.dx)) << "dx, zero biases";
    EXPECT_TRUE(bitwise_equal(zero.dw1, plain.dw1)) << "dw1, zero biases";
    EXPECT_TRUE(bitwise_equal(zero.dw2, plain.dw2)) << "dw2, zero biases";
    EXPECT_TRUE(bitwise_equal(zero.dpw, plain.dpw)) << "d_pair_weights, zero biases";
  }
}

// A bias the CUDA backend cannot take (not 16-byte aligned) is refused naming it, outputs
// untouched; the materialized baseline refuses biases on the GPU as on the CPU.
TEST(LayerGpu, RejectsUnalignedBiasesAndLeavesOutputsUntouched) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  LayerConfig c;
  c.T = 16;
  c.d = 128;
  c.n = 128;
  c.E = 4;
  c.K = 2;
  c.dtype = DType::bf16;
  Plans plans;
  make_plans(make_routing(c.T, c.E, c.K, RouteKind::balanced, seed), plans);
  const int64_t R = c.w1_rows();
  DevMem x(c.T * c.d * 2), w1(c.E * R * c.d * 2), w2(c.E * c.d * c.n * 2), out(c.T * c.d * 2),
      b1(c.E * R * 2 + 16), b2(c.E * c.d * 2 + 16);
  const auto v = [](void* p, std::initializer_list<int64_t> dims) {
    return TensorView(p, DType::bf16, Device::cuda, dims);
  };
  const TensorView tx = v(x.p, {c.T, c.d}), tw1 = v(w1.p, {c.E, R, c.d}),
                   tw2 = v(w2.p, {c.E, c.d, c.n});
  char* b1_odd = static_cast<char*>(b1.p) + 2;  // bf16-aligned, not 16-byte aligned
  char* b2_odd = static_cast<char*>(b2.p) + 2;
  for (const auto& [biases, name] :
       {std::pair<LayerBiases, const char*>{{v(b1_odd, {c.E, R}), {}}, "b1"},
        {{{}, v(b2_odd, {c.E, c.d})}, "b2"}}) {
    SCOPED_TRACE(name);
    out.poison();
    SavedForBackward saved;
    try {
      layer_forward(c, plans.dev, tx, tw1, tw2, biases, v(out.p, {c.T, c.d}), saved, {});
      ADD_FAILURE() << "no error thrown";
    } catch (const Unsupported& e) {
      EXPECT_NE(std::string(e.what()).find(std::string(name) + ": the CUDA backend needs 16-byte"),
                std::string::npos)
          << e.what();
    }
    EXPECT_FALSE(saved.valid());
    for (uint8_t b : out.download<uint8_t>()) ASSERT_EQ(b, 0xFF) << "out was written";
  }
  LayerOptions mat;
  mat.mode = LayerMode::materialized;
  SavedForBackward saved;
  out.poison();
  try {
    layer_forward(c, plans.dev, tx, tw1, tw2, {v(b1.p, {c.E, R}), {}}, v(out.p, {c.T, c.d}),
                  saved, mat);
    ADD_FAILURE() << "no error thrown";
  } catch (const Unsupported& e) {
    EXPECT_NE(std::string(e.what()).find("b1: the materialized baseline takes no expert biases"),
              std::string::npos)
        << e.what();
  }
  for (uint8_t b : out.download<uint8_t>()) ASSERT_EQ(b, 0xFF) << "out was written";
}

// ---- recompute's backward in expert ranges (cuda/layer/expert_ranges.hpp) -------------------

// The split against its definition (host only): whole experts, in order, covering every expert
// and slot; a range closes only before the expert that would take it past the target; an
// expert above the target is a range of its own; one above the capacity is refused by name.
TEST(LayerGpu, ExpertRangeSplitFollowsItsDefinition) {
  std::mt19937 gen{unsigned(fresh_seed())};
  for (int trial = 0; trial < 200; ++trial) {
    const int E = 1 + int(gen() % 40);
    std::vector<int32_t> off(size_t(E) + 1, 0);
    int32_t most = 0;
    for (int e = 0; e < E; ++e) {
      const int32_t count = gen() % 4 == 0 ? 0 : int32_t(gen() % 300);  // empty experts too
      off[size_t(e) + 1] = off[size_t(e)] + count;
      most = std::max(most, count);
    }
    const int64_t S = off.back();
    const int64_t capacity = std::max<int64_t>(most, 1) + int64_t(gen() % 200);
    const int64_t target = 1 + int64_t(gen() % uint32_t(capacity));
    const cuda::ExpertRanges r{true, target, capacity, "test"};
    const std::vector<cuda::ExpertRange> list = cuda::split_expert_ranges(off, r);
    ASSERT_FALSE(list.empty());
    EXPECT_EQ(list.front().e0, 0);
    EXPECT_EQ(list.back().e1, E);
    EXPECT_EQ(list.back().hi, S);
    for (size_t i = 0; i < list.size(); ++i) {
      const cuda::ExpertRange& x = list[i];
      EXPECT_LT(x.e0, x.e1);
      EXPECT_EQ(x.lo, off[size_t(x.e0)]);
      EXPECT_EQ(x.hi, off[size_t(x.e1)]);
      if (i > 0) EXPECT_EQ(x.e0, list[i - 1].e1);
      // Within the target, unless it is one expert (plus empty ones) above it.
      const int64_t nonempty = std::count_if(off.begin() + x.e0, off.begin() + x.e1,
                                             [&](const int32_t& o) {
                                               const size_t e = size_t(&o - off.data());
                                               return off[e + 1] > off[e];
                                             });
      EXPECT_TRUE(x.hi - x.lo <= target || nonempty == 1) << "range " << i;
      EXPECT_LE(x.hi - x.lo, capacity);
      // Closed only where the next expert would have taken it past the target.
      if (i + 1 < list.size())
        EXPECT_GT(x.hi - x.lo + (off[size_t(x.e1) + 1] - off[size_t(x.e1)]), target)
            << "range " << i;
    }
  }
  const cuda::ExpertRanges small{true, 2, 3, "test"};
  test::expect_invalid([&] { (void)cuda::split_expert_ranges({0, 2, 6, 7}, small); },
                       "plan: expert 1 has 4 slots, more than the expert-range buffers' 3 rows");
}

// The rule (host only): recompute only, from kExpertRangesMinBytes of whole-step H/dH and A';
// the override in either direction; a DeepSeek-V2-size layer at the T that did not fit before.
TEST(LayerGpu, ExpertRangeRule) {
  LayerConfig cfg;
  cfg.T = 1310720, cfg.d = 5120, cfg.n = 1536, cfg.E = 160, cfg.K = 6;
  cfg.activation = Activation::swiglu;
  cfg.dtype = DType::bf16;
  const int64_t S = cfg.T * cfg.K;
  const cuda::gemm::LayerKernels k = cuda::gemm::choose_kernels({S, cfg.E, cfg.d, cfg.n});
  const cuda::ExpertRanges on = cuda::choose_expert_ranges(cfg, S, LayerMode::recompute, k, {});
  EXPECT_TRUE(on.on) << cuda::describe(on);
  EXPECT_EQ(on.capacity_rows, cfg.T);
  EXPECT_EQ(on.target_rows, cfg.T);
  EXPECT_FALSE(cuda::choose_expert_ranges(cfg, S, LayerMode::keep_h, k, {}).on);
  EXPECT_FALSE(cuda::choose_expert_ranges(cfg, S, LayerMode::recompute, k, 1).on);
  const cuda::ExpertRanges four = cuda::choose_expert_ranges(cfg, S, LayerMode::recompute, k, 12);
  EXPECT_TRUE(four.on);
  EXPECT_EQ(four.target_rows, (S + 11) / 12);
  // The backward's workspace in ranges: H/dH, A' and dX̃ of T rows, against the whole step's
  // (sizing the TMA scratch asks the device for its SM count: GPU machines only).
  if (gpu_available()) {
    const int64_t cols = cuda::gemm::ds_partials_cols(cfg.n);
    const cuda::TokenChunks chunks =
        cuda::choose_token_chunks(cfg, S, LayerMode::recompute).backward;
    const size_t ranged =
        cuda::backward_workspace(cfg, S, LayerMode::recompute, cols, chunks, nullptr, false,
                                 nullptr, &on).bytes;
    const size_t whole =
        cuda::backward_workspace(cfg, S, LayerMode::recompute, cols, chunks, nullptr).bytes;
    EXPECT_LT(double(ranged), 0.7 * double(whole)) << ranged << " vs " << whole;
  }
  // A fifth of that T: ranges still on, and the forward's whole-step A and Y (S (n + d)) now
  // outgrow the ranged backward, so Y is chunked too (with the whole-step backward it was not:
  // its H/dH and A' were larger than the forward's A and Y).
  cfg.T = 262144;
  const int64_t S1 = cfg.T * cfg.K;
  const cuda::gemm::LayerKernels k1 = cuda::gemm::choose_kernels({S1, cfg.E, cfg.d, cfg.n});
  const cuda::ExpertRanges on1 = cuda::choose_expert_ranges(cfg, S1, LayerMode::recompute, k1, {});
  const cuda::ExpertRanges off1 = cuda::choose_expert_ranges(cfg, S1, LayerMode::recompute, k1, 1);
  ASSERT_TRUE(on1.on);
  EXPECT_GT(cuda::choose_token_chunks(cfg, S1, LayerMode::recompute, k1, {}, &on1).forward.count,
            1);
  EXPECT_EQ(cuda::choose_token_chunks(cfg, S1, LayerMode::recompute, k1, {}, &off1).forward.count,
            1);
  // Below the threshold (sm-default's T): the whole step.
  cfg.T = 32768, cfg.d = 4096, cfg.n = 1024, cfg.E = 128, cfg.K = 8;
  const int64_t S2 = cfg.T * cfg.K;
  EXPECT_FALSE(cuda::choose_expert_ranges(
                   cfg, S2, LayerMode::recompute,
                   cuda::gemm::choose_kernels({S2, cfg.E, cfg.d, cfg.n}), {})
                   .on);
  // K = 1: a range of T rows would hold the whole step.
  cfg.K = 1;
  EXPECT_FALSE(cuda::choose_expert_ranges(cfg, cfg.T, LayerMode::recompute,
                                          cuda::gemm::choose_kernels({cfg.T, cfg.E, cfg.d, cfg.n}),
                                          8)
                   .on);
}

// Expert ranges give the whole step's bits: every output (dx through the fp32 carry, dW1/dW2
// per range of experts, d_pair_weights from the range-wise ds), for 2 to 9 ranges, on balanced,
// skewed (empty experts) and rounded routings, with dX̃ on the TMA path and on the ws kernel,
// with and without expert biases, through the layer's own workspace and the caller's.
TEST(LayerGpu, ExpertRangesGiveTheWholeStepsBits) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const ClearOverridesAtExit restore;
  const LayerMode mode = LayerMode::recompute;
  for (const RouteKind route : {RouteKind::balanced, RouteKind::skewed, RouteKind::rounded})
    for (const char* dx_kernel : {"down.family=tma,dx.family=tma", "dx.family=ws"}) {
      const Inputs in = make_inputs({1500, 512, 128, 8, 3, Activation::swiglu, mode, route}, seed);
      const int64_t S = in.plans.dev.S();
      SCOPED_TRACE(std::string(route_name(route)) + " " + dx_kernel + " S " + std::to_string(S));
      const std::string base = std::string(dx_kernel) + ",";
      cuda::gemm::set_kernel_overrides(cuda::gemm::parse_kernel_overrides(base + "ranges=1"));
      ASSERT_FALSE(cuda::layer_ranges(in.cfg, S, mode).on);
      const GpuResult whole = run_gpu(in, mode);
      const size_t whole_bwd =
          layer_workspace_bytes(in.cfg, S, mode, Device::cuda, LayerPass::backward, false);
      for (const int count : {2, 3, 5, 9}) {
        SCOPED_TRACE("ranges " + std::to_string(count));
        cuda::gemm::set_kernel_overrides(
            cuda::gemm::parse_kernel_overrides(base + "ranges=" + std::to_string(count)));
        const cuda::ExpertRanges r = cuda::layer_ranges(in.cfg, S, mode);
        ASSERT_TRUE(r.on) << cuda::describe(r);
        expect_same_bits(whole, run_gpu(in, mode));
        expect_same_bits(whole, run_gpu(in, mode, false, /*fresh_threads=*/true));
        // The forward in token chunks beside it: the backward reads only the plan.
        cuda::gemm::set_kernel_overrides(cuda::gemm::parse_kernel_overrides(
            base + "chunks=3,ranges=" + std::to_string(count)));
        expect_same_bits(whole, run_gpu(in, mode));
        EXPECT_LT(layer_workspace_bytes(in.cfg, S, mode, Device::cuda, LayerPass::backward, false),
                  whole_bwd);
      }
      // Expert biases: db1 / db2 and ds's bias share per range, bit for bit too.
      const int64_t R = in.cfg.w1_rows();
      const std::vector<bf16> b1 = to_bf16(random_normal(in.cfg.E * R, seed + 5, 0.5f));
      const std::vector<bf16> b2 = to_bf16(random_normal(in.cfg.E * in.cfg.d, seed + 6, 0.5f));
      cuda::gemm::set_kernel_overrides(cuda::gemm::parse_kernel_overrides(base + "ranges=1"));
      const BiasedResult bw = run_biased(in, mode, 3, b1, b2, true);
      cuda::gemm::set_kernel_overrides(cuda::gemm::parse_kernel_overrides(base + "ranges=4"));
      const BiasedResult br = run_biased(in, mode, 3, b1, b2, true);
      expect_same_bits(bw, br);
      EXPECT_TRUE(bitwise_equal(bw.db1, br.db1)) << "db1";
      EXPECT_TRUE(bitwise_equal(bw.db2, br.db2)) << "db2";
    }
}

// A CUDA graph capture cannot read the expert counts on the host: the ranged backward refuses it
// by name (the capture is then invalid, as after any failed capture), and outputs stay untouched.
TEST(LayerGpu, ExpertRangesRefuseAGraphCapture) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  const ClearOverridesAtExit restore;
  cuda::gemm::set_kernel_overrides(cuda::gemm::parse_kernel_overrides("dx.family=tma,ranges=3"));
  const Inputs in = make_inputs({1500, 512, 128, 8, 3, Activation::swiglu, LayerMode::recompute,
                                 RouteKind::balanced}, seed);
  const LayerConfig& c = in.cfg;
  const int64_t S = in.plans.dev.S(), R = c.w1_rows();
  DevMem x(in.x), w1(in.w1), w2(in.w2), dout(in.dout), out(c.T * c.d * 2), dx(c.T * c.d * 2),
      dw1(c.E * R * c.d * 2), dw2(c.E * c.d * c.n * 2), dpw(S * 4);
  const auto v = [](const DevMem& m, DType dt, std::initializer_list<int64_t> dims) {
    return TensorView(m.p, dt, Device::cuda, dims);
  };
  LayerOptions opts;
  opts.mode = LayerMode::recompute;
  SavedForBackward saved;
  const TensorView tx = v(x, DType::bf16, {c.T, c.d}), tw1 = v(w1, DType::bf16, {c.E, R, c.d}),
                   tw2 = v(w2, DType::bf16, {c.E, c.d, c.n});
  layer_forward(c, in.plans.dev, tx, tw1, tw2, v(out, DType::bf16, {c.T, c.d}), saved, opts);
  MOEBLAZE_CUDA_CHECK(cudaDeviceSynchronize());
  dx.poison();
  cudaStream_t s;
  MOEBLAZE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  LayerOptions b = opts;
  b.stream = s;
  LayerGrads g{v(dx, DType::bf16, {c.T, c.d}), v(dw1, DType::bf16, {c.E, R, c.d}),
               v(dw2, DType::bf16, {c.E, c.d, c.n}), v(dpw, DType::f32, {S})};
  MOEBLAZE_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  try {
    layer_backward(c, in.plans.dev, tx, tw1, tw2, v(dout, DType::bf16, {c.T, c.d}), saved, g, b);
    ADD_FAILURE() << "a captured backward in expert ranges was not refused";
  } catch (const Unsupported& e) {
    EXPECT_NE(std::string(e.what()).find("reads the expert counts on the host"),
              std::string::npos)
        << e.what();
  }
  cudaGraph_t graph = nullptr;
  (void)cudaStreamEndCapture(s, &graph);
  if (graph) (void)cudaGraphDestroy(graph);
  (void)cudaGetLastError();
  MOEBLAZE_CUDA_CHECK(cudaStreamDestroy(s));
  for (uint8_t byte : dx.download<uint8_t>()) ASSERT_EQ(byte, 0xFF) << "dx was written";
}

}  // namespace
}  // namespace moeblaze::test
