// A NULL where the C ABI needs a pointer fails with MOEBLAZE_ERR_INVALID_ARGUMENT and a message
// that names the argument and its rule, never an internal one (Buffer::borrow's "null data for
// 80 bytes" once reached a caller who passed a NULL plan array), and writes no output.
// Every required pointer of the layer calls and of the plan entry points, one NULL at a time.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/layer_fixtures.hpp"
#include "common/plan_fixtures.hpp"
#include "moeblaze/capi.h"
#include "moeblaze/moeblaze.hpp"

namespace moeblaze {
namespace {

using test::HostPlan;
using test::HostTensor;
using test::LayerTensors;

// A small valid layer on the CPU: T = 20 tokens, K = 2 of E = 4 experts (S = 40), bf16.
struct Layer {
  LayerConfig cfg{20, 16, 16, 4, 2, Activation::swiglu, DType::bf16};
  RoutingPlan built = test::make_plan(test::random_routing({20, 4, 2, 1, true}, 31));
  LayerTensors t{cfg, built.S()};
  std::vector<unsigned char> h;
  Layer() {
    t.randomize(5);
    h.assign(size_t(built.S() * cfg.w1_rows()) * 2 + 16, 0);
  }
  std::vector<HostTensor> outputs() const { return {t.out, t.dx, t.dw1, t.dw2, t.d_pair_weights}; }
};

// The layer call's pointer arguments; `null` names the one set to NULL ("" = none).
struct Args {
  const void *x, *w1, *w2, *d_out;
  void *out, *h, *dx, *dw1, *dw2;
  float* dpw;
};
Args args_of(Layer& L, const std::string& null) {
  Args a{L.t.x.data(),  L.t.w1.data(),  L.t.w2.data(),  L.t.d_out.data(),
         L.t.out.data(), L.h.data(),     L.t.dx.data(),  L.t.dw1.data(),
         L.t.dw2.data(), static_cast<float*>(L.t.d_pair_weights.data())};
  if (null == "x") a.x = nullptr;
  if (null == "w1") a.w1 = nullptr;
  if (null == "w2") a.w2 = nullptr;
  if (null == "d_out") a.d_out = nullptr;
  if (null == "out") a.out = nullptr;
  if (null == "h") a.h = nullptr;
  if (null == "dx") a.dx = nullptr;
  if (null == "dw1") a.dw1 = nullptr;
  if (null == "dw2") a.dw2 = nullptr;
  if (null == "d_pair_weights") a.dpw = nullptr;
  return a;
}

// rc must be INVALID_ARGUMENT with a message containing every needle and no internal name.
void expect_named(int rc, const std::vector<std::string>& needles) {
  const std::string msg = moeblaze_last_error();
  EXPECT_EQ(rc, MOEBLAZE_ERR_INVALID_ARGUMENT) << msg;
  for (const std::string& n : needles)
    EXPECT_NE(msg.find(n), std::string::npos) << "'" << msg << "' does not name '" << n << "'";
  EXPECT_EQ(msg.find("Buffer::borrow"), std::string::npos) << msg;
}

void expect_untouched(const Layer& L, const std::vector<HostTensor>& before) {
  const std::vector<HostTensor> now = L.outputs();
  for (size_t i = 0; i < now.size(); ++i)
    EXPECT_TRUE(test::bitwise_equal(now[i], before[i])) << "output " << i << " was written";
}

int forward(const moeblaze_plan* p, const Args& a, const moeblaze_layer_cfg* c) {
  return moeblaze_layer_forward(c, p, 0, nullptr, a.x, a.w1, a.w2, a.out, a.h, nullptr, 0);
}
int backward(const moeblaze_plan* p, const Args& a, const moeblaze_layer_cfg* c) {
  return moeblaze_layer_backward(c, p, 0, nullptr, a.x, a.w1, a.w2, a.d_out, a.h, a.dx, a.dw1,
                                 a.dw2, a.dpw, nullptr, 0);
}

// Each of the plan's arrays NULL in turn, through every entry point that takes a plan: the
// message names the array and its rule (the (S,) arrays are needed while S > 0; the offsets
// always).
TEST(CAbiNullPointers, EachNullPlanArrayIsNamedWithItsRule) {
  struct Array {
    const char* name;
    int32_t* moeblaze_plan::*i32;
    float* moeblaze_plan::*f32;
    const char* rule;
  };
  const Array arrays[] = {
      {"expert_token_offsets", &moeblaze_plan::expert_token_offsets, nullptr, "(E+1,)"},
      {"expert_token_indices", &moeblaze_plan::expert_token_indices, nullptr, "S = 40 slots"},
      {"slot_weights", nullptr, &moeblaze_plan::slot_weights, "S = 40 slots"},
      {"token_pair_offsets", &moeblaze_plan::token_pair_offsets, nullptr, "(T+1,)"},
      {"token_index_map", &moeblaze_plan::token_index_map, nullptr, "S = 40 slots"},
      {"token_expert_indices", &moeblaze_plan::token_expert_indices, nullptr,
       "only a CUDA layer backward"},
  };
  for (const Array& arr : arrays) {
    SCOPED_TRACE(arr.name);
    Layer L;
    HostPlan hp(L.built);
    moeblaze_plan p = hp.c_plan();
    if (arr.i32) p.*arr.i32 = nullptr;
    if (arr.f32) p.*arr.f32 = nullptr;
    const std::vector<std::string> needles{std::string("plan.") + arr.name, "null pointer",
                                           arr.rule};
    const moeblaze_layer_cfg keep = test::c_layer_cfg(L.cfg, 0, 1);
    const moeblaze_layer_cfg recompute = test::c_layer_cfg(L.cfg, 1, 1);
    const std::vector<HostTensor> before = L.outputs();
    const Args a = args_of(L, "");
    Args no_h = a;
    no_h.h = nullptr;
    expect_named(forward(&p, a, &keep), needles);
    expect_named(forward(&p, no_h, &recompute), needles);
    expect_named(backward(&p, a, &keep), needles);
    expect_named(backward(&p, no_h, &recompute), needles);
    expect_named(moeblaze_validate_plan(&p), needles);
    expect_named(moeblaze_check_plan_async(&p, 0, nullptr, nullptr, 0, nullptr), needles);
    expect_named(moeblaze_validate_plan_sync(&p, 0, nullptr), needles);
    expect_untouched(L, before);

    // The plan builds write into the plan's arrays: the same names before anything is written.
    test::HostRouting r = test::random_routing({20, 4, 2, 0, false}, 3);
    moeblaze_routing cr{r.T, r.E, r.P(), r.offsets.data(), r.experts.data(), r.weights.data()};
    expect_named(moeblaze_build_plan(&cr, 0, nullptr, &p, nullptr, 0, nullptr), needles);
    std::vector<int32_t> ids(r.experts);
    std::vector<float> w(r.weights);
    expect_named(moeblaze_plan_from_ids(ids.data(), MOEBLAZE_IDS_INT32, w.data(), 0, 20, 2, 4, 0,
                                        nullptr, &p, nullptr, 0, nullptr),
                 needles);
  }
}

// With S = 0 (no token routed) the (S,) arrays may be NULL; the offsets still may not.
TEST(CAbiNullPointers, EmptyPlanTakesNullSlotArraysButNotNullOffsets) {
  LayerConfig cfg{3, 16, 16, 4, 2, Activation::swiglu, DType::f32};
  std::vector<int32_t> eto(5, 0), tpo(4, 0);
  moeblaze_plan p{3, 4, 0, eto.data(), nullptr, nullptr, tpo.data(), nullptr, nullptr};
  EXPECT_EQ(moeblaze_validate_plan(&p), MOEBLAZE_OK) << moeblaze_last_error();
  LayerTensors t(cfg, 0);
  t.randomize(2);
  const moeblaze_layer_cfg c = test::c_layer_cfg(cfg, 1, 1);
  EXPECT_EQ(moeblaze_layer_forward(&c, &p, 0, nullptr, t.x.data(), t.w1.data(), t.w2.data(),
                                   t.out.data(), nullptr, nullptr, 0),
            MOEBLAZE_OK)
      << moeblaze_last_error();
  for (double v : t.out.to_double()) ASSERT_EQ(v, 0.0) << "a token with no pair outputs zeros";
  p.token_pair_offsets = nullptr;
  expect_named(moeblaze_validate_plan(&p), {"plan.token_pair_offsets", "null pointer", "(T+1,)"});
  p.token_pair_offsets = tpo.data();
  p.expert_token_offsets = nullptr;
  expect_named(moeblaze_layer_forward(&c, &p, 0, nullptr, t.x.data(), t.w1.data(), t.w2.data(),
                                      t.out.data(), nullptr, nullptr, 0),
               {"plan.expert_token_offsets", "null pointer", "(E+1,)"});
}

// Each tensor argument of the layer calls NULL in turn (and cfg, plan): named, outputs untouched.
TEST(CAbiNullPointers, EachNullLayerArgumentIsNamed) {
  for (const char* name : {"x", "w1", "w2", "out", "h"}) {
    SCOPED_TRACE(std::string("forward ") + name);
    Layer L;
    HostPlan hp(L.built);
    const moeblaze_plan p = hp.c_plan();
    const moeblaze_layer_cfg c = test::c_layer_cfg(L.cfg, 0, 1);
    const std::vector<HostTensor> before = L.outputs();
    expect_named(forward(&p, args_of(L, name), &c), {name});
    expect_untouched(L, before);
  }
  for (const char* name : {"x", "w1", "w2", "d_out", "h", "dx", "dw1", "dw2", "d_pair_weights"}) {
    SCOPED_TRACE(std::string("backward ") + name);
    Layer L;
    HostPlan hp(L.built);
    const moeblaze_plan p = hp.c_plan();
    const moeblaze_layer_cfg c = test::c_layer_cfg(L.cfg, 0, 1);
    const std::vector<HostTensor> before = L.outputs();
    expect_named(backward(&p, args_of(L, name), &c), {name});
    expect_untouched(L, before);
  }
  Layer L;
  HostPlan hp(L.built);
  const moeblaze_plan p = hp.c_plan();
  const moeblaze_layer_cfg c = test::c_layer_cfg(L.cfg, 0, 1);
  const Args a = args_of(L, "");
  expect_named(forward(nullptr, a, &c), {"plan is NULL"});
  expect_named(backward(nullptr, a, &c), {"plan is NULL"});
  expect_named(forward(&p, a, nullptr), {"cfg is NULL"});
  expect_named(backward(&p, a, nullptr), {"cfg is NULL"});
}

}  // namespace
}  // namespace moeblaze
