// Warp-specialised, persistent varlen-K grouped GEMM (sm_90a), the weight gradients:
//   out[e] (M x N) = sum over slots r of expert e of P[token(r), :]ᵀ ⊗ Q[r, :]
// P is gathered (its row = the slot's token, through expert_token_indices), Q is contiguous (its
// row = the slot). (dW1's gathered operand is its wide one, so dW1 is computed transposed:
// kTransposed.) The reduction runs over the expert's slots
// [off[e], off[e+1]), read on the device. The machinery of the gathered varlen-M kernel
// (pipeline/sm90_ws_pipeline.cuh: one CTA per SM, a producer warpgroup, two cooperative consumer
// warpgroups on a 128 x 256 tile, a 4-stage mbarrier ring), with both operands MN-major (one
// slot is one K row of 128 (P) or 256 (Q) contiguous elements):
//   * P, 128 columns per tile, is copied by the producer warpgroup's cp.async, its row ids loaded
//     one stage ahead (so their latency hides behind the copies of the stage before), rows past
//     the expert's slots zero-filled. The producer issues every one of a stage's copies, so its
//     instructions per stage bound the stage rate: a whole stage takes one 32-bit multiply-add
//     per row for the address (row bytes < 2^31) and smem offsets fixed per thread
//     (lean_copy_p); only an expert's partial last stage takes the predicated, zero-filling copy;
//   * Q, 256 columns per tile, comes by TMA (64-column x 64-slot boxes of the 2D (S, N) view),
//     except in an expert's last, partial K step: there its rows past the expert's end would be
//     the next expert's, so the producer copies that step with cp.async and zero fill instead
//     (a zero row times a finite row is an exact zero, but 0 x Inf is not: no reliance on it).
// Both operands' stages are ordered K-blocks first (Step<_2,_1,_3>): MN columns [64 h, 64 h + 64)
// of a stage are 8 KiB holding each of the 64 k as one 128-byte line, 16-byte chunks swizzled by
// k % 8 — the layout of one TMA box with 128-byte swizzle, which the cp.async copies reproduce
// (kfirst_offset). Tiles are (expert, m-tile, n-tile), expert by expert, raster_tile's order
// within an expert; an expert with no slot gets zeros. The epilogue stores 16 bytes per lane
// (varlen_k_store), or, with kTmaStore, leaves through shared memory by TMA store
// (varlen_k_store_tma). A 2-CTA cluster variant (kCluster = 2, dW1 where experts have many rows)
// shares Q's stages between two m-tiles by TMA multicast.
#pragma once

#include <cuda.h>  // CUtensorMap

#include "cuda/cuda_backend.hpp"
#include "cuda/gemm/epilogues/quad_transpose.cuh"
#include "cuda/gemm/pipeline/sm90_tma_desc.cuh"  // make_tma_kmajor
#include "cuda/gemm/pipeline/sm90_ws_pipeline.cuh"
#include "cuda/pdl.cuh"
#include "moeblaze/error.hpp"
#include "moeblaze/routing_plan.hpp"

namespace moeblaze::cuda::gemm::sm90::ws {

struct VarlenKArgs {
  const __nv_bfloat16* p;   // (rows, M) gathered operand
  const __nv_bfloat16* q;   // (S, N) contiguous operand
  const int32_t* gather;    // (S,) slot -> row of p
  const int32_t* offsets;   // (E+1,)
  int E, M, N;
  int m_tiles, n_tiles;     // ceil(M / kBM), ceil(N / kBN)
  int raster_group;         // band height of raster_tile within an expert
  __nv_bfloat16* out;       // (E, M, N), or (E, N, M) for the kernel's kTransposed
  CUtensorMap tma;          // q as a 2D (S, N) tensor, 64 x 64 boxes
  CUtensorMap out_tma;      // kTmaStore: out as a 3D (E, rows, cols) tensor, 64 x 64 boxes
};

// Args for out (E, M, N) = per expert P[token]ᵀ ⊗ Q[slot] over the plan (M, N from the caller).
inline VarlenKArgs varlen_k_args(const RoutingPlanView& plan, const void* p_gathered,
                                 const void* q_slots, int64_t M, int64_t N, void* out) {
  VarlenKArgs a{};
  a.p = static_cast<const __nv_bfloat16*>(p_gathered);
  a.q = static_cast<const __nv_bfloat16*>(q_slots);
  a.gather = plan.expert_token_indices;
  a.offsets = plan.expert_token_offsets;
  a.E = static_cast<int>(plan.E);
  a.M = static_cast<int>(M);
  a.N = static_cast<int>(N);
  a.out = static_cast<__nv_bfloat16*>(out);
  return a;
}

// Byte offset of element (mn, k) in a K-blocks-first MN-major SW128 stage (see above).
__device__ __forceinline__ uint32_t kfirst_offset(int mn, int k) {
  return (mn >> 6) * 8192 + k * 128 + ((((mn & 63) >> 3) ^ (k & 7)) << 4) + (mn & 7) * 2;
}

template <int kStagesN = kStages>
struct VarlenKLayouts {
  static constexpr int kTileN = kBN;
  using TiledMma = decltype(ct::make_tiled_mma(
      ct::SM90_64x256x16_F32BF16BF16_SS<GMajor::MN, GMajor::MN>{},
      ct::Layout<ct::Shape<ct::_2, ct::_1, ct::_1>>{}));
  using Order = ct::Step<ct::_2, ct::_1, ct::_3>;
  using SmemLayoutA = decltype(ct::tile_to_shape(
      ct::GMMA::Layout_MN_SW128_Atom<Elem>{},
      ct::Shape<ct::Int<kBM>, ct::Int<kBK>, ct::Int<kStagesN>>{}, Order{}));  // (BM, BK, stages)
  using SmemLayoutB = decltype(ct::tile_to_shape(
      ct::GMMA::Layout_MN_SW128_Atom<Elem>{},
      ct::Shape<ct::Int<kBN>, ct::Int<kBK>, ct::Int<kStagesN>>{}, Order{}));  // (BN, BK, stages)
};

// The varlen-K kernel's ring: the cooperative one, its stages shared by kCluster CTAs. With
// kTmaStore the epilogue's 64 KiB staging tile takes one stage's place (3 x 48 + 64 KiB).
constexpr int kVkTmaStoreStages = 3;
constexpr size_t kVkStagingBytes = size_t(kBM) * kBN * 2;  // (2 warpgroups, 4 boxes, 64, 64) bf16
template <int kCluster, bool kTmaStore = false>
using VarlenKRing =
    RingT<kBN, kTmaStore ? kVkTmaStoreStages : kStages, kConsumerThreads, kCluster>;
template <int kCluster, bool kTmaStore>
constexpr size_t varlen_k_smem_bytes() {
  return VarlenKRing<kCluster, kTmaStore>::kBytes + (kTmaStore ? 1024 + kVkStagingBytes : 0);
}
static_assert(varlen_k_smem_bytes<1, true>() <= 227 * 1024, "staging tile + 3 stages fit");

// Registers after setmaxnreg: 128 x 88 + 256 x 208 = 64512. The producer holds 8 row ids
// of the next stage besides the current ones.
constexpr int kVkProducerRegs = 88;
constexpr int kVkConsumerRegs = 208;

// Copies one stage's share of an MN-major operand of kCols columns (128 or 256) by cp.async:
// thread t copies chunk t % (kCols / 8) of k-rows t / (kCols / 8) + j * (1024 / kCols) ... i.e.
// kRows = kCols / 16 rows per thread; row[j] is the source row (-1: zero fill).
template <int kCols>
struct MnCopy {
  static constexpr int kChunks = kCols / 8;             // 16-byte chunks per k-row
  static constexpr int kStep = kProducerThreads / kChunks;  // k-rows covered per pass
  static constexpr int kRows = kBK / kStep;                 // rows per thread
  __device__ static int first_row() { return threadIdx.x / kChunks; }
  __device__ static int chunk() { return threadIdx.x % kChunks; }
  __device__ static void copy(uint32_t stage, const __nv_bfloat16* src, int64_t ld, int col0,
                              const int (&row)[kRows]) {
    const int c = chunk(), r0 = first_row();
#pragma unroll
    for (int j = 0; j < kRows; ++j)
      cp_async_16(stage + kfirst_offset(c * 8, r0 + kStep * j),
                  row[j] >= 0 ? src + int64_t(row[j]) * ld + col0 + c * 8 : src, row[j] >= 0);
  }
};

// A whole stage of P (every row of it valid): thread t's row j, at k-row first_row() + kStep j,
// lands at chunk_off + j * kStep * 128 (kStep = 8: the swizzle, k % 8, is the same for every j)
// and comes from src_col + row[j] * row_bytes, src_col the thread's 16-byte column chunk.
template <class Copy>
__device__ __forceinline__ void lean_copy_p(uint32_t stage, uint32_t chunk_off, const char* src_col,
                                            int row_bytes, const int (&row)[Copy::kRows]) {
  static_assert(Copy::kStep % 8 == 0, "one swizzle phase for all of a thread's rows");
#pragma unroll
  for (int j = 0; j < Copy::kRows; ++j)
    cp_async_16(stage + chunk_off + j * Copy::kStep * 128, src_col + mul_wide(row[j], row_bytes),
                true);
}

// movmatrix: the 8 x 8 bf16 matrix a warp holds in the MMA fragment layout (lane l: row l / 4,
// columns 2 (l % 4), + 1, one 32-bit word) transposed, in the same layout.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t a) {
  uint32_t d;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(a));
  return d;
}

// The epilogue: a consumer thread's fp32 accumulators (WsFrag: rows ws_frag_row(v1), column
// pairs ws_frag_col(i)) stored as bf16 into out[e], 16 bytes per lane and store (the plain
// fragment stores, 4 bytes per lane and 2 for the transposed tile, half-fill each 32-byte sector
// they touch, and the GEMM pays for it;
// docs/notes/varlen-k-weight-gradients.md):
//   row-major (M, N): quads of column groups, a quad transpose (quad_transpose.cuh) gives each
//     lane one whole 8-column group of its row: 16 bytes.
//   transposed (N, M): per column group i and row half v1 the warp holds an 8 x 8 block (rows m,
//     columns n); movmatrix transposes it, so lane (r8, q) holds out row n = col(i) - 2q + r8,
//     m pair 2q; the four blocks (i0, i0 + 1) x (v1 = 0, 1) then quad-transposed give lane q
//     16 contiguous bytes: out row n0 + 8 (i0 + q / 2) + r8, m = the warp's 16 rows' half q % 2.
//     A warp's store covers 16 rows n of 32 contiguous bytes each: full sectors.
// M and N are multiples of 64; nothing past them is stored.
template <bool kTransposed, class Acc>
__device__ __forceinline__ void varlen_k_store(const VarlenKArgs& p, Acc& acc, int expert,
                                               int m_tile, int n_tile) {
  __nv_bfloat16* out = p.out + int64_t(expert) * p.M * p.N;
  const int m0 = m_tile * kBM, n0 = n_tile * kBN;
  const int lane = threadIdx.x & 31, q = lane & 3;
  if constexpr (kTransposed) {
    // The warp's 16 rows m start at ws_frag_row(0) - lane / 4.
    const int m = m0 + ws_frag_row(0) - (lane >> 2) + 8 * (q & 1);
    const bool m_ok = m < p.M;
#pragma unroll
    for (int i0 = 0; i0 < kFragColGroups; i0 += 2) {
      uint32_t w[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {  // block (i0 + k / 2, v1 = k % 2)
        const int e = 4 * (i0 + (k >> 1)) + 2 * (k & 1);
        w[k] = movmatrix_trans(pack_bf16x2(acc(e), acc(e + 1)));
      }
      quad_transpose(w);
      const int n = n0 + 8 * (i0 + (q >> 1)) + (lane >> 2);
      if (m_ok && n < p.N)
        *reinterpret_cast<uint4*>(out + int64_t(n) * p.M + m) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  } else {
#pragma unroll
    for (int v1 = 0; v1 < 2; ++v1) {
      const int m = m0 + ws_frag_row(v1);
#pragma unroll
      for (int i0 = 0; i0 < kFragColGroups; i0 += 4) {
        uint32_t w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k)
          w[k] = pack_bf16x2(acc(4 * (i0 + k) + 2 * v1), acc(4 * (i0 + k) + 2 * v1 + 1));
        quad_transpose(w);
        const int n = n0 + 8 * (i0 + q);
        if (m < p.M && n < p.N)
          *reinterpret_cast<uint4*>(out + int64_t(m) * p.N + n) =
              make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
  }
}

// The epilogue through shared memory (kTmaStore): each consumer warpgroup w writes its 64 rows
// of the tile as bf16 into its 32 KiB of `staging`, four 64 x 64 boxes in the 128-byte swizzle
// of a TMA box (16-byte chunk c of box row r at r * 128 + (c ^ r % 8) * 16), and one thread of it
// stores them by TMA and does not wait: the stores drain under the next tile's MMAs, where the
// plain stores held every CTA until its tile was written (docs/notes/varlen-k-weight-gradients.md,
// "Few rows an expert"). Before writing the staging tile again, that thread waits until its
// previous stores have read it (cp.async.bulk.wait_group.read). Same values, same bits as
// varlen_k_store.
// The fragment goes to shared memory by stmatrix, four 8 x 8 blocks an instruction: block
// (i, v1) is the warp's rows 8 v1 .. + 8 of its 16, columns 8 i .. + 8, and a lane holds its
// row lane / 4, columns 2 (lane % 4), + 1 (the WGMMA fragment is stmatrix's). Lane L gives the
// address of row L % 8 of block L / 8; those 8 rows differ in r % 8, so each 8-lane phase
// meets 8 different bank groups.
//   row-major (M, N): box j of warpgroup w is rows m0 + 64 w .. + 64, columns n0 + 64 j .. + 64;
//     a block row is 8 columns n of one row m: box row = m, chunk = i % 8.
//   transposed (N, M): box j is out rows n0 + 64 j .. + 64, columns m0 + 64 w .. + 64;
//     stmatrix.trans writes a block's column as a row: box row = n = 8 i + L % 8, chunk = the
//     block's 8 rows m.
// Boxes wholly past M or N (multiples of 64) are not stored.
template <bool kTransposed, class Acc>
__device__ __forceinline__ void varlen_k_store_tma(const VarlenKArgs& p, Acc& acc, int expert,
                                                   int m_tile, int n_tile, char* staging) {
  const int t = threadIdx.x - kProducerThreads, w = t >> 7, warp = (t >> 5) & 3;
  const bool issuer = (t & 127) == 0;
  const int lane = threadIdx.x & 31, rho = lane & 7, blk = lane >> 3;
  char* mine = staging + w * (4 * kBoxBytes);
  const uint32_t base = smem_u32(mine);
  if (issuer) cute::tma_store_wait<0>();  // the previous tile's stores have read `mine`
  cutlass::arch::NamedBarrier::sync(128, 1 + w);
#pragma unroll
  for (int i = 0; i < kFragColGroups; i += 2) {
    uint32_t v[4];  // blocks (i, 0), (i, 1), (i + 1, 0), (i + 1, 1)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int e = 4 * (i + (k >> 1)) + 2 * (k & 1);
      v[k] = pack_bf16x2(acc(e), acc(e + 1));
    }
    const int ii = i + (blk >> 1), vv = blk & 1;  // this lane's address: block (ii, vv)
    int r, c;
    if constexpr (kTransposed) {
      r = 8 * (ii & 7) + rho;
      c = 2 * warp + vv;
    } else {
      r = 16 * warp + 8 * vv + rho;
      c = ii & 7;
    }
    const uint32_t a = base + (ii >> 3) * kBoxBytes + r * 128 + ((c ^ (r & 7)) << 4);
    if constexpr (kTransposed)
      asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(a),
                   "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]));
    else
      asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(a),
                   "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]));
  }
  cute::tma_store_fence();  // this thread's shared-memory writes, visible to the TMA unit
  cutlass::arch::NamedBarrier::sync(128, 1 + w);
  if (issuer) {
    const int m_box = m_tile * kBM + 64 * w;  // this warpgroup's 64 of M
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int n_box = n_tile * kBN + 64 * j;
      if (m_box >= p.M || n_box >= p.N) continue;
      if constexpr (kTransposed)
        cute::SM90_TMA_STORE_3D::copy(&p.out_tma, mine + j * kBoxBytes, m_box, n_box, expert);
      else
        cute::SM90_TMA_STORE_3D::copy(&p.out_tma, mine + j * kBoxBytes, n_box, m_box, expert);
    }
    cute::tma_store_arrive();
  }
}

// kTransposed: out[e] is stored as (N, M) instead of (M, N), so a GEMM whose gathered operand is
// the wide one can be computed transposed with the gathered operand as the 128-wide P (dW1).
// kCluster: CTAs per cluster (1 or 2). With 2, a cluster computes the two m-tiles 2 g, 2 g + 1
// of one (expert, n-tile): Q's stage is the same for both, and each CTA loads half of its TMA
// boxes multicast into both CTAs, halving Q's reads from L2 (P, gathered by cp.async, stays per
// CTA). When m_tiles is odd the last cluster's second CTA has no m-tile: it reads zero rows of P,
// takes part in the loads and barriers, and stores nothing. An expert's partial last K step is
// copied by each CTA for itself (cp.async), as without a cluster.
// kTmaStore: the epilogue leaves through shared memory by TMA store (varlen_k_store_tma), the
// ring one stage shorter; one CTA per tile only.
template <bool kTransposed, int kCluster, bool kTmaStore = false>
__global__ void __launch_bounds__(kThreads, 1) varlen_k_ws_kernel(const __grid_constant__
                                                                  VarlenKArgs p) {
  static_assert(kCluster == 1 || !kTmaStore, "the TMA-store epilogue is built for one CTA a tile");
  pdl_wait();  // before any global memory access (src/cuda/pdl.cuh)
  pdl_launch_dependents();
  using namespace cute;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  using R = VarlenKRing<kCluster, kTmaStore>;
  using L = VarlenKLayouts<R::kStageCount>;
  using CopyG = MnCopy<kBM>;  // P, gathered
  using CopyC = MnCopy<kBN>;  // Q, contiguous (an expert's partial last K step only)
  constexpr int kBoxesC = kBN / kBox;          // TMA boxes of a Q stage
  constexpr int kBoxesOwn = kBoxesC / kCluster;  // of which this CTA loads
  extern __shared__ char smem_raw[];
  const R ring = R::carve(smem_raw);
  char* const staging = kTmaStore ? align_smem_1k(ring.end()) : nullptr;  // (2, 4, 64, 64) bf16
  ring.init_barriers();
  // The cluster's barriers are initialised before any CTA multicasts into, or arrives on, them.
  if constexpr (kCluster > 1) cute::cluster_sync(); else __syncthreads();
  const int rank = kCluster > 1 ? static_cast<int>(cute::block_rank_in_cluster()) : 0;
  const int first = blockIdx.x / kCluster, stride = gridDim.x / kCluster;
  const int m_groups = (p.m_tiles + kCluster - 1) / kCluster;  // m-tiles of a cluster: kCluster
  const int tiles_per_expert = m_groups * p.n_tiles;
  const int num_tiles = p.E * tiles_per_expert;  // cluster tiles
  auto decode = [&](int t, int& expert, int& m_tile, int& n_tile) {
    expert = t / tiles_per_expert;
    int m_group;
    raster_tile(t - expert * tiles_per_expert, m_groups, p.n_tiles, p.raster_group, m_group,
                n_tile);
    m_tile = m_group * kCluster + rank;
  };

  if (threadIdx.x < kProducerThreads) {
    cutlass::arch::warpgroup_reg_dealloc<kVkProducerRegs>();
    const uint32_t a_base = smem_u32(ring.a), b_base = smem_u32(ring.b);
    const uint32_t g_chunk_off = kfirst_offset(CopyG::chunk() * 8, CopyG::first_row());
    const int g_row_bytes = p.M * 2;  // < 2^31 (launch_varlen_k_ws)
    RingPosT<R::kStageCount> pos;
    for (int t = first; t < num_tiles; t += stride) {
      int expert, m_tile, n_tile;
      decode(t, expert, m_tile, n_tile);
      const int k_begin = p.offsets[expert], k_end = p.offsets[expert + 1];
      const int k_tiles = (k_end - k_begin + kBK - 1) / kBK;
      const int g_col0 = m_tile * kBM, c_col0 = n_tile * kBN;
      const bool g_col_ok = g_col0 + CopyG::chunk() * 8 < p.M;
      const bool c_col_ok = c_col0 + CopyC::chunk() * 8 < p.N;
      // This thread's ids start at k-row first_row() of each stage; its row j of stage kt exists
      // when kStep j < rows_after - kt kBK.
      const int32_t* ids = p.gather + k_begin + CopyG::first_row();
      const int rows_after = k_end - k_begin - CopyG::first_row();
      const char* g_src = reinterpret_cast<const char*>(p.p + g_col0 + CopyG::chunk() * 8);
      int grow[CopyG::kRows];  // gathered rows of the stage about to be copied (-1: zero fill)
      bool g_whole = false;    // all of them exist (lean_copy_p)
      auto fetch = [&](int kt) {
        const int left = rows_after - kt * kBK;
        const int32_t* src = ids + kt * kBK;
        g_whole = g_col_ok && CopyG::kStep * (CopyG::kRows - 1) < left;
        if (g_whole) {  // no predicate per row
#pragma unroll
          for (int j = 0; j < CopyG::kRows; ++j) grow[j] = __ldg(src + CopyG::kStep * j);
        } else {
#pragma unroll
          for (int j = 0; j < CopyG::kRows; ++j)
            grow[j] = (g_col_ok && CopyG::kStep * j < left) ? __ldg(src + CopyG::kStep * j) : -1;
        }
      };
      if (k_tiles > 0) fetch(0);
      for (int kt = 0; kt < k_tiles; ++kt) {
        const int stage = pos.stage;
        Barrier::wait(&ring.empty[stage], pos.phase ^ 1);
        const uint32_t sa = a_base + stage * kStageBytesA, sb = b_base + stage * kStageBytesB;
        const int k0 = k_begin + kt * kBK;
        if (k0 + kBK <= k_end) {  // a whole K step: the contiguous operand by TMA
          if (threadIdx.x == 0) {
            // The whole stage lands here: this CTA's boxes and, multicast, the other CTAs'.
            Barrier::arrive_and_expect_tx(&ring.full[stage], kBoxesC * kBoxBytes);
            char* dst = ring.b + stage * kStageBytesB;
#pragma unroll
            for (int j = 0; j < kBoxesOwn; ++j) {
              const int h = rank * kBoxesOwn + j;
              if constexpr (kCluster == 1)
                SM90_TMA_LOAD_2D::copy(&p.tma, &ring.full[stage],
                                       static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL),
                                       dst + h * kBoxBytes, c_col0 + h * kBox, k0);
              else
                SM90_TMA_LOAD_MULTICAST_2D::copy(
                    &p.tma, &ring.full[stage], static_cast<uint16_t>((1u << kCluster) - 1),
                    static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL), dst + h * kBoxBytes,
                    c_col0 + h * kBox, k0);
            }
          }
        } else {  // the expert's partial last step: cp.async with zero fill past k_end
          int crow[CopyC::kRows];
#pragma unroll
          for (int j = 0; j < CopyC::kRows; ++j) {
            const int k = k0 + CopyC::first_row() + CopyC::kStep * j;
            crow[j] = (c_col_ok && k < k_end) ? k : -1;
          }
          CopyC::copy(sb, p.q, p.N, c_col0, crow);
          if (threadIdx.x == 0) Barrier::arrive(&ring.full[stage]);
        }
        if (g_whole)
          lean_copy_p<CopyG>(sa, g_chunk_off, g_src, g_row_bytes, grow);
        else
          CopyG::copy(sa, p.p, p.M, g_col0, grow);
        cutlass::arch::cpasync_barrier_arrive_noinc(&ring.full[stage]);
        if (kt + 1 < k_tiles) fetch(kt + 1);
        pos.advance();
      }
    }
  } else {
    int expert, m_tile, n_tile;
    consumer_loop<L, kVkConsumerRegs>(
        ring, first, stride, num_tiles,
        [&](int t) {
          decode(t, expert, m_tile, n_tile);
          return (p.offsets[expert + 1] - p.offsets[expert] + kBK - 1) / kBK;
        },
        [&](int, auto& acc) {
          if constexpr (kTmaStore)
            varlen_k_store_tma<kTransposed>(p, acc, expert, m_tile, n_tile, staging);
          else
            varlen_k_store<kTransposed>(p, acc, expert, m_tile, n_tile);
        });
    // The last stores complete (not only read their staging) before the CTA leaves.
    if constexpr (kTmaStore)
      if (((threadIdx.x - kProducerThreads) & 127) == 0)
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
  // No CTA leaves while another may still multicast into it or arrive on its barriers.
  if constexpr (kCluster > 1) cute::cluster_sync();
}

// S: rows of q (the plan's slots); raster_group: the host's band height (dispatch/raster.hpp).
template <bool kTransposed, int kCluster, bool kTmaStore = false>
void launch_varlen_k_ws(const VarlenKArgs& a, int64_t S, int raster_group, cudaStream_t stream) {
  VarlenKArgs q = a;
  q.m_tiles = (a.M + kBM - 1) / kBM;
  q.n_tiles = (a.N + kBN - 1) / kBN;
  const int64_t m_groups = (q.m_tiles + kCluster - 1) / kCluster;
  const int64_t tiles = int64_t(a.E) * m_groups * q.n_tiles;
  MOEBLAZE_UNSUPPORTED_IF(tiles > int64_t(INT32_MAX), "weight-gradient GEMM of ", tiles,
                          " tiles exceeds 2^31 - 1");
  MOEBLAZE_UNSUPPORTED_IF(int64_t(a.M) * 2 > int64_t(INT32_MAX), "weight-gradient GEMM: rows of ",
                          a.M, " bf16 elements exceed the gathered copy's 32-bit row stride");
  q.raster_group = clamp_raster_group(raster_group, m_groups);
  // q: rows = slots. With S = 0 every expert is empty and nothing is read
  // (its operands may be null), but a descriptor needs a valid address: the output's first
  // 64 x 64 elements stand in.
  q.tma = S > 0 ? make_tma_kmajor(a.q, S, a.N) : make_tma_kmajor(a.out, 1, 64);
  // out as (E, rows, cols): (E, M, N), or (E, N, M) transposed; M, N multiples of 64.
  if constexpr (kTmaStore)
    q.out_tma = kTransposed ? make_tma_store_3d(a.out, a.E, a.N, a.M)
                            : make_tma_store_3d(a.out, a.E, a.M, a.N);
  const size_t smem = varlen_k_smem_bytes<kCluster, kTmaStore>();
  auto kernel = &varlen_k_ws_kernel<kTransposed, kCluster, kTmaStore>;
  MOEBLAZE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem)));
  if constexpr (kCluster == 1) {
    const int grid = persistent_grid(tiles);
    launch_kernel(kernel, dim3(grid), dim3(kThreads), smem, stream, 1, q);
  } else {
    // Persistent: as many clusters as can be resident at once, or one per cluster tile when
    // there are fewer (per instantiation; a process's devices are alike).
    static const int resident = resident_clusters(kernel, dim3(kThreads), smem, kCluster);
    MOEBLAZE_UNSUPPORTED_IF(resident <= 0, "weight-gradient GEMM: no ", kCluster,
                            "-CTA cluster of its kernel fits on this device");
    const int64_t clusters = tiles < resident ? tiles : resident;
    launch_kernel(kernel, dim3(static_cast<unsigned>(kCluster * (clusters > 0 ? clusters : 1))),
                  dim3(kThreads), smem, stream, kCluster, q);
  }
}

}  // namespace moeblaze::cuda::gemm::sm90::ws
