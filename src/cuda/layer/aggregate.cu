// Aggregation through the plan's token view (docs/DESIGN.md's steps 3 and 7): out_t = sum over the
// pairs of token t, in pair order, of w_p * rows[slot_p]. A gather-and-sum, not a scatter: every
// output row is produced by the threads that own it, so no atomics and a fixed summation order.
// (The layer's dx sum hands in a token view whose map lists each token's slots in ascending order,
// expert_ranges.hpp's ascending_token_slots: the order its expert ranges can keep.)
//
// Layout of the work: a thread owns C 16-byte column chunks of one token, spaced C-th of a row
// apart (c, c + Q, c + 2Q, ...), so consecutive threads take consecutive chunks (coalesced
// 16-byte gathers and stores), and loads the rows of B pairs before summing them: C x B = 4
// independent 16-byte loads in flight per thread behind one walk of the token's index chain
// (offsets -> pair -> slot -> weight). C = 1, B = 4 when tokens have many pairs (K > 6 on
// average); C = 2, B = 4 for 2 < K <= 6 (8 loads in flight, the index walk shared by 2 chunks:
// C = 1 left the K = 4 configs short of copy bandwidth); C = 4, B = 1 otherwise: with C = 1 a
// K = 1 token gave each thread a single 16-byte load behind three dependent index loads
// (docs/notes/plan-build.md). The index arrays (a few bytes per pair) stay in
// L1/L2. Every output element is summed over its pairs in pair order whatever C and B are, so
// the result does not depend on them.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math_constants.h>  // CUDART_NAN_F

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/cuda_backend.hpp"
#include "cuda/layer/token_chunks.hpp"
#include "cuda/pdl.cuh"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
struct Vec;  // one 16-byte chunk of T, unpacked to floats
template <>
struct Vec<__nv_bfloat16> {
  static constexpr int kElems = 8;
  static __device__ __forceinline__ void unpack(const uint4& raw, float* f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 v = __bfloat1622float2(h[i]);
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
  static __device__ __forceinline__ uint4 pack(const float* f) {
    uint4 raw;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    return raw;
  }
};
template <>
struct Vec<float> {
  static constexpr int kElems = 4;
  static __device__ __forceinline__ void unpack(const uint4& raw, float* f) {
    f[0] = __uint_as_float(raw.x);
    f[1] = __uint_as_float(raw.y);
    f[2] = __uint_as_float(raw.z);
    f[3] = __uint_as_float(raw.w);
  }
  static __device__ __forceinline__ uint4 pack(const float* f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                      __float_as_uint(f[3]));
  }
};

__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(float v) { return v; }
template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ float from_f<float>(float v) { return v; }

// Token t's chunks q + k * Q (k < C, below `chunks`, Q = ceil(chunks / C)) of
// out[t, :] = sum over its pairs p of w_p * rows[row_map[p], :], w_p by slot token_index_map[p].
// rows (*, d) T, out (T, d) T; d a multiple of Vec<T>::kElems and both 16-byte aligned.
// row_map (kChunk) is a chunk's pair_rows into its buffer (token_chunks.hpp), else the rows are
// the whole step's (S, d), row = slot: the sum is the same either way. kBias: each pair also adds
// w_p * bias[e_p, :] (bias (E, d) T, e_p = pair_experts[p]: the expert biases b2).
template <typename T, bool kWeighted, bool kChunk, int C, int kBatch, bool kBias = false>
__device__ __forceinline__ void aggregate_token(int64_t t, int64_t q, int64_t quarter_chunks,
                                                const int32_t* __restrict__ token_pair_offsets,
                                                const int32_t* __restrict__ token_index_map,
                                                const int32_t* __restrict__ row_map,
                                                const float* __restrict__ slot_weights,
                                                const T* __restrict__ rows, T* __restrict__ out,
                                                int64_t d, const T* __restrict__ bias = nullptr,
                                                const int32_t* __restrict__ pair_experts = nullptr) {
  constexpr int V = Vec<T>::kElems;
  const int64_t chunks = d / V;
  const int p0 = token_pair_offsets[t], p1 = token_pair_offsets[t + 1];

  float acc[C][V];
#pragma unroll
  for (int k = 0; k < C; ++k)
#pragma unroll
    for (int j = 0; j < V; ++j) acc[k][j] = 0.0f;

  for (int p = p0; p < p1; p += kBatch) {
    uint4 raw[kBatch][C];
    uint4 braw[kBias ? kBatch : 1][kBias ? C : 1];
    float w[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (p + b < p1) {
        const int64_t slot = token_index_map[p + b];
        // slot < 0: a pair the plan builder left out (its flag is raised). Its weight is NaN and
        // nothing is loaded for it, so the token's row comes out NaN instead of a pair short.
        w[b] = slot < 0 ? CUDART_NAN_F : kWeighted ? slot_weights[slot] : 1.0f;
        if (slot < 0) continue;
        const int64_t r = kChunk ? int64_t(row_map[p + b]) : slot;
        const uint4* row = reinterpret_cast<const uint4*>(rows + r * d);
        const uint4* brow =
            kBias ? reinterpret_cast<const uint4*>(bias + int64_t(pair_experts[p + b]) * d) : row;
#pragma unroll
        for (int k = 0; k < C; ++k) {
          const int64_t c = q + k * quarter_chunks;
          if (c < chunks) {
            raw[b][k] = __ldg(row + c);
            if constexpr (kBias) braw[b][k] = __ldg(brow + c);
          }
        }
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (p + b < p1) {
#pragma unroll
        for (int k = 0; k < C; ++k) {
          if (q + k * quarter_chunks < chunks) {
            float f[V];
            Vec<T>::unpack(raw[b][k], f);
#pragma unroll
            for (int j = 0; j < V; ++j)  // unweighted: w = 1, and fma(1, f, acc) = acc + f
              acc[k][j] = fmaf(w[b], f[j], acc[k][j]);
            if constexpr (kBias) {  // the pair's y_p + b2_e, weighted like y_p
              Vec<T>::unpack(braw[b][k], f);
#pragma unroll
              for (int j = 0; j < V; ++j) acc[k][j] = fmaf(w[b], f[j], acc[k][j]);
            }
          }
        }
      }
    }
  }
  uint4* out_row = reinterpret_cast<uint4*>(out + t * d);
#pragma unroll
  for (int k = 0; k < C; ++k) {
    const int64_t c = q + k * quarter_chunks;
    if (c < chunks) out_row[c] = Vec<T>::pack(acc[k]);
  }
}

// rows (S, d) T, out (T, d) T: one (token, quarter) per thread.
// bias (E, d) T and pair_experts (S,) with kBias, else unread.
template <typename T, bool kWeighted, int C, int kBatch, bool kBias>
__global__ void __launch_bounds__(kThreads, 3)  // <= 85 registers: 768 threads per SM, no spill
    aggregate_vec_kernel(const int32_t* __restrict__ token_pair_offsets,  // (T+1,)
                         const int32_t* __restrict__ token_index_map,     // (S,) pair → slot
                         const float* __restrict__ slot_weights,          // (S,) by slot
                         const T* __restrict__ rows, T* __restrict__ out, int64_t num_tokens,
                         int64_t d, const T* __restrict__ bias,
                         const int32_t* __restrict__ pair_experts) {
  pdl_wait();  // before any global memory access (src/cuda/pdl.cuh)
  pdl_launch_dependents();
  const int64_t quarter_chunks = (d / Vec<T>::kElems + C - 1) / C;
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= num_tokens * quarter_chunks) return;
  const int64_t t = i / quarter_chunks;
  aggregate_token<T, kWeighted, false, C, kBatch, kBias>(
      t, i - t * quarter_chunks, quarter_chunks, token_pair_offsets, token_index_map, nullptr,
      slot_weights, rows, out, d, bias, pair_experts);
}

// One token chunk: tokens [token_bounds[c], token_bounds[c + 1]) (on the device), rows the
// chunk's buffer addressed through pair_rows; a grid-stride loop, as the host does not know how
// many tokens the chunk holds.
template <typename T, bool kWeighted, int C, int kBatch, bool kBias>
__global__ void __launch_bounds__(kThreads, 3)
    aggregate_chunk_kernel(const int32_t* __restrict__ token_pair_offsets,  // (T+1,)
                           const int32_t* __restrict__ token_index_map,     // (S,) pair → slot
                           const int32_t* __restrict__ pair_rows,           // (S,) pair → row
                           const int32_t* __restrict__ token_bounds,        // (chunks+1,)
                           int64_t c, const float* __restrict__ slot_weights,
                           const T* __restrict__ rows, T* __restrict__ out, int64_t d,
                           const T* __restrict__ bias, const int32_t* __restrict__ pair_experts) {
  pdl_wait();
  pdl_launch_dependents();
  const int64_t quarter_chunks = (d / Vec<T>::kElems + C - 1) / C;
  const int64_t t0 = token_bounds[c];
  const int64_t items = (token_bounds[c + 1] - t0) * quarter_chunks;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < items;
       i += int64_t(gridDim.x) * kThreads) {
    const int64_t k = i / quarter_chunks;
    aggregate_token<T, kWeighted, true, C, kBatch, kBias>(
        t0 + k, i - k * quarter_chunks, quarter_chunks, token_pair_offsets, token_index_map,
        pair_rows, slot_weights, rows, out, d, bias, pair_experts);
  }
}

// Any d, any alignment: one thread per output element, same order and arithmetic.
template <typename T, bool kWeighted>
__global__ void __launch_bounds__(kThreads)
    aggregate_scalar_kernel(const int32_t* __restrict__ token_pair_offsets,
                            const int32_t* __restrict__ token_index_map,
                            const float* __restrict__ slot_weights, const T* __restrict__ rows,
                            T* __restrict__ out, int64_t num_tokens, int64_t d) {
  pdl_wait();
  pdl_launch_dependents();
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= num_tokens * d) return;
  const int64_t t = i / d;
  const int64_t col = i - t * d;
  float acc = 0.0f;
  for (int p = token_pair_offsets[t]; p < token_pair_offsets[t + 1]; ++p) {
    const int64_t slot = token_index_map[p];
    if (slot < 0) {  // a pair the plan builder left out (its flag is raised): NaN, not short
      acc = CUDART_NAN_F;
      continue;
    }
    const float v = to_f(rows[slot * d + col]);
    acc = kWeighted ? fmaf(slot_weights[slot], v, acc) : acc + v;
  }
  out[i] = from_f<T>(acc);
}

template <typename T, bool kWeighted, int C, int kBatch, bool kBias = false>
void launch_vec(const RoutingPlanView& plan, const void* rows, const float* w, void* out,
                int64_t d, cudaStream_t stream, const void* bias = nullptr) {
  const int64_t work = plan.T * ((d / Vec<T>::kElems + C - 1) / C);
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  MOEBLAZE_UNSUPPORTED_IF(blocks > int64_t(INT32_MAX), "aggregate: T*d (", plan.T * d,
                          ") is too large for one launch");
  launch_kernel(&aggregate_vec_kernel<T, kWeighted, C, kBatch, kBias>, dim3(unsigned(blocks)),
                dim3(kThreads), 0, stream, 1, plan.token_pair_offsets, plan.token_index_map, w,
                static_cast<const T*>(rows), static_cast<T*>(out), plan.T, d,
                static_cast<const T*>(bias), plan.token_expert_indices);
}

// Calls f(C, B) (std::integral_constant values) with the vector layout for the plan's pairs per
// token (the header's rule: C = 1, B = 4 above 6; C = 2, B = 4 above 2; C = 4, B = 1 otherwise).
template <class F>
void with_vec_layout(const RoutingPlanView& plan, F&& f) {
  using std::integral_constant;
  if (plan.S > 6 * plan.T) f(integral_constant<int, 1>{}, integral_constant<int, 4>{});
  else if (plan.S > 2 * plan.T) f(integral_constant<int, 2>{}, integral_constant<int, 4>{});
  else f(integral_constant<int, 4>{}, integral_constant<int, 1>{});
}

template <typename T, bool kWeighted>
void launch_aggregate(const RoutingPlanView& plan, const void* rows, const float* w, void* out,
                      int64_t d, cudaStream_t stream) {
  constexpr int V = Vec<T>::kElems;
  const bool aligned = (reinterpret_cast<uintptr_t>(rows) % 16 == 0) &&
                       (reinterpret_cast<uintptr_t>(out) % 16 == 0) && d % V == 0;
  if (aligned) {
    with_vec_layout(plan, [&](auto C, auto B) {
      launch_vec<T, kWeighted, decltype(C)::value, decltype(B)::value>(plan, rows, w, out, d,
                                                                       stream);
    });
  } else {
    const int64_t blocks = (plan.T * d + kThreads - 1) / kThreads;
    MOEBLAZE_UNSUPPORTED_IF(blocks > int64_t(INT32_MAX), "aggregate: T*d (", plan.T * d,
                            ") is too large for one launch");
    launch_kernel(&aggregate_scalar_kernel<T, kWeighted>, dim3(unsigned(blocks)), dim3(kThreads),
                  0, stream, 1, plan.token_pair_offsets, plan.token_index_map, w,
                  static_cast<const T*>(rows), static_cast<T*>(out), plan.T, d);
  }
}

// Chunk c with the (C, B) layout with_vec_layout picks; the grid covers the chunk's share of the
// tokens (T / count), the loop any more.
template <typename T, bool kWeighted, int C, int kBatch, bool kBias>
void launch_chunk(const RoutingPlanView& plan, const TokenChunks& chunks, const ChunkMaps& maps,
                  int64_t c, const void* rows, const float* w, void* out, int64_t d,
                  cudaStream_t stream, const void* bias) {
  const int64_t tokens = (plan.T + chunks.count - 1) / chunks.count;
  const int64_t work = tokens * ((d / Vec<T>::kElems + C - 1) / C);
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads,
                                                                int64_t(INT32_MAX)));
  launch_kernel(&aggregate_chunk_kernel<T, kWeighted, C, kBatch, kBias>, dim3(unsigned(blocks)),
                dim3(kThreads), 0, stream, 1, plan.token_pair_offsets, plan.token_index_map,
                maps.pair_rows, maps.token_bounds, c, w, static_cast<const T*>(rows),
                static_cast<T*>(out), d, static_cast<const T*>(bias), plan.token_expert_indices);
}

template <bool kWeighted, bool kBias = false>
void launch_chunk_bf16(const RoutingPlanView& plan, const TokenChunks& chunks,
                       const ChunkMaps& maps, int64_t c, const void* rows, const float* w,
                       void* out, int64_t d, cudaStream_t stream, const void* bias = nullptr) {
  with_vec_layout(plan, [&](auto C, auto B) {
    launch_chunk<__nv_bfloat16, kWeighted, decltype(C)::value, decltype(B)::value, kBias>(
        plan, chunks, maps, c, rows, w, out, d, stream, bias);
  });
}

__global__ void gather_pair_grads_kernel(const int32_t* __restrict__ token_index_map,  // (S,)
                                         const float* __restrict__ ds,  // (S,) by slot
                                         float* __restrict__ d_pair_weights,  // (S,) by pair
                                         int64_t S) {
  pdl_wait();
  pdl_launch_dependents();
  const int64_t p = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (p < S) {
    const int32_t slot = token_index_map[p];  // < 0: a pair left out of the plan (flagged)
    d_pair_weights[p] = slot >= 0 ? ds[slot] : CUDART_NAN_F;
  }
}

}  // namespace

void aggregate_rows(const RoutingPlanView& plan, const void* rows, const float* slot_weights,
                    void* out, int64_t d, DType dtype, cudaStream_t stream, const void* b2) {
  MOEBLAZE_REQUIRE(dtype == DType::bf16 || dtype == DType::f32, "aggregate_rows: dtype (",
                   dtype_name(dtype), ") must be bf16 or fp32");
  MOEBLAZE_REQUIRE(d >= 1, "aggregate_rows: d (", d, ") must be >= 1");
  if (plan.T == 0) return;
  if (b2 != nullptr) {  // the GPU layer's case only: bf16, weighted, 16-byte rows
    // S == 0 (token rounding dropped every pair): rows and slot weights are empty, out is zero.
    MOEBLAZE_REQUIRE(dtype == DType::bf16 && (slot_weights != nullptr || plan.S == 0) &&
                         d % 8 == 0 &&
                         reinterpret_cast<uintptr_t>(rows) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(out) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(b2) % 16 == 0,
                     "aggregate_rows: b2 needs bf16, slot weights, d % 8 == 0 and 16-byte "
                     "aligned rows, out and b2");
    with_vec_layout(plan, [&](auto C, auto B) {
      launch_vec<__nv_bfloat16, true, decltype(C)::value, decltype(B)::value, true>(
          plan, rows, slot_weights, out, d, stream, b2);
    });
    MOEBLAZE_CUDA_CHECK(cudaGetLastError());
    return;
  }
  const bool weighted = slot_weights != nullptr;
  if (dtype == DType::bf16) {
    weighted ? launch_aggregate<__nv_bfloat16, true>(plan, rows, slot_weights, out, d, stream)
             : launch_aggregate<__nv_bfloat16, false>(plan, rows, nullptr, out, d, stream);
  } else {
    weighted ? launch_aggregate<float, true>(plan, rows, slot_weights, out, d, stream)
             : launch_aggregate<float, false>(plan, rows, nullptr, out, d, stream);
  }
}

void aggregate_chunk(const RoutingPlanView& plan, const TokenChunks& chunks, const ChunkMaps& maps,
                     int64_t c, const void* rows, const float* slot_weights, void* out, int64_t d,
                     cudaStream_t stream, const void* b2) {
  MOEBLAZE_REQUIRE(c >= 0 && c < chunks.count, "aggregate_chunk: chunk ", c, " is not in [0, ",
                   chunks.count, ")");
  MOEBLAZE_REQUIRE(d >= 8 && d % 8 == 0, "aggregate_chunk: d (", d, ") must be a multiple of 8");
  MOEBLAZE_REQUIRE(reinterpret_cast<uintptr_t>(rows) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(out) % 16 == 0,
                   "aggregate_chunk: rows and out must be 16-byte aligned");
  if (plan.T == 0) return;
  if (b2 != nullptr) {
    MOEBLAZE_REQUIRE((slot_weights != nullptr || plan.S == 0) &&
                         reinterpret_cast<uintptr_t>(b2) % 16 == 0,
                     "aggregate_chunk: b2 needs the slot weights and 16-byte alignment");
    return launch_chunk_bf16<true, true>(plan, chunks, maps, c, rows, slot_weights, out, d,
                                         stream, b2);
  }
  slot_weights
      ? launch_chunk_bf16<true>(plan, chunks, maps, c, rows, slot_weights, out, d, stream)
      : launch_chunk_bf16<false>(plan, chunks, maps, c, rows, nullptr, out, d, stream);
}

void gather_pair_grads(const RoutingPlanView& plan, const float* ds, float* d_pair_weights,
                       cudaStream_t stream) {
  if (plan.S == 0) return;
  const int64_t blocks = (plan.S + kThreads - 1) / kThreads;
  launch_kernel(&gather_pair_grads_kernel, dim3(unsigned(blocks)), dim3(kThreads), 0, stream, 1,
                plan.token_index_map, ds, d_pair_weights, plan.S);
}

}  // namespace moeblaze::cuda
