// Helpers shared by the GPU tests (tests/gpu/*). Every GPU test starts with
// MOEBLAZE_REQUIRE_GPU() so that a machine without a GPU reports it as skipped, not failed.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace moeblaze::test {

// True when the CUDA runtime sees at least one device. Clears the sticky "no device" error so
// later calls start clean.
inline bool gpu_available() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
}

}  // namespace moeblaze::test

#define MOEBLAZE_REQUIRE_GPU()                                             \
  do {                                                                     \
    if (!::moeblaze::test::gpu_available()) GTEST_SKIP() << "skipped: no GPU"; \
  } while (0)

// Test-side check of a CUDA call: fails the test (fatally) with the call's text and message.
#define MOEBLAZE_TEST_CUDA(call)                                                          \
  do {                                                                                    \
    const cudaError_t err_ = (call);                                                      \
    ASSERT_EQ(err_, cudaSuccess) << #call << ": " << cudaGetErrorString(err_);            \
  } while (0)
