// Two Hopper copies by the TMA unit, on their own, to read compute-sanitizer's initcheck by.
// The pointer-array kernels of the TMA path (down-proj, dX̃) update each expert's descriptor in
// shared memory and copy it into their global workspace with cute::tma_descriptor_cp_fence_release
// (one `tensormap.cp_fenceproxy` instruction: 128 bytes from shared to global memory), and their
// epilogue stores output tiles with TMA (`cp.async.bulk.tensor` from shared memory); the
// aggregation kernel then reads those rows with ordinary loads. Over the GPU fuzz, initcheck
// reports 4-byte global reads at the descriptor copy and 16-byte reads of the stored rows in the
// aggregation. These tests run each copy into global memory that nothing wrote before and check
// the bytes; run alone under initcheck they show what the tool counts as written
// (docs/notes/gathered-gemms.md, "compute-sanitizer's initcheck and the TMA copies";
// scripts/gpu_check.sh's sanitize-fuzz part).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include <cute/tensor.hpp>  // first: the atom headers below need its algorithms
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>

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

// One 64 x 64 tile of 16-bit words, row-major in both memories: a TMA store of a tile, as the
// epilogue does, then the aggregation's kind of load of what it stored.
constexpr int kTileRows = 64, kTileCols = 64;
using TileSmem = cute::Layout<cute::Shape<cute::Int<kTileRows>, cute::Int<kTileCols>>,
                              cute::Stride<cute::Int<kTileCols>, cute::_1>>;

// src (64, 64) global -> shared (plain loads) -> dst (64, 64) global, never written, by one
// `cp.async.bulk.tensor` store. 128 threads.
template <class TmaStore>
__global__ void tma_store_tile_kernel(const uint16_t* src, CUTE_GRID_CONSTANT TmaStore const tma) {
#if defined(CUTE_ARCH_TMA_SM90_ENABLED)
  using namespace cute;
  __shared__ alignas(128) uint16_t smem[kTileRows * kTileCols];
  for (int i = threadIdx.x; i < kTileRows * kTileCols; i += blockDim.x) smem[i] = src[i];
  tma_store_fence();  // each thread's shared-memory writes, visible to the TMA unit, before
  __syncthreads();    // the one thread that issues the store
  if (threadIdx.x == 0) {
    Tensor s = make_tensor(make_smem_ptr(smem), TileSmem{});
    Tensor m = tma.get_tma_tensor(make_shape(Int<kTileRows>{}, Int<kTileCols>{}));
    auto cta = tma.get_slice(Int<0>{});
    copy(tma, cta.partition_S(s), cta.partition_D(m));
    tma_store_arrive();
    tma_store_wait<0>();
  }
#endif
}

// out[i] = in[i], 16 bytes a thread by __ldg, as the aggregation reads a row.
__global__ void load_rows_kernel(const uint4* in, uint4* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = __ldg(in + i);
}

TEST(TmaDescriptorCopy, TmaStoredTileReadsBackByOrdinaryLoads) {
  MOEBLAZE_REQUIRE_GPU();
  int major = 0;
  MOEBLAZE_TEST_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  if (major != 9) GTEST_SKIP() << "needs an sm_90 GPU (TMA stores are Hopper's)";
  constexpr int kWords = kTileRows * kTileCols;
  constexpr int kVecs = kWords * 2 / 16;
  std::vector<uint16_t> want(kWords);
  for (int i = 0; i < kWords; ++i) want[i] = static_cast<uint16_t>(40503u * unsigned(i) + 7u);
  uint16_t *src = nullptr, *dst = nullptr, *loaded = nullptr;
  MOEBLAZE_TEST_CUDA(cudaMalloc(&src, kWords * 2));
  MOEBLAZE_TEST_CUDA(cudaMalloc(&dst, kWords * 2));  // written only by the TMA store
  MOEBLAZE_TEST_CUDA(cudaMalloc(&loaded, kWords * 2));
  MOEBLAZE_TEST_CUDA(cudaMemcpy(src, want.data(), kWords * 2, cudaMemcpyHostToDevice));
  using namespace cute;
  Tensor g = make_tensor(make_gmem_ptr(dst), make_shape(Int<kTileRows>{}, Int<kTileCols>{}),
                         make_stride(Int<kTileCols>{}, _1{}));
  auto tma = make_tma_copy(SM90_TMA_STORE{}, g, TileSmem{});
  tma_store_tile_kernel<<<1, 128>>>(src, tma);
  MOEBLAZE_TEST_CUDA(cudaGetLastError());
  load_rows_kernel<<<1, kVecs>>>(reinterpret_cast<const uint4*>(dst),
                                 reinterpret_cast<uint4*>(loaded), kVecs);
  MOEBLAZE_TEST_CUDA(cudaGetLastError());
  std::vector<uint16_t> got(kWords, 0);
  MOEBLAZE_TEST_CUDA(cudaMemcpy(got.data(), loaded, kWords * 2, cudaMemcpyDeviceToHost));
  MOEBLAZE_TEST_CUDA(cudaFree(src));
  MOEBLAZE_TEST_CUDA(cudaFree(dst));
  MOEBLAZE_TEST_CUDA(cudaFree(loaded));
  for (int i = 0; i < kWords; ++i) ASSERT_EQ(got[i], want[i]) << "word " << i;
}

}  // namespace
}  // namespace moeblaze::test
