// The device maps of the token chunks (token_chunks.hpp): chunk bounds and per-expert row ranges
// by binary search over the plan's sorted arrays, the packed bases by one block scan per chunk,
// and each pair's row in its chunk's buffer. No atomics; no host sync.
#include "cuda/layer/token_chunks.hpp"

#include <cub/block/block_scan.cuh>

#include "cuda/cuda_backend.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda {
namespace {

constexpr int kThreads = 256;

// First index i in [lo, hi) with a[i] >= v (hi when none): a ascending.
__device__ __forceinline__ int64_t lower_bound(const int32_t* a, int64_t lo, int64_t hi,
                                               int64_t v) {
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (a[mid] < v) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}
// First index i in [lo, hi) with a[i] > v (hi when none): a ascending.
__device__ __forceinline__ int64_t upper_bound(const int32_t* a, int64_t lo, int64_t hi,
                                               int64_t v) {
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (a[mid] <= v) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// One thread per (c, e), c in [0, C]: t_c (written by e == 0) and lo[c][e].
__global__ void chunk_bounds_kernel(const int32_t* __restrict__ pair_offsets,  // (T+1,)
                                    const int32_t* __restrict__ offsets,       // (E+1,)
                                    const int32_t* __restrict__ slot_tokens,   // (S,)
                                    int64_t T, int64_t E, int64_t C, int64_t B,
                                    int32_t* __restrict__ token_bounds,  // (C+1,)
                                    int32_t* __restrict__ expert_rows) {  // (C+1, E)
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= (C + 1) * E) return;
  const int64_t c = i / E, e = i - c * E;
  // t_C = T so that every token, trailing tokens without pairs too, falls in a chunk.
  const int64_t t = c == C ? T : lower_bound(pair_offsets, 0, T, c * B);
  if (e == 0) token_bounds[c] = int32_t(t);
  expert_rows[i] = int32_t(lower_bound(slot_tokens, offsets[e], offsets[e + 1], t));
}

// One block per chunk: base[c][e] = sum over e' < e of lo[c+1][e'] - lo[c][e'].
__global__ void __launch_bounds__(kThreads)
    chunk_bases_kernel(const int32_t* __restrict__ expert_rows, int64_t E,
                       int32_t* __restrict__ packed_base) {
  using Scan = cub::BlockScan<int32_t, kThreads>;
  __shared__ typename Scan::TempStorage tmp;
  const int64_t c = blockIdx.x;
  const int32_t* lo = expert_rows + c * E;
  const int32_t* hi = lo + E;
  int32_t carry = 0;
  for (int64_t e0 = 0; e0 < E; e0 += kThreads) {
    const int64_t e = e0 + threadIdx.x;
    const int32_t count = e < E ? hi[e] - lo[e] : 0;
    int32_t before, total;
    Scan(tmp).ExclusiveSum(count, before, total);
    if (e < E) packed_base[c * E + e] = carry + before;
    carry += total;
    __syncthreads();  // tmp is reused by the next tile's scan
  }
}

// One thread per token: each of its pairs' rows in the chunk buffer.
__global__ void chunk_pair_rows_kernel(const int32_t* __restrict__ pair_offsets,     // (T+1,)
                                       const int32_t* __restrict__ token_index_map,  // (S,)
                                       const int32_t* __restrict__ offsets,          // (E+1,)
                                       const int32_t* __restrict__ token_bounds,     // (C+1,)
                                       const int32_t* __restrict__ expert_rows,      // (C+1, E)
                                       const int32_t* __restrict__ packed_base,      // (C, E)
                                       int64_t T, int64_t E, int64_t C,
                                       int32_t* __restrict__ pair_rows) {            // (S,)
  const int64_t t = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (t >= T) return;
  // The chunk holding t: the last c with t_c <= t (t_0 = 0 <= t < T = t_C).
  const int64_t c = upper_bound(token_bounds, 0, C + 1, t) - 1;
  for (int64_t p = pair_offsets[t]; p < pair_offsets[t + 1]; ++p) {
    const int64_t slot = token_index_map[p];
    if (slot < 0) {  // a pair left out of the plan (flagged): no row; the aggregation gives NaN
      pair_rows[p] = -1;
      continue;
    }
    const int64_t e = upper_bound(offsets, 0, E + 1, slot) - 1;  // off[e] <= slot < off[e+1]
    pair_rows[p] = int32_t(packed_base[c * E + e] + (slot - expert_rows[c * E + e]));
  }
}

}  // namespace

void build_chunk_maps(const RoutingPlanView& plan, const TokenChunks& chunks,
                      const ChunkMaps& maps, cudaStream_t stream) {
  MOEBLAZE_REQUIRE(chunks.count > 1, "build_chunk_maps: count (", chunks.count,
                   ") must be > 1 (one chunk needs no maps)");
  MOEBLAZE_REQUIRE(maps.token_bounds && maps.expert_rows && maps.packed_base && maps.pair_rows,
                   "build_chunk_maps: every map must be set");
  const int64_t C = chunks.count, E = plan.E, T = plan.T;
  const int64_t B = (plan.S + C - 1) / C;
  const int64_t bounds_threads = (C + 1) * E;
  chunk_bounds_kernel<<<unsigned((bounds_threads + kThreads - 1) / kThreads), kThreads, 0,
                        stream>>>(plan.token_pair_offsets, plan.expert_token_offsets,
                                  plan.expert_token_indices, T, E, C, B, maps.token_bounds,
                                  maps.expert_rows);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
  chunk_bases_kernel<<<unsigned(C), kThreads, 0, stream>>>(maps.expert_rows, E,
                                                           maps.packed_base);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
  if (T == 0) return;
  chunk_pair_rows_kernel<<<unsigned((T + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      plan.token_pair_offsets, plan.token_index_map, plan.expert_token_offsets, maps.token_bounds,
      maps.expert_rows, maps.packed_base, T, E, C, maps.pair_rows);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeblaze::cuda
