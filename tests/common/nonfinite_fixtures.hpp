// Non-finite values in the layer's inputs (NaN, +inf, -inf planted in x, w1, w2 or d_out) and
// the checks that the outputs carry them where the arithmetic does: the same non-finite
// elements as a yardstick (the float64 reference on the CPU, the CPU backend for the GPU), and
// the finite elements still within tolerance.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/layer_fixtures.hpp"

namespace moeblaze::test {

enum class PlantIn { x, w1, w2, d_out };
const char* plant_name(PlantIn where);

// One non-finite value at element `index` of one input.
struct Plant {
  PlantIn where = PlantIn::x;
  int64_t index = 0;
  float value = 0.0f;
  std::string describe() const;
};

// The three non-finite values a test plants.
std::vector<float> nonfinite_values();

// Writes the value into t's input (in the tensor's dtype: NaN and inf survive bf16).
void plant(LayerTensors& t, const Plant& p);

// A test failure naming `what` and the first element whose finiteness differs between got and
// ref (non-finite in one, finite in the other); returns how many elements of got are non-finite.
int64_t expect_same_nonfinite(const char* what, const HostTensor& got,
                              const std::vector<double>& ref);

// ||got - ref|| / ||scale|| over the elements finite in both (scale = ref when empty).
double finite_rel_error(const HostTensor& got, const std::vector<double>& ref,
                        const std::vector<double>& scale = {});

// Both checks on every output of a step: out, dx, dw1, dw2 and d_pair_weights (against
// dpw_scale, the dot products' magnitudes, where given). dw1_mask = false skips dw1's
// finiteness check (swiglu_oai against the float64 reference: see tests/cpu/test_nonfinite.cpp).
void expect_nonfinite_like(const LayerTensors& got, const std::vector<double>& out,
                           const std::vector<double>& dx, const std::vector<double>& dw1,
                           const std::vector<double>& dw2, const std::vector<double>& dpw,
                           const std::vector<double>& dpw_scale, double tolerance,
                           bool dw1_mask = true);

}  // namespace moeblaze::test
