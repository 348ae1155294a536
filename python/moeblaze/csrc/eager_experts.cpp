// moeblaze_eager: the eager moe_experts step with its host work in C++ (python/moeblaze/_ext.py
// builds it at first use against the installed torch; nothing is pinned to a torch ABI at the
// library's build; MoE's router is eager_router.cpp, in the same module). The same C ABI calls as
// layer._ExpertsFn (plan from the ids, layer forward, layer backward writing dH over H on CUDA),
// reached through function pointers that the Python side resolved with ctypes, so this file links
// against torch only. Why: on a GPU the forward kernels wait for the Python checks, allocations
// and autograd node before their launch (measured in
// docs/notes/pytorch-host-path.md).
//
// experts_from_ids (moe_experts) and experts_from_routing return the output tensor, None where
// this fast path does not apply (the Python path then runs, raising the error that names the
// argument), or the C ABI's error code when a C call refused the arguments (Python raises it
// with moeblaze_last_error's message).
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "eager.h"

namespace moeblaze_eager {

Api g_api;

// key: cfg fields, S, pass (see eager.h). Written once per key; C++ only reads it after.
using WsKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int32_t, int32_t, int32_t,
                         int32_t, bool, int64_t, int32_t>;
std::mutex g_ws_mutex;
std::map<WsKey, uint64_t> g_ws_bytes;

uint64_t pass_workspace_bytes(const moeblaze_layer_cfg& c, int64_t S, int32_t pass) {
  // With a weight cache the workspace holds no weight codes: a key of its own (any live cache).
  const WsKey key{c.T,     c.d,    c.n, c.E, c.K, c.activation, c.dtype, c.mode, c.compute,
                  c.fp8_weights != nullptr, S, pass};
  std::lock_guard<std::mutex> lock(g_ws_mutex);
  auto it = g_ws_bytes.find(key);
  if (it != g_ws_bytes.end()) return it->second;
  uint64_t n = 0;
  const int rc = pass == -1   ? g_api.plan_from_ids_workspace_bytes(c.T, c.K, c.E, 1, &n)
                 : pass == -2 ? g_api.plan_workspace_bytes(c.T, c.E, S, 1, &n)
                 : pass == -3 ? g_api.token_round_workspace_bytes(c.T, c.E, 1, &n)
                 : pass == -4 ? g_api.layer_kept_h_bytes(&c, S, &n)
                 : pass == -5 ? g_api.router_losses_workspace_bytes(c.T, c.E, S, 1, &n)
                              : g_api.layer_pass_workspace_bytes(&c, S, 1, pass, &n);
  if (rc != MOEBLAZE_OK) throw CallFailed{rc};
  g_ws_bytes.emplace(key, n);
  return n;
}

torch::autograd::variable_list once_differentiable(torch::autograd::variable_list g,
                                                   const torch::autograd::variable_list& grads_in) {
  if (!c10::GradMode::is_enabled() ||
      std::none_of(grads_in.begin(), grads_in.end(),
                   [](const at::Tensor& t) { return t.defined() && t.requires_grad(); }))
    return g;
  for (auto& t : g) {
    if (!t.defined()) continue;
    t = t.detach();
    t.set_requires_grad(true);
  }
  return torch::autograd::DelayedError(
             "trying to differentiate twice a function that was marked with @once_differentiable",
             int64_t(g.size()))
      .apply(std::move(g));
}

namespace {

constexpr int kModeKeepH = 0, kModeRecompute = 1, kModeDhOverH = 2;  // moeblaze_layer_cfg.mode

// moe_experts' / experts_from_routing's K in the layer config (LayerConfig checks 1 <= K <= E):
// the ids' K, or a routing's S / T clamped to [1, E] as ops._layer_cfg (rounding varies it).
int64_t config_k(const PlanSource& src, int64_t T, int64_t E) {
  if (src.from_ids) return src.ids.size(1);
  const int64_t k = T > 0 ? src.pairs() / T : 1;
  return std::min(std::max<int64_t>(k, 1), std::max<int64_t>(E, 1));
}

}  // namespace

ExpertsForward experts_forward(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                               const at::Tensor& b1, const at::Tensor& b2, const PlanSource& src,
                               ExpertsArgs a, const at::Tensor& zeroed_flags) {
  const bool cuda = x.is_cuda();
  const int32_t dev = cuda ? 1 : 0;
  const int64_t T = x.size(0), E = w2.size(0), d = x.size(1), n = w2.size(2), S = src.pairs();
  a.K = config_k(src, T, E);
  const auto guard = device_guard(x);
  void* stream = stream_of(x);
  moeblaze_layer_cfg cfg{T,       d, n, E, a.K, int32_t(a.activation), dtype_code(x),
                         a.recompute ? kModeRecompute : kModeKeepH, 0, int32_t(a.compute),
                         reinterpret_cast<void*>(a.fp8_cache)};
  // One int32 allocation for the plan's four int32 arrays and its fp32 slot weights, as
  // ops._plan_from_ids_built; token_expert_indices alone (CUDA's backward never reads it).
  const auto i32 = x.options().dtype(at::kInt);
  at::Tensor buf = at::empty({E + 1 + T + 1 + 3 * S}, i32);                  // (E+1+T+1+3S,)
  at::Tensor eto = buf.narrow(0, 0, E + 1);                                   // (E+1,)
  at::Tensor tpo = buf.narrow(0, E + 1, T + 1);                               // (T+1,)
  at::Tensor eti = buf.narrow(0, E + T + 2, S);                               // (S,)
  at::Tensor sw = buf.narrow(0, E + T + 2 + S, S).view(at::kFloat);           // (S,) fp32
  at::Tensor tim = buf.narrow(0, E + T + 2 + 2 * S, S);                       // (S,)
  at::Tensor tei = at::empty({S}, i32);                                       // (S,)
  at::Tensor flags = !cuda ? at::Tensor() : zeroed_flags.defined() ? zeroed_flags
                                                                    : at::empty({4}, i32);  // (4,)
  // One workspace for both calls: the plan build's is dead once its kernels ran (one stream).
  const uint64_t ws_plan = cuda ? pass_workspace_bytes(cfg, S, src.from_ids ? -1 : -2) : 0;
  const uint64_t ws_fwd = cuda ? pass_workspace_bytes(cfg, S, 0) : 0;
  const uint64_t ws_bytes = std::max(ws_plan, ws_fwd);
  at::Tensor ws = ws_bytes ? at::empty({int64_t(ws_bytes)}, x.options().dtype(at::kByte))
                           : at::Tensor();                                    // (bytes,)
  moeblaze_plan plan{T,
                     E,
                     S,
                     eto.data_ptr<int32_t>(),
                     static_cast<int32_t*>(data(eti)),
                     static_cast<float*>(data(sw)),
                     tpo.data_ptr<int32_t>(),
                     static_cast<int32_t*>(data(tei)),
                     static_cast<int32_t*>(data(tim))};
  int32_t* flags_ptr = cuda ? flags.data_ptr<int32_t>() : nullptr;
  int rc;
  if (src.from_ids) {
    rc = g_api.plan_from_ids(data(src.ids),
                             src.ids.scalar_type() == at::kLong ? MOEBLAZE_IDS_INT64
                                                                : MOEBLAZE_IDS_INT32,
                             data(src.weights), dtype_code(src.weights), T, a.K, E, dev, stream,
                             &plan, data(ws), ws_plan, flags_ptr);
  } else {
    // build_plan's flags start zeroed by the caller (capi.h).
    if (cuda && !zeroed_flags.defined()) flags.zero_();
    moeblaze_routing r{T, E, S, static_cast<int32_t*>(data(src.offsets)),
                       static_cast<int32_t*>(data(src.experts)),
                       static_cast<float*>(data(src.pw))};
    rc = g_api.build_plan(&r, dev, stream, &plan, data(ws), ws_plan, flags_ptr);
  }
  if (rc != MOEBLAZE_OK) throw CallFailed{rc};
  const int64_t rows = w1.size(1);
  at::Tensor out = at::empty_like(x);                                         // (T, d)
  // The kept H: (S, w1_rows) in x's dtype, or fp8 compute's e4m3 codes and scales as bytes.
  const int64_t h_rows = a.recompute ? 0 : S;
  at::Tensor h = a.compute == 0
                     ? at::empty({h_rows, rows}, x.options())                 // (S, w1_rows)
                     : at::empty({h_rows ? int64_t(pass_workspace_bytes(cfg, S, -4)) : 0},
                                 x.options().dtype(at::kByte));               // (bytes,)
  rc = g_api.layer_forward_biased(&cfg, &plan, dev, stream, data(x), data(w1), data(w2),
                                  data(b1), data(b2), data(out), a.recompute ? nullptr : data(h),
                                  data(ws), ws_fwd);
  if (rc != MOEBLAZE_OK) throw CallFailed{rc};
  // Backward on CUDA never reads token_expert_indices: not kept (S int32 fewer bytes held).
  return {out, {x, w1, w2, h, eto, eti, sw, tpo, cuda ? at::Tensor() : tei, tim, b1, b2}, a};
}

bool operands_apply(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                    const at::Tensor& b1, const at::Tensor& b2, int64_t w1_rows, int64_t compute,
                    bool fp32_weights) {
  if (x.dim() != 2 || w1.dim() != 3 || w2.dim() != 3) return false;
  const auto dt = x.scalar_type();
  const auto dtype_ok = [&](const at::Tensor& w) {
    return w.scalar_type() == dt ||
           (fp32_weights && dt == at::kBFloat16 && w.scalar_type() == at::kFloat);
  };
  if (dt != at::kBFloat16 && dt != at::kFloat) return false;
  // fp8 and fp8-wgrad: bf16 storage only
  if (compute != 0 && ((compute != 1 && compute != 2) || dt != at::kBFloat16)) return false;
  if (x.is_cuda() && dt != at::kBFloat16) return false;
  if (!dtype_ok(w1) || !dtype_ok(w2)) return false;
  if (w1.device() != x.device() || w2.device() != x.device()) return false;
  const int64_t d = x.size(1), E = w2.size(0), n = w2.size(2);
  if (w2.size(1) != d || w1.size(0) != E || w1.size(1) != w1_rows || w1.size(2) != d)
    return false;
  for (const auto& [b, cols] : {std::pair<const at::Tensor*, int64_t>{&b1, w1_rows}, {&b2, d}})
    if (b->defined() && (b->dim() != 2 || b->size(0) != E || b->size(1) != cols ||
                         !dtype_ok(*b) || b->device() != x.device()))
      return false;
  return w1_rows > 0 && n > 0 && E > 0;
}

ExpertsGrads experts_backward(const torch::autograd::variable_list& saved, const ExpertsArgs& a,
                              const at::Tensor& grad_out) {
  const at::Tensor &x = saved[0], &w1 = saved[1], &w2 = saved[2], &b1 = saved[10],
                   &b2 = saved[11];
  const at::Tensor& h = saved[3];
  const bool cuda = x.is_cuda();
  const int32_t dev = cuda ? 1 : 0;
  const int64_t T = x.size(0), d = x.size(1), E = w2.size(0), n = w2.size(2),
                S = saved[5].size(0);
  const auto guard = device_guard(x);
  void* stream = stream_of(x);
  const int32_t mode = a.recompute ? kModeRecompute : cuda ? kModeDhOverH : kModeKeepH;
  moeblaze_layer_cfg cfg{T,    d,    n, E, a.K, int32_t(a.activation), dtype_code(x), mode, 0,
                         int32_t(a.compute), reinterpret_cast<void*>(a.fp8_cache)};
  const at::Tensor d_out = grad_out.to(x.scalar_type()).contiguous();        // (T, d)
  ExpertsGrads g;
  g.dx = at::empty_like(x);                                                   // (T, d)
  g.dw1 = at::empty_like(w1);                                                 // (E, w1_rows, d)
  g.dw2 = at::empty_like(w2);                                                 // (E, d, n)
  g.dpw = at::empty({S}, x.options().dtype(at::kFloat));                      // (S,) fp32
  if (b1.defined()) g.db1 = at::empty_like(b1);                               // (E, w1_rows)
  if (b2.defined()) g.db2 = at::empty_like(b2);                               // (E, d)
  const uint64_t ws_bytes = cuda ? pass_workspace_bytes(cfg, S, 1) : 0;
  at::Tensor ws = ws_bytes ? at::empty({int64_t(ws_bytes)}, x.options().dtype(at::kByte))
                           : at::Tensor();                                    // (bytes,)
  moeblaze_plan plan{T,
                     E,
                     S,
                     saved[4].data_ptr<int32_t>(),
                     static_cast<int32_t*>(data(saved[5])),
                     static_cast<float*>(data(saved[6])),
                     saved[7].data_ptr<int32_t>(),
                     static_cast<int32_t*>(data(saved[8])),
                     static_cast<int32_t*>(data(saved[9]))};
  const int rc = g_api.layer_backward_biased(
      &cfg, &plan, dev, stream, data(x), data(w1), data(w2), data(b1), data(b2), data(d_out),
      a.recompute ? nullptr : data(h), data(g.dx), data(g.dw1), data(g.dw2),
      static_cast<float*>(data(g.dpw)), data(g.db1), data(g.db2), data(ws), ws_bytes);
  TORCH_CHECK(rc == MOEBLAZE_OK, "moeblaze: ", g_api.last_error());
  // dH went over h: a second backward (retain_graph) must fail on h's version, not read dH.
  if (mode == kModeDhOverH) torch::autograd::impl::bump_version(h);
  return g;
}

}  // namespace moeblaze_eager

namespace {

using namespace moeblaze_eager;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct EagerExperts : public torch::autograd::Function<EagerExperts> {
  // x (T, d), w1 (E, w1_rows, d), w2 (E, d, n): checked, contiguous, one dtype and device.
  // pair_weights: the caller's expert weights ((T, K) or (P,)), only here to receive their
  // gradient; the kernels read the plan's copy (src). b1 (E, w1_rows), b2 (E, d): the optional
  // expert biases (undefined: none), x's dtype, contiguous.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w1,
                               const at::Tensor& w2, const at::Tensor& pair_weights,
                               const std::optional<at::Tensor>& b1_opt,
                               const std::optional<at::Tensor>& b2_opt, const PlanSource& src,
                               int64_t activation, bool recompute, int64_t compute,
                               int64_t fp8_cache) {
    // Optional, not undefined tensors: autograd records an input's device and dtype.
    ExpertsForward f = experts_forward(x, w1, w2, b1_opt.value_or(at::Tensor()),
                                       b2_opt.value_or(at::Tensor()), src,
                                       {activation, recompute, compute, 0, fp8_cache});
    ctx->save_for_backward(f.keep);
    ctx->saved_data["activation"] = activation;
    ctx->saved_data["recompute"] = recompute;
    ctx->saved_data["compute"] = compute;
    ctx->saved_data["fp8_cache"] = fp8_cache;
    ctx->saved_data["K"] = f.args.K;
    ctx->saved_data["pw_dtype"] = pair_weights.scalar_type();
    ctx->saved_data["pw_sizes"] = pair_weights.sizes().vec();
    return {f.out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const ExpertsArgs a{ctx->saved_data["activation"].toInt(),
                        ctx->saved_data["recompute"].toBool(), ctx->saved_data["compute"].toInt(),
                        ctx->saved_data["K"].toInt(), ctx->saved_data["fp8_cache"].toInt()};
    ExpertsGrads e = experts_backward(ctx->get_saved_variables(), a, grads[0]);
    const auto pw_dtype = ctx->saved_data["pw_dtype"].toScalarType();
    at::Tensor dpw_shaped = e.dpw.view(ctx->saved_data["pw_sizes"].toIntVector());
    if (pw_dtype != at::kFloat) dpw_shaped = dpw_shaped.to(pw_dtype);
    variable_list g = once_differentiable({e.dx, e.dw1, e.dw2, dpw_shaped, e.db1, e.db2}, grads);
    g.resize(11);  // no gradient for the plan source, activation, recompute, compute, fp8_cache
    return g;
  }
};

at::Tensor dense(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->contiguous() : at::Tensor();
}

py::object run(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
               const at::Tensor& pair_weights, const at::Tensor& b1, const at::Tensor& b2,
               const PlanSource& src, int64_t activation, bool recompute, int64_t compute,
               int64_t fp8_cache) {
  try {
    const auto opt = [](const at::Tensor& t) {
      return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
    };
    variable_list out = EagerExperts::apply(x.contiguous(), w1.contiguous(), w2.contiguous(),
                                            pair_weights, opt(b1), opt(b2), src, activation,
                                            recompute, compute, fp8_cache);
    return py::cast(out[0]);
  } catch (const CallFailed& f) {
    return py::int_(f.rc);
  }
}

// moe_experts: ids (T, K) int32/int64 with K >= 1, kernel_weights (T, K) fp32/bf16 (the
// caller's weights, detached). compute: moeblaze_layer_cfg.compute (0 storage dtype, 1 fp8);
// fp8_cache: its fp8_weights handle (0: none).
py::object experts_from_ids(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                            const at::Tensor& pair_weights, const at::Tensor& ids,
                            const at::Tensor& kernel_weights, int64_t activation, int64_t w1_rows,
                            bool recompute, const std::optional<at::Tensor>& b1_,
                            const std::optional<at::Tensor>& b2_, int64_t compute,
                            int64_t fp8_cache) {
  const at::Tensor b1 = dense(b1_), b2 = dense(b2_);
  if (g_api.layer_forward_biased == nullptr ||
      !operands_apply(x, w1, w2, b1, b2, w1_rows, compute))
    return py::none();
  if (ids.dim() != 2 || ids.size(0) != x.size(0) || ids.size(1) < 1 ||
      kernel_weights.sizes() != ids.sizes() || ids.device() != x.device() ||
      kernel_weights.device() != x.device())
    return py::none();
  if (ids.scalar_type() != at::kInt && ids.scalar_type() != at::kLong) return py::none();
  if (kernel_weights.scalar_type() != at::kFloat &&
      kernel_weights.scalar_type() != at::kBFloat16)
    return py::none();
  return run(x, w1, w2, pair_weights, b1, b2,
             {true, ids.contiguous(), kernel_weights.contiguous(), {}, {}, {}}, activation,
             recompute, compute, fp8_cache);
}

// experts_from_routing: the CSR routing, pair_offsets (T+1,) int32, pair_experts (P,) int32,
// kernel_weights (P,) fp32 (the caller's pair weights, detached).
py::object experts_from_routing(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                                const at::Tensor& pair_weights, const at::Tensor& offsets,
                                const at::Tensor& experts, const at::Tensor& kernel_weights,
                                int64_t activation, int64_t w1_rows, bool recompute,
                                const std::optional<at::Tensor>& b1_,
                                const std::optional<at::Tensor>& b2_, int64_t compute,
                                int64_t fp8_cache) {
  const at::Tensor b1 = dense(b1_), b2 = dense(b2_);
  if (g_api.build_plan == nullptr || !operands_apply(x, w1, w2, b1, b2, w1_rows, compute))
    return py::none();
  if (offsets.dim() != 1 || offsets.size(0) != x.size(0) + 1 || experts.dim() != 1 ||
      kernel_weights.dim() != 1 || kernel_weights.size(0) != experts.size(0))
    return py::none();
  if (offsets.scalar_type() != at::kInt || experts.scalar_type() != at::kInt ||
      kernel_weights.scalar_type() != at::kFloat)
    return py::none();
  for (const at::Tensor* t : {&offsets, &experts, &kernel_weights})
    if (t->device() != x.device()) return py::none();
  return run(x, w1, w2, pair_weights, b1, b2,
             {false, {}, {}, offsets.contiguous(), experts.contiguous(),
              kernel_weights.contiguous()},
             activation, recompute, compute, fp8_cache);
}

// The C ABI's functions from their addresses, by name (ctypes resolved capi_functions).
void init(const std::map<std::string, uintptr_t>& addresses) {
#define MOEBLAZE_EAGER_INIT(name) \
  g_api.name = reinterpret_cast<decltype(g_api.name)>(addresses.at("moeblaze_" #name));
  MOEBLAZE_EAGER_CAPI(MOEBLAZE_EAGER_INIT)
#undef MOEBLAZE_EAGER_INIT
}

}  // namespace

PYBIND11_MODULE(moeblaze_eager, m) {
  m.doc() = "moeblaze's eager moe_experts step and MoE router with the host work in C++ (_ext.py)";
  m.def("init", &init, "the C ABI's function addresses by name (ctypes)");
#define MOEBLAZE_EAGER_NAME(name) "moeblaze_" #name,
  m.attr("capi_functions") = std::vector<std::string>{MOEBLAZE_EAGER_CAPI(MOEBLAZE_EAGER_NAME)};
#undef MOEBLAZE_EAGER_NAME
  m.def("experts_from_ids", &experts_from_ids,
        "moe_experts: out, None (not this path's case) or a C ABI error code");
  m.def("experts_from_routing", &experts_from_routing,
        "experts_from_routing: out, None (not this path's case) or a C ABI error code");
  moeblaze_eager::register_router(m);
  moeblaze_eager::register_layer(m);
  m.attr("capi_version") = MOEBLAZE_CAPI_VERSION;
}
