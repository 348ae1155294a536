// Public layer API: validates every argument before any output is touched, then dispatches to
// the backend of the plan's device (CPU: keep_h / recompute → cpu::layer_*, materialized →
// cpu::materialized_*).
#include <cstdint>

#include "core/aliasing.hpp"
#include "core/checked_math.hpp"
#include "core/layer_checks.hpp"
#include "core/parallel.hpp"
#include "core/plan_validation.hpp"
#include "core/saved_access.hpp"
#include "cpu/cpu_backend.hpp"
#include "cpu/layer_common.hpp"
#include "moeblaze/error.hpp"
#include "moeblaze/layer.hpp"

#ifdef MOEBLAZE_WITH_CUDA
#include "cuda/cuda_backend.hpp"
#endif

namespace moeblaze {

using Saved = moeblaze::detail::SavedAccess;

void require_layer_mode(LayerMode mode, const char* name) {
  MOEBLAZE_REQUIRE(mode == LayerMode::keep_h || mode == LayerMode::recompute ||
                       mode == LayerMode::materialized,
                   name, " (", int(mode), ") is not a LayerMode: must be 0 (keep_h), 1 (recompute) "
                   "or 2 (materialized)");
}

namespace {

// A tensor argument: shape, dtype, device (the plan's) and data, in that order, so the first
// broken rule is the one reported.
void check_tensor(const TensorView& t, const char* name, std::initializer_list<int64_t> dims,
                  DType dtype, Device device) {
  require_shape(t, name, dims);
  require_dtype(t, name, dtype);
  require_device(t, name, device);
  require_data(t, name);
}

void check_common(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                  const TensorView& w1, const TensorView& w2, const LayerOptions& opts,
                  bool token_experts_optional = false) {
  cfg.validate();
  MOEBLAZE_REQUIRE(plan.T() == cfg.T, "plan has T = ", plan.T(), " tokens, expected cfg.T = ",
                   cfg.T);
  MOEBLAZE_REQUIRE(plan.E() == cfg.E, "plan has E = ", plan.E(), " experts, expected cfg.E = ",
                   cfg.E);
  require_valid_plan(plan, token_experts_optional);
  check_slot_extents(cfg, plan.S());
  require_layer_mode(opts.mode, "opts.mode");
  require_thread_count(opts.num_threads, "opts.num_threads");
  const Device dev = plan.device();
  if (is_fp8(cfg.compute)) {
    MOEBLAZE_UNSUPPORTED_IF(opts.mode == LayerMode::materialized,
                            "compute ", compute_name(cfg.compute), ": the materialized baseline "
                            "computes in the storage dtype only (use keep_h or recompute)");
  }
  // A cache of FP8 codes beside storage compute is a caller's slip, not a no-op to hide.
  MOEBLAZE_REQUIRE(opts.fp8_weights == nullptr || is_fp8(cfg.compute),
                   "opts.fp8_weights is given, but cfg.compute is ", compute_name(cfg.compute),
                   ": the cache holds FP8 codes (compute fp8 only)");
#ifndef MOEBLAZE_WITH_CUDA
  for (const auto& [t, name] : {std::pair<const TensorView*, const char*>{&x, "x"}, {&w1, "w1"},
                                {&w2, "w2"}})
    MOEBLAZE_UNSUPPORTED_IF(t->device == Device::cuda, name,
                            " is on cuda, but moeblaze was built without CUDA");
#endif
  check_tensor(x, "x", {cfg.T, cfg.d}, cfg.dtype, dev);
  check_tensor(w1, "w1", {cfg.E, cfg.w1_rows(), cfg.d}, cfg.dtype, dev);
  check_tensor(w2, "w2", {cfg.E, cfg.d, cfg.n}, cfg.dtype, dev);
}

void check_output(const TensorView& t, const char* name, std::initializer_list<int64_t> dims,
                  DType dtype, Device dev) {
#ifndef MOEBLAZE_WITH_CUDA
  MOEBLAZE_UNSUPPORTED_IF(t.device == Device::cuda, name,
                          " is on cuda, but moeblaze was built without CUDA");
#endif
  check_tensor(t, name, dims, dtype, dev);
}

// Expert biases: each optional (rank 0 = none), else (E, w1_rows) / (E, d) cfg.dtype on `dev`.
// Biases run in keep_h and recompute (CPU and CUDA); the materialized baseline rejects them here,
// before any output is touched.
bool has_bias(const LayerBiases& b) { return b.b1.rank != 0 || b.b2.rank != 0; }

void check_biases(const LayerConfig& cfg, const LayerBiases& b, LayerMode mode, Device dev) {
  // check_output's checks are an input's too (shape, dtype, device, data, a CUDA build for cuda).
  if (b.b1.rank != 0) check_output(b.b1, "b1", {cfg.E, cfg.w1_rows()}, cfg.dtype, dev);
  if (b.b2.rank != 0) check_output(b.b2, "b2", {cfg.E, cfg.d}, cfg.dtype, dev);
  if (!has_bias(b)) return;
  MOEBLAZE_UNSUPPORTED_IF(mode == LayerMode::materialized,
                          b.b1.rank != 0 ? "b1" : "b2",
                          ": the materialized baseline takes no expert biases (use keep_h or "
                          "recompute)");
}

// db1 / db2: given exactly when b1 / b2 is, shaped like it.
void check_bias_grads(const LayerConfig& cfg, const LayerBiases& b, const LayerGrads& g,
                      Device dev) {
  MOEBLAZE_REQUIRE((g.db1.rank != 0) == (b.b1.rank != 0),
                   b.b1.rank != 0 ? "grads.db1 is missing: b1 is given, so its gradient (E, "
                                    "w1_rows) is required"
                                  : "grads.db1 is given without b1: a bias gradient needs its bias");
  MOEBLAZE_REQUIRE((g.db2.rank != 0) == (b.b2.rank != 0),
                   b.b2.rank != 0 ? "grads.db2 is missing: b2 is given, so its gradient (E, d) "
                                    "is required"
                                  : "grads.db2 is given without b2: a bias gradient needs its bias");
  if (g.db1.rank != 0) check_output(g.db1, "db1", {cfg.E, cfg.w1_rows()}, cfg.dtype, dev);
  if (g.db2.rank != 0) check_output(g.db2, "db2", {cfg.E, cfg.d}, cfg.dtype, dev);
}

// Caller-provided memory (LayerOptions::workspace / h_storage). Called where the call's thread
// count is in force (the CPU workspace holds per-thread scratch).
void check_caller_memory(const LayerConfig& cfg, const RoutingPlan& plan, const LayerOptions& opts,
                         bool forward) {
  if (opts.workspace == nullptr && opts.workspace_bytes == 0 && opts.h_storage == nullptr) return;
  MOEBLAZE_REQUIRE(opts.mode != LayerMode::materialized,
                   "opts.workspace / opts.h_storage: the materialized baseline allocates its own "
                   "memory (caller memory is for keep_h and recompute)");
  if (opts.workspace != nullptr) {
    const size_t need =
        layer_workspace_bytes(cfg, plan.S(), opts.mode, plan.device(),
                              forward ? LayerPass::forward : LayerPass::backward, opts.dh_over_h,
                              opts.fp8_weights != nullptr);
    MOEBLAZE_REQUIRE(opts.workspace_bytes >= need, "opts.workspace_bytes (", opts.workspace_bytes,
                     ") is less than layer_workspace_bytes (", need, ") for S = ", plan.S());
    MOEBLAZE_REQUIRE(reinterpret_cast<uintptr_t>(opts.workspace) % 64 == 0,
                     "opts.workspace must be 64-byte aligned");
  } else {
    MOEBLAZE_REQUIRE(opts.workspace_bytes == 0, "opts.workspace_bytes (", opts.workspace_bytes,
                     ") is given without opts.workspace");
  }
  if (opts.h_storage != nullptr) {
    MOEBLAZE_REQUIRE(forward, "opts.h_storage is for layer_forward only (backward reads H from "
                              "saved)");
    MOEBLAZE_REQUIRE(opts.mode == LayerMode::keep_h, "opts.h_storage is given, but mode ",
                     layer_mode_name(opts.mode), " keeps no H");
    MOEBLAZE_REQUIRE(reinterpret_cast<uintptr_t>(opts.h_storage) % 16 == 0,
                     "opts.h_storage must be 16-byte aligned");
  }
}

// What a call reads besides its tensor arguments: the plan's six arrays (a borrowed plan lives
// in caller memory), appended to `inputs`.
std::vector<ByteRange> with_plan(std::vector<ByteRange> inputs, const RoutingPlan& plan) {
  const RoutingPlanView v = plan.view();
  const size_t e1 = sizeof(int32_t) * size_t(v.E + 1), t1 = sizeof(int32_t) * size_t(v.T + 1),
               s = sizeof(int32_t) * size_t(v.S);
  inputs.insert(inputs.end(), {{v.expert_token_offsets, e1, "plan.expert_token_offsets"},
                               {v.expert_token_indices, s, "plan.expert_token_indices"},
                               {v.slot_weights, s, "plan.slot_weights"},
                               {v.token_pair_offsets, t1, "plan.token_pair_offsets"},
                               {v.token_expert_indices, v.token_expert_indices ? s : 0,
                                "plan.token_expert_indices"},
                               {v.token_index_map, s, "plan.token_index_map"}});
  return inputs;
}

ByteRange workspace_range(const LayerOptions& opts) {
  return {opts.workspace, opts.workspace ? opts.workspace_bytes : 0, "opts.workspace"};
}

#ifdef MOEBLAZE_WITH_CUDA
// The opt-in device check of a caller-filled cuda plan (LayerOptions::check_plan), last of the
// checks because it is the one that synchronises.
void check_cuda_plan(const RoutingPlan& plan, const LayerOptions& opts) {
  if (opts.check_plan && !plan.library_built())
    cuda::validate_plan(plan.view(), static_cast<cudaStream_t>(opts.stream));
}
#endif

}  // namespace

void layer_forward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                   const TensorView& w1, const TensorView& w2, const TensorView& out,
                   SavedForBackward& saved, const LayerOptions& opts) {
  layer_forward(cfg, plan, x, w1, w2, LayerBiases{}, out, saved, opts);
}

void layer_forward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                   const TensorView& w1, const TensorView& w2, const LayerBiases& biases,
                   const TensorView& out, SavedForBackward& saved, const LayerOptions& opts) {
  check_common(cfg, plan, x, w1, w2, opts);
  check_output(out, "out", {cfg.T, cfg.d}, cfg.dtype, plan.device());
  check_biases(cfg, biases, opts.mode, plan.device());
  const size_t h_bytes = opts.h_storage ? cfg.kept_h_bytes(plan.S()) : 0;
  require_disjoint({byte_range(out, "out"), {opts.h_storage, h_bytes, "opts.h_storage"},
                    workspace_range(opts)},
                   with_plan({byte_range(x, "x"), byte_range(w1, "w1"), byte_range(w2, "w2"),
                              byte_range(biases.b1, "b1"), byte_range(biases.b2, "b2")},
                             plan));

  if (plan.device() == Device::cuda) {
#ifdef MOEBLAZE_WITH_CUDA
    check_caller_memory(cfg, plan, opts, true);
    check_cuda_plan(plan, opts);
    if (opts.mode == LayerMode::materialized)
      cuda::materialized_forward(cfg, plan, x, w1, w2, out, saved, opts);
    else
      cuda::layer_forward(cfg, plan, x, w1, w2, biases, out, saved, opts);
    return;
#else
    MOEBLAZE_UNSUPPORTED_IF(true, "plan is on cuda, but moeblaze was built without CUDA");
#endif
  }
  ThreadCountScope threads(opts.num_threads);
  check_caller_memory(cfg, plan, opts, true);
  if (opts.mode == LayerMode::materialized)
    cpu::materialized_forward(cfg, plan, x, w1, w2, out, saved, opts);
  else
    cpu::layer_forward(cfg, plan, x, w1, w2, biases, out, saved, opts);
}

void layer_backward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                    const TensorView& w1, const TensorView& w2, const TensorView& d_out,
                    const SavedForBackward& saved, const LayerGrads& grads,
                    const LayerOptions& opts) {
  layer_backward(cfg, plan, x, w1, w2, LayerBiases{}, d_out, saved, grads, opts);
}

void layer_backward(const LayerConfig& cfg, const RoutingPlan& plan, const TensorView& x,
                    const TensorView& w1, const TensorView& w2, const LayerBiases& biases,
                    const TensorView& d_out, const SavedForBackward& saved,
                    const LayerGrads& grads, const LayerOptions& opts) {
  // A CUDA backward in keep_h / recompute never reads token_expert_indices, so a caller may drop
  // it after forward (S int32 fewer kept bytes); the materialized baseline and the device plan
  // check read it.
  check_common(cfg, plan, x, w1, w2, opts, /*token_experts_optional=*/true);
  if (plan.S() > 0 && plan.view().token_expert_indices == nullptr) {
    MOEBLAZE_REQUIRE(opts.mode != LayerMode::materialized,
                     "plan.token_expert_indices has no data (null pointer): the materialized "
                     "baseline's backward reads it (keep_h and recompute do not)");
    MOEBLAZE_REQUIRE(!opts.check_plan,
                     "plan.token_expert_indices has no data (null pointer): opts.check_plan "
                     "validates every plan array");
  }
  const Device dev = plan.device();
  check_output(d_out, "d_out", {cfg.T, cfg.d}, cfg.dtype, dev);
  check_output(grads.dx, "dx", {cfg.T, cfg.d}, cfg.dtype, dev);
  check_output(grads.dw1, "dw1", {cfg.E, cfg.w1_rows(), cfg.d}, cfg.dtype, dev);
  check_output(grads.dw2, "dw2", {cfg.E, cfg.d, cfg.n}, cfg.dtype, dev);
  check_output(grads.d_pair_weights, "d_pair_weights", {plan.S()}, DType::f32, dev);
  check_biases(cfg, biases, opts.mode, dev);
  check_bias_grads(cfg, biases, grads, dev);
  MOEBLAZE_REQUIRE(saved.valid(), "saved is not valid: run layer_forward first");
  require_disjoint({byte_range(grads.dx, "dx"), byte_range(grads.dw1, "dw1"),
                    byte_range(grads.dw2, "dw2"),
                    byte_range(grads.d_pair_weights, "d_pair_weights"),
                    byte_range(grads.db1, "db1"), byte_range(grads.db2, "db2"),
                    workspace_range(opts)},
                   with_plan({byte_range(x, "x"), byte_range(w1, "w1"), byte_range(w2, "w2"),
                              byte_range(biases.b1, "b1"), byte_range(biases.b2, "b2"),
                              byte_range(d_out, "d_out"),
                              {Saved::h(saved).data(), Saved::h(saved).bytes(), "saved H"}},
                             plan));
  MOEBLAZE_REQUIRE(saved.mode() == opts.mode, "saved comes from mode ",
                   layer_mode_name(saved.mode()), ", but opts.mode is ",
                   layer_mode_name(opts.mode));
  MOEBLAZE_REQUIRE(Saved::S(saved) == plan.S(), "saved holds S = ", Saved::S(saved),
                   " assignments, but plan has S = ", plan.S());
  if (opts.mode == LayerMode::keep_h) {
    const size_t want = cfg.kept_h_bytes(plan.S());
    const Buffer& h = Saved::h(saved);
    MOEBLAZE_REQUIRE(h.bytes() == want && h.device() == dev, "saved.h holds ", h.bytes(),
                     " bytes on ", device_name(h.device()), ", expected cfg.kept_h_bytes(S) = ",
                     want, " (compute ", compute_name(cfg.compute), ") on ", device_name(dev));
  }

  if (dev == Device::cuda) {
#ifdef MOEBLAZE_WITH_CUDA
    check_caller_memory(cfg, plan, opts, false);
    check_cuda_plan(plan, opts);
    if (opts.mode == LayerMode::materialized)
      cuda::materialized_backward(cfg, plan, x, w1, w2, d_out, saved, grads, opts);
    else
      cuda::layer_backward(cfg, plan, x, w1, w2, biases, d_out, saved, grads, opts);
    return;
#else
    MOEBLAZE_UNSUPPORTED_IF(true, "plan is on cuda, but moeblaze was built without CUDA");
#endif
  }
  ThreadCountScope threads(opts.num_threads);
  check_caller_memory(cfg, plan, opts, false);
  if (opts.mode == LayerMode::materialized)
    cpu::materialized_backward(cfg, plan, x, w1, w2, d_out, saved, grads, opts);
  else
    cpu::layer_backward(cfg, plan, x, w1, w2, biases, d_out, saved, grads, opts);
}

size_t layer_workspace_bytes(const LayerConfig& cfg, int64_t S, LayerMode mode, Device device) {
  const size_t fwd = layer_workspace_bytes(cfg, S, mode, device, LayerPass::forward);
  const size_t bwd = layer_workspace_bytes(cfg, S, mode, device, LayerPass::backward);
  return fwd > bwd ? fwd : bwd;
}

size_t layer_workspace_bytes(const LayerConfig& cfg, int64_t S, LayerMode mode, Device device,
                             LayerPass pass, bool dh_over_h, bool fp8_weights_cached) {
  cfg.validate();
  check_slot_extents(cfg, S);
  require_layer_mode(mode, "mode");
  MOEBLAZE_REQUIRE(device == Device::cpu || device == Device::cuda, "device (", int(device),
                   ") must be cpu or cuda");
  if (device == Device::cuda) {
#ifdef MOEBLAZE_WITH_CUDA
    return cuda::layer_workspace_bytes(cfg, S, mode, pass == LayerPass::forward, dh_over_h,
                                       fp8_weights_cached);
#else
    MOEBLAZE_UNSUPPORTED_IF(true, "device cuda, but moeblaze was built without CUDA");
#endif
  }
  MOEBLAZE_UNSUPPORTED_IF(mode == LayerMode::materialized,
                          "layer_workspace_bytes: the CPU materialized baseline allocates several "
                          "buffers, not one workspace; measure it with PeakScope");
  return cpu::layer::workspace_bytes(cfg, S, mode);
}

}  // namespace moeblaze
