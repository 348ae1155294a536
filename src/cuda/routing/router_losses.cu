// Router auxiliary losses on the GPU, deterministic: the switch load-balancing loss
// coef·E·Σ_e f_e·P_e and the z-loss coef·mean_t lse_t², with the CPU reference's exact
// decomposition (per 64-token chunk partial sums in token order, chunk partials added in chunk
// order, the final sums in double), so the losses match it bit for bit. No atomics: every
// partial has one writer, and reductions run in a fixed order.
// Also the deterministic per-expert pair count (a histogram without atomics) used by the aux
// loss and its gradient.
#include <cuda_runtime.h>

#include <algorithm>
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
using detail::ref_expf;
using detail::ref_max;
using detail::ref_sigmoid;

constexpr int kChunk = 64;  // tokens per partial: the CPU's router_math::kTokenChunk
constexpr int kHistWarps = 8;
constexpr int kHistPairsPerWarp = 1024;

// ---- per-expert pair counts -------------------------------------------------------------------
// Block b counts pairs [b·8192, (b+1)·8192) into per-warp shared counters (one leader lane per
// distinct expert in a warp step writes, so no two writers meet) and writes its row of partials.
__global__ void __launch_bounds__(kHistWarps * 32)
expert_hist_partial_kernel(const int32_t* __restrict__ experts, int64_t P, int E, int bits,
                           int32_t* __restrict__ partial) {  // (blocks, E) int32
  extern __shared__ int32_t s_cnt[];                        // (kHistWarps, E)
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  for (int i = threadIdx.x; i < kHistWarps * E; i += blockDim.x) s_cnt[i] = 0;
  __syncthreads();
  const int64_t begin = (int64_t(blockIdx.x) * kHistWarps + w) * kHistPairsPerWarp;
  int32_t* cnt = s_cnt + w * E;
  for (int s = 0; s < kHistPairsPerWarp; s += 32) {
    if (begin + s >= P) break;
    const int64_t p = begin + s + lane;
    int32_t e = p < P ? __ldg(experts + p) : -1;
    if (e < 0 || e >= E) e = -1;
    const unsigned peers = detail::match_peers(e, bits);
    if (e >= 0 && lane == __ffs(peers) - 1) cnt[e] += __popc(peers);
    __syncwarp();
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t c = 0;
    for (int v = 0; v < kHistWarps; ++v) c += s_cnt[v * E + e];
    partial[int64_t(blockIdx.x) * E + e] = c;
  }
}

__global__ void expert_hist_reduce_kernel(const int32_t* __restrict__ partial, int blocks, int E,
                                          int64_t P, int32_t* __restrict__ counts,
                                          float* __restrict__ f) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  int64_t c = 0;
  for (int b = 0; b < blocks; ++b) c += partial[int64_t(b) * E + e];
  counts[e] = int32_t(c);
  // f_e = count / P in double, rounded once to float: the CPU backward's expression.
  if (f != nullptr) f[e] = P > 0 ? __double2float_rn(__ddiv_rn(double(c), double(P))) : 0.0f;
}

int hist_blocks(int64_t P) {
  const int64_t per = int64_t(kHistWarps) * kHistPairsPerWarp;
  return int(std::max<int64_t>(1, (P + per - 1) / per));
}

// ---- loss partials: one thread per token, one block per 64-token chunk ------------------------
struct LossArgs {
  const void* logits;  // (T, E)
  int64_t T;
  int E;
  bool sigmoid_q;      // sigmoid_bias: P_e averages normalised sigmoids, not the softmax
  bool want_aux, want_z;
  float* q_partial;    // (chunks, E) fp32: Σ_{t in chunk} q_{t,e}, token order
  float* lse2_partial; // (chunks,) fp32: Σ_{t in chunk} lse_t², token order
  int32_t* flags;
  bool vec;            // 16-byte tile loads (detail::tile_vec_ok)
};

template <typename InT>
__global__ void __launch_bounds__(kChunk) router_loss_partials_kernel(LossArgs a) {
  __shared__ __align__(16) detail::LogitTile tile[2];  // per warp: 32 tokens × 32 experts
  __shared__ float q_tile[kChunk][33];
  __shared__ float s_sq[kChunk];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, tid = threadIdx.x;
  const int64_t row0 = int64_t(blockIdx.x) * kChunk + w * 32;
  const InT* logits = static_cast<const InT*>(a.logits);
  const int E = a.E;

  // Pass 1: row max (and the sigmoid sum, which needs no max).
  float m = -INFINITY, zs = 0.0f;
  for (int e0 = 0; e0 < E; e0 += 32) {
    detail::load_tile(logits, a.T, E, row0, e0, a.vec, tile[w]);
    __syncwarp();
    const int ne = min(32, E - e0);
    for (int j = 0; j < ne; ++j) {
      const float v = tile[w][lane][j];
      m = ref_max(m, v);
      if (a.sigmoid_q && a.want_aux) zs = __fadd_rn(zs, ref_sigmoid(v));
    }
    __syncwarp();
  }
  // Pass 2: z = Σ exp(l - m), for the softmax and for lse.
  float z = 0.0f;
  const bool need_z = a.want_z || (a.want_aux && !a.sigmoid_q);
  if (need_z) {
    for (int e0 = 0; e0 < E; e0 += 32) {
      detail::load_tile(logits, a.T, E, row0, e0, a.vec, tile[w]);
      __syncwarp();
      const int ne = min(32, E - e0);
      for (int j = 0; j < ne; ++j) z = __fadd_rn(z, ref_expf(__fsub_rn(tile[w][lane][j], m)));
      __syncwarp();
    }
  }
  // The normalised sigmoid's underflow fallback (every sigmoid of the row below FLT_MIN).
  const bool fallback = a.sigmoid_q && a.want_aux && !(zs >= FLT_MIN);
  float my = -INFINITY, zy = 0.0f;
  if (__any_sync(kFullMask, fallback)) {
    for (int e0 = 0; e0 < E; e0 += 32) {
      detail::load_tile(logits, a.T, E, row0, e0, a.vec, tile[w]);
      __syncwarp();
      const int ne = min(32, E - e0);
      for (int j = 0; j < ne; ++j) my = ref_max(my, detail::log_sigmoid_ref(tile[w][lane][j]));
      __syncwarp();
    }
    for (int e0 = 0; e0 < E; e0 += 32) {
      detail::load_tile(logits, a.T, E, row0, e0, a.vec, tile[w]);
      __syncwarp();
      const int ne = min(32, E - e0);
      for (int j = 0; j < ne; ++j)
        zy = __fadd_rn(zy, ref_expf(__fsub_rn(detail::log_sigmoid_ref(tile[w][lane][j]), my)));
      __syncwarp();
    }
  }

  if (a.want_z) {
    const float lse = __fadd_rn(m, logf(z));
    s_sq[tid] = __fmul_rn(lse, lse);
    __syncthreads();
    if (tid == 0) {
      float acc = 0.0f;
      for (int i = 0; i < kChunk && int64_t(blockIdx.x) * kChunk + i < a.T; ++i)
        acc = __fadd_rn(acc, s_sq[i]);
      a.lse2_partial[blockIdx.x] = acc;
    }
  }
  if (!a.want_aux) return;
  // Pass 3: q_{t,e}, summed over the chunk's tokens in token order per expert.
  for (int e0 = 0; e0 < E; e0 += 32) {
    detail::load_tile(logits, a.T, E, row0, e0, a.vec, tile[w]);
    __syncwarp();
    const int ne = min(32, E - e0);
    for (int j = 0; j < ne; ++j) {
      const float v = tile[w][lane][j];
      float q;
      if (!a.sigmoid_q)
        q = __fdiv_rn(ref_expf(__fsub_rn(v, m)), z);
      else if (!fallback)
        q = __fdiv_rn(ref_sigmoid(v), zs);
      else
        q = __fdiv_rn(ref_expf(__fsub_rn(detail::log_sigmoid_ref(v), my)), zy);
      q_tile[tid][j] = q;
    }
    __syncthreads();
    if (tid < ne) {
      float acc = 0.0f;
      for (int i = 0; i < kChunk && int64_t(blockIdx.x) * kChunk + i < a.T; ++i)
        acc = __fadd_rn(acc, q_tile[i][tid]);
      a.q_partial[int64_t(blockIdx.x) * E + e0 + tid] = acc;
    }
    __syncthreads();
  }
}

// P_e = Σ_chunks q_partial (chunk order), then the losses in double exactly as the CPU forms them.
__global__ void router_aux_P_kernel(const float* __restrict__ q_partial, int chunks, int E,
                                    float* __restrict__ P) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  float acc = 0.0f;
  for (int c = 0; c < chunks; ++c) acc = __fadd_rn(acc, q_partial[int64_t(c) * E + e]);
  P[e] = acc;
}

__global__ void router_loss_final_kernel(const float* __restrict__ P,
                                         const int32_t* __restrict__ counts,
                                         const float* __restrict__ lse2_partial, int chunks,
                                         int64_t T, int E, int64_t TK, float aux_coef,
                                         float z_coef, bool want_aux, bool want_z,
                                         double* __restrict__ losses,  // (2,) aux, z or null
                                         float* __restrict__ aux_f32,   // (1,) or null
                                         float* __restrict__ z_f32) {   // (1,) or null
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  double aux = 0.0, zl = 0.0;
  if (T > 0 && TK > 0 && want_aux) {  // no pairs (a rounding may drop them all): aux = 0
    double sum = 0.0;
    for (int e = 0; e < E; ++e)
      sum = __dadd_rn(sum, __dmul_rn(__ddiv_rn(double(counts[e]), double(TK)),
                                     __ddiv_rn(double(P[e]), double(T))));
    aux = __dmul_rn(__dmul_rn(double(aux_coef), double(E)), sum);
  }
  if (T > 0 && want_z) {
    float sum = 0.0f;
    for (int c = 0; c < chunks; ++c) sum = __fadd_rn(sum, lse2_partial[c]);
    zl = __ddiv_rn(__dmul_rn(double(z_coef), double(sum)), double(T));
  }
  if (losses != nullptr) {
    losses[0] = aux;
    losses[1] = zl;
  }
  // Rounded once, as the C ABI's CPU path rounds RouterLosses.
  if (aux_f32 != nullptr) *aux_f32 = __double2float_rn(aux);
  if (z_f32 != nullptr) *z_f32 = __double2float_rn(zl);
}

size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

struct LossLayout {
  size_t q = 0, lse2 = 0, P = 0, counts = 0, hist = 0, total = 0;
};
LossLayout loss_layout(int64_t T, int64_t E, int64_t TK) {
  LossLayout l;
  const int64_t chunks = std::max<int64_t>(1, (T + kChunk - 1) / kChunk);
  l.q = 0;
  l.lse2 = l.q + align_up(sizeof(float) * size_t(chunks * E));
  l.P = l.lse2 + align_up(sizeof(float) * size_t(chunks));
  l.counts = l.P + align_up(sizeof(float) * size_t(E));
  l.hist = l.counts + align_up(sizeof(int32_t) * size_t(E));
  l.total = l.hist + align_up(sizeof(int32_t) * size_t(hist_blocks(TK)) * size_t(E));
  return l;
}

size_t hist_smem(int E) { return size_t(kHistWarps) * size_t(E) * sizeof(int32_t); }

}  // namespace

void expert_counts_async(const int32_t* experts, int64_t P, int E, int32_t* partial_ws,
                         int32_t* counts, float* f, cudaStream_t stream) {
  static const bool raised = [] {
    MOEBLAZE_CUDA_CHECK(cudaFuncSetAttribute(expert_hist_partial_kernel,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             200 * 1024));
    return true;
  }();
  (void)raised;
  MOEBLAZE_UNSUPPORTED_IF(hist_smem(E) > 200 * 1024, "num_experts E (", E,
                          ") is too large for the GPU expert histogram of the aux loss");
  const int blocks = hist_blocks(P);
  expert_hist_partial_kernel<<<blocks, kHistWarps * 32, hist_smem(E), stream>>>(
      experts, P, E, detail::expert_bits(E), partial_ws);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
  expert_hist_reduce_kernel<<<(E + 255) / 256, 256, 0, stream>>>(partial_ws, blocks, E, P,
                                                                 counts, f);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

size_t expert_counts_workspace_bytes(int64_t P, int64_t E) {
  return align_up(sizeof(int32_t) * size_t(hist_blocks(P)) * size_t(E)) +
         align_up(sizeof(int32_t) * size_t(E)) + align_up(sizeof(float) * size_t(E));
}

size_t router_loss_workspace_bytes(int64_t T, int64_t E, int64_t TK) {
  return loss_layout(T, E, TK).total;
}

void router_losses_async(const RouterConfig& cfg, const TensorView& logits,
                         const int32_t* pair_experts, int64_t TK, void* workspace,
                         double* d_losses, cudaStream_t stream, float* d_aux_f32,
                         float* d_z_f32, float* d_f) {
  const int64_t T = logits.dim(0);
  const int E = int(logits.dim(1));
  const bool want_aux = cfg.aux_loss_coef > 0.0f, want_z = cfg.z_loss_coef > 0.0f;
  const LossLayout l = loss_layout(T, E, TK);
  char* ws = static_cast<char*>(workspace);
  float* q_partial = reinterpret_cast<float*>(ws + l.q);        // (chunks, E)
  float* lse2 = reinterpret_cast<float*>(ws + l.lse2);          // (chunks,)
  float* P = reinterpret_cast<float*>(ws + l.P);                // (E,)
  int32_t* counts = reinterpret_cast<int32_t*>(ws + l.counts);  // (E,)
  int32_t* hist = reinterpret_cast<int32_t*>(ws + l.hist);      // (hist blocks, E)
  const int chunks = int((T + kChunk - 1) / kChunk);
  if (T > 0 && (want_aux || want_z)) {
    LossArgs a;
    a.logits = logits.data;
    a.T = T;
    a.E = E;
    a.sigmoid_q = cfg.kind == RouterKind::sigmoid_bias;
    a.want_aux = want_aux;
    a.want_z = want_z;
    a.q_partial = q_partial;
    a.lse2_partial = lse2;
    a.flags = nullptr;
    a.vec = logits.dtype == DType::bf16 ? detail::tile_vec_ok<uint16_t>(logits.data, E)
                                        : detail::tile_vec_ok<float>(logits.data, E);
    if (logits.dtype == DType::bf16)
      router_loss_partials_kernel<uint16_t><<<chunks, kChunk, 0, stream>>>(a);
    else
      router_loss_partials_kernel<float><<<chunks, kChunk, 0, stream>>>(a);
    MOEBLAZE_CUDA_CHECK(cudaGetLastError());
    if (want_aux) {
      router_aux_P_kernel<<<(E + 255) / 256, 256, 0, stream>>>(q_partial, chunks, E, P);
      MOEBLAZE_CUDA_CHECK(cudaGetLastError());
    }
  }
  if ((T > 0 && want_aux) || d_f != nullptr)
    expert_counts_async(pair_experts, TK, E, hist, counts, d_f, stream);
  router_loss_final_kernel<<<1, 32, 0, stream>>>(P, counts, lse2, chunks, T, E, TK,
                                                 cfg.aux_loss_coef, cfg.z_loss_coef, want_aux,
                                                 want_z, d_losses, d_aux_f32, d_z_f32);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeblaze::cuda
