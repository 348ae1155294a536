// What the fast path's translation units share (eager_experts.cpp: the module and the experts;
// eager_router.cpp: MoE's router): the C ABI's functions, resolved by ctypes in Python (_ext.py
// reads capi_functions and passes their addresses to init), and the helpers around the calls.
#pragma once

#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>

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
// from a CSR routing of S pairs, -3 the two-call token rounding of (T, E)) on CUDA, and (-4) the
// bytes of an fp8 call's kept H (its e4m3 codes and scales): functions of the sizes alone, asked
// once per key. Throws CallFailed.
uint64_t pass_workspace_bytes(const moeblaze_layer_cfg& c, int64_t S, int32_t pass);

// A backward's gradients `g` as Python's @once_differentiable returns them: unchanged, unless
// grad mode is on (create_graph=True) and one of `grads_in` requires grad; then they carry a
// node that raises only if something differentiates through them.
torch::autograd::variable_list once_differentiable(torch::autograd::variable_list g,
                                                   const torch::autograd::variable_list& grads_in);

// Registers the router's entries (eager_router.cpp) on the module.
void register_router(pybind11::module_& m);

}  // namespace moeblaze_eager
