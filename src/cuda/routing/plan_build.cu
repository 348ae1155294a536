// The atomic-free routing-plan build on the GPU (MoEBlaze §4.2 without the dense (T, E) map).
//
// Pairs (token-major CSR) are cut into tiles of `tile_pairs` consecutive pairs; a block owns a
// tile and each of its warps a contiguous run of 32·steps pairs inside it.
//   1. count:   every block counts its tile's pairs per expert (per-warp counters in shared
//               memory; a lane's peers, the lanes holding its expert, found by one ballot per id
//               bit, or __match_any_sync where ids have at most 3 bits; one leader lane per
//               expert updates its warp's counter: no two lanes ever write one counter in the
//               same step) and writes the tile's column of counts (E·tiles + 1,) int32,
//               expert-major. It also copies pair_offsets into the plan and checks them.
//   2. scan:    one exclusive scan (CUB DeviceScan, integers: exact) over the expert-major
//               counts gives every (expert, tile) its first slot; entry E·tiles is the total.
//   3. scatter: every block loads its tile's ids and weights into shared memory (coalesced),
//               recounts per warp (keeping each pair's peer mask), turns the counts into per-warp
//               first slots, and gives each pair its slot = first slot of (expert, warp) + its
//               rank among the earlier pairs of the warp with the same expert (popc of the peer
//               mask). The block stages (slot, token, weight) by expert in shared memory and
//               writes each expert's run of slots in one coalesced sweep (stored from each pair,
//               every slot was a 4-byte store into another expert's range, and the L2 paid for
//               each). Where every token has K0 pairs and K0 divides 32 (top-K with K a power of
//               two), a token never straddles a warp step: its token is p >> log2 K0 and a
//               repeated expert is a peer among the token's earlier lanes (no division, no loop
//               over the token's pairs).
// Slots inside an expert therefore follow the pair order, which is the token order: the plan
// is a function of the routing alone (bit-identical to the CPU builders). No atomics, no host
// synchronisation (the counts never leave the device), no allocation: capturable in a graph.
// Pair indices are unsigned 32-bit on the device: P < 2^31 (a plan's slots are int32) and a
// tile reaches at most 2^14 pairs past P.
#include <cub/block/block_scan.cuh>
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <cstdint>

#include "cuda/cuda_backend.hpp"
#include "cuda/routing/plan_build.hpp"
#include "cuda/routing/routing_device.cuh"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda {
namespace {

using detail::kFullMask;
using detail::raise_flag;

constexpr int kUnroll = 8;  // warp steps whose loads are issued together

// Counts the pairs [begin, begin + 32*steps) ∩ [.., end) into this warp's counters cnt (E,).
// Ids come from `ids` indexed relative to `ids_base` (global memory or the block's smem copy).
// Out-of-range ids are skipped (the scatter skips them the same way, so counts and slots agree)
// and raise kFlagExpertOutOfRange when `flags` is given. With kKeepPeers each pair's peer mask
// is kept in peers_out (indexed like ids) for the scatter's second pass over the same steps.
template <bool kKeepPeers>
__device__ __forceinline__ void warp_count(const int32_t* ids, uint32_t ids_base, uint32_t begin,
                                           uint32_t end, int steps, int E, int bits, int32_t* cnt,
                                           int32_t* flags, unsigned* peers_out) {
  const int lane = threadIdx.x & 31;
  for (int s0 = 0; s0 < steps; s0 += kUnroll) {
    if (begin + s0 * 32 >= end) break;  // warp-uniform
    int32_t key[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t p = begin + (s0 + u) * 32 + lane;
      const bool in = s0 + u < steps && p < end;
      const int32_t e = in ? ids[p - ids_base] : -1;
      const bool ok = e >= 0 && e < E;
      if (in && !ok) raise_flag(flags, kFlagExpertOutOfRange);
      key[u] = ok ? e : -1;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t base = begin + (s0 + u) * 32;
      if (s0 + u >= steps || base >= end) break;  // warp-uniform
      // match.any beats the ballots at E <= 8, loses from E = 64 (docs/notes/plan-build.md).
      const unsigned peers = bits <= 3 ? __match_any_sync(detail::kFullMask, key[u])
                                       : detail::match_peers(key[u], bits);
      if constexpr (kKeepPeers) peers_out[base + lane - ids_base] = peers;
      if (key[u] >= 0 && lane == __ffs(peers) - 1) cnt[key[u]] += __popc(peers);
      __syncwarp();
    }
  }
}

// Copies pair_offsets into the plan, checks 0 = off[0] <= ... <= off[T] = P, and clears
// `*uniform_ok` if some off[t] != t*K0 (the scatter then looks tokens up by binary search).
__device__ void copy_check_offsets(const int32_t* __restrict__ pair_offsets, int64_t T, int64_t P,
                                   int32_t K0, int32_t* __restrict__ out_offsets,
                                   int32_t* __restrict__ nonuniform, int32_t* __restrict__ flags) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t <= T; t += stride) {
    const int32_t o = pair_offsets[t];
    out_offsets[t] = o;
    if ((t == 0 && o != 0) || (t == T && o != P) || (t > 0 && pair_offsets[t - 1] > o))
      raise_flag(flags, kFlagBadOffsets);
    if (int64_t(o) != t * K0) *nonuniform = 1;
  }
}

template <int kWarps>
__global__ void __launch_bounds__(kWarps * 32)
plan_count_kernel(const int32_t* __restrict__ pair_experts,  // (P,) int32, token-major
                  const int32_t* __restrict__ pair_offsets,  // (T+1,) int32
                  int64_t T, int64_t P, int E, int bits, int steps, int tiles, int32_t K0,
                  int32_t* __restrict__ counts,              // (E*tiles + 1,) int32, expert-major
                  int32_t* __restrict__ token_pair_offsets,  // (T+1,) int32, plan's copy
                  int32_t* __restrict__ nonuniform,          // (1,) int32, cleared by the host
                  int32_t* __restrict__ flags) {             // (kRoutingFlagCount,) int32
  extern __shared__ int32_t s_cnt[];                         // (kWarps, E) int32
  copy_check_offsets(pair_offsets, T, P, K0, token_pair_offsets, nonuniform, flags);
  if (blockIdx.x == 0 && threadIdx.x == 0) counts[int64_t(E) * tiles] = 0;
  if (int(blockIdx.x) >= tiles) return;

  const int w = threadIdx.x >> 5;
  const uint32_t tile_pairs = uint32_t(kWarps) * 32 * steps;
  const uint32_t tile_begin = uint32_t(blockIdx.x) * tile_pairs;
  const uint32_t tile_end = uint32_t(min(P, int64_t(tile_begin) + tile_pairs));
  for (int i = threadIdx.x; i < kWarps * E; i += blockDim.x) s_cnt[i] = 0;
  __syncthreads();
  const uint32_t wbegin = tile_begin + uint32_t(w) * 32 * steps;
  warp_count<false>(pair_experts, 0, wbegin, tile_end, steps, E, bits, s_cnt + w * E, flags,
                    nullptr);
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t c = 0;
#pragma unroll
    for (int v = 0; v < kWarps; ++v) c += s_cnt[v * E + e];
    counts[int64_t(e) * tiles + blockIdx.x] = c;
  }
}

template <int kWarps>
__global__ void __launch_bounds__(kWarps * 32)
plan_scatter_kernel(const int32_t* __restrict__ pair_experts,  // (P,) int32, token-major
                    const float* __restrict__ pair_weights,    // (P,) fp32, token-major
                    const int32_t* __restrict__ pair_offsets,  // (T+1,) int32
                    int64_t T, int64_t P, int E, int bits, int steps, int tiles, int32_t K0,
                    int k_shift,  // log2 K0 where K0 divides 32, else -1 (host)
                    const int32_t* __restrict__ bases,  // (E*tiles + 1,) first slot of (e, tile)
                    const int32_t* __restrict__ nonuniform,            // (1,) int32
                    int32_t* __restrict__ expert_token_offsets,        // (E+1,) int32
                    int32_t* __restrict__ expert_token_indices,        // (S,) int32, by expert
                    float* __restrict__ slot_weights,                  // (S,) fp32, by expert
                    int32_t* __restrict__ token_expert_indices,        // (S,) int32, token-major
                    int32_t* __restrict__ token_index_map,             // (S,) int32, token-major
                    int32_t* __restrict__ flags) {                     // (kRoutingFlagCount,)
  using BlockScan = cub::BlockScan<int32_t, kWarps * 32>;
  extern __shared__ int32_t smem[];
  const int tile_pairs = kWarps * 32 * steps;
  int32_t* s_cnt = smem;                   // (kWarps, E) int32: counts, then running first slots
  int32_t* s_delta = s_cnt + kWarps * E;   // (E,) int32: first slot - first staged index
  int32_t* s_ids = s_delta + E;            // (tile_pairs,) int32: the tile's expert ids
  float* s_w = reinterpret_cast<float*>(s_ids + tile_pairs);           // (tile_pairs,) weights
  unsigned* s_peers = reinterpret_cast<unsigned*>(s_w + tile_pairs);   // (tile_pairs,) masks
  int32_t* s_oslot = reinterpret_cast<int32_t*>(s_peers + tile_pairs); // (tile_pairs,) staged:
  int32_t* s_otok = s_oslot + tile_pairs;                              //   slot, token, weight
  float* s_ow = reinterpret_cast<float*>(s_otok + tile_pairs);         //   by expert
  __shared__ int32_t s_tok[2];             // token range of the tile (non-uniform CSR only)
  __shared__ typename BlockScan::TempStorage s_scan;

  if (blockIdx.x == 0)
    for (int e = threadIdx.x; e <= E; e += blockDim.x)
      expert_token_offsets[e] = bases[int64_t(e) * tiles];
  if (int(blockIdx.x) >= tiles) return;

  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const uint32_t tile_begin = uint32_t(blockIdx.x) * uint32_t(tile_pairs);
  const uint32_t tile_end = uint32_t(min(P, int64_t(tile_begin) + tile_pairs));
  const bool uniform = K0 > 0 && *nonuniform == 0;
  const bool by_shift = uniform && k_shift >= 0;  // tokens never straddle a warp step

  // The tile's ids and weights, every load issued before the first use.
  for (int i = threadIdx.x; i < kWarps * E; i += blockDim.x) s_cnt[i] = 0;
  for (uint32_t p = tile_begin + threadIdx.x; p < tile_end; p += blockDim.x) {
    const int32_t e = __ldg(pair_experts + p);
    s_ids[p - tile_begin] = e;
    s_w[p - tile_begin] = __ldg(pair_weights + p);
    token_expert_indices[p] = e;
  }
  if (!uniform && threadIdx.x == 0) {
    const int32_t hi = T > 0 ? int32_t(T - 1) : 0;
    s_tok[0] = detail::token_of_pair_search(pair_offsets, int32_t(tile_begin), 0, hi);
    s_tok[1] = detail::token_of_pair_search(pair_offsets, int32_t(tile_end - 1), 0, hi);
  }
  __syncthreads();

  const uint32_t wbegin = tile_begin + uint32_t(w) * 32 * steps;
  warp_count<true>(s_ids, tile_begin, wbegin, tile_end, steps, E, bits, s_cnt + w * E, nullptr,
                   s_peers);
  __syncthreads();
  // Counts → first slot of each (expert, warp): the tile's base plus the earlier warps' counts;
  // and the staging order: the tile's pairs by expert, expert e's from loc(e) = the tile's pairs
  // of experts before e (a block scan over each thread's run of experts).
  const int per = (E + int(blockDim.x) - 1) / int(blockDim.x);
  const int e0 = min(E, int(threadIdx.x) * per), e1 = min(E, e0 + per);
  int32_t mine = 0;  // the tile's pairs of this thread's experts
  for (int e = e0; e < e1; ++e) {
    s_delta[e] = bases[int64_t(e) * tiles + blockIdx.x];
#pragma unroll
    for (int v = 0; v < kWarps; ++v) mine += s_cnt[v * E + e];
  }
  int32_t loc = 0, staged = 0;  // staged: the tile's pairs with a valid expert
  BlockScan(s_scan).ExclusiveSum(mine, loc, staged);
  for (int e = e0; e < e1; ++e) {
    int32_t run = s_delta[e];
    s_delta[e] = run - loc;
#pragma unroll
    for (int v = 0; v < kWarps; ++v) {
      const int32_t c = s_cnt[v * E + e];
      s_cnt[v * E + e] = run;
      run += c;
      loc += c;
    }
  }
  __syncthreads();

  int32_t* cnt = s_cnt + w * E;
  const int32_t tok_lo = uniform ? 0 : s_tok[0], tok_hi = uniform ? 0 : s_tok[1];
  // by_shift: the lanes of this lane's token that come before it (a token's K0 lanes are
  // aligned in the warp step).
  const unsigned token_before =
      by_shift ? detail::lanemask_lt() & ~((1u << ((lane >> k_shift) << k_shift)) - 1u) : 0u;
  for (int s = 0; s < steps; ++s) {
    const uint32_t base = wbegin + uint32_t(s) * 32;
    if (base >= tile_end) break;  // warp-uniform
    const uint32_t p = base + lane;
    const uint32_t i = p - tile_begin;  // index into the tile's shared arrays
    const bool in = p < tile_end;
    const int32_t e = in ? s_ids[i] : -1;
    const bool ok = e >= 0 && e < E;
    const int32_t key = ok ? e : -1;
    const unsigned peers = s_peers[i];  // warp_count's match of this step
    const int32_t first = ok ? cnt[key] : 0;
    __syncwarp();
    if (ok && lane == __ffs(peers) - 1) cnt[key] = first + __popc(peers);
    __syncwarp();
    if (!in) continue;

    int32_t t;
    bool repeated;
    if (by_shift) {
      t = int32_t(p >> k_shift);
      // A peer among the token's earlier lanes is the same expert twice. (An out-of-range id
      // has raised its own flag in the count kernel.)
      repeated = ok && (peers & token_before) != 0;
    } else {
      int32_t tstart;
      if (uniform) {
        t = int32_t(p) / K0;
        tstart = t * K0;
      } else {
        t = detail::token_of_pair_search(pair_offsets, int32_t(p), tok_lo, tok_hi);
        tstart = __ldg(pair_offsets + t);
      }
      // Compare with the token's earlier pairs: in the tile from shared memory, before it from
      // global memory.
      repeated = false;
      for (uint32_t q = max(uint32_t(tstart), tile_begin); q < p && !repeated; ++q)
        repeated = s_ids[q - tile_begin] == e;
      for (uint32_t q = uint32_t(tstart); q < min(tile_begin, p) && !repeated; ++q)
        repeated = __ldg(pair_experts + q) == e;
    }
    if (repeated) raise_flag(flags, kFlagExpertRepeated);

    const float wgt = s_w[i];
    if (!isfinite(wgt)) raise_flag(flags, kFlagNonFinite);
    if (ok) {
      const int32_t slot = first + __popc(peers & detail::lanemask_lt());
      const int32_t j = slot - s_delta[key];  // staged index
      s_oslot[j] = slot;
      s_otok[j] = t;
      s_ow[j] = wgt;
      // A repeated pair keeps its slot (computed, in bounds) but leaves the token view, like an
      // out-of-range one: the aggregation then gives the token NaN, not a silent double count.
      token_index_map[p] = repeated ? -1 : slot;
    } else {
      token_index_map[p] = -1;
    }
  }
  __syncthreads();
  // Consecutive staged indices of one expert are consecutive slots: runs of coalesced stores.
  for (int j = threadIdx.x; j < staged; j += blockDim.x) {
    const int32_t slot = s_oslot[j];
    expert_token_indices[slot] = s_otok[j];
    slot_weights[slot] = s_ow[j];
  }
}

// Dynamic shared memory a block may opt into, less room for the kernels' static shared memory (the
// scatter's block scan and token range: 1.2 KiB).
int max_smem_optin() {
  static const int n = [] {
    int dev = 0, v = 0;
    MOEBLAZE_CUDA_CHECK(cudaGetDevice(&dev));
    MOEBLAZE_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    return v - 2048;
  }();
  return n;
}

template <int kWarps>
void raise_smem_limits() {
  // Once per process: the scatter of large E needs more than the default 48 KB.
  static const bool done = [] {
    const int lim = max_smem_optin();
    MOEBLAZE_CUDA_CHECK(cudaFuncSetAttribute(plan_count_kernel<kWarps>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, lim));
    MOEBLAZE_CUDA_CHECK(cudaFuncSetAttribute(plan_scatter_kernel<kWarps>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, lim));
    return true;
  }();
  (void)done;
}

size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

size_t scan_temp_bytes(int64_t n) {
  size_t bytes = 0;
  MOEBLAZE_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<int32_t*>(nullptr),
                                                    static_cast<int32_t*>(nullptr), int(n)));
  return bytes;
}

// Workspace: [nonuniform hint (1,)] [counts (E*tiles+1,)] [bases (E*tiles+1,)] [CUB scan temp].
struct AtomicFreeLayout {
  size_t hint = 0, counts = 0, bases = 0, temp = 0, temp_bytes = 0, total = 0;
};
AtomicFreeLayout atomic_free_layout(const PlanTiling& tl, int64_t E) {
  AtomicFreeLayout l;
  const int64_t n = E * tl.tiles + 1;
  l.hint = 0;
  l.counts = align_up(sizeof(int32_t));
  l.bases = l.counts + align_up(sizeof(int32_t) * size_t(n));
  l.temp = l.bases + align_up(sizeof(int32_t) * size_t(n));
  l.temp_bytes = scan_temp_bytes(n);
  l.total = l.temp + align_up(l.temp_bytes);
  return l;
}

}  // namespace

PlanTiling plan_tiling(int64_t P, int64_t E, int tile_steps) {
  PlanTiling tl;
  // The scatter keeps per pair of its tile the id, weight and peer mask, and the staged slot,
  // token and weight (24 bytes), beside per-warp counters and one offset per expert (4 bytes
  // each) in shared memory: 8 warps while E allows it, one warp for very many experts.
  constexpr int64_t kPairBytes = 24;
  const int64_t smem_cap = max_smem_optin();
  auto scatter_bytes = [&](int64_t warps, int64_t steps) {
    return (warps + 1) * E * 4 + warps * 32 * steps * kPairBytes;
  };
  tl.warps = scatter_bytes(8, 4) <= smem_cap ? 8 : 1;
  MOEBLAZE_UNSUPPORTED_IF(scatter_bytes(1, 1) > smem_cap, "num_experts E (", E,
                          ") is too large for the GPU atomic-free plan builder (per-expert "
                          "counters must fit in shared memory); use PlanBuilder::sort");
  int steps = tile_steps;
  if (steps <= 0) {
    // Measured on the H200 (docs/notes/plan-build.md, tile sweep, before the
    // staged scatter): 1024 pairs up to E = 128, 2048 beyond
    // (larger tiles were up to 1.9x slower; the (E, tiles) counts stay at E/2048 ints per pair).
    steps = E <= 128 ? 4 : 8;
  }
  steps = std::max(1, std::min(64, steps));
  while (steps > 1 && scatter_bytes(tl.warps, steps) > smem_cap) steps /= 2;
  tl.steps = steps;
  tl.tile_pairs = int64_t(tl.warps) * 32 * steps;
  tl.tiles = (P + tl.tile_pairs - 1) / tl.tile_pairs;
  tl.smem_count = size_t(tl.warps) * size_t(E) * 4;
  tl.smem_scatter = size_t(scatter_bytes(tl.warps, steps));
  return tl;
}

size_t atomic_free_workspace_bytes(int64_t T, int64_t E, int64_t P, const PlanBuildOptions& o) {
  (void)T;
  return atomic_free_layout(plan_tiling(P, E, o.tile_steps), E).total;
}

void build_plan_atomic_free_async(const RoutingView& r, RoutingPlan& plan, void* workspace,
                                  size_t workspace_bytes, int32_t* d_flags, cudaStream_t stream,
                                  const PlanBuildOptions& o) {
  const int64_t T = r.T, P = r.P;
  const int E = int(r.E);
  const PlanTiling tl = plan_tiling(P, E, o.tile_steps);
  const AtomicFreeLayout l = atomic_free_layout(tl, E);
  MOEBLAZE_REQUIRE(workspace_bytes >= l.total, "workspace (", workspace_bytes,
                   " bytes) is smaller than the atomic-free plan build needs (", l.total, ")");
  char* ws = static_cast<char*>(workspace);
  int32_t* hint = reinterpret_cast<int32_t*>(ws + l.hint);      // (1,) non-uniform CSR
  int32_t* counts = reinterpret_cast<int32_t*>(ws + l.counts);  // (E*tiles+1,) expert-major
  int32_t* bases = reinterpret_cast<int32_t*>(ws + l.bases);    // (E*tiles+1,) first slots
  void* temp = ws + l.temp;
  // Pairs per token when the CSR is plain top-K (checked on the device).
  const int32_t K0 = (T > 0 && P % T == 0) ? int32_t(P / T) : 0;
  int k_shift = -1;  // log2 K0 where K0 divides 32: tokens then never straddle a warp step
  for (int b = 0; b <= 5; ++b)
    if (K0 == (1 << b)) k_shift = b;
  const int tiles = int(tl.tiles);
  const int bits = detail::expert_bits(E);
  const int threads = tl.warps * 32;
  const int64_t offset_blocks = (T + 1 + threads - 1) / threads;
  const int count_grid = int(std::max<int64_t>({int64_t(tiles), std::min<int64_t>(offset_blocks, 4 * 1024), 1}));

  MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(hint, 0, sizeof(int32_t), stream));
  if (tl.warps == 8) {
    raise_smem_limits<8>();
    plan_count_kernel<8><<<count_grid, threads, tl.smem_count, stream>>>(
        r.pair_experts, r.pair_offsets, T, P, E, bits, tl.steps, tiles, K0, counts,
        plan.token_pair_offsets(), hint, d_flags);
  } else {
    raise_smem_limits<1>();
    plan_count_kernel<1><<<count_grid, threads, tl.smem_count, stream>>>(
        r.pair_experts, r.pair_offsets, T, P, E, bits, tl.steps, tiles, K0, counts,
        plan.token_pair_offsets(), hint, d_flags);
  }
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
  size_t temp_bytes = l.temp_bytes;
  MOEBLAZE_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(temp, temp_bytes, counts, bases,
                                                    int(int64_t(E) * tiles + 1), stream));
  const int scatter_grid = std::max(tiles, 1);
  if (tl.warps == 8) {
    plan_scatter_kernel<8><<<scatter_grid, threads, tl.smem_scatter, stream>>>(
        r.pair_experts, r.pair_weights, r.pair_offsets, T, P, E, bits, tl.steps, tiles, K0, k_shift,
        bases, hint,
        plan.expert_token_offsets(), plan.expert_token_indices(), plan.slot_weights(),
        plan.token_expert_indices(), plan.token_index_map(), d_flags);
  } else {
    plan_scatter_kernel<1><<<scatter_grid, threads, tl.smem_scatter, stream>>>(
        r.pair_experts, r.pair_weights, r.pair_offsets, T, P, E, bits, tl.steps, tiles, K0, k_shift,
        bases, hint,
        plan.expert_token_offsets(), plan.expert_token_indices(), plan.slot_weights(),
        plan.token_expert_indices(), plan.token_index_map(), d_flags);
  }
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeblaze::cuda
