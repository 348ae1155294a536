// CUTLASS's device-side TMA descriptor copy, on its own. The pointer-array kernels of the TMA
// path (down-proj, dX̃) update each expert's descriptor in shared memory and copy it into their
// global workspace with cute::tma_descriptor_cp_fence_release (one `tensormap.cp_fenceproxy`
// instruction: 128 bytes from shared to global memory, then a proxy fence). compute-sanitizer's
// initcheck reports a 4-byte global *read* at that instruction inside those kernels. This test
// runs the same call into global memory that nothing wrote before, and checks that all 128
// bytes arrive; run alone under initcheck it shows whether the tool reports the copy's write as
// a read (docs/notes/gathered-gemms.md, "Open"; scripts/gpu_check.sh's sanitize-fuzz part).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include <cute/arch/copy_sm90_desc.hpp>

#include "gpu/gpu_test_util.hpp"

namespace moeblaze::test {
namespace {

constexpr int kDescBytes = 128;  // sizeof(cute::TmaDescriptor)

// src (128 bytes, global) -> shared -> dst (128 bytes, global, never written) by the copy the
// pointer-array epilogue uses. One warp: the instruction is .sync.aligned.
__global__ void copy_descriptor_kernel(const uint8_t* src, cute::TmaDescriptor* dst) {
#if defined(CUTE_ARCH_DEVICE_MODIFIABLE_TMA_SM90_ENABLED)
  __shared__ cute::TmaDescriptor smem;  // 64-byte aligned by its type
  auto* bytes = reinterpret_cast<uint8_t*>(&smem);
  for (int i = threadIdx.x; i < kDescBytes; i += 32) bytes[i] = src[i];
  __syncwarp();
  cute::tma_descriptor_cp_fence_release(dst, smem);
#endif
}

TEST(TmaDescriptorCopy, WritesAllBytesIntoUnwrittenGlobalMemory) {
  MOEBLAZE_REQUIRE_GPU();
  int major = 0;
  MOEBLAZE_TEST_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  if (major != 9) GTEST_SKIP() << "needs an sm_90 GPU (the tensormap copy is Hopper's)";
  std::vector<uint8_t> want(kDescBytes);
  for (int i = 0; i < kDescBytes; ++i) want[i] = static_cast<uint8_t>(37 * i + 11);
  uint8_t* src = nullptr;
  cute::TmaDescriptor* dst = nullptr;  // cudaMalloc'd and never written before the kernel
  MOEBLAZE_TEST_CUDA(cudaMalloc(&src, kDescBytes));
  MOEBLAZE_TEST_CUDA(cudaMalloc(&dst, sizeof(cute::TmaDescriptor)));
  MOEBLAZE_TEST_CUDA(cudaMemcpy(src, want.data(), kDescBytes, cudaMemcpyHostToDevice));
  copy_descriptor_kernel<<<1, 32>>>(src, dst);
  MOEBLAZE_TEST_CUDA(cudaGetLastError());
  std::vector<uint8_t> got(kDescBytes, 0);
  MOEBLAZE_TEST_CUDA(cudaMemcpy(got.data(), dst, kDescBytes, cudaMemcpyDeviceToHost));
  MOEBLAZE_TEST_CUDA(cudaFree(src));
  MOEBLAZE_TEST_CUDA(cudaFree(dst));
  for (int i = 0; i < kDescBytes; ++i) ASSERT_EQ(got[i], want[i]) << "byte " << i;
}

}  // namespace
}  // namespace moeblaze::test
