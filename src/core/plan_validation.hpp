// The one check of a routing plan handed to an entry point (validate_routing_plan in
// routing_plan.hpp holds the rules).
#pragma once

#include "moeblaze/routing_plan.hpp"

namespace moeblaze {

// Sizes and pointers only (T, E, S ranges, int32 limits, non-null arrays): checkable for a plan
// on any device without reading its arrays. validate_routing_plan calls it first.
void validate_routing_plan_header(const RoutingPlanView& p);

// What every entry point taking a RoutingPlan calls: the header always; the contents for a CPU
// plan that is not library_built(). A cuda plan's contents are checked on the device only on
// request (LayerOptions::check_plan, src/cuda/routing/plan_validate.cu).
void require_valid_plan(const RoutingPlan& plan);

}  // namespace moeblaze
