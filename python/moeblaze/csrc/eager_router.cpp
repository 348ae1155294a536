// MoE's eager router with its host work in C++ (in the module of eager_experts.cpp): the same C
// ABI calls as layer._RouteFn and layer._RoundFn (moeblaze_route, the token rounding, and
// moeblaze_router_backward in their backward), as C++ autograd functions with the same saved
// tensors and gradients. Why: once the experts' host work was in C++, the router's Python (the
// checks, allocations and two autograd nodes) was most of an eager MoE step's host time.
//
// route returns (pair_offsets, pair_experts, pair_weights, flags), None where this fast path does
// not apply (the Python path then runs, raising the error that names the argument), or the C
// ABI's error code when a C call refused the arguments (Python raises it with
// moeblaze_last_error's message).
#include <algorithm>
#include <climits>
#include <memory>
#include <optional>

#include "eager.h"

namespace moeblaze_eager {

torch::autograd::variable_list route_call(const at::Tensor& logits, const at::Tensor& bias,
                                          const moeblaze_router_cfg& cfg,
                                          const at::Tensor& zeroed_flags) {
  const int64_t T = logits.size(0), E = logits.size(1), P = T * cfg.top_k;
  const auto guard = device_guard(logits);
  const auto i32 = logits.options().dtype(at::kInt);
  at::Tensor offsets = at::empty({T + 1}, i32);                                 // (T+1,)
  at::Tensor experts = at::empty({P}, i32);                                     // (P,)
  at::Tensor weights = at::empty({P}, logits.options().dtype(at::kFloat));      // (P,) fp32
  at::Tensor flags = zeroed_flags.defined() ? zeroed_flags : at::zeros({4}, i32);  // (4,)
  const moeblaze_routing out = routing(T, E, offsets, experts, weights);
  const int rc = g_api.route(&cfg, data(logits), dtype_code(logits), T, E, floats(bias),
                             device_code(logits), stream_of(logits), &out,
                             flags.data_ptr<int32_t>());
  if (rc != MOEBLAZE_OK) throw CallFailed{rc};
  return {offsets, experts, weights, flags};
}

torch::autograd::variable_list round_call(const at::Tensor& logits, const at::Tensor& bias,
                                          const RouteArgs& a, const at::Tensor& offsets,
                                          const at::Tensor& experts, const at::Tensor& weights) {
  const int64_t T = logits.size(0), E = logits.size(1);
  const int32_t dt = dtype_code(logits);
  const bool cuda = logits.is_cuda();
  const auto guard = device_guard(logits);
  void* stream = stream_of(logits);
  const moeblaze_routing topk = routing(T, E, offsets, experts, weights);
  // The rounded pair count P sizes the outputs. CPU: the library keeps the rounded routing
  // behind a handle until routing_take copies it out (and frees it). CUDA: counted into a
  // workspace (one host sync), then filled from it on the stream.
  void* handle = nullptr;
  int64_t P = 0;
  at::Tensor ws;
  uint64_t ws_bytes = 0;
  int rc;
  if (cuda) {
    ws_bytes = pass_workspace_bytes({T, 0, 0, E, 0, 0, 0, 0, 0, 0}, 0, -3);
    if (ws_bytes) ws = at::empty({int64_t(ws_bytes)}, logits.options().dtype(at::kByte));
    rc = g_api.token_round_count(&a.cfg, a.m_tile, a.mode, a.seed, data(logits), dt, T, E,
                                 floats(bias), 1, stream, &topk, data(ws), ws_bytes, &P);
  } else {
    rc = g_api.token_round(&a.cfg, a.m_tile, a.mode, a.seed, data(logits), dt, T, E,
                           floats(bias), 0, stream, &topk, &handle, &P);
  }
  if (rc != MOEBLAZE_OK) throw CallFailed{rc};
  // Freed here only if an allocation below throws; routing_take frees it otherwise.
  std::unique_ptr<void, void (*)(void*)> rounded(handle, g_api.routing_free);
  const auto i32 = logits.options().dtype(at::kInt);
  at::Tensor r_offsets = at::empty({T + 1}, i32);                               // (T+1,)
  at::Tensor r_experts = at::empty({P}, i32);                                   // (P,)
  at::Tensor r_weights = at::empty({P}, logits.options().dtype(at::kFloat));    // (P,) fp32
  const moeblaze_routing out = routing(T, E, r_offsets, r_experts, r_weights);
  rc = cuda ? g_api.token_round_fill(&a.cfg, data(logits), dt, T, E, 1, stream, data(ws),
                                     ws_bytes, &out)
            : g_api.routing_take(rounded.release(), &out, stream);
  if (rc != MOEBLAZE_OK) throw CallFailed{rc};
  return {r_offsets, r_experts, r_weights};
}

std::optional<RouteArgs> route_args(py::handle kind, py::handle top_k, py::handle renormalize,
                                    py::handle mode, py::handle m_tile, py::handle seed,
                                    int64_t T, int64_t E, const std::optional<at::Tensor>& bias,
                                    const c10::Device& device) {
  const auto k = int_in(kind, 0, 2), K = int_in(top_k, 1, std::max<int64_t>(E, 1));
  if (!k || !K || T * *K > INT32_MAX || !PyBool_Check(renormalize.ptr())) return std::nullopt;
  if (bias && (bias->dim() != 1 || bias->size(0) != E || bias->scalar_type() != at::kFloat ||
               bias->device() != device))
    return std::nullopt;
  RouteArgs a{{int32_t(*k), int32_t(*K), renormalize.ptr() == Py_True}, !mode.is_none(), 0, 0, 0};
  if (a.round) {
    const auto md = int_in(mode, 0, 3), mt = int_in(m_tile, 1, INT32_MAX),
               sd = int_in(seed, 0, LLONG_MAX);
    if (!md || !mt || !sd) return std::nullopt;
    a.mode = int32_t(*md), a.m_tile = int32_t(*mt), a.seed = uint64_t(*sd);
  }
  return a;
}

}  // namespace moeblaze_eager

namespace {

using namespace moeblaze_eager;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// d logits (T, E) fp32 from d pair_weights (P,) over this routing of the logits.
at::Tensor router_backward_call(const moeblaze_router_cfg& cfg, const at::Tensor& logits,
                                const at::Tensor& bias, const at::Tensor& offsets,
                                const at::Tensor& experts, const at::Tensor& weights,
                                const at::Tensor& d_pair_weights) {
  const int64_t T = logits.size(0), E = logits.size(1);
  const auto guard = device_guard(logits);
  const moeblaze_routing r = routing(T, E, offsets, experts, weights);
  const at::Tensor d_pw = d_pair_weights.to(at::kFloat).contiguous();            // (P,) fp32
  at::Tensor d_logits = at::empty({T, E}, logits.options().dtype(at::kFloat));   // (T, E) fp32
  // Written only where a value is bad, and never read here: no zero-fill needed.
  at::Tensor flags = at::empty({4}, logits.options().dtype(at::kInt));          // (4,) unread
  const int rc = g_api.router_backward(&cfg, data(logits), dtype_code(logits), T, E, floats(bias),
                                       device_code(logits), stream_of(logits), &r, floats(d_pw),
                                       static_cast<float*>(data(d_logits)),
                                       flags.data_ptr<int32_t>());
  TORCH_CHECK(rc == MOEBLAZE_OK, "moeblaze: ", g_api.last_error());
  return d_logits;
}

// What both functions keep for backward: the logits, the bias and the routing they returned.
void save(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& bias,
          const at::Tensor& offsets, const at::Tensor& experts, const at::Tensor& weights,
          const RouteArgs& a) {
  ctx->save_for_backward({logits, bias, offsets, experts, weights});
  ctx->saved_data["kind"] = int64_t(a.cfg.kind);
  ctx->saved_data["top_k"] = int64_t(a.cfg.top_k);
  ctx->saved_data["renormalize"] = int64_t(a.cfg.renormalize);
  ctx->set_materialize_grads(false);
}

// Both functions' backward: d logits (in the logits' dtype) from d pair_weights over the saved
// routing (moeblaze_router_backward), the only gradient of the n_inputs inputs; none without a
// d pair_weights.
variable_list router_backward(AutogradContext* ctx, const variable_list& grads, size_t n_inputs) {
  if (!grads[2].defined()) return variable_list(n_inputs);
  const variable_list s = ctx->get_saved_variables();
  const moeblaze_router_cfg cfg{int32_t(ctx->saved_data["kind"].toInt()),
                                int32_t(ctx->saved_data["top_k"].toInt()),
                                int32_t(ctx->saved_data["renormalize"].toInt())};
  const at::Tensor d_logits = router_backward_call(cfg, s[0], s[1], s[2], s[3], s[4], grads[2]);
  variable_list g = once_differentiable({d_logits.to(s[0].scalar_type())}, grads);
  g.resize(n_inputs);
  return g;
}

struct EagerRoute : public torch::autograd::Function<EagerRoute> {
  // logits (T, E) fp32 / bf16 and bias (E,) fp32 (none: undefined), checked, dense, one device.
  // Outputs (offsets, experts, weights, flags); only the weights carry a gradient.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits,
                               const std::optional<at::Tensor>& bias_opt, const RouteArgs& a) {
    const at::Tensor bias = bias_opt.value_or(at::Tensor());
    variable_list r = route_call(logits, bias, a.cfg);
    const at::Tensor &offsets = r[0], &experts = r[1], &weights = r[2], &flags = r[3];
    save(ctx, logits, bias, offsets, experts, weights, a);
    ctx->mark_non_differentiable({offsets, experts, flags});
    return r;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return router_backward(ctx, grads, 3);
  }
};

struct EagerRound : public torch::autograd::Function<EagerRound> {
  // logits and bias as EagerRoute's; offsets, experts, weights: their top-K routing (dense).
  // Outputs the rounded (offsets, experts, weights); only the weights carry a gradient, into
  // the logits alone (every rounded weight is recomputed from them).
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits,
                               const std::optional<at::Tensor>& bias_opt,
                               const at::Tensor& offsets, const at::Tensor& experts,
                               const at::Tensor& weights, const RouteArgs& a) {
    const at::Tensor bias = bias_opt.value_or(at::Tensor());
    const variable_list r =
        round_call(logits, bias, a, offsets, experts, weights);
    const at::Tensor &r_offsets = r[0], &r_experts = r[1], &r_weights = r[2];
    save(ctx, logits, bias, r_offsets, r_experts, r_weights, a);
    ctx->mark_non_differentiable({r_offsets, r_experts});
    return r;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return router_backward(ctx, grads, 6);
  }
};

// MoE.route: logits (T, E) fp32 / bf16, bias (E,) fp32 or None, kind (router code), top_k,
// renormalize (a bool); mode None (no token rounding) or a rounding code with m_tile and seed.
py::object route(const at::Tensor& logits, const std::optional<at::Tensor>& bias,
                 py::handle kind, py::handle top_k, py::handle renormalize, py::handle mode,
                 py::handle m_tile, py::handle seed) {
  if (g_api.route == nullptr || logits.dim() != 2 || !(logits.is_cpu() || logits.is_cuda()))
    return py::none();
  if (logits.scalar_type() != at::kFloat && logits.scalar_type() != at::kBFloat16)
    return py::none();
  const std::optional<RouteArgs> a = route_args(kind, top_k, renormalize, mode, m_tile, seed,
                                                logits.size(0), logits.size(1), bias,
                                                logits.device());
  if (!a) return py::none();
  try {
    const at::Tensor lg = logits.contiguous();
    const std::optional<at::Tensor> b =
        bias ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
    variable_list r = EagerRoute::apply(lg, b, *a);
    if (a->round) {
      variable_list rr = EagerRound::apply(lg, b, r[0], r[1], r[2], *a);
      std::move(rr.begin(), rr.end(), r.begin());
    }
    return py::make_tuple(r[0], r[1], r[2], r[3]);
  } catch (const CallFailed& f) {
    return py::int_(f.rc);
  }
}

}  // namespace

void moeblaze_eager::register_router(py::module_& m) {
  m.def("route", &route,
        "MoE.route: (pair_offsets, pair_experts, pair_weights, flags), None (not this path's "
        "case) or a C ABI error code");
}
