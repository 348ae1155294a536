// The pieces every grouped GEMM kernel of src/cuda/gemm/ is built from (sm_90a):
//   * the CTA tile (128 x 128 x 64), two consumer warpgroups each owning 64 x 128 of the output,
//     SM90 WGMMA (SS, bf16 x bf16 -> fp32) reading 128B-swizzled shared memory;
//   * operand loaders that copy 16-byte chunks with cp.async, so a row of an operand can come from
//     any global address (the routing plan's gather is fused into the loads: a TMA descriptor can
//     only express affine strides);
//   * a multistage shared-memory pipeline driven by all 256 threads;
//   * the device-side tile scheduler for varlen-M grids (which expert and m-tile a CTA owns, from
//     expert_token_offsets, without any host sync);
// Included only by the .cu files of this folder; each instantiates one or two kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "cuda/activation.cuh"  // dev_act, dev_act_grad: the epilogues' activations
#include "moeblaze/config.hpp"

namespace moeblaze::cuda::gemm::sm90 {

namespace ct = cute;
using Elem = cute::bfloat16_t;
using GMajor = cute::GMMA::Major;

constexpr int kBM = 128;  // rows of the output tile (slots for varlen-M)
constexpr int kBN = 128;  // columns of the output tile
constexpr int kBK = 64;   // reduction step: one 128-byte swizzle row of bf16
constexpr int kThreads = 256;  // two warpgroups, each 64 x kBN of the output
// Shared-memory stages (32 KiB each). Loads run 1 or 2 tiles ahead of the MMA (see mainloop).
// 3 stages with 2 CTAs per SM rather than more stages with one: the second CTA's mainloop covers
// this one's prologue (index loads, pipeline fill) and epilogue, which a non-persistent kernel
// cannot overlap itself (docs/notes/gathered-gemms.md, stage variants).
#ifndef MOEBLAZE_GEMM_STAGES
#define MOEBLAZE_GEMM_STAGES 3
#endif
constexpr int kStages = MOEBLAZE_GEMM_STAGES;
// CTAs per SM the kernels are compiled for (__launch_bounds__ caps registers at 128 for 2);
// 2 needs kStages <= 3 (shared memory).
#ifndef MOEBLAZE_GEMM_MIN_BLOCKS
#define MOEBLAZE_GEMM_MIN_BLOCKS 2
#endif
// dH epilogue: load the H tile before the mainloop (1) or at the epilogue's start (0).
#ifndef MOEBLAZE_GEMM_DH_PREFETCH
#define MOEBLAZE_GEMM_DH_PREFETCH 0
#endif
constexpr int kMinBlocks = MOEBLAZE_GEMM_MIN_BLOCKS;
static_assert(kStages >= 3, "the pipeline needs at least 3 stages");
// kMmaInFlight (a template argument of mainloop, chosen per kernel): the WGMMA batches a
// warpgroup leaves in flight when it moves to the next K step. 1 overlaps each step's WGMMAs with
// the next step's loads and issue, but can then refill only the stage read two steps ago, so the
// loads run kStages - 2 = 1 tile ahead; 0 waits for the step's WGMMAs, which frees the stage just
// read, so the loads run kStages - 1 = 2 tiles ahead while the other resident CTA keeps the
// tensor cores busy. Only dH uses 0: it gains from it, dW1 loses and the others do not move
// (docs/notes/gathered-gemms.md, look-ahead).
template <int kMmaInFlight>
constexpr int lookahead() {
  static_assert(kMmaInFlight == 0 || kMmaInFlight == 1, "kMmaInFlight is 0 or 1");
  return kStages - 1 - kMmaInFlight;  // tiles loaded ahead of the MMA
}

template <GMajor M>
using SmemAtom = std::conditional_t<M == GMajor::K, ct::GMMA::Layout_K_SW128_Atom<Elem>,
                                    ct::GMMA::Layout_MN_SW128_Atom<Elem>>;

// Shared-memory layouts and the tiled MMA of one (A major, B major) combination. A is (BM, BK)
// per stage, B is (BN, BK); "K" major means K is the contiguous dimension in global memory.
template <GMajor MA, GMajor MB>
struct TileConfig {
  using SmemLayoutA = decltype(ct::tile_to_shape(
      SmemAtom<MA>{}, ct::Shape<ct::Int<kBM>, ct::Int<kBK>, ct::Int<kStages>>{}));
  using SmemLayoutB = decltype(ct::tile_to_shape(
      SmemAtom<MB>{}, ct::Shape<ct::Int<kBN>, ct::Int<kBK>, ct::Int<kStages>>{}));
  using TiledMma = decltype(ct::make_tiled_mma(ct::SM90_64x128x16_F32BF16BF16_SS<MA, MB>{},
                                               ct::Layout<ct::Shape<ct::_2, ct::_1, ct::_1>>{}));
  static constexpr int kStageBytesA = kBM * kBK * 2;
  static constexpr int kStageBytesB = kBN * kBK * 2;
  // + 1024: the swizzle pattern is a function of the address, so the buffers start 1 KiB aligned.
  static constexpr int kSmemBytes = kStages * (kStageBytesA + kStageBytesB) + 1024;
};

// ---- small PTX helpers ----------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; valid == false writes 16 zero bytes and reads nothing (M/N tails).
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem),
               "r"(src_bytes)
               : "memory");
}
// a * b as one 32 x 32 -> 64-bit multiply (IMAD.WIDE): C++'s int64_t product of two ints
// compiles to a 64 x 64 one.
__device__ __forceinline__ int64_t mul_wide(int a, int b) {
  int64_t r;
  asm("mul.wide.s32 %0, %1, %2;" : "=l"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// cp.async writes shared memory through the generic proxy; WGMMA reads it through the async proxy.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Byte offset of element (mn, k) inside one stage of the operand buffers, for the layouts above:
// tile_to_shape(GMMA::Layout_{K,MN}_SW128_Atom<bf16>, (128, 64)). Written out (instead of asking
// CuTe per chunk at run time) and checked against CuTe's layouts element by element for both
// majors (a host-side comparison while writing this; the GPU tests cover it end to end).
//   K-major: 8-row x 128-byte atoms stacked along MN; 16-byte chunk c of row r sits at chunk
//            c ^ (r % 8) of its 128-byte line.
//   MN-major: 64-MN x 8-K atoms, MN atoms first; each k is a 128-byte line of 64 MN elements.
// Stages are multiples of the 1 KiB swizzle period, so stage s adds s * stage bytes.
template <GMajor M>
__device__ __forceinline__ uint32_t swizzled_offset(int mn, int k) {
  if constexpr (M == GMajor::K) {
    return mn * 128 + ((((k >> 3) ^ (mn & 7))) << 4) + (k & 7) * 2;
  } else {
    return ((mn >> 6) + (kBM / 64) * (k >> 3)) * 1024 + (k & 7) * 128 +
           ((((mn & 63) >> 3) ^ (k & 7)) << 4) + (mn & 7) * 2;
  }
}
static_assert(kBM == kBN, "swizzled_offset's MN-major form assumes 128-wide operand tiles");

// ---- operand loaders --------------------------------------------------------------------------
// Each thread copies four 16-byte chunks of every (128 x 64) operand tile.

// K-major operand: tile row i (an M or N index) is a run of K-contiguous elements in global
// memory starting at an arbitrary address (gathered token rows, gate/up rows of w1, ...).
// Thread t copies chunk (t % 8) of rows t / 8 + 32 j, j = 0..3: a warp reads 4 whole 128-byte rows.
struct KMajorLoader {
  const __nv_bfloat16* row[4];  // row start in global memory; nullptr: the row is zero-filled
  const __nv_bfloat16* any;     // a valid address for the zero-filling copies
  uint32_t soff[4];             // byte offset of the chunk inside a stage
  int col;                      // element offset of this thread's chunk inside the K step

  static __device__ __forceinline__ int tile_row(int tid, int j) { return (tid >> 3) + 32 * j; }

  template <class RowFn>
  __device__ __forceinline__ void init(int tid, const __nv_bfloat16* any_, RowFn row_of) {
    col = (tid & 7) * 8;
    any = any_;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      row[j] = row_of(tile_row(tid, j));
      soff[j] = swizzled_offset<GMajor::K>(tile_row(tid, j), col);
    }
  }
  __device__ __forceinline__ void load(int kt, uint32_t stage_addr) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const bool ok = row[j] != nullptr;
      cp_async_16(stage_addr + soff[j], ok ? row[j] + kt * kBK + col : any, ok);
    }
  }
};

// MN-major operand: tile row r is reduction index k, and its 128 MN elements are contiguous in
// global memory: src[row(k) * ld + mn0 + 0..127], with row(k) = gather[k] or k. k runs over
// [k_begin, k_end) (an expert's slots for varlen-K, [0, K) for a weight read N-major).
// Thread t copies chunk (t % 16) of rows t / 16 + 16 j: a warp reads 2 whole 256-byte rows.
// The gathered row ids of the next tile are loaded one step early, so the index loads' latency
// hides behind the MMA instead of stalling the copy issue.
struct MNMajorLoader {
  const __nv_bfloat16* src;
  int64_t ld;
  const int32_t* gather;  // (k_end,) or nullptr
  int k_begin, k_end;
  int r0;                 // first tile row of this thread
  int col;                // mn0 + chunk * 8
  bool col_ok;            // col < MN extent (N/M tails)
  int next_row[4];        // source row of each chunk of the next tile; -1: zero fill
  uint32_t soff[4];

  __device__ __forceinline__ void init(int tid, const __nv_bfloat16* src_,
                                       int64_t ld_, const int32_t* gather_, int k_begin_,
                                       int k_end_, int mn0, int mn_extent) {
    src = src_;
    ld = ld_;
    gather = gather_;
    k_begin = k_begin_;
    k_end = k_end_;
    r0 = tid >> 4;
    const int chunk_mn = (tid & 15) * 8;
    col = mn0 + chunk_mn;
    col_ok = col < mn_extent;
#pragma unroll
    for (int j = 0; j < 4; ++j) soff[j] = swizzled_offset<GMajor::MN>(chunk_mn, r0 + 16 * j);
    prefetch(0);
  }
  __device__ __forceinline__ void prefetch(int kt) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int k = k_begin + kt * kBK + r0 + 16 * j;
      next_row[j] = (col_ok && k < k_end) ? (gather ? __ldg(gather + k) : k) : -1;
    }
  }
  // Tiles must be loaded in order 0, 1, 2, ... (the prefetch assumes it).
  __device__ __forceinline__ void load(int /*kt*/, uint32_t stage_addr) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const bool ok = next_row[j] >= 0;
      cp_async_16(stage_addr + soff[j], ok ? src + int64_t(next_row[j]) * ld + col : src, ok);
    }
  }
  __device__ __forceinline__ void advance(int kt) { prefetch(kt + 1); }
};

// K-major operand loaded by TMA (the weights of the up-projection): the (128 x 64) tile is two
// 64-row halves, each one TMA box of 64 rows x 64 K elements with 128-byte swizzle, which is
// exactly the GMMA K-SW128 layout of rows [0, 64) resp. [64, 128) of a stage (8 KiB apart). The
// rows are rows of the 2D view (E * rows_per_expert, K) of the stacked weights, so a half can
// start at any multiple of 64 rows (gate rows j0.., up rows n + j0..). One thread issues both
// boxes and arms the stage's mbarrier with their byte count; every thread waits on it before
// the stage's MMA (TmaKMajorLoader::wait). Stage reuse is ordered by the mainloop's
// __syncthreads, as for the cp.async loaders.
struct TmaKMajorLoader {
  const void* desc;  // CUtensorMap in kernel-parameter space (the kernel's __grid_constant__ arg)
  uint64_t* mbar;    // (kStages,) in shared memory, initialised by init_barriers
  int row[2];        // first row of each 64-row half in the 2D view
  static constexpr uint32_t kBoxBytes = 64 * kBK * 2;

  // Thread 0 initialises the barriers; the caller's next __syncthreads publishes them.
  __device__ __forceinline__ void init_barriers() {
    if (threadIdx.x == 0) {
#pragma unroll
      for (int s = 0; s < kStages; ++s) cutlass::arch::ClusterTransactionBarrier::init(&mbar[s], 1);
      cutlass::arch::fence_barrier_init();
    }
  }
  __device__ __forceinline__ void load(int kt, int stage, uint32_t stage_addr) {
    if (threadIdx.x != 0) return;
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&mbar[stage], 2 * kBoxBytes);
    char* dst = reinterpret_cast<char*>(__cvta_shared_to_generic(stage_addr));
#pragma unroll
    for (int h = 0; h < 2; ++h)
      cute::SM90_TMA_LOAD_2D::copy(desc, &mbar[stage],
                                   static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL),
                                   dst + h * kBoxBytes, kt * kBK, row[h]);
  }
  // Tile kt (in stage kt % kStages, that stage's (kt / kStages)-th use) has landed.
  __device__ __forceinline__ void wait(int kt, int stage) const {
    cutlass::arch::ClusterTransactionBarrier::wait(&mbar[stage], (kt / kStages) & 1);
  }
};

template <class L>
__device__ __forceinline__ void loader_load(L& l, int kt, int stage, uint32_t stage_addr) {
  if constexpr (std::is_same_v<L, TmaKMajorLoader>) {
    l.load(kt, stage, stage_addr);
  } else {
    l.load(kt, stage_addr);
    if constexpr (std::is_same_v<L, MNMajorLoader>) l.advance(kt);
  }
}
// Before the MMA of tile kt: the TMA loader's data has arrived (cp.async ones are covered by
// cp.async.wait_group + __syncthreads).
template <class L>
__device__ __forceinline__ void loader_wait(const L& l, int kt, int stage) {
  if constexpr (std::is_same_v<L, TmaKMajorLoader>) l.wait(kt, stage);
}

// ---- the mainloop -----------------------------------------------------------------------------
// acc (this thread's fragment of the 128 x 128 fp32 tile) = sum over num_k_tiles K steps of A·Bᵀ.
// Stage reuse without producer/consumer barriers: at step kt every thread has passed
// warpgroup_wait<kMmaInFlight>() of step kt-1 (so the MMAs of step kt-1-kMmaInFlight are done in
// both warpgroups) before the __syncthreads() of step kt, after which that step's stage is
// refilled with tile kt + kLookahead.
template <class Cfg, int kMmaInFlight, class LoaderA, class LoaderB, class Acc>
__device__ __forceinline__ void mainloop(char* smem, LoaderA& la, LoaderB& lb, int num_k_tiles,
                                         Acc& acc) {
  using namespace cute;
  constexpr int kLookahead = lookahead<kMmaInFlight>();
  typename Cfg::TiledMma mma;
  Tensor sA = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(smem)),
                          typename Cfg::SmemLayoutA{});  // (BM, BK, stages)
  Tensor sB = make_tensor(
      make_smem_ptr(reinterpret_cast<Elem*>(smem + kStages * Cfg::kStageBytesA)),
      typename Cfg::SmemLayoutB{});  // (BN, BK, stages)
  auto thr = mma.get_slice(threadIdx.x);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // GMMA descriptors
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
  const uint32_t a_base = smem_u32(smem);
  const uint32_t b_base = a_base + kStages * Cfg::kStageBytesA;

  clear(acc);
#pragma unroll
  for (int s = 0; s < kLookahead; ++s) {
    if (s < num_k_tiles) {
      loader_load(la, s, s, a_base + s * Cfg::kStageBytesA);
      loader_load(lb, s, s, b_base + s * Cfg::kStageBytesB);
    }
    cp_async_commit();  // empty groups keep the wait count below uniform
  }

  int read_stage = 0;
  int write_stage = kLookahead;
  for (int kt = 0; kt < num_k_tiles; ++kt) {
    cp_async_wait<kLookahead - 1>();  // this thread's copies of tile kt have landed
    fence_proxy_async_smem();
    __syncthreads();  // ... and everybody's; the MMAs that read the stage refilled below are done
    const int kn = kt + kLookahead;
    if (kn < num_k_tiles) {
      loader_load(la, kn, write_stage, a_base + write_stage * Cfg::kStageBytesA);
      loader_load(lb, kn, write_stage, b_base + write_stage * Cfg::kStageBytesB);
    }
    cp_async_commit();
    write_stage = write_stage + 1 == kStages ? 0 : write_stage + 1;

    loader_wait(la, kt, read_stage);
    loader_wait(lb, kt, read_stage);
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    cute::gemm(mma, tCrA(_, _, _, read_stage), tCrB(_, _, _, read_stage), acc);
    warpgroup_commit_batch();
    warpgroup_wait<kMmaInFlight>();
    warpgroup_fence_operand(acc);
    read_stage = read_stage + 1 == kStages ? 0 : read_stage + 1;
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
  cp_async_wait<0>();
}

// Where this thread's accumulators sit in the 128 x 128 tile (SM90 WGMMA C fragment of a
// 64 x 128 atom, two atoms stacked along M): element (v0, v1, i), stored at acc(v0 + 2 v1 + 4 i),
// is row frag_row(v1), column frag_col(i) + v0. Each thread holds pairs of adjacent columns.
__device__ __forceinline__ int frag_row(int v1) {
  const int t = threadIdx.x;
  return 64 * (t >> 7) + 16 * ((t >> 5) & 3) + ((t & 31) >> 2) + 8 * v1;
}
__device__ __forceinline__ int frag_col(int i) { return 8 * i + 2 * (threadIdx.x & 3); }
constexpr int kFragColGroups = kBN / 8;  // i = 0..15
// The same as a fragment policy (act_epilogue.cuh).
struct TwoCtaFrag {
  static constexpr int kTileN = kBN;
  static constexpr int kGroups = kFragColGroups;
  static constexpr int kRows = 2;
  __device__ static int row(int r) { return frag_row(r); }
  __device__ static int col(int i) { return frag_col(i); }
  __device__ static constexpr int acc_index(int r, int i) { return 4 * i + 2 * r; }
};

// bf16x2 (x rounded into the low half) packed as the 32-bit word a vector access moves.
__device__ __forceinline__ uint32_t pack_bf16x2(float x, float y) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ void store_bf16x2(__nv_bfloat16* p, float x, float y) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
}
__device__ __forceinline__ float2 load_bf16x2(const __nv_bfloat16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}

// ---- varlen-M tile scheduler ------------------------------------------------------------------
// Expert e owns ceil(count_e / kBM) m-tiles; tiles are numbered expert by expert. The CTA asking
// for m-tile `tile` learns (expert, m-tile within the expert) from a block-wide scan of the tile
// counts, read on the device from expert_token_offsets. Returns false (for the whole block) when
// `tile` is beyond the last one: the grid is sized from the host-known bound
// ceil(S / kBM) + E >= sum_e ceil(count_e / kBM).
__device__ __forceinline__ bool find_expert_tile(const int32_t* __restrict__ offsets, int E,
                                                 int tile, int& expert, int& m_tile) {
  __shared__ int s_expert, s_m_tile;
  __shared__ int s_warp_sum[kThreads / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) s_expert = -1;
  __syncthreads();
  int running = 0;  // tiles of experts [0, base)
  for (int base = 0; base < E; base += kThreads) {
    const int e = base + tid;
    const int cnt = e < E ? (offsets[e + 1] - offsets[e] + kBM - 1) / kBM : 0;
    int incl = cnt;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    if (lane == 31) s_warp_sum[warp] = incl;
    __syncthreads();
    int before = 0, total = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) {
      const int v = s_warp_sum[w];
      before += w < warp ? v : 0;
      total += v;
    }
    incl += running + before;
    if (cnt > 0 && tile >= incl - cnt && tile < incl) {
      s_expert = e;
      s_m_tile = tile - (incl - cnt);
    }
    running += total;
    __syncthreads();  // s_warp_sum is rewritten next round; s_expert is visible after this
    if (running > tile) break;
  }
  expert = s_expert;
  m_tile = s_m_tile;
  return expert >= 0;
}

// ---- tile rasterization --------------------------------------------------------------------
// The order in which consecutive CTAs (roughly: the CTAs resident at one time) walk an
// m_tiles x n_tiles grid of output tiles, which decides what the L2 cache can share between
// them. The grid is cut into bands of `group` consecutive m-tiles; a band is swept n-tile by
// n-tile with its m-tiles innermost, so the ~264 resident CTAs (132 SMs x 2) cover about
// group x (264 / group) tiles and each A row-panel and B column-panel loaded from DRAM is reused
// by ~264 / group and ~group CTAs. group = 1 is the row-major order (one m-tile, all its
// n-tiles): on a GEMM with many n-tiles (up-proj: 128) only 2 m-tiles are resident at once and
// every B panel is fetched once per 2 m-tiles. The result is independent of the order (each
// tile is computed alone), so any group gives bitwise the same output.
__device__ __forceinline__ void raster_tile(int linear, int m_tiles, int n_tiles, int group,
                                            int& m_tile, int& n_tile) {
  const int band_tiles = group * n_tiles;  // group <= m_tiles (host-clamped): fits int
  const int band = linear / band_tiles;
  const int first_m = band * group;
  const int band_m = min(group, m_tiles - first_m);  // the last band may be narrower
  const int local = linear - band * band_tiles;
  m_tile = first_m + local % band_m;
  n_tile = local / band_m;
}

// The band height a launcher passes to raster_tile: the host's choice (group) clamped to
// [1, m_tiles], so that group * n_tiles <= m_tiles * n_tiles fits the grid's int range.
inline int clamp_raster_group(int group, int64_t m_tiles) {
  const int64_t g = group;
  return static_cast<int>(g < m_tiles ? g : (m_tiles > 0 ? m_tiles : 1));
}

__device__ __forceinline__ char* align_smem_1k(char* p) {
  const uint32_t a = smem_u32(p);
  return p + ((1024u - (a & 1023u)) & 1023u);
}

}  // namespace moeblaze::cuda::gemm::sm90
