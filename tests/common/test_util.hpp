// Shared test helpers: fresh random inputs (never zeros), error norms, and bit-exact compares.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "moeblaze/dtype.hpp"

namespace moeblaze::test {

// A fresh seed per call (std::random_device), printed on failure through SCOPED_TRACE by callers
// that want to reproduce a run.
uint64_t fresh_seed();

// fresh_seed(), printed with the test's name so that a failing run can be replayed.
uint64_t printed_seed(const char* test);

// The bits of a float and back (bit-exact comparisons; NaN payloads included).
inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

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
