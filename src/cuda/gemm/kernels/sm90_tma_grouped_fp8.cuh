// FP8 varlen-M grouped GEMM with a CONTIGUOUS A operand and DeepSeek-V3's fine-grained scales
// (issue 20), built from CUTLASS's Hopper pointer-array kernel with blockwise scaling (TMA loads
// of the e4m3 codes, cp.async loads of the fp32 scales, the tensor cores' fp32 accumulators
// promoted into a scaled fp32 sum every 128 of K; CUTLASS example 68):
//   for every expert e and i < rows.end[e] - rows.begin[e], n < N:
//     D[rows.out[e] + i, n] = Σ_kb sA[r, kb] · sB_e[n / 128, kb] · Σ_{k in kb} qA[r, k] qB_e[n, k]
//   with r = rows.begin[e] + i; qA (rows, K) e4m3 and sA (rows, K/128) fp32: 1x128 tiles along K
//   (fp8::quantize_1x128_async); qB (E, N, K) e4m3 and sB (E, N/128, K/128): 128x128 blocks
//   (fp8::quantize_128x128_async); D bf16. Both scale arrays are K-major, the quantizers' layout.
// B_e is (N, K) with K contiguous: FP8 WGMMA reads both operands K-major, so a weight used the
// other way round (dX̃'s W1_e) needs its codes transposed first (a 128x128 block's scale serves
// both orientations).
// As in sm90_tma_grouped.cuh: no host sync; the per-expert sizes, pointers, strides and scale
// layouts are written on the device into the caller's scratch, CUTLASS gets no host shapes.
// Included by one .cu file (instantiations/fp8_contiguous.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "cuda/cuda_backend.hpp"
#include "cuda/gemm/grouped_gemm.hpp"            // ExpertRows
#include "cuda/gemm/kernels/sm90_tma_grouped.cuh"  // packed_stride, PlainEpilogue, ...
#include "cuda/gemm/pipeline/sm90_tma_desc.cuh"    // bind_current_context
#include "moeblaze/error.hpp"

namespace moeblaze::cuda::gemm::tma {

// 1 x 128 scales for A (one per row and 128 of K), 128 x 128 for B; both K-major.
using Fp8ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::K,
                                                                 cute::GMMA::Major::K>;

// 128 x 128 output tiles, 128-deep K steps (one scale block per step), cooperative consumers,
// CUTLASS's configuration of example 68. A first configuration, not yet measured.
template <class Tile = cute::Shape<cute::_128, cute::_128, cute::_128>,
          class Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>>
struct Fp8GroupedGemm {
  using ElemAB = cutlass::float_e4m3_t;
  using ElemD = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;     // (M, K), K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // B_e (N, K), K contiguous
  using LayoutSFA = decltype(Fp8ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(Fp8ScaleConfig::deduce_layoutSFB());
  static constexpr int kAlignAB = 16;  // e4m3 elements per 16 bytes
  static constexpr int kAlignD = 8;    // bf16
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K)
  using Epilogue = PlainEpilogue<Tile, Cluster, ElemD, kAlignD>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElemAB,
      cute::tuple<LayoutA*, LayoutSFA*>, kAlignAB, ElemAB, cute::tuple<LayoutB*, LayoutSFB*>,
      kAlignAB, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;

  // The per-expert argument arrays, carved from the front of the scratch (256-byte pieces).
  struct GroupArrays {
    Shape3* shapes;              // (E,) (M_e, N, K)
    const ElemAB** ptr_a;        // (E,) first code row of expert e in qA
    const ElemAB** ptr_b;        // (E,) qB_e
    ElemD** ptr_d;               // (E,) first row of expert e in D
    const float** ptr_sfa;       // (E,) first scale row of expert e in sA
    const float** ptr_sfb;       // (E,) sB_e
    StrideA* stride_a;           // (E,) all equal; the pointer-array API takes one per group
    StrideB* stride_b;
    StrideD* stride_d;
    LayoutSFA* layout_sfa;       // (E,) scale layouts of (M_e, K)
    LayoutSFB* layout_sfb;       // (E,) and (N, K)
    size_t bytes;                // total, 256-byte aligned
  };
  static GroupArrays carve(void* base, int E) {
    Carver t(base);
    GroupArrays g;
    g.shapes = t.take<Shape3>(E);
    g.ptr_a = t.take<const ElemAB*>(E);
    g.ptr_b = t.take<const ElemAB*>(E);
    g.ptr_d = t.take<ElemD*>(E);
    g.ptr_sfa = t.take<const float*>(E);
    g.ptr_sfb = t.take<const float*>(E);
    g.stride_a = t.take<StrideA>(E);
    g.stride_b = t.take<StrideB>(E);
    g.stride_d = t.take<StrideD>(E);
    g.layout_sfa = t.take<LayoutSFA>(E);
    g.layout_sfb = t.take<LayoutSFB>(E);
    g.bytes = t.high_water();
    return g;
  }

  static typename Gemm::Arguments arguments(const GroupArrays& g, int E,
                                            const cutlass::KernelHardwareInfo& hw) {
    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {E, g.shapes, nullptr};  // sizes on the device only
    args.mainloop = {g.ptr_a, g.stride_a, g.ptr_b, g.stride_b,
                     g.ptr_sfa, g.layout_sfa, g.ptr_sfb, g.layout_sfb};
    set_plain_epilogue(args, g.ptr_d, g.stride_d);
    args.hw_info = hw;
    return args;
  }

  // The argument arrays + CUTLASS's workspace (per-SM TMA descriptors) for E experts.
  static size_t scratch_bytes(int E) {
    const GroupArrays g = carve(nullptr, E);
    return g.bytes +
           (Gemm::get_workspace_size(arguments(g, E, current_hw_info())) + 255) / 256 * 256;
  }
};

// One thread per expert: sizes, operand and scale pointers, strides and scale layouts of group e.
//   qa (rows, K), sa (rows, K/128); qb (E, N, K), sb (E, N/128, K/128); d (rows, N).
template <class G>
__global__ void build_fp8_group_args(typename G::GroupArrays g, ExpertRows rows, int E,
                                     const typename G::ElemAB* qa, const float* sa,
                                     const typename G::ElemAB* qb, const float* sb,
                                     typename G::ElemD* d, int N, int K) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  const int begin = rows.begin[e], m = rows.end[e] - begin;
  const int kb = K / 128;
  g.shapes[e] = typename G::Shape3{m, N, K};
  g.ptr_a[e] = qa + int64_t(begin) * K;
  g.ptr_b[e] = qb + int64_t(e) * N * K;
  g.ptr_d[e] = d + int64_t(rows.out[e]) * N;
  g.ptr_sfa[e] = sa + int64_t(begin) * kb;
  g.ptr_sfb[e] = sb + int64_t(e) * (N / 128) * kb;
  g.stride_a[e] = packed_stride<typename G::StrideA>(K);
  g.stride_b[e] = packed_stride<typename G::StrideB>(K);
  g.stride_d[e] = packed_stride<typename G::StrideD>(N);
  g.layout_sfa[e] = Fp8ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(m, N, K, 1));
  g.layout_sfb[e] = Fp8ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(m, N, K, 1));
}

// Enqueues the argument build and the GEMM on `stream` (scratch: G::scratch_bytes(E), 256-byte
// aligned, not used by anything else until the GEMM has run).
template <class G>
void run_fp8(const char* fn, ExpertRows rows, int E, const void* qa, const float* sa,
             const void* qb, const float* sb, void* d, int N, int K, void* scratch,
             size_t scratch_bytes, cudaStream_t stream) {
  sm90::bind_current_context();  // CUTLASS's initialize encodes TMA descriptors (driver API)
  const typename G::GroupArrays g = G::carve(scratch, E);
  const typename G::Gemm::Arguments args = G::arguments(g, E, current_hw_info());
  const size_t ws_bytes = G::Gemm::get_workspace_size(args);
  MOEBLAZE_REQUIRE(scratch_bytes >= g.bytes + ws_bytes, fn, ": scratch of ", scratch_bytes,
                   " bytes is smaller than the ", g.bytes + ws_bytes, " the FP8 GEMM needs");
  using AB = typename G::ElemAB;
  build_fp8_group_args<G><<<(E + 127) / 128, 128, 0, stream>>>(
      g, rows, E, static_cast<const AB*>(qa), sa, static_cast<const AB*>(qb), sb,
      static_cast<typename G::ElemD*>(d), N, K);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
  initialize_and_run<typename G::Gemm>(fn, "FP8 grouped GEMM", args, N, K,
                                       static_cast<char*>(scratch) + g.bytes, stream);
}

}  // namespace moeblaze::cuda::gemm::tma
