// Helpers shared by the GPU tests (tests/gpu/*). Every GPU test starts with
// MOEBLAZE_REQUIRE_GPU() so that a machine without a GPU reports it as skipped, not failed.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "cuda/cuda_backend.hpp"  // MOEBLAZE_CUDA_CHECK

namespace moeblaze::test {

// Device memory owned by a test (a caller's tensors or a foreign caller's plan arrays: never
// counted by the library's allocator statistics).
struct DevMem {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DevMem(size_t b) : bytes(b) {
    if (b) MOEBLAZE_CUDA_CHECK(cudaMalloc(&p, b));
  }
  template <typename T>
  explicit DevMem(const std::vector<T>& v) : DevMem(v.size() * sizeof(T)) {
    upload(v);
  }
  ~DevMem() {
    if (p) cudaFree(p);
  }
  DevMem(const DevMem&) = delete;
  DevMem& operator=(const DevMem&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(p); }
  template <typename T>
  void upload(const std::vector<T>& v) {
    if (!v.empty())
      MOEBLAZE_CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  template <typename T>
  std::vector<T> download() const {
    std::vector<T> v(bytes / sizeof(T));
    MOEBLAZE_CUDA_CHECK(cudaDeviceSynchronize());
    if (bytes) MOEBLAZE_CUDA_CHECK(cudaMemcpy(v.data(), p, bytes, cudaMemcpyDeviceToHost));
    return v;
  }
  void poison() {  // 0xFF bytes: NaN in bf16 and fp32, so an unwritten element fails the check
    if (bytes) MOEBLAZE_CUDA_CHECK(cudaMemset(p, 0xFF, bytes));
  }
};

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
