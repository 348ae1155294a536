// Host side of the GPU routing entry points: builder dispatch, the checked (synchronising) API
// path, and the error report for the device-side bad-input flags.
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "cpu/cpu_backend.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/routing/plan_build.hpp"
#include "cuda/routing/router_kernels.hpp"
#include "moeblaze/error.hpp"
#include "moeblaze/memory.hpp"

namespace moeblaze::cuda {

size_t plan_build_workspace_bytes(int64_t T, int64_t E, int64_t P, PlanBuilder builder,
                                  const PlanBuildOptions& opts) {
  return builder == PlanBuilder::sort ? sort_workspace_bytes(T, E, P)
                                      : atomic_free_workspace_bytes(T, E, P, opts);
}

void build_plan_async(const RoutingView& routing, PlanBuilder builder, RoutingPlan& plan,
                      void* workspace, size_t workspace_bytes, int32_t* d_flags,
                      cudaStream_t stream, const PlanBuildOptions& opts) {
  MOEBLAZE_REQUIRE(routing.device == Device::cuda, "routing is on ", device_name(routing.device),
                   ", expected cuda");
  MOEBLAZE_REQUIRE(plan.device() == Device::cuda && plan.T() == routing.T &&
                       plan.E() == routing.E && plan.S() == routing.P,
                   "plan (T=", plan.T(), ", E=", plan.E(), ", S=", plan.S(), ", ",
                   device_name(plan.device()), ") does not match the routing (T=", routing.T,
                   ", E=", routing.E, ", P=", routing.P, ", cuda)");
  if (builder == PlanBuilder::sort)
    build_plan_sort_async(routing, plan, workspace, workspace_bytes, d_flags, stream);
  else
    build_plan_atomic_free_async(routing, plan, workspace, workspace_bytes, d_flags, stream,
                                 opts);
}

void throw_if_routing_flags(const int32_t* h_flags, const RoutingView& routing) {
  bool raised = false;
  for (int i = 0; i < kRoutingFlagCount; ++i) raised = raised || h_flags[i] != 0;
  if (!raised) return;
  // The error path only: copy the routing to the host and let the CPU validator name the first
  // offending entry, so a GPU caller gets the same message as a CPU one.
  std::vector<int32_t> offsets(static_cast<size_t>(routing.T + 1));
  std::vector<int32_t> experts(static_cast<size_t>(routing.P));
  std::vector<float> weights(static_cast<size_t>(routing.P));
  MOEBLAZE_CUDA_CHECK(cudaMemcpy(offsets.data(), routing.pair_offsets,
                                 offsets.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
  if (routing.P > 0) {
    MOEBLAZE_CUDA_CHECK(cudaMemcpy(experts.data(), routing.pair_experts,
                                   experts.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
    MOEBLAZE_CUDA_CHECK(cudaMemcpy(weights.data(), routing.pair_weights,
                                   weights.size() * sizeof(float), cudaMemcpyDeviceToHost));
  }
  RoutingView host = routing;
  host.device = Device::cpu;
  host.pair_offsets = offsets.data();
  host.pair_experts = experts.data();
  host.pair_weights = weights.data();
  validate_routing(host);  // throws InvalidArgument naming the entry
  throw DeviceError(detail::concat(
      "device-side routing check raised flags [out_of_range=", h_flags[kFlagExpertOutOfRange],
      ", repeated=", h_flags[kFlagExpertRepeated], ", non_finite=", h_flags[kFlagNonFinite],
      ", bad_offsets=", h_flags[kFlagBadOffsets], "] but the host validator found nothing"));
}

namespace {

bool any_flag(const int32_t* h_flags) {
  for (int i = 0; i < kRoutingFlagCount; ++i)
    if (h_flags[i] != 0) return true;
  return false;
}

// A host copy of a device tensor or routing, for the error path only.
struct HostTensor {
  std::vector<unsigned char> bytes;
  TensorView view;
};
HostTensor to_host(const TensorView& t) {
  HostTensor h;
  h.view = t;
  h.view.device = Device::cpu;
  if (t.data == nullptr || t.numel() == 0) return h;  // an absent argument stays absent
  h.bytes.resize(t.bytes());
  if (!h.bytes.empty())
    MOEBLAZE_CUDA_CHECK(cudaMemcpy(h.bytes.data(), t.data, t.bytes(), cudaMemcpyDeviceToHost));
  h.view.data = h.bytes.data();
  return h;
}
struct HostRouting {
  std::vector<int32_t> offsets, experts;
  std::vector<float> weights;
  RoutingView view;
};
HostRouting to_host(const RoutingView& r) {
  HostRouting h;
  h.offsets.resize(size_t(r.T + 1));
  h.experts.resize(size_t(r.P));
  h.weights.resize(size_t(r.P));
  MOEBLAZE_CUDA_CHECK(cudaMemcpy(h.offsets.data(), r.pair_offsets, h.offsets.size() * 4,
                                 cudaMemcpyDeviceToHost));
  if (r.P > 0) {
    MOEBLAZE_CUDA_CHECK(cudaMemcpy(h.experts.data(), r.pair_experts, h.experts.size() * 4,
                                   cudaMemcpyDeviceToHost));
    if (r.pair_weights != nullptr)
      MOEBLAZE_CUDA_CHECK(cudaMemcpy(h.weights.data(), r.pair_weights, h.weights.size() * 4,
                                     cudaMemcpyDeviceToHost));
  }
  h.view = r;
  h.view.device = Device::cpu;
  h.view.pair_offsets = h.offsets.data();
  h.view.pair_experts = h.experts.data();
  h.view.pair_weights = h.weights.data();
  return h;
}

int32_t* clear_flags(Buffer& flags, cudaStream_t stream) {
  flags = Buffer(Device::cuda, sizeof(int32_t) * kRoutingFlagCount);
  MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(flags.data(), 0, flags.bytes(), stream));
  return flags.as<int32_t>();
}

void read_flags(const Buffer& flags, int32_t* h_flags, cudaStream_t stream) {
  MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(h_flags, flags.data(), sizeof(int32_t) * kRoutingFlagCount,
                                      cudaMemcpyDeviceToHost, stream));
  MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(stream));
}

[[noreturn]] void flags_without_message(const char* fn, const int32_t* h) {
  throw DeviceError(detail::concat(
      fn, ": device-side check raised flags [out_of_range=", h[kFlagExpertOutOfRange],
      ", repeated=", h[kFlagExpertRepeated], ", non_finite=", h[kFlagNonFinite],
      ", bad_offsets=", h[kFlagBadOffsets], "] but the CPU replay found nothing"));
}

// Validates a device routing before a kernel indexes through it (one host sync).
void check_routing_on_device(const RoutingView& r, cudaStream_t stream) {
  Buffer flags;
  int32_t* d_flags = clear_flags(flags, stream);
  validate_routing_async(r, d_flags, stream);
  int32_t h[kRoutingFlagCount];
  read_flags(flags, h, stream);
  throw_if_routing_flags(h, r);
}

}  // namespace

size_t route_workspace_bytes(const RouterConfig& cfg, int64_t T, int64_t E) {
  (void)cfg;
  return router_loss_workspace_bytes(T, E, T * cfg.top_k);
}

void route_async(const RouterConfig& cfg, const TensorView& logits, const TensorView& bias,
                 Routing& out, void* workspace, double* d_losses, int32_t* d_flags,
                 cudaStream_t stream) {
  const float* b = cfg.kind == RouterKind::sigmoid_bias ? bias.as<const float>() : nullptr;
  router_topk_async(cfg, logits, b, out, d_flags, stream);
  router_losses_async(cfg, logits, out.pair_experts(), out.P(), workspace, d_losses, stream);
}

RouterLosses route(const RouterConfig& cfg, const TensorView& logits, const TensorView& bias,
                   Routing& out) {
  const cudaStream_t stream = nullptr;
  const int64_t T = logits.dim(0), E = logits.dim(1);
  Routing fresh(Device::cuda, T, E, T * cfg.top_k);
  Buffer ws(Device::cuda, route_workspace_bytes(cfg, T, E));
  Buffer losses(Device::cuda, 2 * sizeof(double));
  Buffer flags;
  int32_t* d_flags = clear_flags(flags, stream);
  route_async(cfg, logits, bias, fresh, ws.data(), losses.as<double>(), d_flags, stream);
  double h_losses[2] = {0, 0};
  MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(h_losses, losses.data(), sizeof(h_losses),
                                      cudaMemcpyDeviceToHost, stream));
  int32_t h[kRoutingFlagCount];
  read_flags(flags, h, stream);
  if (any_flag(h)) {
    // Replay on a host copy: the CPU router throws the message naming the first bad value.
    HostTensor hl = to_host(logits), hb = to_host(bias);
    Routing scratch;
    cpu::route(cfg, hl.view, hb.view, scratch);
    flags_without_message("route", h);
  }
  out = std::move(fresh);
  RouterLosses r;
  r.aux_loss = h_losses[0];
  r.z_loss = h_losses[1];
  return r;
}

void router_backward(const RouterConfig& cfg, const TensorView& logits, const TensorView& bias,
                     const RoutingView& routing, const TensorView& d_pair_weights,
                     const TensorView& d_logits) {
  const cudaStream_t stream = nullptr;
  const int64_t T = logits.dim(0), E = logits.dim(1);
  check_routing_on_device(routing, stream);
  const bool want_aux = cfg.aux_loss_coef > 0.0f;
  const cpu::RouterLossScales scales = cpu::router_loss_scales(cfg, T, E);
  Buffer counts_ws, counts, f;
  if (want_aux) {
    counts_ws = Buffer(Device::cuda, expert_counts_workspace_bytes(routing.P, E));
    counts = Buffer(Device::cuda, sizeof(int32_t) * size_t(E));
    f = Buffer(Device::cuda, sizeof(float) * size_t(E));
    expert_counts_async(routing.pair_experts, routing.P, int(E), counts_ws.as<int32_t>(),
                        counts.as<int32_t>(), f.as<float>(), stream);
  }
  // Written into a scratch first: d_logits is untouched unless every value checks out.
  Buffer scratch(Device::cuda, sizeof(float) * size_t(T * E));
  Buffer flags;
  int32_t* d_flags = clear_flags(flags, stream);
  const float* b = cfg.kind == RouterKind::sigmoid_bias ? bias.as<const float>() : nullptr;
  router_backward_async(cfg, logits, b, routing, d_pair_weights.as<const float>(),
                        scratch.as<float>(), want_aux ? f.as<float>() : nullptr, scales.aux,
                        scales.z, d_flags, stream);
  int32_t h[kRoutingFlagCount];
  read_flags(flags, h, stream);
  if (any_flag(h)) {
    HostTensor hl = to_host(logits), hb = to_host(bias), hg = to_host(d_pair_weights);
    HostRouting hr = to_host(routing);
    std::vector<float> hd(size_t(T * E));
    cpu::router_backward(cfg, hl.view, hb.view, hr.view, hg.view,
                         host_view(hd.data(), {T, E}));
    flags_without_message("router_backward", h);
  }
  if (T * E > 0)
    MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(d_logits.data, scratch.data(), scratch.bytes(),
                                        cudaMemcpyDeviceToDevice, stream));
  MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void throw_if_token_round_flags(const int32_t* h_flags, const RouterConfig& router,
                                const TokenRoundingConfig& cfg, const TensorView& logits,
                                const TensorView& bias, const RoutingView& topk) {
  throw_if_routing_flags(h_flags, topk);
  const int32_t* logit_flags = h_flags + kRoutingFlagCount;
  if (!any_flag(logit_flags)) return;
  HostTensor hl = to_host(logits), hb = to_host(bias);
  HostRouting hr = to_host(topk);
  Routing scratch;
  cpu::token_round(router, cfg, hl.view, hb.view, hr.view, scratch);
  flags_without_message("token_round", logit_flags);
}

void token_round(const RouterConfig& router, const TokenRoundingConfig& cfg,
                 const TensorView& logits, const TensorView& bias, const RoutingView& topk,
                 Routing& out) {
  const cudaStream_t stream = nullptr;
  const int64_t T = logits.dim(0), E = logits.dim(1);
  Buffer ws(Device::cuda, token_round_workspace_bytes(T, E));
  const float* b = router.kind == RouterKind::sigmoid_bias ? bias.as<const float>() : nullptr;
  int32_t h[2 * kRoutingFlagCount];
  const int64_t S = token_round_count(router, cfg, logits, b, topk, ws.data(), h, stream);
  throw_if_token_round_flags(h, router, cfg, logits, bias, topk);
  Routing fresh(Device::cuda, T, E, S);
  token_round_fill_async(router, logits, ws.data(), fresh.pair_offsets(), fresh.pair_experts(),
                         fresh.pair_weights(), S, stream);
  MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(stream));
  out = std::move(fresh);
}

void build_routing_plan(const RoutingView& routing, PlanBuilder builder, RoutingPlan& plan) {
  const cudaStream_t stream = nullptr;
  RoutingPlan fresh(Device::cuda, routing.T, routing.E, routing.P);
  const size_t ws_bytes = plan_build_workspace_bytes(routing.T, routing.E, routing.P, builder);
  Buffer workspace(Device::cuda, ws_bytes);
  Buffer flags(Device::cuda, sizeof(int32_t) * kRoutingFlagCount);
  MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(flags.data(), 0, flags.bytes(), stream));
  build_plan_async(routing, builder, fresh, workspace.data(), ws_bytes, flags.as<int32_t>(),
                   stream);
  int32_t h_flags[kRoutingFlagCount] = {};
  MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(h_flags, flags.data(), sizeof(h_flags),
                                      cudaMemcpyDeviceToHost, stream));
  MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(stream));
  throw_if_routing_flags(h_flags, routing);
  plan = std::move(fresh);
}

}  // namespace moeblaze::cuda
