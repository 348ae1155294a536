// Routing checks shared by the public entry points (see validate_routing in routing.hpp).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "moeblaze/routing.hpp"

namespace moeblaze {

// Scalars and pointers only (T, E, P ranges, int32 limits, non-null arrays): checkable for a
// routing on any device without reading its arrays. validate_routing calls it first.
void validate_routing_header(const RoutingView& r);

// P = T*top_k pairs (checked_mul) must fit the int32 indices of a routing.
void require_pairs_fit(int64_t T, int64_t top_k);

// The first entry of experts[0, count) that repeats an earlier one, as {earlier, later} indices
// (the earliest equal entry, and the lowest such later index), or {-1, -1} if all differ.
// O(count) memory whatever the expert range (`scratch` is reused across calls).
struct Repeat {
  int64_t earlier = -1, later = -1;
};
Repeat first_repeat(const int32_t* experts, int64_t count,
                    std::vector<std::pair<int32_t, int32_t>>& scratch);

}  // namespace moeblaze
