// float64 reference of the MoE layer: one straightforward pass per routing pair.
#include "reference/reference_layer.hpp"

#include <cmath>

#include "moeblaze/error.hpp"

namespace moeblaze::reference {

namespace {
// gpt-oss's clamped SwiGLU (swiglu_oai): sigmoid's scale and the clamp limit of g and u (the
// float values the CPU and GPU code use, widened).
constexpr double kOaiAlpha = double(1.702f);
constexpr double kOaiLimit = 7.0;
}  // namespace

double activation_f(Activation act, double v) {
  switch (act) {
    case Activation::swiglu:
    case Activation::silu: return v / (1.0 + std::exp(-v));
    case Activation::geglu:
    case Activation::gelu: return 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0)));
    case Activation::relu: return v > 0 ? v : 0.0;
    case Activation::relu2: return v > 0 ? v * v : 0.0;
    case Activation::swiglu_oai: {
      const double c = v > kOaiLimit ? kOaiLimit : v;
      return c / (1.0 + std::exp(-kOaiAlpha * c));
    }
  }
  return 0.0;
}

double activation_df(Activation act, double v) {
  switch (act) {
    case Activation::swiglu:
    case Activation::silu: {
      const double sg = 1.0 / (1.0 + std::exp(-v));
      return sg + v * sg * (1.0 - sg);
    }
    case Activation::geglu:
    case Activation::gelu: {
      const double pi = 3.14159265358979323846;
      return 0.5 * (1.0 + std::erf(v / std::sqrt(2.0))) +
             v * std::exp(-0.5 * v * v) / std::sqrt(2.0 * pi);
    }
    case Activation::relu: return v > 0 ? 1.0 : 0.0;
    case Activation::relu2: return v > 0 ? 2.0 * v : 0.0;
    case Activation::swiglu_oai: {
      // zero at v == limit too: no gradient at the clamp limits (the library's convention)
      if (!(v < kOaiLimit)) return 0.0;
      const double sg = 1.0 / (1.0 + std::exp(-kOaiAlpha * v));
      return sg + kOaiAlpha * v * sg * (1.0 - sg);
    }
  }
  return 0.0;
}

double activation_up(Activation act, double u) {
  if (act != Activation::swiglu_oai) return u;
  return (u < -kOaiLimit ? -kOaiLimit : u > kOaiLimit ? kOaiLimit : u) + 1.0;
}

double activation_dup(Activation act, double u) {
  if (act != Activation::swiglu_oai) return 1.0;
  return (u > -kOaiLimit && u < kOaiLimit) ? 1.0 : 0.0;  // as torch.clamp: 0 at +-limit
}

LayerReference reference_layer(const LayerConfig& cfg, const int32_t* pair_offsets,
                               const int32_t* pair_experts, const double* pair_weights,
                               const double* x, const double* w1, const double* w2,
                               const double* d_out, const double* b1, const double* b2) {
  const int64_t T = cfg.T, d = cfg.d, n = cfg.n, E = cfg.E, R = cfg.w1_rows();
  const Activation act = cfg.activation;
  const bool gated = is_gated(act);
  const int64_t P = T > 0 ? pair_offsets[T] : 0;
  LayerReference r;
  r.out.assign(static_cast<size_t>(T * d), 0.0);
  if (d_out) {
    r.dx.assign(static_cast<size_t>(T * d), 0.0);
    r.dw1.assign(static_cast<size_t>(E * R * d), 0.0);
    r.dw2.assign(static_cast<size_t>(E * d * n), 0.0);
    r.db1.assign(static_cast<size_t>(E * R), 0.0);
    r.db2.assign(static_cast<size_t>(E * d), 0.0);
    r.d_pair_weights.assign(static_cast<size_t>(P), 0.0);
    r.d_pair_weights_abs.assign(static_cast<size_t>(P), 0.0);
  }
  std::vector<double> h(R), a(n), y(d), dap(n), dh(R);
  for (int64_t t = 0; t < T; ++t) {
    const double* xt = x + t * d;
    for (int64_t p = pair_offsets[t]; p < pair_offsets[t + 1]; ++p) {
      const int64_t e = pair_experts[p];
      MOEBLAZE_REQUIRE(e >= 0 && e < E, "pair_experts: expert id ", e, " of token ", t,
                       " is out of range [0, ", E, ")");
      const double s = pair_weights[p];
      const double* W1 = w1 + e * R * d;  // (R, d)
      const double* W2 = w2 + e * d * n;  // (d, n)
      for (int64_t i = 0; i < R; ++i) {
        double acc = 0;
        for (int64_t k = 0; k < d; ++k) acc += W1[i * d + k] * xt[k];
        h[i] = b1 ? acc + b1[e * R + i] : acc;
      }
      for (int64_t j = 0; j < n; ++j)
        a[j] = gated ? activation_f(act, h[j]) * activation_up(act, h[n + j])
                     : activation_f(act, h[j]);
      for (int64_t i = 0; i < d; ++i) {
        double acc = 0;
        for (int64_t j = 0; j < n; ++j) acc += W2[i * n + j] * a[j];
        if (b2) acc += b2[e * d + i];
        y[i] = acc;
        r.out[t * d + i] += s * acc;
      }
      if (!d_out) continue;
      const double* dot = d_out + t * d;
      double ds = 0, ds_abs = 0;
      for (int64_t j = 0; j < n; ++j) {
        double acc = 0;
        for (int64_t i = 0; i < d; ++i) acc += W2[i * n + j] * dot[i];
        dap[j] = acc;
        ds += acc * a[j];
        ds_abs += std::fabs(acc * a[j]);
      }
      for (int64_t i = 0; b2 && i < d; ++i) {
        ds += dot[i] * b2[e * d + i];
        ds_abs += std::fabs(dot[i] * b2[e * d + i]);
      }
      r.d_pair_weights[p] = ds;
      r.d_pair_weights_abs[p] = ds_abs;
      for (int64_t j = 0; j < n; ++j) {
        const double da = s * dap[j];
        if (gated) {
          dh[j] = da * activation_up(act, h[n + j]) * activation_df(act, h[j]);
          dh[n + j] = da * activation_f(act, h[j]) * activation_dup(act, h[n + j]);
        } else {
          dh[j] = da * activation_df(act, h[j]);
        }
      }
      double* dW1 = r.dw1.data() + e * R * d;
      double* dW2 = r.dw2.data() + e * d * n;
      for (int64_t i = 0; i < R; ++i)
        for (int64_t k = 0; k < d; ++k) {
          r.dx[t * d + k] += W1[i * d + k] * dh[i];
          dW1[i * d + k] += dh[i] * xt[k];
        }
      for (int64_t i = 0; i < d; ++i)
        for (int64_t j = 0; j < n; ++j) dW2[i * n + j] += s * dot[i] * a[j];
      for (int64_t i = 0; i < R; ++i) r.db1[e * R + i] += dh[i];
      for (int64_t i = 0; i < d; ++i) r.db2[e * d + i] += s * dot[i];
    }
  }
  return r;
}

namespace {
std::vector<double> widen(const TensorView& t, const char* name) {
  MOEBLAZE_REQUIRE(t.device == Device::cpu, name, " is on ", device_name(t.device),
                   ", expected cpu");
  std::vector<double> v(static_cast<size_t>(t.numel()));
  if (t.dtype == DType::bf16) {
    for (size_t i = 0; i < v.size(); ++i) v[i] = float(t.as<const bf16>()[i]);
  } else if (t.dtype == DType::f32) {
    for (size_t i = 0; i < v.size(); ++i) v[i] = t.as<const float>()[i];
  } else if (t.dtype == DType::f64) {
    for (size_t i = 0; i < v.size(); ++i) v[i] = t.as<const double>()[i];
  } else {
    MOEBLAZE_REQUIRE(false, name, " has dtype ", dtype_name(t.dtype), ", expected a float type");
  }
  return v;
}
}  // namespace

LayerReference reference_layer(const LayerConfig& cfg, const RoutingView& routing,
                               const TensorView& x, const TensorView& w1, const TensorView& w2,
                               const TensorView& d_out, const TensorView& b1,
                               const TensorView& b2) {
  require_shape(x, "x", {cfg.T, cfg.d});
  require_shape(w1, "w1", {cfg.E, cfg.w1_rows(), cfg.d});
  require_shape(w2, "w2", {cfg.E, cfg.d, cfg.n});
  MOEBLAZE_REQUIRE(routing.T == cfg.T && routing.E == cfg.E, "routing has T = ", routing.T,
                   ", E = ", routing.E, ", expected T = ", cfg.T, ", E = ", cfg.E);
  MOEBLAZE_REQUIRE(routing.device == Device::cpu, "routing is on ", device_name(routing.device),
                   ", expected cpu");
  const bool with_grad = d_out.rank != 0;  // a default TensorView: forward only
  if (with_grad) require_shape(d_out, "d_out", {cfg.T, cfg.d});
  const std::vector<double> xd = widen(x, "x"), w1d = widen(w1, "w1"), w2d = widen(w2, "w2");
  const std::vector<double> dod = with_grad ? widen(d_out, "d_out") : std::vector<double>();
  if (b1.rank != 0) require_shape(b1, "b1", {cfg.E, cfg.w1_rows()});
  if (b2.rank != 0) require_shape(b2, "b2", {cfg.E, cfg.d});
  const std::vector<double> b1d = b1.rank != 0 ? widen(b1, "b1") : std::vector<double>();
  const std::vector<double> b2d = b2.rank != 0 ? widen(b2, "b2") : std::vector<double>();
  std::vector<double> pw(static_cast<size_t>(routing.P));
  for (int64_t p = 0; p < routing.P; ++p) pw[p] = routing.pair_weights[p];
  static const double kNone = 0.0;  // a non-null d_out for T = 0 (nothing is read)
  return reference_layer(cfg, routing.pair_offsets, routing.pair_experts, pw.data(), xd.data(),
                         w1d.data(), w2d.data(),
                         with_grad ? (dod.empty() ? &kNone : dod.data()) : nullptr,
                         b1.rank != 0 ? b1d.data() : nullptr, b2.rank != 0 ? b2d.data() : nullptr);
}

double reference_loss(const LayerConfig& cfg, const int32_t* pair_offsets,
                      const int32_t* pair_experts, const double* pair_weights, const double* x,
                      const double* w1, const double* w2, const double* d_out, const double* b1,
                      const double* b2) {
  const LayerReference r =
      reference_layer(cfg, pair_offsets, pair_experts, pair_weights, x, w1, w2, nullptr, b1, b2);
  double loss = 0;
  for (size_t i = 0; i < r.out.size(); ++i) loss += d_out[i] * r.out[i];
  return loss;
}

}  // namespace moeblaze::reference
