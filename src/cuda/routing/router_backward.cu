// Router backward on the GPU: d logits (T, E) fp32 from d pair_weights (P,), for any routing
// whose pairs came from the logits (top-K or token-rounded: a token's pair set is read from the
// CSR, any size), plus the aux-loss and z-loss gradients. The CPU reference's formulas and
// operation order, one thread per token, no atomics.
//
// Per token: the weight rule of its pair set (router_math.cuh), dot = Σ g_i w_i in ascending
// expert order; then every d_{t,e} is written through the warp's shared-memory tile (coalesced
// row stores) with the value of a non-selected expert, and finally each pair's own entry is
// overwritten by its thread (ordered after the tile stores by __syncwarp).
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "cuda/cuda_backend.hpp"
#include "cuda/routing/router_kernels.hpp"
#include "cuda/routing/router_math.cuh"
#include "cuda/routing/routing_device.cuh"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda {
namespace {

using detail::kFullMask;
using detail::load_logit;
using detail::raise_flag;
using detail::ref_expf;
using detail::ref_max;
using detail::ref_sigmoid;

constexpr int kWarps = 2;
constexpr int kThreads = 32 * kWarps;

struct BwdArgs {
  const void* logits;          // (T, E) fp32 or bf16
  const float* bias;           // (E,) fp32 or nullptr: only checked (it gets no gradient)
  const int32_t* pair_offsets; // (T+1,)
  const int32_t* pair_experts; // (P,)
  const float* d_pair_weights; // (P,)
  const float* f;              // (E,) fp32 pair fraction per expert (aux only)
  float* d_logits;             // (T, E) fp32
  int64_t T;
  int E;
  RouterKind kind;
  bool renormalize, want_aux, want_z;
  float aux_scale, z_scale;
  const float* aux_grad;    // (1,) upstream gradient of the aux loss, or nullptr (1)
  const float* z_grad;      // (1,) ... of the z loss
  int32_t* flags;
  bool vec;  // 16-byte tile loads (detail::tile_vec_ok)
};

__device__ __forceinline__ void store_rows(float* __restrict__ d, int64_t T, int E, int64_t row0,
                                           int e0, detail::LogitTile& tile) {
  const int lane = threadIdx.x & 31;
  const int c = e0 + lane;
#pragma unroll 8
  for (int i = 0; i < 32; ++i) {
    const int64_t r = row0 + i;
    if (r < T && c < E) d[r * E + c] = tile[i][lane];
  }
}

// Per-token constants of the aux and z terms.
struct TokenConsts {
  float m, z;        // softmax: max and Σ exp(l - m) over the row
  float zs;          // sigmoid_bias aux: Σ sigmoid(l) over the row
  bool fallback;     // ... below FLT_MIN: log-domain softmax with (my, zy)
  float my, zy;
  float fq;          // Σ_e f_e q_e
  float lse;
};

// d of expert e of the token, `base` being the router term: adds the aux and z terms in the
// CPU's order.
__device__ __forceinline__ float add_loss_terms(const BwdArgs& a, const TokenConsts& c, int e,
                                                float v, float base) {
  float d = base;
  if (a.want_aux) {
    const bool sig = a.kind == RouterKind::sigmoid_bias;
    float q;
    if (!sig)
      q = __fdiv_rn(ref_expf(__fsub_rn(v, c.m)), c.z);
    else if (!c.fallback)
      q = __fdiv_rn(ref_sigmoid(v), c.zs);
    else
      q = __fdiv_rn(ref_expf(__fsub_rn(detail::log_sigmoid_ref(v), c.my)), c.zy);
    float term = __fmul_rn(__fmul_rn(a.aux_scale, q), __fsub_rn(__ldg(a.f + e), c.fq));
    if (sig) term = __fmul_rn(term, ref_sigmoid(-v));
    d = __fadd_rn(d, term);
  }
  if (a.want_z) {
    const float p = __fdiv_rn(ref_expf(__fsub_rn(v, c.m)), c.z);
    d = __fadd_rn(d, __fmul_rn(__fmul_rn(a.z_scale, c.lse), p));
  }
  return d;
}

template <typename InT>
__global__ void __launch_bounds__(kThreads) router_backward_kernel(BwdArgs a) {
  __shared__ __align__(16) detail::LogitTile tile[kWarps];
  // Autograd's upstream gradients of the losses: one rounding each, as the CPU scales them.
  if (a.aux_grad != nullptr) a.aux_scale = __fmul_rn(a.aux_scale, __ldg(a.aux_grad));
  if (a.z_grad != nullptr) a.z_scale = __fmul_rn(a.z_scale, __ldg(a.z_grad));
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int64_t row0 = (int64_t(blockIdx.x) * kWarps + w) * 32;
  const int64_t t = row0 + lane;
  const bool live = t < a.T;
  const InT* logits = static_cast<const InT*>(a.logits);
  const InT* row = logits + (live ? t : 0) * a.E;
  const int E = a.E;
  const bool sig = a.kind == RouterKind::sigmoid_bias;
  const bool plain_softmax = a.kind == RouterKind::softmax_topk && !a.renormalize;
  const bool need_p = plain_softmax || a.want_z || (a.want_aux && !sig);

  TokenConsts c{};
  c.m = -INFINITY;
  bool bad = false;
  for (int e0 = 0; e0 < E; e0 += 32) {
    detail::load_tile(logits, a.T, E, row0, e0, a.vec, tile[w]);
    __syncwarp();
    const int ne = min(32, E - e0);
    for (int j = 0; j < ne; ++j) {
      const float v = tile[w][lane][j];
      bad |= !isfinite(v);
      c.m = ref_max(c.m, v);
      if (sig && a.want_aux) c.zs = __fadd_rn(c.zs, ref_sigmoid(v));
    }
    __syncwarp();
  }
  if (need_p) {
    for (int e0 = 0; e0 < E; e0 += 32) {
      detail::load_tile(logits, a.T, E, row0, e0, a.vec, tile[w]);
      __syncwarp();
      const int ne = min(32, E - e0);
      for (int j = 0; j < ne; ++j) c.z = __fadd_rn(c.z, ref_expf(__fsub_rn(tile[w][lane][j], c.m)));
      __syncwarp();
    }
  }
  c.fallback = sig && a.want_aux && !(c.zs >= FLT_MIN);
  c.my = -INFINITY;
  if (__any_sync(kFullMask, c.fallback)) {
    for (int e0 = 0; e0 < E; e0 += 32) {
      detail::load_tile(logits, a.T, E, row0, e0, a.vec, tile[w]);
      __syncwarp();
      const int ne = min(32, E - e0);
      for (int j = 0; j < ne; ++j) c.my = ref_max(c.my, detail::log_sigmoid_ref(tile[w][lane][j]));
      __syncwarp();
    }
    for (int e0 = 0; e0 < E; e0 += 32) {
      detail::load_tile(logits, a.T, E, row0, e0, a.vec, tile[w]);
      __syncwarp();
      const int ne = min(32, E - e0);
      for (int j = 0; j < ne; ++j)
        c.zy = __fadd_rn(c.zy, ref_expf(__fsub_rn(detail::log_sigmoid_ref(tile[w][lane][j]), c.my)));
      __syncwarp();
    }
  }
  if (a.want_z) c.lse = __fadd_rn(c.m, logf(c.z));

  // The token's pairs, their weights and dot = Σ g_i w_i (ascending expert order).
  const int32_t begin = live ? a.pair_offsets[t] : 0;
  const int n = live ? a.pair_offsets[t + 1] - begin : 0;
  const int32_t* ids = a.pair_experts + begin;
  const float* g = a.d_pair_weights + begin;
  auto id_at = [&](int i) { return __ldg(ids + i); };
  auto x_at = [&](int i) { return load_logit(row + __ldg(ids + i)); };
  for (int i = 0; i < n; ++i) bad |= !isfinite(__ldg(g + i));
  if (bad && live) raise_flag(a.flags, kFlagNonFinite);
  const detail::PairRule rule =
      detail::make_pair_rule(a.kind, a.renormalize, n, id_at, x_at, c.m, c.z);
  float dot = 0.0f;
  detail::for_each_by_expert(n, id_at, [&](int i) {
    dot = __fadd_rn(dot, __fmul_rn(__ldg(g + i), detail::pair_weight(rule, x_at(i))));
  });

  if (a.want_aux) {
    c.fq = 0.0f;
    for (int e0 = 0; e0 < E; e0 += 32) {
      detail::load_tile(logits, a.T, E, row0, e0, a.vec, tile[w]);
      __syncwarp();
      const int ne = min(32, E - e0);
      for (int j = 0; j < ne; ++j) {
        const float v = tile[w][lane][j];
        float q;
        if (!sig)
          q = __fdiv_rn(ref_expf(__fsub_rn(v, c.m)), c.z);
        else if (!c.fallback)
          q = __fdiv_rn(ref_sigmoid(v), c.zs);
        else
          q = __fdiv_rn(ref_expf(__fsub_rn(detail::log_sigmoid_ref(v), c.my)), c.zy);
        c.fq = __fadd_rn(c.fq, __fmul_rn(__ldg(a.f + e0 + j), q));
      }
      __syncwarp();
    }
  }

  // Every entry as if its expert were not selected, written row-wise through the tile.
  for (int e0 = 0; e0 < E; e0 += 32) {
    detail::load_tile(logits, a.T, E, row0, e0, a.vec, tile[w]);
    __syncwarp();
    const int ne = min(32, E - e0);
    for (int j = 0; j < ne; ++j) {
      const float v = tile[w][lane][j];
      float base = 0.0f;
      if (plain_softmax && n > 0)
        base = __fmul_rn(-__fdiv_rn(ref_expf(__fsub_rn(v, c.m)), c.z), dot);
      tile[w][lane][j] = add_loss_terms(a, c, e0 + j, v, base);
    }
    __syncwarp();
    store_rows(a.d_logits, a.T, E, row0, e0, tile[w]);
    __syncwarp();
  }
  // The selected experts' entries (program order after the warp's stores above).
  for (int i = 0; i < n; ++i) {
    const int e = id_at(i);
    const float x = x_at(i);
    const float gi = __ldg(g + i);
    float base;
    if (plain_softmax) {
      base = __fmul_rn(__fdiv_rn(ref_expf(__fsub_rn(x, c.m)), c.z), __fsub_rn(gi, dot));
    } else if (sig) {
      const float wi = detail::pair_weight(rule, x);
      const float sneg = ref_sigmoid(-x);
      base = a.renormalize ? __fmul_rn(__fmul_rn(wi, sneg), __fsub_rn(gi, dot))
                           : __fmul_rn(__fmul_rn(gi, wi), sneg);
    } else {
      base = __fmul_rn(detail::pair_weight(rule, x), __fsub_rn(gi, dot));
    }
    a.d_logits[t * E + e] = add_loss_terms(a, c, e, x, base);
  }
}

}  // namespace

void router_backward_async(const RouterConfig& cfg, const TensorView& logits, const float* bias,
                           const RoutingView& routing, const float* d_pair_weights,
                           float* d_logits, const float* f, float aux_scale, float z_scale,
                           int32_t* d_flags, cudaStream_t stream, const float* d_aux_grad,
                           const float* d_z_grad) {
  BwdArgs a;
  a.logits = logits.data;
  a.bias = bias;
  a.pair_offsets = routing.pair_offsets;
  a.pair_experts = routing.pair_experts;
  a.d_pair_weights = d_pair_weights;
  a.f = f;
  a.d_logits = d_logits;
  a.T = logits.dim(0);
  a.E = int(logits.dim(1));
  a.kind = cfg.kind;
  a.renormalize = cfg.renormalize;
  a.want_aux = cfg.aux_loss_coef > 0.0f;
  a.want_z = cfg.z_loss_coef > 0.0f;
  a.aux_scale = aux_scale;
  a.z_scale = z_scale;
  a.aux_grad = d_aux_grad;
  a.z_grad = d_z_grad;
  a.flags = d_flags;
  a.vec = logits.dtype == DType::bf16 ? detail::tile_vec_ok<uint16_t>(logits.data, a.E)
                                      : detail::tile_vec_ok<float>(logits.data, a.E);
  if (a.T == 0) return;
  const int grid = int((a.T + kThreads - 1) / kThreads);
  if (logits.dtype == DType::bf16)
    router_backward_kernel<uint16_t><<<grid, kThreads, 0, stream>>>(a);
  else
    router_backward_kernel<float><<<grid, kThreads, 0, stream>>>(a);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeblaze::cuda
