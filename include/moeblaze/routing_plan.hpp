// The routing plan: who goes where, as small integer index arrays built once per step and read
// by every kernel of forward and backward. No per-expert token buffer ever exists.
//
// Slots are the S assignments grouped by expert; inside an expert, slots are in ascending token
// order (ties impossible: a token picks an expert at most once). That order is part of the
// contract: it makes every result independent of thread timing.
//
//   expert_token_offsets (E+1,) int32  slots of expert e are [off[e], off[e+1])
//   expert_token_indices (S,)   int32  token id of each slot
//   slot_weights         (S,)   fp32   gate weight s_p of each slot
//   token_pair_offsets   (T+1,) int32  pairs of token t are [tpo[t], tpo[t+1]) (CSR; = t*K for
//                                      plain top-K).
//   token_expert_indices (S,)   int32  expert of each pair, token-major
//   token_index_map      (S,)   int32  slot of each pair, token-major
//
// For top-K routing the token view is exactly MoEBlaze's (T*K,) arrays. Token rounding removes
// dropped pairs from the CSR instead of marking them -1 (one code path for every routing).
#pragma once

#include <cstdint>

#include "moeblaze/memory.hpp"
#include "moeblaze/routing.hpp"

namespace moeblaze {

struct RoutingPlanView {
  int64_t T = 0, E = 0, S = 0;
  const int32_t* expert_token_offsets = nullptr;  // (E+1,)
  const int32_t* expert_token_indices = nullptr;  // (S,)
  const float* slot_weights = nullptr;            // (S,)
  const int32_t* token_pair_offsets = nullptr;    // (T+1,)
  const int32_t* token_expert_indices = nullptr;  // (S,)
  const int32_t* token_index_map = nullptr;       // (S,)
  Device device = Device::cpu;
};

enum class PlanBuilder : uint8_t {
  atomic_free,  // per-tile per-expert counts → one exclusive scan → each pair writes its slot
  sort,         // stable sort of pairs by expert (the MegaBlocks/ScatterMoE way); the baseline
};
const char* plan_builder_name(PlanBuilder b);

class RoutingPlan {
 public:
  RoutingPlan() = default;
  RoutingPlan(Device device, int64_t T, int64_t E, int64_t S);  // uninitialised contents
  // A plan over caller storage (the six arrays of the shapes above, on `device`), borrowed: not
  // freed, not accounted (Buffer::borrow). build_routing_plan on the CPU fills it in place when
  // (T, E, S) match the routing; the caller keeps the storage alive while the plan is used.
  static RoutingPlan borrow(Device device, int64_t T, int64_t E, int64_t S,
                            int32_t* expert_token_offsets, int32_t* expert_token_indices,
                            float* slot_weights, int32_t* token_pair_offsets,
                            int32_t* token_expert_indices, int32_t* token_index_map);
  int64_t T() const { return T_; }
  int64_t E() const { return E_; }
  int64_t S() const { return S_; }
  Device device() const { return device_; }

  // Writable arrays. Handing one out drops the library-built stamp (below): the caller may
  // write anything through it, so the plan is checked again before its next use.
  int32_t* expert_token_offsets() { return unstamped(expert_token_offsets_.as<int32_t>()); }
  int32_t* expert_token_indices() { return unstamped(expert_token_indices_.as<int32_t>()); }
  float* slot_weights() { return unstamped(slot_weights_.as<float>()); }
  int32_t* token_pair_offsets() { return unstamped(token_pair_offsets_.as<int32_t>()); }
  int32_t* token_expert_indices() { return unstamped(token_expert_indices_.as<int32_t>()); }
  int32_t* token_index_map() { return unstamped(token_index_map_.as<int32_t>()); }

  // True only for a plan that build_routing_plan filled in storage the plan owns, with no
  // writable array handed out since: the layer API trusts it without reading it. Every other
  // plan (borrowed caller arrays, or arrays written through the accessors above) is checked by
  // validate_routing_plan before a CPU call uses it. Borrowing never sets it.
  bool library_built() const { return library_built_; }

  RoutingPlanView view() const;
  size_t bytes() const;  // bytes of all arrays (what keeping the plan for backward costs)

 private:
  friend void build_routing_plan(const RoutingView&, PlanBuilder, RoutingPlan&);
  template <typename T>
  T* unstamped(T* p) {
    library_built_ = false;
    return p;
  }
  int64_t T_ = 0, E_ = 0, S_ = 0;
  Device device_ = Device::cpu;
  bool library_built_ = false;
  Buffer expert_token_offsets_, expert_token_indices_, slot_weights_, token_pair_offsets_,
      token_expert_indices_, token_index_map_;
};

// Builds the plan of a routing on the routing's device. Both builders produce bit-identical
// plans. Workspace is O(P + E * tiles); no (T, E) array. Validates the routing (CPU) or raises a
// device-side flag checked before return (GPU). T = 0 gives an empty plan.
void build_routing_plan(const RoutingView& routing, PlanBuilder builder, RoutingPlan& plan);

// Checks a plan's contents in O(S + T + E): expert_token_offsets starts at 0, is non-decreasing
// and ends at S; every expert_token_indices entry is in [0, T) and ascends within an expert;
// token_pair_offsets likewise from 0 to S; token_expert_indices in [0, E); token_index_map a
// permutation of [0, S) under which the two views agree (pair p of token t with expert e sits
// in slot s = token_index_map[p] inside expert e's range, and expert_token_indices[s] == t);
// slot_weights finite. Throws InvalidArgument naming the array, the entry and the rule, e.g.
// "plan.expert_token_indices[3] (1000000) must be in [0, T = 512)".
// Host memory only (plan.device == cpu). The layer API calls it on every CPU plan that is not
// library_built(). The host never reads a plan on cuda: the same rules run there as a device
// kernel, on request (LayerOptions::check_plan; the C ABI's moeblaze_check_plan_async and
// moeblaze_validate_plan_sync), or on a host copy of the six arrays passed here.
void validate_routing_plan(const RoutingPlanView& plan);

}  // namespace moeblaze
