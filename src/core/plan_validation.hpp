// The one check of a routing plan handed to an entry point (validate_routing_plan in
// routing_plan.hpp holds the rules).
#pragma once

#include "moeblaze/routing_plan.hpp"

namespace moeblaze {

// Sizes and pointers only (T, E, S ranges, int32 limits, non-null arrays): checkable for a plan
// on any device without reading its arrays. validate_routing_plan calls it first.
// token_experts_optional: a null token_expert_indices passes (a CUDA layer backward in keep_h or
// recompute mode never reads it; layer_backward checks those conditions).
void validate_routing_plan_header(const RoutingPlanView& p, bool token_experts_optional = false);

// What every entry point taking a RoutingPlan calls: the header always; the contents for a CPU
// plan that is not library_built(). A cuda plan's contents are checked on the device only on
// request (LayerOptions::check_plan, src/cuda/routing/plan_validate.cu).
// token_experts_optional: as validate_routing_plan_header's, for a cuda plan only.
void require_valid_plan(const RoutingPlan& plan, bool token_experts_optional = false);

}  // namespace moeblaze
