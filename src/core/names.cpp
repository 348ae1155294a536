// Names and parsing of the public enums, and LayerConfig validation.
#include <string>

#include "core/checked_math.hpp"
#include "moeblaze/config.hpp"
#include "moeblaze/error.hpp"
#include "moeblaze/layer.hpp"
#include "moeblaze/routing_plan.hpp"

namespace moeblaze {
DType parse_dtype(const std::string& s) {
  if (s == "fp32" || s == "float32" || s == "f32") return DType::f32;
  if (s == "bf16" || s == "bfloat16") return DType::bf16;
  throw InvalidArgument("dtype '" + s + "' is not one of: fp32, bf16");
}

const char* activation_name(Activation a) {
  switch (a) {
    case Activation::swiglu: return "swiglu";
    case Activation::geglu: return "geglu";
    case Activation::relu: return "relu";
    case Activation::silu: return "silu";
    case Activation::gelu: return "gelu";
    case Activation::relu2: return "relu2";
    case Activation::swiglu_oai: return "swiglu-oai";
  }
  return "?";
}
Activation parse_activation(const std::string& s) {
  for (Activation a : {Activation::swiglu, Activation::geglu, Activation::relu, Activation::silu,
                       Activation::gelu, Activation::relu2, Activation::swiglu_oai})
    if (s == activation_name(a)) return a;
  if (s == "relu²" || s == "relu^2") return Activation::relu2;
  throw InvalidArgument("activation '" + s +
                        "' is not one of: swiglu, geglu, relu, silu, gelu, relu2, swiglu-oai");
}

const char* router_name(RouterKind r) {
  switch (r) {
    case RouterKind::softmax_topk: return "softmax-topk";
    case RouterKind::topk_softmax: return "topk-softmax";
    case RouterKind::sigmoid_bias: return "sigmoid-bias";
    case RouterKind::supplied: return "supplied";
  }
  return "?";
}
RouterKind parse_router(const std::string& s) {
  for (RouterKind r : {RouterKind::softmax_topk, RouterKind::topk_softmax,
                       RouterKind::sigmoid_bias, RouterKind::supplied})
    if (s == router_name(r)) return r;
  throw InvalidArgument("router '" + s +
                        "' is not one of: softmax-topk, topk-softmax, sigmoid-bias, supplied");
}

const char* rounding_name(RoundingMode m) {
  switch (m) {
    case RoundingMode::nearest_freq: return "nr-f";
    case RoundingMode::stochastic_freq: return "sr-f";
    case RoundingMode::up: return "up";
    case RoundingMode::down: return "down";
  }
  return "?";
}
RoundingMode parse_rounding(const std::string& s) {
  for (RoundingMode m : {RoundingMode::nearest_freq, RoundingMode::stochastic_freq,
                         RoundingMode::up, RoundingMode::down})
    if (s == rounding_name(m)) return m;
  throw InvalidArgument("token rounding '" + s + "' is not one of: nr-f, sr-f, up, down");
}

const char* plan_builder_name(PlanBuilder b) {
  return b == PlanBuilder::atomic_free ? "atomic-free" : "sort";
}

const char* layer_mode_name(LayerMode m) {
  switch (m) {
    case LayerMode::keep_h: return "moeblaze";
    case LayerMode::recompute: return "moeblaze-recompute";
    case LayerMode::materialized: return "materialized";
  }
  return "?";
}

const char* compute_name(Compute c) {
  switch (c) {
    case Compute::storage: return "storage";
    case Compute::fp8: return "fp8";
    case Compute::fp8_wgrad: return "fp8-wgrad";
  }
  return "?";
}

Compute parse_compute(const std::string& s) {
  if (s == "storage" || s == "bf16" || s == "fp32") return Compute::storage;
  if (s == "fp8" || s == "fp8-e4m3" || s == "e4m3") return Compute::fp8;
  if (s == "fp8-wgrad") return Compute::fp8_wgrad;
  throw InvalidArgument("compute '" + s + "' is not one of: storage (bf16, fp32), fp8, fp8-wgrad");
}

size_t LayerConfig::kept_h_scales_offset(int64_t S) const {
  if (!is_fp8(compute)) return static_cast<size_t>(S * w1_rows()) * dtype_size(dtype);
  return (static_cast<size_t>(S * w1_rows()) + 15) / 16 * 16;  // e4m3 codes, then 16-aligned
}

size_t LayerConfig::kept_h_bytes(int64_t S) const {
  const size_t codes = kept_h_scales_offset(S);
  if (!is_fp8(compute)) return codes;
  return codes + static_cast<size_t>(S * ((w1_rows() + 127) / 128)) * sizeof(float);
}

void LayerConfig::validate() const {
  MOEBLAZE_REQUIRE(T >= 0, "T (", T, ") must be >= 0");
  MOEBLAZE_REQUIRE(d >= 1, "d (", d, ") must be >= 1");
  MOEBLAZE_REQUIRE(n >= 1, "n (", n, ") must be >= 1");
  MOEBLAZE_REQUIRE(E >= 1, "num_experts E (", E, ") must be >= 1");
  MOEBLAZE_REQUIRE(K >= 1, "top_k K (", K, ") must be >= 1");
  MOEBLAZE_REQUIRE(K <= E, "top_k K (", K, ") exceeds num_experts E (", E, ")");
  // Enums first: a value outside the enum (from a cast or a C caller) must not reach a switch.
  MOEBLAZE_REQUIRE(activation <= Activation::swiglu_oai, "activation (", int(activation),
                   ") is not an Activation: must be 0..6 (swiglu, geglu, relu, silu, gelu, relu2, "
                   "swiglu-oai)");
  MOEBLAZE_REQUIRE(dtype == DType::f32 || dtype == DType::bf16, "dtype (",
                   dtype <= DType::f64 ? dtype_name(dtype) : std::to_string(int(dtype)),
                   ") must be fp32 or bf16");
  MOEBLAZE_REQUIRE(compute <= Compute::fp8_wgrad, "compute (", int(compute),
                   ") is not a Compute: must be 0 (storage), 1 (fp8) or 2 (fp8-wgrad)");
  MOEBLAZE_REQUIRE(!is_fp8(compute) || dtype == DType::bf16, "compute ", compute_name(compute),
                   " needs bf16 storage (dtype is ", dtype_name(dtype),
                   "): the recipe quantizes bf16 operands");
  // int32 slot indices: S = T*K must fit.
  const int64_t S = checked_mul(T, K, "T*K");
  MOEBLAZE_REQUIRE(S < kInt32Limit, "T*K (", S,
                   ") exceeds the int32 index range of the routing plan");
  // Bounded so that no size derived from them (tensors, workspaces) can overflow int64.
  MOEBLAZE_REQUIRE(d < kInt32Limit, "d (", d, ") must be < 2^31");
  MOEBLAZE_REQUIRE(n < kInt32Limit, "n (", n, ") must be < 2^31");
  const int64_t size = static_cast<int64_t>(dtype_size(dtype));
  checked_mul(checked_mul(T, d, "T*d"), size, "T*d*dtype_size");
  checked_mul(checked_mul(checked_mul(E, w1_rows(), "E*w1_rows"), d, "E*w1_rows*d"), size,
              "E*w1_rows*d*dtype_size");
  checked_mul(checked_mul(checked_mul(E, d, "E*d"), n, "E*d*n"), size, "E*d*n*dtype_size");
}

}  // namespace moeblaze
