// Warp-specialised, persistent varlen-M grouped GEMM with a gathered A operand (sm_90a):
//   C[slot, :] = A[gather[slot], :] · B_eᵀ        for every slot of expert e
// or, with kTmaA, C[slot, :] = A[slot, :] · B_eᵀ (the contiguous-A GEMMs down_proj and dx_proj:
// A's 128 rows of a tile come by TMA like B, from one descriptor for all experts; rows past the
// expert's end are the next expert's and feed only rows the epilogue does not store)
// the design of docs/DESIGN.md's kernel section for the gathered GEMMs, which the 2-CTA kernels of
// sm90_varlen_m.cuh approximate without warp specialisation:
//   * one CTA per SM (persistent), 384 threads: warpgroup 0 is the producer, warpgroups 1 and 2
//     the consumers, which compute one 128 x 256 output tile together (cooperative: each owns
//     64 rows x 256 columns, 128 fp32 accumulators per thread);
//   * the producer warpgroup copies A's 128 gathered rows per K step with cp.async (a TMA box can
//     only describe affine strides; the row ids of a tile are read once per tile, not per K step)
//     and one of its threads loads B (the weights, K-major) by TMA, four 64 x 64 boxes per stage;
//   * a kStages-deep shared-memory ring with two mbarriers per stage: full[s] completes when the
//     128 producer threads' cp.async (cp.async.mbarrier.arrive.noinc) and B's TMA bytes have
//     landed, empty[s] when the WGMMAs of every consumer warp that read it have retired (one
//     arrival per warp);
//   * the tile loop walks (expert, m-tile, n-tile) in raster_tile's order from a per-CTA table of
//     each expert's first m-tile, built once from expert_token_offsets (no host sync), so the
//     producer runs into the next tile's loads while the consumers are in this tile's epilogue.
// The epilogue policy consumes the accumulators straight from registers (Epi::apply, with the
// fragment mapping of ws_frag_row / ws_frag_col); Epi::at_tile_start runs in the consumers before
// a tile's mainloop (e.g. to prefetch the epilogue's inputs into L2 or shared memory); both get
// the epilogue's own shared-memory region of Epi::kSmemBytes (after the tile table). Each output
// element is computed by one thread in a fixed order, so the result is bitwise independent of the
// tile order and of gridDim.
// Two schedules (the Sched template argument):
//   * Cooperative: as above, both consumer warpgroups on one 128 x 256 tile; the tensor cores idle
//     while the consumers run a tile's epilogue.
//   * PingPong: each consumer warpgroup computes whole 128 x 128 tiles (two 64 x 128 WGMMA atoms
//     along M, again 128 fp32 accumulators per thread), the CTA's tiles alternating between the
//     two; an order barrier pair lets one warpgroup start a tile's mainloop only after the other
//     has issued its last MMA, so one warpgroup's epilogue runs under the other's mainloop. The
//     price: B is loaded once per 128 rows of output instead of once per 128 x 256, and A once per
//     128 columns. For the epilogue-heavy gathered GEMMs (dH, up-projection at short d).
// kCluster = 2 (cooperative only): a cluster of two CTAs computes the m-tiles 2 g and 2 g + 1 of
// one (expert, n-tile), and each CTA loads half of B's boxes by TMA multicast into both, halving
// the weight's reads where an expert's m-tiles would each read its whole panel
// (docs/notes/dh-epilogue.md, "Clusters of 2"). A is copied per CTA, as without a cluster. When an expert
// has an odd number of m-tiles, its last cluster's second CTA has no rows: it copies zeros, takes
// part in the loads and barriers, and its epilogue stores nothing. The same K order per output
// element as on single CTAs, so the same bits.
// Included by the .cu file of each GEMM that uses it (one instantiation per file).
#pragma once

#include <cuda.h>  // CUtensorMap

#include <cub/block/block_scan.cuh>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "cuda/cuda_backend.hpp"
#include "cuda/gemm/pipeline/sm90_gemm_core.cuh"
#include "cuda/pdl.cuh"
#include "cuda/gemm/pipeline/sm90_tma_desc.cuh"  // make_tma_kmajor
#include "cuda/gemm/pipeline/sm90_ws_pipeline.cuh"  // ring, schedules, consumer loops
#include "moeblaze/error.hpp"
#include "moeblaze/routing_plan.hpp"

namespace moeblaze::cuda::gemm::sm90::ws {

// Registers after setmaxnreg: 128 x 40 + 256 x 232 = 64512 of the SM's 65536 (ptxas allocates
// each role's code within its count). The consumers need 128 accumulators plus the epilogue's
// temporaries (the dH epilogue spilled at 224, ptxas -v); the producer keeps its rows as 32-bit
// element offsets so that it fits in 40.
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
// Largest E the per-CTA table (E + 1 ints of shared memory) is sized for; larger E runs the
// 2-CTA kernels (the caller checks supports()).
constexpr int kMaxExperts = 4096;

// The shared-memory layouts and tiled MMA of a schedule (sm90_ws_pipeline.cuh) for B of major
// kMajorB (A is always K-major). An MN-major B stage is ordered K-blocks first
// (Step<_2,_1,_3>), so the 8 KiB
// that hold MN columns [64 h, 64 h + 64) for all 64 k of the stage are contiguous: one TMA box of
// a 2D (K rows, N columns) tensor with 128-byte swizzle, like the K-major case's 64-row boxes.
template <GMajor kMajorB, class Sched>
struct Layouts {
  static constexpr int kTileN = Sched::kTileN;
  static constexpr int kStagesN = Sched::kStages;
  using TiledMma = decltype(ct::make_tiled_mma(typename Sched::template Atom<kMajorB>{},
                                               typename Sched::AtomLayout{}));
  using SmemLayoutA = decltype(ct::tile_to_shape(
      ct::GMMA::Layout_K_SW128_Atom<Elem>{},
      ct::Shape<ct::Int<kBM>, ct::Int<kBK>, ct::Int<kStagesN>>{}));  // (BM, BK, stages)
  using SmemLayoutB = std::conditional_t<
      kMajorB == GMajor::K,
      decltype(ct::tile_to_shape(ct::GMMA::Layout_K_SW128_Atom<Elem>{},
                                 ct::Shape<ct::Int<kTileN>, ct::Int<kBK>, ct::Int<kStagesN>>{})),
      decltype(ct::tile_to_shape(ct::GMMA::Layout_MN_SW128_Atom<Elem>{},
                                 ct::Shape<ct::Int<kTileN>, ct::Int<kBK>, ct::Int<kStagesN>>{},
                                 ct::Step<ct::_2, ct::_1, ct::_3>{}))>;  // (BN, BK, stages)
};

struct Args {
  const __nv_bfloat16* a;   // (rows, lda) bf16, rows gathered per slot
  int64_t lda;
  const int32_t* gather;    // (S,) slot -> A row (unused with A by TMA)
  const int32_t* offsets;   // (E+1,) expert_token_offsets
  int E;
  int K;                    // reduction length, a multiple of kBK
  int n_tiles;              // output tiles along N
  // B is the expert-stacked weights seen as one row-major 2D tensor of E * b_rows_per_expert rows,
  //   K-major B: rows are N indices, b_cols = K;   MN-major B: rows are K indices, b_cols = N.
  int b_rows_per_expert;
  int b_cols;
  // K-major B: rows of B_e feeding tile n_tile, four 64-row boxes starting at
  //   gated (gate_split > 0): j0, j0 + 64, gate_split + j0, gate_split + j0 + 64, j0 = 128 n_tile
  //   plain:                  256 n_tile + 64 h, h = 0..3
  // Rows past B_e's end read the next expert's rows (or TMA's zero fill past the tensor) and
  // feed only accumulator columns the epilogue does not store. MN-major B: columns
  // 256 n_tile + 64 h of rows e K + 64 kt; columns past N are TMA's zero fill.
  int gate_split;
  int raster_group;         // band height of raster_tile
  CUtensorMap tma_b;        // that 2D tensor, 64 x 64 boxes (set by launch_gather_gemm)
  CUtensorMap tma_a;        // kTmaA: A (S, K) row-major, 64 x 64 boxes (set by launch_gather_gemm)
  // kTmaA: expert e's A rows [rows_begin[e], rows_end[e]) go to output rows from rows_out[e]
  // (gemm::ExpertRows: the whole step, or one token chunk); (E,) each.
  const int32_t* rows_begin;
  const int32_t* rows_end;
  const int32_t* rows_out;
};

// The Args fields every gathered GEMM sets alike: A (rows, K) bf16 gathered per slot through the
// plan, the plan's offsets and E, the reduction length K.
inline Args gather_args(const RoutingPlanView& plan, const void* a, int64_t K) {
  Args p{};
  p.a = static_cast<const __nv_bfloat16*>(a);
  p.lda = K;
  p.gather = plan.expert_token_indices;
  p.offsets = plan.expert_token_offsets;
  p.E = static_cast<int>(plan.E);
  p.K = static_cast<int>(K);
  return p;
}

// The tile a CTA works on: expert, its slot range [m_begin, m_end), the n-tile, and where its
// output rows go: slot r to row r + out_shift (0 but on a contiguous-A GEMM's token chunk).
struct Tile {
  int expert, m_begin, m_end, n_tile, out_shift;
};

// Expert e's A rows: [offsets[e], offsets[e + 1]) for the gathered GEMMs, the ExpertRows range
// for the contiguous-A ones (kRows).
template <bool kRows>
__device__ __forceinline__ int expert_begin(const Args& p, int e) {
  if constexpr (kRows) return __ldg(p.rows_begin + e);
  return p.offsets[e];
}
template <bool kRows>
__device__ __forceinline__ int expert_end(const Args& p, int e) {
  if constexpr (kRows) return __ldg(p.rows_end + e);
  return p.offsets[e + 1];
}

// Linear tile t -> Tile, from the table tile_start[e] = first m-group of expert e (tile_start[E]
// = all m-groups; an m-group is kCluster consecutive m-tiles of one expert, the m-tile itself
// when kCluster = 1): the expert is the last e with tile_start[e] <= m (empty experts share their
// successor's start and are skipped by taking the last). rank: the CTA's place in its cluster,
// which picks its m-tile of the group; past the expert's rows the tile is empty
// (m_begin = m_end).
template <bool kRows, int kCluster = 1>
__device__ __forceinline__ Tile decode_tile(const Args& p, const int* tile_start, int m_total,
                                            int t, int rank = 0) {
  int m_linear, n_tile;
  raster_tile(t, m_total, p.n_tiles, p.raster_group, m_linear, n_tile);
  int lo = 0, hi = p.E - 1;  // answer in [lo, hi]
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (tile_start[mid] <= m_linear) lo = mid; else hi = mid - 1;
  }
  Tile tl;
  tl.expert = lo;
  const int begin = expert_begin<kRows>(p, lo);
  tl.m_end = expert_end<kRows>(p, lo);
  tl.m_begin = begin + ((m_linear - tile_start[lo]) * kCluster + rank) * kBM;
  if (kCluster > 1 && tl.m_begin > tl.m_end) tl.m_begin = tl.m_end;  // the group's idle CTA
  tl.n_tile = n_tile;
  tl.out_shift = 0;
  if constexpr (kRows) tl.out_shift = __ldg(p.rows_out + lo) - begin;
  return tl;
}

// tile_start[e] for e in [0, E], by all threads (block-wide scan of each expert's m-groups,
// ceil(ceil(count_e / kBM) / kCluster)).
template <bool kRows, int kCluster = 1>
__device__ __forceinline__ void build_tile_table(const Args& p, int* tile_start) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  int running = 0;
  for (int base = 0; base < p.E; base += kThreads) {
    const int e = base + static_cast<int>(threadIdx.x);
    const int m_tiles =
        e < p.E ? (expert_end<kRows>(p, e) - expert_begin<kRows>(p, e) + kBM - 1) / kBM : 0;
    const int cnt = (m_tiles + kCluster - 1) / kCluster;
    int excl, total;
    Scan(scan_tmp).ExclusiveSum(cnt, excl, total);
    if (e < p.E) tile_start[e] = running + excl;
    running += total;
    __syncthreads();  // scan_tmp is reused next round
  }
  if (threadIdx.x == 0) tile_start[p.E] = running;
}

// Bytes of the (E + 1)-entry tile table, rounded up to 16 (the epilogue's region follows it).
__host__ __device__ constexpr size_t tile_table_bytes(int E) { return (4 * (size_t(E) + 1) + 15) / 16 * 16; }

// Shared-memory bytes of the gather kernel for E experts: the ring (1 KiB alignment slack, the
// stages, the mbarriers), the tile table and the epilogue's own region (Epi::kSmemBytes).
template <class Sched, class Epi>
constexpr size_t smem_bytes(int E) {
  return RingOf<Sched>::kBytes + tile_table_bytes(E) + Epi::kSmemBytes;
}

// Dynamic shared memory a CTA may take beside the kernels' static 2 KiB (the tile scan's).
constexpr size_t kMaxDynamicSmem = 227 * 1024 - 2048;

// The gather kernel's ring: its schedule's, the stages shared by kCluster CTAs.
template <class Sched, int kCluster>
using GatherRing = RingT<Sched::kTileN, Sched::kStages, Sched::kStageConsumers, kCluster>;

template <GMajor kMajorB, class Epi, class Sched, bool kTmaA = false, int kCluster = 1>
__global__ void __launch_bounds__(kThreads, 1)
    gather_gemm_kernel(const __grid_constant__ Args p, const typename Epi::Params ep) {
  static_assert(kCluster == 1 || (kCluster == 2 && !Sched::kPingPong),
                "clusters of 2, cooperative schedule only");
  pdl_wait();  // before any global memory access (src/cuda/pdl.cuh)
  pdl_launch_dependents();
  using namespace cute;
  using L = Layouts<kMajorB, Sched>;
  using R = GatherRing<Sched, kCluster>;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  constexpr int kTileN = Sched::kTileN;
  constexpr int kBoxes = kTileN / kBox;  // TMA boxes of B per stage
  constexpr int kBoxesOwn = kBoxes / kCluster;  // of which this CTA loads (multicast to all)
  extern __shared__ char smem_raw[];
  const R ring = R::carve(smem_raw);
  int* tile_start = reinterpret_cast<int*>(ring.end());  // (E + 1,)
  char* epi_smem = ring.end() + tile_table_bytes(p.E);    // (Epi::kSmemBytes,)
  ring.init_barriers();
  build_tile_table<kTmaA, kCluster>(p, tile_start);
  __syncthreads();
  // The cluster's barriers are initialised before any CTA multicasts into, or arrives on, them.
  if constexpr (kCluster > 1) cute::cluster_sync();
  const int rank = kCluster > 1 ? static_cast<int>(cute::block_rank_in_cluster()) : 0;
  // This CTA's (cluster's) tiles: first, first + stride, ...
  const int first = blockIdx.x / kCluster, stride = gridDim.x / kCluster;
  const int m_total = tile_start[p.E];
  const int num_tiles = m_total * p.n_tiles;
  const int k_tiles = p.K / kBK;

  if (threadIdx.x < kProducerThreads) {
    // ---------------- producer ----------------
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    const int tid = threadIdx.x;
    const int chunk = tid & 7;  // 16-byte chunk of the 128-byte K-step row
    // Thread tid copies chunk `chunk` of tile rows tid / 8 + 16 j, j = 0..7.
    // Byte offset of row tid / 8 + 16 j's chunk in a stage: row * 128 + (chunk ^ (row % 8)) * 16,
    // and row % 8 does not depend on j.
    const uint32_t soff0 = swizzled_offset<GMajor::K>(tid >> 3, chunk * 8);
    const uint32_t a_base = smem_u32(ring.a);
    RingPosT<Sched::kStages> pos;
    for (int t = first; t < num_tiles; t += stride) {
      const Tile tl = decode_tile<kTmaA, kCluster>(p, tile_start, m_total, t, rank);
      // This thread's source row of each j (an A row id), or -1 past the expert's end.
      int src[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int slot = tl.m_begin + (tid >> 3) + 16 * j;
        src[j] = !kTmaA && slot < tl.m_end ? __ldg(p.gather + slot) : -1;
      }
      // TMA box h of a stage: column b_x[h] (+ 64 kt for K-major), row b_y[h] (+ 64 kt for
      // MN-major) of the 2D view.
      int b_x[kBoxes], b_y[kBoxes];
      const int b_base_row = tl.expert * p.b_rows_per_expert;
#pragma unroll
      for (int h = 0; h < kBoxes; ++h) {
        if constexpr (kMajorB == GMajor::K) {
          constexpr int kHalf = kBoxes / 2;  // gated: boxes [0, kHalf) gate rows, then up rows
          const int j0 = tl.n_tile * (kTileN / 2);
          b_x[h] = 0;
          b_y[h] = p.gate_split > 0
                       ? b_base_row + (h < kHalf ? 0 : p.gate_split) + j0 + (h % kHalf) * kBox
                       : b_base_row + tl.n_tile * kTileN + h * kBox;
        } else {
          b_x[h] = tl.n_tile * kTileN + h * kBox;
          b_y[h] = b_base_row;
        }
      }
      for (int kt = 0; kt < k_tiles; ++kt) {
        const int stage = pos.stage;
        Barrier::wait(&ring.empty[stage], pos.phase ^ 1);  // the consumers released this stage
        if (tid == 0) {
          Barrier::arrive_and_expect_tx(&ring.full[stage],
                                        kBoxes * kBoxBytes + (kTmaA ? kStageBytesA : 0));
          // The whole stage lands here: this CTA's boxes and, multicast, the other CTA's.
          char* dst = ring.b + stage * R::kStageBytesB;
#pragma unroll
          for (int j = 0; j < kBoxesOwn; ++j) {
            const int h = rank * kBoxesOwn + j;
            const int x = kMajorB == GMajor::K ? kt * kBK : b_x[h];
            const int y = kMajorB == GMajor::K ? b_y[h] : b_y[h] + kt * kBK;
            if constexpr (kCluster == 1)
              SM90_TMA_LOAD_2D::copy(&p.tma_b, &ring.full[stage],
                                     static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL),
                                     dst + h * kBoxBytes, x, y);
            else
              SM90_TMA_LOAD_MULTICAST_2D::copy(
                  &p.tma_b, &ring.full[stage], static_cast<uint16_t>((1u << kCluster) - 1),
                  static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL), dst + h * kBoxBytes,
                  x, y);
          }
          if constexpr (kTmaA) {  // the tile's 128 rows as two 64-row boxes (past S: zero fill)
            char* a_dst = ring.a + stage * kStageBytesA;
#pragma unroll
            for (int h = 0; h < kBM / kBox; ++h)
              SM90_TMA_LOAD_2D::copy(&p.tma_a, &ring.full[stage],
                                     static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL),
                                     a_dst + h * kBoxBytes, kt * kBK, tl.m_begin + h * kBox);
          }
        }
        if constexpr (!kTmaA) {
          const uint32_t a_stage = a_base + stage * kStageBytesA;
          const __nv_bfloat16* a_k = p.a + kt * kBK + chunk * 8;
#pragma unroll
          for (int j = 0; j < 8; ++j)
            cp_async_16(a_stage + soff0 + j * 16 * 128,
                        src[j] >= 0 ? a_k + int64_t(src[j]) * p.lda : p.a, src[j] >= 0);
        }
        // With A by TMA no copy is pending, so this arrives at once: the barrier's count stays.
        cutlass::arch::cpasync_barrier_arrive_noinc(&ring.full[stage]);
        pos.advance();
      }
    }
  } else {
    // ---------------- consumers ----------------
    Tile tl;
    auto begin = [&](int t) {
      tl = decode_tile<kTmaA, kCluster>(p, tile_start, m_total, t, rank);
      Epi::at_tile_start(ep, tl.m_begin, tl.m_end, tl.n_tile, epi_smem);
      return k_tiles;
    };
    auto end = [&](int, auto& acc) {
      Epi::apply(ep, acc, tl.m_begin + tl.out_shift, tl.m_end + tl.out_shift, tl.n_tile,
                 tl.expert, epi_smem);
    };
    if constexpr (Sched::kPingPong)
      pingpong_consumer_loop<L, kConsumerRegs>(ring, num_tiles, k_tiles, begin, end);
    else
      consumer_loop<L, kConsumerRegs>(ring, first, stride, num_tiles, begin, end);
  }
  // No CTA leaves while the other may still multicast into it or arrive on its barriers.
  if constexpr (kCluster > 1) cute::cluster_sync();
}

// The grid: one CTA per SM, or fewer when there are fewer tiles than SMs (the host bound
// (ceil(S / kBM) + E) * n_tiles); with clusters, as many clusters as can be resident at once
// (the GPCs decide, not SMs / kCluster), or fewer when there are fewer m-groups
// (ceil(S / (kCluster kBM)) + E per n-tile).
// b: the stacked weights (E * b_rows_per_expert, b_cols) behind Args::tma_b; raster_group: the
// host's band height (dispatch/raster.hpp).
template <GMajor kMajorB, class Epi, class Sched, bool kTmaA = false, int kCluster = 1>
void launch_gather_gemm(const Args& p, const void* b, const typename Epi::Params& ep, int64_t S,
                        int raster_group, cudaStream_t stream) {
  if (S == 0) return;
  const int64_t m_groups = (S + kCluster * kBM - 1) / (kCluster * kBM) + p.E;  // a bound
  Args q = p;
  q.raster_group = clamp_raster_group(raster_group, m_groups);
  const int64_t b_rows = int64_t(p.E) * p.b_rows_per_expert;
  MOEBLAZE_UNSUPPORTED_IF(b_rows > INT32_MAX, "the weight stack's ", b_rows,
                          " rows exceed the TMA coordinate range (2^31 - 1)");
  q.tma_b = make_tma_kmajor(b, b_rows, p.b_cols);  // a (b_rows, b_cols) row-major tensor
  if constexpr (kTmaA) {
    MOEBLAZE_UNSUPPORTED_IF(S > INT32_MAX, "S (", S, ") exceeds the TMA coordinate range");
    q.tma_a = make_tma_kmajor(p.a, S, p.K);  // A (S, K) row-major: K-major like a weight stack
  }
  auto kernel = &gather_gemm_kernel<kMajorB, Epi, Sched, kTmaA, kCluster>;
  const size_t smem = smem_bytes<Sched, Epi>(p.E);
  MOEBLAZE_UNSUPPORTED_IF(smem > kMaxDynamicSmem, "the gather kernel's shared memory (", smem,
                          " bytes for E = ", p.E, ") exceeds the SM's ", kMaxDynamicSmem);
  MOEBLAZE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem)));
  const int64_t tiles = m_groups * p.n_tiles;
  if constexpr (kCluster == 1) {
    launch_kernel(kernel, dim3(persistent_grid(tiles)), dim3(kThreads), smem, stream, 1, q, ep);
  } else {
    // Resident clusters of this instantiation at this shared-memory size (the tile table's
    // bytes follow E), asked once per size and host thread.
    thread_local size_t asked_smem = 0;
    thread_local int resident = 0;
    if (asked_smem != smem) {
      resident = resident_clusters(kernel, dim3(kThreads), smem, kCluster);
      asked_smem = smem;
    }
    MOEBLAZE_UNSUPPORTED_IF(resident <= 0, "the gather kernel: no ", kCluster,
                            "-CTA cluster of it fits on this device (", smem, " bytes of shared "
                            "memory a CTA)");
    const int64_t clusters = tiles < resident ? tiles : resident;
    launch_kernel(kernel, dim3(static_cast<unsigned>(kCluster * clusters)), dim3(kThreads), smem,
                  stream, kCluster, q, ep);
  }
}

}  // namespace moeblaze::cuda::gemm::sm90::ws
