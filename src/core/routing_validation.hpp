// Routing checks shared by the public entry points (see validate_routing in routing.hpp).
#pragma once

#include "moeblaze/routing.hpp"

namespace moeblaze {

// Scalars and pointers only (T, E, P ranges, int32 limits, non-null arrays): checkable for a
// routing on any device without reading its arrays. validate_routing calls it first.
void validate_routing_header(const RoutingView& r);

}  // namespace moeblaze
