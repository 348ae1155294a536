// Router forward on the GPU: logits (T, E) → top-K routing (pairs in rank order) with gate
// weights, for softmax→top-K (optionally renormalised), top-K→softmax and sigmoid + bias.
//
// One thread per token. The CPU reference sums a token's exps in ascending expert order, and the
// weights must match it to the ulp, so the per-token reductions are sequential per thread (a
// warp holds 32 tokens, the SIMD lanes run 32 such sequences side by side). Logits reach the
// threads through a per-warp shared-memory tile (32 tokens × 32 experts): the warp loads each
// row segment coalesced, then every lane reads its own row from the tile (padded: no bank
// conflicts). Selection keys are the logits themselves for the softmax routers (softmax is
// monotonic, so ids are decided on exact inputs) and sigmoid(l) + bias for sigmoid_bias, with
// the CPU's exact expf. Ties break to the lower expert id: the top-K list is kept sorted in
// registers and a key only moves past strictly smaller keys.
//   fast path: K <= 16, the list of KMAX ∈ {1, 2, 4, 8, 16} entries lives in registers; any E.
//   generic path: K > 16, rank counting per expert (O(E^2) per token; correct, slow).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_backend.hpp"
#include "cuda/routing/router_kernels.hpp"
#include "cuda/routing/router_math.cuh"
#include "cuda/routing/routing_device.cuh"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda {
namespace {

using detail::load_logit;
using detail::raise_flag;
using detail::ref_expf;
using detail::ref_max;
using detail::ref_sigmoid;

constexpr int kWarps = 2;  // 64 tokens per block
constexpr int kThreads = 32 * kWarps;

struct FwdArgs {
  const void* logits;  // (T, E) fp32 or bf16
  const float* bias;   // (E,) fp32, sigmoid_bias only
  int64_t T;
  int E, K;
  RouterKind kind;
  bool renormalize;
  int32_t* pair_offsets;  // (T+1,) int32 = t*K
  int32_t* pair_experts;  // (T*K,) int32, rank order
  float* pair_weights;    // (T*K,) fp32
  int32_t* flags;         // (kRoutingFlagCount,) int32
  bool vec;               // 16-byte tile loads (detail::tile_vec_ok)
};

template <int KMAX, typename InT>
__global__ void __launch_bounds__(kThreads, 12) router_topk_fast_kernel(FwdArgs a) {
  __shared__ __align__(16) detail::LogitTile tile[kWarps];  // per warp: 32 tokens × 32 experts
  __shared__ int32_t s_id[KMAX][kThreads];   // the token's selected experts, rank order
  __shared__ float s_x[KMAX][kThreads];      // ... and their logits
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, tid = threadIdx.x;
  const int64_t row0 = (int64_t(blockIdx.x) * kWarps + w) * 32;
  const int64_t t = row0 + lane;
  const InT* logits = static_cast<const InT*>(a.logits);
  const int E = a.E, K = a.K;
  const bool sig = a.kind == RouterKind::sigmoid_bias;
  if (blockIdx.x == 0 && tid == 0) a.pair_offsets[0] = 0;

  float kv[KMAX], xv[KMAX];  // top-K keys (descending) and their logits
  int id[KMAX];
#pragma unroll
  for (int j = 0; j < KMAX; ++j) {
    kv[j] = -INFINITY;
    xv[j] = 0.0f;
    id[j] = 0;
  }
  float m = -INFINITY;
  bool bad = false;
  auto select = [&](float v, int e) {
    bad |= !isfinite(v);
    m = ref_max(m, v);
    float key = v;
    if (sig) {
      const float b = __ldg(a.bias + e);
      bad |= !isfinite(b);
      key = __fadd_rn(ref_sigmoid(v), b);
    }
    if (key > kv[KMAX - 1]) {
      // Insert below every key >= this one (ties keep the earlier, lower expert ahead).
#pragma unroll
      for (int q = KMAX - 1; q > 0; --q) {
        if (kv[q - 1] < key) {
          kv[q] = kv[q - 1];
          xv[q] = xv[q - 1];
          id[q] = id[q - 1];
        } else if (kv[q] < key) {
          kv[q] = key;
          xv[q] = v;
          id[q] = e;
        }
      }
      if (kv[0] < key) {
        kv[0] = key;
        xv[0] = v;
        id[0] = e;
      }
    }
  };
  // Each lane walks its own row of the tile, four experts per 16-byte shared-memory read.
  auto walk_row = [&](int e0, auto&& fn) {
    const int ne = min(32, E - e0);
    const float4* row = reinterpret_cast<const float4*>(tile[w][lane]);
    if (ne == 32) {
#pragma unroll 2
      for (int j = 0; j < 8; ++j) {
        const float4 q = row[j];
        fn(q.x, e0 + 4 * j);
        fn(q.y, e0 + 4 * j + 1);
        fn(q.z, e0 + 4 * j + 2);
        fn(q.w, e0 + 4 * j + 3);
      }
    } else {
      for (int j = 0; j < ne; ++j) fn(tile[w][lane][j], e0 + j);
    }
  };
  for (int e0 = 0; e0 < E; e0 += 32) {
    detail::load_tile(logits, a.T, E, row0, e0, a.vec, tile[w]);
    __syncwarp();
    walk_row(e0, select);
    __syncwarp();
  }
  if (bad && t < a.T) raise_flag(a.flags, kFlagNonFinite);

  // softmax_topk without renormalisation weighs by p = exp(l - m) / sum over the whole row.
  float z = 1.0f;
  if (a.kind == RouterKind::softmax_topk && !a.renormalize) {
    z = 0.0f;
    for (int e0 = 0; e0 < E; e0 += 32) {
      detail::load_tile(logits, a.T, E, row0, e0, a.vec, tile[w]);
      __syncwarp();
      walk_row(e0, [&](float v, int) { z = __fadd_rn(z, ref_expf(__fsub_rn(v, m))); });
      __syncwarp();
    }
  }

#pragma unroll
  for (int j = 0; j < KMAX; ++j) {
    s_id[j][tid] = id[j];
    s_x[j][tid] = xv[j];
  }
  const detail::PairRule rule = detail::make_pair_rule(
      a.kind, a.renormalize, K, [&](int i) { return s_id[i][tid]; },
      [&](int i) { return s_x[i][tid]; }, m, z);
  if (t >= a.T) return;
#pragma unroll
  for (int j = 0; j < KMAX; ++j) {
    if (j < K) {
      a.pair_experts[t * K + j] = id[j];
      a.pair_weights[t * K + j] = detail::pair_weight(rule, xv[j]);
    }
  }
  a.pair_offsets[t + 1] = int32_t((t + 1) * K);
}

// K > 16: expert e is selected at rank r = #{e' better than e} when r < K ("better": larger key,
// or equal key and lower id), which is exactly the order the fast path's insertion produces.
template <typename InT>
__global__ void __launch_bounds__(kThreads) router_topk_generic_kernel(FwdArgs a) {
  const int64_t t = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (blockIdx.x == 0 && threadIdx.x == 0) a.pair_offsets[0] = 0;
  if (t >= a.T) return;
  const InT* row = static_cast<const InT*>(a.logits) + t * a.E;
  const int E = a.E, K = a.K;
  const bool sig = a.kind == RouterKind::sigmoid_bias;
  auto key_of = [&](int e) {
    const float v = load_logit(row + e);
    return sig ? __fadd_rn(ref_sigmoid(v), __ldg(a.bias + e)) : v;
  };
  float m = -INFINITY;
  bool bad = false;
  for (int e = 0; e < E; ++e) {
    const float v = load_logit(row + e);
    bad |= !isfinite(v) || (sig && !isfinite(__ldg(a.bias + e)));
    m = ref_max(m, v);
  }
  if (bad) raise_flag(a.flags, kFlagNonFinite);
  float z = 1.0f;
  if (a.kind == RouterKind::softmax_topk && !a.renormalize) {
    z = 0.0f;
    for (int e = 0; e < E; ++e) z = __fadd_rn(z, ref_expf(__fsub_rn(load_logit(row + e), m)));
  }
  int32_t* ids = a.pair_experts + t * K;
  for (int e = 0; e < E; ++e) {
    const float ke = key_of(e);
    int rank = 0;
    for (int f = 0; f < E && rank < K; ++f) {
      const float kf = key_of(f);
      rank += (kf > ke) || (kf == ke && f < e);
    }
    if (rank < K) ids[rank] = e;
  }
  const detail::PairRule rule = detail::make_pair_rule(
      a.kind, a.renormalize, K, [&](int i) { return ids[i]; },
      [&](int i) { return load_logit(row + ids[i]); }, m, z);
  for (int i = 0; i < K; ++i)
    a.pair_weights[t * K + i] = detail::pair_weight(rule, load_logit(row + ids[i]));
  a.pair_offsets[t + 1] = int32_t((t + 1) * K);
}

template <typename InT>
void launch_router(const FwdArgs& a, cudaStream_t stream) {
  const int grid = int(std::max<int64_t>(1, (a.T + kThreads - 1) / kThreads));
  if (a.K > 16) {
    router_topk_generic_kernel<InT><<<grid, kThreads, 0, stream>>>(a);
  } else if (a.K > 8) {
    router_topk_fast_kernel<16, InT><<<grid, kThreads, 0, stream>>>(a);
  } else if (a.K > 4) {
    router_topk_fast_kernel<8, InT><<<grid, kThreads, 0, stream>>>(a);
  } else if (a.K > 2) {
    router_topk_fast_kernel<4, InT><<<grid, kThreads, 0, stream>>>(a);
  } else if (a.K > 1) {
    router_topk_fast_kernel<2, InT><<<grid, kThreads, 0, stream>>>(a);
  } else {
    router_topk_fast_kernel<1, InT><<<grid, kThreads, 0, stream>>>(a);
  }
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void router_topk_async(const RouterConfig& cfg, const TensorView& logits, const float* bias,
                       Routing& out, int32_t* d_flags, cudaStream_t stream) {
  FwdArgs a;
  a.logits = logits.data;
  a.bias = bias;
  a.T = logits.dim(0);
  a.E = int(logits.dim(1));
  a.K = cfg.top_k;
  a.kind = cfg.kind;
  a.renormalize = cfg.renormalize;
  a.pair_offsets = out.pair_offsets();
  a.pair_experts = out.pair_experts();
  a.pair_weights = out.pair_weights();
  a.flags = d_flags;
  a.vec = logits.dtype == DType::bf16 ? detail::tile_vec_ok<uint16_t>(logits.data, a.E)
                                      : detail::tile_vec_ok<float>(logits.data, a.E);
  if (logits.dtype == DType::bf16)
    launch_router<uint16_t>(a, stream);
  else
    launch_router<float>(a, stream);
}

}  // namespace moeblaze::cuda
