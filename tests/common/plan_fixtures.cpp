#include "common/plan_fixtures.hpp"

#include <gtest/gtest.h>

namespace moeblaze::test {

HostPlan::HostPlan(const RoutingPlan& built) : T(built.T()), E(built.E()), S(built.S()) {
  const RoutingPlanView v = built.view();
  const auto copy = [](const auto* p, int64_t count) {
    return std::vector<std::remove_const_t<std::remove_pointer_t<decltype(p)>>>(p, p + count);
  };
  expert_token_offsets = copy(v.expert_token_offsets, E + 1);
  expert_token_indices = copy(v.expert_token_indices, S);
  slot_weights = copy(v.slot_weights, S);
  token_pair_offsets = copy(v.token_pair_offsets, T + 1);
  token_expert_indices = copy(v.token_expert_indices, S);
  token_index_map = copy(v.token_index_map, S);
}

RoutingPlan HostPlan::borrow() {
  return RoutingPlan::borrow(Device::cpu, T, E, S, expert_token_offsets.data(),
                             expert_token_indices.data(), slot_weights.data(),
                             token_pair_offsets.data(), tei(), token_index_map.data());
}

moeblaze_plan HostPlan::c_plan() {
  return moeblaze_plan{T,
                       E,
                       S,
                       expert_token_offsets.data(),
                       expert_token_indices.data(),
                       slot_weights.data(),
                       token_pair_offsets.data(),
                       tei(),
                       token_index_map.data()};
}

moeblaze_layer_cfg c_layer_cfg(const LayerConfig& cfg, int32_t mode, int32_t num_threads) {
  return moeblaze_layer_cfg{cfg.T,
                            cfg.d,
                            cfg.n,
                            cfg.E,
                            cfg.K,
                            static_cast<int32_t>(cfg.activation),
                            cfg.dtype == DType::f32 ? 0 : 1,
                            mode,
                            num_threads,
                            static_cast<int32_t>(cfg.compute),
                            nullptr};
}

std::string expect_invalid(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message '" << e.what() << "' does not contain '" << needle << "'";
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected InvalidArgument containing '" << needle << "', got "
                  << typeid(e).name() << ": " << e.what();
    return {};
  }
  ADD_FAILURE() << "expected InvalidArgument containing '" << needle << "', nothing was thrown";
  return {};
}

}  // namespace moeblaze::test
