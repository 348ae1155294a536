#include "common/test_util.hpp"

#include <cinttypes>
#include <cstdio>

namespace moeblaze::test {

uint64_t fresh_seed() {
  std::random_device rd;
  return (uint64_t(rd()) << 32) ^ rd();
}

uint64_t printed_seed(const char* test) {
  const uint64_t seed = fresh_seed();
  std::printf("[ seed ] %s %" PRIu64 "\n", test, seed);
  return seed;
}

std::vector<float> random_normal(size_t count, uint64_t seed, float stddev) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(count);
  for (auto& x : v) {
    do x = dist(rng); while (x == 0.0f);
  }
  return v;
}

std::vector<bf16> to_bf16(const std::vector<float>& v) {
  std::vector<bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16(v[i]);
  return out;
}

std::vector<float> to_float(const std::vector<bf16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = float(v[i]);
  return out;
}

}  // namespace moeblaze::test
