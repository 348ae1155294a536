// Non-finite values on the CPU backend. The policy, as the code implements it:
//  - Router logits and the sigmoid-bias router's bias must be finite: the CPU throws
//    InvalidArgument naming the first non-finite entry before writing any output; CUDA (no host
//    sync) raises flags[2] and still writes expert ids inside [0, E), so nothing downstream reads
//    out of bounds; the caller checks the flags (moeblaze_routing_flags_error) before using the
//    routing. The router's backward likewise refuses (CPU) or flags (CUDA) non-finite
//    d_pair_weights.
//  - A plan's slot weights must be finite (validate_routing_plan; the plan builds flag them).
//  - The layer's data (x, w1, w2, biases, d_out) is not scanned (a pass over it would cost a
//    step's bandwidth): IEEE arithmetic carries a NaN or inf as torch does. One in x[t] reaches
//    out[t], dx[t], d_pair_weights of t's pairs and dw1, dw2 of t's experts; one in w1[e] or
//    w2[e] the tokens routed to e; one in d_out[t] the gradients. The exception: relu and relu2
//    map a NaN pre-activation to 0 (x > 0 ? x : 0, derivative 0), where torch.relu keeps NaN, so
//    out[t] stays finite there. swiglu_oai's clamps keep NaN in the forward, as torch.clamp does,
//    and pass no gradient where u is not inside (-7, 7) (a select, as torch.clamp's backward
//    masks): a NaN or inf u gives dH_u = 0, not NaN, so dW1's up rows stay finite where the
//    float64 reference (which multiplies by the mask) has NaN; its gate rows carry the NaN.
//  - The GPU follows the same arithmetic: its non-finite outputs are the CPU backend's
//    (tests/gpu/test_trust_gpu.cpp).
// Here: every activation, both modes, fp32 and bf16, NaN / inf / -inf planted in each input,
// against the float64 reference: the same non-finite elements and the finite ones within the
// layer's tolerance; and the propagation rule above for x, element by element.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/layer_fixtures.hpp"
#include "common/nonfinite_fixtures.hpp"
#include "common/plan_fixtures.hpp"
#include "common/test_util.hpp"
#include "moeblaze/moeblaze.hpp"
#include "reference/reference_layer.hpp"

namespace moeblaze {
namespace {

using test::HostTensor;
using test::LayerTensors;
using test::Plant;
using test::PlantIn;

constexpr Activation kActivations[] = {Activation::swiglu, Activation::geglu,
                                       Activation::relu,   Activation::silu,
                                       Activation::gelu,   Activation::relu2,
                                       Activation::swiglu_oai};

int64_t numel_of(const LayerTensors& t, PlantIn where) {
  switch (where) {
    case PlantIn::x: return t.x.numel();
    case PlantIn::w1: return t.w1.numel();
    case PlantIn::w2: return t.w2.numel();
    case PlantIn::d_out: return t.d_out.numel();
  }
  return 0;
}

TEST(NonFinite, LayerOutputsCarryThemLikeTheFloat64Reference) {
  const uint64_t seed = 20261205;
  std::mt19937_64 rng(seed);
  int64_t cases = 0;
  for (Activation act : kActivations)
    for (DType dt : {DType::f32, DType::bf16})
      for (PlantIn where : {PlantIn::x, PlantIn::w1, PlantIn::w2, PlantIn::d_out})
        for (float value : test::nonfinite_values()) {
          const LayerConfig cfg{24, 32, 16, 6, 2, act, dt};
          const test::HostRouting routing = test::random_routing({24, 6, 2, 1, true}, rng());
          const RoutingPlan plan = test::make_plan(routing);
          LayerTensors base(cfg, plan.S());
          base.randomize(rng());
          const Plant p{where, int64_t(rng() % uint64_t(numel_of(base, where))), value};
          test::plant(base, p);
          SCOPED_TRACE(std::string(activation_name(act)) + " " + dtype_name(dt) + " " +
                       p.describe());
          const reference::LayerReference ref = reference::reference_layer(
              cfg, routing.view(), base.x.view(), base.w1.view(), base.w2.view(),
              base.d_out.view());
          for (LayerMode mode : {LayerMode::keep_h, LayerMode::recompute}) {
            SCOPED_TRACE(layer_mode_name(mode));
            LayerTensors t = base;
            test::run_layer(cfg, plan, t, {mode, 2});
            test::expect_nonfinite_like(t, ref.out, ref.dx, ref.dw1, ref.dw2, ref.d_pair_weights,
                                        ref.d_pair_weights_abs, test::rel_tolerance(dt),
                                        act != Activation::swiglu_oai);
            ++cases;
          }
        }
  std::cout << "[nonfinite] " << cases << " planted steps checked\n";
}

// A NaN in x[t]: torch's pattern, element by element (gated and smooth activations), and relu's
// exception (out[t] is 0, not NaN).
TEST(NonFinite, NanInOneTokenReachesExactlyItsRowsAndExperts) {
  for (Activation act : kActivations) {
    SCOPED_TRACE(activation_name(act));
    const LayerConfig cfg{16, 32, 16, 5, 2, act, DType::f32};
    const test::HostRouting routing = test::random_routing({16, 5, 2, 1, false}, 77);
    const RoutingPlan plan = test::make_plan(routing);
    LayerTensors t(cfg, plan.S());
    t.randomize(78);
    const int64_t tok = 9, d = cfg.d, n = cfg.n, R = cfg.w1_rows();
    t.x.set(tok * d + 3, std::nan(""));
    test::run_layer(cfg, plan, t, {LayerMode::keep_h, 1});
    std::set<int32_t> experts;
    for (int32_t q = routing.offsets[tok]; q < routing.offsets[tok + 1]; ++q)
      experts.insert(routing.experts[q]);
    const bool relu_like = act == Activation::relu || act == Activation::relu2;
    for (int64_t r = 0; r < cfg.T; ++r)
      for (int64_t i = 0; i < d; ++i) {
        const double o = t.out.at(r * d + i), g = t.dx.at(r * d + i);
        if (r != tok) {
          ASSERT_TRUE(std::isfinite(o) && std::isfinite(g)) << "token " << r << " column " << i;
        } else if (relu_like) {
          ASSERT_EQ(o, 0.0) << "relu(NaN) is 0 here (torch.relu keeps NaN), column " << i;
        } else {
          ASSERT_TRUE(std::isnan(o)) << "out[" << tok << ", " << i << "] = " << o;
          ASSERT_TRUE(std::isnan(g)) << "dx[" << tok << ", " << i << "] = " << g;
        }
      }
    for (int64_t e = 0; e < cfg.E; ++e) {
      const bool hit = experts.count(int32_t(e)) != 0;
      int64_t bad1 = 0, bad2 = 0;
      for (int64_t k = 0; k < R * d; ++k) bad1 += !std::isfinite(t.dw1.at(e * R * d + k));
      for (int64_t k = 0; k < d * n; ++k) bad2 += !std::isfinite(t.dw2.at(e * d * n + k));
      if (!hit) {
        EXPECT_EQ(bad1 + bad2, 0) << "expert " << e << " does not see the token";
      } else {
        // dW1 = dH x^T: x's NaN column reaches every row even where dH is 0 (0 * NaN = NaN).
        EXPECT_GE(bad1, R) << "expert " << e;
        if (act == Activation::swiglu_oai) {
          EXPECT_GE(bad1, n * d) << "expert " << e << ": the gate rows";
          EXPECT_EQ(bad2, d * n) << "expert " << e;
        } else if (!relu_like) {
          EXPECT_EQ(bad1, R * d) << "expert " << e;
          EXPECT_EQ(bad2, d * n) << "expert " << e;
        }
      }
    }
    const float* dpw = static_cast<const float*>(t.d_pair_weights.view().data);
    for (int32_t q = 0; q < routing.offsets[cfg.T]; ++q) {
      const bool mine = q >= routing.offsets[tok] && q < routing.offsets[tok + 1];
      if (!mine) EXPECT_TRUE(std::isfinite(dpw[q])) << "pair " << q;
      if (mine && !relu_like) EXPECT_TRUE(std::isnan(dpw[q])) << "pair " << q;
    }
  }
}

// The router refuses non-finite logits by name before it writes anything, and its backward
// refuses non-finite d_pair_weights.
TEST(NonFinite, RouterRefusesNonFiniteLogitsAndGradients) {
  const int64_t T = 6, E = 8;
  for (float bad : test::nonfinite_values()) {
    std::vector<float> logits(T * E);
    for (size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(float(i));
    logits[3 * E + 5] = bad;
    RouterConfig r;
    r.top_k = 2;
    Routing out;
    test::expect_invalid([&] { route(r, host_view(logits.data(), {T, E}), {}, out); },
                         "logits must be finite");
    logits[3 * E + 5] = 0.25f;
    route(r, host_view(logits.data(), {T, E}), {}, out);
    std::vector<float> dpw(T * 2, 0.5f), dlogits(T * E, 7.0f);
    dpw[7] = bad;
    const std::vector<float> before = dlogits;
    test::expect_invalid(
        [&] {
          router_backward(r, host_view(logits.data(), {T, E}), {}, out.view(),
                          host_view(dpw.data(), {T * 2}), host_view(dlogits.data(), {T, E}));
        },
        "gradients must be finite");
    EXPECT_EQ(dlogits, before) << "d_logits was written";
  }
}

}  // namespace
}  // namespace moeblaze
