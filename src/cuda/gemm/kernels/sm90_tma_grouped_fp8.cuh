// FP8 varlen-M grouped GEMM with a CONTIGUOUS A operand and DeepSeek-V3's fine-grained scales
// (docs/FP8.md), built from CUTLASS's Hopper pointer-array kernel with blockwise scaling (TMA loads
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
// The same kernel with 1x128 scales on BOTH operands also runs the weight gradients, whose K
// (tokens) varies per expert (varlen-K, Fp8RowScaleConfig, build_fp8_varlen_k_args):
//   for every expert e:
//     D_e[m, n] = Σ_kb sA_e[m, kb] · sB_e[n, kb] · Σ_{k in kb} qA_e[m, k] qB_e[n, k]
//   with qA_e (M, P_e), qB_e (N, P_e) e4m3 and sA_e (M, P_e/128), sB_e (N, P_e/128) fp32, all
//   K-major, P_e = poff[e+1] - poff[e]; D (E, M, N) bf16.
// As in sm90_tma_grouped.cuh: no host sync; the per-expert sizes, pointers, strides and scale
// layouts are written on the device into the caller's scratch, CUTLASS gets no host shapes.
// Included by one .cu file per GEMM (instantiations/fp8_contiguous.cu, fp8_varlen_k.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

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
// 1 x 128 scales for both A and B (one per row and 128 of K), both K-major: the weight gradients,
// whose operands are both token-major activations / gradients quantized along the tokens.
using Fp8RowScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, 128, cute::GMMA::Major::K,
                                                                    cute::GMMA::Major::K>;

// Cooperative / PingPong (sm90_tma_grouped.cuh) with CUTLASS's FP8 blockwise mainloop policy;
// the epilogue policy is theirs.
struct Fp8Cooperative : Cooperative {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
};
struct Fp8PingPong : PingPong {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise;
};

// 128 x 128 output tiles, 128-deep K steps (one scale block per step), cooperative consumers,
// CUTLASS's configuration of example 68 (ping-pong: 64 x 128 per warpgroup, as its FP8 examples,
// so that a warpgroup's fp32 accumulators and their promotion copy fit its registers).
// ScaleConfig: the operands' scale granularity (Fp8ScaleConfig, or Fp8RowScaleConfig for varlen-K).
template <class Tile = cute::Shape<cute::_128, cute::_128, cute::_128>,
          class Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>,
          class ScaleConfig_ = Fp8ScaleConfig, class Schedule = Fp8Cooperative>
struct Fp8GroupedGemm {
  using ScaleConfig = ScaleConfig_;
  using ElemAB = cutlass::float_e4m3_t;
  using ElemD = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;     // (M, K), K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // B_e (N, K), K contiguous
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  static constexpr int kAlignAB = 16;  // e4m3 elements per 16 bytes
  static constexpr int kAlignD = 8;    // bf16
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K)
  using Epilogue = PlainEpilogue<Tile, Cluster, ElemD, kAlignD, Schedule>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElemAB,
      cute::tuple<LayoutA*, LayoutSFA*>, kAlignAB, ElemAB, cute::tuple<LayoutB*, LayoutSFB*>,
      kAlignAB, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      typename Schedule::Kernel>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;

  // The per-expert argument arrays, carved from the front of the scratch (256-byte pieces).
  // Contiguous: group e is (M_e, N, K); varlen-K: (M, N, P_e).
  struct GroupArrays {
    Shape3* shapes;              // (E,) (M_e, N, K) / (M, N, P_e)
    const ElemAB** ptr_a;        // (E,) first code row of expert e in qA / qA_e
    const ElemAB** ptr_b;        // (E,) qB_e
    ElemD** ptr_d;               // (E,) first row of expert e in D / D_e
    const float** ptr_sfa;       // (E,) first scale row of expert e in sA / sA_e
    const float** ptr_sfb;       // (E,) sB_e
    StrideA* stride_a;           // (E,) the pointer-array API takes one per group
    StrideB* stride_b;
    StrideD* stride_d;
    LayoutSFA* layout_sfa;       // (E,) scale layouts of (M_e, K) / (M, P_e)
    LayoutSFB* layout_sfb;       // (E,) and (N, K) / (N, P_e)
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

// Group e of the argument arrays: A (m, K) and B (N, K) codes K-major with their scales, D (m, N)
// row-major; strides packed, scale layouts from G's scale configuration.
template <class G>
__device__ void set_fp8_group(const typename G::GroupArrays& g, int e, int m, int N, int K,
                              const typename G::ElemAB* a, const float* sfa,
                              const typename G::ElemAB* b, const float* sfb,
                              typename G::ElemD* d) {
  g.shapes[e] = typename G::Shape3{m, N, K};
  g.ptr_a[e] = a;
  g.ptr_b[e] = b;
  g.ptr_d[e] = d;
  g.ptr_sfa[e] = sfa;
  g.ptr_sfb[e] = sfb;
  g.stride_a[e] = packed_stride<typename G::StrideA>(K);
  g.stride_b[e] = packed_stride<typename G::StrideB>(K);
  g.stride_d[e] = packed_stride<typename G::StrideD>(N);
  g.layout_sfa[e] = G::ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(m, N, K, 1));
  g.layout_sfb[e] = G::ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(m, N, K, 1));
}

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
  set_fp8_group<G>(g, e, m, N, K, qa + int64_t(begin) * K, sa + int64_t(begin) * kb,
                   qb + int64_t(e) * N * K, sb + int64_t(e) * (N / 128) * kb,
                   d + int64_t(rows.out[e]) * N);
}

// The argument arrays carved from the scratch and CUTLASS's arguments over them, after checking
// that the scratch holds both (InvalidArgument naming fn otherwise, nothing enqueued).
template <class G>
std::pair<typename G::GroupArrays, typename G::Gemm::Arguments> prepare_fp8(
    const char* fn, int E, void* scratch, size_t scratch_bytes) {
  sm90::bind_current_context();  // CUTLASS's initialize encodes TMA descriptors (driver API)
  const typename G::GroupArrays g = G::carve(scratch, E);
  const typename G::Gemm::Arguments args = G::arguments(g, E, current_hw_info());
  const size_t ws_bytes = G::Gemm::get_workspace_size(args);
  MOEBLAZE_REQUIRE(scratch_bytes >= g.bytes + ws_bytes, fn, ": scratch of ", scratch_bytes,
                   " bytes is smaller than the ", g.bytes + ws_bytes, " the FP8 GEMM needs");
  return {g, args};
}

// Enqueues the argument build and the GEMM on `stream` (scratch: G::scratch_bytes(E), 256-byte
// aligned, not used by anything else until the GEMM has run).
template <class G>
void run_fp8(const char* fn, ExpertRows rows, int E, const void* qa, const float* sa,
             const void* qb, const float* sb, void* d, int N, int K, void* scratch,
             size_t scratch_bytes, cudaStream_t stream) {
  const auto [g, args] = prepare_fp8<G>(fn, E, scratch, scratch_bytes);
  using AB = typename G::ElemAB;
  build_fp8_group_args<G><<<(E + 127) / 128, 128, 0, stream>>>(
      g, rows, E, static_cast<const AB*>(qa), sa, static_cast<const AB*>(qb), sb,
      static_cast<typename G::ElemD*>(d), N, K);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
  initialize_and_run<typename G::Gemm>(fn, "FP8 grouped GEMM", args, N, K,
                                       static_cast<char*>(scratch) + g.bytes, stream);
}

// One thread per expert, varlen-K (G with Fp8RowScaleConfig): group e is (M, N, P_e) with
// P_e = poff[e+1] - poff[e], a positive multiple of 128 (the caller's contract, device-only).
//   qa (M·P) codes, sa (M·P/128) fp32: expert e's (M, P_e) and (M, P_e/128) from M·poff[e] and
//   M·poff[e]/128; qb, sb likewise with N rows; d (E, M, N). P = poff[E].
// An expert with P_e <= 0 (outside the contract) gets no tiles: its D_e is left as it was rather
// than written from accumulators no K tile has set.
template <class G>
__global__ void build_fp8_varlen_k_args(typename G::GroupArrays g, const int32_t* poff, int E,
                                        int M, int N, const typename G::ElemAB* qa,
                                        const float* sa, const typename G::ElemAB* qb,
                                        const float* sb, typename G::ElemD* d) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  const int64_t p0 = poff[e];
  const int pk = int(poff[e + 1] - p0);
  const int m = pk > 0 ? M : 0, k = pk > 0 ? pk : 0;
  set_fp8_group<G>(g, e, m, N, k, qa + int64_t(M) * p0, sa + int64_t(M) * (p0 / 128),
                   qb + int64_t(N) * p0, sb + int64_t(N) * (p0 / 128), d + int64_t(e) * M * N);
}

// run_fp8 for the varlen-K GEMM: enqueues build_fp8_varlen_k_args and the GEMM on `stream`
// (scratch: G::scratch_bytes(E), 256-byte aligned, not used by anything else until it has run).
template <class G>
void run_fp8_varlen_k(const char* fn, const int32_t* poff, int E, int M, int N, const void* qa,
                      const float* sa, const void* qb, const float* sb, void* d, void* scratch,
                      size_t scratch_bytes, cudaStream_t stream) {
  const auto [g, args] = prepare_fp8<G>(fn, E, scratch, scratch_bytes);
  // initialize_and_run's own check names N and K; K varies per expert and is not on the host, so
  // check here first (same arguments: its check then passes and its K, 0, is never shown).
  MOEBLAZE_UNSUPPORTED_IF(G::Gemm::can_implement(args) != cutlass::Status::kSuccess, fn,
                          ": CUTLASS's FP8 varlen-K grouped GEMM rejects M = ", M, ", N = ", N);
  using AB = typename G::ElemAB;
  build_fp8_varlen_k_args<G><<<(E + 127) / 128, 128, 0, stream>>>(
      g, poff, E, M, N, static_cast<const AB*>(qa), sa, static_cast<const AB*>(qb), sb,
      static_cast<typename G::ElemD*>(d));
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
  initialize_and_run<typename G::Gemm>(fn, "FP8 varlen-K grouped GEMM", args, N, 0,
                                       static_cast<char*>(scratch) + g.bytes, stream);
}

}  // namespace moeblaze::cuda::gemm::tma
