// The C ABI (include/moeblaze/capi.h) over the C++ API: every call converts its C arguments into
// views, checks what the C++ entry point it forwards to does not (enum codes, the CUDA async
// paths' host-side rules), and maps exceptions to an error code plus a per-thread message.
//
// CPU calls go through the public C++ API (which validates everything and never syncs anything).
// CUDA calls go to the backend's *_async functions directly, over caller storage, so that no call
// allocates through the library or synchronises with the host (graph-capturable); the public
// C++ CUDA paths would read their device-side check flags back at the end of every call.
#include "moeblaze/capi.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core/aliasing.hpp"
#include "core/checked_math.hpp"
#include "core/parallel.hpp"
#include "core/plan_validation.hpp"
#include "core/routing_validation.hpp"
#include "cpu/cpu_backend.hpp"
#include "moeblaze/moeblaze.hpp"

#ifdef MOEBLAZE_WITH_CUDA
#include <cuda_runtime.h>

#include "cuda/cuda_backend.hpp"
#include "cuda/routing/router_kernels.hpp"
#endif

using namespace moeblaze;

namespace {

thread_local std::string g_last_error;

template <typename Fn>
int guarded(Fn&& fn) {
  try {
    g_last_error.clear();
    fn();
    return MOEBLAZE_OK;
  } catch (const InvalidArgument& e) {
    g_last_error = e.what();
    return MOEBLAZE_ERR_INVALID_ARGUMENT;
  } catch (const Unsupported& e) {
    g_last_error = e.what();
    return MOEBLAZE_ERR_UNSUPPORTED;
  } catch (const DeviceError& e) {
    g_last_error = e.what();
    return MOEBLAZE_ERR_DEVICE;
  } catch (const std::bad_alloc&) {
    g_last_error = "out of memory (std::bad_alloc)";
    return MOEBLAZE_ERR_OTHER;
  } catch (const std::exception& e) {
    g_last_error = e.what();
    return MOEBLAZE_ERR_OTHER;
  } catch (...) {
    g_last_error = "unknown exception";
    return MOEBLAZE_ERR_OTHER;
  }
}

Device to_device(int32_t device) {
  MOEBLAZE_REQUIRE(device == 0 || device == 1, "device (", device, ") must be 0 (cpu) or 1 (cuda)");
#ifndef MOEBLAZE_WITH_CUDA
  MOEBLAZE_UNSUPPORTED_IF(device == 1, "device cuda: moeblaze was built without CUDA");
#endif
  return device == 0 ? Device::cpu : Device::cuda;
}

DType to_float_dtype(int32_t dtype, const char* name) {
  MOEBLAZE_REQUIRE(dtype == 0 || dtype == 1, name, " dtype (", dtype,
                   ") must be 0 (fp32) or 1 (bf16)");
  return dtype == 0 ? DType::f32 : DType::bf16;
}

template <typename P>
void require_ptr(const P* p, const char* name) {
  MOEBLAZE_REQUIRE(p != nullptr, name, " is NULL");
}

RouterConfig to_router(const moeblaze_router_cfg* c, int64_t E) {
  require_ptr(c, "cfg");
  MOEBLAZE_REQUIRE(c->kind >= 0 && c->kind <= 2, "router kind (", c->kind,
                   ") must be 0 (softmax_topk), 1 (topk_softmax) or 2 (sigmoid_bias)");
  MOEBLAZE_REQUIRE(c->top_k >= 1, "top_k (", c->top_k, ") must be >= 1");
  MOEBLAZE_REQUIRE(c->top_k <= E, "top_k (", c->top_k, ") exceeds num_experts (", E, ")");
  RouterConfig r;
  r.kind = static_cast<RouterKind>(c->kind);
  r.top_k = c->top_k;
  r.renormalize = c->renormalize != 0;
  return r;
}

// The logits and bias views, with the rules the public router API applies.
struct RouterArgs {
  TensorView logits, bias;
};
RouterArgs router_args(const RouterConfig& r, const void* logits, int32_t logits_dtype,
                       int64_t T, int64_t E, const float* bias, Device dev) {
  MOEBLAZE_REQUIRE(T >= 0, "T (", T, ") must be >= 0");
  MOEBLAZE_REQUIRE(E >= 1, "E (", E, ") must be >= 1");
  RouterArgs a;
  a.logits = TensorView(const_cast<void*>(logits), to_float_dtype(logits_dtype, "logits"), dev,
                        {T, E});
  require_data(a.logits, "logits");
  if (r.kind == RouterKind::sigmoid_bias) {
    MOEBLAZE_REQUIRE(bias != nullptr, "bias (", E,
                     ",) fp32 is required by the sigmoid-bias router, got none");
    a.bias = TensorView(const_cast<float*>(bias), DType::f32, dev, {E});
  } else {
    MOEBLAZE_REQUIRE(bias == nullptr, "bias is given but the ", router_name(r.kind),
                     " router takes none (only sigmoid-bias uses a bias)");
  }
  require_pairs_fit(T, r.top_k);
  return a;
}

RoutingView routing_view(const moeblaze_routing* r, Device dev, const char* name) {
  require_ptr(r, name);
  MOEBLAZE_REQUIRE(r->T >= 0 && r->E >= 1 && r->P >= 0, name, ": T (", r->T, "), E (", r->E,
                   "), P (", r->P, ") must be >= 0, >= 1, >= 0");
  MOEBLAZE_REQUIRE(r->P < (int64_t(1) << 31), name, ": P (", r->P,
                   ") exceeds the int32 index range");
  MOEBLAZE_REQUIRE(r->pair_offsets != nullptr, name, ".pair_offsets is NULL");
  MOEBLAZE_REQUIRE(r->P == 0 || (r->pair_experts != nullptr && r->pair_weights != nullptr), name,
                   ".pair_experts / pair_weights is NULL");
  RoutingView v;
  v.T = r->T;
  v.E = r->E;
  v.P = r->P;
  v.pair_offsets = r->pair_offsets;
  v.pair_experts = r->pair_experts;
  v.pair_weights = r->pair_weights;
  v.device = dev;
  return v;
}

// token_experts_optional: a NULL token_expert_indices passes here (layer backward; the layer API
// says where it may be NULL).
RoutingPlan borrow_plan(const moeblaze_plan* p, Device dev, bool token_experts_optional = false) {
  require_ptr(p, "plan");
  // Each array's NULL named here, with its rule, before RoutingPlan::borrow: Buffer::borrow's own
  // check knows only a byte count, not which argument broke which rule.
  MOEBLAZE_REQUIRE(p->expert_token_offsets != nullptr,
                   "plan.expert_token_offsets has no data (null pointer): every plan needs its "
                   "(E+1,) int32 expert offsets, also with S = 0 (E = ", p->E, ")");
  MOEBLAZE_REQUIRE(p->token_pair_offsets != nullptr,
                   "plan.token_pair_offsets has no data (null pointer): every plan needs its "
                   "(T+1,) int32 token offsets, also with S = 0 (T = ", p->T, ")");
  if (p->S > 0) {
    for (const auto& [ptr, what] :
         {std::pair<const void*, const char*>{p->expert_token_indices,
                                              "expert_token_indices has no data (null pointer): "
                                              "a plan of S = "},
          {p->slot_weights, "slot_weights has no data (null pointer): a plan of S = "},
          {p->token_index_map, "token_index_map has no data (null pointer): a plan of S = "}})
      MOEBLAZE_REQUIRE(ptr != nullptr, "plan.", what, p->S,
                       " slots needs this (S,) array (NULL only where S = 0)");
  }
  // token_expert_indices may be NULL in some calls: validate_routing_plan_header says which.
  RoutingPlan plan = RoutingPlan::borrow(dev, p->T, p->E, p->S, p->expert_token_offsets,
                                         p->expert_token_indices, p->slot_weights,
                                         p->token_pair_offsets, p->token_expert_indices,
                                         p->token_index_map);
  // Sizes and pointers here (later size arithmetic relies on them); contents in the layer API.
  validate_routing_plan_header(plan.view(), token_experts_optional);
  return plan;
}

// The byte ranges a plan build writes: the plan's six arrays, the flags (CUDA: 4 int32) and the
// workspace; none may overlap another or the build's inputs (they are read while written).
std::vector<ByteRange> plan_build_outputs(const moeblaze_plan* p, const int32_t* flags,
                                          const void* workspace, uint64_t workspace_bytes) {
  const size_t S = size_t(p->S) * 4, T1 = size_t(p->T + 1) * 4, E1 = size_t(p->E + 1) * 4;
  return {{p->expert_token_offsets, E1, "plan.expert_token_offsets"},
          {p->expert_token_indices, S, "plan.expert_token_indices"},
          {p->slot_weights, S, "plan.slot_weights"},
          {p->token_pair_offsets, T1, "plan.token_pair_offsets"},
          {p->token_expert_indices, S, "plan.token_expert_indices"},
          {p->token_index_map, S, "plan.token_index_map"},
          {flags, flags ? sizeof(int32_t) * 4 : 0, "flags"},
          {workspace, workspace ? size_t(workspace_bytes) : 0, "workspace"}};
}

LayerConfig to_layer(const moeblaze_layer_cfg* c) {
  require_ptr(c, "cfg");
  MOEBLAZE_REQUIRE(c->activation >= 0 && c->activation <= 6, "activation (", c->activation,
                   ") must be 0..6 (swiglu, geglu, relu, silu, gelu, relu2, swiglu_oai)");
  MOEBLAZE_REQUIRE(c->mode >= 0 && c->mode <= 2, "mode (", c->mode,
                   ") must be 0 (keep_h), 1 (recompute) or 2 (keep_h, dH over h)");
  LayerConfig cfg;
  cfg.T = c->T;
  cfg.d = c->d;
  cfg.n = c->n;
  cfg.E = c->E;
  cfg.K = c->K;
  cfg.activation = static_cast<Activation>(c->activation);
  cfg.dtype = to_float_dtype(c->dtype, "layer");
  MOEBLAZE_REQUIRE(c->compute >= 0 && c->compute <= 2, "compute (", c->compute,
                   ") must be 0 (storage), 1 (fp8) or 2 (fp8-wgrad)");
  cfg.compute = static_cast<Compute>(c->compute);
  cfg.validate();
  require_thread_count(c->num_threads, "num_threads");
  return cfg;
}

// The FP8 weight caches create has returned and destroy has not taken: a handle is checked
// against them before it is used, so a stale or made-up one is an InvalidArgument, not a crash.
std::mutex g_caches_mu;
std::unordered_set<Fp8WeightCache*>& live_caches() {
  static auto* caches = new std::unordered_set<Fp8WeightCache*>;  // never destroyed: exit order
  return *caches;
}

Fp8WeightCache* live_cache(void* handle, const char* name) {
  require_ptr(handle, name);
  const std::lock_guard<std::mutex> lock(g_caches_mu);
  auto* cache = static_cast<Fp8WeightCache*>(handle);
  MOEBLAZE_REQUIRE(live_caches().count(cache) != 0, name,
                   " is not a live FP8 weight cache (moeblaze_fp8_weight_cache_create returns "
                   "one; destroy ends it)");
  return cache;
}

// cfg->fp8_weights: a live cache, given with compute 1 or 2 only; nullptr when not given.
Fp8WeightCache* fp8_weights_of(const moeblaze_layer_cfg* c) {
  if (c->fp8_weights == nullptr) return nullptr;
  MOEBLAZE_REQUIRE(c->compute == 1 || c->compute == 2, "cfg.fp8_weights is given, but compute is ",
                   c->compute, " (storage): an FP8 weight cache serves compute 1 and 2 (fp8) only");
  return live_cache(c->fp8_weights, "cfg.fp8_weights");
}

// cfg->mode (checked by to_layer): 0 keep_h, 1 recompute, 2 keep_h whose backward writes dH
// over h (LayerOptions::dh_over_h).
LayerMode to_mode(const moeblaze_layer_cfg* c) {
  return c->mode == 1 ? LayerMode::recompute : LayerMode::keep_h;
}

LayerOptions to_options(const moeblaze_layer_cfg* c, void* stream, void* workspace,
                        uint64_t workspace_bytes) {
  LayerOptions o;
  o.mode = to_mode(c);
  o.dh_over_h = c->mode == 2;
  o.num_threads = c->num_threads;
  o.stream = stream;
  o.workspace = workspace;
  o.workspace_bytes = workspace ? static_cast<size_t>(workspace_bytes) : 0;
  o.fp8_weights = fp8_weights_of(c);
  return o;
}

#ifdef MOEBLAZE_WITH_CUDA
cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }
#endif

// An optional pair of bias (or bias-gradient) pointers as views: NULL = none (rank 0).
LayerBiases biases_of(const LayerConfig& c, Device dev, const void* b1, const void* b2) {
  LayerBiases b;
  if (b1) b.b1 = TensorView(const_cast<void*>(b1), c.dtype, dev, {c.E, c.w1_rows()});
  if (b2) b.b2 = TensorView(const_cast<void*>(b2), c.dtype, dev, {c.E, c.d});
  return b;
}

// Checks of moeblaze_plan_from_ids's sizes and codes; returns whether ids are int64.
bool check_ids_args(int64_t T, int64_t K, int64_t E, int32_t ids_dtype) {
  MOEBLAZE_REQUIRE(T >= 0, "T (", T, ") must be >= 0");
  MOEBLAZE_REQUIRE(E >= 1 && E < (int64_t(1) << 31), "E (", E, ") must be in [1, 2^31)");
  MOEBLAZE_REQUIRE(K >= 1 && K <= E, "K (", K, ") must be in [1, E = ", E, "]");
  require_pairs_fit(T, K);
  MOEBLAZE_REQUIRE(ids_dtype == MOEBLAZE_IDS_INT32 || ids_dtype == MOEBLAZE_IDS_INT64,
                   "ids_dtype (", ids_dtype, ") must be ", int(MOEBLAZE_IDS_INT32), " (int32) or ",
                   int(MOEBLAZE_IDS_INT64), " (int64)");
  return ids_dtype == MOEBLAZE_IDS_INT64;
}

constexpr uint64_t kIdsAlign = 256;
uint64_t ids_align(uint64_t b) { return (b + kIdsAlign - 1) / kIdsAlign * kIdsAlign; }

// The CUDA workspace: the converted routing (offsets, ids, weights), then the plan build's.
struct IdsWorkspace {
  uint64_t offsets = 0, experts = 0, weights = 0, build = 0, total = 0;  // byte offsets, size
};
IdsWorkspace ids_workspace(int64_t T, int64_t K, int64_t E) {
  IdsWorkspace w;
  const uint64_t P = uint64_t(T) * uint64_t(K);
  w.experts = ids_align(uint64_t(T + 1) * 4);
  w.weights = w.experts + ids_align(P * 4);
  w.build = w.weights + ids_align(P * 4);
  w.total = w.build;
#ifdef MOEBLAZE_WITH_CUDA
  w.total += cuda::plan_build_workspace_bytes(T, E, int64_t(P), PlanBuilder::atomic_free);
#else
  (void)E;
#endif
  return w;
}

// The CPU conversion: offsets t*K, int32 ids (range-checked here, naming expert_ids[t, k]),
// fp32 weights.
template <typename Id>
void ids_to_routing_cpu(const Id* ids, const void* weights, DType wdt, int64_t T, int64_t K,
                        int64_t E, std::vector<int32_t>& offsets, std::vector<int32_t>& experts,
                        std::vector<float>& w) {
  const int64_t P = T * K;
  for (int64_t i = 0; i < P; ++i) {
    const int64_t e = static_cast<int64_t>(ids[i]);
    if (e < 0 || e >= E)
      throw InvalidArgument(detail::concat("expert_ids[", i / K, ", ", i % K, "]: expert id ", e,
                                           " of token ", i / K, " is out of range [0, ", E, ")"));
    experts[size_t(i)] = static_cast<int32_t>(e);
    w[size_t(i)] = wdt == DType::bf16 ? float(static_cast<const bf16*>(weights)[i])
                                      : static_cast<const float*>(weights)[i];
  }
  for (int64_t t = 0; t <= T; ++t) offsets[size_t(t)] = static_cast<int32_t>(t * K);
}

}  // namespace

extern "C" {

int moeblaze_capi_version(void) { return MOEBLAZE_CAPI_VERSION; }

int moeblaze_has_cuda(void) {
#ifdef MOEBLAZE_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

const char* moeblaze_last_error(void) { return g_last_error.c_str(); }

int moeblaze_memory_stats(int32_t device, uint64_t* current, uint64_t* peak) {
  return guarded([&] {
    require_ptr(current, "current");
    require_ptr(peak, "peak");
    MOEBLAZE_REQUIRE(device == 0 || device == 1, "device (", device, ") must be 0 or 1");
    const MemoryStats s = memory_stats(device == 0 ? Device::cpu : Device::cuda);
    *current = s.current;
    *peak = s.peak;
  });
}

int moeblaze_reset_peak(int32_t device) {
  return guarded([&] {
    MOEBLAZE_REQUIRE(device == 0 || device == 1, "device (", device, ") must be 0 or 1");
    reset_peak(device == 0 ? Device::cpu : Device::cuda);
  });
}

int moeblaze_route(const moeblaze_router_cfg* cfg, const void* logits, int32_t logits_dtype,
                   int64_t T, int64_t E, const float* bias, int32_t device, void* stream,
                   const moeblaze_routing* out, int32_t* flags) {
  return guarded([&] {
    const Device dev = to_device(device);
    const RouterConfig r = to_router(cfg, E);
    const RouterArgs a = router_args(r, logits, logits_dtype, T, E, bias, dev);
    const RoutingView o = routing_view(out, dev, "out");
    MOEBLAZE_REQUIRE(o.T == T && o.E == E && o.P == T * r.top_k, "out has (T, E, P) = (", o.T,
                     ", ", o.E, ", ", o.P, "), expected (", T, ", ", E, ", T*top_k = ",
                     T * r.top_k, ")");
    if (dev == Device::cpu) {
      Routing tmp;
      route(r, a.logits, a.bias, tmp);  // validates values (NaN logits name the entry)
      std::memcpy(out->pair_offsets, tmp.pair_offsets(), sizeof(int32_t) * size_t(T + 1));
      std::memcpy(out->pair_experts, tmp.pair_experts(), sizeof(int32_t) * size_t(o.P));
      std::memcpy(out->pair_weights, tmp.pair_weights(), sizeof(float) * size_t(o.P));
      return;
    }
#ifdef MOEBLAZE_WITH_CUDA
    require_ptr(flags, "flags");
    Routing borrowed = Routing::borrow(Device::cuda, T, E, o.P, out->pair_offsets,
                                       out->pair_experts, out->pair_weights);
    if (T > 0)
      cuda::router_topk_async(r, a.logits, a.bias.as<const float>(), borrowed, flags,
                              as_stream(stream));
    else
      MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(out->pair_offsets, 0, sizeof(int32_t),
                                          as_stream(stream)));
#else
    (void)stream;
    (void)flags;
#endif
  });
}

int moeblaze_router_backward(const moeblaze_router_cfg* cfg, const void* logits,
                             int32_t logits_dtype, int64_t T, int64_t E, const float* bias,
                             int32_t device, void* stream, const moeblaze_routing* routing,
                             const float* d_pair_weights, float* d_logits, int32_t* flags) {
  return guarded([&] {
    const Device dev = to_device(device);
    const RouterConfig r = to_router(cfg, E);
    const RouterArgs a = router_args(r, logits, logits_dtype, T, E, bias, dev);
    const RoutingView rv = routing_view(routing, dev, "routing");
    MOEBLAZE_REQUIRE(rv.T == T && rv.E == E, "routing has (T, E) = (", rv.T, ", ", rv.E,
                     "), logits are (", T, ", ", E, ")");
    MOEBLAZE_REQUIRE(T * E == 0 || d_logits != nullptr, "d_logits is NULL");
    MOEBLAZE_REQUIRE(rv.P == 0 || d_pair_weights != nullptr, "d_pair_weights is NULL");
    const TensorView dpw(const_cast<float*>(d_pair_weights), DType::f32, dev, {rv.P});
    const TensorView dl(d_logits, DType::f32, dev, {T, E});
    if (dev == Device::cpu) {
      router_backward(r, a.logits, a.bias, rv, dpw, dl);
      return;
    }
#ifdef MOEBLAZE_WITH_CUDA
    require_ptr(flags, "flags");
    if (T * E == 0) return;
    // Loss coefficients are 0 here (moeblaze_router_backward_losses adds the losses): no f.
    cuda::router_backward_async(r, a.logits, a.bias.as<const float>(), rv, d_pair_weights,
                                d_logits, nullptr, 0.0f, 0.0f, flags, as_stream(stream));
#else
    (void)stream;
    (void)flags;
#endif
  });
}

namespace {
// The router config of the loss entry points: cfg's, with the two coefficients checked.
RouterConfig with_loss_coefs(const moeblaze_router_cfg* cfg, int64_t E, float aux_coef,
                             float z_coef) {
  RouterConfig r = to_router(cfg, E);
  MOEBLAZE_REQUIRE(std::isfinite(aux_coef) && aux_coef >= 0.0f, "aux_coef (", aux_coef,
                   ") must be finite and >= 0");
  MOEBLAZE_REQUIRE(std::isfinite(z_coef) && z_coef >= 0.0f, "z_coef (", z_coef,
                   ") must be finite and >= 0");
  r.aux_loss_coef = aux_coef;
  r.z_loss_coef = z_coef;
  return r;
}

// A routing of (T, E) logits whose experts the loss calls read: shape and ids checked (CPU: the
// ids' values too; CUDA: the histogram ignores an id outside [0, E)).
RoutingView loss_routing(const moeblaze_routing* routing, Device dev, int64_t T, int64_t E) {
  const RoutingView rv = routing_view(routing, dev, "routing");
  MOEBLAZE_REQUIRE(rv.T == T && rv.E == E, "routing has (T, E) = (", rv.T, ", ", rv.E,
                   "), logits are (", T, ", ", E, ")");
  if (dev == Device::cpu)
    for (int64_t p = 0; p < rv.P; ++p)
      MOEBLAZE_REQUIRE(rv.pair_experts[p] >= 0 && rv.pair_experts[p] < E, "routing: pair_experts[",
                       p, "] = ", rv.pair_experts[p], " is out of range [0, ", E, ")");
  return rv;
}
}  // namespace

int moeblaze_router_losses_workspace_bytes(int64_t T, int64_t E, int64_t P, int32_t device,
                                           uint64_t* bytes) {
  return guarded([&] {
    require_ptr(bytes, "bytes");
    const Device dev = to_device(device);
    MOEBLAZE_REQUIRE(T >= 0 && E >= 1 && P >= 0, "T (", T, "), E (", E, "), P (", P,
                     ") must be >= 0, >= 1, >= 0");
    *bytes = 0;
#ifdef MOEBLAZE_WITH_CUDA
    if (dev == Device::cuda) *bytes = cuda::router_loss_workspace_bytes(T, E, P);
#else
    (void)dev;
#endif
  });
}

int moeblaze_router_losses(const moeblaze_router_cfg* cfg, float aux_coef, float z_coef,
                           const void* logits, int32_t logits_dtype, int64_t T, int64_t E,
                           const float* bias, int32_t device, void* stream,
                           const moeblaze_routing* routing, void* workspace,
                           uint64_t workspace_bytes, float* aux_loss, float* z_loss, float* f) {
  return guarded([&] {
    const Device dev = to_device(device);
    const RouterConfig r = with_loss_coefs(cfg, E, aux_coef, z_coef);
    const RouterArgs a = router_args(r, logits, logits_dtype, T, E, bias, dev);
    const RoutingView rv = loss_routing(routing, dev, T, E);
    if (dev == Device::cpu) {
      const RouterLosses l = cpu::router_losses(r, a.logits, rv.pair_experts, rv.P, f);
      if (aux_loss != nullptr) *aux_loss = float(l.aux_loss);
      if (z_loss != nullptr) *z_loss = float(l.z_loss);
      return;
    }
#ifdef MOEBLAZE_WITH_CUDA
    const uint64_t need = cuda::router_loss_workspace_bytes(T, E, rv.P);
    MOEBLAZE_REQUIRE(workspace_bytes >= need, "workspace_bytes (", workspace_bytes,
                     ") is below moeblaze_router_losses_workspace_bytes (", need, ")");
    MOEBLAZE_REQUIRE(need == 0 || workspace != nullptr, "workspace is NULL");
    cuda::router_losses_async(r, a.logits, rv.pair_experts, rv.P, workspace, nullptr,
                              as_stream(stream), aux_loss, z_loss, f);
#else
    (void)stream;
    (void)workspace;
    (void)workspace_bytes;
#endif
  });
}

int moeblaze_router_backward_losses(const moeblaze_router_cfg* cfg, float aux_coef, float z_coef,
                                    const void* logits, int32_t logits_dtype, int64_t T,
                                    int64_t E, const float* bias, int32_t device, void* stream,
                                    const moeblaze_routing* routing, const float* d_pair_weights,
                                    const float* f, const float* g_aux, const float* g_z,
                                    float* d_logits, int32_t* flags) {
  return guarded([&] {
    const Device dev = to_device(device);
    // A loss without an upstream gradient adds nothing: its term is off.
    const RouterConfig r = with_loss_coefs(cfg, E, g_aux != nullptr ? aux_coef : 0.0f,
                                           g_z != nullptr ? z_coef : 0.0f);
    const RouterArgs a = router_args(r, logits, logits_dtype, T, E, bias, dev);
    const RoutingView rv = loss_routing(routing, dev, T, E);
    MOEBLAZE_REQUIRE(T * E == 0 || d_logits != nullptr, "d_logits is NULL");
    MOEBLAZE_REQUIRE(rv.P == 0 || d_pair_weights != nullptr, "d_pair_weights is NULL");
    if (r.aux_loss_coef > 0.0f) require_ptr(f, "f");
    const TensorView dpw(const_cast<float*>(d_pair_weights), DType::f32, dev, {rv.P});
    const TensorView dl(d_logits, DType::f32, dev, {T, E});
    if (dev == Device::cpu) {
      const float g[2] = {g_aux != nullptr ? *g_aux : 0.0f, g_z != nullptr ? *g_z : 0.0f};
      MOEBLAZE_REQUIRE(std::isfinite(g[0]) && std::isfinite(g[1]), "g_aux (", g[0], ") and g_z (",
                       g[1], ") must be finite");
      cpu::router_backward(r, a.logits, a.bias, rv, dpw, dl, g);  // f: counted from the routing
      return;
    }
#ifdef MOEBLAZE_WITH_CUDA
    require_ptr(flags, "flags");
    if (T * E == 0) return;
    const cpu::RouterLossScales scales = cpu::router_loss_scales(r, T, E);
    cuda::router_backward_async(r, a.logits, a.bias.as<const float>(), rv, d_pair_weights,
                                d_logits, r.aux_loss_coef > 0.0f ? f : nullptr, scales.aux,
                                scales.z, flags, as_stream(stream), g_aux, g_z);
#else
    (void)stream;
    (void)flags;
#endif
  });
}

namespace {
// The rounding parameters of both token-rounding entry points, checked.
TokenRoundingConfig to_rounding(int32_t m_tile, int32_t rounding, uint64_t seed) {
  MOEBLAZE_REQUIRE(m_tile >= 1, "m_tile (", m_tile, ") must be >= 1");
  MOEBLAZE_REQUIRE(rounding >= 0 && rounding <= 3, "rounding (", rounding,
                   ") must be 0 (nr-f), 1 (sr-f), 2 (up) or 3 (down)");
  TokenRoundingConfig tc;
  tc.m_tile = m_tile;
  tc.mode = static_cast<RoundingMode>(rounding);
  tc.seed = seed;
  return tc;
}
}  // namespace

int moeblaze_token_round(const moeblaze_router_cfg* cfg, int32_t m_tile, int32_t rounding,
                         uint64_t seed, const void* logits, int32_t logits_dtype, int64_t T,
                         int64_t E, const float* bias, int32_t device, void* stream,
                         const moeblaze_routing* topk, void** handle, int64_t* rounded_pairs) {
  return guarded([&] {
    const Device dev = to_device(device);
    const RouterConfig r = to_router(cfg, E);
    const RouterArgs a = router_args(r, logits, logits_dtype, T, E, bias, dev);
    const RoutingView tv = routing_view(topk, dev, "topk");
    require_ptr(handle, "handle");
    require_ptr(rounded_pairs, "rounded_pairs");
    const TokenRoundingConfig tc = to_rounding(m_tile, rounding, seed);
#ifdef MOEBLAZE_WITH_CUDA
    // The public GPU path runs on the legacy default stream; order it after the caller's stream
    // (a non-blocking stream does not synchronise with it implicitly). This call syncs anyway.
    if (dev == Device::cuda) MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)));
#else
    (void)stream;
#endif
    auto out = std::make_unique<Routing>();
    token_round(r, tc, a.logits, a.bias, tv, *out);
    *rounded_pairs = out->P();
    *handle = out.release();
  });
}

int moeblaze_routing_take(void* handle, const moeblaze_routing* out, void* stream) {
  std::unique_ptr<Routing> r(static_cast<Routing*>(handle));
  return guarded([&] {
    require_ptr(r.get(), "handle");
    const RoutingView o = routing_view(out, r->device(), "out");
    MOEBLAZE_REQUIRE(o.T == r->T() && o.E == r->E() && o.P == r->P(), "out has (T, E, P) = (",
                     o.T, ", ", o.E, ", ", o.P, "), the rounded routing has (", r->T(), ", ",
                     r->E(), ", ", r->P(), ")");
    const size_t off = sizeof(int32_t) * size_t(o.T + 1), pe = sizeof(int32_t) * size_t(o.P),
                 pw = sizeof(float) * size_t(o.P);
    if (r->device() == Device::cpu) {
      std::memcpy(out->pair_offsets, r->pair_offsets(), off);
      if (o.P) std::memcpy(out->pair_experts, r->pair_experts(), pe);
      if (o.P) std::memcpy(out->pair_weights, r->pair_weights(), pw);
      return;
    }
#ifdef MOEBLAZE_WITH_CUDA
    const cudaStream_t s = as_stream(stream);
    MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(out->pair_offsets, r->pair_offsets(), off,
                                        cudaMemcpyDeviceToDevice, s));
    if (o.P) {
      MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(out->pair_experts, r->pair_experts(), pe,
                                          cudaMemcpyDeviceToDevice, s));
      MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(out->pair_weights, r->pair_weights(), pw,
                                          cudaMemcpyDeviceToDevice, s));
    }
    // The handle's buffers were allocated on the default stream; free them only after the copies.
    MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(s));
#else
    (void)stream;
#endif
  });
}

void moeblaze_routing_free(void* handle) { delete static_cast<Routing*>(handle); }

namespace {
// The two-call token rounding is CUDA-only: the CPU has no synchronisation to save
// (moeblaze_token_round).
void require_two_call_device(Device dev) {
  MOEBLAZE_UNSUPPORTED_IF(dev != Device::cuda, "device (", device_name(dev),
                          "): the two-call token rounding is CUDA-only; on the CPU call "
                          "moeblaze_token_round");
}
}  // namespace

int moeblaze_token_round_workspace_bytes(int64_t T, int64_t E, int32_t device, uint64_t* bytes) {
  return guarded([&] {
    const Device dev = to_device(device);
    require_ptr(bytes, "bytes");
    MOEBLAZE_REQUIRE(T >= 0 && E >= 1, "T (", T, "), E (", E, ") must be >= 0, >= 1");
    require_two_call_device(dev);
#ifdef MOEBLAZE_WITH_CUDA
    *bytes = cuda::token_round_workspace_bytes(T, E);
#endif
  });
}

int moeblaze_token_round_count(const moeblaze_router_cfg* cfg, int32_t m_tile, int32_t rounding,
                               uint64_t seed, const void* logits, int32_t logits_dtype,
                               int64_t T, int64_t E, const float* bias, int32_t device,
                               void* stream, const moeblaze_routing* topk, void* workspace,
                               uint64_t workspace_bytes, int64_t* rounded_pairs) {
  return guarded([&] {
    const Device dev = to_device(device);
    require_two_call_device(dev);
    const TokenRoundingConfig tc = to_rounding(m_tile, rounding, seed);
    const RouterConfig r = to_router(cfg, E);
    const RouterArgs a = router_args(r, logits, logits_dtype, T, E, bias, dev);
    const RoutingView tv = routing_view(topk, dev, "topk");
    MOEBLAZE_REQUIRE(tv.T == T && tv.E == E, "topk has (T, E) = (", tv.T, ", ", tv.E,
                     "), logits are (", T, ", ", E, ")");
    require_ptr(rounded_pairs, "rounded_pairs");
#ifdef MOEBLAZE_WITH_CUDA
    const size_t need = cuda::token_round_workspace_bytes(T, E);
    MOEBLAZE_REQUIRE(workspace_bytes >= need, "workspace_bytes (", workspace_bytes,
                     ") is below moeblaze_token_round_workspace_bytes (", need, ")");
    require_ptr(workspace, "workspace");
    int32_t h[2 * cuda::kRoutingFlagCount];
    const int64_t S = cuda::token_round_count(r, tc, a.logits, a.bias.as<const float>(), tv,
                                              workspace, h, as_stream(stream));
    cuda::throw_if_token_round_flags(h, r, tc, a.logits, a.bias, tv);
    *rounded_pairs = S;
#else
    (void)stream;
    (void)workspace;
    (void)workspace_bytes;
    (void)tc;
    (void)a;
#endif
  });
}

int moeblaze_token_round_fill(const moeblaze_router_cfg* cfg, const void* logits,
                              int32_t logits_dtype, int64_t T, int64_t E, int32_t device,
                              void* stream, const void* workspace, uint64_t workspace_bytes,
                              const moeblaze_routing* out) {
  return guarded([&] {
    const Device dev = to_device(device);
    require_two_call_device(dev);
    const RouterConfig r = to_router(cfg, E);
    // The bias is not read here (the pair weights use the logits alone).
    MOEBLAZE_REQUIRE(T >= 0 && E >= 1, "T (", T, "), E (", E, ") must be >= 0, >= 1");
    const TensorView lv(const_cast<void*>(logits), to_float_dtype(logits_dtype, "logits"), dev,
                        {T, E});
    require_data(lv, "logits");
    const RoutingView o = routing_view(out, dev, "out");
    MOEBLAZE_REQUIRE(o.T == T && o.E == E, "out has (T, E) = (", o.T, ", ", o.E,
                     "), logits are (", T, ", ", E, ")");
#ifdef MOEBLAZE_WITH_CUDA
    const size_t need = cuda::token_round_workspace_bytes(T, E);
    MOEBLAZE_REQUIRE(workspace_bytes >= need, "workspace_bytes (", workspace_bytes,
                     ") is below moeblaze_token_round_workspace_bytes (", need, ")");
    require_ptr(workspace, "workspace");
    cuda::token_round_fill_async(r, lv, workspace, out->pair_offsets, out->pair_experts,
                                 out->pair_weights, o.P, as_stream(stream));
#else
    (void)stream;
    (void)workspace;
    (void)workspace_bytes;
    (void)lv;
    (void)r;
#endif
  });
}

int moeblaze_plan_workspace_bytes(int64_t T, int64_t E, int64_t P, int32_t device,
                                  uint64_t* bytes) {
  return guarded([&] {
    const Device dev = to_device(device);
    require_ptr(bytes, "bytes");
    MOEBLAZE_REQUIRE(T >= 0 && E >= 1 && P >= 0, "T (", T, "), E (", E, "), P (", P,
                     ") must be >= 0, >= 1, >= 0");
    *bytes = 0;
#ifdef MOEBLAZE_WITH_CUDA
    if (dev == Device::cuda)
      *bytes = cuda::plan_build_workspace_bytes(T, E, P, PlanBuilder::atomic_free);
#else
    (void)dev;
#endif
  });
}

int moeblaze_build_plan(const moeblaze_routing* routing, int32_t device, void* stream,
                        const moeblaze_plan* plan, void* workspace, uint64_t workspace_bytes,
                        int32_t* flags) {
  return guarded([&] {
    const Device dev = to_device(device);
    const RoutingView rv = routing_view(routing, dev, "routing");
    RoutingPlan p = borrow_plan(plan, dev);
    MOEBLAZE_REQUIRE(p.T() == rv.T && p.E() == rv.E && p.S() == rv.P, "plan has (T, E, S) = (",
                     p.T(), ", ", p.E(), ", ", p.S(), "), the routing has (T, E, P) = (", rv.T,
                     ", ", rv.E, ", ", rv.P, ")");
    require_disjoint(plan_build_outputs(plan, dev == Device::cuda ? flags : nullptr,
                                        dev == Device::cuda ? workspace : nullptr,
                                        workspace_bytes),
                     {{rv.pair_offsets, size_t(rv.T + 1) * 4, "routing.pair_offsets"},
                      {rv.pair_experts, size_t(rv.P) * 4, "routing.pair_experts"},
                      {rv.pair_weights, size_t(rv.P) * 4, "routing.pair_weights"}});
    if (dev == Device::cpu) {
      build_routing_plan(rv, PlanBuilder::atomic_free, p);  // fills the borrowed arrays in place
      MOEBLAZE_REQUIRE(p.view().expert_token_offsets == plan->expert_token_offsets,
                       "internal: the CPU plan builder did not reuse the caller's storage");
      return;
    }
#ifdef MOEBLAZE_WITH_CUDA
    require_ptr(flags, "flags");
    const size_t need = cuda::plan_build_workspace_bytes(rv.T, rv.E, rv.P, PlanBuilder::atomic_free);
    MOEBLAZE_REQUIRE(workspace_bytes >= need, "workspace_bytes (", workspace_bytes,
                     ") is less than the plan build's ", need);
    MOEBLAZE_REQUIRE(need == 0 || workspace != nullptr, "workspace is NULL");
    cuda::build_plan_async(rv, PlanBuilder::atomic_free, p, workspace, size_t(workspace_bytes),
                           flags, as_stream(stream));
#else
    (void)stream;
    (void)workspace;
    (void)workspace_bytes;
    (void)flags;
#endif
  });
}

int moeblaze_plan_from_ids_workspace_bytes(int64_t T, int64_t K, int64_t E, int32_t device,
                                           uint64_t* bytes) {
  return guarded([&] {
    const Device dev = to_device(device);
    require_ptr(bytes, "bytes");
    check_ids_args(T, K, E, MOEBLAZE_IDS_INT32);
    *bytes = dev == Device::cuda ? ids_workspace(T, K, E).total : 0;
  });
}

int moeblaze_plan_from_ids(const void* expert_ids, int32_t ids_dtype, const void* expert_weights,
                           int32_t weights_dtype, int64_t T, int64_t K, int64_t E,
                           int32_t device, [[maybe_unused]] void* stream,
                           const moeblaze_plan* plan, void* workspace, uint64_t workspace_bytes,
                           int32_t* flags) {
  return guarded([&] {
    const Device dev = to_device(device);
    const bool wide = check_ids_args(T, K, E, ids_dtype);
    const DType wdt = to_float_dtype(weights_dtype, "expert_weights");
    const int64_t P = T * K;
    MOEBLAZE_REQUIRE(P == 0 || (expert_ids != nullptr && expert_weights != nullptr),
                     "expert_ids / expert_weights is NULL");
    RoutingPlan p = borrow_plan(plan, dev);
    MOEBLAZE_REQUIRE(p.T() == T && p.E() == E && p.S() == P, "plan has (T, E, S) = (", p.T(),
                     ", ", p.E(), ", ", p.S(), "), the ids give (T, E, T*K) = (", T, ", ", E,
                     ", ", P, ")");
    require_disjoint(plan_build_outputs(plan, dev == Device::cuda ? flags : nullptr,
                                        dev == Device::cuda ? workspace : nullptr,
                                        workspace_bytes),
                     {{expert_ids, size_t(P) * (wide ? 8 : 4), "expert_ids"},
                      {expert_weights, size_t(P) * dtype_size(wdt), "expert_weights"}});
    RoutingView rv;
    rv.T = T;
    rv.E = E;
    rv.P = P;
    rv.device = dev;
    if (dev == Device::cpu) {
      std::vector<int32_t> offsets(static_cast<size_t>(T + 1)), experts(static_cast<size_t>(P));
      std::vector<float> w(static_cast<size_t>(P));
      if (wide)
        ids_to_routing_cpu(static_cast<const int64_t*>(expert_ids), expert_weights, wdt, T, K, E,
                           offsets, experts, w);
      else
        ids_to_routing_cpu(static_cast<const int32_t*>(expert_ids), expert_weights, wdt, T, K, E,
                           offsets, experts, w);
      rv.pair_offsets = offsets.data();
      rv.pair_experts = experts.data();
      rv.pair_weights = w.data();
      build_routing_plan(rv, PlanBuilder::atomic_free, p);  // fills the borrowed arrays in place
      return;
    }
#ifdef MOEBLAZE_WITH_CUDA
    require_ptr(flags, "flags");
    const IdsWorkspace ws = ids_workspace(T, K, E);
    MOEBLAZE_REQUIRE(workspace_bytes >= ws.total, "workspace_bytes (", workspace_bytes,
                     ") is less than moeblaze_plan_from_ids_workspace_bytes' ", ws.total);
    require_ptr(workspace, "workspace");
    char* base = static_cast<char*>(workspace);
    const cuda::FixedKRouting r{reinterpret_cast<int32_t*>(base + ws.offsets),
                                reinterpret_cast<int32_t*>(base + ws.experts),
                                reinterpret_cast<float*>(base + ws.weights)};
    const cudaStream_t s = as_stream(stream);
    MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(flags, 0, cuda::kRoutingFlagCount * sizeof(int32_t), s));
    cuda::routing_from_ids_async(expert_ids, wide, expert_weights, wdt, T, K, E, r, s);
    rv.pair_offsets = r.pair_offsets;
    rv.pair_experts = r.pair_experts;
    rv.pair_weights = r.pair_weights;
    cuda::build_plan_async(rv, PlanBuilder::atomic_free, p, base + ws.build,
                           size_t(workspace_bytes - ws.build), flags, s);
#endif
  });
}

int moeblaze_routing_flags_error(const int32_t* host_flags, const moeblaze_routing* routing,
                                 int32_t device) {
  return guarded([&] {
    require_ptr(host_flags, "host_flags");
    bool raised = false;
    for (int i = 0; i < 4; ++i) raised = raised || host_flags[i] != 0;
    if (!raised) return;
    if (routing == nullptr)
      throw InvalidArgument(detail::concat(
          "logits: the router found a NaN or Inf logit (device-side check; flags [out_of_range=",
          host_flags[0], ", repeated=", host_flags[1], ", non_finite=", host_flags[2],
          ", bad_offsets=", host_flags[3], "])"));
    const Device dev = to_device(device);
    const RoutingView rv = routing_view(routing, dev, "routing");
    if (dev == Device::cpu) {
      validate_routing(rv);
      return;
    }
#ifdef MOEBLAZE_WITH_CUDA
    MOEBLAZE_CUDA_CHECK(cudaDeviceSynchronize());
    cuda::throw_if_routing_flags(host_flags, rv);
#endif
  });
}

int moeblaze_validate_plan(const moeblaze_plan* plan) {
  return guarded([&] { validate_routing_plan(borrow_plan(plan, Device::cpu).view()); });
}

int moeblaze_plan_check_workspace_bytes(int64_t S, int32_t device, uint64_t* bytes) {
  return guarded([&] {
    const Device dev = to_device(device);
    require_ptr(bytes, "bytes");
    MOEBLAZE_REQUIRE(S >= 0 && S < kInt32Limit, "S (", S, ") must be in [0, 2^31)");
    *bytes = 0;
#ifdef MOEBLAZE_WITH_CUDA
    if (dev == Device::cuda) *bytes = cuda::plan_check_workspace_bytes(S);
#else
    (void)dev;
#endif
  });
}

int moeblaze_check_plan_async(const moeblaze_plan* plan, int32_t device,
                              [[maybe_unused]] void* stream, [[maybe_unused]] void* workspace,
                              [[maybe_unused]] uint64_t workspace_bytes,
                              [[maybe_unused]] int32_t* flags) {
  if (device == 0) return moeblaze_validate_plan_sync(plan, device, stream);  // the CPU: at once
  return guarded([&] {
    const Device dev = to_device(device);
    [[maybe_unused]] const RoutingPlan p = borrow_plan(plan, dev);
#ifdef MOEBLAZE_WITH_CUDA
    require_ptr(flags, "flags");
    cuda::validate_plan_async(p.view(), workspace, size_t(workspace_bytes), flags,
                              as_stream(stream));
#endif
  });
}

int moeblaze_validate_plan_sync(const moeblaze_plan* plan, int32_t device, void* stream) {
  return guarded([&] {
    const Device dev = to_device(device);
    const RoutingPlan p = borrow_plan(plan, dev);
    if (dev == Device::cpu) {
      validate_routing_plan(p.view());
      return;
    }
#ifdef MOEBLAZE_WITH_CUDA
    cuda::validate_plan(p.view(), as_stream(stream));
#else
    (void)stream;
#endif
  });
}

int moeblaze_fp8_weight_cache_create(void** cache) {
  return guarded([&] {
    require_ptr(cache, "cache");
    auto made = std::make_unique<Fp8WeightCache>();
    const std::lock_guard<std::mutex> lock(g_caches_mu);
    live_caches().insert(made.get());
    *cache = made.release();
  });
}

int moeblaze_fp8_weight_cache_destroy(void* cache) {
  return guarded([&] {
    if (cache == nullptr) return;
    Fp8WeightCache* c = live_cache(cache, "cache");
    {
      const std::lock_guard<std::mutex> lock(g_caches_mu);
      live_caches().erase(c);
    }
    delete c;  // waits for the device before it frees the codes (~Fp8WeightCache)
  });
}

int moeblaze_fp8_weight_cache_weights_changed(void* cache) {
  return guarded([&] { live_cache(cache, "cache")->weights_changed(); });
}

int moeblaze_fp8_weight_cache_stats(void* cache, uint64_t* bytes, int64_t* quantizations) {
  return guarded([&] {
    const Fp8WeightCache* c = live_cache(cache, "cache");
    require_ptr(bytes, "bytes");
    require_ptr(quantizations, "quantizations");
    *bytes = c->bytes();
    *quantizations = c->quantizations();
  });
}

int moeblaze_layer_kept_h_bytes(const moeblaze_layer_cfg* cfg, int64_t S, uint64_t* bytes) {
  return guarded([&] {
    const LayerConfig c = to_layer(cfg);
    require_ptr(bytes, "bytes");
    MOEBLAZE_REQUIRE(S >= 0 && S < (int64_t(1) << 31), "S (", S, ") must be in [0, 2^31)");
    *bytes = c.kept_h_bytes(S);
  });
}

int moeblaze_layer_workspace_bytes(const moeblaze_layer_cfg* cfg, int64_t S, int32_t device,
                                   uint64_t* bytes) {
  return guarded([&] {
    const Device dev = to_device(device);
    const LayerConfig c = to_layer(cfg);
    require_ptr(bytes, "bytes");
    const bool cached = fp8_weights_of(cfg) != nullptr;
    ThreadCountScope threads(cfg->num_threads);  // the CPU workspace holds per-thread scratch
    const size_t fwd = layer_workspace_bytes(c, S, to_mode(cfg), dev, LayerPass::forward, false,
                                             cached);
    const size_t bwd = layer_workspace_bytes(c, S, to_mode(cfg), dev, LayerPass::backward, false,
                                             cached);
    *bytes = fwd > bwd ? fwd : bwd;  // layer_workspace_bytes(c, S, mode, dev) without a cache
  });
}

int moeblaze_layer_pass_workspace_bytes(const moeblaze_layer_cfg* cfg, int64_t S, int32_t device,
                                        int32_t pass, uint64_t* bytes) {
  return guarded([&] {
    const Device dev = to_device(device);
    const LayerConfig c = to_layer(cfg);
    require_ptr(bytes, "bytes");
    MOEBLAZE_REQUIRE(pass == 0 || pass == 1, "pass (", pass, ") must be 0 (forward) or 1 (backward)");
    ThreadCountScope threads(cfg->num_threads);
    *bytes = layer_workspace_bytes(c, S, to_mode(cfg), dev,
                                   pass == 0 ? LayerPass::forward : LayerPass::backward,
                                   cfg->mode == 2, fp8_weights_of(cfg) != nullptr);
  });
}

int moeblaze_layer_forward(const moeblaze_layer_cfg* cfg, const moeblaze_plan* plan,
                           int32_t device, void* stream, const void* x, const void* w1,
                           const void* w2, void* out, void* h, void* workspace,
                           uint64_t workspace_bytes) {
  return moeblaze_layer_forward_biased(cfg, plan, device, stream, x, w1, w2, nullptr, nullptr,
                                       out, h, workspace, workspace_bytes);
}

int moeblaze_layer_forward_biased(const moeblaze_layer_cfg* cfg, const moeblaze_plan* plan,
                                  int32_t device, void* stream, const void* x, const void* w1,
                                  const void* w2, const void* b1, const void* b2, void* out,
                                  void* h, void* workspace, uint64_t workspace_bytes) {
  return guarded([&] {
    const Device dev = to_device(device);
    const LayerConfig c = to_layer(cfg);
    const RoutingPlan p = borrow_plan(plan, dev);
    LayerOptions o = to_options(cfg, stream, workspace, workspace_bytes);
    if (o.mode == LayerMode::keep_h) {
      MOEBLAZE_REQUIRE(h != nullptr || p.S() * c.w1_rows() == 0,
                       "h is NULL: keep_h mode keeps H (S, w1_rows) in caller storage");
      o.h_storage = h;
    } else {
      MOEBLAZE_REQUIRE(h == nullptr, "h is given, but recompute mode keeps no H");
    }
    const auto v = [&](const void* ptr, std::initializer_list<int64_t> dims) {
      return TensorView(const_cast<void*>(ptr), c.dtype, dev, dims);
    };
    SavedForBackward saved;
    layer_forward(c, p, v(x, {c.T, c.d}), v(w1, {c.E, c.w1_rows(), c.d}), v(w2, {c.E, c.d, c.n}),
                  biases_of(c, dev, b1, b2), v(out, {c.T, c.d}), saved, o);
  });
}

int moeblaze_layer_backward(const moeblaze_layer_cfg* cfg, const moeblaze_plan* plan,
                            int32_t device, void* stream, const void* x, const void* w1,
                            const void* w2, const void* d_out, const void* h, void* dx,
                            void* dw1, void* dw2, float* d_pair_weights, void* workspace,
                            uint64_t workspace_bytes) {
  return moeblaze_layer_backward_biased(cfg, plan, device, stream, x, w1, w2, nullptr, nullptr,
                                        d_out, h, dx, dw1, dw2, d_pair_weights, nullptr, nullptr,
                                        workspace, workspace_bytes);
}

int moeblaze_layer_backward_biased(const moeblaze_layer_cfg* cfg, const moeblaze_plan* plan,
                                   int32_t device, void* stream, const void* x, const void* w1,
                                   const void* w2, const void* b1, const void* b2,
                                   const void* d_out, const void* h, void* dx, void* dw1,
                                   void* dw2, float* d_pair_weights, void* db1, void* db2,
                                   void* workspace, uint64_t workspace_bytes) {
  return guarded([&] {
    const Device dev = to_device(device);
    const LayerConfig c = to_layer(cfg);
    const RoutingPlan p = borrow_plan(plan, dev, /*token_experts_optional=*/true);
    const LayerOptions o = to_options(cfg, stream, workspace, workspace_bytes);
    const size_t h_bytes = c.kept_h_bytes(p.S());
    if (o.mode == LayerMode::keep_h)
      MOEBLAZE_REQUIRE(h != nullptr || h_bytes == 0, "h is NULL: keep_h backward reads H");
    else
      MOEBLAZE_REQUIRE(h == nullptr, "h is given, but recompute mode keeps no H");
    const SavedForBackward saved = SavedForBackward::borrow(
        o.mode, p.S(), dev, const_cast<void*>(h), o.mode == LayerMode::keep_h ? h_bytes : 0);
    const auto v = [&](const void* ptr, std::initializer_list<int64_t> dims) {
      return TensorView(const_cast<void*>(ptr), c.dtype, dev, dims);
    };
    LayerGrads g{v(dx, {c.T, c.d}), v(dw1, {c.E, c.w1_rows(), c.d}), v(dw2, {c.E, c.d, c.n}),
                 TensorView(d_pair_weights, DType::f32, dev, {p.S()})};
    const LayerBiases grads_of_biases = biases_of(c, dev, db1, db2);
    g.db1 = grads_of_biases.b1;
    g.db2 = grads_of_biases.b2;
    layer_backward(c, p, v(x, {c.T, c.d}), v(w1, {c.E, c.w1_rows(), c.d}),
                   v(w2, {c.E, c.d, c.n}), biases_of(c, dev, b1, b2), v(d_out, {c.T, c.d}), saved,
                   g, o);
  });
}

}  // extern "C"
