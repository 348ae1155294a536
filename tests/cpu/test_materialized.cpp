// The materialized baseline (src/baselines/materialized_cpu.cpp), run through the public layer
// API with LayerMode::materialized: numerics against a float64 reference computed straight from
// the routing pairs and against moeblaze's own layer (keep_h), what it keeps for backward (and
// that moeblaze keeps less than half of it on cpu-default), determinism across runs and thread
// counts, edge cases (empty experts, all tokens on one expert, tokens without pairs, T = 0), and
// its own checks on `saved`.
//
// Tolerances, relative Frobenius error (d_pair_weights: see expect_dpw_close):
//   against float64       fp32 1e-4, bf16 1e-2 (test::rel_tolerance): fp32 accumulation over
//                         d, n or tokens-per-expert terms; in bf16 the baseline stores H, act(g),
//                         A, Y, dA, s dO, dH, dXs, each a 2^-9 relative rounding, and the results
//   against keep_h layer  fp32 1e-5: same GEMM kernels and summation order, the only
//                         differences are fp32 roundings (ds = <dO, Y> vs <dA', a>, s applied
//                         before or after a GEMM); bf16 1e-2: the baseline's extra bf16 roundings
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/test_util.hpp"
#include "core/saved_access.hpp"
#include "cpu/cpu_backend.hpp"
#include "moeblaze/moeblaze.hpp"
#include "reference/reference_layer.hpp"

namespace moeblaze {

using Saved = moeblaze::detail::SavedAccess;

namespace {

// ---------------------------------------------------------------------------------------------
// Host tensors in either storage dtype
// ---------------------------------------------------------------------------------------------
struct HostTensor {
  DType dtype = DType::f32;
  std::vector<int64_t> dims;
  std::vector<unsigned char> bytes;

  HostTensor() = default;
  HostTensor(DType dt, std::vector<int64_t> d) : dtype(dt), dims(std::move(d)) {
    bytes.assign(size_t(numel()) * dtype_size(dtype), 0);
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    return n;
  }
  float get(int64_t i) const {
    if (dtype == DType::bf16) {
      uint16_t b;
      std::memcpy(&b, bytes.data() + 2 * i, 2);
      return bf16::to_float(b);
    }
    float f;
    std::memcpy(&f, bytes.data() + 4 * i, 4);
    return f;
  }
  void set(int64_t i, float v) {
    if (dtype == DType::bf16) {
      const uint16_t b = bf16::from_float(v);
      std::memcpy(bytes.data() + 2 * i, &b, 2);
    } else {
      std::memcpy(bytes.data() + 4 * i, &v, 4);
    }
  }
  void randomize(uint64_t seed, float stddev) {
    const auto r = test::random_normal(size_t(numel()), seed, stddev);
    for (int64_t i = 0; i < numel(); ++i) set(i, r[i]);
  }
  void fill(float v) {
    for (int64_t i = 0; i < numel(); ++i) set(i, v);
  }
  std::vector<float> values() const {
    std::vector<float> v(static_cast<size_t>(numel()));
    for (int64_t i = 0; i < numel(); ++i) v[i] = get(i);
    return v;
  }
  TensorView view() const {
    TensorView v;
    v.data = const_cast<unsigned char*>(bytes.data());
    v.dtype = dtype;
    v.device = Device::cpu;
    v.rank = int(dims.size());
    for (size_t i = 0; i < dims.size(); ++i) v.shape[i] = dims[i];
    return v;
  }
};

// ---------------------------------------------------------------------------------------------
// Routings
// ---------------------------------------------------------------------------------------------
enum class RouteShape {
  uniform,      // K distinct experts per token, uniformly at random
  skewed,       // experts drawn from a few favourites; the rest stay empty
  one_expert,   // K = 1, every token on the same expert
  ragged,       // 0..K pairs per token (as token rounding produces), some tokens without pairs
};
const char* route_shape_name(RouteShape r) {
  switch (r) {
    case RouteShape::uniform: return "uniform";
    case RouteShape::skewed: return "skewed";
    case RouteShape::one_expert: return "one_expert";
    case RouteShape::ragged: return "ragged";
  }
  return "?";
}

Routing make_routing(int64_t T, int64_t E, int64_t K, RouteShape shape, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> counts(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    if (shape == RouteShape::ragged)
      counts[t] = int32_t(std::uniform_int_distribution<int64_t>(0, K)(rng));
    else if (shape == RouteShape::one_expert)
      counts[t] = 1;
    else
      counts[t] = int32_t(K);
  }
  const int64_t P = std::accumulate(counts.begin(), counts.end(), int64_t(0));
  Routing r(Device::cpu, T, E, P);
  // Favourites for the skewed shape: the odd experts below 2K, so even and high experts are
  // empty (K <= E/2 for that shape).
  std::vector<int32_t> favourites;
  for (int32_t e = 1; e < E && int64_t(favourites.size()) < 2 * K; e += 2) favourites.push_back(e);
  const int32_t lone = int32_t(std::uniform_int_distribution<int64_t>(0, E - 1)(rng));
  std::uniform_real_distribution<float> weight(0.05f, 1.0f);
  r.pair_offsets()[0] = 0;
  int64_t p = 0;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> pool;
    if (shape == RouteShape::skewed) {
      pool = favourites;
    } else {
      pool.resize(size_t(E));
      std::iota(pool.begin(), pool.end(), 0);
    }
    std::shuffle(pool.begin(), pool.end(), rng);
    for (int32_t k = 0; k < counts[t]; ++k, ++p) {
      r.pair_experts()[p] = shape == RouteShape::one_expert ? lone : pool[k];
      r.pair_weights()[p] = weight(rng);
    }
    r.pair_offsets()[t + 1] = int32_t(p);
  }
  return r;
}

// ---------------------------------------------------------------------------------------------
// Float64 reference, straight from the routing pairs (no plan involved)
// ---------------------------------------------------------------------------------------------
struct Grads64 {
  std::vector<double> out, dx, dw1, dw2, dpw;
  std::vector<double> dpw_scale;  // (P,) sum_j |do_t,j * y_p,j|: the magnitude of ds_p's terms
};

Grads64 reference(const LayerConfig& c, const Routing& r, const HostTensor& x,
                  const HostTensor& w1, const HostTensor& w2, const HostTensor& dout) {
  const int64_t d = c.d, n = c.n, w1r = c.w1_rows();
  const bool gated = is_gated(c.activation);
  const auto X = x.values(), W1 = w1.values(), W2 = w2.values(), dO = dout.values();
  Grads64 g;
  g.out.assign(size_t(c.T * d), 0.0);
  g.dx.assign(size_t(c.T * d), 0.0);
  g.dw1.assign(size_t(c.E * w1r * d), 0.0);
  g.dw2.assign(size_t(c.E * d * n), 0.0);
  g.dpw.assign(size_t(r.P()), 0.0);
  g.dpw_scale.assign(size_t(r.P()), 0.0);
  std::vector<double> h(static_cast<size_t>(w1r)), a(static_cast<size_t>(n)), da(static_cast<size_t>(n)),
      dh(static_cast<size_t>(w1r));
  for (int64_t t = 0; t < c.T; ++t) {
    for (int32_t p = r.pair_offsets()[t]; p < r.pair_offsets()[t + 1]; ++p) {
      const int64_t e = r.pair_experts()[p];
      const double s = r.pair_weights()[p];
      const float* w1e = W1.data() + e * w1r * d;
      const float* w2e = W2.data() + e * d * n;
      for (int64_t i = 0; i < w1r; ++i) {
        double acc = 0;
        for (int64_t k = 0; k < d; ++k) acc += double(w1e[i * d + k]) * X[t * d + k];
        h[i] = acc;
      }
      for (int64_t j = 0; j < n; ++j)
        a[j] = gated ? reference::activation_f(c.activation, h[j]) *
                           reference::activation_up(c.activation, h[n + j])
                     : reference::activation_f(c.activation, h[j]);
      for (int64_t i = 0; i < d; ++i) {
        double acc = 0;
        for (int64_t j = 0; j < n; ++j) acc += double(w2e[i * n + j]) * a[j];
        g.out[t * d + i] += s * acc;
        g.dpw_scale[p] += std::fabs(acc * dO[t * d + i]);
      }
      double ds = 0;
      for (int64_t j = 0; j < n; ++j) {
        double acc = 0;
        for (int64_t i = 0; i < d; ++i) acc += double(w2e[i * n + j]) * dO[t * d + i];
        ds += acc * a[j];
        da[j] = s * acc;
      }
      g.dpw[p] = ds;
      for (int64_t j = 0; j < n; ++j) {
        if (gated) {
          dh[j] = da[j] * reference::activation_up(c.activation, h[n + j]) *
                  reference::activation_df(c.activation, h[j]);
          dh[n + j] = da[j] * reference::activation_f(c.activation, h[j]) *
                      reference::activation_dup(c.activation, h[n + j]);
        } else {
          dh[j] = da[j] * reference::activation_df(c.activation, h[j]);
        }
      }
      double* dw2e = g.dw2.data() + e * d * n;
      for (int64_t i = 0; i < d; ++i)
        for (int64_t j = 0; j < n; ++j) dw2e[i * n + j] += dO[t * d + i] * s * a[j];
      double* dw1e = g.dw1.data() + e * w1r * d;
      for (int64_t i = 0; i < w1r; ++i)
        for (int64_t k = 0; k < d; ++k) {
          dw1e[i * d + k] += dh[i] * X[t * d + k];
          g.dx[t * d + k] += dh[i] * w1e[i * d + k];
        }
    }
  }
  return g;
}

// ---------------------------------------------------------------------------------------------
// Running the baseline
// ---------------------------------------------------------------------------------------------
struct Problem {
  LayerConfig cfg;
  Routing routing;
  RoutingPlan plan;
  HostTensor x, w1, w2, dout;
};

Problem make_problem(const LayerConfig& cfg, RouteShape shape, uint64_t seed) {
  Problem pb;
  pb.cfg = cfg;
  pb.routing = make_routing(cfg.T, cfg.E, cfg.K, shape, seed);
  build_routing_plan(pb.routing.view(), PlanBuilder::sort, pb.plan);
  pb.x = HostTensor(cfg.dtype, {cfg.T, cfg.d});
  pb.w1 = HostTensor(cfg.dtype, {cfg.E, cfg.w1_rows(), cfg.d});
  pb.w2 = HostTensor(cfg.dtype, {cfg.E, cfg.d, cfg.n});
  pb.dout = HostTensor(cfg.dtype, {cfg.T, cfg.d});
  // Weights scaled by 1/sqrt(fan-in) so every stage stays O(1).
  pb.x.randomize(seed + 1, 1.0f);
  pb.w1.randomize(seed + 2, 1.0f / std::sqrt(float(cfg.d)));
  pb.w2.randomize(seed + 3, 1.0f / std::sqrt(float(cfg.n)));
  pb.dout.randomize(seed + 4, 1.0f);
  return pb;
}

struct Result {
  HostTensor out, dx, dw1, dw2;
  std::vector<float> dpw;
  size_t saved_bytes = 0;
  std::vector<unsigned char> saved_contents;  // xs, h, act_g, a, y concatenated
};

// Output tensors start as a sentinel (never a plausible result) so a missed write shows.
constexpr float kSentinel = 12345.0f;

// Forward and backward through the public API in `mode`.
Result run_mode(const Problem& pb, LayerMode mode, int threads = 0) {
  const LayerConfig& c = pb.cfg;
  Result r;
  r.out = HostTensor(c.dtype, {c.T, c.d});
  r.dx = HostTensor(c.dtype, {c.T, c.d});
  r.dw1 = HostTensor(c.dtype, {c.E, c.w1_rows(), c.d});
  r.dw2 = HostTensor(c.dtype, {c.E, c.d, c.n});
  r.dpw.assign(size_t(pb.plan.S()), kSentinel);
  for (HostTensor* t : {&r.out, &r.dx, &r.dw1, &r.dw2}) t->fill(kSentinel);
  LayerOptions opts;
  opts.mode = mode;
  opts.num_threads = threads;
  SavedForBackward saved;
  layer_forward(c, pb.plan, pb.x.view(), pb.w1.view(), pb.w2.view(), r.out.view(), saved, opts);
  EXPECT_TRUE(saved.valid());
  EXPECT_EQ(saved.mode(), mode);
  EXPECT_EQ(Saved::S(saved), pb.plan.S());
  r.saved_bytes = saved.bytes();
  for (const Buffer* b : {&Saved::xs(saved), &Saved::h(saved), &Saved::act_g(saved),
                          &Saved::a(saved), &Saved::y(saved)}) {
    const auto* p = static_cast<const unsigned char*>(b->data());
    r.saved_contents.insert(r.saved_contents.end(), p, p + b->bytes());
  }
  LayerGrads g;
  g.dx = r.dx.view();
  g.dw1 = r.dw1.view();
  g.dw2 = r.dw2.view();
  g.d_pair_weights = host_view(r.dpw.data(), {pb.plan.S()});
  layer_backward(c, pb.plan, pb.x.view(), pb.w1.view(), pb.w2.view(), pb.dout.view(), saved, g,
                 opts);
  return r;
}

Result run_materialized(const Problem& pb, int threads = 0) {
  return run_mode(pb, LayerMode::materialized, threads);
}

std::string describe(const LayerConfig& c, RouteShape shape, uint64_t seed) {
  return detail::concat("T=", c.T, " d=", c.d, " n=", c.n, " E=", c.E, " K=", c.K, " ",
                        activation_name(c.activation), " ", dtype_name(c.dtype), " ",
                        route_shape_name(shape), " seed=", seed);
}

void expect_close(const HostTensor& got, const std::vector<double>& ref, double tol,
                  const char* what) {
  ASSERT_EQ(size_t(got.numel()), ref.size()) << what;
  const auto v = got.values();
  const double err = test::rel_frobenius(v.data(), ref.data(), ref.size());
  EXPECT_LE(err, tol) << what << " relative Frobenius error";
}

// ds_p = <do_t, y_p> is a d-term dot product of rounded values: a pair whose terms nearly cancel
// has no relative accuracy in any implementation, so (with few pairs, as at T = 1) a plain
// relative Frobenius error is noise. The error is measured against the magnitude of the terms,
// ||ds - ref||_F / ||sum_j |do_j y_j| ||_F, which is what rounding the terms can move.
void expect_dpw_close(const std::vector<float>& got, const Grads64& ref, double tol) {
  ASSERT_EQ(got.size(), ref.dpw.size());
  double num = 0, den = 0;
  for (size_t p = 0; p < got.size(); ++p) {
    if (std::isnan(got[p])) num = INFINITY;
    num += (double(got[p]) - ref.dpw[p]) * (double(got[p]) - ref.dpw[p]);
    den += ref.dpw_scale[p] * ref.dpw_scale[p];
  }
  EXPECT_LE(std::sqrt(num) / std::max(std::sqrt(den), 1e-30), tol)
      << "d_pair_weights error relative to the magnitude of their terms";
}

const Activation kAllActivations[] = {Activation::swiglu, Activation::geglu, Activation::relu,
                                      Activation::silu,   Activation::gelu,  Activation::relu2,
                                      Activation::swiglu_oai};

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

// Every activation, both dtypes, routings with uneven and empty experts and tokens without pairs;
// shapes not multiples of any tile.
TEST(Materialized, MatchesFloat64Reference) {
  struct Shape { int64_t T, d, n, E, K; RouteShape route; };
  const Shape shapes[] = {
      {37, 40, 24, 5, 2, RouteShape::uniform},
      {70, 32, 48, 8, 2, RouteShape::skewed},
      {53, 24, 20, 6, 3, RouteShape::ragged},
      {1, 64, 48, 4, 4, RouteShape::uniform},  // T = 1, K = E
  };
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (Activation act : kAllActivations) {
      for (const Shape& s : shapes) {
        const LayerConfig cfg{s.T, s.d, s.n, s.E, s.K, act, dtype};
        const uint64_t seed = test::fresh_seed();
        SCOPED_TRACE(describe(cfg, s.route, seed));
        const Problem pb = make_problem(cfg, s.route, seed);
        const Result r = run_materialized(pb);
        const Grads64 ref = reference(cfg, pb.routing, pb.x, pb.w1, pb.w2, pb.dout);
        const double tol = test::rel_tolerance(dtype);
        expect_close(r.out, ref.out, tol, "out");
        expect_close(r.dx, ref.dx, tol, "dx");
        expect_close(r.dw1, ref.dw1, tol, "dw1");
        expect_close(r.dw2, ref.dw2, tol, "dw2");
        expect_dpw_close(r.dpw, ref, tol);
      }
    }
  }
}

// The baseline and moeblaze's layer (keep_h) agree on every output and gradient, for every
// activation, both dtypes, and routings with uneven and empty experts and tokens without pairs.
TEST(Materialized, MatchesMoeblazeLayer) {
  struct Shape { int64_t T, d, n, E, K; RouteShape route; };
  const Shape shapes[] = {
      {150, 40, 56, 6, 2, RouteShape::uniform},
      {200, 64, 48, 8, 2, RouteShape::skewed},
      {97, 32, 40, 5, 3, RouteShape::ragged},
      {300, 24, 16, 4, 1, RouteShape::one_expert},
  };
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (Activation act : kAllActivations) {
      for (const Shape& s : shapes) {
        const LayerConfig cfg{s.T, s.d, s.n, s.E, s.K, act, dtype};
        const uint64_t seed = test::fresh_seed();
        SCOPED_TRACE(describe(cfg, s.route, seed));
        const Problem pb = make_problem(cfg, s.route, seed);
        const Result mat = run_mode(pb, LayerMode::materialized);
        const Result moe = run_mode(pb, LayerMode::keep_h);
        const double tol = dtype == DType::bf16 ? 1e-2 : 1e-5;
        auto as_double = [](const HostTensor& t) {
          const auto v = t.values();
          return std::vector<double>(v.begin(), v.end());
        };
        expect_close(mat.out, as_double(moe.out), tol, "out vs keep_h");
        expect_close(mat.dx, as_double(moe.dx), tol, "dx vs keep_h");
        expect_close(mat.dw1, as_double(moe.dw1), tol, "dw1 vs keep_h");
        expect_close(mat.dw2, as_double(moe.dw2), tol, "dw2 vs keep_h");
        Grads64 moe_dpw;  // keep_h's ds, with the term magnitudes of the float64 reference
        moe_dpw.dpw.assign(moe.dpw.begin(), moe.dpw.end());
        moe_dpw.dpw_scale = reference(cfg, pb.routing, pb.x, pb.w1, pb.w2, pb.dout).dpw_scale;
        expect_dpw_close(mat.dpw, moe_dpw, tol);
      }
    }
  }
}

// cpu-default (T=2048, d=256, n=512, E=16, K=4, swiglu, bf16): the baseline keeps
// Xs + H + act(g) + A + Y = S (d + 2n + n + n + d) bf16 values, moeblaze keeps H = S 2n; with the
// plan on top of each, moeblaze keeps less than half. Forward only (what is kept is decided
// there); the two forwards' outputs are compared too, at this realistic size.
TEST(Materialized, MoeblazeKeepsLessThanHalfOnCpuDefault) {
  const LayerConfig cfg{2048, 256, 512, 16, 4, Activation::swiglu, DType::bf16};
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(describe(cfg, RouteShape::uniform, seed));
  Problem pb = make_problem(cfg, RouteShape::uniform, seed);
  RoutingPlan moe_plan;
  build_routing_plan(pb.routing.view(), PlanBuilder::atomic_free, moe_plan);
  ASSERT_EQ(pb.plan.S(), cfg.T * cfg.K);

  HostTensor mat_out(cfg.dtype, {cfg.T, cfg.d}), moe_out(cfg.dtype, {cfg.T, cfg.d});
  LayerOptions opts;
  SavedForBackward mat_saved, moe_saved;
  opts.mode = LayerMode::materialized;
  layer_forward(cfg, pb.plan, pb.x.view(), pb.w1.view(), pb.w2.view(), mat_out.view(),
                mat_saved, opts);
  opts.mode = LayerMode::keep_h;
  layer_forward(cfg, moe_plan, pb.x.view(), pb.w1.view(), pb.w2.view(), moe_out.view(),
                moe_saved, opts);

  const size_t S = size_t(pb.plan.S()), d = size_t(cfg.d), n = size_t(cfg.n);
  EXPECT_EQ(mat_saved.bytes(), (S * d + S * 2 * n + S * n + S * n + S * d) * 2);
  EXPECT_EQ(moe_saved.bytes(), S * 2 * n * 2);
  EXPECT_EQ(moe_plan.bytes(), pb.plan.bytes());
  const size_t mat_kept = mat_saved.bytes() + pb.plan.bytes();
  const size_t moe_kept = moe_saved.bytes() + moe_plan.bytes();
  RecordProperty("materialized_kept_bytes", std::to_string(mat_kept));
  RecordProperty("moeblaze_kept_bytes", std::to_string(moe_kept));
  EXPECT_LT(double(moe_kept), 0.5 * double(mat_kept))
      << "moeblaze keeps " << moe_kept << " bytes, materialized " << mat_kept;

  const auto v = moe_out.values();
  expect_close(mat_out, std::vector<double>(v.begin(), v.end()), 1e-2, "out vs keep_h");
}

// One expert with more tokens than a GEMM task has rows and than a k-block holds (the dW GEMMs
// reduce over tokens), all other experts empty: their weight gradients must be written as zeros.
TEST(Materialized, AllTokensOnOneExpert) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    const LayerConfig cfg{700, 24, 16, 4, 1, Activation::swiglu, dtype};
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE(describe(cfg, RouteShape::one_expert, seed));
    const Problem pb = make_problem(cfg, RouteShape::one_expert, seed);
    const Result r = run_materialized(pb);
    const Grads64 ref = reference(cfg, pb.routing, pb.x, pb.w1, pb.w2, pb.dout);
    const double tol = test::rel_tolerance(dtype);
    expect_close(r.out, ref.out, tol, "out");
    expect_close(r.dx, ref.dx, tol, "dx");
    expect_close(r.dw1, ref.dw1, tol, "dw1");
    expect_close(r.dw2, ref.dw2, tol, "dw2");
    expect_dpw_close(r.dpw, ref, tol);
    const int32_t lone = pb.routing.pair_experts()[0];
    for (int64_t e = 0; e < cfg.E; ++e) {
      if (e == lone) continue;
      for (int64_t i = 0; i < cfg.w1_rows() * cfg.d; ++i)
        ASSERT_EQ(r.dw1.get(e * cfg.w1_rows() * cfg.d + i), 0.0f) << "dw1 of empty expert " << e;
      for (int64_t i = 0; i < cfg.d * cfg.n; ++i)
        ASSERT_EQ(r.dw2.get(e * cfg.d * cfg.n + i), 0.0f) << "dw2 of empty expert " << e;
    }
  }
}

// Tokens with no pairs get zero output and zero dx (written, not left as they were).
TEST(Materialized, TokensWithoutPairsGetZeros) {
  const LayerConfig cfg{64, 16, 12, 4, 2, Activation::gelu, DType::f32};
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(describe(cfg, RouteShape::ragged, seed));
  const Problem pb = make_problem(cfg, RouteShape::ragged, seed);
  const Result r = run_materialized(pb);
  int64_t empty_tokens = 0;
  for (int64_t t = 0; t < cfg.T; ++t) {
    if (pb.routing.pair_offsets()[t + 1] != pb.routing.pair_offsets()[t]) continue;
    ++empty_tokens;
    for (int64_t j = 0; j < cfg.d; ++j) {
      ASSERT_EQ(r.out.get(t * cfg.d + j), 0.0f) << "out of token " << t;
      ASSERT_EQ(r.dx.get(t * cfg.d + j), 0.0f) << "dx of token " << t;
    }
  }
  // With 0..2 pairs drawn uniformly for 64 tokens, no empty token has probability (2/3)^64.
  EXPECT_GT(empty_tokens, 0);
}

// T = 0 is valid: nothing kept, nothing written, weight gradients zero. And T > 0 with S = 0
// (every token dropped) zeroes out, dx and the weight gradients.
TEST(Materialized, EmptyBatchAndEmptyRouting) {
  for (int64_t T : {int64_t(0), int64_t(5)}) {
    const LayerConfig cfg{T, 8, 4, 3, 2, Activation::swiglu, DType::bf16};
    Problem pb;
    pb.cfg = cfg;
    pb.routing = Routing(Device::cpu, T, cfg.E, 0);
    for (int64_t t = 0; t <= T; ++t) pb.routing.pair_offsets()[t] = 0;
    build_routing_plan(pb.routing.view(), PlanBuilder::sort, pb.plan);
    pb.x = HostTensor(cfg.dtype, {T, cfg.d});
    pb.w1 = HostTensor(cfg.dtype, {cfg.E, cfg.w1_rows(), cfg.d});
    pb.w2 = HostTensor(cfg.dtype, {cfg.E, cfg.d, cfg.n});
    pb.dout = HostTensor(cfg.dtype, {T, cfg.d});
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE(detail::concat("T=", T, " seed=", seed));
    pb.x.randomize(seed, 1.0f);
    pb.w1.randomize(seed + 1, 1.0f);
    pb.w2.randomize(seed + 2, 1.0f);
    pb.dout.randomize(seed + 3, 1.0f);
    const Result r = run_materialized(pb);
    EXPECT_EQ(r.saved_bytes, 0u);
    for (const HostTensor* t : {&r.out, &r.dx, &r.dw1, &r.dw2})
      for (int64_t i = 0; i < t->numel(); ++i) ASSERT_EQ(t->get(i), 0.0f);
  }
}

// Kept for backward: Xs (S,d), H (S,w1_rows), act(g) (S,n) for gated only, A (S,n), Y (S,d).
// For non-gated activations autograd of act(h) saves its input H, already kept: no act_g.
TEST(Materialized, SavedBytesAreTheConventionalSet) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (Activation act : kAllActivations) {
      const LayerConfig cfg{45, 24, 20, 6, 2, act, dtype};
      const uint64_t seed = test::fresh_seed();
      SCOPED_TRACE(describe(cfg, RouteShape::ragged, seed));
      const Problem pb = make_problem(cfg, RouteShape::ragged, seed);
      LayerOptions opts;
      opts.mode = LayerMode::materialized;
      HostTensor out(dtype, {cfg.T, cfg.d});
      SavedForBackward saved;
      layer_forward(cfg, pb.plan, pb.x.view(), pb.w1.view(), pb.w2.view(), out.view(), saved,
                    opts);
      const size_t S = size_t(pb.plan.S()), d = size_t(cfg.d), n = size_t(cfg.n);
      const size_t es = dtype_size(dtype);
      const size_t want = is_gated(act) ? (S * d + S * 2 * n + S * n + S * n + S * d) * es
                                        : (S * d + S * n + S * n + S * d) * es;
      EXPECT_EQ(saved.bytes(), want);
      EXPECT_EQ(Saved::xs(saved).bytes(), S * d * es);
      EXPECT_EQ(Saved::h(saved).bytes(), S * size_t(cfg.w1_rows()) * es);
      EXPECT_EQ(Saved::act_g(saved).bytes(), is_gated(act) ? S * n * es : 0u);
      EXPECT_EQ(Saved::a(saved).bytes(), S * n * es);
      EXPECT_EQ(Saved::y(saved).bytes(), S * d * es);
      // Xs really is the gathered copy of x in slot order.
      const RoutingPlanView pv = pb.plan.view();
      for (size_t s = 0; s < S; ++s)
        ASSERT_EQ(std::memcmp(static_cast<const char*>(Saved::xs(saved).data()) + s * d * es,
                              pb.x.bytes.data() + size_t(pv.expert_token_indices[s]) * d * es,
                              d * es),
                  0)
            << "xs slot " << s;
    }
  }
}

void expect_bitwise_equal(const Result& a, const Result& b) {
  EXPECT_TRUE(a.out.bytes == b.out.bytes) << "out differs";
  EXPECT_TRUE(a.dx.bytes == b.dx.bytes) << "dx differs";
  EXPECT_TRUE(a.dw1.bytes == b.dw1.bytes) << "dw1 differs";
  EXPECT_TRUE(a.dw2.bytes == b.dw2.bytes) << "dw2 differs";
  EXPECT_EQ(std::memcmp(a.dpw.data(), b.dpw.data(), a.dpw.size() * sizeof(float)), 0)
      << "d_pair_weights differ";
  EXPECT_TRUE(a.saved_contents == b.saved_contents) << "saved tensors differ";
}

// Two runs are bitwise equal, and 1 thread gives the same bits as 2 (and as 3, an odd split).
TEST(Materialized, DeterministicAcrossRunsAndThreadCounts) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    const LayerConfig cfg{300, 72, 136, 8, 3, Activation::swiglu, dtype};
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE(describe(cfg, RouteShape::skewed, seed));
    const Problem pb = make_problem(cfg, RouteShape::skewed, seed);
    const Result one = run_materialized(pb, 1);
    const Result two = run_materialized(pb, 2);
    const Result two_again = run_materialized(pb, 2);
    const Result three = run_materialized(pb, 3);
    expect_bitwise_equal(two, two_again);
    expect_bitwise_equal(one, two);
    expect_bitwise_equal(one, three);
  }
}

// Backward checks that `saved` came from a materialized forward of this plan, before writing.
TEST(Materialized, BackwardRejectsForeignSavedAndLeavesOutputsUntouched) {
  const LayerConfig cfg{20, 16, 8, 4, 2, Activation::swiglu, DType::f32};
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(describe(cfg, RouteShape::uniform, seed));
  const Problem pb = make_problem(cfg, RouteShape::uniform, seed);
  LayerOptions opts;
  opts.mode = LayerMode::materialized;

  HostTensor dx(cfg.dtype, {cfg.T, cfg.d}), dw1(cfg.dtype, {cfg.E, cfg.w1_rows(), cfg.d}),
      dw2(cfg.dtype, {cfg.E, cfg.d, cfg.n});
  std::vector<float> dpw(size_t(pb.plan.S()), kSentinel);
  for (HostTensor* t : {&dx, &dw1, &dw2}) t->randomize(seed + 9, 1.0f);
  const HostTensor dx0 = dx, dw10 = dw1, dw20 = dw2;
  LayerGrads g;
  g.dx = dx.view();
  g.dw1 = dw1.view();
  g.dw2 = dw2.view();
  g.d_pair_weights = host_view(dpw.data(), {pb.plan.S()});
  auto untouched = [&] {
    EXPECT_TRUE(dx.bytes == dx0.bytes);
    EXPECT_TRUE(dw1.bytes == dw10.bytes);
    EXPECT_TRUE(dw2.bytes == dw20.bytes);
    for (float v : dpw) ASSERT_EQ(v, kSentinel);
  };

  SavedForBackward never_filled;
  try {
    cpu::materialized_backward(cfg, pb.plan, pb.x.view(), pb.w1.view(), pb.w2.view(),
                               pb.dout.view(), never_filled, g, opts);
    ADD_FAILURE() << "no throw for an empty saved";
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "saved was not filled by a materialized-mode forward");
  }
  untouched();

  // A saved from a forward over another plan (different S).
  const LayerConfig other_cfg{cfg.T + 3, cfg.d, cfg.n, cfg.E, cfg.K, cfg.activation, cfg.dtype};
  const Problem other = make_problem(other_cfg, RouteShape::uniform, seed + 100);
  HostTensor other_out(cfg.dtype, {other_cfg.T, cfg.d});
  SavedForBackward foreign;
  cpu::materialized_forward(other_cfg, other.plan, other.x.view(), other.w1.view(),
                            other.w2.view(), other_out.view(), foreign, opts);
  try {
    cpu::materialized_backward(cfg, pb.plan, pb.x.view(), pb.w1.view(), pb.w2.view(),
                               pb.dout.view(), foreign, g, opts);
    ADD_FAILURE() << "no throw for a saved of another plan";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("saved holds S (" + std::to_string(other.plan.S()) +
                                         ") assignments but the plan has S (" +
                                         std::to_string(pb.plan.S()) + ")"),
              std::string::npos)
        << e.what();
  }
  untouched();

  // A saved of the right plan but another activation (gated vs not: act_g missing).
  LayerConfig relu_cfg = cfg;
  relu_cfg.activation = Activation::relu;
  HostTensor w1_relu(cfg.dtype, {cfg.E, relu_cfg.w1_rows(), cfg.d});
  w1_relu.randomize(seed + 11, 0.25f);
  HostTensor out(cfg.dtype, {cfg.T, cfg.d});
  SavedForBackward relu_saved;
  cpu::materialized_forward(relu_cfg, pb.plan, pb.x.view(), w1_relu.view(), pb.w2.view(),
                            out.view(), relu_saved, opts);
  try {
    cpu::materialized_backward(cfg, pb.plan, pb.x.view(), pb.w1.view(), pb.w2.view(),
                               pb.dout.view(), relu_saved, g, opts);
    ADD_FAILURE() << "no throw for a saved of another activation";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("saved's buffers do not match the config"),
              std::string::npos)
        << e.what();
  }
  untouched();
}

}  // namespace
}  // namespace moeblaze
