// The public routing API (routing.hpp): every function checks shapes, dtypes, devices and
// configuration here, before any output is touched, then dispatches on the device. Value checks
// that need a pass over the data (non-finite logits, expert ids) happen in the backend, still
// before any output is written; outputs that are Routing objects are only assigned at the end.
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/aliasing.hpp"
#include "core/checked_math.hpp"
#include "core/routing_validation.hpp"
#include "cpu/cpu_backend.hpp"
#include "moeblaze/error.hpp"
#include "moeblaze/routing.hpp"
#ifdef MOEBLAZE_WITH_CUDA
#include "cuda/cuda_backend.hpp"
#endif

namespace moeblaze {
namespace {

// A tensor argument counts as given when it has elements (rank >= 1) or, as a rank-0 view, a
// pointer. A default TensorView{} is "not given".
bool is_given(const TensorView& t) { return t.rank > 0 ? t.numel() > 0 : t.data != nullptr; }

void require_router_config(const RouterConfig& cfg, int64_t E, const char* fn) {
  MOEBLAZE_REQUIRE(cfg.kind == RouterKind::softmax_topk || cfg.kind == RouterKind::topk_softmax ||
                       cfg.kind == RouterKind::sigmoid_bias || cfg.kind == RouterKind::supplied,
                   fn, ": router kind (", int(cfg.kind), ") is not a RouterKind");
  MOEBLAZE_REQUIRE(cfg.kind != RouterKind::supplied, fn,
                   ": the supplied router has no logits (build its routing with "
                   "routing_from_ids; its d pair_weights are the gradient itself)");
  MOEBLAZE_REQUIRE(cfg.top_k >= 1, "top_k (", cfg.top_k, ") must be >= 1");
  MOEBLAZE_REQUIRE(cfg.top_k <= E, "top_k (", cfg.top_k, ") exceeds num_experts (", E, ")");
  MOEBLAZE_REQUIRE(std::isfinite(cfg.aux_loss_coef) && cfg.aux_loss_coef >= 0.0f,
                   "aux_loss_coef (", cfg.aux_loss_coef, ") must be finite and >= 0");
  MOEBLAZE_REQUIRE(std::isfinite(cfg.z_loss_coef) && cfg.z_loss_coef >= 0.0f, "z_loss_coef (",
                   cfg.z_loss_coef, ") must be finite and >= 0");
}

// logits (T, E) fp32 or bf16, E >= 1.
void require_logits(const TensorView& logits) {
  MOEBLAZE_REQUIRE(logits.rank == 2, "logits must be (T, E), got ", logits.describe());
  require_float_dtype(logits, "logits");
  MOEBLAZE_REQUIRE(logits.dim(0) >= 0, "logits has ", logits.dim(0), " rows (T must be >= 0)");
  MOEBLAZE_REQUIRE(logits.dim(1) >= 1, "logits has ", logits.dim(1),
                   " columns (num_experts must be >= 1)");
  require_data(logits, "logits");
}

// bias (E,) fp32 on the logits' device for sigmoid_bias; absent for every other router.
void require_bias(const RouterConfig& cfg, const TensorView& bias, const TensorView& logits) {
  const int64_t E = logits.dim(1);
  if (cfg.kind == RouterKind::sigmoid_bias) {
    MOEBLAZE_REQUIRE(is_given(bias), "bias (", E,
                     ",) fp32 is required by the sigmoid-bias router, got none");
    require_shape(bias, "bias", {E});
    require_dtype(bias, "bias", DType::f32);
    require_data(bias, "bias");
    MOEBLAZE_REQUIRE(bias.device == logits.device, "bias is on ", device_name(bias.device),
                     " but logits are on ", device_name(logits.device));
  } else {
    MOEBLAZE_REQUIRE(!is_given(bias), "bias is given but the ", router_name(cfg.kind),
                     " router takes none (only sigmoid-bias uses a bias)");
  }
}

// A routing view consistent with logits (T, E) and on their device.
void require_routing_matches(const RoutingView& r, const char* name, const TensorView& logits) {
  MOEBLAZE_REQUIRE(r.T == logits.dim(0), name, " has T = ", r.T, " tokens but logits have ",
                   logits.dim(0));
  MOEBLAZE_REQUIRE(r.E == logits.dim(1), name, " has E = ", r.E, " experts but logits have ",
                   logits.dim(1));
  MOEBLAZE_REQUIRE(r.device == logits.device, name, " is on ", device_name(r.device),
                   " but logits are on ", device_name(logits.device));
}

[[noreturn]] void no_backend(const char* name, Device device, const char* what) {
#ifdef MOEBLAZE_WITH_CUDA
  throw Unsupported(detail::concat(name, " is on ", device_name(device), ": the CUDA ", what,
                                   " is not implemented yet"));
#else
  throw Unsupported(detail::concat(name, " is on ", device_name(device), ": the CUDA ", what,
                                   " is not built in (moeblaze was built without CUDA)"));
#endif
}

const char* nonfinite_name(float v) { return std::isnan(v) ? "nan" : "inf"; }


}  // namespace

RouterLosses route(const RouterConfig& cfg, const TensorView& logits, const TensorView& bias,
                   Routing& out) {
  require_logits(logits);
  require_router_config(cfg, logits.dim(1), "route");
  require_bias(cfg, bias, logits);
  require_pairs_fit(logits.dim(0), cfg.top_k);
  if (logits.device == Device::cpu) return cpu::route(cfg, logits, bias, out);
#ifdef MOEBLAZE_WITH_CUDA
  if (logits.device == Device::cuda) return cuda::route(cfg, logits, bias, out);
#endif
  no_backend("logits", logits.device, "router");
}

void routing_from_ids(const TensorView& ids, const TensorView& weights, int64_t num_experts,
                      Routing& out) {
  MOEBLAZE_REQUIRE(num_experts >= 1, "num_experts (", num_experts, ") must be >= 1");
  MOEBLAZE_REQUIRE(num_experts < kInt32Limit, "num_experts (", num_experts,
                   ") must be < 2^31: expert ids are int32");
  MOEBLAZE_REQUIRE(ids.rank == 2, "ids must be (T, K), got ", ids.describe());
  require_dtype(ids, "ids", DType::i32);
  const int64_t T = ids.dim(0), K = ids.dim(1);
  MOEBLAZE_REQUIRE(T >= 0, "ids has ", T, " rows (T must be >= 0)");
  MOEBLAZE_REQUIRE(K >= 1, "ids has ", K, " columns (top_k must be >= 1)");
  MOEBLAZE_REQUIRE(K <= num_experts, "top_k (", K, ") exceeds num_experts (", num_experts, ")");
  require_pairs_fit(T, K);
  require_shape(weights, "weights", {T, K});
  require_dtype(weights, "weights", DType::f32);
  require_data(ids, "ids");
  require_data(weights, "weights");
  MOEBLAZE_REQUIRE(weights.device == ids.device, "weights are on ", device_name(weights.device),
                   " but ids are on ", device_name(ids.device));
  if (ids.device != Device::cpu) no_backend("ids", ids.device, "routing_from_ids");

  const int32_t* id = ids.as<const int32_t>();   // (T, K)
  const float* w = weights.as<const float>();    // (T, K)
  std::vector<std::pair<int32_t, int32_t>> scratch;  // (K,) for first_repeat
  for (int64_t t = 0; t < T; ++t) {
    const Repeat rep = first_repeat(id + t * K, K, scratch);
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = id[t * K + k];
      MOEBLAZE_REQUIRE(e >= 0 && e < num_experts, "ids[", t, ", ", k, "]: expert id ", e,
                       " of token ", t, " is out of range [0, ", num_experts, ")");
      MOEBLAZE_REQUIRE(k != rep.later, "ids: expert ", e, " appears twice in token ", t);
      const float v = w[t * K + k];
      MOEBLAZE_REQUIRE(std::isfinite(v), "weights[", t, ", ", k, "] (token ", t, ") is ",
                       nonfinite_name(v), ": weights must be finite");
    }
  }
  Routing r(Device::cpu, T, num_experts, T * K);
  for (int64_t t = 0; t <= T; ++t) r.pair_offsets()[t] = static_cast<int32_t>(t * K);
  std::copy(id, id + T * K, r.pair_experts());
  std::copy(w, w + T * K, r.pair_weights());
  out = std::move(r);
}

void router_backward(const RouterConfig& cfg, const TensorView& logits, const TensorView& bias,
                     const RoutingView& routing, const TensorView& d_pair_weights,
                     const TensorView& d_logits) {
  require_logits(logits);
  const int64_t T = logits.dim(0), E = logits.dim(1);
  require_router_config(cfg, E, "router_backward");
  require_bias(cfg, bias, logits);
  require_routing_matches(routing, "routing", logits);
  require_shape(d_pair_weights, "d_pair_weights", {routing.P});
  require_dtype(d_pair_weights, "d_pair_weights", DType::f32);
  require_data(d_pair_weights, "d_pair_weights");
  require_shape(d_logits, "d_logits", {T, E});
  require_dtype(d_logits, "d_logits", DType::f32);
  require_data(d_logits, "d_logits");
  MOEBLAZE_REQUIRE(d_pair_weights.device == logits.device, "d_pair_weights is on ",
                   device_name(d_pair_weights.device), " but logits are on ",
                   device_name(logits.device));
  MOEBLAZE_REQUIRE(d_logits.device == logits.device, "d_logits is on ",
                   device_name(d_logits.device), " but logits are on ",
                   device_name(logits.device));
  const size_t pair_bytes = sizeof(int32_t) * static_cast<size_t>(routing.P);
  require_disjoint({byte_range(d_logits, "d_logits")},
                   {byte_range(logits, "logits"), byte_range(bias, "bias"),
                    byte_range(d_pair_weights, "d_pair_weights"),
                    {routing.pair_offsets, sizeof(int32_t) * static_cast<size_t>(routing.T + 1),
                     "routing.pair_offsets"},
                    {routing.pair_experts, pair_bytes, "routing.pair_experts"},
                    {routing.pair_weights, pair_bytes, "routing.pair_weights"}});
  if (logits.device == Device::cpu) {
    validate_routing(routing);
    cpu::router_backward(cfg, logits, bias, routing, d_pair_weights, d_logits);
    return;
  }
#ifdef MOEBLAZE_WITH_CUDA
  if (logits.device == Device::cuda) {
    cuda::router_backward(cfg, logits, bias, routing, d_pair_weights, d_logits);
    return;
  }
#endif
  no_backend("logits", logits.device, "router backward");
}

void token_round(const RouterConfig& router, const TokenRoundingConfig& cfg,
                 const TensorView& logits, const TensorView& bias, const RoutingView& topk,
                 Routing& out) {
  require_logits(logits);
  require_router_config(router, logits.dim(1), "token_round");
  require_bias(router, bias, logits);
  MOEBLAZE_REQUIRE(cfg.m_tile >= 1, "m_tile (", cfg.m_tile, ") must be >= 1");
  MOEBLAZE_REQUIRE(cfg.mode == RoundingMode::nearest_freq ||
                       cfg.mode == RoundingMode::stochastic_freq || cfg.mode == RoundingMode::up ||
                       cfg.mode == RoundingMode::down,
                   "token rounding mode (", int(cfg.mode), ") is not a RoundingMode");
  require_routing_matches(topk, "topk", logits);
  if (logits.device == Device::cpu) {
    validate_routing(topk);
    cpu::token_round(router, cfg, logits, bias, topk, out);
    return;
  }
#ifdef MOEBLAZE_WITH_CUDA
  if (logits.device == Device::cuda) {
    cuda::token_round(router, cfg, logits, bias, topk, out);
    return;
  }
#endif
  no_backend("logits", logits.device, "token rounding");
}

}  // namespace moeblaze
