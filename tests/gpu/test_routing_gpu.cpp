// GPU routing against the CPU backend: routers (ids bit-exact, weights within 1 ulp, losses,
// backward), token rounding (bit-exact routing), routing-plan builders (bit-exact plans across
// the benchmark's shapes and the edge cases, graph capture), device-side bad-input checks.
// Every test draws fresh random inputs and prints its seed on failure; outputs of the async
// entry points are poisoned (0xFF) before each run so that an unwritten element shows.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/test_util.hpp"
#include "cuda/cuda_backend.hpp"
#include "gpu/gpu_test_util.hpp"
#include "moeblaze/capi.h"
#include "moeblaze/moeblaze.hpp"

namespace moeblaze {
namespace {

constexpr PlanBuilder kBuilders[] = {PlanBuilder::atomic_free, PlanBuilder::sort};

// ---- host-side routings -----------------------------------------------------------------------

struct HostRouting {
  int64_t T = 0, E = 0;
  std::vector<int32_t> offsets;  // (T+1,) int32
  std::vector<int32_t> experts;  // (P,) int32, token-major
  std::vector<float> weights;    // (P,) fp32
  int64_t P() const { return int64_t(experts.size()); }
  RoutingView view() const {
    RoutingView v;
    v.T = T;
    v.E = E;
    v.P = P();
    v.pair_offsets = offsets.data();
    v.pair_experts = experts.empty() ? nullptr : experts.data();
    v.pair_weights = weights.empty() ? nullptr : weights.data();
    v.device = Device::cpu;
    return v;
  }
};

// K distinct experts per token; with `skew` a random 20% of the experts get about 80% of pairs.
HostRouting random_topk(int64_t T, int64_t E, int64_t K, uint64_t seed, bool skew) {
  std::mt19937_64 rng(seed);
  HostRouting r;
  r.T = T;
  r.E = E;
  r.offsets.resize(size_t(T + 1));
  std::vector<int32_t> perm(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) perm[size_t(e)] = int32_t(e);
  std::shuffle(perm.begin(), perm.end(), rng);
  const int64_t hot = std::max<int64_t>(1, E / 5);
  std::vector<int64_t> used(size_t(E), -1);
  for (int64_t t = 0; t < T; ++t) {
    r.offsets[size_t(t)] = int32_t(r.experts.size());
    for (int64_t k = 0; k < K; ++k) {
      int32_t e = -1;
      for (int tries = 0; tries < 64 && e < 0; ++tries) {
        int64_t c;
        if (skew && hot < E)
          c = (rng() % 5 != 0) ? perm[size_t(rng() % hot)] : perm[size_t(hot + rng() % (E - hot))];
        else
          c = int64_t(rng() % uint64_t(E));
        if (used[size_t(c)] != t) e = int32_t(c);
      }
      for (int64_t i = 0; e < 0; ++i)
        if (used[size_t(perm[size_t(i)])] != t) e = perm[size_t(i)];
      used[size_t(e)] = t;
      r.experts.push_back(e);
    }
  }
  r.offsets[size_t(T)] = int32_t(r.experts.size());
  r.weights = test::random_normal(r.experts.size(), seed ^ 0x5bd1e995ull);
  return r;
}

// A general CSR routing: 0..maxn pairs per token (runs of empty tokens included), ascending
// experts within a token (the token-rounding layout).
HostRouting random_csr(int64_t T, int64_t E, int64_t maxn, uint64_t seed) {
  std::mt19937_64 rng(seed);
  HostRouting r;
  r.T = T;
  r.E = E;
  r.offsets.resize(size_t(T + 1));
  std::vector<int32_t> ids(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) ids[size_t(e)] = int32_t(e);
  for (int64_t t = 0; t < T; ++t) {
    r.offsets[size_t(t)] = int32_t(r.experts.size());
    // Every 97th block of tokens is a run of 300 empty tokens.
    const bool empty_run = (t / 300) % 97 == 5;
    const int64_t n = empty_run ? 0 : int64_t(rng() % uint64_t(maxn + 1));
    std::shuffle(ids.begin(), ids.end(), rng);
    std::vector<int32_t> pick(ids.begin(), ids.begin() + std::min(n, E));
    std::sort(pick.begin(), pick.end());
    r.experts.insert(r.experts.end(), pick.begin(), pick.end());
  }
  r.offsets[size_t(T)] = int32_t(r.experts.size());
  r.weights = test::random_normal(r.experts.size(), seed ^ 0x27d4eb2full);
  return r;
}

// ---- device copies ----------------------------------------------------------------------------

template <typename T>
void upload(T* dst, const std::vector<T>& src) {
  if (!src.empty()) {
    ASSERT_EQ(cudaMemcpy(dst, src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
}
template <typename T>
std::vector<T> download(const T* src, size_t n) {
  std::vector<T> v(n);
  if (n > 0) {
    EXPECT_EQ(cudaMemcpy(v.data(), src, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return v;
}

Routing to_device(const HostRouting& h) {
  Routing d(Device::cuda, h.T, h.E, h.P());
  upload(d.pair_offsets(), h.offsets);
  upload(d.pair_experts(), h.experts);
  upload(d.pair_weights(), h.weights);
  return d;
}

HostRouting to_host(const Routing& d) {
  HostRouting h;
  h.T = d.T();
  h.E = d.E();
  if (d.device() == Device::cpu) {
    h.offsets.assign(d.pair_offsets(), d.pair_offsets() + d.T() + 1);
    h.experts.assign(d.pair_experts(), d.pair_experts() + d.P());
    h.weights.assign(d.pair_weights(), d.pair_weights() + d.P());
    return h;
  }
  h.offsets = download(d.pair_offsets(), size_t(d.T() + 1));
  h.experts = download(d.pair_experts(), size_t(d.P()));
  h.weights = download(d.pair_weights(), size_t(d.P()));
  return h;
}

struct HostPlan {
  std::vector<int32_t> expert_offsets, expert_tokens, token_offsets, token_experts, token_slots;
  std::vector<float> slot_weights;
};

HostPlan plan_to_host(const RoutingPlan& p) {
  const RoutingPlanView v = p.view();
  HostPlan h;
  if (p.device() == Device::cpu) {
    h.expert_offsets.assign(v.expert_token_offsets, v.expert_token_offsets + p.E() + 1);
    h.expert_tokens.assign(v.expert_token_indices, v.expert_token_indices + p.S());
    h.slot_weights.assign(v.slot_weights, v.slot_weights + p.S());
    h.token_offsets.assign(v.token_pair_offsets, v.token_pair_offsets + p.T() + 1);
    h.token_experts.assign(v.token_expert_indices, v.token_expert_indices + p.S());
    h.token_slots.assign(v.token_index_map, v.token_index_map + p.S());
    return h;
  }
  h.expert_offsets = download(v.expert_token_offsets, size_t(p.E() + 1));
  h.expert_tokens = download(v.expert_token_indices, size_t(p.S()));
  h.slot_weights = download(v.slot_weights, size_t(p.S()));
  h.token_offsets = download(v.token_pair_offsets, size_t(p.T() + 1));
  h.token_experts = download(v.token_expert_indices, size_t(p.S()));
  h.token_slots = download(v.token_index_map, size_t(p.S()));
  return h;
}

template <typename T>
::testing::AssertionResult same_bits(const char* what, const std::vector<T>& got,
                                     const std::vector<T>& want) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << what << ": size " << got.size() << " vs " << want.size();
  for (size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0)
      return ::testing::AssertionFailure() << what << "[" << i << "]: got " << got[i]
                                           << ", want " << want[i];
  return ::testing::AssertionSuccess();
}

void expect_same_plan(const HostPlan& got, const HostPlan& want) {
  EXPECT_TRUE(same_bits("expert_token_offsets", got.expert_offsets, want.expert_offsets));
  EXPECT_TRUE(same_bits("expert_token_indices", got.expert_tokens, want.expert_tokens));
  EXPECT_TRUE(same_bits("slot_weights", got.slot_weights, want.slot_weights));
  EXPECT_TRUE(same_bits("token_pair_offsets", got.token_offsets, want.token_offsets));
  EXPECT_TRUE(same_bits("token_expert_indices", got.token_experts, want.token_experts));
  EXPECT_TRUE(same_bits("token_index_map", got.token_slots, want.token_slots));
}

HostPlan cpu_plan(const HostRouting& h) {
  RoutingPlan p;
  build_routing_plan(h.view(), PlanBuilder::atomic_free, p);
  return plan_to_host(p);
}

void poison(RoutingPlan& p) {
  const RoutingPlanView v = p.view();
  cudaMemset(const_cast<int32_t*>(v.expert_token_offsets), 0xFF, sizeof(int32_t) * size_t(p.E() + 1));
  cudaMemset(const_cast<int32_t*>(v.token_pair_offsets), 0xFF, sizeof(int32_t) * size_t(p.T() + 1));
  if (p.S() > 0) {
    cudaMemset(const_cast<int32_t*>(v.expert_token_indices), 0xFF, sizeof(int32_t) * size_t(p.S()));
    cudaMemset(const_cast<float*>(v.slot_weights), 0xFF, sizeof(float) * size_t(p.S()));
    cudaMemset(const_cast<int32_t*>(v.token_expert_indices), 0xFF, sizeof(int32_t) * size_t(p.S()));
    cudaMemset(const_cast<int32_t*>(v.token_index_map), 0xFF, sizeof(int32_t) * size_t(p.S()));
  }
}

// Builds with build_plan_async into a poisoned plan; returns the flags.
std::vector<int32_t> build_async(const Routing& d, PlanBuilder b, RoutingPlan& plan,
                                 int tile_steps = 0) {
  plan = RoutingPlan(Device::cuda, d.T(), d.E(), d.P());
  poison(plan);
  cuda::PlanBuildOptions o;
  o.tile_steps = tile_steps;
  Buffer ws(Device::cuda, cuda::plan_build_workspace_bytes(d.T(), d.E(), d.P(), b, o));
  Buffer flags(Device::cuda, sizeof(int32_t) * cuda::kRoutingFlagCount);
  cudaMemset(flags.data(), 0, flags.bytes());
  cuda::build_plan_async(d.view(), b, plan, ws.data(), ws.bytes(), flags.as<int32_t>(), nullptr, o);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return download(flags.as<int32_t>(), cuda::kRoutingFlagCount);
}

// ---- routing plan -----------------------------------------------------------------------------

TEST(RoutingPlanGpu, BitExactAcrossBenchmarkShapes) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const int64_t T = 16411;  // not a multiple of any tile
  for (int64_t E : {8, 64, 256, 512})
    for (int64_t K : {1, 2, 4, 8})
      for (bool skew : {false, true}) {
        SCOPED_TRACE(testing::Message() << "E " << E << " K " << K << " skew " << skew);
        const HostRouting h = random_topk(T, E, K, seed + uint64_t(E * 131 + K * 7 + skew), skew);
        const HostPlan want = cpu_plan(h);
        const Routing d = to_device(h);
        for (PlanBuilder b : kBuilders) {
          SCOPED_TRACE(plan_builder_name(b));
          RoutingPlan plan;
          build_routing_plan(d.view(), b, plan);  // the public API
          ASSERT_EQ(plan.device(), Device::cuda);
          expect_same_plan(plan_to_host(plan), want);
          RoutingPlan plan2;
          const std::vector<int32_t> flags = build_async(d, b, plan2);
          EXPECT_EQ(flags, std::vector<int32_t>(cuda::kRoutingFlagCount, 0));
          expect_same_plan(plan_to_host(plan2), want);
        }
      }
}

TEST(RoutingPlanGpu, EdgeCases) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  std::vector<std::pair<std::string, HostRouting>> cases;
  {  // empty experts: every pair on experts [0, 8) of 64
    HostRouting h = random_topk(5000, 8, 3, seed + 1, false);
    h.E = 64;
    cases.push_back({"empty experts", h});
  }
  {  // all tokens on one expert
    HostRouting h = random_topk(7000, 16, 1, seed + 2, false);
    for (int32_t& e : h.experts) e = 11;
    cases.push_back({"one expert", h});
  }
  cases.push_back({"K = E", random_topk(3000, 8, 8, seed + 3, false)});
  cases.push_back({"K = E = 64", random_topk(500, 64, 64, seed + 4, false)});
  cases.push_back({"T = 1", random_topk(1, 32, 4, seed + 5, false)});
  cases.push_back({"T = 0", random_topk(0, 32, 4, seed + 6, false)});
  {  // tokens but no pairs
    HostRouting h;
    h.T = 100;
    h.E = 4;
    h.offsets.assign(101, 0);
    cases.push_back({"no pairs", h});
  }
  cases.push_back({"E = 1", random_topk(4099, 1, 1, seed + 7, false)});
  cases.push_back({"E = 1000 (generic E)", random_topk(3001, 1000, 4, seed + 8, true)});
  for (const auto& c : cases) {
    SCOPED_TRACE(c.first);
    const HostPlan want = cpu_plan(c.second);
    const Routing d = to_device(c.second);
    for (PlanBuilder b : kBuilders) {
      SCOPED_TRACE(plan_builder_name(b));
      RoutingPlan plan;
      build_routing_plan(d.view(), b, plan);
      expect_same_plan(plan_to_host(plan), want);
      RoutingPlan plan2;
      EXPECT_EQ(build_async(d, b, plan2), std::vector<int32_t>(cuda::kRoutingFlagCount, 0));
      expect_same_plan(plan_to_host(plan2), want);
    }
  }
}

TEST(RoutingPlanGpu, GeneralCsrAndEveryTileSize) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (int64_t E : {8, 128}) {
    const HostRouting h = random_csr(60000, E, 6, seed + uint64_t(E));
    const HostPlan want = cpu_plan(h);
    const Routing d = to_device(h);
    for (PlanBuilder b : kBuilders)
      for (int steps : {0, 1, 3, 64}) {
        if (b == PlanBuilder::sort && steps != 0) continue;
        SCOPED_TRACE(testing::Message() << plan_builder_name(b) << " E " << E << " steps " << steps);
        RoutingPlan plan;
        EXPECT_EQ(build_async(d, b, plan, steps), std::vector<int32_t>(cuda::kRoutingFlagCount, 0));
        expect_same_plan(plan_to_host(plan), want);
      }
  }
  // Top-K routing with every tile size too (the uniform fast path).
  const HostRouting h = random_topk(20011, 256, 8, seed + 99, true);
  const HostPlan want = cpu_plan(h);
  const Routing d = to_device(h);
  for (int steps : {1, 2, 5, 16, 64}) {
    SCOPED_TRACE(testing::Message() << "top-K steps " << steps);
    RoutingPlan plan;
    build_async(d, PlanBuilder::atomic_free, plan, steps);
    expect_same_plan(plan_to_host(plan), want);
  }
}

TEST(RoutingPlanGpu, CapturedInACudaGraphAndReplayed) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const int64_t T = 30000, E = 64, K = 4;
  for (PlanBuilder b : kBuilders) {
    SCOPED_TRACE(plan_builder_name(b));
    const HostRouting h1 = random_topk(T, E, K, seed + 1, false);
    Routing d = to_device(h1);
    RoutingPlan plan(Device::cuda, T, E, T * K);
    Buffer ws(Device::cuda, cuda::plan_build_workspace_bytes(T, E, T * K, b));
    Buffer flags(Device::cuda, sizeof(int32_t) * cuda::kRoutingFlagCount);
    MOEBLAZE_TEST_CUDA(cudaMemset(flags.data(), 0, flags.bytes()));
    cudaStream_t s;
    MOEBLAZE_TEST_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaGraph_t graph;
    MOEBLAZE_TEST_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    cuda::build_plan_async(d.view(), b, plan, ws.data(), ws.bytes(), flags.as<int32_t>(), s);
    MOEBLAZE_TEST_CUDA(cudaStreamEndCapture(s, &graph));
    cudaGraphExec_t exec;
    MOEBLAZE_TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    poison(plan);
    MOEBLAZE_TEST_CUDA(cudaDeviceSynchronize());
    MOEBLAZE_TEST_CUDA(cudaGraphLaunch(exec, s));
    MOEBLAZE_TEST_CUDA(cudaStreamSynchronize(s));
    expect_same_plan(plan_to_host(plan), cpu_plan(h1));
    // New routing values in the same buffers (skewed this time): replay sees them.
    const HostRouting h2 = random_topk(T, E, K, seed + 2, true);
    upload(d.pair_experts(), h2.experts);
    upload(d.pair_weights(), h2.weights);
    poison(plan);
    MOEBLAZE_TEST_CUDA(cudaDeviceSynchronize());
    MOEBLAZE_TEST_CUDA(cudaGraphLaunch(exec, s));
    MOEBLAZE_TEST_CUDA(cudaStreamSynchronize(s));
    expect_same_plan(plan_to_host(plan), cpu_plan(h2));
    EXPECT_EQ(download(flags.as<int32_t>(), cuda::kRoutingFlagCount),
              std::vector<int32_t>(cuda::kRoutingFlagCount, 0));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
  }
}

TEST(RoutingPlanGpu, BadRoutingRaisesFlagsAndClearErrors) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const HostRouting good = random_topk(9000, 8, 2, seed, false);
  struct Case {
    const char* name;
    int flag;
    const char* message;
    void (*mutate)(HostRouting&);
    int left_out;  // the pair the graph-capturable build leaves out of the token view (-1: none)
  };
  const Case cases[] = {
      {"out of range", cuda::kFlagExpertOutOfRange, "is out of range [0, 8)",
       [](HostRouting& h) { h.experts[2 * 4321 + 1] = 9; }, 2 * 4321 + 1},
      {"negative", cuda::kFlagExpertOutOfRange, "is out of range [0, 8)",
       [](HostRouting& h) { h.experts[2 * 17] = -3; }, 2 * 17},
      {"repeated", cuda::kFlagExpertRepeated, "is repeated in token 5000",
       [](HostRouting& h) { h.experts[2 * 5000 + 1] = h.experts[2 * 5000]; }, 2 * 5000 + 1},
      {"nan weight", cuda::kFlagNonFinite, "is not finite",
       [](HostRouting& h) { h.weights[777] = NAN; }, -1},
      {"inf weight", cuda::kFlagNonFinite, "is not finite",
       [](HostRouting& h) { h.weights[8000] = -INFINITY; }, -1},
      {"decreasing offsets", cuda::kFlagBadOffsets, "pair_offsets must be non-decreasing: token",
       [](HostRouting& h) { std::swap(h.offsets[300], h.offsets[301]); }, -1},
  };
  // A valid plan the failed calls must leave alone.
  const Routing dgood = to_device(good);
  for (PlanBuilder b : kBuilders) {
    for (const Case& c : cases) {
      SCOPED_TRACE(testing::Message() << plan_builder_name(b) << ": " << c.name);
      HostRouting bad = good;
      c.mutate(bad);
      const Routing d = to_device(bad);
      RoutingPlan plan;
      build_routing_plan(dgood.view(), b, plan);
      const HostPlan before = plan_to_host(plan);
      const void* before_ptr = plan.view().expert_token_indices;
      try {
        build_routing_plan(d.view(), b, plan);
        ADD_FAILURE() << "no exception";
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find(c.message), std::string::npos) << e.what();
      }
      EXPECT_EQ(plan.view().expert_token_indices, before_ptr);
      expect_same_plan(plan_to_host(plan), before);
      // The graph-capturable path only raises the flag.
      RoutingPlan p2;
      const std::vector<int32_t> flags = build_async(d, b, p2);
      EXPECT_EQ(flags[size_t(c.flag)], 1) << "flag " << c.flag;
      // A bad id's pair has no slot in the token view (-1), so the aggregations give its token
      // NaN rather than a row short of a pair or counted twice; every other pair keeps one.
      if (c.left_out >= 0) {
        const HostPlan h = plan_to_host(p2);
        for (size_t p = 0; p < h.token_slots.size(); ++p)
          if (int(p) == c.left_out)
            EXPECT_EQ(h.token_slots[p], -1) << "pair " << p;
          else
            ASSERT_GE(h.token_slots[p], 0) << "pair " << p;
      }
    }
  }
}

// ---- routers ----------------------------------------------------------------------------------

struct RouterCase {
  RouterKind kind;
  bool renormalize;
};
constexpr RouterCase kRouters[] = {{RouterKind::softmax_topk, false},
                                   {RouterKind::softmax_topk, true},
                                   {RouterKind::topk_softmax, false},
                                   {RouterKind::sigmoid_bias, false},
                                   {RouterKind::sigmoid_bias, true}};

std::string router_label(const RouterCase& r) {
  return std::string(router_name(r.kind)) + (r.renormalize ? " renorm" : "");
}

// Logits stored in `dtype` (bf16 values rounded once), with the fp32 copy the CPU reads.
struct Logits {
  int64_t T = 0, E = 0;
  DType dtype = DType::f32;
  std::vector<float> f32;
  std::vector<bf16> b16;
  Buffer dev;
  TensorView host() const {
    return dtype == DType::f32 ? host_view(f32.data(), {T, E}) : host_view(b16.data(), {T, E});
  }
  TensorView device() const { return TensorView(dev.data(), dtype, Device::cuda, {T, E}); }
};

Logits make_logits(int64_t T, int64_t E, DType dtype, std::vector<float> values) {
  Logits l;
  l.T = T;
  l.E = E;
  l.dtype = dtype;
  l.dev = Buffer(Device::cuda, size_t(T * E) * dtype_size(dtype));
  if (dtype == DType::bf16) {
    l.b16 = test::to_bf16(values);
    if (!l.b16.empty())
      cudaMemcpy(l.dev.data(), l.b16.data(), l.b16.size() * 2, cudaMemcpyHostToDevice);
  } else {
    l.f32 = std::move(values);
    if (!l.f32.empty())
      cudaMemcpy(l.dev.data(), l.f32.data(), l.f32.size() * 4, cudaMemcpyHostToDevice);
  }
  return l;
}

struct Bias {
  std::vector<float> h;
  Buffer d;
  TensorView host(const RouterCase& r) const {
    return r.kind == RouterKind::sigmoid_bias ? host_view(h.data(), {int64_t(h.size())})
                                              : TensorView();
  }
  TensorView device(const RouterCase& r) const {
    return r.kind == RouterKind::sigmoid_bias
               ? TensorView(d.data(), DType::f32, Device::cuda, {int64_t(h.size())})
               : TensorView();
  }
};
Bias make_bias(int64_t E, uint64_t seed) {
  Bias b;
  b.h = test::random_normal(size_t(E), seed, 0.1f);
  b.d = Buffer(Device::cuda, sizeof(float) * size_t(E));
  cudaMemcpy(b.d.data(), b.h.data(), sizeof(float) * size_t(E), cudaMemcpyHostToDevice);
  return b;
}

int64_t ulp_distance(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return INT64_MAX;
  int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  if (ia < 0) ia = int32_t(0x80000000u - uint32_t(ia));
  if (ib < 0) ib = int32_t(0x80000000u - uint32_t(ib));
  return std::llabs(int64_t(ia) - int64_t(ib));
}

void expect_same_routing(const HostRouting& got, const HostRouting& want, int64_t max_ulp) {
  EXPECT_TRUE(same_bits("pair_offsets", got.offsets, want.offsets));
  EXPECT_TRUE(same_bits("pair_experts", got.experts, want.experts));
  ASSERT_EQ(got.weights.size(), want.weights.size());
  int64_t worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < got.weights.size(); ++i) {
    const int64_t u = ulp_distance(got.weights[i], want.weights[i]);
    if (u > worst) worst = u, at = i;
  }
  EXPECT_LE(worst, max_ulp) << "pair_weights[" << at << "]: got " << got.weights[at] << ", want "
                            << want.weights[at];
}

TEST(RouterGpu, MatchesCpuEveryRouterEAndK) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const int64_t T = 1000;
  for (int64_t E : {8, 64, 256, 512, 1024}) {
    const std::vector<float> values = test::random_normal(size_t(T * E), seed + uint64_t(E), 2.0f);
    const Bias bias = make_bias(E, seed ^ uint64_t(E));
    for (DType dt : {DType::f32, DType::bf16}) {
      const Logits lg = make_logits(T, E, dt, values);
      for (int K : {1, 2, 4, 8, 16, 24}) {
        if (K > E) continue;
        for (const RouterCase& rc : kRouters) {
          SCOPED_TRACE(testing::Message() << "E " << E << " K " << K << " " << dtype_name(dt)
                                          << " " << router_label(rc));
          RouterConfig cfg;
          cfg.kind = rc.kind;
          cfg.renormalize = rc.renormalize;
          cfg.top_k = K;
          Routing want, got;
          route(cfg, lg.host(), bias.host(rc), want);
          route(cfg, lg.device(), bias.device(rc), got);
          ASSERT_EQ(got.device(), Device::cuda);
          expect_same_routing(to_host(got), to_host(want), 1);
        }
      }
    }
  }
}

TEST(RouterGpu, AsyncPathWritesEveryOutputAndIsDeterministic) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const int64_t T = 4097, E = 128;
  const Logits lg = make_logits(T, E, DType::bf16, test::random_normal(size_t(T * E), seed));
  const Bias bias = make_bias(E, seed + 1);
  for (const RouterCase& rc : kRouters) {
    SCOPED_TRACE(router_label(rc));
    RouterConfig cfg;
    cfg.kind = rc.kind;
    cfg.renormalize = rc.renormalize;
    cfg.top_k = 6;
    Routing want;
    route(cfg, lg.host(), bias.host(rc), want);
    HostRouting first;
    for (int run = 0; run < 2; ++run) {
      Routing out(Device::cuda, T, E, T * cfg.top_k);
      cudaMemset(out.pair_offsets(), 0xFF, sizeof(int32_t) * size_t(T + 1));
      cudaMemset(out.pair_experts(), 0xFF, sizeof(int32_t) * size_t(T * cfg.top_k));
      cudaMemset(out.pair_weights(), 0xFF, sizeof(float) * size_t(T * cfg.top_k));
      Buffer ws(Device::cuda, cuda::route_workspace_bytes(cfg, T, E));
      Buffer losses(Device::cuda, 2 * sizeof(double));
      Buffer flags(Device::cuda, sizeof(int32_t) * cuda::kRoutingFlagCount);
      cudaMemset(flags.data(), 0, flags.bytes());
      cuda::route_async(cfg, lg.device(), bias.device(rc), out, ws.data(), losses.as<double>(),
                        flags.as<int32_t>(), nullptr);
      MOEBLAZE_TEST_CUDA(cudaDeviceSynchronize());
      const HostRouting got = to_host(out);
      expect_same_routing(got, to_host(want), 1);
      EXPECT_EQ(download(flags.as<int32_t>(), cuda::kRoutingFlagCount),
                std::vector<int32_t>(cuda::kRoutingFlagCount, 0));
      if (run == 0) {
        first = got;
      } else {
        EXPECT_TRUE(same_bits("run-to-run pair_weights", got.weights, first.weights));
      }
    }
  }
}

TEST(RouterGpu, ExactTiesBreakToTheLowerExpertId) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const int64_t T = 2000;
  for (int64_t E : {8, 64, 300}) {
    std::vector<float> values(size_t(T * E));
    for (float& v : values) v = float(int(rng() % 5) - 2) * 0.5f;  // many exact ties
    Bias flat = make_bias(E, seed + 7);  // a bias with ties too
    for (float& b : flat.h) b = 0.25f;
    cudaMemcpy(flat.d.data(), flat.h.data(), sizeof(float) * size_t(E), cudaMemcpyHostToDevice);
    for (DType dt : {DType::f32, DType::bf16}) {
      const Logits lg = make_logits(T, E, dt, values);
      for (const RouterCase& rc : kRouters)
        for (int K : {1, 3, 8, 20}) {
          if (K > E) continue;
          SCOPED_TRACE(testing::Message() << "E " << E << " K " << K << " " << dtype_name(dt)
                                          << " " << router_label(rc));
          RouterConfig cfg;
          cfg.kind = rc.kind;
          cfg.renormalize = rc.renormalize;
          cfg.top_k = K;
          Routing want, got;
          route(cfg, lg.host(), flat.host(rc), want);
          route(cfg, lg.device(), flat.device(rc), got);
          expect_same_routing(to_host(got), to_host(want), 1);
        }
    }
  }
}

TEST(RouterGpu, LossesMatchCpu) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (int64_t T : {1, 64, 5000}) {
    const int64_t E = 48;
    const Logits lg = make_logits(T, E, DType::f32, test::random_normal(size_t(T * E), seed + T, 3.0f));
    const Bias bias = make_bias(E, seed + 3);
    for (const RouterCase& rc : kRouters) {
      SCOPED_TRACE(testing::Message() << "T " << T << " " << router_label(rc));
      RouterConfig cfg;
      cfg.kind = rc.kind;
      cfg.renormalize = rc.renormalize;
      cfg.top_k = 3;
      cfg.aux_loss_coef = 0.01f;
      cfg.z_loss_coef = 0.001f;
      Routing want, got;
      const RouterLosses lw = route(cfg, lg.host(), bias.host(rc), want);
      const RouterLosses lg2 = route(cfg, lg.device(), bias.device(rc), got);
      EXPECT_GT(lw.aux_loss, 0.0);
      EXPECT_GT(lw.z_loss, 0.0);
      // aux: the same fp32 partials and double sums as the CPU (exact); z: lse uses logf, whose
      // last bit may differ from the CPU's.
      EXPECT_NEAR(lg2.aux_loss, lw.aux_loss, 1e-12 * lw.aux_loss);
      EXPECT_NEAR(lg2.z_loss, lw.z_loss, 1e-6 * lw.z_loss);
      expect_same_routing(to_host(got), to_host(want), 1);
    }
  }
}

TEST(RouterGpu, EmptyBatch) {
  MOEBLAZE_REQUIRE_GPU();
  const Logits lg = make_logits(0, 16, DType::f32, {});
  RouterConfig cfg;
  cfg.top_k = 2;
  cfg.aux_loss_coef = 0.1f;
  Routing got;
  const RouterLosses l = route(cfg, lg.device(), TensorView(), got);
  EXPECT_EQ(got.T(), 0);
  EXPECT_EQ(got.P(), 0);
  EXPECT_EQ(download(got.pair_offsets(), 1), std::vector<int32_t>{0});
  EXPECT_EQ(l.aux_loss, 0.0);
}

TEST(RouterGpu, NonFiniteLogitsAreRejectedWithTheCpuMessage) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const int64_t T = 300, E = 16;
  std::vector<float> values = test::random_normal(size_t(T * E), seed);
  values[size_t(123 * E + 5)] = NAN;
  values[size_t(200 * E + 1)] = INFINITY;
  for (DType dt : {DType::f32, DType::bf16}) {
    const Logits lg = make_logits(T, E, dt, values);
    RouterConfig cfg;
    cfg.top_k = 2;
    const HostRouting h = random_topk(T, E, 2, seed, false);
    Routing out = to_device(h);
    const HostRouting before = to_host(out);
    try {
      route(cfg, lg.device(), TensorView(), out);
      ADD_FAILURE() << "no exception";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("logits[123, 5] (token 123, expert 5) is nan"),
                std::string::npos)
          << e.what();
    }
    const HostRouting after = to_host(out);
    EXPECT_TRUE(same_bits("untouched experts", after.experts, before.experts));
  }
}

TEST(RouterGpu, BackwardMatchesCpu) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const int64_t T = 700;
  for (int64_t E : {8, 96}) {
    for (DType dt : {DType::f32, DType::bf16}) {
      const Logits lg = make_logits(T, E, dt, test::random_normal(size_t(T * E), seed + E, 2.0f));
      const Bias bias = make_bias(E, seed + 5);
      for (const RouterCase& rc : kRouters)
        for (bool losses : {false, true}) {
          SCOPED_TRACE(testing::Message() << "E " << E << " " << dtype_name(dt) << " "
                                          << router_label(rc) << " losses " << losses);
          RouterConfig cfg;
          cfg.kind = rc.kind;
          cfg.renormalize = rc.renormalize;
          cfg.top_k = 4;
          cfg.aux_loss_coef = losses ? 0.02f : 0.0f;
          cfg.z_loss_coef = losses ? 0.003f : 0.0f;
          Routing r;
          route(cfg, lg.host(), bias.host(rc), r);
          const HostRouting hr = to_host(r);
          const Routing dr = to_device(hr);
          const std::vector<float> g = test::random_normal(size_t(r.P()), seed + 11);
          Buffer dg(Device::cuda, sizeof(float) * g.size());
          upload(dg.as<float>(), g);
          std::vector<float> want(size_t(T * E));
          router_backward(cfg, lg.host(), bias.host(rc), r.view(),
                          host_view(g.data(), {int64_t(g.size())}), host_view(want.data(), {T, E}));
          Buffer dd(Device::cuda, sizeof(float) * size_t(T * E));
          cudaMemset(dd.data(), 0xFF, dd.bytes());
          router_backward(cfg, lg.device(), bias.device(rc), dr.view(),
                          TensorView(dg.data(), DType::f32, Device::cuda, {int64_t(g.size())}),
                          TensorView(dd.data(), DType::f32, Device::cuda, {T, E}));
          const std::vector<float> got = download(dd.as<float>(), size_t(T * E));
          // Same formulas and fp32 order as the CPU: equal up to the last bit of a logf (lse),
          // measured relative to each value, floored at 1e-3 of the largest.
          double scale = 0;
          for (float v : want) scale = std::max(scale, std::fabs(double(v)));
          double worst = 0;
          size_t at = 0;
          for (size_t i = 0; i < got.size(); ++i) {
            const double err = std::fabs(double(got[i]) - double(want[i])) /
                               (std::fabs(double(want[i])) + 1e-3 * scale + 1e-30);
            if (!(err <= worst)) worst = err, at = i;
          }
          EXPECT_LE(worst, 1e-5) << "d_logits[" << at << "]: got " << got[at] << ", want "
                                 << want[at];
        }
    }
  }
}

// The C ABI's router losses on CUDA against its CPU path: f bit for bit, the losses (the
// same partials; z's lse through logf) and d_logits with device-side upstream gradients within
// the backward test's bound. Outputs poisoned first; no host sync inside the calls.
TEST(RouterGpu, CapiLossesAndTheirGradientMatchCpu) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const int64_t T = 700, K = 4;
  for (int64_t E : {8, 96})
    for (const RouterCase& rc : kRouters) {
      SCOPED_TRACE(testing::Message() << "E " << E << " " << router_label(rc));
      const moeblaze_router_cfg cfg{int32_t(rc.kind), int32_t(K), rc.renormalize ? 1 : 0};
      const Logits lg =
          make_logits(T, E, DType::f32, test::random_normal(size_t(T * E), seed + E, 2.0f));
      const Bias bias = make_bias(E, seed + 5);
      const float* hb = rc.kind == RouterKind::sigmoid_bias ? bias.h.data() : nullptr;
      const float* db = rc.kind == RouterKind::sigmoid_bias ? bias.d.as<float>() : nullptr;
      HostRouting h;
      h.T = T;
      h.E = E;
      h.offsets.resize(size_t(T + 1));
      h.experts.resize(size_t(T * K));
      h.weights.resize(size_t(T * K));
      const moeblaze_routing hr{T, E, T * K, h.offsets.data(), h.experts.data(), h.weights.data()};
      ASSERT_EQ(moeblaze_route(&cfg, lg.f32.data(), 0, T, E, hb, 0, nullptr, &hr, nullptr),
                MOEBLAZE_OK) << moeblaze_last_error();
      const Routing d = to_device(h);
      const moeblaze_routing dr{T, E, T * K, const_cast<int32_t*>(d.pair_offsets()),
                                const_cast<int32_t*>(d.pair_experts()),
                                const_cast<float*>(d.pair_weights())};
      // Forward: aux, z, f.
      float want_aux = 0, want_z = 0;
      std::vector<float> want_f(static_cast<size_t>(E));
      ASSERT_EQ(moeblaze_router_losses(&cfg, 0.02f, 0.003f, lg.f32.data(), 0, T, E, hb, 0,
                                       nullptr, &hr, nullptr, 0, &want_aux, &want_z,
                                       want_f.data()),
                MOEBLAZE_OK) << moeblaze_last_error();
      uint64_t ws_bytes = 0;
      ASSERT_EQ(moeblaze_router_losses_workspace_bytes(T, E, T * K, 1, &ws_bytes), MOEBLAZE_OK);
      Buffer ws(Device::cuda, ws_bytes), out(Device::cuda, sizeof(float) * size_t(2 + E));
      cudaMemset(out.data(), 0xFF, out.bytes());
      float* dout = out.as<float>();  // aux, z, f (E,)
      ASSERT_EQ(moeblaze_router_losses(&cfg, 0.02f, 0.003f, lg.dev.data(), 0, T, E, db, 1,
                                       nullptr, &dr, ws.data(), ws_bytes, dout, dout + 1, dout + 2),
                MOEBLAZE_OK) << moeblaze_last_error();
      const std::vector<float> got = download(dout, size_t(2 + E));
      EXPECT_NEAR(got[0], want_aux, 1e-6 * want_aux);
      EXPECT_NEAR(got[1], want_z, 1e-6 * want_z);
      EXPECT_TRUE(same_bits("f", std::vector<float>(got.begin() + 2, got.end()), want_f));
      // No pairs (a rounding may drop them all): aux and f are 0, not NaN.
      Buffer no_offsets(Device::cuda, sizeof(int32_t) * size_t(T + 1));
      cudaMemset(no_offsets.data(), 0, no_offsets.bytes());
      const moeblaze_routing none{T, E, 0, no_offsets.as<int32_t>(), nullptr, nullptr};
      ASSERT_EQ(moeblaze_router_losses(&cfg, 0.02f, 0.0f, lg.dev.data(), 0, T, E, db, 1, nullptr,
                                       &none, ws.data(), ws_bytes, dout, dout + 1, dout + 2),
                MOEBLAZE_OK) << moeblaze_last_error();
      EXPECT_EQ(download(dout, size_t(2 + E)), std::vector<float>(size_t(2 + E), 0.0f));
      upload(dout, got);  // f again for the backward below
      // Backward with upstream gradients 2.5 (aux) and -0.75 (z) read on the device.
      const std::vector<float> g = test::random_normal(size_t(T * K), seed + 11);
      const float hg[2] = {2.5f, -0.75f};
      std::vector<float> want(size_t(T * E));
      ASSERT_EQ(moeblaze_router_backward_losses(&cfg, 0.02f, 0.003f, lg.f32.data(), 0, T, E, hb,
                                                0, nullptr, &hr, g.data(), want_f.data(), &hg[0],
                                                &hg[1], want.data(), nullptr),
                MOEBLAZE_OK) << moeblaze_last_error();
      Buffer dg(Device::cuda, sizeof(float) * g.size()), dgl(Device::cuda, sizeof(hg)),
          dd(Device::cuda, sizeof(float) * size_t(T * E)), flags(Device::cuda, 4 * sizeof(int32_t));
      upload(dg.as<float>(), g);
      upload(dgl.as<float>(), std::vector<float>{hg[0], hg[1]});
      cudaMemset(dd.data(), 0xFF, dd.bytes());
      cudaMemset(flags.data(), 0, flags.bytes());
      ASSERT_EQ(moeblaze_router_backward_losses(&cfg, 0.02f, 0.003f, lg.dev.data(), 0, T, E, db,
                                                1, nullptr, &dr, dg.as<float>(), dout + 2,
                                                dgl.as<float>(), dgl.as<float>() + 1,
                                                dd.as<float>(), flags.as<int32_t>()),
                MOEBLAZE_OK) << moeblaze_last_error();
      const std::vector<float> gd = download(dd.as<float>(), size_t(T * E));
      double scale = 0, worst = 0;
      size_t at = 0;
      for (float v : want) scale = std::max(scale, std::fabs(double(v)));
      for (size_t i = 0; i < gd.size(); ++i) {
        const double err = std::fabs(double(gd[i]) - double(want[i])) /
                           (std::fabs(double(want[i])) + 1e-3 * scale + 1e-30);
        if (!(err <= worst)) worst = err, at = i;
      }
      EXPECT_LE(worst, 1e-5) << "d_logits[" << at << "]: got " << gd[at] << ", want " << want[at];
      EXPECT_EQ(download(flags.as<int32_t>(), 4), std::vector<int32_t>(4, 0));
    }
}

// ---- token rounding ---------------------------------------------------------------------------

TEST(TokenRoundingGpu, MatchesCpuEveryModeAndRouter) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const int64_t T = 3001, E = 24;
  for (DType dt : {DType::f32, DType::bf16}) {
    const Logits lg = make_logits(T, E, dt, test::random_normal(size_t(T * E), seed + 1, 1.5f));
    const Bias bias = make_bias(E, seed + 2);
    for (const RouterCase& rc : kRouters)
      for (RoundingMode mode : {RoundingMode::nearest_freq, RoundingMode::stochastic_freq,
                                RoundingMode::up, RoundingMode::down})
        for (int m_tile : {16, 128}) {
          SCOPED_TRACE(testing::Message() << dtype_name(dt) << " " << router_label(rc) << " "
                                          << rounding_name(mode) << " m_tile " << m_tile);
          RouterConfig cfg;
          cfg.kind = rc.kind;
          cfg.renormalize = rc.renormalize;
          cfg.top_k = 2;
          TokenRoundingConfig tr;
          tr.m_tile = m_tile;
          tr.mode = mode;
          tr.seed = seed;
          Routing topk_cpu, want;
          route(cfg, lg.host(), bias.host(rc), topk_cpu);
          token_round(cfg, tr, lg.host(), bias.host(rc), topk_cpu.view(), want);
          const Routing topk_gpu = to_device(to_host(topk_cpu));
          Routing got;
          token_round(cfg, tr, lg.device(), bias.device(rc), topk_gpu.view(), got);
          ASSERT_EQ(got.device(), Device::cuda);
          ASSERT_EQ(got.P(), want.P());
          expect_same_routing(to_host(got), to_host(want), 1);
          // The rounded routing's plan, on the GPU, equals the CPU's.
          RoutingPlan gp;
          build_routing_plan(got.view(), PlanBuilder::atomic_free, gp);
          expect_same_plan(plan_to_host(gp), cpu_plan(to_host(want)));
        }
  }
}

TEST(TokenRoundingGpu, TiesAndSmallBatches) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  for (int64_t T : {1, 5, 200}) {
    const int64_t E = 6;
    std::vector<float> values(size_t(T * E));
    for (float& v : values) v = float(int(rng() % 3));  // ties everywhere, +0 and -0 too
    for (size_t i = 0; i < values.size(); i += 7) values[i] = -0.0f;
    const Logits lg = make_logits(T, E, DType::f32, values);
    for (const RouterCase& rc : kRouters) {
      if (rc.kind == RouterKind::sigmoid_bias) continue;
      for (RoundingMode mode : {RoundingMode::nearest_freq, RoundingMode::up, RoundingMode::down}) {
        SCOPED_TRACE(testing::Message() << "T " << T << " " << router_label(rc) << " "
                                        << rounding_name(mode));
        RouterConfig cfg;
        cfg.kind = rc.kind;
        cfg.renormalize = rc.renormalize;
        cfg.top_k = 2;
        TokenRoundingConfig tr;
        tr.m_tile = 4;
        tr.mode = mode;
        Routing topk, want, got;
        route(cfg, lg.host(), TensorView(), topk);
        token_round(cfg, tr, lg.host(), TensorView(), topk.view(), want);
        const Routing dt = to_device(to_host(topk));
        token_round(cfg, tr, lg.device(), TensorView(), dt.view(), got);
        ASSERT_EQ(got.P(), want.P());
        expect_same_routing(to_host(got), to_host(want), 1);
      }
    }
  }
}

// The one-sync path checks topk on the device while it already runs: a broken topk or a
// non-finite logit must still throw the CPU's message, read nothing out of bounds (the
// sanitize part runs this test) and leave `out` untouched.
TEST(TokenRoundingGpu, BadTopkOrNonFiniteLogitsThrowTheCpusMessage) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const int64_t T = 2000, E = 8;
  std::vector<float> values = test::random_normal(size_t(T * E), seed);
  const HostRouting good = random_topk(T, E, 2, seed + 1, false);
  struct Case {
    const char* name;
    const char* message;
    void (*mutate)(HostRouting&, std::vector<float>&);
  };
  const Case cases[] = {
      {"out of range", "is out of range [0, 8)",
       [](HostRouting& h, std::vector<float>&) { h.experts[2 * 1234 + 1] = 1 << 20; }},
      {"negative", "is out of range [0, 8)",
       [](HostRouting& h, std::vector<float>&) { h.experts[2 * 17] = -3; }},
      {"repeated", "is repeated in token 500",
       [](HostRouting& h, std::vector<float>&) { h.experts[2 * 500 + 1] = h.experts[2 * 500]; }},
      {"offsets past P", "pair_offsets must be non-decreasing: token",
       [](HostRouting& h, std::vector<float>&) { h.offsets[300] = 1 << 30; }},
      {"nan logit", "logits[77, 3] (token 77, expert 3) is nan",
       [](HostRouting&, std::vector<float>& v) { v[77 * 8 + 3] = NAN; }},
  };
  RouterConfig cfg;
  cfg.top_k = 2;
  TokenRoundingConfig tr;
  tr.m_tile = 16;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    HostRouting bad = good;
    std::vector<float> v = values;
    c.mutate(bad, v);
    const Logits lg = make_logits(T, E, DType::f32, v);
    const Routing d = to_device(bad);
    Routing out = to_device(good);
    const void* before_ptr = out.view().pair_experts;
    try {
      token_round(cfg, tr, lg.device(), TensorView(), d.view(), out);
      ADD_FAILURE() << "no exception";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(c.message), std::string::npos) << e.what();
    }
    EXPECT_EQ(out.view().pair_experts, before_ptr);
    EXPECT_TRUE(same_bits("untouched experts", to_host(out).experts, good.experts));
  }
}

}  // namespace
}  // namespace moeblaze
