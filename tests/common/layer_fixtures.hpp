// Test fixtures for the MoE layer: random routings (uneven, with empty experts), host tensors in
// a storage dtype, layer inputs and outputs, and helpers that run the public layer API.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "moeblaze/moeblaze.hpp"

namespace moeblaze::test {

// A routing held in std::vectors (the caller's memory), viewable as a RoutingView.
struct HostRouting {
  int64_t T = 0, E = 0;
  std::vector<int32_t> offsets;  // (T+1,) int32
  std::vector<int32_t> experts;  // (P,) int32, token-major
  std::vector<float> weights;    // (P,) fp32, token-major

  int64_t P() const { return static_cast<int64_t>(experts.size()); }
  RoutingView view() const;
};

struct RoutingSpec {
  int64_t T = 0, E = 1, K = 1;
  int64_t empty_experts = 0;  // this many randomly chosen experts receive no pair
  bool skew = false;          // 20 % of the (used) experts receive ~80 % of the pairs
};
// K distinct experts per token; positive weights in [0.05, 1).
HostRouting random_routing(const RoutingSpec& spec, uint64_t seed);
// Each token loses all its pairs with probability p (as token rounding can leave a token), so
// the routing is a general CSR with S < T*K.
void drop_some_tokens(HostRouting& r, std::mt19937_64& rng, double p = 0.25);

// Dense host tensor in a storage dtype (fp32, bf16 or fp64), owned by the test.
struct HostTensor {
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  std::vector<unsigned char> bytes;

  HostTensor() = default;
  HostTensor(DType dt, std::vector<int64_t> dims);  // zero-filled
  int64_t numel() const;
  void* data() { return bytes.empty() ? nullptr : bytes.data(); }
  TensorView view() const;
  double at(int64_t i) const;
  void set(int64_t i, double v);
  std::vector<double> to_double() const;
  void fill_random(uint64_t seed, float stddev);  // N(0, stddev), no exact zeros, rounded to dtype
  void fill_pattern();  // a recognisable non-zero byte pattern (for untouched-output checks)
};

// Inputs and outputs of one layer call (forward and backward), in cfg.dtype.
struct LayerTensors {
  HostTensor x, w1, w2, out, d_out, dx, dw1, dw2, d_pair_weights;
  explicit LayerTensors(const LayerConfig& cfg, int64_t S);
  // x ~ N(0,1), w1 ~ N(0, 1/sqrt(d)), w2 ~ N(0, 1/sqrt(n)), d_out ~ N(0,1): every h is O(1),
  // so each activation is exercised over its interesting range.
  void randomize(uint64_t seed);
  // out, dx, dw1, dw2 and d_pair_weights to the pattern, so that a kernel that skips a row shows.
  void pattern_outputs();
  LayerGrads grads() const;
};

// Routing plan of a routing, through the library's builder.
RoutingPlan make_plan(const HostRouting& r);

// Runs forward and backward through the public API.
void run_layer(const LayerConfig& cfg, const RoutingPlan& plan, LayerTensors& t,
               const LayerOptions& opts, SavedForBackward* keep_saved = nullptr);

// Bitwise equality of two host tensors (same dtype and shape).
bool bitwise_equal(const HostTensor& a, const HostTensor& b);
// A test failure for each of out, dx, dw1, dw2, d_pair_weights that differs in any bit.
void expect_same_results(const LayerTensors& a, const LayerTensors& b);

// ||a - ref||_F / ||ref||_F with ref in float64; 0 when both are empty, and exact-zero check
// when ref is all zero (returns +inf if a is not all zero).
double rel_error(const HostTensor& a, const std::vector<double>& ref);

// The layer's relative Frobenius tolerance against float64 per storage dtype (1e-5 fp32, 1e-2
// bf16; the reasoning is at tests/cpu/test_layer.cpp's use), and the check itself: a test
// failure naming `what` when rel_error(got, ref) exceeds `tolerance`.
double layer_tol(DType dt);
void expect_close(const char* what, const HostTensor& got, const std::vector<double>& ref,
                  double tolerance);

// ||a - ref||_F / ||scale||_F: the error measured against a scale of its own (e.g. the sum of
// magnitudes of the terms of a dot product that may cancel).
double scaled_error(const HostTensor& a, const std::vector<double>& ref,
                    const std::vector<double>& scale);

}  // namespace moeblaze::test
