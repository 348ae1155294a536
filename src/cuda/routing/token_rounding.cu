// Token rounding on the GPU (SonicMoE §5), the same function as the CPU reference
// (src/cpu/token_rounding.cpp): every expert's token count rounded to a multiple of m_tile by
// NR-f / SR-f / UP / DOWN, dropping its lowest-score token-choice tokens or padding with its
// highest-score other tokens, then pairs regrouped by token (ascending expert) and weights
// recomputed by the router's rule over each token's new pair set.
//
//  1. scores (E, T): softmax probability / logit / sigmoid + bias, one thread per token
//     (router_math.cuh: bitwise the CPU's values), -0 folded into +0 so that the radix order
//     below agrees with the CPU's '>' comparison;
//  2. chosen (E, T) flags from the top-K routing (checked on the device in the same pass of
//     the stream, its broken entries skipped so nothing reads out of bounds), c_e = row sums;
//  3. one CUB radix sort of 64-bit keys (expert, descending score) with token values: stable,
//     so equal scores keep ascending token order, the CPU's tie rule;
//  4. per expert (one block), a fixed-order scan down its sorted tokens keeps the first
//     min(target, c) chosen ones and the first max(0, target - c) others: in SonicMoE's order
//     every token-choice pair outranks every expert-choice one, so this is exactly the CPU's
//     "drop the lowest / pad with the best" rule;
//  5. per token, the kept experts in ascending order; one exclusive scan gives the offsets;
//     S and the flags are read back together (token_round_count: the one host synchronisation,
//     on the caller's stream; S sizes the output routing);
//  6. weights per token by the router's rule, into the caller's arrays (token_round_fill_async).
// No atomics anywhere; every step is a function of the inputs alone.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <cstdint>

#include "cuda/cuda_backend.hpp"
#include "cuda/routing/router_kernels.hpp"
#include "cuda/routing/router_math.cuh"
#include "cuda/routing/routing_device.cuh"
#include "moeblaze/error.hpp"
#include "moeblaze/memory.hpp"

namespace moeblaze::cuda {
namespace {

using detail::load_logit;
using detail::raise_flag;
using detail::ref_expf;
using detail::ref_max;
using detail::ref_sigmoid;

constexpr int kThreads = 256;

// Monotonic map of a float onto uint32 (larger float → larger integer), inverted so that an
// ascending sort is a descending one by score.
__device__ __forceinline__ uint32_t descending_key(float s) {
  const uint32_t u = __float_as_uint(s);
  const uint32_t ord = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ~ord;
}

template <typename InT>
__global__ void __launch_bounds__(kThreads)
rounding_scores_kernel(const InT* __restrict__ logits, const float* __restrict__ bias, int64_t T,
                       int E, RouterKind kind, uint64_t* __restrict__ keys,  // (E*T,) (e, score)
                       int32_t* __restrict__ values,                         // (E*T,) token
                       int32_t* __restrict__ flags) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= T) return;
  const InT* row = logits + t * E;
  float m = -INFINITY, z = 0.0f;
  bool bad = false;
  for (int e = 0; e < E; ++e) {
    const float v = load_logit(row + e);
    bad |= !isfinite(v) || (bias != nullptr && !isfinite(__ldg(bias + e)));
    m = ref_max(m, v);
  }
  if (bad) raise_flag(flags, kFlagNonFinite);
  if (kind == RouterKind::softmax_topk)
    for (int e = 0; e < E; ++e) z = __fadd_rn(z, ref_expf(__fsub_rn(load_logit(row + e), m)));
  for (int e = 0; e < E; ++e) {
    const float v = load_logit(row + e);
    float s;
    if (kind == RouterKind::softmax_topk)
      s = __fdiv_rn(ref_expf(__fsub_rn(v, m)), z);
    else if (kind == RouterKind::sigmoid_bias)
      s = __fadd_rn(ref_sigmoid(v), __ldg(bias + e));
    else
      s = v;
    s = __fadd_rn(s, 0.0f);  // -0 → +0: the CPU's '>' sees them equal
    const int64_t i = int64_t(e) * T + t;
    keys[i] = (uint64_t(e) << 32) | descending_key(s);
    values[i] = int32_t(t);
  }
}

// chosen[e*T + t] = 1 for every pair of the top-K routing (one writer per entry). The routing is
// validated on the same stream without a sync, so offsets are clamped to [0, P] and ids outside
// [0, E) skipped: a broken routing (flagged, then thrown on the host) never writes out of bounds.
__global__ void mark_chosen_kernel(const int32_t* __restrict__ offsets,
                                   const int32_t* __restrict__ experts, int64_t T, int64_t P,
                                   int E, uint8_t* __restrict__ chosen) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= T) return;
  const int64_t b = max(int64_t(0), min(int64_t(offsets[t]), P));
  const int64_t end = max(b, min(int64_t(offsets[t + 1]), P));
  for (int64_t p = b; p < end; ++p) {
    const int32_t e = experts[p];
    if (e >= 0 && e < E) chosen[int64_t(e) * T + t] = 1;
  }
}

// c_e = the number of tokens that chose expert e: one block per expert sums its chosen row in a
// fixed order (the top-K histogram of a valid routing, which has no repeated pair).
__global__ void __launch_bounds__(kThreads)
chosen_counts_kernel(const uint8_t* __restrict__ chosen, int64_t T,  // (E, T)
                     int32_t* __restrict__ counts) {                 // (E,)
  using Reduce = cub::BlockReduce<int, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const uint8_t* row = chosen + int64_t(blockIdx.x) * T;
  int c = 0;
  for (int64_t i = threadIdx.x; i < T; i += kThreads) c += row[i];
  c = Reduce(tmp).Sum(c);
  if (threadIdx.x == 0) counts[blockIdx.x] = c;
}

__device__ __forceinline__ uint64_t splitmix64_finalize(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The CPU's rounded_count: target multiple of m for count c (SR-f: a counter-based draw per
// expert), clamped to T.
__device__ int64_t rounded_count(RoundingMode mode, int64_t m, uint64_t seed, int64_t c,
                                 int64_t T, int64_t expert) {
  const int64_t tiles = c / m, rem = c % m;
  int64_t up = 0;
  if (rem != 0) {
    switch (mode) {
      case RoundingMode::nearest_freq: up = 2 * rem > m || (2 * rem == m && (tiles % 2) == 1); break;
      case RoundingMode::stochastic_freq: {
        const uint64_t h = splitmix64_finalize(
            seed ^ splitmix64_finalize(uint64_t(expert) + 0x9E3779B97F4A7C15ull));
        up = __umul64hi(h, uint64_t(m)) < uint64_t(rem);
        break;
      }
      case RoundingMode::up: up = 1; break;
      case RoundingMode::down: up = 0; break;
    }
  }
  return min((tiles + up) * m, T);
}

// One block per expert: walk its tokens best first and keep the first min(target, c) chosen
// and the first max(0, target - c) others. Block scans in fixed order; no atomics.
__global__ void __launch_bounds__(kThreads)
select_kept_kernel(const int32_t* __restrict__ sorted_tokens,  // (E*T,) per expert, best first
                   const uint8_t* __restrict__ chosen,         // (E, T)
                   const int32_t* __restrict__ counts,         // (E,) c_e
                   int64_t T, RoundingMode mode, int64_t m_tile, uint64_t seed,
                   uint8_t* __restrict__ keep) {               // (E, T), zeroed
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  const int e = blockIdx.x;
  const int64_t c = counts[e];
  const int64_t target = rounded_count(mode, m_tile, seed, c, T, e);
  const int64_t want_chosen = min(target, c), want_other = max(int64_t(0), target - c);
  const int32_t* tok = sorted_tokens + int64_t(e) * T;
  const uint8_t* ch = chosen + int64_t(e) * T;
  uint8_t* kp = keep + int64_t(e) * T;
  int64_t seen_chosen = 0, seen_other = 0;
  for (int64_t base = 0; base < T; base += kThreads) {
    if (seen_chosen >= want_chosen && seen_other >= want_other) break;  // block-uniform
    const int64_t i = base + threadIdx.x;
    const bool in = i < T;
    const int32_t t = in ? tok[i] : 0;
    const int is_chosen = in ? ch[t] : 0;
    int before = 0, total = 0;
    Scan(scan_tmp).ExclusiveSum(is_chosen, before, total);
    const int64_t chosen_rank = seen_chosen + before;
    const int64_t other_rank = seen_other + (threadIdx.x - before);
    if (in && (is_chosen ? chosen_rank < want_chosen : other_rank < want_other)) kp[t] = 1;
    const int n_in = int(min(int64_t(kThreads), T - base));
    seen_chosen += total;
    seen_other += n_in - total;
    __syncthreads();  // scan_tmp is reused next round
  }
}

__global__ void count_kept_kernel(const uint8_t* __restrict__ keep, int64_t T, int E,
                                  int32_t* __restrict__ n) {  // (T+1,), n[T] = 0
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t > T) return;
  int32_t c = 0;
  if (t < T)
    for (int e = 0; e < E; ++e) c += keep[int64_t(e) * T + t];
  n[t] = c;
}

template <typename InT>
__global__ void __launch_bounds__(kThreads)
fill_rounded_kernel(const uint8_t* __restrict__ keep, const int32_t* __restrict__ offsets,
                    const InT* __restrict__ logits, int64_t T, int E, RouterKind kind,
                    bool renormalize, int64_t P, int32_t* __restrict__ experts,  // (P,)
                    float* __restrict__ weights) {                                // (P,)
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= T) return;
  const int32_t begin = offsets[t];
  if (offsets[t + 1] > P) return;  // not the count's P (the C ABI's caller broke its contract)
  int32_t* ids = experts + begin;
  int n = 0;
  for (int e = 0; e < E; ++e)
    if (keep[int64_t(e) * T + t]) ids[n++] = e;
  if (n == 0) return;
  const InT* row = logits + t * E;
  float m = -INFINITY, z = 1.0f;
  if (kind == RouterKind::softmax_topk && !renormalize) {
    for (int e = 0; e < E; ++e) m = ref_max(m, load_logit(row + e));
    z = 0.0f;
    for (int e = 0; e < E; ++e) z = __fadd_rn(z, ref_expf(__fsub_rn(load_logit(row + e), m)));
  }
  auto id_at = [&](int i) { return ids[i]; };
  auto x_at = [&](int i) { return load_logit(row + ids[i]); };
  const detail::PairRule rule = detail::make_pair_rule(kind, renormalize, n, id_at, x_at, m, z);
  for (int i = 0; i < n; ++i) weights[begin + i] = detail::pair_weight(rule, x_at(i));
}

size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

int grid_of(int64_t n) { return int(std::max<int64_t>(1, (n + kThreads - 1) / kThreads)); }

// The workspace's pieces, from T and E alone (both calls lay it out the same way).
struct RoundLayout {
  size_t kin, kout, vin, vout, chosen, keep, counts, nkept, offsets, flags, temp, total;
  size_t sort_bytes, scan_bytes;
  int end_bit;
};

RoundLayout round_layout(int64_t T, int64_t E) {
  RoundLayout l{};
  const size_t n = size_t(T * E);
  l.end_bit = 32;
  while ((int64_t(1) << (l.end_bit - 32)) < E) ++l.end_bit;
  MOEBLAZE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, l.sort_bytes, static_cast<const uint64_t*>(nullptr),
      static_cast<uint64_t*>(nullptr), static_cast<const int32_t*>(nullptr),
      static_cast<int32_t*>(nullptr), int(n), 0, l.end_bit));
  MOEBLAZE_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, l.scan_bytes,
                                                    static_cast<int32_t*>(nullptr),
                                                    static_cast<int32_t*>(nullptr), int(T + 1)));
  size_t off = 0;
  auto take = [&off](size_t bytes) { const size_t at = off; off += align_up(bytes); return at; };
  l.kin = take(8 * n);
  l.kout = take(8 * n);
  l.vin = take(4 * n);
  l.vout = take(4 * n);
  l.chosen = take(n);
  l.keep = take(n);
  l.counts = take(sizeof(int32_t) * size_t(E));
  l.nkept = take(sizeof(int32_t) * size_t(T + 1));
  l.offsets = take(sizeof(int32_t) * size_t(T + 1));
  l.flags = take(sizeof(int32_t) * 2 * kRoutingFlagCount);
  l.temp = take(std::max(l.sort_bytes, l.scan_bytes));
  l.total = off;
  return l;
}

}  // namespace

size_t token_round_workspace_bytes(int64_t T, int64_t E) {
  MOEBLAZE_UNSUPPORTED_IF(T * E >= (int64_t(1) << 31), "token rounding on the GPU needs T*E (",
                          T * E, ") below 2^31 (it ranks every (expert, token) score)");
  return round_layout(T, E).total;
}

int64_t token_round_count(const RouterConfig& router, const TokenRoundingConfig& cfg,
                          const TensorView& logits, const float* bias, const RoutingView& topk,
                          void* workspace, int32_t* h_flags, cudaStream_t stream) {
  const int64_t T = logits.dim(0), E = logits.dim(1), n = T * E;
  const RoundLayout l = round_layout(T, E);
  const int Ei = int(E);
  char* w = static_cast<char*>(workspace);
  uint64_t* kin = reinterpret_cast<uint64_t*>(w + l.kin);      // (E*T,) (expert, desc score)
  uint64_t* kout = reinterpret_cast<uint64_t*>(w + l.kout);    // (E*T,) sorted
  int32_t* vin = reinterpret_cast<int32_t*>(w + l.vin);        // (E*T,) token
  int32_t* vout = reinterpret_cast<int32_t*>(w + l.vout);      // (E*T,) token, best first per e
  uint8_t* chosen = reinterpret_cast<uint8_t*>(w + l.chosen);  // (E, T)
  uint8_t* keep = reinterpret_cast<uint8_t*>(w + l.keep);      // (E, T)
  int32_t* counts = reinterpret_cast<int32_t*>(w + l.counts);  // (E,) c_e
  int32_t* nkept = reinterpret_cast<int32_t*>(w + l.nkept);      // (T+1,) pairs per token
  int32_t* offsets = reinterpret_cast<int32_t*>(w + l.offsets);  // (T+1,) exclusive scan
  int32_t* flags = reinterpret_cast<int32_t*>(w + l.flags);  // (2, 4): topk's, the logits'
  void* temp = w + l.temp;

  MOEBLAZE_CUDA_CHECK(
      cudaMemsetAsync(flags, 0, sizeof(int32_t) * 2 * kRoutingFlagCount, stream));
  validate_routing_async(topk, flags, stream);
  if (T > 0) {
    int32_t* logit_flags = flags + kRoutingFlagCount;
    if (logits.dtype == DType::bf16)
      rounding_scores_kernel<uint16_t><<<grid_of(T), kThreads, 0, stream>>>(
          static_cast<const uint16_t*>(logits.data),
          router.kind == RouterKind::sigmoid_bias ? bias : nullptr, T, Ei, router.kind, kin, vin,
          logit_flags);
    else
      rounding_scores_kernel<float><<<grid_of(T), kThreads, 0, stream>>>(
          static_cast<const float*>(logits.data),
          router.kind == RouterKind::sigmoid_bias ? bias : nullptr, T, Ei, router.kind, kin, vin,
          logit_flags);
    MOEBLAZE_CUDA_CHECK(cudaGetLastError());
    MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(chosen, 0, size_t(n), stream));
    MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(keep, 0, size_t(n), stream));
    mark_chosen_kernel<<<grid_of(T), kThreads, 0, stream>>>(topk.pair_offsets, topk.pair_experts,
                                                            T, topk.P, Ei, chosen);
    MOEBLAZE_CUDA_CHECK(cudaGetLastError());
    chosen_counts_kernel<<<Ei, kThreads, 0, stream>>>(chosen, T, counts);
    MOEBLAZE_CUDA_CHECK(cudaGetLastError());
    size_t tb = l.sort_bytes;
    MOEBLAZE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, tb, kin, kout, vin, vout, int(n), 0,
                                                        l.end_bit, stream));
    select_kept_kernel<<<Ei, kThreads, 0, stream>>>(vout, chosen, counts, T, cfg.mode,
                                                    cfg.m_tile, cfg.seed, keep);
    MOEBLAZE_CUDA_CHECK(cudaGetLastError());
  }
  count_kept_kernel<<<grid_of(T + 1), kThreads, 0, stream>>>(keep, T, Ei, nkept);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
  size_t sb = l.scan_bytes;
  MOEBLAZE_CUDA_CHECK(
      cub::DeviceScan::ExclusiveSum(temp, sb, nkept, offsets, int(T + 1), stream));
  int32_t S = 0;
  MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(&S, offsets + T, sizeof(int32_t), cudaMemcpyDeviceToHost,
                                      stream));
  MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(h_flags, flags, sizeof(int32_t) * 2 * kRoutingFlagCount,
                                      cudaMemcpyDeviceToHost, stream));
  MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return S;
}

void token_round_fill_async(const RouterConfig& router, const TensorView& logits,
                            const void* workspace, int32_t* pair_offsets, int32_t* pair_experts,
                            float* pair_weights, int64_t P, cudaStream_t stream) {
  const int64_t T = logits.dim(0), E = logits.dim(1);
  const RoundLayout l = round_layout(T, E);
  const char* w = static_cast<const char*>(workspace);
  const uint8_t* keep = reinterpret_cast<const uint8_t*>(w + l.keep);      // (E, T)
  const int32_t* offsets = reinterpret_cast<const int32_t*>(w + l.offsets);  // (T+1,)
  MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(pair_offsets, offsets, sizeof(int32_t) * size_t(T + 1),
                                      cudaMemcpyDeviceToDevice, stream));
  if (T == 0) return;
  if (logits.dtype == DType::bf16)
    fill_rounded_kernel<uint16_t><<<grid_of(T), kThreads, 0, stream>>>(
        keep, offsets, static_cast<const uint16_t*>(logits.data), T, int(E), router.kind,
        router.renormalize, P, pair_experts, pair_weights);
  else
    fill_rounded_kernel<float><<<grid_of(T), kThreads, 0, stream>>>(
        keep, offsets, static_cast<const float*>(logits.data), T, int(E), router.kind,
        router.renormalize, P, pair_experts, pair_weights);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeblaze::cuda
