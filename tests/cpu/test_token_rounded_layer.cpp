// The layer driven by a token-rounded routing (SonicMoE §5): tokens lose pairs, gain
// expert-choice pairs, or end with none. Forward and backward must match the float64 reference
// on the rounded routing, tokens without pairs get exactly zero output and input gradient, and
// d logits through router_backward match the float64 chain.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/layer_fixtures.hpp"
#include "common/test_util.hpp"
#include "moeblaze/moeblaze.hpp"
#include "reference/reference_layer.hpp"
#include "reference/reference_router.hpp"

namespace moeblaze {
namespace {

struct RoundedCase {
  RoundingMode mode;
  int64_t K;
  int m_tile;
};

TEST(TokenRoundedLayer, ForwardBackwardMatchFloat64Reference) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t T = 700, E = 8, d = 24, n = 20;
  // DOWN with K = 1 leaves tokens with no pair at all; UP adds expert-choice pairs beyond K;
  // NR-f and SR-f do some of each.
  const RoundedCase cases[] = {{RoundingMode::down, 1, 32},
                               {RoundingMode::up, 2, 32},
                               {RoundingMode::nearest_freq, 2, 24},
                               {RoundingMode::stochastic_freq, 3, 16}};
  bool saw_zero = false, saw_fewer = false, saw_more = false;
  for (const RoundedCase& rc : cases) {
    for (DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(std::string(rounding_name(rc.mode)) + " K=" + std::to_string(rc.K) +
                   " m_tile=" + std::to_string(rc.m_tile) + " " + dtype_name(dt));
      const RouterConfig router{RouterKind::softmax_topk, static_cast<int>(rc.K), false, 0.0f,
                                0.0f};
      const TokenRoundingConfig rounding{rc.m_tile, rc.mode, seed};
      test::HostTensor logits(DType::f32, {T, E});
      logits.fill_random(seed + 1, 1.0f);
      Routing topk, rounded;
      route(router, logits.view(), TensorView(), topk);
      token_round(router, rounding, logits.view(), TensorView(), topk.view(), rounded);

      // The routing really is rounded: every expert count a multiple of m_tile, per-token pair
      // counts deviate from K.
      std::vector<int64_t> count(E, 0);
      for (int64_t p = 0; p < rounded.P(); ++p) ++count[rounded.pair_experts()[p]];
      for (int64_t e = 0; e < E; ++e) ASSERT_EQ(count[e] % rc.m_tile, 0) << "expert " << e;
      int64_t zero = 0, fewer = 0, more = 0;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t c = rounded.pair_offsets()[t + 1] - rounded.pair_offsets()[t];
        zero += c == 0;
        fewer += c < rc.K;
        more += c > rc.K;
      }
      saw_zero |= zero > 0;
      saw_fewer |= fewer > 0;
      saw_more |= more > 0;
      EXPECT_GT(zero + fewer + more, 0) << "rounding changed no token's pairs";

      RoutingPlan plan;
      build_routing_plan(rounded.view(), PlanBuilder::atomic_free, plan);
      ASSERT_EQ(plan.S(), rounded.P());
      const LayerConfig cfg{T, d, n, E, rc.K, Activation::swiglu, dt};
      test::LayerTensors keep(cfg, plan.S());
      keep.randomize(seed + 2);
      test::LayerTensors rec = keep;
      test::run_layer(cfg, plan, keep, {LayerMode::keep_h, 0});
      test::run_layer(cfg, plan, rec, {LayerMode::recompute, 0});
      test::expect_same_results(keep, rec);

      const reference::LayerReference ref = reference::reference_layer(
          cfg, rounded.view(), keep.x.view(), keep.w1.view(), keep.w2.view(),
          keep.d_out.view());
      // Tolerances as in test_layer.cpp (fp32 1e-5, bf16 1e-2 relative Frobenius).
      const double tol = dt == DType::bf16 ? 1e-2 : 1e-5;
      EXPECT_LE(test::rel_error(keep.out, ref.out), tol);
      EXPECT_LE(test::rel_error(keep.dx, ref.dx), tol);
      EXPECT_LE(test::rel_error(keep.dw1, ref.dw1), tol);
      EXPECT_LE(test::rel_error(keep.dw2, ref.dw2), tol);
      EXPECT_LE(test::scaled_error(keep.d_pair_weights, ref.d_pair_weights,
                                   ref.d_pair_weights_abs),
                tol);

      // Tokens without pairs: output and input gradient exactly zero (written, not skipped:
      // the buffers started as a non-zero pattern).
      for (int64_t t = 0; t < T; ++t) {
        if (rounded.pair_offsets()[t + 1] != rounded.pair_offsets()[t]) continue;
        for (int64_t j = 0; j < d; ++j) {
          ASSERT_EQ(keep.out.at(t * d + j), 0.0) << "token " << t;
          ASSERT_EQ(keep.dx.at(t * d + j), 0.0) << "token " << t;
        }
      }

      if (dt != DType::f32) continue;
      // d logits through the router's backward, against the float64 chain on the same pairs.
      test::HostTensor dlogits(DType::f32, {T, E});
      router_backward(router, logits.view(), TensorView(), rounded.view(),
                      keep.d_pair_weights.view(), dlogits.view());
      const std::vector<double> lg = logits.to_double();
      const std::vector<double> dref = reference::router_backward(
          router, lg.data(), nullptr, T, E, rounded.pair_offsets(), rounded.pair_experts(),
          ref.d_pair_weights.data());
      EXPECT_LE(test::rel_error(dlogits, dref), 1e-5);
    }
  }
  EXPECT_TRUE(saw_zero) << "no token ended with zero pairs";
  EXPECT_TRUE(saw_fewer) << "no token lost a pair";
  EXPECT_TRUE(saw_more) << "no token gained a pair";
}

}  // namespace
}  // namespace moeblaze
