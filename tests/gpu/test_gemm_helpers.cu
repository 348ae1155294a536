// The GEMM kernels' hand-written device helpers against independent references: the swizzled
// shared-memory offsets of sm90_gemm_core.cuh against CuTe's address of the same element in the
// layouts the WGMMA descriptors are built from, and quad_transpose.cuh against a plain transpose.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "cuda/gemm/epilogues/quad_transpose.cuh"
#include "cuda/gemm/pipeline/sm90_gemm_core.cuh"
#include "gpu/gpu_test_util.hpp"

namespace moeblaze::test {
namespace {

namespace sm90 = moeblaze::cuda::gemm::sm90;
namespace ct = cute;

constexpr int kMn = sm90::kBM, kK = sm90::kBK;  // one stage of one operand: (128, 64) bf16

// out (kMn, kK): swizzled_offset<M>(mn, k), row-major.
template <sm90::GMajor M>
__global__ void swizzled_offsets_kernel(uint32_t* out) {
  for (int i = threadIdx.x; i < kMn * kK; i += blockDim.x)
    out[i] = sm90::swizzled_offset<M>(i / kK, i % kK);
}

// CuTe's byte offset of (mn, k) in stage 0 of the kernels' shared-memory layout, over a 1 KiB
// aligned base (the kernels align their buffers so; the swizzle is a function of the address).
template <sm90::GMajor M>
std::vector<uint32_t> cute_offsets() {
  using Layout = typename sm90::TileConfig<M, M>::SmemLayoutA;
  alignas(1024) static sm90::Elem base[kMn * kK];
  auto t = ct::make_tensor(ct::make_smem_ptr(base), Layout{});
  std::vector<uint32_t> off(kMn * kK);
  for (int mn = 0; mn < kMn; ++mn)
    for (int k = 0; k < kK; ++k) {
      const auto* p = &t(mn, k, 0);
      off[mn * kK + k] = static_cast<uint32_t>(reinterpret_cast<const char*>(p) -
                                               reinterpret_cast<const char*>(base));
    }
  return off;
}

template <sm90::GMajor M>
void expect_offsets_match_cute(const char* name) {
  uint32_t* d = nullptr;
  MOEBLAZE_TEST_CUDA(cudaMalloc(&d, sizeof(uint32_t) * kMn * kK));
  swizzled_offsets_kernel<M><<<1, 256>>>(d);
  MOEBLAZE_TEST_CUDA(cudaGetLastError());
  std::vector<uint32_t> got(kMn * kK);
  MOEBLAZE_TEST_CUDA(cudaMemcpy(got.data(), d, sizeof(uint32_t) * got.size(),
                                cudaMemcpyDeviceToHost));
  MOEBLAZE_TEST_CUDA(cudaFree(d));
  const std::vector<uint32_t> want = cute_offsets<M>();
  for (int i = 0; i < kMn * kK; ++i)
    ASSERT_EQ(got[i], want[i]) << name << " (mn " << i / kK << ", k " << i % kK << ")";
}

TEST(GemmHelpersGpu, SwizzledOffsetKMajorIsCuteSw128Layout) {
  MOEBLAZE_REQUIRE_GPU();
  expect_offsets_match_cute<sm90::GMajor::K>("K-major");
}

TEST(GemmHelpersGpu, SwizzledOffsetMnMajorIsCuteSw128Layout) {
  MOEBLAZE_REQUIRE_GPU();
  expect_offsets_match_cute<sm90::GMajor::MN>("MN-major");
}

// words (32 lanes, 4): lane l's w[k] before and after quad_transpose (applied `times` times).
__global__ void quad_transpose_kernel(const uint32_t* in, uint32_t* out, int times) {
  const int lane = threadIdx.x;
  uint32_t w[4];
  for (int k = 0; k < 4; ++k) w[k] = in[lane * 4 + k];
  for (int t = 0; t < times; ++t) sm90::quad_transpose(w);
  for (int k = 0; k < 4; ++k) out[lane * 4 + k] = w[k];
}

std::vector<uint32_t> run_quad_transpose(const std::vector<uint32_t>& in, int times) {
  uint32_t *d_in = nullptr, *d_out = nullptr;
  std::vector<uint32_t> out(in.size());
  EXPECT_EQ(cudaMalloc(&d_in, sizeof(uint32_t) * in.size()), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&d_out, sizeof(uint32_t) * in.size()), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d_in, in.data(), sizeof(uint32_t) * in.size(), cudaMemcpyHostToDevice),
            cudaSuccess);
  quad_transpose_kernel<<<1, 32>>>(d_in, d_out, times);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(out.data(), d_out, sizeof(uint32_t) * out.size(), cudaMemcpyDeviceToHost),
            cudaSuccess);
  cudaFree(d_in);
  cudaFree(d_out);
  return out;
}

TEST(GemmHelpersGpu, QuadTransposeIsA4x4TransposePerQuad) {
  MOEBLAZE_REQUIRE_GPU();
  std::vector<uint32_t> in(32 * 4);  // (lane, word): a distinct value per word
  for (int i = 0; i < 32 * 4; ++i) in[i] = 0x1000u * static_cast<uint32_t>(i) + 7u;
  const std::vector<uint32_t> once = run_quad_transpose(in, 1);
  // Lane 4m + q's word k was lane 4m + k's word q: a 4 x 4 transpose inside each quad.
  for (int m = 0; m < 8; ++m)
    for (int q = 0; q < 4; ++q)
      for (int k = 0; k < 4; ++k)
        ASSERT_EQ(once[(4 * m + q) * 4 + k], in[(4 * m + k) * 4 + q])
            << "lane " << 4 * m + q << ", word " << k;
  // Its own inverse, as the epilogues use it (after a vector load and before a vector store).
  EXPECT_EQ(run_quad_transpose(in, 2), in);
}

}  // namespace
}  // namespace moeblaze::test
