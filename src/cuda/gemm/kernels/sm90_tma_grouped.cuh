// Varlen-M grouped GEMM with a CONTIGUOUS A operand, built from CUTLASS's Hopper pointer-array
// kernel (TMA loads of both operands, a producer warp and two consumer warpgroups, cooperative
// or ping-pong, persistent group tile scheduler, TMA store epilogue; CUTLASS example 57):
//   for every expert e: D[rows.out[e] + i, :] = A[rows.begin[e] + i, :] · B_e
//                       i < rows.end[e] - rows.begin[e]
// (ExpertRows, grouped_gemm.hpp: the whole step's off[e] ranges, or one token chunk's).
// Used by down_proj (A = act, B_e = w2_eᵀ) and dx_proj (A = dH, B_e = w1_e) when the experts'
// row ranges are long enough for its tiles (choose_kernels, kTmaVariants). Up-proj, dH and the weight
// gradients gather an operand row by row, which a TMA descriptor cannot express (affine strides
// only), so they stay on the cp.async kernels of sm90_varlen_m.cuh / dw_proj.cu.
//
// No host sync: the per-expert problem sizes and operand pointers are written ON THE DEVICE by
// build_group_args from expert_token_offsets into the caller's scratch, and CUTLASS is given no
// host problem shapes (its scheduler then launches one persistent CTA per SM and reads the sizes
// on the device). Experts with no rows have zero tiles and are skipped by the scheduler.
// Included by one .cu file per GEMM and variant (dispatch/tma_paths.hpp's table): each
// instantiation costs ~80 s of nvcc on one core.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "core/carver.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/gemm/dispatch/tma_paths.hpp"  // TmaCall
#include "cuda/gemm/grouped_gemm.hpp"  // ExpertRows
#include "cuda/gemm/pipeline/sm90_band_scheduler.cuh"  // BandedProblemShape (its scheduler)
#include "cuda/gemm/pipeline/sm90_tma_desc.cuh"  // bind_current_context
#include "moeblaze/error.hpp"

namespace moeblaze::cuda::gemm::tma {

using ElemT = cutlass::bfloat16_t;  // bf16 bits, as moeblaze::bf16 / __nv_bfloat16
using LayoutD = cutlass::layout::RowMajor;  // D (M, N), N contiguous
constexpr int kAlign = 8;                   // elements per 16 bytes (TMA's alignment)
// 128 x 256 output tile, 64-deep K steps, cooperative (both consumer warpgroups on one tile),
// clusters of 2 CTAs along M so the weight tile B is multicast to both.
using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
// The persistent scheduler's tile order inside each expert's (M, N) grid. CUTLASS's default for
// grouped problems walks M first (AlongM) with no swizzle; walking N first with swizzle 2 lets
// consecutive CTAs share A row panels (pairs of N-tiles), which is faster on the coarse configs
// (docs/notes/gathered-gemms.md). Across experts, the CTAs walk in bands
// (pipeline/sm90_band_scheduler.cuh). The host passes the order in force (dispatch/tma_paths.hpp:
// the chosen kernel's, or tma_tile_order: the tma.order / tma.swizzle / tma.bands overrides).
using SchedulerChoice = detail::TmaTileOrder;

inline cutlass::KernelHardwareInfo current_hw_info() {
  cutlass::KernelHardwareInfo hw;
  MOEBLAZE_CUDA_CHECK(cudaGetDevice(&hw.device_id));
  MOEBLAZE_CUDA_CHECK(
      cudaDeviceGetAttribute(&hw.sm_count, cudaDevAttrMultiProcessorCount, hw.device_id));
  return hw;
}

// The CUTLASS kernel's checks, initialisation (TMA descriptors into `workspace`) and launch,
// after the caller enqueued the argument build on `stream`; errors name fn and `what`.
template <class Gemm>
void initialize_and_run(const char* fn, const char* what, const typename Gemm::Arguments& args,
                        int N, int K, void* workspace, cudaStream_t stream) {
  Gemm gemm;
  MOEBLAZE_UNSUPPORTED_IF(gemm.can_implement(args) != cutlass::Status::kSuccess, fn,
                          ": CUTLASS's ", what, " rejects N = ", N, ", K = ", K);
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess)
    throw DeviceError(std::string(fn) + ": CUTLASS " + what + " initialisation failed");
  const cutlass::Status st = gemm.run(stream);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
  if (st != cutlass::Status::kSuccess)
    throw DeviceError(std::string(fn) + ": CUTLASS " + what + " launch failed");
}

// The consumers' schedule, as CUTLASS's pair of mainloop and epilogue policies:
//   Cooperative: both consumer warpgroups on one tile (each takes half its rows);
//   PingPong:    each warpgroup on its own tile, one's epilogue under the other's mainloop.
struct Cooperative {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct PingPong {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// The pointer-array epilogue both kernels use: D = A·B stored row-major in ElemD, no C operand.
template <class Tile, class Cluster, class ElemD, int kAlignD, class Schedule = Cooperative>
using PlainEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
    cutlass::layout::RowMajor*, kAlignD, ElemD, cutlass::layout::RowMajor*, kAlignD,
    typename Schedule::Epilogue,
    cutlass::epilogue::fusion::LinearCombination<ElemD, float>>::CollectiveOp;
// Its arguments: alpha 1, beta 0, no C, D per group.
template <class Args, class PtrD, class StrideD>
void set_plain_epilogue(Args& args, PtrD ptr_d, StrideD* stride_d) {
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
  args.epilogue.ptr_D = ptr_d;
  args.epilogue.dD = stride_d;
}

// LayoutB: ColumnMajor = B_e stored (N, K), K contiguous (w2_e (d, n) for the down-projection);
//          RowMajor    = B_e stored (K, N), N contiguous (w1_e (w1_rows, d) for dX̃).
// Tile and Cluster are template parameters (defaulted) so that both builders are dependent types:
// with non-dependent builders inside a class template nvcc's host pass fails to compile them.
template <class LayoutB, class Tile = TileShape, class Cluster = ClusterShape,
          class Schedule = Cooperative>
struct GroupedGemm {
  using ElemT = tma::ElemT;
  using ProblemShape = BandedProblemShape;  // (M, N, K) per expert, + the scheduler's bands
  using LayoutA = cutlass::layout::RowMajor;  // (M, K), K contiguous
  using Epilogue = PlainEpilogue<Tile, Cluster, ElemT, kAlign, Schedule>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElemT, LayoutA*, kAlign, ElemT,
      LayoutB*, kAlign, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      typename Schedule::Kernel>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  using RasterOptions = typename Kernel::TileScheduler::RasterOrderOptions;

  // The per-expert argument arrays, carved from the front of the scratch (256-byte pieces).
  struct GroupArrays {
    Shape3* shapes;        // (E,) (M_e, N, K)
    const ElemT** ptr_a;   // (E,) first row of expert e in A
    const ElemT** ptr_b;   // (E,) B_e
    ElemT** ptr_d;         // (E,) first row of expert e in D
    StrideA* stride_a;     // (E,) all equal; CUTLASS's pointer-array API takes one per group
    StrideB* stride_b;
    StrideD* stride_d;
    size_t bytes;          // total, 256-byte aligned
  };
  static GroupArrays carve(void* base, int E) {
    Carver t(base);
    GroupArrays g;
    g.shapes = t.take<Shape3>(E);
    g.ptr_a = t.take<const ElemT*>(E);
    g.ptr_b = t.take<const ElemT*>(E);
    g.ptr_d = t.take<ElemT*>(E);
    g.stride_a = t.take<StrideA>(E);
    g.stride_b = t.take<StrideB>(E);
    g.stride_d = t.take<StrideD>(E);
    g.bytes = t.high_water();
    return g;
  }

  static typename Gemm::Arguments arguments(const GroupArrays& g, int E,
                                            const cutlass::KernelHardwareInfo& hw,
                                            SchedulerChoice sc) {
    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape.num_groups = E;  // sizes on the device only
    args.problem_shape.problem_shapes = g.shapes;
    args.problem_shape.host_problem_shapes = nullptr;
    args.problem_shape.bands = sc.bands;
    args.mainloop = {g.ptr_a, g.stride_a, g.ptr_b, g.stride_b};
    set_plain_epilogue(args, g.ptr_d, g.stride_d);
    args.hw_info = hw;
    args.scheduler.raster_order = sc.along_n ? RasterOptions::AlongN : RasterOptions::AlongM;
    args.scheduler.max_swizzle_size = sc.swizzle;
    return args;
  }

  // Scratch bytes for E experts on the current device: the argument arrays + CUTLASS's workspace
  // (per-SM TMA descriptors, which the kernel rewrites for each group it visits).
  static size_t scratch_bytes(int E, SchedulerChoice sc) {
    const GroupArrays g = carve(nullptr, E);
    return g.bytes +
           (Gemm::get_workspace_size(arguments(g, E, current_hw_info(), sc)) + 255) / 256 * 256;
  }
};

// Strides of a row-major (rows, ld) matrix in the stride type CUTLASS uses for this operand:
// (ld, 1, 0) when the second mode is the contiguous one, (1, ld, 0) when the first is.
template <class Stride>
__host__ __device__ Stride packed_stride(int64_t ld) {
  Stride s{};
  if constexpr (cute::is_static_v<cute::remove_cvref_t<decltype(cute::get<1>(s))>>) {
    cute::get<0>(s) = ld;
  } else {
    cute::get<1>(s) = ld;
  }
  return s;
}

// One thread per expert: sizes, operand pointers and strides of group e.
//   a (rows, lda); b (E, ...) with b_stride elements per expert and leading dimension ldb;
//   d (rows, ldd).
template <class G>
__global__ void build_group_args(typename G::GroupArrays g, ExpertRows rows, int E,
                                 const typename G::ElemT* a, int64_t lda,
                                 const typename G::ElemT* b, int64_t b_stride, int64_t ldb,
                                 typename G::ElemT* d, int64_t ldd, int N, int K) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  const int begin = rows.begin[e];
  g.shapes[e] = typename G::Shape3{rows.end[e] - begin, N, K};
  g.ptr_a[e] = a + int64_t(begin) * lda;
  g.ptr_b[e] = b + int64_t(e) * b_stride;
  g.ptr_d[e] = d + int64_t(rows.out[e]) * ldd;
  g.stride_a[e] = packed_stride<typename G::StrideA>(lda);
  g.stride_b[e] = packed_stride<typename G::StrideB>(ldb);
  g.stride_d[e] = packed_stride<typename G::StrideD>(ldd);
}

// Enqueues the argument build and the GEMM on `stream`. scratch: scratch_bytes(E, sc) bytes,
// 256-byte aligned, not used by anything else until the GEMM has run (stream order).
template <class G>
void run(const char* fn, ExpertRows rows, int E, const void* a, int64_t lda, const void* b,
         int64_t b_stride, int64_t ldb, void* d, int64_t ldd, int N, int K, void* scratch,
         size_t scratch_bytes, SchedulerChoice sc, cudaStream_t stream) {
  sm90::bind_current_context();  // CUTLASS's initialize encodes TMA descriptors (driver API)
  const typename G::GroupArrays g = G::carve(scratch, E);
  const typename G::Gemm::Arguments args = G::arguments(g, E, current_hw_info(), sc);
  const size_t ws_bytes = G::Gemm::get_workspace_size(args);
  MOEBLAZE_REQUIRE(scratch_bytes >= g.bytes + ws_bytes, fn, ": scratch of ", scratch_bytes,
                   " bytes is smaller than the ", g.bytes + ws_bytes,
                   " the TMA grouped GEMM needs (tma_gemm_scratch_bytes)");
  using Elem = typename G::ElemT;
  build_group_args<G><<<(E + 127) / 128, 128, 0, stream>>>(
      g, rows, E, static_cast<const Elem*>(a), lda, static_cast<const Elem*>(b), b_stride, ldb,
      static_cast<Elem*>(d), ldd, N, K);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
  initialize_and_run<typename G::Gemm>(fn, "grouped GEMM", args, N, K,
                                       static_cast<char*>(scratch) + g.bytes, stream);
}

// run() with a call's operands (dispatch/tma_paths.hpp).
template <class G>
void run(const detail::TmaCall& c) {
  run<G>(c.fn, c.rows, c.E, c.a, c.lda, c.b, c.b_stride, c.ldb, c.d, c.ldd, c.N, c.K,
         c.scratch.data, c.scratch.bytes, c.order, c.stream);
}

}  // namespace moeblaze::cuda::gemm::tma
