// Varlen-M grouped GEMM (sm_90a): for every expert e, rows = the expert's slots
// [off[e], off[e+1]) read from the routing plan on the device,
//   C[slot, :] = A[row(slot), :] · B_eᵀ        row(slot) = gather[slot] (token) or slot
// with A K-major (T or S rows of K elements), B_e either K-major (N rows of K: nn.Linear's
// out x in, reduce over its columns) or N-major (K rows of N: reduce over its rows), and an
// epilogue policy that consumes the fp32 accumulators (plain store, fused activation, dH).
// Instantiated once per (B major, epilogue) pair in its own .cu file.
#pragma once

#include <cuda.h>  // CUtensorMap

#include <climits>

#include <cutlass/cuda_host_adapter.hpp>  // cuTensorMapEncodeTiled through the runtime

#include "cuda/cuda_backend.hpp"
#include "cuda/gemm/pipeline/sm90_gemm_core.cuh"
#include "cuda/gemm/pipeline/sm90_tma_desc.cuh"  // make_tma_kmajor
#include "moeblaze/error.hpp"

namespace moeblaze::cuda::gemm::sm90 {

struct VarlenMArgs {
  const __nv_bfloat16* a;  // (rows, lda), rows = tokens (gathered) or slots
  int64_t lda;
  const int32_t* a_gather;  // (S,) slot -> A row, or nullptr (A row = slot)
  const __nv_bfloat16* b;   // (E, ...) expert-stacked weights
  int64_t b_expert_stride;  // elements between experts
  int64_t ldb;              // K-major: K; N-major: N
  const int32_t* offsets;   // (E+1,) expert_token_offsets
  int E;
  int K;        // reduction length, a multiple of kBK
  int N;        // output columns (for the gated up-projection: n, counted in j)
  int n_tiles;  // tiles along N
  // > 0: gated up-projection. Tile t covers j in [64 t, 64 t + 64); B tile rows 0..63 are w1 rows
  // j (gate) and rows 64..127 are w1 rows gate_split + j (up), so one tile holds g and u of the
  // same j and the epilogue can combine them.
  int gate_split;
  // Set by launch_varlen_m: the grid's m-tile count (host bound ceil(S / kBM) + E) and the band
  // height of raster_tile (1..m_tiles).
  int m_tiles;
  int raster_group;
  // TMA descriptor of B as a 2D (E * rows per expert, K) bf16 tensor, 64 x 64 boxes, 128-byte
  // swizzle (make_tma_kmajor); used by the kernels instantiated with kTmaB (K-major B only).
  CUtensorMap tma_b;
};

// kTmaB: B (K-major only) comes by TMA (TmaKMajorLoader) instead of cp.async. The arguments are a
// __grid_constant__ parameter so that the TMA descriptor inside stays in parameter space.
template <GMajor kMajorB, class Epi, bool kTmaB = false>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    varlen_m_kernel(const __grid_constant__ VarlenMArgs p, const typename Epi::Params ep) {
  static_assert(!kTmaB || kMajorB == GMajor::K, "TMA B loads are implemented for K-major B");
  using Cfg = TileConfig<GMajor::K, kMajorB>;
  extern __shared__ char smem_raw[];
  char* smem = align_smem_1k(smem_raw);

  // m_linear numbers the m-tiles of all experts, expert by expert (find_expert_tile's order).
  int m_linear, n_tile;
  raster_tile(static_cast<int>(blockIdx.x), p.m_tiles, p.n_tiles, p.raster_group, m_linear,
              n_tile);
  int expert, m_tile;
  if (!find_expert_tile(p.offsets, p.E, m_linear, expert, m_tile)) return;
  const int m_begin = p.offsets[expert] + m_tile * kBM;  // first slot of this tile
  const int m_end = p.offsets[expert + 1];                // one past the expert's last slot
  const int tid = threadIdx.x;

  KMajorLoader la;
  la.init(tid, p.a, [&](int i) -> const __nv_bfloat16* {
    const int slot = m_begin + i;
    if (slot >= m_end) return nullptr;
    const int row = p.a_gather ? __ldg(p.a_gather + slot) : slot;
    return p.a + int64_t(row) * p.lda;
  });

  const __nv_bfloat16* b_e = p.b + int64_t(expert) * p.b_expert_stride;
  // Epilogue inputs (e.g. the H tile of dH) are loaded into registers now, so their latency
  // hides behind the mainloop instead of stalling the epilogue.
  typename Epi::Prefetched pre;
  Epi::prefetch(ep, pre, m_begin, m_end, n_tile);
  auto acc = cute::partition_fragment_C(typename Cfg::TiledMma{},
                                        cute::Shape<cute::Int<kBM>, cute::Int<kBN>>{});
  if constexpr (kTmaB) {
    __shared__ alignas(8) uint64_t mbar[kStages];
    TmaKMajorLoader lb;
    lb.desc = &p.tma_b;
    lb.mbar = mbar;
    const int base = expert * static_cast<int>(p.b_expert_stride / p.ldb);  // rows per expert
    if (p.gate_split > 0) {  // gate rows j0.., up rows gate_split + j0..
      const int j0 = n_tile * (kBN / 2);
      lb.row[0] = base + j0;
      lb.row[1] = base + p.gate_split + j0;
    } else {  // rows n0.. n0 + 127; rows >= N (next expert's, or zeros past the end) feed only
              // accumulator columns the epilogue does not store
      lb.row[0] = base + n_tile * kBN;
      lb.row[1] = lb.row[0] + kBN / 2;
    }
    lb.init_barriers();
    __syncthreads();
    mainloop<Cfg, Epi::kMmaInFlight>(smem, la, lb, p.K / kBK, acc);
  } else if constexpr (kMajorB == GMajor::K) {
    KMajorLoader lb;
    lb.init(tid, b_e, [&](int i) -> const __nv_bfloat16* {
      int row;
      if (p.gate_split > 0) {
        const int j0 = n_tile * (kBN / 2);
        row = i < kBN / 2 ? j0 + i : p.gate_split + j0 + (i - kBN / 2);
      } else {
        row = n_tile * kBN + i;
        if (row >= p.N) return nullptr;
      }
      return b_e + int64_t(row) * p.ldb;
    });
    mainloop<Cfg, Epi::kMmaInFlight>(smem, la, lb, p.K / kBK, acc);
  } else {
    MNMajorLoader lb;
    lb.init(tid, b_e, p.ldb, nullptr, 0, p.K, n_tile * kBN, p.N);
    mainloop<Cfg, Epi::kMmaInFlight>(smem, la, lb, p.K / kBK, acc);
  }
  Epi::apply(ep, acc, pre, m_begin, m_end, n_tile, expert);
}

// Epilogue policies provide Params, Prefetched (registers filled by prefetch() before the
// mainloop), apply(params, acc, prefetched, m_begin, m_end, n_tile, expert) and kMmaInFlight, the
// mainloop variant their kernel runs (sm90_gemm_core.cuh, lookahead()).
struct NoPrefetch {};

// Plain store of the tile: out[slot, n_tile * 128 + c] (bf16), columns < N.
struct StoreEpilogue {
  static constexpr int kMmaInFlight = 1;
  struct Params {
    __nv_bfloat16* out;  // (S, ldo)
    int64_t ldo;
    int N;
  };
  using Prefetched = NoPrefetch;
  __device__ static void prefetch(const Params&, Prefetched&, int, int, int) {}
  template <class Acc>
  __device__ static void apply(const Params& p, Acc& acc, const Prefetched&, int m_begin,
                               int m_end, int n_tile, int /*expert*/) {
    const int n0 = n_tile * kBN;
#pragma unroll
    for (int v1 = 0; v1 < 2; ++v1) {
      const int slot = m_begin + frag_row(v1);
      if (slot >= m_end) continue;
      __nv_bfloat16* out_row = p.out + int64_t(slot) * p.ldo + n0;
#pragma unroll
      for (int i = 0; i < kFragColGroups; ++i) {
        const int c = frag_col(i);
        if (n0 + c < p.N) store_bf16x2(out_row + c, acc(4 * i + 2 * v1), acc(4 * i + 2 * v1 + 1));
      }
    }
  }
};

// Launches varlen_m_kernel<MB, Epi> over ceil(S / 128) + E m-tiles (the host-known bound) times
// n_tiles, walked in raster_tile's order with band height raster_group (the host's choice,
// dispatch/raster.hpp); CTAs past the last real tile exit in the scheduler.
template <GMajor kMajorB, class Epi, bool kTmaB = false>
void launch_varlen_m(const VarlenMArgs& p, const typename Epi::Params& ep, int64_t S,
                     int raster_group, cudaStream_t stream) {
  if (S == 0) return;
  using Cfg = TileConfig<GMajor::K, kMajorB>;
  const int64_t m_tiles = (S + kBM - 1) / kBM + p.E;
  const int64_t blocks = m_tiles * p.n_tiles;
  MOEBLAZE_UNSUPPORTED_IF(blocks > int64_t(INT32_MAX), "grouped GEMM grid of ", blocks,
                          " CTAs (S = ", S, ") exceeds 2^31 - 1");
  VarlenMArgs q = p;
  q.m_tiles = static_cast<int>(m_tiles);
  q.raster_group = clamp_raster_group(raster_group, m_tiles);
  if constexpr (kTmaB) q.tma_b = make_tma_kmajor(p.b, p.E * (p.b_expert_stride / p.ldb), p.K);
  auto kernel = &varlen_m_kernel<kMajorB, Epi, kTmaB>;
  MOEBLAZE_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
  kernel<<<static_cast<unsigned>(blocks), kThreads, Cfg::kSmemBytes, stream>>>(q, ep);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeblaze::cuda::gemm::sm90
