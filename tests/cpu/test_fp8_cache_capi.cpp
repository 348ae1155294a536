// The C ABI's FP8 weight caches (moeblaze_fp8_weight_cache_*, moeblaze_layer_cfg.fp8_weights) on
// the CPU: a handle's life (create, weights_changed, stats, destroy; a destroyed or made-up handle
// refused by name, never dereferenced), a layer step given a cache giving the bits of one without
// (the CPU emulation quantizes in every call and leaves the cache empty), the workspace queries
// unchanged by it, and a cache with storage compute or a dead cache in cfg refused with the
// outputs untouched. tests/gpu/test_layer_fp8_gpu.cpp checks what the cache holds on CUDA.
#include <gtest/gtest.h>

#include <cstdint>
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

bool error_names(const std::string& what) {
  return std::string(moeblaze_last_error()).find(what) != std::string::npos;
}

TEST(Fp8CacheCAbi, HandleLifeAndDeadHandlesRefusedByName) {
  EXPECT_EQ(moeblaze_fp8_weight_cache_create(nullptr), MOEBLAZE_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("cache is NULL")) << moeblaze_last_error();
  void* cache = nullptr;
  ASSERT_EQ(moeblaze_fp8_weight_cache_create(&cache), MOEBLAZE_OK) << moeblaze_last_error();
  ASSERT_NE(cache, nullptr);
  void* other = nullptr;
  ASSERT_EQ(moeblaze_fp8_weight_cache_create(&other), MOEBLAZE_OK);
  EXPECT_NE(cache, other);
  uint64_t bytes = 7;
  int64_t quantizations = 7;
  ASSERT_EQ(moeblaze_fp8_weight_cache_stats(cache, &bytes, &quantizations), MOEBLAZE_OK);
  EXPECT_EQ(bytes, 0u);
  EXPECT_EQ(quantizations, 0);
  EXPECT_EQ(moeblaze_fp8_weight_cache_stats(cache, nullptr, &quantizations),
            MOEBLAZE_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("bytes is NULL")) << moeblaze_last_error();
  EXPECT_EQ(moeblaze_fp8_weight_cache_weights_changed(cache), MOEBLAZE_OK);
  EXPECT_EQ(moeblaze_fp8_weight_cache_destroy(cache), MOEBLAZE_OK);
  EXPECT_EQ(moeblaze_fp8_weight_cache_destroy(nullptr), MOEBLAZE_OK);  // like free(NULL)

  // The destroyed handle and a made-up one: refused, not dereferenced.
  int not_a_cache = 0;
  for (void* dead : {cache, static_cast<void*>(&not_a_cache)}) {
    EXPECT_EQ(moeblaze_fp8_weight_cache_weights_changed(dead), MOEBLAZE_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(error_names("cache is not a live FP8 weight cache")) << moeblaze_last_error();
    EXPECT_EQ(moeblaze_fp8_weight_cache_stats(dead, &bytes, &quantizations),
              MOEBLAZE_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(moeblaze_fp8_weight_cache_destroy(dead), MOEBLAZE_ERR_INVALID_ARGUMENT);
  }
  EXPECT_EQ(moeblaze_fp8_weight_cache_weights_changed(nullptr), MOEBLAZE_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("cache is NULL")) << moeblaze_last_error();
  // The other handle lives on.
  EXPECT_EQ(moeblaze_fp8_weight_cache_weights_changed(other), MOEBLAZE_OK);
  EXPECT_EQ(moeblaze_fp8_weight_cache_destroy(other), MOEBLAZE_OK);
}

// One FP8 step through the C ABI on the CPU, keep_h, with h in test storage.
struct Fp8Step {
  LayerConfig cfg{48, 40, 24, 6, 2, Activation::swiglu, DType::bf16};
  RoutingPlan built;
  HostPlan plan;
  LayerTensors t;
  std::vector<unsigned char> h;
  explicit Fp8Step(uint64_t seed)
      : built(test::make_plan(test::random_routing({48, 6, 2, 0, false}, seed))),
        plan(built),
        t(cfg, built.S()) {
    cfg.compute = Compute::fp8;
    t.randomize(seed + 1);
    for (HostTensor* o : {&t.out, &t.dx, &t.dw1, &t.dw2, &t.d_pair_weights}) o->fill_pattern();
    const moeblaze_layer_cfg c = test::c_layer_cfg(cfg, 0);
    uint64_t h_bytes = 0;
    EXPECT_EQ(moeblaze_layer_kept_h_bytes(&c, plan.S, &h_bytes), MOEBLAZE_OK);
    h.assign(size_t(h_bytes) + 16, 0);
  }
  int run(void* cache) {
    moeblaze_layer_cfg c = test::c_layer_cfg(cfg, 0);
    c.fp8_weights = cache;
    const moeblaze_plan p = plan.c_plan();
    const int rc = moeblaze_layer_forward(&c, &p, 0, nullptr, t.x.data(), t.w1.data(),
                                          t.w2.data(), t.out.data(), h.data(), nullptr, 0);
    if (rc != MOEBLAZE_OK) return rc;
    return moeblaze_layer_backward(&c, &p, 0, nullptr, t.x.data(), t.w1.data(), t.w2.data(),
                                   t.d_out.data(), h.data(), t.dx.data(), t.dw1.data(),
                                   t.dw2.data(), static_cast<float*>(t.d_pair_weights.data()),
                                   nullptr, 0);
  }
};

TEST(Fp8CacheCAbi, CpuStepWithACacheGivesTheBitsOfOneWithout) {
  void* cache = nullptr;
  ASSERT_EQ(moeblaze_fp8_weight_cache_create(&cache), MOEBLAZE_OK);
  Fp8Step plain(31), cached(31);
  ASSERT_EQ(plain.run(nullptr), MOEBLAZE_OK) << moeblaze_last_error();
  ASSERT_EQ(cached.run(cache), MOEBLAZE_OK) << moeblaze_last_error();
  ASSERT_EQ(cached.run(cache), MOEBLAZE_OK) << moeblaze_last_error();  // a second step, reused
  test::expect_same_results(plain.t, cached.t);
  uint64_t bytes = 1;
  int64_t quantizations = 1;
  ASSERT_EQ(moeblaze_fp8_weight_cache_stats(cache, &bytes, &quantizations), MOEBLAZE_OK);
  EXPECT_EQ(bytes, 0u);  // the CPU emulation quantizes in every call
  EXPECT_EQ(quantizations, 0);

  // The workspace queries: the CPU's does not depend on a cache.
  moeblaze_layer_cfg c = test::c_layer_cfg(plain.cfg, 0);
  uint64_t without = 0, with = 0, pass_without = 0, pass_with = 0;
  ASSERT_EQ(moeblaze_layer_workspace_bytes(&c, plain.plan.S, 0, &without), MOEBLAZE_OK);
  ASSERT_EQ(moeblaze_layer_pass_workspace_bytes(&c, plain.plan.S, 0, 1, &pass_without),
            MOEBLAZE_OK);
  c.fp8_weights = cache;
  ASSERT_EQ(moeblaze_layer_workspace_bytes(&c, plain.plan.S, 0, &with), MOEBLAZE_OK);
  ASSERT_EQ(moeblaze_layer_pass_workspace_bytes(&c, plain.plan.S, 0, 1, &pass_with), MOEBLAZE_OK);
  EXPECT_EQ(with, without);
  EXPECT_EQ(pass_with, pass_without);
  EXPECT_EQ(moeblaze_fp8_weight_cache_destroy(cache), MOEBLAZE_OK);
}

TEST(Fp8CacheCAbi, CacheWithStorageComputeOrDeadCacheRefusedOutputsUntouched) {
  void* cache = nullptr;
  ASSERT_EQ(moeblaze_fp8_weight_cache_create(&cache), MOEBLAZE_OK);
  Fp8Step step(5);
  const LayerTensors before = step.t;
  step.cfg.compute = Compute::storage;  // a cache with bf16 compute
  EXPECT_EQ(step.run(cache), MOEBLAZE_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("cfg.fp8_weights is given, but compute is 0")) << moeblaze_last_error();
  moeblaze_layer_cfg c = test::c_layer_cfg(step.cfg, 0);
  c.fp8_weights = cache;
  uint64_t bytes = 0;
  EXPECT_EQ(moeblaze_layer_workspace_bytes(&c, step.plan.S, 0, &bytes),
            MOEBLAZE_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("cfg.fp8_weights")) << moeblaze_last_error();
  step.cfg.compute = Compute::fp8;
  ASSERT_EQ(moeblaze_fp8_weight_cache_destroy(cache), MOEBLAZE_OK);
  EXPECT_EQ(step.run(cache), MOEBLAZE_ERR_INVALID_ARGUMENT);  // destroyed
  EXPECT_TRUE(error_names("cfg.fp8_weights is not a live FP8 weight cache"))
      << moeblaze_last_error();
  test::expect_same_results(step.t, before);
}

// Compute 2 is fp8-wgrad: the C ABI step gives the C++ API's bits, with a cache too; 3 is
// refused by the rule, outputs untouched.
TEST(Fp8CacheCAbi, ComputeTwoIsFp8WgradAndThreeIsRefused) {
  Fp8Step step(41);
  step.cfg.compute = Compute::fp8_wgrad;
  LayerTensors api = step.t;
  test::run_layer(step.cfg, step.built, api, {LayerMode::keep_h, 0});
  void* cache = nullptr;
  ASSERT_EQ(moeblaze_fp8_weight_cache_create(&cache), MOEBLAZE_OK);
  ASSERT_EQ(step.run(cache), MOEBLAZE_OK) << moeblaze_last_error();
  test::expect_same_results(step.t, api);
  EXPECT_EQ(moeblaze_fp8_weight_cache_destroy(cache), MOEBLAZE_OK);

  Fp8Step bad(42);
  const LayerTensors before = bad.t;
  bad.cfg.compute = static_cast<Compute>(3);
  EXPECT_EQ(bad.run(nullptr), MOEBLAZE_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("compute (3) must be 0 (storage), 1 (fp8) or 2 (fp8-wgrad)"))
      << moeblaze_last_error();
  test::expect_same_results(bad.t, before);
}

}  // namespace
}  // namespace moeblaze
