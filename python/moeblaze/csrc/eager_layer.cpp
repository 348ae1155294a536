// MoE.forward's whole eager step as one C++ autograd node (in the module of eager_experts.cpp):
// the router's linear layer in fp32, moeblaze_route, the experts (plan build, layer forward) and
// the switch and z losses forward; the experts' backward, moeblaze_router_backward, the losses'
// gradients and the router layer's backward. Why: as separate pieces (router_logits, the route
// node, the experts node, router_losses in torch) an eager MoE step issued about forty ATen ops
// and fifteen autograd nodes around its C calls, which made a small model's training step
// host-bound (bench/tiny_lm_share.py). Every op here is one the Python path runs, with the same
// operands in the same order, so the results are its bits (python/tests/test_extension.py);
// what changes is what is held for backward: x in fp32 and the softmax are recomputed there
// (the gate in fp32, E x d, is held).
//
// moe_layer returns (out, aux_loss, z_loss, pair_experts, flags), None where this path does not
// apply (the Python path then runs and names the argument), or the C ABI's error code when a C
// call refused the arguments.
#include <ATen/autocast_mode.h>

#include <algorithm>
#include <optional>

#include "eager.h"

namespace {

using namespace moeblaze_eager;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kSigmoidBias = 2;    // moeblaze_router_cfg.kind of sigmoid_bias
constexpr int64_t kSerialNumel = 32768;  // layer._SERIAL_NUMEL: ATen's one-thread grain size

struct LayerArgs {
  moeblaze_router_cfg router;
  ExpertsArgs experts;
  double aux_coef, z_coef;
};

// layer.router_losses' row blocks: all rows on CUDA; on the CPU blocks that ATen runs on one
// thread, so that the sums round the same way for every thread count.
int64_t loss_rows(const at::Tensor& logits) {
  const int64_t T = logits.size(0), E = logits.size(1);
  return logits.is_cuda() ? T : std::max<int64_t>(1, (kSerialNumel - 1) / std::max<int64_t>(E, 1));
}

// The aux loss's token distribution q (rows, E) of a block of logits: softmax, or the
// normalised sigmoid of sigmoid_bias (no bias: it steers the selection only).
at::Tensor aux_distribution(const at::Tensor& blk, bool sigmoid) {
  if (!sigmoid) return at::softmax(blk, -1);
  const at::Tensor s = at::sigmoid(blk);  // (rows, E)
  return s / s.sum(-1, true);
}

struct Losses {
  at::Tensor aux, z;    // () fp32 each
  at::Tensor counts;    // (E,) fp32 pairs routed to each expert (aux only)
};

// The aux loss's scalar: coef * E / (T * P), formed in double as router_losses forms it.
double aux_scale(const LayerArgs& a, int64_t T, int64_t E, int64_t P) {
  return a.aux_coef * double(E) / double(T * std::max<int64_t>(P, 1));
}

// layer.router_losses, op for op: aux = coef * E / (T P) * sum_e c_e * sum_t q_t,e and
// z = coef * mean_t logsumexp(logits_t)^2, zero scalars for a zero coefficient. expert_offsets:
// the plan's (E+1,) int32; P pairs.
Losses losses_forward(const at::Tensor& logits, const at::Tensor& expert_offsets, int64_t P,
                      const LayerArgs& a) {
  const int64_t T = logits.size(0), E = logits.size(1);
  const bool want_aux = a.aux_coef > 0, want_z = a.z_coef > 0;
  Losses l;
  at::Tensor q_sum, lse2_sum;  // (E,), ()
  if (want_aux || want_z) {
    for (const at::Tensor& blk : logits.split(loss_rows(logits))) {  // in order: a fixed sum
      if (want_aux) {
        const at::Tensor s = aux_distribution(blk, a.router.kind == kSigmoidBias).sum(0);
        q_sum = q_sum.defined() ? q_sum + s : s;
      }
      if (want_z) {
        const at::Tensor s = at::logsumexp(blk, {-1}).square().sum();
        lse2_sum = lse2_sum.defined() ? lse2_sum + s : s;
      }
    }
  }
  if (want_aux) {
    // The pairs per expert, exact integers: the plan's expert offsets differenced (router_losses
    // counts them with scatter_add; the same integers, so the same f).
    l.counts = (expert_offsets.narrow(0, 1, E) - expert_offsets.narrow(0, 0, E))
                   .to(at::kFloat);                                             // (E,)
    l.aux = (l.counts * q_sum).sum() * aux_scale(a, T, E, P);
  } else {
    l.aux = at::zeros({}, logits.options());
  }
  l.z = want_z ? (lse2_sum / T) * a.z_coef : at::zeros({}, logits.options());
  return l;
}

// d logits (T, E) of the losses for their upstream gradients g_aux, g_z (undefined: none), as
// autograd differentiates router_losses' ops; undefined when neither term has a gradient.
at::Tensor losses_backward(const at::Tensor& logits, const at::Tensor& counts, int64_t P,
                           const at::Tensor& g_aux, const at::Tensor& g_z, const LayerArgs& a) {
  const int64_t T = logits.size(0), E = logits.size(1);
  at::Tensor d_aux, d_z;  // (T, E) each
  if (a.aux_coef > 0 && g_aux.defined()) {
    // mul by the scalar, sum over e, c * q_sum, q.sum(0): each row's d q.
    const at::Tensor dq =
        ((g_aux * aux_scale(a, T, E, P)).expand({E}) * counts).unsqueeze(0).expand({T, E});
    const at::Tensor q = aux_distribution(logits, a.router.kind == kSigmoidBias);
    if (a.router.kind != kSigmoidBias) {
      d_aux = at::_softmax_backward_data(dq, q, -1, at::kFloat);
    } else {
      // q = s / S, S = s.sum(-1): d s = dq / S + sum_e(-dq * (s / S) / S), then the sigmoid's.
      const at::Tensor s = at::sigmoid(logits), S = s.sum(-1, true);
      const at::Tensor d_S = (-dq * ((s / S) / S)).sum(-1, true);
      d_aux = at::sigmoid_backward(dq / S + d_S.expand({T, E}), s);
    }
  }
  if (a.z_coef > 0 && g_z.defined()) {
    // mul, / T, sum, square (pow 2), logsumexp.
    const at::Tensor lse = at::logsumexp(logits, {-1});                          // (T,)
    const at::Tensor d_lse = ((g_z * a.z_coef) / T).expand({T}) * (2.0 * lse.pow(1.0));
    d_z = d_lse.unsqueeze(-1) * (logits - lse.unsqueeze(-1)).exp();
  }
  if (d_aux.defined() && d_z.defined()) return d_aux + d_z;
  return d_aux.defined() ? d_aux : d_z;
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
    const variable_list r = route_call(logits, bias, a.router, flags.narrow(0, 0, 4));
    const ExpertsForward e = experts_forward(
        x, in_dtype(w1, x), in_dtype(w2, x), in_dtype(b1_opt.value_or(at::Tensor()), x),
        in_dtype(b2_opt.value_or(at::Tensor()), x), {false, {}, {}, r[0], r[1], r[2]}, a.experts,
        flags.narrow(0, 4, 4));
    Losses l = losses_forward(logits, e.keep[4], r[1].numel(), a);
    variable_list keep = e.keep;  // x, w1, w2, h, the plan's six arrays, b1, b2
    keep.insert(keep.end(), {logits, bias, r[0], r[1], r[2], l.counts, gate_f});
    ctx->save_for_backward(keep);
    ctx->saved_data["router"] = std::vector<int64_t>{a.router.kind, a.router.top_k,
                                                     a.router.renormalize};
    ctx->saved_data["experts"] = std::vector<int64_t>{
        a.experts.activation, a.experts.recompute, a.experts.compute, e.args.K};
    ctx->saved_data["coefs"] = std::vector<double>{a.aux_coef, a.z_coef};
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
                     &experts = s[15], &pw = s[16], &counts = s[17], &gate_f = s[18];
    const auto ri = ctx->saved_data["router"].toIntVector();
    const auto ei = ctx->saved_data["experts"].toIntVector();
    const auto coefs = ctx->saved_data["coefs"].toDoubleVector();
    const auto dt = ctx->saved_data["dtypes"].toIntVector();
    const LayerArgs a{{int32_t(ri[0]), int32_t(ri[1]), int32_t(ri[2])},
                      {ei[0], ei[1] != 0, ei[2], ei[3]},
                      coefs[0],
                      coefs[1]};
    const auto guard = device_guard(x);
    ExpertsGrads e;
    at::Tensor d_logits;  // (T, E) fp32
    if (grads[0].defined()) {
      e = experts_backward(variable_list(s.begin(), s.begin() + 12), a.experts, grads[0]);
      d_logits = router_backward_call(a.router, logits, bias, offsets, experts, pw, e.dpw);
    }
    const at::Tensor d_losses =
        losses_backward(logits, counts, experts.numel(), grads[1], grads[2], a);
    if (d_losses.defined()) d_logits = d_logits.defined() ? d_losses + d_logits : d_losses;
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
// None); kind, top_k, renormalize as MoE.route; activation, w1_rows, recompute, compute as
// experts_from_routing; the two loss coefficients.
py::object moe_layer(const at::Tensor& x, const at::Tensor& gate,
                     const std::optional<at::Tensor>& bias, const at::Tensor& w1,
                     const at::Tensor& w2, const std::optional<at::Tensor>& b1,
                     const std::optional<at::Tensor>& b2, py::handle kind, py::handle top_k,
                     py::handle renormalize, int64_t activation, int64_t w1_rows, bool recompute,
                     int64_t compute, double aux_coef, double z_coef) {
  if (g_api.route == nullptr || g_api.build_plan == nullptr || x.dim() != 2 || x.size(0) == 0 ||
      !(x.is_cpu() || x.is_cuda()) || at::autocast::is_autocast_enabled(x.device().type()))
    return py::none();
  const int64_t T = x.size(0), d = x.size(1);
  if (gate.dim() != 2 || gate.size(1) != d || !float_dtype(gate) || gate.device() != x.device() ||
      w2.dim() != 3 || gate.size(0) != w2.size(0))
    return py::none();
  const int64_t E = gate.size(0);
  if (bias && (bias->dim() != 1 || bias->size(0) != E || bias->scalar_type() != at::kFloat ||
               bias->device() != x.device()))
    return py::none();
  const auto k = int_in(kind, 0, 2), K = int_in(top_k, 1, std::max<int64_t>(E, 1));
  if (!k || !K || T * *K > INT32_MAX || !PyBool_Check(renormalize.ptr())) return py::none();
  const at::Tensor none;
  const at::Tensor& b1t = b1 ? *b1 : none;
  const at::Tensor& b2t = b2 ? *b2 : none;
  if (!operands_apply(x, w1, w2, b1t, b2t, w1_rows, compute, true)) return py::none();
  LayerArgs a{{int32_t(*k), int32_t(*K), renormalize.ptr() == Py_True},
              {activation, recompute, compute, 0},
              aux_coef,
              z_coef};
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
