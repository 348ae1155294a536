// build_routing_plan: validate the routing, (re)allocate the plan on the routing's device, hand
// over to the backend's builder. Nothing in `plan` changes unless the routing is valid.
#include "core/routing_validation.hpp"
#include "cpu/cpu_backend.hpp"
#include "moeblaze/error.hpp"
#include "moeblaze/routing_plan.hpp"
#ifdef MOEBLAZE_WITH_CUDA
#include "cuda/cuda_backend.hpp"
#endif

namespace moeblaze {

void build_routing_plan(const RoutingView& routing, PlanBuilder builder, RoutingPlan& plan) {
  MOEBLAZE_REQUIRE(builder == PlanBuilder::atomic_free || builder == PlanBuilder::sort,
                   "builder (", static_cast<int>(builder), ") is not atomic_free or sort");
  validate_routing_header(routing);  // (the CUDA path checks values on the device)
  if (routing.device == Device::cpu) {
    validate_routing(routing);
    // Reuse the plan's arrays when the sizes match (the common case: one plan per step, same
    // shape every step); otherwise free the old arrays before allocating the new ones, so the
    // two are never held together.
    if (!(plan.device() == Device::cpu && plan.T() == routing.T && plan.E() == routing.E &&
          plan.S() == routing.P)) {
      plan = RoutingPlan();
      plan = RoutingPlan(Device::cpu, routing.T, routing.E, routing.P);
    }
    if (builder == PlanBuilder::atomic_free)
      cpu::build_plan_atomic_free(routing, plan);
    else
      cpu::build_plan_sort(routing, plan);
#ifdef MOEBLAZE_WITH_CUDA
  } else if (routing.device == Device::cuda) {
    // Values are checked on the device (flags read back once); `plan` is untouched on error.
    cuda::build_routing_plan(routing, builder, plan);
#endif
  } else {
    throw Unsupported(detail::concat("build_routing_plan: routing on ",
                                     device_name(routing.device),
                                     " is not supported by this build (CPU routing only)"));
  }
  // Borrowed storage stays writable by its owner after this call, so only an owned plan is
  // stamped as trusted (RoutingPlan::library_built).
  plan.library_built_ = plan.expert_token_offsets_.owned();
}

}  // namespace moeblaze
