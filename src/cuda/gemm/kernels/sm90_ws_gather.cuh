// Warp-specialised, persistent varlen-M grouped GEMM with a gathered A operand (sm_90a):
//   C[slot, :] = A[gather[slot], :] · B_eᵀ        for every slot of expert e
// the design of DESIGN.md's GEMM section for the gathered GEMMs, which the 2-CTA kernels of
// sm90_varlen_m.cuh approximate without warp specialisation:
//   * one CTA per SM (persistent), 384 threads: warpgroup 0 is the producer, warpgroups 1 and 2
//     the consumers, which compute one 128 x 256 output tile together (cooperative: each owns
//     64 rows x 256 columns, 128 fp32 accumulators per thread);
//   * the producer warpgroup copies A's 128 gathered rows per K step with cp.async (a TMA box can
//     only describe affine strides; the row ids of a tile are read once per tile, not per K step)
//     and one of its threads loads B (the weights, K-major) by TMA, four 64 x 64 boxes per stage;
//   * a kStages-deep shared-memory ring with two mbarriers per stage: full[s] completes when the
//     128 producer threads' cp.async (cp.async.mbarrier.arrive.noinc) and B's TMA bytes have
//     landed, empty[s] when all 256 consumer threads' WGMMAs that read it have retired;
//   * the tile loop walks (expert, m-tile, n-tile) in raster_tile's order from a per-CTA table of
//     each expert's first m-tile, built once from expert_token_offsets (no host sync), so the
//     producer runs into the next tile's loads while the consumers are in this tile's epilogue.
// The epilogue policy consumes the accumulators straight from registers (Epi::apply, with the
// fragment mapping of ws_frag_row / ws_frag_col); Epi::at_tile_start runs in the consumers before
// a tile's mainloop (e.g. to prefetch the epilogue's inputs into L2). Each output element is computed by one thread
// in a fixed order, so the result is bitwise independent of the tile order and of gridDim.
// Two schedules (the Sched template argument):
//   * Cooperative: as above, both consumer warpgroups on one 128 x 256 tile; the tensor cores idle
//     while the consumers run a tile's epilogue.
//   * PingPong: each consumer warpgroup computes whole 128 x 128 tiles (two 64 x 128 WGMMA atoms
//     along M, again 128 fp32 accumulators per thread), the CTA's tiles alternating between the
//     two; an order barrier pair lets one warpgroup start a tile's mainloop only after the other
//     has issued its last MMA, so one warpgroup's epilogue runs under the other's mainloop. The
//     price: B is loaded once per 128 rows of output instead of once per 128 x 256, and A once per
//     128 columns. For the epilogue-heavy gathered GEMMs (dH, up-projection at short d).
// Included by the .cu file of each GEMM that uses it (one instantiation per file).
#pragma once

#include <cuda.h>  // CUtensorMap

#include <cub/block/block_scan.cuh>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "cuda/cuda_backend.hpp"
#include "cuda/gemm/dispatch/raster.hpp"
#include "cuda/gemm/pipeline/sm90_gemm_core.cuh"
#include "cuda/gemm/kernels/sm90_varlen_m.cuh"  // make_tma_kmajor
#include "moeblaze/error.hpp"
#include "moeblaze/routing_plan.hpp"

namespace moeblaze::cuda::gemm::sm90::ws {

constexpr int kBM = 128;  // output tile rows (slots)
constexpr int kBN = 256;  // output tile columns
constexpr int kBK = 64;   // K step: one 128-byte swizzle row of bf16
// 48 KiB per stage (A 16 KiB + B 32 KiB); 4 stages = 192 KiB of the 227 KiB an SM offers, the
// rest holds the barriers and the expert tile table.
constexpr int kStages = 4;
constexpr int kProducerThreads = 128;
constexpr int kConsumerThreads = 256;
constexpr int kThreads = kProducerThreads + kConsumerThreads;
// Registers after setmaxnreg: 128 x 40 + 256 x 232 = 64512 of the SM's 65536 (ptxas allocates
// each role's code within its count). The consumers need 128 accumulators plus the epilogue's
// temporaries (the dH epilogue spilled at 224, ptxas -v); the producer keeps its rows as 32-bit
// element offsets so that it fits in 40.
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
// Largest E the per-CTA table (E + 1 ints of shared memory) is sized for; larger E runs the
// 2-CTA kernels (the caller checks supports()).
constexpr int kMaxExperts = 4096;

// The shared-memory layouts and tiled MMA of a schedule (below) for B of major kMajorB (A is
// always K-major). An MN-major B stage is ordered K-blocks first (Step<_2,_1,_3>), so the 8 KiB
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
constexpr int kStageBytesA = kBM * kBK * 2;
constexpr int kStageBytesB = kBN * kBK * 2;
constexpr int kBox = 64;  // a TMA box of B is 64 x 64 elements (make_tma_kmajor)
constexpr uint32_t kBoxBytes = kBox * kBox * 2;

struct Args {
  const __nv_bfloat16* a;   // (rows, lda) bf16, rows gathered per slot
  int64_t lda;
  const int32_t* gather;    // (S,) slot -> A row
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

// Where a consumer thread's accumulators sit in the 128 x 256 tile: element acc(v0 + 2 v1 + 4 i)
// is row ws_frag_row(v1), column ws_frag_col(i) + v0 (SM90 WGMMA C fragment of a 64 x 256
// atom, one atom per consumer warpgroup). i = 0..31.
__device__ __forceinline__ int ws_frag_row(int v1) {
  const int t = threadIdx.x - kProducerThreads;
  return 64 * (t >> 7) + 16 * ((t >> 5) & 3) + ((t & 31) >> 2) + 8 * v1;
}
__device__ __forceinline__ int ws_frag_col(int i) { return 8 * i + 2 * (threadIdx.x & 3); }
constexpr int kFragColGroups = kBN / 8;  // 32
// The same as a fragment policy (act_epilogue.cuh).
struct WsFrag {
  static constexpr int kTileN = kBN;
  static constexpr int kGroups = kFragColGroups;
  static constexpr int kRows = 2;
  __device__ static int row(int r) { return ws_frag_row(r); }
  __device__ static int col(int i) { return ws_frag_col(i); }
  __device__ static constexpr int acc_index(int r, int i) { return 4 * i + 2 * r; }
};

// The ping-pong schedule's fragment: one warpgroup owns a 128 x 128 tile as two 64 x 128 atoms
// along M, so a thread holds 4 rows (r = v1 + 2 mi: row 64 mi + 16 warp + lane / 4 + 8 v1) and
// 16 column groups; element (v0, v1, i, mi) sits at acc(v0 + 2 v1 + 4 i + 64 mi).
struct PingFrag {
  static constexpr int kTileN = 128;
  static constexpr int kGroups = kTileN / 8;  // 16
  static constexpr int kRows = 4;
  __device__ static int row(int r) {
    const int t = (threadIdx.x - kProducerThreads) & 127;  // thread of its warpgroup
    return 64 * (r >> 1) + 16 * (t >> 5) + ((t & 31) >> 2) + 8 * (r & 1);
  }
  __device__ static int col(int i) { return 8 * i + 2 * (threadIdx.x & 3); }
  __device__ static constexpr int acc_index(int r, int i) {
    return 64 * (r >> 1) + 4 * i + 2 * (r & 1);
  }
};

// The schedules (see the top of the file): output tile width, ring depth (stages fill the same
// ~192 KiB), consumer threads that release each stage, fragment policy and WGMMA atom.
struct Cooperative {
  static constexpr bool kPingPong = false;
  static constexpr int kTileN = kBN;        // 128 x 256 per CTA, shared by both warpgroups
  static constexpr int kStages = ws::kStages;  // 48 KiB each
  static constexpr int kStageConsumers = kConsumerThreads;
  using Frag = WsFrag;
  template <GMajor kMajorB>
  using Atom = ct::SM90_64x256x16_F32BF16BF16_SS<GMajor::K, kMajorB>;
  using AtomLayout = ct::Layout<ct::Shape<ct::_2, ct::_1, ct::_1>>;  // 2 warpgroups along M
};
struct PingPong {
  static constexpr bool kPingPong = true;
  static constexpr int kTileN = 128;  // 128 x 128 per warpgroup
  static constexpr int kStages = 6;   // 32 KiB each
  static constexpr int kStageConsumers = kConsumerThreads / 2;
  using Frag = PingFrag;
  template <GMajor kMajorB>
  using Atom = ct::SM90_64x128x16_F32BF16BF16_SS<GMajor::K, kMajorB>;
  using AtomLayout = ct::Layout<ct::Shape<ct::_1, ct::_1, ct::_1>>;  // one warpgroup per tile
};

// The tile a CTA works on: expert, its slot range [m_begin, m_end) and the n-tile.
struct Tile {
  int expert, m_begin, m_end, n_tile;
};

// Linear tile t -> Tile, from the table tile_start[e] = first m-tile of expert e (tile_start[E]
// = all m-tiles): the expert is the last e with tile_start[e] <= m (empty experts share their
// successor's start and are skipped by taking the last).
__device__ __forceinline__ Tile decode_tile(const Args& p, const int* tile_start, int m_total,
                                            int t) {
  int m_linear, n_tile;
  raster_tile(t, m_total, p.n_tiles, p.raster_group, m_linear, n_tile);
  int lo = 0, hi = p.E - 1;  // answer in [lo, hi]
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (tile_start[mid] <= m_linear) lo = mid; else hi = mid - 1;
  }
  Tile tl;
  tl.expert = lo;
  tl.m_begin = p.offsets[lo] + (m_linear - tile_start[lo]) * kBM;
  tl.m_end = p.offsets[lo + 1];
  tl.n_tile = n_tile;
  return tl;
}

// tile_start[e] for e in [0, E], by all threads (block-wide scan of ceil(count_e / kBM)).
__device__ __forceinline__ void build_tile_table(const Args& p, int* tile_start) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  int running = 0;
  for (int base = 0; base < p.E; base += kThreads) {
    const int e = base + static_cast<int>(threadIdx.x);
    const int cnt = e < p.E ? (p.offsets[e + 1] - p.offsets[e] + kBM - 1) / kBM : 0;
    int excl, total;
    Scan(scan_tmp).ExclusiveSum(cnt, excl, total);
    if (e < p.E) tile_start[e] = running + excl;
    running += total;
    __syncthreads();  // scan_tmp is reused next round
  }
  if (threadIdx.x == 0) tile_start[p.E] = running;
}


// ---- pieces shared by the warp-specialised kernels (this file and sm90_ws_varlen_k.cuh) ----

// The shared-memory ring: kStagesN stages of A (BM x BK) and of B (kTileNB x BK), 1 KiB
// aligned (the swizzle is a function of the address), then the full / empty mbarriers of each
// stage and the ping-pong order barrier pair.
// kCluster > 1 (the varlen-K kernel's multicast variant): the CTAs of a cluster share B, each
// loading a part of every stage by TMA multicast into all of them, so a stage may only be
// refilled when the consumers of every CTA of the cluster have released it: empty[s] then counts
// one arrival per consumer warp of each CTA (release() below, lane c of every warp arriving on
// CTA c's barrier).
template <int kTileNB, int kStagesN, int kStageConsumers, int kCluster = 1>
struct RingT {
  static constexpr int kStageCount = kStagesN;
  static constexpr int kStageBytesB = kTileNB * kBK * 2;
  char* a;          // (kStagesN, BM, BK) swizzled
  char* b;          // (kStagesN, kTileNB, BK) swizzled
  uint64_t* full;   // (kStagesN,): the stage's data has landed
  uint64_t* empty;  // (kStagesN,): the consumers' MMAs that read the stage have retired
  uint64_t* order;  // (2,): order[w] completes when the other consumer warpgroup has issued its
                    // tile's last MMA (ping-pong only)
  // Bytes of dynamic shared memory the ring takes, alignment slack included.
  static constexpr size_t kBytes =
      1024 + size_t(kStagesN) * (kStageBytesA + kStageBytesB) + (2 * kStagesN + 2) * 8;

  __device__ static RingT carve(char* smem_raw) {
    RingT r;
    r.a = align_smem_1k(smem_raw);
    r.b = r.a + kStagesN * kStageBytesA;
    r.full = reinterpret_cast<uint64_t*>(r.b + kStagesN * kStageBytesB);
    r.empty = r.full + kStagesN;
    r.order = r.empty + kStagesN;
    return r;
  }
  // The first byte after the ring's barriers (the gather kernel's tile table).
  __device__ char* end() const { return reinterpret_cast<char*>(order + 2); }
  // Thread 0 initialises the barriers: full[s] completes after the 128 producer threads'
  // cp.async arrivals (cp.async.mbarrier.arrive.noinc) and one more arrival by the thread that
  // issues the stage's TMA (with its byte count); empty[s] after every arrival of the consumer
  // threads that read the stage; order[w] after one warpgroup's 128 arrivals. The caller's next
  // __syncthreads publishes them.
  __device__ void init_barriers() const {
    if (threadIdx.x != 0) return;
#pragma unroll
    for (int s = 0; s < kStagesN; ++s) {
      cutlass::arch::ClusterTransactionBarrier::init(&full[s], kProducerThreads + 1);
      cutlass::arch::ClusterTransactionBarrier::init(
          &empty[s], kCluster == 1 ? kStageConsumers : kStageConsumers / 32 * kCluster);
    }
    cutlass::arch::ClusterBarrier::init(&order[0], kConsumerThreads / 2);
    cutlass::arch::ClusterBarrier::init(&order[1], kConsumerThreads / 2);
    cutlass::arch::fence_barrier_init();
  }
  // A consumer thread's release of stage s once the MMAs that read it have retired. In a
  // cluster, one lane per warp and CTA arrives (wgmma.wait_group is warp-aligned: when lane c
  // gets here, every lane of its warp is done with the stage).
  __device__ void release(int s) const {
    if constexpr (kCluster == 1) {
      cutlass::arch::ClusterTransactionBarrier::arrive(&empty[s]);
    } else {
      const uint32_t lane = threadIdx.x & 31;
      cutlass::arch::ClusterBarrier::arrive(&empty[s], lane, lane < kCluster);
    }
  }
};
template <class Sched>
using RingOf = RingT<Sched::kTileN, Sched::kStages, Sched::kStageConsumers>;
// The cooperative ring (also the varlen-K kernel's).
using Ring = RingOf<Cooperative>;

// Position in the ring, the same sequence on the producer and the consumer side.
template <int kStagesN = kStages>
struct RingPosT {
  int stage = 0;
  uint32_t phase = 0;
  __device__ void advance() {
    if (++stage == kStagesN) {
      stage = 0;
      phase ^= 1;
    }
  }
  __device__ void skip(int n) {  // the positions another consumer warpgroup reads
    for (int i = 0; i < n; ++i) advance();
  }
};
using RingPos = RingPosT<>;

// One tile's mainloop on a consumer warpgroup: k_tiles ring stages, one WGMMA batch in flight,
// each stage released once the batch after it is issued and it has retired. issued() runs after
// the last batch is issued, before waiting for it (the ping-pong hand-over).
template <class R, class Mma, class FragA, class FragB, class Acc, class Issued>
__device__ __forceinline__ void mma_mainloop(const R& r, RingPosT<R::kStageCount>& pos, Mma& mma,
                                             FragA& tCrA, FragB& tCrB, Acc& acc, int k_tiles,
                                             Issued issued) {
  using namespace cute;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  int release = pos.stage;  // the stage whose MMAs retire next
  mma.accumulate_ = GMMA::ScaleOut::Zero;
  for (int kt = 0; kt < k_tiles; ++kt) {
    Barrier::wait(&r.full[pos.stage], pos.phase);
    fence_proxy_async_smem();  // cp.async wrote through the generic proxy; WGMMA reads async
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
#pragma unroll
    for (int kb = 0; kb < size<2>(tCrA); ++kb) {
      cute::gemm(mma, tCrA(_, _, kb, pos.stage), tCrB(_, _, kb, pos.stage), acc);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_wait<1>();  // the previous step's MMAs are done: release its stage
    warpgroup_fence_operand(acc);
    if (kt > 0) {
      r.release(release);
      if (++release == R::kStageCount) release = 0;
    }
    pos.advance();
  }
  issued();
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
  if (k_tiles > 0) r.release(release);
}

// The consumer warpgroups of a warp-specialised kernel, cooperative: for each of this CTA's
// tiles t (t = blockIdx.x, + gridDim.x, ... < num_tiles), k_tiles = begin(t) (also the place for
// per-tile work before the mainloop), the mainloop (mma_mainloop), then end(t, acc), the epilogue
// on this thread's fp32 accumulators (zeros when k_tiles = 0). L gives TiledMma (two warpgroups
// along M), the stage layouts and kTileN.
// The CTA's tiles are first, first + stride, ... (blockIdx.x, gridDim.x; a cluster's index and
// count in a kernel whose clusters share their tiles).
template <class L, int kRegs, class R, class Begin, class End>
__device__ __forceinline__ void consumer_loop(const R& r, int first, int stride, int num_tiles,
                                              Begin begin, End end) {
  using namespace cute;
  cutlass::arch::warpgroup_reg_alloc<kRegs>();
  typename L::TiledMma mma;
  Tensor sA = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(r.a)), typename L::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(r.b)), typename L::SmemLayoutB{});
  auto thr = mma.get_slice(threadIdx.x - kProducerThreads);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // GMMA descriptors
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
  auto acc = partition_fragment_C(mma, Shape<Int<kBM>, Int<L::kTileN>>{});
  RingPosT<R::kStageCount> pos;
  for (int t = first; t < num_tiles; t += stride) {
    const int k_tiles = begin(t);
    if (k_tiles == 0) clear(acc);
    mma_mainloop(r, pos, mma, tCrA, tCrB, acc, k_tiles, [] {});
    end(t, acc);
  }
}

// The consumer warpgroups, ping-pong: warpgroup w takes this CTA's tiles number w, w + 2, ...
// (t = blockIdx.x + (w + 2 i) gridDim.x), each alone, k_tiles ring stages per tile (the same for
// every tile: the gather kernel's K is fixed), so it skips the other warpgroup's k_tiles
// positions after each of its own. Order: warpgroup 0's first mainloop starts at once; every
// later mainloop waits for order[w], which the other warpgroup completes after issuing its
// tile's last MMA. Besides putting one warpgroup's epilogue under the other's mainloop, this
// keeps each warpgroup's full[s] waits within one phase of the barrier's: an mbarrier wait tells
// phases apart only by parity, and without it a warpgroup could wait on a stage two phases ahead
// of the ring (its own stages start where the other warpgroup's end, and the other has passed
// all of those waits before this one starts).
template <class L, int kRegs, class R, class Begin, class End>
__device__ __forceinline__ void pingpong_consumer_loop(const R& r, int num_tiles, int k_tiles,
                                                       Begin begin, End end) {
  using namespace cute;
  using OrderBarrier = cutlass::arch::ClusterBarrier;
  cutlass::arch::warpgroup_reg_alloc<kRegs>();
  const int wg = (threadIdx.x - kProducerThreads) >> 7;
  typename L::TiledMma mma;
  Tensor sA = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(r.a)), typename L::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(r.b)), typename L::SmemLayoutB{});
  auto thr = mma.get_slice((threadIdx.x - kProducerThreads) & 127);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // GMMA descriptors
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
  auto acc = partition_fragment_C(mma, Shape<Int<kBM>, Int<L::kTileN>>{});
  RingPosT<R::kStageCount> pos;
  if (wg == 1) pos.skip(k_tiles);  // tile 0's stages belong to warpgroup 0
  uint32_t order_phase = 0;
  int j = 0;  // tiles this warpgroup has done
  for (int t = blockIdx.x + wg * gridDim.x; t < num_tiles; t += 2 * gridDim.x, ++j) {
    begin(t);
    if (wg == 1 || j > 0) {
      OrderBarrier::wait(&r.order[wg], order_phase);
      order_phase ^= 1;
    }
    mma_mainloop(r, pos, mma, tCrA, tCrB, acc, k_tiles,
                 [&] { OrderBarrier::arrive(&r.order[wg ^ 1]); });
    end(t, acc);
    pos.skip(k_tiles);  // the other warpgroup's next tile
  }
}

// Shared-memory bytes of the gather kernel for E experts: the ring (1 KiB alignment slack, the
// stages, the mbarriers) and the (E + 1)-entry tile table.
template <class Sched>
inline size_t smem_bytes(int E) { return RingOf<Sched>::kBytes + 4 * (size_t(E) + 1); }

// One persistent CTA per SM, or one per tile when there are fewer tiles (tile_bound, a host-known
// bound on the tile count).
inline int persistent_grid(int64_t tile_bound) {
  int dev = 0, sms = 0;
  MOEBLAZE_CUDA_CHECK(cudaGetDevice(&dev));
  MOEBLAZE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return static_cast<int>(tile_bound < sms ? tile_bound : sms);
}

template <GMajor kMajorB, class Epi, class Sched>
__global__ void __launch_bounds__(kThreads, 1)
    gather_gemm_kernel(const __grid_constant__ Args p, const typename Epi::Params ep) {
  using namespace cute;
  using L = Layouts<kMajorB, Sched>;
  using R = RingOf<Sched>;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  constexpr int kTileN = Sched::kTileN;
  constexpr int kBoxes = kTileN / kBox;  // TMA boxes of B per stage
  extern __shared__ char smem_raw[];
  const R ring = R::carve(smem_raw);
  int* tile_start = reinterpret_cast<int*>(ring.end());  // (E + 1,)
  ring.init_barriers();
  build_tile_table(p, tile_start);
  __syncthreads();
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
    for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      const Tile tl = decode_tile(p, tile_start, m_total, t);
      // This thread's source row of each j (an A row id), or -1 past the expert's end.
      int src[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int slot = tl.m_begin + (tid >> 3) + 16 * j;
        src[j] = slot < tl.m_end ? __ldg(p.gather + slot) : -1;
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
          Barrier::arrive_and_expect_tx(&ring.full[stage], kBoxes * kBoxBytes);
          char* dst = ring.b + stage * R::kStageBytesB;
#pragma unroll
          for (int h = 0; h < kBoxes; ++h)
            SM90_TMA_LOAD_2D::copy(&p.tma_b, &ring.full[stage],
                                   static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL),
                                   dst + h * kBoxBytes,
                                   kMajorB == GMajor::K ? kt * kBK : b_x[h],
                                   kMajorB == GMajor::K ? b_y[h] : b_y[h] + kt * kBK);
        }
        const uint32_t a_stage = a_base + stage * kStageBytesA;
        const __nv_bfloat16* a_k = p.a + kt * kBK + chunk * 8;
#pragma unroll
        for (int j = 0; j < 8; ++j)
          cp_async_16(a_stage + soff0 + j * 16 * 128,
                      src[j] >= 0 ? a_k + int64_t(src[j]) * p.lda : p.a, src[j] >= 0);
        cutlass::arch::cpasync_barrier_arrive_noinc(&ring.full[stage]);
        pos.advance();
      }
    }
  } else {
    // ---------------- consumers ----------------
    Tile tl;
    auto begin = [&](int t) {
      tl = decode_tile(p, tile_start, m_total, t);
      Epi::at_tile_start(ep, tl.m_begin, tl.m_end, tl.n_tile);
      return k_tiles;
    };
    auto end = [&](int, auto& acc) { Epi::apply(ep, acc, tl.m_begin, tl.m_end, tl.n_tile); };
    if constexpr (Sched::kPingPong)
      pingpong_consumer_loop<L, kConsumerRegs>(ring, num_tiles, k_tiles, begin, end);
    else
      consumer_loop<L, kConsumerRegs>(ring, blockIdx.x, gridDim.x, num_tiles, begin, end);
  }
}

// The grid: one CTA per SM, or fewer when there are fewer tiles than SMs (the host bound
// (ceil(S / kBM) + E) * n_tiles).
// b: the stacked weights (E * b_rows_per_expert, b_cols) behind Args::tma_b.
template <GMajor kMajorB, class Epi, class Sched>
void launch_gather_gemm(const Args& p, const void* b, const typename Epi::Params& ep, int64_t S,
                        cudaStream_t stream) {
  if (S == 0) return;
  const int grid = persistent_grid(((S + kBM - 1) / kBM + p.E) * p.n_tiles);
  Args q = p;
  q.raster_group = raster_group_for((S + kBM - 1) / kBM + p.E);
  const int64_t b_rows = int64_t(p.E) * p.b_rows_per_expert;
  MOEBLAZE_UNSUPPORTED_IF(b_rows > INT32_MAX, "the weight stack's ", b_rows,
                          " rows exceed the TMA coordinate range (2^31 - 1)");
  q.tma_b = make_tma_kmajor(b, b_rows, p.b_cols);  // a (b_rows, b_cols) row-major tensor
  auto kernel = &gather_gemm_kernel<kMajorB, Epi, Sched>;
  const size_t smem = smem_bytes<Sched>(p.E);
  MOEBLAZE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem)));
  kernel<<<grid, kThreads, smem, stream>>>(q, ep);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeblaze::cuda::gemm::sm90::ws
