// validate_routing_plan: the O(S + T + E) host check of a plan that did not come from the
// library's builder (a borrowed plan through the C ABI, or arrays the caller wrote). Kernels
// index x, out and the slot arrays through every entry, so each one is range-checked here.
#include "core/plan_validation.hpp"

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/checked_math.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze {
namespace {

// offsets (count+1,) starts at 0, never decreases and ends at `total`.
void require_csr_offsets(const int32_t* off, int64_t count, int64_t total, const char* name,
                         const char* count_name) {
  MOEBLAZE_REQUIRE(off[0] == 0, "plan.", name, "[0] (", off[0], ") must be 0");
  for (int64_t i = 0; i < count; ++i)
    MOEBLAZE_REQUIRE(off[i + 1] >= off[i], "plan.", name, " must be non-decreasing: plan.", name,
                     "[", i + 1, "] (", off[i + 1], ") < plan.", name, "[", i, "] (", off[i], ")");
  MOEBLAZE_REQUIRE(off[count] == total, "plan.", name, "[", count_name, " = ", count, "] (",
                   off[count], ") must equal S (", total, ")");
}

}  // namespace

void validate_routing_plan_header(const RoutingPlanView& p, bool token_experts_optional) {
  MOEBLAZE_REQUIRE(p.device == Device::cpu || p.device == Device::cuda, "plan.device (",
                   int(p.device), ") must be cpu or cuda");
  MOEBLAZE_REQUIRE(p.T >= 0 && p.T < kInt32Limit, "plan.T (", p.T, ") must be in [0, 2^31)");
  MOEBLAZE_REQUIRE(p.E >= 1 && p.E < kInt32Limit, "plan.E (", p.E, ") must be in [1, 2^31)");
  MOEBLAZE_REQUIRE(p.S >= 0 && p.S < kInt32Limit, "plan.S (", p.S, ") must be in [0, 2^31)");
  MOEBLAZE_REQUIRE(p.expert_token_offsets != nullptr,
                   "plan.expert_token_offsets has no data (null pointer)");
  MOEBLAZE_REQUIRE(p.token_pair_offsets != nullptr,
                   "plan.token_pair_offsets has no data (null pointer)");
  if (p.S == 0) return;
  for (const auto& [ptr, name] :
       {std::pair<const void*, const char*>{p.expert_token_indices, "expert_token_indices"},
        {p.slot_weights, "slot_weights"},
        {p.token_index_map, "token_index_map"}})
    MOEBLAZE_REQUIRE(ptr != nullptr, "plan.", name, " has no data (null pointer)");
  MOEBLAZE_REQUIRE(p.token_expert_indices != nullptr || token_experts_optional,
                   "plan.token_expert_indices has no data (null pointer); only a CUDA layer "
                   "backward in keep_h or recompute mode runs without it");
}

void validate_routing_plan(const RoutingPlanView& p) {
  validate_routing_plan_header(p);
  MOEBLAZE_REQUIRE(p.device == Device::cpu, "validate_routing_plan: the plan is on ",
                   device_name(p.device), "; pass a host copy of its arrays");
  const int64_t T = p.T, E = p.E, S = p.S;
  const int32_t* eto = p.expert_token_offsets;  // (E+1,) slots of expert e
  const int32_t* eti = p.expert_token_indices;  // (S,) token of each slot
  const int32_t* tpo = p.token_pair_offsets;    // (T+1,) pairs of token t
  const int32_t* tei = p.token_expert_indices;  // (S,) expert of each pair
  const int32_t* tim = p.token_index_map;       // (S,) slot of each pair

  // Expert view: offsets, then tokens in range and strictly ascending inside each expert
  // (the order contract; it also rules out a token taking one expert twice).
  require_csr_offsets(eto, E, S, "expert_token_offsets", "E");
  for (int64_t e = 0; e < E; ++e)
    for (int32_t s = eto[e]; s < eto[e + 1]; ++s) {
      MOEBLAZE_REQUIRE(eti[s] >= 0 && eti[s] < T, "plan.expert_token_indices[", s, "] (", eti[s],
                       ") must be in [0, T = ", T, ")");
      MOEBLAZE_REQUIRE(s == eto[e] || eti[s] > eti[s - 1], "plan.expert_token_indices[", s, "] (",
                       eti[s], ") must be greater than entry ", s - 1, " (", eti[s - 1],
                       "): tokens ascend within expert ", e);
      MOEBLAZE_REQUIRE(std::isfinite(p.slot_weights[s]), "plan.slot_weights[", s, "] (",
                       p.slot_weights[s], ") must be finite");
    }

  // Token view: offsets, experts in range, and token_index_map a permutation of [0, S) that
  // sends pair p of token t with expert e to a slot of expert e holding token t.
  require_csr_offsets(tpo, T, S, "token_pair_offsets", "T");
  std::vector<uint8_t> slot_taken(static_cast<size_t>(S), 0);  // (S,) slot already mapped to
  for (int64_t t = 0; t < T; ++t)
    for (int32_t q = tpo[t]; q < tpo[t + 1]; ++q) {
      const int32_t e = tei[q], s = tim[q];
      MOEBLAZE_REQUIRE(e >= 0 && e < E, "plan.token_expert_indices[", q, "] (", e,
                       ") must be in [0, E = ", E, ")");
      MOEBLAZE_REQUIRE(s >= 0 && s < S, "plan.token_index_map[", q, "] (", s,
                       ") must be in [0, S = ", S, ")");
      MOEBLAZE_REQUIRE(!slot_taken[s], "plan.token_index_map[", q, "] (", s,
                       ") repeats an earlier entry: it must be a permutation of [0, S = ", S, ")");
      slot_taken[s] = 1;
      MOEBLAZE_REQUIRE(s >= eto[e] && s < eto[e + 1], "plan.token_index_map[", q, "] (", s,
                       ") must be a slot of expert ", e, " (plan.token_expert_indices[", q,
                       "]), i.e. in [", eto[e], ", ", eto[e + 1], ")");
      MOEBLAZE_REQUIRE(eti[s] == t, "plan.expert_token_indices[", s, "] (", eti[s],
                       ") must be token ", t, ", whose pair ", q,
                       " maps to that slot (plan.token_index_map[", q, "])");
    }
}

void require_valid_plan(const RoutingPlan& plan, bool token_experts_optional) {
  const RoutingPlanView v = plan.view();
  validate_routing_plan_header(v, token_experts_optional && plan.device() == Device::cuda);
  if (plan.device() == Device::cpu && !plan.library_built()) validate_routing_plan(v);
}

}  // namespace moeblaze
