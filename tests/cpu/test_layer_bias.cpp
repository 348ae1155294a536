// Expert biases b1 / b2 (LayerBiases) on the CPU layer: against the float64 reference, bitwise
// invariance across modes and thread counts, and the front door's checks of the biases and their
// gradients (outputs untouched on error).
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>

#include "common/layer_fixtures.hpp"
#include "common/plan_fixtures.hpp"
#include "moeblaze/capi.h"
#include "common/test_util.hpp"
#include "moeblaze/moeblaze.hpp"
#include "reference/reference_layer.hpp"

namespace moeblaze {
namespace {

using test::HostRouting;
using test::HostTensor;
using test::LayerTensors;

// test_layer.cpp's tolerances: the bias adds no reduction longer than the slot sums already there.
double tol(DType dt) { return test::layer_tol(dt); }

// A layer call's tensors plus the biases and their gradients; which biases are present is `which`
// (1 = b1, 2 = b2, 3 = both).
struct BiasedTensors {
  LayerTensors t;
  HostTensor b1, b2, db1, db2;
  int which;
  BiasedTensors(const LayerConfig& cfg, int64_t S, int which_)
      : t(cfg, S),
        b1(cfg.dtype, {cfg.E, cfg.w1_rows()}),
        b2(cfg.dtype, {cfg.E, cfg.d}),
        db1(cfg.dtype, {cfg.E, cfg.w1_rows()}),
        db2(cfg.dtype, {cfg.E, cfg.d}),
        which(which_) {}
  void randomize(uint64_t seed) {
    t.randomize(seed);
    b1.fill_random(seed + 1, 0.5f);
    b2.fill_random(seed + 2, 0.5f);
    db1.fill_pattern();
    db2.fill_pattern();
  }
  LayerBiases biases() const {
    return {(which & 1) ? b1.view() : TensorView(), (which & 2) ? b2.view() : TensorView()};
  }
  LayerGrads grads() const {
    LayerGrads g = t.grads();
    if (which & 1) g.db1 = db1.view();
    if (which & 2) g.db2 = db2.view();
    return g;
  }
  void run(const LayerConfig& cfg, const RoutingPlan& plan, const LayerOptions& opts) {
    SavedForBackward saved;
    layer_forward(cfg, plan, t.x.view(), t.w1.view(), t.w2.view(), biases(), t.out.view(), saved,
                  opts);
    layer_backward(cfg, plan, t.x.view(), t.w1.view(), t.w2.view(), biases(), t.d_out.view(),
                   saved, grads(), opts);
  }
};

using test::expect_close;

bool all_equal(const BiasedTensors& a, const BiasedTensors& b) {
  return test::bitwise_equal(a.t.out, b.t.out) && test::bitwise_equal(a.t.dx, b.t.dx) &&
         test::bitwise_equal(a.t.dw1, b.t.dw1) && test::bitwise_equal(a.t.dw2, b.t.dw2) &&
         test::bitwise_equal(a.t.d_pair_weights, b.t.d_pair_weights) &&
         test::bitwise_equal(a.db1, b.db1) && test::bitwise_equal(a.db2, b.db2);
}

TEST(CpuLayerBias, ForwardBackwardMatchFloat64Reference) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct Case {
    const char* name;
    test::RoutingSpec spec;
    int64_t d, n;
  };
  // ReLU and swiglu_oai are left out: their kinks need test_layer.cpp's redraws.
  const Case cases[] = {{"skewed", {700, 8, 2, 0, true}, 33, 21},
                        {"empty-experts", {200, 10, 3, 4, false}, 24, 17},
                        {"long-k", {300, 3, 1, 0, false}, 270, 140},
                        {"T=0", {0, 5, 2, 0, false}, 12, 9}};
  for (const Case& c : cases) {
    const HostRouting routing = test::random_routing(c.spec, rng());
    const RoutingPlan plan = test::make_plan(routing);
    for (DType dt : {DType::f32, DType::bf16}) {
      for (Activation act : {Activation::swiglu, Activation::gelu, Activation::relu2}) {
        for (int which : {1, 2, 3}) {
          SCOPED_TRACE(std::string(c.name) + " " + activation_name(act) + " " + dtype_name(dt) +
                       " biases " + std::to_string(which));
          const LayerConfig cfg{c.spec.T, c.d, c.n, c.spec.E, c.spec.K, act, dt};
          BiasedTensors keep(cfg, plan.S(), which);
          keep.randomize(rng());
          BiasedTensors rec = keep;
          keep.run(cfg, plan, {LayerMode::keep_h, 0});
          rec.run(cfg, plan, {LayerMode::recompute, 0});
          // Recompute adds b1 to H as forward did, so both modes agree bit for bit.
          EXPECT_TRUE(all_equal(keep, rec));

          const LayerBiases b = keep.biases();
          const reference::LayerReference ref = reference::reference_layer(
              cfg, routing.view(), keep.t.x.view(), keep.t.w1.view(), keep.t.w2.view(),
              keep.t.d_out.view(), b.b1, b.b2);
          expect_close("out", keep.t.out, ref.out, tol(dt));
          expect_close("dx", keep.t.dx, ref.dx, tol(dt));
          expect_close("dw1", keep.t.dw1, ref.dw1, tol(dt));
          expect_close("dw2", keep.t.dw2, ref.dw2, tol(dt));
          if (which & 1) expect_close("db1", keep.db1, ref.db1, tol(dt));
          if (which & 2) expect_close("db2", keep.db2, ref.db2, tol(dt));
          EXPECT_LE(test::scaled_error(keep.t.d_pair_weights, ref.d_pair_weights,
                                       ref.d_pair_weights_abs),
                    tol(dt));
        }
      }
    }
  }
}

TEST(CpuLayerBias, BitwiseDeterministicAcrossThreadCounts) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const HostRouting routing = test::random_routing({1200, 8, 2, 0, true}, seed);
  const RoutingPlan plan = test::make_plan(routing);
  for (DType dt : {DType::bf16, DType::f32}) {
    for (LayerMode mode : {LayerMode::keep_h, LayerMode::recompute}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " " + layer_mode_name(mode));
      // d, 2n above kGradRows: the bias sums span several row blocks.
      const LayerConfig cfg{1200, 150, 70, 8, 2, Activation::geglu, dt};
      BiasedTensors first(cfg, plan.S(), 3);
      first.randomize(seed);
      first.run(cfg, plan, {mode, 2});
      for (int threads : {1, 3}) {
        SCOPED_TRACE("threads " + std::to_string(threads));
        BiasedTensors again = first;
        again.t.out.fill_pattern();
        again.t.dx.fill_pattern();
        again.db1.fill_pattern();
        again.db2.fill_pattern();
        again.run(cfg, plan, {mode, threads});
        EXPECT_TRUE(all_equal(first, again));
      }
    }
  }
}

// ---- argument validation ---------------------------------------------------------------------

struct BiasFixture {
  LayerConfig cfg{64, 16, 12, 6, 2, Activation::swiglu, DType::f32};
  HostRouting routing;
  RoutingPlan plan;
  BiasedTensors bt;
  SavedForBackward saved;
  explicit BiasFixture(uint64_t seed)
      : routing(test::random_routing({64, 6, 2, 0, false}, seed)),
        plan(test::make_plan(routing)),
        bt(cfg, plan.S(), 3) {
    bt.randomize(seed);
    layer_forward(cfg, plan, bt.t.x.view(), bt.t.w1.view(), bt.t.w2.view(), bt.biases(),
                  bt.t.out.view(), saved, {});
    bt.t.pattern_outputs();
  }
};

template <typename Ex, typename Fn>
void expect_rejected(BiasFixture& f, const std::string& needle, Fn&& call) {
  SCOPED_TRACE("expected message containing: " + needle);
  const BiasedTensors before = f.bt;
  try {
    call();
    ADD_FAILURE() << "no exception";
  } catch (const Ex& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  }
  EXPECT_TRUE(all_equal(before, f.bt));
}

TEST(CpuLayerBiasValidation, RejectsBadBiasesAndGradientsAndLeavesOutputsUntouched) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  BiasFixture f(seed);
  const TensorView x = f.bt.t.x.view(), w1 = f.bt.t.w1.view(), w2 = f.bt.t.w2.view(),
                   dout = f.bt.t.d_out.view(), out = f.bt.t.out.view();
  auto fwd = [&](LayerBiases b, const TensorView& o, LayerOptions opts) {
    return [&f, x, w1, w2, b, o, opts] {
      SavedForBackward s;
      layer_forward(f.cfg, f.plan, x, w1, w2, b, o, s, opts);
    };
  };
  auto bwd = [&](LayerBiases b, LayerGrads g, LayerOptions opts) {
    return [&f, x, w1, w2, dout, b, g, opts] {
      layer_backward(f.cfg, f.plan, x, w1, w2, b, dout, f.saved, g, opts);
    };
  };
  const LayerBiases good = f.bt.biases();
  const LayerGrads grads = f.bt.grads();

  LayerBiases b = good;
  b.b1.shape[1] = 12;
  expect_rejected<InvalidArgument>(f, "b1 has shape (6, 12), expected (6, 24)", fwd(b, out, {}));
  expect_rejected<InvalidArgument>(f, "b1 has shape (6, 12), expected (6, 24)",
                                   bwd(b, grads, {}));
  b = good;
  b.b2.dtype = DType::bf16;
  expect_rejected<InvalidArgument>(f, "b2 has dtype bf16, expected fp32", fwd(b, out, {}));
  b = good;
  b.b2.rank = 1;
  b.b2.shape[0] = 6 * 16;
  expect_rejected<InvalidArgument>(f, "b2 has shape (96,), expected (6, 16)", fwd(b, out, {}));
  b = good;
  b.b1.data = nullptr;
  expect_rejected<InvalidArgument>(f, "b1", fwd(b, out, {}));

  // Gradients: exactly when their bias is given, shaped like it.
  LayerGrads g = grads;
  g.db1 = TensorView();
  expect_rejected<InvalidArgument>(f, "grads.db1 is missing: b1 is given", bwd(good, g, {}));
  g = grads;
  expect_rejected<InvalidArgument>(f, "grads.db2 is given without b2",
                                   bwd({good.b1, TensorView()}, g, {}));
  g.db2.shape[1] = 15;
  expect_rejected<InvalidArgument>(f, "db2 has shape (6, 15), expected (6, 16)",
                                   bwd(good, g, {}));

  // Aliasing: biases are inputs, their gradients outputs.
  b = good;
  b.b2 = TensorView(out.data, DType::f32, Device::cpu, {6, 16});
  expect_rejected<InvalidArgument>(f, "out overlaps b2", fwd(b, out, {}));
  g = grads;
  g.db1 = f.bt.b1.view();
  expect_rejected<InvalidArgument>(f, "db1 overlaps b1", bwd(good, g, {}));
  g = grads;
  g.db2 = TensorView(f.bt.t.dx.data(), DType::f32, Device::cpu, {6, 16});
  expect_rejected<InvalidArgument>(f, "db2 overlaps dx", bwd(good, g, {}));
  g = grads;
  g.dx = TensorView(f.bt.db1.data(), DType::f32, Device::cpu, {64, 16});
  expect_rejected<InvalidArgument>(f, "overlaps", bwd(good, g, {}));

  // The materialized baseline takes no biases.
  expect_rejected<Unsupported>(f, "b1: the materialized baseline takes no expert biases",
                               fwd(good, out, {LayerMode::materialized, 0}));
  expect_rejected<Unsupported>(f, "b2: the materialized baseline takes no expert biases",
                               fwd({TensorView(), good.b2}, out, {LayerMode::materialized, 0}));
}

// Without biases the new overloads are the old ones, bit for bit.
TEST(CpuLayerBias, EmptyBiasesAreTheUnbiasedLayer) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const HostRouting routing = test::random_routing({300, 6, 2, 1, false}, seed);
  const RoutingPlan plan = test::make_plan(routing);
  const LayerConfig cfg{300, 24, 20, 6, 2, Activation::swiglu, DType::bf16};
  BiasedTensors biased(cfg, plan.S(), 0);
  biased.randomize(seed);
  LayerTensors plain = biased.t;
  biased.run(cfg, plan, {});
  test::run_layer(cfg, plan, plain, {});
  EXPECT_TRUE(test::bitwise_equal(plain.out, biased.t.out));
  EXPECT_TRUE(test::bitwise_equal(plain.dx, biased.t.dx));
  EXPECT_TRUE(test::bitwise_equal(plain.dw1, biased.t.dw1));
  EXPECT_TRUE(test::bitwise_equal(plain.d_pair_weights, biased.t.d_pair_weights));
}

// The C ABI's biased calls are the C++ API's, bit for bit; NULL biases take none, and a gradient
// pointer without its bias is refused.
TEST(CpuLayerBias, CAbiBiasedCallsMatchTheCppApi) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const HostRouting routing = test::random_routing({200, 6, 2, 1, false}, seed);
  const RoutingPlan built = test::make_plan(routing);
  const LayerConfig cfg{200, 24, 20, 6, 2, Activation::swiglu, DType::f32};
  BiasedTensors want(cfg, built.S(), 3);
  want.randomize(seed);
  BiasedTensors got = want;
  want.run(cfg, built, {LayerMode::recompute, 1});

  test::HostPlan plan(built);
  const moeblaze_layer_cfg c = test::c_layer_cfg(cfg, 1);  // recompute: no h
  const moeblaze_plan p = plan.c_plan();
  LayerTensors& t = got.t;
  ASSERT_EQ(moeblaze_layer_forward_biased(&c, &p, 0, nullptr, t.x.data(), t.w1.data(),
                                          t.w2.data(), got.b1.data(), got.b2.data(),
                                          t.out.data(), nullptr, nullptr, 0),
            MOEBLAZE_OK)
      << moeblaze_last_error();
  ASSERT_EQ(moeblaze_layer_backward_biased(
                &c, &p, 0, nullptr, t.x.data(), t.w1.data(), t.w2.data(), got.b1.data(),
                got.b2.data(), t.d_out.data(), nullptr, t.dx.data(), t.dw1.data(), t.dw2.data(),
                reinterpret_cast<float*>(t.d_pair_weights.data()), got.db1.data(),
                got.db2.data(), nullptr, 0),
            MOEBLAZE_OK)
      << moeblaze_last_error();
  EXPECT_TRUE(all_equal(want, got));

  EXPECT_EQ(moeblaze_layer_backward_biased(
                &c, &p, 0, nullptr, t.x.data(), t.w1.data(), t.w2.data(), nullptr, got.b2.data(),
                t.d_out.data(), nullptr, t.dx.data(), t.dw1.data(), t.dw2.data(),
                reinterpret_cast<float*>(t.d_pair_weights.data()), got.db1.data(),
                got.db2.data(), nullptr, 0),
            MOEBLAZE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moeblaze_last_error()).find("grads.db1 is given without b1"),
            std::string::npos)
      << moeblaze_last_error();
}

}  // namespace
}  // namespace moeblaze
