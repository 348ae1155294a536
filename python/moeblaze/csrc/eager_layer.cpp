// MoE.forward's whole eager step as one C++ autograd node (in eager_experts.cpp's module):
// the router's linear layer in fp32, moeblaze_route (and token rounding), the experts (plan
// build, layer forward) and the switch and z losses forward; the experts' backward, the router's
// backward with the losses' gradients, and the router layer's backward. Why: as separate pieces
// (router_logits, the route node, the experts node, router_losses in torch) an eager MoE step
// issued about forty ATen ops and fifteen autograd nodes around its C calls, which made a small
// model's training step host-bound (bench/tiny_lm_share.py). Here the losses are the library's
// deterministic kernels (moeblaze_router_losses forward; their gradients inside
// moeblaze_router_backward_losses), the rest the Python path's ops in its order: out and the
// weights' gradients are its bits, the losses and the gradients through the logits agree with it
// to fp32 rounding (python/tests/test_extension.py). Held for backward: the logits, the routing,
// the plan, H and the gate in fp32 (E x d); x in fp32 is recomputed there.
//
// moe_layer returns (out, aux_loss, z_loss, pair_experts, flags), None where this path does not
// apply (the Python path then runs and names the argument), or the C ABI's error code when a C
// call refused the arguments.
#include <ATen/autocast_mode.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "eager.h"

namespace {

using namespace moeblaze_eager;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct LayerArgs {
  RouteArgs route;
  ExpertsArgs experts;
  float aux_coef, z_coef;  // > 0 or 0 (off)
};

struct Losses {
  at::Tensor aux, z;  // () fp32 each
  at::Tensor f;       // (E,) fp32 pair fractions count_e / P (aux only)
};

// The switch and z losses of the routing r (offsets, experts, weights) of these fp32 logits:
// the library's deterministic kernels (moeblaze_router_losses, the C++ route()'s values), one C
// call; zero scalars when both coefficients are 0.
Losses losses_forward(const at::Tensor& logits, const at::Tensor& bias, const variable_list& r,
                      const LayerArgs& a) {
  const int64_t T = logits.size(0), E = logits.size(1), P = r[1].numel();
  Losses l;
  if (!(a.aux_coef > 0) && !(a.z_coef > 0)) {
    l.aux = at::zeros({}, logits.options());
    l.z = at::zeros({}, logits.options());
    return l;
  }
  l.aux = at::empty({}, logits.options());                                       // ()
  l.z = at::empty({}, logits.options());                                         // ()
  if (a.aux_coef > 0) l.f = at::empty({E}, logits.options());                     // (E,)
  const bool cuda = logits.is_cuda();
  const uint64_t ws_bytes =
      cuda ? pass_workspace_bytes({T, 0, 0, E, 0, 0, 0, 0, 0, 0}, P, -5) : 0;
  at::Tensor ws = ws_bytes ? at::empty({int64_t(ws_bytes)}, logits.options().dtype(at::kByte))
                           : at::Tensor();                                      // (bytes,)
  const moeblaze_routing rt = routing(T, E, r[0], r[1], r[2]);
  const int rc = g_api.router_losses(&a.route.cfg, a.aux_coef, a.z_coef, data(logits), 0, T, E,
                                     floats(bias), device_code(logits), stream_of(logits), &rt,
                                     data(ws), ws_bytes, static_cast<float*>(data(l.aux)),
                                     static_cast<float*>(data(l.z)),
                                     static_cast<float*>(data(l.f)));
  if (rc != MOEBLAZE_OK) throw CallFailed{rc};
  return l;
}

// d logits (T, E) fp32: the route weights' gradient d_pw (P,) plus the losses' for their
// upstream gradients g_aux, g_z (undefined: none), in one C call (moeblaze_router_backward_losses).
at::Tensor router_and_losses_backward(const moeblaze_router_cfg& cfg, float aux_coef,
                                      float z_coef, const at::Tensor& logits,
                                      const at::Tensor& bias, const at::Tensor& offsets,
                                      const at::Tensor& experts, const at::Tensor& pw,
                                      const at::Tensor& d_pw, const at::Tensor& f,
                                      const at::Tensor& g_aux, const at::Tensor& g_z) {
  const int64_t T = logits.size(0), E = logits.size(1);
  const moeblaze_routing rt = routing(T, E, offsets, experts, pw);
  const at::Tensor dpw = d_pw.to(at::kFloat).contiguous();                       // (P,) fp32
  const at::Tensor ga = g_aux.defined() ? g_aux.to(at::kFloat).contiguous() : g_aux;  // ()
  const at::Tensor gz = g_z.defined() ? g_z.to(at::kFloat).contiguous() : g_z;        // ()
  at::Tensor d_logits = at::empty({T, E}, logits.options());                     // (T, E) fp32
  // Written only where a value is bad, and never read here: no zero-fill needed.
  at::Tensor flags = at::empty({4}, logits.options().dtype(at::kInt));           // (4,) unread
  const int rc = g_api.router_backward_losses(
      &cfg, aux_coef, z_coef, data(logits), 0, T, E, floats(bias), device_code(logits),
      stream_of(logits), &rt, floats(dpw), floats(f), floats(ga), floats(gz),
      static_cast<float*>(data(d_logits)), flags.data_ptr<int32_t>());
  TORCH_CHECK(rc == MOEBLAZE_OK, "moeblaze: ", g_api.last_error());
  return d_logits;
}

// w (undefined: none) dense in x's dtype: fp32 master weights beside bf16 x are cast down (their
// gradients come back up).
at::Tensor in_dtype(const at::Tensor& w, const at::Tensor& x) {
  if (!w.defined()) return w;
  return (w.scalar_type() != x.scalar_type() ? w.to(x.scalar_type()) : w).contiguous();
}

// g back in the dtype of the input it is the gradient of (ToCopyBackward).
at::Tensor as_input(const at::Tensor& g, c10::ScalarType dtype) {
  return g.defined() && g.scalar_type() != dtype ? g.to(dtype) : g;
}

struct EagerLayer : public torch::autograd::Function<EagerLayer> {
  // x (T, d) bf16 (CUDA) / fp32 or bf16 (CPU), T >= 1; gate (E, d) fp32 / bf16; bias (E,) fp32
  // or none; w1 (E, w1_rows, d), w2 (E, d, n), b1 (E, w1_rows), b2 (E, d) in x's dtype or fp32.
  // All checked (moe_layer), on x's device. Outputs (out, aux, z, pair_experts, flags).
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x_in,
                               const at::Tensor& gate, const std::optional<at::Tensor>& bias_opt,
                               const at::Tensor& w1, const at::Tensor& w2,
                               const std::optional<at::Tensor>& b1_opt,
                               const std::optional<at::Tensor>& b2_opt, const LayerArgs& a) {
    const at::Tensor x = x_in.contiguous();
    const at::Tensor bias = bias_opt.value_or(at::Tensor());
    // layer.router_logits: fp32 logits of fp32 operands.
    const at::Tensor gate_f = gate.to(at::kFloat);                              // (E, d) fp32
    const at::Tensor logits = at::linear(x.to(at::kFloat), gate_f);               // (T, E)
    // One zero-fill for the route's flags (returned: MoE.check reads them) and the plan build's.
    const at::Tensor flags = at::zeros({8}, logits.options().dtype(at::kInt));  // (8,)
    variable_list r = route_call(logits, bias, a.route.cfg, flags.narrow(0, 0, 4));
    if (a.route.round) {  // the experts, the losses and backward all see the rounded routing
      const variable_list rr = round_call(logits, bias, a.route, r[0], r[1], r[2]);
      std::copy(rr.begin(), rr.end(), r.begin());
    }
    const ExpertsForward e = experts_forward(
        x, in_dtype(w1, x), in_dtype(w2, x), in_dtype(b1_opt.value_or(at::Tensor()), x),
        in_dtype(b2_opt.value_or(at::Tensor()), x), {false, {}, {}, r[0], r[1], r[2]}, a.experts,
        flags.narrow(0, 4, 4));
    Losses l = losses_forward(logits, bias, r, a);
    variable_list keep = e.keep;  // x, w1, w2, h, the plan's six arrays, b1, b2
    keep.insert(keep.end(), {logits, bias, r[0], r[1], r[2], l.f, gate_f});
    ctx->save_for_backward(keep);
    ctx->saved_data["router"] = std::vector<int64_t>{a.route.cfg.kind, a.route.cfg.top_k,
                                                     a.route.cfg.renormalize};
    ctx->saved_data["experts"] = std::vector<int64_t>{
        a.experts.activation, a.experts.recompute, a.experts.compute, e.args.K,
        a.experts.fp8_cache};
    ctx->saved_data["coefs"] = std::vector<double>{a.aux_coef, a.z_coef};  // floats, exact
    ctx->saved_data["dtypes"] = std::vector<int64_t>{
        int64_t(w1.scalar_type()), int64_t(w2.scalar_type()),
        int64_t(b1_opt ? b1_opt->scalar_type() : x.scalar_type()),
        int64_t(b2_opt ? b2_opt->scalar_type() : x.scalar_type()),
        int64_t(gate.scalar_type())};
    variable_list constant{r[1], r[3]};  // one call: each replaces the last one's set
    if (!(a.aux_coef > 0)) constant.push_back(l.aux);
    if (!(a.z_coef > 0)) constant.push_back(l.z);
    ctx->mark_non_differentiable(constant);
    ctx->set_materialize_grads(false);
    return {e.out, l.aux, l.z, r[1], r[3]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    const at::Tensor &x = s[0], &logits = s[12], &bias = s[13], &offsets = s[14],
                     &experts = s[15], &pw = s[16], &f = s[17], &gate_f = s[18];
    const auto ri = ctx->saved_data["router"].toIntVector();
    const auto ei = ctx->saved_data["experts"].toIntVector();
    const auto coefs = ctx->saved_data["coefs"].toDoubleVector();
    const auto dt = ctx->saved_data["dtypes"].toIntVector();
    const moeblaze_router_cfg cfg{int32_t(ri[0]), int32_t(ri[1]), int32_t(ri[2])};
    const ExpertsArgs ea{ei[0], ei[1] != 0, ei[2], ei[3], ei[4]};
    const auto guard = device_guard(x);
    ExpertsGrads e;
    if (grads[0].defined())
      e = experts_backward(variable_list(s.begin(), s.begin() + 12), ea, grads[0]);
    // The losses' upstream gradients where they have one (undefined: none, or a zero coefficient).
    const float aux_coef = float(coefs[0]), z_coef = float(coefs[1]);
    const at::Tensor g_aux = aux_coef > 0 ? grads[1] : at::Tensor();
    const at::Tensor g_z = z_coef > 0 ? grads[2] : at::Tensor();
    at::Tensor d_logits;  // (T, E) fp32
    if (e.dpw.defined() || g_aux.defined() || g_z.defined()) {
      const at::Tensor d_pw = e.dpw.defined() ? e.dpw : at::zeros_like(pw);   // (P,) fp32
      d_logits = router_and_losses_backward(cfg, aux_coef, z_coef, logits, bias, offsets,
                                            experts, pw, d_pw, f, g_aux, g_z);
    }
    // The router's linear layer (MmBackward of x_f @ gate_f^T), then the casts to fp32 undone.
    at::Tensor dx = e.dx, d_gate;
    if (d_logits.defined()) {
      if (ctx->needs_input_grad(0)) {
        const at::Tensor dx_r = as_input(d_logits.mm(gate_f), x.scalar_type());
        dx = dx.defined() ? dx + dx_r : dx_r;
      }
      if (ctx->needs_input_grad(1))
        d_gate = as_input(d_logits.t().mm(x.to(at::kFloat)), c10::ScalarType(dt[4]));
    }
    variable_list g = once_differentiable(
        {dx, d_gate, at::Tensor(), as_input(e.dw1, c10::ScalarType(dt[0])),
         as_input(e.dw2, c10::ScalarType(dt[1])), as_input(e.db1, c10::ScalarType(dt[2])),
         as_input(e.db2, c10::ScalarType(dt[3]))},
        grads);
    g.resize(8);  // none for the arguments
    return g;
  }
};

bool float_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

// MoE.forward: x (T, d), gate_weight (E, d), expert_bias (E,) fp32 or None, w1, w2, b1, b2 (or
// None); kind, top_k, renormalize, and mode (None: no token rounding), m_tile, seed as
// MoE.route; activation, w1_rows, recompute, compute, fp8_cache as experts_from_routing; the two
// loss coefficients.
py::object moe_layer(const at::Tensor& x, const at::Tensor& gate,
                     const std::optional<at::Tensor>& bias, const at::Tensor& w1,
                     const at::Tensor& w2, const std::optional<at::Tensor>& b1,
                     const std::optional<at::Tensor>& b2, py::handle kind, py::handle top_k,
                     py::handle renormalize, py::handle mode, py::handle m_tile,
                     py::handle seed, int64_t activation, int64_t w1_rows, bool recompute,
                     int64_t compute, int64_t fp8_cache, double aux_coef, double z_coef) {
  if (g_api.route == nullptr || g_api.build_plan == nullptr || x.dim() != 2 || x.size(0) == 0 ||
      !(x.is_cpu() || x.is_cuda()) || at::autocast::is_autocast_enabled(x.device().type()))
    return py::none();
  const int64_t d = x.size(1);
  if (gate.dim() != 2 || gate.size(1) != d || !float_dtype(gate) || gate.device() != x.device() ||
      w2.dim() != 3 || gate.size(0) != w2.size(0))
    return py::none();
  const std::optional<RouteArgs> route =
      route_args(kind, top_k, renormalize, mode, m_tile, seed, x.size(0), gate.size(0), bias,
                 x.device());
  if (!route) return py::none();
  const at::Tensor none;
  const at::Tensor& b1t = b1 ? *b1 : none;
  const at::Tensor& b2t = b2 ? *b2 : none;
  if (!operands_apply(x, w1, w2, b1t, b2t, w1_rows, compute, true)) return py::none();
  // router_losses' rule: a coefficient counts only when > 0 (NaN: off); an infinite one is the
  // Python path's to handle.
  if (std::isinf(aux_coef) || std::isinf(z_coef)) return py::none();
  const LayerArgs a{*route, {activation, recompute, compute, 0, fp8_cache},
                    aux_coef > 0 ? float(aux_coef) : 0.0f, z_coef > 0 ? float(z_coef) : 0.0f};
  try {
    variable_list r = EagerLayer::apply(x, gate, bias, w1, w2, b1, b2, a);
    return py::make_tuple(r[0], r[1], r[2], r[3], r[4]);
  } catch (const CallFailed& f) {
    return py::int_(f.rc);
  }
}

}  // namespace

void moeblaze_eager::register_layer(py::module_& m) {
  m.def("moe_layer", &moe_layer,
        "MoE.forward: (out, aux_loss, z_loss, pair_experts, flags), None (not this path's case) "
        "or a C ABI error code");
}
