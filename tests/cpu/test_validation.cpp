// Regression tests of issue 19 ("trust under bad input"), C++ API and C ABI: every bad argument
// fails with InvalidArgument (C ABI: MOEBLAZE_ERR_INVALID_ARGUMENT) naming the argument and the
// rule, and leaves the outputs untouched (they are filled with a pattern before the call).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "common/layer_fixtures.hpp"
#include "common/plan_fixtures.hpp"
#include "moeblaze/capi.h"
#include "moeblaze/moeblaze.hpp"

namespace moeblaze {
namespace {

using test::expect_invalid;
using test::HostPlan;
using test::HostRouting;
using test::HostTensor;
using test::LayerTensors;

// A small valid layer: T = 40 tokens, K = 2 of E = 5 experts, bf16.
struct Fixture {
  LayerConfig cfg{40, 16, 12, 5, 2, Activation::swiglu, DType::bf16};
  HostRouting routing = test::random_routing({40, 5, 2, 0, false}, 19);
  RoutingPlan built = test::make_plan(routing);
  LayerTensors t{cfg, built.S()};
  Fixture() {
    t.randomize(7);
    for (HostTensor* o : outputs()) o->fill_pattern();
  }
  std::vector<HostTensor*> outputs() {
    return {&t.out, &t.dx, &t.dw1, &t.dw2, &t.d_pair_weights};
  }
  // Copies of the poisoned outputs, to compare against after a failed call.
  std::vector<HostTensor> snapshot() {
    std::vector<HostTensor> s;
    for (HostTensor* o : outputs()) s.push_back(*o);
    return s;
  }
  void expect_untouched(const std::vector<HostTensor>& before) {
    const std::vector<HostTensor*> now = outputs();
    for (size_t i = 0; i < now.size(); ++i)
      EXPECT_TRUE(test::bitwise_equal(*now[i], before[i])) << "output " << i << " was written";
  }
  void forward(const RoutingPlan& plan, LayerMode mode = LayerMode::keep_h) {
    SavedForBackward saved;
    layer_forward(cfg, plan, t.x.view(), t.w1.view(), t.w2.view(), t.out.view(), saved,
                  {mode, 1});
  }
  // Forward with the library's plan, then backward with `plan`.
  void backward(const RoutingPlan& plan, LayerMode mode = LayerMode::keep_h) {
    SavedForBackward saved;
    HostTensor out(cfg.dtype, {cfg.T, cfg.d});
    layer_forward(cfg, built, t.x.view(), t.w1.view(), t.w2.view(), out.view(), saved,
                  {mode, 1});
    layer_backward(cfg, plan, t.x.view(), t.w1.view(), t.w2.view(), t.d_out.view(), saved,
                   t.grads(), {mode, 1});
  }
  // The C ABI forward / backward over `plan` (keep_h; h in test storage).
  int c_forward(HostPlan& plan) {
    const moeblaze_layer_cfg c = test::c_layer_cfg(cfg, 0);
    const moeblaze_plan p = plan.c_plan();
    h.assign(size_t(plan.S * cfg.w1_rows()) * 2 + 16, 0);
    return moeblaze_layer_forward(&c, &p, 0, nullptr, t.x.data(), t.w1.data(), t.w2.data(),
                                  t.out.data(), h.data(), nullptr, 0);
  }
  int c_backward(HostPlan& plan) {
    const moeblaze_layer_cfg c = test::c_layer_cfg(cfg, 0);
    const moeblaze_plan p = plan.c_plan();
    h.assign(size_t(plan.S * cfg.w1_rows()) * 2 + 16, 0);
    return moeblaze_layer_backward(&c, &p, 0, nullptr, t.x.data(), t.w1.data(), t.w2.data(),
                                   t.d_out.data(), h.data(), t.dx.data(), t.dw1.data(),
                                   t.dw2.data(), static_cast<float*>(t.d_pair_weights.data()), nullptr, 0);
  }
  std::vector<unsigned char> h;
};

// One corruption of a valid plan and the words its error must contain.
struct Corruption {
  const char* name;
  std::function<void(HostPlan&)> apply;
  const char* message;
};

std::vector<Corruption> corruptions() {
  return {
      {"token id out of range", [](HostPlan& p) { p.expert_token_indices[3] = 1000000; },
       "plan.expert_token_indices[3] (1000000) must be in [0, T = 40)"},
      {"negative token id", [](HostPlan& p) { p.expert_token_indices[0] = -1; },
       "plan.expert_token_indices[0] (-1) must be in [0, T = 40)"},
      {"non-monotone expert offsets",
       [](HostPlan& p) { p.expert_token_offsets[2] = p.expert_token_offsets[1] - 1; },
       "plan.expert_token_offsets must be non-decreasing"},
      {"expert offsets not ending at S", [](HostPlan& p) { p.expert_token_offsets[5] += 1; },
       "plan.expert_token_offsets[E = 5]"},
      {"non-monotone token offsets", [](HostPlan& p) { p.token_pair_offsets[7] = 100000; },
       "plan.token_pair_offsets must be non-decreasing"},
      {"expert id out of range", [](HostPlan& p) { p.token_expert_indices[4] = 5; },
       "plan.token_expert_indices[4] (5) must be in [0, E = 5)"},
      {"token_index_map not a permutation",
       [](HostPlan& p) { p.token_index_map[1] = p.token_index_map[0]; },
       "plan.token_index_map[1]"},
      {"slot out of range", [](HostPlan& p) { p.token_index_map[2] = -7; },
       "plan.token_index_map[2] (-7) must be in [0, S = 80)"},
      {"views disagree", [](HostPlan& p) { std::swap(p.token_index_map[0], p.token_index_map[2]); },
       "plan.token_index_map[0]"},
      {"NaN slot weight", [](HostPlan& p) { p.slot_weights[5] = std::nanf(""); },
       "plan.slot_weights[5] (nan) must be finite"},
      {"infinite slot weight",
       [](HostPlan& p) { p.slot_weights[0] = std::numeric_limits<float>::infinity(); },
       "plan.slot_weights[0] (inf) must be finite"},
  };
}

TEST(PlanValidation, LibraryPlanPassesAndIsStamped) {
  Fixture f;
  EXPECT_TRUE(f.built.library_built());
  HostPlan copy(f.built);
  EXPECT_NO_THROW(validate_routing_plan(copy.borrow().view()));
  EXPECT_FALSE(copy.borrow().library_built());  // borrowing never carries the stamp
  const moeblaze_plan c = copy.c_plan();
  EXPECT_EQ(moeblaze_validate_plan(&c), MOEBLAZE_OK) << moeblaze_last_error();
}

TEST(PlanValidation, CorruptedPlansRejectedByCppApiOutputsUntouched) {
  for (const Corruption& k : corruptions()) {
    SCOPED_TRACE(k.name);
    Fixture f;
    HostPlan bad(f.built);
    k.apply(bad);
    const RoutingPlan plan = bad.borrow();
    const std::vector<HostTensor> before = f.snapshot();
    expect_invalid([&] { f.forward(plan); }, k.message);
    expect_invalid([&] { f.forward(plan, LayerMode::materialized); }, k.message);
    expect_invalid([&] { f.backward(plan); }, k.message);
    expect_invalid([&] { f.backward(plan, LayerMode::recompute); }, k.message);
    f.expect_untouched(before);
  }
}

TEST(PlanValidation, CorruptedPlansRejectedByCAbiOutputsUntouched) {
  for (const Corruption& k : corruptions()) {
    SCOPED_TRACE(k.name);
    Fixture f;
    HostPlan bad(f.built);
    k.apply(bad);
    const std::vector<HostTensor> before = f.snapshot();
    const moeblaze_plan c = bad.c_plan();
    for (int rc : {moeblaze_validate_plan(&c), f.c_forward(bad), f.c_backward(bad)}) {
      EXPECT_EQ(rc, MOEBLAZE_ERR_INVALID_ARGUMENT);
      EXPECT_NE(std::string(moeblaze_last_error()).find(k.message), std::string::npos)
          << moeblaze_last_error();
    }
    f.expect_untouched(before);
  }
}

// Writing through a library-built plan's accessors drops its stamp: the next use checks it.
TEST(PlanValidation, WritingThroughAccessorsDropsTheStamp) {
  Fixture f;
  f.built.slot_weights()[5] = std::nanf("");
  EXPECT_FALSE(f.built.library_built());
  const std::vector<HostTensor> before = f.snapshot();
  expect_invalid([&] { f.forward(f.built); }, "plan.slot_weights[5] (nan) must be finite");
  f.expect_untouched(before);
}

// A valid borrowed plan (the C ABI's way) gives the same result as the library's own plan.
TEST(PlanValidation, ValidBorrowedPlanMatchesBuiltPlan) {
  Fixture f;
  HostPlan copy(f.built);
  ASSERT_EQ(f.c_forward(copy), MOEBLAZE_OK) << moeblaze_last_error();
  const HostTensor via_c = f.t.out;
  f.forward(f.built);
  EXPECT_TRUE(test::bitwise_equal(via_c, f.t.out));
}

}  // namespace
}  // namespace moeblaze
