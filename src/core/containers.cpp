// Owning containers of the routing and the routing plan.
#include "moeblaze/layer.hpp"
#include "moeblaze/routing.hpp"
#include "moeblaze/routing_plan.hpp"

namespace moeblaze {

Routing::Routing(Device device, int64_t T, int64_t E, int64_t P)
    : T_(T), E_(E), P_(P),
      offsets_(device, sizeof(int32_t) * static_cast<size_t>(T + 1)),
      experts_(device, sizeof(int32_t) * static_cast<size_t>(P)),
      weights_(device, sizeof(float) * static_cast<size_t>(P)) {}

RoutingView Routing::view() const {
  RoutingView v;
  v.T = T_;
  v.E = E_;
  v.P = P_;
  v.pair_offsets = pair_offsets();
  v.pair_experts = pair_experts();
  v.pair_weights = pair_weights();
  v.device = device();
  return v;
}

RoutingPlan::RoutingPlan(Device device, int64_t T, int64_t E, int64_t S)
    : T_(T), E_(E), S_(S), device_(device),
      expert_token_offsets_(device, sizeof(int32_t) * static_cast<size_t>(E + 1)),
      expert_token_indices_(device, sizeof(int32_t) * static_cast<size_t>(S)),
      slot_weights_(device, sizeof(float) * static_cast<size_t>(S)),
      token_pair_offsets_(device, sizeof(int32_t) * static_cast<size_t>(T + 1)),
      token_expert_indices_(device, sizeof(int32_t) * static_cast<size_t>(S)),
      token_index_map_(device, sizeof(int32_t) * static_cast<size_t>(S)) {}

RoutingPlanView RoutingPlan::view() const {
  RoutingPlanView v;
  v.T = T_;
  v.E = E_;
  v.S = S_;
  v.expert_token_offsets = expert_token_offsets_.as<int32_t>();
  v.expert_token_indices = expert_token_indices_.as<int32_t>();
  v.slot_weights = slot_weights_.as<float>();
  v.token_pair_offsets = token_pair_offsets_.as<int32_t>();
  v.token_expert_indices = token_expert_indices_.as<int32_t>();
  v.token_index_map = token_index_map_.as<int32_t>();
  v.device = device_;
  return v;
}

size_t RoutingPlan::bytes() const {
  return expert_token_offsets_.bytes() + expert_token_indices_.bytes() + slot_weights_.bytes() +
         token_pair_offsets_.bytes() + token_expert_indices_.bytes() + token_index_map_.bytes();
}

size_t SavedForBackward::bytes() const {
  return h.bytes() + xs.bytes() + act_g.bytes() + a.bytes() + y.bytes();
}

}  // namespace moeblaze
