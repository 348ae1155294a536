// Gradient checks.
//  1. The float64 layer reference's backward against central finite differences of its own
//     forward, for every activation (checks the backward math itself).
//  2. End to end through router + layer in float64: d logits from the reference layer's
//     d_pair_weights fed to the reference router's backward, against central differences of
//     L(logits) = Σ <d_out, o> (+ aux / z losses) with the selected pairs held fixed, for each
//     router kind (supplied routing: the d pair weights are checked directly in 1).
//  3. The CPU fp32 layer's gradients against the float64 reference on the same tiny shapes.
//  4. The CPU chain route → plan → layer fp32 → router_backward against the float64 chain.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/layer_fixtures.hpp"
#include "common/test_util.hpp"
#include "moeblaze/moeblaze.hpp"
#include "reference/reference_layer.hpp"
#include "reference/reference_router.hpp"

namespace moeblaze {
namespace {

constexpr Activation kActivations[] = {Activation::swiglu, Activation::geglu, Activation::relu,
                                       Activation::silu,   Activation::gelu,  Activation::relu2,
                                       Activation::swiglu_oai};

std::vector<double> normal64(size_t count, uint64_t seed, double stddev) {
  const std::vector<float> v = test::random_normal(count, seed, static_cast<float>(stddev));
  return std::vector<double>(v.begin(), v.end());
}

// Central difference of f at v[i] with step h; restores v[i].
double central_difference(std::vector<double>& v, size_t i, double h,
                          const std::function<double()>& f) {
  const double saved = v[i];
  v[i] = saved + h;
  const double up = f();
  v[i] = saved - h;
  const double down = f();
  v[i] = saved;
  return (up - down) / (2 * h);
}

// Step 1e-5: truncation error ~h^2 |f'''| ~ 1e-10 and cancellation ~1e-16 |L| / h ~ 1e-11 for
// these O(1) losses, so analytic and numeric derivatives agree to ~1e-9; 1e-6 (absolute plus
// relative) is a safe bound that still catches any wrong term (those are O(1e-2) or larger).
constexpr double kStep = 1e-5;
constexpr double kFdTol = 1e-6;

void expect_gradient(const char* what, std::vector<double>& v, const std::vector<double>& grad,
                     const std::function<double()>& loss) {
  ASSERT_EQ(v.size(), grad.size()) << what;
  for (size_t i = 0; i < v.size(); ++i) {
    const double fd = central_difference(v, i, kStep, loss);
    EXPECT_NEAR(grad[i], fd, kFdTol * (1 + std::fabs(fd))) << what << "[" << i << "]";
  }
}

// A tiny routing: T tokens, K distinct random experts each, weights in (0.05, 1).
test::HostRouting tiny_routing(int64_t T, int64_t E, int64_t K, uint64_t seed) {
  return test::random_routing({T, E, K, 0, false}, seed);
}

// The float64 reference's backward (with expert biases b1, b2 when `biased`) against central
// differences of its loss.
void check_layer_gradients(Activation act, bool biased, uint64_t seed) {
  SCOPED_TRACE(std::string(activation_name(act)) + (biased ? " biased" : ""));
  const int64_t T = 5, d = 4, n = 3, E = 3, K = 2;
  const test::HostRouting r = tiny_routing(T, E, K, seed);
  const LayerConfig cfg{T, d, n, E, K, act, DType::f32};
  const int64_t R = cfg.w1_rows();
  std::vector<double> x = normal64(T * d, seed + 1, 1.0);
  std::vector<double> w1 = normal64(E * R * d, seed + 2, 0.5);
  std::vector<double> w2 = normal64(E * d * n, seed + 3, 0.6);
  std::vector<double> dout = normal64(T * d, seed + 4, 1.0);
  std::vector<double> b1 = biased ? normal64(E * R, seed + 5, 0.5) : std::vector<double>();
  std::vector<double> b2 = biased ? normal64(E * d, seed + 6, 0.5) : std::vector<double>();
  const double* b1p = biased ? b1.data() : nullptr;
  const double* b2p = biased ? b2.data() : nullptr;
  std::vector<double> pw(r.weights.begin(), r.weights.end());
  const reference::LayerReference g = reference::reference_layer(
      cfg, r.offsets.data(), r.experts.data(), pw.data(), x.data(), w1.data(), w2.data(),
      dout.data(), b1p, b2p);
  auto loss = [&] {
    return reference::reference_loss(cfg, r.offsets.data(), r.experts.data(), pw.data(),
                                     x.data(), w1.data(), w2.data(), dout.data(), b1p, b2p);
  };
  expect_gradient("dx", x, g.dx, loss);
  expect_gradient("dw1", w1, g.dw1, loss);
  expect_gradient("dw2", w2, g.dw2, loss);
  if (biased) {
    expect_gradient("db1", b1, g.db1, loss);
    expect_gradient("db2", b2, g.db2, loss);
  }
  expect_gradient("d_pair_weights", pw, g.d_pair_weights, loss);
  // The forward itself: out is linear in d_out, so <d_out, out> = loss.
  double l = 0;
  for (size_t i = 0; i < dout.size(); ++i) l += dout[i] * g.out[i];
  EXPECT_NEAR(l, loss(), 1e-12 * (1 + std::fabs(l)));
}

TEST(ReferenceGradcheck, LayerBackwardMatchesCentralDifferences) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (Activation act : kActivations) check_layer_gradients(act, false, seed);
}

// The same with expert biases b1, b2 (smooth activations: a bias may move h onto a kink).
TEST(ReferenceGradcheck, BiasedLayerBackwardMatchesCentralDifferences) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (Activation act : {Activation::swiglu, Activation::gelu, Activation::silu})
    check_layer_gradients(act, true, seed);
}

// The activation formulas of the reference against differences of themselves, on a grid that
// avoids relu's kink.
TEST(ReferenceGradcheck, ActivationDerivativesMatchCentralDifferences) {
  for (Activation act : kActivations) {
    for (double v = -4.05; v < 4.0; v += 0.1) {
      const double fd = (reference::activation_f(act, v + 1e-6) -
                         reference::activation_f(act, v - 1e-6)) / 2e-6;
      EXPECT_NEAR(reference::activation_df(act, v), fd, 1e-7) << activation_name(act) << " " << v;
    }
  }
  // Spot values pinning the definitions (gelu: exact erf form).
  EXPECT_NEAR(reference::activation_f(Activation::gelu, 1.0), 0.8413447460685429, 1e-15);
  EXPECT_NEAR(reference::activation_f(Activation::silu, 1.0), 0.7310585786300049, 1e-15);
  EXPECT_EQ(reference::activation_f(Activation::relu2, -2.0), 0.0);
  EXPECT_EQ(reference::activation_f(Activation::relu2, 3.0), 9.0);
  // swiglu_oai past its limits (grid off the kinks at g = 7 and u = +-7): the gate and the up
  // transform against their own differences.
  const Activation oai = Activation::swiglu_oai;
  for (double v = -10.05; v < 10.0; v += 0.1) {
    const double fd_f =
        (reference::activation_f(oai, v + 1e-6) - reference::activation_f(oai, v - 1e-6)) / 2e-6;
    EXPECT_NEAR(reference::activation_df(oai, v), fd_f, 1e-7) << "swiglu-oai gate " << v;
    const double fd_up =
        (reference::activation_up(oai, v + 1e-6) - reference::activation_up(oai, v - 1e-6)) / 2e-6;
    EXPECT_NEAR(reference::activation_dup(oai, v), fd_up, 1e-7) << "swiglu-oai up " << v;
  }
  EXPECT_EQ(reference::activation_f(oai, 9.0), reference::activation_f(oai, 7.0));
  EXPECT_EQ(reference::activation_up(oai, -9.0), -6.0);
  EXPECT_EQ(reference::activation_up(oai, 2.0), 3.0);
  EXPECT_EQ(reference::activation_up(Activation::swiglu, 9.0), 9.0);
}

struct RouterCase {
  const char* name;
  RouterConfig cfg;
};
std::vector<RouterCase> router_cases(int K) {
  std::vector<RouterCase> c;
  c.push_back({"softmax-topk", {RouterKind::softmax_topk, K, false, 0.0f, 0.0f}});
  c.push_back({"softmax-topk renormalized", {RouterKind::softmax_topk, K, true, 0.0f, 0.0f}});
  c.push_back({"topk-softmax", {RouterKind::topk_softmax, K, false, 0.0f, 0.0f}});
  c.push_back({"sigmoid-bias", {RouterKind::sigmoid_bias, K, false, 0.0f, 0.0f}});
  c.push_back({"sigmoid-bias renormalized", {RouterKind::sigmoid_bias, K, true, 0.0f, 0.0f}});
  c.push_back({"softmax-topk + aux + z loss", {RouterKind::softmax_topk, K, false, 0.01f, 0.001f}});
  return c;
}

TEST(ReferenceGradcheck, RouterPlusLayerDLogitsMatchCentralDifferences) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t T = 6, d = 4, n = 3, E = 5, K = 2;
  for (Activation act : {Activation::swiglu, Activation::gelu}) {
    const LayerConfig cfg{T, d, n, E, K, act, DType::f32};
    const int64_t R = cfg.w1_rows();
    const std::vector<double> x = normal64(T * d, seed + 1, 1.0);
    const std::vector<double> w1 = normal64(E * R * d, seed + 2, 0.5);
    const std::vector<double> w2 = normal64(E * d * n, seed + 3, 0.6);
    const std::vector<double> dout = normal64(T * d, seed + 4, 1.0);
    for (const RouterCase& rc : router_cases(K)) {
      SCOPED_TRACE(std::string(rc.name) + " " + activation_name(act));
      std::vector<double> logits = normal64(T * E, seed + 5, 1.5);
      const std::vector<double> bias = normal64(E, seed + 6, 0.3);
      const double* b = rc.cfg.kind == RouterKind::sigmoid_bias ? bias.data() : nullptr;
      const std::vector<int32_t> experts = reference::router_topk(rc.cfg, logits.data(), b, T, E);
      std::vector<int32_t> offsets(T + 1);
      for (int64_t t = 0; t <= T; ++t) offsets[t] = static_cast<int32_t>(t * K);

      auto weights_of = [&](const std::vector<double>& lg) {
        return reference::router_pair_weights(rc.cfg, lg.data(), b, T, E, offsets.data(),
                                              experts.data());
      };
      const std::vector<double> w = weights_of(logits);
      const reference::LayerReference g = reference::reference_layer(
          cfg, offsets.data(), experts.data(), w.data(), x.data(), w1.data(), w2.data(),
          dout.data());
      const std::vector<double> dlogits =
          reference::router_backward(rc.cfg, logits.data(), b, T, E, offsets.data(),
                                     experts.data(), g.d_pair_weights.data());
      auto loss = [&] {
        const std::vector<double> wp = weights_of(logits);
        const RouterLosses l = reference::router_losses(rc.cfg, logits.data(), T, E,
                                                        offsets.data(), experts.data());
        return reference::reference_loss(cfg, offsets.data(), experts.data(), wp.data(),
                                         x.data(), w1.data(), w2.data(), dout.data()) +
               l.aux_loss + l.z_loss;
      };
      // The selection is held fixed; make sure no step crosses a tie (it would change it).
      for (size_t i = 0; i < logits.size(); ++i) {
        for (double s : {kStep, -kStep}) {
          std::vector<double> lp = logits;
          lp[i] += s;
          ASSERT_EQ(reference::router_topk(rc.cfg, lp.data(), b, T, E), experts)
              << "a finite-difference step changes the selection; re-run (seed above)";
        }
      }
      expect_gradient("d_logits", logits, dlogits, loss);
    }
  }
}

// ---- the CPU fp32 layer against the float64 reference on the same tiny shapes ----

TEST(CpuLayerGradcheck, Fp32GradientsMatchFloat64Reference) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (Activation act : kActivations) {
    for (int64_t K : {1, 2, 3}) {
      SCOPED_TRACE(std::string(activation_name(act)) + " K=" + std::to_string(K));
      const int64_t T = 5, d = 4, n = 3, E = 3;
      const test::HostRouting r = tiny_routing(T, E, K, seed + K);
      const RoutingPlan plan = test::make_plan(r);
      const LayerConfig cfg{T, d, n, E, K, act, DType::f32};
      test::LayerTensors t(cfg, plan.S());
      t.randomize(seed);
      test::run_layer(cfg, plan, t, {});
      const reference::LayerReference ref = reference::reference_layer(
          cfg, r.view(), t.x.view(), t.w1.view(), t.w2.view(), t.d_out.view());
      // Reductions of length <= 6 in fp32: relative error a few 2^-24; 1e-5 as in test_layer.
      EXPECT_LE(test::rel_error(t.out, ref.out), 1e-5);
      EXPECT_LE(test::rel_error(t.dx, ref.dx), 1e-5);
      EXPECT_LE(test::rel_error(t.dw1, ref.dw1), 1e-5);
      EXPECT_LE(test::rel_error(t.dw2, ref.dw2), 1e-5);
      // d pair weights against their dot products' error scale (see test_layer.cpp).
      EXPECT_LE(test::scaled_error(t.d_pair_weights, ref.d_pair_weights, ref.d_pair_weights_abs),
                1e-5);
    }
  }
}

// ---- the CPU chain (route → plan → layer → router_backward) against the float64 chain ----

TEST(CpuLayerGradcheck, RouterPlusLayerDLogitsMatchFloat64Chain) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t T = 40, d = 12, n = 10, E = 6, K = 2;
  for (const RouterCase& rc : router_cases(K)) {
    SCOPED_TRACE(rc.name);
    const LayerConfig cfg{T, d, n, E, K, Activation::swiglu, DType::f32};
    test::HostTensor logits(DType::f32, {T, E}), bias(DType::f32, {E});
    logits.fill_random(seed + 11, 1.5f);
    bias.fill_random(seed + 12, 0.3f);
    const bool has_bias = rc.cfg.kind == RouterKind::sigmoid_bias;
    const TensorView bias_view = has_bias ? bias.view() : TensorView();

    Routing routing;
    route(rc.cfg, logits.view(), bias_view, routing);
    const RoutingPlan plan = [&] {
      RoutingPlan p;
      build_routing_plan(routing.view(), PlanBuilder::atomic_free, p);
      return p;
    }();
    test::LayerTensors t(cfg, plan.S());
    t.randomize(seed);
    test::run_layer(cfg, plan, t, {});
    test::HostTensor dlogits(DType::f32, {T, E});
    router_backward(rc.cfg, logits.view(), bias_view, routing.view(), t.d_pair_weights.view(),
                    dlogits.view());

    // float64 chain on the same (exactly widened) inputs.
    const std::vector<double> lg = logits.to_double(), bs = bias.to_double();
    const double* b = has_bias ? bs.data() : nullptr;
    const std::vector<int32_t> experts = reference::router_topk(rc.cfg, lg.data(), b, T, E);
    ASSERT_EQ(experts, std::vector<int32_t>(routing.pair_experts(),
                                            routing.pair_experts() + routing.P()));
    const std::vector<double> w = reference::router_pair_weights(
        rc.cfg, lg.data(), b, T, E, routing.pair_offsets(), experts.data());
    const std::vector<double> xd = t.x.to_double(), w1d = t.w1.to_double(),
                              w2d = t.w2.to_double(), dod = t.d_out.to_double();
    const reference::LayerReference g =
        reference::reference_layer(cfg, routing.pair_offsets(), experts.data(), w.data(),
                                   xd.data(), w1d.data(), w2d.data(), dod.data());
    const std::vector<double> dref = reference::router_backward(
        rc.cfg, lg.data(), b, T, E, routing.pair_offsets(), experts.data(),
        g.d_pair_weights.data());
    EXPECT_LE(test::scaled_error(t.d_pair_weights, g.d_pair_weights, g.d_pair_weights_abs), 1e-5);
    EXPECT_LE(test::rel_error(dlogits, dref), 1e-5);
  }
}

// Caller-supplied routing: ids and weights in, d pair weights out, no router in between.
TEST(CpuLayerGradcheck, SuppliedRoutingDPairWeightsMatchFloat64) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t T = 33, d = 10, n = 14, E = 5, K = 3;
  const test::HostRouting r = test::random_routing({T, E, K, 0, false}, seed);
  test::HostTensor ids(DType::i32, {T, K}), wts(DType::f32, {T, K});
  for (int64_t p = 0; p < T * K; ++p) {
    ids.set(p, r.experts[p]);
    wts.set(p, r.weights[p]);
  }
  Routing routing;
  routing_from_ids(ids.view(), wts.view(), E, routing);
  RoutingPlan plan;
  build_routing_plan(routing.view(), PlanBuilder::sort, plan);
  const LayerConfig cfg{T, d, n, E, K, Activation::geglu, DType::f32};
  test::LayerTensors t(cfg, plan.S());
  t.randomize(seed);
  test::run_layer(cfg, plan, t, {});
  const reference::LayerReference ref = reference::reference_layer(
      cfg, r.view(), t.x.view(), t.w1.view(), t.w2.view(), t.d_out.view());
  EXPECT_LE(test::scaled_error(t.d_pair_weights, ref.d_pair_weights, ref.d_pair_weights_abs),
            1e-5);
  EXPECT_LE(test::rel_error(t.dx, ref.dx), 1e-5);
}

}  // namespace
}  // namespace moeblaze
