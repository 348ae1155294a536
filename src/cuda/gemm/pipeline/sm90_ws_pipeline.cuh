// The machinery shared by the warp-specialised persistent kernels (sm_90a): the gathered varlen-M
// kernel (kernels/sm90_ws_gather.cuh) and the varlen-K weight-gradient kernel
// (kernels/sm90_ws_varlen_k.cuh):
//   * one CTA per SM (persistent_grid), 384 threads: warpgroup 0 is the producer, warpgroups 1
//     and 2 the consumers;
//   * a kStages-deep shared-memory ring with two mbarriers per stage (RingT, RingPosT): full[s]
//     completes when the producer's copies into the stage have landed, empty[s] when the consumer
//     threads' WGMMAs that read it have retired;
//   * the consumers' mainloop (mma_mainloop) and tile loops, cooperative (consumer_loop: both
//     consumer warpgroups on one 128 x 256 tile) and ping-pong (pingpong_consumer_loop: each
//     warpgroup on whole 128 x 128 tiles, its epilogue under the other's mainloop);
//   * the two schedules (Cooperative, PingPong) with their accumulator fragment policies
//     (WsFrag, PingFrag: where a consumer thread's accumulators sit in the tile).
// Moved verbatim out of sm90_ws_gather.cuh, where it was born; see that file's header for the
// gather kernel's design.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "cuda/cuda_backend.hpp"
#include "cuda/gemm/pipeline/sm90_gemm_core.cuh"
#include "moeblaze/error.hpp"

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
constexpr int kStageBytesA = kBM * kBK * 2;
constexpr int kStageBytesB = kBN * kBK * 2;
constexpr int kBox = 64;  // a TMA box of B is 64 x 64 elements (make_tma_kmajor)
constexpr uint32_t kBoxBytes = kBox * kBox * 2;

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

// The shared-memory ring: kStagesN stages of A (BM x BK) and of B (kTileNB x BK), 1 KiB
// aligned (the swizzle is a function of the address), then the full / empty mbarriers of each
// stage and the ping-pong order barrier pair.
// kCluster > 1 (the varlen-K kernel's multicast variant): the CTAs of a cluster share B, each
// loading a part of every stage by TMA multicast into all of them, so a stage may only be
// refilled when the consumers of every CTA of the cluster have released it: empty[s] counts
// one arrival per consumer warp of each CTA (release() below, lane c of every warp arriving on
// CTA c's barrier; without a cluster, lane 0 on its own CTA's).
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
  // issues the stage's TMA (with its byte count); empty[s] after one arrival per consumer warp
  // that reads the stage (per CTA of the cluster); order[w] after one warpgroup's 128 arrivals. The caller's next
  // __syncthreads publishes them.
  __device__ void init_barriers() const {
    if (threadIdx.x != 0) return;
#pragma unroll
    for (int s = 0; s < kStagesN; ++s) {
      cutlass::arch::ClusterTransactionBarrier::init(&full[s], kProducerThreads + 1);
      cutlass::arch::ClusterTransactionBarrier::init(&empty[s], kStageConsumers / 32 * kCluster);
    }
    cutlass::arch::ClusterBarrier::init(&order[0], kConsumerThreads / 2);
    cutlass::arch::ClusterBarrier::init(&order[1], kConsumerThreads / 2);
    cutlass::arch::fence_barrier_init();
  }
  // A consumer warp's release of stage s once the MMAs that read it have retired: one lane per
  // warp (and per CTA of a cluster) arrives, 8 arrivals a stage instead of 256 (wgmma.wait_group
  // is warp-aligned: when lane c gets here, every lane of its warp is done with the stage).
  __device__ void release(int s) const {
    if constexpr (kCluster == 1) {
      if ((threadIdx.x & 31) == 0) cutlass::arch::ClusterTransactionBarrier::arrive(&empty[s]);
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

// One persistent CTA per SM, or one per tile when there are fewer tiles (tile_bound, a host-known
// bound on the tile count).
inline int persistent_grid(int64_t tile_bound) {
  int dev = 0, sms = 0;
  MOEBLAZE_CUDA_CHECK(cudaGetDevice(&dev));
  MOEBLAZE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return static_cast<int>(tile_bound < sms ? tile_bound : sms);
}

}  // namespace moeblaze::cuda::gemm::sm90::ws
