// The sort-based routing-plan build on the GPU: the baseline the atomic-free builder is measured
// against, done the way MegaBlocks and ScatterMoE do it. CUB radix sort of (key = expert id,
// value = pair index) over only the bits an expert id needs; radix sort is stable, so slots
// inside an expert come out in pair (= token) order and the plan equals the atomic-free one.
// Expert segment offsets are read off the sorted keys (boundaries), and each slot recovers its
// token and weight from its pair index.
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <cstdint>

#include "cuda/cuda_backend.hpp"
#include "cuda/gemm/dispatch/kernel_config.hpp"  // current_device_props
#include "cuda/routing/plan_build.hpp"
#include "cuda/routing/routing_device.cuh"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda {
namespace {

using detail::raise_flag;

constexpr int kThreads = 256;

// Sort input: pair indices, the plan's token-major expert copy, pair_offsets copy and checks.
__global__ void __launch_bounds__(kThreads)
sort_prepare_kernel(const int32_t* __restrict__ pair_experts,  // (P,) int32
                    const int32_t* __restrict__ pair_offsets,  // (T+1,) int32
                    int64_t T, int64_t P, int E, int32_t K0,
                    int32_t* __restrict__ pair_index,            // (P,) int32: p
                    int32_t* __restrict__ token_expert_indices,  // (S,) int32, token-major
                    int32_t* __restrict__ token_pair_offsets,    // (T+1,) int32
                    int32_t* __restrict__ nonuniform,            // (1,) int32
                    int32_t* __restrict__ flags) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < max(P, T + 1); i += stride) {
    if (i < P) {
      const int32_t e = pair_experts[i];
      if (e < 0 || e >= E) raise_flag(flags, kFlagExpertOutOfRange);
      pair_index[i] = int32_t(i);
      token_expert_indices[i] = e;
    }
    if (i <= T) {
      const int32_t o = pair_offsets[i];
      token_pair_offsets[i] = o;
      if ((i == 0 && o != 0) || (i == T && o != P) || (i > 0 && pair_offsets[i - 1] > o))
        raise_flag(flags, kFlagBadOffsets);
      if (int64_t(o) != i * K0) *nonuniform = 1;
    }
  }
}

__device__ __forceinline__ int32_t sort_token_of(const int32_t* __restrict__ pair_offsets,
                                                 int32_t p, bool uniform, int32_t K0, int64_t T) {
  if (uniform) return p / K0;
  return detail::token_of_pair_search(pair_offsets, p, 0, T > 0 ? int32_t(T - 1) : 0);
}

// One thread per slot: token, weight and the reverse map from the sorted pair index; expert
// boundaries (empty experts included) from the sorted keys.
__global__ void __launch_bounds__(kThreads)
sort_finish_kernel(const uint32_t* __restrict__ keys,       // (P,) expert id, sorted
                   const int32_t* __restrict__ pairs,       // (P,) pair index, sorted by expert
                   const float* __restrict__ pair_weights,  // (P,) fp32, token-major
                   const int32_t* __restrict__ pair_offsets,  // (T+1,) int32
                   int64_t T, int64_t P, int E, int32_t K0,
                   const int32_t* __restrict__ nonuniform,
                   int32_t* __restrict__ expert_token_offsets,  // (E+1,) int32
                   int32_t* __restrict__ expert_token_indices,  // (S,) int32, by expert
                   float* __restrict__ slot_weights,            // (S,) fp32, by expert
                   int32_t* __restrict__ token_index_map,       // (S,) int32, token-major
                   int32_t* __restrict__ flags) {
  const bool uniform = K0 > 0 && *nonuniform == 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  if (P == 0) {
    for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e <= E; e += stride)
      expert_token_offsets[e] = 0;
    return;
  }
  for (int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; s < P; s += stride) {
    // Ids outside [0, E) were flagged; clamping keeps every write in bounds.
    const int32_t e = int32_t(min(keys[s], uint32_t(E - 1)));
    const int32_t p = pairs[s];
    const int32_t t = sort_token_of(pair_offsets, p, uniform, K0, T);
    const float w = pair_weights[p];
    if (!isfinite(w)) raise_flag(flags, kFlagNonFinite);
    expert_token_indices[s] = t;
    slot_weights[s] = w;
    const int32_t prev = s > 0 ? int32_t(min(keys[s - 1], uint32_t(E - 1))) : -1;
    for (int32_t f = prev + 1; f <= e; ++f) expert_token_offsets[f] = int32_t(s);
    if (s == P - 1)
      for (int32_t f = e + 1; f <= E; ++f) expert_token_offsets[f] = int32_t(P);
    // Equal neighbours in one expert segment with the same token: a repeated expert.
    const bool repeated =
        s > 0 && prev == e && sort_token_of(pair_offsets, pairs[s - 1], uniform, K0, T) == t;
    if (repeated) raise_flag(flags, kFlagExpertRepeated);
    // A clamped (out-of-range) or repeated pair keeps its slot but leaves the token view: the
    // aggregation gives the token NaN rather than expert E - 1's row or a double count.
    token_index_map[p] = keys[s] >= uint32_t(E) || repeated ? -1 : int32_t(s);
  }
}

int key_bits(int64_t E) {
  int bits = 1;
  while ((int64_t(1) << bits) < E) ++bits;
  return bits;
}

size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

// Workspace: [hint (1,)] [keys out (P,)] [pair index in (P,)] [pair index out (P,)] [CUB temp].
struct SortLayout {
  size_t hint = 0, keys = 0, vin = 0, vout = 0, temp = 0, temp_bytes = 0, total = 0;
};
SortLayout sort_layout(int64_t E, int64_t P) {
  SortLayout l;
  const size_t arr = align_up(sizeof(int32_t) * size_t(P));
  l.keys = align_up(sizeof(int32_t));
  l.vin = l.keys + arr;
  l.vout = l.vin + arr;
  l.temp = l.vout + arr;
  size_t bytes = 0;
  MOEBLAZE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), int(P), 0,
      key_bits(E)));
  l.temp_bytes = bytes;
  l.total = l.temp + align_up(bytes);
  return l;
}

int grid_for(int64_t n) {
  // Grid-stride, 16 blocks per SM at most (the kernels' results do not depend on the grid).
  return int(std::max<int64_t>(
      1, std::min<int64_t>((n + kThreads - 1) / kThreads, gemm::current_device_props().sms * 16)));
}

}  // namespace

size_t sort_workspace_bytes(int64_t T, int64_t E, int64_t P) {
  (void)T;
  return sort_layout(E, P).total;
}

void build_plan_sort_async(const RoutingView& r, RoutingPlan& plan, void* workspace,
                           size_t workspace_bytes, int32_t* d_flags, cudaStream_t stream) {
  const int64_t T = r.T, P = r.P;
  const int E = int(r.E);
  const SortLayout l = sort_layout(E, P);
  MOEBLAZE_REQUIRE(workspace_bytes >= l.total, "workspace (", workspace_bytes,
                   " bytes) is smaller than the sort plan build needs (", l.total, ")");
  char* ws = static_cast<char*>(workspace);
  int32_t* hint = reinterpret_cast<int32_t*>(ws);                // (1,) non-uniform CSR
  uint32_t* keys = reinterpret_cast<uint32_t*>(ws + l.keys);     // (P,) sorted expert ids
  int32_t* vin = reinterpret_cast<int32_t*>(ws + l.vin);         // (P,) pair index
  int32_t* vout = reinterpret_cast<int32_t*>(ws + l.vout);       // (P,) pair index, by expert
  const int32_t K0 = (T > 0 && P % T == 0) ? int32_t(P / T) : 0;

  MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(hint, 0, sizeof(int32_t), stream));
  sort_prepare_kernel<<<grid_for(std::max(P, T + 1)), kThreads, 0, stream>>>(
      r.pair_experts, r.pair_offsets, T, P, E, K0, vin, plan.token_expert_indices(),
      plan.token_pair_offsets(), hint, d_flags);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
  if (P > 0) {
    size_t temp_bytes = l.temp_bytes;
    MOEBLAZE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
        ws + l.temp, temp_bytes, reinterpret_cast<const uint32_t*>(r.pair_experts), keys, vin,
        vout, int(P), 0, key_bits(E), stream));
  }
  sort_finish_kernel<<<grid_for(std::max<int64_t>(P, E + 1)), kThreads, 0, stream>>>(
      keys, vout, r.pair_weights, r.pair_offsets, T, P, E, K0, hint, plan.expert_token_offsets(),
      plan.expert_token_indices(), plan.slot_weights(), plan.token_index_map(), d_flags);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeblaze::cuda
