// Regression tests for bad input, C++ API and C ABI: every bad argument
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
  std::vector<HostTensor*> outputs() { return {&t.out, &t.dx, &t.dw1, &t.dw2, &t.d_pair_weights}; }
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
    layer_forward(cfg, plan, t.x.view(), t.w1.view(), t.w2.view(), t.out.view(), saved, {mode, 1});
  }
  // Forward with the library's plan, then backward with `plan`.
  void backward(const RoutingPlan& plan, LayerMode mode = LayerMode::keep_h) {
    SavedForBackward saved;
    HostTensor out(cfg.dtype, {cfg.T, cfg.d});
    layer_forward(cfg, built, t.x.view(), t.w1.view(), t.w2.view(), out.view(), saved, {mode, 1});
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
                                   t.dw2.data(), static_cast<float*>(t.d_pair_weights.data()),
                                   nullptr, 0);
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
       [](HostPlan& p) { p.token_index_map[1] = p.token_index_map[0]; }, "plan.token_index_map[1]"},
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

// Calls check(corruption, fixture, corrupted copy of the fixture's plan) for every corruption.
template <typename Fn>
void for_each_corruption(const Fn& check) {
  for (const Corruption& k : corruptions()) {
    SCOPED_TRACE(k.name);
    Fixture f;
    HostPlan bad(f.built);
    k.apply(bad);
    check(k, f, bad);
  }
}

TEST(PlanValidation, CorruptedPlansRejectedByCppApiOutputsUntouched) {
  for_each_corruption([](const Corruption& k, Fixture& f, HostPlan& bad) {
    const RoutingPlan plan = bad.borrow();
    const std::vector<HostTensor> before = f.snapshot();
    expect_invalid([&] { f.forward(plan); }, k.message);
    expect_invalid([&] { f.forward(plan, LayerMode::materialized); }, k.message);
    expect_invalid([&] { f.backward(plan); }, k.message);
    expect_invalid([&] { f.backward(plan, LayerMode::recompute); }, k.message);
    f.expect_untouched(before);
  });
}

TEST(PlanValidation, CorruptedPlansRejectedByCAbiOutputsUntouched) {
  for_each_corruption([](const Corruption& k, Fixture& f, HostPlan& bad) {
    const std::vector<HostTensor> before = f.snapshot();
    const moeblaze_plan c = bad.c_plan();
    // On cpu the device check's two entries are the host validator (flags, workspace unused).
    for (int rc : {moeblaze_validate_plan(&c), f.c_forward(bad), f.c_backward(bad),
                   moeblaze_check_plan_async(&c, 0, nullptr, nullptr, 0, nullptr),
                   moeblaze_validate_plan_sync(&c, 0, nullptr)}) {
      EXPECT_EQ(rc, MOEBLAZE_ERR_INVALID_ARGUMENT);
      EXPECT_NE(std::string(moeblaze_last_error()).find(k.message), std::string::npos)
          << moeblaze_last_error();
    }
    f.expect_untouched(before);
  });
}

// Only a CUDA backward in keep_h / recompute runs without token_expert_indices: on the CPU every
// entry refuses a null one by name, through both APIs, and writes nothing.
TEST(PlanValidation, NullTokenExpertIndicesRefusedOnTheCpu) {
  Fixture f;
  HostPlan copy(f.built);
  copy.token_expert_indices.clear();
  const RoutingPlan plan = copy.borrow();
  const std::vector<HostTensor> before = f.snapshot();
  const std::string msg = "plan.token_expert_indices has no data (null pointer)";
  expect_invalid([&] { f.forward(plan); }, msg);
  expect_invalid([&] { f.backward(plan); }, msg);
  expect_invalid([&] { f.backward(plan, LayerMode::recompute); }, msg);
  expect_invalid([&] { f.backward(plan, LayerMode::materialized); }, msg);
  for (int rc : {f.c_forward(copy), f.c_backward(copy)}) {
    EXPECT_EQ(rc, MOEBLAZE_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(moeblaze_last_error()).find(msg), std::string::npos)
        << moeblaze_last_error();
  }
  f.expect_untouched(before);
}

// The CPU behaviour of the device plan check's entries: a valid plan passes, no workspace is
// needed, and LayerOptions::check_plan (a CUDA option) changes nothing on the CPU.
TEST(PlanValidation, DeviceCheckEntriesOnCpuMatchTheHostValidator) {
  Fixture f;
  HostPlan copy(f.built);
  const moeblaze_plan c = copy.c_plan();
  EXPECT_EQ(moeblaze_check_plan_async(&c, 0, nullptr, nullptr, 0, nullptr), MOEBLAZE_OK)
      << moeblaze_last_error();
  EXPECT_EQ(moeblaze_validate_plan_sync(&c, 0, nullptr), MOEBLAZE_OK) << moeblaze_last_error();
  uint64_t bytes = 1;
  EXPECT_EQ(moeblaze_plan_check_workspace_bytes(c.S, 0, &bytes), MOEBLAZE_OK);
  EXPECT_EQ(bytes, 0u);
  EXPECT_EQ(moeblaze_plan_check_workspace_bytes(-1, 0, &bytes), MOEBLAZE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moeblaze_last_error()).find("S (-1) must be in [0, 2^31)"),
            std::string::npos);
  EXPECT_EQ(moeblaze_check_plan_async(nullptr, 0, nullptr, nullptr, 0, nullptr),
            MOEBLAZE_ERR_INVALID_ARGUMENT);

  HostPlan bad(f.built);
  bad.expert_token_indices[3] = 1000000;
  const std::vector<HostTensor> before = f.snapshot();
  SavedForBackward saved;
  LayerOptions o{LayerMode::keep_h, 1};
  o.check_plan = true;
  expect_invalid([&] {
    layer_forward(f.cfg, bad.borrow(), f.t.x.view(), f.t.w1.view(), f.t.w2.view(),
                  f.t.out.view(), saved, o);
  }, "plan.expert_token_indices[3] (1000000) must be in [0, T = 40)");
  f.expect_untouched(before);
  layer_forward(f.cfg, copy.borrow(), f.t.x.view(), f.t.w1.view(), f.t.w2.view(), f.t.out.view(),
                saved, o);
  EXPECT_TRUE(saved.valid());
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

// ---- checked size arithmetic ----

constexpr int64_t k2to(int b) { return int64_t(1) << b; }

TEST(CheckedSizes, LayerConfigProductsDoNotWrap) {
  LayerConfig c{k2to(62), 16, 16, 8, 4, Activation::swiglu, DType::bf16};
  expect_invalid([&] { c.validate(); }, "T*K (4611686018427387904 * 4) overflows int64");
  c = {k2to(29), 16, 16, 8, 4, Activation::swiglu, DType::bf16};
  expect_invalid([&] { c.validate(); }, "T*K (2147483648) exceeds the int32 index range");
  c = {16, k2to(62), 16, 8, 2, Activation::swiglu, DType::bf16};
  expect_invalid([&] { c.validate(); }, "d (4611686018427387904) must be < 2^31");
  c = {16, 16, k2to(40), 8, 2, Activation::swiglu, DType::bf16};
  expect_invalid([&] { c.validate(); }, "n (1099511627776) must be < 2^31");
  c = {16, k2to(31) - 1, k2to(31) - 1, k2to(30), 2, Activation::swiglu, DType::f32};
  expect_invalid([&] { c.validate(); }, "E*w1_rows*d");
}

TEST(CheckedSizes, WorkspaceBytesThrowInsteadOfWrapping) {
  LayerConfig c{16, k2to(62), 16, 8, 2, Activation::swiglu, DType::bf16};
  expect_invalid([&] { layer_workspace_bytes(c, 32, LayerMode::keep_h, Device::cpu); },
                 "d (4611686018427387904) must be < 2^31");
  c = {16, k2to(30), k2to(30), 1, 1, Activation::relu, DType::bf16};
  expect_invalid([&] { layer_workspace_bytes(c, k2to(31) - 1, LayerMode::recompute, Device::cpu); },
                 "S*(w1_rows+n+d)");
  expect_invalid([&] { layer_workspace_bytes(c, -1, LayerMode::keep_h, Device::cpu); },
                 "S (-1) must be in [0, 2^31)");
}

TEST(CheckedSizes, HugeNullViewIsNotEmpty) {
  const TensorView x(nullptr, DType::bf16, Device::cpu, {k2to(20), k2to(44)});
  expect_invalid([&] { require_data(x, "x"); }, "x element count (1048576 * 17592186044416)");
  expect_invalid([&] { (void)x.numel(); }, "overflows int64");
}

TEST(CheckedSizes, RoutingSizesThrowInvalidArgumentNotBadAlloc) {
  std::vector<int32_t> ids{0, 1, 1, 0};
  std::vector<float> w{0.5f, 0.5f, 0.5f, 0.5f};
  Routing r;
  expect_invalid(
      [&] {
        routing_from_ids(host_view(ids.data(), {2, 2}), host_view(w.data(), {2, 2}), k2to(40), r);
      },
      "num_experts (1099511627776) must be < 2^31");
  // The largest valid E allocates nothing of size E (the repeat check is O(K)).
  EXPECT_NO_THROW(routing_from_ids(host_view(ids.data(), {2, 2}), host_view(w.data(), {2, 2}),
                                   k2to(31) - 1, r));
  // T*top_k overflowing int64 through the C ABI.
  const moeblaze_router_cfg rc{0, 8, 0};
  std::vector<float> logits(64);
  std::vector<int32_t> off(9), ex(64);
  std::vector<float> pw(64);
  const moeblaze_routing out{k2to(61), 8, 0, off.data(), ex.data(), pw.data()};
  EXPECT_EQ(moeblaze_route(&rc, logits.data(), 0, k2to(61), 8, nullptr, 0, nullptr, &out, nullptr),
            MOEBLAZE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moeblaze_last_error()).find("overflows int64"), std::string::npos)
      << moeblaze_last_error();
}

// Tokens with many pairs (> 32) take the sorting repeat check: same rule, same message.
TEST(CheckedSizes, RepeatCheckForManyPairsPerToken) {
  const int64_t K = 40, E = 64;
  std::vector<int32_t> ids(2 * K);
  std::vector<float> w(2 * K, 0.1f);
  for (int64_t k = 0; k < K; ++k) ids[k] = ids[K + k] = int32_t(k);
  ids[K + 37] = 5;  // token 1 repeats expert 5 (pair 5) at pair 37
  Routing r;
  expect_invalid(
      [&] {
        routing_from_ids(host_view(ids.data(), {2, K}), host_view(w.data(), {2, K}), E, r);
      },
      "ids: expert 5 appears twice in token 1");
  std::vector<int32_t> off{0, int32_t(K), int32_t(2 * K)};
  const RoutingView v{2, E, 2 * K, off.data(), ids.data(), w.data(), Device::cpu};
  expect_invalid([&] { validate_routing(v); },
                 "pair_experts: expert id 5 is repeated in token 1 (pairs 45 and 77)");
}

// ---- enum ranges ----

TEST(EnumRanges, OutOfRangeEnumsAreRejectedBeforeAnyWork) {
  for (LayerMode mode : {LayerMode::keep_h, LayerMode::recompute, LayerMode::materialized}) {
    Fixture f;
    f.cfg.activation = static_cast<Activation>(7);
    const std::vector<HostTensor> before = f.snapshot();
    expect_invalid([&] { f.forward(f.built, mode); }, "activation (7) is not an Activation");
    expect_invalid([&] { f.backward(f.built, mode); }, "activation (7) is not an Activation");
    f.expect_untouched(before);
  }
  LayerConfig c{8, 8, 8, 4, 2, Activation::relu, static_cast<DType>(9)};
  expect_invalid([&] { c.validate(); }, "dtype (9) must be fp32 or bf16");
  c.dtype = DType::f64;
  expect_invalid([&] { c.validate(); }, "dtype (fp64) must be fp32 or bf16");
  c.dtype = DType::f32;
  expect_invalid([&] { layer_workspace_bytes(c, 16, static_cast<LayerMode>(5), Device::cpu); },
                 "mode (5) is not a LayerMode");
  expect_invalid([&] { layer_workspace_bytes(c, 16, LayerMode::keep_h, static_cast<Device>(3)); },
                 "device (3) must be cpu or cuda");
  Fixture f;
  const std::vector<HostTensor> before = f.snapshot();
  expect_invalid([&] { f.forward(f.built, static_cast<LayerMode>(3)); },
                 "opts.mode (3) is not a LayerMode");
  f.expect_untouched(before);

  std::vector<float> logits(8 * 4, 0.5f);
  RouterConfig rc;
  rc.kind = static_cast<RouterKind>(7);
  Routing r;
  expect_invalid(
      [&] {
        route(rc, host_view(logits.data(), {8, 4}), TensorView(), r);
      },
      "router kind (7) is not a RouterKind");
  rc.kind = RouterKind::softmax_topk;
  route(rc, host_view(logits.data(), {8, 4}), TensorView(), r);
  TokenRoundingConfig tc;
  tc.mode = static_cast<RoundingMode>(9);
  Routing rounded;
  expect_invalid(
      [&] {
        token_round(rc, tc, host_view(logits.data(), {8, 4}), TensorView(), r.view(), rounded);
      },
      "token rounding mode (9) is not a RoundingMode");
  HostPlan plan(f.built);
  RoutingPlanView v = plan.borrow().view();
  v.device = static_cast<Device>(4);
  expect_invalid([&] { validate_routing_plan(v); }, "plan.device (4) must be cpu or cuda");
  // The C ABI checks its codes too.
  moeblaze_layer_cfg cc = test::c_layer_cfg(f.cfg, 0);
  cc.activation = 7;
  uint64_t bytes = 0;
  EXPECT_EQ(moeblaze_layer_workspace_bytes(&cc, 16, 0, &bytes), MOEBLAZE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moeblaze_last_error()).find("activation (7)"), std::string::npos);
}

// The two-call token rounding is CUDA-only (the CPU has no sync to save): each of its three C
// functions refuses the CPU by name, and its arguments are checked before the device is touched.
TEST(TokenRoundingCAbi, TwoCallPathRefusesTheCpuAndBadArguments) {
  uint64_t bytes = 0;
  EXPECT_EQ(moeblaze_token_round_workspace_bytes(8, 4, 0, &bytes), MOEBLAZE_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(moeblaze_last_error()).find("CUDA-only"), std::string::npos)
      << moeblaze_last_error();
  EXPECT_EQ(bytes, 0u);
  std::vector<float> logits(8 * 4, 0.5f);
  std::vector<int32_t> offsets(9, 0);
  moeblaze_router_cfg rc{};
  rc.top_k = 2;
  moeblaze_routing topk{8, 4, 0, offsets.data(), nullptr, nullptr};
  int64_t P = -1;
  std::vector<char> ws(64);
  EXPECT_EQ(moeblaze_token_round_count(&rc, 4, 0, 0, logits.data(), 0 /* fp32 */, 8, 4,
                                       nullptr, 0, nullptr, &topk, ws.data(), ws.size(), &P),
            MOEBLAZE_ERR_UNSUPPORTED);
  EXPECT_EQ(P, -1);
  EXPECT_EQ(moeblaze_token_round_fill(&rc, logits.data(), 0 /* fp32 */, 8, 4, 0, nullptr,
                                      ws.data(), ws.size(), &topk),
            MOEBLAZE_ERR_UNSUPPORTED);
  if (!moeblaze_has_cuda()) return;  // a CPU-only build refuses device 1 before any of this
  EXPECT_EQ(moeblaze_token_round_workspace_bytes(8, 0, 1, &bytes), MOEBLAZE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moeblaze_last_error()).find("E (0)"), std::string::npos);
  EXPECT_EQ(moeblaze_token_round_count(&rc, 0, 0, 0, logits.data(), 0 /* fp32 */, 8, 4,
                                       nullptr, 1, nullptr, &topk, ws.data(), ws.size(), &P),
            MOEBLAZE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moeblaze_last_error()).find("m_tile (0) must be >= 1"), std::string::npos)
      << moeblaze_last_error();
  EXPECT_EQ(moeblaze_token_round_count(&rc, 4, 7, 0, logits.data(), 0 /* fp32 */, 8, 4,
                                       nullptr, 1, nullptr, &topk, ws.data(), ws.size(), &P),
            MOEBLAZE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moeblaze_last_error()).find("rounding (7)"), std::string::npos);
  EXPECT_EQ(P, -1);
}

// ---- aliasing ----

TEST(Aliasing, OutputsOverlappingInputsOrEachOtherAreRejected) {
  for (LayerMode mode : {LayerMode::keep_h, LayerMode::recompute, LayerMode::materialized}) {
    SCOPED_TRACE(layer_mode_name(mode));
    Fixture f;
    SavedForBackward saved;
    HostTensor out(f.cfg.dtype, {f.cfg.T, f.cfg.d});
    layer_forward(f.cfg, f.built, f.t.x.view(), f.t.w1.view(), f.t.w2.view(), out.view(), saved,
                  {mode, 1});
    const auto backward = [&](LayerGrads g) {
      layer_backward(f.cfg, f.built, f.t.x.view(), f.t.w1.view(), f.t.w2.view(), f.t.d_out.view(),
                     saved, g, {mode, 1});
    };
    const LayerGrads good = f.t.grads();
    const HostTensor x0 = f.t.x, w10 = f.t.w1, dout0 = f.t.d_out;
    LayerGrads g = good;
    g.dx = f.t.x.view();  // in place over x
    expect_invalid([&] { backward(g); }, "dx overlaps x in memory");
    g = good;
    g.dx = f.t.d_out.view();
    expect_invalid([&] { backward(g); }, "dx overlaps d_out in memory");
    g = good;
    g.dw1 = f.t.w1.view();
    expect_invalid([&] { backward(g); }, "dw1 overlaps w1 in memory");
    g = good;
    g.dw2 = f.t.w2.view();
    expect_invalid([&] { backward(g); }, "dw2 overlaps w2 in memory");
    g = good;
    // d_pair_weights inside dw2's bytes (outputs overlapping each other).
    g.d_pair_weights.data = f.t.dw2.data();
    expect_invalid([&] { backward(g); }, "d_pair_weights overlaps dw2 in memory");
    g = good;
    g.dx.data = static_cast<char*>(f.t.x.data()) + 2;  // a partial overlap counts too
    expect_invalid([&] { backward(g); }, "dx overlaps x in memory");
    EXPECT_TRUE(test::bitwise_equal(f.t.x, x0));
    EXPECT_TRUE(test::bitwise_equal(f.t.w1, w10));
    EXPECT_TRUE(test::bitwise_equal(f.t.d_out, dout0));
    SavedForBackward s2;
    expect_invalid(
        [&] {
          layer_forward(f.cfg, f.built, f.t.x.view(), f.t.w1.view(), f.t.w2.view(), f.t.x.view(),
                        s2, {mode, 1});
        },
        "out overlaps x in memory");
    EXPECT_TRUE(test::bitwise_equal(f.t.x, x0));
  }
}

TEST(Aliasing, RouterBackwardRejectsInPlaceLogits) {
  std::vector<float> logits(8 * 4, 0.25f), dpw(16, 1.0f), dl(8 * 4, 0.0f);
  logits[1] = 1.0f;
  RouterConfig rc;
  Routing r;
  route(rc, host_view(logits.data(), {8, 4}), TensorView(), r);
  const std::vector<float> logits0 = logits;
  expect_invalid(
      [&] {
        router_backward(rc, host_view(logits.data(), {8, 4}), TensorView(), r.view(),
                        host_view(dpw.data(), {16}), host_view(logits.data(), {8, 4}));
      },
      "d_logits overlaps logits in memory");
  EXPECT_EQ(logits, logits0);
  EXPECT_NO_THROW(router_backward(rc, host_view(logits.data(), {8, 4}), TensorView(), r.view(),
                                  host_view(dpw.data(), {16}), host_view(dl.data(), {8, 4})));
}

TEST(Aliasing, CAbiRejectsInPlaceAndPlanOverlap) {
  Fixture f;
  HostPlan plan(f.built);
  const moeblaze_layer_cfg c = test::c_layer_cfg(f.cfg, 1);  // recompute: no h
  const moeblaze_plan p = plan.c_plan();
  const HostTensor x0 = f.t.x;
  EXPECT_EQ(moeblaze_layer_forward(&c, &p, 0, nullptr, f.t.x.data(), f.t.w1.data(), f.t.w2.data(),
                                   f.t.x.data(), nullptr, nullptr, 0),
            MOEBLAZE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moeblaze_last_error()).find("out overlaps x"), std::string::npos);
  EXPECT_EQ(moeblaze_layer_backward(&c, &p, 0, nullptr, f.t.x.data(), f.t.w1.data(), f.t.w2.data(),
                                    f.t.d_out.data(), nullptr, f.t.dx.data(), f.t.dw1.data(),
                                    f.t.dw2.data(),
                                    reinterpret_cast<float*>(plan.slot_weights.data()), nullptr, 0),
            MOEBLAZE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moeblaze_last_error()).find("d_pair_weights overlaps plan.slot_weights"),
            std::string::npos)
      << moeblaze_last_error();
  EXPECT_TRUE(test::bitwise_equal(f.t.x, x0));
}

// ---- thread counts (the strict-numbers checks, library side) ----

TEST(ThreadCounts, OutOfRangeThreadCountsAreInvalidArguments) {
  Fixture f;
  HostPlan plan(f.built);
  const std::vector<HostTensor> before = f.snapshot();
  for (int32_t threads : {-1, 1025, 100000, INT32_MAX}) {
    SCOPED_TRACE(threads);
    const moeblaze_layer_cfg c = test::c_layer_cfg(f.cfg, 1, threads);
    const moeblaze_plan p = plan.c_plan();
    const std::string rule = "num_threads (" + std::to_string(threads) + ") must be in [0, 1024]";
    uint64_t bytes = 7;
    EXPECT_EQ(moeblaze_layer_workspace_bytes(&c, plan.S, 0, &bytes), MOEBLAZE_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(moeblaze_last_error()).find(rule), std::string::npos)
        << moeblaze_last_error();
    EXPECT_EQ(bytes, 7u);
    EXPECT_EQ(moeblaze_layer_forward(&c, &p, 0, nullptr, f.t.x.data(), f.t.w1.data(), f.t.w2.data(),
                                     f.t.out.data(), nullptr, nullptr, 0),
              MOEBLAZE_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(moeblaze_last_error()).find(rule), std::string::npos);
    SavedForBackward saved;
    expect_invalid(
        [&] {
          layer_forward(f.cfg, f.built, f.t.x.view(), f.t.w1.view(), f.t.w2.view(), f.t.out.view(),
                        saved, {LayerMode::keep_h, threads});
        },
        "opts.num_threads (" + std::to_string(threads) + ") must be in [0, 1024]");
  }
  f.expect_untouched(before);
}

}  // namespace
}  // namespace moeblaze
