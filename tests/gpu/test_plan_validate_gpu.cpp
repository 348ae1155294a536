// The device-side plan check (src/cuda/routing/plan_validate.cu) against the CPU validator: a
// valid plan raises nothing; each corruption raises flags[kFlagBadPlan] only, and the
// synchronous check (C++ and C ABI) throws the CPU validator's exact message; the layer with
// LayerOptions::check_plan rejects a bad caller plan before writing any output.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "common/layer_fixtures.hpp"
#include "common/plan_fixtures.hpp"
#include "core/plan_validation.hpp"
#include "cuda/cuda_backend.hpp"
#include "gpu/gpu_test_util.hpp"
#include "moeblaze/capi.h"
#include "moeblaze/moeblaze.hpp"

namespace moeblaze::test {
namespace {

// A host plan's six arrays uploaded as a caller-filled device plan.
struct DevPlan {
  int64_t T, E, S;
  DevMem eto, eti, sw, tpo, tei, tim;
  explicit DevPlan(const HostPlan& h)
      : T(h.T), E(h.E), S(h.S), eto(h.expert_token_offsets), eti(h.expert_token_indices),
        sw(h.slot_weights), tpo(h.token_pair_offsets), tei(h.token_expert_indices),
        tim(h.token_index_map) {}
  RoutingPlan borrow() const {
    return RoutingPlan::borrow(Device::cuda, T, E, S, eto.as<int32_t>(), eti.as<int32_t>(),
                               sw.as<float>(), tpo.as<int32_t>(), tei.as<int32_t>(),
                               tim.as<int32_t>());
  }
  moeblaze_plan c_plan() const {
    return moeblaze_plan{T, E, S, eto.as<int32_t>(), eti.as<int32_t>(), sw.as<float>(),
                         tpo.as<int32_t>(), tei.as<int32_t>(), tim.as<int32_t>()};
  }
};

// The async check's flags (kPlanFlagCount int32) for a device plan, through the C++ entry.
std::vector<int32_t> async_flags(const DevPlan& d) {
  DevMem ws(cuda::plan_check_workspace_bytes(d.S));
  DevMem flags(std::vector<int32_t>(cuda::kPlanFlagCount, 0));
  cuda::validate_plan_async(d.borrow().view(), ws.p, ws.bytes, flags.as<int32_t>(), nullptr);
  return flags.download<int32_t>();
}

// The CPU validator's message for a host plan ("" when it passes).
std::string cpu_message(HostPlan& h) {
  try {
    validate_routing_plan(h.borrow().view());
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

struct Corruption {
  const char* name;
  std::function<void(HostPlan&)> apply;
  const char* message;  // words the error must contain
};

// T = 64 tokens, K = 2 of E = 8 experts: S = 128.
std::vector<Corruption> corruptions() {
  return {
      {"expert offsets out of order",
       [](HostPlan& p) { p.expert_token_offsets[2] = p.expert_token_offsets[1] - 1; },
       "plan.expert_token_offsets must be non-decreasing"},
      {"token offsets out of order", [](HostPlan& p) { p.token_pair_offsets[7] = 100000; },
       "plan.token_pair_offsets must be non-decreasing"},
      {"expert offsets wrong total", [](HostPlan& p) { p.expert_token_offsets[8] += 1; },
       "plan.expert_token_offsets[E = 8]"},
      {"token offsets wrong total", [](HostPlan& p) { p.token_pair_offsets[64] -= 1; },
       "plan.token_pair_offsets[T = 64] (127) must equal S (128)"},
      {"expert offsets not from 0", [](HostPlan& p) { p.expert_token_offsets[0] = 1; },
       "plan.expert_token_offsets[0] (1) must be 0"},
      {"token id out of range", [](HostPlan& p) { p.expert_token_indices[3] = 1000000; },
       "plan.expert_token_indices[3] (1000000) must be in [0, T = 64)"},
      {"negative token id", [](HostPlan& p) { p.expert_token_indices[0] = -1; },
       "plan.expert_token_indices[0] (-1) must be in [0, T = 64)"},
      {"expert id out of range", [](HostPlan& p) { p.token_expert_indices[4] = 8; },
       "plan.token_expert_indices[4] (8) must be in [0, E = 8)"},
      {"slot out of range", [](HostPlan& p) { p.token_index_map[2] = -7; },
       "plan.token_index_map[2] (-7) must be in [0, S = 128)"},
      {"views not inverse (swapped slots)",
       [](HostPlan& p) { std::swap(p.token_index_map[0], p.token_index_map[2]); },
       "plan.token_index_map[0]"},
      {"token_index_map not a permutation",
       [](HostPlan& p) { p.token_index_map[1] = p.token_index_map[0]; },
       "plan.token_index_map[1]"},
      {"NaN slot weight", [](HostPlan& p) { p.slot_weights[5] = std::nanf(""); },
       "plan.slot_weights[5] (nan) must be finite"},
      {"infinite slot weight",
       [](HostPlan& p) { p.slot_weights[0] = std::numeric_limits<float>::infinity(); },
       "plan.slot_weights[0] (inf) must be finite"},
  };
}

HostPlan fixture_plan() {
  return HostPlan(make_plan(random_routing({64, 8, 2, 0, false}, 19)));
}

TEST(PlanValidateGpu, ValidPlansRaiseNoFlag) {
  MOEBLAZE_REQUIRE_GPU();
  for (const RoutingSpec& spec :
       {RoutingSpec{64, 8, 2, 0, false}, RoutingSpec{1, 1, 1, 0, false},
        RoutingSpec{0, 4, 1, 0, false}, RoutingSpec{300, 16, 4, 5, true},
        RoutingSpec{4096, 128, 8, 0, true}}) {
    SCOPED_TRACE("T " + std::to_string(spec.T) + " E " + std::to_string(spec.E));
    HostPlan h(make_plan(random_routing(spec, 7)));
    const DevPlan d(h);
    EXPECT_EQ(async_flags(d), std::vector<int32_t>(cuda::kPlanFlagCount, 0));
    EXPECT_NO_THROW(cuda::validate_plan(d.borrow().view(), nullptr));
    const moeblaze_plan c = d.c_plan();
    EXPECT_EQ(moeblaze_validate_plan_sync(&c, 1, nullptr), MOEBLAZE_OK) << moeblaze_last_error();
  }
}

TEST(PlanValidateGpu, EachCorruptionRaisesTheFlagAndTheSyncCheckNamesTheRule) {
  MOEBLAZE_REQUIRE_GPU();
  for (const Corruption& k : corruptions()) {
    SCOPED_TRACE(k.name);
    HostPlan bad = fixture_plan();
    k.apply(bad);
    const std::string want = cpu_message(bad);
    ASSERT_NE(want.find(k.message), std::string::npos) << want;
    const DevPlan d(bad);
    std::vector<int32_t> expect(cuda::kPlanFlagCount, 0);
    expect[cuda::kFlagBadPlan] = 1;
    EXPECT_EQ(async_flags(d), expect);
    EXPECT_EQ(expect_invalid([&] { cuda::validate_plan(d.borrow().view(), nullptr); }, k.message),
              want);

    // The C ABI: the async entry raises flags[4] only; the synchronous one returns the message.
    const moeblaze_plan c = d.c_plan();
    uint64_t ws_bytes = 0;
    ASSERT_EQ(moeblaze_plan_check_workspace_bytes(c.S, 1, &ws_bytes), MOEBLAZE_OK);
    DevMem ws(ws_bytes);
    DevMem flags(std::vector<int32_t>(cuda::kPlanFlagCount, 0));
    ASSERT_EQ(moeblaze_check_plan_async(&c, 1, nullptr, ws.p, ws_bytes, flags.as<int32_t>()),
              MOEBLAZE_OK)
        << moeblaze_last_error();
    EXPECT_EQ(flags.download<int32_t>(), expect);
    EXPECT_EQ(moeblaze_validate_plan_sync(&c, 1, nullptr), MOEBLAZE_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(moeblaze_last_error()), want);
  }
}

// Captured in a CUDA graph and replayed over new contents: the flag follows the contents.
TEST(PlanValidateGpu, AsyncCheckIsGraphCapturable) {
  MOEBLAZE_REQUIRE_GPU();
  HostPlan good = fixture_plan();
  HostPlan bad = good;
  bad.expert_token_indices[3] = 1000000;
  const DevPlan d(good);
  DevMem ws(cuda::plan_check_workspace_bytes(d.S));
  DevMem flags(std::vector<int32_t>(cuda::kPlanFlagCount, 0));
  cudaStream_t s;
  MOEBLAZE_TEST_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  MOEBLAZE_TEST_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  cuda::validate_plan_async(d.borrow().view(), ws.p, ws.bytes, flags.as<int32_t>(), s);
  MOEBLAZE_TEST_CUDA(cudaStreamEndCapture(s, &g));
  MOEBLAZE_TEST_CUDA(cudaGraphInstantiate(&ge, g, 0));
  MOEBLAZE_TEST_CUDA(cudaGraphLaunch(ge, s));
  MOEBLAZE_TEST_CUDA(cudaStreamSynchronize(s));
  EXPECT_EQ(flags.download<int32_t>()[cuda::kFlagBadPlan], 0);
  MOEBLAZE_TEST_CUDA(cudaMemcpy(d.eti.p, bad.expert_token_indices.data(), d.eti.bytes,
                                cudaMemcpyHostToDevice));
  MOEBLAZE_TEST_CUDA(cudaGraphLaunch(ge, s));
  MOEBLAZE_TEST_CUDA(cudaStreamSynchronize(s));
  EXPECT_EQ(flags.download<int32_t>()[cuda::kFlagBadPlan], 1);
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  cudaStreamDestroy(s);
}

// The layer with LayerOptions::check_plan: a bad caller plan throws before any output is
// written; a valid one gives the library plan's bits.
TEST(PlanValidateGpu, LayerCheckPlanLeavesOutputsUntouched) {
  MOEBLAZE_REQUIRE_GPU();
  LayerConfig c{64, 128, 128, 8, 2, Activation::swiglu, DType::bf16};
  HostPlan good = fixture_plan();
  const size_t es = dtype_size(c.dtype);
  HostTensor hx(c.dtype, {c.T, c.d}), hw1(c.dtype, {c.E, c.w1_rows(), c.d}),
      hw2(c.dtype, {c.E, c.d, c.n}), hdo(c.dtype, {c.T, c.d});
  hx.fill_random(1, 1.0f);
  hw1.fill_random(2, 0.1f);
  hw2.fill_random(3, 0.1f);
  hdo.fill_random(4, 1.0f);
  const DevMem x(hx.bytes), w1(hw1.bytes), w2(hw2.bytes), d_out(hdo.bytes);
  const auto tv = [&](const DevMem& m, std::initializer_list<int64_t> dims, DType dt) {
    return TensorView(m.p, dt, Device::cuda, dims);
  };
  const std::vector<unsigned char> poison_out(size_t(c.T * c.d) * es, 0xAB);
  const std::vector<unsigned char> poison_w1(size_t(c.E * c.w1_rows() * c.d) * es, 0xAB);
  const std::vector<unsigned char> poison_w2(size_t(c.E * c.d * c.n) * es, 0xAB);
  const std::vector<unsigned char> poison_pw(size_t(good.S) * 4, 0xAB);
  LayerOptions opts;
  opts.check_plan = true;

  // The valid borrowed plan, checked, against the same plan unchecked: the same bits.
  const DevPlan dgood(good);
  DevMem out_checked(poison_out), out_plain(poison_out);
  SavedForBackward saved;
  {
    SavedForBackward s2;
    layer_forward(c, dgood.borrow(), tv(x, {c.T, c.d}, c.dtype),
                  tv(w1, {c.E, c.w1_rows(), c.d}, c.dtype), tv(w2, {c.E, c.d, c.n}, c.dtype),
                  tv(out_plain, {c.T, c.d}, c.dtype), s2, LayerOptions{});
  }
  layer_forward(c, dgood.borrow(), tv(x, {c.T, c.d}, c.dtype),
                tv(w1, {c.E, c.w1_rows(), c.d}, c.dtype), tv(w2, {c.E, c.d, c.n}, c.dtype),
                tv(out_checked, {c.T, c.d}, c.dtype), saved, opts);
  EXPECT_EQ(out_checked.download<unsigned char>(), out_plain.download<unsigned char>());

  for (const Corruption& k : corruptions()) {
    SCOPED_TRACE(k.name);
    HostPlan bad = good;
    k.apply(bad);
    const DevPlan d(bad);
    DevMem out(poison_out), dx(poison_out), dw1(poison_w1), dw2(poison_w2), dpw(poison_pw);
    SavedForBackward s_bad;
    expect_invalid(
        [&] {
          layer_forward(c, d.borrow(), tv(x, {c.T, c.d}, c.dtype),
                        tv(w1, {c.E, c.w1_rows(), c.d}, c.dtype),
                        tv(w2, {c.E, c.d, c.n}, c.dtype), tv(out, {c.T, c.d}, c.dtype), s_bad,
                        opts);
        },
        k.message);
    EXPECT_FALSE(s_bad.valid());
    const LayerGrads grads{tv(dx, {c.T, c.d}, c.dtype), tv(dw1, {c.E, c.w1_rows(), c.d}, c.dtype),
                           tv(dw2, {c.E, c.d, c.n}, c.dtype),
                           tv(dpw, {bad.S}, DType::f32)};
    expect_invalid(
        [&] {
          layer_backward(c, d.borrow(), tv(x, {c.T, c.d}, c.dtype),
                         tv(w1, {c.E, c.w1_rows(), c.d}, c.dtype),
                         tv(w2, {c.E, c.d, c.n}, c.dtype), tv(d_out, {c.T, c.d}, c.dtype), saved,
                         grads, opts);
        },
        k.message);
    EXPECT_EQ(out.download<unsigned char>(), poison_out) << "out was written";
    EXPECT_EQ(dx.download<unsigned char>(), poison_out) << "dx was written";
    EXPECT_EQ(dw1.download<unsigned char>(), poison_w1) << "dw1 was written";
    EXPECT_EQ(dw2.download<unsigned char>(), poison_w2) << "dw2 was written";
    EXPECT_EQ(dpw.download<unsigned char>(), poison_pw) << "d_pair_weights was written";
  }
}

}  // namespace
}  // namespace moeblaze::test
