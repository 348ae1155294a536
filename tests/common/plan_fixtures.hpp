// Test fixtures for argument validation: a routing plan copied into test-owned arrays (so it can
// be corrupted and borrowed, as a foreign caller's plan is), the C ABI structs over test
// tensors, and a check that a call fails with InvalidArgument naming the rule.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/layer_fixtures.hpp"
#include "moeblaze/capi.h"
#include "moeblaze/moeblaze.hpp"

namespace moeblaze::test {

// The six plan arrays in std::vectors (the caller's memory).
struct HostPlan {
  int64_t T = 0, E = 0, S = 0;
  std::vector<int32_t> expert_token_offsets;  // (E+1,)
  std::vector<int32_t> expert_token_indices;  // (S,)
  std::vector<float> slot_weights;            // (S,)
  std::vector<int32_t> token_pair_offsets;    // (T+1,)
  std::vector<int32_t> token_expert_indices;  // (S,); cleared: borrowed as a null pointer
  std::vector<int32_t> token_index_map;       // (S,)

  explicit HostPlan(const RoutingPlan& built);  // a copy of a CPU plan's arrays
  RoutingPlan borrow();                         // RoutingPlan::borrow over these arrays
  moeblaze_plan c_plan();                       // the C ABI struct over these arrays
  int32_t* tei() { return token_expert_indices.empty() ? nullptr : token_expert_indices.data(); }
};

// The C ABI layer config of a LayerConfig (mode 0 keep_h / 1 recompute).
moeblaze_layer_cfg c_layer_cfg(const LayerConfig& cfg, int32_t mode, int32_t num_threads = 1);

// Calls fn; it must throw InvalidArgument whose message contains `needle`. Returns the message
// (empty, with a test failure, when it did not throw that).
std::string expect_invalid(const std::function<void()>& fn, const std::string& needle);

}  // namespace moeblaze::test
