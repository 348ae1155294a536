// validate_routing: the one host-side check of a routing, used by build_routing_plan, token
// rounding, router backward and (after a device-side flag) the CUDA path's error message.
// Chunks of tokens are checked in parallel; the first offending entry in token order is
// reported whatever the thread count.
#include "core/routing_validation.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/checked_math.hpp"
#include "core/parallel.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze {

void validate_routing_header(const RoutingView& r) {
  MOEBLAZE_REQUIRE(r.T >= 0, "routing: T (", r.T, ") must be >= 0");
  MOEBLAZE_REQUIRE(r.E >= 1, "routing: E (", r.E, ") must be >= 1");
  MOEBLAZE_REQUIRE(r.P >= 0, "routing: P (", r.P, ") must be >= 0");
  // Token ids, expert ids and slots are int32 in the plan.
  MOEBLAZE_REQUIRE(r.T < kInt32Limit, "routing: T (", r.T,
                   ") exceeds the int32 index range of the routing plan");
  MOEBLAZE_REQUIRE(r.E < kInt32Limit, "routing: E (", r.E,
                   ") exceeds the int32 index range of the routing plan");
  MOEBLAZE_REQUIRE(r.P < kInt32Limit, "routing: P (", r.P,
                   ") exceeds the int32 index range of the routing plan");
  // pair_offsets has T+1 >= 1 entries, so it is never empty.
  MOEBLAZE_REQUIRE(r.pair_offsets != nullptr, "pair_offsets has no data (null pointer)");
  MOEBLAZE_REQUIRE(r.pair_experts != nullptr || r.P == 0,
                   "pair_experts has no data (null pointer)");
  MOEBLAZE_REQUIRE(r.pair_weights != nullptr || r.P == 0,
                   "pair_weights has no data (null pointer)");
}

void require_pairs_fit(int64_t T, int64_t top_k) {
  const int64_t P = checked_mul(T, top_k, "T*top_k");
  MOEBLAZE_REQUIRE(P < kInt32Limit, "T*top_k (", P,
                   ") exceeds the int32 index range of a routing");
}

Repeat first_repeat(const int32_t* experts, int64_t count,
                    std::vector<std::pair<int32_t, int32_t>>& scratch) {
  // Up to this many entries, compare directly (K is small for every router); beyond it, sort
  // (expert, index) so that the cost is O(count log count) and no (E,) array is needed.
  constexpr int64_t kDirectCompare = 32;
  Repeat r;
  if (count <= kDirectCompare) {
    for (int64_t p = 1; p < count && r.later < 0; ++p)
      for (int64_t q = 0; q < p; ++q)
        if (experts[q] == experts[p]) {
          r = {q, p};
          break;
        }
    return r;
  }
  scratch.resize(static_cast<size_t>(count));
  for (int64_t p = 0; p < count; ++p) scratch[p] = {experts[p], static_cast<int32_t>(p)};
  std::sort(scratch.begin(), scratch.end());
  // In each run of one expert the first entry is the earliest; the second is its first repeat.
  for (int64_t i = 1; i < count; ++i)
    if (scratch[i].first == scratch[i - 1].first &&
        (i < 2 || scratch[i - 2].first != scratch[i].first) &&
        (r.later < 0 || scratch[i].second < r.later))
      r = {scratch[i - 1].second, scratch[i].second};
  return r;
}

namespace {

// The first offending pair of tokens [t0, t1), as a message; empty if there is none.
// Assumes pair_offsets was checked.
std::string first_pair_error(const RoutingView& r, int64_t t0, int64_t t1,
                             std::vector<std::pair<int32_t, int32_t>>& scratch) {
  const int32_t* off = r.pair_offsets;
  for (int64_t t = t0; t < t1; ++t) {
    const int32_t p0 = off[t], p1 = off[t + 1];
    const Repeat rep = first_repeat(r.pair_experts + p0, p1 - p0, scratch);
    for (int32_t p = p0; p < p1; ++p) {
      const int32_t e = r.pair_experts[p];
      if (e < 0 || e >= r.E)
        return detail::concat("pair_experts: expert id ", e, " of token ", t,
                              " is out of range [0, ", r.E, ")");
      if (p - p0 == rep.later)
        return detail::concat("pair_experts: expert id ", e, " is repeated in token ", t,
                              " (pairs ", p0 + rep.earlier, " and ", p, ")");
      const float w = r.pair_weights[p];
      if (!std::isfinite(w))
        return detail::concat("pair_weights: weight ", w, " of token ", t, " (pair ", p,
                              ") is not finite");
    }
  }
  return {};
}

}  // namespace

// Values: offsets non-decreasing from 0 to P, expert ids in [0, E) and not repeated within a
// token, weights finite. Reports the first offending entry in token order, whatever the thread
// count. CPU memory only.
void validate_routing(const RoutingView& r) {
  validate_routing_header(r);
  if (r.device != Device::cpu)
    throw Unsupported(detail::concat("validate_routing: the routing is on ", device_name(r.device),
                                     "; only host routings can be read (the CUDA path checks on the device)"));
  const int32_t* off = r.pair_offsets;  // (T+1,) int32
  MOEBLAZE_REQUIRE(off[0] == 0, "pair_offsets[0] (", off[0], ") must be 0");
  for (int64_t t = 0; t < r.T; ++t)
    MOEBLAZE_REQUIRE(off[t + 1] >= off[t], "pair_offsets must be non-decreasing: token ", t,
                     " has pair_offsets[", t + 1, "] (", off[t + 1], ") < pair_offsets[", t,
                     "] (", off[t], ")");
  MOEBLAZE_REQUIRE(off[r.T] == r.P, "pair_offsets[T=", r.T, "] (", off[r.T],
                   ") must equal the number of pairs P (", r.P, ")");

  // Chunks of tokens checked in parallel; each keeps its own first error and the lowest chunk
  // with one wins, so the message does not depend on the thread count.
  constexpr int64_t kChunkTokens = 4096;
  const int64_t chunks = (r.T + kChunkTokens - 1) / kChunkTokens;
  std::vector<std::string> errors(static_cast<size_t>(chunks));
  parallel_for(0, chunks, 1, [&](int64_t c) {
    std::vector<std::pair<int32_t, int32_t>> scratch;  // (pairs of one token,) for many pairs
    errors[c] =
        first_pair_error(r, c * kChunkTokens, std::min(r.T, (c + 1) * kChunkTokens), scratch);
  });
  for (const std::string& e : errors)
    if (!e.empty()) throw InvalidArgument(e);
}


}  // namespace moeblaze
