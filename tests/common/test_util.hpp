// Shared test helpers: fresh random inputs (never zeros), error norms, and bit-exact compares.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "moeblaze/dtype.hpp"

namespace moeblaze::test {

// A fresh seed per call (std::random_device), printed on failure through SCOPED_TRACE by callers
// that want to reproduce a run.
uint64_t fresh_seed();

// Normal(0, stddev) values; none is exactly zero.
std::vector<float> random_normal(size_t count, uint64_t seed, float stddev = 1.0f);
std::vector<bf16> to_bf16(const std::vector<float>& v);
std::vector<float> to_float(const std::vector<bf16>& v);

// ||a - ref||_F / ||ref||_F (ref norm floored at 1e-30). NaN in `a` gives +inf.
template <typename A, typename R>
double rel_frobenius(const A* a, const R* ref, size_t count) {
  double num = 0, den = 0;
  for (size_t i = 0; i < count; ++i) {
    const double x = static_cast<double>(static_cast<float>(a[i]));
    const double r = static_cast<double>(ref[i]);
    if (std::isnan(x)) return INFINITY;
    num += (x - r) * (x - r);
    den += r * r;
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

// Relative tolerance for results stored in `dtype` after fp32 accumulation, against float64.
// fp32: accumulation error only; bf16: a few units of bf16's 2^-8 relative rounding.
inline double rel_tolerance(DType dtype) { return dtype == DType::bf16 ? 1e-2 : 1e-4; }

}  // namespace moeblaze::test
