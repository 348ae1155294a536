// A layer step's host tensors and plans on the device, shared by the GPU layer tests
// (test_layer_fp8_gpu.cpp, test_fuzz_gpu.cpp, test_trust_gpu.cpp).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "common/layer_fixtures.hpp"
#include "gpu/gpu_test_util.hpp"
#include "moeblaze/moeblaze.hpp"

namespace moeblaze::test {

// The host plan's arrays copied to the device. The plan is the caller's, not library-built, so
// a step given it checks it only where LayerOptions::check_plan asks.
inline RoutingPlan device_plan(const RoutingPlan& h) {
  RoutingPlan p(Device::cuda, h.T(), h.E(), h.S());
  const auto copy = [](void* dst, const void* src, size_t bytes) {
    if (bytes) MOEBLAZE_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  };
  const RoutingPlanView v = h.view();
  copy(p.expert_token_offsets(), v.expert_token_offsets, 4 * (h.E() + 1));
  copy(p.expert_token_indices(), v.expert_token_indices, 4 * h.S());
  copy(p.slot_weights(), v.slot_weights, 4 * h.S());
  copy(p.token_pair_offsets(), v.token_pair_offsets, 4 * (h.T() + 1));
  copy(p.token_expert_indices(), v.token_expert_indices, 4 * h.S());
  copy(p.token_index_map(), v.token_index_map, 4 * h.S());
  return p;
}

// A host tensor's bytes on the device, viewed with its shape; `offset` bytes into a slightly
// larger allocation (a misaligned view, for the alignment checks).
struct DevTensor {
  DevMem mem;
  TensorView v;
  explicit DevTensor(const HostTensor& h, size_t offset = 0) : mem(h.bytes.size() + offset) {
    if (!h.bytes.empty())
      MOEBLAZE_CUDA_CHECK(cudaMemcpy(static_cast<char*>(mem.p) + offset, h.bytes.data(),
                                     h.bytes.size(), cudaMemcpyHostToDevice));
    v = h.view();
    v.data = h.bytes.empty() ? nullptr : static_cast<char*>(mem.p) + offset;
    v.device = Device::cuda;
  }
  // After the device is done (synchronises first).
  void download_into(HostTensor& h) const {
    MOEBLAZE_CUDA_CHECK(cudaDeviceSynchronize());
    if (!h.bytes.empty())
      MOEBLAZE_CUDA_CHECK(
          cudaMemcpy(h.bytes.data(), v.data, h.bytes.size(), cudaMemcpyDeviceToHost));
  }
};

}  // namespace moeblaze::test
