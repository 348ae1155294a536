#include "common/layer_fixtures.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <utility>

#include "common/test_util.hpp"

namespace moeblaze::test {

RoutingView HostRouting::view() const {
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

HostRouting random_routing(const RoutingSpec& spec, uint64_t seed) {
  std::mt19937_64 rng(seed);
  HostRouting r;
  r.T = spec.T;
  r.E = spec.E;
  r.offsets.assign(static_cast<size_t>(spec.T + 1), 0);
  std::vector<int32_t> perm(spec.E);
  for (int64_t e = 0; e < spec.E; ++e) perm[e] = static_cast<int32_t>(e);
  std::shuffle(perm.begin(), perm.end(), rng);
  // perm[0, used) may be chosen; perm[used, E) are the empty experts.
  const int64_t used = spec.E - spec.empty_experts;
  const int64_t hot = std::max<int64_t>(1, used / 5);
  std::bernoulli_distribution pick_hot(0.8);
  std::uniform_real_distribution<float> wdist(0.05f, 1.0f);
  for (int64_t t = 0; t < spec.T; ++t) {
    r.offsets[t] = static_cast<int32_t>(r.experts.size());
    const size_t first = r.experts.size();
    while (static_cast<int64_t>(r.experts.size() - first) < spec.K) {
      int64_t j;
      if (spec.skew && hot < used) {
        const bool h = pick_hot(rng);
        j = std::uniform_int_distribution<int64_t>(h ? 0 : hot, h ? hot - 1 : used - 1)(rng);
      } else {
        j = std::uniform_int_distribution<int64_t>(0, used - 1)(rng);
      }
      const int32_t e = perm[j];
      if (std::find(r.experts.begin() + first, r.experts.end(), e) == r.experts.end()) {
        r.experts.push_back(e);
        r.weights.push_back(wdist(rng));
      }
    }
  }
  r.offsets[spec.T] = static_cast<int32_t>(r.experts.size());
  return r;
}

void drop_some_tokens(HostRouting& routing, std::mt19937_64& rng, double p) {
  HostRouting r;
  r.T = routing.T;
  r.E = routing.E;
  r.offsets.push_back(0);
  std::bernoulli_distribution drop(p);
  for (int64_t t = 0; t < routing.T; ++t) {
    if (!drop(rng))
      for (int32_t q = routing.offsets[t]; q < routing.offsets[t + 1]; ++q) {
        r.experts.push_back(routing.experts[q]);
        r.weights.push_back(routing.weights[q]);
      }
    r.offsets.push_back(static_cast<int32_t>(r.experts.size()));
  }
  routing = std::move(r);
}

HostTensor::HostTensor(DType dt, std::vector<int64_t> dims) : dtype(dt), shape(std::move(dims)) {
  bytes.assign(static_cast<size_t>(numel()) * dtype_size(dtype), 0);
}

int64_t HostTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

TensorView HostTensor::view() const {
  TensorView v;
  v.data = bytes.empty() ? nullptr : const_cast<unsigned char*>(bytes.data());
  v.dtype = dtype;
  v.device = Device::cpu;
  v.rank = static_cast<int>(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) v.shape[i] = shape[i];
  return v;
}

double HostTensor::at(int64_t i) const {
  switch (dtype) {
    case DType::f32: return reinterpret_cast<const float*>(bytes.data())[i];
    case DType::bf16: return float(reinterpret_cast<const bf16*>(bytes.data())[i]);
    case DType::f64: return reinterpret_cast<const double*>(bytes.data())[i];
    case DType::i32: return reinterpret_cast<const int32_t*>(bytes.data())[i];
  }
  return 0;
}

void HostTensor::set(int64_t i, double v) {
  switch (dtype) {
    case DType::f32: reinterpret_cast<float*>(bytes.data())[i] = static_cast<float>(v); break;
    case DType::bf16:
      reinterpret_cast<bf16*>(bytes.data())[i] = bf16(static_cast<float>(v));
      break;
    case DType::f64: reinterpret_cast<double*>(bytes.data())[i] = v; break;
    case DType::i32: reinterpret_cast<int32_t*>(bytes.data())[i] = static_cast<int32_t>(v); break;
  }
}

std::vector<double> HostTensor::to_double() const {
  std::vector<double> v(static_cast<size_t>(numel()));
  for (int64_t i = 0; i < numel(); ++i) v[i] = at(i);
  return v;
}

void HostTensor::fill_random(uint64_t seed, float stddev) {
  const std::vector<float> v = random_normal(static_cast<size_t>(numel()), seed, stddev);
  for (int64_t i = 0; i < numel(); ++i) {
    set(i, v[i]);
    if (at(i) == 0.0) set(i, stddev);  // bf16 rounding cannot make a N(0, s) draw zero, but be sure
  }
}

void HostTensor::fill_pattern() {
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<unsigned char>(0x5a ^ (i * 31));
}

LayerTensors::LayerTensors(const LayerConfig& cfg, int64_t S)
    : x(cfg.dtype, {cfg.T, cfg.d}),
      w1(cfg.dtype, {cfg.E, cfg.w1_rows(), cfg.d}),
      w2(cfg.dtype, {cfg.E, cfg.d, cfg.n}),
      out(cfg.dtype, {cfg.T, cfg.d}),
      d_out(cfg.dtype, {cfg.T, cfg.d}),
      dx(cfg.dtype, {cfg.T, cfg.d}),
      dw1(cfg.dtype, {cfg.E, cfg.w1_rows(), cfg.d}),
      dw2(cfg.dtype, {cfg.E, cfg.d, cfg.n}),
      d_pair_weights(DType::f32, {S}) {
  pattern_outputs();  // never zeros, so that a kernel that skips a row is caught
}

void LayerTensors::pattern_outputs() {
  out.fill_pattern();
  dx.fill_pattern();
  dw1.fill_pattern();
  dw2.fill_pattern();
  d_pair_weights.fill_pattern();
}

void LayerTensors::randomize(uint64_t seed) {
  const int64_t d = x.shape[1], n = w2.shape[2];
  x.fill_random(seed + 1, 1.0f);
  w1.fill_random(seed + 2, 1.0f / std::sqrt(float(d)));
  w2.fill_random(seed + 3, 1.0f / std::sqrt(float(n)));
  d_out.fill_random(seed + 4, 1.0f);
}

LayerGrads LayerTensors::grads() const {
  LayerGrads g;
  g.dx = dx.view();
  g.dw1 = dw1.view();
  g.dw2 = dw2.view();
  g.d_pair_weights = d_pair_weights.view();
  return g;
}

RoutingPlan make_plan(const HostRouting& r) {
  RoutingPlan plan;
  build_routing_plan(r.view(), PlanBuilder::atomic_free, plan);
  return plan;
}

void run_layer(const LayerConfig& cfg, const RoutingPlan& plan, LayerTensors& t,
               const LayerOptions& opts, SavedForBackward* keep_saved) {
  SavedForBackward saved;
  layer_forward(cfg, plan, t.x.view(), t.w1.view(), t.w2.view(), t.out.view(), saved, opts);
  layer_backward(cfg, plan, t.x.view(), t.w1.view(), t.w2.view(), t.d_out.view(), saved,
                 t.grads(), opts);
  if (keep_saved) *keep_saved = std::move(saved);
}

bool bitwise_equal(const HostTensor& a, const HostTensor& b) {
  return a.dtype == b.dtype && a.shape == b.shape && a.bytes == b.bytes;
}

void expect_same_results(const LayerTensors& a, const LayerTensors& b) {
  EXPECT_TRUE(bitwise_equal(a.out, b.out)) << "out";
  EXPECT_TRUE(bitwise_equal(a.dx, b.dx)) << "dx";
  EXPECT_TRUE(bitwise_equal(a.dw1, b.dw1)) << "dw1";
  EXPECT_TRUE(bitwise_equal(a.dw2, b.dw2)) << "dw2";
  EXPECT_TRUE(bitwise_equal(a.d_pair_weights, b.d_pair_weights)) << "d_pair_weights";
}

double layer_tol(DType dt) { return dt == DType::bf16 ? 1e-2 : 1e-5; }

void expect_close(const char* what, const HostTensor& got, const std::vector<double>& ref,
                  double tolerance) {
  ASSERT_EQ(size_t(got.numel()), ref.size()) << what;
  const double err = rel_error(got, ref);
  EXPECT_LE(err, tolerance) << what << ": relative Frobenius error " << err;
}

double rel_error(const HostTensor& a, const std::vector<double>& ref) {
  if (static_cast<size_t>(a.numel()) != ref.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double v = a.at(static_cast<int64_t>(i));
    if (!std::isfinite(v)) return INFINITY;
    num += (v - ref[i]) * (v - ref[i]);
    den += ref[i] * ref[i];
  }
  if (den == 0) return num == 0 ? 0.0 : INFINITY;
  return std::sqrt(num / den);
}

double scaled_error(const HostTensor& a, const std::vector<double>& ref,
                    const std::vector<double>& scale) {
  if (static_cast<size_t>(a.numel()) != ref.size() || ref.size() != scale.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double v = a.at(static_cast<int64_t>(i));
    if (!std::isfinite(v)) return INFINITY;
    num += (v - ref[i]) * (v - ref[i]);
    den += scale[i] * scale[i];
  }
  if (den == 0) return num == 0 ? 0.0 : INFINITY;
  return std::sqrt(num / den);
}

}  // namespace moeblaze::test
