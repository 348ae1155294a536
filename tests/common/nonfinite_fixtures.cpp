#include "common/nonfinite_fixtures.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace moeblaze::test {

const char* plant_name(PlantIn where) {
  switch (where) {
    case PlantIn::x: return "x";
    case PlantIn::w1: return "w1";
    case PlantIn::w2: return "w2";
    case PlantIn::d_out: return "d_out";
  }
  return "?";
}

std::string Plant::describe() const {
  return std::string(plant_name(where)) + "[" + std::to_string(index) + "] = " +
         (std::isnan(value) ? "nan" : value > 0 ? "inf" : "-inf");
}

std::vector<float> nonfinite_values() {
  return {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
          -std::numeric_limits<float>::infinity()};
}

void plant(LayerTensors& t, const Plant& p) {
  HostTensor* h = p.where == PlantIn::x    ? &t.x
                  : p.where == PlantIn::w1 ? &t.w1
                  : p.where == PlantIn::w2 ? &t.w2
                                           : &t.d_out;
  h->set(p.index, p.value);
}

int64_t expect_same_nonfinite(const char* what, const HostTensor& got,
                              const std::vector<double>& ref) {
  EXPECT_EQ(size_t(got.numel()), ref.size()) << what;
  int64_t bad = 0;
  bool reported = false;
  for (size_t i = 0; i < ref.size() && i < size_t(got.numel()); ++i) {
    const double g = got.at(int64_t(i));
    bad += !std::isfinite(g);
    if (!reported && std::isfinite(g) != std::isfinite(ref[i])) {
      ADD_FAILURE() << what << "[" << i << "] is " << g << ", the yardstick has " << ref[i];
      reported = true;
    }
  }
  return bad;
}

double finite_rel_error(const HostTensor& got, const std::vector<double>& ref,
                        const std::vector<double>& scale) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size() && i < size_t(got.numel()); ++i) {
    const double g = got.at(int64_t(i));
    if (!std::isfinite(g) || !std::isfinite(ref[i])) continue;
    const double s = scale.empty() ? ref[i] : scale[i];
    if (!std::isfinite(s)) continue;
    num += (g - ref[i]) * (g - ref[i]);
    den += s * s;
  }
  if (den == 0) return num == 0 ? 0.0 : INFINITY;
  return std::sqrt(num / den);
}

void expect_nonfinite_like(const LayerTensors& got, const std::vector<double>& out,
                           const std::vector<double>& dx, const std::vector<double>& dw1,
                           const std::vector<double>& dw2, const std::vector<double>& dpw,
                           const std::vector<double>& dpw_scale, double tolerance,
                           bool dw1_mask) {
  const std::vector<double> none;
  const struct {
    const char* name;
    const HostTensor& got;
    const std::vector<double>& ref;
    const std::vector<double>& scale;
  } outputs[] = {{"out", got.out, out, none},
                 {"dx", got.dx, dx, none},
                 {"dw1", got.dw1, dw1, none},
                 {"dw2", got.dw2, dw2, none},
                 {"d_pair_weights", got.d_pair_weights, dpw, dpw_scale}};
  for (const auto& o : outputs) {
    if (dw1_mask || &o.got != &got.dw1) expect_same_nonfinite(o.name, o.got, o.ref);
    EXPECT_LE(finite_rel_error(o.got, o.ref, o.scale), tolerance) << o.name << ", finite part";
  }
}

}  // namespace moeblaze::test
