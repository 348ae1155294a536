// The C ABI's router losses (moeblaze_router_losses, moeblaze_router_backward_losses) on the CPU
// against the C++ router: the same losses and pair fractions as route(), bit for bit; the same
// d_logits as router_backward() with the coefficients in its config when both upstream
// gradients are 1, as moeblaze_router_backward when there are none, and linear in the upstream
// gradients; bad arguments refused with a message naming them, outputs untouched.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/test_util.hpp"
#include "moeblaze/capi.h"
#include "moeblaze/moeblaze.hpp"

namespace moeblaze {
namespace {

struct Case {
  int32_t kind;  // moeblaze_router_cfg.kind
  int32_t renormalize;
};
constexpr Case kCases[] = {{0, 0}, {0, 1}, {1, 0}, {2, 0}, {2, 1}};

// A top-K routing of random logits through the C ABI, on the CPU.
struct Routed {
  int64_t T, E, K;
  std::vector<float> logits, bias;  // (T, E), (E,) (sigmoid-bias only)
  std::vector<int32_t> offsets, experts;
  std::vector<float> weights;
  moeblaze_routing view() {
    return {T, E, T * K, offsets.data(), experts.data(), weights.data()};
  }
  const float* bias_ptr(int32_t kind) const { return kind == 2 ? bias.data() : nullptr; }
  RoutingView cpp_view() const {
    RoutingView v;
    v.T = T;
    v.E = E;
    v.P = T * K;
    v.pair_offsets = offsets.data();
    v.pair_experts = experts.data();
    v.pair_weights = weights.data();
    return v;
  }
};

// Bitwise equality of two float vectors, naming the first difference.
::testing::AssertionResult same_bits(const char* what, const std::vector<float>& got,
                                     const std::vector<float>& want) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  for (size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0)
      return ::testing::AssertionFailure()
             << what << ": [" << i << "] got " << got[i] << ", want " << want[i];
  return ::testing::AssertionSuccess();
}

Routed route_cpu(const moeblaze_router_cfg& cfg, int64_t T, int64_t E, uint64_t seed) {
  Routed r{T, E, cfg.top_k, test::random_normal(size_t(T * E), seed, 2.0f),
           test::random_normal(size_t(E), seed + 1, 0.3f), std::vector<int32_t>(size_t(T + 1)),
           std::vector<int32_t>(size_t(T * cfg.top_k)), std::vector<float>(size_t(T * cfg.top_k))};
  const moeblaze_routing out = r.view();
  EXPECT_EQ(moeblaze_route(&cfg, r.logits.data(), 0, T, E, r.bias_ptr(cfg.kind), 0, nullptr, &out,
                           nullptr),
            MOEBLAZE_OK)
      << moeblaze_last_error();
  return r;
}

RouterConfig cpp_config(const moeblaze_router_cfg& c, float aux, float z) {
  RouterConfig r;
  r.kind = RouterKind(c.kind);
  r.top_k = c.top_k;
  r.renormalize = c.renormalize != 0;
  r.aux_loss_coef = aux;
  r.z_loss_coef = z;
  return r;
}

// d_logits of moeblaze_router_backward_losses with upstream gradients ga, gz (nullptr: none).
std::vector<float> backward(const moeblaze_router_cfg& cfg, Routed& r, float aux, float z,
                            const std::vector<float>& g, const std::vector<float>& f,
                            const float* ga, const float* gz) {
  std::vector<float> d(size_t(r.T * r.E), -7.0f);
  const moeblaze_routing rt = r.view();
  EXPECT_EQ(moeblaze_router_backward_losses(&cfg, aux, z, r.logits.data(), 0, r.T, r.E,
                                            r.bias_ptr(cfg.kind), 0, nullptr, &rt, g.data(),
                                            f.data(), ga, gz, d.data(), nullptr),
            MOEBLAZE_OK)
      << moeblaze_last_error();
  return d;
}

TEST(RouterLossesCapi, LossesAndFractionsAreRoutesBits) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const Case& c : kCases)
    for (int64_t T : {1, 63, 700}) {
      SCOPED_TRACE(testing::Message() << "kind " << c.kind << " renorm " << c.renormalize
                                      << " T " << T);
      const int64_t E = 40;
      const moeblaze_router_cfg cfg{c.kind, 3, c.renormalize};
      Routed r = route_cpu(cfg, T, E, seed + uint64_t(T));
      // The C++ router's losses of the same logits and config.
      Routing cpp;
      const RouterConfig rc = cpp_config(cfg, 0.02f, 0.003f);
      const RouterLosses want =
          route(rc, host_view(r.logits.data(), {T, E}),
                cfg.kind == 2 ? host_view(r.bias.data(), {E}) : TensorView(), cpp);
      ASSERT_GT(want.aux_loss, 0.0);
      float aux = -1, z = -1;
      std::vector<float> f(size_t(E), -1.0f);
      const moeblaze_routing rt = r.view();
      ASSERT_EQ(moeblaze_router_losses(&cfg, 0.02f, 0.003f, r.logits.data(), 0, T, E,
                                       r.bias_ptr(cfg.kind), 0, nullptr, &rt, nullptr, 0, &aux,
                                       &z, f.data()),
                MOEBLAZE_OK)
          << moeblaze_last_error();
      EXPECT_EQ(aux, float(want.aux_loss));
      EXPECT_EQ(z, float(want.z_loss));
      std::vector<int64_t> count(size_t(E), 0);
      for (int32_t e : r.experts) ++count[size_t(e)];
      for (int64_t e = 0; e < E; ++e)
        EXPECT_EQ(f[size_t(e)], float(double(count[size_t(e)]) / double(T * 3)))
            << "f[" << e << "]";
      // A zero coefficient gives a zero loss; NULL outputs are not written.
      ASSERT_EQ(moeblaze_router_losses(&cfg, 0.0f, 0.003f, r.logits.data(), 0, T, E,
                                       r.bias_ptr(cfg.kind), 0, nullptr, &rt, nullptr, 0, &aux,
                                       nullptr, nullptr),
                MOEBLAZE_OK);
      EXPECT_EQ(aux, 0.0f);
      // A routing without pairs (token rounding may drop them all): f = 0 and aux = 0, no NaN.
      std::vector<int32_t> none(size_t(T + 1), 0);
      const moeblaze_routing empty{T, E, 0, none.data(), nullptr, nullptr};
      ASSERT_EQ(moeblaze_router_losses(&cfg, 0.02f, 0.003f, r.logits.data(), 0, T, E,
                                       r.bias_ptr(cfg.kind), 0, nullptr, &empty, nullptr, 0, &aux,
                                       &z, f.data()),
                MOEBLAZE_OK)
          << moeblaze_last_error();
      EXPECT_EQ(aux, 0.0f);
      EXPECT_EQ(z, float(want.z_loss));
      for (float v : f) EXPECT_EQ(v, 0.0f);
    }
}

TEST(RouterLossesCapi, BackwardIsRouterBackwardScaledByTheUpstreamGradients) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const int64_t T = 300, E = 24;
  for (const Case& c : kCases) {
    SCOPED_TRACE(testing::Message() << "kind " << c.kind << " renorm " << c.renormalize);
    const moeblaze_router_cfg cfg{c.kind, 4, c.renormalize};
    Routed r = route_cpu(cfg, T, E, seed);
    const std::vector<float> g = test::random_normal(r.experts.size(), seed + 7);
    std::vector<float> f(static_cast<size_t>(E));
    const moeblaze_routing rt = r.view();
    ASSERT_EQ(moeblaze_router_losses(&cfg, 0.02f, 0.003f, r.logits.data(), 0, T, E,
                                     r.bias_ptr(cfg.kind), 0, nullptr, &rt, nullptr, 0, nullptr,
                                     nullptr, f.data()),
              MOEBLAZE_OK);
    const float one = 1.0f, zero = 0.0f, ga = 2.5f, gz = -0.75f;
    // Both gradients 1: the C++ router_backward with the coefficients in its config, bitwise.
    std::vector<float> want(size_t(T * E));
    router_backward(cpp_config(cfg, 0.02f, 0.003f), host_view(r.logits.data(), {T, E}),
                    cfg.kind == 2 ? host_view(r.bias.data(), {E}) : TensorView(), r.cpp_view(),
                    host_view(g.data(), {int64_t(g.size())}), host_view(want.data(), {T, E}));
    EXPECT_TRUE(same_bits("g = (1, 1)", backward(cfg, r, 0.02f, 0.003f, g, f, &one, &one), want));
    // No upstream gradients: moeblaze_router_backward's d_logits, bitwise.
    std::vector<float> plain(size_t(T * E));
    ASSERT_EQ(moeblaze_router_backward(&cfg, r.logits.data(), 0, T, E, r.bias_ptr(cfg.kind), 0,
                                       nullptr, &rt, g.data(), plain.data(), nullptr),
              MOEBLAZE_OK);
    EXPECT_TRUE(same_bits("no g", backward(cfg, r, 0.02f, 0.003f, g, f, nullptr, nullptr), plain));
    // Linear in (g_aux, g_z): d(ga, gz) = d0 + ga (d(1, 0) - d0) + gz (d(0, 1) - d0).
    const std::vector<float> d10 = backward(cfg, r, 0.02f, 0.003f, g, f, &one, &zero);
    const std::vector<float> d01 = backward(cfg, r, 0.02f, 0.003f, g, f, &zero, &one);
    const std::vector<float> got = backward(cfg, r, 0.02f, 0.003f, g, f, &ga, &gz);
    double scale = 0, worst = 0;
    for (float v : got) scale = std::max(scale, std::fabs(double(v)));
    for (size_t i = 0; i < got.size(); ++i) {
      const double lin = double(plain[i]) + ga * (double(d10[i]) - plain[i]) +
                         gz * (double(d01[i]) - plain[i]);
      worst = std::max(worst, std::fabs(got[i] - lin) / (std::fabs(lin) + 1e-3 * scale));
    }
    EXPECT_LE(worst, 1e-5);
  }
}

TEST(RouterLossesCapi, BadArgumentsAreNamedAndOutputsUntouched) {
  const moeblaze_router_cfg cfg{0, 2, 0};
  Routed r = route_cpu(cfg, 16, 8, test::fresh_seed());
  const moeblaze_routing rt = r.view();
  float aux = -1, z = -1;
  const auto losses = [&](float ac, float zc) {
    return moeblaze_router_losses(&cfg, ac, zc, r.logits.data(), 0, 16, 8, nullptr, 0, nullptr,
                                  &rt, nullptr, 0, &aux, &z, nullptr);
  };
  const auto expect_error = [&](int rc, const std::string& text) {
    EXPECT_EQ(rc, MOEBLAZE_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(moeblaze_last_error()).find(text), std::string::npos)
        << moeblaze_last_error();
    EXPECT_EQ(aux, -1.0f);
    EXPECT_EQ(z, -1.0f);
  };
  expect_error(losses(-0.5f, 0.0f), "aux_coef (-0.5) must be finite and >= 0");
  expect_error(losses(0.0f, NAN), "z_coef (nan) must be finite and >= 0");
  r.experts[3] = 8;
  expect_error(losses(0.01f, 0.0f), "pair_experts[3] = 8 is out of range [0, 8)");
  r.experts[3] = 1;
  const moeblaze_routing wrong{15, 8, 32, r.offsets.data(), r.experts.data(), r.weights.data()};
  EXPECT_EQ(moeblaze_router_losses(&cfg, 0.01f, 0.0f, r.logits.data(), 0, 16, 8, nullptr, 0,
                                   nullptr, &wrong, nullptr, 0, &aux, &z, nullptr),
            MOEBLAZE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moeblaze_last_error()).find("routing has (T, E) = (15, 8)"),
            std::string::npos)
      << moeblaze_last_error();
  // The backward: f is required with the aux term on; a non-finite upstream gradient is refused.
  std::vector<float> g(32, 0.5f), d(16 * 8, -7.0f);
  const float one = 1.0f, inf = INFINITY;
  EXPECT_EQ(moeblaze_router_backward_losses(&cfg, 0.01f, 0.0f, r.logits.data(), 0, 16, 8,
                                            nullptr, 0, nullptr, &rt, g.data(), nullptr, &one,
                                            nullptr, d.data(), nullptr),
            MOEBLAZE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moeblaze_last_error()).find("f is NULL"), std::string::npos);
  std::vector<float> f(8, 0.25f);
  EXPECT_EQ(moeblaze_router_backward_losses(&cfg, 0.01f, 0.0f, r.logits.data(), 0, 16, 8,
                                            nullptr, 0, nullptr, &rt, g.data(), f.data(), &inf,
                                            nullptr, d.data(), nullptr),
            MOEBLAZE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moeblaze_last_error()).find("must be finite"), std::string::npos);
  for (float v : d) ASSERT_EQ(v, -7.0f);
}

}  // namespace
}  // namespace moeblaze
