// Compute fp8_wgrad on the CPU (the weight-gradient GEMMs on e4m3 operands too, 128x1 tiles along
// each expert's slots): the tile geometry against the 1x128 rule on the transpose, the data path
// bitwise fp8's, the weight gradients within the e4m3 bound of float64 and moved by the
// quantization, both modes bitwise equal, and the option's names (thread counts:
// test_layer_fp8.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/layer_fixtures.hpp"
#include "common/test_util.hpp"
#include "core/fp8.hpp"
#include "cpu/fp8_operands.hpp"
#include "moeblaze/moeblaze.hpp"
#include "reference/reference_layer.hpp"

namespace moeblaze {
namespace {

using test::HostRouting;
using test::LayerTensors;

// As test_layer_fp8.cpp: one e4m3 operand costs ~0.036 relative; the weight gradients now pass
// two more quantized operands (~0.036 sqrt(4) in all), still far below a broken path's O(1).
constexpr double kFp8Tol = 0.1;

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// One expert's slots [s0, s0 + cnt) of a (S, cols) matrix, fake-quantized in 128x1 tiles, equal
// bit for bit to quantize_1x128 of that segment's transpose (rows = columns, tiles start at s0),
// dequantized: the tiles restart at each expert and end partial at its last slot.
TEST(Fp8Wgrad, TokenTilesAreTheOneByOneTwentyEightRuleOnEachExpertsTranspose) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t cols = 5;
  const std::vector<int64_t> counts = {0, 1, 128, 129, 300, 7};  // (E,) slots per expert
  int64_t S = 0;
  for (int64_t c : counts) S += c;
  std::vector<float> m(size_t(S * cols));  // (S, cols)
  for (float& v : m) v = normal(rng) * std::exp2(float(int(rng() % 9)) - 4.0f);
  m[3 * cols + 2] = 0.0f;
  std::vector<float> fq = m;
  int64_t s0 = 0;
  for (int64_t cnt : counts) {
    cpu::fp8::fake_quant_token_tiles(fq.data(), cols, s0, cnt);
    if (cnt > 0) {
      std::vector<float> t(size_t(cols * cnt));  // (cols, cnt): the segment's transpose
      for (int64_t s = 0; s < cnt; ++s)
        for (int64_t c = 0; c < cols; ++c) t[size_t(c * cnt + s)] = m[size_t((s0 + s) * cols + c)];
      std::vector<e4m3> q(t.size());
      std::vector<float> sc(size_t(cols * fp8_groups(cnt)));  // (cols, ceil(cnt/128))
      quantize_1x128(t.data(), cols, cnt, cnt, q.data(), sc.data());
      std::vector<float> back(t.size());
      dequantize_1x128(q.data(), sc.data(), cols, cnt, back.data());
      for (int64_t s = 0; s < cnt; ++s)
        for (int64_t c = 0; c < cols; ++c)
          ASSERT_EQ(bits(fq[size_t((s0 + s) * cols + c)]), bits(back[size_t(c * cnt + s)]))
              << "expert slot " << s << " of " << cnt << ", column " << c;
    }
    s0 += cnt;
  }
}

LayerConfig config(int64_t T, int64_t d, int64_t n, int64_t E, int64_t K, Activation act,
                   Compute compute) {
  LayerConfig cfg{T, d, n, E, K, act, DType::bf16};
  cfg.compute = compute;
  return cfg;
}

TEST(Fp8Wgrad, DataPathIsFp8sAndWeightGradientsStayWithinTheE4m3Bound) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct Case {
    int64_t T, d, n, E, K, empty;
    Activation act;
  };
  // Experts with 0 slots, fewer than 128 and more (partial last tiles); partial 1x128 tiles of d.
  for (const Case& c : {Case{300, 256, 128, 6, 2, 1, Activation::swiglu},
                        Case{257, 160, 96, 5, 3, 0, Activation::gelu},
                        Case{90, 128, 128, 8, 2, 2, Activation::swiglu_oai}}) {
    SCOPED_TRACE("T=" + std::to_string(c.T) + " d=" + std::to_string(c.d) + " " +
                 activation_name(c.act));
    const HostRouting routing = test::random_routing({c.T, c.E, c.K, c.empty, true}, rng());
    const RoutingPlan plan = test::make_plan(routing);
    const LayerConfig wcfg = config(c.T, c.d, c.n, c.E, c.K, c.act, Compute::fp8_wgrad);
    const LayerConfig dcfg = config(c.T, c.d, c.n, c.E, c.K, c.act, Compute::fp8);
    LayerTensors w(wcfg, plan.S());
    w.randomize(rng());
    LayerTensors data = w, rec = w;
    test::run_layer(wcfg, plan, w, {LayerMode::keep_h, 0});
    test::run_layer(dcfg, plan, data, {LayerMode::keep_h, 0});
    test::run_layer(wcfg, plan, rec, {LayerMode::recompute, 0});
    test::expect_same_results(w, rec);
    // Only the weight gradients' GEMMs change.
    EXPECT_TRUE(test::bitwise_equal(w.out, data.out));
    EXPECT_TRUE(test::bitwise_equal(w.dx, data.dx));
    EXPECT_TRUE(test::bitwise_equal(w.d_pair_weights, data.d_pair_weights));

    const reference::LayerReference ref = reference::reference_layer(
        wcfg, routing.view(), w.x.view(), w.w1.view(), w.w2.view(), w.d_out.view());
    test::expect_close("dw1", w.dw1, ref.dw1, kFp8Tol);
    test::expect_close("dw2", w.dw2, ref.dw2, kFp8Tol);
    // And they are quantized: about one e4m3 rounding per operand away from fp8's bf16 GEMMs.
    for (const auto& [name, a, b] :
         {std::tuple<const char*, const test::HostTensor*, const test::HostTensor*>{
              "dw1", &w.dw1, &data.dw1},
          {"dw2", &w.dw2, &data.dw2}}) {
      const double moved = test::rel_error(*a, b->to_double());
      EXPECT_GT(moved, 0.005) << name;
      EXPECT_LT(moved, 0.1) << name;
    }
  }
}

TEST(Fp8Wgrad, TheValueIsNamedParsedAndChecked) {
  EXPECT_EQ(parse_compute("fp8-wgrad"), Compute::fp8_wgrad);
  EXPECT_STREQ(compute_name(Compute::fp8_wgrad), "fp8-wgrad");
  EXPECT_TRUE(is_fp8(Compute::fp8_wgrad));
  EXPECT_FALSE(is_fp8(Compute::storage));
  LayerConfig cfg = config(16, 32, 16, 4, 2, Activation::swiglu, Compute::fp8_wgrad);
  cfg.dtype = DType::f32;
  try {
    cfg.validate();
    ADD_FAILURE() << "fp8-wgrad with fp32 storage was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("compute fp8-wgrad needs bf16 storage"),
              std::string::npos)
        << e.what();
  }
  cfg.dtype = DType::bf16;
  cfg.compute = static_cast<Compute>(3);
  try {
    cfg.validate();
    ADD_FAILURE() << "compute 3 was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("2 (fp8-wgrad)"), std::string::npos) << e.what();
  }
  // The weight cache serves it as it serves fp8 (the CPU quantizes every call: no codes kept).
  cfg.compute = Compute::fp8_wgrad;
  const HostRouting routing = test::random_routing({16, 4, 2, 0, false}, 7);
  const RoutingPlan plan = test::make_plan(routing);
  LayerTensors plain(cfg, plan.S());
  plain.randomize(3);
  LayerTensors cached = plain;
  Fp8WeightCache cache;
  LayerOptions with_cache{LayerMode::keep_h, 1};
  with_cache.fp8_weights = &cache;
  test::run_layer(cfg, plan, plain, {LayerMode::keep_h, 1});
  test::run_layer(cfg, plan, cached, with_cache);
  test::expect_same_results(plain, cached);
}

}  // namespace
}  // namespace moeblaze
