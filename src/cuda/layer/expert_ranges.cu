// The device side of the expert ranges (expert_ranges.hpp): each token's slots in ascending
// order, a range's rebased expert offsets, and dX̃ rows of one range summed into dx through an
// fp32 carry split in two: its high 16 bits in dx itself (bf16's size, written for good by the
// last range), its low 16 bits in a (T, d) workspace piece, so the carry costs T·d·2 bytes, not
// T·d·4. No atomics: every output element is written by the one thread that sums it.
#include "cuda/layer/expert_ranges.hpp"

#include <cuda_bf16.h>
#include <math_constants.h>  // CUDART_NAN_F

#include <algorithm>

#include "cuda/cuda_backend.hpp"
#include "cuda/pdl.cuh"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda {
namespace {

constexpr int kThreads = 256;

// One thread per token: its pairs' slots, insertion-sorted in place (a token has K pairs).
__global__ void ascending_slots_kernel(const int32_t* __restrict__ pair_offsets,     // (T+1,)
                                       const int32_t* __restrict__ token_index_map,  // (S,)
                                       int64_t T, int32_t* __restrict__ slots) {     // (S,)
  pdl_wait();
  pdl_launch_dependents();
  const int64_t t = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (t >= T) return;
  const int32_t p0 = pair_offsets[t], p1 = pair_offsets[t + 1];
  for (int32_t j = p0; j < p1; ++j) {
    const int32_t v = token_index_map[j];
    int32_t i = j;
    for (; i > p0 && slots[i - 1] > v; --i) slots[i] = slots[i - 1];
    slots[i] = v;
  }
}

__global__ void rebase_kernel(const int32_t* __restrict__ offsets, int64_t e0, int64_t count,
                              int32_t* __restrict__ out) {  // (count + 1,)
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i <= count) out[i] = offsets[e0 + i] - offsets[e0];
}

// One thread per (token, 8 columns), grid-stride: the token's slots in [lo, hi), ascending, added
// to the fp32 carry in the order and arithmetic of the layer's unweighted aggregation
// (aggregate.cu: acc + v from 0, one rounding at the end).
__global__ void __launch_bounds__(kThreads)
    accumulate_range_kernel(const int32_t* __restrict__ pair_offsets,  // (T+1,)
                            const int32_t* __restrict__ slots,         // (S,) ascending per token
                            int64_t T, int64_t lo, int64_t hi,
                            const __nv_bfloat16* __restrict__ rows,  // (hi - lo, d)
                            uint16_t* __restrict__ carry_lo,         // (T, d)
                            __nv_bfloat16* __restrict__ dx,          // (T, d)
                            int64_t d, bool first, bool last) {
  const int64_t chunks = d / 8;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < T * chunks;
       i += int64_t(gridDim.x) * kThreads) {
    const int64_t t = i / chunks, col = (i - t * chunks) * 8;
    float acc[8];
    uint4* hi_bits = reinterpret_cast<uint4*>(dx + t * d + col);  // 8 x the carry's high half
    uint4* lo_bits = reinterpret_cast<uint4*>(carry_lo + t * d + col);
    if (first) {
      // A pair left out of the plan (flagged) sorts first as slot -1: the token's dx is NaN.
      const int32_t p0 = pair_offsets[t];
      const float init = p0 < pair_offsets[t + 1] && slots[p0] < 0 ? CUDART_NAN_F : 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = init;
    } else {
      const uint4 h = *hi_bits, l = *lo_bits;
      const uint32_t hw[4] = {h.x, h.y, h.z, h.w}, lw[4] = {l.x, l.y, l.z, l.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // element 2j in the low half of word j, 2j + 1 in the high
        acc[2 * j] = __uint_as_float((hw[j] << 16) | (lw[j] & 0xFFFFu));
        acc[2 * j + 1] = __uint_as_float((hw[j] & 0xFFFF0000u) | (lw[j] >> 16));
      }
    }
    bool any = false;
    for (int32_t p = pair_offsets[t]; p < pair_offsets[t + 1]; ++p) {
      const int64_t s = slots[p];
      if (s < lo) continue;
      if (s >= hi) break;  // ascending: the rest lie in later ranges
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(rows + (s - lo) * d + col));
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 v = __bfloat1622float2(h[j]);
        acc[2 * j] = acc[2 * j] + v.x;
        acc[2 * j + 1] = acc[2 * j + 1] + v.y;
      }
      any = true;
    }
    if (last) {
      uint4 raw;
      __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
      for (int j = 0; j < 4; ++j) h[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
      *hi_bits = raw;
    } else if (first || any) {  // a middle range that adds nothing leaves the carry as it is
      uint32_t hw[4], lw[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t a = __float_as_uint(acc[2 * j]), b = __float_as_uint(acc[2 * j + 1]);
        hw[j] = (a >> 16) | (b & 0xFFFF0000u);
        lw[j] = (a & 0xFFFFu) | (b << 16);
      }
      *hi_bits = make_uint4(hw[0], hw[1], hw[2], hw[3]);
      *lo_bits = make_uint4(lw[0], lw[1], lw[2], lw[3]);
    }
  }
}

unsigned blocks_for(int64_t work) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads,
                                                         int64_t(1) << 20)));
}

}  // namespace

void ascending_token_slots(const RoutingPlanView& plan, int32_t* slots, cudaStream_t stream) {
  if (plan.T == 0 || plan.S == 0) return;
  MOEBLAZE_REQUIRE(slots != nullptr && plan.token_pair_offsets && plan.token_index_map,
                   "ascending_token_slots: slots and the plan's token view must be set");
  launch_kernel(&ascending_slots_kernel, dim3(unsigned((plan.T + kThreads - 1) / kThreads)),
                dim3(kThreads), 0, stream, 1, plan.token_pair_offsets, plan.token_index_map,
                plan.T, slots);
}

void rebase_offsets(const int32_t* offsets, int64_t e0, int64_t count, int32_t* out,
                    cudaStream_t stream) {
  MOEBLAZE_REQUIRE(e0 >= 0 && count >= 0, "rebase_offsets: e0 (", e0, ") and count (", count,
                   ") must be >= 0");
  rebase_kernel<<<unsigned((count + kThreads) / kThreads), kThreads, 0, stream>>>(offsets, e0,
                                                                                count, out);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

void accumulate_range(const RoutingPlanView& plan, const int32_t* slots, int64_t lo, int64_t hi,
                      const bf16* rows, uint16_t* carry_lo, bf16* dx, int64_t d, bool first,
                      bool last, cudaStream_t stream) {
  MOEBLAZE_REQUIRE(d >= 8 && d % 8 == 0, "accumulate_range: d (", d, ") must be a multiple of 8");
  MOEBLAZE_REQUIRE(0 <= lo && lo <= hi && hi <= plan.S, "accumulate_range: slots [", lo, ", ",
                   hi, ") are not inside [0, S = ", plan.S, "]");
  MOEBLAZE_REQUIRE(reinterpret_cast<uintptr_t>(rows) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(carry_lo) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(dx) % 16 == 0,
                   "accumulate_range: rows, carry_lo and dx must be 16-byte aligned");
  if (plan.T == 0) return;
  accumulate_range_kernel<<<blocks_for(plan.T * (d / 8)), kThreads, 0, stream>>>(
      plan.token_pair_offsets, slots, plan.T, lo, hi,
      reinterpret_cast<const __nv_bfloat16*>(rows), carry_lo,
      reinterpret_cast<__nv_bfloat16*>(dx), d, first, last);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeblaze::cuda
