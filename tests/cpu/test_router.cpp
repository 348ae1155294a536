// CPU routers against the float64 reference (src/reference/reference_router.*): selection
// bit-exact, weights and losses within fp32 tolerance, router_backward against central finite
// differences of the reference's forward through FIXED pairs, and every validation rule.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/test_util.hpp"
#include "core/parallel.hpp"
#include "moeblaze/moeblaze.hpp"
#include "reference/reference_router.hpp"

namespace moeblaze {
namespace {

constexpr RouterKind kKinds[] = {RouterKind::softmax_topk, RouterKind::topk_softmax,
                                 RouterKind::sigmoid_bias};

// Router logits in fp32 or bf16, with their exact float64 widening for the reference.
struct Logits {
  int64_t T = 0, E = 0;
  DType dtype = DType::f32;
  std::vector<float> f32;
  std::vector<bf16> b16;
  std::vector<double> f64;  // (T*E) exactly the stored values

  Logits(int64_t T_, int64_t E_, DType dtype_, uint64_t seed, float stddev = 1.5f)
      : T(T_), E(E_), dtype(dtype_) {
    set(test::random_normal(size_t(T * E), seed, stddev));
  }
  void set(const std::vector<float>& v) {
    f32 = v;
    if (dtype == DType::bf16) {
      b16 = test::to_bf16(v);
      f32 = test::to_float(b16);
    }
    f64.assign(f32.begin(), f32.end());
  }
  TensorView view() {
    return dtype == DType::bf16 ? host_view(b16.data(), {T, E}) : host_view(f32.data(), {T, E});
  }
};

struct Bias {
  std::vector<float> f32;
  std::vector<double> f64;
  Bias(int64_t E, uint64_t seed) : f32(test::random_normal(size_t(E), seed, 0.3f)) {
    f64.assign(f32.begin(), f32.end());
  }
};

RouterConfig make_cfg(RouterKind kind, int K, bool renorm, float aux = 0, float z = 0) {
  RouterConfig c;
  c.kind = kind;
  c.top_k = K;
  c.renormalize = renorm;
  c.aux_loss_coef = aux;
  c.z_loss_coef = z;
  return c;
}

std::string cfg_str(const RouterConfig& c, DType dt, int64_t T, int64_t E) {
  return detail::concat(router_name(c.kind), " K=", c.top_k, " renorm=", c.renormalize,
                        " aux=", c.aux_loss_coef, " z=", c.z_loss_coef, " ", dtype_name(dt),
                        " T=", T, " E=", E);
}

// |got - ref| within fp32 tolerance of a value of size |ref| computed through a few fp32 ops.
void expect_close_f32(double got, double ref, double scale, const std::string& what) {
  EXPECT_LE(std::fabs(got - ref), 2e-6 * scale + 1e-5 * std::fabs(ref))
      << what << ": got " << got << ", reference " << ref;
}

template <typename Fn>
void expect_invalid(Fn&& fn, const std::string& substring) {
  try {
    fn();
    ADD_FAILURE() << "no exception; expected InvalidArgument containing \"" << substring << "\"";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(substring), std::string::npos)
        << "message \"" << e.what() << "\" lacks \"" << substring << "\"";
  }
}

// A routing filled with recognisable contents, to check that failed calls leave it alone.
struct SentinelRouting {
  Routing r;
  std::vector<int32_t> experts;
  std::vector<float> weights;
  SentinelRouting() {
    std::vector<int32_t> ids = {3, 1, 0, 2, 1, 3};
    std::vector<float> w = {0.25f, -7.0f, 1e3f, 0.5f, 42.0f, -0.125f};
    routing_from_ids(host_view(ids.data(), {3, 2}), host_view(w.data(), {3, 2}), 5, r);
    experts = ids;
    weights = w;
  }
  void expect_untouched() const {
    ASSERT_EQ(r.T(), 3);
    ASSERT_EQ(r.E(), 5);
    ASSERT_EQ(r.P(), 6);
    for (int t = 0; t <= 3; ++t) EXPECT_EQ(r.pair_offsets()[t], 2 * t);
    for (int p = 0; p < 6; ++p) {
      EXPECT_EQ(r.pair_experts()[p], experts[p]);
      EXPECT_EQ(r.pair_weights()[p], weights[p]);
    }
  }
};

// Near-ties closer than fp32 can resolve make the float64 reference's choice undecidable for an
// fp32 router; only the sigmoid-bias router computes its key in floating point (the softmax
// routers rank exact logits). Returns whether token t's top-K+1 keys are that close.
bool near_tie(const std::vector<double>& score, int64_t t, int64_t E, int K) {
  std::vector<double> s(score.begin() + t * E, score.begin() + (t + 1) * E);
  std::sort(s.rbegin(), s.rend());
  for (int k = 0; k < K && k + 1 < E; ++k)
    if (s[k] - s[k + 1] < 1e-6) return true;
  return false;
}

// ---------------------------------------------------------------------------------------------
// Forward

TEST(RouterForward, MatchesFloat64ReferenceForEveryRouter) {
  struct Shape { int64_t T, E; int K; };
  const Shape shapes[] = {{37, 8, 2}, {1, 16, 4}, {1, 1, 1}, {64, 8, 8}, {300, 64, 6}, {129, 5, 1}};
  for (RouterKind kind : kKinds)
    for (bool renorm : {false, true})
      for (DType dt : {DType::f32, DType::bf16})
        for (const Shape& sh : shapes) {
          const uint64_t seed = test::fresh_seed();
          std::mt19937_64 rng(seed);
          const float aux = 0.01f + 0.1f * float(rng() % 10), z = 0.001f * float(1 + rng() % 10);
          const RouterConfig cfg = make_cfg(kind, sh.K, renorm, aux, z);
          SCOPED_TRACE(cfg_str(cfg, dt, sh.T, sh.E) + " seed=" + std::to_string(seed));
          Logits lg(sh.T, sh.E, dt, seed);
          Bias bias(sh.E, seed ^ 0x5bd1e995);
          const bool sig = kind == RouterKind::sigmoid_bias;
          const TensorView bias_view = sig ? host_view(bias.f32.data(), {sh.E}) : TensorView();
          const double* bias64 = sig ? bias.f64.data() : nullptr;

          Routing r;
          const RouterLosses losses = route(cfg, lg.view(), bias_view, r);
          ASSERT_EQ(r.T(), sh.T);
          ASSERT_EQ(r.E(), sh.E);
          ASSERT_EQ(r.P(), sh.T * sh.K);
          for (int64_t t = 0; t <= sh.T; ++t) ASSERT_EQ(r.pair_offsets()[t], t * sh.K);
          EXPECT_NO_THROW(validate_routing(r.view()));

          const auto ref_ids = reference::router_topk(cfg, lg.f64.data(), bias64, sh.T, sh.E);
          const auto ref_score = reference::router_scores(cfg, lg.f64.data(), bias64, sh.T, sh.E);
          int64_t ambiguous = 0;
          for (int64_t t = 0; t < sh.T; ++t) {
            if (sig && near_tie(ref_score, t, sh.E, sh.K)) {
              ++ambiguous;
              continue;
            }
            for (int k = 0; k < sh.K; ++k)
              ASSERT_EQ(r.pair_experts()[t * sh.K + k], ref_ids[t * sh.K + k])
                  << "token " << t << " rank " << k;
          }
          EXPECT_LE(ambiguous, sh.T / 20 + 1);  // near-ties are rare, not a way out

          // Weights of the router's own pairs (so they are compared even on near-tie tokens).
          const auto ref_w = reference::router_pair_weights(cfg, lg.f64.data(), bias64, sh.T, sh.E,
                                                            r.pair_offsets(), r.pair_experts());
          for (int64_t p = 0; p < r.P(); ++p)
            expect_close_f32(r.pair_weights()[p], ref_w[p], 1.0, "weight " + std::to_string(p));
          if (renorm || kind == RouterKind::topk_softmax)
            for (int64_t t = 0; t < sh.T; ++t) {
              double sum = 0;
              for (int k = 0; k < sh.K; ++k) sum += r.pair_weights()[t * sh.K + k];
              EXPECT_NEAR(sum, 1.0, 1e-5) << "token " << t;
            }

          const RouterLosses ref_l = reference::router_losses(cfg, lg.f64.data(), sh.T, sh.E,
                                                              r.pair_offsets(), r.pair_experts());
          EXPECT_GT(ref_l.aux_loss, 0.0);
          EXPECT_GT(ref_l.z_loss, 0.0);
          expect_close_f32(losses.aux_loss, ref_l.aux_loss, ref_l.aux_loss, "aux_loss");
          expect_close_f32(losses.z_loss, ref_l.z_loss, ref_l.z_loss, "z_loss");
        }
}

TEST(RouterForward, LossesAreZeroWhenTheirCoefficientIs) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  Logits lg(50, 8, DType::f32, seed);
  Routing r;
  RouterLosses l = route(make_cfg(RouterKind::softmax_topk, 2, false, 0.0f, 0.5f), lg.view(), {}, r);
  EXPECT_EQ(l.aux_loss, 0.0);
  EXPECT_GT(l.z_loss, 0.0);
  l = route(make_cfg(RouterKind::softmax_topk, 2, false, 0.5f, 0.0f), lg.view(), {}, r);
  EXPECT_GT(l.aux_loss, 0.0);
  EXPECT_EQ(l.z_loss, 0.0);
}

TEST(RouterForward, ExactTiesBreakToLowerExpertId) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t T = 3, E = 10;
  const int K = 4;
  for (RouterKind kind : kKinds)
    for (DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(router_name(kind) + std::string(" ") + dtype_name(dt));
      // token 0: all logits equal → experts 0..K-1.
      // token 1: the maximum appears at experts 7, 2 and 5 → ranks 2, 5, 7, then the runner-up.
      // token 2: distinct values except a tie for rank 3/4 between experts 8 and 1 → 1 kept.
      std::vector<float> v(T * E);
      const float c0 = normal(rng);
      for (int64_t e = 0; e < E; ++e) v[e] = c0;
      for (int64_t e = 0; e < E; ++e) v[E + e] = -1.0f - 0.25f * float(e);
      v[E + 7] = v[E + 2] = v[E + 5] = 2.5f;
      v[E + 9] = 1.75f;  // the runner-up
      for (int64_t e = 0; e < E; ++e) v[2 * E + e] = -3.0f + 0.125f * float(e % 5) - float(e / 5);
      v[2 * E + 0] = 4.0f;
      v[2 * E + 4] = 3.0f;
      v[2 * E + 6] = 2.0f;
      v[2 * E + 8] = v[2 * E + 1] = 1.0f;  // tie at rank 3: expert 1 wins, 8 is dropped
      Logits lg(T, E, dt, seed);
      lg.set(v);
      // Equal bias: ties in sigmoid + bias are exact ties of the logits.
      std::vector<float> bias(E, 0.5f * normal(rng));
      const bool sig = kind == RouterKind::sigmoid_bias;
      Routing r;
      route(make_cfg(kind, K, false), lg.view(), sig ? host_view(bias.data(), {E}) : TensorView(),
            r);
      const std::vector<int32_t> want = {0, 1, 2, 3, 2, 5, 7, 9, 0, 4, 6, 1};
      for (int64_t p = 0; p < T * K; ++p) EXPECT_EQ(r.pair_experts()[p], want[p]) << "pair " << p;
      // The reference breaks ties the same way.
      std::vector<double> b64(bias.begin(), bias.end());
      const auto ref = reference::router_topk(make_cfg(kind, K, false), lg.f64.data(),
                                              sig ? b64.data() : nullptr, T, E);
      EXPECT_EQ(ref, want);
    }
}

TEST(RouterForward, EmptyBatch) {
  std::vector<float> none;
  std::vector<float> bias = {0.1f, -0.2f, 0.3f, 0.0f};
  for (RouterKind kind : kKinds) {
    const bool sig = kind == RouterKind::sigmoid_bias;
    Routing r;
    const RouterLosses l = route(make_cfg(kind, 2, true, 0.5f, 0.5f), host_view(none.data(), {0, 4}),
                                 sig ? host_view(bias.data(), {4}) : TensorView(), r);
    EXPECT_EQ(r.T(), 0);
    EXPECT_EQ(r.E(), 4);
    EXPECT_EQ(r.P(), 0);
    EXPECT_EQ(r.pair_offsets()[0], 0);
    EXPECT_EQ(l.aux_loss, 0.0);
    EXPECT_EQ(l.z_loss, 0.0);
    EXPECT_NO_THROW(validate_routing(r.view()));
    std::vector<float> d;
    router_backward(make_cfg(kind, 2, true, 0.5f, 0.5f), host_view(none.data(), {0, 4}),
                    sig ? host_view(bias.data(), {4}) : TensorView(), r.view(),
                    host_view(d.data(), {0}), host_view(d.data(), {0, 4}));
  }
}

TEST(RouterForward, BitwiseIndependentOfThreadCount) {
  for (RouterKind kind : kKinds) {
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE(std::string(router_name(kind)) + " seed=" + std::to_string(seed));
    const int64_t T = 1000, E = 32;
    Logits lg(T, E, DType::bf16, seed);
    Bias bias(E, seed + 1);
    const bool sig = kind == RouterKind::sigmoid_bias;
    const TensorView bv = sig ? host_view(bias.f32.data(), {E}) : TensorView();
    const RouterConfig cfg = make_cfg(kind, 4, true, 0.01f, 0.001f);
    const auto g = test::random_normal(size_t(T * 4), seed + 2);
    Routing r1, r4;
    RouterLosses l1, l4;
    std::vector<float> d1(T * E), d4(T * E);
    {
      ThreadCountScope one(1);
      l1 = route(cfg, lg.view(), bv, r1);
      router_backward(cfg, lg.view(), bv, r1.view(), host_view(g.data(), {T * 4}),
                      host_view(d1.data(), {T, E}));
    }
    {
      ThreadCountScope four(4);
      l4 = route(cfg, lg.view(), bv, r4);
      router_backward(cfg, lg.view(), bv, r4.view(), host_view(g.data(), {T * 4}),
                      host_view(d4.data(), {T, E}));
    }
    EXPECT_EQ(std::memcmp(r1.pair_experts(), r4.pair_experts(), T * 4 * 4), 0);
    EXPECT_EQ(std::memcmp(r1.pair_weights(), r4.pair_weights(), T * 4 * 4), 0);
    EXPECT_EQ(l1.aux_loss, l4.aux_loss);
    EXPECT_EQ(l1.z_loss, l4.z_loss);
    EXPECT_EQ(std::memcmp(d1.data(), d4.data(), d1.size() * 4), 0);
  }
}

// ---------------------------------------------------------------------------------------------
// Backward

// Pair sets: the top-K, or arbitrary ones (as token rounding makes: sizes 0..E, any experts).
struct Pairs {
  std::vector<int32_t> offsets, experts;
};
Pairs random_pairs(int64_t T, int64_t E, std::mt19937_64& rng) {
  Pairs p;
  p.offsets.push_back(0);
  std::vector<int32_t> all(E);
  std::iota(all.begin(), all.end(), 0);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t n = t == 0 ? 0 : t == 1 ? E : int64_t(rng() % (E + 1));
    std::shuffle(all.begin(), all.end(), rng);
    p.experts.insert(p.experts.end(), all.begin(), all.begin() + n);
    p.offsets.push_back(int32_t(p.experts.size()));
  }
  return p;
}

// L(logits) = sum_p g_p w_p + aux + z through the reference's forward, pairs fixed.
double reference_objective(const RouterConfig& cfg, const std::vector<double>& logits,
                           const double* bias, int64_t T, int64_t E, const Pairs& pairs,
                           const std::vector<double>& g) {
  const auto w = reference::router_pair_weights(cfg, logits.data(), bias, T, E,
                                                pairs.offsets.data(), pairs.experts.data());
  double L = 0;
  for (size_t p = 0; p < w.size(); ++p) L += g[p] * w[p];
  const RouterLosses l = reference::router_losses(cfg, logits.data(), T, E, pairs.offsets.data(),
                                                  pairs.experts.data());
  return L + l.aux_loss + l.z_loss;
}

TEST(RouterBackward, MatchesFiniteDifferencesForEveryRouter) {
  const int64_t T = 12, E = 6;
  const int K = 3;
  for (RouterKind kind : kKinds)
    for (bool renorm : {false, true})
      for (int losses = 0; losses < 4; ++losses)
        for (bool topk_pairs : {true, false})
          for (DType dt : {DType::f32, DType::bf16}) {
            const uint64_t seed = test::fresh_seed();
            std::mt19937_64 rng(seed);
            const RouterConfig cfg = make_cfg(kind, K, renorm, (losses & 1) ? 0.3f : 0.0f,
                                              (losses & 2) ? 0.2f : 0.0f);
            SCOPED_TRACE(cfg_str(cfg, dt, T, E) + " topk_pairs=" + std::to_string(topk_pairs) +
                         " seed=" + std::to_string(seed));
            Logits lg(T, E, dt, seed);
            Bias bias(E, seed + 7);
            const bool sig = kind == RouterKind::sigmoid_bias;
            const TensorView bv = sig ? host_view(bias.f32.data(), {E}) : TensorView();
            const double* b64 = sig ? bias.f64.data() : nullptr;

            Pairs pairs;
            if (topk_pairs) {
              Routing r;
              route(cfg, lg.view(), bv, r);
              pairs.offsets.assign(r.pair_offsets(), r.pair_offsets() + T + 1);
              pairs.experts.assign(r.pair_experts(), r.pair_experts() + r.P());
            } else {
              pairs = random_pairs(T, E, rng);
            }
            const int64_t P = int64_t(pairs.experts.size());
            const auto gf = test::random_normal(size_t(P), seed + 3);
            const std::vector<double> g(gf.begin(), gf.end());

            const auto ref = reference::router_backward(cfg, lg.f64.data(), b64, T, E,
                                                        pairs.offsets.data(), pairs.experts.data(),
                                                        g.data());
            double scale = 0;
            for (double v : ref) scale = std::max(scale, std::fabs(v));
            ASSERT_GT(scale, 0.0);

            // Central differences of the reference's forward: checks the reference backward.
            const double h = 1e-6;
            std::vector<double> x = lg.f64;
            for (int64_t i = 0; i < T * E; ++i) {
              const double x0 = x[i];
              x[i] = x0 + h;
              const double up = reference_objective(cfg, x, b64, T, E, pairs, g);
              x[i] = x0 - h;
              const double dn = reference_objective(cfg, x, b64, T, E, pairs, g);
              x[i] = x0;
              const double fd = (up - dn) / (2 * h);
              ASSERT_NEAR(ref[i], fd, 1e-7 * (1 + scale)) << "d logits[" << i / E << ", " << i % E
                                                          << "] reference vs finite difference";
            }

            // The CPU router's backward against the (now trusted) reference.
            const auto w = reference::router_pair_weights(cfg, lg.f64.data(), b64, T, E,
                                                          pairs.offsets.data(), pairs.experts.data());
            std::vector<float> wf(w.begin(), w.end());
            RoutingView rv;
            rv.T = T;
            rv.E = E;
            rv.P = P;
            rv.pair_offsets = pairs.offsets.data();
            rv.pair_experts = pairs.experts.data();
            rv.pair_weights = wf.data();
            std::vector<float> d(T * E, std::numeric_limits<float>::quiet_NaN());
            router_backward(cfg, lg.view(), bv, rv, host_view(gf.data(), {P}),
                            host_view(d.data(), {T, E}));
            for (int64_t i = 0; i < T * E; ++i)
              expect_close_f32(d[i], ref[i], scale,
                               "d logits[" + std::to_string(i / E) + ", " + std::to_string(i % E) + "]");
            EXPECT_LE(test::rel_frobenius(d.data(), ref.data(), d.size()),
                      test::rel_tolerance(DType::f32));
          }
}

TEST(RouterBackward, LargeBatchMatchesReference) {
  const int64_t T = 500, E = 64;
  for (RouterKind kind : kKinds)
    for (bool renorm : {false, true}) {
      const uint64_t seed = test::fresh_seed();
      const RouterConfig cfg = make_cfg(kind, 8, renorm, 0.02f, 0.001f);
      SCOPED_TRACE(cfg_str(cfg, DType::f32, T, E) + " seed=" + std::to_string(seed));
      Logits lg(T, E, DType::f32, seed, 3.0f);
      Bias bias(E, seed + 1);
      const bool sig = kind == RouterKind::sigmoid_bias;
      const TensorView bv = sig ? host_view(bias.f32.data(), {E}) : TensorView();
      Routing r;
      route(cfg, lg.view(), bv, r);
      const auto gf = test::random_normal(size_t(r.P()), seed + 2);
      const std::vector<double> g(gf.begin(), gf.end());
      std::vector<float> d(T * E);
      router_backward(cfg, lg.view(), bv, r.view(), host_view(gf.data(), {r.P()}),
                      host_view(d.data(), {T, E}));
      const auto ref = reference::router_backward(cfg, lg.f64.data(), sig ? bias.f64.data() : nullptr,
                                                  T, E, r.pair_offsets(), r.pair_experts(), g.data());
      EXPECT_LE(test::rel_frobenius(d.data(), ref.data(), d.size()), test::rel_tolerance(DType::f32));
    }
}

// ---------------------------------------------------------------------------------------------
// Validation: the message names the argument and the rule; outputs stay untouched.

TEST(RouterValidation, TopKOutsideOneToE) {
  const uint64_t seed = test::fresh_seed();
  Logits lg(4, 8, DType::f32, seed);
  SentinelRouting out;
  expect_invalid([&] { route(make_cfg(RouterKind::softmax_topk, 9, false), lg.view(), {}, out.r); },
                 "top_k (9) exceeds num_experts (8)");
  expect_invalid([&] { route(make_cfg(RouterKind::topk_softmax, 0, false), lg.view(), {}, out.r); },
                 "top_k (0) must be >= 1");
  out.expect_untouched();
}

TEST(RouterValidation, NonFiniteLogitsNameTokenAndExpert) {
  const uint64_t seed = test::fresh_seed();
  for (DType dt : {DType::f32, DType::bf16}) {
    Logits lg(6, 8, dt, seed);
    auto v = lg.f32;
    v[3 * 8 + 5] = std::numeric_limits<float>::quiet_NaN();
    v[4 * 8 + 1] = std::numeric_limits<float>::infinity();
    lg.set(v);
    SentinelRouting out;
    expect_invalid([&] { route(make_cfg(RouterKind::softmax_topk, 2, false), lg.view(), {}, out.r); },
                   "logits[3, 5] (token 3, expert 5) is nan");
    v[3 * 8 + 5] = 0.5f;
    lg.set(v);
    expect_invalid([&] { route(make_cfg(RouterKind::softmax_topk, 2, false), lg.view(), {}, out.r); },
                   "logits[4, 1] (token 4, expert 1) is inf");
    out.expect_untouched();

    // router_backward rejects them too, before writing d_logits.
    std::vector<int32_t> off = {0, 1, 2, 3, 4, 5, 6}, ex = {0, 1, 2, 3, 4, 5};
    std::vector<float> w(6, 0.5f), g(6, 1.0f), d(48, -123.0f);
    RoutingView rv{6, 8, 6, off.data(), ex.data(), w.data(), Device::cpu};
    expect_invalid(
        [&] {
          router_backward(make_cfg(RouterKind::softmax_topk, 1, false), lg.view(), {}, rv,
                          host_view(g.data(), {6}), host_view(d.data(), {6, 8}));
        },
        "logits[4, 1] (token 4, expert 1) is inf");
    for (float x : d) ASSERT_EQ(x, -123.0f);
  }
}

TEST(RouterValidation, WrongShapesDtypesAndDevices) {
  const uint64_t seed = test::fresh_seed();
  Logits lg(4, 8, DType::f32, seed);
  SentinelRouting out;
  const RouterConfig cfg = make_cfg(RouterKind::softmax_topk, 2, false);
  expect_invalid([&] { route(cfg, host_view(lg.f32.data(), {32}), {}, out.r); },
                 "logits must be (T, E), got (32,) fp32 cpu");
  std::vector<int32_t> ints(32, 1);
  expect_invalid([&] { route(cfg, host_view(ints.data(), {4, 8}), {}, out.r); },
                 "logits has dtype int32, expected fp32 or bf16");
  expect_invalid([&] { route(cfg, TensorView(nullptr, DType::f32, Device::cpu, {4, 8}), {}, out.r); },
                 "logits has no data");
  out.expect_untouched();

#ifndef MOEBLAZE_WITH_CUDA
  // A CUDA view is rejected by the CPU-only build with a message naming the argument. (A CUDA
  // build takes it to the GPU router; the GPU tests cover that path.)
  TensorView on_gpu = lg.view();
  on_gpu.device = Device::cuda;
  try {
    route(cfg, on_gpu, {}, out.r);
    ADD_FAILURE() << "no exception for a cuda view";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("logits is on cuda"), std::string::npos) << e.what();
  }
  out.expect_untouched();
#endif

  // router_backward: every tensor's shape and dtype.
  Routing r;
  route(cfg, lg.view(), {}, r);
  std::vector<float> g(8, 1.0f), d(32, 77.0f), d_small(28, 77.0f);
  std::vector<bf16> g16(8);
  expect_invalid(
      [&] {
        router_backward(cfg, lg.view(), {}, r.view(), host_view(g.data(), {8}),
                        host_view(d_small.data(), {4, 7}));
      },
      "d_logits has shape (4, 7), expected (4, 8)");
  expect_invalid(
      [&] {
        router_backward(cfg, lg.view(), {}, r.view(), host_view(g.data(), {7}),
                        host_view(d.data(), {4, 8}));
      },
      "d_pair_weights has shape (7,), expected (8,)");
  expect_invalid(
      [&] {
        router_backward(cfg, lg.view(), {}, r.view(), host_view(g16.data(), {8}),
                        host_view(d.data(), {4, 8}));
      },
      "d_pair_weights has dtype bf16, expected fp32");
  Logits other(5, 8, DType::f32, seed + 1);
  std::vector<float> d5(40, 77.0f);
  expect_invalid(
      [&] {
        router_backward(cfg, other.view(), {}, r.view(), host_view(g.data(), {8}),
                        host_view(d5.data(), {5, 8}));
      },
      "routing has T = 4 tokens but logits have 5");
  g[3] = std::numeric_limits<float>::infinity();
  expect_invalid(
      [&] {
        router_backward(cfg, lg.view(), {}, r.view(), host_view(g.data(), {8}),
                        host_view(d.data(), {4, 8}));
      },
      "d_pair_weights[3] (token 1, expert");
  for (float x : d) ASSERT_EQ(x, 77.0f);
  for (float x : d5) ASSERT_EQ(x, 77.0f);
}

TEST(RouterValidation, BiasOnlyAndAlwaysForSigmoidBias) {
  const uint64_t seed = test::fresh_seed();
  Logits lg(4, 8, DType::f32, seed);
  Bias bias(8, seed + 1);
  SentinelRouting out;
  expect_invalid([&] { route(make_cfg(RouterKind::sigmoid_bias, 2, false), lg.view(), {}, out.r); },
                 "bias (8,) fp32 is required by the sigmoid-bias router");
  expect_invalid(
      [&] {
        route(make_cfg(RouterKind::softmax_topk, 2, false), lg.view(),
              host_view(bias.f32.data(), {8}), out.r);
      },
      "bias is given but the softmax-topk router takes none");
  expect_invalid(
      [&] {
        route(make_cfg(RouterKind::topk_softmax, 2, false), lg.view(),
              host_view(bias.f32.data(), {8}), out.r);
      },
      "bias is given but the topk-softmax router takes none");
  expect_invalid(
      [&] {
        route(make_cfg(RouterKind::sigmoid_bias, 2, false), lg.view(),
              host_view(bias.f32.data(), {7}), out.r);
      },
      "bias has shape (7,), expected (8,)");
  std::vector<bf16> b16(8);
  expect_invalid(
      [&] {
        route(make_cfg(RouterKind::sigmoid_bias, 2, false), lg.view(), host_view(b16.data(), {8}),
              out.r);
      },
      "bias has dtype bf16, expected fp32");
  bias.f32[2] = std::numeric_limits<float>::quiet_NaN();
  expect_invalid(
      [&] {
        route(make_cfg(RouterKind::sigmoid_bias, 2, false), lg.view(),
              host_view(bias.f32.data(), {8}), out.r);
      },
      "bias[2] (expert 2) is nan");
  out.expect_untouched();
}

TEST(RouterValidation, SuppliedRouterAndCoefficients) {
  const uint64_t seed = test::fresh_seed();
  Logits lg(4, 8, DType::f32, seed);
  SentinelRouting out;
  expect_invalid([&] { route(make_cfg(RouterKind::supplied, 2, false), lg.view(), {}, out.r); },
                 "route: the supplied router has no logits");
  expect_invalid(
      [&] { route(make_cfg(RouterKind::softmax_topk, 2, false, -0.5f), lg.view(), {}, out.r); },
      "aux_loss_coef (-0.5) must be finite and >= 0");
  expect_invalid(
      [&] {
        route(make_cfg(RouterKind::softmax_topk, 2, false, 0.0f,
                       std::numeric_limits<float>::quiet_NaN()),
              lg.view(), {}, out.r);
      },
      "z_loss_coef (nan) must be finite and >= 0");
  out.expect_untouched();
  std::vector<float> g(6, 1.0f), d(32, 5.0f);
  expect_invalid(
      [&] {
        router_backward(make_cfg(RouterKind::supplied, 2, false), lg.view(), {}, out.r.view(),
                        host_view(g.data(), {6}), host_view(d.data(), {4, 8}));
      },
      "router_backward: the supplied router has no logits");
  for (float x : d) ASSERT_EQ(x, 5.0f);
}

TEST(RoutingFromIds, CopiesValidIdsAndWeights) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t T = 40, E = 9, K = 3;
  std::vector<int32_t> ids;
  std::vector<int32_t> all(E);
  std::iota(all.begin(), all.end(), 0);
  for (int64_t t = 0; t < T; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    ids.insert(ids.end(), all.begin(), all.begin() + K);
  }
  const auto w = test::random_normal(size_t(T * K), seed + 1);
  Routing r;
  routing_from_ids(host_view(ids.data(), {T, K}), host_view(w.data(), {T, K}), E, r);
  ASSERT_EQ(r.T(), T);
  ASSERT_EQ(r.E(), E);
  ASSERT_EQ(r.P(), T * K);
  for (int64_t t = 0; t <= T; ++t) EXPECT_EQ(r.pair_offsets()[t], t * K);
  EXPECT_EQ(std::memcmp(r.pair_experts(), ids.data(), ids.size() * 4), 0);
  EXPECT_EQ(std::memcmp(r.pair_weights(), w.data(), w.size() * 4), 0);
  EXPECT_NO_THROW(validate_routing(r.view()));
}

TEST(RoutingFromIds, RejectsBadIdsAndWeights) {
  SentinelRouting out;
  std::vector<int32_t> ids = {0, 1, 2, 3, 4, 5, 6, 7};  // (4, 2)
  std::vector<float> w = {0.5f, 0.25f, 0.1f, 0.2f, 0.3f, 0.4f, 0.6f, 0.7f};
  auto call = [&](int64_t E) {
    routing_from_ids(host_view(ids.data(), {4, 2}), host_view(w.data(), {4, 2}), E, out.r);
  };
  ids[2] = 9;
  expect_invalid([&] { call(8); }, "ids[1, 0]: expert id 9 of token 1 is out of range [0, 8)");
  ids[2] = -1;
  expect_invalid([&] { call(8); }, "ids[1, 0]: expert id -1 of token 1 is out of range [0, 8)");
  ids[2] = 2;
  ids[5] = 4;
  expect_invalid([&] { call(8); }, "ids: expert 4 appears twice in token 2");
  ids[5] = 5;
  w[5] = std::numeric_limits<float>::quiet_NaN();
  expect_invalid([&] { call(8); }, "weights[2, 1] (token 2) is nan");
  w[5] = -std::numeric_limits<float>::infinity();
  expect_invalid([&] { call(8); }, "weights[2, 1] (token 2) is inf");
  w[5] = 0.4f;
  expect_invalid([&] { call(1); }, "top_k (2) exceeds num_experts (1)");
  expect_invalid([&] { call(0); }, "num_experts (0) must be >= 1");
  expect_invalid(
      [&] {
        routing_from_ids(host_view(ids.data(), {4, 2}), host_view(w.data(), {2, 4}), 8, out.r);
      },
      "weights has shape (2, 4), expected (4, 2)");
  expect_invalid(
      [&] {
        routing_from_ids(host_view(w.data(), {4, 2}), host_view(w.data(), {4, 2}), 8, out.r);
      },
      "ids has dtype fp32, expected int32");
  out.expect_untouched();
  call(8);  // the same arguments, repaired, are accepted
  EXPECT_EQ(out.r.P(), 8);
}

TEST(ValidateRouting, NamesTheFirstOffendingEntry) {
  std::vector<int32_t> off = {0, 2, 4, 6}, ex = {0, 3, 1, 2, 7, 5};
  std::vector<float> w = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f};
  RoutingView rv{3, 8, 6, off.data(), ex.data(), w.data(), Device::cpu};
  EXPECT_NO_THROW(validate_routing(rv));
  ex[4] = 9;
  expect_invalid([&] { validate_routing(rv); },
                 "pair_experts: expert id 9 of token 2 is out of range [0, 8)");
  ex[4] = 5;
  expect_invalid([&] { validate_routing(rv); }, "pair_experts: expert id 5 is repeated in token 2 (pairs 4 and 5)");
  ex[4] = 7;
  w[3] = std::numeric_limits<float>::infinity();
  expect_invalid([&] { validate_routing(rv); }, "pair_weights: weight inf of token 1 (pair 3) is not finite");
  w[3] = 0.4f;
  off[0] = 1;
  expect_invalid([&] { validate_routing(rv); }, "pair_offsets[0] (1) must be 0");
  off[0] = 0;
  off[2] = 1;
  expect_invalid([&] { validate_routing(rv); }, "pair_offsets must be non-decreasing: token 1 has pair_offsets[2] (1) < pair_offsets[1] (2)");
  off[2] = 4;
  off[3] = 5;
  expect_invalid([&] { validate_routing(rv); }, "pair_offsets[T=3] (5) must equal the number of pairs P (6)");
  off[3] = 6;
  // The same expert in two different tokens is fine.
  ex = {0, 3, 0, 3, 0, 3};
  EXPECT_NO_THROW(validate_routing(rv));
}

}  // namespace
}  // namespace moeblaze
