// What the fast path's translation units share (eager_experts.cpp: the module and the experts;
// eager_router.cpp: MoE's router): the C ABI's functions, resolved by ctypes in Python (_ext.py
// reads capi_functions and passes their addresses to init), and the helpers around the calls.
#pragma once

#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/utils/pybind.h>

#include <climits>
#include <cstdint>
#include <optional>

#include "moeblaze/capi.h"

namespace moeblaze_eager {

// X(name) for every moeblaze_<name> the fast path calls.
#define MOEBLAZE_EAGER_CAPI(X)                                                                 \
  X(plan_from_ids)                                                                             \
  X(plan_from_ids_workspace_bytes)                                                             \
  X(build_plan)                                                                                \
  X(plan_workspace_bytes)                                                                      \
  X(layer_pass_workspace_bytes)                                                                \
  X(layer_kept_h_bytes)                                                                        \
  X(layer_forward_biased)                                                                      \
  X(layer_backward_biased)                                                                     \
  X(route)                                                                                     \
  X(router_backward)                                                                           \
  X(router_losses)                                                                             \
  X(router_losses_workspace_bytes)                                                             \
  X(router_backward_losses)                                                                    \
  X(token_round)                                                                               \
  X(routing_take)                                                                              \
  X(routing_free)                                                                              \
  X(token_round_workspace_bytes)                                                               \
  X(token_round_count)                                                                         \
  X(token_round_fill)                                                                          \
  X(last_error)

struct Api {
#define MOEBLAZE_EAGER_FIELD(name) decltype(&moeblaze_##name) name = nullptr;
  MOEBLAZE_EAGER_CAPI(MOEBLAZE_EAGER_FIELD)
#undef MOEBLAZE_EAGER_FIELD
};
extern Api g_api;

// A C call's refusal inside an autograd function's forward, carried out of apply().
struct CallFailed {
  int rc;
};

inline int32_t dtype_code(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? 1 : 0;
}

inline void* data(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 ? t.data_ptr() : nullptr;
}

inline const float* floats(const at::Tensor& t) { return static_cast<const float*>(data(t)); }

inline int32_t device_code(const at::Tensor& t) { return t.is_cuda() ? 1 : 0; }

// A routing struct over offsets (T+1,) int32, experts (P,) int32, weights (P,) fp32, dense.
inline moeblaze_routing routing(int64_t T, int64_t E, const at::Tensor& offsets,
                                const at::Tensor& experts, const at::Tensor& weights) {
  return {T,
          E,
          experts.numel(),
          static_cast<int32_t*>(data(offsets)),
          static_cast<int32_t*>(data(experts)),
          static_cast<float*>(data(weights))};
}

// PyTorch's current stream on t's device (NULL on the CPU).
inline void* stream_of(const at::Tensor& t) {
  if (!t.is_cuda()) return nullptr;
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(t.device())
      .native_handle();
}

// t's CUDA device made current for the scope (nothing on the CPU).
inline c10::OptionalDeviceGuard device_guard(const at::Tensor& t) {
  return c10::OptionalDeviceGuard(t.is_cuda() ? std::optional<c10::Device>(t.device())
                                              : std::nullopt);
}

// Workspace bytes of a pass (0 forward, 1 backward; -1 the plan from (T, K) ids, -2 the plan
// from a CSR routing of S pairs, -3 the two-call token rounding of (T, E), -5 the router losses
// of S pairs) on CUDA, and (-4) the bytes of an fp8 call's kept H (its e4m3 codes and scales):
// functions of the sizes alone, asked once per key. Throws CallFailed.
uint64_t pass_workspace_bytes(const moeblaze_layer_cfg& c, int64_t S, int32_t pass);

// A backward's gradients `g` as Python's @once_differentiable returns them: unchanged, unless
// grad mode is on (create_graph=True) and one of `grads_in` requires grad; then they carry a
// node that raises only if something differentiates through them.
torch::autograd::variable_list once_differentiable(torch::autograd::variable_list g,
                                                   const torch::autograd::variable_list& grads_in);

// What the plan is built from, contiguous, on x's device: (T, K) ids (int32/int64) with their
// weights (fp32/bf16), moeblaze_plan_from_ids; or a CSR routing (pair_offsets (T+1,) int32,
// pair_experts (P,) int32, pair_weights (P,) fp32), moeblaze_build_plan. Not differentiable.
struct PlanSource {
  bool from_ids;
  at::Tensor ids, weights;          // from_ids
  at::Tensor offsets, experts, pw;  // otherwise
  int64_t pairs() const { return from_ids ? ids.numel() : experts.numel(); }
};

// The experts' settings: activation and compute codes, recompute, the layer config's K
// (experts_forward fills it from the plan source), and fp8 compute's weight cache (a C ABI
// handle as an integer, 0: none).
struct ExpertsArgs {
  int64_t activation;
  bool recompute;
  int64_t compute;
  int64_t K;
  int64_t fp8_cache = 0;
};

// The experts' forward (plan build, layer forward) over x (T, d), w1 (E, w1_rows, d), w2
// (E, d, n) and the optional b1, b2 (undefined: none), all checked, contiguous, x's dtype and
// device: the output (T, d) and what experts_backward reads, in this order: x, w1, w2, h, the
// plan's six arrays, b1, b2. Throws CallFailed when a C call refuses.
struct ExpertsForward {
  at::Tensor out;
  torch::autograd::variable_list keep;
  ExpertsArgs args;
};
// zeroed_flags: the plan build's (4,) int32 flags on CUDA, zeroed by the caller (undefined:
// allocated here); never read by the fast path.
ExpertsForward experts_forward(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                               const at::Tensor& b1, const at::Tensor& b2, const PlanSource& src,
                               ExpertsArgs a, const at::Tensor& zeroed_flags = {});

// The experts' backward over experts_forward's `keep`: dx, dw1, dw2, db1, db2 (undefined where
// there is no bias) and d pair weights (S,) fp32 in the routing's pair order. On CUDA dH is
// written over h (whose version it bumps).
struct ExpertsGrads {
  at::Tensor dx, dw1, dw2, dpw, db1, db2;
};
ExpertsGrads experts_backward(const torch::autograd::variable_list& keep, const ExpertsArgs& a,
                              const at::Tensor& grad_out);

// MoE's router calls (eager_router.cpp): route_call returns (pair_offsets (T+1,) int32,
// pair_experts (P,) int32, pair_weights (P,) fp32, flags (4,) int32) of logits (T, E) fp32/bf16
// (dense; bias (E,) fp32 or undefined), throwing CallFailed when moeblaze_route refuses.
// zeroed_flags: route's (4,) int32 flags, zeroed by the caller (undefined: allocated here).
torch::autograd::variable_list route_call(const at::Tensor& logits, const at::Tensor& bias,
                                          const moeblaze_router_cfg& cfg,
                                          const at::Tensor& zeroed_flags = {});

// v when it is a Python int (not a bool) in [lo, hi]; else nullopt, and the Python path names
// the argument (ops._int, ops._code).
inline std::optional<int64_t> int_in(py::handle v, int64_t lo, int64_t hi) {
  if (!PyLong_CheckExact(v.ptr())) return std::nullopt;
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
  if (overflow != 0 || x < lo || x > hi) return std::nullopt;
  return x;
}

// The experts' fast-path conditions (eager_experts.cpp; each a rule the Python path checks and
// names on failure): plain dense shapes, one dtype (bf16 on CUDA, bf16 / fp32 on the CPU; bf16
// with fp8 compute), all on x's device; b1 / b2 undefined or (E, w1_rows) / (E, d).
// fp32_weights: the weights and biases may also be fp32 beside bf16 x (the caller casts them).
bool operands_apply(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                    const at::Tensor& b1, const at::Tensor& b2, int64_t w1_rows, int64_t compute,
                    bool fp32_weights = false);

// MoE.route's settings, checked: the router's config and, when round, token rounding's m_tile,
// rounding code and seed.
struct RouteArgs {
  moeblaze_router_cfg cfg;
  bool round;
  int32_t m_tile, mode;
  uint64_t seed;
};

// MoE.route's Python values (kind, top_k, renormalize; mode None, or a rounding code with m_tile
// and seed) for (T, E) logits and bias (E,) fp32 or None on `device`, checked as the fast path
// takes them; nullopt where one breaks a rule (the Python path then names it).
std::optional<RouteArgs> route_args(py::handle kind, py::handle top_k, py::handle renormalize,
                                    py::handle mode, py::handle m_tile, py::handle seed,
                                    int64_t T, int64_t E, const std::optional<at::Tensor>& bias,
                                    const c10::Device& device);

// Token rounding (a.round's settings) of the top-K routing (offsets, experts, weights) of these
// logits: the rounded (offsets (T+1,), experts (P,), weights (P,) fp32). CUDA: one host sync,
// the pair count. Throws CallFailed when a C call refuses.
torch::autograd::variable_list round_call(const at::Tensor& logits, const at::Tensor& bias,
                                          const RouteArgs& a, const at::Tensor& offsets,
                                          const at::Tensor& experts, const at::Tensor& weights);

// Registers the router's entries (eager_router.cpp) on the module.
void register_router(pybind11::module_& m);

// Registers the whole MoE module's step (eager_layer.cpp) on the module.
void register_layer(pybind11::module_& m);

}  // namespace moeblaze_eager
