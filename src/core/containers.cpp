// Owning containers of the routing, the routing plan and FP8 compute's weight cache.
#ifdef MOEBLAZE_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "core/fp8_weight_cache.hpp"
#include "moeblaze/layer.hpp"
#include "moeblaze/routing.hpp"
#include "moeblaze/routing_plan.hpp"

namespace moeblaze {

Routing::Routing(Device device, int64_t T, int64_t E, int64_t P)
    : T_(T), E_(E), P_(P),
      offsets_(device, sizeof(int32_t) * static_cast<size_t>(T + 1)),
      experts_(device, sizeof(int32_t) * static_cast<size_t>(P)),
      weights_(device, sizeof(float) * static_cast<size_t>(P)) {}

Routing Routing::borrow(Device device, int64_t T, int64_t E, int64_t P, int32_t* pair_offsets,
                        int32_t* pair_experts, float* pair_weights) {
  Routing r;
  r.T_ = T;
  r.E_ = E;
  r.P_ = P;
  r.offsets_ = Buffer::borrow(device, pair_offsets, sizeof(int32_t) * static_cast<size_t>(T + 1));
  r.experts_ = Buffer::borrow(device, pair_experts, sizeof(int32_t) * static_cast<size_t>(P));
  r.weights_ = Buffer::borrow(device, pair_weights, sizeof(float) * static_cast<size_t>(P));
  return r;
}

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

RoutingPlan RoutingPlan::borrow(Device device, int64_t T, int64_t E, int64_t S,
                                int32_t* expert_token_offsets, int32_t* expert_token_indices,
                                float* slot_weights, int32_t* token_pair_offsets,
                                int32_t* token_expert_indices, int32_t* token_index_map) {
  const auto n = [](int64_t count) { return sizeof(int32_t) * static_cast<size_t>(count); };
  RoutingPlan p;
  p.T_ = T;
  p.E_ = E;
  p.S_ = S;
  p.device_ = device;
  p.expert_token_offsets_ = Buffer::borrow(device, expert_token_offsets, n(E + 1));
  p.expert_token_indices_ = Buffer::borrow(device, expert_token_indices, n(S));
  p.slot_weights_ = Buffer::borrow(device, slot_weights, sizeof(float) * static_cast<size_t>(S));
  p.token_pair_offsets_ = Buffer::borrow(device, token_pair_offsets, n(T + 1));
  // Null only where nothing reads it (a CUDA layer backward; the layer API checks).
  p.token_expert_indices_ =
      Buffer::borrow(device, token_expert_indices, token_expert_indices ? n(S) : 0);
  p.token_index_map_ = Buffer::borrow(device, token_index_map, n(S));
  return p;
}

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
  return h_.bytes() + xs_.bytes() + act_g_.bytes() + a_.bytes() + y_.bytes();
}

SavedForBackward SavedForBackward::borrow(LayerMode mode, int64_t S, Device device, void* h,
                                          size_t h_bytes) {
  SavedForBackward s;
  s.mode_ = mode;
  s.valid_ = true;
  s.S_ = S;
  s.h_ = Buffer::borrow(device, h, h_bytes);
  return s;
}

Fp8WeightCache::Fp8WeightCache() : state_(new State) {}
Fp8WeightCache::~Fp8WeightCache() {
#ifdef MOEBLAZE_WITH_CUDA
  // The codes are freed on the legacy default stream, which is not ordered with the caller's
  // non-blocking streams: wait for every reader first.
  if (state_->codes.device() == Device::cuda && state_->codes.bytes() > 0) cudaDeviceSynchronize();
#endif
}
void Fp8WeightCache::weights_changed() { state_->valid = false; }
size_t Fp8WeightCache::bytes() const { return state_->codes.bytes(); }
int64_t Fp8WeightCache::quantizations() const { return state_->quantizations; }

}  // namespace moeblaze
